//! Attention's backward: the gradients of its queries, keys and values from the saved
//! log-sum-exp and `delta = rowsum(dy * y)`, the probabilities recomputed tile by tile.
//!
//! With the key or value gradient wanted, a task takes a (problem, run of key tiles) and
//! sweeps the query tiles; the query gradient, when wanted too, comes from the same `dS`
//! tiles as a partial sum per task, added over a problem's runs in their order at the end
//! (one recomputation of the probabilities and of `dP` instead of two). The query gradient
//! alone runs by query tiles. Tile sizes and runs depend on the sizes alone, so the bits do
//! not depend on the threads.

use super::layout::{bad, with_scratch, Layout, Out, Rows};
use super::{for_each_tile, math, scale_row, vectorised, Dims, KEY_TILE, ONE, QUERY_TILE};
use crate::cpu::kernels::gemm::{check_f32, gemm_into, View};
use crate::cpu::kernels::{scratch, KernelError};
use crate::cpu::tensor::Tensor;
use rayon::prelude::*;

/// The saved statistics and the output's gradient the backward reads besides q, k, v.
pub struct Saved<'a> {
    /// `dy [.., T, H, E]`
    pub dy: &'a Tensor,
    /// `lse [.., T, H]`
    pub lse: &'a Tensor,
    /// `delta = rowsum(dy * y) [.., T, H]`
    pub delta: &'a Tensor,
}

