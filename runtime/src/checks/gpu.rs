//! Conformance of the CUDA backend with the CPU oracle, as `parallax gpu-check` measures it
//! on a GPU machine (`scripts/gpu-check.sh`): a few training steps from identical weights on
//! both backends and the GPU's step time (`collectives` has the collectives' checks). The
//! figures come back typed; the command line prints them.

#[path = "gpu_report.rs"]
pub mod report;

use crate::backend::Backend;
use crate::checks::kernels::{KernelCheckArgs, KernelRow, Mirror};
use crate::cpu::Executor;
use crate::cuda::{self, CudaError, CudaExecutor, Precision};
use crate::data::Batch;
use crate::exec::{ExecError, Mode};
use crate::train::{feed, set_scalars, SessionData, TrainError};
use parallax_compiler::dsl::ast::Optimizer;
use parallax_compiler::ir::KernelKind;
use parallax_compiler::{Plan, Source};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The experiment's data could not be loaded.
    #[error(transparent)]
    Data(#[from] TrainError),
    #[error("initial parameter `{0}` differs between backends")]
    InitialParameter(String),
}

/// What `gpu-check` runs.
pub struct CheckArgs {
    /// Also time every launch of one step ([`Conformance::profile`]).
    pub profile: bool,
    /// Training steps compared with the oracle (0: timing only, for models too large for it).
    pub steps: u64,
    pub precision: Precision,
    /// Timed steps (the median is reported, after 3 warm-up steps).
    pub time_steps: u64,
    /// Compare every kernel's values with the oracle's, resynchronising after each.
    pub lockstep: bool,
    /// In lockstep, also run every kernel on the PTX interpreter from the same inputs and
    /// compare the GPU's values with its, bit for bit (tensor cores modelled as `mma`).
    pub interpreter: Option<parallax_emulator::MmaModel>,
}

/// What a check reports while it runs.
pub enum Progress<'a> {
    Started {
        kernels: usize,
        target: &'a str,
        batch: usize,
    },
    /// Step `step` (from 1) of both backends and the relative difference of their losses.
    Step {
        step: u64,
        cpu_loss: f32,
        gpu_loss: f32,
        difference: f64,
    },
    Mismatch(Mismatch),
    /// A kernel's values on the GPU against the PTX interpreter's (`CheckArgs::interpreter`).
    Interpreter(InterpreterRow),
}

/// How one kernel's stored values on the GPU differ in bits from the interpreter's.
pub struct InterpreterRow {
    pub kernel: usize,
    /// Its family (`kernels::Family::name`).
    pub family: &'static str,
    pub ops: Vec<&'static str>,
    pub elements: usize,
    /// Values whose bits differ.
    pub differing: usize,
    /// The largest distance in f32 units in the last place (`u64::MAX`: a NaN on one side).
    pub max_ulp: u64,
    /// The largest difference over the largest magnitude of its tensor (on the
    /// interpreter): ulps mislead across zero, where values a rounding apart but of
    /// opposite signs are billions of ulps apart.
    pub max_scaled: f64,
    /// Where `max_scaled` is: (step, element, the GPU's value, the interpreter's).
    pub worst: Option<(usize, usize, f32, f32)>,
    /// Sanitizer findings or a failure on the interpreter.
    pub failed: Option<String>,
}

/// The distance of two f32 values in units in the last place (0 for equal bits; +0 and -0
/// are 0 apart; `u64::MAX` when one is NaN).
pub fn ulps(a: f32, b: f32) -> u64 {
    if a.to_bits() == b.to_bits() {
        return 0;
    }
    if a.is_nan() || b.is_nan() {
        return u64::MAX;
    }
    let key = |x: f32| {
        let b = x.to_bits();
        if b >> 31 == 1 {
            -i64::from(b & 0x7fff_ffff)
        } else {
            i64::from(b)
        }
    };
    (key(a) - key(b)).unsigned_abs()
}

