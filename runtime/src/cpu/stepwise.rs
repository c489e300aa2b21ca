//! Executors that share one copy of the parameters and optimizer state (the shards of a
//! simulated device, which drive a step kernel by kernel with `begin_step`, `run_kernel_at`
//! and `finish_step`) pass it between them; and what an executor allocated.

use super::tensor::Tensor;
use super::Executor;

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
