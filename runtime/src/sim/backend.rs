//! The training interface (`Backend`) over simulated devices: a step's batch split into
//! micro-shards, inputs set where they are read, and parameters, optimizer state and outputs
//! gathered whole from the devices that hold them.

use super::rank::Step;
use super::SimulatedDevices;
use crate::backend::{Backend, ParamValues};
use crate::cpu::kernels::Ctx;
use crate::cpu::tensor::Tensor;
use crate::cpu::{ExecError, Mode};
use crate::data::Values;
use crate::finite::{all_finite, Count, NonFinite};
use crate::loss_share::shard_weights;
use parallax_compiler::plan::{LABELS, LOSS};
use parallax_compiler::shards::{assign, INV_BATCH, SHARD_WEIGHT};

impl Backend for SimulatedDevices {
    fn backend_name(&self) -> &'static str {
        "cpu"
    }

    fn set_input(&mut self, name: &str, batch: usize, v: &Values) -> Result<(), ExecError> {
        if self.plan.is_batched(name) {
            self.batched.insert(name.to_string(), (batch, v.clone()));
            return Ok(());
        }
        for dev in &mut self.devices {
            for e in &mut dev.shards {
                if e.has_input(name) {
                    Backend::set_input(e, name, batch, v)?;
                }
            }
        }
        Ok(())
    }

    fn has_input(&self, name: &str) -> bool {
        self.devices.iter().any(|d| d.shards[0].has_input(name))
    }

    fn run(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), ExecError> {
        self.last = self.sharding.split(batch);
        self.owners = assign(self.last.len(), self.grid.dp);
        let labels = self
            .counts_labels
            .then(|| self.batched.get(LABELS).map(|(_, v)| v))
            .flatten();
        let weights = shard_weights(&self.last, batch, labels);
        let mut ctxs: Vec<Vec<Ctx>> = Vec::with_capacity(self.devices.len());
        let per_rank = self.grid.pp * self.grid.tp;
        for (d, dev) in self.devices.iter_mut().enumerate() {
            let own = self.owners[d / per_rank].clone();
            let mut mine = Vec::new();
            if own.is_empty() {
                // No shards this step: it still runs the update on its own copy.
                mine.push(dev.shards[0].begin_step(1, mode, step, first_sample)?);
                ctxs.push(mine);
                continue;
            }
            for (j, r) in self.last[own.clone()].iter().enumerate() {
                let e = &mut dev.shards[j];
                let n = r.len();
                for (name, (total, v)) in &self.batched {
                    if *total != batch {
                        return Err(ExecError::Device(format!(
                            "input `{name}` holds {total} samples but the step runs {batch}"
                        )));
                    }
                    if !e.has_input(name) {
                        continue;
                    }
                    let len = match v {
                        Values::F32(x) => x.len(),
                        Values::I32(x) => x.len(),
                    };
                    Backend::set_input(e, name, n, &v.samples(len / batch.max(1), r.start, r.end))?;
                }
                let scalars = [
                    (SHARD_WEIGHT, weights[own.start + j]),
                    (INV_BATCH, 1.0 / batch as f32),
                ];
                for (name, value) in scalars {
                    if e.has_input(name) {
                        Backend::set_input(e, name, 1, &Values::F32(vec![value]))?;
                    }
                }
                mine.push(e.begin_step(n, mode, step, first_sample + r.start as u64)?);
            }
            ctxs.push(mine);
        }
        let step = Step {
            plan: &self.plan,
            kernel_stage: &self.kernel_stage,
            grid: self.grid,
            owners: &self.owners,
            leaves: self.last.len(),
            mode,
        };
        // A failed step may have left its failure, and messages, behind.
        self.world.reset();
        // Each device runs its own share on its own thread, with its own communicator.
        let results: Vec<Result<(), ExecError>> = std::thread::scope(|scope| {
            let step = &step;
            let handles: Vec<_> = self
                .devices
                .iter_mut()
                .zip(self.comms.iter_mut())
                .zip(&ctxs)
                .enumerate()
                .map(|(d, ((dev, comm), ctxs))| {
                    let guard = comm.panic_guard();
                    std::thread::Builder::new()
                        .name(format!("device {d}"))
                        .spawn_scoped(scope, move || {
                            let _guard = guard;
                            dev.step(d, ctxs, step, comm)
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(d, h)| match h {
                    Err(e) => Err(ExecError::Device(format!(
                        "simulated device {d}: its thread did not start: {e}"
                    ))),
                    Ok(h) => h.join().unwrap_or_else(|p| {
                        Err(ExecError::Device(format!(
                            "simulated device {d} panicked: {}",
                            panic_message(p.as_ref())
                        )))
                    }),
                })
                .collect()
        });
        first_error(results)
    }

    fn loss(&self, _batch: usize) -> Result<f32, ExecError> {
        let Some(step) = self.plan.output_steps.iter().find(|o| o.name == LOSS) else {
            return Ok(f32::NAN);
        };
        let t = self
            .shard(0, self.stage_of_step(step.step), 0)
            .value(step.step);
        Ok(t.map_or(f32::NAN, |t| t.f32()[0]))
    }

    fn output_values(&self, name: &str, _batch: usize) -> Result<Option<Tensor>, ExecError> {
        let Some(out) = self.plan.output_steps.iter().find(|o| o.name == name) else {
            return Ok(None);
        };
        let stage = self.stage_of_step(out.step);
        // The shards' outputs, concatenated along the batch axis in shard order.
        let mut shape: Option<Vec<usize>> = None;
        let mut data = Vec::new();
        for i in 0..self.last.len() {
            let Some(t) = self.shard(0, stage, i).value(out.step) else {
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
        self.persistent(false)
    }

    fn set_param(&mut self, name: &str, shape: &[usize], values: &[f32]) -> Result<(), ExecError> {
        self.set_persistent(name, shape, values, false)
    }

    fn state_values(&self) -> Result<ParamValues, ExecError> {
        self.persistent(true)
    }

    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), ExecError> {
        let shape = self
            .persistent(true)?
            .into_iter()
            .find(|s| s.0 == name)
            .map(|s| s.1)
            .unwrap_or_else(|| vec![values.len()]);
        self.set_persistent(name, &shape, values, true)
    }

    /// Scanned in place, each tensor where it lives: on its owner rank under ZeRO (rank 0
    /// otherwise), its pipeline stage, and every tensor rank when it is a tensor-parallel
    /// slice (counted over the whole tensor); so the answer is that of one device running
    /// the whole plan.
    fn first_non_finite(&self) -> Result<Option<NonFinite>, ExecError> {
        let Some(any) = self.devices.first().and_then(|d| d.shards.first()) else {
            return Ok(None);
        };
        for (kind, name, step) in any.checked() {
            let rank = self.plan.steps[*step].owner.unwrap_or(0) as usize;
            let stage = self.stage_of_step(*step);
            let split = self
                .plan
                .tensor_parallel
                .as_ref()
                .is_some_and(|tp| tp.axis_of(name).is_some());
            let ranks = if split { self.grid.tp } else { 1 };
            let parts = (0..ranks).filter_map(|t| {
                self.devices[self.device(rank, t, stage)].shards[0].held_f32(*step)
            });
            if parts.clone().all(all_finite) {
                continue;
            }
            let len = parts.clone().map(<[f32]>::len).sum();
            let count = parts
                .filter_map(Count::of)
                .reduce(Count::merge)
                .map(|c| Count { len, ..c });
            if let Some(count) = count {
                return Ok(Some(NonFinite {
                    kind: *kind,
                    name: name.clone(),
                    count,
                }));
            }
        }
        Ok(None)
    }
}

/// The step's error: the first device's own failure, not the others' reports of it.
fn first_error(results: Vec<Result<(), ExecError>>) -> Result<(), ExecError> {
    let echo = |e: &ExecError| matches!(e, ExecError::Comm(c) if c.is_echo());
    let mut errors: Vec<ExecError> = results.into_iter().filter_map(Result::err).collect();
    match errors.iter().position(|e| !echo(e)) {
        Some(i) => Err(errors.swap_remove(i)),
        None if errors.is_empty() => Ok(()),
        None => Err(errors.swap_remove(0)),
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}
