//! CPU kernels, one per primitive op of the compiler's op table, dispatched by `execute`.
//!
//! Conventions: `out` arrives shaped (its buffer sized to its shape) and every kernel
//! overwrites all of it. Kernels never evaluate symbolic sizes: the executor resolved every
//! shape, and attributes such as a slice's length are read from the output's shape.
//! Reductions run in a fixed order inside each output element, so results do not depend on
//! how many threads ran them.

pub mod attention;
pub mod cache;
pub mod conv;
pub mod elementwise;
pub mod gemm;
pub mod layout;
pub mod norms;
/// The transcendental functions, shared with the op table's CPU column.
pub use parallax_compiler::scalar::math;
pub mod pool;
pub mod reduce;
pub mod rows;
pub mod scratch;
pub mod simd;
#[cfg(test)]
pub(crate) mod testutil;

use super::tensor::Tensor;

/// Shape metadata of a kernel (axes, strides), on the stack for ranks up to 8: a
/// steady-state step allocates nothing for it.
pub type Small<T> = smallvec::SmallVec<[T; 8]>;
use parallax_compiler::ir::{AttentionInput, Op};

/// What a kernel needs besides its operands.
#[derive(Debug, Clone, Copy)]
pub struct Ctx {
    pub seed: u64,
    /// The training step (keys dropout masks).
    pub step: u64,
    /// Training mode: dropout active. In evaluation dropout is the identity.
    pub training: bool,
    /// The index, within the global batch, of this batch's first sample (keys dropout masks
    /// by sample, so they do not depend on how the batch was split).
    pub first_sample: u64,
}

pub use crate::exec::KernelError;

/// Runs `op` on `ins` into `out`.
pub fn execute(op: &Op, ins: &[&Tensor], out: &mut Tensor, ctx: &Ctx) -> Result<(), KernelError> {
    use elementwise as ew;
    match op {
        // Sources hold values the executor sets (inputs, parameters, state).
        Op::Input { .. } | Op::Param { .. } | Op::State { .. } | Op::Training => Ok(()),
        Op::Fill { value, .. } => {
            out.f32_mut().fill(*value as f32);
            Ok(())
        }
        Op::MatMul { trans_a, trans_b } => gemm::matmul(ins[0], ins[1], *trans_a, *trans_b, out),
        Op::Conv2d {
            stride,
            padding,
            groups,
        } => conv::conv2d(
            ins[0],
            ins[1],
            *stride as usize,
            *padding as usize,
            *groups as usize,
            out,
        ),
        Op::Conv2dGradInput {
            stride,
            padding,
            groups,
            ..
        } => conv::conv2d_grad_input(
            ins[0],
            ins[1],
            *stride as usize,
            *padding as usize,
            *groups as usize,
            out,
        ),
        Op::Conv2dGradWeight {
            stride,
            padding,
            groups,
            ..
        } => conv::conv2d_grad_weight(
            ins[0],
            ins[1],
            *stride as usize,
            *padding as usize,
            *groups as usize,
            out,
        ),
        Op::Pool2d {
            max,
            kernel,
            stride,
            padding,
        } => pool::pool2d(
            ins[0],
            *max,
            *kernel as usize,
            *stride as usize,
            *padding as usize,
            out,
        ),
        Op::Pool2dGrad {
            max,
            kernel,
            stride,
            padding,
        } => pool::pool2d_grad(
            ins[0],
            ins[1],
            *max,
            *kernel as usize,
            *stride as usize,
            *padding as usize,
            out,
        ),
        Op::Reshape { .. } => layout::copy(ins[0], out),
        // Alone, an executor is a one-shard world: the sum over shards is its own value.
        Op::AllReduce { .. }
        | Op::TensorParallelCopy
        | Op::Transfer { .. }
        | Op::Broadcast { .. }
        | Op::Reduce { .. } => layout::copy(ins[0], out),
        Op::Permute { perm } => layout::permute(ins[0], perm, out),
        Op::Concat { axis } => layout::concat(ins[0], ins[1], *axis, out),
        Op::Slice { axis, start, .. } => layout::slice(ins[0], *axis, *start as usize, out),
        Op::Pad { axis, start, .. } => layout::pad(ins[0], *axis, *start as usize, out),
        Op::Gather => layout::gather(ins[0], ins[1], out),
        Op::ScatterAdd { .. } => layout::scatter_add(ins[0], ins[1], out),
        Op::ReduceSum { axes } => reduce::reduce(ins[0], axes, false, out),
        Op::ReduceMean { axes } => reduce::reduce(ins[0], axes, true, out),
        Op::SumTo { .. } => reduce::sum_to(ins[0], out),
        Op::Expand { axes, mean, .. } => reduce::expand(ins[0], axes, *mean, out),
        Op::Dropout { p, stream } => ew::dropout(ins[0], *p, *stream, ctx, out),
        Op::Softmax { causal } => rows::softmax(ins[0], *causal, out),
        Op::Attention { causal, scale } => {
            attention::attention(ins[0], ins[1], ins[2], *causal, *scale, out, None)
        }
        Op::CacheWrite => cache::cache_write(ins[0], ins[1], ins[2], out),
        Op::CachedAttention { scale } => {
            cache::cached_attention(ins[0], ins[1], ins[2], ins[3], *scale, out)
        }
        Op::AttentionLse { causal, scale } => {
            attention::attention_lse(ins[0], ins[1], *causal, *scale, out)
        }
        Op::AttentionGrad { causal, scale, wrt } => {
            let saved = attention::Saved {
                dy: ins[3],
                lse: ins[4],
                delta: ins[5],
            };
            let grads = match wrt {
                AttentionInput::Query => attention::Grads {
                    dq: Some(out),
                    ..Default::default()
                },
                AttentionInput::Key => attention::Grads {
                    dk: Some(out),
                    ..Default::default()
                },
                AttentionInput::Value => attention::Grads {
                    dv: Some(out),
                    ..Default::default()
                },
            };
            let qkv = (ins[0], ins[1], ins[2]);
            attention::attention_grads(qkv, &saved, *causal, *scale, grads)
        }
        Op::SoftmaxGrad => rows::softmax_grad(ins[0], ins[1], out),
        Op::LayerNorm { eps } => rows::layer_norm(ins[0], *eps as f32, out),
        Op::LayerNormGrad { eps } => rows::layer_norm_grad(ins[0], ins[1], *eps as f32, out),
        Op::RmsNorm { eps } => rows::rms_norm(ins[0], *eps as f32, out),
        Op::RmsNormGrad { eps } => rows::rms_norm_grad(ins[0], ins[1], *eps as f32, out),
        Op::CrossEntropy { smoothing } => {
            rows::cross_entropy(ins[0], ins[1], *smoothing as f32, out)
        }
        Op::CrossEntropyGrad { smoothing } => {
            rows::cross_entropy_grad(ins[0], ins[1], ins[2], *smoothing as f32, out)
        }
        // The plain elementwise maps, as the op table's vector loops.
        parallax_compiler::map_ops!() => match op.map() {
            Some(simd::Elementwise::Unary(u)) => ew::unary(ins[0], out, u),
            Some(simd::Elementwise::Binary(b)) => ew::binary(ins[0], ins[1], out, b),
            None => Err(KernelError::Unsupported(op.name())),
        },
    }
}
