//! Fused elementwise kernels: a chain of elementwise ops evaluated chunk by chunk, each
//! intermediate held in a small register block instead of a buffer. Every element is computed
//! by the same f32 operations as the one-op kernels, so fused and unfused plans give the same
//! bits.

use super::kernels::elementwise::{
    gelu, gelu_grad, relu_grad, sigmoid, sigmoid_grad, tanh_grad, DropoutMask,
};
use super::kernels::{Ctx, KernelError};
use parallax_compiler::ir::Op;
use rayon::prelude::*;

thread_local! {
    static REGISTERS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

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

/// One op of a fused kernel. The op is borrowed from the executor's plan, which outlives
/// every call that reads it.
#[derive(Debug, Clone)]
pub struct FusedOp {
    pub op: *const Op,
    pub operands: [Source; 2],
    /// Where to store the result, if anything outside the kernel reads it.
    pub store: Option<*mut f32>,
}

struct Ptr<T>(T);
// SAFETY: the pointers address buffers the executor keeps alive and unaliased for the call;
// chunks write disjoint ranges.
unsafe impl<T> Send for Ptr<T> {}
unsafe impl<T> Sync for Ptr<T> {}

/// The operand's values for elements `start..start + len`: a register, a slice of memory,
/// or (for a repeated operand) a copy into `tmp` made by a wrapping index, without a division
/// per element.
#[inline]
fn view<'r>(
    src: Source,
    done: &'r [f32],
    tmp: &'r mut [f32],
    start: usize,
    len: usize,
) -> &'r [f32] {
    match src {
        Source::Register(r) => &done[r * CHUNK..r * CHUNK + len],
        Source::Memory(p, n) if n >= start + len => {
            // SAFETY: the buffer holds `n` elements, and `start + len <= n`.
            unsafe { std::slice::from_raw_parts(p.add(start), len) }
        }
        Source::Memory(p, n) => {
            let mut i = start % n;
            for t in tmp[..len].iter_mut() {
                // SAFETY: `i < n`, the buffer's length.
                *t = unsafe { *p.add(i) };
                i += 1;
                if i == n {
                    i = 0;
                }
            }
            &tmp[..len]
        }
    }
}

fn map1(out: &mut [f32], a: &[f32], f: impl Fn(f32) -> f32) {
    for (o, &x) in out.iter_mut().zip(a) {
        *o = f(x);
    }
}

fn map2(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) {
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

/// Evaluates `ops` over `n` elements (`per_sample` elements per sample, for dropout keys).
pub fn run(ops: &[FusedOp], n: usize, per_sample: usize, ctx: &Ctx) -> Result<(), KernelError> {
    let chunks = n.div_ceil(CHUNK);
    let ops = Ptr(ops);
    let nops = ops.0.len();
    let body = |regs: &mut Vec<f32>, c: usize| {
        let ops = &ops;
        let start = c * CHUNK;
        let len = CHUNK.min(n - start);
        for (r, f) in ops.0.iter().enumerate() {
            let (done, rest) = regs.split_at_mut(r * CHUNK);
            let (out, rest) = rest.split_at_mut(CHUNK);
            let (ta, tb) = rest[(nops - r - 1) * CHUNK..].split_at_mut(CHUNK);
            let out = &mut out[..len];
            let a = view(f.operands[0], done, ta, start, len);
            // SAFETY: as below, the op lives in the executor's plan.
            let parallax_compiler::ir::ops::Arity::Exactly(arity) = unsafe { &*f.op }.def().arity;
            let b: &[f32] = if arity == 2 {
                view(f.operands[1], done, tb, start, len)
            } else {
                &[]
            };
            // SAFETY: the op lives in the plan the executor holds for this call.
            let op = unsafe { &*f.op };
            match op {
                Op::Add => map2(out, a, b, |x, y| x + y),
                Op::Sub => map2(out, a, b, |x, y| x - y),
                Op::Mul => map2(out, a, b, |x, y| x * y),
                Op::Div => map2(out, a, b, |x, y| x / y),
                Op::Scale { by } => {
                    let by = *by as f32;
                    map1(out, a, |x| x * by)
                }
                Op::AddScalar { value } => {
                    let v = *value as f32;
                    map1(out, a, |x| x + v)
                }
                Op::ClampMax { value } => {
                    let v = *value as f32;
                    map1(out, a, |x| x.min(v))
                }
                Op::Sqrt => map1(out, a, f32::sqrt),
                Op::Relu => map1(out, a, |x| x.max(0.0)),
                Op::Gelu => map1(out, a, gelu),
                Op::Tanh => map1(out, a, f32::tanh),
                Op::Sigmoid => map1(out, a, sigmoid),
                Op::ReluGrad => map2(out, a, b, relu_grad),
                Op::GeluGrad => map2(out, a, b, |x, dy| dy * gelu_grad(x)),
                Op::TanhGrad => map2(out, a, b, tanh_grad),
                Op::SigmoidGrad => map2(out, a, b, sigmoid_grad),
                Op::Dropout { p, stream } => match DropoutMask::new(*p, *stream, ctx, per_sample) {
                    None => out.copy_from_slice(a),
                    Some(mask) => {
                        for (k, (o, &x)) in out.iter_mut().zip(a).enumerate() {
                            *o = mask.apply(start + k, x);
                        }
                    }
                },
                other => unreachable!("`{}` is not elementwise", other.name()),
            }
            if let Some(dst) = f.store {
                // SAFETY: each chunk writes its own range of a buffer of at least `n` elements.
                unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), dst.add(start), len) };
            }
        }
    };
    // One register per op, then two for repeated operands; each thread keeps its block, so a
    // steady-state step does not allocate them.
    let regs = (nops + 2) * CHUNK;
    let with_registers = |c: usize| {
        REGISTERS.with(|r| {
            let mut r = r.borrow_mut();
            if r.len() < regs {
                r.resize(regs, 0.0);
            }
            body(&mut r, c)
        })
    };
    if chunks > 8 {
        (0..chunks).into_par_iter().for_each(with_registers);
    } else {
        (0..chunks).for_each(with_registers);
    }
    Ok(())
}
