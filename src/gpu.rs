//! GPU commands: `parallax devices` and the checks `scripts/gpu-check.sh` runs on a GPU
//! machine (`gpu-check`: the CUDA backend against the CPU oracle from identical weights, and
//! its step time; `collectives-check`: NCCL and the simulated-ranks all-reduce).

use crate::{load, run_pipeline, Exit, Format};
use parallax_compiler::{Options, Plan, Source};
use parallax_runtime::checks;
use parallax_runtime::checks::collectives::Gpu;
use parallax_runtime::checks::gpu::{CheckArgs, CheckError, Progress};
use parallax_runtime::cuda;
use std::path::{Path, PathBuf};

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

pub(crate) fn fail(file: &Path, e: impl std::fmt::Display) -> Exit {
    errln!("{}: error: {e}", file.display());
    Exit(1)
}

/// The file's experiment, its plan (for one device) and the folder its data paths start from.
pub(crate) fn compiled(file: &Path, set: &[String]) -> Result<(Source, Plan, PathBuf), Exit> {
    let (source, _) = load(file, Format::Text)?;
    let source = crate::apply_set(file, source, set, Format::Text)?;
    let options = Options::default();
    let compiled = run_pipeline(file, &source, &options, Format::Text, &mut |_, _| {})?;
    let plan = compiled.plan(&source, &options);
    let base = file.parent().map(Path::to_path_buf).unwrap_or_default();
    Ok((source, plan, base))
}

