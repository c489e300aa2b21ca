//! GPU ranks' sums over NCCL (`PARALLAX_NCCL=1`, `crate::cuda::nccl::sum`): every device of
//! the job joins one communicator, with an id made here or shared over the job's.

use super::{lock, Links, Ranks};
use crate::cuda::cudarc::driver::{CudaContext, CudaStream};
use crate::cuda::nccl::comm::NcclId;
use crate::cuda::nccl::sum::{fail, join_all};
use crate::cuda::CudaExecutor;
use crate::exec::ExecError;
use std::sync::Arc;
use std::time::Duration;

impl Ranks<CudaExecutor> {
    /// Sums over shards on the GPUs over NCCL instead of on the host (see the module). Every
    /// device of the job joins one NCCL communicator, whose ranks are the devices: in one
    /// process each device's thread joins with an id made here; in a job of processes rank
    /// 0's id is broadcast over the job's communicator. Joining waits at most `timeout`.
    pub fn use_nccl(&mut self, timeout: Duration) -> Result<(), ExecError> {
        let world = self.grid.devices();
        let first = self.first;
        // What each device's thread needs (an executor stays on its own thread).
        let places: Vec<(Arc<CudaContext>, Arc<CudaStream>, &'static str)> = self
            .devices
            .iter()
            .map(|d| {
                let e = &d.shards[0];
                (e.context().clone(), e.stream().clone(), e.target())
            })
            .collect();
        let id = match &self.links {
            Links::Threads { .. } => NcclId::new().map_err(|e| fail(e.to_string()))?,
            Links::Process(peers) => {
                let made = match first {
                    0 => Some(NcclId::new().map_err(|e| fail(e.to_string()))?),
                    _ => None,
                };
                let mut comm = lock(peers);
                let bytes =
                    crate::comm::rendezvous::share_id(&mut **comm, 0, made.map(|i| i.to_bytes()))
                        .map_err(|e| fail(e.to_string()))?;
                NcclId::from_bytes(bytes)
            }
        };
        let sums = join_all(&places, &id, first, world, timeout)?;
        self.set_device_sums(sums)
    }
}
