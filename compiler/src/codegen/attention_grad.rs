//! Attention's backward, plain f32, from the saved log-sum-exp: `P = exp(scale s - lse)`,
//! `dP = dy v^T`, `dS = P (dP - delta)`. The query gradient `scale dS k` takes a warp per
//! query and walks the keys (as the forward); the key gradient `scale dS^T q` and the value
//! gradient `P^T dy` take a warp per key and walk the queries, so neither needs atomics.

use super::{
    accumulate, bad, check, chunks, dot, each_warp_row, keys_end, regs, setup, stage, store_row,
    tile_rows, visible, zeros, Ctx, Dims, Outs, Problem, Tensor, BLOCK, PITCH, ROWS,
};
use crate::codegen::builder::{Kernel, Rd, F, P};
use crate::codegen::{grid_for, CodegenError, Gen, Launches, OpArgs, Operand};
use crate::ir::Op;

/// Checks the six operands `(q, k, v, dy, lse, delta)` and the outputs (`[.., T, H, D]` for
/// the query's, `[.., S, H, D]` and `[.., S, H, E]` for the key's and value's).
pub(super) fn dims(
    op: &Op,
    ins: &[Operand],
    outs: &[(&str, Option<&Operand>, bool)],
) -> Result<Dims, CodegenError> {
    if ins.len() != 6 {
        return Err(bad(op, format!("got {} operands", ins.len())));
    }
    let dm = Dims::of(op, &ins[0], &ins[1], Some(&ins[2]))?;
    let (n, t, s, d, e) = (dm.problems, dm.t, dm.s, dm.d, dm.e);
    let mut vals = vec![
        ("q", Some(&ins[0]), n * t * d),
        ("k", Some(&ins[1]), n * s * d),
        ("v", Some(&ins[2]), n * s * e),
        ("dy", Some(&ins[3]), n * t * e),
        ("lse", Some(&ins[4]), n * t),
        ("delta", Some(&ins[5]), n * t),
    ];
    for &(what, o, by_key) in outs {
        // The query's and key's gradients are `D` wide, the value's `E`.
        let width = if what == "dv" { e } else { d };
        vals.push((what, o, n * if by_key { s } else { t } * width));
    }
    check(op, &vals)?;
    Ok(dm)
}

/// The six inputs `(q, k, v, dy, lse, delta)`, their parameters declared in that order: q, k,
/// v and dy as tensors, then lse's and delta's pointers with the one view whose offsets serve
/// both.
pub(super) fn inputs(
    k: &mut Kernel,
    dm: &Dims,
    ins: &[Operand],
) -> ([Tensor; 4], (Tensor, Rd, Rd)) {
    let p: Vec<Rd> = ins.iter().map(|o| k.param_ptr(o.arg)).collect();
    let t = [
        dm.tensor(p[0], dm.t, dm.d),
        dm.tensor(p[1], dm.s, dm.d),
        dm.tensor(p[2], dm.s, dm.e),
        dm.tensor(p[3], dm.t, dm.e),
    ];
    (t, (dm.tensor(p[4], dm.t, 1), p[4], p[5]))
}

/// The shared address of this lane's row of the tile at `buf`.
fn lane_row(k: &mut Kernel, lane64: Rd, buf: Rd) -> Rd {
    let r = k.op64("mul.lo", lane64, 4 * PITCH);
    k.op64("add", r, buf)
}

/// `p * (dp - delta)` and `p = visible ? exp(scale s - lse) : 0` (masked keys are selected away
/// before `exp(-inf)`, NaN in `exp`, counts).
fn probs(k: &mut Kernel, dm: &Dims, s: F, lse: F, vis: P) -> F {
    let x = k.mulc(s, dm.scale);
    let x = k.sub(x, lse);
    let e = k.exp(x);
    let z = k.fc(0.0);
    k.sel(e, z, vis)
}

/// Adds `dS = p (dp - delta)` times the other side's staged rows `src` (the keys for dq, the
/// queries for dk; `rows` of them from `first`) into `acc`, chunk by chunk of width `D`. With
/// one chunk, the tile is still staged from the scores.
fn add_ds(
    k: &mut Kernel,
    ctx: &Ctx,
    dm: &Dims,
    (pr, dpv, delta): (F, F, F),
    (src, pb, first, rows): (&Tensor, &Problem, Rd, Rd),
    acc: &[F],
) {
    let t = k.sub(dpv, delta);
    let ds = k.mul(pr, t);
    let one_d_chunk = chunks(dm.d).len() == 1;
    for c in chunks(dm.d) {
        if !one_d_chunk {
            stage(k, ctx, ctx.a, src, pb, first, rows, c);
        }
        accumulate(k, ctx, regs(acc, c), ds, ctx.a, c.1);
    }
}

