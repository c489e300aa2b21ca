//! Attention's forward on tensor cores (FlashAttention-2 style): bf16 operands, f32
//! accumulation, `mma.sync.m16n8k16` (sm_80 and later), for head widths 64 and 128.
//!
//! A block of 4 warps takes 64 queries of one problem (batch position and head); each warp
//! owns 16 of them (one m16 tile), so the softmax statistics of a row never leave the 4 lanes
//! that hold it. Keys and values stream in tiles of 64, double-buffered in dynamic shared
//! memory (`Stream`, in `attention_mma_stage.rs`): while the warps compute on tile j in bf16,
//! tile j + 1 lands as f32 by `cp.async`, and each thread converts its own copies
//! (`cvt.rn.bf16x2.f32`) when the next step begins (98 KB at width 128, past static shared
//! memory's 48 KB). The query tile goes through the key buffer once and then lives in
//! registers as `mma` A fragments.
//!
//! Per key tile: `S = Q K^T` (B fragments by `ldmatrix`), scores scaled by `scale * log2 e`
//! so `ex2.approx` is the exponential, masking only on the diagonal tile of a causal head and
//! on the last, partial tile; the S accumulators are repacked in registers as the A fragments
//! of `P V` (V by `ldmatrix.trans`), so P never touches shared memory. Each lane keeps its
//! own partial row sums; the 4 lanes of a row add them once at the end. Every sum runs in one
//! fixed order and each output has one writer: deterministic.

use super::super::builder::{imm, Kernel, Rd, F, P, R};
use super::super::{grid_for, Gen, Launch, Operand};
use super::{each_task, problem_and_first, Dims, Problem, Tensor};

#[path = "attention_mma_stage.rs"]
mod staging;
pub(super) use staging::{rows_left, stage, Stream};

/// Warps per block, 16 query rows each.
pub(super) const WARPS: u64 = 4;
pub(super) const THREADS: u64 = 32 * WARPS;
/// Query rows per block and keys per tile.
pub(super) const BR: u64 = 16 * WARPS;
const BC: u64 = 64;
/// bf16 elements of padding per staged row: 16 bytes, so the 8 rows one `ldmatrix` reads
/// fall in 8 different 16-byte bank groups.
pub(super) const PAD: u64 = 8;

/// Whether the tensor-core forward takes these sizes (others use the f32 kernel).
pub(super) fn fits(dm: &Dims) -> bool {
    matches!(dm.d, 64 | 128) && matches!(dm.e, 0 | 64 | 128)
}

/// A staged tile's row pitch in bytes.
pub(super) fn pitch(width: u64) -> u64 {
    2 * (width + PAD)
}

/// The thread's place in the block.
pub(super) struct Ctx {
    pub(super) tid: Rd,
    pub(super) lane: Rd,
    pub(super) warp: Rd,
}

impl Ctx {
    pub(super) fn new(k: &mut Kernel) -> Ctx {
        let t = k.special("%tid.x");
        let tid = k.wide(t);
        let l = k.special("%laneid");
        let lane = k.wide(l);
        let warp = k.op64("shr", tid, 5);
        Ctx { tid, lane, warp }
    }
}

/// `(r >> shift) & mask`.
pub(super) fn lane_bits(k: &mut Kernel, r: Rd, shift: u64, mask: u64) -> Rd {
    let s = k.rd();
    k.ins(format!("shr.u64 {s}, {r}, {shift}"));
    let d = k.rd();
    k.ins(format!("and.b64 {d}, {s}, {mask}"));
    d
}

/// `ldmatrix` x4 (`.trans` if `trans`) with this lane's row address `at + off`.
pub(super) fn ldmatrix(k: &mut Kernel, at: Rd, off: u64, trans: bool) -> [R; 4] {
    let d = [k.r(), k.r(), k.r(), k.r()];
    let t = if trans { ".trans" } else { "" };
    k.ins(format!(
        "ldmatrix.sync.aligned.m8n8.x4{t}.shared.b16 {{{}, {}, {}, {}}}, [{at}+{off}]",
        d[0], d[1], d[2], d[3]
    ));
    d
}

