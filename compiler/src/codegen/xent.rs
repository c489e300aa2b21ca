//! Cross-entropy and its gradient, row by row (a part of `rows`: it shares its helpers).

use super::*;

/// `(l, l as s64, valid)`: the row's label and whether it is in `[0, c)`.
fn label(k: &mut Kernel, lp: Rd, row: Rd, c: u64) -> (R, Rd, P) {
    let l = k.load_s32(lp, row);
    let lw = k.rd();
    k.ins(format!("cvt.s64.s32 {lw}, {l}"));
    let (v, hi) = (k.p(), k.p());
    k.ins(format!("setp.ge.s64 {v}, {lw}, 0"));
    k.ins(format!("setp.lt.s64 {hi}, {lw}, {c}"));
    k.ins(format!("and.pred {v}, {v}, {hi}"));
    (l, lw, v)
}

/// The mean over rows whose label is not -100 of `-log softmax(x)[label]`, with label
/// smoothing `s`: `(1 - s) nll + s (lse - mean(x))` (0 when every label is ignored; NaN for a
/// label outside `[0, C)`, which the CPU refuses). Rows go to warps (or blocks) as for the
/// other row ops, each keeping its running sums; each block publishes its sums to a static
/// buffer of the kernel (`.global` in its body), and the last block to finish (an integer
/// atomic count, reset after) adds the blocks' sums in block order.
pub(super) fn xent(g: &mut Gen, name: &str, ins: &[Operand], out: &Operand, s: f64) -> Launch {
    let mut k = g.kernel(name);
    let [xp, lp, op] = k.param_ptrs([ins[0].arg, ins[1].arg, out.arg]);
    let (lay, ctx, grid) = row_layout(&mut k, &ins[0].shape);
    let grid = grid.min(XENT_GRID_MAX as u32);
    let (part, done, last) = (
        format!("{name}_part"),
        format!("{name}_done"),
        format!("{name}_last"),
    );
    k.ins(format!(".global .align 8 .b64 {part}[{}]", 2 * grid));
    k.ins(format!(".global .align 4 .u32 {done}"));
    k.ins(format!(".shared .align 4 .u32 {last}"));
    let c = lay.len();
    let (total, count) = (dc(&mut k, 0.0), dc(&mut k, 0.0));
    each_segment(&mut k, &ctx, lay.segments(), |k, row| {
        let next = k.label();
        let (l, lw, valid) = label(k, lp, row, c);
        let ignored = k.cmp32s("eq", l, IGNORE);
        k.bra_if(ignored, &next);
        let (m, sum, sx) = max_sum_exp(k, &ctx, lay, row, xp, None, s != 0.0);
        let md = f64_of(k, m);
        let ln = ln64(k, sum);
        let lse = dop(k, "add", md, ln);
        let at = k.rd();
        k.ins(format!("selp.b64 {at}, {lw}, 0, {valid}"));
        let base = k.op64("mul.lo", row, c);
        let at = k.op64("add", base, at);
        let xl = k.load(xp, at);
        let xl = f64_of(k, xl);
        let mut loss = dop(k, "sub", lse, xl);
        if s != 0.0 {
            let a = dop(k, "mul", loss, dimm(1.0 - s));
            let mean = dop(k, "div", sx, dimm(c as f64));
            let b = dop(k, "sub", lse, mean);
            let b = dop(k, "mul", b, dimm(s));
            loss = dop(k, "add", a, b);
        }
        k.ins(format!(
            "selp.f64 {loss}, {loss}, {}, {valid}",
            dimm(f64::NAN)
        ));
        dacc(k, "add", total, loss);
        dacc(k, "add", count, dimm(1.0));
        k.place(&next);
    });
    // The block's sums (already block-wide when a block takes a row).
    let sums = if ctx.per_warp {
        cross_warp(&mut k, &ctx, &[(total, "add"), (count, "add")])
    } else {
        vec![total, count]
    };
    let first = k.p();
    k.ins(format!("setp.eq.u32 {first}, {}, 0", ctx.tid));
    let pb = k.rd();
    k.ins(format!("mov.u64 {pb}, {part}"));
    let (skip, end) = (k.label(), k.label());
    k.bra_unless(first, &skip);
    let b = k.special("%ctaid.x");
    let b = k.wide(b);
    for (j, v) in sums.into_iter().enumerate() {
        let i = k.op64("add", b, j as u64 * grid as u64);
        k.ins(format!("mad.lo.u64 {i}, {i}, 8, {pb}"));
        k.ins(format!("st.global.f64 [{i}], {v}"));
    }
    let (old, flag) = (k.r(), k.r());
    k.ins("membar.gl");
    k.ins(format!("atom.global.add.u32 {old}, [{done}], 1"));
    let is_last = k.p();
    k.ins(format!("setp.eq.u32 {is_last}, {old}, {}", grid - 1));
    k.ins(format!("selp.u32 {flag}, 1, 0, {is_last}"));
    k.ins(format!("st.shared.u32 [{last}], {flag}"));
    k.place(&skip);
    k.ins("bar.sync 0");
    k.ins(format!("ld.shared.u32 {flag}, [{last}]"));
    let not_last = k.p();
    k.ins(format!("setp.eq.u32 {not_last}, {flag}, 0"));
    k.bra_if(not_last, &end);
    // The last block: every block's sums, in block order.
    k.ins("membar.gl");
    let (t, n) = (dc(&mut k, 0.0), dc(&mut k, 0.0));
    let start = k.wide(ctx.tid);
    let stop = k.u64c(grid as u64);
    k.for_range(start, stop, ctx.block, |k, i| {
        for (j, acc) in [t, n].into_iter().enumerate() {
            let at = k.op64("add", i, j as u64 * grid as u64);
            k.ins(format!("mad.lo.u64 {at}, {at}, 8, {pb}"));
            let v = k.rd();
            k.ins(format!("ld.relaxed.gpu.global.f64 {v}, [{at}]"));
            dacc(k, "add", acc, v);
        }
    });
    let r = reduce(&mut k, &ctx, &[(t, "add"), (n, "add")], true);
    let n = dop(&mut k, "max", r[1], dimm(1.0));
    let mean = dop(&mut k, "div", r[0], n);
    let mean = f32_of(&mut k, mean);
    k.bra_unless(first, &end);
    let zero = k.u64c(0);
    k.store(op, zero, mean);
    k.ins(format!("st.global.u32 [{done}], 0"));
    k.place(&end);
    g.launch(k, grid, ctx.block)
}

