//! Row-wise ops: softmax, layer and RMS norm over the last axis, batch norm per channel,
//! cross-entropy, and their gradients, each as one kernel.
//!
//! Rows of up to `WARP_ROW_MAX` values get one warp each (8 rows per 256-thread block), longer
//! rows a 256-thread block each; batch norm gives each channel a 1024-thread block. As in the
//! CPU oracle, sums and the per-value formulas run in f64 (kept in the 64-bit registers) and
//! exponentials in f32. Every reduction runs in a fixed order (per-thread strides, shuffle
//! trees, then the warps in order through shared memory): no float atomics, so results do not
//! depend on timing. The cross-entropy loss (a mean over rows) adds per-block sums in a last
//! block, through a buffer declared in the kernel itself.

use super::builder::{Kernel, Rd, F, P, R};
use super::{grid_for, CodegenError, Gen, Launch, Launches, OpArgs, Operand};
use crate::ir::{DType, Op};

/// Rows up to this long get one warp each; longer ones a block.
const WARP_ROW_MAX: u64 = 1024;
/// Threads per block of the row kernels.
const ROW_BLOCK: u32 = 256;
/// At most this many blocks for cross-entropy (the gradient's blocks each count the labels; the
/// loss keeps two sums per block).
const XENT_GRID_MAX: u64 = 1024;
/// The label of a position that does not count (as the CPU's `rows::IGNORE`).
const IGNORE: i32 = -100;

// ---- f64 values in the 64-bit registers ----

fn dimm(v: f64) -> String {
    format!("0d{:016X}", v.to_bits())
}
fn dc(k: &mut Kernel, v: f64) -> Rd {
    let d = k.rd();
    k.ins(format!("mov.f64 {d}, {}", dimm(v)));
    d
}
fn f64_of(k: &mut Kernel, x: F) -> Rd {
    let d = k.rd();
    k.ins(format!("cvt.f64.f32 {d}, {x}"));
    d
}
fn f32_of(k: &mut Kernel, x: Rd) -> F {
    let d = k.f();
    k.ins(format!("cvt.rn.f32.f64 {d}, {x}"));
    d
}
fn dins(op: &str) -> String {
    match op {
        "max" => "max.f64".into(),
        "add" | "sub" | "mul" | "div" => format!("{op}.rn.f64"),
        other => format!("{other}.f64"),
    }
}
/// `a op b` on f64 (`add`, `sub`, `mul`, `div`, `max`: the number when one is NaN, as Rust's).
fn dop(k: &mut Kernel, op: &str, a: Rd, b: impl std::fmt::Display) -> Rd {
    let d = k.rd();
    k.ins(format!("{} {d}, {a}, {b}", dins(op)));
    d
}
/// `acc = acc op x` in place (loop-carried values).
fn dacc(k: &mut Kernel, op: &str, acc: Rd, x: impl std::fmt::Display) {
    k.ins(format!("{} {acc}, {acc}, {x}", dins(op)));
}
fn identity(op: &str) -> f64 {
    if op == "max" {
        f64::NEG_INFINITY
    } else {
        0.0
    }
}

