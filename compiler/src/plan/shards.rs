//! Data parallelism that gives the same bits on any GPU count: each batch is cut into a fixed
//! number of micro-shards (the file's `devices.micro_shards`), independent of the device count;
//! every device runs whole shards with the same per-shard plan, and every cross-shard sum
//! (gradients, the loss, BatchNorm statistics) follows one fixed tree over shard index. Which
//! device holds which shard then changes who computes a value, never the value.

use serde::Serialize;
use std::ops::Range;

/// How a batch is split for data parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Sharding {
    /// Micro-shards per full batch.
    pub shards: u32,
    /// The training batch (the file's `batch_size`): the global batch all devices share.
    pub global_batch: u64,
}

/// The scalar inputs a sharded plan reads besides the data, set per shard by the runtime.
pub const SHARD_WEIGHT: &str = "shard_weight";
/// `1 / samples in the whole batch`: synchronised BatchNorm divides its sums by it.
pub const INV_BATCH: &str = "inv_global_batch";

impl Sharding {
    pub fn new(shards: u32, global_batch: u64) -> Sharding {
        Sharding {
            shards: shards.clamp(1, global_batch.clamp(1, u64::from(u32::MAX)) as u32),
            global_batch,
        }
    }

    /// Samples in the largest shard of a full batch: the batch the per-shard plan is built for.
    pub fn shard_batch(&self) -> u64 {
        self.global_batch.div_ceil(u64::from(self.shards)).max(1)
    }

    /// The shards of a batch of `batch` samples as sample ranges, in order. A full batch gives
    /// `shards` pieces of `shard_batch` (the last may be shorter); a short last batch gives
    /// pieces of the same rule, so the split never depends on the device count.
    pub fn split(&self, batch: usize) -> Vec<Range<usize>> {
        let per = batch.div_ceil(self.shards as usize).max(1);
        (0..batch)
            .step_by(per)
            .map(|a| a..(a + per).min(batch))
            .collect()
    }
}

