//! Training: the compiled plan's steps on a backend (the CPU executor, simulated devices or
//! CUDA) with the schedule's scalars, validation after every epoch, and the run directory
//! (`experiment.ron`, `run.json`, `metrics.jsonl`, checkpoints, `summary.json`,
//! `final.safetensors`). Beside it: `config` (what a run is asked for), `session` (the data
//! and the plan's inputs), `validate`, `error` (why a run stopped).

mod config;
mod error;
mod job;
mod open;
mod placed;
pub mod prepare;
mod records;
pub mod say;
mod session;
pub mod signals;
mod steps;
mod validate;

pub use config::{parallel_devices, resolved, CudaRanks, Device, Fault, Simulated, TrainConfig};
pub use error::{signal_name, TrainError};
pub use placed::{train_placed, PlacedError};
pub use session::{feed, model_io, run_id, set_scalars, BatchInfo, Session, SessionData};
pub use validate::{Tally, Validator};

use crate::backend::Backend;
use crate::cpu::Executor;
use crate::data::Values;
use crate::ranks::{lock, Peers};
use crate::run::weights;
use parallax_compiler::dsl::ast::Loss;
use parallax_compiler::{Plan, Source};
use serde::Serialize;
use std::path::Path;
use std::time::Instant;
use steps::{Steps, Tallies};

/// The file of the run directory that holds the class names of data that names its classes
/// (an image folder's), in index order, as a JSON array.
pub const CLASSES: &str = "classes.json";

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
    /// Seconds the steps waited for their batch: the loading the loader's threads did not
    /// hide.
    pub data_wait_seconds: f64,
    /// That wait's share of the time spent in steps and waiting.
    pub data_wait_share: f64,
    /// Samples of the trained batches this process read (decoded): all of them, or, in a
    /// job of several processes, its devices' micro-shards' (rank 0's, in the run's file).
    pub data_samples_read: u64,
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
    /// Image files that `skip_corrupt` left out (image folders only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_files: Option<u64>,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Trains the compiled `plan` of `source` and writes the run directory.
