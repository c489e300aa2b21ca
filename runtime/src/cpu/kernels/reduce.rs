//! Sums along axes and the broadcasts that undo them in backward graphs: `reduce_sum` /
//! `reduce_mean`, `sum_to` (a broadcast's gradient) and `expand`. Every output element adds
//! its terms in f64 in an order fixed by the shape, so results are bit-identical whatever the
//! thread count.

use super::layout::{bad, f32s, f32s_mut, for_rows, offset_of, strided, strides};
use super::simd::{sum8, vectorised};
use super::{scratch, KernelError, Small};
use crate::cpu::tensor::Tensor;
use rayon::prelude::*;
use smallvec::smallvec;

/// Output columns summed together in `sum_axes` (an f64 accumulator on the stack).
const COLS: usize = 256;

/// `x` (shaped `shape`) summed over the axes marked in `red`, into `out` (the other axes, in
/// order), each sum divided by `div`. Every output element adds its terms in f64, in row-major
/// order of the reduced axes (a reduction to one value: in `simd::sum8`'s order), whatever the
/// loop structure or thread count.
fn sum_axes(x: &[f32], shape: &[usize], red: &[bool], div: f64, out: &mut [f32]) {
    if x.is_empty() {
        out.fill((0.0 / div) as f32);
        return;
    }
    if out.len() == 1 {
        // Everything into one value (a loss): eight lanes in a fixed order, vectorised.
        out[0] = (sum_all(x) / div) as f32;
        return;
    }
    // (size, stride, reduced), innermost first while building: size-1 axes dropped, runs of
    // adjacent axes of one kind merged.
    let mut groups: Small<(usize, usize, bool)> = Small::new();
    let mut stride = 1;
    for (&n, &r) in shape.iter().zip(red).rev() {
        if n != 1 {
            match groups.last_mut() {
                Some(g) if g.2 == r => g.0 *= n,
                _ => groups.push((n, stride, r)),
            }
        }
        stride *= n;
    }
    // A kept innermost run is contiguous: each output row of that length sums whole rows.
    let inner = match groups.first() {
        Some(&(n, _, false)) => {
            groups.remove(0);
            n
        }
        _ => 1,
    };
    groups.reverse();
    let kept: Small<(usize, usize)> = groups.iter().filter(|g| !g.2).map(|g| (g.0, g.1)).collect();
    let mut reduced: Small<(usize, usize)> =
        groups.iter().filter(|g| g.2).map(|g| (g.0, g.1)).collect();
    let (last_n, last_s) = reduced.pop().unwrap_or((1, 0));
    let outer_n: usize = reduced.iter().map(|g| g.0).product();
    let total = x.len();
    if kept.is_empty() && inner == out.len() && total >= 2 * PART_WORK {
        // `x` is `[rows, inner]` summed down to its last axis (a bias gradient): `parts`
        // bands of whole rows, each streamed through memory into its own f64 row, then the
        // bands added in order. The bands depend only on the shape.
        column_sums(x, inner, total / PART_WORK, div, out);
        return;
    }
    if inner == 1 && last_s == 1 && last_n >= LANES && out.len() > 1 {
        // Every output sums contiguous runs (a conv bias gradient, [N, C, H, W] to [C]):
        // `LANES` outputs at once, each its own f64 chain in the general order.
        let base = |r: usize| offset_of(r, &kept);
        let reduced_off = |k: usize| offset_of(k, &reduced);
        for_rows(out, LANES, total, |blk, chunk| {
            let first = blk * LANES;
            if let Ok(chunk) = <&mut [f32; LANES]>::try_from(&mut *chunk) {
                let bases: [usize; LANES] = std::array::from_fn(|q| base(first + q));
                let acc = sum_runs(x, bases, outer_n, reduced_off, last_n);
                for (o, a) in chunk.iter_mut().zip(acc) {
                    *o = (a / div) as f32;
                }
            } else {
                for (q, o) in chunk.iter_mut().enumerate() {
                    let [a] = sum_runs(x, [base(first + q)], outer_n, reduced_off, last_n);
                    *o = (a / div) as f32;
                }
            }
        });
        return;
    }
    let rows = out.len().div_ceil(inner).max(1);
    for_rows(out, inner, total, |r, orow| {
        let base = offset_of(r, &kept);
        for_rows(orow, COLS, total / rows, |ci, chunk| {
            let w = chunk.len();
            let mut acc = [0f64; COLS];
            let acc = &mut acc[..w];
            let start = base + ci * COLS;
            for k in 0..outer_n {
                let off = start + offset_of(k, &reduced);
                for j in 0..last_n {
                    let o = off + j * last_s;
                    for (a, &v) in acc.iter_mut().zip(&x[o..o + w]) {
                        *a += v as f64;
                    }
                }
            }
            for (o, &a) in chunk.iter_mut().zip(acc.iter()) {
                *o = (a / div) as f32;
            }
        });
    });
}

