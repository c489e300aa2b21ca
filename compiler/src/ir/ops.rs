//! The op table: every primitive op of the IR, declared once.
//!
//! A row gives the op's name, arity, class, shape rule and cost. Later stages add their
//! columns to the same row (VJP, CPU kernel, PTX expression), so adding an op touches this
//! file and a test. Layers (`dsl::ast::Layer`) lower into these ops in `passes::lower`.

use super::dim::{product, Dim};
use super::types::{DType, TensorType};
use serde::Serialize;

/// How a parameter is initialised (recorded, never materialised by the compiler).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Init {
    /// Uniform in `[-bound, bound]`.
    Uniform {
        bound: f64,
    },
    Normal {
        std: f64,
    },
    Zeros,
    Ones,
}

impl Init {
    pub fn show(&self) -> String {
        match self {
            Init::Uniform { bound } => format!("uniform({bound:.6})"),
            Init::Normal { std } => format!("normal({std})"),
            Init::Zeros => "zeros".into(),
            Init::Ones => "ones".into(),
        }
    }
}

/// A primitive op with its attributes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Op {
    /// A graph input (data or labels), fed per step.
    Input {
        name: String,
        ty: TensorType,
    },
    /// A trainable parameter.
    Param {
        name: String,
        ty: TensorType,
        init: Init,
    },
    /// `[.., M, K] x [.., K, N]` (or `[.., N, K]` when `trans_b`); `b` may be 2-D and shared.
    MatMul {
        trans_b: bool,
    },
    /// `x [N, C, H, W]`, `w [O, C/groups, KH, KW]`.
    Conv2d {
        stride: u64,
        padding: u64,
        groups: u64,
    },
    Pool2d {
        max: bool,
        kernel: u64,
        stride: u64,
        padding: u64,
    },
    /// To `shape` (the whole shape, batch included), same element count.
    Reshape {
        shape: Vec<Dim>,
    },
    Permute {
        perm: Vec<usize>,
    },
    Concat {
        axis: usize,
    },
    Slice {
        axis: usize,
        start: u64,
        len: Dim,
    },
    /// Elementwise with numpy broadcasting.
    Add,
    Sub,
    Mul,
    Scale {
        by: f64,
    },
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
    /// Over the last axis; `causal` masks key positions after the query's.
    Softmax {
        causal: bool,
    },
    /// Normalise over the last axis (no affine: that is a Mul and an Add).
    LayerNorm {
        eps: f64,
    },
    RmsNorm {
        eps: f64,
    },
    /// Normalise each channel (axis 1) over the batch and the spatial axes.
    BatchNorm {
        eps: f64,
    },
    ReduceSum {
        axes: Vec<usize>,
    },
    ReduceMean {
        axes: Vec<usize>,
    },
    /// Rows of `table [V, D]` at integer `indices [..]`: `[.., D]`.
    Gather,
    /// Mask keyed by (seed, `stream`, sample index), so it is the same on any device count.
    Dropout {
        p: f64,
        stream: u64,
    },
    /// Mean cross-entropy of `logits [.., C]` against integer `labels [..]`.
    CrossEntropy {
        smoothing: f64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum OpKind {
    Input,
    Param,
    MatMul,
    Conv2d,
    Pool2d,
    Reshape,
    Permute,
    Concat,
    Slice,
    Add,
    Sub,
    Mul,
    Scale,
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
    Softmax,
    LayerNorm,
    RmsNorm,
    BatchNorm,
    ReduceSum,
    ReduceMean,
    Gather,
    Dropout,
    CrossEntropy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Arity {
    Exactly(usize),
}

impl Arity {
    pub fn accepts(self, n: usize) -> bool {
        match self {
            Arity::Exactly(k) => n == k,
        }
    }
}

/// What kind of kernel an op becomes; the fuse pass groups by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum OpClass {
    Source,
    Gemm,
    Conv,
    Elementwise,
    /// Reduces along an axis (softmax, norms, sums, losses).
    Reduction,
    /// Moves data without arithmetic.
    Layout,
}

/// Infers the output type; `names` names the symbols for messages.
pub type ShapeRule = fn(&Op, &[&TensorType], &[String]) -> Result<TensorType, String>;
/// FLOPs of one execution, from concrete operand and output sizes.
pub type CostRule = fn(&Op, &[Vec<u64>], &[u64]) -> u64;

pub struct OpDef {
    pub kind: OpKind,
    pub name: &'static str,
    pub arity: Arity,
    pub class: OpClass,
    pub shape: ShapeRule,
    pub flops: CostRule,
}

const fn row(
    kind: OpKind,
    name: &'static str,
    arity: usize,
    class: OpClass,
    shape: ShapeRule,
    flops: CostRule,
) -> OpDef {
    OpDef {
        kind,
        name,
        arity: Arity::Exactly(arity),
        class,
        shape,
        flops,
    }
}

use OpClass::*;

/// The table, in `OpKind` order (a test checks it).
pub static OPS: [OpDef; 26] = [
    row(OpKind::Input, "input", 0, Source, declared, free),
    row(OpKind::Param, "param", 0, Source, declared, free),
    row(
        OpKind::MatMul,
        "matmul",
        2,
        Gemm,
        matmul_shape,
        matmul_flops,
    ),
    row(OpKind::Conv2d, "conv2d", 2, Conv, conv_shape, conv_flops),
    row(
        OpKind::Pool2d,
        "pool2d",
        1,
        Reduction,
        pool_shape,
        pool_flops,
    ),
    row(OpKind::Reshape, "reshape", 1, Layout, reshape_shape, free),
    row(OpKind::Permute, "permute", 1, Layout, permute_shape, free),
    row(OpKind::Concat, "concat", 2, Layout, concat_shape, free),
    row(OpKind::Slice, "slice", 1, Layout, slice_shape, free),
    row(
        OpKind::Add,
        "add",
        2,
        Elementwise,
        broadcast_shape,
        per_out::<1>,
    ),
    row(
        OpKind::Sub,
        "sub",
        2,
        Elementwise,
        broadcast_shape,
        per_out::<1>,
    ),
    row(
        OpKind::Mul,
        "mul",
        2,
        Elementwise,
        broadcast_shape,
        per_out::<1>,
    ),
    row(
        OpKind::Scale,
        "scale",
        1,
        Elementwise,
        float_same,
        per_out::<1>,
    ),
    row(
        OpKind::Relu,
        "relu",
        1,
        Elementwise,
        float_same,
        per_out::<1>,
    ),
    row(
        OpKind::Gelu,
        "gelu",
        1,
        Elementwise,
        float_same,
        per_out::<8>,
    ),
    row(
        OpKind::Tanh,
        "tanh",
        1,
        Elementwise,
        float_same,
        per_out::<4>,
    ),
    row(
        OpKind::Sigmoid,
        "sigmoid",
        1,
        Elementwise,
        float_same,
        per_out::<4>,
    ),
    row(
        OpKind::Softmax,
        "softmax",
        1,
        Reduction,
        softmax_shape,
        per_out::<5>,
    ),
    row(
        OpKind::LayerNorm,
        "layer_norm",
        1,
        Reduction,
        float_same,
        per_out::<8>,
    ),
    row(
        OpKind::RmsNorm,
        "rms_norm",
        1,
        Reduction,
        float_same,
        per_out::<5>,
    ),
    row(
        OpKind::BatchNorm,
        "batch_norm",
        1,
        Reduction,
        batchnorm_shape,
        per_out::<8>,
    ),
    row(
        OpKind::ReduceSum,
        "reduce_sum",
        1,
        Reduction,
        reduce_shape,
        per_in::<1>,
    ),
    row(
        OpKind::ReduceMean,
        "reduce_mean",
        1,
        Reduction,
        reduce_shape,
        per_in::<1>,
    ),
    row(OpKind::Gather, "gather", 2, Layout, gather_shape, free),
    row(
        OpKind::Dropout,
        "dropout",
        1,
        Elementwise,
        float_same,
        per_out::<2>,
    ),
    row(
        OpKind::CrossEntropy,
        "cross_entropy",
        2,
        Reduction,
        xent_shape,
        per_in::<5>,
    ),
];

impl Op {
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Input { .. } => OpKind::Input,
            Op::Param { .. } => OpKind::Param,
            Op::MatMul { .. } => OpKind::MatMul,
            Op::Conv2d { .. } => OpKind::Conv2d,
            Op::Pool2d { .. } => OpKind::Pool2d,
            Op::Reshape { .. } => OpKind::Reshape,
            Op::Permute { .. } => OpKind::Permute,
            Op::Concat { .. } => OpKind::Concat,
            Op::Slice { .. } => OpKind::Slice,
            Op::Add => OpKind::Add,
            Op::Sub => OpKind::Sub,
            Op::Mul => OpKind::Mul,
            Op::Scale { .. } => OpKind::Scale,
            Op::Relu => OpKind::Relu,
            Op::Gelu => OpKind::Gelu,
            Op::Tanh => OpKind::Tanh,
            Op::Sigmoid => OpKind::Sigmoid,
            Op::Softmax { .. } => OpKind::Softmax,
            Op::LayerNorm { .. } => OpKind::LayerNorm,
            Op::RmsNorm { .. } => OpKind::RmsNorm,
            Op::BatchNorm { .. } => OpKind::BatchNorm,
            Op::ReduceSum { .. } => OpKind::ReduceSum,
            Op::ReduceMean { .. } => OpKind::ReduceMean,
            Op::Gather => OpKind::Gather,
            Op::Dropout { .. } => OpKind::Dropout,
            Op::CrossEntropy { .. } => OpKind::CrossEntropy,
        }
    }

    pub fn def(&self) -> &'static OpDef {
        &OPS[self.kind() as usize]
    }

    pub fn name(&self) -> &'static str {
        self.def().name
    }

    /// The op's type for these operands, by its table row (arity checked first).
    pub fn infer(&self, operands: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
        let def = self.def();
        if !def.arity.accepts(operands.len()) {
            let Arity::Exactly(k) = def.arity;
            return Err(format!(
                "{} takes {k} operand(s), got {}",
                def.name,
                operands.len()
            ));
        }
        (def.shape)(self, operands, names)
    }

    /// Attributes as stable text, `stride=2, padding=1` (empty when none).
    pub fn attrs(&self, names: &[String]) -> String {
        let dims = |d: &[Dim]| {
            let v: Vec<String> = d.iter().map(|x| x.show(names)).collect();
            format!("[{}]", v.join(", "))
        };
        match self {
            Op::Input { name, .. } => format!("\"{name}\""),
            Op::Param { name, init, .. } => format!("\"{name}\", init={}", init.show()),
            Op::MatMul { trans_b } => {
                if *trans_b {
                    "trans_b".into()
                } else {
                    String::new()
                }
            }
            Op::Conv2d {
                stride,
                padding,
                groups,
            } => format!("stride={stride}, padding={padding}, groups={groups}"),
            Op::Pool2d {
                max,
                kernel,
                stride,
                padding,
            } => format!(
                "{}, kernel={kernel}, stride={stride}, padding={padding}",
                if *max { "max" } else { "avg" }
            ),
            Op::Reshape { shape } => dims(shape),
            Op::Permute { perm } => format!("{perm:?}"),
            Op::Concat { axis } => format!("axis={axis}"),
            Op::Slice { axis, start, len } => {
                format!("axis={axis}, start={start}, len={}", len.show(names))
            }
            Op::Scale { by } => format!("by={by}"),
            Op::Softmax { causal } => {
                if *causal {
                    "causal".into()
                } else {
                    String::new()
                }
            }
            Op::LayerNorm { eps } | Op::RmsNorm { eps } | Op::BatchNorm { eps } => {
                format!("eps={eps:e}")
            }
            Op::ReduceSum { axes } | Op::ReduceMean { axes } => format!("axes={axes:?}"),
            Op::Dropout { p, stream } => format!("p={p}, stream={stream}"),
            Op::CrossEntropy { smoothing } => {
                if *smoothing != 0.0 {
                    format!("smoothing={smoothing}")
                } else {
                    String::new()
                }
            }
            Op::Add
            | Op::Sub
            | Op::Mul
            | Op::Relu
            | Op::Gelu
            | Op::Tanh
            | Op::Sigmoid
            | Op::Gather => String::new(),
        }
    }
}

