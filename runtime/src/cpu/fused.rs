//! Fused elementwise kernels: a chain of elementwise ops evaluated chunk by chunk, each
//! intermediate held in a small register block instead of a buffer. Every element is computed
//! by the same f32 operations as the one-op kernels, so fused and unfused plans give the same
//! bits.

use super::kernels::elementwise::DropoutMask;
use super::kernels::layout::offset_of;
use super::kernels::simd::{Elementwise, Operand};
use super::kernels::{scratch, Small};
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

/// What one op of a fused kernel computes.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Map(Elementwise),
    Dropout { p: f64, stream: u64 },
}

impl Kind {
    /// `None` for an op that is not elementwise.
    pub fn of(op: &Op) -> Option<Kind> {
        match *op {
            Op::Dropout { p, stream } => Some(Kind::Dropout { p, stream }),
            _ => op.map().map(Kind::Map),
        }
    }
}

/// Where a fused op's result goes.
#[derive(Debug, Clone)]
pub enum Store {
    /// Element `i` at `ptr + i`.
    Dense(*mut f32),
    /// Element `i` at `ptr + offset_of(i / run, outer) + i % run`: a permuted layout that
    /// keeps runs of `run` elements whole (see `cpu::views`).
    Runs {
        ptr: *mut f32,
        run: usize,
        outer: Small<(usize, usize)>,
    },
}

/// One op of a fused kernel.
#[derive(Debug, Clone)]
pub struct FusedOp {
    pub kind: Kind,
    pub operands: [Source; 2],
    /// Where to store the result, if anything outside the kernel reads it.
    pub store: Option<Store>,
    /// Stored in bf16: rounded in its register before it is stored, so that the kernel's
    /// own later ops read what readers outside it load (the same bits however ops fuse).
    pub round: bool,
}

/// The fused ops of the kernel being run, kept between kernels only for their allocation.
#[derive(Default)]
pub struct OpsCache(Vec<FusedOp>);

impl OpsCache {
    /// The (empty) list to fill for a kernel.
    pub fn take(&mut self) -> Vec<FusedOp> {
        std::mem::take(&mut self.0)
    }

    /// Keeps `ops`'s allocation for the next kernel, not its contents.
    pub fn keep(&mut self, mut ops: Vec<FusedOp>) {
        ops.clear();
        self.0 = ops;
    }
}

// SAFETY: an `OpsCache` holds no op between kernels (`keep` clears the list), so the raw
// pointers a `FusedOp` holds never outlive the kernel call that made them; an executor, and
// this empty list with it, may move to another thread (a simulated device's).
unsafe impl Send for OpsCache {}

struct Ptr<T>(T);
// SAFETY: the pointers address buffers the executor keeps alive and unaliased for the call;
// chunks write disjoint ranges.
unsafe impl<T> Send for Ptr<T> {}
unsafe impl<T> Sync for Ptr<T> {}

/// The operand's values for elements `start..start + len`: a register, a slice of memory,
/// or (for a repeated operand) a copy into `tmp` made run by run.
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
        // The whole operand, or a chunk inside one run of a repeated one.
        Source::Memory(p, n) if start % n + len <= n => {
            // SAFETY: the buffer holds `n` elements, and `start % n + len <= n`.
            unsafe { std::slice::from_raw_parts(p.add(start % n), len) }
        }
        Source::Memory(p, n) => {
            // SAFETY: the buffer holds `n` elements.
            let src = unsafe { std::slice::from_raw_parts(p, n) };
            // Whole runs of the repeated operand, copied a run at a time.
            let (mut at, mut i) = (0, start % n);
            while at < len {
                let run = (n - i).min(len - at);
                tmp[at..at + run].copy_from_slice(&src[i..i + run]);
                at += run;
                i = 0;
            }
            &tmp[..len]
        }
    }
}

/// A stored operand whose elements `start..start + len` wrap around its end (a bias
/// repeated within the chunk): its values.
fn wrapping<'a>(src: Source, start: usize, len: usize) -> Option<&'a [f32]> {
    match src {
        // SAFETY: the buffer holds `n` elements, alive for the kernel call.
        Source::Memory(p, n) if start % n + len > n => {
            Some(unsafe { std::slice::from_raw_parts(p, n) })
        }
        _ => None,
    }
}

