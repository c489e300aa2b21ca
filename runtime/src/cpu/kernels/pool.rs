//! Max and average pooling over square windows, with their gradients. Tensors are NCHW.
//!
//! Determinism: pooled planes are independent, each computed in one fixed order; a max
//! window's gradient goes to its first maximum.

use super::conv::{bad, check_shape, window_out};
use super::gemm::{check_f32, PARALLEL_WORK};
use super::{scratch, KernelError};
use crate::cpu::tensor::Tensor;
use rayon::prelude::*;
use std::hint::select_unpredictable;

/// Pooling's sizes, validated: `(N * C, H, W, Ho, Wo)`.
fn pool_geom(
    op: &'static str,
    x: &Tensor,
    kernel: usize,
    stride: usize,
    padding: usize,
) -> Result<[usize; 5], KernelError> {
    check_f32(op, "the input", x)?;
    let &[n, c, h, w] = &x.shape[..] else {
        return Err(bad(
            op,
            format!("the input must be [N, C, H, W], got {:?}", x.shape),
        ));
    };
    let (Some(ho), Some(wo)) = (
        window_out(h, kernel, stride, padding),
        window_out(w, kernel, stride, padding),
    ) else {
        return Err(bad(
            op,
            format!("a {kernel}x{kernel} window with stride {stride} does not fit a {h}x{w} input with padding {padding}"),
        ));
    };
    Ok([n * c, h, w, ho, wo])
}

/// The window of output `(oh, ow)`: the input rows and columns it covers inside the input.
#[inline]
fn window(
    oh: usize,
    ow: usize,
    k: usize,
    s: usize,
    p: usize,
    h: usize,
    w: usize,
) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let (r0, c0) = (oh * s, ow * s);
    let (r1, c1) = (
        (r0 + k).saturating_sub(p).min(h),
        (c0 + k).saturating_sub(p).min(w),
    );
    (
        r0.saturating_sub(p).min(r1)..r1,
        c0.saturating_sub(p).min(c1)..c1,
    )
}

/// Runs `f(planes of x, matching planes of out)` over batches of whole planes, in parallel
/// when large. Planes are independent, so the split does not change any result.
fn per_plane<F>(x: &[f32], ip: usize, out: &mut [f32], op: usize, f: F)
where
    F: Fn(&[f32], &mut [f32]) + Send + Sync,
{
    if ip == 0 || op == 0 {
        return;
    }
    if x.len() + out.len() > PARALLEL_WORK {
        // Whole planes per job, at least ~16K elements of work each.
        let per = ((1 << 14) / (ip + op)).max(1);
        out.par_chunks_mut(op * per)
            .zip(x.par_chunks(ip * per))
            .for_each(|(o, p)| f(p, o));
    } else {
        f(x, out);
    }
}

/// The input columns `(start, end)` each output column's window covers inside the input.
fn col_windows(cols: &mut [(usize, usize)], k: usize, s: usize, p: usize, w: usize) {
    for (ow, c) in cols.iter_mut().enumerate() {
        let (_, range) = window(0, ow, k, s, p, 1, w);
        *c = (range.start, range.end);
    }
}

/// Whether the windows are 2x2 tiles from the top-left corner (`kernel == stride == 2`, no
/// padding): every window lies inside the input, output `(oh, ow)` covering rows `2 oh`,
/// `2 oh + 1` and columns `2 ow`, `2 ow + 1`. The common case, with its own loops.
fn tiles2(k: usize, s: usize, p: usize) -> bool {
    k == 2 && s == 2 && p == 0
}

/// The maximum rule, one candidate at a time in the window's row-major order: the first
/// maximum wins, and a NaN wins at once (nothing replaces it).
#[inline(always)]
#[allow(clippy::neg_cmp_op_on_partial_ord)] // `!(v <= best)`: v > best, or v is NaN
fn beats(v: f32, best: f32) -> bool {
    // One comparison, so the selects it feeds stay branch-free.
    !best.is_nan() && !(v <= best)
}

/// The geometry of one pooling call.
#[derive(Clone, Copy)]
struct PoolGeom {
    h: usize,
    w: usize,
    k: usize,
    s: usize,
    p: usize,
}

impl PoolGeom {
    /// The input rows output row `oh`'s windows cover.
    fn rows(&self, oh: usize) -> std::ops::Range<usize> {
        window(oh, 0, self.k, self.s, self.p, self.h, 1).0
    }
}