/// Natural logarithm in f64: `s = 2^e m` with `m` in `[sqrt(1/2), sqrt(2))`, then
/// `ln s = e ln 2 + 2 atanh((m - 1) / (m + 1))` by its series (|u| < 0.172: 11 terms).
/// 0, infinity and NaN map as `f64::ln`.
fn ln64(k: &mut Kernel, s: Rd) -> Rd {
    let ex = k.op64("shr", s, 52);
    let mb = k.rd();
    k.ins(format!("and.b64 {mb}, {s}, 4503599627370495"));
    k.ins(format!("or.b64 {mb}, {mb}, 4607182418800017408"));
    let big = k.p();
    k.ins(format!(
        "setp.gt.f64 {big}, {mb}, {}",
        dimm(std::f64::consts::SQRT_2)
    ));
    k.ins(format!("@{big} mul.rn.f64 {mb}, {mb}, {}", dimm(0.5)));
    k.ins(format!("@{big} add.u64 {ex}, {ex}, 1"));
    let e = k.op64("sub", ex, 1023);
    let ef = k.rd();
    k.ins(format!("cvt.rn.f64.s64 {ef}, {e}"));
    let num = dop(k, "sub", mb, dimm(1.0));
    let den = dop(k, "add", mb, dimm(1.0));
    let u = dop(k, "div", num, den);
    let u2 = dop(k, "mul", u, u);
    let mut p = dc(k, 1.0 / 21.0);
    for t in (0..10).rev() {
        let q = dop(k, "mul", p, u2);
        p = dop(k, "add", q, dimm(1.0 / (2 * t + 1) as f64));
    }
    let a = dop(k, "mul", ef, dimm(std::f64::consts::LN_2));
    let b = dop(k, "mul", u, p);
    let b = dop(k, "mul", b, dimm(2.0));
    let r = dop(k, "add", a, b);
    // Positive normal and finite, or the special value: ln 0 = -inf, ln inf = inf, NaN.
    let (ok, lo, zero) = (k.p(), k.p(), k.p());
    k.ins(format!("setp.lt.f64 {ok}, {s}, {}", dimm(f64::INFINITY)));
    k.ins(format!(
        "setp.ge.f64 {lo}, {s}, {}",
        dimm(f64::MIN_POSITIVE)
    ));
    k.ins(format!("and.pred {ok}, {ok}, {lo}"));
    k.ins(format!("setp.eq.f64 {zero}, {s}, {}", dimm(0.0)));
    let special = k.rd();
    k.ins(format!(
        "selp.f64 {special}, {}, {s}, {zero}",
        dimm(f64::NEG_INFINITY)
    ));
    let d = k.rd();
    k.ins(format!("selp.f64 {d}, {r}, {special}, {ok}"));
    d
}

// ---- threads, segments and reductions ----

/// A kernel's thread layout: each segment (row or channel) to a warp or to the whole block.
struct Ctx {
    block: u32,
    per_warp: bool,
    tid: R,
    lane: R,
    warp: R,
    /// Shared f64 slots for the cross-warp step (two values per warp).
    red: String,
}

fn setup(k: &mut Kernel, block: u32, per_warp: bool) -> Ctx {
    let red = format!("{}_red", k.name());
    k.ins(format!(".shared .align 8 .b64 {red}[{}]", 2 * (block / 32)));
    let tid = k.special("%tid.x");
    let lane = k.special("%laneid");
    let warp = k.op32("shr", tid, 5);
    Ctx {
        block,
        per_warp,
        tid,
        lane,
        warp,
        red,
    }
}

/// Loops over segments `0..count`: this warp's (`per_warp`) or this block's, grid-strided.
fn each_segment(k: &mut Kernel, ctx: &Ctx, count: u64, body: impl FnOnce(&mut Kernel, Rd)) {
    let per = if ctx.per_warp { ctx.block / 32 } else { 1 };
    let (c, n) = (k.special("%ctaid.x"), k.special("%nctaid.x"));
    let first = k.rd();
    k.ins(format!("mul.wide.u32 {first}, {c}, {per}"));
    let first = if ctx.per_warp {
        let w = k.wide(ctx.warp);
        k.op64("add", first, w)
    } else {
        first
    };
    let stride = k.rd();
    k.ins(format!("mul.wide.u32 {stride}, {n}, {per}"));
    let end = k.u64c(count);
    k.for_range(first, end, stride, body);
}

/// Where the values of one segment lie.
#[derive(Clone, Copy)]
enum Layout {
    /// Rows of `c` contiguous values.
    Rows { rows: u64, c: u64 },
}

impl Layout {
    fn segments(self) -> u64 {
        match self {
            Layout::Rows { rows, .. } => rows,
        }
    }
    fn len(self) -> u64 {
        match self {
            Layout::Rows { c, .. } => c,
        }
    }
}