/// A value a kernel stored that differs from the oracle's (lockstep mode).
pub struct Mismatch {
    pub kernel: usize,
    pub kind: KernelKind,
    /// The names of the kernel's fused ops, in order.
    pub ops: Vec<&'static str>,
    /// The plan step whose value differs, its op and layer.
    pub step: usize,
    pub op: &'static str,
    pub layer: String,
    pub difference: f64,
    /// The first (up to 4) values of each backend.
    pub cpu: Vec<f32>,
    pub gpu: Vec<f32>,
}

/// The time spent in each kind of launch of one step, slowest first.
pub struct Profile {
    pub total_ms: f64,
    /// `(label, milliseconds, launches)`.
    pub kinds: Vec<(String, f64, usize)>,
}

/// The figures of one `gpu-check`.
pub struct Conformance {
    pub precision: Precision,
    /// Steps compared (0: timing only, and the differences mean nothing).
    pub steps: u64,
    /// The largest relative difference of the losses.
    pub loss_difference: f64,
    /// The relative difference of the whole parameter vector (L2).
    pub parameter_difference: f64,
    /// For information, the largest per-tensor max-norm difference and its tensor
    /// (zero-initialised biases are pure accumulated updates, so reduced-precision GEMMs
    /// show there first).
    pub worst_tensor: (String, f64),
    pub lockstep_failures: usize,
    pub median_step_ms: f64,
    pub tflops: f64,
    /// The percentage of the GPU's peak dense FLOP/s at this precision, for a known GPU.
    pub peak_percent: Option<f64>,
    pub tolerance: f64,
    pub profile: Option<Profile>,
    /// cuBLASLt's (plans built, GEMM shapes sent to cuBLAS, the heuristic's refusals);
    /// `None`: every GEMM on cuBLAS.
    pub cublaslt: Option<(usize, usize, Vec<String>)>,
    /// What CUDA graphs did (`PARALLAX_CUDA_GRAPH=1`); `None`: off.
    pub cuda_graphs: Option<String>,
}

impl Conformance {
    pub fn ok(&self) -> bool {
        self.loss_difference <= self.tolerance
            && self.parameter_difference <= self.tolerance
            && self.lockstep_failures == 0
    }
}

/// How closely the GPU must follow the oracle at a precision.
fn tolerance(p: Precision) -> f64 {
    match p {
        Precision::Fp32 => 1e-5,
        Precision::Tf32 => 1e-3,
        Precision::Bf16 => 2e-2,
    }
}

pub use crate::checks::kernels::rel_diff;

/// Peak dense FLOP/s of a known GPU at a precision (its device profile).
fn peak_flops(name: &str, precision: Precision) -> Option<f64> {
    let p = parallax_compiler::devices::for_gpu_name(name)?;
    Some(match precision {
        Precision::Fp32 => p.fp32,
        Precision::Tf32 => p.tf32,
        Precision::Bf16 => p.bf16,
    })
}

/// Sets a batch and the schedule's scalars for `step` of `total` on either backend.
fn set_batch(
    e: &mut dyn Backend,
    session: &SessionData,
    b: &Batch,
    optimizer: &Optimizer,
    step: u64,
    total: u64,
) -> Result<(), ExecError> {
    feed(e, &session.input, b.size, &b.inputs)?;
    feed(e, &session.target, b.size, &b.targets)?;
    set_scalars(e, optimizer, step, total).map(|_| ())
}

/// The experiment's data, in batches of its batch size (`base_dir` resolves its files).
pub(super) fn session(
    source: &Source,
    plan: &Plan,
    base_dir: &Path,
) -> Result<SessionData, TrainError> {
    let t = &source.experiment.train;
    SessionData::load(source, plan, t.batch_size as usize, t.seed, base_dir, 0)
}

