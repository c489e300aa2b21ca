//! Convolution (im2col + GEMM) and pooling, with their gradients. Tensors are NCHW; kernels
//! are square.
//!
//! Determinism: samples (and pooled planes) are independent and each is computed in one
//! fixed order; the weight gradient sums over the batch inside one GEMM reduction (the batch
//! folded into K) whose chunks are sized from the shapes alone and added in sample order.

use super::gemm::{check_f32, gemm_into, parallelism, View, PARALLEL_WORK};
use super::{scratch, KernelError};
use crate::cpu::tensor::Tensor;
use rayon::prelude::*;
use std::hint::select_unpredictable;

/// The most elements the weight gradient's im2col buffer holds at once (16 MiB of f32).
const COL_LIMIT: usize = 1 << 22;

fn bad(op: &'static str, message: String) -> KernelError {
    KernelError::Bad { op, message }
}

/// `(size + 2 padding - kernel) / stride + 1`, if at least 1.
fn window_out(size: usize, kernel: usize, stride: usize, padding: usize) -> Option<usize> {
    let padded = size.checked_add(padding.checked_mul(2)?)?;
    if stride == 0 || kernel == 0 || padded < kernel {
        return None;
    }
    Some((padded - kernel) / stride + 1)
}

/// The sizes of one convolution, validated.
#[derive(Debug, Clone, Copy)]
struct Geom {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    groups: usize,
    kh: usize,
    kw: usize,
    ho: usize,
    wo: usize,
    stride: usize,
    pad: usize,
}

impl Geom {
    /// From `x [N, C, H, W]` and `w [O, C/groups, KH, KW]`'s shapes.
    fn new(
        op: &'static str,
        x: &[usize],
        w: &[usize],
        stride: usize,
        pad: usize,
        groups: usize,
    ) -> Result<Geom, KernelError> {
        let (&[n, c, h, wd], &[o, cg, kh, kw]) = (x, w) else {
            return Err(bad(
                op,
                format!("needs [N, C, H, W] and [O, C/groups, K, K], got {x:?} and {w:?}"),
            ));
        };
        if groups == 0 || cg.checked_mul(groups) != Some(c) || o % groups != 0 {
            return Err(bad(
                op,
                format!(
                    "{c} input and {o} output channels do not split into {groups} groups of {cg}"
                ),
            ));
        }
        let (Some(ho), Some(wo)) = (
            window_out(h, kh, stride, pad),
            window_out(wd, kw, stride, pad),
        ) else {
            return Err(bad(
                op,
                format!("a {kh}x{kw} kernel with stride {stride} does not fit a {h}x{wd} input with padding {pad}"),
            ));
        };
        Ok(Geom {
            n,
            c,
            h,
            w: wd,
            o,
            groups,
            kh,
            kw,
            ho,
            wo,
            stride,
            pad,
        })
    }

    fn y_shape(&self) -> [usize; 4] {
        [self.n, self.o, self.ho, self.wo]
    }
    fn cg(&self) -> usize {
        self.c / self.groups
    }
    fn og(&self) -> usize {
        self.o / self.groups
    }
    /// Rows of a group's im2col matrix: `C/groups * KH * KW`.
    fn cgkk(&self) -> usize {
        self.cg() * self.kh * self.kw
    }
    fn in_plane(&self) -> usize {
        self.h * self.w
    }
    fn out_plane(&self) -> usize {
        self.ho * self.wo
    }
    /// Whether im2col is the identity (1x1 kernel, stride 1, no padding).
    fn direct(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == 1 && self.pad == 0
    }
}

/// The outputs `lo..hi` along one axis whose input `o * stride + k - pad` lies in `0..size`.
fn valid(size: usize, out: usize, k: usize, stride: usize, pad: usize) -> (usize, usize) {
    let lo = if pad > k {
        (pad - k).div_ceil(stride)
    } else {
        0
    };
    let hi = if size + pad > k {
        ((size + pad - k - 1) / stride + 1).min(out)
    } else {
        0
    };
    (lo.min(hi), hi)
}

