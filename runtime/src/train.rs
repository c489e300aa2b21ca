//! Training on the CPU executor: the data set of the file, the compiled plan's training steps
//! with the schedule's scalars, validation after every epoch, and the run directory
//! (`experiment.ron`, `metrics.jsonl`, `summary.json`, `final.safetensors`).

use crate::backend::Backend;
use crate::cpu::tensor::Tensor;
use crate::cpu::{ExecError, Executor, Mode};
use crate::data::{self, DataError, Dataset, Loader, ModelIo, TensorSpec, Values};
use crate::weights::{self, WeightsError};
use parallax_compiler::dsl::ast::{Data, Experiment, Loss, Optimizer};
use parallax_compiler::ir::{Dim, Op};
use parallax_compiler::passes::lower::{LABELS, TARGET};
use parallax_compiler::{Plan, Source};
use serde::Serialize;
use sha2::Digest;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Clone, Default)]
pub struct TrainConfig {
    /// Overrides of the file's `train` section.
    pub steps: Option<u64>,
    pub epochs: Option<u64>,
    pub seed: Option<u64>,
    pub run_dir: PathBuf,
    /// Parameters to start from instead of the seeded initialisation.
    pub init: Option<PathBuf>,
    /// Where relative data paths are resolved (the experiment file's folder).
    pub base_dir: PathBuf,
    /// What runs the plan.
    pub device: Device,
    /// Write a checkpoint every this many steps (none when 0; a resumed run's own when
    /// `None`, and none for a new one).
    pub checkpoint_every: Option<u64>,
    /// Keep the newest this many checkpoints (all when 0; the run's own or 3 when `None`).
    pub keep: Option<usize>,
    /// Continue the run in `run_dir` from its newest checkpoint.
    pub resume: bool,
    /// Continue although the run's experiment or data changed (recorded in `run.json`).
    pub accept_changes: bool,
    /// Set to a signal's number to stop after the current step with a checkpoint.
    pub stop: Option<Arc<AtomicUsize>>,
    /// The `--set` overrides applied to the file, recorded in `run.json`.
    pub overrides: Vec<String>,
}

/// What runs a plan: one of them, never two.
#[derive(Debug, Clone, Copy, Default)]
pub enum Device {
    /// The CPU executor, the whole batch unsplit.
    #[default]
    Cpu,
    /// GPU 0 with the CUDA executor at this GEMM precision.
    Cuda(crate::cuda::Precision),
    /// A per-shard plan on simulated devices (`crate::sim`), on the CPU.
    Simulated(Simulated),
}

impl Device {
    /// The simulated devices, if these are.
    pub fn simulated(&self) -> Option<Simulated> {
        match *self {
            Device::Simulated(s) => Some(s),
            _ => None,
        }
    }

    /// As `run.json` names it.
    fn describe(&self) -> String {
        match self {
            Device::Cpu => "cpu".to_string(),
            Device::Cuda(p) => format!("cuda:0 ({p:?})"),
            Device::Simulated(s) => format!(
                "{} simulated device(s) on the cpu (dp{}.tp{}.pp{})",
                s.grid.devices(),
                s.grid.dp,
                s.grid.tp,
                s.grid.pp
            ),
        }
    }
}

