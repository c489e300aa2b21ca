//! Layer and RMS norm over the last axis and their gradients (a part of the row kernels,
//! `rows`), plus the two fused forms the plan's kernels use: rows normalized as an
//! elementwise chain hands them over (`norm_rows`, see `fused::run_blocks`), and a norm's
//! gradient with the add after it (`norm_grad_add`). Each row is computed by the same
//! functions in every form, so fused and unfused plans give the same bits.

use super::layout::{bad, f32s, f32s_mut, for_rows};
use super::rows::{mean, pair_of, rows_of};
use super::simd::{sum8, sum8_pair, vectorised};
use super::{scratch, KernelError};
use crate::cpu::tensor::Tensor;

/// Mean and `1 / sqrt(var + eps)` (biased variance, two passes).
#[inline(always)]
fn moments(v: &[f32], eps: f32) -> (f64, f64) {
    let m = mean(v);
    let var = sum8(v, |x| (x as f64 - m) * (x as f64 - m)) / v.len() as f64;
    (m, 1.0 / (var + eps as f64).sqrt())
}

/// Which norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    Layer,
    Rms,
}

/// `(x - mean) / sqrt(var + eps)` over the last axis (biased variance, as PyTorch).
pub fn layer_norm(x: &Tensor, eps: f32, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "layer_norm";
    let (xs, c) = rows_of(OP, x, out)?;
    let o = f32s_mut(OP, out)?;
    for_rows(o, c, xs.len(), |i, row| {
        layer_norm_row(&xs[i * c..][..c], row, eps)
    });
    Ok(())
}

vectorised! {
    pub(super) fn layer_norm_row(xr: &[f32], row: &mut [f32], eps: f32) = layer_norm_row_at;
}

#[inline(always)]
pub(super) fn layer_norm_row_at(xr: &[f32], row: &mut [f32], eps: f32) {
    let (m, rstd) = moments(xr, eps);
    for (o, &v) in row.iter_mut().zip(xr) {
        *o = ((v as f64 - m) * rstd) as f32;
    }
}

/// `(x, dy)`: `rstd * (dy - mean(dy) - xhat * mean(dy * xhat))` per row.
pub fn layer_norm_grad(
    x: &Tensor,
    dy: &Tensor,
    eps: f32,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "layer_norm_grad";
    let (xs, gs, c) = pair_of(OP, x, dy, out)?;
    let o = f32s_mut(OP, out)?;
    for_rows(o, c, 2 * xs.len(), |i, row| {
        layer_norm_grad_row(&xs[i * c..][..c], &gs[i * c..][..c], row, eps)
    });
    Ok(())
}

vectorised! {
    pub(super) fn layer_norm_grad_row(xr: &[f32], gr: &[f32], row: &mut [f32], eps: f32) =
        layer_norm_grad_row_at;
}

#[inline(always)]
pub(super) fn layer_norm_grad_row_at(xr: &[f32], gr: &[f32], row: &mut [f32], eps: f32) {
    let c = row.len();
    let (m, rstd) = moments(xr, eps);
    let mdy = mean(gr);
    let mdyx = sum8_pair(gr, xr, |g, x| g as f64 * (x as f64 - m) * rstd) / c as f64;
    for ((o, &x), &g) in row.iter_mut().zip(xr).zip(gr) {
        let xhat = (x as f64 - m) * rstd;
        *o = (rstd * (g as f64 - mdy - xhat * mdyx)) as f32;
    }
}

/// `1 / sqrt(mean(x^2) + eps)`.
#[inline(always)]
fn rms_scale(v: &[f32], eps: f32) -> f64 {
    let ms = sum8(v, |x| x as f64 * x as f64) / v.len() as f64;
    1.0 / (ms + eps as f64).sqrt()
}

/// `x / sqrt(mean(x^2) + eps)` over the last axis.
pub fn rms_norm(x: &Tensor, eps: f32, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "rms_norm";
    let (xs, c) = rows_of(OP, x, out)?;
    let o = f32s_mut(OP, out)?;
    for_rows(o, c, xs.len(), |i, row| {
        rms_norm_row(&xs[i * c..][..c], row, eps)
    });
    Ok(())
}

fn rms_norm_row(xr: &[f32], row: &mut [f32], eps: f32) {
    let r = rms_scale(xr, eps);
    for (o, &v) in row.iter_mut().zip(xr) {
        *o = (v as f64 * r) as f32;
    }
}

/// `(x, dy)`: `r * dy - x * r^3 * mean(dy * x)` with `r = 1 / sqrt(mean(x^2) + eps)`.
pub fn rms_norm_grad(
    x: &Tensor,
    dy: &Tensor,
    eps: f32,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "rms_norm_grad";
    let (xs, gs, c) = pair_of(OP, x, dy, out)?;
    let o = f32s_mut(OP, out)?;
    for_rows(o, c, 2 * xs.len(), |i, row| {
        rms_norm_grad_row(&xs[i * c..][..c], &gs[i * c..][..c], row, eps)
    });
    Ok(())
}