/// `c += a b` on one m16n8k16 tile.
pub(super) fn mma(k: &mut Kernel, c: &[F], a: &[R], b: [R; 2]) {
    k.ins(format!(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c0}, {c1}, {c2}, {c3}}}, \
         {{{}, {}, {}, {}}}, {{{}, {}}}, {{{c0}, {c1}, {c2}, {c3}}}",
        a[0],
        a[1],
        a[2],
        a[3],
        b[0],
        b[1],
        c0 = c[0],
        c1 = c[1],
        c2 = c[2],
        c3 = c[3],
    ));
}

/// `acc += A B^T` of one warp: A 16 rows by `width` (`a(k, kk)`: the 4 fragment registers
/// of columns `16 kk..`), B `acc.len() / 4` rows by `width`, staged row-major, read by
/// `ldmatrix` at this lane's `b_at` (`lane_row`, not split).
pub(super) fn mma_abt(
    k: &mut Kernel,
    acc: &[F],
    a: &mut dyn FnMut(&mut Kernel, usize) -> Vec<R>,
    b_at: Rd,
    width: u64,
) {
    for nt in 0..acc.len() as u64 / 4 {
        let c = &acc[4 * nt as usize..4 * nt as usize + 4];
        for pr in 0..width / 32 {
            let b = ldmatrix(k, b_at, 8 * nt * pitch(width) + 64 * pr, false);
            let a0 = a(k, 2 * pr as usize);
            mma(k, c, &a0, [b[0], b[1]]);
            let a1 = a(k, 2 * pr as usize + 1);
            mma(k, c, &a1, [b[2], b[3]]);
        }
    }
}

/// `acc += A B` of one warp: A 16 rows by `a.len() * 4` (packed bf16 fragments, 4 registers
/// per 16 columns), B that many rows by `width`, staged row-major, read by `ldmatrix.trans`
/// at this lane's `b_at` (`lane_row`, split).
pub(super) fn mma_ab(k: &mut Kernel, acc: &[F], a: &[R], b_at: Rd, width: u64) {
    for kk in 0..a.len() as u64 / 4 {
        let a = &a[4 * kk as usize..4 * kk as usize + 4];
        for np in 0..width / 16 {
            let b = ldmatrix(k, b_at, 16 * kk * pitch(width) + 32 * np, true);
            let n = 8 * np as usize;
            mma(k, &acc[n..n + 4], a, [b[0], b[1]]);
            mma(k, &acc[n + 4..n + 8], a, [b[2], b[3]]);
        }
    }
}

/// The row address this lane gives `ldmatrix` x4: matrix `m = lane / 8`, its row `lane % 8`.
/// `split_rows`: matrices 0-3 are (rows 0-7, columns 0-7), (rows 8-15, columns 0-7), then
/// the same of columns 8-15; otherwise rows 0-7 of columns 0-7, 8-15, 16-23, 24-31.
pub(super) fn lane_row(k: &mut Kernel, ctx: &Ctx, buf: Rd, width: u64, split_rows: bool) -> Rd {
    let mut r = lane_bits(k, ctx.lane, 0, 7);
    let m = lane_bits(k, ctx.lane, 3, 3);
    let mut c = m;
    if split_rows {
        let lo = lane_bits(k, m, 0, 1);
        let lo = k.op64("mul.lo", lo, 8);
        r = k.op64("add", r, lo);
        c = k.op64("shr", m, 1);
    }
    // 8 bf16 columns: 16 bytes.
    let c = k.op64("mul.lo", c, 16);
    let a = k.op64("mul.lo", r, pitch(width));
    let a = k.op64("add", a, c);
    k.op64("add", a, buf)
}

/// The A fragments (4 registers per 16 columns) of this warp's 16 rows of the tile at `buf`.
pub(super) fn fragments(k: &mut Kernel, ctx: &Ctx, buf: Rd, d: u64) -> Vec<R> {
    let at = fragment_row(k, ctx, buf, d);
    (0..d / 16)
        .flat_map(|kk| ldmatrix(k, at, 32 * kk, false))
        .collect()
}

