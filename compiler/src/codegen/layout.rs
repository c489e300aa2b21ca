//! Data movement and general reductions (`layout_reduce.rs`).
//!
//! Moves copy 32-bit words (the bits of f32 or i32 values), one thread per output element in a
//! grid-stride loop, with the source index computed from the output index and the shapes
//! baked in as immediates (u32 arithmetic when the output has under 2^32 elements). Sums
//! accumulate in f64 like the CPU oracle: one thread per output in the CPU's row-major order
//! (bit-identical) when there are many outputs or few terms, otherwise 32 or 256 lanes per
//! output, each summing every 32nd (256th) run element, their partials then added in lane order
//! through shared memory. `ScatterAdd` sums in index order in f32, as the CPU, with no atomics.

use super::builder::{Kernel, Rd, P, R};
use super::{grid_for, CodegenError, Gen, Launch, Launches, OpArgs, Operand, BLOCK};
use crate::ir::{DType, Op};

#[path = "layout_reduce.rs"]
mod sums;
use sums::reduce;

pub(super) fn generate(g: &mut Gen, OpArgs { name, op, ins, out }: OpArgs) -> Launches {
    let bad = |m: String| CodegenError::Bad {
        op: op.name(),
        message: m,
    };
    let want = match op {
        Op::Concat { .. } | Op::Gather | Op::ScatterAdd { .. } => 2,
        Op::CacheWrite => 3,
        _ => 1,
    };
    if ins.len() != want {
        return Err(bad(format!("expects {want} operands, got {}", ins.len())));
    }
    let x = &ins[0];
    let words = ins.iter().all(|o| o.dtype == out.dtype) && is_word(out.dtype);
    let floats = ins.iter().chain([out]).all(|o| o.dtype == DType::F32);
    let types = || bad("operands and output must share one element type, f32 or i32".into());
    let shapes = || {
        let s: Vec<&Vec<u64>> = ins.iter().map(|o| &o.shape).collect();
        bad(format!("cannot map {s:?} to {:?}", out.shape))
    };
    let launch = match op {
        // A tensor-parallel copy is the identity forward (its backward sum is the ranks').
        Op::Reshape { .. } | Op::TensorParallelCopy => {
            if !words {
                return Err(types());
            }
            if x.numel() != out.numel() {
                return Err(shapes());
            }
            // Same elements in the same order: a plain copy the copy engine does best, when
            // both are stored alike (else a kernel converts).
            let bf16 = g.arg_is_bf16(out.arg);
            if g.arg_is_bf16(x.arg) == bf16 {
                return Ok(vec![Launch::Copy {
                    src: x.arg,
                    dst: out.arg,
                    elements: out.numel(),
                    bf16,
                }]);
            }
            strided(g, name, x, out, &[(out.numel(), 1)], 0, None)
        }
        Op::Permute { perm } => {
            let r = x.shape.len();
            let mut seen = vec![false; r];
            let ok = perm.len() == r
                && perm
                    .iter()
                    .all(|&p| p < r && !std::mem::replace(&mut seen[p], true));
            if !words {
                return Err(types());
            }
            if !ok || out.shape.len() != r || (0..r).any(|i| out.shape[i] != x.shape[perm[i]]) {
                return Err(shapes());
            }
            let xs = strides(&x.shape);
            let dims: Vec<(u64, u64)> = perm.iter().map(|&p| (x.shape[p], xs[p])).collect();
            strided(g, name, x, out, &dims, 0, None)
        }
        Op::Expand { axes, mean, .. } => {
            let r = out.shape.len();
            let kept: Vec<u64> = (0..r)
                .filter(|i| !axes.contains(i))
                .map(|i| out.shape[i])
                .collect();
            if !words || (*mean && !floats) {
                return Err(types());
            }
            if axes.iter().any(|&a| a >= r) || kept != x.shape {
                return Err(shapes());
            }
            let xs = strides(&x.shape);
            let mut next = xs.iter();
            let dims: Vec<(u64, u64)> = (0..r)
                .map(|i| {
                    let s = if axes.contains(&i) {
                        0
                    } else {
                        *next.next().unwrap_or(&0)
                    };
                    (out.shape[i], s)
                })
                .collect();
            let count: u64 = axes.iter().map(|&a| out.shape[a]).product();
            let div = mean.then_some(count as f32);
            strided(g, name, x, out, &dims, 0, div)
        }
        Op::Slice { axis, start, .. } | Op::Pad { axis, start, .. } => {
            let (a, r) = (*axis, x.shape.len());
            if !words {
                return Err(types());
            }
            if a >= r
                || out.shape.len() != r
                || (0..r).any(|i| i != a && x.shape[i] != out.shape[i])
            {
                return Err(shapes());
            }
            let inner = numel(&x.shape[a + 1..]);
            let (xc, oc, at) = (x.shape[a] * inner, out.shape[a] * inner, start * inner);
            if let Op::Slice { .. } = op {
                if start + out.shape[a] > x.shape[a] {
                    return Err(shapes());
                }
                let rows = numel(&x.shape[..a]);
                strided(g, name, x, out, &[(rows, xc), (oc, 1)], at, None)
            } else {
                if start + x.shape[a] > out.shape[a] {
                    return Err(shapes());
                }
                pad(g, name, x, out, xc, oc, at)
            }
        }
        Op::Concat { axis } => {
            let (a, b, r) = (&ins[0], &ins[1], out.shape.len());
            if !words {
                return Err(types());
            }
            let fits = a.shape.len() == r
                && b.shape.len() == r
                && *axis < r
                && (0..r).all(|i| {
                    if i == *axis {
                        out.shape[i] == a.shape[i] + b.shape[i]
                    } else {
                        a.shape[i] == out.shape[i] && b.shape[i] == out.shape[i]
                    }
                });
            if !fits {
                return Err(shapes());
            }
            concat(g, name, a, b, out, *axis)
        }
        Op::Gather => {
            let (table, idx) = (&ins[0], &ins[1]);
            if table.dtype != DType::F32 || out.dtype != DType::F32 || idx.dtype != DType::I32 {
                return Err(bad("needs an f32 table and i32 indices".into()));
            }
            let mut want = idx.shape.clone();
            want.push(table.shape.get(1).copied().unwrap_or(0));
            if table.shape.len() != 2 || out.shape != want || table.shape[0] > i32::MAX as u64 {
                return Err(shapes());
            }
            gather(g, name, table, idx, out)
        }
        Op::ScatterAdd { .. } => {
            let (idx, dy) = (&ins[0], &ins[1]);
            if idx.dtype != DType::I32 || dy.dtype != DType::F32 || out.dtype != DType::F32 {
                return Err(bad("needs i32 indices and f32 values".into()));
            }
            let r = idx.shape.len();
            if out.shape.len() != 2
                || dy.shape.len() != r + 1
                || dy.shape[..r] != idx.shape[..]
                || dy.shape[r] != out.shape[1]
                || out.shape[0] > i32::MAX as u64
            {
                return Err(shapes());
            }
            scatter_add(g, name, idx, dy, out)
        }
        Op::CacheWrite => {
            let (cache, rows, pos) = (&ins[0], &ins[1], &ins[2]);
            let f32s = [cache, rows, out].iter().all(|o| o.dtype == DType::F32);
            if !f32s || pos.dtype != DType::I32 {
                return Err(bad("needs an f32 cache and rows and i32 positions".into()));
            }
            let r = cache.shape.len();
            let fits = r >= 3
                && rows.shape.len() == r
                && out.shape == cache.shape
                && cache.shape[..r - 3] == rows.shape[..r - 3]
                && cache.shape[r - 2..] == rows.shape[r - 2..]
                && rows.shape[r - 3] <= cache.shape[r - 3]
                && pos.numel() == numel(&cache.shape[..r - 3]);
            if !fits {
                return Err(shapes());
            }
            cache_write(g, name, (cache, rows, pos), out)
        }
        Op::ReduceSum { axes } | Op::ReduceMean { axes } => {
            if !floats {
                return Err(types());
            }
            let rank = x.shape.len();
            if axes.iter().any(|&a| a >= rank) {
                return Err(shapes());
            }
            let red: Vec<bool> = (0..rank).map(|i| axes.contains(&i)).collect();
            let count: u64 = (0..rank).filter(|&i| red[i]).map(|i| x.shape[i]).product();
            let mean = matches!(op, Op::ReduceMean { .. }).then_some(count);
            reduce(g, name, x, out, &red, mean).ok_or_else(shapes)?
        }
        Op::SumTo { .. } => {
            if !floats {
                return Err(types());
            }
            let (xr, or) = (x.shape.len(), out.shape.len());
            if or > xr {
                return Err(shapes());
            }
            let lead = xr - or;
            let mut red = vec![true; xr];
            for (j, &d) in out.shape.iter().enumerate() {
                if d == x.shape[lead + j] {
                    red[lead + j] = false;
                } else if d != 1 {
                    return Err(shapes());
                }
            }
            reduce(g, name, x, out, &red, None).ok_or_else(shapes)?
        }
        other => return Err(CodegenError::Unsupported { op: other.name() }),
    };
    Ok(vec![launch])
}

