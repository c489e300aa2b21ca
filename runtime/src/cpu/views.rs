//! Permutes folded into the kernel that computes their operand. Attention permutes
//! `[B, S, H, D]` to `[B, H, S, D]` and back around its batched products; as kernels of their
//! own, those permutes are a pass over memory each (eight per transformer block and step).
//! When a permute's operand (through reshapes that share its buffer) is read by nothing else
//! and comes out of a matmul or a matmul's epilogue, that kernel writes the permuted tensor
//! directly (strided output, or a strided store of the epilogue's last value), and the
//! permute's kernel does nothing. The plan is unchanged: this is how the CPU runs it, every
//! element computed by the same operations, so the bits are the same.
//!
//! The permuted tensor is written earlier than the plan says (when its operand is), so a
//! fold needs the permute's buffer free from the operand's kernel on: no other value may live
//! in it in between.

use super::kernels::layout::{merged_dims, strides};
use super::kernels::Small;
use parallax_compiler::ir::KernelKind;
use parallax_compiler::ir::{DType, Op};
use parallax_compiler::Plan;

/// A permute whose operand is written permuted by the kernel that computes it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fold {
    /// The permute step, whose buffer receives the values.
    pub permute: usize,
    /// Its operand: the value it permutes (the producer itself, or a reshape of it).
    pub value: usize,
}

/// Per step, the fold its value is written by (`None`: written as the plan says); per kernel,
/// whether it is a folded permute, which does nothing.
pub(super) struct Folds {
    pub by_producer: Vec<Option<Fold>>,
    pub skipped: Vec<bool>,
}

impl Folds {
    pub fn none(plan: &Plan) -> Folds {
        Folds {
            by_producer: vec![None; plan.steps.len()],
            skipped: vec![false; plan.kernels.len()],
        }
    }

    /// The folds of `plan` with buffers `slot`, for an executor holding `needed`.
    pub fn of(plan: &Plan, slot: &[Option<usize>], needed: &[bool]) -> Folds {
        let mut folds = Folds::none(plan);
        let n = plan.steps.len();
        let mut kernel_of = vec![usize::MAX; n];
        for (k, kern) in plan.kernels.iter().enumerate() {
            for &s in &kern.steps {
                kernel_of[s] = k;
            }
        }
        // Readers of each value, and the last kernel that reads it (`MAX`: read after the
        // step, as an output, a gradient or an update).
        let mut readers = vec![0usize; n];
        let mut last_read = vec![0usize; n];
        for s in &plan.steps {
            for &o in &s.operands {
                readers[o] += 1;
                last_read[o] = last_read[o].max(kernel_of[s.id]);
            }
        }
        let kept = plan.output_steps.iter().map(|o| o.step);
        let kept = kept.chain(plan.grads.iter().map(|g| g.1));
        let kept = kept.chain(plan.updates.iter().flat_map(|u| [u.0, u.1]));
        for s in kept {
            readers[s] += 1;
            last_read[s] = usize::MAX;
        }
        for p in &plan.steps {
            let Op::Permute { perm } = &p.op else {
                continue;
            };
            let kp = kernel_of[p.id];
            let single = kp != usize::MAX && plan.kernels[kp].steps == [p.id];
            // The innermost axis stays innermost: rows are written whole.
            let rows_kept = perm.last() == Some(&(perm.len() - 1));
            if !single || !rows_kept || p.ty.dtype != DType::F32 || !needed[p.id] {
                continue;
            }
            let Some(out) = slot[p.id] else { continue };
            let value = p.operands[0];
            let mut q = value;
            let mut ok = readers[q] == 1;
            while ok {
                let s = &plan.steps[q];
                match (&s.op, s.operands.first()) {
                    (Op::Reshape { .. }, Some(&src))
                        if slot[q].is_some() && slot[q] == slot[src] =>
                    {
                        q = src;
                        ok = readers[q] == 1;
                    }
                    _ => break,
                }
            }
            let kq = kernel_of[q];
            if !ok || kq == usize::MAX || !needed[q] || slot[q].is_none() || slot[q] == Some(out) {
                continue;
            }
            let kern = &plan.kernels[kq];
            // A matmul alone writes strided rows (its value unreshaped: a reshape could split
            // its rows); an epilogue's last value is stored run by run.
            let producer = match kern.kind {
                KernelKind::Single | KernelKind::Gemm { .. } if kern.steps == [q] => {
                    q == value && matches!(plan.steps[q].op, Op::MatMul { .. })
                }
                KernelKind::Gemm { .. } => kern.steps.last() == Some(&q),
                _ => false,
            };
            // No other value lives in the permute's buffer from the producer's kernel on.
            let free = plan.steps.iter().all(|s| {
                let k = kernel_of[s.id];
                s.id == p.id
                    || slot[s.id] != Some(out)
                    || (k != usize::MAX && (k > kp || (k < kq && last_read[s.id] < kq)))
            });
            if producer && free && folds.by_producer[q].is_none() {
                folds.by_producer[q] = Some(Fold {
                    permute: p.id,
                    value,
                });
                folds.skipped[kp] = true;
            }
        }
        folds
    }
}

/// Where element `(u_0, .., u_{r-1})` of a value of `shape` lands in its permute's output of
/// `out_shape` (row-major): one stride per axis of the value.
pub(super) fn permuted_strides(
    shape: &[usize],
    perm: &[usize],
    out_shape: &[usize],
) -> Small<usize> {
    let out_strides = strides(out_shape);
    let mut strides: Small<usize> = smallvec::smallvec![0; shape.len()];
    for (d, &axis) in perm.iter().enumerate() {
        strides[axis] = out_strides[d];
    }
    strides
}

/// A value of `shape` stored at element `strides` as whole runs: `(run, outer)` where element
/// `i` lands at `offset_of(i / run, outer) + i % run` (size-1 axes dropped, axes that are
/// contiguous in both orders merged).
pub(super) fn runs_of(shape: &[usize], strides: &[usize]) -> (usize, Small<(usize, usize)>) {
    let mut dims = merged_dims(shape, strides);
    match dims.last() {
        Some(&(run, 1)) => {
            dims.pop();
            (run, dims)
        }
        _ => (1, dims),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::kernels::layout::offset_of;

    #[test]
    fn strides_and_runs_place_each_element_where_the_permute_puts_it() {
        // [2, 3, 4, 5] permuted by [0, 2, 1, 3] is [2, 4, 3, 5].
        let (shape, perm, out_shape) = ([2, 3, 4, 5], [0, 2, 1, 3], [2, 4, 3, 5]);
        let strides = permuted_strides(&shape, &perm, &out_shape);
        assert_eq!(&strides[..], &[60, 5, 15, 1]);
        let (run, outer) = runs_of(&shape, &strides);
        assert_eq!(run, 5);
        for i in 0..120 {
            let u = [i / 60, i / 20 % 3, i / 5 % 4, i % 5];
            let want = ((u[0] * 4 + u[2]) * 3 + u[1]) * 5 + u[3];
            assert_eq!(offset_of(i / run, &outer) + i % run, want, "element {i}");
        }
        // Size-1 axes are dropped; a whole contiguous value is one run.
        let (run, outer) = runs_of(&[1, 6, 1], &[6, 1, 1]);
        assert_eq!((run, outer.len()), (6, 0));
        // An innermost axis that is not contiguous gives runs of one element.
        let (run, outer) = runs_of(&[3, 2], &[1, 3]);
        assert_eq!((run, &outer[..]), (1, &[(3, 1), (2, 3)][..]));
    }
}
