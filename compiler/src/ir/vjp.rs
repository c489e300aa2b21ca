//! The VJP rules of the op table: each adds the ops that compute its operands' gradients
//! from its output's gradient `dy`. `passes::autodiff` walks the graph backwards and calls
//! them; no layer has a hand-written backward. Each takes its op's attributes (`attrs`),
//! binding the ones it reads, ahead of the graph.

use super::attrs::{self, Attrs};
use super::op::{AttentionInput, Group, Op};
use super::types::TensorType;
use petgraph::stable_graph::NodeIndex;

/// The graph a rule reads and adds its ops to (`passes::autodiff` implements it over the
/// `Graph`, in the layer the forward op came from).
pub trait Vjp {
    /// Adds `op` of `ins` in the backward phase.
    fn add(&mut self, op: Op, ins: &[NodeIndex]) -> Result<NodeIndex, String>;
    /// Adds `op` of `ins` in the forward phase: a statistic the forward kernel computes.
    fn add_forward(&mut self, op: Op, ins: &[NodeIndex]) -> Result<NodeIndex, String>;
    fn ty(&self, n: NodeIndex) -> TensorType;
    /// The op of node `n` (the table's row takes the forward op's attributes from it).
    fn op(&self, n: NodeIndex) -> Op;
    /// `d` summed down to the shape of `like` where the forward op broadcast it.
    fn unbroadcast(&mut self, d: NodeIndex, like: NodeIndex) -> Result<NodeIndex, String> {
        let shape = self.ty(like).shape;
        if self.ty(d).shape == shape {
            Ok(d)
        } else {
            self.add(Op::SumTo { shape }, &[d])
        }
    }
}

/// One gradient per operand (`None` where an operand has none, as integer labels).
pub type Grads = Result<Vec<Option<NodeIndex>>, String>;

/// A row's VJP: `(context, the forward node, its operands, the gradient of its output)` to
/// the operands' gradients, by the entry's rule (which takes the op's attributes first).
pub type VjpRule = fn(&mut dyn Vjp, NodeIndex, &[NodeIndex], NodeIndex) -> Grads;

pub fn source(
    _: impl Attrs,
    _: &mut dyn Vjp,
    _: NodeIndex,
    _: &[NodeIndex],
    _: NodeIndex,
) -> Grads {
    Ok(Vec::new())
}

/// Ops that appear only in backward or update graphs; differentiating them is a bug.
pub fn none<A: Attrs>(_: A, _: &mut dyn Vjp, _: NodeIndex, _: &[NodeIndex], _: NodeIndex) -> Grads {
    Err(format!("`{}` has no gradient rule", A::NAME))
}

pub fn identity(
    _: impl Attrs,
    _: &mut dyn Vjp,
    _: NodeIndex,
    _: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(dy)])
}

/// Over shards, the objective is the sum of every shard's loss and each shard reads the
/// reduced value: a shard's operand gets the sum of every shard's cotangent. Over tensor
/// ranks, every rank computes the same loss once: the cotangent passes through.
pub fn all_reduce(
    attrs::AllReduce { group }: attrs::AllReduce,
    v: &mut dyn Vjp,
    _: NodeIndex,
    _: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    match group {
        Group::Shards => Ok(vec![Some(v.add(
            Op::AllReduce {
                group: Group::Shards,
            },
            &[dy],
        )?)]),
        Group::Tensor => Ok(vec![Some(dy)]),
    }
}

/// Every tensor rank's branch reads the copy: the gradient sums their cotangents.
pub fn tensor_parallel_copy(
    _: attrs::TensorParallelCopy,
    v: &mut dyn Vjp,
    _: NodeIndex,
    _: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(
        Op::AllReduce {
            group: Group::Tensor,
        },
        &[dy],
    )?)])
}

pub fn matmul(
    attrs::MatMul {
        trans_a: &trans_a,
        trans_b: &trans_b,
    }: attrs::MatMul,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    if trans_a {
        return Err("no gradient rule for a matmul with a transposed left operand".into());
    }
    let (a, b) = (ins[0], ins[1]);
    let (ta, tb) = (v.ty(a), v.ty(b));
    // dA = dY op(B)^T
    let da = v.add(
        Op::MatMul {
            trans_a: false,
            trans_b: !trans_b,
        },
        &[dy, b],
    )?;
    // A shared 2-D B sums its gradient over every batch of A: fold those into the rows.
    let (a2, dy2) = if tb.rank() == 2 && ta.rank() > 2 {
        let rows = super::dim::product(&ta.shape[..ta.rank() - 1]).ok_or("size overflow")?;
        let tdy = v.ty(dy);
        let a2 = v.add(
            Op::Reshape {
                shape: vec![rows.clone(), ta.shape[ta.rank() - 1].clone()],
            },
            &[a],
        )?;
        let dy2 = v.add(
            Op::Reshape {
                shape: vec![rows, tdy.shape[tdy.rank() - 1].clone()],
            },
            &[dy],
        )?;
        (a2, dy2)
    } else {
        (a, dy)
    };
    let t = Op::MatMul {
        trans_a: true,
        trans_b: false,
    };
    // dB = A^T dY, or (dY^T A) when B was used transposed.
    let db = if trans_b {
        v.add(t, &[dy2, a2])?
    } else {
        v.add(t, &[a2, dy2])?
    };
    Ok(vec![Some(da), Some(db)])
}

