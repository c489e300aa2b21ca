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
mod tests {
    use super::*;
    use crate::cpu::kernels::testutil::{assert_near as assert_close, f64s, zeros};
    use crate::cpu::tensor::numel;

    /// Uniform in [-1, 1), keyed by `tag`.
    fn random(shape: &[usize], tag: u64) -> Tensor {
        crate::cpu::kernels::testutil::uniform_tensor(11, shape, tag)
    }

    /// Pooling by definition in f64: outputs, and the gradient for `dy`.
    fn pool_ref(
        x: &Tensor,
        dy: &[f64],
        max: bool,
        k: usize,
        s: usize,
        p: usize,
    ) -> (Vec<f64>, Vec<f64>) {
        let [n, c, h, w] = x.shape[..] else {
            unreachable!()
        };
        let (ho, wo) = ((h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1);
        let xf = f64s(x);
        let mut y = vec![0f64; n * c * ho * wo];
        let mut dx = vec![0f64; xf.len()];
        for plane in 0..n * c {
            for oh in 0..ho {
                for ow in 0..wo {
                    let yi = (plane * ho + oh) * wo + ow;
                    let (mut best, mut at, mut sum) = (f64::NEG_INFINITY, None, 0f64);
                    let mut inside = Vec::new();
                    for ki in 0..k {
                        for kj in 0..k {
                            let ih = (oh * s + ki) as isize - p as isize;
                            let iw = (ow * s + kj) as isize - p as isize;
                            if ih < 0 || iw < 0 || ih >= h as isize || iw >= w as isize {
                                continue; // padding: -inf for max, 0 for the average
                            }
                            let xi = (plane * h + ih as usize) * w + iw as usize;
                            inside.push(xi);
                            sum += xf[xi];
                            if at.is_none() || xf[xi] > best {
                                best = xf[xi];
                                at = Some(xi);
                            }
                        }
                    }
                    if max {
                        y[yi] = best;
                        dx[at.unwrap()] += dy[yi];
                    } else {
                        y[yi] = sum / (k * k) as f64;
                        for xi in inside {
                            dx[xi] += dy[yi] / (k * k) as f64;
                        }
                    }
                }
            }
        }
        (y, dx)
    }

    #[test]
    fn pooling_and_its_gradient_match_the_definition() {
        // (kernel, stride, padding)
        let windows = [
            (2, 2, 0),
            (3, 1, 1),
            (3, 2, 1),
            (2, 1, 1),
            (3, 3, 0),
            (4, 2, 2),
        ];
        for shape in [[2, 3, 6, 7], [1, 2, 5, 5], [4, 16, 20, 20]] {
            for (k, s, p) in windows {
                let x = random(&shape, 5);
                let (ho, wo) = (
                    (shape[2] + 2 * p - k) / s + 1,
                    (shape[3] + 2 * p - k) / s + 1,
                );
                let yshape = [shape[0], shape[1], ho, wo];
                let dy = random(&yshape, 6);
                for max in [true, false] {
                    let what = format!("{shape:?} k{k} s{s} p{p} max {max}");
                    let (want_y, want_dx) = pool_ref(&x, &f64s(&dy), max, k, s, p);
                    let mut y = zeros(&yshape);
                    pool2d(&x, max, k, s, p, &mut y).unwrap();
                    assert_close(y.f32(), &want_y, 1e-6, &what);
                    let mut dx = Tensor::from_f32(shape.to_vec(), vec![7.0; numel(&shape)]);
                    pool2d_grad(&x, &dy, max, k, s, p, &mut dx).unwrap();
                    assert_close(dx.f32(), &want_dx, 1e-6, &what);
                }
            }
        }
    }

    /// The first kernels' pooling, kept as the bit-exact reference for the fast loops:
    /// `(y, dx)`, each window scanned by its own loops.
    fn pool_first(
        x: &Tensor,
        dy: &Tensor,
        max: bool,
        kernel: usize,
        stride: usize,
        padding: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        fn window_max(
            plane: &[f32],
            w: usize,
            rows: std::ops::Range<usize>,
            cols: std::ops::Range<usize>,
        ) -> Option<(f32, usize)> {
            let mut best: Option<(f32, usize)> = None;
            for r in rows {
                for c in cols.clone() {
                    let v = plane[r * w + c];
                    if v.is_nan() {
                        return Some((v, r * w + c));
                    }
                    if best.is_none_or(|(b, _)| v > b) {
                        best = Some((v, r * w + c));
                    }
                }
            }
            best
        }
        let [planes, h, w, ho, wo] = pool_geom("test", x, kernel, stride, padding).unwrap();
        let area = kernel as f32 * kernel as f32;
        let (xv, dyv) = (x.f32(), dy.f32());
        let mut y = vec![0f32; planes * ho * wo];
        let mut dx = vec![0f32; planes * h * w];
        for i in 0..planes {
            let plane = &xv[i * h * w..(i + 1) * h * w];
            let dx = &mut dx[i * h * w..(i + 1) * h * w];
            for oh in 0..ho {
                for ow in 0..wo {
                    let o = (i * ho + oh) * wo + ow;
                    let (rows, cols) = window(oh, ow, kernel, stride, padding, h, w);
                    let d = dyv[o];
                    if max {
                        let best = window_max(plane, w, rows, cols);
                        y[o] = best.map_or(f32::NEG_INFINITY, |(v, _)| v);
                        if let Some((_, at)) = best {
                            dx[at] += d;
                        }
                    } else {
                        let mut sum = 0f32;
                        for r in rows.clone() {
                            for &v in &plane[r * w + cols.start..r * w + cols.end] {
                                sum += v;
                            }
                        }
                        y[o] = sum / area;
                        let share = d / area;
                        for r in rows {
                            for v in &mut dx[r * w + cols.start..r * w + cols.end] {
                                *v += share;
                            }
                        }
                    }
                }
            }
        }
        (y, dx)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// The row-at-a-time loops (and the 2x2 tiles' own loops) give the very bits of the
    /// per-window loops, on odd sizes, with ties, signed zeros, infinities and NaNs, serial
    /// and parallel, whatever the thread count.
    #[test]
    fn pooling_is_bit_identical_to_per_window_loops() {
        // (kernel, stride, padding)
        let windows = [
            (2, 2, 0),
            (2, 2, 1),
            (3, 2, 1),
            (2, 1, 0),
            (3, 3, 0),
            (3, 1, 1),
            (1, 1, 0),
            (4, 2, 2),
        ];
        let specials = [
            0.0,
            -0.0,
            1.0,
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let shapes = [
            [1, 1, 2, 2],
            [2, 3, 7, 5],
            [1, 2, 6, 9],
            [3, 2, 5, 4],
            [1, 1, 3, 1],
            // Parallel: whole planes per job, with a remainder batch.
            [5, 37, 13, 11],
            [4, 48, 26, 26],
        ];
        for (si, shape) in shapes.into_iter().enumerate() {
            for (k, s, p) in windows {
                let (Some(ho), Some(wo)) =
                    (window_out(shape[2], k, s, p), window_out(shape[3], k, s, p))
                else {
                    continue;
                };
                let yshape = [shape[0], shape[1], ho, wo];
                for special in [false, true] {
                    let mut x = random(&shape, 20 + si as u64);
                    if special {
                        // Coarse values tie often; some are special.
                        for (i, v) in x.f32_mut().iter_mut().enumerate() {
                            *v = match i * 7919 % 23 {
                                j @ 0..=6 => specials[j],
                                _ => (*v * 2.0).round(),
                            };
                        }
                    }
                    let mut dy = random(&yshape, 30 + si as u64);
                    dy.f32_mut()[0] = -0.0;
                    for max in [true, false] {
                        let what = format!("{shape:?} k{k} s{s} p{p} max {max} special {special}");
                        let (want_y, want_dx) = pool_first(&x, &dy, max, k, s, p);
                        for threads in [1, 2, 3] {
                            let pool = rayon::ThreadPoolBuilder::new()
                                .num_threads(threads)
                                .build()
                                .unwrap();
                            let (y, dx) = pool.install(|| {
                                let mut y =
                                    Tensor::from_f32(yshape.to_vec(), vec![7.0; numel(&yshape)]);
                                pool2d(&x, max, k, s, p, &mut y).unwrap();
                                let mut dx =
                                    Tensor::from_f32(shape.to_vec(), vec![7.0; numel(&shape)]);
                                pool2d_grad(&x, &dy, max, k, s, p, &mut dx).unwrap();
                                (y, dx)
                            });
                            assert_eq!(bits(y.f32()), bits(&want_y), "y {what}");
                            assert_eq!(bits(dx.f32()), bits(&want_dx), "dx {what}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn max_pooling_routes_ties_to_the_first_maximum() {
        // All equal: each 2x2 window's gradient goes to its top-left element.
        let x = Tensor::from_f32(vec![1, 1, 4, 4], vec![1.0; 16]);
        let dy = Tensor::from_f32(vec![1, 1, 2, 2], vec![1.0, 2.0, 3.0, 4.0]);
        let mut dx = zeros(&[1, 1, 4, 4]);
        pool2d_grad(&x, &dy, true, 2, 2, 0, &mut dx).unwrap();
        #[rustfmt::skip]
        let want = [
            1.0, 0.0, 2.0, 0.0,
            0.0, 0.0, 0.0, 0.0,
            3.0, 0.0, 4.0, 0.0,
            0.0, 0.0, 0.0, 0.0,
        ];
        assert_eq!(dx.f32(), want);
        // Negative inputs with padding: padding never wins (it is -inf), so the maximum is
        // the window's largest input.
        let x = Tensor::from_f32(vec![1, 1, 2, 2], vec![-3.0, -1.0, -2.0, -4.0]);
        let mut y = zeros(&[1, 1, 3, 3]);
        pool2d(&x, true, 2, 1, 1, &mut y).unwrap();
        assert_eq!(
            y.f32(),
            [-3.0, -1.0, -1.0, -2.0, -1.0, -1.0, -2.0, -2.0, -4.0]
        );
        // The average divides by the whole window, padding included.
        let mut avg = zeros(&[1, 1, 3, 3]);
        pool2d(&x, false, 2, 1, 1, &mut avg).unwrap();
        assert_eq!(
            avg.f32(),
            [-0.75, -1.0, -0.25, -1.25, -2.5, -1.25, -0.5, -1.5, -1.0]
        );
    }
}
