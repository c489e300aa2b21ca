//! Data movement and sums along axes: copies, permutations, concatenation, slices, gathers,
//! and the reductions and broadcasts that undo each other in backward graphs.
//!
//! Every kernel checks its operands' element types and shapes and answers a mismatch with
//! `KernelError::Bad` (never a panic). Work is split across rayon threads by output rows only
//! when the tensor is large, and never inside one sum, so results are bit-identical whatever
//! the thread count.

use super::simd::sum8;
use super::{scratch, KernelError, Small};
use crate::cpu::tensor::{numel, Data, Tensor};
use rayon::prelude::*;
use smallvec::smallvec;

/// Below this much work (elements touched) a kernel runs on the calling thread.
pub(crate) const PAR_MIN: usize = 1 << 15;
/// The least work one rayon job gets.
const JOB_MIN: usize = 1 << 12;
/// Output columns summed together in `sum_axes` (an f64 accumulator on the stack).
const COLS: usize = 256;

pub(crate) fn bad(op: &'static str, message: impl Into<String>) -> KernelError {
    KernelError::Bad {
        op,
        message: message.into(),
    }
}

/// Runs `f(row index, row)` on every `len`-long row of `out` (the last may be shorter), on
/// rayon threads when `work` (the elements the whole call touches) is large. Rows are
/// independent, so the result does not depend on how they were split.
pub(crate) fn for_rows<T: Send>(
    out: &mut [T],
    len: usize,
    work: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    if len == 0 || out.is_empty() {
        return;
    }
    if work.max(out.len()) < PAR_MIN {
        out.chunks_mut(len).enumerate().for_each(|(i, r)| f(i, r));
    } else {
        let rows = out.len().div_ceil(len);
        let per_row = (work.max(out.len()) / rows).max(1);
        out.par_chunks_mut(len)
            .with_min_len((JOB_MIN / per_row).max(1))
            .enumerate()
            .for_each(|(i, r)| f(i, r));
    }
}

/// `out[i] = f(i)`, computed on rayon threads when `work` is large.
pub(crate) fn fill_range<R: Send>(
    out: &mut [R],
    work: usize,
    f: impl Fn(usize) -> R + Sync + Send,
) {
    let n = out.len();
    if work < PAR_MIN || n <= 1 {
        out.iter_mut().enumerate().for_each(|(i, o)| *o = f(i));
    } else {
        let per = (work / n).max(1);
        out.par_iter_mut()
            .with_min_len((JOB_MIN / per).max(1))
            .enumerate()
            .for_each(|(i, o)| *o = f(i));
    }
}

/// The operand as f32, or an error naming `what`.
pub(crate) fn f32s<'a>(
    op: &'static str,
    t: &'a Tensor,
    what: &str,
) -> Result<&'a [f32], KernelError> {
    match &t.data {
        Data::F32(v) if v.len() == t.numel() => Ok(v),
        Data::F32(v) => Err(bad(
            op,
            format!("{what} holds {} values for shape {:?}", v.len(), t.shape),
        )),
        Data::I32(_) => Err(bad(
            op,
            format!("{what} must be f32, got i32 {:?}", t.shape),
        )),
    }
}

/// The operand as i32, or an error naming `what`.
pub(crate) fn i32s<'a>(
    op: &'static str,
    t: &'a Tensor,
    what: &str,
) -> Result<&'a [i32], KernelError> {
    match &t.data {
        Data::I32(v) if v.len() == t.numel() => Ok(v),
        Data::I32(v) => Err(bad(
            op,
            format!("{what} holds {} values for shape {:?}", v.len(), t.shape),
        )),
        Data::F32(_) => Err(bad(
            op,
            format!("{what} must be i32, got f32 {:?}", t.shape),
        )),
    }
}

/// The output as f32, its buffer the size of its shape.
pub(crate) fn f32s_mut<'a>(
    op: &'static str,
    out: &'a mut Tensor,
) -> Result<&'a mut [f32], KernelError> {
    let (n, len) = (out.numel(), out.f32().len());
    if !out.is_f32() {
        return Err(bad(
            op,
            format!("the output must be f32, got i32 {:?}", out.shape),
        ));
    }
    if len != n {
        return Err(bad(
            op,
            format!("the output holds {len} values for shape {:?}", out.shape),
        ));
    }
    Ok(out.f32_mut())
}