/// This lane's `ldmatrix` row address for the A fragments of this warp's 16 rows at `buf`:
/// columns `16 kk..` at offset `32 kk`.
pub(super) fn fragment_row(k: &mut Kernel, ctx: &Ctx, buf: Rd, d: u64) -> Rd {
    // Matrices: rows 0-7 / 8-15 of columns 0-7, then of columns 8-15 (a0..a3).
    let at = lane_row(k, ctx, buf, d, true);
    let w = k.op64("mul.lo", ctx.warp, 16 * pitch(d));
    k.op64("add", at, w)
}

/// The forward: `o = softmax(scale q k^T) v` when `vo` is given, `lse = ln sum exp` when
/// `lse` is.
pub(super) fn forward(
    g: &mut Gen,
    name: &str,
    dm: Dims,
    (q, key): (&Operand, &Operand),
    vo: Option<(&Operand, &Operand)>,
    lse: Option<&Operand>,
) -> Launch {
    let mut k = g.kernel(name);
    let (tq, tk, vo, tl) = dm.forward_views(&mut k, (q, key), vo, lse);
    let (d, e) = (dm.d, if vo.is_some() { dm.e } else { 0 });
    // Two stages of the K and V tiles in dynamic shared memory (past the 48 KB of static
    // shared memory at width 128): tile j + 1 lands as f32 (`cp.async`) while the warps
    // compute on tile j in bf16.
    let (kb, vb) = (BC * pitch(d), if e > 0 { BC * pitch(e) } else { 0 });
    let kbuf = k.dynamic_shared(kb + vb);
    let vbuf = (e > 0).then(|| k.op64("add", kbuf, kb));
    let widths: Vec<u64> = if e > 0 { vec![d, e] } else { vec![d] };
    let kf32 = k.dynamic_shared(Stream::staging_bytes(BC, &widths));
    let vf32 = k.op64("add", kf32, 4 * BC * d);
    let ctx = Ctx::new(&mut k);
    let (lane, warp) = (ctx.lane, ctx.warp);
    // This lane's place in a C fragment: row `grp` (and `grp + 8`), columns 2 tig, 2 tig + 1.
    let grp = lane_bits(&mut k, lane, 2, 7);
    let tig = lane_bits(&mut k, lane, 0, 3);
    // ldmatrix row addresses: K as B of `Q K^T` (one 8-key tile, 32 columns: b0 b1 of two
    // k-steps), V as B of `P V` by `.trans` (16 keys, 16 columns: b0 b1 of two n-tiles).
    let k_at = lane_row(&mut k, &ctx, kbuf, d, false);
    let v_at = vbuf.map(|b| lane_row(&mut k, &ctx, b, e, true));
    let qtiles = dm.t.div_ceil(BR);
    let tasks = dm.problems * qtiles;
    let c = dm.scale * std::f32::consts::LOG2_E;
    each_task(&mut k, tasks, |k, task| {
        let (pb, i0) = problem_and_first(k, &dm, task, qtiles, BR);
        let left = k.u64c(dm.t);
        let left = k.op64("sub", left, i0);
        let rows = k.op64("min", left, BR);
        // The first key tile's copy goes out first, then the query tile through the key
        // buffer, which the previous task's warps may still read.
        let mut tiles = vec![(&tk, kf32, kbuf)];
        if let (Some(vb), Some((tv, _))) = (vbuf, &vo) {
            tiles.push((tv, vf32, vb));
        }
        let keys = Stream {
            tiles,
            rows: BC,
            len: dm.s,
        };
        // Causal: the block's last query sees keys below `i0 + BR`.
        let (zero, end) = keys.copy_first(k, &ctx, &pb, i0, dm.causal);
        stage(k, &ctx, (kbuf, BR), &tq, &pb, i0, rows);
        k.ins("bar.sync 0");
        let qf = fragments(k, &ctx, kbuf, d);
        // This lane's two query rows.
        let wr = k.op64("mul.lo", warp, 16);
        let wr = k.op64("add", wr, grp);
        let row0 = k.op64("add", i0, wr);
        let row1 = k.op64("add", row0, 8);
        let m = [k.fc(f32::NEG_INFINITY), k.fc(f32::NEG_INFINITY)];
        let sum = [k.fc(0.0), k.fc(0.0)];
        let o: Vec<F> = (0..e / 2).map(|_| k.fc(0.0)).collect();
        k.for_range(zero, end, BC, |k, j0| {
            keys.step(k, &ctx, &pb, (j0, end), |_| {});
            let s = scores(k, &qf, k_at, d, c);
            mask(k, &dm, &s, (j0, i0), (row0, row1), tig);
            let pa = softmax_step(k, &s, &m, &sum, &o);
            if let Some(v_at) = v_at {
                mma_ab(k, &o, &pa, v_at, e);
            }
        });
        let out = (vo.map(|(_, to)| to), tl);
        finish(k, &dm, (&pb, [row0, row1], tig), &m, &sum, &o, out);
    });
    g.launch(k, grid_for(tasks, 1), THREADS as u32)
}

