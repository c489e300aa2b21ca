//! Convolution and pooling (NCHW, square kernels) as direct kernels: one thread per output
//! element, looping over what it reduces, in a fixed order, with no atomics.
//!
//! - `conv2d`: each output sums its group's `C/groups` channels, the `K x K` taps unrolled
//!   with the tap offsets as immediates (taps in the padding load 0 under a predicate).
//! - `conv2d_grad_input`: each input element gathers, tap by tap, the outputs whose window
//!   holds it, summing over the group's output channels.
//! - `conv2d_grad_weight`: one warp per weight element, the lanes striding over the output
//!   positions of every sample, then a fixed butterfly sum across the warp.
//! - `pool2d`: each output scans its window (clipped to the input) in row-major order: the
//!   first maximum wins and a NaN wins at once (padding never wins), or the sum over `K * K`,
//!   padding counted (as the CPU kernel).
//! - `pool2d_grad`: each input element adds, in row-major order of the outputs whose window
//!   holds it, `dy / (K * K)`, or `dy` when it is its window's first maximum (recomputed).
//!
//! Coordinates that may fall in the padding are u64 values that wrap below 0; one unsigned
//! comparison `c < size` then checks both bounds.

use super::builder::{Kernel, Rd, F, P};
use super::{grid_for, CodegenError, Gen, Launches, OpArgs, BLOCK};
use crate::ir::shape_rules::window_out;
use crate::ir::{DType, Op};

/// The sizes of one convolution or pooling (pooling: `o == c`, `groups == 1`).
#[derive(Debug, Clone, Copy)]
struct Geom {
    n: u64,
    c: u64,
    h: u64,
    w: u64,
    o: u64,
    groups: u64,
    k: u64,
    s: u64,
    p: u64,
    ho: u64,
    wo: u64,
}

impl Geom {
    /// From the input's shape `[N, C, H, W]`, `O` output channels in `groups` groups, a
    /// `k x k` kernel, the stride and the padding.
    fn new(x: &[u64], o: u64, groups: u64, k: u64, s: u64, p: u64) -> Result<Geom, String> {
        let &[n, c, h, w] = x else {
            return Err(format!("the input must be [N, C, H, W], got {x:?}"));
        };
        if groups == 0 || !c.is_multiple_of(groups) || !o.is_multiple_of(groups) {
            return Err(format!(
                "{c} and {o} channels do not split into {groups} groups"
            ));
        }
        let (Some(ho), Some(wo)) = (window_out(h, k, s, p), window_out(w, k, s, p)) else {
            return Err(format!(
                "a {k}x{k} window with stride {s} and padding {p} does not fit a {h}x{w} input"
            ));
        };
        Ok(Geom {
            n,
            c,
            h,
            w,
            o,
            groups,
            k,
            s,
            p,
            ho,
            wo,
        })
    }
    /// A convolution of `x` by weights shaped `wt`.
    fn conv(x: &[u64], wt: &[u64], s: u64, p: u64, groups: u64) -> Result<Geom, String> {
        let m = match *wt {
            [o, _, k, k2] if k == k2 => Geom::new(x, o, groups, k, s, p)?,
            _ => {
                return Err(format!(
                    "the weights must be [O, C/groups, K, K], got {wt:?}"
                ))
            }
        };
        if m.cg() != wt[1] {
            return Err(format!(
                "{x:?} and {wt:?} do not make a {groups}-group convolution"
            ));
        }
        Ok(m)
    }
    /// A pooling of `x`.
    fn pool(x: &[u64], k: u64, s: u64, p: u64) -> Result<Geom, String> {
        Geom::new(x, x.get(1).copied().unwrap_or(0), 1, k, s, p)
    }
    fn y(&self) -> Vec<u64> {
        vec![self.n, self.o, self.ho, self.wo]
    }
    fn cg(&self) -> u64 {
        self.c / self.groups
    }
    fn og(&self) -> u64 {
        self.o / self.groups
    }
    fn kk(&self) -> u64 {
        self.k * self.k
    }
}