/// Fills one im2col row, `dst [Ho * Wo]`, with the `(ki, kj)` tap of `plane [H, W]`.
fn im2col_row(dst: &mut [f32], plane: &[f32], ki: usize, kj: usize, g: &Geom) {
    let (s, p) = (g.stride, g.pad);
    let (rlo, rhi) = valid(g.h, g.ho, ki, s, p);
    let (clo, chi) = valid(g.w, g.wo, kj, s, p);
    dst[..rlo * g.wo].fill(0.0);
    dst[rhi * g.wo..].fill(0.0);
    for oh in rlo..rhi {
        let row = &mut dst[oh * g.wo..(oh + 1) * g.wo];
        let src = &plane[(oh * s + ki - p) * g.w..][..g.w];
        row[..clo].fill(0.0);
        row[chi..].fill(0.0);
        if s == 1 {
            row[clo..chi].copy_from_slice(&src[clo + kj - p..chi + kj - p]);
        } else {
            for (ow, d) in row.iter_mut().enumerate().take(chi).skip(clo) {
                *d = src[ow * s + kj - p];
            }
        }
    }
}

/// Adds one im2col row, `src [Ho * Wo]`, back into its `(ki, kj)` tap of `plane [H, W]`.
fn col2im_row(plane: &mut [f32], src: &[f32], ki: usize, kj: usize, g: &Geom) {
    let (s, p) = (g.stride, g.pad);
    let (rlo, rhi) = valid(g.h, g.ho, ki, s, p);
    let (clo, chi) = valid(g.w, g.wo, kj, s, p);
    for oh in rlo..rhi {
        let row = &src[oh * g.wo..(oh + 1) * g.wo];
        let dst = &mut plane[(oh * s + ki - p) * g.w..][..g.w];
        if s == 1 {
            let dst = &mut dst[clo + kj - p..chi + kj - p];
            for (d, &v) in dst.iter_mut().zip(&row[clo..chi]) {
                *d += v;
            }
        } else {
            for (ow, &v) in row.iter().enumerate().take(chi).skip(clo) {
                dst[ow * s + kj - p] += v;
            }
        }
    }
}

/// The im2col matrix `col [C * KH * KW, Ho * Wo]` of one sample `xs [C, H, W]`.
fn im2col(col: &mut [f32], xs: &[f32], g: &Geom) {
    let (ip, op) = (g.in_plane(), g.out_plane());
    for (r, dst) in col.chunks_mut(op).enumerate() {
        let (c, k) = (r / (g.kh * g.kw), r % (g.kh * g.kw));
        im2col_row(dst, &xs[c * ip..(c + 1) * ip], k / g.kw, k % g.kw, g);
    }
}

/// Runs `f(scratch, sample, out_sample)` over the chunks of `out`, in parallel when `parallel`.
/// Each sample's result depends only on its inputs, so the split does not change any bit.
fn per_sample<F>(out: &mut [f32], len: usize, parallel: bool, f: F)
where
    F: Fn(&mut Vec<f32>, usize, &mut [f32]) + Send + Sync,
{
    if len == 0 {
        return;
    }
    if parallel {
        out.par_chunks_mut(len)
            .enumerate()
            .for_each(|(i, o)| scratch::with_vec(|s| f(s, i, o)));
    } else {
        scratch::with_vec(|s| {
            for (i, o) in out.chunks_mut(len).enumerate() {
                f(s, i, o);
            }
        });
    }
}

fn check_shape(
    op: &'static str,
    what: &str,
    t: &Tensor,
    want: &[usize],
) -> Result<(), KernelError> {
    if t.shape != want {
        return Err(bad(
            op,
            format!("{what} is {:?}, expected {want:?}", t.shape),
        ));
    }
    Ok(())
}

