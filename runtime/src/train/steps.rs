//! The step loop's body: one training step (its batch, the update, the checks, the metrics),
//! validation at an epoch's end, the checkpoint cadence and the stop on a signal, with the
//! tallies the summary reports.

use super::error::non_finite;
use super::records::Records;
use super::validate::Validator;
use super::{feed, job, labelled_but_all_ignored, set_scalars, Event, TrainConfig, TrainError};
use crate::backend::Backend;
use crate::data::loader::{Batch, Computing, Loader};
use crate::exec::Mode;
use crate::ranks::{lock, Peers};
use parallax_compiler::dsl::ast::Experiment;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// What the steps add up, for the summary.
pub(super) struct Tallies {
    /// Each step's seconds (grows with the steps run, never reserved for a budget up front).
    pub times: Vec<f64>,
    pub samples: usize,
    pub last_loss: f32,
    /// The last validation's loss and accuracy.
    pub val: (Option<f64>, Option<f64>),
    pub without_labels: u64,
    /// Seconds the steps waited for the loader's next batch (its threads prepare them ahead).
    pub data_wait: f64,
    /// Samples of the trained batches read here (`Batch::read`).
    pub samples_read: u64,
}

impl Default for Tallies {
    fn default() -> Self {
        Tallies {
            times: Vec::new(),
            samples: 0,
            last_loss: f32::NAN,
            val: (None, None),
            without_labels: 0,
            data_wait: 0.0,
            samples_read: 0,
        }
    }
}

/// Writes a checkpoint of the backend at a step (every rank gathers; one writes).
pub(super) type Save<'a> = dyn Fn(&dyn Backend, u64) -> Result<PathBuf, TrainError> + 'a;

/// What the steps need besides the backend and the loader.
pub(super) struct Steps<'a> {
    pub exp: &'a Experiment,
    pub cfg: &'a TrainConfig,
    pub peers: &'a Option<Peers>,
    pub input: &'a str,
    pub target: &'a str,
    pub validator: &'a Validator<'a>,
    pub total: u64,
    pub per_epoch: u64,
    pub checkpoint_every: u64,
    pub records: &'a mut Records,
    pub save: &'a Save<'a>,
    pub t: Tallies,
}

