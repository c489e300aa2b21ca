//! Row-wise reductions over the last axis (softmax, norms, cross-entropy) and batch norm over
//! the batch and spatial axes, with their gradients.
//!
//! Values are stored in f32; every sum runs in f64, sequentially within its row (or channel),
//! and rows run on rayon threads only when the tensor is large, so results are bit-identical
//! whatever the thread count.

use super::layout::{bad, f32s, f32s_mut, fill_range, for_rows, typed};
use super::simd::{sum8, sum8_pair, vectorised};
use super::{math, scratch, KernelError};
use crate::cpu::tensor::Tensor;

/// `x`'s values and its last axis's length (its rows), with `out` checked to be shaped like
/// `x` (f32).
pub(super) fn rows_of<'a>(
    op: &'static str,
    x: &'a Tensor,
    out: &Tensor,
) -> Result<(&'a [f32], usize), KernelError> {
    let xs = f32s(op, x, "the operand")?;
    if x.shape.is_empty() {
        return Err(bad(op, "needs at least one axis"));
    }
    if out.shape != x.shape {
        return Err(bad(
            op,
            format!(
                "the output must be shaped {:?}, got {:?}",
                x.shape, out.shape
            ),
        ));
    }
    Ok((xs, x.shape[x.shape.len() - 1]))
}

/// `(x, dy)` of one shape: both as f32, with the row length.
pub(super) fn pair_of<'a>(
    op: &'static str,
    x: &'a Tensor,
    dy: &'a Tensor,
    out: &Tensor,
) -> Result<(&'a [f32], &'a [f32], usize), KernelError> {
    let (xs, c) = rows_of(op, x, out)?;
    if dy.shape != x.shape {
        return Err(bad(
            op,
            format!(
                "the gradient {:?} must be shaped like the operand {:?}",
                dy.shape, x.shape
            ),
        ));
    }
    Ok((xs, f32s(op, dy, "the gradient")?, c))
}

#[inline(always)]
pub(super) fn mean(v: &[f32]) -> f64 {
    sum8(v, |x| x as f64) / v.len() as f64
}

/// The largest value (NaNs skipped, as `f32::max`), in eight lanes so that it vectorises:
/// the max of a set does not depend on the order it is taken in.
#[inline(always)]
fn row_max(v: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = l.max(x);
        }
    }
    let m = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    chunks.remainder().iter().fold(m, |a, &b| a.max(b))
}

/// The row's max and `sum(exp(x - max))` (exponentials in f32, summed in f64).
fn max_sum_exp(v: &[f32]) -> (f32, f64) {
    let m = row_max(v);
    (m, sum8(v, |x| math::exp(x - m) as f64))
}

/// Work (in elements touched, see `layout::PAR_MIN`) that an element costing an exponential
/// counts for (a softmax's, a cross-entropy's): a cross-entropy's `[128, 10]` logits run on
/// both threads (each row's exponentials, scalar code on one thread, were 3% of the MLP
/// bench's AVX2 step).
const EXP_WORK: usize = 32;

/// Softmax over the last axis; `causal` zeroes key positions after the query's (the last two
/// axes are `[.., S, S]`).
pub fn softmax(x: &Tensor, causal: bool, out: &mut Tensor) -> Result<(), KernelError> {
    softmax_scaled(x, None, causal, out)
}

/// [`softmax`] of `x * by` (`x * by` rounded to f32, as a `scale` op before it would give),
/// without storing the scaled values.
pub fn softmax_scaled(
    x: &Tensor,
    by: Option<f32>,
    causal: bool,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "softmax";
    let (xs, c) = rows_of(OP, x, out)?;
    let r = x.shape.len();
    if causal && (r < 2 || x.shape[r - 2] != c) {
        return Err(bad(
            OP,
            format!("a causal softmax needs [.., S, S], got {:?}", x.shape),
        ));
    }
    let o = f32s_mut(OP, out)?;
    for_rows(o, c, xs.len() * EXP_WORK, |i, row| {
        let n = if causal { i % c + 1 } else { c };
        let (xr, (row, masked)) = (&xs[i * c..][..n], row.split_at_mut(n));
        softmax_row(xr, row, by);
        masked.fill(0.0);
    });
    Ok(())
}

vectorised! {
    fn softmax_row(xr: &[f32], row: &mut [f32], by: Option<f32>) = softmax_row_at;
}