pub(super) fn generate(g: &mut Gen, OpArgs { name, op, ins, out }: OpArgs) -> Launches {
    let arity = match op {
        Op::Pool2d { .. } => 1,
        Op::Conv2d { .. }
        | Op::Conv2dGradInput { .. }
        | Op::Conv2dGradWeight { .. }
        | Op::Pool2dGrad { .. } => 2,
        _ => return Err(CodegenError::Unsupported { op: op.name() }),
    };
    let bad = |message: String| CodegenError::Bad {
        op: op.name(),
        message,
    };
    if ins.len() != arity {
        return Err(bad(format!("expects {arity} operands, got {}", ins.len())));
    }
    if ins.iter().chain([out]).any(|o| o.dtype != DType::F32) {
        return Err(bad("expects f32 operands".into()));
    }
    let expect = |what: &str, shape: &[u64], want: &[u64]| {
        (shape == want)
            .then_some(())
            .ok_or_else(|| bad(format!("{what} is {shape:?}, expected {want:?}")))
    };
    let n = out.numel();
    // The kernel's name suffix, its thread count and its body (given the pointers of `ins`
    // then `out`).
    type Body = Box<dyn FnOnce(&mut Kernel, &[Rd])>;
    let (a, b) = (&ins[0].shape, &ins[ins.len() - 1].shape);
    let (suffix, threads, body): (&str, u64, Body) = match *op {
        Op::Conv2d {
            stride,
            padding,
            groups,
        } => {
            let m = Geom::conv(a, b, stride, padding, groups).map_err(bad)?;
            expect("the output", &out.shape, &m.y())?;
            ("conv", n, Box::new(move |k, p| conv(k, &m, p)))
        }
        Op::Conv2dGradInput {
            stride,
            padding,
            groups,
            in_h,
            in_w,
        } => {
            let m = Geom::conv(&out.shape, b, stride, padding, groups).map_err(bad)?;
            expect("the output gradient", a, &m.y())?;
            expect("the input size", &[m.h, m.w], &[in_h, in_w])?;
            ("dx", n, Box::new(move |k, p| conv_dx(k, &m, p)))
        }
        Op::Conv2dGradWeight {
            stride,
            padding,
            groups,
            kernel,
        } => {
            let m = Geom::conv(a, &out.shape, stride, padding, groups).map_err(bad)?;
            expect("the output gradient", b, &m.y())?;
            expect("the kernel", &[m.k], &[kernel])?;
            // A warp per weight element.
            (
                "dw",
                n.saturating_mul(32),
                Box::new(move |k, p| conv_dw(k, &m, p)),
            )
        }
        Op::Pool2d {
            max,
            kernel,
            stride,
            padding,
        }
        | Op::Pool2dGrad {
            max,
            kernel,
            stride,
            padding,
        } => {
            let m = Geom::pool(a, kernel, stride, padding).map_err(bad)?;
            if let Op::Pool2d { .. } = op {
                expect("the output", &out.shape, &m.y())?;
                ("pool", n, Box::new(move |k, p| pool(k, &m, max, p)))
            } else {
                expect("the output gradient", b, &m.y())?;
                expect("the input gradient", &out.shape, a)?;
                ("pgrad", n, Box::new(move |k, p| pool_dx(k, &m, max, p)))
            }
        }
        _ => unreachable!("checked above"),
    };
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut k = g.kernel(&format!("{name}_{suffix}"));
    let ptrs: Vec<Rd> = ins
        .iter()
        .chain([out])
        .map(|o| k.param_ptr(o.arg))
        .collect();
    body(&mut k, &ptrs);
    Ok(vec![g.launch(k, grid_for(threads, BLOCK), BLOCK)])
}

// ---- helpers ----

/// `d = a op b` on s64 (`min`, `max`).
fn s64(k: &mut Kernel, op: &str, a: Rd, b: impl std::fmt::Display) -> Rd {
    let d = k.rd();
    k.ins(format!("{op}.s64 {d}, {a}, {b}"));
    d
}

/// `a * b + c` on u64 (wrapping, so right for negative `c` too).
fn mad(k: &mut Kernel, a: Rd, b: u64, c: impl std::fmt::Display) -> Rd {
    let d = k.rd();
    k.ins(format!("mad.lo.u64 {d}, {a}, {b}, {c}"));
    d
}

