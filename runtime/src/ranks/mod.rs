//! The devices of a partitioned plan, each a rank: a grid of data-parallel ranks times
//! tensor-parallel ranks times pipeline stages. A data rank holds whole micro-shards of each
//! batch (`parallax_compiler::shards`); a stage holds a contiguous run of layers (the
//! `pipeline` pass), their parameters and optimizer state, and runs only their kernels. Each
//! device runs the rank code of `rank` and talks to the others only through its
//! communicator; every cross-shard sum follows one fixed tree, so the result has the same
//! bits on any grid (tests check it).
//!
//! One process runs either every device, a thread each with its memory capped like the GPU it
//! stands for (simulated devices, over `crate::comm::threads`), or one device of a job of
//! processes (`Ranks::process`: one per rank, started by `mpirun`), over that job's
//! communicator. This coordinator hands the devices here their inputs before a step and reads
//! values after it; a value another process holds is sent by it (`fetch`), so every process
//! must make the same reads in the same order (training does).

use crate::backend::ParamValues;
use crate::comm::threads::{ThreadComm, Threads};
use crate::comm::Communicator;

mod backend;
pub mod loss_share;
mod nccl;
pub mod placement;
mod rank;
pub mod shard;
use crate::cpu::Executor;
use crate::data::Values;
use crate::exec::tensor as slice;
use crate::exec::{DeviceSum, ExecError};
use parallax_compiler::plan::bytes;
use parallax_compiler::shards::{assign, Sharding};
use parallax_compiler::Plan;
use rank::Device;
use shard::Held;
pub use shard::ShardExecutor;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub use crate::exec::grid::Grid;

/// How long a device waits for another by default.
const TIMEOUT: Duration = Duration::from_secs(600);

/// The communicator of this process's rank in a job of processes, shared by the devices and
/// the training loop (which checks agreement and votes on stopping through it).
pub type Peers = Arc<Mutex<Box<dyn Communicator>>>;

/// Locks the communicator (a rank that panicked holding it left nothing half-done that the
/// next call could see: every call is whole messages).
pub fn lock(peers: &Peers) -> MutexGuard<'_, Box<dyn Communicator>> {
    peers.lock().unwrap_or_else(|p| p.into_inner())
}

/// How this process's devices reach the others.
enum Links {
    /// Every device here, a thread each, over the in-process communicator (device `d`'s at
    /// `d`).
    Threads {
        world: Threads,
        comms: Vec<ThreadComm>,
    },
    /// One device of a job of processes, over the job's communicator.
    Process(Peers),
}

/// What `Ranks::fetch` reads on the device that holds a value.
type Read<'a, E> = dyn Fn(&Device<E>) -> Result<Option<Held>, ExecError> + 'a;

/// The devices of this process, each an executor `E` per micro-shard it holds (the CPU
/// executor for simulated devices and CPU ranks, the CUDA executor for GPU ranks).
pub struct Ranks<E: ShardExecutor = Executor> {
    plan: Plan,
    sharding: Sharding,
    grid: Grid,
    /// The devices this process runs: `first..first + devices.len()` of the grid, where device
    /// `(r * tp + t) * pp + s` is data rank `r`, tensor rank `t`, stage `s`.
    first: usize,
    devices: Vec<Device<E>>,
    kernel_stage: Vec<usize>,
    links: Links,
    /// Inputs with a batch axis, as set for the whole batch: split into shards at `run`.
    batched: HashMap<String, (usize, Values)>,
    /// Whether a shard's share of the loss is its counted labels' (`loss_share`).
    counts_labels: bool,
    /// The shards of the last step, and which rank held them.
    last: Vec<Range<usize>>,
    owners: Vec<Range<usize>>,
    /// The mode of the last step (`None` before the first): see `Plan::kept_after_training`.
    last_mode: Option<crate::exec::Mode>,
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

impl Ranks<Executor> {
    /// Every device of `grid` in this process, a thread each (simulated devices). `plan` must
    /// be a per-shard plan (`Plan::sharding` set). Each device gets `capacity` bytes; a device
    /// whose buffers do not fit is refused before anything runs.
    pub fn in_process(
        plan: Plan,
        grid: Grid,
        seed: u64,
        capacity: u64,
    ) -> Result<Ranks, ExecError> {
        let make = shard::cpu(plan.batch_size as usize, seed);
        Ranks::in_process_with(plan, grid, capacity, &make)
    }

