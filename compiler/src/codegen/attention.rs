//! Attention's kernels, plain f32: the forward (the output and its log-sum-exp, or the
//! log-sum-exp alone), the query gradient, and the key and value gradients (`attention_grad.rs`).
//! With `CodegenOptions::bf16_attention`, widths 64 and 128 run on tensor cores instead
//! (`attention_mma.rs`, `attention_mma_grad.rs`).
//!
//! Operands are token-major: q `[.., T, H, D]`, k `[.., S, H, D]`, v `[.., S, H, E]`, the
//! output `[.., T, H, E]` and the log-sum-exp `[.., T, H]`, so projections reshape into them
//! without a permute. Each (batch position, head) pair is one independent problem, whose rows
//! lie `H` tensor rows apart (`Tensor::offset`).
//!
//! The design follows the CPU oracle (`runtime/src/cpu/kernels/attention.rs`): the forward and
//! the query gradient walk the keys of one query row in tiles of 32 with an online softmax; the
//! key and value gradients walk the queries of one key row. Each warp owns one row (8 rows, of
//! one problem, per 256-thread block); the block stages the other side's tiles in shared memory,
//! 32 rows by at most `CHUNK` columns at a time, so any head width fits. Scores and `dP` take
//! lanes over the tile's rows (one dot product per lane), the outputs lanes over the row's
//! columns (registers, `ceil(width / 32)` per lane). Every sum runs in one fixed order and each
//! output element has one writer: no atomics, the same bits on every run.

use super::builder::{imm, Kernel, Rd, F, P, R};
use super::{grid_for, CodegenError, Gen, Launch, Launches, OpArgs, Operand};
use crate::ir::{AttentionInput, DType, Op};
use crate::plan::Plan;

#[path = "attention_grad.rs"]
mod grad;
#[path = "attention_operands.rs"]
mod operands;
use operands::{bad, check, params, Dims, Problem, Tensor};
#[path = "attention_mma.rs"]
mod mma;
#[path = "attention_mma_grad.rs"]
mod mma_grad;

/// A fused kernel's two optional outputs: the forward's `(o, lse)`, the backward's `(dk, dv)`.
type Outs<'a> = (Option<&'a Operand>, Option<&'a Operand>);

/// Warps per block, each with a row of the block's tile.
const WARPS: u64 = 8;
const BLOCK: u32 = 32 * WARPS as u32;
/// Rows of a staged tile: one per lane.
const ROWS: u64 = 32;
/// Columns staged at a time: wider heads loop over chunks, so shared memory stays fixed.
const CHUNK: u64 = 128;
/// A staged row's pitch in floats: odd, so the 32 lanes reading one column of 32 rows hit 32
/// different banks.
const PITCH: u64 = CHUNK + 1;

// ---- the block's layout, tiles and loops ----

struct Ctx {
    tid: Rd,
    lane: R,
    lane64: Rd,
    warp64: Rd,
    /// Shared addresses of the two staged tiles (`ROWS x PITCH` floats each).
    a: Rd,
    b: Rd,
}

fn setup(k: &mut Kernel) -> Ctx {
    let (sa, sb) = (
        k.shared_f32((ROWS * PITCH) as u32),
        k.shared_f32((ROWS * PITCH) as u32),
    );
    let (a, b) = (k.rd(), k.rd());
    k.ins(format!("mov.u64 {a}, {sa}"));
    k.ins(format!("mov.u64 {b}, {sb}"));
    let t = k.special("%tid.x");
    let tid = k.wide(t);
    let lane = k.special("%laneid");
    let lane64 = k.wide(lane);
    let w = k.op32("shr", t, 5);
    let warp64 = k.wide(w);
    Ctx {
        tid,
        lane,
        lane64,
        warp64,
        a,
        b,
    }
}

/// A loop over the tasks `0..count`, grid-strided by block (every thread of a block runs the
/// same tasks, so the body may use barriers).
fn each_task(k: &mut Kernel, count: u64, body: impl FnOnce(&mut Kernel, Rd)) {
    let (c, n) = (k.special("%ctaid.x"), k.special("%nctaid.x"));
    let (first, stride) = (k.wide(c), k.wide(n));
    let end = k.u64c(count);
    k.for_range(first, end, stride, body);
}

