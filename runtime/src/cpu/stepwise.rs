//! Executors that share one copy of the parameters and optimizer state (the shards of one
//! rank, which drive a step kernel by kernel through `RankExecutor`) pass it between them;
//! and what an executor allocated.

use super::kernels::Ctx;
use super::tensor::Tensor;
use super::{ExecError, Executor, Mode};
use crate::exec::RankExecutor;

impl RankExecutor for Executor {
    type Ctx = Ctx;
    type Persistent = Vec<Tensor>;

    fn begin_step(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<Ctx, ExecError> {
        Executor::begin_step(self, batch, mode, step, first_sample)
    }

    fn run_kernel(&mut self, k: usize, ctx: &Ctx) -> Result<(), ExecError> {
        self.run_kernel_at(k, ctx)
    }

    fn read(&self, step: usize) -> Result<Option<Vec<f32>>, ExecError> {
        Ok(self.value(step).map(|v| v.f32().to_vec()))
    }

    fn write(&mut self, step: usize, values: &[f32]) -> Result<(), ExecError> {
        self.receive(step, values)
    }

    fn finish_step(&mut self, mode: Mode) -> Result<(), ExecError> {
        Executor::finish_step(self, mode);
        Ok(())
    }

    fn take_persistent(&mut self) -> Vec<Tensor> {
        Executor::take_persistent(self)
    }

    fn put_persistent(&mut self, persistent: Vec<Tensor>) -> Result<(), ExecError> {
        Executor::put_persistent(self, persistent);
        Ok(())
    }
}

impl Executor {
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

    /// Writes values from another rank (a transfer, a broadcast leg, a collective's total) as
    /// step `step`'s value, in the shape the plan gives it at this step's batch: every rank
    /// knows that shape from the plan, so none travels with the values. A step without a
    /// buffer of its own keeps nothing.
    pub fn receive(&mut self, step: usize, values: &[f32]) -> Result<(), ExecError> {
        let Some(b) = self.slot.get(step).copied().flatten() else {
            return Ok(());
        };
        self.shape_buffer(step);
        let t = &mut self.buffers[b];
        if !t.is_f32() || t.numel() != values.len() {
            return Err(ExecError::Device(format!(
                "step {step} received {} f32 values for a tensor of shape {:?}",
                values.len(),
                t.shape
            )));
        }
        t.f32_mut().copy_from_slice(values);
        Ok(())
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
