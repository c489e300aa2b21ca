//! What one rank's step asks of an executor of one micro-shard (`ranks::rank`): the step
//! driven kernel by kernel, a step's value read out or written in (what a collective or a
//! transfer carries), and the parameters and optimizer state lent between the executors of
//! one rank's shards. The CPU executor (`cpu::stepwise`) and the CUDA executor
//! (`cuda::stepwise`) implement it. Reads, the commit and a loan can fail on a GPU (a copy,
//! a launch, a loan across devices), so they return errors too.

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
    fn read(&self, step: usize) -> Result<Option<Vec<f32>>, ExecError>;
    /// Writes plan step `step`'s value from another rank (or another shard).
    fn write(&mut self, step: usize, values: &[f32]) -> Result<(), ExecError>;
    /// Applies the step's updates (after every rank's step succeeded).
    fn finish_step(&mut self, mode: Mode) -> Result<(), ExecError>;
    /// Lends the parameters and optimizer state out; this executor cannot use them until
    /// they are put back.
    fn take_persistent(&mut self) -> Self::Persistent;
    /// Installs what `take_persistent` of this or an identical executor lent. A refused loan
    /// is kept as it came: the next `take_persistent` returns it, for the lender to take back.
    fn put_persistent(&mut self, persistent: Self::Persistent) -> Result<(), ExecError>;
}

/// A device's sums over micro-shards done where its values live (GPU ranks over NCCL), in
/// place of the host path (each shard's values read, summed along the fixed tree through
/// the communicator). It must give the same bits: the fixed tree over the step's shards.
pub trait DeviceSum<E>: Send {
    /// Sums step `call.operand` over the step's shards into step `call.out` of each of this
    /// device's `shards` that ran this step (of `shards[0]` when none did); with
    /// `call.root`, only that member needs the total.
    fn sum(&mut self, shards: &mut [E], call: &SumCall) -> Result<(), ExecError>;
}

/// One sum over shards, as every member of its group sees it.
#[derive(Debug)]
pub struct SumCall<'a> {
    /// The devices (world ranks) taking part, in data-rank order.
    pub group: &'a [usize],
    /// The shards of the step each member holds (member `q`: `held[q]`).
    pub held: &'a [std::ops::Range<usize>],
    /// This device's place in `group`.
    pub member: usize,
    /// Shards in the step.
    pub leaves: usize,
    pub operand: usize,
    pub out: usize,
    /// The member that needs the total (`None`: every member).
    pub root: Option<usize>,
}
