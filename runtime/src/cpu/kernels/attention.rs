//! Attention without stored scores (the flash algorithm): `softmax(scale * q k^T) v` for a
//! tile of queries at a time, streaming tiles of keys with a running maximum and sum per
//! query, so a head needs `O(T)` memory beyond its operands; the backward recomputes the
//! probabilities tile by tile from the saved log-sum-exp.
//!
//! Threads take whole tasks: a (head, query tile) forward and query gradient, a (head, key
//! tile) key and value gradient. Each task runs in one fixed order whose tiles depend only on
//! the sizes, its products through the GEMM crates on one thread, so the same inputs give
//! the same bits at any thread count. Operands are `[.., T, D]` row-major; the leading axes
//! (batch, heads) are the heads here.

use super::gemm::{check_f32, gemm_into, View};
use super::simd::vectorised;
use super::{math, scratch, KernelError};
use crate::cpu::tensor::Tensor;
use gemm::Parallelism;
use rayon::prelude::*;

/// Queries per task and keys per inner tile: fixed, so the bits never depend on threads.
pub const QUERY_TILE: usize = 64;
pub const KEY_TILE: usize = 64;

/// The sizes of one attention: `heads` independent problems of `t` queries and `s` keys of
/// width `d`, values of width `e`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    pub heads: usize,
    pub t: usize,
    pub s: usize,
    pub d: usize,
    pub e: usize,
    pub causal: bool,
    pub scale: f32,
}

fn bad(op: &'static str, message: String) -> KernelError {
    KernelError::Bad { op, message }
}

impl Dims {
    /// Checks `q [.., T, D]`, `k [.., S, D]`, `v [.., S, E]` (f32, one leading shape).
    pub fn of(
        op: &'static str,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        causal: bool,
        scale: f64,
    ) -> Result<Dims, KernelError> {
        for (what, t) in [("q", q), ("k", k), ("v", v)] {
            check_f32(op, what, t)?;
        }
        let r = q.shape.len();
        let same_lead = k.shape.len() == r
            && v.shape.len() == r
            && r >= 2
            && q.shape[..r - 2] == k.shape[..r - 2]
            && q.shape[..r - 2] == v.shape[..r - 2];
        if !same_lead || q.shape[r - 1] != k.shape[r - 1] || k.shape[r - 2] != v.shape[r - 2] {
            return Err(bad(
                op,
                format!(
                    "needs q [.., T, D], k [.., S, D], v [.., S, E], got {:?}, {:?}, {:?}",
                    q.shape, k.shape, v.shape
                ),
            ));
        }
        let dims = Dims {
            heads: q.shape[..r - 2].iter().product(),
            t: q.shape[r - 2],
            s: k.shape[r - 2],
            d: q.shape[r - 1],
            e: v.shape[r - 1],
            causal,
            scale: scale as f32,
        };
        if causal && dims.t != dims.s {
            return Err(bad(
                op,
                format!("a causal attention needs T = S, got {:?}", dims),
            ));
        }
        Ok(dims)
    }

    /// The keys query `i` sees among `[j0, j0 + cols)`: a prefix of that tile.
    fn visible(&self, i: usize, j0: usize, cols: usize) -> usize {
        if self.causal {
            (i + 1).saturating_sub(j0).min(cols)
        } else {
            cols
        }
    }

    /// The keys any of the queries `[i0, i1)` sees: `[0, end)`.
    fn keys_end(&self, i1: usize) -> usize {
        if self.causal {
            i1.min(self.s)
        } else {
            self.s
        }
    }

    /// The first query that sees key `j`.
    fn first_query(&self, j: usize) -> usize {
        if self.causal {
            j
        } else {
            0
        }
    }
}

/// `s [rows, cols] = q_tile [rows, D] x k_tile^T` (leading dimension `KEY_TILE`).
fn scores(q: &[f32], k: &[f32], rows: usize, cols: usize, d: usize, s: &mut [f32]) {
    gemm_into(
        rows,
        cols,
        d,
        s,
        KEY_TILE,
        false,
        View::new(q, d, 1),
        View::new(k, 1, d),
        Parallelism::None,
    );
}