/// A task's problem and its block's first row: tasks run `tiles` blocks of `rows` rows per
/// problem. `H` is baked in, so splitting the problem is a division by a constant, once.
fn problem_and_first(k: &mut Kernel, dm: &Dims, task: Rd, tiles: u64, rows: u64) -> (Problem, Rd) {
    let g = k.op64("div", task, tiles);
    let tile = k.op64("rem", task, tiles);
    let pb = Problem {
        b: k.op64("div", g, dm.heads),
        h: k.op64("rem", g, dm.heads),
    };
    (pb, k.op64("mul.lo", tile, rows))
}

/// The end of the keys the block's queries `[i0, i0 + WARPS)` see: all `S`, or when causal
/// up to the block's last query (at `shift + i`: a cached attention's position).
fn keys_end(k: &mut Kernel, dm: &Dims, i0: Rd, shift: Option<Rd>) -> Rd {
    if dm.causal {
        let e = k.op64("add", i0, WARPS);
        let e = match shift {
            Some(p) => k.op64("add", e, p),
            None => e,
        };
        k.op64("min", e, dm.s)
    } else {
        k.u64c(dm.s)
    }
}

/// The column chunks `(first, width)` of a row of `width` values.
fn chunks(width: u64) -> Vec<(u64, u64)> {
    (0..width)
        .step_by(CHUNK as usize)
        .map(|c0| (c0, CHUNK.min(width - c0)))
        .collect()
}

/// Copies problem `pb`'s rows `first..first + rows` of `src`, columns `c0..c0 + cw`, into the
/// tile at `buf`, zeros past `rows`, so padded rows add nothing. The whole block runs it,
/// between barriers: the one before lets every warp finish reading the tile's last contents.
#[allow(clippy::too_many_arguments)]
fn stage(
    k: &mut Kernel,
    ctx: &Ctx,
    buf: Rd,
    src: &Tensor,
    pb: &Problem,
    first: Rd,
    rows: Rd,
    c: (u64, u64),
) {
    let (c0, cw) = c;
    k.ins("bar.sync 0");
    let base = src.offset(k, pb, first);
    let base = k.op64("add", base, c0);
    let end = k.u64c(ROWS * cw);
    k.for_range(ctx.tid, end, BLOCK, |k, idx| {
        let r = k.op64("div", idx, cw);
        let c = k.op64("rem", idx, cw);
        let v = k.fc(0.0);
        let inside = k.cmp64("lt", r, rows);
        let at = k.rd();
        k.ins(format!("mad.lo.u64 {at}, {r}, {}, {base}", src.stride()));
        let at = k.op64("add", at, c);
        let addr = k.addr(src.ptr, at);
        let bf16 = k.is_bf16(addr);
        k.load_elem_into(v, Some(&inside.to_string()), &format!("[{addr}]"), bf16);
        let s = k.op64("mul.lo", r, PITCH);
        let s = k.op64("add", s, c);
        let sa = k.addr(buf, s);
        k.ins(format!("st.shared.f32 [{sa}], {v}"));
    });
    k.ins("bar.sync 0");
}

/// `acc += sum_c vec[c] row[c]` over `cw` columns: `vec` a global address the whole warp
/// reads alike (one broadcast load), `row` the shared address of this lane's tile row.
fn dot(k: &mut Kernel, acc: F, vec: Rd, row: Rd, cw: u64) {
    let unroll = if cw.is_multiple_of(4) { 4 } else { 1 };
    let (bf16, bytes) = (k.is_bf16(vec), k.elem_bytes(vec));
    let (pv, ps) = (k.rd(), k.rd());
    k.set64(pv, vec);
    k.set64(ps, row);
    let (zero, end) = (k.u64c(0), k.u64c(cw / unroll));
    k.for_range(zero, end, 1, |k, _| {
        for u in 0..unroll {
            let x = k.load_elem(None, &format!("[{pv}+{}]", bytes * u), bf16);
            let y = k.f();
            k.ins(format!("ld.shared.f32 {y}, [{ps}+{}]", 4 * u));
            k.ins(format!("fma.rn.f32 {acc}, {x}, {y}, {acc}"));
        }
        k.ins(format!("add.u64 {pv}, {pv}, {}", bytes * unroll));
        k.ins(format!("add.u64 {ps}, {ps}, {}", 4 * unroll));
    });
}

