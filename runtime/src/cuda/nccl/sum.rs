//! GPU ranks' sums over micro-shards on the GPUs, over NCCL (`PARALLAX_NCCL=1`): each shard's
//! gradient goes, chunk by chunk, from its GPU to the chunk's owner with grouped
//! `ncclSend`/`ncclRecv`, the owner adds them along the fixed tree with our own kernel
//! (`tree`), and the summed chunks are gathered back: the bits of the host path
//! (every shard a single-leaf partial, combined as `comm::collective::total` combines them), without
//! a copy to the host. Not yet run on a GPU: the host path stays the default until
//! `scripts/gpu-check.sh` has compared the two.

use super::comm::{NcclComm, NcclId};
use super::tree::{DeviceTree, Schedule};
use crate::cuda::cudarc::driver::{result, CudaContext, CudaSlice, CudaStream, DevicePtr};
use crate::cuda::CudaExecutor;
use crate::exec::{DeviceSum, ExecError, SumCall};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// The variable that turns the NCCL path on.
pub const ENV: &str = "PARALLAX_NCCL";

/// A schedule's identity: the shards each member holds, the shard count and the length.
type Key = (Vec<usize>, Vec<Range<usize>>, usize, usize);

/// One GPU rank's side of the sums.
pub struct NcclSum {
    comm: NcclComm,
    tree: DeviceTree,
    stream: Arc<CudaStream>,
    timeout: Duration,
    schedules: HashMap<Key, Schedule>,
    /// Where the total lands before it is copied to each shard's step: never one of the
    /// operands (a total may share its buffer with a shard's gradient).
    total: Option<CudaSlice<f32>>,
}

impl NcclSum {
    fn total_buffer(&mut self, floats: usize) -> Result<u64, ExecError> {
        if self.total.as_ref().is_none_or(|t| t.len() < floats) {
            self.total = None;
            let t = self
                .stream
                .alloc_zeros::<f32>(floats.max(1))
                .map_err(|e| self.error("allocating the sum's buffer", e))?;
            self.total = Some(t);
        }
        Ok(self
            .total
            .as_ref()
            .map_or(0, |t| t.device_ptr(&self.stream).0))
    }

    fn error(&self, doing: &str, e: impl std::fmt::Debug) -> ExecError {
        ExecError::Device(format!("rank {} (NCCL): {doing}: {e:?}", self.comm.rank()))
    }
}

// SAFETY: a rank's sum is used by one thread at a time (`&mut self`), after that thread
// bound the rank's context; NCCL communicators may move between threads (they must not be
// used by two at once, which `&mut` rules out), and the stream and context are cudarc's.
unsafe impl Send for NcclSum {}

impl DeviceSum<CudaExecutor> for NcclSum {
    fn sum(&mut self, shards: &mut [CudaExecutor], call: &SumCall) -> Result<(), ExecError> {
        let own = call.held[call.member].clone();
        if [call.operand, call.out]
            .iter()
            .any(|&s| shards[0].stored_in_bf16(s))
        {
            // Tensor parallelism's partial products, with activations stored in bf16.
            return Err(ExecError::Device(format!(
                "rank {}: step {} is stored in bf16, and the NCCL sums carry f32 only so far (store activations in f32: `--set devices.activations=F32`)",
                self.comm.rank(),
                call.operand
            )));
        }
        let len: usize = shards[0].value_shape(call.operand).iter().product();
        // Every shard its own single-leaf partial: what the host path's partials sum to.
        let key: Key = (call.group.to_vec(), call.held.to_vec(), call.leaves, len);
        if !self.schedules.contains_key(&key) {
            let s = Schedule::new(call.leaves, call.group, &single_leaves(call.held), len)
                .map_err(|e| ExecError::Device(format!("rank {}: {e}", self.comm.rank())))?;
            self.schedules.insert(key.clone(), s);
        }
        let mine: Vec<u64> = shards
            .iter()
            .take(own.len())
            .map(|e| e.device_ptr(call.operand))
            .collect::<Result<_, _>>()
            .map_err(|e| self.error("a shard's gradient", e))?;
        let total = self.total_buffer(len)?;
        let schedule = &self.schedules[&key];
        let root = call.root.map(|q| call.group[q]);
        // SAFETY: `mine` are this rank's shards' buffers of the operand (`len` f32 each, in
        // the schedule's order of its single-leaf partials), `total` has room for `len`, all
        // on the communicator's GPU; `stream` is the one the communicator was made with.
        let done = unsafe {
            self.tree.sum(
                &mut self.comm,
                &self.stream,
                schedule,
                &mine,
                total,
                root,
                self.timeout,
            )
        };
        done.map_err(|e| ExecError::Device(e.to_string()))?;
        if call.root.is_some_and(|q| q != call.member) {
            return Ok(());
        }
        // A device without shards this step still updates its own copy.
        for e in shards.iter().take(own.len().max(1)) {
            if !e.stored(call.out) {
                continue;
            }
            let dst = e
                .device_ptr(call.out)
                .map_err(|e| self.error("the sum's step", e))?;
            // SAFETY: both buffers hold `len` f32 on this GPU; the copy is ordered on the
            // executors' stream before their next kernels.
            unsafe { result::memcpy_dtod_async(dst, total, len * 4, self.stream.cu_stream()) }
                .map_err(|e| self.error("copying the total", e))?;
        }
        Ok(())
    }
}