/// `(logits, labels, dloss)`: `dloss / count (softmax - target)` per counted row, the target
/// `1 - s + s / C` at the label and `s / C` elsewhere; 0 for rows labelled -100. Each block
/// first counts the labels that are not -100 (there is no buffer to share the count in).
pub(super) fn xent_grad(g: &mut Gen, name: &str, ins: &[Operand], out: &Operand, s: f64) -> Launch {
    let mut k = g.kernel(name);
    let [xp, lp, dp, op] = k.param_ptrs([ins[0].arg, ins[1].arg, ins[2].arg, out.arg]);
    let (lay, ctx, grid) = row_layout(&mut k, &ins[0].shape);
    let grid = grid.min(XENT_GRID_MAX as u32);
    let (rows, c) = (lay.segments(), lay.len());
    // The count, in the same order in every block.
    let n = k.u32c(0);
    let start = k.wide(ctx.tid);
    let end = k.u64c(rows);
    k.for_range(start, end, ctx.block, |k, i| {
        let l = k.load_s32(lp, i);
        let counted = k.p();
        k.ins(format!("setp.ne.s32 {counted}, {l}, {IGNORE}"));
        k.ins(format!("@{counted} add.u32 {n}, {n}, 1"));
    });
    let nd = k.rd();
    k.ins(format!("cvt.rn.f64.u32 {nd}, {n}"));
    let total = reduce(&mut k, &ctx, &[(nd, "add")], true)[0];
    let total = dop(&mut k, "max", total, dimm(1.0));
    let zero = k.u64c(0);
    let d = k.load(dp, zero);
    let d = f64_of(&mut k, d);
    let scale = dop(&mut k, "div", d, total);
    let off = s / c as f64;
    each_segment(&mut k, &ctx, rows, |k, row| {
        let (next, counted) = (k.label(), k.label());
        let (l, lw, valid) = label(k, lp, row, c);
        let ignored = k.cmp32s("eq", l, IGNORE);
        k.bra_unless(ignored, &counted);
        let z = k.fc(0.0);
        each_elem(k, &ctx, lay, row, None, |k, i, _| k.store(op, i, z));
        k.bra(&next);
        k.place(&counted);
        let (m, sum, _) = max_sum_exp(k, &ctx, lay, row, xp, None, false);
        let inv = k.rd();
        k.ins(format!("rcp.rn.f64 {inv}, {sum}"));
        let gr = k.rd();
        k.ins(format!(
            "selp.f64 {gr}, {scale}, {}, {valid}",
            dimm(f64::NAN)
        ));
        each_elem(k, &ctx, lay, row, None, |k, i, j| {
            let e = exp_at(k, xp, i, m);
            let prob = dop(k, "mul", e, inv);
            let hit = k.cmp64("eq", j, lw);
            let t = k.rd();
            k.ins(format!(
                "selp.f64 {t}, {}, {}, {hit}",
                dimm(1.0 - s + off),
                dimm(off)
            ));
            let v = dop(k, "sub", prob, t);
            let v = dop(k, "mul", gr, v);
            let v = f32_of(k, v);
            k.store(op, i, v);
        });
        k.place(&next);
    });
    g.launch(k, grid, ctx.block)
}
