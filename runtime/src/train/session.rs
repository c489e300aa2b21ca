//! A compiled experiment's data and inputs: what the data must look like for the plan, the
//! loaded and hashed data set, and setting a batch and the schedule's scalars on a backend.

use super::TrainError;
use crate::backend::Backend;
use crate::cpu::Executor;
use crate::data::{self, EvalSet, Loader, ModelIo, TensorSpec, Values};
use crate::exec::ExecError;
use parallax_compiler::dsl::ast::{Loss, Optimizer};
use parallax_compiler::ir::{Dim, Op};
use parallax_compiler::plan::{LABELS, LOSS, TARGET};
use parallax_compiler::{Plan, Source};
use sha2::Digest;
use std::path::Path;
use std::sync::Arc;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The run's identity: the resolved experiment's text and the data's hash.
pub fn run_id(experiment_ron: &str, data_hash: &str) -> String {
    let mut h = sha2::Sha256::new();
    h.update(experiment_ron.as_bytes());
    h.update(b"\0");
    h.update(data_hash.as_bytes());
    hex(&h.finalize())[..16].to_string()
}

fn concrete(plan: &Plan, dims: &[Dim]) -> Vec<usize> {
    dims.iter()
        .map(|d| d.eval(&|s| plan.symbols.get(s.0 as usize).map_or(1, |x| x.1)) as usize)
        .collect()
}

/// What the data must look like for this plan: its one model input and the loss's target.
pub fn model_io(plan: &Plan, loss: &Loss) -> Result<(ModelIo, String, String), TrainError> {
    let inputs: Vec<(usize, &str)> = plan
        .steps
        .iter()
        .filter_map(|s| match &s.op {
            Op::Input { name, .. } if s.layer.is_empty() => Some((s.id, name.as_str())),
            _ => None,
        })
        .collect();
    let [(input_id, input_name)] = inputs[..] else {
        return Err(TrainError::Model(format!(
            "training reads one model input from the data set, but the model has {}",
            inputs.len()
        )));
    };
    let target_name = match loss {
        Loss::CrossEntropy { .. } => LABELS,
        Loss::Mse { .. } => TARGET,
    };
    let target = plan
        .steps
        .iter()
        .find(|s| matches!(&s.op, Op::Input { name, .. } if name == target_name))
        .ok_or_else(|| TrainError::Model(format!("the plan has no `{target_name}` input")))?;
    let input_ty = &plan.steps[input_id].ty;
    let output = plan
        .output_steps
        .iter()
        .find(|o| o.name != LOSS)
        .map(|o| &plan.steps[o.step].ty);
    let classes = match (loss, output) {
        (Loss::CrossEntropy { .. }, Some(t)) => t
            .shape
            .last()
            .and_then(|d| d.as_known())
            .map(|c| c as usize),
        _ => None,
    };
    let input_range = plan.steps.iter().find_map(|s| match s.op {
        Op::Gather if s.operands[1] == input_id => plan.steps[s.operands[0]].ty.shape[0]
            .as_known()
            .map(|v| v as usize),
        _ => None,
    });
    let io = ModelIo {
        input: TensorSpec {
            dtype: input_ty.dtype,
            shape: concrete(plan, &input_ty.shape[1..]),
        },
        target: TensorSpec {
            dtype: target.ty.dtype,
            shape: concrete(plan, &target.ty.shape[1..]),
        },
        classes,
        input_range,
    };
    Ok((io, input_name.to_string(), target_name.to_string()))
}

/// Sets input `name` of the executor to a batch of `batch` samples.
pub fn feed(e: &mut dyn Backend, name: &str, batch: usize, v: &Values) -> Result<(), ExecError> {
    e.set_input(name, batch, v)
}

/// Sets the schedule's scalars (learning rate, Adam's corrections) for step `step` of `total`;
/// returns them.
pub fn set_scalars(
    e: &mut dyn Backend,
    optimizer: &Optimizer,
    step: u64,
    total: u64,
) -> Result<Vec<(&'static str, f32)>, ExecError> {
    let scalars = optimizer.step_scalars(step, total);
    for &(name, v) in &scalars {
        if e.has_input(name) {
            e.set_input(name, 1, &Values::F32(vec![v]))?;
        }
    }
    Ok(scalars)
}

/// A compiled experiment ready to run one step at a time: its executor, its data and the
/// names of the inputs the data feeds (for tools, benchmarks and tests).
pub struct Session {
    pub exec: Executor,
    pub loader: Loader,
    pub train_samples: usize,
    pub validation: EvalSet,
    pub input: String,
    pub target: String,
}

/// A session's data without its executor (training builds the executor of its backend).
pub struct SessionData {
    /// SHA-256 (hex) of every sample of the training and validation sets.
    pub data_hash: String,
    pub loader: Loader,
    pub train_samples: usize,
    pub validation: EvalSet,
    pub input: String,
    pub target: String,
    /// The class names of an image folder, in index order (`classes.json`).
    pub classes: Option<Vec<String>>,
    /// What the data's loading wants the user told (hidden folders skipped, ...).
    pub warnings: Vec<String>,
    /// Image files left out by `skip_corrupt`.
    pub skipped_files: usize,
}

