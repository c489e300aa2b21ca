//! A device on the PTX interpreter that follows the CPU oracle kernel by kernel: each kernel
//! runs on the oracle's values of its operands, what it stores is compared with the
//! oracle's, then replaced by them. `check` drives it for `check-kernels`; `gpu-check
//! --interpreter` beside a GPU, to compare the two bit for bit.

use super::device::{Device, DeviceError};
use super::tolerance::{self, Family};
use super::{difference, KernelCheckArgs, KernelCheckError, KernelRow};
use crate::cpu::Executor;
use crate::exec::Mode;
use parallax_compiler::codegen::Launch;
use parallax_compiler::Plan;

pub struct Mirror<'p> {
    dev: Device<'p>,
    plan: &'p Plan,
    /// The kernels the device runs, in order.
    order: Vec<usize>,
    step: u64,
    /// Keep each kernel's interpreted values in its row (`KernelRow::values`).
    pub keep_values: bool,
}

impl<'p> Mirror<'p> {
    /// The device of `plan`'s kernels marked in `owned` (every kernel when `None`), at the
    /// oracle's state before training step `step`: its parameters, state and inputs (set
    /// before this), the first kernel's operands, and the step's constants.
    pub fn new(
        plan: &'p Plan,
        cpu: &Executor,
        owned: Option<&[bool]>,
        a: &KernelCheckArgs,
        (seed, step): (u64, u64),
    ) -> Result<Mirror<'p>, KernelCheckError> {
        let batch = plan.batch_size as usize;
        let mut dev = Device::new(plan, batch, seed, a.precision, a.ptx_dir.as_deref())?;
        dev.options.mma = a.mma;
        let names = plan.names();
        // The same parameters, state and inputs: the oracle's (a tensor rank's slices).
        let sources = names
            .params
            .iter()
            .chain(&names.states)
            .chain(&names.inputs);
        for &(_, id) in sources {
            upload(&mut dev, cpu, id)?;
        }
        let order: Vec<usize> = (0..plan.kernels.len())
            .filter(|&k| owned.is_none_or(|o| o[k]) && cpu.wanted(k, Mode::Train))
            .collect();
        if let Some(&first) = order.first() {
            upload_operands(&mut dev, cpu, plan, first)?;
        }
        dev.begin(Mode::Train)?;
        Ok(Mirror {
            dev,
            plan,
            order,
            step,
            keep_values: false,
        })
    }

    /// After the oracle ran kernel `k`: runs it here and compares, then takes the next
    /// kernel's operands as the oracle has them now (values another stage or rank sent
    /// included).
    pub fn after(&mut self, k: usize, cpu: &Executor) -> Result<KernelRow, KernelCheckError> {
        let row = check_kernel(
            &mut self.dev,
            cpu,
            self.plan,
            (k, self.step),
            self.keep_values,
        );
        let next = self.order.iter().skip_while(|&&x| x != k).nth(1);
        if let Some(&n) = next {
            upload_operands(&mut self.dev, cpu, self.plan, n)?;
        }
        Ok(row)
    }

    /// The step's final copies; each parameter and state held here that then differs from
    /// the oracle's, with its difference (`label` names the device).
    pub fn finish(
        &mut self,
        cpu: &Executor,
        label: &str,
    ) -> Result<Vec<(String, f64)>, KernelCheckError> {
        self.dev.finish(Mode::Train)?;
        let names = self.plan.names();
        let mut updates = Vec::new();
        for (name, id) in names.params.iter().chain(&names.states) {
            let (Some(t), Some(_)) = (cpu.value(*id), self.dev.ptr(*id)) else {
                continue;
            };
            let Ok((got, _)) = self.dev.read(*id) else {
                continue;
            };
            // Another stage's parameters are not held here.
            if t.f32().len() != got.len() {
                continue;
            }
            let d = difference(t.f32(), &got);
            if d > 0.0 {
                let at = if label.is_empty() {
                    String::new()
                } else {
                    format!(" ({label})")
                };
                updates.push((format!("{name}{at}"), d));
            }
        }
        Ok(updates)
    }

    pub fn device(&self) -> &Device<'p> {
        &self.dev
    }
}