vectorised! {
    fn sum_all(x: &[f32]) -> f64 = sum_all_at;
}

/// [`sum8`] of the values in f64, in the CPU's vectors (the same order, so the same bits).
#[inline(always)]
fn sum_all_at(x: &[f32]) -> f64 {
    sum8(x, |v| v as f64)
}

vectorised! {
    fn add_rows(acc: &mut [f64], x: &[f32]) = add_rows_at;
}

/// Each row of `x` (`acc.len()` wide) added to `acc` in f64, row after row.
#[inline(always)]
fn add_rows_at(acc: &mut [f64], x: &[f32]) {
    for row in x.chunks_exact(acc.len()) {
        for (a, &v) in acc.iter_mut().zip(row) {
            *a += v as f64;
        }
    }
}

/// Elements per band of `column_sums` (at most `MAX_PARTS` bands).
const PART_WORK: usize = 1 << 16;
const MAX_PARTS: usize = 8;

/// `out[j] = sum over rows r of x[r * inner + j] / div` for `x` of `[rows, inner]`: the rows
/// cut into at most `parts` bands of consecutive rows, each band's sums in f64 in row order,
/// the bands' sums added in band order.
fn column_sums(x: &[f32], inner: usize, parts: usize, div: f64, out: &mut [f32]) {
    let rows = x.len() / inner;
    let parts = parts.clamp(1, MAX_PARTS).min(rows);
    let per = rows.div_ceil(parts);
    scratch::with(parts * inner, |bands: &mut [f64]| {
        bands
            .par_chunks_mut(inner)
            .enumerate()
            .for_each(|(p, acc)| {
                let (start, end) = ((p * per).min(rows), ((p + 1) * per).min(rows));
                add_rows(acc, &x[start * inner..end * inner]);
            });
        for (j, o) in out.iter_mut().enumerate() {
            let sum = (0..parts).fold(0.0, |s, p| s + bands[p * inner + j]);
            *o = (sum / div) as f32;
        }
    });
}

/// Outputs summed together in `sum_axes`' contiguous-runs path.
const LANES: usize = 8;

/// For each lane `q`, the f64 sum over `k in 0..outer` (in order) of the run
/// `x[bases[q] + off(k)..][..len]` (in order): the order of `sum_axes`' general path.
#[inline(always)]
fn sum_runs<const L: usize>(
    x: &[f32],
    bases: [usize; L],
    outer: usize,
    off: impl Fn(usize) -> usize,
    len: usize,
) -> [f64; L] {
    let mut acc = [0f64; L];
    for k in 0..outer {
        let o = off(k);
        let runs: [&[f32]; L] = std::array::from_fn(|q| &x[bases[q] + o..bases[q] + o + len]);
        for j in 0..len {
            for (a, run) in acc.iter_mut().zip(&runs) {
                *a += run[j] as f64;
            }
        }
    }
    acc
}

/// Elements one task of `expand`'s fill writes.
const FILL_RUN: usize = 1 << 14;

/// Sums (or means) over `axes`, removing them.
pub fn reduce(x: &Tensor, axes: &[usize], mean: bool, out: &mut Tensor) -> Result<(), KernelError> {
    let op = if mean { "reduce_mean" } else { "reduce_sum" };
    let rank = x.shape.len();
    if axes.iter().any(|&a| a >= rank) || axes.windows(2).any(|w| w[0] >= w[1]) {
        return Err(bad(
            op,
            format!("axes {axes:?} must be ascending axes of {:?}", x.shape),
        ));
    }
    let red: Small<bool> = (0..rank).map(|i| axes.contains(&i)).collect();
    let kept: Small<usize> = (0..rank).filter(|&i| !red[i]).map(|i| x.shape[i]).collect();
    if out.shape[..] != kept[..] {
        return Err(bad(
            op,
            format!(
                "{:?} reduced over {axes:?} is {kept:?}, not {:?}",
                x.shape, out.shape
            ),
        ));
    }
    let count: usize = axes.iter().map(|&a| x.shape[a]).product();
    let div = if mean { count as f64 } else { 1.0 };
    let xs = f32s(op, x, "the operand")?;
    let o = f32s_mut(op, out)?;
    sum_axes(xs, &x.shape, &red, div, o);
    Ok(())
}

