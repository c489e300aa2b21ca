//! ZeRO (only when the optimizer state is sharded over data-parallel ranks): each parameter
//! belongs to one rank (largest first to the least loaded, so the state splits evenly). That
//! rank alone holds the parameter's optimizer state and computes its update, then broadcasts
//! the new value to the others (ZeRO-1). With stage 2 the rank also alone receives the
//! parameter's reduced gradient: the gradient's all-reduce becomes a reduce to that rank
//! (together, a reduce-scatter), and what every rank needs from it (its squared norm, for
//! clipping) is computed there and broadcast. Ownership flows forward from the states (and
//! the reduced gradients): an op of the update whose operands belong to one rank belongs to
//! it; one that reads several ranks' values runs everywhere, each such value broadcast first.
//! With stage 3 the parameter itself lives only there, broadcast to the others before the
//! forward and again before the backward ops that read it (the by-tensor form of FSDP's
//! all-gather). Every value is computed by the same ops from the same inputs as without
//! sharding, so the bits do not change.

use super::Ctx;
use crate::diag::Diagnostic;
use crate::ir::{Graph, Group, NodeIndex, Op, Phase};
use crate::Error;
use std::collections::HashMap;

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    let Some(ranks) = ctx.options.optimizer_shards.filter(|&n| n > 1) else {
        return Ok(());
    };
    let fail = |m: String| Error::Model(Diagnostic::new(format!("ZeRO: {m}"), None));
    let numel = |g: &Graph, n: NodeIndex| -> u128 {
        g.g[n].ty.shape.iter().map(|d| d.factor as u128).product()
    };
    let mut params = g.params();
    params.sort_by_key(|&p| (std::cmp::Reverse(numel(g, p)), p));
    let mut load = vec![0u128; ranks as usize];
    let mut param_owner: HashMap<NodeIndex, u32> = HashMap::new();
    for p in params {
        let r = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[r] += numel(g, p);
        param_owner.insert(p, r as u32);
    }
    let names: Vec<(String, u32)> = param_owner
        .iter()
        .filter_map(|(&p, &r)| match &g.g[p].op {
            Op::Param { name, .. } => Some((name.clone(), r)),
            _ => None,
        })
        .collect();
    // Seeds: each state with its parameter's rank; with stage 2, each reduced gradient.
    let mut owner: HashMap<NodeIndex, u32> = HashMap::new();
    for n in g.g.node_indices() {
        if let Op::State { name, .. } = &g.g[n].op {
            let of = names
                .iter()
                .filter(|(p, _)| {
                    name.strip_prefix(p.as_str())
                        .is_some_and(|r| r.starts_with('.'))
                })
                .max_by_key(|(p, _)| p.len());
            if let Some((_, r)) = of {
                owner.insert(n, *r);
            }
        }
    }
    if ctx.options.zero_stage >= 2 {
        for i in 0..g.grads.len() {
            let (p, total) = g.grads[i];
            let root = param_owner[&p];
            if matches!(
                g.g[total].op,
                Op::AllReduce {
                    group: Group::Shards
                }
            ) {
                g.g[total].op = Op::Reduce { root };
                owner.insert(total, root);
            }
        }
    }
    // Stage 3: a parameter lives only on its rank, and each phase that reads it (forward,
    // backward) gets it by broadcast just before, so other ranks hold it only while in use.
    if ctx.options.zero_stage >= 3 {
        let saved = g.phase;
        for p in g.params() {
            let root = param_owner[&p];
            owner.insert(p, root);
            let mut copies: HashMap<Phase, NodeIndex> = HashMap::new();
            for user in g.users(p) {
                let phase = g.g[user].phase;
                if phase == Phase::Update {
                    continue;
                }
                let b = match copies.get(&phase) {
                    Some(&b) => b,
                    None => {
                        g.phase = phase;
                        let layer = g.g[p].layer.clone();
                        let b = g
                            .add(Op::Broadcast { root }, &[p], &layer, None)
                            .map_err(fail)?;
                        copies.insert(phase, b);
                        b
                    }
                };
                for (i, o) in g.operands(user).into_iter().enumerate() {
                    if o == p {
                        g.replace_operand(user, i, b);
                    }
                }
            }
        }
        g.phase = saved;
    }
    // Forward through the update: one owner among the operands makes it the op's owner.
    let order = g.topo_order().unwrap_or_default();
    let mut crossing: Vec<(NodeIndex, usize, NodeIndex, u32)> = Vec::new();
    for &v in &order {
        if g.g[v].phase != Phase::Update || g.g[v].op.is_source() || owner.contains_key(&v) {
            continue;
        }
        let operands = g.operands(v);
        let mut ranks_read: Vec<u32> = operands
            .iter()
            .filter_map(|o| owner.get(o).copied())
            .collect();
        ranks_read.sort_unstable();
        ranks_read.dedup();
        match ranks_read.as_slice() {
            [] => {}
            [r] => {
                owner.insert(v, *r);
            }
            _ => {
                for (i, &o) in operands.iter().enumerate() {
                    if let Some(&r) = owner.get(&o) {
                        crossing.push((v, i, o, r));
                    }
                }
            }
        }
    }
    // Values a shared op reads from one rank arrive by broadcast (one per value).
    let mut sent: HashMap<NodeIndex, NodeIndex> = HashMap::new();
    let saved = std::mem::replace(&mut g.phase, Phase::Update);
    for (v, i, o, root) in crossing {
        let b = match sent.get(&o) {
            Some(&b) => b,
            None => {
                let layer = g.g[o].layer.clone();
                let b = g
                    .add(Op::Broadcast { root }, &[o], &layer, None)
                    .map_err(fail)?;
                sent.insert(o, b);
                b
            }
        };
        g.replace_operand(v, i, b);
    }
    // Below stage 3 every rank holds every parameter: an update computed on one rank is
    // broadcast.
    for i in 0..g.updates.len() {
        let (p, u) = g.updates[i];
        let Some(&root) = owner.get(&u) else { continue };
        if !matches!(g.g[p].op, Op::Param { .. }) || ctx.options.zero_stage >= 3 {
            continue;
        }
        let layer = g.g[p].layer.clone();
        let b = g
            .add(Op::Broadcast { root }, &[u], &layer, None)
            .map_err(fail)?;
        g.updates[i].1 = b;
    }
    g.phase = saved;
    g.owners = owner;
    Ok(())
}
