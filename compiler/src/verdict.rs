//! What `parallax compile` concludes for a GPU count: the partition chosen (or why none fits)
//! and, for one GPU, whether the plan fits its memory. Text only; the command line prints it
//! and exits 1 when the verdict is a refusal.

use crate::partition::explain::{candidate_table, explain};
use crate::partition::{self, summary};
use crate::plan::Plan;
use crate::target::{self, Partitioned, Request, Split, TargetError};
use crate::{Compiled, Options, Source};
use std::fmt::Write;
use std::time::{Duration, Instant};

/// What `compile` decides for the plan's GPU count: the plan (its strategy the split's), the
/// partition, the split `train` runs (or why none), what each simulated device allocates,
/// and how long planning and partitioning took.
pub struct Planned {
    pub plan: Plan,
    pub partitioned: Partitioned,
    pub split: Result<Split, TargetError>,
    pub simulated: Option<Vec<u64>>,
    pub times: [(&'static str, Duration); 2],
}

/// Plans `compiled` for `request` (its GPU count is the plan's) by the function `train
/// --gpus N` calls too, so both choose the same split.
pub fn plan(
    source: &Source,
    compiled: &Compiled,
    options: &Options,
    request: Request,
) -> Result<Planned, TargetError> {
    let t = Instant::now();
    let mut plan = compiled.plan(source, options);
    let plan_time = t.elapsed();
    let t = Instant::now();
    let request = Request {
        gpus: plan.gpus_requested,
        ..request
    };
    let partitioned = target::partition_for(source, compiled, &request)?
        .expect("a device kind that `devices::find` knows has a profile");
    let partition_time = t.elapsed();
    let split = target::split_from(source, &request, Some(&partitioned));
    let simulated = match (&partitioned.partition, &split) {
        (Ok(p), Ok(s)) if p.gpus > 1 => target::simulated_device_bytes(source, s.strategy, s.zero),
        _ => None,
    };
    if let Ok(s) = &split {
        plan.strategy = s.strategy;
    }
    Ok(Planned {
        plan,
        partitioned,
        split,
        simulated,
        times: [("plan", plan_time), ("partition", partition_time)],
    })
}

/// The verdict's text for the standard output and the error stream, and whether it is a
/// refusal.
#[derive(Default)]
pub struct Verdict {
    pub out: String,
    pub err: String,
    pub refused: bool,
}

/// The verdict for `plan` on `partitioned`, on devices named `device` of `capacity` bytes
/// each; `text`: the text format (the JSON summary already holds the rest); `explain`: the
/// candidates and each pipeline stage too.
pub fn verdict(
    plan: &Plan,
    partitioned: &Partitioned,
    device: &str,
    capacity: u64,
    text: bool,
    explain_it: bool,
) -> Verdict {
    let mut v = Verdict::default();
    match (&partitioned.partition, plan.gpus_requested > 1) {
        (Err(e), true) => {
            let _ = writeln!(v.err, "error: {e}");
            v.err += &summary::no_fit(e, explain_it);
            v.refused = true;
            return v;
        }
        (Ok(p), _) if text && explain_it => v.out += &explain(p),
        (Ok(p), true) if text => {
            let n = p.candidates.len();
            let _ = writeln!(
                v.out,
                "  (--explain lists the {n} candidates and each pipeline stage)"
            );
        }
        (Err(partition::Error::NoFit { candidates, .. }), false) if text && explain_it => {
            v.err += &candidate_table(candidates, capacity)
        }
        _ => {}
    }
    if plan.gpus_requested > 1 {
        return v;
    }
    // One GPU: whether the plan fits it, refused with its memory table before anything runs.
    if text {
        let _ = writeln!(v.out, "{}", summary::device_line(plan, device, capacity));
    }
    if plan.memory.peak_bytes > capacity {
        v.err += &summary::one_device_refusal(plan, device, capacity);
        let _ = writeln!(v.err, "  = hint: {}", partitioned.one_device_hint());
        v.refused = true;
    }
    v
}
