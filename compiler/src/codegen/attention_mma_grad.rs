//! Attention's backward on tensor cores: bf16 operands, f32 accumulation, `mma.sync.m16n8k16`
//! (sm_80 and later), for head widths 64 and 128, from the saved log-sum-exp.
//!
//! As the forward (`attention_mma.rs`), a block of 4 warps owns 64 rows of one problem, 16 per
//! warp, and streams the other side's rows in tiles; operands are staged from f32 as bf16.
//! Two kernels, so every output element has one writer and no atomics are needed:
//! - the query gradient, a block per 64 queries: per key tile `S = Q K^T`,
//!   `P = 2^(S scale log2 e - lse log2 e)`, `dP = dY V^T`, `dS = P (dP - delta)`,
//!   `dQ += dS K`;
//! - the key and value gradients (either or both), a block per 64 keys: per query tile the
//!   same transposed, `S^T = K Q^T`, `dP^T = V dY^T`, then `dV += P^T dY`, `dK += dS^T Q`.
//!
//! P and dS go from the C fragments of one `mma` to the A fragments of the next in registers.
//! Every sum runs in one fixed order: deterministic.
//!
//! Tiles live in dynamic shared memory (past the 48 KB of static shared memory at width 128).
//! The streamed tiles are double-buffered as in the forward (`Stream`): the next tile's f32
//! copies (`cp.async`) are in flight while the warps compute on this one. At widths up to 64
//! the block's own tiles are read into registers once and the other side streams in tiles of
//! 64 rows. At width 128 their fragments would not fit in registers next to the accumulators
//! (a spill), so the own tiles stay in shared memory (2 x 17 KB), fragments are read per use,
//! and the streamed tiles are 32 rows. The products run over the same keys in the same order
//! whatever the tile length, so the results do not depend on it.

use super::super::builder::{imm, Kernel, Rd, F, R};
use super::super::{grid_for, Gen, Launch, Launches, OpArgs, Operand};
use super::grad::inputs;
use super::mma::{
    fragment_row, fragments, lane_bits, lane_row, ldmatrix, mma_ab, mma_abt, pack, pitch,
    rows_left, stage, Ctx, Stream, BR, THREADS,
};
use super::{each_task, problem_and_first, Dims, Outs, Problem, Tensor};

const LOG2E: f32 = std::f32::consts::LOG2_E;

/// Whether the tensor-core backward takes these sizes (others use the f32 kernels).
pub(super) fn fits(dm: &Dims) -> bool {
    super::mma::fits(dm) && dm.e > 0
}

/// The query gradient, on tensor cores for bf16 plans of the widths they take.
pub(super) fn query_grad(g: &mut Gen, a: OpArgs) -> Launches {
    let dm = super::grad::dims(a.op, a.ins, &[("dq", Some(a.out), false)])?;
    if g.options.bf16_attention && fits(&dm) {
        return Ok(vec![query(g, a.name, dm, a.ins, a.out)]);
    }
    super::grad::query(g, a)
}

/// The key and value gradients (either or both), on tensor cores as `query_grad`.
pub(super) fn key_value_grad(g: &mut Gen, a: OpArgs<Outs>) -> Launches {
    let (dk, dv) = a.out;
    let dm = super::grad::dims(a.op, a.ins, &[("dk", dk, true), ("dv", dv, true)])?;
    if g.options.bf16_attention && fits(&dm) {
        return Ok(vec![key_value(g, a.name, dm, a.ins, (dk, dv))]);
    }
    super::grad::key_value(g, a)
}

/// Rows per streamed tile, and whether the own tiles' fragments live in registers. At width
/// 128 the own fragments stay in shared memory (in registers they would spill next to the
/// accumulators) and the streamed tiles are 32 rows: 64 would leave the query gradient at
/// 240 registers, the key and value gradients past 255.
fn tiling(dm: &Dims) -> (u64, bool) {
    if dm.d.max(dm.e) <= 64 {
        (64, true)
    } else {
        (32, false)
    }
}

/// A bf16 tile of `rows` rows of `width` in the block's dynamic shared memory (the tiles
/// at width 128 pass the 48 KB of static shared memory), and its address.
fn tile(k: &mut Kernel, rows: u64, width: u64) -> Rd {
    k.dynamic_shared(rows * pitch(width))
}

/// The A fragments of this warp's 16 rows of an own tile: in registers, or read from the
/// tile at each use.
enum Own {
    Regs(Vec<R>),
    Shared(Rd),
}

