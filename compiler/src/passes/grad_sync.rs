//! Gradient synchronisation (sharded plans only): each parameter's gradient becomes the sum
//! over every micro-shard, an all-reduce the optimizer reads. Gradients are all-reduced in
//! buckets of about `devices.gradient_bucket_mb` (as PyTorch's DDP does): in the order they
//! become ready, flattened and joined into one buffer, reduced at once, then cut back. The
//! schedule runs each bucket's all-reduce as soon as its last gradient exists
//! (`Graph::topo_order`), so communication overlaps the rest of the backward pass. Summing a
//! joined buffer adds each element exactly as summing it alone does: buckets never change
//! the bits. Under ZeRO-2 each gradient goes alone (it becomes a reduce to its own rank).

use super::Ctx;
use crate::diag::Diagnostic;
use crate::ir::{Dim, Graph, Group, NodeIndex, Op};
use crate::Error;
use std::collections::HashMap;

const SHARDS: Op = Op::AllReduce {
    group: Group::Shards,
};

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    if ctx.options.shards.is_none() {
        return Ok(());
    }
    let fail = |m: String| Error::Model(Diagnostic::new(format!("gradient sync: {m}"), None));
    let alone = ctx.options.optimizer_shards.is_some_and(|n| n > 1) && ctx.options.zero_stage >= 2;
    let cap = (ctx.source.experiment.devices.gradient_bucket_mb * 1024.0 * 1024.0) as u64;
    let numel =
        |g: &Graph, n: NodeIndex| -> u64 { g.g[n].ty.shape.iter().map(|d| d.factor).product() };
    // Ready order: where each gradient sits in the schedule.
    let pos: HashMap<NodeIndex, usize> = g
        .topo_order()
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, n)| (n, i))
        .collect();
    let mut ready: Vec<usize> = (0..g.grads.len()).collect();
    ready.sort_by_key(|&i| pos.get(&g.grads[i].1).copied().unwrap_or(usize::MAX));
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut filled = u64::MAX;
    for i in ready {
        let bytes = 4 * numel(g, g.grads[i].1);
        if alone || filled.saturating_add(bytes) > cap || buckets.is_empty() {
            buckets.push(Vec::new());
            filled = 0;
        }
        buckets.last_mut().expect("a bucket").push(i);
        filled += bytes;
    }
    for bucket in buckets {
        let first = g.grads[bucket[0]].1;
        let layer = g.g[first].layer.clone();
        if let [i] = bucket[..] {
            let total = g.add(SHARDS, &[first], &layer, None).map_err(fail)?;
            g.grads[i].1 = total;
            continue;
        }
        let mut joined: Option<NodeIndex> = None;
        for &i in &bucket {
            let grad = g.grads[i].1;
            let flat = Op::Reshape {
                shape: vec![Dim::known(numel(g, grad))],
            };
            let flat = g.add(flat, &[grad], &layer, None).map_err(fail)?;
            joined = Some(match joined {
                None => flat,
                Some(j) => g
                    .add(Op::Concat { axis: 0 }, &[j, flat], &layer, None)
                    .map_err(fail)?,
            });
        }
        let total = g
            .add(
                SHARDS,
                &[joined.expect("a bucket has gradients")],
                &layer,
                None,
            )
            .map_err(fail)?;
        let mut start = 0;
        for &i in &bucket {
            let grad = g.grads[i].1;
            let n = numel(g, grad);
            let cut = Op::Slice {
                axis: 0,
                start,
                len: Dim::known(n),
            };
            let part = g.add(cut, &[total], &layer, None).map_err(fail)?;
            let shape = g.g[grad].ty.shape.clone();
            g.grads[i].1 = g
                .add(Op::Reshape { shape }, &[part], &layer, None)
                .map_err(fail)?;
            start += n;
        }
    }
    Ok(())
}
