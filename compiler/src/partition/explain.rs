//! The `--explain` text: the candidate table, the choice and each pipeline stage.

use super::{strategy_name, Candidate, Error, Partition, Smallest};
use crate::plan::bytes;
use std::fmt::Write;

pub(super) fn seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

/// `N micro-batches of M` (one: `1 micro-batch of M`).
pub fn micro_batches(count: u64, size: impl std::fmt::Display) -> String {
    let s = if count == 1 { "" } else { "es" };
    format!("{count} micro-batch{s} of {size}")
}

/// The candidate table, one row per strategy and options.
pub fn candidate_table(candidates: &[Candidate], capacity: u64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  {:<14} {:>4} {:>5} {:>6} {:>11} {:>11} {:>11}  verdict",
        "strategy", "zero", "sched", "micro", "memory/GPU", "step time", "comm/step"
    );
    for c in candidates {
        let verdict = match &c.rejected {
            None => format!(
                "fits ({:.0}%)",
                100.0 * c.memory.total as f64 / capacity.max(1) as f64
            ),
            Some(why) => format!("rejected: {why}"),
        };
        let _ = writeln!(
            out,
            "  {:<14} {:>4} {:>5} {:>6} {:>11} {:>11} {:>11}  {verdict}",
            c.strategy_name(),
            c.zero,
            c.schedule.name(),
            format!("{}x{}", c.micro_batches, c.micro_batch_size),
            bytes(c.memory.total),
            seconds(c.step_time_s),
            bytes(c.bytes_communicated_per_step),
        );
    }
    out
}

/// An itemised device memory, one line per item.
pub fn memory_lines(m: &super::DeviceMemory, indent: &str) -> String {
    let mut out = String::new();
    for (what, b) in [
        ("parameters", m.parameters),
        ("gradients", m.gradients),
        ("optimizer state", m.optimizer_state),
        ("activations at the peak", m.activations),
        ("communication buffers", m.communication_buffers),
        ("inputs", m.inputs),
        ("total at the peak", m.total),
    ] {
        let _ = writeln!(out, "{indent}{what:<24} {:>12}", bytes(b));
    }
    out
}

/// The whole explanation: assumptions, candidates, choice, stages.
pub fn explain(p: &Partition) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "partition: {} GPUs of {} ({} each, {} per node); matmuls at {} x {:.0}% of peak; {}",
        p.gpus,
        p.device,
        bytes(p.capacity_bytes),
        p.gpus_per_node,
        p.precision,
        super::cost::MATMUL_EFFICIENCY * 100.0,
        p.tp_rule
    );
    let fitting = p.candidates.iter().filter(|c| c.fits).count();
    let _ = writeln!(
        out,
        "candidates ({}, {} fit; micro is micro-batches x samples per replica):",
        p.candidates.len(),
        fitting
    );
    out.push_str(&candidate_table(&p.candidates, p.capacity_bytes));
    if !p.not_considered.is_empty() {
        const SHOWN: usize = 6;
        let mut shown: Vec<String> = p
            .not_considered
            .iter()
            .take(SHOWN)
            .map(|s| format!("{} ({})", strategy_name(&s.strategy), s.why))
            .collect();
        if p.not_considered.len() > SHOWN {
            shown.push(format!("and {} more", p.not_considered.len() - SHOWN));
        }
        let _ = writeln!(out, "not considered: {}", shown.join("; "));
    }
    let t = &p.time;
    let _ = writeln!(
        out,
        "chosen: {} (zero {}, schedule {}, {}){}: {} per GPU, step {} = compute {} + bubble {} + tensor-parallel {} + p2p {} + data-parallel exposed {} + optimizer {}; {} sent per GPU per step",
        strategy_name(&p.strategy),
        p.zero,
        p.schedule.name(),
        micro_batches(p.micro_batches, p.micro_batch_size),
        if p.forced { " (forced)" } else { "" },
        bytes(p.per_device_peak_bytes),
        seconds(p.step_time_s),
        seconds(t.compute_s),
        seconds(t.bubble_s),
        seconds(t.tensor_parallel_s),
        seconds(t.pipeline_p2p_s),
        seconds(t.data_parallel_exposed_s),
        seconds(t.optimizer_s),
        bytes(p.bytes_communicated_per_step),
    );
    let _ = writeln!(
        out,
        "per device ({} tensor-parallel x {} data-parallel GPUs per stage hold the same):",
        p.strategy.tp, p.strategy.dp
    );
    for s in &p.stages {
        let m = &s.memory;
        let _ = writeln!(
            out,
            "  stage {}: {}\n    {} = parameters {} + gradients {} + optimizer state {} + activations {} + communication buffers {} + inputs {}; compute {} per micro-batch",
            s.stage,
            s.layers,
            bytes(m.total),
            bytes(m.parameters),
            bytes(m.gradients),
            bytes(m.optimizer_state),
            bytes(m.activations),
            bytes(m.communication_buffers),
            bytes(m.inputs),
            seconds(s.compute_s),
        );
    }
    out
}

