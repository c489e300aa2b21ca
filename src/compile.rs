//! `parallax compile`: the plan, its kernels and memory, the device check, and what `--emit`
//! writes (IR, DOT, plan JSON, PTX).

use crate::{apply_set, load, run_pipeline, Emit, Exit, Format};
use parallax_compiler::ir::print::{to_dot, to_text};
use parallax_compiler::partition::explain::smallest_hint;
use parallax_compiler::partition::summary::{self, Partitioned};
use parallax_compiler::plan::bytes;
use parallax_compiler::target::{self, simulated_device_bytes};
use parallax_compiler::{partition, Options};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What `compile` plans for: GPU count, device kind and memory (the file's unless given).
pub(crate) struct Target {
    pub gpus: Option<u32>,
    pub device: Option<String>,
    pub gpu_memory: Option<u64>,
    pub nodes: Option<u32>,
    /// `--strategy`, as written.
    pub strategy: Option<String>,
    pub explain: bool,
    /// The CUDA precision `--emit ptx` generates for.
    pub precision: parallax_runtime::cuda::Precision,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn compile_cmd(
    file: &Path,
    set: &[String],
    target: Target,
    emit: &[Emit],
    out: Option<&Path>,
    format: Format,
    timings: bool,
    dump_ir: &[String],
) -> Result<(), Exit> {
    if out.is_none() && (emit.len() > 1 || emit.contains(&Emit::Ptx)) {
        errln!("error: emitting several files needs `--out DIR`");
        return Err(Exit(2));
    }
    let Target {
        gpus,
        device,
        gpu_memory,
        nodes,
        strategy,
        explain,
        precision,
    } = target;
    let (source, parse_time) = load(file, format)?;
    let source = apply_set(file, source, set, format)?;
    let options = Options {
        gpus,
        ..Options::default()
    };
    let kind = device.unwrap_or_else(|| source.experiment.devices.kind.clone());
    let profile = parallax_compiler::devices::find(&kind).map_err(|e| {
        errln!("error: {e}");
        Exit(2)
    })?;
    let title = source.experiment.name.clone();
    let mut dump = |pass: &str, g: &parallax_compiler::ir::Graph| {
        if dump_ir.iter().any(|d| d == pass || d == "all") {
            errln!("// IR after pass `{pass}`");
            err!("{}", to_text(g, &title));
        }
    };
    let compiled = run_pipeline(file, &source, &options, format, &mut dump)?;
    let t = Instant::now();
    let mut plan = compiled.plan(&source, &options);
    let mut pass_times = compiled.timings.clone();
    pass_times.push(("plan", t.elapsed()));
    let capacity = gpu_memory.unwrap_or(profile.memory);
    let t = Instant::now();
    // The split `train --gpus N` runs, chosen by the one function both call.
    let request = target::Request {
        gpus: plan.gpus_requested,
        strategy: strategy.as_deref(),
        memory: gpu_memory,
        kind: Some(profile.kind),
        nodes,
        ..target::Request::default()
    };
    let partitioned = target::partition_for(&source, &compiled, &request)
        .map_err(refused)?
        .expect("a device kind that `find` knows has a profile");
    pass_times.push(("partition", t.elapsed()));
    let split = target::split_from(&source, &request, Some(&partitioned));
    let (split, emitted) = emitted_plan(file, &source, &plan, split, emit)?;
    if let Some(split) = split {
        plan.strategy = split.strategy;
    }
    if timings {
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "timings:");
        let _ = writeln!(err, "  {:<10} {:>9.3} ms", "parse", ms(parse_time));
        let mut total = parse_time;
        for (name, d) in &pass_times {
            let _ = writeln!(err, "  {name:<10} {:>9.3} ms", ms(*d));
            total += *d;
        }
        let _ = writeln!(err, "  {:<10} {:>9.3} ms", "total", ms(total));
    }
    let render = |e: Emit| -> String {
        match e {
            Emit::Ir => to_text(&compiled.graph, &title),
            Emit::Dot => to_dot(&compiled.graph, &title),
            Emit::Plan => emitted.as_ref().unwrap_or(&plan).to_json(),
            Emit::Ptx => String::new(),
        }
    };
    match (out, emit) {
        (None, [e]) => {
            out!("{}", render(*e))?;
            return Ok(());
        }
        (Some(dir), _) if !emit.is_empty() => {
            if let Err(e) = std::fs::create_dir_all(dir) {
                errln!("error: cannot create `{}`: {e}", dir.display());
                return Err(Exit(1));
            }
            for &e in emit {
                if e == Emit::Ptx {
                    emit_ptx(&plan, dir, file, precision)?;
                    continue;
                }
                let path = dir.join(e.file_name());
                if let Err(err) = std::fs::write(&path, render(e)) {
                    errln!("error: cannot write `{}`: {err}", path.display());
                    return Err(Exit(1));
                }
                errln!("wrote {}", path.display());
            }
        }
        _ => {}
    }
    let fits = plan.memory.peak_bytes <= capacity;
    let device = serde_json::json!({
        "kind": profile.kind,
        "name": profile.name,
        "memory_bytes": capacity,
        "fits_one_device": fits,
    });
    let simulated = match (&partitioned.partition, split) {
        (Ok(p), Some(s)) if p.gpus > 1 => simulated_device_bytes(&source, s.strategy, s.zero),
        _ => None,
    };
    print_plan(
        &plan,
        &pass_times,
        format,
        device,
        &partitioned.partition,
        simulated,
    )?;
    if plan.gpus_requested > 1 {
        return partition_fit(&partitioned.partition, format, explain);
    }
    if explain && format == Format::Text {
        match &partitioned.partition {
            Ok(p) => out!("{}", partition::explain::explain(p))?,
            Err(partition::Error::NoFit { candidates, .. }) => {
                err!(
                    "{}",
                    partition::explain::candidate_table(candidates, capacity)
                )
            }
            Err(_) => {}
        }
    }
    // Only computed when one device does not fit: what to do instead.
    let hint = || {
        match &partitioned.partition {
        Err(partition::Error::NoFit { smallest, .. }) => smallest_hint(smallest.as_ref()),
        Ok(p) => format!(
            "the planner fits it on one GPU with gradient accumulation ({} micro-batches of {}, peak {}), which single-device plans do not do yet; {}",
            p.micro_batches,
            p.micro_batch_size,
            bytes(p.per_device_peak_bytes),
            smallest_hint(partitioned.smallest_fitting().as_ref())
        ),
        Err(_) => smallest_hint(partitioned.smallest_fitting().as_ref()),
    }
    };
    memory_fit(&plan, profile, capacity, format, hint)
}

/// The partition's verdict for more than one GPU: the choice (and with `--explain` the
/// candidates), or, when nothing fits, the memory table and the smallest GPU count that fits.
fn partition_fit(partitioned: &Partitioned, format: Format, explain: bool) -> Result<(), Exit> {
    match partitioned {
        Ok(p) if format == Format::Text && explain => out!("{}", partition::explain::explain(p))?,
        Ok(p) if format == Format::Text => outln!(
            "  (--explain lists the {} candidates and each pipeline stage)",
            p.candidates.len()
        )?,
        Ok(_) => {}
        Err(e) => {
            errln!("error: {e}");
            err!("{}", summary::no_fit(e, explain));
            return Err(Exit(1));
        }
    }
    Ok(())
}

/// Whether the plan's peak memory fits one device; a plan for one GPU that does not fit is
/// refused with its memory table (exit 1) before anything runs.
fn memory_fit(
    p: &parallax_compiler::Plan,
    profile: &parallax_compiler::devices::Profile,
    capacity: u64,
    format: Format,
    hint: impl FnOnce() -> String,
) -> Result<(), Exit> {
    if format == Format::Text {
        outln!("{}", summary::device_line(p, profile.name, capacity))?;
    }
    if p.memory.peak_bytes <= capacity {
        return Ok(());
    }
    err!("{}", summary::one_device_refusal(p, profile.name, capacity));
    errln!("  = hint: {}", hint());
    Err(Exit(1))
}

/// Writes `DIR/<kernel>.ptx` for each generated entry and `DIR/manifest.json`.
fn emit_ptx(
    plan: &parallax_compiler::Plan,
    dir: &Path,
    file: &Path,
    precision: parallax_runtime::cuda::Precision,
) -> Result<(), Exit> {
    let options = parallax_runtime::cuda::codegen_options(precision);
    let module =
        parallax_compiler::codegen::generate_with(plan, plan.batch_size, "sm_80", &options)
            .map_err(|e| {
                errln!("{}: error: {e}", file.display());
                Exit(1)
            })?;
    let write = |path: PathBuf, text: String| {
        std::fs::write(&path, text).map_err(|err| {
            errln!("error: cannot write `{}`: {err}", path.display());
            Exit(1)
        })
    };
    for (name, _) in &module.entries {
        let text = module.entry_text(name).unwrap_or_default();
        write(dir.join(format!("{name}.ptx")), text)?;
    }
    let manifest = module.manifest();
    write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&manifest).expect("serialisable") + "\n",
    )?;
    errln!(
        "wrote {} PTX files and manifest.json for {} kernels to {}",
        module.entries.len(),
        module.kernels.len(),
        dir.display()
    );
    Ok(())
}

