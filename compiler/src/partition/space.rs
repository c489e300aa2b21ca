//! The search space: every degree triple `dp x tp x pp` of a GPU count, the micro-batch
//! counts tried, and the rules (heads, blocks, batch, nodes) that rule a triple out for a
//! model, each with the reason the planner shows.

use super::{cost, strategy_name, Error, ModelCost, Target};
use crate::plan::Strategy;
use serde::Serialize;

fn divisors(n: u32) -> Vec<u32> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Micro-batch counts tried: powers of two up to the replica's batch, and the batch itself.
pub(super) fn micro_batch_counts(replica_batch: u64) -> Vec<u64> {
    let mut v: Vec<u64> = std::iter::successors(Some(1u64), |m| m.checked_mul(2))
        .take_while(|&m| m <= replica_batch)
        .collect();
    if v.last() != Some(&replica_batch) {
        v.push(replica_batch);
    }
    v
}

pub(super) struct Rules {
    pub gpus_per_node: u32,
    max_tp: u32,
    max_pp: u32,
    pub tp_rule: String,
}

pub(super) fn rules(m: &ModelCost, t: &Target) -> Rules {
    let gpus_per_node = match t.nodes {
        Some(n) if n > 0 => t.gpus.div_ceil(n).max(1),
        _ => t.gpus.min(cost::GPUS_PER_NODE),
    };
    let (max_tp, tp_rule) = match m.heads {
        Some(h) => (
            gpus_per_node,
            format!(
                "tp divides the {h} attention heads and stays within a node ({gpus_per_node} GPUs)"
            ),
        ),
        None => (
            1,
            "tp = 1: tensor parallelism splits attention heads and MLPs, and this model has no attention"
                .to_string(),
        ),
    };
    let max_pp = if m.blocks > 0 {
        m.blocks
    } else {
        (0..m.groups.len())
            .filter(|&g| m.cost(g).param_bytes.total() > 0.0)
            .count()
            .max(1)
    } as u32;
    Rules {
        gpus_per_node,
        max_tp,
        max_pp,
        tp_rule,
    }
}

/// Why `s` cannot be planned for this model, if it cannot.
fn infeasible(m: &ModelCost, r: &Rules, s: &Strategy) -> Option<String> {
    if s.tp > r.max_tp {
        return Some(format!("tp {} > {}: {}", s.tp, r.max_tp, r.tp_rule));
    }
    if let Some(h) = m.heads {
        if !h.is_multiple_of(s.tp as u64) {
            return Some(format!(
                "tp {} does not divide the {h} attention heads",
                s.tp
            ));
        }
    }
    if s.pp > r.max_pp {
        return Some(format!(
            "pp {} > the {} {} a pipeline can be cut into",
            s.pp,
            r.max_pp,
            if m.blocks > 0 { "blocks" } else { "layers" }
        ));
    }
    if s.dp as u64 > m.batch {
        return Some(format!("dp {} > the batch size {}", s.dp, m.batch));
    }
    None
}

/// The strategies to consider: all feasible degree triples, or the forced one.
pub(super) fn strategies(m: &ModelCost, t: &Target, r: &Rules) -> Result<Vec<Strategy>, Error> {
    if let Some(s) = t.strategy {
        let product = s.dp as u64 * s.tp as u64 * s.pp as u64;
        if product != t.gpus as u64 {
            return Err(Error::StrategyProduct {
                strategy: strategy_name(&s),
                product,
                gpus: t.gpus,
            });
        }
        if let Some(why) = infeasible(m, r, &s) {
            return Err(Error::Infeasible {
                strategy: strategy_name(&s),
                why,
            });
        }
        return Ok(vec![s]);
    }
    let all = triples(t.gpus);
    let mut why = Vec::new();
    let feasible: Vec<Strategy> = all
        .iter()
        .filter(|s| match infeasible(m, r, s) {
            None => true,
            Some(w) => {
                why.push(format!("{}: {w}", strategy_name(s)));
                false
            }
        })
        .copied()
        .collect();
    if feasible.is_empty() {
        // Name the all-data, all-tensor and all-pipeline splits' reasons (the others mix them).
        let shown: Vec<String> = why.iter().take(2).chain(why.last()).cloned().collect();
        return Err(Error::NoStrategy {
            model: m.name.clone(),
            gpus: t.gpus,
            why: shown.join("; "),
        });
    }
    Ok(feasible)
}

/// Every degree triple `dp x tp x pp = gpus`.
fn triples(gpus: u32) -> Vec<Strategy> {
    divisors(gpus)
        .into_iter()
        .flat_map(|tp| {
            divisors(gpus / tp).into_iter().map(move |pp| Strategy {
                dp: gpus / tp / pp,
                tp,
                pp,
            })
        })
        .collect()
}

/// A degree triple the planner did not cost, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    pub strategy: Strategy,
    pub why: String,
}

/// The degree triples of `t.gpus` that cannot be used for this model.
pub(super) fn not_considered(m: &ModelCost, t: &Target, r: &Rules) -> Vec<Skipped> {
    if t.strategy.is_some() {
        return Vec::new();
    }
    triples(t.gpus)
        .into_iter()
        .filter_map(|s| infeasible(m, r, &s).map(|why| Skipped { strategy: s, why }))
        .collect()
}