/// The pieces of elements `start..start + len` over which an operand read at `i % n` does
/// not wrap: each piece's range in the chunk and in the operand.
fn runs(
    n: usize,
    start: usize,
    len: usize,
) -> impl Iterator<Item = (std::ops::Range<usize>, std::ops::Range<usize>)> {
    let mut at = 0;
    std::iter::from_fn(move || {
        (at < len).then(|| {
            let i = (start + at) % n;
            let take = (n - i).min(len - at);
            at += take;
            (at - take..at, i..i + take)
        })
    })
}

/// The value of a one-element operand.
fn scalar(src: Source) -> Option<f32> {
    match src {
        // SAFETY: the buffer holds one element.
        Source::Memory(p, 1) => Some(unsafe { *p }),
        _ => None,
    }
}

/// Evaluates `ops` at elements `start..start + len` (at most `CHUNK`) into `regs`, one
/// register of `CHUNK` values per op (then two for repeated operands), storing the stored ones.
fn eval(ops: &[FusedOp], regs: &mut [f32], start: usize, len: usize, per_sample: usize, ctx: &Ctx) {
    let nops = ops.len();
    for (r, f) in ops.iter().enumerate() {
        let (done, rest) = regs.split_at_mut(r * CHUNK);
        let (out, rest) = rest.split_at_mut(CHUNK);
        let (ta, tb) = rest[(nops - r - 1) * CHUNK..].split_at_mut(CHUNK);
        let out = &mut out[..len];
        match f.kind {
            Kind::Map(Elementwise::Unary(u)) => {
                u.run(out, view(f.operands[0], done, ta, start, len))
            }
            // A one-value operand (a learning rate, a scalar) is passed as such.
            Kind::Map(Elementwise::Binary(op)) => match f.operands.map(scalar) {
                [_, Some(y)] => {
                    let a = view(f.operands[0], done, ta, start, len);
                    op.run(out, a, Operand::All(y), false)
                }
                [Some(x), None] => {
                    let b = view(f.operands[1], done, tb, start, len);
                    op.run(out, b, Operand::All(x), true)
                }
                // A repeated operand (a bias) read run by run in place, not copied.
                [None, None] => match f.operands.map(|x| wrapping(x, start, len)) {
                    [None, Some(rep)] => {
                        let a = view(f.operands[0], done, ta, start, len);
                        for (at, i) in runs(rep.len(), start, len) {
                            op.run(&mut out[at.clone()], &a[at], Operand::Each(&rep[i]), false)
                        }
                    }
                    [Some(rep), None] => {
                        let b = view(f.operands[1], done, tb, start, len);
                        for (at, i) in runs(rep.len(), start, len) {
                            op.run(&mut out[at.clone()], &rep[i], Operand::Each(&b[at]), false)
                        }
                    }
                    _ => {
                        let a = view(f.operands[0], done, ta, start, len);
                        let b = view(f.operands[1], done, tb, start, len);
                        op.run(out, a, Operand::Each(b), false)
                    }
                },
            },
            Kind::Dropout { p, stream } => {
                let a = view(f.operands[0], done, ta, start, len);
                match DropoutMask::new(p, stream, ctx, per_sample) {
                    None => out.copy_from_slice(a),
                    Some(mask) => {
                        for (k, (o, &x)) in out.iter_mut().zip(a).enumerate() {
                            *o = mask.apply(start + k, x);
                        }
                    }
                }
            }
        }
        if f.round {
            super::storage::round_bf16(out);
        }
        match &f.store {
            // SAFETY: each chunk writes its own range of a buffer of at least `n` elements.
            Some(Store::Dense(dst)) => unsafe {
                std::ptr::copy_nonoverlapping(out.as_ptr(), dst.add(start), len)
            },
            Some(Store::Runs { ptr, run, outer }) => {
                let (mut i, end) = (start, start + len);
                while i < end {
                    let within = i % run;
                    let take = (run - within).min(end - i);
                    let at = offset_of(i / run, outer) + within;
                    // SAFETY: the layout places the `n` elements at distinct offsets
                    // inside its buffer (the permute's output), so chunks write
                    // disjoint elements.
                    unsafe {
                        std::ptr::copy_nonoverlapping(out[i - start..].as_ptr(), ptr.add(at), take)
                    };
                    i += take;
                }
            }
            None => {}
        }
    }
}