pub fn gpu_check(file: &Path, set: &[String], a: &CheckArgs) -> Result<(), Exit> {
    let (source, plan, base) = compiled(file, set)?;
    let name = &source.experiment.name;
    let prec = a.precision.name();
    // Per kernel family: kernels, kernels bit-equal to the interpreter, largest ulp apart,
    // largest difference over the tensor's largest magnitude.
    let mut families: std::collections::BTreeMap<&str, (usize, usize, u64, f64)> =
        Default::default();
    let mut progress = |p: Progress| match p {
        Progress::Interpreter(r) => {
            let f = families.entry(r.family).or_default();
            f.0 += 1;
            f.1 += usize::from(r.differing == 0 && r.failed.is_none());
            f.2 = f.2.max(r.max_ulp);
            f.3 = f.3.max(r.max_scaled);
            // Only the kernels that differ: the rest are in the family lines.
            if r.differing == 0 && r.failed.is_none() {
                return;
            }
            let _ = outln!(
                "INTERP kernel {} ({}: {}) {}/{} values differ from the interpreter's in bits, largest {} ulp, {:.1e} of the largest value{}{}",
                r.kernel,
                r.family,
                r.ops.join(" -> "),
                r.differing,
                r.elements,
                r.max_ulp,
                r.max_scaled,
                r.worst.map_or(String::new(), |(s, e, g, i)| format!(
                    " (step {s} element {e}: GPU {g:e}, interpreter {i:e})"
                )),
                r.failed.map_or(String::new(), |m| format!("; interpreter: {m}"))
            );
        }
        Progress::Started {
            kernels,
            target,
            batch,
        } => errln!("{name}: {kernels} kernels, PTX for {target}, {prec}, batch {batch}"),
        Progress::Step {
            step,
            cpu_loss,
            gpu_loss,
            difference: d,
        } => errln!(
            "step {step}: loss cpu {cpu_loss:.7} cuda {gpu_loss:.7} (relative difference {d:.2e})"
        ),
        Progress::Mismatch(m) => {
            // A write error is reported by `emit` and fails the command's next line.
            let _ = outln!(
                "LOCKSTEP kernel {} ({:?}: {}) step {} `{}` in `{}`: relative difference {:.2e}; first values cpu {:?} cuda {:?}",
                m.kernel,
                m.kind,
                m.ops.join(" -> "),
                m.step,
                m.op,
                m.layer,
                m.difference,
                m.cpu,
                m.gpu,
            );
        }
    };
    let c = match checks::gpu::check(&source, plan, &base, a, &mut progress) {
        Ok(c) => c,
        Err(e @ CheckError::InitialParameter(_)) => {
            errln!("{name}: {e}");
            return Err(Exit(1));
        }
        Err(e) => return Err(fail(file, e)),
    };
    for (family, (kernels, equal, ulp, scaled)) in &families {
        outln!("INTERP {family}: {equal} of {kernels} kernels bit-equal to the interpreter; largest {ulp} ulp apart, {scaled:.1e} of the largest value")?;
    }
    if let Some(p) = &c.profile {
        let all = p.total_ms;
        outln!("PROFILE {name}: {all:.2} ms in launches (one step, events around each launch)")?;
        for (label, ms, n) in p.kinds.iter().take(25) {
            let label: String = label.chars().take(70).collect();
            outln!(
                "PROFILE {ms:9.3} ms {:5.1}% {n:5}x  {label}",
                100.0 * ms / all.max(1e-9)
            )?;
        }
    }
    let share = (c.peak_percent).map_or("?".to_string(), |s| format!("{s:.1}%"));
    let (ld, pd) = if c.steps == 0 {
        ("-".to_string(), "-".to_string())
    } else {
        let d = (c.loss_difference, c.parameter_difference);
        (format!("{:.2e}", d.0), format!("{:.2e}", d.1))
    };
    let (worst, worst_d) = &c.worst_tensor;
    if let Some((plans, fallbacks, refused)) = &c.cublaslt {
        errln!("{name}: cuBLASLt ran {plans} GEMM shape(s); {fallbacks} went to cuBLAS");
        for r in refused {
            errln!("{name}: cuBLASLt refused {r}");
        }
    }
    if let Some(graphs) = &c.cuda_graphs {
        errln!("{name}: CUDA graphs: {graphs}");
    }
    errln!(
        "{name}: largest relative difference of losses {:.2e}; parameters {:.2e} (whole vector, L2; largest per tensor {worst_d:.2e} in `{worst}`); tolerance {:.0e}",
        c.loss_difference,
        c.parameter_difference,
        c.tolerance
    );
    // One machine-readable row for the script's table.
    outln!(
        "ROW|{name}|{prec}|{ld}|{pd}|{}|{:.3}|{:.2}|{share}",
        if c.ok() { "ok" } else { "FAIL" },
        c.median_step_ms,
        c.tflops
    )?;
    if c.ok() {
        Ok(())
    } else {
        Err(Exit(1))
    }
}

/// NCCL at world size 1, and a 4-rank data-parallel gradient step (simulated ranks on one
/// GPU) against the 1-rank step.
pub fn collectives_check(file: &Path) -> Result<(), Exit> {
    let gpu = Gpu::open().map_err(|e| fail(file, e))?;
    let nccl = match gpu.nccl_world_one() {
        Ok(d) => format!("{d:.1e}"),
        Err(e) => format!("error: {e}"),
    };
    outln!(
        "ROW|nccl all-reduce, world size 1|fp32|{nccl}|-|{}|-|-|-",
        if nccl == "0.0e0" { "ok" } else { "FAIL" }
    )?;
    let ranks = 4usize;
    let (source, plan, base) = compiled(file, &[])?;
    match gpu.data_parallel(&source, plan, &base, ranks) {
        Ok(d) => {
            outln!(
                "ROW|dp{ranks} simulated ranks vs 1 rank ({})|fp32|-|{d:.2e}|{}|-|-|-",
                source.experiment.name,
                if d <= 1e-5 { "ok" } else { "FAIL" }
            )?;
            Ok(())
        }
        Err(e @ CheckError::Data(_)) => Err(fail(file, e)),
        Err(err) => {
            outln!("ROW|dp{ranks} simulated ranks vs 1 rank|fp32|-|error: {err}|FAIL|-|-|-")?;
            Err(Exit(1))
        }
    }
}