/// The shards device `d` of `devices` holds out of `shards`: contiguous, as even as possible
/// (the first `shards % devices` devices take one more).
pub fn assign(shards: usize, devices: usize) -> Vec<Range<usize>> {
    let devices = devices.max(1);
    let (base, extra) = (shards / devices, shards % devices);
    let mut start = 0;
    (0..devices)
        .map(|d| {
            let len = base + usize::from(d < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// Where the fixed reduction tree splits the leaves `lo..hi` (two or more): the left part is
/// the largest power of two below the count, so every subtree covers an aligned range.
pub fn tree_split(lo: usize, hi: usize) -> usize {
    let n = hi - lo;
    debug_assert!(n >= 2);
    lo + (1usize << (usize::BITS - 1 - (n - 1).leading_zeros()))
}

/// The largest subtrees of the tree over `0..leaves` that lie wholly inside `own`, left to
/// right: what a device holding the shards `own` can sum on its own before communicating.
pub fn owned_subtrees(leaves: usize, own: Range<usize>) -> Vec<Range<usize>> {
    fn walk(lo: usize, hi: usize, own: &Range<usize>, out: &mut Vec<Range<usize>>) {
        if hi <= own.start || lo >= own.end {
            return;
        }
        if own.start <= lo && hi <= own.end {
            out.push(lo..hi);
            return;
        }
        let mid = tree_split(lo, hi);
        walk(lo, mid, own, out);
        walk(mid, hi, own, out);
    }
    let mut out = Vec::new();
    if leaves > 0 && !own.is_empty() {
        walk(0, leaves, &own, &mut out);
    }
    out
}

/// The memory a device holding `held` shards of a per-shard `plan` needs when it runs the
/// kernels marked in `owned` (a pipeline stage; all when `None`): one copy of the parameters
/// and optimizer state those kernels read, and for each shard the other values they touch
/// and the executor's staging buffer (a device without shards still holds one shard's).
pub fn device_bytes(plan: &crate::Plan, held: usize, owned: Option<&[bool]>) -> u64 {
    use crate::ir::Op;
    let touched = plan.steps_touched(owned);
    let elements = plan.buffer_elements(&touched, plan.batch_size);
    let mut persistent = vec![false; plan.buffers.len()];
    for s in &plan.steps {
        if let (Op::Param { .. } | Op::State { .. }, Some(b)) = (&s.op, s.buffer) {
            persistent[b] = true;
        }
    }
    let (mut once, mut per_shard) = (0u64, plan.scratch_elements(plan.batch_size));
    for (b, &n) in elements.iter().enumerate() {
        if persistent[b] {
            once = once.saturating_add(n);
        } else {
            per_shard = per_shard.saturating_add(n);
        }
    }
    // Every element is 4 bytes (f32 values, i32 indices). Saturating: a size past u64 is
    // refused as too large, never wrapped.
    once.saturating_add(per_shard.saturating_mul(held.max(1) as u64))
        .saturating_mul(4)
}

/// `device_bytes` for every device of a grid of `dp` data-parallel ranks, `tp` tensor ranks
/// and the plan's pipeline stages, in the simulated devices' order (rank, tensor rank, stage).
pub fn grid_bytes(plan: &crate::Plan, dp: u32, tp: u32) -> Vec<u64> {
    let shards = plan.sharding.map_or(1, |s| s.shards) as usize;
    let mut out = Vec::new();
    for (rank, held) in assign(shards, dp as usize).into_iter().enumerate() {
        for _ in 0..tp {
            for stage in 0..plan.pipeline_stages {
                let owned = plan.kernel_mask(stage, rank as u32);
                out.push(device_bytes(plan, held.len(), owned.as_deref()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_fixed_by_the_shard_count() {
        let s = Sharding::new(8, 64);
        assert_eq!(s.shard_batch(), 8);
        assert_eq!(s.split(64).len(), 8);
        assert!(s.split(64).iter().all(|r| r.len() == 8));
        // A short last batch: pieces of ceil(13 / 8) = 2, the last shorter.
        let short = s.split(13);
        assert_eq!(short.len(), 7);
        assert_eq!(short[6], 12..13);
        // Fewer samples than shards: one-sample shards.
        assert_eq!(Sharding::new(8, 64).split(3), vec![0..1, 1..2, 2..3]);
        // More shards than samples in the batch: clamped.
        assert_eq!(Sharding::new(8, 4).shards, 4);
    }

    #[test]
    fn assignment_is_contiguous_and_even() {
        assert_eq!(assign(8, 3), vec![0..3, 3..6, 6..8]);
        assert_eq!(assign(8, 1), vec![0..8]);
        assert_eq!(assign(2, 4), vec![0..1, 1..2, 2..2, 2..2]);
        for n in 1..=9 {
            let a = assign(8, n);
            assert_eq!(a.iter().map(|r| r.len()).sum::<usize>(), 8);
        }
    }

    #[test]
    fn subtrees_cover_the_owned_range_and_align_with_the_tree() {
        assert_eq!(tree_split(0, 8), 4);
        assert_eq!(tree_split(0, 7), 4);
        assert_eq!(tree_split(4, 7), 6);
        assert_eq!(owned_subtrees(8, 0..8), vec![0..8]);
        assert_eq!(owned_subtrees(8, 3..6), vec![3..4, 4..6]);
        assert_eq!(owned_subtrees(8, 6..8), vec![6..8]);
        for leaves in 1..=12 {
            for n in 1..=leaves {
                for own in assign(leaves, n) {
                    let parts = owned_subtrees(leaves, own.clone());
                    let covered: Vec<usize> = parts.iter().flat_map(|r| r.clone()).collect();
                    assert_eq!(covered, own.clone().collect::<Vec<_>>());
                }
            }
        }
    }
}
