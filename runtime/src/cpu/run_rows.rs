//! Row kernels fused with elementwise ops: a layer or RMS norm of an elementwise chain (the
//! residual add before a pre-LN block's norm) run row block by row block, and a norm's
//! gradient with the add after it. Same per-element and per-row arithmetic as the unfused
//! kernels, so the same bits.

use super::kernels::norms::{self, Norm};
use super::kernels::{Ctx, KernelError};
use super::{fused, ExecError, Executor};
use parallax_compiler::ir::Op;

/// Elements per block of rows: the chain's block of values stays in the L1 or L2 cache
/// until its rows are normalized.
const BLOCK_ELEMENTS: usize = 8 * fused::CHUNK;

fn bad(op: &'static str, message: &str) -> KernelError {
    KernelError::Bad {
        op,
        message: message.into(),
    }
}

impl Executor {
    /// Whether a fused reduction's kernel ends in a layer or RMS norm.
    pub(super) fn ends_in_norm(&self, steps: &[usize]) -> bool {
        steps.last().is_some_and(|&s| {
            matches!(
                self.plan.steps[s].op,
                Op::LayerNorm { .. } | Op::RmsNorm { .. }
            )
        })
    }

    /// The chain's values block by block (its stored ones written as its own kernel would),
    /// each block's last values normalized while in cache (`fused::run_blocks`).
    pub(super) fn run_chain_then_norm(
        &mut self,
        steps: &[usize],
        ctx: &Ctx,
    ) -> Result<(), ExecError> {
        let (&red, chain) = steps.split_last().expect("a norm and its chain");
        let (norm, eps) = match self.plan.steps[red].op {
            Op::LayerNorm { eps } => (Norm::Layer, eps as f32),
            Op::RmsNorm { eps } => (Norm::Rms, eps as f32),
            _ => return Err(self.kernel_err(red, bad("norm", "expected a layer or RMS norm"))),
        };
        let c = self.shapes[red].last().copied().unwrap_or(0);
        if chain.is_empty() || c == 0 {
            return Err(self.kernel_err(red, bad("norm", "needs a chain and rows")));
        }
        let mut out = self.take_shaped(red);
        let block = c * (BLOCK_ELEMENTS / c).max(1);
        let r = if out.is_f32() {
            let o = out.f32_mut();
            self.run_fused_with(chain, None, None, None, |ops, n, per_sample| {
                fused::run_blocks(ops, n, per_sample, ctx, block, o, |xs, o| {
                    norms::norm_rows(norm, xs, o, c, eps)
                })
            })
        } else {
            Err(self.kernel_err(red, bad("norm", "expects an f32 output")))
        };
        *self.buf_mut(red) = out;
        r
    }

    /// `add(other, norm_grad(x, dy))` (either order) row by row, the gradient never stored;
    /// the sum may be written over `other` (see the schedule pass).
    pub(super) fn run_norm_grad_add(&mut self, steps: &[usize]) -> Result<(), ExecError> {
        let &[ng, add] = steps else {
            return Err(self.kernel_err(steps[0], bad("add", "expected a gradient and an add")));
        };
        let (norm, eps) = match self.plan.steps[ng].op {
            Op::LayerNormGrad { eps } => (Norm::Layer, eps as f32),
            Op::RmsNormGrad { eps } => (Norm::Rms, eps as f32),
            _ => return Err(self.kernel_err(ng, bad("add", "expected a norm's gradient"))),
        };
        let plan = self.plan.clone();
        let ops = &plan.steps[add].operands;
        let other = ops.iter().copied().find(|&o| o != ng);
        let (Some(other), None, &[x, dy]) = (other, self.slot[ng], &plan.steps[ng].operands[..])
        else {
            return Err(
                self.kernel_err(add, bad("add", "the gradient is stored or added to itself"))
            );
        };
        self.shape_operands(ng);
        self.shape_buffer(other);
        let mut out = self.take_shaped(add);
        let in_place = self.slot[other] == self.slot[add];
        let other = (!in_place).then(|| self.buf(other));
        let r = norms::norm_grad_add(norm, self.buf(x), self.buf(dy), other, eps, &mut out);
        *self.buf_mut(add) = out;
        r.map_err(|e| self.kernel_err(ng, e))
    }
}
