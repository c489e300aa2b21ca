//! Layer and RMS norm and their gradients, row by row (a part of `rows`: it shares its
//! helpers). Two fused forms: the norm of an elementwise chain (the residual add before a
//! pre-LN block's norm), whose first pass evaluates the chain where it would load `x` and
//! stores its value for the passes after, so the sum is written once and normalized in the
//! same launch; and a norm's gradient whose store adds another value (the residual stream's
//! gradient) instead of storing the gradient.

use super::super::elementwise::{binary, Chain};
use super::*;
use crate::plan::Plan;

/// Where a norm kernel reads and writes.
struct Io<'c> {
    /// `x`, read by every pass; with `chain`, by the passes after the first, which stores it.
    xp: Rd,
    /// An elementwise chain evaluated by the first pass instead of loading `x`.
    chain: Option<&'c Chain<'c>>,
    /// `dy`, for a gradient.
    gp: Option<Rd>,
    op: Rd,
    /// `(other, gradient first)`: stores `gradient + other` (in the add's operand order).
    epilogue: Option<(Rd, bool)>,
}

/// Layer norm or RMS norm, or its gradient given `ins[1]`.
pub(super) fn norm(
    g: &mut Gen,
    name: &str,
    ins: &[Operand],
    out: &Operand,
    eps: f64,
    rms: bool,
) -> Result<Launch, CodegenError> {
    let mut k = g.kernel(name);
    let xp = k.param_ptr(ins[0].arg);
    let gp = ins.get(1).map(|d| k.param_ptr(d.arg));
    let op = k.param_ptr(out.arg);
    let io = Io {
        xp,
        chain: None,
        gp,
        op,
        epilogue: None,
    };
    let block = body(&mut k, &io, &ins[0].shape, eps, rms)?;
    Ok(g.launch(k, block.0, block.1))
}

/// The launch of a plan's kernel of `steps`: elementwise ops then a layer or RMS norm
/// (`norm_of_chain`), or a norm's gradient then an add (`norm_grad_add`); with the scratch
/// elements it stages (0 when none).
pub(in crate::codegen) fn fused(
    g: &mut Gen,
    name: &str,
    plan: &Plan,
    shapes: &[Vec<u64>],
    steps: &[usize],
    of: &dyn Fn(usize) -> Operand,
) -> Result<(Launch, u64), CodegenError> {
    let bad_kernel = || CodegenError::Bad {
        op: "norm",
        message: "a fused norm kernel needs a chain and a norm, or a gradient and an add".into(),
    };
    let (&last, rest) = steps.split_last().ok_or_else(bad_kernel)?;
    match (&plan.steps[last].op, rest) {
        (Op::Add, &[ng]) => {
            let ops = &plan.steps[last].operands;
            let other = ops
                .iter()
                .copied()
                .find(|&o| o != ng)
                .ok_or_else(bad_kernel)?;
            let ins: Vec<Operand> = plan.steps[ng].operands.iter().map(|&o| of(o)).collect();
            let grad_first = ops.first() == Some(&ng);
            let op = &plan.steps[ng].op;
            let l = norm_grad_add(g, name, op, &ins, &of(other), grad_first, &of(last))?;
            Ok((l, 0))
        }
        (op @ (Op::LayerNorm { .. } | Op::RmsNorm { .. }), [.., staged]) => {
            let l = norm_of_chain(g, name, plan, shapes, rest, op, &of(last))?;
            let scratch = match plan.steps[*staged].buffer {
                None => shapes[*staged].iter().product(),
                Some(_) => 0,
            };
            Ok((l, scratch))
        }
        _ => Err(bad_kernel()),
    }
}

