//! Simulated devices: a partitioned plan run by N device workers in one process, each with its
//! own memory (capped like the GPU it stands for). Devices form a grid of data-parallel ranks
//! times pipeline stages. A rank holds whole micro-shards of each batch
//! (`parallax_compiler::shards`); a stage holds a contiguous run of layers (the `pipeline`
//! pass), their parameters and optimizer state, and runs only their kernels. The plan's
//! collectives run through the collective library (`crate::collective`), its transfers copy a
//! value from the stage that computed it to the one that reads it. Every device runs in
//! lockstep, kernel by kernel, and every cross-shard sum follows one fixed tree, so the
//! result has the same bits on any grid (tests check it).

use crate::backend::{Backend, ParamValues};
use crate::collective::{partials, Collective, InProcess};

mod backend;
use crate::cpu::kernels::Ctx;
use crate::cpu::tensor as slice;
use crate::cpu::{ExecError, Executor};
use crate::data::Values;
use parallax_compiler::ir::{Group, Op, Phase};
use parallax_compiler::plan::bytes;
use parallax_compiler::shards::{assign, Sharding};
use parallax_compiler::Plan;
use std::collections::HashMap;
use std::ops::Range;

/// One simulated device: an executor per micro-shard its rank holds; the first owns the
/// stage's parameters and optimizer state, which the others borrow kernel by kernel.
struct Device {
    shards: Vec<Executor>,
}

pub use crate::grid::Grid;

pub struct SimulatedDevices {
    plan: Plan,
    sharding: Sharding,
    grid: Grid,
    /// Data rank, then tensor rank, then stage: device `(r * tp + t) * pp + s`.
    devices: Vec<Device>,
    kernel_stage: Vec<usize>,
    collective: InProcess,
    /// The tensor-parallel ranks' all-reduces.
    tensor: InProcess,
    /// Point-to-point sends: pipeline transfers and broadcasts' legs.
    p2p: InProcess,
    /// Inputs with a batch axis, as set for the whole batch: split into shards at `run`.
    batched: HashMap<String, (usize, Values)>,
    /// Whether a shard's share of the loss is its counted labels' (`loss_share`).
    counts_labels: bool,
    /// The shards of the last step, and which rank held them.
    last: Vec<Range<usize>>,
    owners: Vec<Range<usize>>,
}

/// What a device holds after setup, in bytes (its executors' allocations).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemory {
    pub device: usize,
    pub rank: usize,
    pub tensor_rank: usize,
    pub stage: usize,
    pub shards: usize,
    pub bytes: u64,
}

impl SimulatedDevices {
    /// `plan` must be a per-shard plan (`Plan::sharding` set). Each device gets `capacity`
    /// bytes; a device whose buffers do not fit is refused before anything runs.
    pub fn new(
        plan: Plan,
        grid: Grid,
        seed: u64,
        capacity: u64,
    ) -> Result<SimulatedDevices, ExecError> {
        let Some(sharding) = plan.sharding else {
            return Err(ExecError::Device(
                "simulated devices run a per-shard plan (compiled with micro-shards)".into(),
            ));
        };
        let grid = Grid {
            dp: grid.dp.max(1),
            tp: grid.tp.max(1),
            pp: grid.pp.max(1),
        };
        let degree = plan
            .tensor_parallel
            .as_ref()
            .map_or(1, |t| t.degree as usize);
        if degree != grid.tp {
            return Err(ExecError::Device(format!(
                "the plan is built for {degree} tensor-parallel rank(s), the grid has {}",
                grid.tp
            )));
        }
        if plan.pipeline_stages as usize != grid.pp {
            return Err(ExecError::Device(format!(
                "the plan is built for {} pipeline stage(s), the grid has {}",
                plan.pipeline_stages, grid.pp
            )));
        }
        if plan.optimizer_shards > 1 && plan.optimizer_shards as usize != grid.dp {
            return Err(ExecError::Device(format!(
                "the plan shards the optimizer state over {} rank(s), the grid has {}",
                plan.optimizer_shards, grid.dp
            )));
        }
        let kernel_stage: Vec<usize> = plan
            .kernel_stages()
            .into_iter()
            .map(|s| s as usize)
            .collect();
        let max_batch = plan.batch_size as usize;
        let mut devices = Vec::with_capacity(grid.devices());
        for (rank, held) in assign(sharding.shards as usize, grid.dp)
            .into_iter()
            .enumerate()
        {
            for t in 0..grid.tp {
                for stage in 0..grid.pp {
                    let owned = plan.kernel_mask(stage as u32, rank as u32);
                    let owned = owned.as_deref();
                    // Even a rank without shards holds the parameters and runs the update.
                    let mut shards: Vec<Executor> = (0..held.len().max(1))
                        .map(|_| Executor::for_kernels(plan.clone(), max_batch, seed, owned, t))
                        .collect();
                    for e in shards.iter_mut().skip(1) {
                        drop(e.take_persistent());
                    }
                    devices.push(Device { shards });
                }
            }
        }
        let sim = SimulatedDevices {
            counts_labels: crate::loss_share::counts_labels(&plan),
            plan,
            sharding,
            grid,
            devices,
            kernel_stage,
            collective: InProcess::new(grid.dp),
            tensor: InProcess::new(grid.tp),
            p2p: InProcess::new(grid.devices()),
            batched: HashMap::new(),
            last: Vec::new(),
            owners: Vec::new(),
        };
        for m in sim.memory() {
            if m.bytes > capacity {
                return Err(ExecError::Device(format!(
                    "simulated device {} (rank {}, tensor rank {}, stage {}) runs out of memory: its {} micro-shard(s) need {} but it has {}",
                    m.device,
                    m.rank,
                    m.tensor_rank,
                    m.stage,
                    m.shards,
                    bytes(m.bytes),
                    bytes(capacity)
                )));
            }
        }
        Ok(sim)
    }

