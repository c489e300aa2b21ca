//! The training interface (`Backend`) over the devices of a partitioned plan: a step's batch
//! split into micro-shards, inputs set where they are read, and parameters, optimizer state
//! and outputs gathered whole from the devices that hold them.

use super::rank::Step;
use super::{lock, Device, Held, Links, Ranks, ShardExecutor};
use crate::backend::{Backend, ParamValues};
use crate::data::Values;
use crate::exec::finite::{all_finite, Count, NonFinite};
use crate::exec::tensor::Tensor;
use crate::exec::{ExecError, Mode};
use crate::ranks::loss_share::shard_weights;
use parallax_compiler::plan::{LABELS, LOSS};
use parallax_compiler::shards::{assign, INV_BATCH, SHARD_WEIGHT};
use std::borrow::Cow;

impl<E: ShardExecutor> Backend for Ranks<E> {
    fn backend_name(&self) -> &'static str {
        self.devices
            .first()
            .map_or("cpu", |d| d.shards[0].backend_name())
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

    fn samples_here(&self) -> Option<crate::data::loader::Wanted> {
        let grid = self.grid;
        if self.devices.len() >= grid.dp * grid.tp * grid.pp {
            return None; // every device is here: the whole batch is read
        }
        // The data ranks of the devices here (their tensor ranks and stages read the same).
        let mut ranks: Vec<usize> = (0..self.devices.len())
            .map(|i| grid.place(self.first + i).0)
            .collect();
        ranks.dedup();
        let sharding = self.sharding;
        Some(std::sync::Arc::new(move |batch| {
            let split = sharding.split(batch);
            let owners = assign(split.len(), grid.dp);
            (ranks.iter())
                .filter_map(|&r| {
                    let o = owners.get(r).filter(|o| !o.is_empty())?;
                    let (first, last) = (split.get(o.start)?, split.get(o.end - 1)?);
                    Some(first.start..last.end)
                })
                .collect()
        }))
    }

