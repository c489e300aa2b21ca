//! Sharding for data parallelism (only when the plan is built per micro-shard, see
//! `crate::shards`): BatchNorm becomes its synchronised form, whose statistics are sums over
//! every shard (all-reduces), divided by the whole batch's sample count; the loss a shard
//! differentiates is its share of the batch mean (its loss times its fraction of the
//! samples), and the `loss` output is the sum of those shares over every shard.

use super::Ctx;
use crate::diag::Diagnostic;
use crate::ir::{DType, Dim, Graph, Group, NodeIndex, Op, TensorType};

const SHARDS: Op = Op::AllReduce {
    group: Group::Shards,
};
use crate::shards::{INV_BATCH, SHARD_WEIGHT};
use crate::Error;

struct Builder<'g> {
    g: &'g mut Graph,
    layer: String,
}

impl Builder<'_> {
    fn op(&mut self, op: Op, ins: &[NodeIndex]) -> Result<NodeIndex, Error> {
        let layer = self.layer.clone();
        self.g
            .add(op, ins, &layer, None)
            .map_err(|m| Error::Model(Diagnostic::new(format!("sharding `{layer}`: {m}"), None)))
    }
    fn scalar_input(&mut self, name: &str) -> Result<NodeIndex, Error> {
        if let Some(&n) = self
            .g
            .inputs
            .iter()
            .find(|&&n| matches!(&self.g.g[n].op, Op::Input { name: k, .. } if k == name))
        {
            return Ok(n);
        }
        let ty = TensorType::scalar(DType::F32);
        let name = name.to_string();
        self.op(Op::Input { name, ty }, &[])
    }
}

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    if ctx.options.shards.is_none() {
        return Ok(());
    }
    let norms: Vec<NodeIndex> =
        g.g.node_indices()
            .filter(|&n| matches!(g.g[n].op, Op::BatchNorm { .. }))
            .collect();
    for n in norms {
        synchronised_batch_norm(g, n)?;
    }
    let Some(at) = g.outputs.iter().position(|(k, _)| k == "loss") else {
        return Ok(());
    };
    let loss = g.outputs[at].1;
    let layer = g.g[loss].layer.clone();
    let mut b = Builder { g, layer };
    let weight = b.scalar_input(SHARD_WEIGHT)?;
    let share = b.op(Op::Mul, &[loss, weight])?;
    let total = b.op(SHARDS, &[share])?;
    g.outputs[at].1 = total;
    g.objective = Some(share);
    Ok(())
}

/// `x [B, C, H, W]`: mean and variance per channel over every shard's samples, two
/// all-reduces (the sum, then the centred squares), then `(x - mean) / sqrt(var + eps)`.
fn synchronised_batch_norm(g: &mut Graph, n: NodeIndex) -> Result<(), Error> {
    let Op::BatchNorm { eps } = g.g[n].op else {
        unreachable!("called on BatchNorm nodes")
    };
    let x = g.operands(n)[0];
    let shape = g.g[x].ty.shape.clone();
    let internal = |m: &str| Error::Model(Diagnostic::new(m.to_string(), None));
    let (Some(c), Some(h), Some(w)) = (
        shape.get(1).and_then(Dim::as_known),
        shape.get(2).and_then(Dim::as_known),
        shape.get(3).and_then(Dim::as_known),
    ) else {
        return Err(internal("synchronised BatchNorm needs known [C, H, W]"));
    };
    let per_sample = 1.0 / (h * w) as f64;
    let layer = g.g[n].layer.clone();
    let mut b = Builder { g, layer };
    let inv_batch = b.scalar_input(INV_BATCH)?;
    let channels = vec![Dim::known(1), Dim::known(c), Dim::known(1), Dim::known(1)];
    let axes = vec![0, 2, 3];
    // mean = sum over all shards / (samples * H * W)
    let sum = b.op(Op::ReduceSum { axes: axes.clone() }, &[x])?;
    let sum = b.op(SHARDS, &[sum])?;
    let mean = b.op(Op::Mul, &[sum, inv_batch])?;
    let mean = b.op(Op::Scale { by: per_sample }, &[mean])?;
    let mean = b.op(
        Op::Reshape {
            shape: channels.clone(),
        },
        &[mean],
    )?;
    let centred = b.op(Op::Sub, &[x, mean])?;
    let square = b.op(Op::Mul, &[centred, centred])?;
    let var = b.op(Op::ReduceSum { axes }, &[square])?;
    let var = b.op(SHARDS, &[var])?;
    let var = b.op(Op::Mul, &[var, inv_batch])?;
    let var = b.op(Op::Scale { by: per_sample }, &[var])?;
    let var = b.op(Op::AddScalar { value: eps }, &[var])?;
    let std = b.op(Op::Sqrt, &[var])?;
    let one = b.op(
        Op::Fill {
            value: 1.0,
            ty: TensorType::scalar(DType::F32),
        },
        &[],
    )?;
    let inv_std = b.op(Op::Div, &[one, std])?;
    let inv_std = b.op(Op::Reshape { shape: channels }, &[inv_std])?;
    let y = b.op(Op::Mul, &[centred, inv_std])?;
    g.replace_uses(n, y);
    g.g.remove_node(n);
    Ok(())
}