impl Own {
    fn new(k: &mut Kernel, ctx: &Ctx, buf: Rd, width: u64, regs: bool) -> Own {
        if regs {
            Own::Regs(fragments(k, ctx, buf, width))
        } else {
            Own::Shared(fragment_row(k, ctx, buf, width))
        }
    }

    /// The 4 registers of columns `16 kk..`.
    fn get(&self, k: &mut Kernel, kk: usize) -> Vec<R> {
        match self {
            Own::Regs(r) => r[4 * kk..4 * kk + 4].to_vec(),
            Own::Shared(at) => ldmatrix(k, *at, 32 * kk as u64, false).to_vec(),
        }
    }
}

/// `acc = A B^T` from zero: 16 rows by `cols` of f32 C fragments.
fn product(k: &mut Kernel, a: &Own, b_at: Rd, width: u64, cols: u64) -> Vec<F> {
    let acc: Vec<F> = (0..cols / 2).map(|_| k.fc(0.0)).collect();
    mma_abt(k, &acc, &mut |k, kk| a.get(k, kk), b_at, width);
    acc
}

/// What a tile drops: keys at or past their count and, causal, keys after their query.
struct Mask {
    causal: bool,
    /// Whether the tile's rows are keys (the key and value gradients) or queries.
    keys_are_rows: bool,
    /// Columns, rows of the block.
    cols: u64,
    rows: u64,
    /// The count of the columns' side (past it, padding).
    limit: u64,
}

/// The C fragment element `n`'s (row half, column offset from `2 tig`).
fn place(n: usize) -> (usize, u64) {
    (n % 4 / 2, 8 * (n as u64 / 4) + n as u64 % 2)
}

/// Sets to -inf the elements of `s` the mask drops (columns from `c0`, the lane's rows `rows`,
/// the block's from `r0`): only on tiles that have any (a uniform branch skips the rest).
fn mask(k: &mut Kernel, m: &Mask, s: &[F], (c0, r0): (Rd, Rd), rows: [Rd; 2], tig: Rd) {
    let tail = k.op64("add", c0, m.cols);
    let need = k.cmp64("gt", tail, m.limit);
    if m.causal {
        // Some key after some query: the largest key against the smallest query.
        let diag = if m.keys_are_rows {
            let last = k.op64("add", r0, m.rows - 1);
            k.cmp64("gt", last, c0)
        } else {
            let last = k.op64("add", c0, m.cols - 1);
            k.cmp64("gt", last, r0)
        };
        k.ins(format!("or.pred {need}, {need}, {diag}"));
    }
    let skip = k.label();
    k.bra_unless(need, &skip);
    let ninf = k.fc(f32::NEG_INFINITY);
    let col = k.op64("mul.lo", tig, 2);
    let col = k.op64("add", col, c0);
    for (n, &x) in s.iter().enumerate() {
        let (half, off) = place(n);
        let j = k.op64("add", col, off);
        let drop = k.cmp64("ge", j, m.limit);
        if m.causal {
            let after = if m.keys_are_rows {
                k.cmp64("gt", rows[half], j)
            } else {
                k.cmp64("gt", j, rows[half])
            };
            k.ins(format!("or.pred {drop}, {drop}, {after}"));
        }
        k.ins(format!("selp.f32 {x}, {ninf}, {x}, {drop}"));
    }
    k.place(&skip);
}

/// The thread's fragment coordinates `(grp, tig)` and its two rows of the block's 64 from `r0`.
fn rows_of(k: &mut Kernel, ctx: &Ctx, r0: Rd) -> (Rd, [Rd; 2]) {
    let grp = lane_bits(k, ctx.lane, 2, 7);
    let tig = lane_bits(k, ctx.lane, 0, 3);
    let w = k.op64("mul.lo", ctx.warp, 16);
    let w = k.op64("add", w, grp);
    let row0 = k.op64("add", r0, w);
    let row1 = k.op64("add", row0, 8);
    (tig, [row0, row1])
}

/// Stores `acc * by` (C fragments, `dst.width` columns) of the lane's rows below `limit`.
fn store(
    k: &mut Kernel,
    dst: &Tensor,
    pb: &Problem,
    (rows, tig): ([Rd; 2], Rd),
    acc: &[F],
    by: f32,
) {
    let col = k.op64("mul.lo", tig, 2);
    for (half, &row) in rows.iter().enumerate() {
        let inside = k.cmp64("lt", row, dst.len);
        let base = dst.offset(k, pb, row);
        let base = k.op64("add", base, col);
        let base = k.addr(dst.ptr, base);
        for nt in 0..dst.width / 8 {
            let c = 4 * nt as usize + 2 * half;
            let (x, y) = (k.mulc(acc[c], by), k.mulc(acc[c + 1], by));
            k.store_pair(Some(&inside.to_string()), base, 8 * nt, (x, y));
        }
    }
}