vectorised! {
    fn online_row(row: &mut [f32], visible: usize, scale: f32, m: &mut f32, l: &mut f32) -> f32 = online_row_at;
}

/// One query's row of a key tile: scales its visible scores, folds them into the running
/// maximum `m` and sum `l` (in f32, in order), writes `exp(x - m)` over the scores (zero past
/// the visible keys) and returns the factor the earlier output must be scaled by.
#[inline(always)]
fn online_row_at(row: &mut [f32], visible: usize, scale: f32, m: &mut f32, l: &mut f32) -> f32 {
    let (seen, masked) = row.split_at_mut(visible);
    masked.fill(0.0);
    let mut mx = f32::NEG_INFINITY;
    for x in seen.iter_mut() {
        *x *= scale;
        mx = mx.max(*x);
    }
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
    let sum = seen.iter().fold(0.0f32, |a, &p| a + p);
    *l = *l * correction + sum;
    *m = m_new;
    correction
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

/// The forward: `out [.., T, E]` and, when given, each query's log-sum-exp `lse [.., T]`.
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
    if out.numel() != dm.heads * t * e || lse.as_ref().is_some_and(|l| l.numel() != dm.heads * t) {
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

/// The log-sum-exp alone `[.., T]` (the forward without values: `AttentionLse` run by
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
    if lse.numel() != dm.heads * dm.t {
        return Err(bad(OP, format!("output sized {:?} for {dm:?}", lse.shape)));
    }
    forward_all(&dm, q.f32(), k.f32(), &[], &mut [], lse.f32_mut());
    Ok(())
}

/// Every (head, query tile) task of the forward, in parallel.
fn forward_all(dm: &Dims, q: &[f32], k: &[f32], v: &[f32], o: &mut [f32], lse: &mut [f32]) {
    let (t, s, d, e) = (dm.t, dm.s, dm.d, dm.e);
    let with_lse = !lse.is_empty();
    let o_ptr = SendPtr(o.as_mut_ptr());
    let l_ptr = SendPtr(lse.as_mut_ptr());
    for_each_tile(dm.heads, t, QUERY_TILE, |h, i0, i1| {
        let rows = i1 - i0;
        // SAFETY: tasks write disjoint rows `[i0, i1)` of head `h` of the outputs, which
        // outlive this parallel loop.
        let (o_tile, l_tile) = unsafe {
            let o_tile =
                std::slice::from_raw_parts_mut(o_ptr.get().add((h * t + i0) * e), rows * e);
            let l_tile = if with_lse {
                Some(std::slice::from_raw_parts_mut(
                    l_ptr.get().add(h * t + i0),
                    rows,
                ))
            } else {
                None
            };
            (o_tile, l_tile)
        };
        let qh = &q[(h * t + i0) * d..(h * t + i1) * d];
        let (kh, vh) = (
            &k[h * s * d..(h + 1) * s * d],
            &v[h * s * e..(h + 1) * s * e],
        );
        forward_tile(dm, i0, rows, qh, kh, vh, o_tile, l_tile);
    });
}

/// One task of the forward: queries `[i0, i0 + rows)` of one head into `o` (and `lse`).
#[allow(clippy::too_many_arguments)]
fn forward_tile(
    dm: &Dims,
    i0: usize,
    rows: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    let (d, e) = (dm.d, dm.e);
    o.fill(0.0);
    scratch::with(rows * KEY_TILE + 2 * rows, |buf: &mut [f32]| {
        let (s, stats) = buf.split_at_mut(rows * KEY_TILE);
        let (m, l) = stats.split_at_mut(rows);
        m.fill(f32::NEG_INFINITY);
        let end = dm.keys_end(i0 + rows);
        for j0 in (0..end).step_by(KEY_TILE) {
            let cols = KEY_TILE.min(end - j0);
            scores(q, &k[j0 * d..(j0 + cols) * d], rows, cols, d, s);
            for r in 0..rows {
                let visible = dm.visible(i0 + r, j0, cols);
                let row = &mut s[r * KEY_TILE..r * KEY_TILE + cols];
                if visible == 0 {
                    row.fill(0.0);
                    continue;
                }
                let c = online_row(row, visible, dm.scale, &mut m[r], &mut l[r]);
                if c != 1.0 {
                    scale_row(&mut o[r * e..(r + 1) * e], c);
                }
            }
            // o += p [rows, cols] x v_tile [cols, E]
            gemm_into(
                rows,
                e,
                cols,
                o,
                e,
                true,
                View::new(s, KEY_TILE, 1),
                View::new(&v[j0 * e..(j0 + cols) * e], e, 1),
                Parallelism::None,
            );
        }
        for r in 0..rows {
            scale_row(&mut o[r * e..(r + 1) * e], 1.0 / l[r]);
        }
        if let Some(lse) = lse {
            for r in 0..rows {
                lse[r] = m[r] + l[r].ln();
            }
        }
    });
}

/// The saved statistics and the output's gradient the backward reads besides q, k, v.
pub struct Saved<'a> {
    /// `dy [.., T, E]`
    pub dy: &'a Tensor,
    /// `lse [.., T]`
    pub lse: &'a Tensor,
    /// `delta = rowsum(dy * y) [.., T]`
    pub delta: &'a Tensor,
}

