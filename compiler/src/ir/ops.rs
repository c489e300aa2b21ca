//! The op table: every primitive op of the IR, declared once.
//!
//! A row gives the op's name, arity, class, shape rule (`shape_rules.rs`), cost (`cost.rs`),
//! VJP (`vjp.rs`) and, for a plain elementwise map, its backend columns (`maps.rs`: CPU
//! function and vector loop, f64 reference, PTX body, epilogue flag), so adding an
//! elementwise op touches this table, its map, its VJP rule and a test. Layers
//! (`dsl::ast::Layer`) lower into these ops in `passes::lower`; `passes::autodiff` builds the
//! backward graph from the VJP column alone.

use super::attention::*;
use super::cost::*;
use super::dim::Dim;
use super::maps::{self, Map};
use super::shape_rules::*;
use super::types::TensorType;
use super::vjp::{self, VjpRule};
use serde::Serialize;

/// How a parameter is initialised (recorded, never materialised by the compiler).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub enum Op {
    // ---- sources ----
    /// A graph input (data, labels, the learning rate), fed per step.
    Input {
        name: String,
        ty: TensorType,
    },
    /// A trainable parameter, persistent across steps.
    Param {
        name: String,
        ty: TensorType,
        init: Init,
    },
    /// State persistent across steps that no gradient updates: optimizer state (momentum,
    /// Adam moments) and BatchNorm's running statistics. Every element is `start` at first.
    State {
        name: String,
        ty: TensorType,
        start: f64,
    },
    /// The scalar 1 in a step that trains (or computes gradients), 0 in an evaluation: what
    /// BatchNorm blends its batch and running statistics by.
    Training,
    /// A tensor filled with one value.
    Fill {
        value: f64,
        ty: TensorType,
    },

    // ---- GEMM and convolution ----
    /// `op(a) x op(b)`, `op` transposing the last two axes when its flag is set:
    /// `[.., M, K] x [.., K, N]`; `b` may be 2-D and shared by every batch of `a`.
    MatMul {
        trans_a: bool,
        trans_b: bool,
    },
    /// `x [N, C, H, W]`, `w [O, C/groups, K, K]`.
    Conv2d {
        stride: u64,
        padding: u64,
        groups: u64,
    },
    /// The input gradient of a convolution: `dy [N, O, Ho, Wo]`, `w` to `[N, C, in_h, in_w]`.
    Conv2dGradInput {
        stride: u64,
        padding: u64,
        groups: u64,
        in_h: u64,
        in_w: u64,
    },
    /// The weight gradient: `x [N, C, H, W]`, `dy [N, O, Ho, Wo]` to `[O, C/groups, K, K]`.
    Conv2dGradWeight {
        stride: u64,
        padding: u64,
        groups: u64,
        kernel: u64,
    },
    Pool2d {
        max: bool,
        kernel: u64,
        stride: u64,
        padding: u64,
    },
    /// `(x, dy)` to the gradient of a pooling of `x`.
    Pool2dGrad {
        max: bool,
        kernel: u64,
        stride: u64,
        padding: u64,
    },

    // ---- layout ----
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
    /// Zeros of `size` along `axis` with the operand at `start`: the inverse of `Slice`.
    Pad {
        axis: usize,
        start: u64,
        size: Dim,
    },
    /// Rows of `table [V, D]` at integer `indices [..]`: `[.., D]`.
    Gather,
    /// `(indices [..], dy [.., D])` summed into `[rows, D]`: the gradient of `Gather`.
    ScatterAdd {
        rows: u64,
    },

    // ---- elementwise (numpy broadcasting for two operands) ----
    Add,
    Sub,
    Mul,
    Div,
    Scale {
        by: f64,
    },
    AddScalar {
        value: f64,
    },
    /// `min(x, value)`
    ClampMax {
        value: f64,
    },
    Sqrt,
    Relu,
    /// The exact (erf) GELU, as PyTorch's default.
    Gelu,
    Tanh,
    Sigmoid,
    /// `x * sigmoid(x)` (SiLU, or swish), as PyTorch's `F.silu`.
    Silu,
    /// `(x, dy)`: `dy * (x > 0)`.
    ReluGrad,
    /// `(x, dy)`: `dy * gelu'(x)`.
    GeluGrad,
    /// `(y, dy)` with `y = tanh(x)`: `dy * (1 - y^2)`.
    TanhGrad,
    /// `(y, dy)` with `y = sigmoid(x)`: `dy * y * (1 - y)`.
    SigmoidGrad,
    /// `(x, dy)`: `dy * s * (1 + x * (1 - s))` with `s = sigmoid(x)`.
    SiluGrad,
    /// Each element to the nearest bf16 (ties to even), kept in f32: the copy of a weight
    /// that a matmul multiplies when activations are stored in bf16 (as a bf16 GEMM does);
    /// its gradient passes through unchanged.
    RoundBf16,
    /// Zeroes elements with probability `p` and scales the rest by `1/(1-p)`; the mask is keyed
    /// by (seed, step, `stream`, sample, element), so it is the same on any device count and
    /// the same op applied to the gradient uses the same mask.
    Dropout {
        p: f64,
        stream: u64,
    },

    // ---- reductions ----
    /// Over the last axis; `causal` masks key positions after the query's.
    Softmax {
        causal: bool,
    },
    /// `(y, dy)` with `y` the softmax: `y * (dy - sum(dy * y))` over the last axis.
    SoftmaxGrad,
    /// Normalise over the last axis (no affine: that is a Mul and an Add).
    LayerNorm {
        eps: f64,
    },
    /// `(x, dy)`: the gradient of `LayerNorm` at `x`.
    LayerNormGrad {
        eps: f64,
    },
    RmsNorm {
        eps: f64,
    },
    RmsNormGrad {
        eps: f64,
    },
    ReduceSum {
        axes: Vec<usize>,
    },
    ReduceMean {
        axes: Vec<usize>,
    },
    /// Sums a broadcast operand back down to `shape` (the gradient of broadcasting).
    SumTo {
        shape: Vec<Dim>,
    },
    /// Repeats the operand along `axes` to `shape`, divided by the repeat count if `mean` (the
    /// gradient of `ReduceSum` / `ReduceMean`).
    Expand {
        axes: Vec<usize>,
        shape: Vec<Dim>,
        mean: bool,
    },
    /// Mean cross-entropy of `logits [.., C]` against integer `labels [..]`.
    CrossEntropy {
        smoothing: f64,
    },
    /// `(logits, labels, dloss)` to the gradient with respect to the logits.
    CrossEntropyGrad {
        smoothing: f64,
    },

    // ---- attention ----
    /// `softmax(scale * q k^T, masked when causal) v` per head, token-major: `q [.., T, H, D]`,
    /// `k [.., S, H, D]`, `v [.., S, H, E]` to `[.., T, H, E]` (a projection's output reshaped,
    /// no permute). One op, so the `T x S` scores are never stored: the kernel streams tiles
    /// of keys with an online softmax.
    Attention {
        causal: bool,
        scale: f64,
    },
    /// `(q, k)` to each query's log-sum-exp of its scaled, masked scores, `[.., T, H]`: what
    /// the backward reads instead of the probabilities. The fuse pass runs it in the same
    /// kernel as the `Attention` of the same `q` and `k`.
    AttentionLse {
        causal: bool,
        scale: f64,
    },
    /// `(q, k, v, dy, lse, delta)` to the gradient of `Attention` with respect to `wrt`, with
    /// `lse` from `AttentionLse` and `delta = rowsum(dy * y)`: the probabilities are
    /// recomputed tile by tile. The fuse pass runs the key and value gradients in one kernel.
    AttentionGrad {
        causal: bool,
        scale: f64,
        wrt: AttentionInput,
    },
    /// `(cache [.., S, H, D], rows [.., T, H, D], pos [..] integer)` to the cache with row
    /// `pos + t` replaced by `rows[t]`: a decode step's key or value cache, updated where it
    /// lives (the schedule writes it over its `State`, which persists between steps).
    CacheWrite,
    /// `(q [.., T, H, D], k [.., S, H, D], v [.., S, H, E], pos [..] integer)` to
    /// `[.., T, H, E]`: query `t` at position `pos + t` attends to cache rows `0..=pos + t`
    /// (a decode step over its key and value caches; the causal mask is the position).
    CachedAttention {
        scale: f64,
    },

    // ---- collectives ----
    /// The sum of the operand over a group of devices. Over `Shards` (every micro-shard of
    /// data parallelism) it follows a fixed tree over shard index, so the bits do not depend
    /// on how shards sit on devices; over `Tensor` it sums a row-parallel layer's partial
    /// products across the tensor-parallel ranks. With one member it is the identity.
    AllReduce {
        group: Group,
    },
    /// The identity on a value every tensor-parallel rank holds, entering a column-parallel
    /// layer: its gradient is the sum over the ranks of theirs.
    TensorParallelCopy,
    /// A value one pipeline stage computed, sent to a later (or, in backward, earlier) stage
    /// that reads it: the send and the receive of one point-to-point transfer.
    Transfer {
        from: u32,
        to: u32,
    },
    /// The value data-parallel rank `root` computed, on every rank: a parameter updated by
    /// the rank that holds its optimizer state (ZeRO-1).
    Broadcast {
        root: u32,
    },
    /// The sum over every micro-shard, like `AllReduce` over shards (the same tree, the same
    /// bits), delivered only to data-parallel rank `root`: a gradient under ZeRO-2, where
    /// each rank keeps the reduced gradients of the parameters it updates (together, a
    /// reduce-scatter).
    Reduce {
        root: u32,
    },
}