/// Sums `x` down to `out`'s shape, which `x` broadcasts from (numpy rules, aligned right).
pub fn sum_to(x: &Tensor, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "sum_to";
    let (xr, or) = (x.shape.len(), out.shape.len());
    let fail = || {
        bad(
            OP,
            format!("{:?} does not sum down to {:?}", x.shape, out.shape),
        )
    };
    if or > xr {
        return Err(fail());
    }
    let lead = xr - or;
    let mut red: Small<bool> = smallvec![true; xr];
    for (j, &d) in out.shape.iter().enumerate() {
        let n = x.shape[lead + j];
        if d == n {
            red[lead + j] = false;
        } else if d != 1 {
            return Err(fail());
        }
    }
    let xs = f32s(OP, x, "the operand")?;
    let o = f32s_mut(OP, out)?;
    sum_axes(xs, &x.shape, &red, 1.0, o);
    Ok(())
}

/// Repeats `x` along `axes` of `out` (inserted there), divided by the repeat count if `mean`.
pub fn expand(x: &Tensor, axes: &[usize], mean: bool, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "expand";
    let rank = out.shape.len();
    let inserted: Small<bool> = (0..rank).map(|i| axes.contains(&i)).collect();
    let kept: Small<usize> = (0..rank)
        .filter(|&i| !inserted[i])
        .map(|i| out.shape[i])
        .collect();
    if axes.iter().any(|&a| a >= rank) || kept[..] != x.shape[..] {
        return Err(bad(
            OP,
            format!(
                "{:?} does not expand along {axes:?} to {:?}",
                x.shape, out.shape
            ),
        ));
    }
    let xstr = strides(&x.shape);
    let mut k = 0;
    let st: Small<usize> = (0..rank)
        .map(|i| {
            if inserted[i] {
                0
            } else {
                k += 1;
                xstr[k - 1]
            }
        })
        .collect();
    let count: usize = (0..rank)
        .filter(|&i| inserted[i])
        .map(|i| out.shape[i])
        .product();
    let shape: Small<usize> = out.shape.iter().copied().collect();
    let xs = f32s(OP, x, "the operand")?;
    let o = f32s_mut(OP, out)?;
    if let [v] = xs {
        // One value everywhere (a mean's gradient): a fill, not a walk over the strides.
        let v = if mean { v / count as f32 } else { *v };
        for_rows(o, FILL_RUN, o.len(), |_, run| run.fill(v));
        return Ok(());
    }
    if mean {
        let n = count as f32;
        strided(xs, &shape, &st, o, |v| v / n);
    } else {
        strided(xs, &shape, &st, o, |v| v);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::kernels::testutil::{assert_close, dot, in_pool, randn, ravel, unravel, zeros};
    use crate::cpu::tensor::numel;

    /// Naive f64 sum of `x` over the axes in `red`, to the kept axes.
    fn naive_sum(x: &Tensor, red: &[bool], mean: bool) -> Vec<f64> {
        let kept: Vec<usize> = (0..x.shape.len())
            .filter(|&i| !red[i])
            .map(|i| x.shape[i])
            .collect();
        let mut out = vec![0f64; numel(&kept)];
        for i in 0..x.numel() {
            let idx = unravel(i, &x.shape);
            let k: Vec<usize> = (0..idx.len())
                .filter(|&a| !red[a])
                .map(|a| idx[a])
                .collect();
            out[ravel(&k, &kept)] += x.f32()[i] as f64;
        }
        if mean {
            let n = x.numel() / numel(&kept).max(1);
            out.iter_mut().for_each(|v| *v /= n as f64);
        }
        out
    }

    #[test]
    fn reduce_matches_naive_sums_and_means() {
        let shape = [3, 4, 5, 6];
        let x = randn(20, &shape);
        let cases: [&[usize]; 9] = [
            &[],
            &[0],
            &[3],
            &[1, 2],
            &[0, 2],
            &[1, 3],
            &[0, 1, 2],
            &[0, 3],
            &[0, 1, 2, 3],
        ];
        for axes in cases {
            for mean in [false, true] {
                let red: Vec<bool> = (0..4).map(|i| axes.contains(&i)).collect();
                let kept: Vec<usize> = (0..4).filter(|&i| !red[i]).map(|i| shape[i]).collect();
                let mut out = zeros(&kept);
                reduce(&x, axes, mean, &mut out).unwrap();
                assert_close(out.f32(), &naive_sum(&x, &red, mean), 1e-6);
            }
        }
        // Wide rows exercise the column blocks; size-1 axes are dropped.
        let w = randn(21, &[3, 1, 700]);
        let mut out = zeros(&[1, 700]);
        reduce(&w, &[0], false, &mut out).unwrap();
        assert_close(
            out.f32(),
            &naive_sum(&w, &[true, false, false], false),
            1e-6,
        );
        assert!(reduce(&x, &[2, 1], false, &mut zeros(&[3, 6])).is_err());
        assert!(reduce(&x, &[1], false, &mut zeros(&[3, 4, 6])).is_err());
    }

    /// Sums of contiguous runs (`LANES` outputs at a time, and the remainder one by one)
    /// give the very bits of f64 sums in row-major order, which the general path also adds
    /// in, whatever the thread count.
    #[test]
    fn contiguous_run_sums_add_in_the_general_order() {
        let cases: &[(&[usize], &[bool])] = &[
            // The conv bias gradient, [N, C, H, W] to [C].
            (&[64, 32, 26, 26], &[true, false, true, true]),
            (&[5, 13, 3, 3], &[true, false, true, true]),
            (&[3, 17, 8], &[true, false, true]),
            // Kept and reduced axes interleaved; a leading kept axis.
            (&[3, 5, 7, 11], &[false, true, false, true]),
            (&[9, 2, 10], &[false, true, true]),
            (&[7, 9], &[false, true]),
            (&[1, 20, 1, 8], &[true, false, true, true]),
        ];
        for (&(shape, red), hard) in cases.iter().flat_map(|c| [(c, false), (c, true)]) {
            let mut x = randn(70, shape);
            if hard {
                // +-2^60 pairs in every run of 8: the small terms the f64 sum keeps depend
                // on the order it adds in, so another order shows in the f32 results.
                let last = shape[shape.len() - 1];
                for (i, v) in x.f32_mut().iter_mut().enumerate() {
                    match i % last % 8 {
                        0 => *v = 2f32.powi(60),
                        3 => *v = -(2f32.powi(60)),
                        _ => {}
                    }
                }
            }
            let axes: Vec<usize> = (0..shape.len()).filter(|&i| red[i]).collect();
            let kept: Vec<usize> = (0..shape.len())
                .filter(|&i| !red[i])
                .map(|i| shape[i])
                .collect();
            let to: Vec<usize> = (0..shape.len())
                .map(|i| if red[i] { 1 } else { shape[i] })
                .collect();
            for mean in [false, true] {
                let want: Vec<u32> = naive_sum(&x, red, mean)
                    .iter()
                    .map(|&v| (v as f32).to_bits())
                    .collect();
                for threads in [1, 2, 3] {
                    let (r, st) = in_pool(threads, || {
                        let mut r = zeros(&kept);
                        reduce(&x, &axes, mean, &mut r).unwrap();
                        let mut st = zeros(&to[1..]);
                        if !mean && red[0] {
                            sum_to(&x, &mut st).unwrap();
                        }
                        (r, st)
                    });
                    let bits = |t: &Tensor| t.f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&r), want, "{shape:?} {red:?} mean {mean} hard {hard}");
                    if !mean && red[0] {
                        assert_eq!(bits(&st), want, "sum_to {shape:?} {red:?}");
                    }
                }
            }
        }
    }

    /// A large `[rows, C]` summed to `[C]`: bands of consecutive rows, each summed in f64 in
    /// row order, the bands then added in order, on any number of threads.
    #[test]
    fn column_sums_add_bands_of_rows_in_order() {
        let (rows, c) = (700, 300);
        let mut x = randn(71, &[rows, c]);
        for (i, v) in x.f32_mut().iter_mut().enumerate() {
            if i / c % 97 == 5 {
                *v = 2f32.powi(50) * if i % 2 == 0 { 1.0 } else { -1.0 };
            }
        }
        let parts = (rows * c / PART_WORK).min(MAX_PARTS);
        assert_eq!(parts, 3);
        let per = rows.div_ceil(parts);
        let want: Vec<u32> = (0..c)
            .map(|j| {
                let band = |p: usize| {
                    (p * per..((p + 1) * per).min(rows))
                        .fold(0f64, |s, r| s + x.f32()[r * c + j] as f64)
                };
                ((band(0) + band(1)) + band(2)) as f32
            })
            .map(f32::to_bits)
            .collect();
        for threads in [1, 2, 3] {
            let st = in_pool(threads, || {
                let mut st = zeros(&[c]);
                sum_to(&x, &mut st).unwrap();
                st
            });
            let bits: Vec<u32> = st.f32().iter().map(|v| v.to_bits()).collect();
            assert_eq!(bits, want, "{threads} threads");
        }
    }

    #[test]
    fn sum_to_undoes_broadcasting_with_leading_and_size1_axes() {
        let shape = [2, 3, 4, 5];
        let x = randn(30, &shape);
        let cases: [&[usize]; 9] = [
            &[5],
            &[4, 1],
            &[3, 1, 5],
            &[1, 3, 4, 1],
            &[2, 1, 1, 5],
            &[],
            &[1],
            &[2, 3, 4, 5],
            &[1, 1, 1, 1],
        ];
        for to in cases {
            let lead = 4 - to.len();
            let red: Vec<bool> = (0..4).map(|i| i < lead || to[i - lead] == 1).collect();
            let mut out = zeros(to);
            sum_to(&x, &mut out).unwrap();
            assert_close(out.f32(), &naive_sum(&x, &red, false), 1e-6);
            // Adjoint of broadcasting r up to x's shape: <x, bcast(r)> = <sum_to(x), r>.
            let r = randn(31, to);
            let mut lhs = 0f64;
            for i in 0..x.numel() {
                let idx = unravel(i, &shape);
                let j: Vec<usize> = (0..to.len())
                    .map(|k| if to[k] == 1 { 0 } else { idx[lead + k] })
                    .collect();
                lhs += x.f32()[i] as f64 * r.f32()[ravel(&j, to)] as f64;
            }
            assert!((lhs - dot(&out, &r)).abs() < 1e-4, "{to:?}");
        }
        assert!(sum_to(&x, &mut zeros(&[6])).is_err());
        assert!(sum_to(&x, &mut zeros(&[3, 5])).is_err());
        assert!(sum_to(&x, &mut zeros(&[1, 2, 3, 4, 5])).is_err());
    }

    #[test]
    fn expand_repeats_and_means_and_is_the_adjoint_of_reduce() {
        let cases: [(&[usize], &[usize], &[usize]); 4] = [
            (&[3, 5], &[1], &[3, 4, 5]),
            (&[3, 5], &[0, 3], &[2, 3, 5, 4]),
            (&[], &[0, 1], &[2, 3]),
            (&[4], &[1, 2], &[4, 3, 2]),
        ];
        for (xs, axes, os) in cases {
            let x = randn(40, xs);
            let count: usize = axes.iter().map(|&a| os[a]).product();
            for mean in [false, true] {
                let mut out = zeros(os);
                expand(&x, axes, mean, &mut out).unwrap();
                for i in 0..out.numel() {
                    let idx = unravel(i, os);
                    let k: Vec<usize> = (0..os.len())
                        .filter(|a| !axes.contains(a))
                        .map(|a| idx[a])
                        .collect();
                    let mut want = x.f32()[ravel(&k, xs)];
                    if mean {
                        want /= count as f32;
                    }
                    assert_eq!(out.f32()[i], want, "{xs:?} {axes:?} {os:?} mean={mean}");
                }
                // <expand(x), r> = <x, reduce(r)>, with means on both sides.
                let r = randn(41, os);
                let mut red = zeros(xs);
                reduce(&r, axes, mean, &mut red).unwrap();
                assert!((dot(&out, &r) - dot(&x, &red)).abs() < 1e-5);
            }
        }
        assert!(expand(&randn(42, &[3, 5]), &[1], false, &mut zeros(&[3, 4, 6])).is_err());
        assert!(expand(&randn(42, &[3, 5]), &[3], false, &mut zeros(&[3, 4, 5])).is_err());
    }
}