impl Steps<'_> {
    /// Step `step` (0-based): trains one batch, validates at an epoch's end and after the
    /// last step, checkpoints on the cadence, and stops the run on a signal.
    pub fn run(
        &mut self,
        exec: &mut dyn Backend,
        loader: &mut Loader,
        step: u64,
        on_event: &mut dyn FnMut(&Event),
    ) -> Result<(), TrainError> {
        let waiting = Instant::now();
        let Some(batch) = loader.next() else {
            return Err(loader.failure().map_or_else(
                || TrainError::Model("the data loader stopped".into()),
                TrainError::from,
            ));
        };
        self.t.data_wait += waiting.elapsed().as_secs_f64();
        self.t.samples_read += batch.read as u64;
        let lr = self.train(exec, &batch, step, loader.computing(), on_event)?;
        let epoch_end = batch.index as u64 + 1 == self.per_epoch;
        if (epoch_end || step + 1 == self.total) && !self.validator.set.is_empty() {
            self.validate(exec, &batch, step, lr, on_event)?;
        }
        self.checkpoint_or_stop(exec, step)
    }

    /// The update on `batch`, checked finite and logged; returns the learning rate. The
    /// loader holds off while `computing` lives: until the step's loss is read.
    fn train(
        &mut self,
        exec: &mut dyn Backend,
        batch: &Batch,
        step: u64,
        computing: Computing,
        on_event: &mut dyn FnMut(&Event),
    ) -> Result<f32, TrainError> {
        if labelled_but_all_ignored(&self.exp.loss, &batch.targets) {
            self.t.without_labels += 1;
            if self.t.without_labels == 1 {
                on_event(&Event::Warning(format!(
                    "step {}: every label of this batch is ignored ({}), so it trains nothing; the summary counts such batches",
                    step + 1,
                    crate::exec::IGNORE
                )));
            }
        }
        let t = Instant::now();
        feed(exec, self.input, batch.size, &batch.inputs)?;
        feed(exec, self.target, batch.size, &batch.targets)?;
        let scalars = set_scalars(exec, &self.exp.optimizer, step, self.total)?;
        let at_step = |source| TrainError::Step {
            step: step + 1,
            source,
        };
        exec.run(batch.size, Mode::Train, step, 0)
            .map_err(at_step)?;
        // Reading the loss waits for an asynchronous backend's step to finish.
        let loss = exec.loss(batch.size).map_err(at_step)?;
        self.t.times.push(t.elapsed().as_secs_f64());
        drop(computing);
        self.t.samples += batch.size;
        // The loss misses a NaN that a ReLU or a max-pooling hides: every tensor is checked.
        let tensor = exec.first_non_finite().map_err(at_step)?;
        let lr = scalars[0].1;
        if !loss.is_finite() || tensor.is_some() {
            return Err(TrainError::NonFinite {
                step: step + 1,
                epoch: None,
                what: non_finite(loss, tensor),
                lr,
            });
        }
        self.t.last_loss = loss;
        self.records.line(
            serde_json::json!({"step": step + 1, "epoch": batch.epoch, "loss": loss, "lr": lr}),
        )?;
        self.records.scalar("train/loss", step + 1, loss)?;
        self.records.scalar("train/lr", step + 1, lr)?;
        let busy: f64 = self.t.times.iter().sum();
        on_event(&Event::Step {
            step: step + 1,
            total: self.total,
            epoch: batch.epoch,
            loss,
            samples_per_sec: self.t.samples as f64 / busy.max(1e-9),
        });
        Ok(lr)
    }

    fn validate(
        &mut self,
        exec: &mut dyn Backend,
        batch: &Batch,
        step: u64,
        lr: f32,
        on_event: &mut dyn FnMut(&Event),
    ) -> Result<(), TrainError> {
        let (l, a) = self.validator.run(exec, step)?;
        if !l.is_finite() {
            return Err(TrainError::NonFinite {
                step: step + 1,
                epoch: Some(batch.epoch),
                what: format!(
                    "the validation loss is {l}, though every tensor of the step was finite"
                ),
                lr,
            });
        }
        self.t.val = (Some(l), a);
        self.records.line(
            serde_json::json!({"step": step + 1, "epoch": batch.epoch, "val_loss": l, "val_accuracy": a}),
        )?;
        self.records.scalar("val/loss", step + 1, l as f32)?;
        if let Some(a) = a {
            self.records.scalar("val/accuracy", step + 1, a as f32)?;
        }
        on_event(&Event::Validation {
            epoch: batch.epoch,
            loss: l,
            accuracy: a,
        });
        Ok(())
    }

    /// The checkpoint the cadence asks for; on a signal (any rank's: the ranks vote, so that
    /// all stop after the same step) the run stops here, its step done and saved, unless this
    /// was the last.
    fn checkpoint_or_stop(&mut self, exec: &mut dyn Backend, step: u64) -> Result<(), TrainError> {
        let mut saved = None;
        if self.checkpoint_every > 0 && (step + 1).is_multiple_of(self.checkpoint_every) {
            // The metrics up to this step reach the file before the checkpoint exists.
            self.records.flush()?;
            saved = Some((self.save)(exec, step + 1)?);
        }
        let mut signal = (self.cfg.stop.as_ref()).map_or(0, |s| s.load(Ordering::SeqCst));
        if let Some(p) = self.peers {
            let any = lock(p).any(signal != 0).map_err(|e| TrainError::Step {
                step: step + 1,
                source: e.into(),
            })?;
            if any && signal == 0 {
                signal = job::SIGNALLED_ELSEWHERE;
            }
        }
        if signal == 0 || step + 1 >= self.total {
            return Ok(());
        }
        self.records.flush()?;
        let checkpoint = match saved {
            Some(p) => p,
            None => (self.save)(exec, step + 1)?,
        };
        Err(TrainError::Interrupted {
            signal,
            step: step + 1,
            total: self.total,
            checkpoint: checkpoint.display().to_string(),
            dir: self.cfg.run_dir.display().to_string(),
        })
    }
}
