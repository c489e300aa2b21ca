//! What `parallax compile` says of a plan: its summary (text or JSON), the one-device memory
//! verdict, and why a partition did not fit. Text only; the command line prints it.

use super::explain::{
    candidate_table, failure_json, memory_lines, micro_batches, seconds, smallest_hint,
};
use crate::partition::{self, Partition};
use crate::plan::{bytes, si, thousands, Plan};
use std::fmt::Write;

/// The partition the planner chose for the plan's GPU count, or why none fits.
pub type Partitioned = Result<Partition, partition::Error>;

/// The plan's summary as `compile` prints it: GPUs, the split, parameters, layers, ops,
/// kernels, FLOPs and memory (`simulated`: what each simulated device allocates).
pub fn text(p: &Plan, partitioned: &Partitioned, simulated: Option<&[u64]>) -> String {
    let mut s = String::new();
    let mut line = |l: String| {
        s.push_str(&l);
        s.push('\n');
    };
    line(format!("{}: compiled", p.name));
    line(format!(
        "  gpus:       {} ({})",
        p.gpus_requested, p.device_kind
    ));
    line(match partitioned {
        Ok(part) => format!(
            "  strategy:   {} (dp={} tp={} pp={}, zero {}, schedule {}, {}){}: per-GPU peak {} of {} (the planner's estimate), est. step {}, {} sent per GPU per step",
            partition::strategy_name(&part.strategy),
            part.strategy.dp,
            part.strategy.tp,
            part.strategy.pp,
            part.zero,
            part.schedule.name(),
            micro_batches(part.micro_batches, part.micro_batch_size),
            if part.forced { " (forced)" } else { "" },
            bytes(part.per_device_peak_bytes),
            bytes(part.capacity_bytes),
            seconds(part.step_time_s),
            bytes(part.bytes_communicated_per_step),
        ),
        Err(_) => "  strategy:   none fits (see below)".into(),
    });
    if let Some(sim) = simulated {
        let (lo, hi) = (
            sim.iter().min().copied().unwrap_or(0),
            sim.iter().max().copied().unwrap_or(0),
        );
        line(format!(
            "  simulated:  `train --backend cpu` allocates {} to {} on each of its {} devices (exact; it holds every micro-shard's activations at once)",
            bytes(lo),
            bytes(hi),
            sim.len()
        ));
    }
    line(format!(
        "  parameters: {} ({})",
        thousands(p.parameters),
        bytes(p.memory.parameter_bytes)
    ));
    line(format!(
        "  layers:     {}   ops: {}   kernels: {} before fusion, {} after",
        p.layers,
        p.steps.len(),
        p.ops,
        p.kernels.len()
    ));
    line(format!(
        "  forward:    {} per sample",
        si(p.flops_per_sample, "FLOP")
    ));
    let m = &p.memory;
    // Running statistics are named only where the model has some (BatchNorm).
    let statistics = if m.statistics_bytes > 0 {
        format!(" + running statistics {}", bytes(m.statistics_bytes))
    } else {
        String::new()
    };
    line(format!(
        "  memory:     {}at batch {}: peak {} = parameters {} + optimizer state {}{statistics} + inputs {} + activations {}{} ({} without buffer reuse)",
        if p.gpus_requested > 1 { "unpartitioned, on one device, " } else { "" },
        p.batch_size,
        bytes(m.peak_bytes),
        bytes(m.parameter_bytes),
        bytes(m.optimizer_state_bytes),
        bytes(m.input_bytes),
        bytes(m.activation_bytes_at_peak()),
        if p.bf16_activations() { " in bf16" } else { "" },
        bytes(m.activation_bytes_without_reuse)
    ));
    s
}