    /// What each device allocated.
    pub fn memory(&self) -> Vec<DeviceMemory> {
        self.devices
            .iter()
            .enumerate()
            .map(|(device, d)| DeviceMemory {
                device,
                rank: device / (self.grid.pp * self.grid.tp),
                tensor_rank: device / self.grid.pp % self.grid.tp,
                stage: device % self.grid.pp,
                shards: d.shards.len(),
                bytes: d.shards.iter().map(Executor::allocated_bytes).sum(),
            })
            .collect()
    }

    fn device(&self, rank: usize, tensor_rank: usize, stage: usize) -> usize {
        (rank * self.grid.tp + tensor_rank) * self.grid.pp + stage
    }

    /// The executor of shard `i` of the last step on `stage` of tensor rank `t`.
    fn shard(&self, t: usize, stage: usize, i: usize) -> &Executor {
        let r = self.owners.iter().position(|o| o.contains(&i)).unwrap_or(0);
        let j = i.saturating_sub(self.owners.get(r).map_or(0, |o| o.start));
        &self.devices[self.device(r, t, stage)].shards[j]
    }

    fn stage_of_step(&self, step: usize) -> usize {
        self.plan.steps[step].stage as usize
    }

    /// Runs kernel `k` on every shard of its stage, or the collective it is.
    fn kernel(&mut self, k: usize, ctxs: &[Vec<Ctx>]) -> Result<(), ExecError> {
        let stage = self.kernel_stage[k];
        let last = *self.plan.kernels[k]
            .steps
            .last()
            .expect("a kernel has steps");
        let (op, phase) = (&self.plan.steps[last].op, self.plan.steps[last].phase);
        // A reduce is an all-reduce over the shards delivered to one rank.
        let (group, to) = match op {
            Op::AllReduce { group } => (Some(*group), None),
            Op::Reduce { root } => (Some(Group::Shards), Some(*root as usize)),
            _ => (None, None),
        };
        // Under ZeRO-1 a parameter's update runs only on the rank holding its state.
        let only = self.plan.steps[last].owner.map(|o| o as usize);
        // The update runs once per device, where the parameters live.
        let update = phase == Phase::Update;
        let Grid { dp, tp, .. } = self.grid;
        for (r, t) in (0..dp).flat_map(|r| (0..tp).map(move |t| (r, t))) {
            if only.is_some_and(|o| o != r) {
                continue;
            }
            let held = self.owners[r].len();
            let runs = if update { 1 } else { held };
            let d = self.device(r, t, stage);
            for (j, ctx) in ctxs[d].iter().enumerate().take(runs) {
                if group.is_some() {
                    continue;
                }
                if let Op::Transfer { from, .. } = self.plan.steps[last].op {
                    let source = d - stage + from as usize;
                    self.transfer(source, d, j, last)?;
                    continue;
                }
                if let Op::Broadcast { root } = self.plan.steps[last].op {
                    let source = self.device(root as usize, t, stage);
                    self.transfer(source, d, j, last)?;
                    continue;
                }
                let dev = &mut self.devices[d];
                if j == 0 {
                    dev.shards[0].run_kernel_at(k, ctx)?;
                } else {
                    let persistent = dev.shards[0].take_persistent();
                    dev.shards[j].put_persistent(persistent);
                    let result = dev.shards[j].run_kernel_at(k, ctx);
                    let persistent = dev.shards[j].take_persistent();
                    dev.shards[0].put_persistent(persistent);
                    result?;
                }
            }
        }
        let operand = self.plan.steps[last].operands[0];
        match group {
            Some(Group::Shards) => {
                for t in 0..self.grid.tp {
                    self.all_reduce(t, stage, last, operand, to)?;
                }
            }
            Some(Group::Tensor) => self.tensor_all_reduce(stage, last, operand)?,
            None => {}
        }
        Ok(())
    }