pub fn conv2d(
    attrs::Conv2d {
        stride: &stride,
        padding: &padding,
        groups: &groups,
    }: attrs::Conv2d,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let (x, w) = (ins[0], ins[1]);
    let (tx, tw) = (v.ty(x), v.ty(w));
    let known = |d: &super::dim::Dim| d.as_known().ok_or("a symbolic image size");
    let dx = v.add(
        Op::Conv2dGradInput {
            stride,
            padding,
            groups,
            in_h: known(&tx.shape[2])?,
            in_w: known(&tx.shape[3])?,
        },
        &[dy, w],
    )?;
    let dw = v.add(
        Op::Conv2dGradWeight {
            stride,
            padding,
            groups,
            kernel: known(&tw.shape[2])?,
        },
        &[x, dy],
    )?;
    Ok(vec![Some(dx), Some(dw)])
}

pub fn pool2d(
    attrs::Pool2d {
        max: &max,
        kernel: &kernel,
        stride: &stride,
        padding: &padding,
    }: attrs::Pool2d,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let d = v.add(
        Op::Pool2dGrad {
            max,
            kernel,
            stride,
            padding,
        },
        &[ins[0], dy],
    )?;
    Ok(vec![Some(d)])
}

pub fn reshape(
    _: attrs::Reshape,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let shape = v.ty(ins[0]).shape;
    Ok(vec![Some(v.add(Op::Reshape { shape }, &[dy])?)])
}

pub fn permute(
    attrs::Permute { perm }: attrs::Permute,
    v: &mut dyn Vjp,
    _: NodeIndex,
    _: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let mut inverse = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inverse[p] = i;
    }
    Ok(vec![Some(v.add(Op::Permute { perm: inverse }, &[dy])?)])
}

pub fn concat(
    attrs::Concat { axis: &axis }: attrs::Concat,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let (la, lb) = (
        v.ty(ins[0]).shape[axis].clone(),
        v.ty(ins[1]).shape[axis].clone(),
    );
    let start_b = la.as_known().ok_or("a symbolic concatenation")?;
    let da = v.add(
        Op::Slice {
            axis,
            start: 0,
            len: la,
        },
        &[dy],
    )?;
    let db = v.add(
        Op::Slice {
            axis,
            start: start_b,
            len: lb,
        },
        &[dy],
    )?;
    Ok(vec![Some(da), Some(db)])
}

pub fn slice(
    attrs::Slice {
        axis: &axis,
        start: &start,
        ..
    }: attrs::Slice,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let size = v.ty(ins[0]).shape[axis].clone();
    Ok(vec![Some(v.add(Op::Pad { axis, start, size }, &[dy])?)])
}

pub fn pad(
    attrs::Pad {
        axis: &axis,
        start: &start,
        ..
    }: attrs::Pad,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let len = v.ty(ins[0]).shape[axis].clone();
    Ok(vec![Some(v.add(Op::Slice { axis, start, len }, &[dy])?)])
}

pub fn gather(
    _: attrs::Gather,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let rows = v.ty(ins[0]).shape[0].as_known().ok_or("a symbolic table")?;
    let d = v.add(Op::ScatterAdd { rows }, &[ins[1], dy])?;
    Ok(vec![Some(d), None])
}

pub fn add(
    _: attrs::Add,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let da = v.unbroadcast(dy, ins[0])?;
    let db = v.unbroadcast(dy, ins[1])?;
    Ok(vec![Some(da), Some(db)])
}

pub fn sub(
    _: attrs::Sub,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let da = v.unbroadcast(dy, ins[0])?;
    let neg = v.add(Op::Scale { by: -1.0 }, &[dy])?;
    let db = v.unbroadcast(neg, ins[1])?;
    Ok(vec![Some(da), Some(db)])
}

pub fn mul(
    _: attrs::Mul,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let (a, b) = (ins[0], ins[1]);
    let da = v.add(Op::Mul, &[dy, b])?;
    let da = v.unbroadcast(da, a)?;
    let db = v.add(Op::Mul, &[dy, a])?;
    let db = v.unbroadcast(db, b)?;
    Ok(vec![Some(da), Some(db)])
}

/// `y = a / b`: `da = dy / b`, `db = -(dy / b) * y`.
pub fn div(
    _: attrs::Div,
    v: &mut dyn Vjp,
    n: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let (a, b) = (ins[0], ins[1]);
    let q = v.add(Op::Div, &[dy, b])?;
    let da = v.unbroadcast(q, a)?;
    let qy = v.add(Op::Mul, &[q, n])?;
    let db = v.add(Op::Scale { by: -1.0 }, &[qy])?;
    let db = v.unbroadcast(db, b)?;
    Ok(vec![Some(da), Some(db)])
}