impl Saved<'_> {
    fn check(&self, op: &'static str, dm: &Dims) -> Result<(), KernelError> {
        for (what, t, n) in [
            ("dy", self.dy, dm.problems * dm.t * dm.e),
            ("lse", self.lse, dm.problems * dm.t),
            ("delta", self.delta, dm.problems * dm.t),
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

    /// Queries `[i0, i1)` of problem `g`: their `dy` rows, `lse` and `delta`.
    fn rows(&self, dm: &Dims, g: usize, at: (usize, usize)) -> (Rows<'_>, Rows<'_>, Rows<'_>) {
        (
            dm.rows(self.dy.f32(), g, at, dm.t, dm.e),
            dm.rows(self.lse.f32(), g, at, dm.t, 1),
            dm.rows(self.delta.f32(), g, at, dm.t, 1),
        )
    }
}

/// `s [rows, cols] = q_tile [rows, D] x k_tile^T` (leading dimension `KEY_TILE`), the key
/// tile transposed, `[D, KEY_TILE]` (see [`Layout::TilesTransposed`]).
fn scores(q: Rows, kt: View, rows: usize, cols: usize, d: usize, s: &mut [f32]) {
    gemm_into(rows, cols, d, s, KEY_TILE, false, q.view(), kt, ONE);
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
        *x = math::exp_nonpositive(*x * scale - lse);
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
/// problem (`kt` their tile transposed) into `p` (`[rows, KEY_TILE]`): the scores
/// recomputed, `exp(scale * x - lse)`.
fn probs_tile(
    dm: &Dims,
    (i0, rows): (usize, usize),
    (j0, cols): (usize, usize),
    (q, kt): (Rows, View),
    lse: Rows,
    p: &mut [f32],
) {
    scores(q, kt, rows, cols, dm.d, p);
    for r in 0..rows {
        let visible = dm.visible(i0 + r, j0, cols);
        probs_row(
            &mut p[r * KEY_TILE..r * KEY_TILE + cols],
            visible,
            dm.scale,
            lse.get(r),
        );
    }
}

/// `dS = P * (dy v^T - delta)` over the probabilities `p` in place (`dp` its scratch, both
/// `[rows, KEY_TILE]`; `vt` the value tile transposed, `[E, KEY_TILE]`).
fn ds_tile(
    (rows, cols, e): (usize, usize, usize),
    (dy, vt): (Rows, View),
    delta: Rows,
    p: &mut [f32],
    dp: &mut [f32],
) {
    // dp [rows, cols] = dy [rows, E] x v_tile^T
    gemm_into(rows, cols, e, dp, KEY_TILE, false, dy.view(), vt, ONE);
    for r in 0..rows {
        let at = r * KEY_TILE..r * KEY_TILE + cols;
        ds_row(&mut p[at.clone()], &dp[at], delta.get(r));
    }
}

/// The query gradient alone `[.., T, H, D]`: `scale * dS k` over every key tile, by query
/// tile.
fn query_alone(dm: Dims, (q, k, v): (&[f32], &[f32], &[f32]), saved: &Saved, out: Out) {
    let (t, s, d, e) = (dm.t, dm.s, dm.d, dm.e);
    // Every query tile of a problem reads all its keys and values.
    let operands = [
        (k, s, d, Layout::TilesTransposed),
        (k, s, d, Layout::HeadMajor),
        (v, s, e, Layout::TilesTransposed),
    ];
    let once = t <= QUERY_TILE;
    dm.packed(operands, once, |[_, at_k, _], [kt, k, vt]| {
        for_each_tile(dm.problems, t, QUERY_TILE, |g, i0, i1| {
            let rows = i1 - i0;
            let qg = dm.rows(q, g, (i0, i1), t, d);
            let kg = at_k.rows(k, g, (0, s), s, d);
            let (dyg, lse, delta) = saved.rows(&dm, g, (i0, i1));
            let pack = [qg.packing(rows), dyg.packing(rows)];
            let len = 2 * rows * KEY_TILE + rows * d + pack.iter().sum::<usize>();
            with_scratch(len, |buf: &mut [f32]| {
                let (p, rest) = buf.split_at_mut(rows * KEY_TILE);
                let (dp, rest) = rest.split_at_mut(rows * KEY_TILE);
                let (dq, rest) = rest.split_at_mut(rows * d);
                dq.fill(0.0);
                let (qb, yb) = rest.split_at_mut(pack[0]);
                let (qg, dyg) = (qg.packed(qb), dyg.packed(yb));
                let end = dm.keys_end(i1);
                for j0 in (0..end).step_by(KEY_TILE) {
                    let cols = KEY_TILE.min(end - j0);
                    let (kt, vt) = (dm.tile_t(kt, g, j0, s, d), dm.tile_t(vt, g, j0, s, e));
                    probs_tile(&dm, (i0, rows), (j0, cols), (qg, kt), lse, p);
                    ds_tile((rows, cols, e), (dyg, vt), delta, p, dp);
                    // dq += ds [rows, cols] x k_tile [cols, D]
                    let ds = View::new(p, KEY_TILE, 1);
                    gemm_into(
                        rows,
                        d,
                        cols,
                        dq,
                        d,
                        true,
                        ds,
                        kg.sub(j0, j0 + cols).view(),
                        ONE,
                    );
                }
                for r in 0..rows {
                    scale_row(&mut dq[r * d..(r + 1) * d], dm.scale);
                }
                out.put(&dm, g, i0, t, d, dq);
            });
        });
    });
}

/// The gradients [`attention_grads`] computes, each when given: the query's `[.., T, H, D]`
/// (`scale * dS k`), the key's `[.., S, H, D]` (`scale * dS^T q`) and the value's
/// `[.., S, H, E]` (`P^T dy`).
#[derive(Default)]
pub struct Grads<'a> {
    pub dq: Option<&'a mut Tensor>,
    pub dk: Option<&'a mut Tensor>,
    pub dv: Option<&'a mut Tensor>,
}

/// Tasks the fused backward aims at (see [`runs_per_problem`]).
const TASKS: usize = 16;

/// Runs of key tiles a problem's tasks take when the query gradient is summed from them:
/// enough for [`TASKS`] tasks in all, at most 4 (each run adds a partial query gradient to
/// write and sum), at most one per key tile. Sizes alone decide, never the threads.
fn runs_per_problem(problems: usize, key_tiles: usize) -> usize {
    (TASKS / problems.max(1)).clamp(1, 4).min(key_tiles.max(1))
}

/// The gradients of an attention's inputs that `grads` asks for, from `dy`, the forward's
/// log-sum-exp and `delta` (see [`Saved`]).
pub fn attention_grads(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    saved: &Saved,
    causal: bool,
    scale: f64,
    grads: Grads,
) -> Result<(), KernelError> {
    const OP: &str = "attention_grad";
    let dm = Dims::of(OP, q, k, v, causal, scale)?;
    saved.check(OP, &dm)?;
    let (t, s, d, e) = (dm.t, dm.s, dm.d, dm.e);
    for (what, x, n) in [
        ("query", &grads.dq, t * d),
        ("key", &grads.dk, s * d),
        ("value", &grads.dv, s * e),
    ] {
        if let Some(x) = x.as_ref().filter(|x| x.numel() != dm.problems * n) {
            return Err(bad(
                OP,
                format!("the {what} gradient sized {:?} for {dm:?}", x.shape),
            ));
        }
    }
    let operands = (q.f32(), k.f32(), v.f32());
    let out = |x: Option<&mut Tensor>| x.map(|x| Out::of(x.f32_mut()));
    let (dq, dk, dv) = (out(grads.dq), out(grads.dk), out(grads.dv));
    match (dq, dk.is_none() && dv.is_none()) {
        (Some(dq), true) => query_alone(dm, operands, saved, dq),
        (dq, _) => by_key_tiles(dm, operands, saved, (dq, dk, dv)),
    }
    Ok(())
}

/// The key and value gradients by key tile, and the query gradient's partial sums per run
/// of key tiles, added up at the end.
fn by_key_tiles(
    dm: Dims,
    (q, k, v): (&[f32], &[f32], &[f32]),
    saved: &Saved,
    (dq_out, dk_out, dv_out): (Option<Out>, Option<Out>, Option<Out>),
) {
    let (t, s, d, e) = (dm.t, dm.s, dm.d, dm.e);
    let want_dq = dq_out.is_some();
    let key_tiles = s.div_ceil(KEY_TILE);
    let runs = if want_dq {
        runs_per_problem(dm.problems, key_tiles)
    } else {
        key_tiles
    };
    let per_run = key_tiles.div_ceil(runs.max(1)).max(1);
    // Every key tile of a problem reads all its queries and their output gradients. With
    // one key tile and one query tile per problem, its keys and values are transposed by
    // its one product that reads them (the panels' packing), not in a pass of their own.
    let tiles_in_place = key_tiles == 1 && t <= QUERY_TILE;
    let tiles = if tiles_in_place {
        Layout::HeadMajor
    } else {
        Layout::TilesTransposed
    };
    let operands = [
        (q, t, d, Layout::HeadMajor),
        (saved.dy.f32(), t, e, Layout::HeadMajor),
        (k, s, d, tiles),
        (v, s, e, tiles),
        (k, s, if want_dq { d } else { 0 }, Layout::HeadMajor),
    ];
    let partial = if want_dq { t * d } else { 0 };
    // One key tile per problem: each problem's queries are read by one task.
    let once = key_tiles == 1;
    dm.packed(operands, once, |dims, [q, dy, kt, vt, k]| {
        let sweep = Sweep {
            dm,
            dims,
            tiles_in_place,
            packed: [q, dy, kt, vt, k],
            saved,
            outs: (dk_out, dv_out),
        };
        // Its own element type, so neither `packed` nor the tasks' scratch is this vector.
        scratch::with_vec(|sums: &mut Vec<[f32; 16]>| {
            let len = dm.problems * runs * partial;
            if sums.len() * 16 < len {
                sums.resize(len.div_ceil(16), [0.0; 16]);
            }
            let sums = &mut sums.as_flattened_mut()[..len];
            let parts = Out::of(sums);
            (0..dm.problems * runs).into_par_iter().for_each(|task| {
                let (g, run) = (task / runs, task % runs);
                // The next problem's operands, which this thread likely takes next, on
                // their way from memory while this task computes.
                if run + 1 == runs && g + 1 < dm.problems {
                    sweep.prefetch(g + 1);
                }
                // SAFETY: each task writes its own `partial` floats and nothing else does.
                let dq = unsafe { parts.slice(task * partial, partial) };
                dq.fill(0.0);
                let tiles = run * per_run..((run + 1) * per_run).min(key_tiles);
                for j0 in tiles.map(|j| j * KEY_TILE) {
                    sweep.key_tile(g, j0, (want_dq).then_some(&mut *dq));
                }
                // One run: the problem's query gradient is whole here, while it is in cache.
                if let (Some(out), 1) = (dq_out, runs) {
                    scale_row(dq, dm.scale);
                    out.put(&dm, g, 0, t, d, dq);
                }
            });
            if let Some(out) = dq_out.filter(|_| runs > 1) {
                sum_runs(&dm, sums, runs, out);
            }
        });
    });
}

/// What every task of [`by_key_tiles`] reads, and where its key and value gradients go.
struct Sweep<'a> {
    dm: Dims,
    /// The sizes that address each of `packed` (one head where copied).
    dims: [Dims; 5],
    /// `k` and `v` are lent as they are (not in transposed tiles): read transposed in place.
    tiles_in_place: bool,
    /// `q`, `dy` head-major; `k`, `v` in transposed tiles (as they are with
    /// `tiles_in_place`); `k` head-major (empty without the query gradient).
    packed: [&'a [f32]; 5],
    saved: &'a Saved<'a>,
    outs: (Option<Out>, Option<Out>),
}

impl Sweep<'_> {
    /// Asks for problem `g`'s queries and output gradients, and its first key and value
    /// tile where those are read in place, to be brought into L2 (see [`Rows::prefetch`]).
    fn prefetch(&self, g: usize) {
        let Sweep { dm, dims, .. } = *self;
        let [q, dy, kt, vt, _] = self.packed;
        let (t, s) = (dm.t, dm.s);
        let j1 = KEY_TILE.min(s);
        dims[0].rows(q, g, (0, t), t, dm.d).prefetch();
        dims[1].rows(dy, g, (0, t), t, dm.e).prefetch();
        if self.tiles_in_place {
            dims[2].rows(kt, g, (0, j1), s, dm.d).prefetch();
            dims[3].rows(vt, g, (0, j1), s, dm.e).prefetch();
        }
    }

    /// Key tile `[j0, j0 + KEY_TILE)` of problem `g` against every query tile that sees it:
    /// its key and value gradients, each when wanted, and the query gradient's partial sums
    /// added to `dq` (`[T, D]`, the problem's), when given.
    fn key_tile(&self, g: usize, j0: usize, mut dq: Option<&mut [f32]>) {
        let Sweep { dm, dims, .. } = *self;
        let [q, dy, kt, vt, k] = self.packed;
        let (dk_out, dv_out) = self.outs;
        let (t, s, d, e) = (dm.t, dm.s, dm.d, dm.e);
        let (want_dk, want_dv) = (dk_out.is_some(), dv_out.is_some());
        let j1 = (j0 + KEY_TILE).min(s);
        let cols = j1 - j0;
        let (kt, vt) = if self.tiles_in_place {
            let rows = |x, i: usize, width| dims[i].rows(x, g, (j0, j1), s, width).transposed();
            (rows(kt, 2, d), rows(vt, 3, e))
        } else {
            (dm.tile_t(kt, g, j0, s, d), dm.tile_t(vt, g, j0, s, e))
        };
        let kg = dims[4].rows(k, g, (j0, j1), s, if dq.is_some() { d } else { 0 });
        let sizes = 2 * QUERY_TILE * KEY_TILE + cols * d + cols * e;
        with_scratch(sizes, |buf: &mut [f32]| {
            let (p, rest) = buf.split_at_mut(QUERY_TILE * KEY_TILE);
            let (dp, rest) = rest.split_at_mut(QUERY_TILE * KEY_TILE);
            let (dk, dv) = rest.split_at_mut(cols * d);
            dk.fill(0.0);
            dv.fill(0.0);
            let first = dm.first_query(j0) / QUERY_TILE * QUERY_TILE;
            for i0 in (first..t).step_by(QUERY_TILE) {
                let i1 = (i0 + QUERY_TILE).min(t);
                let rows = i1 - i0;
                let qg = dims[0].rows(q, g, (i0, i1), t, d);
                let (_, lse, delta) = self.saved.rows(&dm, g, (i0, i1));
                let dyg = dims[1].rows(dy, g, (i0, i1), t, e);
                probs_tile(&dm, (i0, rows), (j0, cols), (qg, kt), lse, p);
                if want_dv {
                    // dv += p^T [cols, rows] x dy [rows, E]
                    let pt = View::new(p, 1, KEY_TILE);
                    gemm_into(cols, e, rows, dv, e, true, pt, dyg.view(), ONE);
                }
                if !want_dk && dq.is_none() {
                    continue;
                }
                // dS over the same probabilities: recomputed once per tile.
                ds_tile((rows, cols, e), (dyg, vt), delta, p, dp);
                if want_dk {
                    // dk += ds^T [cols, rows] x q [rows, D]
                    let dst = View::new(p, 1, KEY_TILE);
                    gemm_into(cols, d, rows, dk, d, true, dst, qg.view(), ONE);
                }
                if let Some(dq) = dq.as_deref_mut() {
                    // dq += ds [rows, cols] x k_tile [cols, D]
                    let (ds, at) = (View::new(p, KEY_TILE, 1), &mut dq[i0 * d..i1 * d]);
                    gemm_into(rows, d, cols, at, d, true, ds, kg.view(), ONE);
                }
            }
            if let Some(out) = dk_out {
                for r in 0..cols {
                    scale_row(&mut dk[r * d..(r + 1) * d], dm.scale);
                }
                out.put(&dm, g, j0, s, d, dk);
            }
            if let Some(out) = dv_out {
                out.put(&dm, g, j0, s, e, dv);
            }
        });
    }
}

/// Each query's gradient into `out`: its problem's `runs` partial sums (`sums`, a `[T, D]`
/// per run, problem by problem) added in order, then scaled.
fn sum_runs(dm: &Dims, sums: &[f32], runs: usize, out: Out) {
    let (t, d) = (dm.t, dm.d);
    for_each_tile(dm.problems, t, QUERY_TILE, |g, i0, i1| {
        with_scratch((i1 - i0) * d, |dq: &mut [f32]| {
            let at = |run: usize| &sums[(g * runs + run) * t * d..][i0 * d..i1 * d];
            dq.copy_from_slice(at(0));
            for run in 1..runs {
                for (x, &y) in dq.iter_mut().zip(at(run)) {
                    *x += y;
                }
            }
            scale_row(dq, dm.scale);
            out.put(dm, g, i0, t, d, dq);
        });
    });
}
