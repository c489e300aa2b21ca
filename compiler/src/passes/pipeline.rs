//! Pipeline stages (only when the plan is built for several): the model's top-level layers (a
//! repeated block's instances each count as one, `h.3`) in forward order are cut into
//! contiguous stages of about equal forward FLOPs. Every op runs on the stage of its layer
//! (backward and update ops with their layer; the loss and the optimizer's global ops, such as
//! clipping, on the last); a parameter lives where its layer does. Each value a stage reads
//! from another arrives through a `transfer` op (a send and its receive), so the schedule
//! orders the communication with everything else.

use super::Ctx;
use crate::diag::Diagnostic;
use crate::ir::{Graph, NodeIndex, Op, OpKind, Phase};
use crate::Error;
use std::collections::HashMap;

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

/// Each top-level layer in forward order with its forward FLOPs at `batch`.
pub fn layer_groups(g: &Graph, batch: u64) -> Vec<(String, u64)> {
    let mut groups: Vec<(String, u64)> = Vec::new();
    for n in g.topo_order().unwrap_or_default() {
        let node = &g.g[n];
        if node.phase != Phase::Forward || node.op.is_source() || node.layer.is_empty() {
            continue;
        }
        let flops = g.node_flops(n, batch);
        let group = group_of(&node.layer);
        match groups.iter_mut().find(|x| x.0 == group) {
            Some(x) => x.1 = x.1.saturating_add(flops),
            None => groups.push((group.to_string(), flops)),
        }
    }
    groups
}

/// The stage of each group: cut where the running total passes each stage's share, leaving a
/// group for every stage still to come.
pub fn cut(groups: &[(String, u64)], stages: usize) -> Vec<usize> {
    let total: u128 = groups.iter().map(|g| g.1 as u128).sum::<u128>().max(1);
    let n = groups.len();
    let (mut stage, mut acc) = (0usize, 0u128);
    let mut out = Vec::with_capacity(n);
    for (i, g) in groups.iter().enumerate() {
        let must = n - i == stages - 1 - stage;
        let share_done = acc * stages as u128 >= total * (stage as u128 + 1);
        if i > 0 && stage + 1 < stages && (must || share_done) {
            stage += 1;
        }
        out.push(stage);
        acc += g.1 as u128;
    }
    out
}

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    let stages = ctx.options.pipeline_stages.unwrap_or(1).max(1) as usize;
    if stages == 1 {
        return Ok(());
    }
    let fail = |m: String| Error::Model(Diagnostic::new(m, None));
    let groups = layer_groups(g, ctx.options.plan_batch(ctx.source));
    if groups.len() < stages {
        return Err(fail(format!(
            "{stages} pipeline stages need at least {stages} layers, but the model has {}",
            groups.len()
        )));
    }
    let group_stage: HashMap<&str, u32> = groups
        .iter()
        .zip(cut(&groups, stages))
        .map(|(g, s)| (g.0.as_str(), s as u32))
        .collect();
    let last = stages as u32 - 1;
    let order = g.topo_order().unwrap_or_default();
    let mut stage: HashMap<NodeIndex, u32> = HashMap::new();
    for &n in &order {
        if !g.g[n].op.is_source() {
            let s = group_stage.get(group_of(&g.g[n].layer)).copied();
            stage.insert(n, s.unwrap_or(last));
        }
    }
    // A source lives with its readers; a parameter or state read on two stages (tied
    // weights) cannot be placed.
    for &n in &order {
        if !g.g[n].op.is_source() {
            continue;
        }
        let readers: Vec<u32> = g
            .users(n)
            .iter()
            .filter_map(|u| stage.get(u).copied())
            .collect();
        let persistent = matches!(g.g[n].op.kind(), OpKind::Param | OpKind::State);
        if persistent && readers.windows(2).any(|w| w[0] != w[1]) {
            return Err(fail(format!(
                "`{}` is read on pipeline stages {} and {}: a tensor shared across stages (tied weights) cannot be split yet",
                g.g[n].layer,
                readers.iter().min().unwrap_or(&0),
                readers.iter().max().unwrap_or(&0)
            )));
        }
        stage.insert(n, readers.first().copied().unwrap_or(0));
    }
    // Every edge between stages goes through one transfer per (value, receiving stage).
    let mut sent: HashMap<(NodeIndex, u32), NodeIndex> = HashMap::new();
    for &v in &order {
        for (i, u) in g.operands(v).into_iter().enumerate() {
            if g.g[u].op.is_source() {
                continue;
            }
            let (from, to) = (stage[&u], stage[&v]);
            if from == to {
                continue;
            }
            let t = match sent.get(&(u, to)) {
                Some(&t) => t,
                None => {
                    let (layer, phase) = (g.g[u].layer.clone(), g.g[u].phase);
                    let saved = std::mem::replace(&mut g.phase, phase);
                    let t = g.add(Op::Transfer { from, to }, &[u], &layer, None);
                    g.phase = saved;
                    let t = t.map_err(fail)?;
                    stage.insert(t, to);
                    sent.insert((u, to), t);
                    t
                }
            };
            g.replace_operand(v, i, t);
        }
    }
    g.stages = Some(stage);
    Ok(())
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

    #[test]
    fn cuts_balance_and_leave_a_group_for_every_stage() {
        let g =
            |v: &[u64]| -> Vec<(String, u64)> { v.iter().map(|&f| (String::new(), f)).collect() };
        assert_eq!(cut(&g(&[1, 1, 1, 1]), 2), vec![0, 0, 1, 1]);
        assert_eq!(cut(&g(&[10, 1, 1, 1]), 2), vec![0, 1, 1, 1]);
        assert_eq!(cut(&g(&[1, 1, 1, 100]), 3), vec![0, 0, 1, 2]);
        assert_eq!(cut(&g(&[0, 0, 0]), 3), vec![0, 1, 2]);
    }
}