/// `S = Q K^T * c` for this warp's 16 rows and the tile's 64 keys: 8 C fragments of 4.
fn scores(k: &mut Kernel, qf: &[R], k_at: Rd, d: u64, c: f32) -> Vec<F> {
    let s: Vec<F> = (0..BC / 2).map(|_| k.fc(0.0)).collect();
    mma_abt(k, &s, &mut |_, kk| qf[4 * kk..4 * kk + 4].to_vec(), k_at, d);
    for &x in &s {
        k.ins(format!("mul.rn.f32 {x}, {x}, {}", imm(c)));
    }
    s
}

/// Sets to -inf the scores of keys past `S` and, causal, of keys after their query: only on
/// tiles that have any (a uniform branch skips the rest).
fn mask(k: &mut Kernel, dm: &Dims, s: &[F], (j0, i0): (Rd, Rd), rows: (Rd, Rd), tig: Rd) {
    let tail = k.op64("add", j0, BC);
    let need = k.cmp64("gt", tail, dm.s);
    if dm.causal {
        let last = k.op64("add", j0, BC - 1);
        let diag = k.cmp64("gt", last, i0);
        k.ins(format!("or.pred {need}, {need}, {diag}"));
    }
    let skip = k.label();
    k.bra_unless(need, &skip);
    let ninf = k.fc(f32::NEG_INFINITY);
    let col = k.op64("mul.lo", tig, 2);
    let col = k.op64("add", col, j0);
    for (n, &x) in s.iter().enumerate() {
        let (nt, half, odd) = (n as u64 / 4, n % 4 / 2, n as u64 % 2);
        let j = k.op64("add", col, 8 * nt + odd);
        let drop: P = k.cmp64("ge", j, dm.s);
        if dm.causal {
            let i = if half == 0 { rows.0 } else { rows.1 };
            let after = k.cmp64("gt", j, i);
            k.ins(format!("or.pred {drop}, {drop}, {after}"));
        }
        k.ins(format!("selp.f32 {x}, {ninf}, {x}, {drop}"));
    }
    k.place(&skip);
}

