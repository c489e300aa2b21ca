//! Elementwise kernels: unary maps, binary ops with numpy broadcasting, activation gradients
//! and dropout. Large tensors are split across threads by contiguous chunks; every element
//! is computed the same way whatever the split, so results do not depend on thread count.

use super::simd::{Binary, Operand, Unary};
use super::{Ctx, KernelError, Small};
use crate::cpu::tensor::Tensor;
use crate::rng;
use rayon::prelude::*;

/// Below this many elements a kernel runs on the calling thread.
const PARALLEL_MIN: usize = 1 << 15;
const CHUNK: usize = 1 << 13;

fn f32s<'a>(t: &'a Tensor, op: &'static str) -> Result<&'a [f32], KernelError> {
    if t.is_f32() {
        Ok(t.f32())
    } else {
        Err(KernelError::Bad {
            op,
            message: "expects f32 operands".into(),
        })
    }
}

/// `out[i] = op(x[i])`.
pub fn unary(x: &Tensor, out: &mut Tensor, op: Unary) -> Result<(), KernelError> {
    let x = f32s(x, "unary")?;
    let o = out.f32_mut();
    if o.len() != x.len() {
        return Err(KernelError::Bad {
            op: "unary",
            message: format!("{} elements into {}", x.len(), o.len()),
        });
    }
    if o.len() >= PARALLEL_MIN {
        o.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(o, x)| op.run(o, x));
    } else {
        op.run(o, x);
    }
    Ok(())
}

/// `out[i] = op(a[i], b[i])` for operands of one shape (activation gradients).
pub fn same_shape(a: &Tensor, b: &Tensor, out: &mut Tensor, op: Binary) -> Result<(), KernelError> {
    if a.shape != b.shape || a.shape != out.shape {
        return Err(KernelError::Bad {
            op: "elementwise",
            message: format!("shapes {:?}, {:?} into {:?}", a.shape, b.shape, out.shape),
        });
    }
    let (a, b) = (f32s(a, "elementwise")?, f32s(b, "elementwise")?);
    let o = out.f32_mut();
    let body = |(o, (a, b)): (&mut [f32], (&[f32], &[f32]))| op.run(o, a, Operand::Each(b), false);
    if o.len() >= PARALLEL_MIN {
        o.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
            .for_each(body);
    } else {
        body((o, (a, b)));
    }
    Ok(())
}

/// Strides of `shape` broadcast to `rank` axes of `out` (0 where the axis is broadcast).
fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let rank = out.len();
    let mut strides = vec![0; rank];
    let mut s = 1;
    for i in (0..shape.len()).rev() {
        let axis = rank - shape.len() + i;
        strides[axis] = if shape[i] == 1 && out[axis] != 1 {
            0
        } else {
            s
        };
        s *= shape[i];
    }
    strides
}

/// `out[i] = op(a[i], y)` (or `op(y, a[i])` when `swap`) for one value `y`.
fn with_scalar(op: Binary, o: &mut [f32], a: &[f32], y: f32, swap: bool) {
    if o.len() >= PARALLEL_MIN {
        o.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .for_each(|(o, a)| op.run(o, a, Operand::All(y), swap));
    } else {
        op.run(o, a, Operand::All(y), swap);
    }
}

