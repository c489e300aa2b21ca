//! `parallax compile`: the plan, its kernels and memory, the device check, and what `--emit`
//! writes (IR, DOT, plan JSON, PTX).

use crate::{load, run_pipeline, Emit, Exit, Format};
use parallax_compiler::ir::print::{to_dot, to_text};
use parallax_compiler::plan::{bytes, si, thousands};
use parallax_compiler::Options;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What `compile` plans for: GPU count, device kind and memory (the file's unless given).
pub(crate) struct Target {
    pub gpus: Option<u32>,
    pub device: Option<String>,
    pub gpu_memory: Option<u64>,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn compile_cmd(
    file: &Path,
    target: Target,
    emit: &[Emit],
    out: Option<&Path>,
    format: Format,
    timings: bool,
    dump_ir: &[String],
) -> Result<(), Exit> {
    if out.is_none() && (emit.len() > 1 || emit.contains(&Emit::Ptx)) {
        eprintln!("error: emitting several files needs `--out DIR`");
        return Err(Exit(2));
    }
    let Target {
        gpus,
        device,
        gpu_memory,
    } = target;
    let (source, parse_time) = load(file, format)?;
    let options = Options {
        gpus,
        ..Options::default()
    };
    let kind = device.unwrap_or_else(|| source.experiment.devices.kind.clone());
    let Some(profile) = parallax_compiler::devices::profile(&kind) else {
        let kinds: Vec<&str> = parallax_compiler::devices::PROFILES
            .iter()
            .map(|p| p.kind)
            .collect();
        eprintln!(
            "error: unknown device kind `{kind}`; {}",
            parallax_compiler::diag::suggest(&kind, "device kinds", kinds.iter().copied())
        );
        return Err(Exit(2));
    };
    let title = source.experiment.name.clone();
    let mut dump = |pass: &str, g: &parallax_compiler::ir::Graph| {
        if dump_ir.iter().any(|d| d == pass || d == "all") {
            eprintln!("// IR after pass `{pass}`");
            eprint!("{}", to_text(g, &title));
        }
    };
    let compiled = run_pipeline(file, &source, &options, format, &mut dump)?;
    let t = Instant::now();
    let plan = compiled.plan(&source, &options);
    let mut pass_times = compiled.timings.clone();
    pass_times.push(("plan", t.elapsed()));
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
            Emit::Plan => serde_json::to_string_pretty(&plan).expect("a plan serialises") + "\n",
            Emit::Ptx => String::new(),
        }
    };
    match (out, emit) {
        (None, [e]) => {
            print!("{}", render(*e));
            return Ok(());
        }
        (Some(dir), _) if !emit.is_empty() => {
            if let Err(e) = std::fs::create_dir_all(dir) {
                eprintln!("error: cannot create `{}`: {e}", dir.display());
                return Err(Exit(1));
            }
            for &e in emit {
                if e == Emit::Ptx {
                    emit_ptx(&plan, dir, file)?;
                    continue;
                }
                let path = dir.join(e.file_name());
                if let Err(err) = std::fs::write(&path, render(e)) {
                    eprintln!("error: cannot write `{}`: {err}", path.display());
                    return Err(Exit(1));
                }
                eprintln!("wrote {}", path.display());
            }
        }
        _ => {}
    }
    let capacity = gpu_memory.unwrap_or(profile.memory);
    let fits = plan.memory.peak_bytes <= capacity;
    let device = serde_json::json!({
        "kind": profile.kind,
        "name": profile.name,
        "memory_bytes": capacity,
        "fits_one_device": fits,
    });
    print_plan(&plan, &pass_times, format, device);
    memory_fit(&plan, profile, capacity, format)
}

/// Whether the plan's peak memory fits one device; a plan for one GPU that does not fit is
/// refused with its memory table (exit 1) before anything runs.
fn memory_fit(
    p: &parallax_compiler::Plan,
    profile: &parallax_compiler::devices::Profile,
    capacity: u64,
    format: Format,
) -> Result<(), Exit> {
    let m = &p.memory;
    let fits = m.peak_bytes <= capacity;
    if format == Format::Text {
        println!(
            "  device:     {} ({} each): {}",
            profile.name,
            bytes(capacity),
            if fits {
                format!(
                    "fits, peak {} ({:.1}%)",
                    bytes(m.peak_bytes),
                    100.0 * m.peak_bytes as f64 / capacity as f64
                )
            } else {
                format!("does not fit one device: peak {}", bytes(m.peak_bytes))
            }
        );
    }
    if fits || p.gpus_requested > 1 {
        if !fits && format == Format::Text {
            println!(
                "  note:       partitioning over the {} requested GPUs is not built yet, so this plan cannot run as it is",
                p.gpus_requested
            );
        }
        return Ok(());
    }
    let activations = m
        .peak_bytes
        .saturating_sub(m.parameter_bytes)
        .saturating_sub(m.optimizer_state_bytes)
        .saturating_sub(m.input_bytes);
    eprintln!(
        "error: `{}` needs {} at its peak, more than the {} of one {}",
        p.name,
        bytes(m.peak_bytes),
        bytes(capacity),
        profile.name
    );
    for (what, b) in [
        ("parameters", m.parameter_bytes),
        ("optimizer state", m.optimizer_state_bytes),
        ("inputs", m.input_bytes),
        ("activations at the peak", activations),
        ("total at the peak", m.peak_bytes),
    ] {
        eprintln!("  {what:<24} {:>12}", bytes(b));
    }
    eprintln!(
        "  = hint: parameters and optimizer state alone need at least {} GPUs of this kind once sharded; multi-GPU partitioning is not built yet; a smaller batch_size lowers the activations",
        (m.parameter_bytes + m.optimizer_state_bytes).div_ceil(capacity.max(1))
    );
    Err(Exit(1))
}