    /// The sum over the tensor-parallel ranks of `operand` into `out`, shard by shard.
    fn tensor_all_reduce(
        &mut self,
        stage: usize,
        out: usize,
        operand: usize,
    ) -> Result<(), ExecError> {
        let tp = self.grid.tp;
        for r in 0..self.grid.dp {
            for j in 0..self.owners[r].len() {
                let grid = self.grid;
                let at = move |t: usize| (r * grid.tp + t) * grid.pp + stage;
                let value = |t: usize| -> Vec<f32> {
                    self.devices[at(t)].shards[j]
                        .value(operand)
                        .map(|v| v.f32().to_vec())
                        .unwrap_or_default()
                };
                let shape = self.devices[at(0)].shards[j]
                    .value(operand)
                    .map(|v| v.shape.clone());
                let sent = (0..tp).map(|t| partials(tp, t..t + 1, &value)).collect();
                let total = self
                    .tensor
                    .all_reduce(tp, sent)
                    .map_err(|e| ExecError::Device(e.to_string()))?;
                let shape = shape.unwrap_or_else(|| vec![total.len()]);
                for t in 0..tp {
                    let d = at(t);
                    if let Some(v) = self.devices[d].shards[j].value_mut(out) {
                        v.reshape_in_place(&shape);
                        v.f32_mut().copy_from_slice(&total);
                    }
                }
            }
        }
        Ok(())
    }

    /// Transfer step `step` for shard `j`: its operand's value on device `from` becomes its
    /// value on device `to` (a send and its receive).
    fn transfer(&mut self, from: usize, to: usize, j: usize, step: usize) -> Result<(), ExecError> {
        let operand = self.plan.steps[step].operands[0];
        // Parameters and optimizer state live with a device's first shard.
        let holder = if self.plan.steps[operand].op.is_source() {
            0
        } else {
            j
        };
        let Some(v) = self.devices[from].shards[holder].value(operand) else {
            return Err(ExecError::Device(format!(
                "transfer: device {from} does not hold the value it sends"
            )));
        };
        let (shape, data) = (v.shape.clone(), v.f32().to_vec());
        let data = self.p2p.send(from, to, data);
        if let Some(t) = self.devices[to].shards[j].value_mut(step) {
            t.reshape_in_place(&shape);
            t.f32_mut().copy_from_slice(&data);
        }
        Ok(())
    }