/// `out = op(a, b)` with numpy broadcasting.
pub fn binary(a: &Tensor, b: &Tensor, out: &mut Tensor, op: Binary) -> Result<(), KernelError> {
    let (av, bv) = (f32s(a, "binary")?, f32s(b, "binary")?);
    let owned: Small<usize> = out.shape.iter().copied().collect();
    let shape = &owned[..];
    let n = out.numel();
    let o = out.f32_mut();
    // Fast paths: one shape; a scalar; an operand repeating along the leading axes (a bias).
    if a.shape == shape && b.shape == shape {
        return same_shape(a, b, out, op);
    }
    if a.shape == shape && b.numel() == 1 {
        with_scalar(op, o, av, bv[0], false);
        return Ok(());
    }
    if b.shape == shape && a.numel() == 1 {
        with_scalar(op, o, bv, av[0], true);
        return Ok(());
    }
    let suffix = |small: &[usize]| {
        small.len() <= shape.len() && shape[shape.len() - small.len()..] == *small
    };
    if a.shape == shape && !b.shape.is_empty() && suffix(&b.shape) && b.numel() > 0 {
        let m = bv.len();
        let body = |(o, a): (&mut [f32], &[f32])| {
            for (o, a) in o.chunks_mut(m).zip(a.chunks(m)) {
                op.run(o, a, Operand::Each(bv), false);
            }
        };
        // Chunks are whole rows, so each element is computed the same way.
        let rows = (CHUNK / m).max(1) * m;
        if n >= PARALLEL_MIN {
            o.par_chunks_mut(rows)
                .zip(av.par_chunks(rows))
                .for_each(body);
        } else {
            body((o, av));
        }
        return Ok(());
    }
    // One operand repeating each of its values over a contiguous run of the output (a conv
    // bias [C, 1, 1] onto [N, C, H, W]), the other shaped like the output.
    if a.shape == shape {
        if let Some(run) = repeat_run(&b.shape, shape) {
            runs(av, bv, run, o, op, false);
            return Ok(());
        }
    }
    if b.shape == shape {
        if let Some(run) = repeat_run(&a.shape, shape) {
            runs(bv, av, run, o, op, true);
            return Ok(());
        }
    }
    general(av, &a.shape, bv, &b.shape, shape, o, |x, y| op.apply(x, y));
    Ok(())
}

/// If `small` broadcasts to `out` by repeating each of its values over a contiguous run of
/// the output (`small`, aligned right, is 1 on the leading and trailing axes and equals
/// `out` on the axes between), the run's length (the product of the trailing axes).
fn repeat_run(small: &[usize], out: &[usize]) -> Option<usize> {
    if small.len() > out.len() || small.iter().product::<usize>() == 0 {
        return None;
    }
    let lead = out.len() - small.len();
    let Some(last) = small.iter().rposition(|&d| d != 1) else {
        return None; // a scalar: handled before
    };
    let first = small.iter().position(|&d| d != 1).unwrap_or(last);
    if small[first..=last] != out[lead + first..=lead + last] {
        return None;
    }
    let run: usize = out[lead + last + 1..].iter().product();
    (run > 0).then_some(run)
}

/// `out[i] = op(a[i], b[(i / run) % b.len()])` (operands swapped when `swap`): `b`'s values
/// each repeated over `run` consecutive elements. Split across threads by whole runs.
fn runs(a: &[f32], b: &[f32], run: usize, o: &mut [f32], op: Binary, swap: bool) {
    let m = b.len();
    let body = |first: usize, o: &mut [f32], a: &[f32]| {
        for (r, (o, a)) in o.chunks_mut(run).zip(a.chunks(run)).enumerate() {
            let y = b[(first + r) % m];
            op.run(o, a, Operand::All(y), swap);
        }
    };
    if o.len() >= PARALLEL_MIN {
        let per = (CHUNK / run).max(1);
        o.par_chunks_mut(per * run)
            .zip(a.par_chunks(per * run))
            .enumerate()
            .for_each(|(j, (o, a))| body(j * per, o, a));
    } else {
        body(0, o, a);
    }
}

/// General broadcasting by an index counter.
fn general(
    av: &[f32],
    a_shape: &[usize],
    bv: &[f32],
    b_shape: &[usize],
    shape: &[usize],
    o: &mut [f32],
    f: impl Fn(f32, f32) -> f32,
) {
    let sa = broadcast_strides(a_shape, shape);
    let sb = broadcast_strides(b_shape, shape);
    let rank = shape.len();
    let mut idx = vec![0usize; rank];
    let (mut ia, mut ib) = (0usize, 0usize);
    for o in o.iter_mut() {
        *o = f(av[ia], bv[ib]);
        for ax in (0..rank).rev() {
            idx[ax] += 1;
            ia += sa[ax];
            ib += sb[ax];
            if idx[ax] < shape[ax] {
                break;
            }
            ia -= sa[ax] * shape[ax];
            ib -= sb[ax] * shape[ax];
            idx[ax] = 0;
        }
    }
}