/// `acc[m] += sum_j w_j tile[j][32 m + lane]` over the tile's 32 rows, `w_j` lane `j`'s `w`:
/// this lane's columns of `w^T tile`, rows in order. A lane past the chunk's `cw` columns
/// reads nothing (the tile holds no such column; its sums are never stored).
fn accumulate(k: &mut Kernel, ctx: &Ctx, acc: &[F], w: F, buf: Rd, cw: u64) {
    let p = k.addr(buf, ctx.lane64);
    // The accumulators whose columns reach past the chunk, and whether this lane's is in it.
    let inside: Vec<Option<P>> = (0..acc.len() as u64)
        .map(|m| {
            (32 * m + 32 > cw).then(|| {
                let q = k.p();
                let n = cw.saturating_sub(32 * m);
                k.ins(format!("setp.lt.u32 {q}, {}, {n}", ctx.lane));
                q
            })
        })
        .collect();
    let (zero, end) = (k.u64c(0), k.u64c(ROWS));
    k.for_range(zero, end, 1, |k, j| {
        let jr = k.narrow(j);
        let wj = k.f();
        k.ins(format!("shfl.sync.idx.b32 {wj}, {w}, {jr}, 31, -1"));
        for (m, a) in acc.iter().enumerate() {
            let x = k.f();
            let at = format!("[{p}+{}]", 128 * m);
            match inside[m] {
                None => k.ins(format!("ld.shared.f32 {x}, {at}")),
                Some(q) => {
                    k.ins(format!("mov.f32 {x}, {}", imm(0.0)));
                    k.ins(format!("@{q} ld.shared.f32 {x}, {at}"));
                }
            }
            k.ins(format!("fma.rn.f32 {a}, {wj}, {x}, {a}"));
        }
        k.ins(format!("add.u64 {p}, {p}, {}", 4 * PITCH));
    });
}

/// The registers of chunk `(c0, cw)` among a row's accumulators.
fn regs(acc: &[F], (c0, cw): (u64, u64)) -> &[F] {
    let m0 = (c0 / 32) as usize;
    &acc[m0..m0 + cw.div_ceil(32) as usize]
}

/// `ceil(width / 32)` accumulators, zero.
fn zeros(k: &mut Kernel, width: u64) -> Vec<F> {
    (0..width.div_ceil(32)).map(|_| k.fc(0.0)).collect()
}

/// Stores this lane's columns `acc * by` of problem `pb`'s row `i` of `dst`.
fn store_row(k: &mut Kernel, ctx: &Ctx, dst: &Tensor, pb: &Problem, i: Rd, acc: &[F], by: F) {
    let width = dst.width;
    let at = dst.offset(k, pb, i);
    let at = k.op64("add", at, ctx.lane64);
    let addr = k.addr(dst.ptr, at);
    let (bf16, bytes) = (k.is_bf16(addr), k.elem_bytes(addr));
    for (m, &a) in acc.iter().enumerate() {
        let v = k.mul(a, by);
        let col = 32 * m as u64;
        let at = format!("[{addr}+{}]", bytes * col);
        if col + 32 <= width {
            k.store_elem(None, &at, v, bf16);
        } else {
            let p = k.p();
            k.ins(format!("setp.lt.u32 {p}, {}, {}", ctx.lane, width - col));
            k.store_elem(Some(&p.to_string()), &at, v, bf16);
        }
    }
}

/// This warp's row of a block's tile of `WARPS` rows starting at `first`, among `n`: the row,
/// the row clamped to `n - 1` (what the warp computes on, so every load stays inside) and
/// whether it is a real row.
fn warp_row(k: &mut Kernel, ctx: &Ctx, first: Rd, n: u64) -> (Rd, Rd, P) {
    let i = k.op64("add", first, ctx.warp64);
    let ic = k.op64("min", i, n.saturating_sub(1));
    let valid = k.cmp64("lt", i, n);
    (i, ic, valid)
}