    /// Device `rank` of `grid` (the communicator's rank), one of a job of processes, one
    /// per device: the communicator's world must be the grid.
    pub fn process(
        plan: Plan,
        grid: Grid,
        seed: u64,
        capacity: u64,
        peers: Peers,
    ) -> Result<Ranks, ExecError> {
        let make = shard::cpu(plan.batch_size as usize, seed);
        Ranks::process_with(plan, grid, capacity, peers, &make)
    }
}

impl<E: ShardExecutor> Ranks<E> {
    /// `in_process` with the executors `make` builds (GPU ranks: `shard::cuda`).
    pub fn in_process_with(
        plan: Plan,
        grid: Grid,
        capacity: u64,
        make: &shard::Make<E>,
    ) -> Result<Ranks<E>, ExecError> {
        let grid = whole(grid);
        let world = Threads::new(grid.devices(), TIMEOUT);
        let comms = world.comms();
        Ranks::build(
            plan,
            grid,
            capacity,
            0..grid.devices(),
            Links::Threads { world, comms },
            make,
        )
    }

    /// `process` with the executors `make` builds.
    pub fn process_with(
        plan: Plan,
        grid: Grid,
        capacity: u64,
        peers: Peers,
        make: &shard::Make<E>,
    ) -> Result<Ranks<E>, ExecError> {
        let grid = whole(grid);
        let (rank, size) = {
            let comm = lock(&peers);
            (comm.rank(), comm.size())
        };
        if size != grid.devices() {
            return Err(ExecError::Device(format!(
                "the job has {size} process(es) but the plan's grid (dp{}.tp{}.pp{}) has {} device(s): one process runs one device",
                grid.dp,
                grid.tp,
                grid.pp,
                grid.devices()
            )));
        }
        Ranks::build(
            plan,
            grid,
            capacity,
            rank..rank + 1,
            Links::Process(peers),
            make,
        )
    }

