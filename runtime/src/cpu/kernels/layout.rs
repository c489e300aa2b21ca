//! Data movement: copies, permutations, concatenation, slices, pads, gathers and their
//! scatter-adds (sums along axes are in `reduce`), and the helpers every kernel shares
//! (operand checks, row-parallel loops).
//!
//! Every kernel checks its operands' element types and shapes and answers a mismatch with
//! `KernelError::Bad` (never a panic). Work is split across rayon threads by output rows only
//! when the tensor is large, and never inside one sum, so results are bit-identical whatever
//! the thread count.

use super::{KernelError, Small};
use crate::cpu::tensor::{numel, Data, Tensor};
use rayon::prelude::*;
use smallvec::smallvec;

/// Below this much work (elements touched) a kernel runs on the calling thread.
pub(crate) const PAR_MIN: usize = 1 << 15;
/// The least work one rayon job gets.
const JOB_MIN: usize = 1 << 12;

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

/// An element type of tensor data: what an operand check asks for.
pub(crate) trait Elem: Sized {
    /// Its name, and the other type's, in errors.
    const NAMES: [&'static str; 2];
    /// The values, if `t` holds this type.
    fn of(t: &Tensor) -> Option<&[Self]>;
}

impl Elem for f32 {
    const NAMES: [&'static str; 2] = ["f32", "i32"];
    fn of(t: &Tensor) -> Option<&[f32]> {
        t.is_f32().then(|| t.f32())
    }
}

impl Elem for i32 {
    const NAMES: [&'static str; 2] = ["i32", "f32"];
    fn of(t: &Tensor) -> Option<&[i32]> {
        (!t.is_f32()).then(|| t.i32())
    }
}

/// The operand's values as `T` (`typed::<i32>` for indices and labels), or an error naming
/// `what`.
pub(crate) fn typed<'a, T: Elem>(
    op: &'static str,
    t: &'a Tensor,
    what: &str,
) -> Result<&'a [T], KernelError> {
    let [want, other] = T::NAMES;
    match T::of(t) {
        Some(v) if v.len() == t.numel() => Ok(v),
        Some(v) => Err(bad(
            op,
            format!("{what} holds {} values for shape {:?}", v.len(), t.shape),
        )),
        None => Err(bad(
            op,
            format!("{what} must be {want}, got {other} {:?}", t.shape),
        )),
    }
}

/// The operand as f32 (the common case of `typed`).
pub(crate) fn f32s<'a>(
    op: &'static str,
    t: &'a Tensor,
    what: &str,
) -> Result<&'a [f32], KernelError> {
    typed(op, t, what)
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

/// Row-major element strides of `shape`.
pub(crate) fn strides(shape: &[usize]) -> Small<usize> {
    let mut s: Small<usize> = smallvec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Where the `i`-th element (row-major) of `dims` lies: `dims` are `(size, stride)`,
/// outermost first.
#[inline]
pub(crate) fn offset_of(i: usize, dims: &[(usize, usize)]) -> usize {
    let (mut rem, mut off) = (i, 0);
    for &(n, s) in dims.iter().rev() {
        off += rem % n * s;
        rem /= n;
    }
    off
}

/// `(size, stride)` per axis of a strided layout, outermost first, with size-1 axes dropped
/// and each axis merged into the next inner one where the two are contiguous: an element's
/// offset is `offset_of` its index over these.
pub(crate) fn merged_dims(shape: &[usize], strides: &[usize]) -> Small<(usize, usize)> {
    let mut dims: Small<(usize, usize)> = Small::new();
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n == 1 {
            continue;
        }
        match dims.last_mut() {
            Some(d) if s == d.0 * d.1 => d.0 *= n,
            _ => dims.push((n, s)),
        }
    }
    dims.reverse();
    dims
}

/// `out[i] = map(x[offset(i)])`, the offset of output index `i` given by one stride into `x`
/// per output axis (0 repeats). Size-1 axes are dropped and contiguous axes merged, so the
/// inner loop runs along the longest run of `out` it can.
pub(super) fn strided<T: Copy + Send + Sync>(
    x: &[T],
    shape: &[usize],
    xstrides: &[usize],
    out: &mut [T],
    map: impl Fn(T) -> T + Sync + Send,
) {
    let mut dims = merged_dims(shape, xstrides);
    let (len, step) = dims.pop().unwrap_or((1, 0));
    let outer = dims;
    for_rows(out, len, out.len(), |r, row| {
        let off = offset_of(r, &outer);
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
    let (xc, oc, from) = axis_rows(x, out, axis, start);
    match pair(OP, x, out)? {
        Pair::F(a, o) => slice_rows(a, xc, from, oc, o),
        Pair::I(a, o) => slice_rows(a, xc, from, oc, o),
    }
    Ok(())
}

/// A slice's or a pad's rows: `x`'s and `out`'s elements from `axis` in, and where
/// `start` along `axis` falls in such a row.
fn axis_rows(x: &Tensor, out: &Tensor, axis: usize, start: usize) -> (usize, usize, usize) {
    let inner = numel(&x.shape[axis + 1..]);
    (
        x.shape[axis] * inner,
        out.shape[axis] * inner,
        start * inner,
    )
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
    let (xc, oc, at) = axis_rows(x, out, axis, start);
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
    let idx = typed::<i32>(OP, indices, "the indices")?;
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
    let idx = typed::<i32>(OP, indices, "the indices")?;
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

#[cfg(test)]
#[path = "layout_tests.rs"]
mod tests;