    /// The sum over every shard of `operand` into `out`, on every shard of `stage` of tensor
    /// rank `t` (of data rank `to` only, when given: a reduce).
    fn all_reduce(
        &mut self,
        t: usize,
        stage: usize,
        out: usize,
        operand: usize,
        to: Option<usize>,
    ) -> Result<(), ExecError> {
        let leaves = self.last.len();
        let value = |i: usize| -> Vec<f32> {
            self.shard(t, stage, i)
                .value(operand)
                .map(|v| v.f32().to_vec())
                .unwrap_or_default()
        };
        let shape = self
            .shard(t, stage, 0)
            .value(operand)
            .map(|v| v.shape.clone());
        let sent: Vec<_> = self
            .owners
            .iter()
            .map(|own| partials(leaves, own.clone(), &value))
            .collect();
        let total = match to {
            Some(_) => self.collective.reduce(leaves, sent),
            None => self.collective.all_reduce(leaves, sent),
        }
        .map_err(|e| ExecError::Device(e.to_string()))?;
        let shape = shape.unwrap_or_else(|| vec![total.len()]);
        for r in 0..self.grid.dp {
            if to.is_some_and(|root| root != r) {
                continue;
            }
            let held = self.owners[r].len().max(1);
            let d = self.device(r, t, stage);
            for e in self.devices[d].shards.iter_mut().take(held) {
                if let Some(v) = e.value_mut(out) {
                    v.reshape_in_place(&shape);
                    v.f32_mut().copy_from_slice(&total);
                }
            }
        }
        Ok(())
    }

    /// Each persistent value (by name) from the device of rank 0 that holds it, in plan order.
    fn persistent(&self, states: bool) -> Result<ParamValues, ExecError> {
        let names = self.plan.names();
        let list = if states { &names.states } else { &names.params };
        let mut out = Vec::with_capacity(list.len());
        let split = |name: &str| self.plan.tensor_parallel.as_ref()?.axis_of(name);
        for (name, step) in list {
            let stage = self.stage_of_step(*step);
            let ranks = if split(name).is_some() {
                self.grid.tp
            } else {
                1
            };
            let mut parts = Vec::with_capacity(ranks);
            // Under ZeRO-1 a state lives only on its owner rank.
            let rank = self.plan.steps[*step].owner.unwrap_or(0) as usize;
            for t in 0..ranks {
                let e = &self.devices[self.device(rank, t, stage)].shards[0];
                let all = if states {
                    e.state_values()?
                } else {
                    e.param_values()?
                };
                if let Some(v) = all.into_iter().find(|v| &v.0 == name) {
                    parts.push(v);
                }
            }
            let Some(first) = parts.first() else { continue };
            match split(name) {
                Some(axis) => {
                    let mut shape = first.1.clone();
                    let values: Vec<Vec<f32>> = parts.iter().map(|p| p.2.clone()).collect();
                    let whole = slice::join_parts(&values, &shape, axis);
                    shape[axis] *= self.grid.tp;
                    out.push((name.clone(), shape, whole));
                }
                None => out.push(parts.swap_remove(0)),
            }
        }
        Ok(out)
    }

    /// Sets persistent value `name` from its whole value on every device that holds it (a
    /// tensor-parallel slice on each tensor rank).
    fn set_persistent(
        &mut self,
        name: &str,
        shape: &[usize],
        values: &[f32],
        state: bool,
    ) -> Result<(), ExecError> {
        let split = self
            .plan
            .tensor_parallel
            .as_ref()
            .and_then(|tp| tp.axis_of(name));
        let tp = self.grid.tp;
        for d in self.holders(name) {
            let t = d / self.grid.pp % tp;
            let (local, part) = match split {
                Some(axis) if shape.len() > axis => {
                    let mut local = shape.to_vec();
                    local[axis] /= tp;
                    (local, slice::slice_part(values, shape, axis, tp, t))
                }
                _ => (shape.to_vec(), values.to_vec()),
            };
            let e = &mut self.devices[d].shards[0];
            if state {
                e.set_state(name, &part)?;
            } else {
                e.set_param(name, &local, &part)?;
            }
        }
        Ok(())
    }

    /// The devices of every rank that hold persistent value `name`.
    fn holders(&self, name: &str) -> Vec<usize> {
        let names = self.plan.names();
        let step = names
            .params
            .iter()
            .chain(&names.states)
            .find(|(n, _)| n == name)
            .map(|p| p.1);
        let stage = step.map_or(0, |s| self.stage_of_step(s));
        let owner = step.and_then(|s| self.plan.steps[s].owner);
        (0..self.grid.dp)
            .filter(|&r| owner.is_none_or(|o| o as usize == r))
            .flat_map(|r| (0..self.grid.tp).map(move |t| (r, t)))
            .map(|(r, t)| self.device(r, t, stage))
            .collect()
    }
}
