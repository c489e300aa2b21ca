//! Every primitive op of the IR, declared once: one entry of `__parallax_ops!` per op gives
//! its variant (attributes and doc), its name, arity, class, shape rule (`shape_rules.rs`,
//! `attention.rs`), cost rule (`cost.rs`), VJP rule (`vjp.rs`) and, for the elementwise
//! family, its map (`maps.rs`) and an example; the attributes as text where it has any.
//!
//! This file makes the `Op` type of it (`Op`, `OpKind`, `Op::kind`, `Op::name`, `Op::attrs`,
//! `elementwise_examples`) and names no other file of the IR but `types` and `dim`: the rule
//! columns are only tokens here, resolved where the table is made (`ops.rs`, `OPS`). The
//! `map_ops!` pattern and each op's attribute struct (`attrs.rs`) are made from the same
//! entries. A rule takes that struct, not the op: the table's row destructures the op once
//! and calls its rules with its attributes, so no rule matches an op. Adding an elementwise
//! op is its entry here, its map in `maps.rs` and its VJP rule in `vjp.rs`.

use super::dim::Dim;
use super::types::TensorType;
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

/// The op list. `__parallax_ops!(callback)` hands every entry, in order, to `callback!` in
/// one form: `[docs] Variant [{ field: Type, .. }] "name" arity Class shape flops vjp [map [{param}]]
/// [example] [names (attrs)];` (the bracketed columns may be empty).
///
/// An entry is written `Variant { field: Type, .. } = "name", arity, Class, shape rule, cost
/// rule, vjp::RULE` (`vjp::none` for an op never differentiated) and then, each optional,
/// `, map maps::ROW` (a plain elementwise map; `maps::ROW { field }` when the map takes that
/// attribute as its `p`), `, example Op::..` (every elementwise row has
/// one: the backends' tests walk them) and `, attrs |names| text` (the attributes as the
/// printer shows them, the fields bound by name). Entries are in `OpKind` order, which sorts
/// and indexes the table.
///
/// Each rule's first argument is the op's attributes, `attrs::Variant` (`attrs.rs`), and it
/// binds the fields it reads by name (`attrs::MatMul { trans_a, .. }: attrs::MatMul`); a rule
/// that several ops share and that reads none of their attributes takes `impl Attrs` (its
/// `NAME` is the op's name), as `broadcast_shape`, `per_out::<K>` or `vjp::none`.
#[doc(hidden)]
#[macro_export]
macro_rules! __parallax_ops {
    (@rows [$($cb:tt)+] $(
        $(#[$doc:meta])*
        $op:ident $({ $($field:ident : $ty:ty),* $(,)? })? =
            $name:literal, $arity:literal, $class:ident, $shape:path, $flops:expr, vjp::$vjp:ident
            $(, map $map:path $({ $param:ident })?)?
            $(, example $example:expr)?
            $(, attrs |$names:ident| $attrs:expr)?
        ;
    )*) => {
        $($cb)+ ! { $(
            [$(#[$doc])*] $op [$({ $($field : $ty),* })?] $name $arity $class $shape $flops $vjp
            [$($map $({ $param })?)?] [$($example)?] [$($names ($attrs))?];
        )* }
    };
    ($($cb:tt)+) => { $crate::__parallax_ops! { @rows [$($cb)+]
        // ---- sources ----
        /// A graph input (data, labels, the learning rate), fed per step.
        Input { name: String, ty: TensorType } =
            "input", 0, Source, input_shape, free, vjp::source,
            attrs |names| format!("\"{name}\"");
        /// A trainable parameter, persistent across steps.
        Param { name: String, ty: TensorType, init: Init } =
            "param", 0, Source, param_shape, free, vjp::source,
            attrs |names| format!("\"{name}\", init={}", init.show());
        /// State persistent across steps that no gradient updates: optimizer state (momentum,
        /// Adam moments) and BatchNorm's running statistics. Every element is `start` at first.
        State { name: String, ty: TensorType, start: f64 } =
            "state", 0, Source, state_shape, free, vjp::source,
            attrs |names| if *start != 0.0 {
                format!("\"{name}\", start={start}")
            } else {
                format!("\"{name}\"")
            };
        /// The scalar 1 in a step that trains (or computes gradients), 0 in an evaluation: what
        /// BatchNorm blends its batch and running statistics by.
        Training = "training", 0, Source, training_shape, free, vjp::source;
        /// A tensor filled with one value.
        Fill { value: f64, ty: TensorType } =
            "fill", 0, Source, fill_shape, free, vjp::source,
            attrs |names| format!("value={value}");

        // ---- GEMM and convolution ----
        /// `op(a) x op(b)`, `op` transposing the last two axes when its flag is set:
        /// `[.., M, K] x [.., K, N]`; `b` may be 2-D and shared by every batch of `a`.
        MatMul { trans_a: bool, trans_b: bool } =
            "matmul", 2, Gemm, matmul_shape, matmul_flops, vjp::matmul,
            attrs |names| {
                let t: Vec<&str> = [(*trans_a, "trans_a"), (*trans_b, "trans_b")]
                    .iter()
                    .filter(|(on, _)| *on)
                    .map(|(_, s)| *s)
                    .collect();
                t.join(", ")
            };
        /// `x [N, C, H, W]`, `w [O, C/groups, K, K]`.
        Conv2d { stride: u64, padding: u64, groups: u64 } =
            "conv2d", 2, Conv, conv_shape, conv_flops, vjp::conv2d,
            attrs |names| format!("stride={stride}, padding={padding}, groups={groups}");
        /// The input gradient of a convolution: `dy [N, O, Ho, Wo]`, `w` to `[N, C, in_h, in_w]`.
        Conv2dGradInput { stride: u64, padding: u64, groups: u64, in_h: u64, in_w: u64 } =
            "conv2d_grad_input", 2, Conv, conv_grad_input_shape, conv_grad_input_flops, vjp::none,
            attrs |names| format!(
                "stride={stride}, padding={padding}, groups={groups}, in={in_h}x{in_w}"
            );
        /// The weight gradient: `x [N, C, H, W]`, `dy [N, O, Ho, Wo]` to `[O, C/groups, K, K]`.
        Conv2dGradWeight { stride: u64, padding: u64, groups: u64, kernel: u64 } =
            "conv2d_grad_weight", 2, Conv, conv_grad_weight_shape, conv_grad_weight_flops,
            vjp::none,
            attrs |names| format!(
                "stride={stride}, padding={padding}, groups={groups}, kernel={kernel}"
            );
        Pool2d { max: bool, kernel: u64, stride: u64, padding: u64 } =
            "pool2d", 1, Reduction, pool_shape, pool_flops, vjp::pool2d,
            attrs |names| pool_attrs(*max, *kernel, *stride, *padding);
        /// `(x, dy)` to the gradient of a pooling of `x`.
        Pool2dGrad { max: bool, kernel: u64, stride: u64, padding: u64 } =
            "pool2d_grad", 2, Reduction, pool_grad_shape, pool_grad_flops, vjp::none,
            attrs |names| pool_attrs(*max, *kernel, *stride, *padding);

        // ---- layout ----
        /// To `shape` (the whole shape, batch included), same element count.
        Reshape { shape: Vec<Dim> } =
            "reshape", 1, Layout, reshape_shape, free, vjp::reshape,
            attrs |names| dims(shape, names);
        Permute { perm: Vec<usize> } =
            "permute", 1, Layout, permute_shape, free, vjp::permute,
            attrs |names| format!("{perm:?}");
        Concat { axis: usize } =
            "concat", 2, Layout, concat_shape, free, vjp::concat,
            attrs |names| format!("axis={axis}");
        Slice { axis: usize, start: u64, len: Dim } =
            "slice", 1, Layout, slice_shape, free, vjp::slice,
            attrs |names| format!("axis={axis}, start={start}, len={}", len.show(names));
        /// Zeros of `size` along `axis` with the operand at `start`: the inverse of `Slice`.
        Pad { axis: usize, start: u64, size: Dim } =
            "pad", 1, Layout, pad_shape, free, vjp::pad,
            attrs |names| format!("axis={axis}, start={start}, size={}", size.show(names));
        /// Rows of `table [V, D]` at integer `indices [..]`: `[.., D]`.
        Gather = "gather", 2, Layout, gather_shape, free, vjp::gather;
        /// `(indices [..], dy [.., D])` summed into `[rows, D]`: the gradient of `Gather`.
        ScatterAdd { rows: u64 } =
            "scatter_add", 2, Layout, scatter_add_shape, per_in::<1, 1>, vjp::none,
            attrs |names| format!("rows={rows}");

        // ---- elementwise (numpy broadcasting for two operands) ----
        Add = "add", 2, Elementwise, broadcast_shape, per_out::<1>, vjp::add,
            map maps::ADD, example Op::Add;
        Sub = "sub", 2, Elementwise, broadcast_shape, per_out::<1>, vjp::sub,
            map maps::SUB, example Op::Sub;
        Mul = "mul", 2, Elementwise, broadcast_shape, per_out::<1>, vjp::mul,
            map maps::MUL, example Op::Mul;
        Div = "div", 2, Elementwise, broadcast_shape, per_out::<1>, vjp::div,
            map maps::DIV, example Op::Div;
        Scale { by: f64 } = "scale", 1, Elementwise, float_same, per_out::<1>, vjp::scale,
            map maps::SCALE { by }, example Op::Scale { by: 0.5 },
            attrs |names| format!("by={by}");
        AddScalar { value: f64 } =
            "add_scalar", 1, Elementwise, float_same, per_out::<1>, vjp::identity,
            map maps::ADD_SCALAR { value }, example Op::AddScalar { value: 1.0 },
            attrs |names| format!("value={value}");
        /// `min(x, value)`
        ClampMax { value: f64 } =
            "clamp_max", 1, Elementwise, float_same, per_out::<1>, vjp::none,
            map maps::CLAMP_MAX { value }, example Op::ClampMax { value: 2.0 },
            attrs |names| format!("value={value}");
        Sqrt = "sqrt", 1, Elementwise, float_same, per_out::<1>, vjp::sqrt,
            map maps::SQRT, example Op::Sqrt;
        Relu = "relu", 1, Elementwise, float_same, per_out::<1>, vjp::relu,
            map maps::RELU, example Op::Relu;
        /// The exact (erf) GELU, as PyTorch's default.
        Gelu = "gelu", 1, Elementwise, float_same, per_out::<8>, vjp::gelu,
            map maps::GELU, example Op::Gelu;
        Tanh = "tanh", 1, Elementwise, float_same, per_out::<4>, vjp::tanh,
            map maps::TANH, example Op::Tanh;
        Sigmoid = "sigmoid", 1, Elementwise, float_same, per_out::<4>, vjp::sigmoid,
            map maps::SIGMOID, example Op::Sigmoid;
        /// `x * sigmoid(x)` (SiLU, or swish), as PyTorch's `F.silu`.
        Silu = "silu", 1, Elementwise, float_same, per_out::<5>, vjp::silu,
            map maps::SILU, example Op::Silu;
        /// `min(max(x, 0), 6)`, as PyTorch's `F.relu6` (MobileNet's activation).
        Relu6 = "relu6", 1, Elementwise, float_same, per_out::<2>, vjp::relu6,
            map maps::RELU6, example Op::Relu6;
        /// `(x, dy)`: `dy * (x > 0)`.
        ReluGrad = "relu_grad", 2, Elementwise, same_pair, per_out::<1>, vjp::none,
            map maps::RELU_GRAD, example Op::ReluGrad;
        /// `(x, dy)`: `dy * gelu'(x)`.
        GeluGrad = "gelu_grad", 2, Elementwise, same_pair, per_out::<12>, vjp::none,
            map maps::GELU_GRAD, example Op::GeluGrad;
        /// `(y, dy)` with `y = tanh(x)`: `dy * (1 - y^2)`.
        TanhGrad = "tanh_grad", 2, Elementwise, same_pair, per_out::<3>, vjp::none,
            map maps::TANH_GRAD, example Op::TanhGrad;
        /// `(y, dy)` with `y = sigmoid(x)`: `dy * y * (1 - y)`.
        SigmoidGrad = "sigmoid_grad", 2, Elementwise, same_pair, per_out::<3>, vjp::none,
            map maps::SIGMOID_GRAD, example Op::SigmoidGrad;
        /// `(x, dy)`: `dy * s * (1 + x * (1 - s))` with `s = sigmoid(x)`.
        SiluGrad = "silu_grad", 2, Elementwise, same_pair, per_out::<8>, vjp::none,
            map maps::SILU_GRAD, example Op::SiluGrad;
        /// `(x, dy)`: `dy * (0 < x < 6)`.
        Relu6Grad = "relu6_grad", 2, Elementwise, same_pair, per_out::<2>, vjp::none,
            map maps::RELU6_GRAD, example Op::Relu6Grad;
        /// Each element to the nearest bf16 (ties to even), kept in f32: the copy of a weight
        /// that a matmul multiplies when activations are stored in bf16 (as a bf16 GEMM does);
        /// its gradient passes through unchanged.
        RoundBf16 = "round_bf16", 1, Elementwise, float_same, per_out::<1>, vjp::identity,
            map maps::ROUND_BF16, example Op::RoundBf16;
        /// Zeroes elements with probability `p` and scales the rest by `1/(1-p)`; the mask is
        /// keyed by (seed, step, `stream`, sample, element), so it is the same on any device
        /// count and the same op applied to the gradient uses the same mask.
        Dropout { p: f64, stream: u64 } =
            "dropout", 1, Elementwise, float_same, per_out::<2>, vjp::dropout,
            example Op::Dropout { p: 0.1, stream: 3 },
            attrs |names| format!("p={p}, stream={stream}");

        // ---- reductions ----
        /// Over the last axis; `causal` masks key positions after the query's.
        Softmax { causal: bool } =
            "softmax", 1, Reduction, softmax_shape, per_out::<5>, vjp::softmax,
            attrs |names| flag(*causal, "causal");
        /// `(y, dy)` with `y` the softmax: `y * (dy - sum(dy * y))` over the last axis.
        SoftmaxGrad = "softmax_grad", 2, Reduction, same_pair, per_out::<4>, vjp::none;
        /// Normalise over the last axis (no affine: that is a Mul and an Add).
        LayerNorm { eps: f64 } =
            "layer_norm", 1, Reduction, last_axis_norm, per_out::<8>, vjp::layer_norm,
            attrs |names| format!("eps={eps:e}");
        /// `(x, dy)`: the gradient of `LayerNorm` at `x`.
        LayerNormGrad { eps: f64 } =
            "layer_norm_grad", 2, Reduction, same_pair, per_out::<12>, vjp::none,
            attrs |names| format!("eps={eps:e}");
        RmsNorm { eps: f64 } =
            "rms_norm", 1, Reduction, last_axis_norm, per_out::<5>, vjp::rms_norm,
            attrs |names| format!("eps={eps:e}");
        RmsNormGrad { eps: f64 } =
            "rms_norm_grad", 2, Reduction, same_pair, per_out::<8>, vjp::none,
            attrs |names| format!("eps={eps:e}");
        ReduceSum { axes: Vec<usize> } =
            "reduce_sum", 1, Reduction, reduce_sum_shape, per_in::<0, 1>, vjp::reduce_sum,
            attrs |names| format!("axes={axes:?}");
        ReduceMean { axes: Vec<usize> } =
            "reduce_mean", 1, Reduction, reduce_mean_shape, per_in::<0, 1>, vjp::reduce_mean,
            attrs |names| format!("axes={axes:?}");
        /// Sums a broadcast operand back down to `shape` (the gradient of broadcasting).
        SumTo { shape: Vec<Dim> } =
            "sum_to", 1, Reduction, sum_to_shape, per_in::<0, 1>, vjp::none,
            attrs |names| dims(shape, names);
        /// Repeats the operand along `axes` to `shape`, divided by the repeat count if `mean`
        /// (the gradient of `ReduceSum` / `ReduceMean`).
        Expand { axes: Vec<usize>, shape: Vec<Dim>, mean: bool } =
            "expand", 1, Layout, expand_shape, per_out::<1>, vjp::none,
            attrs |names| format!("axes={axes:?}, {}{}", dims(shape, names), flag(*mean, ", mean"));
        /// Mean cross-entropy of `logits [.., C]` against integer `labels [..]`.
        CrossEntropy { smoothing: f64 } =
            "cross_entropy", 2, Reduction, xent_shape, per_in::<0, 5>, vjp::cross_entropy,
            attrs |names| flag(*smoothing != 0.0, &format!("smoothing={smoothing}"));
        /// `(logits, labels, dloss)` to the gradient with respect to the logits.
        CrossEntropyGrad { smoothing: f64 } =
            "cross_entropy_grad", 3, Reduction, xent_grad_shape, per_in::<0, 5>, vjp::none,
            attrs |names| flag(*smoothing != 0.0, &format!("smoothing={smoothing}"));

        // ---- attention ----
        /// `softmax(scale * q k^T, masked when causal) v` per head, token-major: `q [.., T, H,
        /// D]`, `k [.., S, H, D]`, `v [.., S, H, E]` to `[.., T, H, E]` (a projection's output
        /// reshaped, no permute). One op, so the `T x S` scores are never stored: the kernel
        /// streams tiles of keys with an online softmax.
        Attention { causal: bool, scale: f64 } =
            "attention", 3, Attention, attention_shape, attention_flops, vjp::attention,
            attrs |names| format!("scale={scale}{}", flag(*causal, ", causal"));
        /// `(q, k)` to each query's log-sum-exp of its scaled, masked scores, `[.., T, H]`:
        /// what the backward reads instead of the probabilities. The fuse pass runs it in the
        /// same kernel as the `Attention` of the same `q` and `k`.
        AttentionLse { causal: bool, scale: f64 } =
            "attention_lse", 2, Attention, attention_lse_shape, attention_lse_flops, vjp::none,
            attrs |names| format!("scale={scale}{}", flag(*causal, ", causal"));
        /// `(q, k, v, dy, lse, delta)` to the gradient of `Attention` with respect to `wrt`,
        /// with `lse` from `AttentionLse` and `delta = rowsum(dy * y)`: the probabilities are
        /// recomputed tile by tile. The fuse pass runs the key and value gradients in one
        /// kernel.
        AttentionGrad { causal: bool, scale: f64, wrt: AttentionInput } =
            "attention_grad", 6, Attention, attention_grad_shape, attention_grad_flops, vjp::none,
            attrs |names| format!("wrt={wrt:?}, scale={scale}{}", flag(*causal, ", causal"));
        /// `(cache [.., S, H, D], rows [.., T, H, D], pos [..] integer)` to the cache with row
        /// `pos + t` replaced by `rows[t]`: a decode step's key or value cache, updated where
        /// it lives (the schedule writes it over its `State`, which persists between steps).
        CacheWrite = "cache_write", 3, Layout, cache_write_shape, free, vjp::none;
        /// `(q [.., T, H, D], k [.., S, H, D], v [.., S, H, E], pos [..] integer)` to
        /// `[.., T, H, E]`: query `t` at position `pos + t` attends to cache rows `0..=pos + t`
        /// (a decode step over its key and value caches; the causal mask is the position).
        CachedAttention { scale: f64 } =
            "cached_attention", 4, Attention, cached_attention_shape, cached_attention_flops,
            vjp::none,
            attrs |names| format!("scale={scale}");

        // ---- collectives ----
        /// The sum of the operand over a group of devices. Over `Shards` (every micro-shard of
        /// data parallelism) it follows a fixed tree over shard index, so the bits do not
        /// depend on how shards sit on devices; over `Tensor` it sums a row-parallel layer's
        /// partial products across the tensor-parallel ranks. With one member it is the
        /// identity.
        AllReduce { group: Group } =
            "all_reduce", 1, Collective, float_same, per_out::<1>, vjp::all_reduce,
            attrs |names| match group {
                Group::Shards => "group=shards".to_string(),
                Group::Tensor => "group=tensor".to_string(),
            };
        /// The identity on a value every tensor-parallel rank holds, entering a column-parallel
        /// layer: its gradient is the sum over the ranks of theirs.
        TensorParallelCopy =
            "tensor_parallel_copy", 1, Layout, float_same, free, vjp::tensor_parallel_copy;
        /// A value one pipeline stage computed, sent to a later (or, in backward, earlier)
        /// stage that reads it: the send and the receive of one point-to-point transfer.
        Transfer { from: u32, to: u32 } =
            "transfer", 1, Collective, any_same, free, vjp::none,
            attrs |names| format!("from={from}, to={to}");
        /// The value data-parallel rank `root` computed, on every rank: a parameter updated by
        /// the rank that holds its optimizer state (ZeRO-1).
        Broadcast { root: u32 } =
            "broadcast", 1, Collective, any_same, free, vjp::none,
            attrs |names| format!("root={root}");
        /// The sum over every micro-shard, like `AllReduce` over shards (the same tree, the
        /// same bits), delivered only to data-parallel rank `root`: a gradient under ZeRO-2,
        /// where each rank keeps the reduced gradients of the parameters it updates (together,
        /// a reduce-scatter).
        Reduce { root: u32 } =
            "reduce", 1, Collective, float_same, per_out::<1>, vjp::none,
            attrs |names| format!("root={root}");
    } };
}

/// The ops with a map (`maps`), as a pattern: a backend's match over ops covers the whole
/// elementwise family in one arm (`map_ops!() => ..op.map()..`) and names every other op, so
/// it needs no wildcard and a new op without a backend piece does not compile. Made from the
/// entries with a `map` column.
#[macro_export]
macro_rules! map_ops {
    () => {
        $crate::__parallax_ops!($crate::__parallax_map_ops)
    };
}

/// `map_ops!`'s filter: the variants whose entry has a map, as an or-pattern.
#[doc(hidden)]
#[macro_export]
macro_rules! __parallax_map_ops {
    ($($doc:tt $op:ident $fields:tt $name:tt $arity:tt $class:tt $shape:tt $flops:tt $vjp:tt
        [$($map:tt $($param:tt)?)?] $example:tt $attrs:tt;)*) => {
        $crate::__parallax_map_ops!(@keep [] $($op [$($map)?])*)
    };
    (@keep [$($kept:ident)*]) => {
        $($crate::ir::Op::$kept { .. })|*
    };
    (@keep [$($kept:ident)*] $op:ident [] $($rest:tt)*) => {
        $crate::__parallax_map_ops!(@keep [$($kept)*] $($rest)*)
    };
    (@keep [$($kept:ident)*] $op:ident [$map:tt] $($rest:tt)*) => {
        $crate::__parallax_map_ops!(@keep [$($kept)* $op] $($rest)*)
    };
}

/// The entries made into the `Op` type: the enum, its fieldless `OpKind`, and the columns
/// that need nothing but the op (its kind, name, attributes, the elementwise examples).
macro_rules! op_type {
    ($([$($doc:tt)*] $op:ident [$({ $($field:ident : $ty:ty),* })?] $name:literal $arity:tt
        $class:tt $shape:tt $flops:tt $vjp:tt $map:tt [$($example:tt)?]
        [$($names:ident ($attrs:expr))?];)*) => {
        /// A primitive op with its attributes.
        #[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
        pub enum Op {
            $($($doc)* $op $({ $($field: $ty),* })?,)*
        }

        /// An op without its attributes: its row of the table (`OPS[kind as usize]`).
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
        )]
        pub enum OpKind {
            $($op,)*
        }

        /// How many ops there are.
        pub const OP_COUNT: usize = [$(OpKind::$op),*].len();

        impl Op {
            pub fn kind(&self) -> OpKind {
                match self {
                    $(Op::$op { .. } => OpKind::$op,)*
                }
            }

            /// The op's name, as the printer and messages write it.
            pub fn name(&self) -> &'static str {
                match self {
                    $(Op::$op { .. } => $name,)*
                }
            }

            /// Attributes as stable text, `stride=2, padding=1` (empty when none): the IR
            /// printer's `%3 = conv2d(%1, %2; stride=2, padding=1, groups=1)`.
            #[allow(unused_variables)]
            pub fn attrs(&self, names: &[String]) -> String {
                match self {
                    $(Op::$op $({ $($field),* })? => op_type!(@attrs names $($names $attrs)?),)*
                }
            }
        }

        /// One op of each elementwise row of the table, with sample attributes, in table
        /// order: what the backends' tests walk, so an elementwise row without a CPU map or a
        /// PTX arm fails a test (a unit test checks that it covers the table).
        pub fn elementwise_examples() -> Vec<Op> {
            vec![$($($example,)?)*]
        }
    };
    (@attrs $given:ident) => {
        String::new()
    };
    (@attrs $given:ident $names:ident $attrs:expr) => {{
        let $names = $given;
        $attrs
    }};
}

crate::__parallax_ops!(op_type);

/// `[a, b]` with each size shown by `names`.
fn dims(d: &[Dim], names: &[String]) -> String {
    let v: Vec<String> = d.iter().map(|x| x.show(names)).collect();
    format!("[{}]", v.join(", "))
}

fn flag(on: bool, s: &str) -> String {
    if on {
        s.to_string()
    } else {
        String::new()
    }
}

fn pool_attrs(max: bool, kernel: u64, stride: u64, padding: u64) -> String {
    let kind = if max { "max" } else { "avg" };
    format!("{kind}, kernel={kernel}, stride={stride}, padding={padding}")
}