fn is_word(d: DType) -> bool {
    matches!(d, DType::F32 | DType::I32)
}

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

fn strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// `(size, stride)` pairs, outermost first, with size-1 axes dropped and each axis merged into
/// the next inner one when they walk the source contiguously (repeats included).
fn merge(dims: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut m: Vec<(u64, u64)> = Vec::new();
    for &(n, s) in dims.iter().rev() {
        if n == 1 {
            continue;
        }
        match m.last_mut() {
            Some(d) if s == d.0 * d.1 => d.0 *= n,
            _ => m.push((n, s)),
        }
    }
    m.reverse();
    m
}

/// `(x / n, x % n)`, in u32 arithmetic when `small` (every `x` below 2^32).
fn div_rem(k: &mut Kernel, x: Rd, n: u64, small: bool) -> (Rd, Rd) {
    let n = n.max(1);
    if n == 1 {
        let z = k.u64c(0);
        return (x, z);
    }
    if small && n <= u32::MAX as u64 {
        let a = k.narrow(x);
        let q = k.op32("div", a, n);
        let t = k.op32("mul.lo", q, n);
        let r = k.op32("sub", a, t);
        (k.wide(q), k.wide(r))
    } else {
        let q = k.op64("div", x, n);
        let t = k.op64("mul.lo", q, n);
        (q, k.op64("sub", x, t))
    }
}