/// Runs `body(k, index, j)` on this thread's share of segment `seg` (its values `j` below
/// `limit` for rows, every value otherwise), `index` being the value's position in memory.
fn each_elem(
    k: &mut Kernel,
    ctx: &Ctx,
    lay: Layout,
    seg: Rd,
    limit: Option<Rd>,
    body: impl FnOnce(&mut Kernel, Rd, Rd),
) {
    let start = k.wide(if ctx.per_warp { ctx.lane } else { ctx.tid });
    let step = if ctx.per_warp { 32 } else { ctx.block as u64 };
    match lay {
        Layout::Rows { c, .. } => {
            let base = k.op64("mul.lo", seg, c);
            let end = match limit {
                Some(l) => l,
                None => k.u64c(c),
            };
            k.for_range(start, end, step, |k, j| {
                let i = k.op64("add", base, j);
                body(k, i, j)
            });
        }
    }
}

/// `op` (add or max) over the 32 lanes of a warp (a fixed butterfly; every lane gets the same
/// bits, the ops being commutative).
fn warp_d(k: &mut Kernel, v: Rd, op: &str) -> Rd {
    let mut acc = v;
    for shift in [16, 8, 4, 2, 1] {
        let (lo, hi, a, b) = (k.r(), k.r(), k.r(), k.r());
        k.ins(format!("mov.b64 {{{lo}, {hi}}}, {acc}"));
        k.ins(format!("shfl.sync.bfly.b32 {a}, {lo}, {shift}, 31, -1"));
        k.ins(format!("shfl.sync.bfly.b32 {b}, {hi}, {shift}, 31, -1"));
        let o = k.rd();
        k.ins(format!("mov.b64 {o}, {{{a}, {b}}}"));
        acc = dop(k, op, acc, o);
    }
    acc
}

/// Combines warp-uniform values (at most two) across the block's warps, warp by warp in a
/// fixed tree, into every thread. Every thread of the block must come here.
fn cross_warp(k: &mut Kernel, ctx: &Ctx, vals: &[(Rd, &str)]) -> Vec<Rd> {
    let nw = (ctx.block / 32) as u64;
    let base = k.rd();
    k.ins(format!("mov.u64 {base}, {}", ctx.red));
    let (lane, warp) = (k.wide(ctx.lane), k.wide(ctx.warp));
    let first = k.p();
    k.ins(format!("setp.eq.u32 {first}, {}, 0", ctx.lane));
    let slot = |k: &mut Kernel, at: Rd, i: usize| {
        let s = k.op64("add", at, i as u64 * nw);
        let a = k.rd();
        k.ins(format!("mad.lo.u64 {a}, {s}, 8, {base}"));
        a
    };
    for (i, &(v, _)) in vals.iter().enumerate() {
        let a = slot(k, warp, i);
        k.ins(format!("@{first} st.shared.f64 [{a}], {v}"));
    }
    k.ins("bar.sync 0");
    let has = k.p();
    k.ins(format!("setp.lt.u32 {has}, {}, {nw}", ctx.lane));
    let mut out = Vec::new();
    for (i, &(_, op)) in vals.iter().enumerate() {
        let x = dc(k, identity(op));
        let a = slot(k, lane, i);
        k.ins(format!("@{has} ld.shared.f64 {x}, [{a}]"));
        out.push(warp_d(k, x, op));
    }
    k.ins("bar.sync 0");
    out
}

/// Reduces each value over its segment's threads: the warp, then the block unless `per_warp`
/// (or over the whole block when `whole_block`).
fn reduce(k: &mut Kernel, ctx: &Ctx, vals: &[(Rd, &str)], whole_block: bool) -> Vec<Rd> {
    let w: Vec<(Rd, &str)> = vals.iter().map(|&(v, op)| (warp_d(k, v, op), op)).collect();
    if whole_block || !ctx.per_warp {
        cross_warp(k, ctx, &w)
    } else {
        w.into_iter().map(|(v, _)| v).collect()
    }
}

/// A row layout and its thread layout: a warp per row up to `WARP_ROW_MAX` values.
fn row_layout(k: &mut Kernel, shape: &[u64]) -> (Layout, Ctx, u32) {
    let c = *shape.last().unwrap_or(&1);
    let rows = shape.iter().product::<u64>().checked_div(c).unwrap_or(0);
    let per_warp = c <= WARP_ROW_MAX;
    let ctx = setup(k, ROW_BLOCK, per_warp);
    let grid = grid_for(rows, if per_warp { ROW_BLOCK / 32 } else { 1 });
    (Layout::Rows { rows, c }, ctx, grid)
}

