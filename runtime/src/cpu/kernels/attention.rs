//! Attention without stored scores (the flash algorithm): `softmax(scale * q k^T) v` for a
//! tile of queries at a time, streaming tiles of keys with a running maximum and sum per
//! query, so a head needs `O(T)` memory beyond its operands; the backward recomputes the
//! probabilities tile by tile from the saved log-sum-exp.
//!
//! Threads take whole tasks: a (problem, query tile) forward and query gradient, a (problem,
//! key tile) key and value gradient. Each task runs in one fixed order whose tiles depend only
//! on the sizes, its products through `gemm` (the panels' kernel) on one thread, so the same
//! inputs give the same bits at any thread count.
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

/// A task's products run on its own thread.
const ONE: Parallelism = Parallelism::None;

/// Queries per task and keys per inner tile: fixed, so the bits never depend on threads.
pub const QUERY_TILE: usize = 64;
pub const KEY_TILE: usize = 64;

vectorised! {
    fn online_tile(st: &mut [f32], size: (usize, usize), firsts: (usize, usize), stats: Stats) = online_tile_at;
}

/// A query tile's running statistics: the maximum `m` and sum `l` of each query's scaled
/// scores so far, and `c`, where each query's factor for its earlier output is left.
struct Stats<'a> {
    m: &'a mut [f32],
    l: &'a mut [f32],
    c: &'a mut [f32],
    scale: f32,
    causal: bool,
}

/// One key tile's scores transposed, `st [cols, rows]` (a key's scores of every query of the
/// tile in a row, `QUERY_TILE` apart), folded into the statistics: scaled, the masked ones
/// (keys after a query, causal; `firsts` the first query and key) set to `-inf`, the
/// maxima moved, then `exp(x - m)` written over the scores and added to `l` key by key.
/// Queries lie along the vectors, so nothing is summed across lanes and each query's sum
/// runs over its keys in order.
#[inline(always)]
fn online_tile_at(
    st: &mut [f32],
    (cols, rows): (usize, usize),
    firsts: (usize, usize),
    stats: Stats,
) {
    let Stats {
        m,
        l,
        c,
        scale,
        causal,
    } = stats;
    let (i0, j0) = firsts;
    let (m, l, mx) = (&mut m[..rows], &mut l[..rows], &mut c[..rows]);
    mx.fill(f32::NEG_INFINITY);
    for j in 0..cols {
        let row = &mut st[j * QUERY_TILE..j * QUERY_TILE + rows];
        // Key j0 + j is seen by the queries from j0 + j on.
        let first = if causal {
            (j0 + j).saturating_sub(i0).min(rows)
        } else {
            0
        };
        row[..first].fill(f32::NEG_INFINITY);
        for (x, a) in row[first..].iter_mut().zip(&mut mx[first..]) {
            *x *= scale;
            *a = a.max(*x);
        }
    }
    // Each query's correction (a first tile, m = -inf, scales nothing), into `c`.
    for ((m, l), c) in m.iter_mut().zip(l.iter_mut()).zip(mx.iter_mut()) {
        let m_new = m.max(*c);
        *c = if *m == f32::NEG_INFINITY {
            0.0
        } else {
            math::exp_nonpositive(*m - m_new)
        };
        *l *= *c;
        *m = m_new;
    }
    for j in 0..cols {
        let row = &mut st[j * QUERY_TILE..j * QUERY_TILE + rows];
        for ((x, &m), l) in row.iter_mut().zip(&*m).zip(l.iter_mut()) {
            // A query that has seen only -inf scores stays NaN-free until its sum is
            // divided by zero, as a softmax of them would be.
            *x = if m == f32::NEG_INFINITY {
                0.0
            } else {
                math::exp_nonpositive(*x - m)
            };
            *l += *x;
        }
    }
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
    let operands = [(k, s, d, Layout::HeadMajor), (v, s, e, Layout::HeadMajor)];
    // One query tile per problem: each problem's keys and values are read by one task.
    let once = t <= QUERY_TILE;
    dm.packed(operands, once, |[dk, dv], [k, v]| {
        for_each_tile(dm.problems, t, QUERY_TILE, |g, i0, i1| {
            let rows = i1 - i0;
            let qg = dm.rows(q, g, (i0, i1), t, d);
            let (kg, vg) = (dk.rows(k, g, (0, s), s, d), dv.rows(v, g, (0, s), s, e));
            let len = KEY_TILE * QUERY_TILE + 3 * QUERY_TILE + rows * e + d * QUERY_TILE;
            with_scratch(len, |buf: &mut [f32]| {
                let (st, rest) = buf.split_at_mut(KEY_TILE * QUERY_TILE);
                let (m, rest) = rest.split_at_mut(QUERY_TILE);
                let (l, rest) = rest.split_at_mut(QUERY_TILE);
                let (c, rest) = rest.split_at_mut(QUERY_TILE);
                let (ot, qt) = rest.split_at_mut(rows * e);
                qg.transposed_into(qt, QUERY_TILE);
                m.fill(f32::NEG_INFINITY);
                l.fill(0.0);
                ot.fill(0.0);
                let stats = Stats {
                    m,
                    l,
                    c,
                    scale: dm.scale,
                    causal: dm.causal,
                };
                forward_tile(dm, (i0, rows), (qt, kg, vg), st, stats, ot);
                o.put(dm, g, i0, t, e, ot);
                if with_lse {
                    // `c` is free again: the statistics' last use.
                    for r in 0..rows {
                        c[r] = m[r] + l[r].ln();
                    }
                    lse.put(dm, g, i0, t, 1, &c[..rows]);
                }
            });
        });
    });
}

/// One task of the forward: queries `[i0, i0 + rows)` of one problem (`qt` their `[D,
/// QUERY_TILE]` transpose) into the tile `o` (`[rows, E]`, zeros), with their running
/// statistics; `k`, `v` the problem's keys and values. The scores are held transposed (see
/// [`online_tile`]).
fn forward_tile(
    dm: &Dims,
    (i0, rows): (usize, usize),
    (qt, k, v): (&[f32], Rows, Rows),
    st: &mut [f32],
    stats: Stats,
    o: &mut [f32],
) {
    let (d, e) = (dm.d, dm.e);
    let end = dm.keys_end(i0 + rows);
    for j0 in (0..end).step_by(KEY_TILE) {
        let cols = KEY_TILE.min(end - j0);
        // st [cols, rows] = k_tile [cols, D] x q^T [D, rows]
        let (kt, qv) = (k.sub(j0, j0 + cols).view(), View::new(qt, QUERY_TILE, 1));
        gemm_into(cols, rows, d, st, QUERY_TILE, false, kt, qv, ONE);
        let firsts = (i0, j0);
        let tile = Stats {
            m: &mut *stats.m,
            l: &mut *stats.l,
            c: &mut *stats.c,
            ..stats
        };
        online_tile(st, (cols, rows), firsts, tile);
        if e > 0 {
            for (r, &c) in stats.c[..rows].iter().enumerate() {
                if c != 1.0 {
                    scale_row(&mut o[r * e..(r + 1) * e], c);
                }
            }
            // o += p [rows, cols] x v_tile [cols, E], p = st^T
            let p = View::new(st, 1, QUERY_TILE);
            gemm_into(
                rows,
                e,
                cols,
                o,
                e,
                true,
                p,
                v.sub(j0, j0 + cols).view(),
                ONE,
            );
        }
    }
    if e > 0 {
        for r in 0..rows {
            scale_row(&mut o[r * e..(r + 1) * e], 1.0 / stats.l[r]);
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
