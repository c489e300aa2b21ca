//! The collectives on a GPU, as `parallax collectives-check` measures them
//! (`scripts/gpu-check.sh`): NCCL's all-reduce at world size 1, and the data-parallel
//! all-reduce on simulated ranks against one rank.

use super::gpu::{session, CheckError};
use super::kernels::rel_diff;
use crate::backend::Backend;
use crate::cuda::{self, CudaError, CudaExecutor, Precision};
use crate::data::Values;
use crate::exec::Mode;
use parallax_compiler::{Plan, Source};
use std::path::Path;
use std::sync::Arc;

/// `collectives-check`'s rows for `scripts/gpu-check.sh`: NCCL's all-reduce at world size 1,
/// and a 4-rank data-parallel gradient step (simulated ranks on one GPU) against the 1-rank
/// step of `source`; `Ok(false)` when the step's row failed. A GPU that cannot be opened or data that
/// cannot be read is an error.
pub fn collectives(
    source: &Source,
    plan: Plan,
    base_dir: &Path,
) -> Result<(Vec<String>, bool), CheckError> {
    let gpu = Gpu::open()?;
    let nccl = match gpu.nccl_world_one() {
        Ok(d) => format!("{d:.1e}"),
        Err(e) => format!("error: {e}"),
    };
    let mut rows = vec![format!(
        "ROW|nccl all-reduce, world size 1|fp32|{nccl}|-|{}|-|-|-",
        if nccl == "0.0e0" { "ok" } else { "FAIL" }
    )];
    let ranks = 4usize;
    let ok = match gpu.data_parallel(source, plan, base_dir, ranks) {
        Ok(d) => {
            let name = &source.experiment.name;
            let ok = d <= 1e-5;
            let verdict = if ok { "ok" } else { "FAIL" };
            rows.push(format!(
                "ROW|dp{ranks} simulated ranks vs 1 rank ({name})|fp32|-|{d:.2e}|{verdict}|-|-|-"
            ));
            ok
        }
        Err(e @ CheckError::Data(_)) => return Err(e),
        Err(e) => {
            rows.push(format!(
                "ROW|dp{ranks} simulated ranks vs 1 rank|fp32|-|error: {e}|FAIL|-|-|-"
            ));
            false
        }
    };
    // The NCCL row is the table's to judge; the exit code is the step's.
    Ok((rows, ok))
}

/// GPU 0, opened for the collectives checks.
pub struct Gpu {
    ctx: Arc<cuda::cudarc::driver::CudaContext>,
    target: &'static str,
}

impl Gpu {
    pub fn open() -> Result<Gpu, CudaError> {
        let devices = cuda::probe()?;
        let target = cuda::target_for(devices.gpus[0].compute_capability);
        let ctx = cuda::cudarc::driver::CudaContext::new(0).map_err(CudaError::from)?;
        Ok(Gpu { ctx, target })
    }

    /// NCCL's all-reduce at world size 1 (of 1 Mi values): its largest difference.
    pub fn nccl_world_one(&self) -> Result<f32, CudaError> {
        cuda::nccl::world_one_all_reduce(&self.ctx, 1 << 20)
    }

    /// Data parallelism on `ranks` simulated ranks (on this GPU): each rank takes its share
    /// of one batch and computes its gradients; the all-reduce sums them; the sum over the
    /// ranks is compared with the whole batch's gradients on one rank. Returns the largest
    /// relative difference of any gradient. A [`CheckError::Data`] comes before any GPU work.
    pub fn data_parallel(
        &self,
        source: &Source,
        plan: Plan,
        base_dir: &Path,
        ranks: usize,
    ) -> Result<f64, CheckError> {
        let e = &source.experiment;
        let batch = e.train.batch_size as usize;
        let shard = batch / ranks;
        let seed = e.train.seed;
        // The data only: this check runs no CPU executor.
        let mut session = session(source, &plan, base_dir)?;
        let b = session.loader.next().expect("the loader runs forever");
        let per = |v: &Values| match v {
            Values::F32(x) => x.len() / b.size,
            Values::I32(x) => x.len() / b.size,
        };
        let cut = |v: &Values, r: usize| {
            let p = per(v);
            match v {
                Values::F32(x) => Values::F32(x[r * shard * p..(r + 1) * shard * p].to_vec()),
                Values::I32(x) => Values::I32(x[r * shard * p..(r + 1) * shard * p].to_vec()),
            }
        };
        let grads = plan.grads.clone();
        let put = |x: &mut CudaExecutor, name: &str, size: usize, v: &Values| {
            x.set_input(name, size, v)
                .map_err(|e| CudaError::Exec(e.to_string()))
        };
        let mut full = CudaExecutor::new(plan.clone(), batch, seed, 0, Precision::Fp32)?;
        put(&mut full, &session.input, b.size, &b.inputs)?;
        put(&mut full, &session.target, b.size, &b.targets)?;
        full.run(b.size, Mode::Gradients, 0, 0)?;
        full.synchronize()?;
        let mut execs = Vec::new();
        for r in 0..ranks {
            let mut x = CudaExecutor::new(plan.clone(), shard, seed, 0, Precision::Fp32)?;
            put(&mut x, &session.input, shard, &cut(&b.inputs, r))?;
            put(&mut x, &session.target, shard, &cut(&b.targets, r))?;
            x.run(shard, Mode::Gradients, 0, (r * shard) as u64)?;
            x.synchronize()?;
            execs.push(x);
        }
        let sum = cuda::nccl::SimulatedRanks::new(&self.ctx, ranks, self.target)?;
        let mut worst = 0f64;
        for &(_, g) in &grads {
            let n = full.value(g, b.size)?.len();
            let ptrs = execs
                .iter()
                .map(|x| x.device_ptr(g))
                .collect::<Result<Vec<_>, _>>()?;
            sum.all_reduce(execs[0].stream(), &ptrs, n as u64)?;
            execs[0].synchronize()?;
            let reduced: Vec<f32> = execs[0]
                .value(g, shard)?
                .iter()
                .map(|v| v / ranks as f32)
                .collect();
            worst = worst.max(rel_diff(&full.value(g, b.size)?, &reduced));
        }
        Ok(worst)
    }
}