// ---- shape rules ----

fn show(names: &[String], t: &TensorType) -> String {
    t.show(names)
}

fn declared(op: &Op, _: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    match op {
        Op::Input { ty, .. } | Op::Param { ty, .. } => Ok(ty.clone()),
        _ => Err("not a source op".into()),
    }
}

fn float_same(_: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    if !x[0].dtype.is_float() {
        return Err(format!(
            "expects a floating-point tensor, got {}",
            show(names, x[0])
        ));
    }
    Ok(x[0].clone())
}

fn known(d: &Dim, what: &str) -> Result<u64, String> {
    d.as_known()
        .ok_or_else(|| format!("{what} must be a known size, not symbolic"))
}

/// Numpy broadcasting, aligned at the last axis.
pub fn broadcast(a: &TensorType, b: &TensorType, names: &[String]) -> Result<TensorType, String> {
    if a.dtype != b.dtype {
        return Err(format!(
            "element types differ: {} and {}",
            show(names, a),
            show(names, b)
        ));
    }
    let rank = a.rank().max(b.rank());
    let one = Dim::known(1);
    let mut shape = Vec::with_capacity(rank);
    for i in 0..rank {
        let da = (i + a.rank())
            .checked_sub(rank)
            .map_or(&one, |j| &a.shape[j]);
        let db = (i + b.rank())
            .checked_sub(rank)
            .map_or(&one, |j| &b.shape[j]);
        let d = if da == db || *db == one {
            da
        } else if *da == one {
            db
        } else {
            return Err(format!(
                "shapes {} and {} do not broadcast",
                show(names, a),
                show(names, b)
            ));
        };
        shape.push(d.clone());
    }
    Ok(TensorType::new(a.dtype, shape))
}

