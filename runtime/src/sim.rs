//! Simulated devices: a data-parallel plan run on N device workers in one process, each with
//! its own memory (capped like the GPU it stands for), its parameters and optimizer state, and
//! the micro-shards of each batch it holds (`parallax_compiler::shards`). The plan's collective
//! ops run through the collective library (`crate::collective`); every other kernel runs on
//! the CPU executor, once per shard. All devices run in lockstep, kernel by kernel, so the
//! result is the same whatever the device count (tests check it bit for bit).

use crate::backend::{Backend, ParamValues};
use crate::collective::{partials, Collective, InProcess, Traffic};
use crate::cpu::kernels::Ctx;
use crate::cpu::tensor::Tensor;
use crate::cpu::{ExecError, Executor, Mode};
use crate::data::Values;
use parallax_compiler::ir::{Op, Phase};
use parallax_compiler::plan::bytes;
use parallax_compiler::shards::{assign, Sharding, INV_BATCH, SHARD_WEIGHT};
use parallax_compiler::Plan;
use std::collections::HashMap;
use std::ops::Range;

/// One simulated device: an executor per micro-shard it can hold; the first owns the
/// parameters and optimizer state, which the others borrow kernel by kernel.
struct Device {
    shards: Vec<Executor>,
}

pub struct SimulatedDevices {
    plan: Plan,
    sharding: Sharding,
    devices: Vec<Device>,
    collective: InProcess,
    /// Inputs with a batch axis, as set for the whole batch: split into shards at `run`.
    batched: HashMap<String, (usize, Values)>,
    /// The shards of the last step, and who held them.
    last: Vec<Range<usize>>,
    owners: Vec<Range<usize>>,
}

/// What each device holds after setup, in bytes (the executors' allocations).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemory {
    pub device: usize,
    pub shards: usize,
    pub bytes: u64,
}

