//! A matmul and its epilogue (a bias, then an activation): the bias added by the panels'
//! kernel as it stores the product, into the add's own buffer, where it can; the rest of
//! the epilogue in one pass over the product after it.

use super::kernels::gemm::matmul_bias;
use super::kernels::Ctx;
use super::{ExecError, Executor};
use parallax_compiler::ir::Op;

impl Executor {
    /// GEMM kernel `steps`: the matmul `steps[0]`, then its epilogue.
    pub(super) fn run_gemm(
        &mut self,
        steps: &[usize],
        ctx: &Ctx,
        fold: bool,
    ) -> Result<(), ExecError> {
        let mm = steps[0];
        let last = *steps.last().expect("a kernel has steps");
        let last = self.folds.by_producer[last].filter(|_| fold);
        // What is left of the epilogue, and the product it reads if that is not a buffer's.
        let (rest, given) = match self.biased_product(steps, last.is_some()) {
            // An activation reads the biased product from the add's buffer.
            Some(r) => (r.map(|()| &steps[2..])?, None),
            None => {
                let staged = self.slot[mm].is_none();
                self.run_single(mm, ctx, staged)?;
                // The epilogue reads the product as it is stored.
                self.round_bf16_early(mm);
                let source = if staged { &self.scratch } else { self.buf(mm) };
                (
                    &steps[1..],
                    Some((mm, (source.f32().as_ptr(), source.numel()))),
                )
            }
        };
        if rest.is_empty() {
            return Ok(());
        }
        let t = self.profile.is_some().then(std::time::Instant::now);
        self.run_fused(rest, given, ctx, None, last)?;
        if let (Some(t), Some(p)) = (t, self.profile.as_mut()) {
            p.epilogue = Some(t.elapsed().as_secs_f64());
        }
        Ok(())
    }

    /// The product and its bias (`steps[1]`, `add(product, bias)`) by the panels' kernel
    /// into the add's buffer, with no pass over the product: where only that add reads the
    /// product, it is stored as it is (not permuted: `permuted`, the kernel's last value
    /// folded into a permute's buffer, rules out an add that is last) and the product is one
    /// matrix (`matmul_bias`). `None` where not, nothing run. The sums are the add's, so the
    /// bits are the same as a pass after the product.
    fn biased_product(&mut self, steps: &[usize], permuted: bool) -> Option<Result<(), ExecError>> {
        let (mm, add) = (steps[0], *steps.get(1)?);
        let plan = &self.plan.steps;
        let Op::MatMul {
            trans_a: false,
            trans_b,
        } = plan[mm].op
        else {
            return None;
        };
        let ops = &plan[add].operands;
        let bias = match ops[..] {
            [x, b] | [b, x] if x == mm && b != mm => b,
            _ => return None,
        };
        let alone = steps[2..].iter().all(|&s| !plan[s].operands.contains(&mm));
        let last = steps.len() == 2;
        if plan[add].op != Op::Add
            || self.slot[mm].is_some()
            || self.slot[add].is_none()
            || !alone
            || (permuted && last)
            || self.buf(bias).shape[..] != self.shapes[mm][self.shapes[mm].len() - 1..]
        {
            return None;
        }
        self.shape_operands(mm);
        self.shape_operands(add);
        self.shape_buffer(add);
        let mut out = std::mem::take(self.buf_mut(add));
        let ops = &self.plan.steps[mm].operands;
        let (a, b) = (self.buf(ops[0]), self.buf(ops[1]));
        let r = matmul_bias(a, b, trans_b, self.buf(bias), &mut out);
        *self.buf_mut(add) = out;
        let r = r?.map_err(|e| self.kernel_err(mm, e));
        // An epilogue after it reads the sum as it is stored.
        self.round_bf16_early(add);
        Some(r)
    }
}