/// The tasks of a warp-per-row kernel over `n` rows of each problem (queries or keys), a row
/// a warp: runs `body` with the task's problem, its block's first row and the warp's row
/// (`warp_row`); returns the task count (the grid).
fn each_warp_row(
    k: &mut Kernel,
    ctx: &Ctx,
    dm: &Dims,
    n: u64,
    body: impl FnOnce(&mut Kernel, Problem, Rd, (Rd, Rd, P)),
) -> u64 {
    let tiles = n.div_ceil(WARPS);
    let tasks = dm.problems * tiles;
    each_task(k, tasks, |k, task| {
        let (pb, first) = problem_and_first(k, dm, task, tiles, WARPS);
        let row = warp_row(k, ctx, first, n);
        body(k, pb, first, row);
    });
    tasks
}

/// Whether key `j` counts for query `i`: `j < S` and, causal, `j <= i` (`j <= shift + i`
/// for a cached attention).
fn visible(k: &mut Kernel, dm: &Dims, i: Rd, j: Rd, n: (Rd, u64), shift: Option<Rd>) -> P {
    let p = k.cmp64("lt", n.0, n.1);
    if dm.causal {
        let i = match shift {
            Some(s) => k.op64("add", i, s),
            None => i,
        };
        let c = k.cmp64("le", j, i);
        k.ins(format!("and.pred {p}, {p}, {c}"));
    }
    p
}

/// The first `min(ROWS, n - start)` rows from `start`: a tile's real rows.
fn tile_rows(k: &mut Kernel, start: Rd, n: u64) -> Rd {
    let left = k.u64c(n);
    let left = k.op64("sub", left, start);
    k.op64("min", left, ROWS)
}

// ---- the forward ----

/// Sample `b`'s position from the i32 `pos`, clamped to `0..=last` (the cache's last start
/// for the step's queries), so that no key past the cache is read whatever it holds.
fn position(k: &mut Kernel, pos: Rd, b: Rd, last: u64) -> Rd {
    let p = k.load_s32(pos, b);
    let nonneg = k.r();
    k.ins(format!("max.s32 {nonneg}, {p}, 0"));
    let p64 = k.wide(nonneg);
    k.op64("min", p64, last)
}

