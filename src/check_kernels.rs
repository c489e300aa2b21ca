//! `parallax check-kernels`: prints the interpreter's kernel-by-kernel comparison with the
//! oracle (`parallax_runtime::kernel_check`) as a table, then every sanitizer finding; exit 1
//! on any difference beyond tolerance or any finding.

use crate::gpu::{compiled, fail};
use crate::{Exit, Format};
use parallax_compiler::target;
use parallax_emulator::MmaModel;
use parallax_runtime::gpu_check::precision_name;
use parallax_runtime::kernel_check::{self, KernelCheckArgs, KernelReport};
use std::path::Path;
use std::time::Instant;

pub fn run(
    file: &Path,
    set: &[String],
    (gpus, strategy, zero): (u32, Option<&str>, Option<u8>),
    a: &KernelCheckArgs,
    format: Format,
) -> Result<(), Exit> {
    let (source, plan, base) = compiled(file, set)?;
    // Several devices: the plan `train --gpus N` runs (the same choice of split).
    let plan = if gpus > 1 {
        let request = target::Request {
            gpus,
            strategy,
            zero,
            ..target::Request::default()
        };
        let split = target::split(&source, &request).map_err(|e| fail(file, e))?;
        let (_, plan) =
            target::compile_split(&source, &split, &mut |_, _| {}).map_err(|e| fail(file, e))?;
        errln!(
            "{}: --gpus {gpus}: {}",
            source.experiment.name,
            parallax_compiler::partition::strategy_name(&split.strategy)
        );
        plan
    } else {
        plan
    };
    let t = Instant::now();
    let r = kernel_check::check(&source, &plan, &base, a).map_err(|e| fail(file, e))?;
    let seconds = t.elapsed().as_secs_f64();
    match format {
        Format::Json => outln!("{}", json(&r, seconds))?,
        Format::Text => text(&source.experiment.name, &r, seconds)?,
    }
    if r.ok() {
        Ok(())
    } else {
        Err(Exit(1))
    }
}

fn mma_name(m: MmaModel) -> &'static str {
    match m {
        MmaModel::OracleOrder => "oracle-order",
        MmaModel::Hopper => "hopper",
    }
}

fn verdict(row: &kernel_check::KernelRow) -> &'static str {
    if row.failed.is_some() {
        "FAILED"
    } else if row.findings > 0 {
        "SANITIZER"
    } else if !row.unwritten.is_empty() {
        "UNWRITTEN"
    } else if row.difference > row.tolerance {
        "DIFF"
    } else {
        "ok"
    }
}

fn number(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else {
        format!("{x:.1e}")
    }
}

fn text(name: &str, r: &KernelReport, seconds: f64) -> Result<(), Exit> {
    outln!(
        "{name}: {} kernels on the PTX interpreter against the CPU oracle, one training step, batch {}, {}, mma {}",
        r.rows.len(),
        r.batch,
        precision_name(r.precision),
        mma_name(r.mma)
    )?;
    for (entry, f) in &r.replaced {
        outln!("  `{entry}` from {}", f.display())?;
    }
    outln!(
        "{:>6}  {:<40} {:<12} {:>9} {:>9}  verdict",
        "kernel",
        "ops",
        "family",
        "largest",
        "tolerance"
    )?;
    let mut device = String::new();
    for row in &r.rows {
        let mut ops = row.ops.join("+");
        if ops.len() > 40 {
            ops.truncate(37);
            ops.push_str("...");
        }
        if row.device != device {
            device = row.device.clone();
            outln!("{device}:")?;
        }
        outln!(
            "{:>6}  {:<40} {:<12} {:>9} {:>9}  {}",
            row.kernel,
            ops,
            row.family.name(),
            number(row.difference),
            number(row.tolerance),
            verdict(row)
        )?;
        if let (Some((s, op, layer)), true) = (&row.worst, row.difference > row.tolerance) {
            outln!("        largest at step {s} `{op}` in `{layer}`")?;
        }
        if !row.unwritten.is_empty() {
            outln!("        left unwritten: steps {:?}", row.unwritten)?;
        }
        if let Some(m) = &row.failed {
            outln!("        {m}")?;
        }
    }
    for (kernel, f) in &r.findings {
        let at = kernel.map_or("the step's fills and copies".to_string(), |k| {
            format!("kernel {k}")
        });
        outln!("FINDING ({at}) {f}")?;
    }
    for (name, d) in &r.updates {
        outln!("UPDATE `{name}` differs from the oracle's after the step by {d:.1e}")?;
    }
    let bad = r.rows.iter().filter(|x| !x.ok()).count();
    outln!(
        "{}: {} of {} kernels within tolerance, {} sanitizer findings; {:.1} M lane-instructions in {seconds:.1} s",
        if r.ok() { "ok" } else { "FAILED" },
        r.rows.len() - bad,
        r.rows.len(),
        r.findings.len(),
        r.instructions as f64 / 1e6
    )
}

fn json(r: &KernelReport, seconds: f64) -> String {
    let rows: Vec<serde_json::Value> = r
        .rows
        .iter()
        .map(|x| {
            serde_json::json!({
                "kernel": x.kernel,
                "device": x.device,
                "ops": x.ops,
                "launches": x.launches,
                "family": x.family.name(),
                "difference": x.difference,
                "tolerance": x.tolerance,
                "unwritten": x.unwritten,
                "findings": x.findings,
                "failed": x.failed,
                "verdict": verdict(x),
            })
        })
        .collect();
    let findings: Vec<serde_json::Value> = r
        .findings
        .iter()
        .map(|(k, f)| {
            serde_json::json!({
                "kernel": k,
                "kind": format!("{:?}", f.kind),
                "entry": f.entry,
                "line": f.line,
                "block": f.block,
                "thread": f.thread,
                "address": f.address,
                "detail": f.detail,
            })
        })
        .collect();
    serde_json::json!({
        "ok": r.ok(),
        "batch": r.batch,
        "precision": precision_name(r.precision),
        "mma": mma_name(r.mma),
        "kernels": rows,
        "findings": findings,
        "updates": r.updates,
        "instructions": r.instructions,
        "seconds": seconds,
    })
    .to_string()
}
