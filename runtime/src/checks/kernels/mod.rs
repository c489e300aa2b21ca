//! `parallax check-kernels`: one training step (forward, backward, optimizer) of a plan's
//! generated kernels on the PTX interpreter, kernel by kernel, against the CPU oracle, with
//! the sanitizer's checks throughout. Each kernel runs on the oracle's inputs (every value a
//! kernel stores is compared, then replaced by the oracle's), so a difference names the
//! kernel that made it. A GPU is needed for nothing here.

mod device;
mod mirror;
pub mod report;
mod tolerance;

#[cfg(test)]
#[path = "decode_tests.rs"]
mod decode_tests;

pub use device::{Device, DeviceError};
pub use mirror::Mirror;
pub use tolerance::{of as tolerance, Family};

use crate::cpu::Executor;
use crate::cuda::Precision;
use crate::exec::{ExecError, Mode};
use crate::train::{feed, set_scalars, SessionData, TrainError};
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
    /// The interpreter's value of each step it stored (when the mirror keeps them, for a
    /// comparison with a GPU).
    pub values: Vec<(usize, Vec<f32>)>,
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

/// `max |a - b| / max |a|`: a difference relative to the reference's scale.
pub fn rel_diff(reference: &[f32], other: &[f32]) -> f64 {
    if reference.len() != other.len() {
        return f64::INFINITY;
    }
    let scale = reference
        .iter()
        .fold(0f64, |m, &x| m.max((x as f64).abs()))
        .max(1e-30);
    let diff = reference.iter().zip(other).fold(0f64, |m, (&a, &b)| {
        let d = (a as f64 - b as f64).abs();
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    });
    diff / scale
}

/// `rel_diff`, but 0 only when bit-equal values are
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
    rel_diff(reference, other)
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
    let b = session.loader.next().expect("the loader runs forever");
    let total = e.train.steps.unwrap_or(1).max(1);
    feed(&mut cpu, &session.input, b.size, &b.inputs)?;
    feed(&mut cpu, &session.target, b.size, &b.targets)?;
    set_scalars(&mut cpu, &e.optimizer, 0, total)?;
    let mut mirror = Mirror::new(plan, &cpu, owned, a, (seed, 0))?;
    let mut rows = Vec::new();
    let mut error = None;
    let mut after = |k: usize, cpu: &mut Executor| match mirror.after(k, cpu) {
        Ok(mut row) => {
            row.device = label.to_string();
            rows.push(row);
        }
        Err(e) => {
            error.get_or_insert(e);
        }
    };
    cpu.run_observed(b.size, (Mode::Train, owned), 0, 0, &mut after)?;
    if let Some(e) = error {
        return Err(e);
    }
    report.updates.extend(mirror.finish(&cpu, label)?);
    report.rows.extend(rows);
    let dev = mirror.device();
    report.findings.extend(dev.findings.iter().cloned());
    report.instructions += dev.instructions;
    report.replaced = dev.replaced();
    Ok(())
}
