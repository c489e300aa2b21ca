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

    /// The gradients of one attention's inputs in one kernel (`AttentionGrads`): `steps`
    /// are its `AttentionGrad` ops, by query, key or value, on the same operands.
    pub(super) fn run_attention_grads(&mut self, steps: &[usize]) -> Result<(), ExecError> {
        let by = |wrt: AttentionInput| {
            steps.iter().copied().find(
                |&s| matches!(self.plan.steps[s].op, Op::AttentionGrad { wrt: w, .. } if w == wrt),
            )
        };
        let found = [
            AttentionInput::Query,
            AttentionInput::Key,
            AttentionInput::Value,
        ]
        .map(by);
        let first = steps[0];
        let Op::AttentionGrad { causal, scale, .. } = self.plan.steps[first].op else {
            unreachable!("the fuse pass groups attention gradients only");
        };
        self.shape_operands(first);
        let mut taken = found.map(|s| s.map(|s| (s, self.take_shaped(s))));
        let ops = &self.plan.steps[first].operands;
        let b = |i: usize| self.buf(ops[i]);
        let saved = attention::Saved {
            dy: b(3),
            lse: b(4),
            delta: b(5),
        };
        let [dq, dk, dv] = taken.each_mut().map(|t| t.as_mut().map(|(_, x)| x));
        let grads = attention::Grads { dq, dk, dv };
        let r = attention::attention_grads((b(0), b(1), b(2)), &saved, causal, scale, grads);
        for (s, x) in taken.into_iter().flatten() {
            *self.buf_mut(s) = x;
        }
        r.map_err(|e| self.kernel_err(first, e))
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