/// What to try when nothing fits: the smallest GPU count that does, or that none does.
pub fn smallest_hint(smallest: Option<&Smallest>) -> String {
    match smallest {
        Some(s) => {
            let c = &s.candidate;
            format!(
                "the smallest GPU count that fits is {n} (--gpus {n}: {}, zero {}, schedule {}, {} per GPU, est. step {:.3} s)",
                c.strategy_name(),
                c.zero,
                c.schedule.name(),
                bytes(c.memory.total),
                c.step_time_s,
                n = s.gpus
            )
        }
        None => format!(
            "no GPU count up to {} fits; a smaller batch_size or model lowers the memory",
            super::SEARCH_BOUND
        ),
    }
}

/// A partition that failed, as `compile --format json` reports it: the error, and where
/// nothing fits the smallest GPU count that does and the candidates.
pub fn failure_json(e: &Error) -> serde_json::Value {
    let (smallest, candidates) = match e {
        Error::NoFit {
            smallest,
            candidates,
            ..
        } => (smallest.as_ref(), candidates.as_slice()),
        Error::ForcedNoFit { candidates, .. } => (None, candidates.as_slice()),
        _ => (None, &[][..]),
    };
    serde_json::json!({
        "error": e.to_string(),
        "smallest_fitting_gpus": smallest.map(|s| s.gpus),
        "smallest_fitting": smallest,
        "candidates": candidates,
    })
}

/// `wte, wpe, h.0-9`: consecutive instances of a repeat shortened.
pub(super) fn layer_list(m: &super::ModelCost, r: std::ops::Range<usize>) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(String, String, String)> = None; // (block, first, last)
    let flush = |run: &mut Option<(String, String, String)>, out: &mut Vec<String>| {
        if let Some((b, first, last)) = run.take() {
            if first == last {
                out.push(format!("{b}.{first}"));
            } else {
                out.push(format!("{b}.{first}-{last}"));
            }
        }
    };
    for g in r {
        let grp = &m.groups[g];
        match &grp.block {
            Some(b) => {
                let idx = grp.name[b.len() + 1..].to_string();
                match &mut run {
                    Some((rb, _, last)) if rb == b => *last = idx,
                    _ => {
                        flush(&mut run, &mut out);
                        run = Some((b.clone(), idx.clone(), idx));
                    }
                }
            }
            None => {
                flush(&mut run, &mut out);
                out.push(grp.name.clone());
            }
        }
    }
    flush(&mut run, &mut out);
    out.join(", ")
}

#[cfg(test)]
mod tests {
    use super::{micro_batches, seconds};

    #[test]
    fn counts_and_times_read_as_words() {
        assert_eq!(micro_batches(1, 16), "1 micro-batch of 16");
        assert_eq!(micro_batches(128, 1), "128 micro-batches of 1");
        // A step under a millisecond keeps its digits (it printed `0.000 s`).
        assert_eq!(seconds(60.2e-6), "60.2 µs");
        assert_eq!(seconds(0.0125), "12.5 ms");
        assert_eq!(seconds(92.984), "92.98 s");
    }
}