/// `a * b + c` on u64.
fn mad(k: &mut Kernel, a: Rd, b: u64, c: Rd) -> Rd {
    let d = k.rd();
    k.ins(format!("mad.lo.u64 {d}, {a}, {b}, {c}"));
    d
}

/// The source offset of output element `i`: its coordinates along `dims` (merged `(size,
/// stride)`, outermost first, `i` below the product of the sizes) times the strides.
fn offset(k: &mut Kernel, i: Rd, dims: &[(u64, u64)], small: bool) -> Rd {
    let mut rest = i;
    let mut acc: Option<Rd> = None;
    for (pos, &(n, s)) in dims.iter().enumerate().rev() {
        let c = if pos == 0 {
            rest
        } else {
            let (q, r) = div_rem(k, rest, n, small);
            rest = q;
            r
        };
        if s != 0 {
            acc = Some(match acc {
                None if s == 1 => c,
                None => k.op64("mul.lo", c, s),
                Some(a) => mad(k, c, s, a),
            });
        }
    }
    acc.unwrap_or_else(|| k.u64c(0))
}

/// `v = word[base + i]` when `guard` (`@%p1`, `@!%p1` or empty) holds. A bf16 element is
/// widened to its f32 bits (exactly), so `v` holds the bits of an f32 or i32.
fn load_word(k: &mut Kernel, guard: &str, base: Rd, i: Rd, v: R) {
    let a = k.addr(base, i);
    if k.is_bf16(base) {
        let h = k.r();
        k.ins(format!("{guard} ld.global.u16 {h}, [{a}]"));
        k.ins(format!("{guard} shl.b32 {v}, {h}, 16"));
    } else {
        k.ins(format!("{guard} ld.global.b32 {v}, [{a}]"));
    }
}

