//! Rewrites of the scheduled plan that change how kernels run, never what they compute: the
//! last step of plan emission finds them, the plan records them (`Plan::views`, in
//! `plan.json` too), and a backend may take each or run the plan as it is, with the same
//! bits either way.
//!
//! - **Folded permutes.** A `Permute` layer (heads split by hand, `[B, S, H, D]` to
//!   `[B, H, S, D]`) is a pass over memory of its own. When a permute's operand (through
//!   reshapes that share its buffer) is read by nothing else and comes out of a matmul or a
//!   matmul's epilogue, that kernel may write the permuted tensor directly, and the permute's
//!   kernel does nothing. The permuted tensor is then written earlier than the schedule says (when
//!   its operand is), so a fold needs the permute's buffer free from the operand's kernel on.
//! - **Scaled softmax.** A kernel `softmax(x * by)` whose scaled values nothing else reads
//!   (a composed attention's scores) may run as one pass over `x`, the scaling done in the row.
//!
//! Reshapes need no rewrite: the schedule pass already gives a reshape its operand's buffer.

use super::Plan;
use crate::ir::{DType, KernelKind, Op};
use serde::{Deserialize, Serialize};

/// A permute whose operand is written permuted by the kernel that computes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fold {
    /// The permute step, whose buffer receives the values (its kernel does nothing).
    pub permute: usize,
    /// Its operand: the value it permutes (the producer itself, or a reshape of it).
    pub value: usize,
    /// The step whose kernel writes the permuted values: a matmul, or its epilogue's last.
    pub producer: usize,
}

/// The plan's rewrites (none for a partitioned plan's stages and owners, see `find`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Views {
    pub folds: Vec<Fold>,
    /// Kernels that are `softmax(x * by)` over a stored `x`, each one pass.
    pub scaled_softmax: Vec<usize>,
}

impl Views {
    pub fn is_empty(&self) -> bool {
        self.folds.is_empty() && self.scaled_softmax.is_empty()
    }
}

/// The rewrites of a scheduled plan.
pub fn find(plan: &Plan) -> Views {
    Views {
        folds: folds(plan),
        scaled_softmax: scaled_softmax(plan),
    }
}

fn folds(plan: &Plan) -> Vec<Fold> {
    // A pipeline stage's or ZeRO owner's kernels are a part of the plan, run by a device
    // that holds only their values: fold nothing there.
    if plan.pipeline_stages > 1 || plan.steps.iter().any(|s| s.owner.is_some()) {
        return Vec::new();
    }
    let n = plan.steps.len();
    let slot: Vec<Option<usize>> = plan.steps.iter().map(|s| s.buffer).collect();
    let mut kernel_of = vec![usize::MAX; n];
    for (k, kern) in plan.kernels.iter().enumerate() {
        for &s in &kern.steps {
            kernel_of[s] = k;
        }
    }
    // Readers of each value, and the last kernel that reads it (`MAX`: read after the step,
    // as an output, a gradient or an update).
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
    let mut folds: Vec<Fold> = Vec::new();
    for p in &plan.steps {
        let Op::Permute { perm } = &p.op else {
            continue;
        };
        let kp = kernel_of[p.id];
        let single = kp != usize::MAX && plan.kernels[kp].steps == [p.id];
        // The innermost axis stays innermost: rows are written whole.
        let rows_kept = perm.last() == Some(&(perm.len() - 1));
        if !single || !rows_kept || p.ty.dtype != DType::F32 {
            continue;
        }
        let Some(out) = slot[p.id] else { continue };
        let value = p.operands[0];
        let mut q = value;
        let mut ok = readers[q] == 1;
        while ok {
            let s = &plan.steps[q];
            match (&s.op, s.operands.first()) {
                (Op::Reshape { .. }, Some(&src)) if slot[q].is_some() && slot[q] == slot[src] => {
                    q = src;
                    ok = readers[q] == 1;
                }
                _ => break,
            }
        }
        let kq = kernel_of[q];
        if !ok || kq == usize::MAX || slot[q].is_none() || slot[q] == Some(out) {
            continue;
        }
        let kern = &plan.kernels[kq];
        // A matmul alone writes strided rows (its value unreshaped: a reshape could split its
        // rows); an epilogue's last value is stored run by run.
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
        if producer && free && !folds.iter().any(|f| f.producer == q) {
            folds.push(Fold {
                permute: p.id,
                value,
                producer: q,
            });
        }
    }
    folds
}

fn scaled_softmax(plan: &Plan) -> Vec<usize> {
    let slot = |s: usize| plan.steps[s].buffer;
    (0..plan.kernels.len())
        .filter(|&k| {
            let kern = &plan.kernels[k];
            let [scale, red] = kern.steps[..] else {
                return false;
            };
            let ops = (&plan.steps[scale].op, &plan.steps[red].op);
            if kern.kind != KernelKind::ElementwiseReduce
                || !matches!(ops, (Op::Scale { .. }, Op::Softmax { .. }))
            {
                return false;
            }
            let x = plan.steps[scale].operands[0];
            slot(x).is_some() && slot(scale).is_none() && slot(x) != slot(red)
        })
        .collect()
}
