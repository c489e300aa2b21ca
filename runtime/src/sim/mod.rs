//! Simulated devices: a partitioned plan run by N device ranks in one process, each a thread
//! with its own memory (capped like the GPU it stands for). Devices form a grid of
//! data-parallel ranks times tensor-parallel ranks times pipeline stages. A data rank holds
//! whole micro-shards of each batch (`parallax_compiler::shards`); a stage holds a contiguous
//! run of layers (the `pipeline` pass), their parameters and optimizer state, and runs only
//! their kernels. Each device runs the rank code of `rank` (what a real rank runs) and talks
//! to the others only through its in-process communicator (`crate::comm::threads`); every
//! cross-shard sum follows one fixed tree, so the result has the same bits on any grid (tests
//! check it). This coordinator only hands each device its inputs before a step and reads
//! values after it.

use crate::backend::{Backend, ParamValues};
use crate::comm::threads::{ThreadComm, Threads};

mod backend;
mod rank;
use crate::cpu::tensor as slice;
use crate::cpu::{ExecError, Executor};
use crate::data::Values;
use parallax_compiler::plan::bytes;
use parallax_compiler::shards::{assign, Sharding};
use parallax_compiler::Plan;
use rank::Device;
use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

pub use crate::grid::Grid;

/// How long a device waits for another by default.
const TIMEOUT: Duration = Duration::from_secs(600);

pub struct SimulatedDevices {
    plan: Plan,
    sharding: Sharding,
    grid: Grid,
    /// Data rank, then tensor rank, then stage: device `(r * tp + t) * pp + s`.
    devices: Vec<Device>,
    kernel_stage: Vec<usize>,
    /// The devices' communicators (device `d`'s at `d`), and their world.
    world: Threads,
    comms: Vec<ThreadComm>,
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
        let mut sim = SimulatedDevices {
            counts_labels: crate::loss_share::counts_labels(&plan),
            plan,
            sharding,
            grid,
            devices,
            kernel_stage,
            world: Threads::new(grid.devices(), TIMEOUT),
            comms: Vec::new(),
            batched: HashMap::new(),
            last: Vec::new(),
            owners: Vec::new(),
        };
        sim.comms = sim.world.comms();
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

    /// How long a device waits for another before its step fails (ten minutes unless set:
    /// a failing device ends the others' waits at once, so only a stuck one waits this long).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.world = Threads::new(self.grid.devices(), timeout);
        self.comms = self.world.comms();
    }

    fn device(&self, rank: usize, tensor_rank: usize, stage: usize) -> usize {
        self.grid.device(rank, tensor_rank, stage)
    }

    /// The executor of shard `i` of the last step on `stage` of tensor rank `t` (read after
    /// the step).
    fn shard(&self, t: usize, stage: usize, i: usize) -> &Executor {
        let r = self.owners.iter().position(|o| o.contains(&i)).unwrap_or(0);
        let j = i.saturating_sub(self.owners.get(r).map_or(0, |o| o.start));
        &self.devices[self.device(r, t, stage)].shards[j]
    }

    fn stage_of_step(&self, step: usize) -> usize {
        self.plan.steps[step].stage as usize
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