/// `a + b` for a signed constant `b`.
fn add_signed(k: &mut Kernel, a: Rd, b: i64) -> Rd {
    if b >= 0 {
        k.op64("add", a, b)
    } else {
        k.op64("sub", a, b.unsigned_abs())
    }
}

/// `r += by` in place (loop-carried pointers).
fn bump(k: &mut Kernel, r: Rd, elements: u64) {
    let by = elements * k.elem_bytes(r);
    k.ins(format!("add.u64 {r}, {r}, {by}"));
}

/// `acc += a * b` in place, rounding the product (as `mul` then `add`).
fn accumulate(k: &mut Kernel, acc: F, a: F, b: F) {
    let t = k.mul(a, b);
    k.ins(format!("add.rn.f32 {acc}, {acc}, {t}"));
}

/// `0 <= c < size` for a coordinate that wraps below 0.
fn in_range(k: &mut Kernel, c: Rd, size: u64) -> P {
    k.cmp64("lt", c, size)
}

/// The element `off` elements past `addr`, as f32; 0 where `pred` is false.
fn load_at(k: &mut Kernel, addr: Rd, off: u64, pred: Option<P>) -> F {
    let bf16 = k.is_bf16(addr);
    let at = format!("[{addr}+{}]", off * k.elem_bytes(addr));
    match pred {
        Some(p) => {
            let d = k.fc(0.0);
            k.load_elem_into(d, Some(&p.to_string()), &at, bf16);
            d
        }
        None => k.load_elem(None, &at, bf16),
    }
}

/// Runs `body` `n` times.
fn times(k: &mut Kernel, n: u64, body: impl FnOnce(&mut Kernel)) {
    let (zero, end) = (k.u64c(0), k.u64c(n));
    k.for_range(zero, end, 1, |k, _| body(k));
}

/// The coordinates of flat index `i` in a row-major array of shape `dims`.
fn coords<const N: usize>(k: &mut Kernel, i: Rd, dims: [u64; N]) -> [Rd; N] {
    let mut out = [i; N];
    let mut rest = i;
    for d in (1..N).rev() {
        out[d] = k.op64("rem", rest, dims[d]);
        rest = k.op64("div", rest, dims[d]);
    }
    out[0] = rest;
    out
}

/// The CPU's maximum rule: `v` replaces `best` if `best` is not NaN and `!(v <= best)`.
fn beats(k: &mut Kernel, v: F, best: F) -> P {
    let (num, take) = (k.p(), k.p());
    k.ins(format!("setp.num.f32 {num}, {best}, {best}"));
    k.ins(format!("setp.gtu.and.f32 {take}, {v}, {best}, {num}"));
    take
}

/// The input range `lo..hi` (both >= 0) window `o` covers along an axis of `size`.
fn window(k: &mut Kernel, o: Rd, m: &Geom, size: u64) -> (Rd, Rd) {
    let start = mad(k, o, m.s, 0);
    let start = k.op64("sub", start, m.p);
    let lo = s64(k, "max", start, 0);
    let end = k.op64("add", start, m.k);
    let hi = s64(k, "min", end, size);
    (lo, s64(k, "max", hi, lo))
}

/// The outputs `lo..hi` along an axis of `out` whose windows hold input coordinate `i`:
/// `o s - p <= i < o s - p + K`.
fn covering(k: &mut Kernel, i: Rd, m: &Geom, out: u64) -> (Rd, Rd) {
    let t = k.op64("add", i, m.p + m.s);
    let t = k.op64("max", t, m.k);
    let t = k.op64("sub", t, m.k);
    let lo = k.op64("div", t, m.s);
    let t = k.op64("add", i, m.p);
    let t = k.op64("div", t, m.s);
    let t = k.op64("add", t, 1);
    (lo, k.op64("min", t, out))
}

// ---- convolution ----