/// The operand of `Attention` an `AttentionGrad` differentiates by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum AttentionInput {
    Query,
    Key,
    Value,
}

impl AttentionInput {
    /// Its position among the operands of `Attention` (and of `AttentionGrad`).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Which devices a collective spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum Group {
    /// Every micro-shard of the batch (data parallelism).
    Shards,
    /// The ranks that split one layer's weights (tensor parallelism).
    Tensor,
}

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
pub enum OpKind {
    Input,
    Param,
    State,
    Training,
    Fill,
    MatMul,
    Conv2d,
    Conv2dGradInput,
    Conv2dGradWeight,
    Pool2d,
    Pool2dGrad,
    Reshape,
    Permute,
    Concat,
    Slice,
    Pad,
    Gather,
    ScatterAdd,
    Add,
    Sub,
    Mul,
    Div,
    Scale,
    AddScalar,
    ClampMax,
    Sqrt,
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
    Silu,
    ReluGrad,
    GeluGrad,
    TanhGrad,
    SigmoidGrad,
    SiluGrad,
    RoundBf16,
    Dropout,
    Softmax,
    SoftmaxGrad,
    LayerNorm,
    LayerNormGrad,
    RmsNorm,
    RmsNormGrad,
    ReduceSum,
    ReduceMean,
    SumTo,
    Expand,
    CrossEntropy,
    CrossEntropyGrad,
    Attention,
    AttentionLse,
    AttentionGrad,
    CacheWrite,
    CachedAttention,
    AllReduce,
    TensorParallelCopy,
    Transfer,
    Broadcast,
    Reduce,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum OpClass {
    Source,
    Gemm,
    Conv,
    Elementwise,
    /// Reduces along an axis (softmax, norms, sums, losses, pooling).
    Reduction,
    /// Moves data without arithmetic.
    Layout,
    /// Communicates between devices: a kernel of its own, run by the collective library.
    Collective,
    /// Products and a softmax over tiles of keys: attention and its gradients.
    Attention,
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
    /// The vector-Jacobian product: the gradients of the operands from the output's.
    pub vjp: VjpRule,
    /// A plain elementwise map's backend columns (`maps`): CPU, f64 reference, PTX.
    pub map: Option<&'static Map>,
}

const fn row(
    kind: OpKind,
    name: &'static str,
    arity: usize,
    class: OpClass,
    shape: ShapeRule,
    flops: CostRule,
    vjp: VjpRule,
) -> OpDef {
    OpDef {
        kind,
        name,
        arity: Arity::Exactly(arity),
        class,
        shape,
        flops,
        vjp,
        map: None,
    }
}

/// A row of the elementwise family, with its map.
const fn map_row(
    kind: OpKind,
    name: &'static str,
    arity: usize,
    shape: ShapeRule,
    flops: CostRule,
    vjp: VjpRule,
    map: &'static Map,
) -> OpDef {
    OpDef {
        map: Some(map),
        ..row(kind, name, arity, Elementwise, shape, flops, vjp)
    }
}

use OpClass::*;
use OpKind as K;

/// The table, in `OpKind` order (a test checks it).
#[rustfmt::skip]
pub static OPS: [OpDef; 60] = [
    row(K::Input, "input", 0, Source, declared, free, vjp::source),
    row(K::Param, "param", 0, Source, declared, free, vjp::source),
    row(K::State, "state", 0, Source, declared, free, vjp::source),
    row(K::Training, "training", 0, Source, declared, free, vjp::source),
    row(K::Fill, "fill", 0, Source, declared, free, vjp::source),
    row(K::MatMul, "matmul", 2, Gemm, matmul_shape, matmul_flops, vjp::matmul),
    row(K::Conv2d, "conv2d", 2, Conv, conv_shape, conv_flops, vjp::conv2d),
    row(K::Conv2dGradInput, "conv2d_grad_input", 2, Conv, conv_grad_input_shape, conv_grad_input_flops, vjp::none),
    row(K::Conv2dGradWeight, "conv2d_grad_weight", 2, Conv, conv_grad_weight_shape, conv_grad_weight_flops, vjp::none),
    row(K::Pool2d, "pool2d", 1, Reduction, pool_shape, pool_flops, vjp::pool2d),
    row(K::Pool2dGrad, "pool2d_grad", 2, Reduction, pool_grad_shape, pool_grad_flops, vjp::none),
    row(K::Reshape, "reshape", 1, Layout, reshape_shape, free, vjp::reshape),
    row(K::Permute, "permute", 1, Layout, permute_shape, free, vjp::permute),
    row(K::Concat, "concat", 2, Layout, concat_shape, free, vjp::concat),
    row(K::Slice, "slice", 1, Layout, slice_shape, free, vjp::slice),
    row(K::Pad, "pad", 1, Layout, pad_shape, free, vjp::pad),
    row(K::Gather, "gather", 2, Layout, gather_shape, free, vjp::gather),
    row(K::ScatterAdd, "scatter_add", 2, Layout, scatter_add_shape, per_in::<1, 1>, vjp::none),
    map_row(K::Add, "add", 2, broadcast_shape, per_out::<1>, vjp::add, &maps::ADD),
    map_row(K::Sub, "sub", 2, broadcast_shape, per_out::<1>, vjp::sub, &maps::SUB),
    map_row(K::Mul, "mul", 2, broadcast_shape, per_out::<1>, vjp::mul, &maps::MUL),
    map_row(K::Div, "div", 2, broadcast_shape, per_out::<1>, vjp::div, &maps::DIV),
    map_row(K::Scale, "scale", 1, float_same, per_out::<1>, vjp::scale, &maps::SCALE),
    map_row(K::AddScalar, "add_scalar", 1, float_same, per_out::<1>, vjp::identity, &maps::ADD_SCALAR),
    map_row(K::ClampMax, "clamp_max", 1, float_same, per_out::<1>, vjp::none, &maps::CLAMP_MAX),
    map_row(K::Sqrt, "sqrt", 1, float_same, per_out::<1>, vjp::sqrt, &maps::SQRT),
    map_row(K::Relu, "relu", 1, float_same, per_out::<1>, vjp::relu, &maps::RELU),
    map_row(K::Gelu, "gelu", 1, float_same, per_out::<8>, vjp::gelu, &maps::GELU),
    map_row(K::Tanh, "tanh", 1, float_same, per_out::<4>, vjp::tanh, &maps::TANH),
    map_row(K::Sigmoid, "sigmoid", 1, float_same, per_out::<4>, vjp::sigmoid, &maps::SIGMOID),
    map_row(K::Silu, "silu", 1, float_same, per_out::<5>, vjp::silu, &maps::SILU),
    map_row(K::ReluGrad, "relu_grad", 2, same_pair, per_out::<1>, vjp::none, &maps::RELU_GRAD),
    map_row(K::GeluGrad, "gelu_grad", 2, same_pair, per_out::<12>, vjp::none, &maps::GELU_GRAD),
    map_row(K::TanhGrad, "tanh_grad", 2, same_pair, per_out::<3>, vjp::none, &maps::TANH_GRAD),
    map_row(K::SigmoidGrad, "sigmoid_grad", 2, same_pair, per_out::<3>, vjp::none, &maps::SIGMOID_GRAD),
    map_row(K::SiluGrad, "silu_grad", 2, same_pair, per_out::<8>, vjp::none, &maps::SILU_GRAD),
    map_row(K::RoundBf16, "round_bf16", 1, float_same, per_out::<1>, vjp::identity, &maps::ROUND_BF16),
    row(K::Dropout, "dropout", 1, Elementwise, float_same, per_out::<2>, vjp::dropout),
    row(K::Softmax, "softmax", 1, Reduction, softmax_shape, per_out::<5>, vjp::softmax),
    row(K::SoftmaxGrad, "softmax_grad", 2, Reduction, same_pair, per_out::<4>, vjp::none),
    row(K::LayerNorm, "layer_norm", 1, Reduction, last_axis_norm, per_out::<8>, vjp::layer_norm),
    row(K::LayerNormGrad, "layer_norm_grad", 2, Reduction, same_pair, per_out::<12>, vjp::none),
    row(K::RmsNorm, "rms_norm", 1, Reduction, last_axis_norm, per_out::<5>, vjp::rms_norm),
    row(K::RmsNormGrad, "rms_norm_grad", 2, Reduction, same_pair, per_out::<8>, vjp::none),
    row(K::ReduceSum, "reduce_sum", 1, Reduction, reduce_shape, per_in::<0, 1>, vjp::reduce),
    row(K::ReduceMean, "reduce_mean", 1, Reduction, reduce_shape, per_in::<0, 1>, vjp::reduce),
    row(K::SumTo, "sum_to", 1, Reduction, sum_to_shape, per_in::<0, 1>, vjp::none),
    row(K::Expand, "expand", 1, Layout, expand_shape, per_out::<1>, vjp::none),
    row(K::CrossEntropy, "cross_entropy", 2, Reduction, xent_shape, per_in::<0, 5>, vjp::cross_entropy),
    row(K::CrossEntropyGrad, "cross_entropy_grad", 3, Reduction, xent_grad_shape, per_in::<0, 5>, vjp::none),
    row(K::Attention, "attention", 3, Attention, attention_shape, attention_flops, vjp::attention),
    row(K::AttentionLse, "attention_lse", 2, Attention, attention_lse_shape, attention_flops, vjp::none),
    row(K::AttentionGrad, "attention_grad", 6, Attention, attention_grad_shape, attention_grad_flops, vjp::none),
    row(K::CacheWrite, "cache_write", 3, Layout, cache_write_shape, free, vjp::none),
    row(K::CachedAttention, "cached_attention", 4, Attention, cached_attention_shape, cached_attention_flops, vjp::none),
    row(K::AllReduce, "all_reduce", 1, Collective, float_same, per_out::<1>, vjp::all_reduce),
    row(K::TensorParallelCopy, "tensor_parallel_copy", 1, Layout, float_same, free, vjp::tensor_parallel_copy),
    row(K::Transfer, "transfer", 1, Collective, any_same, free, vjp::none),
    row(K::Broadcast, "broadcast", 1, Collective, any_same, free, vjp::none),
    row(K::Reduce, "reduce", 1, Collective, float_same, per_out::<1>, vjp::none),
];

/// The ops with a map (`maps`), as a pattern: a backend's match over ops covers the whole
/// elementwise family in one arm (`map_ops!() => ..op.map()..`) and names every other op, so
/// it needs no wildcard and a new op without a backend piece does not compile. A test checks
/// the pattern against the table.
#[macro_export]
macro_rules! map_ops {
    () => {
        $crate::ir::Op::Add
            | $crate::ir::Op::Sub
            | $crate::ir::Op::Mul
            | $crate::ir::Op::Div
            | $crate::ir::Op::Scale { .. }
            | $crate::ir::Op::AddScalar { .. }
            | $crate::ir::Op::ClampMax { .. }
            | $crate::ir::Op::Sqrt
            | $crate::ir::Op::Relu
            | $crate::ir::Op::Gelu
            | $crate::ir::Op::Tanh
            | $crate::ir::Op::Sigmoid
            | $crate::ir::Op::Silu
            | $crate::ir::Op::ReluGrad
            | $crate::ir::Op::GeluGrad
            | $crate::ir::Op::TanhGrad
            | $crate::ir::Op::SigmoidGrad
            | $crate::ir::Op::SiluGrad
            | $crate::ir::Op::RoundBf16
    };
}

/// One op of each elementwise row of the table, with sample attributes, in table order: what
/// the backends' tests walk, so an elementwise row without a CPU map or a PTX arm fails a
/// test (a unit test checks that it covers the table).
pub fn elementwise_examples() -> Vec<Op> {
    vec![
        Op::Add,
        Op::Sub,
        Op::Mul,
        Op::Div,
        Op::Scale { by: 0.5 },
        Op::AddScalar { value: 1.0 },
        Op::ClampMax { value: 2.0 },
        Op::Sqrt,
        Op::Relu,
        Op::Gelu,
        Op::Tanh,
        Op::Sigmoid,
        Op::Silu,
        Op::ReluGrad,
        Op::GeluGrad,
        Op::TanhGrad,
        Op::SigmoidGrad,
        Op::SiluGrad,
        Op::RoundBf16,
        Op::Dropout { p: 0.1, stream: 3 },
    ]
}

impl Op {
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Input { .. } => K::Input,
            Op::Param { .. } => K::Param,
            Op::State { .. } => K::State,
            Op::Training => K::Training,
            Op::Fill { .. } => K::Fill,
            Op::MatMul { .. } => K::MatMul,
            Op::Conv2d { .. } => K::Conv2d,
            Op::Conv2dGradInput { .. } => K::Conv2dGradInput,
            Op::Conv2dGradWeight { .. } => K::Conv2dGradWeight,
            Op::Pool2d { .. } => K::Pool2d,
            Op::Pool2dGrad { .. } => K::Pool2dGrad,
            Op::Reshape { .. } => K::Reshape,
            Op::Permute { .. } => K::Permute,
            Op::Concat { .. } => K::Concat,
            Op::Slice { .. } => K::Slice,
            Op::Pad { .. } => K::Pad,
            Op::Gather => K::Gather,
            Op::ScatterAdd { .. } => K::ScatterAdd,
            Op::Add => K::Add,
            Op::Sub => K::Sub,
            Op::Mul => K::Mul,
            Op::Div => K::Div,
            Op::Scale { .. } => K::Scale,
            Op::AddScalar { .. } => K::AddScalar,
            Op::ClampMax { .. } => K::ClampMax,
            Op::Sqrt => K::Sqrt,
            Op::Relu => K::Relu,
            Op::Gelu => K::Gelu,
            Op::Tanh => K::Tanh,
            Op::Sigmoid => K::Sigmoid,
            Op::Silu => K::Silu,
            Op::ReluGrad => K::ReluGrad,
            Op::GeluGrad => K::GeluGrad,
            Op::TanhGrad => K::TanhGrad,
            Op::SigmoidGrad => K::SigmoidGrad,
            Op::SiluGrad => K::SiluGrad,
            Op::RoundBf16 => K::RoundBf16,
            Op::Dropout { .. } => K::Dropout,
            Op::Softmax { .. } => K::Softmax,
            Op::SoftmaxGrad => K::SoftmaxGrad,
            Op::LayerNorm { .. } => K::LayerNorm,
            Op::LayerNormGrad { .. } => K::LayerNormGrad,
            Op::RmsNorm { .. } => K::RmsNorm,
            Op::RmsNormGrad { .. } => K::RmsNormGrad,
            Op::ReduceSum { .. } => K::ReduceSum,
            Op::ReduceMean { .. } => K::ReduceMean,
            Op::SumTo { .. } => K::SumTo,
            Op::Expand { .. } => K::Expand,
            Op::CrossEntropy { .. } => K::CrossEntropy,
            Op::CrossEntropyGrad { .. } => K::CrossEntropyGrad,
            Op::Attention { .. } => K::Attention,
            Op::AttentionLse { .. } => K::AttentionLse,
            Op::AttentionGrad { .. } => K::AttentionGrad,
            Op::CacheWrite => K::CacheWrite,
            Op::CachedAttention { .. } => K::CachedAttention,
            Op::AllReduce { .. } => K::AllReduce,
            Op::TensorParallelCopy => K::TensorParallelCopy,
            Op::Transfer { .. } => K::Transfer,
            Op::Broadcast { .. } => K::Broadcast,
            Op::Reduce { .. } => K::Reduce,
        }
    }

    pub fn def(&self) -> &'static OpDef {
        &OPS[self.kind() as usize]
    }

    pub fn name(&self) -> &'static str {
        self.def().name
    }

    /// Whether the op is a source (no operands; its value comes from outside or persists).
    pub fn is_source(&self) -> bool {
        self.def().class == OpClass::Source
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
}

#[path = "ops_attrs.rs"]
mod attrs;

#[cfg(test)]
#[path = "ops_tests.rs"]
mod tests;