/// The online softmax of one tile: new row maxima `m` (over the 4 lanes of a row), the
/// lane's partial sums and the output rescaled, and `P = 2^(s - m)` packed as bf16 A
/// fragments of `P V` (4 registers per 16 keys).
fn softmax_step(k: &mut Kernel, s: &[F], m: &[F; 2], sum: &[F; 2], o: &[F]) -> Vec<R> {
    for (half, (&mr, &lr)) in m.iter().zip(sum).enumerate() {
        let of = |n: usize| n % 4 / 2 == half;
        let xs: Vec<F> = (0..s.len()).filter(|&n| of(n)).map(|n| s[n]).collect();
        let mx = k.mov(xs[0]);
        for &x in &xs[1..] {
            k.ins(format!("max.f32 {mx}, {mx}, {x}"));
        }
        for shift in [1, 2] {
            let t = k.f();
            k.ins(format!("shfl.sync.bfly.b32 {t}, {mx}, {shift}, 31, -1"));
            k.ins(format!("max.f32 {mx}, {mx}, {t}"));
        }
        // Some key of every tile is visible to every row, so the new maximum is finite and
        // the first tile's `2^(-inf - m)` is 0, not NaN.
        let mn = k.f();
        k.ins(format!("max.f32 {mn}, {mr}, {mx}"));
        let dlt = k.sub(mr, mn);
        let corr = k.un("ex2.approx.f32", dlt);
        k.set(mr, mn);
        let part = k.fc(0.0);
        for &x in &xs {
            k.ins(format!("sub.rn.f32 {x}, {x}, {mn}"));
            k.ins(format!("ex2.approx.f32 {x}, {x}"));
            k.ins(format!("add.rn.f32 {part}, {part}, {x}"));
        }
        k.ins(format!("mul.rn.f32 {lr}, {lr}, {corr}"));
        k.ins(format!("add.rn.f32 {lr}, {lr}, {part}"));
        for (n, &a) in o.iter().enumerate() {
            if of(n) {
                k.ins(format!("mul.rn.f32 {a}, {a}, {corr}"));
            }
        }
    }
    pack(k, s)
}

/// C fragments (4 per 8 columns) repacked as the bf16 A fragments of the next `mma` (4
/// registers per 16 columns, the same rows).
pub(super) fn pack(k: &mut Kernel, s: &[F]) -> Vec<R> {
    // A fragment of keys 16 kk..: (row g, keys 2 tig..) = c0 c1 of n-tile 2 kk, (row g + 8)
    // = its c2 c3, then the same of n-tile 2 kk + 1.
    let mut pa = Vec::new();
    for pair in s.chunks(2) {
        let r = k.r();
        k.ins(format!("cvt.rn.bf16x2.f32 {r}, {}, {}", pair[1], pair[0]));
        pa.push(r);
    }
    pa
}

/// `o / l` and `lse = ln 2 (m + log2 l)` of this lane's rows below `T`, into `out`'s tensors.
fn finish(
    k: &mut Kernel,
    dm: &Dims,
    (pb, rows, tig): (&Problem, [Rd; 2], Rd),
    m: &[F; 2],
    sum: &[F; 2],
    o: &[F],
    out: (Option<Tensor>, Option<Tensor>),
) {
    let col = k.op64("mul.lo", tig, 2);
    let lead = k.cmp64("eq", tig, 0);
    for (half, &row) in rows.iter().enumerate() {
        let l = sum[half];
        for shift in [1, 2] {
            let t = k.f();
            k.ins(format!("shfl.sync.bfly.b32 {t}, {l}, {shift}, 31, -1"));
            k.ins(format!("add.rn.f32 {l}, {l}, {t}"));
        }
        let inside = k.cmp64("lt", row, dm.t);
        if let Some(to) = &out.0 {
            let one = k.fc(1.0);
            let inv = k.div(one, l);
            let e = dm.e;
            let base = to.offset(k, pb, row);
            let base = k.op64("add", base, col);
            let base = k.addr(to.ptr, base);
            for nt in 0..e / 8 {
                let c = 4 * nt as usize + 2 * half;
                let (x, y) = (k.mul(o[c], inv), k.mul(o[c + 1], inv));
                k.store_pair(Some(&inside.to_string()), base, 8 * nt, (x, y));
            }
        }
        if let Some(tl) = &out.1 {
            let lg = k.un("lg2.approx.f32", l);
            let v = k.add(m[half], lg);
            let v = k.mulc(v, std::f32::consts::LN_2);
            let p = k.p();
            k.ins(format!("and.pred {p}, {inside}, {lead}"));
            let a = tl.at(k, pb, row);
            let bf16 = k.is_bf16(a);
            k.store_elem(Some(&p.to_string()), &format!("[{a}]"), v, bf16);
        }
    }
}

#[cfg(test)]
#[path = "tests/attention_mma.rs"]
mod tests;