/// Stores word `v` (an f32's or i32's bits) at `base + i`; into bf16 elements rounded to the
/// nearest (exact for a value loaded from bf16).
fn store_word(k: &mut Kernel, base: Rd, i: Rd, v: R) {
    if k.is_bf16(base) {
        let f = k.f();
        k.ins(format!("mov.b32 {f}, {v}"));
        k.store(base, i, f);
        return;
    }
    let a = k.addr(base, i);
    k.ins(format!("st.global.b32 [{a}], {v}"));
}

fn guard(p: P, holds: bool) -> String {
    format!("@{}{p}", if holds { "" } else { "!" })
}

/// A grid-stride kernel over the elements of `out`, with the launch it needs.
fn elementwise(
    g: &mut Gen,
    name: &str,
    ins: &[&Operand],
    out: &Operand,
    body: impl FnOnce(&mut Kernel, &[Rd], Rd, Rd, bool),
) -> Launch {
    let n = out.numel();
    let mut k = g.kernel(name);
    let srcs: Vec<Rd> = ins.iter().map(|o| k.param_ptr(o.arg)).collect();
    let dst = k.param_ptr(out.arg);
    let small = n <= u32::MAX as u64;
    k.grid_stride(n, |k, i| body(k, &srcs, dst, i, small));
    g.launch(k, grid_for(n, BLOCK), BLOCK)
}

/// `out[i] = x[base + offset(i)]` (divided by `div` if given), `dims` giving the `(size,
/// stride)` of every output axis in `x`, outermost first.
fn strided(
    g: &mut Gen,
    name: &str,
    x: &Operand,
    out: &Operand,
    dims: &[(u64, u64)],
    base: u64,
    div: Option<f32>,
) -> Launch {
    let dims = merge(dims);
    elementwise(g, name, &[x], out, |k, src, dst, i, small| {
        let off = offset(k, i, &dims, small);
        let off = if base > 0 {
            k.op64("add", off, base)
        } else {
            off
        };
        match div {
            Some(c) => {
                let v = k.load(src[0], off);
                let c = k.fc(c);
                let v = k.div(v, c);
                k.store(dst, i, v);
            }
            None => {
                let v = k.r();
                load_word(k, "", src[0], off, v);
                store_word(k, dst, i, v);
            }
        }
    })
}

/// Rows of `oc` words: zeros, with the row of `xc` words of `x` at `at`.
fn pad(g: &mut Gen, name: &str, x: &Operand, out: &Operand, xc: u64, oc: u64, at: u64) -> Launch {
    elementwise(g, name, &[x], out, |k, src, dst, i, small| {
        let (r, c) = div_rem(k, i, oc, small);
        // c - at wraps around below `at`, so one unsigned compare checks both ends.
        let t = k.op64("sub", c, at);
        let inside = k.cmp64("lt", t, xc);
        let si = mad(k, r, xc, t);
        let v = k.u32c(0);
        load_word(k, &guard(inside, true), src[0], si, v);
        store_word(k, dst, i, v);
    })
}