/// `y = sqrt(x)`: `dx = 0.5 * dy / y`.
pub fn sqrt(
    _: attrs::Sqrt,
    v: &mut dyn Vjp,
    n: NodeIndex,
    _: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let half = v.add(Op::Scale { by: 0.5 }, &[dy])?;
    Ok(vec![Some(v.add(Op::Div, &[half, n])?)])
}

pub fn scale(
    attrs::Scale { by: &by }: attrs::Scale,
    v: &mut dyn Vjp,
    _: NodeIndex,
    _: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::Scale { by }, &[dy])?)])
}

pub fn relu(
    _: attrs::Relu,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::ReluGrad, &[ins[0], dy])?)])
}

pub fn relu6(
    _: attrs::Relu6,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::Relu6Grad, &[ins[0], dy])?)])
}

pub fn gelu(
    _: attrs::Gelu,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::GeluGrad, &[ins[0], dy])?)])
}

/// From the output `y`, which the forward pass keeps anyway.
pub fn tanh(
    _: attrs::Tanh,
    v: &mut dyn Vjp,
    n: NodeIndex,
    _: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::TanhGrad, &[n, dy])?)])
}

pub fn sigmoid(
    _: attrs::Sigmoid,
    v: &mut dyn Vjp,
    n: NodeIndex,
    _: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::SigmoidGrad, &[n, dy])?)])
}

pub fn silu(
    _: attrs::Silu,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::SiluGrad, &[ins[0], dy])?)])
}

/// The same keyed mask applied to the gradient.
pub fn dropout(
    attrs::Dropout {
        p: &p,
        stream: &stream,
    }: attrs::Dropout,
    v: &mut dyn Vjp,
    _: NodeIndex,
    _: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::Dropout { p, stream }, &[dy])?)])
}

pub fn softmax(
    _: attrs::Softmax,
    v: &mut dyn Vjp,
    n: NodeIndex,
    _: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::SoftmaxGrad, &[n, dy])?)])
}

/// Attention's gradients from its saved statistics: the row log-sum-exp (computed by the
/// forward kernel, so added in the forward phase) and `delta = rowsum(dy * y)`; each operand's
/// gradient recomputes the probabilities tile by tile instead of reading stored scores.
pub fn attention(
    attrs::Attention {
        causal: &causal,
        scale: &scale,
    }: attrs::Attention,
    v: &mut dyn Vjp,
    n: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let lse = v.add_forward(Op::AttentionLse { causal, scale }, &[ins[0], ins[1]])?;
    let dy_y = v.add(Op::Mul, &[dy, n])?;
    let last = v.ty(n).rank() - 1;
    let delta = v.add(Op::ReduceSum { axes: vec![last] }, &[dy_y])?;
    [
        AttentionInput::Query,
        AttentionInput::Key,
        AttentionInput::Value,
    ]
    .into_iter()
    .map(|wrt| {
        let op = Op::AttentionGrad { causal, scale, wrt };
        v.add(op, &[ins[0], ins[1], ins[2], dy, lse, delta])
            .map(Some)
    })
    .collect()
}

pub fn layer_norm(
    attrs::LayerNorm { eps: &eps }: attrs::LayerNorm,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::LayerNormGrad { eps }, &[ins[0], dy])?)])
}

pub fn rms_norm(
    attrs::RmsNorm { eps: &eps }: attrs::RmsNorm,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    Ok(vec![Some(v.add(Op::RmsNormGrad { eps }, &[ins[0], dy])?)])
}

pub fn reduce_sum(
    attrs::ReduceSum { axes }: attrs::ReduceSum,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    expand(axes, false, v, ins[0], dy)
}

pub fn reduce_mean(
    attrs::ReduceMean { axes }: attrs::ReduceMean,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    expand(axes, true, v, ins[0], dy)
}

/// `dy` repeated along `axes` back to the shape of `x` (divided by the count if `mean`).
fn expand(axes: &[usize], mean: bool, v: &mut dyn Vjp, x: NodeIndex, dy: NodeIndex) -> Grads {
    let shape = v.ty(x).shape;
    let axes = axes.to_vec();
    Ok(vec![Some(v.add(Op::Expand { axes, shape, mean }, &[dy])?)])
}

pub fn cross_entropy(
    attrs::CrossEntropy {
        smoothing: &smoothing,
    }: attrs::CrossEntropy,
    v: &mut dyn Vjp,
    _: NodeIndex,
    ins: &[NodeIndex],
    dy: NodeIndex,
) -> Grads {
    let d = v.add(Op::CrossEntropyGrad { smoothing }, &[ins[0], ins[1], dy])?;
    Ok(vec![Some(d), None])
}