fn broadcast_shape(_: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    broadcast(x[0], x[1], names)
}

fn matmul_shape(op: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let Op::MatMul { trans_b } = op else {
        unreachable!("matmul rule on {op:?}")
    };
    let (a, b) = (x[0], x[1]);
    if a.rank() < 2 || b.rank() < 2 {
        return Err(format!(
            "matmul needs operands of rank 2 or more, got {} and {}",
            show(names, a),
            show(names, b)
        ));
    }
    if !a.dtype.is_float() || a.dtype != b.dtype {
        return Err(format!(
            "matmul needs two floating-point operands of one type, got {} and {}",
            show(names, a),
            show(names, b)
        ));
    }
    let (m, k) = (&a.shape[a.rank() - 2], &a.shape[a.rank() - 1]);
    let (kb, n) = if *trans_b {
        (&b.shape[b.rank() - 1], &b.shape[b.rank() - 2])
    } else {
        (&b.shape[b.rank() - 2], &b.shape[b.rank() - 1])
    };
    if k != kb {
        return Err(format!(
            "inner dimensions differ: {} x {}",
            show(names, a),
            show(names, b)
        ));
    }
    let batch_a = &a.shape[..a.rank() - 2];
    let batch_b = &b.shape[..b.rank() - 2];
    if !batch_b.is_empty() && batch_a != batch_b {
        return Err(format!(
            "batch dimensions differ: {} x {}",
            show(names, a),
            show(names, b)
        ));
    }
    let mut shape = batch_a.to_vec();
    shape.push(m.clone());
    shape.push(n.clone());
    Ok(TensorType::new(a.dtype, shape))
}

