//! The partition planner: for N GPUs of one kind, every strategy `dp x tp x pp = N` with its
//! options (ZeRO stage, pipeline schedule, micro-batches), each with per-device memory and step
//! time from the cost model ([`cost`]); what does not fit is rejected with its numbers and the
//! fastest that fits is chosen. Pure: no I/O, no weights.

pub mod cost;
pub mod explain;
pub mod model;
mod pick;
mod space;
pub mod summary;
#[cfg(test)]
mod tests;

pub use cost::{Cluster, DeviceMemory, Options, PipelineSchedule, StepTime};
pub use model::{model_cost, ModelCost};
pub use pick::Pick;
pub use space::Skipped;
use space::{micro_batch_counts, not_considered, rules, strategies, Rules};

use crate::devices::Profile;
use crate::plan::Strategy;
use serde::Serialize;
use std::collections::HashMap;

/// The largest GPU count the smallest-fit search tries.
pub const SEARCH_BOUND: u32 = 65_536;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("no GPUs to plan for (asked for 0)")]
    NoGpus,
    #[error("`{model}` cannot be split over {gpus} GPUs: {why}")]
    NoStrategy {
        model: String,
        gpus: u32,
        why: String,
    },
    #[error("`{text}` is not a strategy: {why} (write e.g. dp4, tp8 or dp2.tp2.pp2)")]
    BadStrategy { text: String, why: String },
    #[error("strategy {strategy} uses {product} GPUs, not the {gpus} asked for")]
    StrategyProduct {
        strategy: String,
        product: u64,
        gpus: u32,
    },
    #[error("strategy {strategy} cannot be used: {why}")]
    Infeasible { strategy: String, why: String },
    #[error("`{model}` fits on no strategy for {gpus} x {device}")]
    NoFit {
        model: String,
        gpus: u32,
        device: &'static str,
        /// The candidate needing the least memory.
        least: Box<Candidate>,
        /// The smallest GPU count (searched up to [`SEARCH_BOUND`]) on which something fits.
        smallest: Option<Smallest>,
        candidates: Vec<Candidate>,
    },
    #[error("`{model}` on {gpus} GPUs: every strategy that fits has more than {max_dp} data-parallel ranks, and each batch is cut into {max_dp} micro-shards")]
    Unrunnable {
        model: String,
        gpus: u32,
        max_dp: u32,
        /// The fastest candidate that fits.
        fastest: Box<Candidate>,
    },
    #[error("strategy {} does not fit: it needs {} per device", .candidate.strategy_name(), crate::plan::bytes(.candidate.memory.total))]
    ForcedNoFit {
        candidate: Box<Candidate>,
        candidates: Vec<Candidate>,
    },
}

/// What to plan for.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub gpus: u32,
    pub profile: &'static Profile,
    /// Usable bytes per device.
    pub capacity: u64,
    /// `--nodes`: GPUs are spread evenly over this many nodes (else 8 GPUs per node).
    pub nodes: Option<u32>,
    /// `--strategy`: only these degrees.
    pub strategy: Option<Strategy>,
}

/// The smallest GPU count that fits, and the candidate chosen there.
#[derive(Debug, Clone, Serialize)]
pub struct Smallest {
    pub gpus: u32,
    pub candidate: Box<Candidate>,
}

/// One row of the candidate table: a strategy with its best options.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub strategy: Strategy,
    pub zero: u8,
    pub schedule: PipelineSchedule,
    pub micro_batches: u64,
    pub micro_batch_size: u64,
    /// The fullest device.
    pub memory: DeviceMemory,
    pub step_time_s: f64,
    pub time: StepTime,
    pub bytes_communicated_per_step: u64,
    pub fits: bool,
    pub rejected: Option<String>,
}

impl Candidate {
    pub fn strategy_name(&self) -> String {
        strategy_name(&self.strategy)
    }
    fn options(&self) -> Options {
        Options {
            dp: self.strategy.dp,
            tp: self.strategy.tp,
            pp: self.strategy.pp,
            zero: self.zero,
            schedule: self.schedule,
            micro_batches: self.micro_batches,
        }
    }
}

