//! Attention kernels of two ops: an attention and its log-sum-exp in one pass over the keys,
//! the key and value gradients of one attention in one pass over the queries; a decode
//! step's cache written where it lives.

use super::kernels::{attention, cache};
use super::{ExecError, Executor};
use parallax_compiler::ir::{AttentionInput, Op};

impl Executor {
    /// An attention and its log-sum-exp in one pass (see `kernels::attention`).
    pub(super) fn run_attention(&mut self, steps: &[usize]) -> Result<(), ExecError> {
        let find = |want: fn(&Op) -> bool| {
            *steps
                .iter()
                .find(|&&s| want(&self.plan.steps[s].op))
                .expect("an attention kernel holds an attention and its statistics")
        };
        let (att, lse) = (
            find(|op| matches!(op, Op::Attention { .. })),
            find(|op| matches!(op, Op::AttentionLse { .. })),
        );
        let Op::Attention { causal, scale } = self.plan.steps[att].op else {
            unreachable!("found above");
        };
        self.shape_operands(att);
        let mut out = self.take_shaped(att);
        let mut stats = self.take_shaped(lse);
        let ops = &self.plan.steps[att].operands;
        let (q, k, v) = (self.buf(ops[0]), self.buf(ops[1]), self.buf(ops[2]));
        let r = attention::attention(q, k, v, causal, scale, &mut out, Some(&mut stats));
        *self.buf_mut(att) = out;
        *self.buf_mut(lse) = stats;
        r.map_err(|e| self.kernel_err(att, e))
    }

    /// The key and value gradients of one attention in one pass.
    pub(super) fn run_attention_grad_kv(&mut self, steps: &[usize]) -> Result<(), ExecError> {
        let by = |wrt: AttentionInput| {
            *steps
                .iter()
                .find(|&&s| matches!(self.plan.steps[s].op, Op::AttentionGrad { wrt: w, .. } if w == wrt))
                .expect("a key and a value gradient")
        };
        let (gk, gv) = (by(AttentionInput::Key), by(AttentionInput::Value));
        let Op::AttentionGrad { causal, scale, .. } = self.plan.steps[gk].op else {
            unreachable!("found above");
        };
        self.shape_operands(gk);
        let mut dk = self.take_shaped(gk);
        let mut dv = self.take_shaped(gv);
        let ops = &self.plan.steps[gk].operands;
        let b = |i: usize| self.buf(ops[i]);
        let saved = attention::Saved {
            dy: b(3),
            lse: b(4),
            delta: b(5),
        };
        let r = attention::attention_grad_key_value(
            b(0),
            b(1),
            b(2),
            &saved,
            causal,
            scale,
            Some(&mut dk),
            Some(&mut dv),
        );
        *self.buf_mut(gk) = dk;
        *self.buf_mut(gv) = dv;
        r.map_err(|e| self.kernel_err(gk, e))
    }

    /// `CacheWrite` step `step`, whose buffer is its cache's (the schedule writes a decode
    /// step's cache over its state): the new rows only, no copy of the cache.
    pub(super) fn run_cache_write_in_place(&mut self, step: usize) -> Result<(), ExecError> {
        self.shape_operands(step);
        let mut c = self.take_shaped(step);
        let ops = &self.plan.steps[step].operands;
        let r = cache::write_rows(&mut c, self.buf(ops[1]), self.buf(ops[2]));
        *self.buf_mut(step) = c;
        r.map_err(|e| self.kernel_err(step, e))
    }
}
