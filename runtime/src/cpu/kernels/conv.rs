//! Convolution (im2col + GEMM) with its gradients (pooling is in `pool`). Tensors are NCHW;
//! kernels are square.
//!
//! Determinism: samples are independent and each is computed in one
//! fixed order; the weight gradient sums over the batch inside one GEMM reduction (the batch
//! folded into K) whose chunks are sized from the shapes alone and added in sample order.

use super::gemm::{check_f32, gemm_into, parallelism, View, PARALLEL_WORK};
use super::{scratch, KernelError};
use crate::cpu::tensor::Tensor;
use parallax_compiler::ir::shape_rules::window_out as window_rule;
use rayon::prelude::*;

/// The most elements the weight gradient's im2col buffer holds at once (16 MiB of f32).
const COL_LIMIT: usize = 1 << 22;

pub(super) fn bad(op: &'static str, message: String) -> KernelError {
    KernelError::Bad { op, message }
}

/// A window's output size, the op table's rule (`shape_rules::window_out`) in `usize`.
pub(super) fn window_out(
    size: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
) -> Option<usize> {
    let n = |x: usize| x as u64;
    window_rule(n(size), n(kernel), n(stride), n(padding)).map(|x| x as usize)
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

pub(super) fn check_shape(
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
    // Every column and output gradient is written before the product reads it.
    scratch::with_stale(ncol + g.o * chunk * op, |buf: &mut [f32]| {
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

#[cfg(test)]
#[path = "conv_tests.rs"]
mod tests;
