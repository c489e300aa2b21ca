//! Pipeline stages of a plan: its top-level layers (a repeated block's instances each count
//! as one: `h.3`) in forward order, cut into contiguous stages of about equal forward FLOPs.
//! A kernel runs on the stage of the parameters it reads, else of its first op's layer; the
//! loss and the optimizer's global ops (clipping) go to the last stage.

use crate::ir::{Op, Phase};
use crate::plan::Plan;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Stages {
    pub count: usize,
    /// Each top-level layer in forward order, its stage and forward FLOPs at the plan's batch.
    pub groups: Vec<(String, usize, u64)>,
    /// The stage of each kernel of the plan.
    pub kernel_stage: Vec<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("{stages} pipeline stages need at least {stages} layers, but the model has {layers}")]
    TooFewLayers { stages: usize, layers: usize },
}

/// The top-level layer a layer path belongs to: `h.3.att.q` is in `h.3`, `2` in `2`.
pub fn group_of(layer: &str) -> &str {
    let mut parts = layer.splitn(3, '.');
    let first = parts.next().unwrap_or("");
    match parts.next() {
        Some(second)
            if second.bytes().all(|b| b.is_ascii_digit())
                && !first.bytes().all(|b| b.is_ascii_digit()) =>
        {
            &layer[..first.len() + 1 + second.len()]
        }
        _ => first,
    }
}

/// Forward FLOPs of `step` at the plan's batch.
fn step_flops(plan: &Plan, step: usize) -> u64 {
    let s = &plan.steps[step];
    let shape =
        |id: usize| crate::codegen::resolve(plan, &plan.steps[id].ty.shape, plan.batch_size);
    let ins: Vec<Vec<u64>> = s.operands.iter().map(|&o| shape(o)).collect();
    (s.op.def().flops)(&s.op, &ins, &shape(step))
}

pub fn split(plan: &Plan, count: usize) -> Result<Stages, StageError> {
    let count = count.max(1);
    let mut groups: Vec<(String, usize, u64)> = Vec::new();
    for s in &plan.steps {
        if s.phase != Phase::Forward || s.op.is_source() || s.layer.is_empty() {
            continue;
        }
        let g = group_of(&s.layer);
        let flops = step_flops(plan, s.id);
        match groups.iter_mut().find(|x| x.0 == g) {
            Some(x) => x.2 = x.2.saturating_add(flops),
            None => groups.push((g.to_string(), 0, flops)),
        }
    }
    if groups.len() < count {
        return Err(StageError::TooFewLayers {
            stages: count,
            layers: groups.len(),
        });
    }
    // Cut where the running total passes each stage's share, leaving a layer for every
    // stage still to come.
    let total: u64 = groups.iter().map(|g| g.2).sum::<u64>().max(1);
    let (mut stage, mut acc) = (0usize, 0u64);
    let n = groups.len();
    for (i, g) in groups.iter_mut().enumerate() {
        let must = n - i == count - 1 - stage;
        let share_done = acc as u128 * count as u128 >= total as u128 * (stage as u128 + 1);
        if i > 0 && stage + 1 < count && (must || share_done) {
            stage += 1;
        }
        g.1 = stage;
        acc = acc.saturating_add(g.2);
    }
    let last = count - 1;
    let stage_of = |layer: &str| {
        let g = group_of(layer);
        groups.iter().find(|x| x.0 == g).map_or(last, |x| x.1)
    };
    // A fused kernel may span two layers (a GEMM and the next layer's activation): it runs
    // where the parameters it reads live, else where its first op's layer does.
    let kernel_stage = plan
        .kernels
        .iter()
        .map(|k| {
            let param = k.steps.iter().find_map(|&s| {
                plan.steps[s].operands.iter().find_map(|&o| {
                    let src = &plan.steps[o];
                    matches!(src.op, Op::Param { .. }).then(|| stage_of(&src.layer))
                })
            });
            param.unwrap_or_else(|| stage_of(&plan.steps[k.steps[0]].layer))
        })
        .collect();
    Ok(Stages {
        count,
        groups,
        kernel_stage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups() {
        assert_eq!(group_of("h.3.att.q"), "h.3");
        assert_eq!(group_of("h.3"), "h.3");
        assert_eq!(group_of("2"), "2");
        assert_eq!(group_of("0.1"), "0");
        assert_eq!(group_of("logits"), "logits");
        assert_eq!(group_of("emb.pos"), "emb");
    }
}