/// `y[n, o, oh, ow] = sum over (c, ki, kj) of w[o, c, ki, kj] x[n, g cg + c, oh s + ki - p,
/// ow s + kj - p]`, `g = o / og`.
fn conv(k: &mut Kernel, m: &Geom, ptrs: &[Rd]) {
    let &[xp, wp, yp] = ptrs else { unreachable!() };
    let (m, total) = (*m, m.y().iter().product());
    k.grid_stride(total, |k, i| {
        let [n, o, oh, ow] = coords(k, i, [m.n, m.o, m.ho, m.wo]);
        let grp = k.op64("div", o, m.og());
        let ih0 = mad(k, oh, m.s, 0);
        let ih0 = k.op64("sub", ih0, m.p);
        let iw0 = mad(k, ow, m.s, 0);
        let iw0 = k.op64("sub", iw0, m.p);
        // Which taps lie inside the input (all of them without padding).
        let mut taps: Vec<Option<P>> = vec![None; m.kk() as usize];
        if m.p > 0 {
            let edge = |k: &mut Kernel, c0: Rd, size: u64| -> Vec<P> {
                (0..m.k)
                    .map(|t| {
                        let c = k.op64("add", c0, t);
                        in_range(k, c, size)
                    })
                    .collect()
            };
            let rows = edge(k, ih0, m.h);
            let cols = edge(k, iw0, m.w);
            for (t, tap) in taps.iter_mut().enumerate() {
                let p = k.p();
                let (r, c) = (rows[t / m.k as usize], cols[t % m.k as usize]);
                k.ins(format!("and.pred {p}, {r}, {c}"));
                *tap = Some(p);
            }
        }
        // The address of tap (0, 0) of the group's first channel, and of its weights.
        let ch = k.op64("mul.lo", n, m.c);
        let ch = mad(k, grp, m.cg(), ch);
        let row = mad(k, ch, m.h, ih0);
        let xo = mad(k, row, m.w, iw0);
        let xa = k.addr(xp, xo);
        let wo = k.op64("mul.lo", o, m.cg() * m.kk());
        let wa = k.addr(wp, wo);
        let acc = k.fc(0.0);
        times(k, m.cg(), |k| {
            for (t, &tap) in taps.iter().enumerate() {
                let (ki, kj) = (t as u64 / m.k, t as u64 % m.k);
                let v = load_at(k, xa, ki * m.w + kj, tap);
                let wv = load_at(k, wa, t as u64, None);
                accumulate(k, acc, wv, v);
            }
            bump(k, xa, m.h * m.w);
            bump(k, wa, m.kk());
        });
        k.store(yp, i, acc);
    });
}

/// The output coordinate `(i + p - t) / s` a tap `t` of input coordinate `i` comes from, and
/// whether there is one (divisible, inside `0..out`).
fn source(k: &mut Kernel, i: Rd, t: u64, m: &Geom, out: u64) -> (Rd, P) {
    let c = add_signed(k, i, m.p as i64 - t as i64);
    if m.s == 1 {
        let v = in_range(k, c, out);
        return (c, v);
    }
    // Below 0, `c` wraps to near 2^64 and `c / s` is far past `out`.
    let q = k.op64("div", c, m.s);
    let r = k.op64("rem", c, m.s);
    let v = in_range(k, q, out);
    let d = k.p();
    k.ins(format!("setp.eq.and.u64 {d}, {r}, 0, {v}"));
    (q, d)
}