/// `(size + 2 padding - kernel) / stride + 1`, if at least 1.
fn window_out(size: u64, kernel: u64, stride: u64, padding: u64) -> Option<u64> {
    let padded = size.checked_add(padding.checked_mul(2)?)?;
    if stride == 0 || padded < kernel {
        return None;
    }
    Some((padded - kernel) / stride + 1)
}

fn conv_shape(op: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let Op::Conv2d {
        stride,
        padding,
        groups,
    } = op
    else {
        unreachable!("conv rule on {op:?}")
    };
    let (inp, w) = (x[0], x[1]);
    if inp.rank() != 4 || w.rank() != 4 {
        return Err(format!(
            "conv2d needs an input [N, C, H, W] and weights [O, C/groups, KH, KW], got {} and {}",
            show(names, inp),
            show(names, w)
        ));
    }
    let c = known(&inp.shape[1], "the channel count")?;
    let (h, wd) = (
        known(&inp.shape[2], "the height")?,
        known(&inp.shape[3], "the width")?,
    );
    let o = known(&w.shape[0], "the output channel count")?;
    let (cg, kh, kw) = (
        known(&w.shape[1], "channels per group")?,
        known(&w.shape[2], "the kernel height")?,
        known(&w.shape[3], "the kernel width")?,
    );
    if *groups == 0 || c % groups != 0 || o % groups != 0 || cg * groups != c {
        return Err(format!(
            "{c} input and {o} output channels do not split into {groups} groups of {cg}"
        ));
    }
    let (Some(ho), Some(wo)) = (
        window_out(h, kh, *stride, *padding),
        window_out(wd, kw, *stride, *padding),
    ) else {
        return Err(format!(
            "a {kh}x{kw} kernel does not fit a {h}x{wd} input with padding {padding}"
        ));
    };
    Ok(TensorType::new(
        inp.dtype,
        vec![
            inp.shape[0].clone(),
            Dim::known(o),
            Dim::known(ho),
            Dim::known(wo),
        ],
    ))
}

