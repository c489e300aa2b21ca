//! One simulated device's share of a step, run by its own thread: the rank code a real rank
//! (a process, a GPU) runs too. It walks the plan's kernels in plan order and does its part
//! of each: a compute kernel of its stage on each micro-shard it holds, its side of a
//! collective through its communicator with its own values only, the send of a pipeline
//! transfer its stage computes or the receive of one its stage reads.
//!
//! It cannot deadlock: every rank walks the same kernels in the same order, a rank blocks
//! only in a receive or a collective whose peers reach the same kernel, and sends are
//! buffered, so a peer never waits on a send; the earliest blocked call therefore always has
//! its messages on the way.

use super::Grid;
use crate::comm::collective::{partials, Partial};
use crate::comm::{CommError, Communicator};
use crate::exec::{DeviceSum, SumCall};
use crate::exec::{ExecError, Mode, RankExecutor};
use parallax_compiler::ir::{Group, Op, Phase};
use parallax_compiler::Plan;
use std::ops::Range;

/// One device: an executor per micro-shard its rank holds; the first owns the stage's
/// parameters and optimizer state, which the others borrow kernel by kernel.
pub(super) struct Device<E> {
    pub shards: Vec<E>,
    /// Sums over shards done where the values live (GPU ranks over NCCL); `None`: on the
    /// host, through the communicator.
    pub sum: Option<Box<dyn DeviceSum<E>>>,
}

/// What every rank knows of a step: the plan, the grid and which shards each data rank
/// holds.
pub(super) struct Step<'a> {
    pub plan: &'a Plan,
    pub kernel_stage: &'a [usize],
    pub grid: Grid,
    /// The shards of the step's batch each data rank holds.
    pub owners: &'a [Range<usize>],
    /// Shards in the step's batch.
    pub leaves: usize,
    pub mode: Mode,
}

impl Grid {
    /// The device (world rank) of data rank `r`, tensor rank `t`, stage `s`.
    pub(super) fn device(&self, r: usize, t: usize, s: usize) -> usize {
        (r * self.tp + t) * self.pp + s
    }

    /// The data rank, tensor rank and stage of device `d`.
    pub(super) fn place(&self, d: usize) -> (usize, usize, usize) {
        (d / (self.pp * self.tp), d / self.pp % self.tp, d % self.pp)
    }
}

impl<E: RankExecutor> Device<E> {
    /// Runs device `me`'s share of a step (its shards' contexts from `begin_step`) and, when
    /// every rank succeeded, commits its updates. A failure anywhere fails every rank's step.
    pub(super) fn step(
        &mut self,
        me: usize,
        ctxs: &[E::Ctx],
        step: &Step,
        comm: &mut dyn Communicator,
    ) -> Result<(), ExecError> {
        let result = self.kernels(me, ctxs, step, comm);
        let any = comm.any_failed(result.is_err());
        result?;
        if any {
            return Err(CommError::OthersFailed { rank: me }.into());
        }
        self.shards[0].finish_step(step.mode)
    }