// ---- the ops ----

fn bad(op: &Op, message: String) -> CodegenError {
    CodegenError::Bad {
        op: op.name(),
        message,
    }
}

/// Checks operand counts, types and shapes.
fn check(op: &Op, ins: &[Operand], out: &Operand) -> Result<(), CodegenError> {
    let arity = op.def().arity;
    if !arity.accepts(ins.len()) {
        return Err(bad(op, format!("got {} operands", ins.len())));
    }
    let x = &ins[0];
    let r = x.shape.len();
    let xent = matches!(op, Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. });
    if r < 1 {
        return Err(bad(op, format!("operand of shape {:?}", x.shape)));
    }
    if ins.iter().chain([out]).any(|o| o.dtype != DType::F32) && !xent {
        return Err(bad(op, "expects f32 values".into()));
    }
    if let Op::Softmax { causal: true } = op {
        if r < 2 || x.shape[r - 2] != x.shape[r - 1] {
            return Err(bad(op, format!("needs [.., S, S], got {:?}", x.shape)));
        }
    }
    if xent {
        let (l, d) = (&ins[1], ins.get(2));
        let f32s = [x, out].into_iter().chain(d).all(|o| o.dtype == DType::F32);
        if l.dtype != DType::I32 || !f32s {
            return Err(bad(op, "expects f32 logits and i32 labels".into()));
        }
        if l.shape[..] != x.shape[..r - 1] || d.is_some_and(|d| d.numel() != 1) {
            return Err(bad(op, format!("labels {:?} for {:?}", l.shape, x.shape)));
        }
        let want = if d.is_some() { x.numel() } else { 1 };
        if out.numel() != want {
            return Err(bad(op, format!("output of shape {:?}", out.shape)));
        }
    } else if ins.iter().chain([out]).any(|o| o.shape != x.shape) {
        return Err(bad(op, "operands and output must share one shape".into()));
    }
    Ok(())
}

pub(super) fn generate(g: &mut Gen, OpArgs { name, op, ins, out }: OpArgs) -> Launches {
    let launch = match op {
        Op::Softmax { causal } => {
            check(op, ins, out)?;
            softmax(g, name, &ins[0], out, *causal)
        }
        Op::SoftmaxGrad => {
            check(op, ins, out)?;
            softmax_grad(g, name, ins, out)
        }
        Op::LayerNorm { eps }
        | Op::LayerNormGrad { eps }
        | Op::RmsNorm { eps }
        | Op::RmsNormGrad { eps } => {
            check(op, ins, out)?;
            let rms = matches!(op, Op::RmsNorm { .. } | Op::RmsNormGrad { .. });
            norm::norm(g, name, ins, out, *eps as f32 as f64, rms)?
        }
        Op::CrossEntropy { smoothing } => {
            check(op, ins, out)?;
            xent::xent(g, name, ins, out, *smoothing as f32 as f64)
        }
        Op::CrossEntropyGrad { smoothing } => {
            check(op, ins, out)?;
            xent::xent_grad(g, name, ins, out, *smoothing as f32 as f64)
        }
        other => return Err(CodegenError::Unsupported { op: other.name() }),
    };
    Ok(vec![launch])
}