fn pool_shape(op: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let Op::Pool2d {
        kernel,
        stride,
        padding,
        ..
    } = op
    else {
        unreachable!("pool rule on {op:?}")
    };
    let inp = x[0];
    if inp.rank() != 4 {
        return Err(format!(
            "pooling needs an input [N, C, H, W], got {}",
            show(names, inp)
        ));
    }
    if *padding * 2 > *kernel {
        return Err(format!(
            "padding {padding} is more than half the kernel {kernel}"
        ));
    }
    let (h, w) = (
        known(&inp.shape[2], "the height")?,
        known(&inp.shape[3], "the width")?,
    );
    let (Some(ho), Some(wo)) = (
        window_out(h, *kernel, *stride, *padding),
        window_out(w, *kernel, *stride, *padding),
    ) else {
        return Err(format!(
            "a {kernel}x{kernel} window does not fit a {h}x{w} input"
        ));
    };
    let mut shape = inp.shape.clone();
    shape[2] = Dim::known(ho);
    shape[3] = Dim::known(wo);
    Ok(TensorType::new(inp.dtype, shape))
}

fn reshape_shape(op: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let Op::Reshape { shape } = op else {
        unreachable!("reshape rule on {op:?}")
    };
    let to = TensorType::new(x[0].dtype, shape.clone());
    if x[0].numel() != to.numel() {
        return Err(format!(
            "cannot reshape {} to {}: element counts differ",
            show(names, x[0]),
            show(names, &to)
        ));
    }
    Ok(to)
}

fn permute_shape(op: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let Op::Permute { perm } = op else {
        unreachable!("permute rule on {op:?}")
    };
    let mut seen = vec![false; x[0].rank()];
    if perm.len() != x[0].rank()
        || perm
            .iter()
            .any(|&p| p >= seen.len() || std::mem::replace(&mut seen[p], true))
    {
        return Err(format!(
            "{perm:?} is not a permutation of the {} axes of {}",
            x[0].rank(),
            show(names, x[0])
        ));
    }
    let shape = perm.iter().map(|&p| x[0].shape[p].clone()).collect();
    Ok(TensorType::new(x[0].dtype, shape))
}