/// A dropout mask: keeps each element with probability `1 - p`, scaled by `1 / (1 - p)`. The
/// decision for an element is a function of (seed, step, stream, the sample's index in the
/// global batch, the element's index in its sample), so a backward dropout with the same
/// stream reuses the forward mask and any split of the batch gives the same masks. Both the
/// one-op kernel and fused kernels use it, so they agree bit for bit.
#[derive(Debug, Clone, Copy)]
pub struct DropoutMask {
    key: u64,
    threshold: f32,
    scale: f32,
    per_sample: usize,
    first_sample: u64,
}

impl DropoutMask {
    /// `None` when dropout is the identity (evaluation, or `p` = 0).
    pub fn new(p: f64, stream: u64, ctx: &Ctx, per_sample: usize) -> Option<DropoutMask> {
        (ctx.training && p != 0.0).then(|| DropoutMask {
            key: Self::key(ctx.seed, ctx.step, stream),
            threshold: p as f32,
            scale: (1.0 / (1.0 - p)) as f32,
            per_sample: per_sample.max(1),
            first_sample: ctx.first_sample,
        })
    }

    /// The key of a dropout stream at a training step (shared with the CUDA kernels).
    pub fn key(seed: u64, step: u64, stream: u64) -> u64 {
        rng::dropout_key(seed, step, stream)
    }

    /// Element `i` of the batch, of value `x`, after dropout.
    #[inline]
    pub fn apply(&self, i: usize, x: f32) -> f32 {
        let sample = self.first_sample + (i / self.per_sample) as u64;
        let index = sample * self.per_sample as u64 + (i % self.per_sample) as u64;
        if rng::uniform(self.key, index) < self.threshold {
            0.0
        } else {
            x * self.scale
        }
    }
}

