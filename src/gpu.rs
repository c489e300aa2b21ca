//! GPU commands: `parallax devices` and the checks `scripts/gpu-check.sh` runs on a GPU
//! machine (`gpu-check`: the CUDA backend against the CPU oracle from identical weights, and
//! its step time; `collectives-check`: NCCL and the simulated-ranks all-reduce).

use crate::{load, run_pipeline, Exit, Format};
use parallax_compiler::dsl::ast::Optimizer;
use parallax_compiler::Options;
use parallax_runtime::backend::Backend;
use parallax_runtime::cpu::{ExecError, Executor, Mode};
use parallax_runtime::cuda::{self, CudaError, CudaExecutor, Precision};
use parallax_runtime::data::{Batch, Values};
use parallax_runtime::train::{feed, set_scalars, SessionData};
use std::path::Path;

pub fn devices(format: Format) -> Result<(), Exit> {
    match cuda::probe() {
        Ok(d) => {
            if format == Format::Json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&d).expect("serialisable")
                )?;
                return Ok(());
            }
            let v = |x: i32| format!("{}.{}", x / 1000, x % 1000 / 10);
            outln!(
                "CUDA driver supports CUDA {}; cuBLAS {}; NCCL {}",
                v(d.driver_cuda_version),
                if d.cublas { "found" } else { "not found" },
                d.nccl_version.map_or("not found".to_string(), |n| format!(
                    "{}.{}.{}",
                    n / 10000,
                    n / 100 % 100,
                    n % 100
                ))
            )?;
            for g in &d.gpus {
                outln!(
                    "GPU {}: {}, {:.1} GiB, compute capability {}.{}",
                    g.ordinal,
                    g.name,
                    g.memory_bytes as f64 / (1u64 << 30) as f64,
                    g.compute_capability.0,
                    g.compute_capability.1
                )?;
            }
            Ok(())
        }
        Err(e) => {
            outln!("no usable GPU: {e}")?;
            outln!("the CPU backend is available (`--backend cpu`)")?;
            Ok(())
        }
    }
}