impl Saved<'_> {
    fn check(&self, op: &'static str, dm: &Dims) -> Result<(), KernelError> {
        for (what, t, n) in [
            ("dy", self.dy, dm.heads * dm.t * dm.e),
            ("lse", self.lse, dm.heads * dm.t),
            ("delta", self.delta, dm.heads * dm.t),
        ] {
            check_f32(op, what, t)?;
            if t.numel() != n {
                return Err(bad(
                    op,
                    format!("`{what}` {:?} does not fit {dm:?}", t.shape),
                ));
            }
        }
        Ok(())
    }
}

vectorised! {
    fn probs_row(row: &mut [f32], visible: usize, scale: f32, lse: f32) = probs_row_at;
}

/// Scores to probabilities `exp(scale * x - lse)`, zero past the visible keys.
#[inline(always)]
fn probs_row_at(row: &mut [f32], visible: usize, scale: f32, lse: f32) {
    let (seen, masked) = row.split_at_mut(visible);
    masked.fill(0.0);
    for x in seen.iter_mut() {
        *x = math::exp(*x * scale - lse);
    }
}

vectorised! {
    fn ds_row(p: &mut [f32], dp: &[f32], delta: f32) = ds_row_at;
}

/// `dS = P * (dP - delta)`, over `p` in place.
#[inline(always)]
fn ds_row_at(p: &mut [f32], dp: &[f32], delta: f32) {
    for (x, &g) in p.iter_mut().zip(dp) {
        *x *= g - delta;
    }
}

/// The probabilities `P` of queries `[i0, i0 + rows)` against keys `[j0, j0 + cols)` of one
/// head into `p` (`[rows, KEY_TILE]`): the scores recomputed, `exp(scale * x - lse)`.
fn probs_tile(
    dm: &Dims,
    (i0, rows): (usize, usize),
    (j0, cols): (usize, usize),
    (q, k): (&[f32], &[f32]),
    lse: &[f32],
    p: &mut [f32],
) {
    scores(q, k, rows, cols, dm.d, p);
    for (r, &l) in lse.iter().enumerate().take(rows) {
        let visible = dm.visible(i0 + r, j0, cols);
        probs_row(
            &mut p[r * KEY_TILE..r * KEY_TILE + cols],
            visible,
            dm.scale,
            l,
        );
    }
}

/// `dS = P * (dy v^T - delta)` over the probabilities `p` in place (`dp` its scratch, both
/// `[rows, KEY_TILE]`).
fn ds_tile(
    (rows, cols, e): (usize, usize, usize),
    (dy, v): (&[f32], &[f32]),
    delta: &[f32],
    p: &mut [f32],
    dp: &mut [f32],
) {
    // dp [rows, cols] = dy [rows, E] x v_tile^T
    gemm_into(
        rows,
        cols,
        e,
        dp,
        KEY_TILE,
        false,
        View::new(dy, e, 1),
        View::new(v, 1, e),
        Parallelism::None,
    );
    for (r, &dl) in delta.iter().enumerate().take(rows) {
        let at = r * KEY_TILE..r * KEY_TILE + cols;
        ds_row(&mut p[at.clone()], &dp[at], dl);
    }
}