/// Evaluates `ops` over `n` elements (`per_sample` elements per sample, for dropout keys).
pub fn run(ops: &[FusedOp], n: usize, per_sample: usize, ctx: &Ctx) -> Result<(), KernelError> {
    let chunks = n.div_ceil(CHUNK);
    let ops = Ptr(ops);
    let nops = ops.0.len();
    let body = |regs: &mut Vec<f32>, c: usize| {
        // The whole wrapper, not its field (a closure captures the fields it names).
        let ops = &ops;
        let start = c * CHUNK;
        eval(ops.0, regs, start, CHUNK.min(n - start), per_sample, ctx)
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

/// Evaluates `ops` over `n` elements in blocks of `block` elements (whole rows of the kernel
/// after the chain), handing each block's values of the last op and the matching block of
/// `out` to `then`: a row kernel after the chain reads them while they are in cache, and the
/// chain's stored values are written as `run` writes them. Blocks run on rayon threads when
/// there are many; each element is computed as `run` computes it.
pub fn run_blocks(
    ops: &[FusedOp],
    n: usize,
    per_sample: usize,
    ctx: &Ctx,
    block: usize,
    out: &mut [f32],
    then: impl Fn(&[f32], &mut [f32]) + Sync + Send,
) -> Result<(), KernelError> {
    if out.len() != n || block == 0 || ops.is_empty() {
        return Err(KernelError::Bad {
            op: "fused",
            message: format!("{n} values in blocks of {block} into {}", out.len()),
        });
    }
    let ops = Ptr(ops);
    let nops = ops.0.len();
    let regs = (nops + 2) * CHUNK;
    let each = |(b, out): (usize, &mut [f32])| {
        let ops = &ops;
        let start = b * block;
        REGISTERS.with(|r| {
            let mut r = r.borrow_mut();
            if r.len() < regs {
                r.resize(regs, 0.0);
            }
            scratch::with_vec(|vals: &mut Vec<f32>| {
                if vals.len() < out.len() {
                    vals.resize(out.len(), 0.0);
                }
                let mut at = 0;
                while at < out.len() {
                    let len = CHUNK.min(out.len() - at);
                    eval(ops.0, &mut r, start + at, len, per_sample, ctx);
                    vals[at..at + len].copy_from_slice(&r[(nops - 1) * CHUNK..][..len]);
                    at += len;
                }
                then(&vals[..out.len()], out)
            })
        })
    };
    if n > 8 * CHUNK {
        out.par_chunks_mut(block).enumerate().for_each(each);
    } else {
        out.chunks_mut(block).enumerate().for_each(each);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_compiler::ir::maps::{Binary, Map, SUB};

    fn sub() -> Elementwise {
        match &SUB {
            Map::Binary(b) => Elementwise::Binary(Binary(b)),
            Map::Unary(_) => unreachable!("SUB is binary"),
        }
    }

    /// A stored operand repeated along the output (a bias), on either side of a
    /// non-commutative op, as long as the chunk, shorter, longer and straddling chunks:
    /// every element is `f(x[i], bias[i % n])` in its order, read in place or copied.
    #[test]
    fn a_repeated_operand_is_read_at_each_element_on_either_side() {
        let ctx = Ctx {
            seed: 0,
            step: 0,
            training: false,
            first_sample: 0,
        };
        let total = 3 * CHUNK + 517;
        let x: Vec<f32> = (0..total).map(|i| (i as f32 * 0.37).sin()).collect();
        for n in [1, 3, 256, 300, CHUNK, 1500, total] {
            let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 7.0).collect();
            for bias_first in [false, true] {
                let mut out = vec![f32::NAN; total];
                let (xs, bs) = (
                    Source::Memory(x.as_ptr(), total),
                    Source::Memory(bias.as_ptr(), n),
                );
                let ops = [FusedOp {
                    kind: Kind::Map(sub()),
                    operands: if bias_first { [bs, xs] } else { [xs, bs] },
                    store: Some(Store::Dense(out.as_mut_ptr())),
                    round: false,
                }];
                run(&ops, total, total, &ctx).unwrap();
                for (i, &got) in out.iter().enumerate() {
                    let (a, b) = (x[i], bias[i % n]);
                    let want = if bias_first { b - a } else { a - b };
                    assert_eq!(got.to_bits(), want.to_bits(), "n {n}, element {i}");
                }
            }
        }
    }

    #[test]
    fn runs_cover_a_chunk_once_in_order() {
        for (n, start, len) in [
            (256, 0, 1024),
            (300, 1024, 1024),
            (1500, 1024, 1024),
            (7, 5, 3),
        ] {
            let mut next = 0;
            for (at, i) in runs(n, start, len) {
                assert_eq!(at.start, next);
                assert_eq!(i.start, (start + at.start) % n);
                assert!(i.end <= n && at.len() == i.len() && !at.is_empty());
                next = at.end;
            }
            assert_eq!(next, len);
        }
    }
}
