//! Gradient synchronisation (sharded plans only): each parameter's gradient becomes the sum
//! over every micro-shard, an all-reduce the optimizer reads. The schedule runs each one as
//! soon as its gradient exists (`Graph::topo_order`), so communication starts while the rest
//! of the backward pass still runs.

use super::Ctx;
use crate::diag::Diagnostic;
use crate::ir::{Graph, Group, Op};

const SHARDS: Op = Op::AllReduce {
    group: Group::Shards,
};
use crate::Error;

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    if ctx.options.shards.is_none() {
        return Ok(());
    }
    for i in 0..g.grads.len() {
        let grad = g.grads[i].1;
        let layer = g.g[grad].layer.clone();
        let total = g
            .add(SHARDS, &[grad], &layer, None)
            .map_err(|m| Error::Model(Diagnostic::new(format!("gradient sync: {m}"), None)))?;
        g.grads[i].1 = total;
    }
    Ok(())
}
