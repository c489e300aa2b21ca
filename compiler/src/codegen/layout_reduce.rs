//! General reductions: sums (and means) over any axes, in f64 like the CPU oracle (see the
//! parent module's note on lanes and order).

use super::super::builder::Kernel;
use super::super::{grid_for, Gen, Launch, Operand, BLOCK};
use super::*;

/// Loops over every combination of the `groups` (`(size, stride)`, outermost first, in
/// row-major order), calling `body` with `off` plus the offset of each.
fn nest(k: &mut Kernel, groups: &[(u64, u64)], off: Rd, body: &mut dyn FnMut(&mut Kernel, Rd)) {
    match groups.split_first() {
        None => body(k, off),
        Some((&(n, s), rest)) => {
            let end = k.op64("add", off, n * s);
            k.for_range(off, end, s, |k, o| nest(k, rest, o, body));
        }
    }
}

fn f64_imm(v: f64) -> String {
    format!("0d{:016X}", v.to_bits())
}

/// `x` summed over the axes marked in `red` into `out` (the other axes in order), each sum
/// divided by `mean` if given: f64 sums in row-major order of the reduced axes, as the CPU.
/// `None` if `out` does not hold the kept axes.
pub(super) fn reduce(
    g: &mut Gen,
    name: &str,
    x: &Operand,
    out: &Operand,
    red: &[bool],
    mean: Option<u64>,
) -> Option<Launch> {
    // (size, stride, reduced), innermost first while building: size-1 axes dropped, runs of
    // adjacent axes of one kind merged, as the CPU's `sum_axes`.
    let mut groups: Vec<(u64, u64, bool)> = Vec::new();
    let mut stride = 1;
    for (&n, &r) in x.shape.iter().zip(red).rev() {
        if n != 1 {
            match groups.last_mut() {
                Some(g) if g.2 == r => g.0 *= n,
                _ => groups.push((n, stride, r)),
            }
        }
        stride *= n;
    }
    let kept_inner = matches!(groups.first(), Some(g) if !g.2);
    groups.reverse();
    let kept: Vec<(u64, u64)> = groups.iter().filter(|g| !g.2).map(|g| (g.0, g.1)).collect();
    let mut reduced: Vec<(u64, u64)> = groups.iter().filter(|g| g.2).map(|g| (g.0, g.1)).collect();
    let n_out = out.numel();
    if kept.iter().map(|g| g.0).product::<u64>() != n_out {
        return None;
    }
    let (last_n, last_s) = reduced.pop().unwrap_or((1, 1));
    let count = last_n * reduced.iter().map(|g| g.0).product::<u64>();
    // Outputs per block and lanes per output.
    let block = BLOCK as u64;
    let (to, tk) = if n_out >= 16_384 || count < 64 || last_n < 32 {
        (block, 1)
    } else if n_out <= 64 && !kept_inner && last_s == 1 {
        (1, block)
    } else {
        (8, 32)
    };
    let mut k = g.kernel(name);
    let (src, dst) = (k.param_ptr(x.arg), k.param_ptr(out.arg));
    let tid = k.special("%tid.x");
    let tid = k.wide(tid);
    // Consecutive threads take consecutive outputs when the innermost kept run is contiguous,
    // consecutive terms otherwise.
    let (oo, kl) = if kept_inner {
        let (q, r) = div_rem(&mut k, tid, to, true);
        (r, q)
    } else {
        div_rem(&mut k, tid, tk, true)
    };
    let shared = (tk > 1).then(|| k.shared_f32(2 * BLOCK));
    let small = n_out <= u32::MAX as u64;
    let (c, nc) = (k.special("%ctaid.x"), k.special("%nctaid.x"));
    let (c, nc) = (k.wide(c), k.wide(nc));
    let tiles = n_out.div_ceil(to);
    let end = k.u64c(tiles);
    let finish = |k: &mut Kernel, sum: Rd, o: Rd| {
        let s = match mean {
            Some(n) => {
                let d = k.rd();
                k.ins(format!("div.rn.f64 {d}, {sum}, {}", f64_imm(n as f64)));
                d
            }
            None => sum,
        };
        let f = k.f();
        k.ins(format!("cvt.rn.f32.f64 {f}, {s}"));
        k.store(dst, o, f);
    };
    k.for_range(c, end, nc, |k, tile| {
        let o = mad(k, tile, to, oo);
        let valid = k.cmp64("lt", o, n_out);
        let acc = k.rd();
        k.ins(format!("mov.b64 {acc}, {}", f64_imm(0.0)));
        let skip = k.label();
        k.bra_unless(valid, &skip);
        let base = offset(k, o, &kept, small);
        nest(k, &reduced, base, &mut |k, off| {
            let start = if tk == 1 {
                off
            } else {
                mad(k, kl, last_s, off)
            };
            let end = k.op64("add", off, last_n * last_s);
            k.for_range(start, end, tk * last_s, |k, e| {
                let v = k.load(src, e);
                let w = k.rd();
                k.ins(format!("cvt.f64.f32 {w}, {v}"));
                k.ins(format!("add.rn.f64 {acc}, {acc}, {w}"));
            });
        });
        k.place(&skip);
        let Some(s) = &shared else {
            let done = k.label();
            k.bra_unless(valid, &done);
            finish(k, acc, o);
            k.place(&done);
            return;
        };
        // Partials to shared memory as two words each; the first lane of each output adds
        // them in lane order.
        let sb = k.share_f64(s, tid, acc);
        let lead = k.cmp64("eq", kl, 0);
        k.ins(format!("and.pred {lead}, {lead}, {valid}"));
        let done = k.label();
        k.bra_unless(lead, &done);
        let (first, step) = if kept_inner {
            (oo, to)
        } else {
            (k.op64("mul.lo", oo, tk), 1)
        };
        let start = mad(k, first, 8, sb);
        let stop = k.op64("add", start, tk * step * 8);
        let sum = k.sum_shared_f64(start, stop, step * 8);
        finish(k, sum, o);
        k.place(&done);
        k.ins("bar.sync 0");
    });
    Some(g.launch(k, grid_for(tiles, 1), BLOCK))
}