/// Simulated devices for a partitioned plan.
#[derive(Debug, Clone, Copy)]
pub struct Simulated {
    pub grid: crate::sim::Grid,
    /// ZeRO stage: 1 shards the optimizer state over the data-parallel ranks, 2 the reduced
    /// gradients too, 3 the parameters too (0: none).
    pub zero: u8,
    /// Each device's memory, in bytes.
    pub capacity: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Model(String),
    /// A NaN or an infinity in the loss, a gradient, a parameter or a state after step
    /// `step` (or in the validation loss after epoch `epoch`). The data are checked finite
    /// when loaded, so the model diverged.
    #[error("{}: {what}; the data were checked finite when loaded, so the model diverged: lower the learning rate (now {lr}) or clip gradients (set `clip_norm`)", at(*.step, *.epoch))]
    NonFinite {
        step: u64,
        epoch: Option<u64>,
        what: String,
        lr: f32,
    },
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// The plan's buffers would not fit in the machine's memory (checked before allocating).
    #[error(transparent)]
    Memory(#[from] crate::host_memory::TooLarge),
    #[error(transparent)]
    RunDir(#[from] crate::run_dir::RunDirError),
    #[error(transparent)]
    Resume(#[from] crate::resume::ResumeError),
    /// A signal asked the run to stop: it finished its step and saved where it stood.
    #[error("stopped by {} after step {step} of {total}; its state is in {checkpoint}; continue with `parallax train --resume {dir}`", signal_name(*signal))]
    Interrupted {
        signal: usize,
        step: u64,
        total: u64,
        checkpoint: String,
        dir: String,
    },
}

/// `SIGINT`, `SIGTERM` or the number.
pub fn signal_name(signal: usize) -> String {
    match signal {
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}

/// Where a [`TrainError::NonFinite`] was found.
fn at(step: u64, epoch: Option<u64>) -> String {
    match epoch {
        Some(e) => format!("the validation after epoch {e} (step {step})"),
        None => format!("step {step}"),
    }
}

/// What a [`TrainError::NonFinite`] of a training step names: the loss, and the first tensor
/// holding a non-finite value.
fn non_finite(loss: f32, tensor: Option<crate::finite::NonFinite>) -> String {
    match (loss.is_finite(), tensor) {
        (true, Some(t)) => format!("{t} went non-finite, which the loss ({loss}) does not show"),
        (false, Some(t)) => format!("the loss is {loss}, and {t} went non-finite"),
        (_, None) => format!("the loss is {loss}"),
    }
}

/// Progress, for the command line to show.
#[derive(Debug, Clone)]
pub enum Event {
    Start {
        total_steps: u64,
        batches_per_epoch: u64,
        train_samples: usize,
        validation_samples: usize,
    },
    Step {
        step: u64,
        total: u64,
        epoch: u64,
        loss: f32,
        samples_per_sec: f64,
    },
    Validation {
        epoch: u64,
        loss: f64,
        accuracy: Option<f64>,
    },
    /// Something the user should know that does not stop the run.
    Warning(String),
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub name: String,
    pub steps: u64,
    pub epochs: f64,
    pub final_train_loss: f32,
    pub val_loss: Option<f64>,
    pub val_accuracy: Option<f64>,
    pub samples_per_sec: f64,
    /// Median step time after the first steps (warm-up excluded).
    pub step_time_ms_median: f64,
    pub wall_seconds: f64,
    pub parameters: u64,
    pub seed: u64,
    pub backend: &'static str,
    /// The run's identity: a hash of the resolved experiment and its data.
    pub run_id: String,
    /// The step this process started from (0, or a checkpoint's step when resumed).
    pub resumed_from: u64,
    /// Training batches whose every label was ignored (they train nothing).
    pub batches_without_labels: u64,
}

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

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The experiment as run: the file with the command line's overrides.
pub fn resolved(e: &Experiment, cfg: &TrainConfig) -> Experiment {
    let mut e = e.clone();
    if let Some(s) = cfg.steps {
        e.train.steps = Some(s);
        e.train.epochs = None;
    }
    if let Some(ep) = cfg.epochs {
        e.train.epochs = Some(ep);
        e.train.steps = None;
    }
    if let Some(seed) = cfg.seed {
        e.train.seed = seed;
    }
    // Data files are recorded absolute, so the run's `experiment.ron` (read again by
    // `--resume`, from the run folder) names the same files.
    let absolute = |p: &mut String| {
        if Path::new(p.as_str()).is_relative() {
            let joined = cfg.base_dir.join(p.as_str());
            *p = std::path::absolute(&joined)
                .unwrap_or(joined)
                .display()
                .to_string();
        }
    };
    match &mut e.data {
        Data::Idx { images, labels, .. } => {
            absolute(images);
            absolute(labels);
        }
        Data::Csv { path, .. } => absolute(path),
        Data::Npy { inputs, labels, .. } => {
            absolute(inputs);
            absolute(labels);
        }
        Data::Digits { .. }
        | Data::Blobs { .. }
        | Data::Sequence { .. }
        | Data::Synthetic { .. } => {}
    }
    e
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
        .find(|o| o.name != "loss")
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

/// Samples `from..to` of a batch whose samples hold `per` values each.
pub(crate) fn slice(v: &Values, per: usize, from: usize, to: usize) -> Values {
    match v {
        Values::F32(x) => Values::F32(x[from * per..to * per].to_vec()),
        Values::I32(x) => Values::I32(x[from * per..to * per].to_vec()),
    }
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
    pub validation: Dataset,
    pub input: String,
    pub target: String,
}

/// A session's data without its executor (training builds the executor of its backend).
pub struct SessionData {
    /// SHA-256 (hex) of every sample of the training and validation sets.
    pub data_hash: String,
    pub loader: Loader,
    pub train_samples: usize,
    pub validation: Dataset,
    pub input: String,
    pub target: String,
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
        let splits = data::load(&e.data, &io, seed, base_dir)?;
        let train_samples = splits.train.len;
        let mut h = sha2::Sha256::new();
        for set in [&splits.train, &splits.validation] {
            for v in [&set.inputs, &set.targets] {
                match v {
                    Values::F32(x) => x.iter().for_each(|a| h.update(a.to_le_bytes())),
                    Values::I32(x) => x.iter().for_each(|a| h.update(a.to_le_bytes())),
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
            validation: splits.validation,
            input,
            target,
        })
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

/// Correct predictions and positions: the argmax of the logits' last axis against labels.
fn correct(logits: &Tensor, labels: &[i32]) -> (usize, usize) {
    let c = *logits.shape.last().unwrap_or(&1);
    let v = logits.f32();
    let ignore = crate::cpu::kernels::rows::IGNORE;
    let counted = labels.iter().filter(|&&l| l != ignore).count();
    let hits = labels
        .iter()
        .enumerate()
        .filter(|&(_, &l)| l != ignore)
        .filter(|&(i, &l)| {
            let row = &v[i * c..(i + 1) * c];
            let best = row
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (j, &x)| if x > b.1 { (j, x) } else { b },
                )
                .0;
            best as i32 == l
        })
        .count();
    (hits, counted)
}

struct Validator<'a> {
    set: &'a Dataset,
    input: &'a str,
    target: &'a str,
    output: String,
    batch: usize,
}

impl Validator<'_> {
    /// Mean loss over the set (weighted by batch size) and accuracy for class labels.
    fn run(&self, e: &mut dyn Backend, step: u64) -> Result<(f64, Option<f64>), ExecError> {
        let n = self.set.len;
        let (per_in, per_t) = (self.set.input.numel(), self.set.target.numel());
        let (mut loss, mut hits, mut total) = (0f64, 0usize, 0usize);
        let mut from = 0;
        while from < n {
            let to = (from + self.batch).min(n);
            let b = to - from;
            feed(e, self.input, b, &slice(&self.set.inputs, per_in, from, to))?;
            let targets = slice(&self.set.targets, per_t, from, to);
            feed(e, self.target, b, &targets)?;
            e.run(b, Mode::Eval, step, from as u64)?;
            loss += e.loss(b)? as f64 * b as f64;
            if let (Values::I32(labels), Some(out)) = (&targets, e.output_values(&self.output, b)?)
            {
                let (h, t) = correct(&out, labels);
                hits += h;
                total += t;
            }
            from = to;
        }
        let acc = (total > 0).then(|| hits as f64 / total as f64);
        Ok((loss / n.max(1) as f64, acc))
    }
}

/// Trains the compiled `plan` of `source` and writes the run directory.
pub fn train(
    source: &Source,
    plan: Plan,
    cfg: &TrainConfig,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary, TrainError> {
    // The folder is checked and held before anything is loaded; a run that fails to start
    // leaves behind no folder it made.
    let held = crate::run_dir::RunDir::open(&cfg.run_dir, cfg.resume)?;
    let result = train_in(source, plan, cfg, on_event);
    if result.is_err() {
        held.abandon();
    }
    result
}

fn train_in(
    source: &Source,
    plan: Plan,
    cfg: &TrainConfig,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary, TrainError> {
    let started = Instant::now();
    let exp = resolved(&source.experiment, cfg);
    let seed = exp.train.seed;
    let batch_size = exp.train.batch_size as usize;
    if plan.updates.is_empty() {
        return Err(TrainError::Model(
            "the model has no parameters that affect the loss: there is nothing to train".into(),
        ));
    }
    let output = plan
        .output_steps
        .iter()
        .find(|o| o.name != "loss")
        .map(|o| o.name.clone())
        .unwrap_or_default();
    let parameters = plan.parameters;
    let optimizer = exp.optimizer.clone();
    let dir = &cfg.run_dir;
    // Where a resumed run starts: its newest checkpoint's own record, read before the data
    // (whose order it sets).
    let resume = if cfg.resume {
        Some(crate::resume::Resume::newest(dir)?)
    } else {
        None
    };
    let start_step = resume.as_ref().map_or(0, |r| r.step());
    // A continuation checkpoints as the run did, so a second crash loses no more.
    let (run_every, run_keep) = resume.as_ref().map_or((None, None), |r| {
        let (every, keep) = r.record.cadence();
        (Some(every), keep)
    });
    let checkpoint_every = cfg.checkpoint_every.or(run_every).unwrap_or(0);
    let keep = cfg.keep.or(run_keep).unwrap_or(3);
    let plan_label = format!(
        "dp{}.tp{}.pp{} {}",
        plan.strategy.dp, plan.strategy.tp, plan.strategy.pp, plan.device_kind
    );
    let plan_record = crate::run_record::PlanRecord {
        strategy: plan.strategy,
        micro_shards: plan.sharding.map(|s| s.shards),
        optimizer_shards: plan.optimizer_shards,
        kernels: plan.kernels.len(),
        ops: plan.ops,
        peak_memory_bytes: plan.memory.peak_bytes,
        batch_size: plan.batch_size,
    };
    // Checked before the data is loaded or anything allocated (a GPU's is `compile`'s).
    if !matches!(cfg.device, Device::Cuda(_)) {
        crate::host_memory::check(&plan, cfg.device.simulated().map(|s| s.grid))?;
    }
    let session = SessionData::load(source, &plan, batch_size, seed, &cfg.base_dir, start_step)?;
    let exp_text = parallax_compiler::dsl::to_ron(&exp);
    let id = run_id(&exp_text, &session.data_hash);
    let mut device_memory = None;
    let file_shapes = weights::FileShapes::of(&plan);
    let mut exec: Box<dyn Backend> = match cfg.device {
        Device::Simulated(sim) => {
            let devices = crate::sim::SimulatedDevices::new(plan, sim.grid, seed, sim.capacity)?;
            device_memory = Some(devices.memory().iter().map(|m| m.bytes).collect::<Vec<_>>());
            Box::new(devices)
        }
        Device::Cpu => Box::new(Executor::new(plan, batch_size, seed)),
        Device::Cuda(precision) => Box::new(crate::cuda::CudaExecutor::new(
            plan, batch_size, seed, 0, precision,
        )?),
    };
    if let Some(init) = &cfg.init {
        weights::load(exec.as_mut(), &file_shapes, init)?;
    }
    let model = crate::checkpoint::fingerprint(&exec.param_values()?, &exec.state_values()?);
    let mut changes = Vec::new();
    if let Some(r) = &resume {
        crate::checkpoint::load(&r.checkpoint, exec.as_mut(), &file_shapes)?;
        // The run's identity as its experiment reads now, without this command's budget.
        let unextended = TrainConfig {
            steps: None,
            epochs: None,
            ..cfg.clone()
        };
        let text = parallax_compiler::dsl::to_ron(&resolved(&source.experiment, &unextended));
        changes = r.check_identity(
            &|data| run_id(&text, data),
            &session.data_hash,
            cfg.accept_changes,
        )?;
    }
    let per_epoch = session.loader.batches_per_epoch() as u64;
    let total = match (exp.train.steps, exp.train.epochs) {
        (Some(s), _) => s,
        (None, Some(ep)) => ep.checked_mul(per_epoch).ok_or_else(|| {
            TrainError::Model(format!(
                "{ep} epochs of {per_epoch} steps each is more steps than can be counted; ask for fewer epochs"
            ))
        })?,
        (None, None) => per_epoch,
    };
    if let Some(r) = &resume {
        r.check_budget(total)?;
    }
    let exp_path = dir.join("experiment.ron");
    write_atomic(&exp_path, exp_text.as_bytes())?;
    let record_path = dir.join(crate::run_record::FILE);
    let devices = cfg.device.describe();
    let record = match &resume {
        // The record of the run being continued, with this continuation noted.
        Some(r) => r.record_with(crate::run_record::Continuation {
            from_step: start_step,
            run_id: id.clone(),
            data_sha256: Some(session.data_hash.clone()),
            devices,
            checkpoint_every: Some(checkpoint_every),
            keep: Some(keep),
            accepted_changes: changes.iter().map(|c| c.to_string()).collect(),
        }),
        None => crate::run_record::RunRecord {
            run_id: id.clone(),
            data_sha256: session.data_hash.clone(),
            parallax_version: env!("CARGO_PKG_VERSION").to_string(),
            backend: exec.backend_name().to_string(),
            devices,
            plan: plan_record,
            device_memory_bytes: device_memory,
            overrides: cfg.overrides.clone(),
            checkpoint_every,
            keep: Some(keep),
            resumes: Vec::new(),
        },
    };
    write_atomic(&record_path, record.to_json().as_bytes())?;
    // Metrics: a resumed run keeps the lines up to its checkpoint (a crashed run may have
    // logged steps after it) and appends from there.
    let metrics_path = dir.join("metrics.jsonl");
    if cfg.resume {
        let old = std::fs::read_to_string(&metrics_path).unwrap_or_default();
        let kept = crate::resume::metrics_through(&old, start_step);
        write_atomic(&metrics_path, kept.as_bytes())?;
    }
    let mut metrics = std::io::BufWriter::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&metrics_path)
            .map_err(io_err(&metrics_path))?,
    );
    let mut events = crate::tensorboard::EventWriter::create(dir).map_err(io_err(dir))?;
    let events_path = events.path().to_path_buf();
    if cfg.resume {
        events
            .session_start(start_step + 1)
            .map_err(io_err(&events_path))?;
    }

    on_event(&Event::Start {
        total_steps: total,
        batches_per_epoch: per_epoch,
        train_samples: session.train_samples,
        validation_samples: session.validation.len,
    });
    let SessionData {
        mut loader,
        validation,
        input,
        target,
        ..
    } = session;
    let validator = Validator {
        set: &validation,
        input: &input,
        target: &target,
        output,
        batch: batch_size,
    };
    // Grows with the steps run, never reserved for an absurd budget up front.
    let mut times = Vec::with_capacity(total.min(1 << 16) as usize);
    let (mut samples, mut last_loss) = (0usize, f32::NAN);
    let mut val = (None, None);
    let mut without_labels = 0u64;
    let save_checkpoint = |exec: &dyn Backend, step: u64| {
        let meta = crate::checkpoint::Meta {
            step,
            run_id: id.clone(),
            model: model.clone(),
            plan: plan_label.clone(),
        };
        crate::checkpoint::save(dir, exec, &file_shapes, &meta, keep)
    };
    // Every write error stops the run, naming the file (a metrics file with holes would
    // misreport the run). Each line reaches the file whole, as its step ends, for whoever
    // follows the run.
    let log = |metrics: &mut std::io::BufWriter<std::fs::File>, line: serde_json::Value| {
        writeln!(metrics, "{line}")
            .and_then(|_| metrics.flush())
            .map_err(io_err(&metrics_path))
    };
    for step in start_step..total {
        let batch = loader.next().expect("the loader runs forever");
        if labelled_but_all_ignored(&exp.loss, &batch.targets) {
            without_labels += 1;
            if without_labels == 1 {
                on_event(&Event::Warning(format!(
                    "step {}: every label of this batch is ignored ({}), so it trains nothing; the summary counts such batches",
                    step + 1,
                    crate::cpu::kernels::rows::IGNORE
                )));
            }
        }
        let t = Instant::now();
        feed(exec.as_mut(), &input, batch.size, &batch.inputs)?;
        feed(exec.as_mut(), &target, batch.size, &batch.targets)?;
        let scalars = set_scalars(exec.as_mut(), &optimizer, step, total)?;
        exec.run(batch.size, Mode::Train, step, 0)?;
        // Reading the loss waits for an asynchronous backend's step to finish.
        let loss = exec.loss(batch.size)?;
        times.push(t.elapsed().as_secs_f64());
        samples += batch.size;
        // The loss misses a NaN that a ReLU or a max-pooling hides: every tensor is checked.
        let tensor = exec.first_non_finite()?;
        if !loss.is_finite() || tensor.is_some() {
            return Err(TrainError::NonFinite {
                step: step + 1,
                epoch: None,
                what: non_finite(loss, tensor),
                lr: scalars[0].1,
            });
        }
        last_loss = loss;
        log(
            &mut metrics,
            serde_json::json!({"step": step + 1, "epoch": batch.epoch, "loss": loss, "lr": scalars[0].1}),
        )?;
        let tb = io_err(&events_path);
        events.scalar("train/loss", step + 1, loss).map_err(&tb)?;
        events
            .scalar("train/lr", step + 1, scalars[0].1)
            .map_err(&tb)?;
        let busy: f64 = times.iter().sum();
        on_event(&Event::Step {
            step: step + 1,
            total,
            epoch: batch.epoch,
            loss,
            samples_per_sec: samples as f64 / busy.max(1e-9),
        });
        let epoch_end = batch.index as u64 + 1 == per_epoch;
        if (epoch_end || step + 1 == total) && validator.set.len > 0 {
            let (l, a) = validator.run(exec.as_mut(), step)?;
            if !l.is_finite() {
                return Err(TrainError::NonFinite {
                    step: step + 1,
                    epoch: Some(batch.epoch),
                    what: format!(
                        "the validation loss is {l}, though every tensor of the step was finite"
                    ),
                    lr: scalars[0].1,
                });
            }
            val = (Some(l), a);
            log(
                &mut metrics,
                serde_json::json!({"step": step + 1, "epoch": batch.epoch, "val_loss": l, "val_accuracy": a}),
            )?;
            events.scalar("val/loss", step + 1, l as f32).map_err(&tb)?;
            if let Some(a) = a {
                events
                    .scalar("val/accuracy", step + 1, a as f32)
                    .map_err(&tb)?;
            }
            on_event(&Event::Validation {
                epoch: batch.epoch,
                loss: l,
                accuracy: a,
            });
        }
        let mut saved = None;
        if checkpoint_every > 0 && (step + 1) % checkpoint_every == 0 {
            // The metrics up to this step reach the file before the checkpoint exists.
            metrics.flush().map_err(io_err(&metrics_path))?;
            saved = Some(save_checkpoint(exec.as_ref(), step + 1)?);
        }
        // A signal stops the run here, its step done and saved, unless this was the last.
        let signal = cfg.stop.as_ref().map_or(0, |s| s.load(Ordering::SeqCst));
        if signal != 0 && step + 1 < total {
            metrics.flush().map_err(io_err(&metrics_path))?;
            events.flush().map_err(&tb)?;
            let checkpoint = match saved {
                Some(p) => p,
                None => save_checkpoint(exec.as_ref(), step + 1)?,
            };
            return Err(TrainError::Interrupted {
                signal,
                step: step + 1,
                total,
                checkpoint: checkpoint.display().to_string(),
                dir: dir.display().to_string(),
            });
        }
    }
    metrics.flush().map_err(io_err(&metrics_path))?;
    events.flush().map_err(io_err(&events_path))?;
    let weights_path = dir.join("final.safetensors");
    weights::save(exec.as_ref(), &file_shapes, &weights_path)?;

    let warmup = (times.len() / 10).clamp(1.min(times.len()), 5);
    let mut steady: Vec<f64> = times[warmup..].to_vec();
    steady.sort_by(|a, b| a.total_cmp(b));
    let median = steady.get(steady.len() / 2).copied().unwrap_or(0.0);
    let busy: f64 = times.iter().sum();
    let summary = Summary {
        name: exp.name.clone(),
        steps: total,
        epochs: total as f64 / per_epoch.max(1) as f64,
        final_train_loss: last_loss,
        val_loss: val.0,
        val_accuracy: val.1,
        samples_per_sec: samples as f64 / busy.max(1e-9),
        step_time_ms_median: median * 1e3,
        wall_seconds: started.elapsed().as_secs_f64(),
        parameters,
        seed,
        backend: exec.backend_name(),
        run_id: id.clone(),
        resumed_from: start_step,
        batches_without_labels: without_labels,
    };
    let summary_path = dir.join("summary.json");
    let text = serde_json::to_string_pretty(&summary).expect("a summary serialises") + "\n";
    write_atomic(&summary_path, text.as_bytes())?;
    Ok(summary)
}

/// Whether a batch has class labels and every one of them is ignored.
fn labelled_but_all_ignored(loss: &Loss, targets: &Values) -> bool {
    match (loss, targets) {
        (Loss::CrossEntropy { .. }, Values::I32(labels)) => labels
            .iter()
            .all(|&l| l == crate::cpu::kernels::rows::IGNORE),
        _ => false,
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    crate::files::write_atomic(path, bytes).map_err(io_err(path))
}
