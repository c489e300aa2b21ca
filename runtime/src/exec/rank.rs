//! What one rank's step asks of an executor of one micro-shard (`ranks::rank`): the step
//! driven kernel by kernel, a step's value read out or written in (what a collective or a
//! transfer carries), and the parameters and optimizer state lent between the executors of
//! one rank's shards. The CPU executor implements it; a GPU executor would too.

use super::{ExecError, Mode};

pub trait RankExecutor {
    /// What a step's kernels share (its batch, mode, step and first sample).
    type Ctx;
    /// The parameters and optimizer state, as lent to another executor of the same rank.
    type Persistent;

    /// Prepares a step of `batch` samples, the first of global index `first_sample`.
    fn begin_step(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<Self::Ctx, ExecError>;
    /// Runs kernel `k` of the plan.
    fn run_kernel(&mut self, k: usize, ctx: &Self::Ctx) -> Result<(), ExecError>;
    /// Plan step `step`'s value as floats (`None` where this executor holds none).
    fn read(&self, step: usize) -> Option<Vec<f32>>;
    /// Writes plan step `step`'s value from another rank (or another shard).
    fn write(&mut self, step: usize, values: &[f32]) -> Result<(), ExecError>;
    /// Applies the step's updates (after every rank's step succeeded).
    fn finish_step(&mut self, mode: Mode);
    fn take_persistent(&mut self) -> Self::Persistent;
    fn put_persistent(&mut self, persistent: Self::Persistent);
}
