//! The cost rules of the op table: FLOPs of one execution from concrete sizes.

use super::op::Op;

fn numel(s: &[u64]) -> u64 {
    s.iter().fold(1u64, |a, &d| a.saturating_mul(d))
}

pub fn free(_: &Op, _: &[Vec<u64>], _: &[u64]) -> u64 {
    0
}

/// `K` per output element.
pub fn per_out<const K: u64>(_: &Op, _: &[Vec<u64>], out: &[u64]) -> u64 {
    numel(out).saturating_mul(K)
}

/// `K` per element of operand `I`.
pub fn per_in<const I: usize, const K: u64>(_: &Op, ins: &[Vec<u64>], _: &[u64]) -> u64 {
    numel(&ins[I]).saturating_mul(K)
}

/// `2 M N K` per batch: the contracted size is the one axis the output lacks.
pub fn matmul_flops(op: &Op, ins: &[Vec<u64>], out: &[u64]) -> u64 {
    let a = &ins[0];
    let trans_a = matches!(op, Op::MatMul { trans_a: true, .. });
    let k = if trans_a {
        a.get(a.len().wrapping_sub(2)).copied().unwrap_or(1)
    } else {
        a.last().copied().unwrap_or(1)
    };
    numel(out).saturating_mul(k).saturating_mul(2)
}

/// `2` per multiply-add: each output element sums `C/groups * K * K` products.
pub fn conv_flops(_: &Op, ins: &[Vec<u64>], out: &[u64]) -> u64 {
    numel(out)
        .saturating_mul(numel(&ins[1][1..]))
        .saturating_mul(2)
}

/// The same products as the forward convolution: `dy` by the weights.
pub fn conv_grad_input_flops(_: &Op, ins: &[Vec<u64>], _: &[u64]) -> u64 {
    numel(&ins[0])
        .saturating_mul(numel(&ins[1][1..]))
        .saturating_mul(2)
}

pub fn conv_grad_weight_flops(_: &Op, ins: &[Vec<u64>], out: &[u64]) -> u64 {
    numel(&ins[1])
        .saturating_mul(numel(&out[1..]))
        .saturating_mul(2)
}

pub fn pool_flops(op: &Op, _: &[Vec<u64>], out: &[u64]) -> u64 {
    let k = match op {
        Op::Pool2d { kernel, .. } => *kernel,
        _ => 1,
    };
    numel(out).saturating_mul(k.saturating_mul(k))
}

pub fn pool_grad_flops(op: &Op, ins: &[Vec<u64>], _: &[u64]) -> u64 {
    let k = match op {
        Op::Pool2dGrad { kernel, .. } => *kernel,
        _ => 1,
    };
    numel(&ins[1]).saturating_mul(k.saturating_mul(k))
}