/// The forward of queries by warp: `o = softmax(scale q k^T) v` when `o` is given (with `v`),
/// `lse = m + ln l` when `lse` is; a cached attention reads its positions from `pos`.
fn forward(
    g: &mut Gen,
    name: &str,
    dm: Dims,
    (q, key, pos): (&Operand, &Operand, Option<&Operand>),
    vo: Option<(&Operand, &Operand)>,
    lse: Option<&Operand>,
) -> Launch {
    let mut k = g.kernel(name);
    let pos = pos.map(|p| k.param_ptr(p.arg));
    let (tq, tk, vo, tl) = dm.forward_views(&mut k, (q, key), vo, lse);
    let ctx = setup(&mut k);
    let tasks = each_warp_row(&mut k, &ctx, &dm, dm.t, |k, pb, i0, (i, ic, valid)| {
        let shift = pos.map(|p| position(k, p, pb.b, dm.s - dm.t));
        let qrow = tq.at(k, &pb, ic);
        let (m, l) = (k.fc(f32::NEG_INFINITY), k.fc(0.0));
        let mut o = zeros(k, dm.e);
        if vo.is_none() {
            o.clear();
        }
        // Causal: the block's last query sees keys up to itself.
        let end = keys_end(k, &dm, i0, shift);
        let zero = k.u64c(0);
        k.for_range(zero, end, ROWS, |k, j0| {
            let rows = tile_rows(k, j0, dm.s);
            let s = k.fc(0.0);
            for c in chunks(dm.d) {
                stage(k, &ctx, ctx.a, &tk, &pb, j0, rows, c);
                let row = k.op64("mul.lo", ctx.lane64, 4 * PITCH);
                let row = k.op64("add", row, ctx.a);
                let vec = k.offset_const(qrow, c.0);
                dot(k, s, vec, row, c.1);
            }
            let j = k.op64("add", j0, ctx.lane64);
            let vis = visible(k, &dm, ic, j, (j, dm.s), shift);
            let x = k.mulc(s, dm.scale);
            let ninf = k.fc(f32::NEG_INFINITY);
            let x = k.sel(x, ninf, vis);
            let mx = k.warp_reduce(x, "max");
            let m_new = k.f();
            k.ins(format!("max.f32 {m_new}, {m}, {mx}"));
            // The first tile scales nothing (m = -inf would make exp NaN).
            let first_tile = k.cmpf("eq", m, ninf);
            let dm_ = k.sub(m, m_new);
            let corr = k.exp(dm_);
            let z = k.fc(0.0);
            let corr = k.sel(z, corr, first_tile);
            // Masked keys are selected away before exp(-inf - m) (NaN in `exp`) counts.
            let xm = k.sub(x, m_new);
            let p = k.exp(xm);
            let p = k.sel(p, z, vis);
            let sum = k.warp_reduce(p, "add");
            k.ins(format!("mul.rn.f32 {l}, {l}, {corr}"));
            k.ins(format!("add.rn.f32 {l}, {l}, {sum}"));
            k.set(m, m_new);
            if let Some((tv, _)) = &vo {
                for &a in &o {
                    k.ins(format!("mul.rn.f32 {a}, {a}, {corr}"));
                }
                for c in chunks(dm.e) {
                    stage(k, &ctx, ctx.b, tv, &pb, j0, rows, c);
                    accumulate(k, &ctx, regs(&o, c), p, ctx.b, c.1);
                }
            }
        });
        let skip = k.label();
        k.bra_unless(valid, &skip);
        if let Some((_, to)) = &vo {
            let one = k.fc(1.0);
            let inv = k.div(one, l);
            store_row(k, &ctx, to, &pb, i, &o, inv);
        }
        if let Some(tl) = &tl {
            let ln = k.ln(l);
            let v = k.add(m, ln);
            let p = k.p();
            k.ins(format!("setp.eq.u32 {p}, {}, 0", ctx.lane));
            let a = tl.at(k, &pb, i);
            let bf16 = k.is_bf16(a);
            k.store_elem(Some(&p.to_string()), &format!("[{a}]"), v, bf16);
        }
        k.place(&skip);
    });
    g.launch(k, grid_for(tasks, 1), BLOCK)
}

/// Whether `op` is an `AttentionGrad` by `wrt`.
fn grad_by(op: &Op, wrt: AttentionInput) -> bool {
    matches!(op, Op::AttentionGrad { wrt: w, .. } if *w == wrt)
}

/// The launches of an attention kernel of the plan (`KernelKind::Attention` or
/// `AttentionGrads`): `steps` are its ops, `of` gives a step's stored value. The query
/// gradient of an `AttentionGrads` kernel is its own launch, before the key and value
/// gradients' one.
pub fn kernel(
    g: &mut Gen,
    name: &str,
    plan: &Plan,
    steps: &[usize],
    of: &dyn Fn(usize) -> Operand,
) -> Launches {
    let find =
        |pred: &dyn Fn(&Op) -> bool| steps.iter().copied().find(|&s| pred(&plan.steps[s].op));
    let ins =
        |s: usize| -> Vec<Operand> { plan.steps[s].operands.iter().map(|&o| of(o)).collect() };
    let att = find(&|op| matches!(op, Op::Attention { .. }));
    let lse = find(&|op| matches!(op, Op::AttentionLse { .. }));
    let dq = find(&|op| grad_by(op, AttentionInput::Query));
    let dk = find(&|op| grad_by(op, AttentionInput::Key));
    let dv = find(&|op| grad_by(op, AttentionInput::Value));
    let op0 = &plan.steps[steps[0]].op;
    // Partners must agree on what they compute over.
    let same = |a: Option<usize>, b: Option<usize>, n: usize| match (a, b) {
        (Some(a), Some(b)) => {
            let (sa, sb) = (&plan.steps[a], &plan.steps[b]);
            params(&sa.op) == params(&sb.op) && sa.operands[..n] == sb.operands[..n]
        }
        _ => true,
    };
    let grads = [dq, dk, dv].iter().flatten().count();
    let one_set = steps.len() == grads || (grads == 0 && steps.len() <= 2);
    if !same(att, lse, 2) || !same(dk, dv, 6) || !same(dq, dk.or(dv), 6) || !one_set {
        return Err(bad(
            op0,
            "the kernel's ops do not share their operands".into(),
        ));
    }
    let mut launches = Vec::new();
    if let Some(q) = dq {
        let (x, out, name) = (ins(q), of(q), format!("{name}q"));
        let a = OpArgs::new(&name, &plan.steps[q].op, &x, &out);
        launches.extend(mma_grad::query_grad(g, a)?);
        if dk.is_none() && dv.is_none() {
            return Ok(launches);
        }
    }
    // The step whose operands the kernel reads, and its outputs (`forward_checked`'s or
    // `key_value_grad`'s).
    let (s, outs) = match (att, lse, dk, dv) {
        (Some(a), l, None, None) => (a, (Some(of(a)), l.map(of))),
        (None, Some(l), None, None) => (l, (None, Some(of(l)))),
        (None, None, k, v) if k.is_some() || v.is_some() => {
            (k.or(v).expect("a gradient"), (k.map(of), v.map(of)))
        }
        _ => return Err(bad(op0, "not an attention kernel".into())),
    };
    let x = ins(s);
    let outs = (outs.0.as_ref(), outs.1.as_ref());
    let a = OpArgs::new(name, &plan.steps[s].op, &x, outs);
    launches.extend(if dk.is_some() || dv.is_some() {
        mma_grad::key_value_grad(g, a)?
    } else {
        forward_checked(g, a)?
    });
    Ok(launches)
}

