//! NCCL, all of it: `comm` a communicator over NCCL's raw layer that never hangs or panics,
//! `tree` the fixed-tree all-reduce on GPUs over it, `sum` GPU ranks' sums over shards with
//! it (`PARALLAX_NCCL=1`). Here: a world-size-1 NCCL all-reduce where NCCL can run, and a
//! simulated-ranks all-reduce that runs a multi-rank collective on one GPU (NCCL refuses two
//! ranks on one device). Both sum in rank order, so results do not depend on timing.

pub mod comm;
pub mod sum;
pub mod tree;

use crate::cuda::probe::nccl_version;
use crate::cuda::CudaError;
use cudarc::driver::{CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nccl::{Comm, ReduceOp};
use parallax_compiler::codegen::builder::Kernel;
use parallax_compiler::codegen::{grid_for, Arg, Gen, BLOCK};
use std::sync::Arc;

/// Asserts that an error's text names each of `parts` (what the error tests check).
#[cfg(test)]
fn assert_names(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "{text:?} lacks {part:?}");
    }
}

fn nccl_err(e: cudarc::nccl::result::NcclError) -> CudaError {
    CudaError::Nccl(format!("{e:?}"))
}

/// A world-size-1 NCCL all-reduce (sum) of `n` values on GPU 0: the real library calls.
/// Returns the largest difference from the input (a one-rank sum is the identity).
pub fn world_one_all_reduce(ctx: &Arc<CudaContext>, n: usize) -> Result<f32, CudaError> {
    if nccl_version().is_none() {
        return Err(CudaError::MissingLibrary {
            library: "libnccl.so",
            hint: "install NCCL (the nvidia-nccl wheel ships libnccl.so.2: link it as libnccl.so in a folder on LD_LIBRARY_PATH)",
        });
    }
    let stream = ctx.default_stream();
    let comms = Comm::from_devices(vec![stream.clone()]).map_err(nccl_err)?;
    let values: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.25 - 3.0).collect();
    let send = stream.clone_htod(&values)?;
    let mut recv = stream.alloc_zeros::<f32>(n)?;
    comms[0]
        .all_reduce(&send, &mut recv, &ReduceOp::Sum)
        .map_err(nccl_err)?;
    let back = stream.clone_dtoh(&recv)?;
    stream.synchronize()?;
    Ok(back
        .iter()
        .zip(&values)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max))
}

/// An all-reduce over `ranks` buffers on one GPU: every buffer ends with the sum of all,
/// added in rank order.
pub struct SimulatedRanks {
    ranks: usize,
    function: cudarc::driver::CudaFunction,
    _module: Arc<cudarc::driver::CudaModule>,
}

impl SimulatedRanks {
    pub fn new(ctx: &Arc<CudaContext>, ranks: usize, target: &str) -> Result<Self, CudaError> {
        let mut g = Gen::new();
        let mut k = Kernel::new("px_rank_sum");
        let ptrs: Vec<_> = (0..ranks).map(|r| k.param_ptr(Arg::Value(r))).collect();
        let n = k.param_u64(Arg::U64(0));
        let (i, s) = k.global_index();
        k.for_range(i, n, s, |k, i| {
            let mut acc = k.load(ptrs[0], i);
            for &p in &ptrs[1..] {
                let v = k.load(p, i);
                acc = k.add(acc, v);
            }
            for &p in &ptrs {
                k.store(p, i, acc);
            }
        });
        g.launch(k, 1, BLOCK);
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(g.text(target)))
            .map_err(|e| CudaError::PtxLoad {
                kernel: "px_rank_sum".into(),
                message: format!("{e:?}"),
            })?;
        let function = module
            .load_function("px_rank_sum")
            .map_err(|e| CudaError::PtxLoad {
                kernel: "px_rank_sum".into(),
                message: format!("{e:?}"),
            })?;
        Ok(SimulatedRanks {
            ranks,
            function,
            _module: module,
        })
    }

    /// Sums `n` f32 values at each of the device addresses (one per rank) into all of them.
    pub fn all_reduce(&self, stream: &CudaStream, ptrs: &[u64], n: u64) -> Result<(), CudaError> {
        if ptrs.len() != self.ranks {
            return Err(CudaError::Exec(format!(
                "{} buffers for {} ranks",
                ptrs.len(),
                self.ranks
            )));
        }
        let mut b = stream.launch_builder(&self.function);
        for p in ptrs {
            b.arg(p);
        }
        b.arg(&n);
        let cfg = LaunchConfig {
            grid_dim: (grid_for(n, BLOCK), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one pointer per rank parameter, then the count; every buffer holds `n`.
        unsafe { b.launch(cfg) }.map_err(|e| CudaError::PtxLoad {
            kernel: "px_rank_sum".into(),
            message: format!("launch failed: {e:?}"),
        })?;
        Ok(())
    }
}