/// Writes `DIR/<kernel>.ptx` for each generated entry and `DIR/manifest.json`.
fn emit_ptx(plan: &parallax_compiler::Plan, dir: &Path, file: &Path) -> Result<(), Exit> {
    let module =
        parallax_compiler::codegen::generate(plan, plan.batch_size, "sm_80").map_err(|e| {
            eprintln!("{}: error: {e}", file.display());
            Exit(1)
        })?;
    let write = |path: PathBuf, text: String| {
        std::fs::write(&path, text).map_err(|err| {
            eprintln!("error: cannot write `{}`: {err}", path.display());
            Exit(1)
        })
    };
    for (name, _) in &module.entries {
        let text = module.entry_text(name).unwrap_or_default();
        write(dir.join(format!("{name}.ptx")), text)?;
    }
    let manifest = serde_json::json!({
        "target": module.target,
        "batch": module.batch,
        "scratch_elements": module.scratch,
        "entries": module.entries.iter().map(|(n, _)| format!("{n}.ptx")).collect::<Vec<_>>(),
        "kernels": module.kernels,
    });
    write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&manifest).expect("serialisable") + "\n",
    )?;
    eprintln!(
        "wrote {} PTX files and manifest.json for {} kernels to {}",
        module.entries.len(),
        module.kernels.len(),
        dir.display()
    );
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn print_plan(
    p: &parallax_compiler::Plan,
    timings: &[(&str, Duration)],
    format: Format,
    device: serde_json::Value,
) {
    match format {
        Format::Json => {
            // A one-GPU plan that does not fit is an error (exit 1, the table on stderr).
            let ok = device["fits_one_device"].as_bool().unwrap_or(true) || p.gpus_requested > 1;
            let v = serde_json::json!({
                "ok": ok,
                "device": device,
                "name": p.name,
                "gpus_requested": p.gpus_requested,
                "device_kind": p.device_kind,
                "strategy": p.strategy,
                "parameters": p.parameters,
                "layers": p.layers,
                "flops_per_sample": p.flops_per_sample,
                "ops": p.steps.len(),
                "kernels_before_fusion": p.ops,
                "kernels": p.kernels.len(),
                "batch_size": p.batch_size,
                "memory": p.memory,
                "timings_ms": timings.iter().map(|(n, d)| (n.to_string(), ms(*d))).collect::<std::collections::BTreeMap<_, _>>(),
            });
            println!("{v}");
        }
        Format::Text => {
            println!("{}: compiled", p.name);
            if p.gpus_requested > 1 {
                println!(
                    "  gpus:       {} requested; this plan runs on 1 (multi-GPU partitioning is not built yet)",
                    p.gpus_requested
                );
            } else {
                println!("  gpus:       1 ({})", p.device_kind);
            }
            println!(
                "  strategy:   dp={} tp={} pp={}",
                p.strategy.dp, p.strategy.tp, p.strategy.pp
            );
            println!(
                "  parameters: {} ({})",
                thousands(p.parameters),
                bytes(p.memory.parameter_bytes)
            );
            println!(
                "  layers:     {}   ops: {}   kernels: {} before fusion, {} after",
                p.layers,
                p.steps.len(),
                p.ops,
                p.kernels.len()
            );
            println!(
                "  forward:    {} per sample",
                si(p.flops_per_sample, "FLOP")
            );
            let m = &p.memory;
            println!(
                "  memory:     at batch {}: peak {} = parameters {} + optimizer state {} + inputs {} + activations {} ({} without buffer reuse)",
                p.batch_size,
                bytes(m.peak_bytes),
                bytes(m.parameter_bytes),
                bytes(m.optimizer_state_bytes),
                bytes(m.input_bytes),
                bytes(m.peak_bytes.saturating_sub(m.parameter_bytes).saturating_sub(m.optimizer_state_bytes).saturating_sub(m.input_bytes)),
                bytes(m.activation_bytes_without_reuse)
            );
        }
    }
}