/// One row of [`softmax_scaled`]: the exponentials in one pass, then their sum in order; a
/// scaled row is first scaled into the output row.
#[inline(always)]
fn softmax_row_at(xr: &[f32], row: &mut [f32], by: Option<f32>) {
    match by {
        Some(by) => {
            for (o, &v) in row.iter_mut().zip(xr) {
                *o = v * by;
            }
            let m = row_max(row);
            for o in row.iter_mut() {
                *o = math::exp(*o - m);
            }
        }
        None => {
            let m = row_max(xr);
            for (o, &v) in row.iter_mut().zip(xr) {
                *o = math::exp(v - m);
            }
        }
    }
    // Times the sum's reciprocal, as the CUDA kernel (a division per value costs more).
    let inv = 1.0 / sum8(row, |x| x as f64);
    for o in row.iter_mut() {
        *o = (*o as f64 * inv) as f32;
    }
}

/// `(y, dy)`: `y * (dy - sum(dy * y))` over the last axis.
pub fn softmax_grad(y: &Tensor, dy: &Tensor, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "softmax_grad";
    let (ys, gs, c) = pair_of(OP, y, dy, out)?;
    let o = f32s_mut(OP, out)?;
    for_rows(o, c, 2 * ys.len(), |i, row| {
        softmax_grad_row(&ys[i * c..][..c], &gs[i * c..][..c], row)
    });
    Ok(())
}

vectorised! {
    fn softmax_grad_row(yr: &[f32], gr: &[f32], row: &mut [f32]) = softmax_grad_row_at;
}

#[inline(always)]
fn softmax_grad_row_at(yr: &[f32], gr: &[f32], row: &mut [f32]) {
    let s = sum8_pair(yr, gr, |y, g| y as f64 * g as f64);
    for ((o, &y), &g) in row.iter_mut().zip(yr).zip(gr) {
        *o = (y as f64 * (g as f64 - s)) as f32;
    }
}

pub use super::norms::{layer_norm, layer_norm_grad, rms_norm, rms_norm_grad};

/// Logits `[.., C]` and labels `[..]` checked: (logits, labels, C), every label in `[0, C)`.
fn logits_labels<'a>(
    op: &'static str,
    logits: &'a Tensor,
    labels: &'a Tensor,
) -> Result<(&'a [f32], &'a [i32], usize), KernelError> {
    let xs = f32s(op, logits, "the logits")?;
    let ls = typed::<i32>(op, labels, "the labels")?;
    let r = logits.shape.len();
    if r == 0 || labels.shape[..] != logits.shape[..r - 1] {
        return Err(bad(
            op,
            format!(
                "labels {:?} do not fit logits {:?}",
                labels.shape, logits.shape
            ),
        ));
    }
    let c = logits.shape[r - 1];
    if let Some(p) = ls
        .iter()
        .position(|&l| l != IGNORE && (l < 0 || l as usize >= c))
    {
        return Err(bad(
            op,
            format!("label {} at position {p} is outside [0, {c})", ls[p]),
        ));
    }
    Ok((xs, ls, c))
}

pub use crate::exec::IGNORE;

/// Positions whose label counts.
fn counted(ls: &[i32]) -> usize {
    ls.iter().filter(|&&l| l != IGNORE).count()
}

/// Mean over every counted position of `-log softmax(logits)[label]`, with label smoothing as
/// PyTorch's `cross_entropy(label_smoothing=s)`. `labels` are i32; a label of -100 is ignored
/// (0 when every label is), any other out of range is an error.
pub fn cross_entropy(
    logits: &Tensor,
    labels: &Tensor,
    smoothing: f32,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "cross_entropy";
    let (xs, ls, c) = logits_labels(OP, logits, labels)?;
    if out.numel() != 1 {
        return Err(bad(
            OP,
            format!("the loss is a scalar, got an output {:?}", out.shape),
        ));
    }
    let s = smoothing as f64;
    // Per-sample losses in a kept buffer, summed in sample order.
    let total = scratch::with(ls.len(), |losses: &mut [f64]| {
        fill_range(losses, xs.len() * EXP_WORK, |p| match ls[p] {
            IGNORE => 0.0,
            l => xent_loss_row(&xs[p * c..][..c], l as usize, s),
        });
        losses.iter().sum::<f64>()
    });
    f32s_mut(OP, out)?[0] = (total / counted(ls).max(1) as f64) as f32;
    Ok(())
}