/// The query gradient: a warp per query row, its keys in tiles of 32.
pub(super) fn query(g: &mut Gen, OpArgs { name, op, ins, out }: OpArgs) -> Launches {
    let dm = dims(op, ins, &[("dq", Some(out), false)])?;
    let mut k = g.kernel(name);
    let ([tq, tk, tv, tdy], (tl, lp, dp)) = inputs(&mut k, &dm, ins);
    let tout = dm.tensor(k.param_ptr(out.arg), dm.t, dm.d);
    let ctx = setup(&mut k);
    let tasks = each_warp_row(&mut k, &ctx, &dm, dm.t, |k, pb, i0, (i, ic, valid)| {
        let qrow = tq.at(k, &pb, ic);
        let dyrow = tdy.at(k, &pb, ic);
        let at = tl.offset(k, &pb, ic);
        let lse = k.load(lp, at);
        let delta = k.load(dp, at);
        let acc = zeros(k, dm.d);
        let end = keys_end(k, &dm, i0, None);
        let zero = k.u64c(0);
        k.for_range(zero, end, ROWS, |k, j0| {
            let rows = tile_rows(k, j0, dm.s);
            let (s, dpv) = (k.fc(0.0), k.fc(0.0));
            for c in chunks(dm.d) {
                stage(k, &ctx, ctx.a, &tk, &pb, j0, rows, c);
                let r = lane_row(k, ctx.lane64, ctx.a);
                let vec = k.offset_const(qrow, c.0);
                dot(k, s, vec, r, c.1);
            }
            for c in chunks(dm.e) {
                stage(k, &ctx, ctx.b, &tv, &pb, j0, rows, c);
                let r = lane_row(k, ctx.lane64, ctx.b);
                let vec = k.offset_const(dyrow, c.0);
                dot(k, dpv, vec, r, c.1);
            }
            let j = k.op64("add", j0, ctx.lane64);
            let vis = visible(k, &dm, ic, j, (j, dm.s), None);
            let pr = probs(k, &dm, s, lse, vis);
            add_ds(k, &ctx, &dm, (pr, dpv, delta), (&tk, &pb, j0, rows), &acc);
        });
        let skip = k.label();
        k.bra_unless(valid, &skip);
        let scale = k.fc(dm.scale);
        store_row(k, &ctx, &tout, &pb, i, &acc, scale);
        k.place(&skip);
    });
    Ok(vec![g.launch(k, grid_for(tasks, 1), BLOCK)])
}

/// The key and value gradients (either or both): a warp per key row, its queries in tiles of
/// 32 (causal: from the tile of the block's first key, as earlier queries see none of them).
pub(super) fn key_value(g: &mut Gen, a: OpArgs<Outs>) -> Launches {
    let OpArgs {
        name,
        op,
        ins,
        out: (dk, dv),
    } = a;
    let dm = dims(op, ins, &[("dk", dk, true), ("dv", dv, true)])?;
    let mut k = g.kernel(name);
    let ([tq, tk, tv, tdy], (tl, lp, dp)) = inputs(&mut k, &dm, ins);
    let tdk = dk.map(|o| dm.tensor(k.param_ptr(o.arg), dm.s, dm.d));
    let tdv = dv.map(|o| dm.tensor(k.param_ptr(o.arg), dm.s, dm.e));
    let ctx = setup(&mut k);
    let tasks = each_warp_row(&mut k, &ctx, &dm, dm.s, |k, pb, j0, (j, jc, valid)| {
        let krow = tk.at(k, &pb, jc);
        let vrow = tv.at(k, &pb, jc);
        let dka = if tdk.is_some() {
            zeros(k, dm.d)
        } else {
            vec![]
        };
        let dva = if tdv.is_some() {
            zeros(k, dm.e)
        } else {
            vec![]
        };
        let start = if dm.causal {
            let t = k.op64("div", j0, ROWS);
            k.op64("mul.lo", t, ROWS)
        } else {
            k.u64c(0)
        };
        let end = k.u64c(dm.t);
        k.for_range(start, end, ROWS, |k, i0| {
            let rows = tile_rows(k, i0, dm.t);
            let i = k.op64("add", i0, ctx.lane64);
            let vis = visible(k, &dm, i, jc, (i, dm.t), None);
            let ic = k.op64("min", i, dm.t.saturating_sub(1));
            let at = tl.offset(k, &pb, ic);
            let lse = k.load(lp, at);
            let s = k.fc(0.0);
            for c in chunks(dm.d) {
                stage(k, &ctx, ctx.a, &tq, &pb, i0, rows, c);
                let r = lane_row(k, ctx.lane64, ctx.a);
                let vec = k.offset_const(krow, c.0);
                dot(k, s, vec, r, c.1);
            }
            let pr = probs(k, &dm, s, lse, vis);
            let dpv = k.fc(0.0);
            // One pass over dy's chunks serves both: dv's sums and dk's dP.
            for c in chunks(dm.e) {
                stage(k, &ctx, ctx.b, &tdy, &pb, i0, rows, c);
                if tdv.is_some() {
                    accumulate(k, &ctx, regs(&dva, c), pr, ctx.b, c.1);
                }
                if tdk.is_some() {
                    let r = lane_row(k, ctx.lane64, ctx.b);
                    let vec = k.offset_const(vrow, c.0);
                    dot(k, dpv, vec, r, c.1);
                }
            }
            if tdk.is_some() {
                let delta = k.load(dp, at);
                add_ds(k, &ctx, &dm, (pr, dpv, delta), (&tq, &pb, i0, rows), &dka);
            }
        });
        let skip = k.label();
        k.bra_unless(valid, &skip);
        if let Some(tdk) = &tdk {
            let scale = k.fc(dm.scale);
            store_row(k, &ctx, tdk, &pb, j, &dka, scale);
        }
        if let Some(tdv) = &tdv {
            let one = k.fc(1.0);
            store_row(k, &ctx, tdv, &pb, j, &dva, one);
        }
        k.place(&skip);
    });
    Ok(vec![g.launch(k, grid_for(tasks, 1), BLOCK)])
}