/// `s = s c - lse` in place, `lse` (times `log2 e`) of each element's query: the exponent
/// of `P`.
fn shift(k: &mut Kernel, s: &[F], c: f32, lse: &dyn Fn(usize) -> F) {
    for (n, &x) in s.iter().enumerate() {
        let l = lse(n);
        k.ins(format!("mul.rn.f32 {x}, {x}, {}", imm(c)));
        k.ins(format!("sub.rn.f32 {x}, {x}, {l}"));
    }
}

/// `P = 2^s` in place, after the mask (its -inf give 0).
fn exp2(k: &mut Kernel, s: &[F]) {
    for &x in s {
        k.ins(format!("ex2.approx.f32 {x}, {x}"));
    }
}

/// Stages the query tile's `lse log2 e` and `delta` as f32 at `buf` (`tile` of each), zeros
/// past `rows` (padded queries are masked, and must stay finite).
fn stage_stats(
    k: &mut Kernel,
    ctx: &Ctx,
    (buf, tile): (Rd, u64),
    tl: &Tensor,
    (lp, dp): (Rd, Rd),
    pb: &Problem,
    (i0, rows): (Rd, Rd),
) {
    let i = k.op64("add", i0, ctx.tid);
    let inside = k.cmp64("lt", ctx.tid, rows);
    let at = tl.offset(k, pb, i);
    let (la, da) = (k.addr(lp, at), k.addr(dp, at));
    let (l, d) = (k.fc(0.0), k.fc(0.0));
    let (lb, db) = (k.is_bf16(la), k.is_bf16(da));
    k.load_elem_into(l, Some(&inside.to_string()), &format!("[{la}]"), lb);
    k.load_elem_into(d, Some(&inside.to_string()), &format!("[{da}]"), db);
    let l = k.mulc(l, LOG2E);
    let sa = k.op64("mul.lo", ctx.tid, 4);
    let sa = k.op64("add", sa, buf);
    let mine = k.cmp64("lt", ctx.tid, tile);
    k.ins(format!("@{mine} st.shared.f32 [{sa}], {l}"));
    k.ins(format!("@{mine} st.shared.f32 [{sa}+{}], {d}", 4 * tile));
}

/// `ds = p (dp - delta)` in place in `dp`, `delta` of each element's query.
fn dscores(k: &mut Kernel, p: &[F], dp: &[F], delta: &dyn Fn(usize) -> F) {
    for (n, (&x, &y)) in p.iter().zip(dp).enumerate() {
        let d = delta(n);
        k.ins(format!("sub.rn.f32 {y}, {y}, {d}"));
        k.ins(format!("mul.rn.f32 {y}, {y}, {x}"));
    }
}

/// A backward kernel's tasks, one a block of `BR` rows (queries, or keys when `keys_are_rows`)
/// of one problem, and the mask of their score tiles against `n` rows of the other side:
/// `(mask, tiles a problem, tasks)`.
fn backward_tasks(dm: &Dims, n: u64, keys_are_rows: bool) -> (Mask, u64, u64) {
    let (rows, others) = if keys_are_rows {
        (dm.s, dm.t)
    } else {
        (dm.t, dm.s)
    };
    let m = Mask {
        causal: dm.causal,
        keys_are_rows,
        cols: n,
        rows: BR,
        limit: others,
    };
    let tiles = rows.div_ceil(BR);
    (m, tiles, dm.problems * tiles)
}