/// Dropout of `x` (see [`DropoutMask`]).
pub fn dropout(
    x: &Tensor,
    p: f64,
    stream: u64,
    ctx: &Ctx,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    let per_sample = x.shape.iter().skip(1).product::<usize>();
    let Some(mask) = DropoutMask::new(p, stream, ctx, per_sample) else {
        return super::layout::copy(x, out);
    };
    let xv = f32s(x, "dropout")?;
    let body = |(start, o): (usize, &mut [f32])| {
        for (k, o) in o.iter_mut().enumerate() {
            *o = mask.apply(start + k, xv[start + k]);
        }
    };
    let o = out.f32_mut();
    if o.len() >= PARALLEL_MIN {
        o.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, o)| body((c * CHUNK, o)));
    } else {
        body((0, o));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::kernels::testutil::in_pool;
    use parallax_compiler::ir::Op;

    fn t(shape: &[usize], v: Vec<f32>) -> Tensor {
        Tensor::from_f32(shape.to_vec(), v)
    }

    fn reference_broadcast(
        a: &Tensor,
        b: &Tensor,
        shape: &[usize],
        f: fn(f64, f64) -> f64,
    ) -> Vec<f64> {
        let n: usize = shape.iter().product();
        let rank = shape.len();
        (0..n)
            .map(|flat| {
                let mut rem = flat;
                let mut idx = vec![0; rank];
                for ax in (0..rank).rev() {
                    idx[ax] = rem % shape[ax];
                    rem /= shape[ax];
                }
                let at = |x: &Tensor| {
                    let off = rank - x.shape.len();
                    let mut i = 0;
                    for (k, &d) in x.shape.iter().enumerate() {
                        i = i * d + if d == 1 { 0 } else { idx[off + k] };
                    }
                    x.f32()[i] as f64
                };
                f(at(a), at(b))
            })
            .collect()
    }

    #[test]
    fn broadcasting_matches_a_reference() {
        let s = rng::stream(3, rng::Purpose::Synthetic, 0);
        let cases: &[(&[usize], &[usize], &[usize])] = &[
            (&[4, 3], &[4, 3], &[4, 3]),
            (&[4, 3], &[3], &[4, 3]),
            (&[4, 3], &[], &[4, 3]),
            (&[], &[4, 3], &[4, 3]),
            (&[2, 1, 5], &[3, 1], &[2, 3, 5]),
            (&[5, 1, 1], &[5, 4, 4], &[5, 4, 4]),
            (&[300, 200], &[200], &[300, 200]),
            (&[4, 6, 5, 7], &[6, 1, 1], &[4, 6, 5, 7]),
            (&[6, 1, 1], &[4, 6, 5, 7], &[4, 6, 5, 7]),
            (&[40, 30, 9, 11], &[30, 1, 1], &[40, 30, 9, 11]),
        ];
        let mut k = 0;
        for &(sa, sb, so) in cases {
            let mut gen = |shape: &[usize]| {
                let n: usize = shape.iter().product();
                let v: Vec<f32> = (0..n)
                    .map(|_| {
                        k += 1;
                        rng::normal(s, k)
                    })
                    .collect();
                t(shape, v)
            };
            let (a, b) = (gen(sa), gen(sb));
            let mut out = Tensor::from_f32(so.to_vec(), vec![0.0; so.iter().product()]);
            binary(&a, &b, &mut out, Binary::of(&Op::Div).unwrap()).unwrap();
            let want = reference_broadcast(&a, &b, so, |x, y| x / y);
            for (g, w) in out.f32().iter().zip(&want) {
                assert!(
                    (*g as f64 - w).abs() <= 1e-6 * (1.0 + w.abs()),
                    "{sa:?} {sb:?}: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn repeat_runs_are_found_only_where_they_hold() {
        assert_eq!(repeat_run(&[3, 1, 1], &[2, 3, 4, 5]), Some(20));
        assert_eq!(repeat_run(&[1, 3, 1, 1], &[2, 3, 4, 5]), Some(20));
        assert_eq!(repeat_run(&[2, 3, 1, 1], &[2, 3, 4, 5]), Some(20));
        assert_eq!(repeat_run(&[4, 1], &[2, 3, 4, 5]), Some(5));
        assert_eq!(repeat_run(&[3, 4, 5], &[2, 3, 4, 5]), Some(1));
        assert_eq!(repeat_run(&[3, 1, 5], &[2, 3, 4, 5]), None);
        assert_eq!(repeat_run(&[2, 1, 1, 1], &[2, 3, 4, 5]), Some(60));
        assert_eq!(repeat_run(&[1, 1], &[2, 3]), None);
        assert_eq!(repeat_run(&[3, 1], &[2, 4, 1]), None);
        assert_eq!(repeat_run(&[0, 1], &[0, 4]), None);
        assert_eq!(repeat_run(&[1, 2, 3, 4, 5], &[2, 3, 4, 5]), None);
    }

    /// Operands repeated over contiguous runs (either side, odd sizes, serial and parallel)
    /// give the very bits of the index-counter path, whatever the thread count.
    #[test]
    fn repeated_runs_match_the_general_path_bit_for_bit() {
        let s = rng::stream(4, rng::Purpose::Synthetic, 0);
        let cases: &[(&[usize], &[usize])] = &[
            (&[64, 32, 26, 26], &[32, 1, 1]),
            (&[3, 5, 7, 9], &[5, 1, 1]),
            (&[3, 5, 7, 9], &[1, 5, 7, 1]),
            (&[3, 5, 7, 9], &[3, 1, 1, 1]),
            (&[3, 5, 7, 9], &[3, 5, 1, 1]),
            (&[7, 11, 13], &[11, 1]),
            (&[2, 1, 13, 3], &[13, 1]),
            (&[33, 17, 61], &[33, 1, 1]),
        ];
        let mut k = 0;
        for &(big, small) in cases {
            let mut gen = |shape: &[usize]| {
                let v: Vec<f32> = (0..shape.iter().product::<usize>() as u64)
                    .map(|i| rng::normal(s, k + i))
                    .collect();
                k += 1 << 24;
                t(shape, v)
            };
            let (a, b) = (gen(big), gen(small));
            assert!(repeat_run(small, big).is_some(), "{small:?} {big:?}");
            let n: usize = big.iter().product();
            let op = Binary::of(&Op::Div).unwrap();
            for (l, r) in [(&a, &b), (&b, &a)] {
                let mut want = vec![0f32; n];
                general(
                    l.f32(),
                    &l.shape,
                    r.f32(),
                    &r.shape,
                    big,
                    &mut want,
                    |x, y| x / y,
                );
                for threads in [1, 2, 3] {
                    let got = in_pool(threads, || {
                        let mut out = t(big, vec![0.0; n]);
                        binary(l, r, &mut out, op).unwrap();
                        out
                    });
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(got.f32()) == bits(&want),
                        "{:?} {:?}, {threads} threads",
                        l.shape,
                        r.shape
                    );
                }
            }
        }
    }

    #[test]
    fn dropout_masks_are_keyed_by_sample_not_by_split() {
        let n = 6 * 50;
        let x = t(&[6, 50], vec![1.0; n]);
        let ctx = Ctx {
            seed: 9,
            step: 3,
            training: true,
            first_sample: 0,
        };
        let mut whole = t(&[6, 50], vec![0.0; n]);
        dropout(&x, 0.5, 1, &ctx, &mut whole).unwrap();
        // The same rows computed as two shards of the batch.
        let half = t(&[3, 50], vec![1.0; n / 2]);
        let mut first = t(&[3, 50], vec![0.0; n / 2]);
        let mut second = t(&[3, 50], vec![0.0; n / 2]);
        dropout(&half, 0.5, 1, &ctx, &mut first).unwrap();
        dropout(
            &half,
            0.5,
            1,
            &Ctx {
                first_sample: 3,
                ..ctx
            },
            &mut second,
        )
        .unwrap();
        assert_eq!(&whole.f32()[..n / 2], first.f32());
        assert_eq!(&whole.f32()[n / 2..], second.f32());
        let kept = whole.f32().iter().filter(|&&v| v != 0.0).count();
        assert!((100..200).contains(&kept), "{kept}");
        assert!(whole.f32().iter().all(|&v| v == 0.0 || v == 2.0));
        // Another step or stream gives another mask; evaluation keeps everything.
        let mut other = t(&[6, 50], vec![0.0; n]);
        dropout(&x, 0.5, 1, &Ctx { step: 4, ..ctx }, &mut other).unwrap();
        assert_ne!(other, whole);
        dropout(
            &x,
            0.5,
            1,
            &Ctx {
                training: false,
                ..ctx
            },
            &mut other,
        )
        .unwrap();
        assert_eq!(other.f32(), x.f32());
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let s = rng::stream(5, rng::Purpose::Synthetic, 1);
        let a = t(
            &[400, 300],
            (0..120_000).map(|i| rng::normal(s, i)).collect(),
        );
        let b = t(
            &[300],
            (0..300).map(|i| rng::normal(s, i + 10_000_000)).collect(),
        );
        let run = |threads: usize| {
            in_pool(threads, || {
                let mut out = t(&[400, 300], vec![0.0; 120_000]);
                binary(&a, &b, &mut out, Binary::of(&Op::Mul).unwrap()).unwrap();
                let mut g = t(&[400, 300], vec![0.0; 120_000]);
                unary(&out, &mut g, Unary::of(&Op::Gelu).unwrap()).unwrap();
                g
            })
        };
        assert_eq!(run(1), run(2));
    }
}