/// One pipeline stage of the chosen plan.
#[derive(Debug, Clone, Serialize)]
pub struct StageSummary {
    pub stage: u32,
    /// Its layer groups, repeats shortened (`wte, wpe, h.0-9`).
    pub layers: String,
    pub memory: DeviceMemory,
    /// Compute per micro-batch, forward and backward.
    pub compute_s: f64,
}

/// The planner's answer.
#[derive(Debug, Clone, Serialize)]
pub struct Partition {
    pub gpus: u32,
    pub device: &'static str,
    pub capacity_bytes: u64,
    pub gpus_per_node: u32,
    pub precision: &'static str,
    pub strategy: Strategy,
    pub zero: u8,
    pub schedule: PipelineSchedule,
    pub micro_batches: u64,
    pub micro_batch_size: u64,
    pub per_device_peak_bytes: u64,
    pub memory: DeviceMemory,
    pub step_time_s: f64,
    pub time: StepTime,
    pub bytes_communicated_per_step: u64,
    pub forced: bool,
    /// What limits the tensor-parallel degree, in words.
    pub tp_rule: String,
    pub stages: Vec<StageSummary>,
    pub candidates: Vec<Candidate>,
    /// Degree triples of this GPU count that cannot be used for this model.
    pub not_considered: Vec<Skipped>,
}

/// `dp2.tp2.pp2`, degrees of 1 left out (`dp4`, `tp8`); `dp1` for one device.
pub fn strategy_name(s: &Strategy) -> String {
    let parts: Vec<String> = [("dp", s.dp), ("tp", s.tp), ("pp", s.pp)]
        .iter()
        .filter(|(_, d)| *d > 1)
        .map(|(n, d)| format!("{n}{d}"))
        .collect();
    if parts.is_empty() {
        "dp1".into()
    } else {
        parts.join(".")
    }
}

/// Reads `dp4`, `tp8`, `dp2.tp2.pp2`, `pp2.dp4` (any order; degrees not named are 1) and
/// checks the product is `gpus`.
pub fn parse_strategy(text: &str, gpus: u32) -> Result<Strategy, Error> {
    let bad = |why: String| Error::BadStrategy {
        text: text.to_string(),
        why,
    };
    let mut s = Strategy {
        dp: 1,
        tp: 1,
        pp: 1,
    };
    let mut seen = [false; 3];
    for part in text.trim().split(['.', 'x', '*']) {
        let part = part.trim().to_ascii_lowercase();
        if part.len() < 3 {
            return Err(bad(format!("`{part}` is not a degree such as dp4")));
        }
        let (name, n) = part.split_at(2);
        let i = match name {
            "dp" => 0,
            "tp" => 1,
            "pp" => 2,
            _ => return Err(bad(format!("`{name}` is not dp, tp or pp"))),
        };
        let n: u32 = n
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| bad(format!("`{part}`: the degree must be a positive integer")))?;
        if std::mem::replace(&mut seen[i], true) {
            return Err(bad(format!("`{name}` is given twice")));
        }
        *[&mut s.dp, &mut s.tp, &mut s.pp][i] = n;
    }
    let product = s.dp as u64 * s.tp as u64 * s.pp as u64;
    if product != gpus as u64 {
        return Err(Error::StrategyProduct {
            strategy: strategy_name(&s),
            product,
            gpus,
        });
    }
    Ok(s)
}

/// `t` rounded to 4 significant digits: estimates that close are a tie.
pub fn significant(t: f64) -> f64 {
    if t <= 0.0 || !t.is_finite() {
        return t;
    }
    let scale = 10f64.powf(t.log10().floor() - 3.0);
    (t / scale).round() * scale
}

