//! ZeRO-1 (only when the optimizer state is sharded over data-parallel ranks): each
//! parameter, with its optimizer state and its update, belongs to one rank (largest first to
//! the least loaded, so the state splits evenly); only that rank holds the state and computes
//! the update, then broadcasts the new value to the others. What every parameter's update
//! shares (the learning rate, the clipping coefficient) stays on every rank. The updates are
//! the same elementwise ops as without sharding, so the bits do not change.

use super::Ctx;
use crate::diag::Diagnostic;
use crate::ir::{Graph, NodeIndex, Op, Phase};
use crate::Error;
use std::collections::HashMap;

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    let Some(ranks) = ctx.options.optimizer_shards.filter(|&n| n > 1) else {
        return Ok(());
    };
    let numel = |g: &Graph, n: NodeIndex| -> u128 {
        g.g[n].ty.shape.iter().map(|d| d.factor as u128).product()
    };
    let mut params = g.params();
    params.sort_by_key(|&p| (std::cmp::Reverse(numel(g, p)), p));
    let mut load = vec![0u128; ranks as usize];
    let mut owner: HashMap<NodeIndex, u32> = HashMap::new();
    for p in params {
        let r = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[r] += numel(g, p);
        owner.insert(p, r as u32);
    }
    let param_names: Vec<(String, NodeIndex)> = owner
        .keys()
        .filter_map(|&p| match &g.g[p].op {
            Op::Param { name, .. } => Some((name.clone(), p)),
            _ => None,
        })
        .collect();
    // The rank of each persistent value: a parameter's own, a state's its parameter's.
    let rank_of = |g: &Graph, n: NodeIndex| -> Option<u32> {
        match &g.g[n].op {
            Op::Param { .. } => owner.get(&n).copied(),
            Op::State { name, .. } => param_names
                .iter()
                .filter(|(p, _)| {
                    name.strip_prefix(p.as_str())
                        .is_some_and(|r| r.starts_with('.'))
                })
                .max_by_key(|(p, _)| p.len())
                .and_then(|(_, p)| owner.get(p).copied()),
            _ => None,
        }
    };
    // Walk each update back through the update phase; what two ranks reach is shared.
    let mut reached: HashMap<NodeIndex, Option<u32>> = HashMap::new();
    for &(p, u) in &g.updates {
        let Some(r) = rank_of(g, p) else { continue };
        let mut stack = vec![u, p];
        while let Some(n) = stack.pop() {
            let node = &g.g[n];
            let walk = node.phase == Phase::Update || matches!(node.op, Op::State { .. });
            if !walk {
                continue;
            }
            let seen = reached.get(&n).copied();
            let now = match seen {
                None => Some(r),
                Some(Some(o)) if o == r => continue,
                Some(_) => None,
            };
            if seen == Some(now) {
                continue;
            }
            reached.insert(n, now);
            stack.extend(g.operands(n));
        }
    }
    let fail = |m: String| Error::Model(Diagnostic::new(format!("ZeRO: {m}"), None));
    for i in 0..g.updates.len() {
        let (p, u) = g.updates[i];
        if !matches!(g.g[p].op, Op::Param { .. }) {
            continue;
        }
        let root = owner[&p];
        let layer = g.g[p].layer.clone();
        let saved = std::mem::replace(&mut g.phase, Phase::Update);
        let b = g.add(Op::Broadcast { root }, &[u], &layer, None);
        g.phase = saved;
        g.updates[i].1 = b.map_err(fail)?;
    }
    g.owners = reached
        .into_iter()
        .filter_map(|(n, r)| r.map(|r| (n, r)))
        .collect();
    Ok(())
}