/// Writes the oracle's value of `step` into the device's buffer (f32, or i32 tokens).
fn upload(dev: &mut Device, cpu: &Executor, step: usize) -> Result<(), KernelCheckError> {
    let (Some(t), Some(_)) = (cpu.value(step), dev.ptr(step)) else {
        return Ok(());
    };
    let n = dev.elements(step) as usize;
    let r = if t.is_f32() {
        let v = &t.f32()[..n.min(t.f32().len())];
        dev.write(step, v)
    } else {
        let v = &t.i32()[..n.min(t.i32().len())];
        dev.write_i32(step, v)
    };
    r.map_err(|m| DeviceError::Plan(format!("step {step}: {m}")).into())
}

/// Writes the oracle's values of what kernel `k` reads from outside itself.
fn upload_operands(
    dev: &mut Device,
    cpu: &Executor,
    plan: &Plan,
    k: usize,
) -> Result<(), KernelCheckError> {
    let steps = &plan.kernels[k].steps;
    let mut outside: Vec<usize> = steps
        .iter()
        .flat_map(|&s| plan.steps[s].operands.iter().copied())
        .filter(|o| !steps.contains(o))
        .collect();
    outside.sort_unstable();
    outside.dedup();
    for o in outside {
        upload(dev, cpu, o)?;
    }
    Ok(())
}

/// Runs kernel `k` on the interpreter after the oracle ran it, compares what it stores,
/// and leaves the oracle's values in its buffers for the next kernel.
fn check_kernel(
    dev: &mut Device,
    cpu: &Executor,
    plan: &Plan,
    (k, step): (usize, u64),
    keep: bool,
) -> KernelRow {
    let kern = &plan.kernels[k];
    let code = &dev.code.kernels[k];
    let launches = code
        .launches
        .iter()
        .map(|l| match l {
            Launch::Kernel { .. } => "kernel",
            Launch::Gemm { .. } => "gemm",
            Launch::Copy { .. } => "copy",
        })
        .collect();
    let (family, tolerance) = tolerance::of(plan, &dev.code, k, dev.precision());
    let mut row = KernelRow {
        kernel: k,
        device: String::new(),
        ops: code.ops.clone(),
        launches,
        family,
        difference: 0.0,
        tolerance,
        worst: None,
        unwritten: Vec::new(),
        findings: 0,
        failed: None,
        values: Vec::new(),
    };
    // The buffers the kernel writes afresh are marked unwritten, so a value it leaves
    // partly unwritten is seen (those it updates in place keep their contents).
    let read_buffers: Vec<Option<usize>> = kern
        .steps
        .iter()
        .flat_map(|&s| plan.steps[s].operands.iter())
        .filter(|o| !kern.steps.contains(o))
        .map(|&o| plan.steps[o].buffer)
        .collect();
    let fresh: Vec<usize> = kern
        .steps
        .iter()
        .copied()
        .filter(|&s| {
            plan.steps[s].buffer.is_some() && !read_buffers.contains(&plan.steps[s].buffer)
        })
        .collect();
    for &s in &fresh {
        if let Some(p) = dev.ptr(s) {
            let bytes = dev.elements(s) * if plan.stored_in_bf16(s) { 2 } else { 4 };
            let _ = dev.memory.forget(p, bytes);
        }
    }
    // The ranks' exchange runs no kernel: its result is delivered as the oracle has it.
    let exchange = family == Family::Collective;
    let before = dev.findings.len();
    if !exchange {
        if let Err(e) = dev.run_kernel(k, Mode::Train, step, 0) {
            row.failed = Some(e.to_string());
        }
    }
    row.findings = dev.findings.len() - before;
    for &s in &kern.steps {
        let Some(t) = cpu.value(s) else { continue };
        if !t.is_f32() || dev.ptr(s).is_none() {
            continue;
        }
        let reference = t.f32();
        // An exchange's values are not compared: they are delivered below.
        match (!exchange).then(|| dev.read(s)) {
            None => {}
            Some(Ok((got, written))) => {
                if !written && fresh.contains(&s) && row.failed.is_none() {
                    row.unwritten.push(s);
                }
                let d = difference(reference, &got);
                if d > row.difference || (d.is_nan() && !row.difference.is_nan()) {
                    row.difference = if d.is_nan() { f64::INFINITY } else { d };
                    row.worst = Some((s, plan.steps[s].op.name(), plan.steps[s].layer.clone()));
                }
                if keep {
                    row.values.push((s, got));
                }
            }
            Some(Err(m)) => row.failed = Some(format!("reading step {s}: {m}")),
        }
        if let Err(m) = dev.write(s, reference) {
            row.failed = Some(format!("writing step {s}: {m}"));
        }
    }
    row
}