/// Every candidate for `t`: per strategy, ZeRO stage and schedule, the best micro-batch
/// count (the fastest that fits, else the one needing least memory).
fn candidates(m: &ModelCost, t: &Target, r: &Rules) -> Result<Vec<Candidate>, Error> {
    let cluster = Cluster {
        gpus: t.gpus,
        gpus_per_node: r.gpus_per_node,
        profile: t.profile,
        capacity: t.capacity,
    };
    let mut stage_cache: HashMap<(u32, u32), Vec<cost::Stage>> = HashMap::new();
    let mut out = Vec::new();
    for s in strategies(m, t, r)? {
        let stages = stage_cache
            .entry((s.tp, s.pp))
            .or_insert_with(|| cost::stages(m, &cluster, s.tp, s.pp));
        let zeros: &[u8] = if s.dp > 1 { &[0, 1, 2, 3] } else { &[0] };
        let schedules: &[PipelineSchedule] = if s.pp > 1 {
            &[PipelineSchedule::OneFOneB, PipelineSchedule::GPipe]
        } else {
            &[PipelineSchedule::Sequential]
        };
        let replica_batch = m.batch.div_ceil(s.dp as u64).max(1);
        let counts = micro_batch_counts(replica_batch);
        for &zero in zeros {
            for &schedule in schedules {
                let mut best: Option<(Options, cost::Estimate)> = None;
                for &micro_batches in &counts {
                    let o = Options {
                        dp: s.dp,
                        tp: s.tp,
                        pp: s.pp,
                        zero,
                        schedule,
                        micro_batches,
                    };
                    let e = cost::estimate(m, &cluster, stages, &o);
                    let better = match &best {
                        None => true,
                        Some((_, b)) => {
                            let (fits, bfits) =
                                (e.peak().total <= t.capacity, b.peak().total <= t.capacity);
                            match (fits, bfits) {
                                (true, false) => true,
                                (false, true) => false,
                                (true, true) => e.time.total_s < b.time.total_s,
                                (false, false) => e.peak().total < b.peak().total,
                            }
                        }
                    };
                    if better {
                        best = Some((o, e));
                    }
                }
                if let Some((o, e)) = best {
                    let peak = e.peak();
                    let fits = peak.total <= t.capacity;
                    out.push(Candidate {
                        strategy: s,
                        zero,
                        schedule,
                        micro_batches: o.micro_batches,
                        micro_batch_size: e.micro_batch_size,
                        memory: peak,
                        step_time_s: e.time.total_s,
                        time: e.time,
                        bytes_communicated_per_step: e.bytes_sent,
                        fits,
                        rejected: (!fits).then(|| {
                            format!(
                                "needs {} per GPU > {}",
                                crate::plan::bytes(peak.total),
                                crate::plan::bytes(t.capacity)
                            )
                        }),
                    });
                }
            }
        }
    }
    // Fitting candidates fastest first (times equal to 4 significant digits prefer less
    // sharding, then less memory, then 1F1B), then the rejected by memory.
    out.sort_by(|a, b| {
        b.fits
            .cmp(&a.fits)
            .then(if a.fits {
                significant(a.step_time_s).total_cmp(&significant(b.step_time_s))
            } else {
                a.memory.total.cmp(&b.memory.total)
            })
            .then(a.zero.cmp(&b.zero))
            .then(a.memory.total.cmp(&b.memory.total))
            .then(b.schedule.cmp(&a.schedule))
    });
    Ok(out)
}

/// Plans `m` for `t`: the fastest candidate that fits, with the table it was chosen from.
pub fn plan(m: &ModelCost, t: &Target) -> Result<Partition, Error> {
    plan_picking(m, t, &Pick::default())
}