/// Output row `oh` of max pooling one plane into `y`. Each window is scanned in row-major
/// order with the maximum kept in a register, and chosen without branches.
fn max_row(plane: &[f32], oh: usize, cols: &[(usize, usize)], g: &PoolGeom, y: &mut [f32]) {
    let rows = g.rows(oh);
    if tiles2(g.k, g.s, g.p) {
        let r0 = &plane[rows.start * g.w..][..g.w];
        let r1 = &plane[(rows.start + 1) * g.w..][..g.w];
        for ((b, t), u) in y.iter_mut().zip(r0.chunks_exact(2)).zip(r1.chunks_exact(2)) {
            // All inside the input: the first element starts the maximum.
            let mut m = t[0];
            for v in [t[1], u[0], u[1]] {
                m = select_unpredictable(beats(v, m), v, m);
            }
            *b = m;
        }
        return;
    }
    for (b, &(c0, c1)) in y.iter_mut().zip(cols) {
        // Padding is -inf, so a window's maximum is its inputs' maximum (-inf if none).
        let mut m = f32::NEG_INFINITY;
        for r in rows.clone() {
            for &v in &plane[r * g.w + c0..r * g.w + c1] {
                m = select_unpredictable(beats(v, m), v, m);
            }
        }
        *b = m;
    }
}

/// Output row `oh` of average pooling one plane into `y`: each window's sum, in row-major
/// order, over the whole window's area.
fn avg_row(plane: &[f32], oh: usize, cols: &[(usize, usize)], g: &PoolGeom, y: &mut [f32]) {
    let rows = g.rows(oh);
    let area = g.k as f32 * g.k as f32;
    for (b, &(c0, c1)) in y.iter_mut().zip(cols) {
        let mut sum = 0f32;
        for r in rows.clone() {
            for &v in &plane[r * g.w + c0..r * g.w + c1] {
                sum += v;
            }
        }
        *b = sum / area;
    }
}

/// The first maximum of each window of output row `oh`, as a flat index into the plane
/// (`usize::MAX` for a window wholly in the padding), into `at`.
fn argmax_row(plane: &[f32], oh: usize, cols: &[(usize, usize)], g: &PoolGeom, at: &mut [usize]) {
    let rows = g.rows(oh);
    let w = g.w;
    if tiles2(g.k, g.s, g.p) {
        let base = rows.start * w;
        let r0 = &plane[base..][..w];
        let r1 = &plane[base + w..][..w];
        for (ow, ((a, t), u)) in at
            .iter_mut()
            .zip(r0.chunks_exact(2))
            .zip(r1.chunks_exact(2))
            .enumerate()
        {
            let (mut m, mut i) = (t[0], 0);
            for (v, j) in [(t[1], 1), (u[0], w), (u[1], w + 1)] {
                // Data-dependent: branches would mispredict half the time.
                let take = beats(v, m);
                m = select_unpredictable(take, v, m);
                i = select_unpredictable(take, j, i);
            }
            *a = base + 2 * ow + i;
        }
        return;
    }
    for (a, &(c0, c1)) in at.iter_mut().zip(cols) {
        let (mut m, mut i) = (f32::NEG_INFINITY, usize::MAX);
        for r in rows.clone() {
            for (c, &v) in (r * w + c0..).zip(&plane[r * w + c0..r * w + c1]) {
                // The window's first element always starts the maximum.
                let take = i == usize::MAX || beats(v, m);
                m = select_unpredictable(take, v, m);
                i = select_unpredictable(take, c, i);
            }
        }
        *a = i;
    }
}

/// The gradient of 2x2 max pooling for one plane `x` (rows `w` long) into `dx`, written
/// whole: each window's four elements get `0 + dy` at the first maximum and 0 elsewhere
/// (what zeroing then adding gives), and elements outside every window 0. `code` (one per
/// output column) is scratch: each row of windows is read whole before its `dx` is written.
fn max_grad_tiles2(x: &[f32], dy: &[f32], w: usize, code: &mut [u8], dx: &mut [f32]) {
    let wo = w / 2;
    let mut done = 0;
    if wo > 0 {
        let code = &mut code[..wo];
        for ((xr, dxr), g) in x
            .chunks_exact(2 * w)
            .zip(dx.chunks_exact_mut(2 * w))
            .zip(dy.chunks_exact(wo))
        {
            let (x0, x1) = xr.split_at(w);
            for ((c, t), u) in code
                .iter_mut()
                .zip(x0.chunks_exact(2))
                .zip(x1.chunks_exact(2))
            {
                let (mut m, mut i) = (t[0], 0u8);
                for (v, j) in [(t[1], 1), (u[0], 2), (u[1], 3)] {
                    // Data-dependent: branches would mispredict half the time.
                    let take = beats(v, m);
                    m = select_unpredictable(take, v, m);
                    i = select_unpredictable(take, j, i);
                }
                *c = i;
            }
            let (d0, d1) = dxr.split_at_mut(w);
            let ds = d0.chunks_exact_mut(2).zip(d1.chunks_exact_mut(2));
            for (((dt, du), &c), &d) in ds.zip(code.iter()).zip(g) {
                let d = 0.0 + d;
                dt[0] = if c == 0 { d } else { 0.0 };
                dt[1] = if c == 1 { d } else { 0.0 };
                du[0] = if c == 2 { d } else { 0.0 };
                du[1] = if c == 3 { d } else { 0.0 };
            }
            // An odd last column lies in no window.
            d0[2 * wo..].fill(0.0);
            d1[2 * wo..].fill(0.0);
            done += 2 * w;
        }
    }
    // So does an odd last row (and everything, in a plane too small for one window).
    dx[done..].fill(0.0);
}

