//! Attention without stored scores (the flash algorithm): `softmax(scale * q k^T) v` for a
//! tile of queries at a time, streaming tiles of keys with a running maximum and sum per
//! query, so a head needs `O(T)` memory beyond its operands; the backward recomputes the
//! probabilities tile by tile from the saved log-sum-exp.
//!
//! Threads take whole tasks: a (problem, query tile) forward and query gradient, a (problem,
//! key tile) key and value gradient. Each task runs in one fixed order whose tiles depend only
//! on the sizes, its products through the GEMM crates on one thread, so the same inputs give
//! the same bits at any thread count.
//!
//! Operands are token-major, `[.., T, H, D]` row-major: a problem is one (batch, head) pair,
//! its rows `H * D` apart, read in place as strided matrices. A task computes its output rows
//! in a contiguous scratch tile and then copies each row to its place, so no two tasks ever
//! hold overlapping slices of an output.

use super::gemm::{gemm_into, View};
use super::simd::vectorised;
use super::{math, KernelError};
pub use layout::Dims;
use layout::{bad, with_scratch, Layout, Out, Rows};

#[path = "attention_grad.rs"]
mod backward;
#[path = "attention_layout.rs"]
mod layout;
use crate::cpu::tensor::Tensor;
pub use backward::{attention_grads, Grads, Saved};
use gemm::Parallelism;
use rayon::prelude::*;

/// Queries per task and keys per inner tile: fixed, so the bits never depend on threads.
pub const QUERY_TILE: usize = 64;
pub const KEY_TILE: usize = 64;

/// `s [rows, cols] = q_tile [rows, D] x k_tile^T` (leading dimension `KEY_TILE`), the key
/// tile transposed, `[D, KEY_TILE]` (see [`Layout::TilesTransposed`]).
fn scores(q: Rows, kt: View, rows: usize, cols: usize, d: usize, s: &mut [f32]) {
    gemm_into(
        rows,
        cols,
        d,
        s,
        KEY_TILE,
        false,
        q.view(),
        kt,
        Parallelism::None,
    );
}

vectorised! {
    fn online_row(row: &mut [f32], visible: usize, scale: f32, m: &mut f32, l: &mut f32) -> f32 = online_row_at;
}

/// One query's row of a key tile: scales its visible scores, folds them into the running
/// maximum `m` and sum `l`, writes `exp(x - m)` over the scores (zero past the visible keys)
/// and returns the factor the earlier output must be scaled by. The row's sum is taken in
/// [`LANES`] running sums (see [`lane_sum`]), not value by value: a chain of dependent adds
/// cost as much as the tile's two products.
#[inline(always)]
fn online_row_at(row: &mut [f32], visible: usize, scale: f32, m: &mut f32, l: &mut f32) -> f32 {
    let (seen, masked) = row.split_at_mut(visible);
    masked.fill(0.0);
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = seen.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (a, x) in lanes.iter_mut().zip(c.iter_mut()) {
            *x *= scale;
            *a = a.max(*x);
        }
    }
    for (a, x) in lanes.iter_mut().zip(chunks.into_remainder()) {
        *x *= scale;
        *a = a.max(*x);
    }
    let mx = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let m_new = m.max(mx);
    // A first tile (m = -inf) scales nothing; a row of -inf scores stays NaN-free until its
    // sum is divided by zero, as a softmax of them would be.
    let correction = if *m == f32::NEG_INFINITY {
        0.0
    } else {
        math::exp(*m - m_new)
    };
    for x in seen.iter_mut() {
        *x = math::exp(*x - m_new);
    }
    *l = *l * correction + lane_sum(seen);
    *m = m_new;
    correction
}

/// Running sums a row is added in: one vector of AVX-512.
const LANES: usize = 16;

/// The sum of `v` in a fixed order that vectorises: [`LANES`] running sums over the indices
/// equal mod `LANES`, then added pairwise. The order depends only on the length.
#[inline(always)]
fn lane_sum(v: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut chunks = v.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &x) in lanes.iter_mut().zip(c) {
            *a += x;
        }
    }
    for (a, &x) in lanes.iter_mut().zip(chunks.remainder()) {
        *a += x;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    lanes[0]
}

vectorised! {
    fn scale_row(row: &mut [f32], by: f32) = scale_row_at;
}

#[inline(always)]
fn scale_row_at(row: &mut [f32], by: f32) {
    for x in row.iter_mut() {
        *x *= by;
    }
}

/// The forward: `out [.., T, H, E]` and, when given, each query's log-sum-exp `lse [.., T, H]`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    scale: f64,
    out: &mut Tensor,
    lse: Option<&mut Tensor>,
) -> Result<(), KernelError> {
    const OP: &str = "attention";
    let dm = Dims::of(OP, q, k, v, causal, scale)?;
    let (t, e) = (dm.t, dm.e);
    if out.numel() != dm.problems * t * e
        || lse.as_ref().is_some_and(|l| l.numel() != dm.problems * t)
    {
        return Err(bad(
            OP,
            format!("outputs sized for other operands ({dm:?})"),
        ));
    }
    let (q, k, v) = (q.f32(), k.f32(), v.f32());
    let o = out.f32_mut();
    let mut none = Vec::new();
    let lse = match lse {
        Some(l) => l.f32_mut(),
        None => &mut none[..],
    };
    forward_all(&dm, q, k, v, o, lse);
    Ok(())
}