    fn run(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), ExecError> {
        self.last = self.sharding.split(batch);
        self.last_mode = Some(mode);
        self.owners = assign(self.last.len(), self.grid.dp);
        let labels = self
            .counts_labels
            .then(|| self.batched.get(LABELS).map(|(_, v)| v))
            .flatten();
        let weights = shard_weights(&self.last, batch, labels);
        let mut ctxs: Vec<Vec<E::Ctx>> = Vec::with_capacity(self.devices.len());
        for (i, dev) in self.devices.iter_mut().enumerate() {
            let own = self.owners[self.grid.place(self.first + i).0].clone();
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
        let first = self.first;
        let (world, comms) = match &mut self.links {
            Links::Threads { world, comms } => (world, comms),
            Links::Process(peers) => {
                // This process's one device, on this thread.
                let mut comm = lock(peers);
                return self.devices[0].step(first, &ctxs[0], &step, &mut **comm);
            }
        };
        // A failed step may have left its failure, and messages, behind.
        world.reset();
        // Each device runs its own share on its own thread, with its own communicator.
        let results: Vec<Result<(), ExecError>> = std::thread::scope(|scope| {
            let step = &step;
            let handles: Vec<_> = self
                .devices
                .iter_mut()
                .zip(comms.iter_mut())
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
        let (r, j) = self.holder_of_shard(0);
        let d = self.device(r, 0, self.stage_of_step(step.step));
        let read = |dev: &Device<E>| {
            let Some(e) = dev.shards.get(j) else {
                return Ok(None);
            };
            Ok(e.value_of(step.step)?
                .and_then(|(_, v)| Some((Vec::new(), vec![*v.first()?]))))
        };
        Ok(self.fetch(d, &read)?.map_or(f32::NAN, |h| h.1[0]))
    }

    fn output_values(&self, name: &str, _batch: usize) -> Result<Option<Tensor>, ExecError> {
        let Some(out) = self.plan.output_steps.iter().find(|o| o.name == name) else {
            return Ok(None);
        };
        if self.last_mode != Some(Mode::Eval) && !self.plan.kept_after_training(out.step) {
            return Err(ExecError::OutputNotKept(name.to_string()));
        }
        let stage = self.stage_of_step(out.step);
        // Each data rank's shards' outputs, then the ranks', concatenated along the batch
        // axis in shard order.
        let mut parts = Vec::new();
        for (r, own) in self.owners.iter().enumerate() {
            if own.is_empty() {
                continue;
            }
            let read = |dev: &Device<E>| {
                let mut held = Vec::with_capacity(own.len());
                for j in 0..own.len() {
                    match dev
                        .shards
                        .get(j)
                        .map(|e| e.value_of(out.step))
                        .transpose()?
                    {
                        Some(Some(h)) => held.push(h),
                        _ => return Ok(None),
                    }
                }
                Ok(concat(
                    held.iter().map(|(s, v)| (s.as_slice(), v.as_slice())),
                ))
            };
            match self.fetch(self.device(r, 0, stage), &read)? {
                Some(held) => parts.push(held),
                None => return Ok(None),
            }
        }
        let whole = concat(parts.iter().map(|(s, v)| (s.as_slice(), v.as_slice())));
        Ok(whole.map(|(s, v)| Tensor::from_f32(s, v)))
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
            .whole_shape(name, true)
            .unwrap_or_else(|| vec![values.len()]);
        self.set_persistent(name, &shape, values, true)
    }

    /// Scanned in place, each tensor where it lives: on its owner rank under ZeRO (rank 0
    /// otherwise), its pipeline stage, and every tensor rank when it is a tensor-parallel
    /// slice (counted over the whole tensor); so the answer is that of one device running
    /// the whole plan. A job of processes first votes on whether any device holds one, and
    /// only then gathers the tensors that do.
    fn first_non_finite(&self) -> Result<Option<NonFinite>, ExecError> {
        let Some(any) = self.devices.first().and_then(|d| d.shards.first()) else {
            return Ok(None);
        };
        let checked = any.checked();
        let holder = |step: usize| {
            let rank = self.plan.steps[step].owner.unwrap_or(0) as usize;
            (rank, self.stage_of_step(step))
        };
        let tensor_ranks = |name: &str| {
            let split = self.plan.tensor_parallel.as_ref();
            if split.is_some_and(|tp| tp.axis_of(name).is_some()) {
                self.grid.tp
            } else {
                1
            }
        };
        if let Links::Process(peers) = &self.links {
            let (r, _, s) = self.grid.place(self.first);
            let mut here = false;
            for (_, _, step) in &checked {
                if holder(*step) == (r, s) {
                    here |= any.held_f32(*step)?.is_some_and(|v| !all_finite(&v));
                }
            }
            if !lock(peers).any(here)? {
                return Ok(None);
            }
        }
        for (kind, name, step) in &checked {
            let (rank, stage) = holder(*step);
            let mut parts: Vec<Cow<[f32]>> = Vec::new();
            for t in 0..tensor_ranks(name) {
                let d = self.device(rank, t, stage);
                match (&self.links, self.here(d)) {
                    (Links::Threads { .. }, Some(dev)) => {
                        parts.extend(dev.shards[0].held_f32(*step)?)
                    }
                    _ => {
                        let read = |dev: &Device<E>| {
                            Ok(dev.shards[0]
                                .held_f32(*step)?
                                .map(|v| (vec![v.len()], v.into_owned())))
                        };
                        parts.extend(self.fetch(d, &read)?.map(|h| Cow::Owned(h.1)));
                    }
                }
            }
            if parts.iter().all(|p| all_finite(p)) {
                continue;
            }
            let len = parts.iter().map(|p| p.len()).sum();
            let count = parts
                .iter()
                .filter_map(|p| Count::of(p))
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

/// Tensors joined along their first axis (scalars: values side by side); `None` for none.
fn concat<'a>(parts: impl Iterator<Item = (&'a [usize], &'a [f32])>) -> Option<Held> {
    let mut whole: Option<Held> = None;
    for (shape, values) in parts {
        match whole.as_mut() {
            Some((s, v)) => {
                if let (Some(n), Some(m)) = (s.first_mut(), shape.first()) {
                    *n += m;
                }
                v.extend_from_slice(values);
            }
            None => whole = Some((shape.to_vec(), values.to_vec())),
        }
    }
    whole
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