/// `dx[n, c, ih, iw] = sum over taps (ki, kj) and the group's outputs o of
/// dy[n, o, (ih + p - ki) / s, (iw + p - kj) / s] w[o, c - g cg, ki, kj]`.
fn conv_dx(k: &mut Kernel, m: &Geom, ptrs: &[Rd]) {
    let &[dyp, wp, dxp] = ptrs else {
        unreachable!()
    };
    let (m, total) = (*m, m.n * m.c * m.h * m.w);
    let plane = m.ho * m.wo;
    k.grid_stride(total, |k, i| {
        let [n, c, ih, iw] = coords(k, i, [m.n, m.c, m.h, m.w]);
        let grp = k.op64("div", c, m.cg());
        let cl = k.op64("rem", c, m.cg());
        // The plane of the group's first output channel, and its weights for channel `cl`.
        let t = k.op64("mul.lo", n, m.o);
        let t = mad(k, grp, m.og(), t);
        let dyb = k.op64("mul.lo", t, plane);
        let t = k.op64("mul.lo", cl, m.kk());
        let wb = mad(k, grp, m.og() * m.cg() * m.kk(), t);
        let rows: Vec<(Rd, P)> = (0..m.k).map(|t| source(k, ih, t, &m, m.ho)).collect();
        let cols: Vec<(Rd, P)> = (0..m.k).map(|t| source(k, iw, t, &m, m.wo)).collect();
        let acc = k.fc(0.0);
        for (ki, &(oh, rv)) in rows.iter().enumerate() {
            for (kj, &(ow, cv)) in cols.iter().enumerate() {
                let skip = k.label();
                let v = k.p();
                k.ins(format!("and.pred {v}, {rv}, {cv}"));
                k.bra_unless(v, &skip);
                let off = mad(k, oh, m.wo, ow);
                let off = k.op64("add", off, dyb);
                let da = k.addr(dyp, off);
                let wo = k.op64("add", wb, ki as u64 * m.k + kj as u64);
                let wa = k.addr(wp, wo);
                times(k, m.og(), |k| {
                    let d = load_at(k, da, 0, None);
                    let wv = load_at(k, wa, 0, None);
                    accumulate(k, acc, d, wv);
                    bump(k, da, plane);
                    bump(k, wa, m.cg() * m.kk());
                });
                k.place(&skip);
            }
        }
        k.store(dxp, i, acc);
    });
}

/// `dw[o, c, ki, kj] = sum over (n, oh, ow) of dy[n, o, oh, ow] x[n, g cg + c, oh s + ki - p,
/// ow s + kj - p]`: a warp per weight element, lane `l` taking positions `l, l + 32, ...` of
/// every sample, then a butterfly sum.
fn conv_dw(k: &mut Kernel, m: &Geom, ptrs: &[Rd]) {
    let &[xp, dyp, dwp] = ptrs else {
        unreachable!()
    };
    let (m, total) = (*m, m.o * m.cg() * m.kk());
    let plane = m.ho * m.wo;
    let (gi, gs) = k.global_index();
    // Blocks are whole warps, so a warp's lanes share `e` and all reach the shuffles.
    let warp = k.op64("shr", gi, 5);
    let warps = k.op64("shr", gs, 5);
    let lane = k.special("%laneid");
    let lane = k.wide(lane);
    let end = k.u64c(total);
    k.for_range(warp, end, warps, |k, e| {
        let [o, cl, ki, kj] = coords(k, e, [m.o, m.cg(), m.k, m.k]);
        let grp = k.op64("div", o, m.og());
        let ci = mad(k, grp, m.cg(), cl);
        let dh = k.op64("sub", ki, m.p);
        let dw_ = k.op64("sub", kj, m.p);
        let t = k.op64("mul.lo", o, plane);
        let da = k.addr(dyp, t);
        let t = k.op64("mul.lo", ci, m.h * m.w);
        let xa = k.addr(xp, t);
        let acc = k.fc(0.0);
        let positions = k.u64c(plane);
        times(k, m.n, |k| {
            k.for_range(lane, positions, 32, |k, q| {
                let [oh, ow] = coords(k, q, [m.ho, m.wo]);
                let ih = mad(k, oh, m.s, dh);
                let iw = mad(k, ow, m.s, dw_);
                let rv = in_range(k, ih, m.h);
                let v = k.p();
                k.ins(format!("setp.lt.and.u64 {v}, {iw}, {}, {rv}", m.w));
                let xo = mad(k, ih, m.w, iw);
                let a = k.addr(xa, xo);
                let xv = load_at(k, a, 0, Some(v));
                let d = k.load(da, q);
                accumulate(k, acc, d, xv);
            });
            bump(k, da, m.o * plane);
            bump(k, xa, m.c * m.h * m.w);
        });
        let sum = k.warp_reduce(acc, "add");
        let first = k.cmp64("eq", lane, 0);
        let skip = k.label();
        k.bra_unless(first, &skip);
        k.store(dwp, e, sum);
        k.place(&skip);
    });
}

// ---- pooling ----