/// The log-sum-exp alone `[.., T, H]` (the forward without values: `AttentionLse` run by
/// itself; beside its `Attention` the fuse pass gives it that kernel).
pub fn attention_lse(
    q: &Tensor,
    k: &Tensor,
    causal: bool,
    scale: f64,
    lse: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "attention_lse";
    let dm = Dims {
        e: 0,
        ..Dims::of(OP, q, k, k, causal, scale)?
    };
    if lse.numel() != dm.problems * dm.t {
        return Err(bad(OP, format!("output sized {:?} for {dm:?}", lse.shape)));
    }
    forward_all(&dm, q.f32(), k.f32(), &[], &mut [], lse.f32_mut());
    Ok(())
}

/// Every (problem, query tile) task of the forward, in parallel.
fn forward_all(dm: &Dims, q: &[f32], k: &[f32], v: &[f32], o: &mut [f32], lse: &mut [f32]) {
    let (t, s, d, e) = (dm.t, dm.s, dm.d, dm.e);
    let with_lse = !lse.is_empty();
    let (o, lse) = (Out::of(o), Out::of(lse));
    // Every query tile of a problem reads all its keys and values.
    let operands = [
        (k, s, d, Layout::TilesTransposed),
        (v, s, e, Layout::HeadMajor),
    ];
    dm.packed(operands, |flat, [kt, v]| {
        for_each_tile(dm.problems, t, QUERY_TILE, |g, i0, i1| {
            let rows = i1 - i0;
            let qg = dm.rows(q, g, (i0, i1), t, d);
            let vg = flat.rows(v, g, (0, s), s, e);
            let pack = qg.packing(rows);
            let len = rows * KEY_TILE + 3 * rows + rows * e + pack;
            with_scratch(len, |buf: &mut [f32]| {
                let (sc, rest) = buf.split_at_mut(rows * KEY_TILE);
                let (m, rest) = rest.split_at_mut(rows);
                let (l, rest) = rest.split_at_mut(rows);
                let (stat, rest) = rest.split_at_mut(rows);
                let (ot, qb) = rest.split_at_mut(rows * e);
                l.fill(0.0);
                ot.fill(0.0);
                let qg = qg.packed(qb);
                forward_tile(dm, (g, i0, rows), (qg, kt, vg), sc, (m, l), ot);
                o.put(dm, g, i0, t, e, ot);
                if with_lse {
                    for r in 0..rows {
                        stat[r] = m[r] + l[r].ln();
                    }
                    lse.put(dm, g, i0, t, 1, stat);
                }
            });
        });
    });
}

/// One task of the forward: queries `[i0, i0 + rows)` of problem `g` into the tile `o`
/// (`[rows, E]`, zeros), with their running maximum `m` and sum `l`; `kt` all keys packed
/// [`Layout::TilesTransposed`].
fn forward_tile(
    dm: &Dims,
    (g, i0, rows): (usize, usize, usize),
    (q, kt, v): (Rows, &[f32], Rows),
    sc: &mut [f32],
    (m, l): (&mut [f32], &mut [f32]),
    o: &mut [f32],
) {
    let (d, e) = (dm.d, dm.e);
    m.fill(f32::NEG_INFINITY);
    let end = dm.keys_end(i0 + rows);
    for j0 in (0..end).step_by(KEY_TILE) {
        let cols = KEY_TILE.min(end - j0);
        scores(q, dm.tile_t(kt, g, j0, dm.s, d), rows, cols, d, sc);
        for r in 0..rows {
            let visible = dm.visible(i0 + r, j0, cols);
            let row = &mut sc[r * KEY_TILE..r * KEY_TILE + cols];
            if visible == 0 {
                row.fill(0.0);
                continue;
            }
            let c = online_row(row, visible, dm.scale, &mut m[r], &mut l[r]);
            if c != 1.0 && e > 0 {
                scale_row(&mut o[r * e..(r + 1) * e], c);
            }
        }
        if e > 0 {
            // o += p [rows, cols] x v_tile [cols, E]
            let p = View::new(sc, KEY_TILE, 1);
            gemm_into(
                rows,
                e,
                cols,
                o,
                e,
                true,
                p,
                v.sub(j0, j0 + cols).view(),
                Parallelism::None,
            );
        }
    }
    if e > 0 {
        for r in 0..rows {
            scale_row(&mut o[r * e..(r + 1) * e], 1.0 / l[r]);
        }
    }
}

/// Runs `f(problem, first, end)` on every tile of `tile` rows (the last may be shorter)
/// of `len` in each of `problems` problems, in parallel: the tasks of a kernel.
fn for_each_tile(problems: usize, len: usize, tile: usize, f: impl Fn(usize, usize, usize) + Sync) {
    let tiles = len.div_ceil(tile).max(1);
    (0..problems * tiles).into_par_iter().for_each(|task| {
        let (g, first) = (task / tiles, task % tiles * tile);
        let end = (first + tile).min(len);
        if first < end {
            f(g, first, end);
        }
    });
}

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;