/// Each member's shards as single-leaf partials (each a subtree of the fixed tree).
fn single_leaves(held: &[Range<usize>]) -> Vec<Vec<Range<usize>>> {
    held.iter()
        .map(|r| r.clone().map(|i| i..i + 1).collect())
        .collect()
}

/// Joins every device of this process to one NCCL communicator over `id`, whose ranks are
/// the devices (`places[i]` is world rank `first + i` of `world`: its context, stream and
/// target), each from its own thread (NCCL's init waits for all of them, at most `timeout`).
pub fn join_all(
    places: &[(Arc<CudaContext>, Arc<CudaStream>, &'static str)],
    id: &NcclId,
    first: usize,
    world: usize,
    timeout: Duration,
) -> Result<Vec<Box<dyn DeviceSum<CudaExecutor>>>, ExecError> {
    let join = |i: usize| -> Result<Box<dyn DeviceSum<CudaExecutor>>, ExecError> {
        let (ctx, stream, target) = &places[i];
        let rank = first + i;
        ctx.bind_to_thread()
            .map_err(|e| fail(format!("rank {rank}: binding its GPU: {e:?}")))?;
        // SAFETY: the executors' stream, of this context, lives as long as the
        // executors, which the sum (and so the communicator) does not outlive.
        let comm = unsafe { NcclComm::init(id, rank, world, stream.cu_stream(), timeout) }
            .map_err(|e| fail(format!("rank {rank}: {e}")))?;
        let tree = DeviceTree::new(ctx, target)
            .map_err(|e| fail(format!("rank {rank}: the add kernel: {e}")))?;
        Ok(Box::new(NcclSum {
            comm,
            tree,
            stream: stream.clone(),
            timeout,
            schedules: HashMap::new(),
            total: None,
        }))
    };
    // Every rank must join at once: NCCL's init waits for all of them.
    let sums: Vec<Result<_, ExecError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..places.len())
            .map(|i| s.spawn(move || join(i)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(fail("a rank's thread panicked".into())))
            })
            .collect()
    });
    sums.into_iter().collect()
}

/// An error of the NCCL path.
pub fn fail(e: String) -> ExecError {
    ExecError::Device(format!("NCCL: {e}"))
}

#[cfg(test)]
mod tests {
    use super::super::tree::check_value;
    use super::*;
    use crate::comm::collective::{partials, total};
    use parallax_compiler::shards::assign;

    /// The NCCL path sends every shard as its own partial; the host path sums each rank's
    /// whole subtrees first. Both follow the fixed tree, so the same bits, for every
    /// assignment of shards to ranks (ranks holding none included).
    #[test]
    fn single_leaf_partials_give_the_host_paths_bits() {
        for leaves in [1, 2, 3, 5, 8, 13] {
            for ranks in [1, 2, 3, 4, 8] {
                let held = assign(leaves, ranks);
                let len = 150;
                let value = |i: usize| (0..len).map(|e| check_value(7, i, e)).collect::<Vec<f32>>();
                let group: Vec<usize> = (0..ranks).map(|r| 10 + 3 * r).collect();
                let schedule = Schedule::new(leaves, &group, &single_leaves(&held), len).unwrap();
                let mine: Vec<Vec<Vec<f32>>> = held
                    .iter()
                    .map(|r| r.clone().map(value).collect())
                    .collect();
                let device = schedule.run_host(&mine).unwrap();
                let host: Vec<_> = held
                    .iter()
                    .enumerate()
                    .flat_map(|(q, r)| {
                        partials(leaves, r.clone(), &value)
                            .into_iter()
                            .map(move |p| (q, p))
                    })
                    .collect();
                let host = total(leaves, host).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&device),
                    bits(&host),
                    "{leaves} shards on {ranks} ranks"
                );
            }
        }
    }
}