/// Max or average pooling of `x [N, C, H, W]` (average counts padding, as PyTorch's default).
pub fn pool2d(
    x: &Tensor,
    max: bool,
    kernel: usize,
    stride: usize,
    padding: usize,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "pool2d";
    let [_, h, w, ho, wo] = pool_geom(OP, x, kernel, stride, padding)?;
    check_f32(OP, "the output", out)?;
    let want = [x.shape[0], x.shape[1], ho, wo];
    check_shape(OP, "the output", out, &want)?;
    let g = PoolGeom {
        h,
        w,
        k: kernel,
        s: stride,
        p: padding,
    };
    scratch::with(wo, |cols: &mut [(usize, usize)]| {
        col_windows(cols, kernel, stride, padding, w);
        let cols = &*cols;
        per_plane(x.f32(), h * w, out.f32_mut(), ho * wo, |planes, ys| {
            for (plane, y) in planes.chunks_exact(h * w).zip(ys.chunks_exact_mut(ho * wo)) {
                for (oh, yrow) in y.chunks_exact_mut(wo).enumerate() {
                    if max {
                        max_row(plane, oh, cols, &g, yrow);
                    } else {
                        avg_row(plane, oh, cols, &g, yrow);
                    }
                }
            }
        });
    });
    Ok(())
}

/// `(x, dy)` to `dx` shaped like `x`. Max pooling routes each gradient to the first maximum
/// of its window. Each `dx` element adds its shares in the order of the outputs they come
/// from (row-major).
pub fn pool2d_grad(
    x: &Tensor,
    dy: &Tensor,
    max: bool,
    kernel: usize,
    stride: usize,
    padding: usize,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "pool2d_grad";
    let [planes, h, w, ho, wo] = pool_geom(OP, x, kernel, stride, padding)?;
    check_f32(OP, "the output gradient", dy)?;
    check_f32(OP, "the input gradient", out)?;
    check_shape(
        OP,
        "the output gradient",
        dy,
        &[x.shape[0], x.shape[1], ho, wo],
    )?;
    check_shape(OP, "the input gradient", out, &x.shape)?;
    if planes == 0 || h * w == 0 {
        return Ok(());
    }
    let g = PoolGeom {
        h,
        w,
        k: kernel,
        s: stride,
        p: padding,
    };
    scratch::with(wo, |cols: &mut [(usize, usize)]| {
        col_windows(cols, kernel, stride, padding, w);
        pool_grad_planes(x, dy, max, &g, cols, out);
    });
    Ok(())
}

/// `pool2d_grad`'s planes, given the input columns of each output column's window.
fn pool_grad_planes(
    x: &Tensor,
    dy: &Tensor,
    max: bool,
    g: &PoolGeom,
    cols: &[(usize, usize)],
    out: &mut Tensor,
) {
    let (w, wo) = (g.w, cols.len());
    let (ip, op) = (x.shape[2] * x.shape[3], dy.shape[2] * dy.shape[3]);
    let area = g.k as f32 * g.k as f32;
    let (xv, dyv) = (x.f32(), dy.f32());
    // `first` is the index of the first plane of `dx`.
    let grad_planes =
        |first: usize, dx: &mut [f32], shares: &mut [f32], at: &mut [usize], code: &mut [u8]| {
            for (i, dx) in dx.chunks_exact_mut(ip).enumerate() {
                let plane = &xv[(first + i) * ip..(first + i + 1) * ip];
                let gp = &dyv[(first + i) * op..(first + i + 1) * op];
                if max && tiles2(g.k, g.s, g.p) {
                    max_grad_tiles2(plane, gp, w, code, dx);
                    continue;
                }
                dx.fill(0.0);
                for (oh, grow) in gp.chunks_exact(wo).enumerate() {
                    if max {
                        argmax_row(plane, oh, cols, g, at);
                        for (&a, &d) in at.iter().zip(grow) {
                            if a != usize::MAX {
                                dx[a] += d;
                            }
                        }
                    } else {
                        for (share, &d) in shares.iter_mut().zip(grow) {
                            *share = d / area;
                        }
                        for r in g.rows(oh) {
                            let xrow = &mut dx[r * w..(r + 1) * w];
                            for (&share, &(c0, c1)) in shares.iter().zip(cols) {
                                for v in &mut xrow[c0..c1] {
                                    *v += share;
                                }
                            }
                        }
                    }
                }
            }
        };
    let run = |first: usize, dx: &mut [f32]| {
        scratch::with(wo, |shares: &mut [f32]| {
            scratch::with(wo, |at: &mut [usize]| {
                scratch::with(wo, |code: &mut [u8]| {
                    grad_planes(first, dx, shares, at, code)
                })
            })
        })
    };
    let dx = out.f32_mut();
    if dx.len() + dyv.len() > PARALLEL_WORK {
        let per = ((1 << 14) / (ip + op)).max(1);
        dx.par_chunks_mut(ip * per)
            .enumerate()
            .for_each(|(j, p)| run(j * per, p));
    } else {
        run(0, dx);
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