/// [`plan`], choosing the fastest candidate that fits and that `pick` allows.
pub fn plan_picking(m: &ModelCost, t: &Target, pick: &Pick) -> Result<Partition, Error> {
    if t.gpus == 0 {
        return Err(Error::NoGpus);
    }
    let r = rules(m, t);
    let candidates = candidates(m, t, &r)?;
    let usable = || candidates.iter().filter(|c| c.fits && pick.allows(c));
    let chosen = usable()
        .find(|c| pick.prefer_tp_free && c.strategy.tp == 1)
        .or_else(|| usable().next())
        .cloned();
    let Some(chosen) = chosen else {
        let allowed = || candidates.iter().filter(|c| pick.allows(c));
        let least = allowed()
            .min_by_key(|c| c.memory.total)
            .or_else(|| candidates.iter().min_by_key(|c| c.memory.total))
            .cloned()
            .ok_or(Error::NoGpus)?;
        if let (None, Some(fastest)) = (t.strategy, candidates.iter().find(|c| c.fits)) {
            if fastest.strategy.dp > pick.max_dp {
                return Err(Error::Unrunnable {
                    model: m.name.clone(),
                    gpus: t.gpus,
                    max_dp: pick.max_dp,
                    fastest: Box::new(fastest.clone()),
                });
            }
        }
        if t.strategy.is_some() {
            return Err(Error::ForcedNoFit {
                candidate: Box::new(least),
                candidates,
            });
        }
        return Err(Error::NoFit {
            model: m.name.clone(),
            gpus: t.gpus,
            device: t.profile.kind,
            least: Box::new(least),
            smallest: smallest_fitting(m, t),
            candidates,
        });
    };
    let cluster = Cluster {
        gpus: t.gpus,
        gpus_per_node: r.gpus_per_node,
        profile: t.profile,
        capacity: t.capacity,
    };
    let stages = cost::stages(m, &cluster, chosen.strategy.tp, chosen.strategy.pp);
    let e = cost::estimate(m, &cluster, &stages, &chosen.options());
    let stages = stages
        .iter()
        .zip(&e.memory)
        .enumerate()
        .map(|(i, (s, mem))| StageSummary {
            stage: i as u32,
            layers: explain::layer_list(m, s.groups.clone()),
            memory: *mem,
            compute_s: s.compute(e.micro_batch_size as f64),
        })
        .collect();
    Ok(Partition {
        gpus: t.gpus,
        device: t.profile.kind,
        capacity_bytes: t.capacity,
        gpus_per_node: r.gpus_per_node,
        precision: m.precision,
        strategy: chosen.strategy,
        zero: chosen.zero,
        schedule: chosen.schedule,
        micro_batches: chosen.micro_batches,
        micro_batch_size: chosen.micro_batch_size,
        per_device_peak_bytes: chosen.memory.total,
        memory: chosen.memory,
        step_time_s: chosen.step_time_s,
        time: chosen.time,
        bytes_communicated_per_step: chosen.bytes_communicated_per_step,
        forced: t.strategy.is_some(),
        not_considered: not_considered(m, t, &r),
        tp_rule: r.tp_rule,
        stages,
        candidates,
    })
}

/// GPU counts the smallest-fit search tries: 1 to 8, multiples of 8 to 1024, then powers of
/// two up to [`SEARCH_BOUND`].
pub fn search_counts() -> impl Iterator<Item = u32> {
    (1..=8).chain((2..=128).map(|k| k * 8)).chain(
        std::iter::successors(Some(2048u32), |n| n.checked_mul(2))
            .take_while(|&n| n <= SEARCH_BOUND),
    )
}

/// The smallest GPU count above `t.gpus` (of the counts [`search_counts`] tries, 8 per node)
/// on which some strategy fits.
pub fn smallest_fitting(m: &ModelCost, t: &Target) -> Option<Smallest> {
    search_counts().filter(|&n| n > t.gpus).find_map(|n| {
        let target = Target {
            gpus: n,
            nodes: None,
            strategy: None,
            ..*t
        };
        let r = rules(m, &target);
        let best = candidates(m, &target, &r).ok()?.into_iter().next()?;
        best.fits.then(|| Smallest {
            gpus: n,
            candidate: Box::new(best),
        })
    })
}