/// Trains `a.steps` steps of `plan` on GPU 0 and on the CPU oracle from the same weights,
/// then times `a.time_steps` steps on the GPU.
pub fn check(
    source: &Source,
    plan: Plan,
    base_dir: &Path,
    a: &CheckArgs,
    progress: &mut dyn FnMut(Progress),
) -> Result<Conformance, CheckError> {
    let e = &source.experiment;
    let batch = e.train.batch_size as usize;
    let seed = e.train.seed;
    let optimizer = e.optimizer.clone();
    let flops_per_step = 3.0 * plan.flops_per_sample as f64 * batch as f64;
    let mut session = session(source, &plan, base_dir)?;
    // The CPU oracle, unless only timing (models too large for it).
    let mut oracle = (a.steps > 0).then(|| Executor::new(plan.clone(), batch, seed));
    let devices = cuda::probe()?;
    let gpu = devices.gpus[0].name.clone();
    let bf16_stored = plan.bf16_activations();
    let mut gpu_exec = CudaExecutor::new(plan, batch, seed, 0, a.precision)?;
    progress(Progress::Started {
        kernels: gpu_exec.plan().kernels.len(),
        target: gpu_exec.target(),
        batch,
    });
    // The same initial parameters, bit for bit.
    let start = if oracle.is_some() {
        gpu_exec.params()?
    } else {
        Vec::new()
    };
    for ((n, _, v), (_, t)) in start.iter().zip(oracle.iter().flat_map(|o| o.params())) {
        if v.as_slice() != t.f32() {
            return Err(CheckError::InitialParameter(n.clone()));
        }
    }
    let total = a.steps;
    if total == 0 {
        // Timing only: one batch on the GPU.
        let b = session.loader.next().expect("the loader runs forever");
        set_batch(&mut gpu_exec, &session, &b, &optimizer, 0, 1)?;
    }
    let mut loss_difference = 0f64;
    let mut lockstep_failures = 0usize;
    for step in 0..total {
        let cpu = oracle.as_mut().expect("an oracle when steps > 0");
        let b = session.loader.next().expect("the loader runs forever");
        set_batch(&mut gpu_exec, &session, &b, &optimizer, step, total)
            .and_then(|_| set_batch(cpu, &session, &b, &optimizer, step, total))?;
        if a.lockstep {
            let interp = a.interpreter.map(|mma| KernelCheckArgs {
                precision: a.precision,
                ptx_dir: None,
                mma,
            });
            let ls = Lockstep {
                batch: b.size,
                precision: a.precision,
                step,
                seed,
                interpreter: interp.as_ref(),
            };
            lockstep_failures += lockstep(cpu, &mut gpu_exec, &ls, progress)?;
        } else {
            cpu.run(b.size, Mode::Train, step, 0)?;
            gpu_exec.run(b.size, Mode::Train, step, 0)?;
            gpu_exec.synchronize()?;
        }
        let cpu_loss = cpu
            .output(parallax_compiler::plan::LOSS)
            .map_or(f32::NAN, |t| t.f32()[0]);
        let gpu_loss = gpu_exec.output(parallax_compiler::plan::LOSS, b.size)?[0];
        let difference = rel_diff(&[cpu_loss], &[gpu_loss]);
        loss_difference = loss_difference.max(difference);
        progress(Progress::Step {
            step: step + 1,
            cpu_loss,
            gpu_loss,
            difference,
        });
    }
    let end = if oracle.is_some() {
        gpu_exec.params()?
    } else {
        Vec::new()
    };
    let (mut diff2, mut norm2) = (0f64, 0f64);
    let (mut worst, mut worst_d) = (String::new(), 0f64);
    for ((n, _, v), (_, t)) in end.iter().zip(oracle.iter().flat_map(|o| o.params())) {
        for (&a, &b) in t.f32().iter().zip(v) {
            diff2 += (a as f64 - b as f64).powi(2);
            norm2 += (a as f64).powi(2);
        }
        let d = rel_diff(t.f32(), v);
        if d > worst_d || worst.is_empty() {
            worst = n.clone();
            worst_d = d;
        }
    }
    let parameter_difference = if diff2.is_nan() {
        f64::INFINITY
    } else {
        (diff2 / norm2.max(1e-300)).sqrt()
    };
    let mut times = time_steps(&mut gpu_exec, batch, total, a.time_steps)?;
    let profile = match a.profile {
        true => Some(profile(&mut gpu_exec, batch, total + a.time_steps + 3)?),
        false => None,
    };
    times.sort_by(|x, y| x.total_cmp(y));
    let median_step_ms = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let tflops = flops_per_step / (median_step_ms * 1e-3) / 1e12;
    Ok(Conformance {
        precision: a.precision,
        steps: total,
        loss_difference,
        parameter_difference,
        worst_tensor: (worst, worst_d),
        lockstep_failures,
        median_step_ms,
        tflops,
        peak_percent: peak_flops(&gpu, a.precision).map(|p| 100.0 * tflops * 1e12 / p),
        // A plan storing activations in bf16 multiplies bf16 whatever the precision, and
        // rounds the f32 operand of a mixed product that the oracle multiplies unrounded.
        tolerance: if bf16_stored {
            tolerance(Precision::Bf16)
        } else {
            tolerance(a.precision)
        },
        profile,
        cublaslt: gpu_exec.cublaslt_plans(),
        cuda_graphs: gpu_exec.cuda_graphs(),
    })
}

