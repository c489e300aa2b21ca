//! Each micro-shard's share of the batch's loss (the `shard_weight` input of a sharded plan).
//!
//! The loss of a batch is what one device computes on it unsplit: for cross-entropy, the sum
//! over the positions whose label counts (not -100) divided by the count over the whole batch
//! (PyTorch's `reduction="mean"` with `ignore_index`, label smoothing included); otherwise the
//! mean over samples. A shard's loss op computes its own mean, so its share is its counted
//! positions over the batch's (or its samples over the batch's). A batch whose labels are all
//! ignored gives every shard the weight 0: loss 0 and no gradient, where PyTorch gives NaN.

use crate::data::Values;
use crate::exec::IGNORE;
use parallax_compiler::ir::Op;
use parallax_compiler::Plan;
use std::ops::Range;

/// Whether the plan's loss is a mean over counted labels (its `LABELS` input) rather than
/// over samples.
pub fn counts_labels(plan: &Plan) -> bool {
    plan.steps
        .iter()
        .any(|s| matches!(s.op, Op::CrossEntropy { .. }))
}

/// The weight of each shard (sample ranges of a batch of `batch`) in the batch's loss.
/// `labels` are the batch's labels when the loss counts them (`counts_labels`).
pub fn shard_weights(ranges: &[Range<usize>], batch: usize, labels: Option<&Values>) -> Vec<f32> {
    let Some(Values::I32(labels)) = labels else {
        return ranges
            .iter()
            .map(|r| r.len() as f32 / batch.max(1) as f32)
            .collect();
    };
    let per = labels.len() / batch.max(1);
    let counted: Vec<u64> = ranges
        .iter()
        .map(|r| {
            let end = (r.end * per).min(labels.len());
            labels[(r.start * per).min(end)..end]
                .iter()
                .filter(|&&l| l != IGNORE)
                .count() as u64
        })
        .collect();
    let total: u64 = counted.iter().sum();
    counted
        .iter()
        .map(|&c| {
            if total == 0 {
                0.0
            } else {
                (c as f64 / total as f64) as f32
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_follow_counted_labels_not_samples() {
        let labels = Values::I32(vec![0, IGNORE, 1, 1]);
        let w = shard_weights(&[0..2, 2..4], 4, Some(&labels));
        assert_eq!(w, vec![1.0 / 3.0, 2.0 / 3.0]);
        // Two positions per sample (a sequence): 1 and 3 counted.
        let seq = Values::I32(vec![IGNORE, 2, 1, 1, 0, IGNORE]);
        let w = shard_weights(&[0..1, 1..3], 3, Some(&seq));
        assert_eq!(w, vec![0.25, 0.75]);
        let none = Values::I32(vec![IGNORE; 4]);
        assert_eq!(shard_weights(&[0..2, 2..4], 4, Some(&none)), vec![0.0, 0.0]);
        assert_eq!(shard_weights(&[0..1, 1..4], 4, None), vec![0.25, 0.75]);
    }
}