/// Max or average pooling of each `H x W` plane.
fn pool(k: &mut Kernel, m: &Geom, max: bool, ptrs: &[Rd]) {
    let &[xp, yp] = ptrs else { unreachable!() };
    let (m, total) = (*m, m.y().iter().product());
    k.grid_stride(total, |k, i| {
        let [pl, oh, ow] = coords(k, i, [m.n * m.c, m.ho, m.wo]);
        let (r0, r1) = window(k, oh, &m, m.h);
        let (c0, c1) = window(k, ow, &m, m.w);
        let base = k.op64("mul.lo", pl, m.h * m.w);
        // Padding is -inf: a window's maximum is its inputs' maximum.
        let acc = k.fc(if max { f32::NEG_INFINITY } else { 0.0 });
        k.for_range(r0, r1, 1, |k, r| {
            let row = mad(k, r, m.w, base);
            k.for_range(c0, c1, 1, |k, c| {
                let at = k.op64("add", row, c);
                let v = k.load(xp, at);
                if max {
                    let take = beats(k, v, acc);
                    k.ins(format!("selp.f32 {acc}, {v}, {acc}, {take}"));
                } else {
                    k.ins(format!("add.rn.f32 {acc}, {acc}, {v}"));
                }
            });
        });
        let v = if max {
            acc
        } else {
            // The whole window's area, padding included.
            let area = k.fc(m.k as f32 * m.k as f32);
            k.div(acc, area)
        };
        k.store(yp, i, v);
    });
}

/// The gradient of pooling for each input element: the shares of the outputs whose window
/// holds it, added in their row-major order (max: `dy` where it is the window's first
/// maximum; average: `dy / (K * K)`).
fn pool_dx(k: &mut Kernel, m: &Geom, max: bool, ptrs: &[Rd]) {
    let &[xp, dyp, dxp] = ptrs else {
        unreachable!()
    };
    let (m, total) = (*m, m.n * m.c * m.h * m.w);
    let area = m.k as f32 * m.k as f32;
    k.grid_stride(total, |k, i| {
        let [pl, ih, iw] = coords(k, i, [m.n * m.c, m.h, m.w]);
        let (oh0, oh1) = covering(k, ih, &m, m.ho);
        let (ow0, ow1) = covering(k, iw, &m, m.wo);
        let me = mad(k, ih, m.w, iw);
        let base = k.op64("mul.lo", pl, m.h * m.w);
        let dyb = k.op64("mul.lo", pl, m.ho * m.wo);
        let acc = k.fc(0.0);
        k.for_range(oh0, oh1, 1, |k, oh| {
            let drow = mad(k, oh, m.wo, dyb);
            let rows = max.then(|| window(k, oh, &m, m.h));
            k.for_range(ow0, ow1, 1, |k, ow| {
                let at = k.op64("add", drow, ow);
                let d = k.load(dyp, at);
                let Some((r0, r1)) = rows else {
                    let a = k.fc(area);
                    let share = k.div(d, a);
                    k.ins(format!("add.rn.f32 {acc}, {acc}, {share}"));
                    return;
                };
                // The window's first maximum (the first element always starts it); `H W`
                // until one is found.
                let (c0, c1) = window(k, ow, &m, m.w);
                let best = k.fc(f32::NEG_INFINITY);
                let arg = k.u64c(m.h * m.w);
                k.for_range(r0, r1, 1, |k, r| {
                    let row = mad(k, r, m.w, 0);
                    k.for_range(c0, c1, 1, |k, c| {
                        let flat = k.op64("add", row, c);
                        let t = k.op64("add", base, flat);
                        let v = k.load(xp, t);
                        let take = beats(k, v, best);
                        k.ins(format!(
                            "setp.eq.or.u64 {take}, {arg}, {}, {take}",
                            m.h * m.w
                        ));
                        k.ins(format!("selp.f32 {best}, {v}, {best}, {take}"));
                        k.ins(format!("selp.b64 {arg}, {flat}, {arg}, {take}"));
                    });
                });
                let hit = k.cmp64("eq", arg, me);
                let sum = k.add(acc, d);
                k.ins(format!("selp.f32 {acc}, {sum}, {acc}, {hit}"));
            });
        });
        k.store(dxp, i, acc);
    });
}

#[cfg(test)]
#[path = "tests/conv.rs"]
mod tests;
