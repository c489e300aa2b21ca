//! `check-kernels`' report: the rows, findings and verdict as text or JSON (the command
//! line prints them).

use super::{KernelReport, KernelRow};
use parallax_emulator::MmaModel;
use std::fmt::Write;

/// The tensor-core model's name, as `--mma` takes it.
pub fn mma_name(m: MmaModel) -> &'static str {
    match m {
        MmaModel::OracleOrder => "oracle-order",
        MmaModel::Hopper => "hopper",
    }
}

/// A row's verdict: `ok`, `DIFF`, `UNWRITTEN`, `SANITIZER` or `FAILED`.
pub fn verdict(row: &KernelRow) -> &'static str {
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

/// The report as `check-kernels` prints it: a row per kernel, then the findings, the
/// updates that differ, and the verdict.
pub fn text(name: &str, r: &KernelReport, seconds: f64) -> String {
    let mut s = String::new();
    let _ = writeln!(s,
        "{name}: {} kernels on the PTX interpreter against the CPU oracle, one training step, batch {}, {}, mma {}",
        r.rows.len(),
        r.batch,
        r.precision.name(),
        mma_name(r.mma)
    );
    for (entry, f) in &r.replaced {
        let _ = writeln!(s, "  `{entry}` from {}", f.display());
    }
    let _ = writeln!(
        s,
        "{:>6}  {:<40} {:<12} {:>9} {:>9}  verdict",
        "kernel", "ops", "family", "largest", "tolerance"
    );
    let mut device = String::new();
    for row in &r.rows {
        let mut ops = row.ops.join("+");
        if ops.len() > 40 {
            ops.truncate(37);
            ops.push_str("...");
        }
        if row.device != device {
            device = row.device.clone();
            let _ = writeln!(s, "{device}:");
        }
        let _ = writeln!(
            s,
            "{:>6}  {:<40} {:<12} {:>9} {:>9}  {}",
            row.kernel,
            ops,
            row.family.name(),
            number(row.difference),
            number(row.tolerance),
            verdict(row)
        );
        if let (Some((step, op, layer)), true) = (&row.worst, row.difference > row.tolerance) {
            let _ = writeln!(s, "        largest at step {step} `{op}` in `{layer}`");
        }
        if !row.unwritten.is_empty() {
            let _ = writeln!(s, "        left unwritten: steps {:?}", row.unwritten);
        }
        if let Some(m) = &row.failed {
            let _ = writeln!(s, "        {m}");
        }
    }
    for (kernel, f) in &r.findings {
        let at = kernel.map_or("the step's fills and copies".to_string(), |k| {
            format!("kernel {k}")
        });
        let _ = writeln!(s, "FINDING ({at}) {f}");
    }
    for (name, d) in &r.updates {
        let _ = writeln!(
            s,
            "UPDATE `{name}` differs from the oracle's after the step by {d:.1e}"
        );
    }
    let bad = r.rows.iter().filter(|x| !x.ok()).count();
    let _ = writeln!(s,
        "{}: {} of {} kernels within tolerance, {} sanitizer findings; {:.1} M lane-instructions in {seconds:.1} s",
        if r.ok() { "ok" } else { "FAILED" },
        r.rows.len() - bad,
        r.rows.len(),
        r.findings.len(),
        r.instructions as f64 / 1e6
    );
    s
}

/// The report as JSON.
pub fn json(r: &KernelReport, seconds: f64) -> String {
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
        "precision": r.precision.name(),
        "mma": mma_name(r.mma),
        "kernels": rows,
        "findings": findings,
        "updates": r.updates,
        "instructions": r.instructions,
        "seconds": seconds,
    })
    .to_string()
}