pub fn train(
    source: &Source,
    plan: Plan,
    cfg: &TrainConfig,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary, TrainError> {
    train_with(source, plan, cfg, None, on_event)
}

/// [`train`] as one rank of a job of processes, one per device of the plan's grid, over
/// `peers` (`cfg.device` must be `Simulated` with that grid). The ranks first agree on the
/// experiment, the binary and the plan (a mismatch is refused on every rank); each runs its
/// device on its own shards of each batch; values another rank holds (the loss, outputs,
/// parameters for checkpoints) come from it; rank 0 alone writes the run directory.
pub fn train_rank(
    source: &Source,
    plan: Plan,
    cfg: &TrainConfig,
    peers: Peers,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary, TrainError> {
    let experiment = parallax_compiler::dsl::to_ron(&resolved(&source.experiment, cfg));
    job::agree(&peers, &plan, experiment.as_bytes())?;
    train_with(source, plan, cfg, Some(peers), on_event)
}

fn train_with(
    source: &Source,
    plan: Plan,
    cfg: &TrainConfig,
    peers: Option<Peers>,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary, TrainError> {
    let writes = peers.as_ref().is_none_or(|p| lock(p).rank() == 0);
    // The folder is checked and held before anything is loaded; a run that fails to start
    // leaves behind no folder it made.
    let held = match writes {
        true => Some(crate::run::dir::RunDir::open(&cfg.run_dir, cfg.resume)?),
        false => None,
    };
    let result = train_in(source, plan, cfg, peers, writes, on_event);
    if let (Err(_), Some(held)) = (&result, held) {
        held.abandon();
    }
    result
}

fn train_in(
    source: &Source,
    plan: Plan,
    cfg: &TrainConfig,
    peers: Option<Peers>,
    // Rank 0 of a job (or a lone process) writes the run directory; every rank computes
    // what goes into it, so that they make the same reads of the devices in the same order.
    writes: bool,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary, TrainError> {
    let started = Instant::now();
    let o = open::open(source, plan, cfg, &peers, writes)?;
    let (exp, session, mut exec, mut records) = (o.exp, o.session, o.exec, o.records);
    if writes {
        for w in &session.warnings {
            on_event(&Event::Warning(w.clone()));
        }
    }
    on_event(&Event::Start {
        total_steps: o.total,
        batches_per_epoch: o.per_epoch,
        train_samples: session.train_samples,
        validation_samples: session.validation.len(),
    });
    let SessionData {
        mut loader,
        validation,
        input,
        target,
        skipped_files,
        ..
    } = session;
    let validator = Validator {
        set: &validation,
        input: &input,
        target: &target,
        output: o.output,
        batch: o.batch_size,
    };
    let dir = &cfg.run_dir;
    // Every rank gathers the tensors (the same reads in the same order); one writes them.
    let save_checkpoint = |exec: &dyn Backend, step: u64| {
        let meta = crate::run::checkpoint::Meta {
            step,
            run_id: o.id.clone(),
            model: o.model.clone(),
            plan: o.plan_label.clone(),
        };
        let values = crate::run::checkpoint::values(exec)?;
        let path = crate::run::checkpoint::path_for(dir, step);
        if writes {
            crate::run::checkpoint::write(dir, values, &o.file_shapes, &meta, o.keep)?;
        }
        Ok::<_, TrainError>(path)
    };
    let mut steps = Steps {
        exp: &exp,
        cfg,
        peers: &peers,
        input: &input,
        target: &target,
        validator: &validator,
        total: o.total,
        per_epoch: o.per_epoch,
        checkpoint_every: o.checkpoint_every,
        records: &mut records,
        save: &save_checkpoint,
        t: Tallies::default(),
    };
    for step in o.start_step..o.total {
        steps.run(exec.as_mut(), &mut loader, step, on_event)?;
    }
    let mut t = steps.t;
    if o.start_step == o.total && o.start_step > 0 {
        // The run stopped after its last checkpoint, before its final files: finish it.
        t.last_loss = o.logged.0.unwrap_or(f32::NAN);
        // Every rank validates (the same collectives); the line is o.logged once.
        if !validator.set.is_empty() {
            let (l, a) = validator.run(exec.as_mut(), o.total - 1)?;
            if o.logged.1.is_none() {
                records
                    .line(serde_json::json!({"step": o.total, "val_loss": l, "val_accuracy": a}))?;
            }
            t.val = (Some(l), a);
        }
    }
    records.flush()?;
    let weights_path = dir.join("final.safetensors");
    let (params, stats) = weights::model_values(exec.as_ref())?;
    if writes {
        weights::write(params, stats, &o.file_shapes, &weights_path)?;
    }

    let median = steady_median(&t.times);
    let busy: f64 = t.times.iter().sum();
    let summary = Summary {
        name: exp.name.clone(),
        steps: o.total,
        epochs: o.total as f64 / o.per_epoch.max(1) as f64,
        final_train_loss: t.last_loss,
        val_loss: t.val.0,
        val_accuracy: t.val.1,
        samples_per_sec: t.samples as f64 / busy.max(1e-9),
        step_time_ms_median: median * 1e3,
        data_wait_seconds: t.data_wait,
        data_wait_share: t.data_wait / (t.data_wait + busy).max(1e-9),
        data_samples_read: t.samples_read,
        wall_seconds: started.elapsed().as_secs_f64(),
        parameters: o.parameters,
        seed: exp.train.seed,
        backend: exec.backend_name(),
        run_id: o.id.clone(),
        resumed_from: o.start_step,
        batches_without_labels: t.without_labels,
        skipped_files: (skipped_files > 0).then_some(skipped_files as u64),
    };
    let summary_path = dir.join(crate::run::resume::SUMMARY);
    let text = serde_json::to_string_pretty(&summary).expect("a summary serialises") + "\n";
    if writes {
        write_atomic(&summary_path, text.as_bytes())?;
    }
    Ok(summary)
}

/// The median step time after the first steps (warm-up excluded).
fn steady_median(times: &[f64]) -> f64 {
    let warmup = (times.len() / 10).clamp(1.min(times.len()), 5);
    let mut steady: Vec<f64> = times[warmup..].to_vec();
    steady.sort_by(|a, b| a.total_cmp(b));
    steady.get(steady.len() / 2).copied().unwrap_or(0.0)
}

/// What was logged at the checkpoint's step `at` of a continuation (`continues`: this process
/// writes the folder of a resumed run), when that is the run's last (`total`): the run is
/// then finished from it. A summary left from before is removed (the continuation writes
/// its own).
fn continued(
    dir: &Path,
    continues: bool,
    at: u64,
    total: u64,
) -> Result<crate::run::resume::Logged, TrainError> {
    if !continues {
        return Ok((None, None));
    }
    let path = dir.join(crate::run::resume::SUMMARY);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(&path)(e)),
        _ => {}
    }
    if at != total || at == 0 {
        return Ok((None, None));
    }
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
    Ok(crate::run::resume::logged_at(&text, total))
}

/// A backend, and what each device of a partitioned plan allocated.
pub type Built = (Box<dyn Backend>, Option<Vec<u64>>);

/// What runs `plan` on `device` (one rank's devices of a job over `peers`), for batches of up
/// to `batch_size` with parameters initialised from `seed`, and what each device of a
/// partitioned plan allocated.
pub fn backend(
    plan: Plan,
    device: Device,
    peers: &Option<Peers>,
    batch_size: usize,
    seed: u64,
) -> Result<Built, TrainError> {
    let max_batch = plan.batch_size as usize;
    let mut device_memory = None;
    let exec: Box<dyn Backend> = match (device, peers) {
        (Device::Simulated(sim), Some(peers)) => {
            let peers = peers.clone();
            let ranks = crate::ranks::Ranks::process(plan, sim.grid, seed, sim.capacity, peers)?;
            device_memory = Some(ranks.memory_of_all()?);
            Box::new(ranks)
        }
        (Device::CudaRanks(g), Some(peers)) => {
            let make = crate::ranks::shard::cuda(max_batch, seed, g.precision, move |_| g.gpu(0));
            let mut ranks = crate::ranks::Ranks::process_with(
                plan,
                g.ranks.grid,
                g.ranks.capacity,
                peers.clone(),
                &make,
            )?;
            if let Some(timeout) = g.nccl {
                ranks.use_nccl(timeout)?;
            }
            device_memory = Some(ranks.memory_of_all()?);
            Box::new(ranks)
        }
        (_, Some(_)) => {
            return Err(TrainError::Model(
                "a job of processes runs a partitioned plan (one device per rank)".into(),
            ))
        }
        (Device::CudaRanks(g), None) => {
            let make = crate::ranks::shard::cuda(max_batch, seed, g.precision, move |d| g.gpu(d));
            let mut ranks =
                crate::ranks::Ranks::in_process_with(plan, g.ranks.grid, g.ranks.capacity, &make)?;
            if let Some(timeout) = g.nccl {
                ranks.use_nccl(timeout)?;
            }
            device_memory = Some(ranks.memory_of_all()?);
            Box::new(ranks)
        }
        (Device::Simulated(sim), None) => {
            let ranks = crate::ranks::Ranks::in_process(plan, sim.grid, seed, sim.capacity)?;
            device_memory = Some(ranks.memory_of_all()?);
            Box::new(ranks)
        }
        (Device::Cpu, None) => Box::new(Executor::new(plan, batch_size, seed)),
        (Device::Cuda(precision), None) => Box::new(crate::cuda::CudaExecutor::new(
            plan, batch_size, seed, 0, precision,
        )?),
    };
    Ok((exec, device_memory))
}

/// Whether a batch has class labels and every one of them is ignored.
fn labelled_but_all_ignored(loss: &Loss, targets: &Values) -> bool {
    match (loss, targets) {
        (Loss::CrossEntropy { .. }, Values::I32(labels)) => {
            labels.iter().all(|&l| l == crate::exec::IGNORE)
        }
        _ => false,
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    crate::run::atomic::write_atomic(path, bytes).map_err(io_err(path))
}