fn cuda_err(file: &Path, e: CudaError) -> Exit {
    errln!("{}: error: {e}", file.display());
    Exit(1)
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

fn exec_err(file: &Path, e: ExecError) -> Exit {
    errln!("{}: error: {e}", file.display());
    Exit(1)
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

/// Peak dense FLOP/s of a known GPU at a precision (its device profile).
fn peak_flops(name: &str, precision: Precision) -> Option<f64> {
    let p = parallax_compiler::devices::for_gpu_name(name)?;
    Some(match precision {
        Precision::Fp32 => p.fp32,
        Precision::Tf32 => p.tf32,
        Precision::Bf16 => p.bf16,
    })
}

pub struct CheckArgs {
    /// Print the slowest kinds of launch of one timed step.
    pub profile: bool,
    pub steps: u64,
    pub precision: Precision,
    pub time_steps: u64,
    pub lockstep: bool,
}

pub fn gpu_check(file: &Path, a: &CheckArgs) -> Result<(), Exit> {
    let (source, _) = load(file, Format::Text)?;
    let options = Options::default();
    let compiled = run_pipeline(file, &source, &options, Format::Text, &mut |_, _| {})?;
    let plan = compiled.plan(&source, &options);
    let e = &source.experiment;
    let batch = e.train.batch_size as usize;
    let seed = e.train.seed;
    let base = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let name = e.name.clone();
    let optimizer = e.optimizer.clone();
    let flops_per_step = 3.0 * plan.flops_per_sample as f64 * batch as f64;
    let mut session = SessionData::load(&source, &plan, batch, seed, &base, 0).map_err(|err| {
        errln!("{}: error: {err}", file.display());
        Exit(1)
    })?;
    // The CPU oracle, unless only timing (models too large for it).
    let mut oracle = (a.steps > 0).then(|| Executor::new(plan.clone(), batch, seed));
    let devices = cuda::probe().map_err(|e| cuda_err(file, e))?;
    let gpu = devices.gpus[0].name.clone();
    let mut gpu_exec =
        CudaExecutor::new(plan, batch, seed, 0, a.precision).map_err(|e| cuda_err(file, e))?;
    let prec = match a.precision {
        Precision::Fp32 => "fp32",
        Precision::Tf32 => "tf32",
        Precision::Bf16 => "bf16",
    };
    errln!(
        "{name}: {} kernels, PTX for {}, {prec}, batch {batch}",
        gpu_exec.plan().kernels.len(),
        gpu_exec.target()
    );
    // The same initial parameters, bit for bit.
    let start = if oracle.is_some() {
        gpu_exec.params().map_err(|e| cuda_err(file, e))?
    } else {
        Vec::new()
    };
    for ((n, _, v), (_, t)) in start.iter().zip(oracle.iter().flat_map(|o| o.params())) {
        if v.as_slice() != t.f32() {
            errln!("{name}: initial parameter `{n}` differs between backends");
            return Err(Exit(1));
        }
    }
    let total = a.steps;
    if total == 0 {
        // Timing only (models too large for the CPU oracle): one batch on the GPU.
        let b = session.loader.next().expect("the loader runs forever");
        set_batch(&mut gpu_exec, &session, &b, &optimizer, 0, 1).map_err(|e| exec_err(file, e))?;
    }
    let mut loss_diff = 0f64;
    let mut lockstep_failures = 0usize;
    for step in 0..total {
        let cpu = oracle.as_mut().expect("an oracle when steps > 0");
        let b = session.loader.next().expect("the loader runs forever");
        set_batch(&mut gpu_exec, &session, &b, &optimizer, step, total)
            .and_then(|_| set_batch(cpu, &session, &b, &optimizer, step, total))
            .map_err(|e| exec_err(file, e))?;
        if a.lockstep {
            lockstep_failures +=
                lockstep(cpu, &mut gpu_exec, b.size, step).map_err(|e| cuda_err(file, e))?;
        } else {
            cpu.run(b.size, Mode::Train, step, 0)
                .map_err(|e| exec_err(file, e))?;
            gpu_exec
                .run(b.size, Mode::Train, step, 0)
                .and_then(|_| gpu_exec.synchronize())
                .map_err(|e| cuda_err(file, e))?;
        }
        let cpu_loss = cpu
            .output(parallax_compiler::plan::LOSS)
            .map_or(f32::NAN, |t| t.f32()[0]);
        let gpu_loss = gpu_exec
            .output(parallax_compiler::plan::LOSS, b.size)
            .map_err(|e| cuda_err(file, e))?[0];
        let d = rel_diff(&[cpu_loss], &[gpu_loss]);
        loss_diff = loss_diff.max(d);
        errln!(
            "step {}: loss cpu {cpu_loss:.7} cuda {gpu_loss:.7} (relative difference {d:.2e})",
            step + 1
        );
    }
    // Parameters: the relative difference of the whole parameter vector (L2), and, for
    // information, the largest per-tensor max-norm difference (zero-initialised biases are
    // pure accumulated updates, so reduced-precision GEMMs show there first).
    let end = if oracle.is_some() {
        gpu_exec.params().map_err(|e| cuda_err(file, e))?
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
    let param_diff = if diff2.is_nan() {
        f64::INFINITY
    } else {
        (diff2 / norm2.max(1e-300)).sqrt()
    };
    // Step time on the GPU: the last batch again, timed with CUDA events after warm-up.
    let b = batch;
    let mut times = Vec::new();
    let timing = (|| -> Result<(), CudaError> {
        let ctx = gpu_exec.context().clone();
        let stream = gpu_exec.stream().clone();
        for i in 0..(a.time_steps + 3) {
            // Timing needs events created without CU_EVENT_DISABLE_TIMING (cudarc's default).
            let flags = Some(cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let t0 = ctx.new_event(flags)?;
            let t1 = ctx.new_event(flags)?;
            t0.record(&stream)?;
            gpu_exec.run(b, Mode::Train, total + i, 0)?;
            t1.record(&stream)?;
            t1.synchronize()?;
            if i >= 3 {
                times.push(t0.elapsed_ms(&t1)? as f64);
            }
        }
        Ok(())
    })();
    timing.map_err(|e| cuda_err(file, e))?;
    if a.profile {
        let launches = gpu_exec
            .profile_step(b, total + a.time_steps + 3)
            .map_err(|e| cuda_err(file, e))?;
        let all: f64 = launches.iter().map(|l| l.1).sum();
        let mut by: std::collections::HashMap<String, (f64, usize)> = Default::default();
        for (label, ms) in launches {
            let e = by.entry(label).or_default();
            e.0 += ms;
            e.1 += 1;
        }
        let mut rows: Vec<_> = by.into_iter().collect();
        rows.sort_by(|x, y| y.1 .0.total_cmp(&x.1 .0));
        outln!("PROFILE {name}: {all:.2} ms in launches (one step, events around each launch)")?;
        for (label, (ms, n)) in rows.iter().take(25) {
            let label: String = label.chars().take(70).collect();
            outln!(
                "PROFILE {ms:9.3} ms {:5.1}% {n:5}x  {label}",
                100.0 * ms / all.max(1e-9)
            )?;
        }
    }
    times.sort_by(|x, y| x.total_cmp(y));
    let median_ms = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let tflops = flops_per_step / (median_ms * 1e-3) / 1e12;
    let share = peak_flops(&gpu, a.precision).map_or("?".to_string(), |p| {
        format!("{:.1}%", 100.0 * tflops * 1e12 / p)
    });
    let tolerance = match a.precision {
        Precision::Fp32 => 1e-5,
        Precision::Tf32 => 1e-3,
        Precision::Bf16 => 2e-2,
    };
    let ok = loss_diff <= tolerance && param_diff <= tolerance && lockstep_failures == 0;
    let (ld, pd) = if total == 0 {
        ("-".to_string(), "-".to_string())
    } else {
        (format!("{loss_diff:.2e}"), format!("{param_diff:.2e}"))
    };
    errln!(
        "{name}: largest relative difference of losses {loss_diff:.2e}; parameters {param_diff:.2e} (whole vector, L2; largest per tensor {worst_d:.2e} in `{worst}`); tolerance {tolerance:.0e}"
    );
    // One machine-readable row for the script's table.
    outln!(
        "ROW|{name}|{prec}|{ld}|{pd}|{}|{median_ms:.3}|{tflops:.2}|{share}",
        if ok { "ok" } else { "FAIL" }
    )?;
    if ok {
        Ok(())
    } else {
        Err(Exit(1))
    }
}

/// Runs one training step kernel by kernel on both backends, comparing every stored value
/// after each kernel and copying the oracle's values into the GPU's buffers, so each kernel
/// is judged on identical inputs. Returns the number of kernels that disagree.
fn lockstep(
    cpu: &mut Executor,
    gpu: &mut CudaExecutor,
    batch: usize,
    step: u64,
) -> Result<usize, CudaError> {
    gpu.begin(batch, Mode::Train)?;
    let mut failures = 0usize;
    let mut error: Option<CudaError> = None;
    let plan = cpu.plan().clone();
    let mut after = |k: usize, cpu: &mut Executor| {
        if error.is_some() {
            return;
        }
        let r = (|| -> Result<(), CudaError> {
            gpu.run_kernel(k, Mode::Train, step, 0)?;
            gpu.synchronize()?;
            let kern = &plan.kernels[k];
            for &s in &kern.steps {
                let Some(t) = cpu.value(s) else { continue };
                if !gpu.stored(s) || !t.is_f32() {
                    continue;
                }
                let got = gpu.value(s, batch)?;
                let d = rel_diff(t.f32(), &got);
                if d.is_nan() || d > 1e-4 {
                    failures += 1;
                    let ops: Vec<&str> = kern
                        .steps
                        .iter()
                        .map(|&x| plan.steps[x].op.name())
                        .collect();
                    // A write error is reported by `emit` and fails the command's next line.
                    let _ = outln!(
                        "LOCKSTEP kernel {k} ({:?}: {}) step {s} `{}` in `{}`: relative difference {d:.2e}; first values cpu {:?} cuda {:?}",
                        kern.kind,
                        ops.join(" -> "),
                        plan.steps[s].op.name(),
                        plan.steps[s].layer,
                        &t.f32()[..t.f32().len().min(4)],
                        &got[..got.len().min(4)],
                    );
                }
                gpu.overwrite(s, t)?;
            }
            Ok(())
        })();
        if let Err(e) = r {
            error = Some(e);
        }
    };
    cpu.run_observed(batch, Mode::Train, step, 0, &mut after)
        .map_err(|e| CudaError::Exec(e.to_string()))?;
    if let Some(e) = error {
        return Err(e);
    }
    gpu.finish(Mode::Train)?;
    gpu.synchronize()?;
    Ok(failures)
}

/// NCCL at world size 1, the simulated-ranks all-reduce against a host sum, and a 4-rank
/// data-parallel gradient step (simulated ranks on one GPU) against the 1-rank step.
pub fn collectives_check(file: &Path) -> Result<(), Exit> {
    let fail = |e: CudaError| cuda_err(file, e);
    let devices = cuda::probe().map_err(fail)?;
    let target = cuda::target_for(devices.gpus[0].compute_capability);
    let ctx = cuda::cudarc::driver::CudaContext::new(0).map_err(|e| fail(CudaError::from(e)))?;
    let nccl = match cuda::nccl::world_one_all_reduce(&ctx, 1 << 20) {
        Ok(d) => format!("{d:.1e}"),
        Err(e) => format!("error: {e}"),
    };
    outln!(
        "ROW|nccl all-reduce, world size 1|fp32|{nccl}|-|{}|-|-|-",
        if nccl == "0.0e0" { "ok" } else { "FAIL" }
    )?;

    // Data parallelism on simulated ranks: each rank takes a quarter of the batch, computes
    // its gradients; the all-reduce sums them; a quarter of the sum is the full batch's.
    let ranks = 4usize;
    let (source, _) = load(file, Format::Text)?;
    let options = Options::default();
    let compiled = run_pipeline(file, &source, &options, Format::Text, &mut |_, _| {})?;
    let plan = compiled.plan(&source, &options);
    let e = &source.experiment;
    let batch = e.train.batch_size as usize;
    let shard = batch / ranks;
    let seed = e.train.seed;
    let base = file.parent().map(Path::to_path_buf).unwrap_or_default();
    // The data only: this check runs no CPU executor.
    let mut session = SessionData::load(&source, &plan, batch, seed, &base, 0).map_err(|err| {
        errln!("{}: error: {err}", file.display());
        Exit(1)
    })?;
    let b = session.loader.next().expect("the loader runs forever");
    let per = |v: &Values| match v {
        Values::F32(x) => x.len() / b.size,
        Values::I32(x) => x.len() / b.size,
    };
    let cut = |v: &Values, r: usize| {
        let p = per(v);
        match v {
            Values::F32(x) => Values::F32(x[r * shard * p..(r + 1) * shard * p].to_vec()),
            Values::I32(x) => Values::I32(x[r * shard * p..(r + 1) * shard * p].to_vec()),
        }
    };
    let grads = plan.grads.clone();
    let put = |x: &mut CudaExecutor, name: &str, size: usize, v: &Values| {
        x.set_input(name, size, v)
            .map_err(|e| CudaError::Exec(e.to_string()))
    };
    let result = (|| -> Result<f64, CudaError> {
        let mut full = CudaExecutor::new(plan.clone(), batch, seed, 0, Precision::Fp32)?;
        put(&mut full, &session.input, b.size, &b.inputs)?;
        put(&mut full, &session.target, b.size, &b.targets)?;
        full.run(b.size, Mode::Gradients, 0, 0)?;
        full.synchronize()?;
        let mut execs = Vec::new();
        for r in 0..ranks {
            let mut x = CudaExecutor::new(plan.clone(), shard, seed, 0, Precision::Fp32)?;
            put(&mut x, &session.input, shard, &cut(&b.inputs, r))?;
            put(&mut x, &session.target, shard, &cut(&b.targets, r))?;
            x.run(shard, Mode::Gradients, 0, (r * shard) as u64)?;
            x.synchronize()?;
            execs.push(x);
        }
        let sum = cuda::nccl::SimulatedRanks::new(&ctx, ranks, target)?;
        let mut worst = 0f64;
        for &(_, g) in &grads {
            let n = full.value(g, b.size)?.len();
            let ptrs = execs
                .iter()
                .map(|x| x.device_ptr(g))
                .collect::<Result<Vec<_>, _>>()?;
            sum.all_reduce(execs[0].stream(), &ptrs, n as u64)?;
            execs[0].synchronize()?;
            let reduced: Vec<f32> = execs[0]
                .value(g, shard)?
                .iter()
                .map(|v| v / ranks as f32)
                .collect();
            worst = worst.max(rel_diff(&full.value(g, b.size)?, &reduced));
        }
        Ok(worst)
    })();
    match result {
        Ok(d) => {
            outln!(
                "ROW|dp{ranks} simulated ranks vs 1 rank ({})|fp32|-|{d:.2e}|{}|-|-|-",
                e.name,
                if d <= 1e-5 { "ok" } else { "FAIL" }
            )?;
            Ok(())
        }
        Err(err) => {
            outln!("ROW|dp{ranks} simulated ranks vs 1 rank|fp32|-|error: {err}|FAIL|-|-|-")?;
            Err(Exit(1))
        }
    }
}
