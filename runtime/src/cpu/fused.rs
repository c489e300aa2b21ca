//! Fused elementwise kernels: a chain of elementwise ops evaluated chunk by chunk, each
//! intermediate held in a small register block instead of a buffer. Every element is computed
//! by the same f32 operations as the one-op kernels, so fused and unfused plans give the same
//! bits.

use super::kernels::elementwise::{gelu, gelu_grad, sigmoid};
use super::kernels::{Ctx, KernelError};
use crate::rng;
use parallax_compiler::ir::Op;
use rayon::prelude::*;

/// Elements per chunk: a few registers of this size stay in the L1 cache.
pub const CHUNK: usize = 1024;

/// Where an operand of a fused op comes from.
#[derive(Debug, Clone, Copy)]
pub enum Source {
    /// An earlier op of the kernel (its register).
    Register(usize),
    /// A stored value, read at element `i` as `data[i % len]` (same shape, a bias, a scalar).
    Memory(*const f32, usize),
}

/// One op of a fused kernel.
#[derive(Debug, Clone)]
pub struct FusedOp<'a> {
    pub op: &'a Op,
    pub operands: [Source; 2],
    /// Where to store the result, if anything outside the kernel reads it.
    pub store: Option<*mut f32>,
}

struct Ptr<T>(T);
// SAFETY: the pointers address buffers the executor keeps alive and unaliased for the call;
// chunks write disjoint ranges.
unsafe impl<T> Send for Ptr<T> {}
unsafe impl<T> Sync for Ptr<T> {}

#[inline]
fn read(src: Source, regs: &[f32], start: usize, k: usize) -> f32 {
    match src {
        Source::Register(r) => regs[r * CHUNK + k],
        // SAFETY: `len` is the buffer's length; the index is reduced modulo it.
        Source::Memory(p, len) => unsafe { *p.add((start + k) % len) },
    }
}

/// Evaluates `ops` over `n` elements (`per_sample` elements per sample, for dropout keys).
pub fn run(ops: &[FusedOp], n: usize, per_sample: usize, ctx: &Ctx) -> Result<(), KernelError> {
    let chunks = n.div_ceil(CHUNK);
    let ops = Ptr(ops);
    let body = |regs: &mut Vec<f32>, c: usize| {
        let ops = &ops;
        let start = c * CHUNK;
        let len = CHUNK.min(n - start);
        for (r, f) in ops.0.iter().enumerate() {
            let (done, rest) = regs.split_at_mut(r * CHUNK);
            let out = &mut rest[..len];
            let a = |k: usize| read(f.operands[0], done, start, k);
            let b = |k: usize| read(f.operands[1], done, start, k);
            match f.op {
                Op::Add => (0..len).for_each(|k| out[k] = a(k) + b(k)),
                Op::Sub => (0..len).for_each(|k| out[k] = a(k) - b(k)),
                Op::Mul => (0..len).for_each(|k| out[k] = a(k) * b(k)),
                Op::Div => (0..len).for_each(|k| out[k] = a(k) / b(k)),
                Op::Scale { by } => {
                    let by = *by as f32;
                    (0..len).for_each(|k| out[k] = a(k) * by)
                }
                Op::AddScalar { value } => {
                    let v = *value as f32;
                    (0..len).for_each(|k| out[k] = a(k) + v)
                }
                Op::ClampMax { value } => {
                    let v = *value as f32;
                    (0..len).for_each(|k| out[k] = a(k).min(v))
                }
                Op::Sqrt => (0..len).for_each(|k| out[k] = a(k).sqrt()),
                Op::Relu => (0..len).for_each(|k| out[k] = a(k).max(0.0)),
                Op::Gelu => (0..len).for_each(|k| out[k] = gelu(a(k))),
                Op::Tanh => (0..len).for_each(|k| out[k] = a(k).tanh()),
                Op::Sigmoid => (0..len).for_each(|k| out[k] = sigmoid(a(k))),
                Op::ReluGrad => (0..len).for_each(|k| out[k] = if a(k) > 0.0 { b(k) } else { 0.0 }),
                Op::GeluGrad => (0..len).for_each(|k| out[k] = b(k) * gelu_grad(a(k))),
                Op::TanhGrad => (0..len).for_each(|k| {
                    let y = a(k);
                    out[k] = b(k) * (1.0 - y * y)
                }),
                Op::SigmoidGrad => (0..len).for_each(|k| {
                    let y = a(k);
                    out[k] = b(k) * y * (1.0 - y)
                }),
                Op::Dropout { p, stream } => {
                    if !ctx.training || *p == 0.0 {
                        (0..len).for_each(|k| out[k] = a(k));
                    } else {
                        let key = rng::stream(
                            rng::mix(ctx.seed ^ rng::mix(ctx.step)),
                            rng::Purpose::Dropout,
                            *stream,
                        );
                        let (threshold, scale) = (*p as f32, (1.0 / (1.0 - p)) as f32);
                        for (k, o) in out.iter_mut().enumerate() {
                            let i = start + k;
                            let sample = ctx.first_sample + (i / per_sample) as u64;
                            let index = sample * per_sample as u64 + (i % per_sample) as u64;
                            *o = if rng::uniform(key, index) < threshold {
                                0.0
                            } else {
                                a(k) * scale
                            };
                        }
                    }
                }
                other => unreachable!("`{}` is not elementwise", other.name()),
            }
            if let Some(dst) = f.store {
                // SAFETY: each chunk writes its own range of a buffer of at least `n` elements.
                unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), dst.add(start), len) };
            }
        }
    };
    let regs = ops.0.len() * CHUNK;
    if chunks > 8 {
        (0..chunks)
            .into_par_iter()
            .for_each_init(|| vec![0f32; regs], |r, c| body(r, c));
    } else {
        let mut r = vec![0f32; regs];
        (0..chunks).for_each(|c| body(&mut r, c));
    }
    Ok(())
}
