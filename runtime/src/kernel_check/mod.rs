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

/// Runs one training step of `plan` on the interpreter against the oracle.
pub fn check(
    source: &Source,
    plan: &Plan,
    base_dir: &Path,
    a: &KernelCheckArgs,
) -> Result<KernelReport, KernelCheckError> {
    let e = &source.experiment;
    let batch = e.train.batch_size as usize;
    let seed = e.train.seed;
    let mut session = SessionData::load(source, plan, batch, seed, base_dir, 0)?;
    let mut cpu = Executor::new(plan.clone(), batch, seed);
    let mut dev = Device::new(plan, batch, seed, a.precision, a.ptx_dir.as_deref())?;
    dev.options.mma = a.mma;
    let names = plan.names();
    // The same parameters and state: the oracle's, as the CUDA executor's are (same keys).
    for &(_, id) in names.params.iter().chain(&names.states) {
        if let Some(t) = cpu.value(id) {
            let v = t.f32().to_vec();
            dev.write(id, &v)
                .map_err(|m| DeviceError::Plan(format!("step {id}: {m}")))?;
        }
    }
    let b = session.loader.next().expect("the loader runs forever");
    let total = e.train.steps.unwrap_or(1).max(1);
    feed(&mut cpu, &session.input, b.size, &b.inputs)?;
    feed(&mut cpu, &session.target, b.size, &b.targets)?;
    set_scalars(&mut cpu, &e.optimizer, 0, total)?;
    for &(_, id) in &names.inputs {
        let Some(t) = cpu.value(id) else { continue };
        let n = dev.elements(id) as usize;
        let r = if t.is_f32() {
            let v = t.f32()[..n.min(t.f32().len())].to_vec();
            dev.write(id, &v)
        } else {
            let v = t.i32()[..n.min(t.i32().len())].to_vec();
            dev.write_i32(id, &v)
        };
        r.map_err(|m| DeviceError::Plan(format!("input step {id}: {m}")))?;
    }
    dev.begin(Mode::Train)?;
    let mut rows = Vec::new();
    let mut after = |k: usize, cpu: &mut Executor| {
        rows.push(check_kernel(&mut dev, cpu, plan, k));
    };
    cpu.run_observed(b.size, Mode::Train, 0, 0, &mut after)?;
    dev.finish(Mode::Train)?;
    let mut updates = Vec::new();
    for (name, id) in names.params.iter().chain(&names.states) {
        let (Some(t), Ok((got, _))) = (cpu.value(*id), dev.read(*id)) else {
            continue;
        };
        let d = difference(t.f32(), &got);
        if d > 0.0 {
            updates.push((name.clone(), d));
        }
    }
    Ok(KernelReport {
        batch,
        precision: a.precision,
        mma: a.mma,
        rows,
        findings: dev.findings.clone(),
        updates,
        instructions: dev.instructions,
        replaced: dev.replaced(),
    })
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
    let before = dev.findings.len();
    if let Err(e) = dev.run_kernel(k, Mode::Train, 0, 0) {
        row.failed = Some(e.to_string());
    }
    row.findings = dev.findings.len() - before;
    for &s in &kern.steps {
        let Some(t) = cpu.value(s) else { continue };
        if !t.is_f32() || dev.ptr(s).is_none() {
            continue;
        }
        let reference = t.f32();
        match dev.read(s) {
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