/// `op` (a layer or RMS norm) of the elementwise `chain`'s last value, in one launch: the
/// chain's stored values are written as its own kernel would, and its last value, if not
/// stored, goes to the scratch for the norm's later passes.
#[allow(clippy::too_many_arguments)]
fn norm_of_chain(
    g: &mut Gen,
    name: &str,
    plan: &Plan,
    shapes: &[Vec<u64>],
    chain: &[usize],
    op: &Op,
    out: &Operand,
) -> Result<Launch, CodegenError> {
    let (eps, rms) = match op {
        Op::LayerNorm { eps } => (*eps, false),
        Op::RmsNorm { eps } => (*eps, true),
        other => return Err(CodegenError::Unsupported { op: other.name() }),
    };
    let last = *chain
        .last()
        .ok_or(bad(op, "no chain before the norm".into()))?;
    let shape = &shapes[last];
    if shape.is_empty() || out.shape != *shape || out.dtype != DType::F32 {
        return Err(bad(
            op,
            format!("a chain of shape {shape:?} into {:?}", out.shape),
        ));
    }
    let mut k = g.kernel(name);
    let stage = plan.steps[last].buffer.is_none().then_some(last);
    let c = Chain::declare(&mut k, plan, shapes, chain, None, stage)?;
    let xp = c
        .last_store()
        .ok_or(bad(op, "the chain's value is stored nowhere".into()))?;
    let op = k.param_ptr(out.arg);
    let io = Io {
        xp,
        chain: Some(&c),
        gp: None,
        op,
        epilogue: None,
    };
    let block = body(&mut k, &io, shape, eps as f32 as f64, rms)?;
    Ok(g.launch(k, block.0, block.1))
}

/// A norm's gradient (`ins`: `x`, `dy`) plus `other`, stored into `out` (the add's value):
/// `gradient + other` when `grad_first`, else `other + gradient`.
#[allow(clippy::too_many_arguments)]
fn norm_grad_add(
    g: &mut Gen,
    name: &str,
    op: &Op,
    ins: &[Operand],
    other: &Operand,
    grad_first: bool,
    out: &Operand,
) -> Result<Launch, CodegenError> {
    let (eps, rms) = match op {
        Op::LayerNormGrad { eps } => (*eps, false),
        Op::RmsNormGrad { eps } => (*eps, true),
        other => return Err(CodegenError::Unsupported { op: other.name() }),
    };
    check(op, ins, out)?;
    if other.shape != out.shape || other.dtype != DType::F32 {
        return Err(bad(
            op,
            format!("adds {:?} to {:?}", other.shape, out.shape),
        ));
    }
    let mut k = g.kernel(name);
    let xp = k.param_ptr(ins[0].arg);
    let gp = Some(k.param_ptr(ins[1].arg));
    let other = k.param_ptr(other.arg);
    let op = k.param_ptr(out.arg);
    let io = Io {
        xp,
        chain: None,
        gp,
        op,
        epilogue: Some((other, grad_first)),
    };
    let block = body(&mut k, &io, &ins[0].shape, eps as f32 as f64, rms)?;
    Ok(g.launch(k, block.0, block.1))
}