/// `x [N, C, H, W]`, `w [O, C/groups, K, K]` to `out [N, O, Ho, Wo]`.
pub fn conv2d(
    x: &Tensor,
    w: &Tensor,
    stride: usize,
    padding: usize,
    groups: usize,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "conv2d";
    check_f32(OP, "the input", x)?;
    check_f32(OP, "the weights", w)?;
    check_f32(OP, "the output", out)?;
    let g = Geom::new(OP, &x.shape, &w.shape, stride, padding, groups)?;
    check_shape(OP, "the output", out, &g.y_shape())?;
    let (xv, wv) = (x.f32(), w.f32());
    let (og, cgkk, op, ip) = (g.og(), g.cgkk(), g.out_plane(), g.in_plane());
    let par = parallelism(og, op, cgkk);
    let parallel = g.n > 1 && (og * op * cgkk).saturating_mul(g.groups * g.n) > PARALLEL_WORK;
    per_sample(out.f32_mut(), g.o * op, parallel, |col, i, ys| {
        let xs = &xv[i * g.c * ip..(i + 1) * g.c * ip];
        let col: &[f32] = if g.direct() {
            xs
        } else {
            col.resize(g.groups * cgkk * op, 0.0);
            im2col(col, xs, &g);
            col
        };
        for gi in 0..g.groups {
            let lhs = View::new(&wv[gi * og * cgkk..(gi + 1) * og * cgkk], cgkk, 1);
            let rhs = View::new(&col[gi * cgkk * op..(gi + 1) * cgkk * op], op, 1);
            let dst = &mut ys[gi * og * op..(gi + 1) * og * op];
            gemm_into(og, op, cgkk, dst, op, false, lhs, rhs, par);
        }
    });
    Ok(())
}

/// `dy [N, O, Ho, Wo]`, `w` to `out = dx [N, C, H, W]` (shape given by `out`).
pub fn conv2d_grad_input(
    dy: &Tensor,
    w: &Tensor,
    stride: usize,
    padding: usize,
    groups: usize,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "conv2d_grad_input";
    check_f32(OP, "the output gradient", dy)?;
    check_f32(OP, "the weights", w)?;
    check_f32(OP, "the input gradient", out)?;
    let g = Geom::new(OP, &out.shape, &w.shape, stride, padding, groups)?;
    check_shape(OP, "the output gradient", dy, &g.y_shape())?;
    let (dyv, wv) = (dy.f32(), w.f32());
    let (og, cgkk, op, ip) = (g.og(), g.cgkk(), g.out_plane(), g.in_plane());
    let par = parallelism(cgkk, op, og);
    let parallel = g.n > 1 && (og * op * cgkk).saturating_mul(g.groups * g.n) > PARALLEL_WORK;
    per_sample(out.f32_mut(), g.c * ip, parallel, |col, i, dxs| {
        let dys = &dyv[i * g.o * op..(i + 1) * g.o * op];
        let direct = g.direct();
        if !direct {
            col.resize(g.groups * cgkk * op, 0.0);
        }
        // Per group, `col [C/g*K*K, HoWo] = w_g^T [C/g*K*K, O/g] x dy_g [O/g, HoWo]`.
        for gi in 0..g.groups {
            let lhs = View::new(&wv[gi * og * cgkk..(gi + 1) * og * cgkk], 1, cgkk);
            let rhs = View::new(&dys[gi * og * op..(gi + 1) * og * op], op, 1);
            let dst = if direct {
                &mut dxs[gi * cgkk * op..(gi + 1) * cgkk * op]
            } else {
                &mut col[gi * cgkk * op..(gi + 1) * cgkk * op]
            };
            gemm_into(cgkk, op, og, dst, op, false, lhs, rhs, par);
        }
        if !direct {
            dxs.fill(0.0);
            for (r, src) in col.chunks(op).enumerate() {
                let (c, k) = (r / (g.kh * g.kw), r % (g.kh * g.kw));
                col2im_row(&mut dxs[c * ip..(c + 1) * ip], src, k / g.kw, k % g.kw, &g);
            }
        }
    });
    Ok(())
}

/// `x [N, C, H, W]`, `dy [N, O, Ho, Wo]` to `out = dw [O, C/groups, K, K]`.
pub fn conv2d_grad_weight(
    x: &Tensor,
    dy: &Tensor,
    stride: usize,
    padding: usize,
    groups: usize,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "conv2d_grad_weight";
    check_f32(OP, "the input", x)?;
    check_f32(OP, "the output gradient", dy)?;
    check_f32(OP, "the weight gradient", out)?;
    let g = Geom::new(OP, &x.shape, &out.shape, stride, padding, groups)?;
    check_shape(OP, "the output gradient", dy, &g.y_shape())?;
    grad_weight(x.f32(), dy.f32(), &g, COL_LIMIT, out.f32_mut());
    Ok(())
}