/// The same as JSON, with the device (`kind`, `name`, `memory_bytes`, `fits_one_device`)
/// and the passes' times in milliseconds. `ok` is false for a plan that fits nowhere.
pub fn json(
    p: &Plan,
    partitioned: &Partitioned,
    simulated: Option<&[u64]>,
    profile: &crate::devices::Profile,
    capacity: u64,
    timings: &[(&str, std::time::Duration)],
) -> serde_json::Value {
    let fits = p.memory.peak_bytes <= capacity;
    let ok = match p.gpus_requested > 1 {
        true => partitioned.is_ok(),
        false => fits,
    };
    let device = serde_json::json!({
        "kind": profile.kind,
        "name": profile.name,
        "memory_bytes": capacity,
        "fits_one_device": fits,
    });
    let partition = match partitioned {
        Ok(part) => serde_json::to_value(part).expect("a partition serialises"),
        Err(e) => failure_json(e),
    };
    let timings: std::collections::BTreeMap<String, f64> = timings
        .iter()
        .map(|(n, d)| (n.to_string(), d.as_secs_f64() * 1e3))
        .collect();
    serde_json::json!({
        "ok": ok,
        "partition": partition,
        "simulated_device_bytes": simulated,
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
        "timings_ms": timings,
    })
}

/// One device's verdict (`device:` line) for a plan of one GPU of `capacity` bytes.
pub fn device_line(p: &Plan, device: &str, capacity: u64) -> String {
    let peak = p.memory.peak_bytes;
    let verdict = if peak <= capacity {
        format!(
            "fits, peak {} ({:.1}%)",
            bytes(peak),
            100.0 * peak as f64 / capacity as f64
        )
    } else {
        format!("does not fit one device: peak {}", bytes(peak))
    };
    format!(
        "  device:     {device} ({} each): {verdict}",
        bytes(capacity)
    )
}

/// Why a plan does not fit one `device` of `capacity` bytes: the error line and its memory
/// table (the caller adds the hint).
pub fn one_device_refusal(p: &Plan, device: &str, capacity: u64) -> String {
    let m = &p.memory;
    let mut s = format!(
        "error: `{}` needs {} at its peak, more than the {} of one {device}\n",
        p.name,
        bytes(m.peak_bytes),
        bytes(capacity),
    );
    for (what, b) in [
        ("parameters", m.parameter_bytes),
        ("optimizer state", m.optimizer_state_bytes),
        ("running statistics", m.statistics_bytes),
        ("inputs", m.input_bytes),
        ("activations at the peak", m.activation_bytes_at_peak()),
        ("total at the peak", m.peak_bytes),
    ] {
        let _ = writeln!(s, "  {what:<24} {:>12}", bytes(b));
    }
    s
}

/// `compile --timings`: each stage's milliseconds and their total.
pub fn timings(stages: &[(&str, std::time::Duration)]) -> String {
    let mut s = "timings:\n".to_string();
    for (name, d) in stages {
        let _ = writeln!(s, "  {name:<10} {:>9.3} ms", d.as_secs_f64() * 1e3);
    }
    let total: std::time::Duration = stages.iter().map(|(_, d)| *d).sum();
    let _ = writeln!(s, "  {:<10} {:>9.3} ms", "total", total.as_secs_f64() * 1e3);
    s
}

/// What follows the error line of a partition that did not fit: the candidates (with
/// `explain`), the least memory any candidate needs, and the hint.
pub fn no_fit(e: &partition::Error, explain: bool) -> String {
    let mut s = String::new();
    match e {
        partition::Error::NoFit {
            least,
            smallest,
            candidates,
            ..
        } => {
            if explain {
                s.push_str(&candidate_table(candidates, least.memory.total.max(1)));
            }
            let _ = writeln!(
                s,
                "  the candidate needing the least memory, {} (zero {}, schedule {}, {}):",
                least.strategy_name(),
                least.zero,
                least.schedule.name(),
                micro_batches(least.micro_batches, least.micro_batch_size)
            );
            s.push_str(&memory_lines(&least.memory, "    "));
            let _ = writeln!(s, "  = hint: {}", smallest_hint(smallest.as_ref()));
        }
        partition::Error::ForcedNoFit { candidate, .. } => {
            s.push_str(&memory_lines(&candidate.memory, "    "));
            s.push_str(
                "  = hint: without --strategy the planner picks among every strategy for this GPU count\n",
            );
        }
        _ => {}
    }
    s
}