/// Step times on the GPU (ms): the last batch again, `n` steps from `first_step` timed with
/// CUDA events after 3 warm-up steps.
fn time_steps(
    gpu: &mut CudaExecutor,
    batch: usize,
    first_step: u64,
    n: u64,
) -> Result<Vec<f64>, CudaError> {
    let ctx = gpu.context().clone();
    let stream = gpu.stream().clone();
    let mut times = Vec::new();
    for i in 0..(n + 3) {
        // Timing needs events created without CU_EVENT_DISABLE_TIMING (cudarc's default).
        let flags = Some(cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let t0 = ctx.new_event(flags)?;
        let t1 = ctx.new_event(flags)?;
        t0.record(&stream)?;
        gpu.run(batch, Mode::Train, first_step + i, 0)?;
        t1.record(&stream)?;
        t1.synchronize()?;
        if i >= 3 {
            times.push(t0.elapsed_ms(&t1)? as f64);
        }
    }
    Ok(times)
}

/// Every launch of step `step` timed, summed by kind of launch.
fn profile(gpu: &mut CudaExecutor, batch: usize, step: u64) -> Result<Profile, CudaError> {
    let launches = gpu.profile_step(batch, step)?;
    let total_ms: f64 = launches.iter().map(|l| l.1).sum();
    let mut by: std::collections::HashMap<String, (f64, usize)> = Default::default();
    for (label, ms) in launches {
        let e = by.entry(label).or_default();
        e.0 += ms;
        e.1 += 1;
    }
    let mut kinds: Vec<_> = by.into_iter().map(|(l, (ms, n))| (l, ms, n)).collect();
    kinds.sort_by(|x, y| y.1.total_cmp(&x.1));
    Ok(Profile { total_ms, kinds })
}

/// Runs one training step kernel by kernel on both backends, comparing every stored value
/// after each kernel and copying the oracle's values into the GPU's buffers, so each kernel
/// is judged on identical inputs. Returns the number of kernels that disagree.
/// One lockstep step's settings.
struct Lockstep<'a> {
    batch: usize,
    precision: Precision,
    step: u64,
    seed: u64,
    /// Also run each kernel on the PTX interpreter and compare bits.
    interpreter: Option<&'a KernelCheckArgs>,
}