/// The weight gradient with an im2col buffer of at most about `col_limit` elements.
fn grad_weight(xv: &[f32], dyv: &[f32], g: &Geom, col_limit: usize, dw: &mut [f32]) {
    let (cgkk, op) = (g.cgkk(), g.out_plane());
    let rows = g.groups * cgkk;
    if g.n == 0 || dw.is_empty() {
        dw.fill(0.0);
        return;
    }
    // The batch folds into the GEMM's K: `dw_g = dy_g [O/g, n*HoWo] x col_g^T`, the columns
    // of both ordered (sample, output position). Chunks of samples (sized from the shapes)
    // accumulate in sample order.
    let chunk = (col_limit / (rows * op).max(1)).clamp(1, g.n);
    let ncol = rows * chunk * op;
    scratch::with(ncol + g.o * chunk * op, |buf: &mut [f32]| {
        let (col, dyb) = buf.split_at_mut(ncol);
        grad_weight_chunks(xv, dyv, g, chunk, col, dyb, dw)
    });
}

/// `grad_weight` over chunks of `chunk` samples, with buffers for their columns and output
/// gradients.
fn grad_weight_chunks(
    xv: &[f32],
    dyv: &[f32],
    g: &Geom,
    chunk: usize,
    col: &mut [f32],
    dyb: &mut [f32],
    dw: &mut [f32],
) {
    let (og, cgkk, op, ip) = (g.og(), g.cgkk(), g.out_plane(), g.in_plane());
    let rows = g.groups * cgkk;
    for n0 in (0..g.n).step_by(chunk) {
        let nb = chunk.min(g.n - n0);
        let kc = nb * op;
        let fill_col = |r: usize, row: &mut [f32]| {
            let (c, k) = (r / (g.kh * g.kw), r % (g.kh * g.kw));
            for (s, dst) in row.chunks_mut(op).enumerate() {
                let plane = &xv[((n0 + s) * g.c + c) * ip..][..ip];
                im2col_row(dst, plane, k / g.kw, k % g.kw, g);
            }
        };
        let fill_dy = |oc: usize, row: &mut [f32]| {
            for (s, dst) in row.chunks_mut(op).enumerate() {
                dst.copy_from_slice(&dyv[((n0 + s) * g.o + oc) * op..][..op]);
            }
        };
        let (col, dyb) = (&mut col[..rows * kc], &mut dyb[..g.o * kc]);
        if col.len() + dyb.len() > PARALLEL_WORK {
            col.par_chunks_mut(kc)
                .enumerate()
                .for_each(|(r, row)| fill_col(r, row));
            dyb.par_chunks_mut(kc)
                .enumerate()
                .for_each(|(oc, row)| fill_dy(oc, row));
        } else {
            col.chunks_mut(kc)
                .enumerate()
                .for_each(|(r, row)| fill_col(r, row));
            dyb.chunks_mut(kc)
                .enumerate()
                .for_each(|(oc, row)| fill_dy(oc, row));
        }
        let par = parallelism(og, cgkk, kc);
        for gi in 0..g.groups {
            let lhs = View::new(&dyb[gi * og * kc..(gi + 1) * og * kc], kc, 1);
            let rhs = View::new(&col[gi * cgkk * kc..(gi + 1) * cgkk * kc], 1, kc);
            let dst = &mut dw[gi * og * cgkk..(gi + 1) * og * cgkk];
            gemm_into(og, cgkk, kc, dst, cgkk, n0 > 0, lhs, rhs, par);
        }
    }
}

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
    use crate::cpu::kernels::testutil::zeros;

    /// Uniform in [-1, 1), keyed by `tag`.
    fn random(shape: &[usize], tag: u64) -> Tensor {
        crate::cpu::kernels::testutil::uniform_tensor(11, shape, tag)
    }
    use crate::cpu::tensor::numel;

    fn f64s(t: &Tensor) -> Vec<f64> {
        t.f32().iter().map(|&v| v as f64).collect()
    }

    /// `|got - want| <= rel * (1 + |want|)` elementwise.
    fn assert_close(got: &[f32], want: &[f64], rel: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= rel * (1.0 + w.abs()),
                "{what}, element {i}: got {g}, want {w}"
            );
        }
    }

    /// A convolution case: `x [n, c, h, w]`, `w [o, c/groups, k, k]`.
    #[derive(Debug, Clone, Copy)]
    struct Case {
        n: usize,
        c: usize,
        h: usize,
        w: usize,
        o: usize,
        k: usize,
        s: usize,
        p: usize,
        g: usize,
    }

    /// `[n, c, h, w, o, k, stride, padding, groups]`.
    const fn case([n, c, h, w, o, k, s, p, g]: [usize; 9]) -> Case {
        Case {
            n,
            c,
            h,
            w,
            o,
            k,
            s,
            p,
            g,
        }
    }

    impl Case {
        fn x(&self) -> [usize; 4] {
            [self.n, self.c, self.h, self.w]
        }
        fn wt(&self) -> [usize; 4] {
            [self.o, self.c / self.g, self.k, self.k]
        }
        fn ho(&self) -> usize {
            (self.h + 2 * self.p - self.k) / self.s + 1
        }
        fn wo(&self) -> usize {
            (self.w + 2 * self.p - self.k) / self.s + 1
        }
        fn y(&self) -> [usize; 4] {
            [self.n, self.o, self.ho(), self.wo()]
        }

        /// Calls `f(x index, w index, y index)` for every product of the convolution.
        fn taps(&self, mut f: impl FnMut(usize, usize, usize)) {
            let (cg, og) = (self.c / self.g, self.o / self.g);
            let (ho, wo) = (self.ho(), self.wo());
            for n in 0..self.n {
                for o in 0..self.o {
                    for oh in 0..ho {
                        for ow in 0..wo {
                            let yi = ((n * self.o + o) * ho + oh) * wo + ow;
                            for cl in 0..cg {
                                let c = o / og * cg + cl;
                                for ki in 0..self.k {
                                    for kj in 0..self.k {
                                        let ih = (oh * self.s + ki) as isize - self.p as isize;
                                        let iw = (ow * self.s + kj) as isize - self.p as isize;
                                        if ih < 0
                                            || iw < 0
                                            || ih >= self.h as isize
                                            || iw >= self.w as isize
                                        {
                                            continue;
                                        }
                                        let xi = ((n * self.c + c) * self.h + ih as usize) * self.w
                                            + iw as usize;
                                        let wi = ((o * cg + cl) * self.k + ki) * self.k + kj;
                                        f(xi, wi, yi);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }

        fn conv(&self, x: &[f64], w: &[f64]) -> Vec<f64> {
            let mut y = vec![0f64; numel(&self.y())];
            self.taps(|xi, wi, yi| y[yi] += x[xi] * w[wi]);
            y
        }

        /// `dx = sum over outputs of dy * w` at each tap.
        fn grad_input(&self, dy: &[f64], w: &[f64]) -> Vec<f64> {
            let mut dx = vec![0f64; numel(&self.x())];
            self.taps(|xi, wi, yi| dx[xi] += dy[yi] * w[wi]);
            dx
        }

        /// `dw = sum over outputs of dy * x` at each tap.
        fn grad_weight(&self, x: &[f64], dy: &[f64]) -> Vec<f64> {
            let mut dw = vec![0f64; numel(&self.wt())];
            self.taps(|xi, wi, yi| dw[wi] += dy[yi] * x[xi]);
            dw
        }
    }

    const CASES: [Case; 9] = [
        case([2, 3, 7, 6, 4, 3, 1, 0, 1]),
        case([2, 3, 7, 6, 4, 3, 1, 1, 1]),
        case([2, 4, 8, 7, 6, 3, 2, 1, 2]),
        case([1, 2, 5, 5, 2, 3, 2, 0, 1]),
        case([3, 4, 6, 6, 4, 1, 1, 0, 2]),
        case([2, 4, 9, 8, 4, 2, 2, 0, 2]),
        case([2, 2, 6, 5, 3, 1, 2, 1, 1]),
        case([2, 6, 5, 4, 6, 3, 1, 1, 3]),
        // Large enough for the per-sample parallel path and parallel GEMMs.
        case([4, 8, 12, 12, 16, 3, 1, 1, 1]),
    ];

    #[test]
    fn conv2d_matches_the_definition() {
        for case in &CASES {
            let (x, w) = (random(&case.x(), 1), random(&case.wt(), 2));
            let mut y = zeros(&case.y());
            conv2d(&x, &w, case.s, case.p, case.g, &mut y).unwrap();
            assert_close(
                y.f32(),
                &case.conv(&f64s(&x), &f64s(&w)),
                1e-5,
                &format!("{case:?}"),
            );
        }
    }

    #[test]
    fn conv2d_grad_input_matches_the_definition() {
        for case in CASES {
            let (dy, w) = (random(&case.y(), 3), random(&case.wt(), 2));
            let mut dx = Tensor::from_f32(case.x().to_vec(), vec![7.0; numel(&case.x())]);
            conv2d_grad_input(&dy, &w, case.s, case.p, case.g, &mut dx).unwrap();
            let want = case.grad_input(&f64s(&dy), &f64s(&w));
            assert_close(dx.f32(), &want, 1e-5, &format!("{case:?}"));
        }
    }

    #[test]
    fn conv2d_grad_weight_matches_the_definition() {
        for case in CASES {
            let (x, dy) = (random(&case.x(), 1), random(&case.y(), 3));
            let mut dw = Tensor::from_f32(case.wt().to_vec(), vec![7.0; numel(&case.wt())]);
            conv2d_grad_weight(&x, &dy, case.s, case.p, case.g, &mut dw).unwrap();
            let want = case.grad_weight(&f64s(&x), &f64s(&dy));
            assert_close(dw.f32(), &want, 1e-5, &format!("{case:?}"));
        }
    }

    #[test]
    fn grad_weight_accumulates_chunks_of_samples() {
        let case = case([5, 4, 6, 5, 4, 3, 1, 1, 2]);
        let (x, dy) = (random(&case.x(), 1), random(&case.y(), 3));
        let geom = Geom::new("test", &case.x(), &case.wt(), case.s, case.p, case.g).unwrap();
        let want = case.grad_weight(&f64s(&x), &f64s(&dy));
        let rows_per_sample = case.c * case.k * case.k * case.ho() * case.wo();
        // Chunks of 1, 2 (with a remainder) and all 5 samples.
        for limit in [1, 2 * rows_per_sample, usize::MAX / 2] {
            let mut dw = vec![7f32; numel(&case.wt())];
            grad_weight(x.f32(), dy.f32(), &geom, limit, &mut dw);
            assert_close(&dw, &want, 1e-5, &format!("limit {limit}"));
        }
    }

    /// `L(x, w) = sum(conv(x, w) * r)` in f64; its central differences must match the
    /// gradient kernels run with `dy = r`.
    #[test]
    fn gradients_match_finite_differences() {
        for case in &CASES[..8] {
            let (x, w, r) = (
                random(&case.x(), 1),
                random(&case.wt(), 2),
                random(&case.y(), 4),
            );
            let (xf, wf, rf) = (f64s(&x), f64s(&w), f64s(&r));
            let loss = |x: &[f64], w: &[f64]| -> f64 {
                case.conv(x, w).iter().zip(&rf).map(|(a, b)| a * b).sum()
            };
            let eps = 1e-3;
            let mut dx = zeros(&case.x());
            conv2d_grad_input(&r, &w, case.s, case.p, case.g, &mut dx).unwrap();
            let mut fd = Vec::new();
            for i in 0..xf.len() {
                let (mut plus, mut minus) = (xf.clone(), xf.clone());
                plus[i] += eps;
                minus[i] -= eps;
                fd.push((loss(&plus, &wf) - loss(&minus, &wf)) / (2.0 * eps));
            }
            assert_close(dx.f32(), &fd, 1e-5, &format!("dx {case:?}"));
            let mut dw = zeros(&case.wt());
            conv2d_grad_weight(&x, &r, case.s, case.p, case.g, &mut dw).unwrap();
            let mut fd = Vec::new();
            for i in 0..wf.len() {
                let (mut plus, mut minus) = (wf.clone(), wf.clone());
                plus[i] += eps;
                minus[i] -= eps;
                fd.push((loss(&xf, &plus) - loss(&xf, &minus)) / (2.0 * eps));
            }
            assert_close(dw.f32(), &fd, 1e-5, &format!("dw {case:?}"));
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let x = random(&[2, 4, 6, 6], 1);
        let w = random(&[4, 2, 3, 3], 2);
        let mut y = zeros(&[2, 4, 4, 4]);
        assert!(conv2d(&x, &w, 1, 0, 2, &mut y).is_ok());
        // Channels that do not match the groups, a wrong output, a kernel that does not fit.
        assert!(matches!(
            conv2d(&x, &w, 1, 0, 1, &mut y),
            Err(KernelError::Bad { .. })
        ));
        assert!(matches!(
            conv2d(&x, &w, 1, 1, 2, &mut y),
            Err(KernelError::Bad { .. })
        ));
        assert!(matches!(
            conv2d(&x, &w, 0, 0, 2, &mut y),
            Err(KernelError::Bad { .. })
        ));
        let big = random(&[4, 2, 9, 9], 2);
        assert!(matches!(
            conv2d(&x, &big, 1, 0, 2, &mut y),
            Err(KernelError::Bad { .. })
        ));
        let flat = random(&[2, 4, 36], 1);
        assert!(matches!(
            conv2d(&flat, &w, 1, 0, 2, &mut y),
            Err(KernelError::Bad { .. })
        ));
        let mut dx = zeros(&[2, 4, 6, 6]);
        let dy_wrong = zeros(&[2, 4, 5, 5]);
        assert!(matches!(
            conv2d_grad_input(&dy_wrong, &w, 1, 0, 2, &mut dx),
            Err(KernelError::Bad { .. })
        ));
        let mut dw = zeros(&[4, 2, 3, 3]);
        assert!(matches!(
            conv2d_grad_weight(&x, &dy_wrong, 1, 0, 2, &mut dw),
            Err(KernelError::Bad { .. })
        ));
        let mut p = zeros(&[2, 4, 3, 3]);
        assert!(pool2d(&x, true, 2, 2, 0, &mut p).is_ok());
        assert!(matches!(
            pool2d(&x, true, 3, 2, 0, &mut p),
            Err(KernelError::Bad { .. })
        ));
        assert!(matches!(
            pool2d(&x, true, 2, 0, 0, &mut p),
            Err(KernelError::Bad { .. })
        ));
        let mut dxp = zeros(&[2, 4, 6, 5]);
        assert!(matches!(
            pool2d_grad(&x, &p, true, 2, 2, 0, &mut dxp),
            Err(KernelError::Bad { .. })
        ));
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

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let case = case([6, 16, 20, 20, 32, 3, 1, 1, 2]);
        let (x, w, dy) = (
            random(&case.x(), 1),
            random(&case.wt(), 2),
            random(&case.y(), 3),
        );
        let pooled = [case.n, case.c, 10, 10];
        let dyp = random(&pooled, 4);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut outs = vec![zeros(&case.y()), zeros(&case.x()), zeros(&case.wt())];
                conv2d(&x, &w, case.s, case.p, case.g, &mut outs[0]).unwrap();
                conv2d_grad_input(&dy, &w, case.s, case.p, case.g, &mut outs[1]).unwrap();
                conv2d_grad_weight(&x, &dy, case.s, case.p, case.g, &mut outs[2]).unwrap();
                for max in [true, false] {
                    let mut y = zeros(&pooled);
                    pool2d(&x, max, 2, 2, 0, &mut y).unwrap();
                    let mut dx = zeros(&case.x());
                    pool2d_grad(&x, &dyp, max, 2, 2, 0, &mut dx).unwrap();
                    outs.extend([y, dx]);
                }
                outs.iter()
                    .map(|t| t.f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>())
                    .collect::<Vec<_>>()
            })
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }
}