/// The buffers of `x` and `out` when both hold one element type (f32 or i32) and are sized
/// to their shapes.
enum Pair<'a> {
    F(&'a [f32], &'a mut [f32]),
    I(&'a [i32], &'a mut [i32]),
}

fn pair<'a>(op: &'static str, x: &'a Tensor, out: &'a mut Tensor) -> Result<Pair<'a>, KernelError> {
    let len = |d: &Data| match d {
        Data::F32(v) => v.len(),
        Data::I32(v) => v.len(),
    };
    if len(&x.data) != x.numel() || len(&out.data) != out.numel() {
        return Err(bad(op, "a buffer's length disagrees with its shape"));
    }
    match (&x.data, &mut out.data) {
        (Data::F32(a), Data::F32(o)) => Ok(Pair::F(a, o)),
        (Data::I32(a), Data::I32(o)) => Ok(Pair::I(a, o)),
        _ => Err(bad(
            op,
            "the operand and the output have different element types",
        )),
    }
}

fn strides(shape: &[usize]) -> Small<usize> {
    let mut s: Small<usize> = smallvec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// `out[i] = map(x[offset(i)])`, the offset of output index `i` given by one stride into `x`
/// per output axis (0 repeats). Size-1 axes are dropped and contiguous axes merged, so the
/// inner loop runs along the longest run of `out` it can.
fn strided<T: Copy + Send + Sync>(
    x: &[T],
    shape: &[usize],
    xstrides: &[usize],
    out: &mut [T],
    map: impl Fn(T) -> T + Sync + Send,
) {
    // (size, stride), outermost first, merged from the innermost axis outwards.
    let mut dims: Small<(usize, usize)> = Small::new();
    for (&n, &s) in shape.iter().zip(xstrides).rev() {
        if n == 1 {
            continue;
        }
        match dims.last_mut() {
            Some(d) if s == d.0 * d.1 => d.0 *= n,
            _ => dims.push((n, s)),
        }
    }
    dims.reverse();
    let (len, step) = dims.pop().unwrap_or((1, 0));
    let outer = dims;
    for_rows(out, len, out.len(), |r, row| {
        let (mut rem, mut off) = (r, 0);
        for &(n, s) in outer.iter().rev() {
            off += rem % n * s;
            rem /= n;
        }
        match step {
            0 => row.fill(map(x[off])),
            1 => {
                for (o, &v) in row.iter_mut().zip(&x[off..off + len]) {
                    *o = map(v);
                }
            }
            _ => {
                for (j, o) in row.iter_mut().enumerate() {
                    *o = map(x[off + j * step]);
                }
            }
        }
    });
}

/// Same elements, new shape (f32 or i32).
pub fn copy(x: &Tensor, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "reshape";
    if x.numel() != out.numel() {
        return Err(bad(
            OP,
            format!(
                "cannot reshape {:?} to {:?}: element counts differ",
                x.shape, out.shape
            ),
        ));
    }
    match pair(OP, x, out)? {
        Pair::F(a, o) => o.copy_from_slice(a),
        Pair::I(a, o) => o.copy_from_slice(a),
    }
    Ok(())
}

/// `out[i_perm[0], ..] = x[i_0, ..]`: output axis `k` is input axis `perm[k]`.
pub fn permute(x: &Tensor, perm: &[usize], out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "permute";
    let rank = x.shape.len();
    let mut seen: Small<bool> = smallvec![false; rank];
    if perm.len() != rank
        || perm
            .iter()
            .any(|&p| p >= rank || std::mem::replace(&mut seen[p], true))
    {
        return Err(bad(
            OP,
            format!("{perm:?} is not a permutation of the axes of {:?}", x.shape),
        ));
    }
    let want: Small<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    if out.shape[..] != want[..] {
        return Err(bad(
            OP,
            format!(
                "{:?} permuted by {perm:?} is {want:?}, not {:?}",
                x.shape, out.shape
            ),
        ));
    }
    let xs = strides(&x.shape);
    let st: Small<usize> = perm.iter().map(|&p| xs[p]).collect();
    match pair(OP, x, out)? {
        Pair::F(a, o) => strided(a, &want, &st, o, |v| v),
        Pair::I(a, o) => strided(a, &want, &st, o, |v| v),
    }
    Ok(())
}

fn concat_rows<T: Copy + Send + Sync>(a: &[T], b: &[T], ca: usize, cb: usize, out: &mut [T]) {
    for_rows(out, ca + cb, out.len(), |r, row| {
        row[..ca].copy_from_slice(&a[r * ca..][..ca]);
        row[ca..].copy_from_slice(&b[r * cb..][..cb]);
    });
}

pub fn concat(a: &Tensor, b: &Tensor, axis: usize, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "concat";
    let rank = a.shape.len();
    let fits = b.shape.len() == rank
        && out.shape.len() == rank
        && axis < rank
        && (0..rank).all(|i| {
            if i == axis {
                out.shape[i] == a.shape[i] + b.shape[i]
            } else {
                a.shape[i] == b.shape[i] && out.shape[i] == a.shape[i]
            }
        });
    if !fits {
        return Err(bad(
            OP,
            format!(
                "cannot concatenate {:?} and {:?} along axis {axis} into {:?}",
                a.shape, b.shape, out.shape
            ),
        ));
    }
    let inner = numel(&a.shape[axis + 1..]);
    let (ca, cb) = (a.shape[axis] * inner, b.shape[axis] * inner);
    let (on, bn) = (out.numel(), b.numel());
    match (&a.data, &b.data, &mut out.data) {
        (Data::F32(x), Data::F32(y), Data::F32(o))
            if y.len() == bn && o.len() == on && x.len() == a.numel() =>
        {
            concat_rows(x, y, ca, cb, o)
        }
        (Data::I32(x), Data::I32(y), Data::I32(o))
            if y.len() == bn && o.len() == on && x.len() == a.numel() =>
        {
            concat_rows(x, y, ca, cb, o)
        }
        _ => {
            return Err(bad(
                OP,
                "operands and output must share one element type and fit their shapes",
            ))
        }
    }
    Ok(())
}

/// `x`'s shape and `out`'s agree except along `axis`.
fn check_except(
    op: &'static str,
    x: &Tensor,
    out: &Tensor,
    axis: usize,
) -> Result<(), KernelError> {
    let r = x.shape.len();
    if axis >= r || out.shape.len() != r || (0..r).any(|i| i != axis && x.shape[i] != out.shape[i])
    {
        return Err(bad(
            op,
            format!(
                "{:?} and {:?} differ other than along axis {axis}",
                x.shape, out.shape
            ),
        ));
    }
    Ok(())
}

fn slice_rows<T: Copy + Send + Sync>(x: &[T], xc: usize, from: usize, oc: usize, out: &mut [T]) {
    for_rows(out, oc, out.len(), |r, row| {
        row.copy_from_slice(&x[r * xc + from..][..oc])
    });
}

/// `out` is `x` from `start` along `axis`, as long as `out`'s axis.
pub fn slice(x: &Tensor, axis: usize, start: usize, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "slice";
    check_except(OP, x, out, axis)?;
    if start + out.shape[axis] > x.shape[axis] {
        return Err(bad(
            OP,
            format!(
                "[{start}, {start}+{}) is outside axis {axis} of {:?}",
                out.shape[axis], x.shape
            ),
        ));
    }
    let inner = numel(&x.shape[axis + 1..]);
    let (xc, oc, from) = (
        x.shape[axis] * inner,
        out.shape[axis] * inner,
        start * inner,
    );
    match pair(OP, x, out)? {
        Pair::F(a, o) => slice_rows(a, xc, from, oc, o),
        Pair::I(a, o) => slice_rows(a, xc, from, oc, o),
    }
    Ok(())
}

fn pad_rows<T: Copy + Default + Send + Sync>(
    x: &[T],
    xc: usize,
    at: usize,
    oc: usize,
    out: &mut [T],
) {
    for_rows(out, oc, out.len(), |r, row| {
        row[..at].fill(T::default());
        row[at..at + xc].copy_from_slice(&x[r * xc..][..xc]);
        row[at + xc..].fill(T::default());
    });
}

/// Zeros, with `x` written at `start` along `axis`.
pub fn pad(x: &Tensor, axis: usize, start: usize, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "pad";
    check_except(OP, x, out, axis)?;
    if start + x.shape[axis] > out.shape[axis] {
        return Err(bad(
            OP,
            format!(
                "{:?} does not fit in {:?} at {start} along axis {axis}",
                x.shape, out.shape
            ),
        ));
    }
    let inner = numel(&x.shape[axis + 1..]);
    let (xc, oc, at) = (
        x.shape[axis] * inner,
        out.shape[axis] * inner,
        start * inner,
    );
    match pair(OP, x, out)? {
        Pair::F(a, o) => pad_rows(a, xc, at, oc, o),
        Pair::I(a, o) => pad_rows(a, xc, at, oc, o),
    }
    Ok(())
}

/// Checks every index against `rows`, naming the first out of range.
fn check_indices(op: &'static str, idx: &[i32], rows: usize) -> Result<(), KernelError> {
    match idx.iter().position(|&i| i < 0 || i as usize >= rows) {
        None => Ok(()),
        Some(p) => Err(bad(
            op,
            format!("index {} at position {p} is outside [0, {rows})", idx[p]),
        )),
    }
}

/// Rows of `table [V, D]` at the i32 `indices [..]`; an index out of range is an error.
pub fn gather(table: &Tensor, indices: &Tensor, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "gather";
    if table.shape.len() != 2 {
        return Err(bad(
            OP,
            format!("the table must be [V, D], got {:?}", table.shape),
        ));
    }
    let (v, d) = (table.shape[0], table.shape[1]);
    let t = f32s(OP, table, "the table")?;
    let idx = i32s(OP, indices, "the indices")?;
    let mut want = indices.shape.clone();
    want.push(d);
    if out.shape != want {
        return Err(bad(
            OP,
            format!(
                "the output must be {want:?} for indices {:?}, got {:?}",
                indices.shape, out.shape
            ),
        ));
    }
    check_indices(OP, idx, v)?;
    let o = f32s_mut(OP, out)?;
    for_rows(o, d, idx.len() * d, |p, row| {
        row.copy_from_slice(&t[idx[p] as usize * d..][..d]);
    });
    Ok(())
}

/// `(indices [..], dy [.., D])` summed into rows of `out [V, D]`, in index order.
pub fn scatter_add(indices: &Tensor, dy: &Tensor, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "scatter_add";
    let idx = i32s(OP, indices, "the indices")?;
    let g = f32s(OP, dy, "the values")?;
    let r = indices.shape.len();
    if out.shape.len() != 2
        || dy.shape.len() != r + 1
        || dy.shape[..r] != indices.shape[..]
        || dy.shape[r] != out.shape[1]
    {
        return Err(bad(
            OP,
            format!(
                "needs indices [..], values [.., D] and output [V, D], got {:?}, {:?} and {:?}",
                indices.shape, dy.shape, out.shape
            ),
        ));
    }
    let (v, d) = (out.shape[0], out.shape[1]);
    check_indices(OP, idx, v)?;
    // The positions of each output row in ascending order (a counting sort), so that rows
    // can be summed independently yet each in index order.
    let mut first = vec![0usize; v + 1];
    for &i in idx {
        first[i as usize + 1] += 1;
    }
    for k in 0..v {
        first[k + 1] += first[k];
    }
    let mut next = first.clone();
    let mut order = vec![0usize; idx.len()];
    for (p, &i) in idx.iter().enumerate() {
        order[next[i as usize]] = p;
        next[i as usize] += 1;
    }
    let o = f32s_mut(OP, out)?;
    for_rows(o, d, (idx.len() + v) * d, |row, acc| {
        acc.fill(0.0);
        for &p in &order[first[row]..first[row + 1]] {
            for (a, &x) in acc.iter_mut().zip(&g[p * d..][..d]) {
                *a += x;
            }
        }
    });
    Ok(())
}

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
        out[0] = (sum8(x.len(), |i| x[i] as f64) / div) as f32;
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
        let base = |r: usize| {
            let (mut rem, mut base) = (r, 0);
            for &(n, s) in kept.iter().rev() {
                base += rem % n * s;
                rem /= n;
            }
            base
        };
        let reduced_off = |k: usize| {
            let (mut rem, mut off) = (k, 0);
            for &(n, s) in reduced.iter().rev() {
                off += rem % n * s;
                rem /= n;
            }
            off
        };
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
        let (mut rem, mut base) = (r, 0);
        for &(n, s) in kept.iter().rev() {
            base += rem % n * s;
            rem /= n;
        }
        for_rows(orow, COLS, total / rows, |ci, chunk| {
            let w = chunk.len();
            let mut acc = [0f64; COLS];
            let acc = &mut acc[..w];
            let start = base + ci * COLS;
            for k in 0..outer_n {
                let (mut rem, mut off) = (k, start);
                for &(n, s) in reduced.iter().rev() {
                    off += rem % n * s;
                    rem /= n;
                }
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
                for row in x[start * inner..end * inner].chunks_exact(inner) {
                    for (a, &v) in acc.iter_mut().zip(row) {
                        *a += v as f64;
                    }
                }
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
    use crate::cpu::kernels::testutil::{in_pool, zeros};
    use crate::rng::{normal, stream, uniform, Purpose};

    fn randn(n: u64, shape: &[usize]) -> Tensor {
        let s = stream(11, Purpose::Synthetic, n);
        let v = (0..numel(shape)).map(|i| normal(s, i as u64)).collect();
        Tensor::from_f32(shape.to_vec(), v)
    }

    fn randi(n: u64, shape: &[usize]) -> Tensor {
        let s = stream(12, Purpose::Synthetic, n);
        let v = (0..numel(shape))
            .map(|i| (uniform(s, i as u64) * 1000.0) as i32 - 500)
            .collect();
        Tensor::from_i32(shape.to_vec(), v)
    }

    fn zeros_i(shape: &[usize]) -> Tensor {
        Tensor::from_i32(shape.to_vec(), vec![0; numel(shape)])
    }

    /// The multi-index of flat index `i` in `shape` (row-major).
    fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
        let mut idx = vec![0; shape.len()];
        for k in (0..shape.len()).rev() {
            idx[k] = i % shape[k];
            i /= shape[k];
        }
        idx
    }

    fn ravel(idx: &[usize], shape: &[usize]) -> usize {
        idx.iter().zip(shape).fold(0, |a, (&i, &n)| a * n + i)
    }

    fn dot(a: &Tensor, b: &Tensor) -> f64 {
        a.f32()
            .iter()
            .zip(b.f32())
            .map(|(&x, &y)| x as f64 * y as f64)
            .sum()
    }

    /// `|got - want| <= tol * (1 + |want|)` everywhere.
    fn assert_close(got: &[f32], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= tol * (1.0 + w.abs()),
                "element {i}: got {g}, want {w}"
            );
        }
    }

    fn all_perms(n: usize) -> Vec<Vec<usize>> {
        if n == 0 {
            return vec![vec![]];
        }
        let mut out = vec![];
        for p in all_perms(n - 1) {
            for k in 0..n {
                let mut q = p.clone();
                q.insert(k, n - 1);
                out.push(q);
            }
        }
        out
    }

    #[test]
    fn copy_keeps_elements_and_checks_types() {
        let x = randn(0, &[3, 4]);
        let mut out = zeros(&[2, 6]);
        copy(&x, &mut out).unwrap();
        assert_eq!(out.f32(), x.f32());
        let xi = randi(0, &[3, 4]);
        let mut oi = zeros_i(&[12]);
        copy(&xi, &mut oi).unwrap();
        assert_eq!(oi.i32(), xi.i32());
        assert!(matches!(
            copy(&xi, &mut zeros(&[12])),
            Err(KernelError::Bad { .. })
        ));
        assert!(matches!(
            copy(&x, &mut zeros(&[13])),
            Err(KernelError::Bad { .. })
        ));
    }

    #[test]
    fn every_rank4_permutation_matches_the_naive_index_map() {
        let shape = [2, 3, 4, 5];
        let x = randn(1, &shape);
        let xi = randi(1, &shape);
        for perm in all_perms(4) {
            let oshape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
            let mut out = zeros(&oshape);
            permute(&x, &perm, &mut out).unwrap();
            let mut oi = zeros_i(&oshape);
            permute(&xi, &perm, &mut oi).unwrap();
            for i in 0..out.numel() {
                let oidx = unravel(i, &oshape);
                let mut xidx = vec![0; 4];
                for k in 0..4 {
                    xidx[perm[k]] = oidx[k];
                }
                let j = ravel(&xidx, &shape);
                assert_eq!(out.f32()[i], x.f32()[j], "perm {perm:?} at {oidx:?}");
                assert_eq!(oi.i32()[i], xi.i32()[j], "perm {perm:?} at {oidx:?}");
            }
            // The inverse permutation restores x.
            let mut inv = vec![0; 4];
            for (k, &p) in perm.iter().enumerate() {
                inv[p] = k;
            }
            let mut back = zeros(&shape);
            permute(&out, &inv, &mut back).unwrap();
            assert_eq!(back, x);
        }
        // Size-1 axes and a scalar.
        let y = randn(2, &[1, 5, 1, 3]);
        let mut out = zeros(&[3, 1, 5, 1]);
        permute(&y, &[3, 0, 1, 2], &mut out).unwrap();
        for i in 0..15 {
            let (a, b) = (i / 3, i % 3);
            assert_eq!(out.f32()[b * 5 + a], y.f32()[i]);
        }
        let s = randn(3, &[]);
        let mut o = zeros(&[]);
        permute(&s, &[], &mut o).unwrap();
        assert_eq!(o, s);
        assert!(permute(&x, &[0, 1, 1, 3], &mut zeros(&shape)).is_err());
        assert!(permute(&x, &[1, 0, 2, 3], &mut zeros(&shape)).is_err());
    }

    #[test]
    fn concat_slice_and_pad_match_naive_and_invert_each_other() {
        let shape = [3, 4, 5];
        for axis in 0..3 {
            let (sa, mut sb) = (shape.to_vec(), shape.to_vec());
            sb[axis] = 2;
            let a = randn(4, &sa);
            let b = randn(5, &sb);
            let mut so = shape.to_vec();
            so[axis] += 2;
            let mut out = zeros(&so);
            concat(&a, &b, axis, &mut out).unwrap();
            for i in 0..out.numel() {
                let mut idx = unravel(i, &so);
                let want = if idx[axis] < sa[axis] {
                    a.f32()[ravel(&idx, &sa)]
                } else {
                    idx[axis] -= sa[axis];
                    b.f32()[ravel(&idx, &sb)]
                };
                assert_eq!(out.f32()[i], want);
            }
            // i32 concat.
            let (ai, bi) = (randi(4, &sa), randi(5, &sb));
            let mut oi = zeros_i(&so);
            concat(&ai, &bi, axis, &mut oi).unwrap();
            // Slices give the parts back, for both element types.
            let mut back_a = zeros(&sa);
            slice(&out, axis, 0, &mut back_a).unwrap();
            assert_eq!(back_a, a);
            let mut back_b = zeros_i(&sb);
            slice(&oi, axis, sa[axis], &mut back_b).unwrap();
            assert_eq!(back_b, bi);
            // Pad is the adjoint of slice: <slice(x), r> = <x, pad(r)>.
            let start = 1;
            let mut sl = shape.to_vec();
            sl[axis] -= 2;
            let x = randn(6, &shape);
            let r = randn(7, &sl);
            let mut s = zeros(&sl);
            slice(&x, axis, start, &mut s).unwrap();
            let mut p = zeros(&shape);
            pad(&r, axis, start, &mut p).unwrap();
            assert!((dot(&s, &r) - dot(&x, &p)).abs() < 1e-9);
            for i in 0..p.numel() {
                let mut idx = unravel(i, &shape);
                let want = if idx[axis] >= start && idx[axis] < start + sl[axis] {
                    idx[axis] -= start;
                    r.f32()[ravel(&idx, &sl)]
                } else {
                    0.0
                };
                assert_eq!(p.f32()[i], want);
            }
        }
        let x = randn(8, &[3, 4]);
        assert!(slice(&x, 1, 2, &mut zeros(&[3, 3])).is_err());
        assert!(pad(&x, 1, 2, &mut zeros(&[3, 5])).is_err());
        assert!(concat(&x, &randn(9, &[2, 4]), 1, &mut zeros(&[3, 8])).is_err());
        assert!(concat(&x, &randi(9, &[3, 4]), 1, &mut zeros(&[3, 8])).is_err());
    }

    fn indices(n: u64, shape: &[usize], rows: usize) -> Tensor {
        let s = stream(13, Purpose::Synthetic, n);
        let v = (0..numel(shape))
            .map(|i| crate::rng::below(s, i as u64, rows as u64) as i32)
            .collect();
        Tensor::from_i32(shape.to_vec(), v)
    }

    #[test]
    fn gather_and_scatter_add_match_naive_and_are_adjoint() {
        let (v, d) = (7, 5);
        let table = randn(10, &[v, d]);
        let idx = indices(0, &[3, 4], v);
        let mut out = zeros(&[3, 4, d]);
        gather(&table, &idx, &mut out).unwrap();
        for p in 0..12 {
            let row = idx.i32()[p] as usize;
            assert_eq!(&out.f32()[p * d..][..d], &table.f32()[row * d..][..d]);
        }
        // Scatter-add sums the rows of dy at each index, repeated indices included.
        let dy = randn(11, &[3, 4, d]);
        let mut acc = zeros(&[v, d]);
        acc.f32_mut().fill(9.0); // overwritten, not accumulated into
        scatter_add(&idx, &dy, &mut acc).unwrap();
        let mut want = vec![0f64; v * d];
        for p in 0..12 {
            let row = idx.i32()[p] as usize;
            for k in 0..d {
                want[row * d + k] += dy.f32()[p * d + k] as f64;
            }
        }
        assert_close(acc.f32(), &want, 1e-6);
        // Adjoint: <gather(T), dy> = <T, scatter_add(dy)>.
        assert!((dot(&out, &dy) - dot(&table, &acc)).abs() < 1e-5);
    }

    #[test]
    fn out_of_range_indices_are_errors_naming_the_index() {
        let table = randn(12, &[4, 3]);
        for bad_index in [4, -1, 1000] {
            let idx = Tensor::from_i32(vec![3], vec![0, bad_index, 2]);
            let e = gather(&table, &idx, &mut zeros(&[3, 3])).unwrap_err();
            let KernelError::Bad { op, message } = e else {
                panic!("{e:?}")
            };
            assert_eq!(op, "gather");
            assert!(
                message.contains(&format!("index {bad_index} ")),
                "{message}"
            );
            let dy = randn(13, &[3, 3]);
            let e = scatter_add(&idx, &dy, &mut zeros(&[4, 3])).unwrap_err();
            assert!(
                e.to_string().contains(&format!("index {bad_index} ")),
                "{e}"
            );
        }
        // Float indices are refused.
        let fidx = Tensor::from_f32(vec![2], vec![0.0, 1.0]);
        assert!(gather(&table, &fidx, &mut zeros(&[2, 3])).is_err());
    }

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

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let x = randn(50, &[8, 64, 300]);
        let idx = indices(1, &[40, 50], 64);
        let table = randn(51, &[64, 300]);
        let dy = randn(52, &[40, 50, 300]);
        let run = || {
            let mut p = zeros(&[300, 8, 64]);
            permute(&x, &[2, 0, 1], &mut p).unwrap();
            let mut r1 = zeros(&[8, 300]);
            reduce(&x, &[1], true, &mut r1).unwrap();
            let mut r2 = zeros(&[64]);
            reduce(&x, &[0, 2], false, &mut r2).unwrap();
            let mut st = zeros(&[300]);
            sum_to(&x, &mut st).unwrap();
            let mut g = zeros(&[40, 50, 300]);
            gather(&table, &idx, &mut g).unwrap();
            let mut sa = zeros(&[64, 300]);
            scatter_add(&idx, &dy, &mut sa).unwrap();
            let mut e = zeros(&[8, 64, 3, 300]);
            expand(&r1, &[1, 2], true, &mut e).unwrap();
            let mut e2 = zeros(&[8, 64, 300]);
            expand(&r1, &[1], true, &mut e2).unwrap();
            [p, r1, r2, st, g, sa, e, e2]
        };
        let one = in_pool(1, run);
        let two = in_pool(2, run);
        for (a, b) in one.iter().zip(&two) {
            let (a, b): (Vec<u32>, Vec<u32>) = (
                a.f32().iter().map(|v| v.to_bits()).collect(),
                b.f32().iter().map(|v| v.to_bits()).collect(),
            );
            assert!(a == b);
        }
    }
}