fn concat_shape(op: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let Op::Concat { axis } = op else {
        unreachable!("concat rule on {op:?}")
    };
    let (a, b) = (x[0], x[1]);
    if a.rank() != b.rank() || *axis >= a.rank() || a.dtype != b.dtype {
        return Err(format!(
            "cannot concatenate {} and {} along axis {axis}",
            show(names, a),
            show(names, b)
        ));
    }
    for i in 0..a.rank() {
        if i != *axis && a.shape[i] != b.shape[i] {
            return Err(format!(
                "cannot concatenate {} and {} along axis {axis}: axis {i} differs",
                show(names, a),
                show(names, b)
            ));
        }
    }
    let sa = known(&a.shape[*axis], "the concatenated axis")?;
    let sb = known(&b.shape[*axis], "the concatenated axis")?;
    let mut shape = a.shape.clone();
    shape[*axis] = Dim::known(sa + sb);
    Ok(TensorType::new(a.dtype, shape))
}

fn slice_shape(op: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let Op::Slice { axis, start, len } = op else {
        unreachable!("slice rule on {op:?}")
    };
    let t = x[0];
    if *axis >= t.rank() {
        return Err(format!(
            "axis {axis} is out of range for {}",
            show(names, t)
        ));
    }
    if let (Some(size), Some(l)) = (t.shape[*axis].as_known(), len.as_known()) {
        if start.saturating_add(l) > size {
            return Err(format!(
                "slice [{start}, {start}+{l}) is outside axis {axis} of {}",
                show(names, t)
            ));
        }
    }
    let mut shape = t.shape.clone();
    shape[*axis] = len.clone();
    Ok(TensorType::new(t.dtype, shape))
}

fn softmax_shape(op: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let t = float_same(op, x, names)?;
    if t.rank() == 0 {
        return Err("softmax needs at least one axis".into());
    }
    if let Op::Softmax { causal: true } = op {
        if t.rank() < 2 || t.shape[t.rank() - 1] != t.shape[t.rank() - 2] {
            return Err(format!(
                "a causal softmax needs square [.., S, S] scores, got {}",
                show(names, &t)
            ));
        }
    }
    Ok(t)
}

fn batchnorm_shape(op: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let t = float_same(op, x, names)?;
    if t.rank() < 2 {
        return Err(format!(
            "batch norm needs [N, C, ..], got {}",
            show(names, &t)
        ));
    }
    Ok(t)
}

fn reduce_shape(op: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let (Op::ReduceSum { axes } | Op::ReduceMean { axes }) = op else {
        unreachable!("reduce rule on {op:?}")
    };
    let t = x[0];
    if axes.iter().any(|&a| a >= t.rank()) || axes.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!(
            "axes {axes:?} must be ascending axes of {}",
            show(names, t)
        ));
    }
    let shape = (0..t.rank())
        .filter(|i| !axes.contains(i))
        .map(|i| t.shape[i].clone())
        .collect();
    Ok(TensorType::new(t.dtype, shape))
}

fn gather_shape(_: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let (table, idx) = (x[0], x[1]);
    if table.rank() != 2 || !table.dtype.is_float() {
        return Err(format!(
            "gather needs a float table [V, D], got {}",
            show(names, table)
        ));
    }
    if idx.dtype.is_float() {
        return Err(format!(
            "indices must be integers (dtype: I32), got {}",
            show(names, idx)
        ));
    }
    let mut shape = idx.shape.clone();
    shape.push(table.shape[1].clone());
    Ok(TensorType::new(table.dtype, shape))
}

fn xent_shape(_: &Op, x: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
    let (logits, labels) = (x[0], x[1]);
    if logits.rank() == 0 || !logits.dtype.is_float() {
        return Err(format!(
            "cross-entropy needs float logits [.., classes], got {}",
            show(names, logits)
        ));
    }
    if labels.dtype.is_float() || labels.shape[..] != logits.shape[..logits.rank() - 1] {
        return Err(format!(
            "labels must be integers of shape {:?} for logits {}, got {}",
            logits.shape[..logits.rank() - 1]
                .iter()
                .map(|d| d.show(names))
                .collect::<Vec<_>>(),
            show(names, logits),
            show(names, labels)
        ));
    }
    Ok(TensorType::scalar(DType::F32))
}