    fn build(
        plan: Plan,
        grid: Grid,
        capacity: u64,
        here: Range<usize>,
        links: Links,
        make: &shard::Make<E>,
    ) -> Result<Ranks<E>, ExecError> {
        let Some(sharding) = plan.sharding else {
            return Err(ExecError::Device(
                "devices run a per-shard plan (compiled with micro-shards)".into(),
            ));
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
        let held = assign(sharding.shards as usize, grid.dp);
        let devices = here
            .clone()
            .map(|d| {
                let (rank, t, stage) = grid.place(d);
                let owned = plan.kernel_mask(stage as u32, rank as u32);
                let owned = owned.as_deref();
                // Even a rank without shards holds the parameters and runs the update.
                let mut shards: Vec<E> = (0..held[rank].len().max(1))
                    .map(|_| make(&plan, d, owned, t))
                    .collect::<Result<_, _>>()?;
                for e in shards.iter_mut().skip(1) {
                    drop(e.take_persistent());
                }
                Ok(Device { shards, sum: None })
            })
            .collect::<Result<_, ExecError>>()?;
        let ranks = Ranks {
            counts_labels: crate::ranks::loss_share::counts_labels(&plan),
            plan,
            sharding,
            grid,
            first: here.start,
            devices,
            kernel_stage,
            links,
            batched: HashMap::new(),
            last: Vec::new(),
            owners: Vec::new(),
            last_mode: None,
        };
        let what = if ranks.runs_every_device() {
            "simulated device"
        } else {
            "device"
        };
        for m in ranks.memory() {
            if m.bytes > capacity {
                return Err(ExecError::Device(format!(
                    "{what} {} (rank {}, tensor rank {}, stage {}) runs out of memory: its {} micro-shard(s) need {} but it has {}",
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
        Ok(ranks)
    }

    /// What each device of this process allocated.
    pub fn memory(&self) -> Vec<DeviceMemory> {
        self.devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let device = self.first + i;
                let (rank, tensor_rank, stage) = self.grid.place(device);
                DeviceMemory {
                    device,
                    rank,
                    tensor_rank,
                    stage,
                    shards: d.shards.len(),
                    bytes: d.shards.iter().map(E::allocated_bytes).sum(),
                }
            })
            .collect()
    }

    /// What every device of the grid allocated, in device order (from the process that
    /// runs it).
    pub fn memory_of_all(&self) -> Result<Vec<u64>, ExecError> {
        (0..self.grid.devices())
            .map(|d| {
                let held = self.fetch(d, &|dev| {
                    let b: u64 = dev.shards.iter().map(E::allocated_bytes).sum();
                    // In two halves: dimensions travel as 32 bits.
                    Ok(Some((
                        vec![b as u32 as usize, (b >> 32) as usize],
                        Vec::new(),
                    )))
                })?;
                Ok(held.map_or(0, |h| h.0[0] as u64 | (h.0[1] as u64) << 32))
            })
            .collect()
    }

    /// How long a device waits for another before its step fails (ten minutes unless set:
    /// a failing device ends the others' waits at once, so only a stuck one waits this long).
    /// A job of processes waits as long as its communicator does.
    pub fn set_timeout(&mut self, timeout: Duration) {
        if let Links::Threads { world, comms } = &mut self.links {
            *world = Threads::new(self.grid.devices(), timeout);
            *comms = world.comms();
        }
    }

    /// Sums over shards done by `sums` (one per device of this process, in device order)
    /// where the values live, instead of on the host through the communicator.
    pub fn set_device_sums(&mut self, sums: Vec<Box<dyn DeviceSum<E>>>) -> Result<(), ExecError> {
        if sums.len() != self.devices.len() {
            return Err(ExecError::Device(format!(
                "{} device sum(s) for the {} device(s) of this process",
                sums.len(),
                self.devices.len()
            )));
        }
        for (d, sum) in self.devices.iter_mut().zip(sums) {
            d.sum = Some(sum);
        }
        Ok(())
    }

    /// Whether this process runs every device (else it is one rank of a job of processes).
    pub fn runs_every_device(&self) -> bool {
        matches!(self.links, Links::Threads { .. })
    }

    fn device(&self, rank: usize, tensor_rank: usize, stage: usize) -> usize {
        self.grid.device(rank, tensor_rank, stage)
    }

    /// Device `d`, if this process runs it.
    fn here(&self, d: usize) -> Option<&Device<E>> {
        d.checked_sub(self.first).and_then(|i| self.devices.get(i))
    }

    /// What `read` finds on device `d`, on every process: read in place where `d` runs here,
    /// else sent (as a broadcast over the job) by the process that runs it. Every process
    /// of a job must fetch the same devices in the same order; a read that fails (a copy
    /// off a GPU) fails on every process, so none goes on with a value missing.
    fn fetch(&self, d: usize, read: &Read<E>) -> Result<Option<Held>, ExecError> {
        let mine = self.here(d).map(read).transpose().map(Option::flatten);
        let Links::Process(peers) = &self.links else {
            return mine;
        };
        let mut wire = match &mine {
            Ok(held) => held.clone().map_or_else(Vec::new, encode),
            Err(_) => vec![f32::from_bits(FAILED_READ)],
        };
        let mut comm = lock(peers);
        let world: Vec<usize> = (0..comm.size()).collect();
        comm.broadcast(&world, d, &mut wire)?;
        drop(comm);
        mine?;
        match decode(&wire) {
            Some(Ok(held)) => Ok(held),
            Some(Err(())) => Err(ExecError::Device(format!(
                "device {d} could not read the value it holds (its own error says why)"
            ))),
            None => Err(ExecError::Device(format!(
                "device {d} sent a malformed tensor ({} words)",
                wire.len()
            ))),
        }
    }

    /// The data rank holding shard `i` of the last step, and the shard's place there.
    fn holder_of_shard(&self, i: usize) -> (usize, usize) {
        let r = self.owners.iter().position(|o| o.contains(&i)).unwrap_or(0);
        let j = i.saturating_sub(self.owners.get(r).map_or(0, |o| o.start));
        (r, j)
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
                let read = |dev: &Device<E>| dev.shards[0].persistent(name, states);
                if let Some(held) = self.fetch(self.device(rank, t, stage), &read)? {
                    parts.push(held);
                }
            }
            let Some(first) = parts.first() else { continue };
            match split(name) {
                Some(axis) => {
                    let mut shape = first.0.clone();
                    let values: Vec<Vec<f32>> = parts.iter().map(|p| p.1.clone()).collect();
                    let whole = slice::join_parts(&values, &shape, axis);
                    shape[axis] *= self.grid.tp;
                    out.push((name.clone(), shape, whole));
                }
                None => {
                    let (shape, values) = parts.swap_remove(0);
                    out.push((name.clone(), shape, values));
                }
            }
        }
        Ok(out)
    }

    /// The whole shape of persistent value `name`, from a device here that holds it (`None`
    /// when none does).
    fn whole_shape(&self, name: &str, state: bool) -> Option<Vec<usize>> {
        let d = self
            .holders(name)
            .into_iter()
            .find(|&d| self.here(d).is_some())?;
        let mut shape = self.here(d)?.shards[0].persistent_shape(name, state)?;
        if let Some(axis) = self.plan.tensor_parallel.as_ref()?.axis_of(name) {
            if let Some(n) = shape.get_mut(axis) {
                *n *= self.grid.tp;
            }
        }
        Some(shape)
    }

    /// Sets persistent value `name` from its whole value on every device here that holds it
    /// (a tensor-parallel slice on each tensor rank).
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
            let Some(i) = d
                .checked_sub(self.first)
                .filter(|&i| i < self.devices.len())
            else {
                continue;
            };
            let t = self.grid.place(d).1;
            let (local, part) = match split {
                Some(axis) if shape.len() > axis => {
                    let mut local = shape.to_vec();
                    local[axis] /= tp;
                    (local, slice::slice_part(values, shape, axis, tp, t))
                }
                _ => (shape.to_vec(), values.to_vec()),
            };
            let e = &mut self.devices[i].shards[0];
            if state {
                crate::backend::Backend::set_state(e, name, &part)?;
            } else {
                crate::backend::Backend::set_param(e, name, &local, &part)?;
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

/// A grid with every degree at least 1.
fn whole(grid: Grid) -> Grid {
    Grid {
        dp: grid.dp.max(1),
        tp: grid.tp.max(1),
        pp: grid.pp.max(1),
    }
}

/// A held tensor as words: its rank, its dimensions (as bits), its values; nothing for none.
fn encode((shape, values): Held) -> Vec<f32> {
    let mut w = Vec::with_capacity(1 + shape.len() + values.len());
    w.push(f32::from_bits(shape.len() as u32));
    w.extend(shape.iter().map(|&d| f32::from_bits(d as u32)));
    w.extend(values);
    w
}

/// The first word of a device's answer to a read that failed there.
const FAILED_READ: u32 = u32::MAX;

/// `encode`'s words back (`Some(Ok(None))` for nothing, `Some(Err)` for a failed read;
/// `None` when malformed).
fn decode(w: &[f32]) -> Option<Result<Option<Held>, ()>> {
    let Some(rank) = w.first() else {
        return Some(Ok(None));
    };
    if rank.to_bits() == FAILED_READ {
        return Some(Err(()));
    }
    let rank = rank.to_bits() as usize;
    let shape: Vec<usize> = w
        .get(1..1 + rank)?
        .iter()
        .map(|d| d.to_bits() as usize)
        .collect();
    Some(Ok(Some((shape, w[1 + rank..].to_vec()))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_tensors_travel_as_words_and_a_failed_read_says_so() {
        let held = (
            vec![2, 3],
            vec![1.5, -2.0, 0.0, 7.0, f32::MIN_POSITIVE, 3.0],
        );
        assert_eq!(decode(&encode(held.clone())), Some(Ok(Some(held))));
        let scalar = (Vec::new(), vec![4.0]);
        assert_eq!(decode(&encode(scalar.clone())), Some(Ok(Some(scalar))));
        assert_eq!(decode(&[]), Some(Ok(None)));
        assert_eq!(decode(&[f32::from_bits(FAILED_READ)]), Some(Err(())));
        // A rank word longer than the message is malformed, never a panic.
        assert_eq!(decode(&[f32::from_bits(5), f32::from_bits(1)]), None);
    }
}