/// The kernel's body, as the CPU: mean and biased variance in two passes,
/// `rstd = 1 / sqrt(var + eps)`, then `(x - m) rstd` or `rstd (dy - mean(dy) - xhat
/// mean(dy xhat))`; RMS: `r = 1 / sqrt(mean(x^2) + eps)`, then `x r` or `r dy - x r^3
/// mean(x dy)`. Returns the launch's (grid, block).
fn body(
    k: &mut Kernel,
    io: &Io,
    shape: &[u64],
    eps: f64,
    rms: bool,
) -> Result<(u32, u32), CodegenError> {
    let (lay, ctx, grid) = row_layout(k, shape);
    let len = dimm(lay.len() as f64);
    let (xp, gp) = (io.xp, io.gp);
    // The value (and gradient) at `i` in f64.
    let load = move |k: &mut Kernel, i: Rd| {
        let x = k.load(xp, i);
        let x = f64_of(k, x);
        let d = gp.map(|gp| {
            let d = k.load(gp, i);
            f64_of(k, d)
        });
        (x, d)
    };
    let mut result = Ok(());
    // The first pass's: the chain's value where there is one (which stores it at `xp`).
    let mut load_first = |k: &mut Kernel, i: Rd| match io.chain {
        None => load(k, i),
        Some(c) => {
            let x = c.eval(k, i).unwrap_or_else(|e| {
                result = Err(e);
                k.fc(0.0)
            });
            (f64_of(k, x), None)
        }
    };
    // The result at `i`, in f64, stored (with the epilogue's add).
    let mut epilogue_result = Ok(());
    let mut store = |k: &mut Kernel, i: Rd, o: Rd| {
        let o = f32_of(k, o);
        let v = match io.epilogue {
            None => o,
            Some((other, grad_first)) => {
                let b = k.load(other, i);
                let (x, y) = if grad_first { (o, b) } else { (b, o) };
                binary(k, &Op::Add, x, y).unwrap_or_else(|e| {
                    epilogue_result = Err(e);
                    o
                })
            }
        };
        k.store(io.op, i, v);
    };
    each_segment(k, &ctx, lay.segments(), |k, seg| {
        let scale = |k: &mut Kernel, sum: Rd| {
            let v = dop(k, "div", sum, &len);
            let v = dop(k, "add", v, dimm(eps));
            let d = k.rd();
            k.ins(format!("sqrt.rn.f64 {d}, {v}"));
            let one = dc(k, 1.0);
            dop(k, "div", one, d)
        };
        if rms {
            let (ss, sxg) = (dc(k, 0.0), dc(k, 0.0));
            each_elem(k, &ctx, lay, seg, None, |k, i, _| {
                let (x, d) = load_first(k, i);
                let t = dop(k, "mul", x, x);
                dacc(k, "add", ss, t);
                if let Some(d) = d {
                    let t = dop(k, "mul", x, d);
                    dacc(k, "add", sxg, t);
                }
            });
            let r = reduce(k, &ctx, &[(ss, "add"), (sxg, "add")], false);
            let sc = scale(k, r[0]);
            let mdx = dop(k, "div", r[1], &len);
            let r3 = dop(k, "mul", sc, sc);
            let r3 = dop(k, "mul", r3, sc);
            let kk = dop(k, "mul", r3, mdx);
            each_elem(k, &ctx, lay, seg, None, |k, i, _| {
                let (x, d) = load(k, i);
                let o = match d {
                    None => dop(k, "mul", x, sc),
                    Some(d) => {
                        let a = dop(k, "mul", sc, d);
                        let b = dop(k, "mul", x, kk);
                        dop(k, "sub", a, b)
                    }
                };
                store(k, i, o);
            });
            return;
        }
        let (sx, sg) = (dc(k, 0.0), dc(k, 0.0));
        each_elem(k, &ctx, lay, seg, None, |k, i, _| {
            let (x, d) = load_first(k, i);
            dacc(k, "add", sx, x);
            if let Some(d) = d {
                dacc(k, "add", sg, d);
            }
        });
        let r = reduce(k, &ctx, &[(sx, "add"), (sg, "add")], false);
        let m = dop(k, "div", r[0], &len);
        let mdy = dop(k, "div", r[1], &len);
        let (sv, sgd) = (dc(k, 0.0), dc(k, 0.0));
        each_elem(k, &ctx, lay, seg, None, |k, i, _| {
            let (x, d) = load(k, i);
            let t = dop(k, "sub", x, m);
            let t2 = dop(k, "mul", t, t);
            dacc(k, "add", sv, t2);
            if let Some(d) = d {
                let u = dop(k, "mul", d, t);
                dacc(k, "add", sgd, u);
            }
        });
        let r = reduce(k, &ctx, &[(sv, "add"), (sgd, "add")], false);
        let rstd = scale(k, r[0]);
        let mdyx = dop(k, "mul", r[1], rstd);
        let mdyx = dop(k, "div", mdyx, &len);
        each_elem(k, &ctx, lay, seg, None, |k, i, _| {
            let (x, d) = load(k, i);
            let t = dop(k, "sub", x, m);
            let xhat = dop(k, "mul", t, rstd);
            let o = match d {
                None => xhat,
                Some(d) => {
                    let a = dop(k, "sub", d, mdy);
                    let b = dop(k, "mul", xhat, mdyx);
                    let c = dop(k, "sub", a, b);
                    dop(k, "mul", rstd, c)
                }
            };
            store(k, i, o);
        });
    });
    result?;
    epilogue_result?;
    Ok((grid, ctx.block))
}

#[cfg(test)]
#[path = "tests/norm.rs"]
mod tests;