/// The query gradient `dq = scale dS K`; `ins` are `(q, k, v, dy, lse, delta)`.
pub(super) fn query(g: &mut Gen, name: &str, dm: Dims, ins: &[Operand], dq: &Operand) -> Launch {
    let mut k = g.kernel(name);
    let ([tq, tk, tv, tdy], (tl, lp, dp)) = inputs(&mut k, &dm, ins);
    let tdq = dm.tensor(k.param_ptr(dq.arg), dm.t, dm.d);
    let (d, e) = (dm.d, dm.e);
    let (n, regs) = tiling(&dm);
    let (qbuf, dybuf) = (tile(&mut k, BR, d), tile(&mut k, BR, e));
    let (kbuf, vbuf) = (tile(&mut k, n, d), tile(&mut k, n, e));
    let kf32 = k.dynamic_shared(Stream::staging_bytes(n, &[d, e]));
    let vf32 = k.op64("add", kf32, 4 * n * d);
    let ctx = Ctx::new(&mut k);
    // K as B of `Q K^T` and (`.trans`) of `dS K`, V as B of `dY V^T`.
    let k_at = lane_row(&mut k, &ctx, kbuf, d, false);
    let kt_at = lane_row(&mut k, &ctx, kbuf, d, true);
    let v_at = lane_row(&mut k, &ctx, vbuf, e, false);
    let (m, tiles, tasks) = backward_tasks(&dm, n, false);
    let c = dm.scale * LOG2E;
    each_task(&mut k, tasks, |k, task| {
        let (pb, i0) = problem_and_first(k, &dm, task, tiles, BR);
        let rows = rows_left(k, i0, dm.t, BR);
        let keys = Stream {
            tiles: vec![(&tk, kf32, kbuf), (&tv, vf32, vbuf)],
            rows: n,
            len: dm.s,
        };
        // The first key tile's copy goes out first. The previous task's warps may still read
        // the tiles.
        // Causal: the block's last query sees keys below `i0 + BR`.
        let (zero, end) = keys.copy_first(k, &ctx, &pb, i0, dm.causal);
        stage(k, &ctx, (qbuf, BR), &tq, &pb, i0, rows);
        stage(k, &ctx, (dybuf, BR), &tdy, &pb, i0, rows);
        k.ins("bar.sync 0");
        let qf = Own::new(k, &ctx, qbuf, d, regs);
        let dyf = Own::new(k, &ctx, dybuf, e, regs);
        let (tig, rw) = rows_of(k, &ctx, i0);
        // Padded rows read the last row's statistics (finite, never stored).
        let mut lse = Vec::new();
        let mut delta = Vec::new();
        for &r in &rw {
            let rc = k.op64("min", r, dm.t.saturating_sub(1));
            let at = tl.offset(k, &pb, rc);
            let l = k.load(lp, at);
            lse.push(k.mulc(l, LOG2E));
            delta.push(k.load(dp, at));
        }
        let acc: Vec<F> = (0..d / 2).map(|_| k.fc(0.0)).collect();
        k.for_range(zero, end, n, |k, j0| {
            keys.step(k, &ctx, &pb, (j0, end), |_| {});
            let s = product(k, &qf, k_at, d, n);
            let dpv = product(k, &dyf, v_at, e, n);
            shift(k, &s, c, &|x| lse[place(x).0]);
            mask(k, &m, &s, (j0, i0), rw, tig);
            exp2(k, &s);
            dscores(k, &s, &dpv, &|n| delta[place(n).0]);
            let ds = pack(k, &dpv);
            mma_ab(k, &acc, &ds, kt_at, d);
        });
        store(k, &tdq, &pb, (rw, tig), &acc, dm.scale);
    });
    g.launch(k, grid_for(tasks, 1), THREADS as u32)
}