fn concat(g: &mut Gen, name: &str, a: &Operand, b: &Operand, out: &Operand, axis: usize) -> Launch {
    let inner = numel(&a.shape[axis + 1..]);
    let (ca, cb) = (a.shape[axis] * inner, b.shape[axis] * inner);
    elementwise(g, name, &[a, b], out, |k, src, dst, i, small| {
        let (r, c) = div_rem(k, i, ca + cb, small);
        let first = k.cmp64("lt", c, ca);
        let ai = mad(k, r, ca, c);
        let t = k.op64("sub", c, ca);
        let bi = mad(k, r, cb, t);
        let v = k.r();
        load_word(k, &guard(first, true), src[0], ai, v);
        load_word(k, &guard(first, false), src[1], bi, v);
        store_word(k, dst, i, v);
    })
}

/// Rows of `table [V, D]` at `indices`; out-of-range indices give rows of zeros.
fn gather(g: &mut Gen, name: &str, table: &Operand, idx: &Operand, out: &Operand) -> Launch {
    let (v, d) = (table.shape[0], table.shape[1]);
    elementwise(g, name, &[table, idx], out, |k, src, dst, i, small| {
        let (p, j) = div_rem(k, i, d, small);
        let row = k.load_s32(src[1], p);
        let row64 = k.rd();
        k.ins(format!("cvt.s64.s32 {row64}, {row}"));
        // Negative indices become huge as u64.
        let ok = k.cmp64("lt", row64, v);
        let si = mad(k, row64, d, j);
        let w = k.u32c(0);
        load_word(k, &guard(ok, true), src[0], si, w);
        store_word(k, dst, i, w);
    })
}

/// `out [B, S, H, D]`: the cache, with rows `pos[b]..pos[b] + T` of sample `b` replaced by
/// `rows [B, T, H, D]`. Every element is written, from the rows or from the cache, so the
/// output may be the cache's own buffer (a decode step writes it in place: each thread reads
/// and writes only its element) or another.
fn cache_write(
    g: &mut Gen,
    name: &str,
    (cache, rows, pos): (&Operand, &Operand, &Operand),
    out: &Operand,
) -> Launch {
    let r = cache.shape.len();
    let (s, t) = (cache.shape[r - 3], rows.shape[r - 3]);
    let row = cache.shape[r - 2] * cache.shape[r - 1];
    elementwise(
        g,
        name,
        &[cache, rows, pos],
        out,
        |k, src, dst, i, small| {
            let (b, rest) = div_rem(k, i, s * row, small);
            let (at, c) = div_rem(k, rest, row, small);
            let p = k.load_s32(src[2], b);
            let p64 = k.rd();
            k.ins(format!("cvt.s64.s32 {p64}, {p}"));
            // at - p wraps around below p, so one unsigned compare checks both ends.
            let tr = k.op64("sub", at, p64);
            let inside = k.cmp64("lt", tr, t);
            let bt = mad(k, b, t, tr);
            let ri = mad(k, bt, row, c);
            let v = k.r();
            load_word(k, &guard(inside, true), src[1], ri, v);
            load_word(k, &guard(inside, false), src[0], i, v);
            store_word(k, dst, i, v);
        },
    )
}

