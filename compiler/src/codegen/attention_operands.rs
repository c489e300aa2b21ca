//! The operands of attention's kernels: their sizes ([`Dims`], checked once per op), and
//! the addressing of a token-major operand's rows per problem ([`Tensor`], [`Problem`]),
//! which every kernel (plain f32 and tensor-core, forward and gradients) goes through.

use super::super::builder::{Kernel, Rd};
use super::super::{CodegenError, Operand};
use crate::ir::attention::Sizes;
use crate::ir::{DType, Op};

/// The sizes of one attention: `problems` (batch positions times `heads`) of `t` queries, `s`
/// keys of width `d` and values of width `e` (0 for the log-sum-exp alone).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(in crate::codegen) struct Dims {
    pub(super) problems: u64,
    pub(super) heads: u64,
    pub(super) t: u64,
    pub(super) s: u64,
    pub(super) d: u64,
    pub(super) e: u64,
    pub(super) causal: bool,
    /// A decode step's attention over caches (`CachedAttention`): query `i` of sample `b`
    /// sits at position `pos[b] + i` and sees keys `0..=pos[b] + i` (causal, shifted).
    pub(super) cached: bool,
    pub(super) scale: f32,
}

pub(super) fn bad(op: &Op, message: String) -> CodegenError {
    CodegenError::Bad {
        op: op.name(),
        message,
    }
}

/// `causal` and `scale` of an attention op.
pub(super) fn params(op: &Op) -> Option<(bool, f32)> {
    match *op {
        Op::Attention { causal, scale }
        | Op::AttentionLse { causal, scale }
        | Op::AttentionGrad { causal, scale, .. } => Some((causal, scale as f32)),
        Op::CachedAttention { scale } => Some((true, scale as f32)),
        _ => None,
    }
}

impl Dims {
    /// Checks `q [.., T, H, D]`, `k [.., S, H, D]` and `v [.., S, H, E]` (one batch shape `..`).
    pub(super) fn of(
        op: &Op,
        q: &Operand,
        k: &Operand,
        v: Option<&Operand>,
    ) -> Result<Dims, CodegenError> {
        let (causal, scale) = params(op).ok_or(CodegenError::Unsupported { op: op.name() })?;
        let cached = matches!(op, Op::CachedAttention { .. });
        let v = v.map(|v| &v.shape[..]);
        let sz = Sizes::of(&q.shape, &k.shape, v, causal && !cached).map_err(|m| bad(op, m))?;
        Ok(Dims {
            problems: sz.problems,
            heads: sz.heads,
            t: sz.t,
            s: sz.s,
            d: sz.d,
            e: sz.e,
            causal,
            cached,
            scale,
        })
    }

    /// The operand at `ptr` with `len` rows of `width` per problem.
    pub(super) fn tensor(&self, ptr: Rd, len: u64, width: u64) -> Tensor {
        Tensor {
            ptr,
            len,
            width,
            heads: self.heads,
        }
    }

    /// The forward's views of `q`, `key`, `(v, o)` and `lse`, their parameters declared in
    /// that order.
    pub(super) fn forward_views(
        &self,
        k: &mut Kernel,
        (q, key): (&Operand, &Operand),
        vo: Option<(&Operand, &Operand)>,
        lse: Option<&Operand>,
    ) -> ForwardViews {
        let tq = self.tensor(k.param_ptr(q.arg), self.t, self.d);
        let tk = self.tensor(k.param_ptr(key.arg), self.s, self.d);
        let vo = vo.map(|(v, o)| {
            let v = self.tensor(k.param_ptr(v.arg), self.s, self.e);
            (v, self.tensor(k.param_ptr(o.arg), self.t, self.e))
        });
        let tl = lse.map(|l| self.tensor(k.param_ptr(l.arg), self.t, 1));
        (tq, tk, vo, tl)
    }
}

/// The forward's q, k, optional (v, o) and optional lse.
pub(super) type ForwardViews = (Tensor, Tensor, Option<(Tensor, Tensor)>, Option<Tensor>);

/// A token-major operand `[.., len, heads, width]` at `ptr` (lse and delta: width 1).
#[derive(Clone, Copy)]
pub(in crate::codegen) struct Tensor {
    pub(super) ptr: Rd,
    pub(super) len: u64,
    pub(super) width: u64,
    pub(super) heads: u64,
}

/// A task's problem `g = b H + h`: batch position `b`, head `h`.
#[derive(Clone, Copy)]
pub(in crate::codegen) struct Problem {
    pub(super) b: Rd,
    pub(super) h: Rd,
}

impl Tensor {
    /// Elements from one of a problem's rows to the next: the other heads' rows lie between.
    pub(super) fn stride(&self) -> u64 {
        self.heads * self.width
    }

    /// The element offset of row `i` of problem `pb`: `((b len + i) H + h) width`. Every
    /// global access of the attention kernels goes through it.
    pub(super) fn offset(&self, k: &mut Kernel, pb: &Problem, i: Rd) -> Rd {
        let (row, at) = (k.rd(), k.rd());
        k.ins(format!("mad.lo.u64 {row}, {}, {}, {i}", pb.b, self.len));
        k.ins(format!("mad.lo.u64 {at}, {row}, {}, {}", self.heads, pb.h));
        if self.width == 1 {
            return at;
        }
        k.op64("mul.lo", at, self.width)
    }

    /// The global address of row `i` of problem `pb`.
    pub(super) fn at(&self, k: &mut Kernel, pb: &Problem, i: Rd) -> Rd {
        let o = self.offset(k, pb, i);
        k.addr(self.ptr, o)
    }
}

/// Checks that every operand is f32 and holds `n` elements.
pub(super) fn check(op: &Op, vals: &[(&str, Option<&Operand>, u64)]) -> Result<(), CodegenError> {
    for (what, o, n) in vals {
        let Some(o) = o else { continue };
        if o.dtype != DType::F32 {
            return Err(bad(op, format!("`{what}` is {:?}, not f32", o.dtype)));
        }
        if o.numel() != *n {
            return Err(bad(
                op,
                format!("`{what}` {:?} holds not {n} values", o.shape),
            ));
        }
    }
    Ok(())
}