fn rms_norm_grad_row(xr: &[f32], gr: &[f32], row: &mut [f32], eps: f32) {
    let c = row.len();
    let r = rms_scale(xr, eps);
    let mdx = xr
        .iter()
        .zip(gr)
        .map(|(&x, &g)| x as f64 * g as f64)
        .sum::<f64>()
        / c as f64;
    let k = r * r * r * mdx;
    for ((o, &x), &g) in row.iter_mut().zip(xr).zip(gr) {
        *o = (r * g as f64 - x as f64 * k) as f32;
    }
}

/// Normalizes whole rows of `c` values of `xs` into `out` (one thread: the caller splits the
/// rows), as `layer_norm` and `rms_norm` do each row.
pub fn norm_rows(norm: Norm, xs: &[f32], out: &mut [f32], c: usize, eps: f32) {
    if c == 0 {
        return;
    }
    for (xr, row) in xs.chunks_exact(c).zip(out.chunks_exact_mut(c)) {
        match norm {
            Norm::Layer => layer_norm_row(xr, row, eps),
            Norm::Rms => rms_norm_row(xr, row, eps),
        }
    }
}

/// A norm's gradient of `(x, dy)` added to `other` without storing the gradient, row by row
/// (an f32 add, commutative: either operand order of the add gives these bits). `other:
/// None` means `out` already holds it (the sum written over it).
pub fn norm_grad_add(
    norm: Norm,
    x: &Tensor,
    dy: &Tensor,
    other: Option<&Tensor>,
    eps: f32,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "norm_grad+add";
    let (xs, gs, c) = pair_of(OP, x, dy, out)?;
    let other = match other {
        Some(t) if t.shape != x.shape => {
            return Err(bad(
                OP,
                format!("adds {:?} to a gradient of {:?}", t.shape, x.shape),
            ))
        }
        Some(t) => Some(f32s(OP, t, "the added value")?),
        None => None,
    };
    let o = f32s_mut(OP, out)?;
    let grad_row = |xr: &[f32], gr: &[f32], dx: &mut [f32]| match norm {
        Norm::Layer => layer_norm_grad_row(xr, gr, dx, eps),
        Norm::Rms => rms_norm_grad_row(xr, gr, dx, eps),
    };
    for_rows(o, c, 3 * xs.len(), |i, row| {
        let (xr, gr) = (&xs[i * c..][..c], &gs[i * c..][..c]);
        match other {
            // The gradient into the output row, then the other value added to it.
            Some(t) => {
                grad_row(xr, gr, row);
                for (o, &b) in row.iter_mut().zip(&t[i * c..][..c]) {
                    *o += b;
                }
            }
            // The output row holds the other value: the gradient goes to a scratch row.
            None => scratch::with(c, |dx: &mut [f32]| {
                grad_row(xr, gr, dx);
                for (o, &d) in row.iter_mut().zip(&*dx) {
                    *o += d;
                }
            }),
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::kernels::testutil::zeros;
    use crate::rng::{normal, stream, Purpose};

    fn randn(n: u64, shape: &[usize], scale: f32) -> Tensor {
        let s = stream(31, Purpose::Synthetic, n);
        let len = shape.iter().product();
        let v = (0..len).map(|i| scale * normal(s, i as u64)).collect();
        Tensor::from_f32(shape.to_vec(), v)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    /// The gradient plus another value, into a buffer or written over that value, has the
    /// bits of the gradient kernel followed by an add; the rows handed over by a chain
    /// normalize to the plain kernel's bits.
    #[test]
    fn fused_forms_give_the_unfused_bits() {
        let shape = [5, 3, 40];
        let (x, dy, r) = (
            randn(1, &shape, 2.0),
            randn(2, &shape, 1.0),
            randn(3, &shape, 1.0),
        );
        let eps = 1e-5;
        for norm in [Norm::Layer, Norm::Rms] {
            let mut dx = zeros(&shape);
            let mut y = zeros(&shape);
            match norm {
                Norm::Layer => {
                    layer_norm_grad(&x, &dy, eps, &mut dx).unwrap();
                    layer_norm(&x, eps, &mut y).unwrap();
                }
                Norm::Rms => {
                    rms_norm_grad(&x, &dy, eps, &mut dx).unwrap();
                    rms_norm(&x, eps, &mut y).unwrap();
                }
            }
            let want: Vec<f32> = r.f32().iter().zip(dx.f32()).map(|(a, b)| a + b).collect();
            let mut out = zeros(&shape);
            norm_grad_add(norm, &x, &dy, Some(&r), eps, &mut out).unwrap();
            assert_eq!(bits(out.f32()), bits(&want), "{norm:?}");
            let mut over = r.clone();
            norm_grad_add(norm, &x, &dy, None, eps, &mut over).unwrap();
            assert_eq!(bits(over.f32()), bits(&want), "{norm:?} in place");
            let mut rows = vec![0.0; x.f32().len()];
            norm_rows(norm, x.f32(), &mut rows, 40, eps);
            assert_eq!(bits(&rows), bits(y.f32()), "{norm:?} rows");
        }
        // An added value of another shape is an error, not a panic.
        let mut out = zeros(&shape);
        let small = randn(4, &[3, 40], 1.0);
        let err = norm_grad_add(Norm::Layer, &x, &dy, Some(&small), eps, &mut out);
        assert!(err.is_err());
    }
}
