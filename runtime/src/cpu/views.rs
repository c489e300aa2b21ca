//! Permutes folded into the kernel that computes their operand, as the plan records them
//! (`parallax_compiler::plan::views` finds them and says why they are safe): the matmul
//! writes strided output, or its epilogue's last value is stored run by run, and the
//! permute's kernel does nothing. Every element is computed by the same operations, so the
//! bits are the same.

use super::kernels::layout::{merged_dims, strides};
use super::kernels::Small;
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

    /// The folds the plan records (`parallax_compiler::plan::views`).
    pub fn of(plan: &Plan) -> Folds {
        let mut folds = Folds::none(plan);
        for f in &plan.views.folds {
            folds.by_producer[f.producer] = Some(Fold {
                permute: f.permute,
                value: f.value,
            });
            if let Some(k) = plan.kernels.iter().position(|k| k.steps == [f.permute]) {
                folds.skipped[k] = true;
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