/// The key and value gradients, either or both: `dk = scale dS^T Q`, `dv = P^T dY`; `ins`
/// are `(q, k, v, dy, lse, delta)`.
pub(super) fn key_value(
    g: &mut Gen,
    name: &str,
    dm: Dims,
    ins: &[Operand],
    (dk, dv): (Option<&Operand>, Option<&Operand>),
) -> Launch {
    let mut k = g.kernel(name);
    let ([tq, tk, tv, tdy], (tl, lp, dp)) = inputs(&mut k, &dm, ins);
    let tdk = dk.map(|o| dm.tensor(k.param_ptr(o.arg), dm.s, dm.d));
    let tdv = dv.map(|o| dm.tensor(k.param_ptr(o.arg), dm.s, dm.e));
    let (d, e) = (dm.d, dm.e);
    let (n, regs) = tiling(&dm);
    let kbuf = tile(&mut k, BR, d);
    let vbuf = tdk.is_some().then(|| tile(&mut k, BR, e));
    let (qbuf, dybuf) = (tile(&mut k, n, d), tile(&mut k, n, e));
    let qf32 = k.dynamic_shared(Stream::staging_bytes(n, &[d, e]));
    let dyf32 = k.op64("add", qf32, 4 * n * d);
    // The query tile's lse (times log2 e) and delta, f32.
    let sbuf = k.dynamic_shared(2 * 4 * n);
    let ctx = Ctx::new(&mut k);
    // Q as B of `K Q^T` and (`.trans`) of `dS^T Q`, dY as B of `V dY^T` and of `P^T dY`.
    let q_at = lane_row(&mut k, &ctx, qbuf, d, false);
    let qt_at = lane_row(&mut k, &ctx, qbuf, d, true);
    let dy_at = lane_row(&mut k, &ctx, dybuf, e, false);
    let dyt_at = lane_row(&mut k, &ctx, dybuf, e, true);
    let (m, tiles, tasks) = backward_tasks(&dm, n, true);
    let c = dm.scale * LOG2E;
    each_task(&mut k, tasks, |k, task| {
        let (pb, j0) = problem_and_first(k, &dm, task, tiles, BR);
        let rows = rows_left(k, j0, dm.s, BR);
        let queries = Stream {
            tiles: vec![(&tq, qf32, qbuf), (&tdy, dyf32, dybuf)],
            rows: n,
            len: dm.t,
        };
        // Causal: queries before the block's first key see none of its keys (`j0` is a
        // multiple of the query tile).
        let start = if dm.causal { j0 } else { k.u64c(0) };
        let end = k.u64c(dm.t);
        // The first query tile's copy goes out first.
        k.ins("bar.sync 0");
        queries.copy(k, &ctx, &pb, (start, end));
        stage(k, &ctx, (kbuf, BR), &tk, &pb, j0, rows);
        if let Some(vb) = vbuf {
            stage(k, &ctx, (vb, BR), &tv, &pb, j0, rows);
        }
        k.ins("bar.sync 0");
        let kf = Own::new(k, &ctx, kbuf, d, regs);
        let vf = vbuf.map(|b| Own::new(k, &ctx, b, e, regs));
        let (tig, rw) = rows_of(k, &ctx, j0);
        // This lane's columns of the statistics: `8 nt + 2 tig (+ 1)`, 4 bytes each.
        let col = k.op64("mul.lo", tig, 8);
        let s_at = k.op64("add", sbuf, col);
        let dka: Vec<F> = (0..if dk.is_some() { d / 2 } else { 0 })
            .map(|_| k.fc(0.0))
            .collect();
        let dva: Vec<F> = (0..if dv.is_some() { e / 2 } else { 0 })
            .map(|_| k.fc(0.0))
            .collect();
        k.for_range(start, end, n, |k, i0| {
            // The statistics are loaded as they are needed (4 values a thread).
            queries.step(k, &ctx, &pb, (i0, end), |k| {
                let qrows = rows_left(k, i0, dm.t, n);
                stage_stats(k, &ctx, (sbuf, n), &tl, (lp, dp), &pb, (i0, qrows));
            });
            let s = product(k, &kf, q_at, d, n);
            // Both halves of a fragment share their columns: one load per column.
            let col_stat = |k: &mut Kernel, which: u64| -> Vec<F> {
                (0..n / 4)
                    .map(|x| {
                        let v = k.f();
                        let off = 4 * (which * n + 8 * (x / 2) + x % 2);
                        k.ins(format!("ld.shared.f32 {v}, [{s_at}+{off}]"));
                        v
                    })
                    .collect()
            };
            // Element `x`'s column: n-tile `x / 4`, odd `x % 2`.
            let at = |x: usize| 2 * (x / 4) + x % 2;
            let lse = col_stat(k, 0);
            shift(k, &s, c, &|x| lse[at(x)]);
            mask(k, &m, &s, (i0, j0), rw, tig);
            exp2(k, &s);
            if !dva.is_empty() {
                let pt = pack(k, &s);
                mma_ab(k, &dva, &pt, dyt_at, e);
            }
            if let Some(vf) = &vf {
                let dpt = product(k, vf, dy_at, e, n);
                let delta = col_stat(k, 1);
                dscores(k, &s, &dpt, &|x| delta[at(x)]);
                let ds = pack(k, &dpt);
                mma_ab(k, &dka, &ds, qt_at, d);
            }
        });
        if let Some(t) = &tdk {
            store(k, t, &pb, (rw, tig), &dka, dm.scale);
        }
        if let Some(t) = &tdv {
            store(k, t, &pb, (rw, tig), &dva, 1.0);
        }
    });
    g.launch(k, grid_for(tasks, 1), THREADS as u32)
}

#[cfg(test)]
#[path = "tests/attention_mma_grad.rs"]
mod tests;