/// The query gradient `[.., T, D]`: `scale * dS k` over every key tile, by query tile.
pub fn attention_grad_query(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    saved: &Saved,
    causal: bool,
    scale: f64,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "attention_grad";
    let dm = Dims::of(OP, q, k, v, causal, scale)?;
    saved.check(OP, &dm)?;
    let (t, s, d, e) = (dm.t, dm.s, dm.d, dm.e);
    if out.numel() != dm.heads * t * d {
        return Err(bad(
            OP,
            format!("the query gradient sized {:?} for {dm:?}", out.shape),
        ));
    }
    let (q, k, v) = (q.f32(), k.f32(), v.f32());
    let (dy, lse, delta) = (saved.dy.f32(), saved.lse.f32(), saved.delta.f32());
    let out_ptr = SendPtr(out.f32_mut().as_mut_ptr());
    for_each_tile(dm.heads, t, QUERY_TILE, |h, i0, i1| {
        let rows = i1 - i0;
        // SAFETY: each task writes its own rows of the output, which outlives the loop.
        let dq = unsafe {
            std::slice::from_raw_parts_mut(out_ptr.get().add((h * t + i0) * d), rows * d)
        };
        dq.fill(0.0);
        let qh = &q[(h * t + i0) * d..(h * t + i1) * d];
        let dyh = &dy[(h * t + i0) * e..(h * t + i1) * e];
        let (kh, vh) = (
            &k[h * s * d..(h + 1) * s * d],
            &v[h * s * e..(h + 1) * s * e],
        );
        let rows_at = h * t + i0..h * t + i1;
        scratch::with(2 * rows * KEY_TILE, |buf: &mut [f32]| {
            let (p, dp) = buf.split_at_mut(rows * KEY_TILE);
            let end = dm.keys_end(i1);
            for j0 in (0..end).step_by(KEY_TILE) {
                let cols = KEY_TILE.min(end - j0);
                let (kt, vt) = (&kh[j0 * d..(j0 + cols) * d], &vh[j0 * e..(j0 + cols) * e]);
                let (lse, delta) = (&lse[rows_at.clone()], &delta[rows_at.clone()]);
                probs_tile(&dm, (i0, rows), (j0, cols), (qh, kt), lse, p);
                ds_tile((rows, cols, e), (dyh, vt), delta, p, dp);
                // dq += ds [rows, cols] x k_tile [cols, D]
                gemm_into(
                    rows,
                    d,
                    cols,
                    dq,
                    d,
                    true,
                    View::new(p, KEY_TILE, 1),
                    View::new(kt, d, 1),
                    Parallelism::None,
                );
            }
        });
        for r in 0..rows {
            scale_row(&mut dq[r * d..(r + 1) * d], dm.scale);
        }
    });
    Ok(())
}

