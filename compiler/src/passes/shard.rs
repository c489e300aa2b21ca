//! Sharding for data parallelism (only when the plan is built per micro-shard, see
//! `crate::shards`; lowering already synchronised BatchNorm's statistics): the loss a shard
//! differentiates is its share of the batch mean (its loss times its fraction of the
//! samples), and the `loss` output is the sum of those shares over every shard.

use super::Ctx;
use crate::diag::Diagnostic;
use crate::ir::{Graph, Group, Op};
use crate::shards::SHARD_WEIGHT;
use crate::Error;

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    if ctx.options.shards.is_none() {
        return Ok(());
    }
    let Some(at) = g.outputs.iter().position(|(k, _)| k == crate::plan::LOSS) else {
        return Ok(());
    };
    let loss = g.outputs[at].1;
    let layer = g.g[loss].layer.clone();
    let fail = |m: String| Error::Model(Diagnostic::new(format!("sharding `{layer}`: {m}"), None));
    let weight = g.scalar_input(SHARD_WEIGHT, &layer).map_err(fail)?;
    let share = g
        .add(Op::Mul, &[loss, weight], &layer, None)
        .map_err(fail)?;
    let all = Op::AllReduce {
        group: Group::Shards,
    };
    let total = g.add(all, &[share], &layer, None).map_err(fail)?;
    g.outputs[at].1 = total;
    g.objective = Some(share);
    Ok(())
}