fn lockstep(
    cpu: &mut Executor,
    gpu: &mut CudaExecutor,
    ls: &Lockstep,
    progress: &mut dyn FnMut(Progress),
) -> Result<usize, CudaError> {
    let (batch, step) = (ls.batch, ls.step);
    gpu.begin(batch, Mode::Train)?;
    let mut failures = 0usize;
    let mut error: Option<CudaError> = None;
    let plan = cpu.plan().clone();
    let mut mirror = match ls.interpreter {
        Some(a) => {
            let mut m = Mirror::new(&plan, cpu, None, a, (ls.seed, step))
                .map_err(|e| CudaError::Exec(format!("the PTX interpreter: {e}")))?;
            m.keep_values = true;
            Some(m)
        }
        None => None,
    };
    let code = parallax_compiler::codegen::generate_with(
        &plan,
        batch as u64,
        "sm_80",
        &cuda::codegen_options(ls.precision),
    )?;
    let family_tolerance: Vec<f64> = (0..plan.kernels.len())
        .map(|k| crate::checks::kernels::tolerance(&plan, &code, k, ls.precision).1)
        .collect();
    let mut after = |k: usize, cpu: &mut Executor| {
        if error.is_some() {
            return;
        }
        let r = (|| -> Result<(), CudaError> {
            gpu.run_kernel(k, Mode::Train, step, 0)?;
            gpu.synchronize()?;
            let kern = &plan.kernels[k];
            if let Some(m) = mirror.as_mut() {
                let row = m
                    .after(k, cpu)
                    .map_err(|e| CudaError::Exec(format!("the PTX interpreter: {e}")))?;
                progress(Progress::Interpreter(against_interpreter(
                    gpu, &row, batch,
                )?));
            }
            for &s in &kern.steps {
                let Some(t) = cpu.value(s) else { continue };
                if !gpu.stored(s) || !t.is_f32() {
                    continue;
                }
                let got = gpu.value(s, batch)?;
                let d = rel_diff(t.f32(), &got);
                // The kernel family's tolerance (as the PTX interpreter is held to: a bf16
                // GEMM's, a bf16-stored value's, ...), and at least 1e-4 on a GPU, whose
                // libraries' orders of sums are their own.
                let limit = family_tolerance[k].max(1e-4);
                if d.is_nan() || d > limit {
                    failures += 1;
                    progress(Progress::Mismatch(Mismatch {
                        kernel: k,
                        kind: kern.kind,
                        ops: kern
                            .steps
                            .iter()
                            .map(|&x| plan.steps[x].op.name())
                            .collect(),
                        step: s,
                        op: plan.steps[s].op.name(),
                        layer: plan.steps[s].layer.clone(),
                        difference: d,
                        cpu: t.f32()[..t.f32().len().min(4)].to_vec(),
                        gpu: got[..got.len().min(4)].to_vec(),
                    }));
                }
                gpu.overwrite(s, t)?;
            }
            Ok(())
        })();
        if let Err(e) = r {
            error = Some(e);
        }
    };
    cpu.run_observed(batch, (Mode::Train, None), step, 0, &mut after)
        .map_err(|e| CudaError::Exec(e.to_string()))?;
    if let Some(e) = error {
        return Err(e);
    }
    gpu.finish(Mode::Train)?;
    gpu.synchronize()?;
    Ok(failures)
}

/// The GPU's values of a kernel's steps against the interpreter's (`row.values`).
fn against_interpreter(
    gpu: &CudaExecutor,
    row: &KernelRow,
    batch: usize,
) -> Result<InterpreterRow, CudaError> {
    let mut r = InterpreterRow {
        kernel: row.kernel,
        family: row.family.name(),
        ops: row.ops.clone(),
        elements: 0,
        differing: 0,
        max_ulp: 0,
        max_scaled: 0.0,
        worst: None,
        failed: row
            .failed
            .clone()
            .or_else(|| (row.findings > 0).then(|| format!("{} sanitizer findings", row.findings))),
    };
    for (s, interp) in &row.values {
        if !gpu.stored(*s) {
            continue;
        }
        let got = gpu.value(*s, batch)?;
        let scale = interp.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (e, (&g, &i)) in got.iter().zip(interp).enumerate() {
            r.elements += 1;
            let u = ulps(g, i);
            if u > 0 {
                r.differing += 1;
                r.max_ulp = r.max_ulp.max(u);
                let scaled = f64::from((g - i).abs()) / f64::from(scale.max(f32::MIN_POSITIVE));
                let scaled = if scaled.is_nan() {
                    f64::INFINITY
                } else {
                    scaled
                };
                if scaled > r.max_scaled || r.worst.is_none() {
                    r.max_scaled = scaled;
                    r.worst = Some((*s, e, g, i));
                }
            }
        }
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::ulps;

    #[test]
    fn ulps_count_representable_values_between() {
        assert_eq!(ulps(1.0, 1.0), 0);
        assert_eq!(ulps(0.0, -0.0), 0);
        assert_eq!(ulps(1.0, f32::from_bits(1.0f32.to_bits() + 3)), 3);
        // Across zero: the smallest subnormals either side are 2 apart.
        assert_eq!(ulps(f32::from_bits(1), -f32::from_bits(1)), 2);
        assert_eq!(ulps(f32::NAN, 1.0), u64::MAX);
        assert_eq!(ulps(f32::MAX, f32::INFINITY), 1);
    }
}