/// The key gradient `[.., S, D]` (`scale * dS^T q`) and the value gradient `[.., S, E]`
/// (`P^T dy`), each when given, summed over every query tile, by key tile.
#[allow(clippy::too_many_arguments)]
pub fn attention_grad_key_value(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    saved: &Saved,
    causal: bool,
    scale: f64,
    dk: Option<&mut Tensor>,
    dv: Option<&mut Tensor>,
) -> Result<(), KernelError> {
    const OP: &str = "attention_grad";
    let dm = Dims::of(OP, q, k, v, causal, scale)?;
    saved.check(OP, &dm)?;
    let (t, s, d, e) = (dm.t, dm.s, dm.d, dm.e);
    if dk.as_ref().is_some_and(|x| x.numel() != dm.heads * s * d)
        || dv.as_ref().is_some_and(|x| x.numel() != dm.heads * s * e)
    {
        return Err(bad(
            OP,
            format!("key or value gradient sized for other operands ({dm:?})"),
        ));
    }
    let (q, k, v) = (q.f32(), k.f32(), v.f32());
    let (dy, lse, delta) = (saved.dy.f32(), saved.lse.f32(), saved.delta.f32());
    let want_dk = dk.is_some();
    let dk_ptr = dk.map(|x| SendPtr(x.f32_mut().as_mut_ptr()));
    let dv_ptr = dv.map(|x| SendPtr(x.f32_mut().as_mut_ptr()));
    for_each_tile(dm.heads, s, KEY_TILE, |h, j0, j1| {
        let cols = j1 - j0;
        // SAFETY: each task writes its own rows (keys) of the outputs, which outlive the loop.
        let (dk, dv) = unsafe {
            (
                dk_ptr.map(|p| {
                    std::slice::from_raw_parts_mut(p.get().add((h * s + j0) * d), cols * d)
                }),
                dv_ptr.map(|p| {
                    std::slice::from_raw_parts_mut(p.get().add((h * s + j0) * e), cols * e)
                }),
            )
        };
        let (mut dk, mut dv) = (dk, dv);
        for x in [dk.as_deref_mut(), dv.as_deref_mut()].into_iter().flatten() {
            x.fill(0.0);
        }
        let kt = &k[(h * s + j0) * d..(h * s + j1) * d];
        let vt = &v[(h * s + j0) * e..(h * s + j1) * e];
        scratch::with(2 * QUERY_TILE * KEY_TILE, |buf: &mut [f32]| {
            let (p, dp) = buf.split_at_mut(QUERY_TILE * KEY_TILE);
            let first = dm.first_query(j0) / QUERY_TILE * QUERY_TILE;
            for i0 in (first..t).step_by(QUERY_TILE) {
                let i1 = (i0 + QUERY_TILE).min(t);
                let rows = i1 - i0;
                let qh = &q[(h * t + i0) * d..(h * t + i1) * d];
                let dyh = &dy[(h * t + i0) * e..(h * t + i1) * e];
                let rows_at = h * t + i0..h * t + i1;
                let (lse, delta) = (&lse[rows_at.clone()], &delta[rows_at]);
                probs_tile(&dm, (i0, rows), (j0, cols), (qh, kt), lse, p);
                if let Some(dv) = dv.as_deref_mut() {
                    // dv += p^T [cols, rows] x dy [rows, E]
                    gemm_into(
                        cols,
                        e,
                        rows,
                        dv,
                        e,
                        true,
                        View::new(p, 1, KEY_TILE),
                        View::new(dyh, e, 1),
                        Parallelism::None,
                    );
                }
                if !want_dk {
                    continue;
                }
                // dS over the same probabilities: the scores are recomputed once per tile.
                ds_tile((rows, cols, e), (dyh, vt), delta, p, dp);
                if let Some(dk) = dk.as_deref_mut() {
                    // dk += ds^T [cols, rows] x q [rows, D]
                    gemm_into(
                        cols,
                        d,
                        rows,
                        dk,
                        d,
                        true,
                        View::new(p, 1, KEY_TILE),
                        View::new(qh, d, 1),
                        Parallelism::None,
                    );
                }
            }
        });
        if let Some(dk) = dk {
            for r in 0..cols {
                scale_row(&mut dk[r * d..(r + 1) * d], dm.scale);
            }
        }
    });
    Ok(())
}

/// Runs `f(head, first, end)` on every tile of `tile` rows (the last may be shorter) of
/// `len` in each of `heads` heads, in parallel: the tasks of a kernel.
fn for_each_tile(heads: usize, len: usize, tile: usize, f: impl Fn(usize, usize, usize) + Sync) {
    let tiles = len.div_ceil(tile).max(1);
    (0..heads * tiles).into_par_iter().for_each(|task| {
        let (h, first) = (task / tiles, task % tiles * tile);
        let end = (first + tile).min(len);
        if first < end {
            f(h, first, end);
        }
    });
}

/// A raw pointer that tasks writing disjoint parts share.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: see its uses: every task writes its own elements only.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;
