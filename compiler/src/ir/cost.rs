//! The cost rules of the op table: FLOPs of one execution from concrete sizes. Each takes its
//! op's attributes (`attrs`), binding the ones it reads.

use super::attrs::{self, Attrs};

fn numel(s: &[u64]) -> u64 {
    s.iter().fold(1u64, |a, &d| a.saturating_mul(d))
}

pub fn free(_: impl Attrs, _: &[Vec<u64>], _: &[u64]) -> u64 {
    0
}

/// `K` per output element.
pub fn per_out<const K: u64>(_: impl Attrs, _: &[Vec<u64>], out: &[u64]) -> u64 {
    numel(out).saturating_mul(K)
}

/// `K` per element of operand `I`.
pub fn per_in<const I: usize, const K: u64>(_: impl Attrs, ins: &[Vec<u64>], _: &[u64]) -> u64 {
    numel(&ins[I]).saturating_mul(K)
}

/// `2 M N K` per batch: the contracted size is the one axis the output lacks.
pub fn matmul_flops(
    attrs::MatMul { trans_a, .. }: attrs::MatMul,
    ins: &[Vec<u64>],
    out: &[u64],
) -> u64 {
    let a = &ins[0];
    let k = if *trans_a {
        a.get(a.len().wrapping_sub(2)).copied().unwrap_or(1)
    } else {
        a.last().copied().unwrap_or(1)
    };
    numel(out).saturating_mul(k).saturating_mul(2)
}

/// `2` per multiply-add: each output element sums `C/groups * K * K` products.
pub fn conv_flops(_: attrs::Conv2d, ins: &[Vec<u64>], out: &[u64]) -> u64 {
    numel(out)
        .saturating_mul(numel(&ins[1][1..]))
        .saturating_mul(2)
}

/// The same products as the forward convolution: `dy` by the weights.
pub fn conv_grad_input_flops(_: attrs::Conv2dGradInput, ins: &[Vec<u64>], _: &[u64]) -> u64 {
    numel(&ins[0])
        .saturating_mul(numel(&ins[1][1..]))
        .saturating_mul(2)
}

pub fn conv_grad_weight_flops(_: attrs::Conv2dGradWeight, ins: &[Vec<u64>], out: &[u64]) -> u64 {
    numel(&ins[1])
        .saturating_mul(numel(&out[1..]))
        .saturating_mul(2)
}

pub fn pool_flops(attrs::Pool2d { kernel, .. }: attrs::Pool2d, _: &[Vec<u64>], out: &[u64]) -> u64 {
    numel(out).saturating_mul(kernel.saturating_mul(*kernel))
}

pub fn pool_grad_flops(
    attrs::Pool2dGrad { kernel, .. }: attrs::Pool2dGrad,
    ins: &[Vec<u64>],
    _: &[u64],
) -> u64 {
    numel(&ins[1]).saturating_mul(kernel.saturating_mul(*kernel))
}