// ---- cost rules (FLOPs of one execution) ----

fn free(_: &Op, _: &[Vec<u64>], _: &[u64]) -> u64 {
    0
}

fn numel(s: &[u64]) -> u64 {
    s.iter().fold(1u64, |a, &d| a.saturating_mul(d))
}

fn per_out<const K: u64>(_: &Op, _: &[Vec<u64>], out: &[u64]) -> u64 {
    numel(out).saturating_mul(K)
}

fn per_in<const K: u64>(_: &Op, ins: &[Vec<u64>], _: &[u64]) -> u64 {
    numel(&ins[0]).saturating_mul(K)
}

fn matmul_flops(_: &Op, ins: &[Vec<u64>], out: &[u64]) -> u64 {
    let a = &ins[0];
    let k = a.last().copied().unwrap_or(1);
    numel(out).saturating_mul(k).saturating_mul(2)
}

fn conv_flops(_: &Op, ins: &[Vec<u64>], out: &[u64]) -> u64 {
    let w = &ins[1];
    numel(out).saturating_mul(numel(&w[1..])).saturating_mul(2)
}

fn pool_flops(op: &Op, _: &[Vec<u64>], out: &[u64]) -> u64 {
    let k = match op {
        Op::Pool2d { kernel, .. } => *kernel,
        _ => 1,
    };
    numel(out).saturating_mul(k * k)
}

/// The element count of a type, for memory estimates.
pub fn elements(t: &TensorType) -> Option<Dim> {
    product(&t.shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: [String; 0] = [];

    fn f(shape: &[u64]) -> TensorType {
        TensorType::f32(shape.iter().map(|&d| Dim::known(d)).collect())
    }

    #[test]
    fn table_is_in_kind_order() {
        for (i, d) in OPS.iter().enumerate() {
            assert_eq!(d.kind as usize, i, "row {} is out of order", d.name);
        }
    }

    #[test]
    fn shape_rules() {
        let mm = Op::MatMul { trans_b: false };
        assert_eq!(
            mm.infer(&[&f(&[8, 3]), &f(&[3, 5])], &B).unwrap(),
            f(&[8, 5])
        );
        assert!(mm.infer(&[&f(&[8, 3]), &f(&[4, 5])], &B).is_err());
        let mmt = Op::MatMul { trans_b: true };
        assert_eq!(
            mmt.infer(&[&f(&[2, 4, 8, 16]), &f(&[2, 4, 8, 16])], &B)
                .unwrap(),
            f(&[2, 4, 8, 8])
        );
        let conv = Op::Conv2d {
            stride: 2,
            padding: 1,
            groups: 1,
        };
        assert_eq!(
            conv.infer(&[&f(&[1, 3, 32, 32]), &f(&[16, 3, 3, 3])], &B)
                .unwrap(),
            f(&[1, 16, 16, 16])
        );
        assert_eq!(
            Op::Add.infer(&[&f(&[4, 1, 5]), &f(&[3, 1])], &B).unwrap(),
            f(&[4, 3, 5])
        );
        assert!(Op::Add.infer(&[&f(&[4, 2]), &f(&[3])], &B).is_err());
        assert!(Op::Relu.infer(&[&f(&[1]), &f(&[1])], &B).is_err());
        let pool = Op::Pool2d {
            max: true,
            kernel: 2,
            stride: 2,
            padding: 0,
        };
        assert_eq!(
            pool.infer(&[&f(&[1, 8, 7, 7])], &B).unwrap(),
            f(&[1, 8, 3, 3])
        );
        let r = Op::ReduceMean { axes: vec![0, 1] };
        assert_eq!(r.infer(&[&f(&[2, 3])], &B).unwrap(), f(&[]));
    }

    #[test]
    fn costs() {
        let mm = Op::MatMul { trans_b: false };
        assert_eq!(
            (mm.def().flops)(&mm, &[vec![8, 3], vec![3, 5]], &[8, 5]),
            240
        );
    }
}
