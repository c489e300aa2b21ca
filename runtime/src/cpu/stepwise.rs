//! Driving an executor from outside, as simulated devices do: a step kernel by kernel (so
//! shards and collectives can interleave), parameters and optimizer state passed between
//! executors that share one copy, and what the executor allocated.

use super::kernels::Ctx;
use super::tensor::Tensor;
use super::{ExecError, Executor, Mode};

impl Executor {
    /// Starts a step that a coordinator drives kernel by kernel (`run_kernel_at`, then
    /// `finish_step`): simulated devices interleave shards and collectives this way.
    pub fn begin_step(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<Ctx, ExecError> {
        self.begin(batch, mode, step, first_sample)
    }

    /// Runs kernel `k` of the step `begin_step` started.
    pub fn run_kernel_at(&mut self, k: usize, ctx: &Ctx) -> Result<(), ExecError> {
        self.run_kernel(k, ctx)
    }

    /// Ends a step `begin_step` started (training replaces parameters and state).
    pub fn finish_step(&mut self, mode: Mode) {
        self.finish(mode)
    }

    /// Moves the parameters and optimizer state out (in plan order), leaving empty buffers:
    /// executors that share one copy (the shards of a simulated device) pass it around.
    pub fn take_persistent(&mut self) -> Vec<Tensor> {
        self.persistent_steps()
            .into_iter()
            .map(|id| std::mem::take(self.buf_mut(id)))
            .collect()
    }

    /// Puts back what `take_persistent` (of this or an identical executor) moved out.
    pub fn put_persistent(&mut self, values: Vec<Tensor>) {
        for (id, t) in self.persistent_steps().into_iter().zip(values) {
            *self.buf_mut(id) = t;
        }
    }

    /// The steps of the parameters, then the optimizer state.
    fn persistent_steps(&self) -> Vec<usize> {
        self.params
            .iter()
            .chain(&self.states)
            .map(|p| p.1)
            .collect()
    }

    /// Bytes its buffers hold (every plan buffer and the staging scratch).
    pub fn allocated_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .chain(std::iter::once(&self.scratch))
            .map(Tensor::allocated_bytes)
            .sum()
    }
}