/// Softmax over the last axis; `causal`: row `i` keeps its first `i % S + 1` values (the query
/// `i % S` of `[.., S, S]` sees keys up to itself) and zeroes the rest.
fn softmax(g: &mut Gen, name: &str, x: &Operand, out: &Operand, causal: bool) -> Launch {
    let mut k = g.kernel(name);
    let (xp, op) = (k.param_ptr(x.arg), k.param_ptr(out.arg));
    let (lay, ctx, grid) = row_layout(&mut k, &x.shape);
    let c = lay.len();
    each_segment(&mut k, &ctx, lay.segments(), |k, row| {
        let n = causal.then(|| {
            let q = k.op64("rem", row, c);
            k.op64("add", q, 1)
        });
        let (m, s, _) = max_sum_exp(k, &ctx, lay, row, xp, n, false);
        let inv = k.rd();
        k.ins(format!("rcp.rn.f64 {inv}, {s}"));
        each_elem(k, &ctx, lay, row, None, |k, i, j| {
            let o = k.fc(0.0);
            let masked = k.label();
            if let Some(n) = n {
                let p = k.cmp64("ge", j, n);
                k.bra_if(p, &masked);
            }
            let e = exp_at(k, xp, i, m);
            let v = dop(k, "mul", e, inv);
            let v = f32_of(k, v);
            k.set(o, v);
            k.place(&masked);
            k.store(op, i, o);
        });
    });
    g.launch(k, grid, ctx.block)
}

/// `y * (dy - sum(dy * y))` over the last axis.
fn softmax_grad(g: &mut Gen, name: &str, ins: &[Operand], out: &Operand) -> Launch {
    let mut k = g.kernel(name);
    let [yp, gp, op] = k.param_ptrs([ins[0].arg, ins[1].arg, out.arg]);
    let (lay, ctx, grid) = row_layout(&mut k, &ins[0].shape);
    let load2 = move |k: &mut Kernel, i: Rd| {
        let (y, g) = (k.load(yp, i), k.load(gp, i));
        (f64_of(k, y), f64_of(k, g))
    };
    each_segment(&mut k, &ctx, lay.segments(), |k, row| {
        let s = dc(k, 0.0);
        each_elem(k, &ctx, lay, row, None, |k, i, _| {
            let (y, g) = load2(k, i);
            let t = dop(k, "mul", y, g);
            dacc(k, "add", s, t);
        });
        let s = reduce(k, &ctx, &[(s, "add")], false)[0];
        each_elem(k, &ctx, lay, row, None, |k, i, _| {
            let (y, g) = load2(k, i);
            let t = dop(k, "sub", g, s);
            let t = dop(k, "mul", y, t);
            let t = f32_of(k, t);
            k.store(op, i, t);
        });
    });
    g.launch(k, grid, ctx.block)
}

/// `f64(e^(x[i] - m))`, the exponential in f32 as the CPU's.
fn exp_at(k: &mut Kernel, xp: Rd, i: Rd, m: F) -> Rd {
    let x = k.load(xp, i);
    let d = k.sub(x, m);
    let e = k.exp(d);
    f64_of(k, e)
}

/// A row's max (f32, NaN skipped as Rust's `f32::max`) and `sum(e^(x - max))` in f64 over its
/// first `limit` values (all without), and with `with_sum` the plain sum of the values.
fn max_sum_exp(
    k: &mut Kernel,
    ctx: &Ctx,
    lay: Layout,
    row: Rd,
    xp: Rd,
    limit: Option<Rd>,
    with_sum: bool,
) -> (F, Rd, Rd) {
    let mx = k.fc(f32::NEG_INFINITY);
    let sx = dc(k, 0.0);
    each_elem(k, ctx, lay, row, limit, |k, i, _| {
        let x = k.load(xp, i);
        k.ins(format!("max.f32 {mx}, {mx}, {x}"));
        if with_sum {
            let xd = f64_of(k, x);
            dacc(k, "add", sx, xd);
        }
    });
    let mx = f64_of(k, mx);
    let mut vals = vec![(mx, "max")];
    if with_sum {
        vals.push((sx, "add"));
    }
    let r = reduce(k, ctx, &vals, false);
    let m = f32_of(k, r[0]);
    let sum = dc(k, 0.0);
    each_elem(k, ctx, lay, row, limit, |k, i, _| {
        let e = exp_at(k, xp, i, m);
        dacc(k, "add", sum, e);
    });
    let sum = reduce(k, ctx, &[(sum, "add")], false)[0];
    (m, sum, *r.get(1).unwrap_or(&sx))
}

#[path = "norm.rs"]
pub(super) mod norm;
#[path = "xent.rs"]
mod xent;

#[cfg(test)]
#[path = "tests/rows.rs"]
mod tests;