/// A refusal of the split or its plan, printed.
fn refused(e: target::TargetError) -> Exit {
    errln!("error: {e}");
    if let Some(hint) = e.hint() {
        errln!("  = hint: {hint}");
    }
    Exit(1)
}

/// The split (none where the partition's verdict says why), and what `--emit plan` writes:
/// the plan `train` runs (for several devices, the per-device plan of the split), with its
/// experiment.
fn emitted_plan(
    file: &Path,
    source: &parallax_compiler::Source,
    plan: &parallax_compiler::Plan,
    split: Result<target::Split, target::TargetError>,
    emit: &[Emit],
) -> Result<(Option<target::Split>, Option<parallax_compiler::Plan>), Exit> {
    let chosen = split.as_ref().ok().copied();
    if !emit.contains(&Emit::Plan) {
        return Ok((chosen, None));
    }
    let mut emitted = match (split, plan.gpus_requested > 1) {
        (Err(e), true) => return Err(refused(e)),
        (Ok(split), true) => {
            target::compile_split(source, &split, &mut |_, _| {})
                .map_err(refused)?
                .1
        }
        (_, false) => plan.clone(),
    };
    emitted.experiment = Some(experiment_text(file, source));
    Ok((chosen, Some(emitted)))
}

/// The experiment as `train` would record it (every default and `--set` resolved, data paths
/// absolute), for a plan that `train --plan` runs without the file.
fn experiment_text(file: &Path, source: &parallax_compiler::Source) -> String {
    let cfg = parallax_runtime::train::TrainConfig {
        base_dir: file.parent().map(Path::to_path_buf).unwrap_or_default(),
        ..Default::default()
    };
    parallax_compiler::dsl::to_ron(&parallax_runtime::train::resolved(&source.experiment, &cfg))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn print_plan(
    p: &parallax_compiler::Plan,
    timings: &[(&str, Duration)],
    format: Format,
    device: serde_json::Value,
    partitioned: &Partitioned,
    simulated: Option<Vec<u64>>,
) -> Result<(), Exit> {
    match format {
        Format::Json => {
            let ms: Vec<(&str, f64)> = timings.iter().map(|(n, d)| (*n, ms(*d))).collect();
            let v = summary::json(p, partitioned, simulated.as_deref(), device, &ms);
            outln!("{v}")?;
        }
        Format::Text => out!("{}", summary::text(p, partitioned, simulated.as_deref()))?,
    }
    Ok(())
}