impl SimulatedDevices {
    /// `plan` must be a per-shard plan (`Plan::sharding` set). Each device gets the memory of
    /// `capacity` bytes; a device whose buffers do not fit is refused before anything runs.
    pub fn new(
        plan: Plan,
        devices: usize,
        seed: u64,
        capacity: u64,
    ) -> Result<SimulatedDevices, ExecError> {
        let Some(sharding) = plan.sharding else {
            return Err(ExecError::Device(
                "simulated devices run a per-shard plan (compiled with micro-shards)".into(),
            ));
        };
        let devices = devices.max(1);
        let max_batch = plan.batch_size as usize;
        let mut devs = Vec::with_capacity(devices);
        for held in assign(sharding.shards as usize, devices) {
            // Even a device without shards holds the parameters and runs the update.
            let mut shards: Vec<Executor> = (0..held.len().max(1))
                .map(|_| Executor::new(plan.clone(), max_batch, seed))
                .collect();
            for e in shards.iter_mut().skip(1) {
                drop(e.take_persistent());
            }
            devs.push(Device { shards });
        }
        let sim = SimulatedDevices {
            plan,
            sharding,
            devices: devs,
            collective: InProcess::new(devices),
            batched: HashMap::new(),
            last: Vec::new(),
            owners: Vec::new(),
        };
        for m in sim.memory() {
            if m.bytes > capacity {
                return Err(ExecError::Device(format!(
                    "simulated device {} runs out of memory: its {} micro-shard(s) need {} but it has {}",
                    m.device,
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
                shards: d.shards.len(),
                bytes: d.shards.iter().map(Executor::allocated_bytes).sum(),
            })
            .collect()
    }

    pub fn traffic(&self) -> Traffic {
        self.collective.traffic()
    }

    pub fn sharding(&self) -> Sharding {
        self.sharding
    }

    /// Shard `i` of the last step: its device and executor.
    fn shard(&self, i: usize) -> &Executor {
        let d = self.owners.iter().position(|r| r.contains(&i)).unwrap_or(0);
        &self.devices[d].shards[i - self.owners[d].start]
    }

    fn is_batched(&self, name: &str) -> bool {
        self.plan
            .inputs
            .iter()
            .any(|t| t.name == name && t.shape.first().is_some_and(|d| d == "B"))
    }

    /// Runs kernel `k` on every shard, or the collective it is.
    fn kernel(&mut self, k: usize, ctxs: &[Vec<Ctx>]) -> Result<(), ExecError> {
        let kern = &self.plan.kernels[k];
        let last = *kern.steps.last().expect("a kernel has steps");
        let step = &self.plan.steps[last];
        if matches!(step.op, Op::AllReduce) {
            return self.all_reduce(last, step.operands[0]);
        }
        // The update runs once per device, where the parameters live.
        let update = step.phase == Phase::Update;
        for (d, dev) in self.devices.iter_mut().enumerate() {
            let held = self.owners[d].len();
            let runs = if update { 1 } else { held };
            for j in 0..runs {
                if j == 0 {
                    dev.shards[0].run_kernel_at(k, &ctxs[d][0])?;
                } else {
                    let persistent = dev.shards[0].take_persistent();
                    dev.shards[j].put_persistent(persistent);
                    let r = dev.shards[j].run_kernel_at(k, &ctxs[d][j]);
                    let persistent = dev.shards[j].take_persistent();
                    dev.shards[0].put_persistent(persistent);
                    r?;
                }
            }
        }
        Ok(())
    }

    /// The sum over every shard of `operand` into `out`, on every shard.
    fn all_reduce(&mut self, out: usize, operand: usize) -> Result<(), ExecError> {
        let leaves = self.last.len();
        let value = |i: usize| -> Vec<f32> {
            self.shard(i)
                .value(operand)
                .map(|t| t.f32().to_vec())
                .unwrap_or_default()
        };
        let shape = self.shard(0).value(operand).map(|t| t.shape.clone());
        let sent: Vec<_> = self
            .owners
            .iter()
            .map(|own| partials(leaves, own.clone(), &value))
            .collect();
        let total = self
            .collective
            .all_reduce(leaves, sent)
            .map_err(|e| ExecError::Device(e.to_string()))?;
        let shape = shape.unwrap_or_else(|| vec![total.len()]);
        for (d, dev) in self.devices.iter_mut().enumerate() {
            for e in dev.shards.iter_mut().take(self.owners[d].len().max(1)) {
                if let Some(t) = e.value_mut(out) {
                    t.reshape_in_place(&shape);
                    t.f32_mut().copy_from_slice(&total);
                }
            }
        }
        Ok(())
    }
}

fn slice(v: &Values, per: usize, r: &Range<usize>) -> Values {
    match v {
        Values::F32(x) => Values::F32(x[r.start * per..r.end * per].to_vec()),
        Values::I32(x) => Values::I32(x[r.start * per..r.end * per].to_vec()),
    }
}

impl Backend for SimulatedDevices {
    fn backend_name(&self) -> &'static str {
        "cpu"
    }

    fn set_input(&mut self, name: &str, batch: usize, v: &Values) -> Result<(), ExecError> {
        if self.is_batched(name) {
            self.batched.insert(name.to_string(), (batch, v.clone()));
            return Ok(());
        }
        for dev in &mut self.devices {
            for e in &mut dev.shards {
                Backend::set_input(e, name, batch, v)?;
            }
        }
        Ok(())
    }

    fn has_input(&self, name: &str) -> bool {
        self.devices[0].shards[0].has_input(name)
    }

    fn run(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), ExecError> {
        self.last = self.sharding.split(batch);
        self.owners = assign(self.last.len(), self.devices.len());
        let mut ctxs: Vec<Vec<Ctx>> = Vec::with_capacity(self.devices.len());
        for (d, dev) in self.devices.iter_mut().enumerate() {
            let mut mine = Vec::new();
            let own = self.owners[d].clone();
            if own.is_empty() {
                // No shards this step: it still runs the update on its own copy.
                mine.push(dev.shards[0].begin_step(1, mode, step, first_sample)?);
                ctxs.push(mine);
                continue;
            }
            for (j, r) in self.last[own].iter().enumerate() {
                let e = &mut dev.shards[j];
                let n = r.len();
                for (name, (total, v)) in &self.batched {
                    if *total != batch {
                        return Err(ExecError::Device(format!(
                            "input `{name}` holds {total} samples but the step runs {batch}"
                        )));
                    }
                    let per = match v {
                        Values::F32(x) => x.len(),
                        Values::I32(x) => x.len(),
                    } / batch.max(1);
                    Backend::set_input(e, name, n, &slice(v, per, r))?;
                }
                let weight = Values::F32(vec![n as f32 / batch as f32]);
                if e.has_input(SHARD_WEIGHT) {
                    Backend::set_input(e, SHARD_WEIGHT, 1, &weight)?;
                }
                if e.has_input(INV_BATCH) {
                    Backend::set_input(e, INV_BATCH, 1, &Values::F32(vec![1.0 / batch as f32]))?;
                }
                mine.push(e.begin_step(n, mode, step, first_sample + r.start as u64)?);
            }
            ctxs.push(mine);
        }
        for k in 0..self.plan.kernels.len() {
            if mode.runs(&self.plan, k) {
                self.kernel(k, &ctxs)?;
            }
        }
        for dev in &mut self.devices {
            dev.shards[0].finish_step(mode);
        }
        Ok(())
    }

    fn loss(&self, _batch: usize) -> Result<f32, ExecError> {
        Ok(self
            .shard(0)
            .output("loss")
            .map_or(f32::NAN, |t| t.f32()[0]))
    }

    fn output_values(&self, name: &str, _batch: usize) -> Result<Option<Tensor>, ExecError> {
        // The shards' outputs, concatenated along the batch axis in shard order.
        let mut shape: Option<Vec<usize>> = None;
        let mut data = Vec::new();
        for i in 0..self.last.len() {
            let Some(t) = self.shard(i).output(name) else {
                return Ok(None);
            };
            match shape.as_mut() {
                Some(s) if !s.is_empty() => s[0] += t.shape[0],
                Some(_) => {}
                None => shape = Some(t.shape.clone()),
            }
            data.extend_from_slice(t.f32());
        }
        Ok(shape.map(|s| Tensor::from_f32(s, data)))
    }

    fn param_values(&self) -> Result<ParamValues, ExecError> {
        self.devices[0].shards[0].param_values()
    }

    fn set_param(&mut self, name: &str, shape: &[usize], values: &[f32]) -> Result<(), ExecError> {
        for dev in &mut self.devices {
            dev.shards[0].set_param(name, shape, values)?;
        }
        Ok(())
    }

    fn state_values(&self) -> Result<ParamValues, ExecError> {
        self.devices[0].shards[0].state_values()
    }

    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), ExecError> {
        for dev in &mut self.devices {
            dev.shards[0].set_state(name, values)?;
        }
        Ok(())
    }
}
