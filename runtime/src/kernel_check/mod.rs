//! `parallax check-kernels`: one training step (forward, backward, optimizer) of a plan's
//! generated kernels on the PTX interpreter, kernel by kernel, against the CPU oracle, with
//! the sanitizer's checks throughout. Each kernel runs on the oracle's inputs (every value a
//! kernel stores is compared, then replaced by the oracle's), so a difference names the
//! kernel that made it. A GPU is needed for nothing here.

mod device;
mod tolerance;

pub use device::{Device, DeviceError};
pub use tolerance::Family;

use crate::cpu::Executor;
use crate::cuda::Precision;
use crate::exec::{ExecError, Mode};
use crate::train::{feed, set_scalars, SessionData, TrainError};
use parallax_compiler::codegen::Launch;
use parallax_compiler::{Plan, Source};
use parallax_emulator::{Finding, MmaModel};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum KernelCheckError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Data(#[from] TrainError),
}

/// What `check-kernels` runs.
#[derive(Debug, Clone)]
pub struct KernelCheckArgs {
    pub precision: Precision,
    /// PTX files that replace the generated entries of the same name.
    pub ptx_dir: Option<PathBuf>,
    pub mma: MmaModel,
}

/// One kernel of the plan, as checked.
#[derive(Debug, Clone)]
pub struct KernelRow {
    pub kernel: usize,
    /// The device of a partitioned plan whose kernel it is (empty for one device).
    pub device: String,
    pub ops: Vec<&'static str>,
    /// `kernel`, `gemm`, `copy` for each launch.
    pub launches: Vec<&'static str>,
    pub family: Family,
    /// The largest `max |oracle - interpreter| / max |oracle|` over the values it stores.
    pub difference: f64,
    pub tolerance: f64,
    /// The step whose value differs most, when any differs.
    pub worst: Option<(usize, &'static str, String)>,
    /// Values the kernel should have stored but left (partly) unwritten.
    pub unwritten: Vec<usize>,
    pub findings: usize,
    /// The launch could not run or finish (the message).
    pub failed: Option<String>,
}

impl KernelRow {
    pub fn ok(&self) -> bool {
        self.failed.is_none()
            && self.findings == 0
            && self.unwritten.is_empty()
            && self.difference <= self.tolerance
    }
}

/// What `check-kernels` found.
#[derive(Debug, Clone)]
pub struct KernelReport {
    pub batch: usize,
    pub precision: Precision,
    pub mma: MmaModel,
    pub rows: Vec<KernelRow>,
    /// Every sanitizer finding, with its kernel (`None`: the step's fills and copies).
    pub findings: Vec<(Option<usize>, Finding)>,
    /// Parameters and state after the step's final copies that differ from the oracle's:
    /// `(name, difference)`.
    pub updates: Vec<(String, f64)>,
    pub instructions: u64,
    pub replaced: Vec<(String, PathBuf)>,
}

impl KernelReport {
    pub fn ok(&self) -> bool {
        self.rows.iter().all(KernelRow::ok) && self.findings.is_empty() && self.updates.is_empty()
    }
}

/// `max |a - b| / max |a|` (see `gpu_check::rel_diff`); 0 only when bit-equal values are
/// compared, NaN in the same places included.
fn difference(reference: &[f32], other: &[f32]) -> f64 {
    if reference.len() == other.len()
        && reference
            .iter()
            .zip(other)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    {
        return 0.0;
    }
    crate::gpu_check::rel_diff(reference, other)
}

/// The kernels one device of a partitioned plan runs, and its tensor rank: every pipeline
/// stage, every optimizer-state owner (ZeRO) and every tensor rank once (data-parallel ranks
/// otherwise run the same kernels); one group for an unsplit plan.
fn device_groups(plan: &Plan) -> Vec<(Option<Vec<bool>>, usize, String)> {
    if plan.sharding.is_none() {
        return vec![(None, 0, String::new())];
    }
    let tp = plan
        .tensor_parallel
        .as_ref()
        .map_or(1, |t| t.degree as usize);
    let mut groups: Vec<(Option<Vec<bool>>, usize, String)> = Vec::new();
    for stage in 0..plan.pipeline_stages.max(1) {
        for owner in 0..plan.optimizer_shards.max(1) {
            for t in 0..tp {
                let mask = plan.kernel_mask(stage, owner);
                if groups.iter().any(|(m, gt, _)| *m == mask && *gt == t) {
                    continue;
                }
                let label = format!("stage {stage}, state owner {owner}, tensor rank {t}");
                groups.push((mask, t, label));
            }
        }
    }
    groups
}

/// Runs one training step of `plan` on the interpreter against the oracle: each device's
/// kernels of a partitioned plan (`device_groups`), each against its own oracle.
pub fn check(
    source: &Source,
    plan: &Plan,
    base_dir: &Path,
    a: &KernelCheckArgs,
) -> Result<KernelReport, KernelCheckError> {
    let batch = plan.batch_size as usize;
    let mut report = KernelReport {
        batch,
        precision: a.precision,
        mma: a.mma,
        rows: Vec::new(),
        findings: Vec::new(),
        updates: Vec::new(),
        instructions: 0,
        replaced: Vec::new(),
    };
    for (owned, t, label) in device_groups(plan) {
        check_device(
            source,
            plan,
            base_dir,
            a,
            (owned.as_deref(), t, &label),
            &mut report,
        )?;
    }
    Ok(report)
}

/// One device's kernels (`owned`, tensor rank `t`), added to `report`.
fn check_device(
    source: &Source,
    plan: &Plan,
    base_dir: &Path,
    a: &KernelCheckArgs,
    (owned, t, label): (Option<&[bool]>, usize, &str),
    report: &mut KernelReport,
) -> Result<(), KernelCheckError> {
    let e = &source.experiment;
    let batch = plan.batch_size as usize;
    let seed = e.train.seed;
    let mut session = SessionData::load(source, plan, batch, seed, base_dir, 0)?;
    let mut cpu = Executor::for_kernels(plan.clone(), batch, seed, owned, t);
    let mut dev = Device::new(plan, batch, seed, a.precision, a.ptx_dir.as_deref())?;
    dev.options.mma = a.mma;
    let names = plan.names();
    let b = session.loader.next().expect("the loader runs forever");
    let total = e.train.steps.unwrap_or(1).max(1);
    feed(&mut cpu, &session.input, b.size, &b.inputs)?;
    feed(&mut cpu, &session.target, b.size, &b.targets)?;
    set_scalars(&mut cpu, &e.optimizer, 0, total)?;
    // The same parameters, state and inputs: the oracle's (a tensor rank's slices).
    let sources = names
        .params
        .iter()
        .chain(&names.states)
        .chain(&names.inputs);
    for &(_, id) in sources {
        upload(&mut dev, &cpu, id)?;
    }
    let order: Vec<usize> = (0..plan.kernels.len())
        .filter(|&k| owned.is_none_or(|o| o[k]) && cpu.wanted(k, Mode::Train))
        .collect();
    if let Some(&first) = order.first() {
        upload_operands(&mut dev, &cpu, plan, first)?;
    }
    dev.begin(Mode::Train)?;
    let mut rows = Vec::new();
    let mut error = None;
    let mut after = |k: usize, cpu: &mut Executor| {
        let mut row = check_kernel(&mut dev, cpu, plan, k);
        row.device = label.to_string();
        rows.push(row);
        // The next kernel's operands as the oracle has them now (values another stage
        // or rank sent included).
        let next = order.iter().skip_while(|&&x| x != k).nth(1);
        if let Some(&n) = next {
            if let Err(e) = upload_operands(&mut dev, cpu, plan, n) {
                error.get_or_insert(e);
            }
        }
    };
    cpu.run_observed(b.size, (Mode::Train, owned), 0, 0, &mut after)?;
    if let Some(e) = error {
        return Err(e);
    }
    dev.finish(Mode::Train)?;
    for (name, id) in names.params.iter().chain(&names.states) {
        let (Some(t), Some(_)) = (cpu.value(*id), dev.ptr(*id)) else {
            continue;
        };
        let Ok((got, _)) = dev.read(*id) else {
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
            report.updates.push((format!("{name}{at}"), d));
        }
    }
    report.rows.extend(rows);
    report.findings.extend(dev.findings.iter().cloned());
    report.instructions += dev.instructions;
    report.replaced = dev.replaced();
    Ok(())
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
fn check_kernel(dev: &mut Device, cpu: &Executor, plan: &Plan, k: usize) -> KernelRow {
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
        if let Err(e) = dev.run_kernel(k, Mode::Train, 0, 0) {
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
        match dev.read(s) {
            _ if exchange => {}
            Ok((got, written)) => {
                if !written && fresh.contains(&s) && row.failed.is_none() {
                    row.unwritten.push(s);
                }
                let d = difference(reference, &got);
                if d > row.difference || (d.is_nan() && !row.difference.is_nan()) {
                    row.difference = if d.is_nan() { f64::INFINITY } else { d };
                    row.worst = Some((s, plan.steps[s].op.name(), plan.steps[s].layer.clone()));
                }
            }
            Err(m) => row.failed = Some(format!("reading step {s}: {m}")),
        }
        let v = reference.to_vec();
        if let Err(m) = dev.write(s, &v) {
            row.failed = Some(format!("writing step {s}: {m}"));
        }
    }
    row
}