    fn kernels(
        &mut self,
        me: usize,
        ctxs: &[E::Ctx],
        step: &Step,
        comm: &mut dyn Communicator,
    ) -> Result<(), ExecError> {
        let Step {
            plan, grid, owners, ..
        } = *step;
        let (r, t, s) = grid.place(me);
        for (k, kernel) in plan.kernels.iter().enumerate() {
            if !step.mode.runs(plan, k) {
                continue;
            }
            let stage = step.kernel_stage[k];
            let Some(&last) = kernel.steps.last() else {
                continue;
            };
            let st = &plan.steps[last];
            // Under ZeRO-1 a parameter's update runs only on the data rank holding its state.
            let takes_part = |q: usize| st.owner.is_none_or(|o| o as usize == q);
            // The update runs once per device, where the parameters live; the rest once per
            // shard.
            let update = st.phase == Phase::Update;
            let runs = |q: usize| if update { 1 } else { owners[q].len() };
            let operand = st.operands.first().copied().unwrap_or(last);
            match st.op {
                Op::Transfer { from, .. } => {
                    let from = from as usize;
                    if !takes_part(r) || reduced_elsewhere(plan, operand, r) {
                        continue;
                    }
                    // The stage that computed the value sends it, shard by shard; the stage
                    // that reads it receives (or copies, within one stage).
                    if s == from && s != stage {
                        for j in 0..runs(r) {
                            let v = self.sent(me, operand, j, step)?;
                            comm.send(grid.device(r, t, stage), v)?;
                        }
                    }
                    if s == stage {
                        for j in 0..runs(r) {
                            let v = if from == s {
                                self.sent(me, operand, j, step)?
                            } else {
                                comm.recv(grid.device(r, t, from))?
                            };
                            self.shards[j].write(last, &v)?;
                        }
                    }
                }
                _ if s != stage => {}
                Op::Broadcast { root } => {
                    let root = root as usize;
                    // One broadcast per shard index, among the data ranks that run it.
                    let most = (0..grid.dp).filter(|&q| takes_part(q)).map(runs).max();
                    for j in 0..most.unwrap_or(0) {
                        let group: Vec<usize> = (0..grid.dp)
                            .filter(|&q| q == root || (takes_part(q) && j < runs(q)))
                            .map(|q| grid.device(q, t, s))
                            .collect();
                        if !group.contains(&me) {
                            continue;
                        }
                        let mut v = if r == root {
                            self.sent(me, operand, j, step)?
                        } else {
                            Vec::new()
                        };
                        comm.broadcast(&group, grid.device(root, t, s), &mut v)?;
                        if takes_part(r) && j < runs(r) {
                            self.shards[j].write(last, &v)?;
                        }
                    }
                }
                Op::AllReduce {
                    group: Group::Shards,
                } => self.shard_sum(me, last, operand, None, step, comm)?,
                Op::Reduce { root } => {
                    self.shard_sum(me, last, operand, Some(root as usize), step, comm)?
                }
                Op::AllReduce {
                    group: Group::Tensor,
                } => {
                    // Shard by shard (as the kernel before it ran), over the tensor ranks of
                    // this data rank and stage.
                    let group: Vec<usize> = (0..grid.tp).map(|u| grid.device(r, u, s)).collect();
                    for j in 0..runs(r) {
                        let mine = vec![Partial {
                            range: t..t + 1,
                            values: value(&self.shards[j], operand)?,
                        }];
                        let total = comm.all_reduce(&group, grid.tp, mine)?;
                        self.shards[j].write(last, &total)?;
                    }
                }
                _ if !takes_part(r) => {}
                _ => {
                    for (j, ctx) in ctxs.iter().enumerate().take(runs(r)) {
                        self.compute(k, j, ctx)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs kernel `k` on shard `j`, which borrows the parameters from shard 0.
    fn compute(&mut self, k: usize, j: usize, ctx: &E::Ctx) -> Result<(), ExecError> {
        if j == 0 {
            return self.shards[0].run_kernel(k, ctx);
        }
        let persistent = self.shards[0].take_persistent();
        if let Err(e) = self.shards[j].put_persistent(persistent) {
            // The loan was refused (a GPU executor of another device): the lender takes it back.
            let back = self.shards[j].take_persistent();
            self.shards[0].put_persistent(back)?;
            return Err(e);
        }
        let result = self.shards[j].run_kernel(k, ctx);
        let persistent = self.shards[j].take_persistent();
        self.shards[0].put_persistent(persistent)?;
        result
    }

    /// The sum over every shard of `operand` into step `out`, on each of this device's
    /// shards (on data rank `root`'s only, for a reduce): this device passes the subtree
    /// sums of its shards, its data-parallel group (same tensor rank and stage) the rest.
    fn shard_sum(
        &mut self,
        me: usize,
        out: usize,
        operand: usize,
        root: Option<usize>,
        step: &Step,
        comm: &mut dyn Communicator,
    ) -> Result<(), ExecError> {
        let grid = step.grid;
        let (r, t, s) = grid.place(me);
        let group: Vec<usize> = (0..grid.dp).map(|q| grid.device(q, t, s)).collect();
        if let Some(sum) = self.sum.as_mut() {
            let call = SumCall {
                group: &group,
                held: step.owners,
                member: r,
                leaves: step.leaves,
                operand,
                out,
                root,
            };
            return sum.sum(&mut self.shards, &call);
        }
        let own = step.owners[r].clone();
        // Read first (a read can fail on a GPU); the tree takes each shard's values once.
        let read: Vec<Vec<f32>> = (0..own.len())
            .map(|i| value(&self.shards[i], operand))
            .collect::<Result<_, _>>()?;
        let read: Vec<std::cell::Cell<Vec<f32>>> =
            read.into_iter().map(std::cell::Cell::new).collect();
        let mine = partials(step.leaves, own.clone(), &|i| read[i - own.start].take());
        let total = match root {
            None => Some(comm.all_reduce(&group, step.leaves, mine)?),
            Some(root) => comm.reduce(&group, grid.device(root, t, s), step.leaves, mine)?,
        };
        if let Some(total) = total {
            // A device without shards this step still updates its own copy.
            for e in self.shards.iter_mut().take(own.len().max(1)) {
                e.write(out, &total)?;
            }
        }
        Ok(())
    }

    /// What this device sends of `operand` for shard `j`: parameters and optimizer state
    /// live with its first shard, other values with their shard.
    fn sent(
        &self,
        me: usize,
        operand: usize,
        j: usize,
        step: &Step,
    ) -> Result<Vec<f32>, ExecError> {
        let holder = if step.plan.steps[operand].op.is_source() {
            0
        } else {
            j
        };
        let held = match self.shards.get(holder) {
            Some(e) => e.read(operand)?,
            None => None,
        };
        match held {
            Some(v) => Ok(v),
            None => Err(ExecError::Device(format!(
                "transfer: device {me} does not hold the value it sends"
            ))),
        }
    }
}

/// A shard's value of `step` (empty when it holds none).
fn value<E: RankExecutor>(e: &E, step: usize) -> Result<Vec<f32>, ExecError> {
    Ok(e.read(step)?.unwrap_or_default())
}

/// Whether `step`'s value is a reduce's total (perhaps passed on by transfers) that data rank
/// `r` does not receive: it holds nothing of it to send on.
fn reduced_elsewhere(plan: &Plan, mut step: usize, r: usize) -> bool {
    loop {
        match plan.steps[step].op {
            Op::Reduce { root } => return root as usize != r,
            Op::Transfer { .. } => match plan.steps[step].operands.first() {
                Some(&o) => step = o,
                None => return false,
            },
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Device, Step};
    use crate::comm::Communicator;
    use crate::cuda::{CudaExecutor, StepCtx};
    use crate::exec::ExecError;

    type RankStep = fn(
        &mut Device<CudaExecutor>,
        usize,
        &[StepCtx],
        &Step,
        &mut dyn Communicator,
    ) -> Result<(), ExecError>;

    /// A compile-time check only (nothing runs on a GPU): the rank code, generic over
    /// `RankExecutor`, is instantiated with the CUDA executor.
    #[test]
    fn the_rank_code_drives_the_cuda_executor() {
        let step: RankStep = Device::<CudaExecutor>::step;
        std::hint::black_box(step);
    }
}