/// `out [V, D]`: for each output row `r`, the rows of `dy` whose index is `r`, added in index
/// order in f32 from 0 (the CPU's order, so bit-identical). A block owns a row and up to
/// `8 * BLOCK` columns (a few per thread); it scans the indices `BLOCK` at a time, each warp's
/// matches a ballot mask in shared memory, and every thread walks the masks in order.
fn scatter_add(g: &mut Gen, name: &str, idx: &Operand, dy: &Operand, out: &Operand) -> Launch {
    let (v, d, n) = (out.shape[0], out.shape[1], idx.numel());
    let block = BLOCK as u64;
    let per = d.div_ceil(block).clamp(1, 8);
    let groups = d.div_ceil(block * per).max(1);
    let blocks = v * groups;
    let mut k = g.kernel(name);
    let [ip, gp, op] = k.param_ptrs([idx.arg, dy.arg, out.arg]);
    let masks = k.shared_f32(BLOCK / 32);
    let sb = k.rd();
    k.ins(format!("mov.u64 {sb}, {masks}"));
    let tid32 = k.special("%tid.x");
    let tid = k.wide(tid32);
    let lane = k.r();
    k.ins(format!("and.b32 {lane}, {tid32}, 31"));
    let lane0 = k.p();
    k.ins(format!("setp.eq.u32 {lane0}, {lane}, 0"));
    let warp = k.op32("shr", tid32, 5);
    let warp = k.wide(warp);
    let wslot = mad(&mut k, warp, 4, sb);
    let (c, nc) = (k.special("%ctaid.x"), k.special("%nctaid.x"));
    let (c, nc) = (k.wide(c), k.wide(nc));
    let end = k.u64c(blocks);
    k.for_range(c, end, nc, |k, blk| {
        let (r, gi) = div_rem(k, blk, groups, blocks <= u32::MAX as u64);
        let r32 = k.narrow(r);
        let col0 = mad(k, gi, block * per, tid);
        let cols: Vec<(Rd, P, _)> = (0..per)
            .map(|a| {
                let col = k.op64("add", col0, a * block);
                (col, k.cmp64("lt", col, d), k.fc(0.0))
            })
            .collect();
        let (z, pe) = (k.u64c(0), k.u64c(n));
        k.for_range(z, pe, block, |k, p0| {
            k.ins("bar.sync 0");
            let p = k.op64("add", p0, tid);
            let inr = k.cmp64("lt", p, n);
            let iv = k.u32c(u32::MAX);
            load_word(k, &guard(inr, true), ip, p, iv);
            let m = k.cmp32s("eq", iv, r32);
            k.ins(format!("and.pred {m}, {m}, {inr}"));
            let bal = k.r();
            k.ins(format!("vote.sync.ballot.b32 {bal}, {m}, -1"));
            k.ins(format!("@{lane0} st.shared.b32 [{wslot}], {bal}"));
            k.ins("bar.sync 0");
            for w in 0..BLOCK / 32 {
                let mask = k.r();
                k.ins(format!("ld.shared.b32 {mask}, [{sb}+{}]", w * 4));
                let (top, next) = (k.label(), k.label());
                k.place(&top);
                let none = k.p();
                k.ins(format!("setp.eq.u32 {none}, {mask}, 0"));
                k.bra_if(none, &next);
                // The lowest set bit: its position, then clear it.
                let low = k.r();
                k.ins(format!("neg.s32 {low}, {mask}"));
                k.ins(format!("and.b32 {low}, {low}, {mask}"));
                k.ins(format!("xor.b32 {mask}, {mask}, {low}"));
                let bit = k.r();
                k.ins(format!("bfind.u32 {bit}, {low}"));
                let bit = k.wide(bit);
                let pw = k.op64("add", p0, w as u64 * 32);
                let pp = k.op64("add", pw, bit);
                let row = k.op64("mul.lo", pp, d);
                for &(col, ok, acc) in &cols {
                    let e = k.op64("add", row, col);
                    let bf16 = k.is_bf16(gp);
                    let a = k.addr(gp, e);
                    let x = k.load_elem(Some(&ok.to_string()), &format!("[{a}]"), bf16);
                    k.ins(format!("@{ok} add.rn.f32 {acc}, {acc}, {x}"));
                }
                k.bra(&top);
                k.place(&next);
            }
        });
        let orow = k.op64("mul.lo", r, d);
        for &(col, ok, acc) in &cols {
            let e = k.op64("add", orow, col);
            let bf16 = k.is_bf16(op);
            let a = k.addr(op, e);
            k.store_elem(Some(&ok.to_string()), &format!("[{a}]"), acc, bf16);
        }
    });
    g.launch(k, grid_for(blocks, 1), BLOCK)
}

#[cfg(test)]
#[path = "tests/layout.rs"]
mod tests;