impl SessionData {
    /// Loads the experiment's data, split and shuffled by `seed`, in batches of `batch`.
    pub fn load(
        source: &Source,
        plan: &Plan,
        batch: usize,
        seed: u64,
        base_dir: &Path,
        first_batch: u64,
    ) -> Result<SessionData, TrainError> {
        let e = &source.experiment;
        let (io, input, target) = model_io(plan, &e.loss)?;
        if let parallax_compiler::dsl::ast::Data::Tokens { .. } = &e.data {
            let t = data::tokens::open(&e.data, &io, seed, base_dir, batch, e.train.shuffle)?;
            let train_samples = t.windows.per_epoch * batch;
            return Ok(SessionData {
                data_hash: t.hash,
                loader: Loader::windows(t.windows, first_batch)?,
                train_samples,
                validation: t.validation.into(),
                input,
                target,
                classes: None,
                warnings: Vec::new(),
                skipped_files: 0,
            });
        }
        if let parallax_compiler::dsl::ast::Data::ImageFolder { .. } = &e.data {
            let (shuffle, drop_last) = (e.train.shuffle, e.train.drop_last);
            let f =
                data::image_folder::open(&e.data, &io, seed, base_dir, batch, shuffle, drop_last)?;
            return Ok(SessionData {
                data_hash: f.hash,
                train_samples: f.images.samples.len(),
                loader: Loader::images(f.images, first_batch)?,
                validation: f.validation,
                input,
                target,
                classes: Some(f.classes),
                warnings: f.warnings,
                skipped_files: f.skipped,
            });
        }
        let splits = data::load(&e.data, &io, seed, base_dir)?;
        let train_samples = splits.train.len;
        let mut h = sha2::Sha256::new();
        for set in [&splits.train, &splits.validation] {
            for v in [&set.inputs, &set.targets] {
                match v {
                    Values::F32(x) => hash_le(&mut h, x, f32::to_le_bytes),
                    Values::I32(x) => hash_le(&mut h, x, i32::to_le_bytes),
                }
            }
        }
        let data_hash = hex(&h.finalize());
        let loader = Loader::with_shuffle(
            Arc::new(splits.train),
            batch,
            seed,
            e.train.drop_last,
            e.train.shuffle,
            first_batch,
        )?;
        Ok(SessionData {
            data_hash,
            loader,
            train_samples,
            validation: splits.validation.into(),
            input,
            target,
            classes: None,
            warnings: Vec::new(),
            skipped_files: 0,
        })
    }
}

/// Feeds `values` to `h` as their little-endian bytes, a few thousand at a time (one
/// `update` per value took 6% of loading a 4 GB generated data set).
fn hash_le<T: Copy>(h: &mut sha2::Sha256, values: &[T], bytes: fn(T) -> [u8; 4]) {
    let mut buf = Vec::with_capacity(4 * 4096);
    for chunk in values.chunks(4096) {
        buf.clear();
        buf.extend(chunk.iter().flat_map(|&v| bytes(v)));
        h.update(&buf);
    }
}

/// Where a training batch sits: its size, epoch and index within the epoch.
#[derive(Debug, Clone, Copy)]
pub struct BatchInfo {
    pub size: usize,
    pub epoch: u64,
    pub index: usize,
}

impl Session {
    /// Loads the experiment's data (split and shuffled by `seed`) and builds an executor for
    /// batches of `batch` samples, its parameters initialised from `seed`.
    pub fn new(
        source: &Source,
        plan: Plan,
        batch: usize,
        seed: u64,
        base_dir: &Path,
    ) -> Result<Session, TrainError> {
        let data = SessionData::load(source, &plan, batch, seed, base_dir, 0)?;
        Ok(Session {
            exec: Executor::new(plan, batch, seed),
            loader: data.loader,
            train_samples: data.train_samples,
            validation: data.validation,
            input: data.input,
            target: data.target,
        })
    }

    /// [`Session::new`] for the experiment's single-device plan (default options) at its own
    /// batch size, its data found from the working directory: what the examples, benchmarks
    /// and tests that time or inspect a plain step build.
    pub fn of_experiment(source: &Source, seed: u64) -> Result<Session, TrainError> {
        let options = parallax_compiler::Options::default();
        let plan = parallax_compiler::compile(source, &options, &mut |_, _| {})
            .map_err(|e| TrainError::Model(e.to_string()))?
            .plan(source, &options);
        let batch = source.experiment.train.batch_size as usize;
        Session::new(source, plan, batch, seed, Path::new("."))
    }

    /// Sets the next training batch as the executor's inputs.
    pub fn next_batch(&mut self) -> Result<BatchInfo, ExecError> {
        let b = self.loader.next().expect("the loader runs forever");
        feed(&mut self.exec, &self.input, b.size, &b.inputs)?;
        feed(&mut self.exec, &self.target, b.size, &b.targets)?;
        Ok(BatchInfo {
            size: b.size,
            epoch: b.epoch,
            index: b.index,
        })
    }
}
