//! The device side of the tree all-reduce (`tree`): the add kernel, and `DeviceTree`,
//! which runs a `Schedule` over an `NcclComm`. Nothing here runs without a GPU and libnccl:
//! the test suite assembles the kernel's PTX with ptxas, and `parallax comm-check --backend
//! cuda` (scripts/gpu-check.sh) runs the exchange on a GPU machine.

use super::{Schedule, Slot, TreeError};
use crate::cuda::nccl::comm::{NcclComm, NcclCommError};
use crate::cuda::CudaError;
use cudarc::driver::{result, CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use parallax_compiler::codegen::builder::Kernel;
use parallax_compiler::codegen::{grid_for, Arg, Gen, BLOCK};
use std::sync::Arc;
use std::time::Duration;

/// The add kernel's entry: `dst[i] = a[i] + b[i]` for `i < n`, round to nearest as the host
/// adds (no FMA, no reassociation: one add per element).
pub const ADD_KERNEL: &str = "px_tree_add";

/// The add kernel's PTX module for `target` (`sm_80`, `sm_90`), from the project's builder.
pub fn add_kernel_ptx(target: &str) -> String {
    let mut g = Gen::new();
    let mut k = Kernel::new(ADD_KERNEL);
    let dst = k.param_ptr(Arg::Scratch);
    let a = k.param_ptr(Arg::Scratch);
    let b = k.param_ptr(Arg::Scratch);
    let n = k.param_u64(Arg::U64(0));
    let (i, s) = k.global_index();
    k.for_range(i, n, s, |k, i| {
        let x = k.load(a, i);
        let y = k.load(b, i);
        let z = k.add(x, y);
        k.store(dst, i, z);
    });
    g.launch(k, 1, BLOCK);
    g.text(target)
}

/// What the device side of the tree all-reduce can fail with; NCCL's errors name the
/// operation and the peer, and the communicator is aborted by then.
#[derive(Debug, thiserror::Error)]
pub enum DeviceTreeError {
    #[error(transparent)]
    Schedule(#[from] TreeError),
    #[error("tree all-reduce on rank {rank}: {what}")]
    Invalid { rank: usize, what: String },
    #[error("tree all-reduce on rank {rank}, {phase}: {source}")]
    Nccl {
        rank: usize,
        phase: &'static str,
        #[source]
        source: Box<NcclCommError>,
    },
    #[error("tree all-reduce on rank {rank}, {op}: CUDA reported {message}")]
    Cuda {
        rank: usize,
        op: &'static str,
        message: String,
    },
}

/// Device memory freed on drop (with its context current).
struct Scratch {
    ptr: u64,
    floats: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `malloc_sync`, freed once; every use ended with a `wait`.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// The loaded add kernel and the scratch for received partials, kept between calls.
///
/// Needs a GPU and libnccl: nothing of it runs in the test suite (see the module's doc).
pub struct DeviceTree {
    ctx: Arc<CudaContext>,
    function: cudarc::driver::CudaFunction,
    _module: Arc<cudarc::driver::CudaModule>,
    scratch: Option<Scratch>,
}

pub(super) const SCATTER: &str = "sending partial sums to the chunk owners";
pub(super) const GATHER: &str = "gathering the summed chunks";

impl DeviceTree {
    /// Loads the add kernel on `ctx`'s device (`target` from `cuda::target_for`).
    pub fn new(ctx: &Arc<CudaContext>, target: &str) -> Result<DeviceTree, CudaError> {
        let load = |e: cudarc::driver::DriverError| CudaError::PtxLoad {
            kernel: ADD_KERNEL.into(),
            message: format!("{e:?}"),
        };
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(add_kernel_ptx(target)))
            .map_err(load)?;
        let function = module.load_function(ADD_KERNEL).map_err(load)?;
        Ok(DeviceTree {
            ctx: ctx.clone(),
            function,
            _module: module,
            scratch: None,
        })
    }

    /// The fixed-tree sum of every member's partials: the bits of `collective::total` (and
    /// of `Schedule::run_host`). Without a `root` (an all-reduce) every member of the
    /// schedule's group gets it in `out`; with one (a reduce) only world rank `root` does,
    /// and elsewhere `out` holds only the chunk the member owns. Waits at most `timeout` for
    /// each of its two exchanges; on an error or the deadline the communicator is aborted
    /// and the error names this rank, the phase and NCCL's operation.
    ///
    /// # Safety
    /// `mine[p]` is the device address of this member's partial `p` (in the order of its
    /// ranges in the schedule) and `out` of room for `schedule.len` f32, on `comm`'s device;
    /// `stream` is the stream `comm` was made with.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sum(
        &mut self,
        comm: &mut NcclComm,
        stream: &CudaStream,
        schedule: &Schedule,
        mine: &[u64],
        out: u64,
        root: Option<usize>,
        timeout: Duration,
    ) -> Result<(), DeviceTreeError> {
        let rank = comm.rank();
        let invalid = |what: String| DeviceTreeError::Invalid { rank, what };
        let me = schedule
            .member(rank)
            .ok_or_else(|| invalid(format!("not a member of the group {:?}", schedule.members)))?;
        if let Some(r) = root.filter(|r| schedule.member(*r).is_none()) {
            return Err(invalid(format!(
                "the root {r} is not a member of the group {:?}",
                schedule.members
            )));
        }
        if stream.cu_stream() != comm.stream() {
            return Err(invalid(
                "the stream is not the communicator's (the adds must follow the receives on one stream)".into(),
            ));
        }
        let want = schedule.ranges[me].len();
        if mine.len() != want {
            return Err(TreeError::Count {
                rank,
                got: mine.len(),
                want,
            }
            .into());
        }
        let plan = &schedule.chunks[me];
        let scratch = self.scratch_for(rank, schedule.scratch_floats(me))?;
        let f32s = |n: usize| 4 * n as u64;
        let nccl = |phase| {
            move |source| DeviceTreeError::Nccl {
                rank,
                phase,
                source: Box::new(source),
            }
        };

        // Every member's partial slices to each chunk's owner, in one group (the sends and
        // receives of a pair would deadlock issued one by one).
        comm.group_start().map_err(nccl(SCATTER))?;
        for (o, c) in schedule.chunks.iter().enumerate() {
            if o != me && !c.range.is_empty() {
                for &p in mine {
                    // SAFETY: `p` holds `len` f32 (the caller's contract), the chunk inside.
                    unsafe {
                        comm.send(p + f32s(c.range.start), c.range.len(), schedule.members[o])
                    }
                    .map_err(nccl(SCATTER))?;
                }
            }
        }
        if !plan.range.is_empty() {
            for rv in &plan.recvs {
                let at = scratch + f32s(rv.slot * schedule.chunk);
                // SAFETY: the scratch holds `scratch_slots` chunks.
                unsafe { comm.recv(at, plan.range.len(), schedule.members[rv.from]) }
                    .map_err(nccl(SCATTER))?;
            }
        }
        comm.group_end().map_err(nccl(SCATTER))?;
        comm.wait(timeout).map_err(nccl(SCATTER))?;

        // The tree's adds over this chunk, in the schedule's order.
        let n = plan.range.len();
        if n > 0 {
            let at = |s: Slot| match s {
                Slot::Mine(p) => mine[p] + f32s(plan.range.start),
                Slot::Scratch(k) => scratch + f32s(k * schedule.chunk),
                Slot::Out => out + f32s(plan.range.start),
            };
            let cuda = |op| {
                move |e| DeviceTreeError::Cuda {
                    rank,
                    op,
                    message: format!("{e:?}"),
                }
            };
            for op in &plan.program {
                self.launch_add(stream, at(op.dst), at(op.a), at(op.b), n as u64)
                    .map_err(cuda("launching the add kernel"))?;
            }
            if plan.result != Slot::Out {
                // SAFETY: both hold the chunk; same stream as the adds and the exchanges.
                unsafe {
                    result::memcpy_dtod_async(
                        at(Slot::Out),
                        at(plan.result),
                        4 * n,
                        stream.cu_stream(),
                    )
                }
                .map_err(cuda("copying the chunk's total"))?;
            }
        }

        // The owners' chunks to every member (or the root): copies, so exact.
        comm.group_start().map_err(nccl(GATHER))?;
        for (o, c) in schedule.chunks.iter().enumerate() {
            let peer = schedule.members[o];
            if o == me {
                continue;
            }
            if n > 0 && root.is_none_or(|r| r == peer) {
                // SAFETY: `out` holds `len` f32 (the caller's contract).
                unsafe { comm.send(out + f32s(plan.range.start), n, peer) }
                    .map_err(nccl(GATHER))?;
            }
            if !c.range.is_empty() && root.is_none_or(|r| r == rank) {
                // SAFETY: as above.
                unsafe { comm.recv(out + f32s(c.range.start), c.range.len(), peer) }
                    .map_err(nccl(GATHER))?;
            }
        }
        comm.group_end().map_err(nccl(GATHER))?;
        comm.wait(timeout).map_err(nccl(GATHER))
    }

    /// The scratch's address, grown to at least `floats` (0 when none is needed).
    fn scratch_for(&mut self, rank: usize, floats: usize) -> Result<u64, DeviceTreeError> {
        if floats == 0 {
            return Ok(0);
        }
        if self.scratch.as_ref().is_none_or(|s| s.floats < floats) {
            // The old buffer is idle: every call ends with a wait on the stream.
            self.scratch = None;
            let cuda = |e: cudarc::driver::DriverError| DeviceTreeError::Cuda {
                rank,
                op: "allocating scratch for the received partials",
                message: format!("{e:?} ({} bytes)", 4 * floats),
            };
            self.ctx.bind_to_thread().map_err(cuda)?;
            // SAFETY: a plain device allocation, freed by `Scratch`.
            let ptr = unsafe { result::malloc_sync(4 * floats) }.map_err(cuda)?;
            self.scratch = Some(Scratch {
                ptr,
                floats,
                ctx: self.ctx.clone(),
            });
        }
        Ok(self.scratch.as_ref().map_or(0, |s| s.ptr))
    }

    fn launch_add(
        &self,
        stream: &CudaStream,
        dst: u64,
        a: u64,
        b: u64,
        n: u64,
    ) -> Result<(), cudarc::driver::DriverError> {
        let mut l = stream.launch_builder(&self.function);
        l.arg(&dst);
        l.arg(&a);
        l.arg(&b);
        l.arg(&n);
        let cfg = LaunchConfig {
            grid_dim: (grid_for(n, BLOCK), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: three device pointers then a u64, as the kernel's parameters; each holds
        // `n` f32 (the slots of a chunk).
        unsafe { l.launch(cfg) }.map(drop)
    }
}
