//! What the devices need of the executor of one micro-shard, beyond a step kernel by kernel
//! (`RankExecutor`) and the training interface (`Backend`): its memory, its parameters and
//! state by name, and a step's value with its shape. The CPU executor and the CUDA executor
//! both provide it, so simulated devices and GPU ranks run the same device code.

use crate::backend::Backend;
use crate::cpu::Executor;
use crate::cuda::{CudaExecutor, Precision};
use crate::exec::finite::Kind;
use crate::exec::{ExecError, RankExecutor};
use parallax_compiler::Plan;
use std::borrow::Cow;

/// A tensor's shape and values, as one rank passes it to the others.
pub(super) type Held = (Vec<usize>, Vec<f32>);

pub trait ShardExecutor: RankExecutor<Ctx: Sync> + Backend + Send + Sized {
    /// Bytes its buffers hold.
    fn allocated_bytes(&self) -> u64;
    /// Parameter (or, with `state`, optimizer state) `name` as held here.
    fn persistent(&self, name: &str, state: bool) -> Result<Option<Held>, ExecError>;
    /// The shape of parameter or state `name` as held here.
    fn persistent_shape(&self, name: &str, state: bool) -> Option<Vec<usize>>;
    /// Step `step`'s value after the step, with its shape (`None` where none is held).
    fn value_of(&self, step: usize) -> Result<Option<Held>, ExecError>;
    /// What a scan for non-finite values reads, in its order: `(kind, name, step)`. Empty
    /// where a scan would copy every tensor off a GPU after every step (see the CUDA
    /// `Backend::first_non_finite`).
    fn checked(&self) -> Vec<(Kind, String, usize)>;
    /// Step `step`'s f32 value, where held.
    fn held_f32(&self, step: usize) -> Result<Option<Cow<'_, [f32]>>, ExecError>;
}

/// Builds the executor of one micro-shard of a device: `(plan, device, the kernels of its
/// stage (None: all), its tensor rank)`.
pub type Make<'a, E> = dyn Fn(&Plan, usize, Option<&[bool]>, usize) -> Result<E, ExecError> + 'a;

impl ShardExecutor for Executor {
    fn allocated_bytes(&self) -> u64 {
        Executor::allocated_bytes(self)
    }

    fn persistent(&self, name: &str, state: bool) -> Result<Option<Held>, ExecError> {
        Ok(persistent_tensor(self, name, state).map(|t| (t.shape.clone(), t.f32().to_vec())))
    }

    fn persistent_shape(&self, name: &str, state: bool) -> Option<Vec<usize>> {
        persistent_tensor(self, name, state).map(|t| t.shape.clone())
    }

    fn value_of(&self, step: usize) -> Result<Option<Held>, ExecError> {
        Ok(self
            .value(step)
            .map(|t| (t.shape.clone(), t.f32().to_vec())))
    }

    fn checked(&self) -> Vec<(Kind, String, usize)> {
        Executor::checked(self).to_vec()
    }

    fn held_f32(&self, step: usize) -> Result<Option<Cow<'_, [f32]>>, ExecError> {
        Ok(Executor::held_f32(self, step).map(Cow::Borrowed))
    }
}

fn persistent_tensor<'a>(
    e: &'a Executor,
    name: &str,
    state: bool,
) -> Option<&'a crate::exec::tensor::Tensor> {
    if state {
        e.states().into_iter().find(|s| s.0 == name).map(|s| s.1)
    } else {
        e.params().find(|p| p.0 == name).map(|p| p.1)
    }
}

/// The CPU executor of one micro-shard (its parameters initialised as the tensor rank's
/// slice of the whole tensors, so every grid starts from the same values).
pub fn cpu(
    max_batch: usize,
    seed: u64,
) -> impl Fn(&Plan, usize, Option<&[bool]>, usize) -> Result<Executor, ExecError> {
    move |plan, _, owned, t| {
        Ok(Executor::for_kernels(
            plan.clone(),
            max_batch,
            seed,
            owned,
            t,
        ))
    }
}

/// The CUDA executor of one micro-shard of device `d`, on GPU `gpu(d)`.
pub fn cuda(
    max_batch: usize,
    seed: u64,
    precision: Precision,
    gpu: impl Fn(usize) -> usize,
) -> impl Fn(&Plan, usize, Option<&[bool]>, usize) -> Result<CudaExecutor, ExecError> {
    move |plan, d, owned, t| {
        if t > 0 || plan.tensor_parallel.is_some() {
            // Its parameters would start as whole tensors, not the tensor rank's slices.
            return Err(ExecError::Device(
                "tensor parallelism does not run on GPU ranks yet (data and pipeline parallelism do)".into(),
            ));
        }
        let mut e = CudaExecutor::new(plan.clone(), max_batch, seed, gpu(d), precision)
            .map_err(|e| ExecError::Device(format!("device {d} (GPU {}): {e}", gpu(d))))?;
        e.hold_only(owned);
        Ok(e)
    }
}

impl ShardExecutor for CudaExecutor {
    fn allocated_bytes(&self) -> u64 {
        CudaExecutor::allocated_bytes(self)
    }

    fn persistent(&self, name: &str, state: bool) -> Result<Option<Held>, ExecError> {
        self.persistent_value(name, state)
            .map_err(|e| ExecError::Cuda {
                step: 0,
                what: format!("copying `{name}` to the host"),
                source: Box::new(e),
            })
    }

    fn persistent_shape(&self, name: &str, state: bool) -> Option<Vec<usize>> {
        CudaExecutor::persistent_shape(self, name, state)
    }

    fn value_of(&self, step: usize) -> Result<Option<Held>, ExecError> {
        let shape = self.value_shape(step);
        Ok(RankExecutor::read(self, step)?.map(|v| (shape, v)))
    }

    fn checked(&self) -> Vec<(Kind, String, usize)> {
        Vec::new()
    }

    fn held_f32(&self, step: usize) -> Result<Option<Cow<'_, [f32]>>, ExecError> {
        Ok(RankExecutor::read(self, step)?.map(Cow::Owned))
    }
}