vectorised! {
    fn xent_loss_row(xr: &[f32], label: usize, s: f64) -> f64 = xent_loss_row_at;
}

/// One position's loss, `-log softmax(xr)[label]`, smoothed by `s`.
#[inline(always)]
fn xent_loss_row_at(xr: &[f32], label: usize, s: f64) -> f64 {
    let (m, sum) = max_sum_exp(xr);
    let lse = m as f64 + sum.ln();
    let nll = lse - xr[label] as f64;
    if s == 0.0 {
        nll
    } else {
        (1.0 - s) * nll + s * (lse - mean(xr))
    }
}

/// `(logits, labels, dloss)` to the gradient of the mean loss with respect to the logits.
pub fn cross_entropy_grad(
    logits: &Tensor,
    labels: &Tensor,
    dloss: &Tensor,
    smoothing: f32,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "cross_entropy_grad";
    let (xs, ls, c) = logits_labels(OP, logits, labels)?;
    let d = f32s(OP, dloss, "the loss gradient")?;
    if d.len() != 1 {
        return Err(bad(
            OP,
            format!("the loss gradient must be a scalar, got {:?}", dloss.shape),
        ));
    }
    if out.shape != logits.shape {
        return Err(bad(
            OP,
            format!(
                "the output must be shaped {:?}, got {:?}",
                logits.shape, out.shape
            ),
        ));
    }
    let g = d[0] as f64 / counted(ls).max(1) as f64;
    let o = f32s_mut(OP, out)?;
    xent_grad_rows(o, Some(xs), ls, c, g, smoothing as f64);
    Ok(())
}

/// `cross_entropy_grad` written over the logits (the schedule gives the gradient their
/// buffer: see `parallax_compiler::passes::schedule`).
pub fn cross_entropy_grad_in_place(
    logits: &mut Tensor,
    labels: &Tensor,
    dloss: &Tensor,
    smoothing: f32,
) -> Result<(), KernelError> {
    const OP: &str = "cross_entropy_grad";
    // Checked as the logits of `cross_entropy_grad`; the labels read again once they are.
    let c = logits_labels(OP, logits, labels)?.2;
    let ls = typed::<i32>(OP, labels, "the labels")?;
    let d = f32s(OP, dloss, "the loss gradient")?;
    if d.len() != 1 {
        return Err(bad(
            OP,
            format!("the loss gradient must be a scalar, got {:?}", dloss.shape),
        ));
    }
    let g = d[0] as f64 / counted(ls).max(1) as f64;
    let o = f32s_mut(OP, logits)?;
    xent_grad_rows(o, None, ls, c, g, smoothing as f64);
    Ok(())
}

/// The gradient into rows `o` (`c` wide) from the logits `xs`, or from `o` itself when
/// `None`: a row's maximum and sum are read before any of it is written, and each element
/// before its write, so both give the same bits.
fn xent_grad_rows(o: &mut [f32], xs: Option<&[f32]>, ls: &[i32], c: usize, g: f64, s: f64) {
    let work = o.len() * EXP_WORK;
    for_rows(o, c, work, |p, row| match ls[p] {
        IGNORE => row.fill(0.0),
        l => xent_grad_row(row, xs.map(|xs| &xs[p * c..][..c]), l as usize, (g, s)),
    });
}

vectorised! {
    fn xent_grad_row(row: &mut [f32], xr: Option<&[f32]>, label: usize, gs: (f64, f64)) = xent_grad_row_at;
}

/// One position's gradient into `row`, from its logits `xr` or from `row` itself.
#[inline(always)]
fn xent_grad_row_at(row: &mut [f32], xr: Option<&[f32]>, label: usize, (g, s): (f64, f64)) {
    let off = s / row.len() as f64;
    let (m, sum) = max_sum_exp(xr.unwrap_or(row));
    for k in 0..row.len() {
        let x = xr.map_or(row[k], |xr| xr[k]);
        let prob = math::exp(x - m) as f64 / sum;
        let target = if k == label { 1.0 - s + off } else { off };
        row[k] = (g * (prob - target)) as f32;
    }
}

#[cfg(test)]
#[path = "rows_tests.rs"]
mod tests;