/// The forward after its checks: `o` of `Attention` and/or `lse` of `AttentionLse`.
fn forward_checked(g: &mut Gen, a: OpArgs<Outs>) -> Launches {
    let OpArgs {
        name,
        op,
        ins,
        out: (o, lse),
    } = a;
    if ins.len() < 2 || (o.is_some() && ins.len() < 3) {
        return Err(bad(op, format!("got {} operands", ins.len())));
    }
    let v = o.and(ins.get(2));
    let dm = Dims::of(op, &ins[0], &ins[1], v)?;
    let (n, t, s) = (dm.problems, dm.t, dm.s);
    check(
        op,
        &[
            ("q", Some(&ins[0]), n * t * dm.d),
            ("k", Some(&ins[1]), n * s * dm.d),
            ("v", v, n * s * dm.e),
            ("o", o, n * t * dm.e),
            ("lse", lse, n * t),
        ],
    )?;
    let vo = v.zip(o);
    // A cached attention's positions: one i32 per sample (its queries shift by it).
    let pos = dm.cached.then(|| ins.get(3)).flatten();
    if dm.cached {
        let samples = n / dm.heads;
        match pos {
            Some(p) if p.dtype == DType::I32 && p.numel() == samples && o.is_some() => {}
            _ => {
                return Err(bad(
                    op,
                    format!("needs q, k, v and {samples} i32 positions, and its output"),
                ))
            }
        }
    }
    // The tensor-core kernels know no positions: a decode step's one query per sample
    // runs on the f32 kernel.
    if g.options.bf16_attention && !dm.cached && mma::fits(&dm) {
        return Ok(vec![mma::forward(g, name, dm, (&ins[0], &ins[1]), vo, lse)]);
    }
    Ok(vec![forward(g, name, dm, (&ins[0], &ins[1], pos), vo, lse)])
}

/// One attention op alone.
pub fn single(g: &mut Gen, a: OpArgs) -> Launches {
    let out = a.out;
    match a.op {
        Op::Attention { .. } | Op::CachedAttention { .. } => {
            forward_checked(g, a.with((Some(out), None)))
        }
        Op::AttentionLse { .. } => forward_checked(g, a.with((None, Some(out)))),
        Op::AttentionGrad { wrt, .. } => match wrt {
            AttentionInput::Query => mma_grad::query_grad(g, a),
            AttentionInput::Key => mma_grad::key_value_grad(g, a.with((Some(out), None))),
            AttentionInput::Value => mma_grad::key_value_grad(g, a.with((None, Some(out)))),
        },
        _ => Err(CodegenError::Unsupported { op: a.op.name() }),
    }
}

#[cfg(test)]
#[path = "tests/attention.rs"]
mod tests;
