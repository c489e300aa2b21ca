//! Training: the compiled plan's steps on a backend (the CPU executor, simulated devices or
//! CUDA) with the schedule's scalars, validation after every epoch, and the run directory
//! (`experiment.ron`, `run.json`, `metrics.jsonl`, checkpoints, `summary.json`,
//! `final.safetensors`). Beside it: `config` (what a run is asked for), `session` (the data
//! and the plan's inputs), `validate`, `error` (why a run stopped).

mod config;
mod error;
mod job;
mod records;
mod session;
mod validate;

pub use config::{parallel_devices, resolved, CudaRanks, Device, Simulated, TrainConfig};
pub use error::{signal_name, TrainError};
pub use session::{feed, model_io, run_id, set_scalars, BatchInfo, Session, SessionData};

use crate::backend::Backend;
use crate::cpu::Executor;
use crate::data::Values;
use crate::exec::Mode;
use crate::ranks::{lock, Peers};
use crate::weights;
use error::non_finite;
use parallax_compiler::dsl::ast::Loss;
use parallax_compiler::{Plan, Source};
use serde::Serialize;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Instant;
use validate::Validator;

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
        true => Some(crate::run_dir::RunDir::open(&cfg.run_dir, cfg.resume)?),
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
        .find(|o| o.name != parallax_compiler::plan::LOSS)
        .map(|o| o.name.clone())
        .unwrap_or_default();
    let parameters = plan.parameters;
    let optimizer = exp.optimizer.clone();
    let dir = &cfg.run_dir;
    // Where a resumed run starts: its newest checkpoint's own record, read before the data
    // (whose order it sets).
    if let Some(steps) = cfg
        .resume
        .then(|| crate::resume::finished(dir, cfg.steps))
        .flatten()
    {
        return Err(TrainError::Finished {
            dir: dir.display().to_string(),
            steps,
        });
    }
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
    let plan_record = crate::run_record::PlanRecord::of(&plan);
    // Checked before the data is loaded or anything allocated (a GPU's is `compile`'s).
    if !matches!(cfg.device, Device::Cuda(_) | Device::CudaRanks(_)) {
        crate::host_memory::check(&plan, cfg.device.simulated().map(|s| s.grid))?;
    }
    let session = SessionData::load(source, &plan, batch_size, seed, &cfg.base_dir, start_step)?;
    if writes {
        session
            .warnings
            .iter()
            .for_each(|w| on_event(&Event::Warning(w.clone())));
    }
    if let Some(p) = &peers {
        job::agree_on_data(p, &session.data_hash)?;
    }
    let exp_text = parallax_compiler::dsl::to_ron(&exp);
    let id = run_id(&exp_text, &session.data_hash);
    let file_shapes = weights::FileShapes::of(&plan);
    let (mut exec, device_memory) = backend(plan, cfg.device, &peers, batch_size, seed)?;
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
    // Every rank reads the run's state before rank 0 writes anything over it.
    if let Some(p) = &peers {
        lock(p).barrier().map_err(|e| TrainError::Exec(e.into()))?;
    }
    let exp_path = dir.join("experiment.ron");
    if writes {
        write_atomic(&exp_path, exp_text.as_bytes())?;
        // An image folder's class names in index order, for `predict` and the user.
        if let Some(classes) = &session.classes {
            let text = serde_json::to_string(classes).expect("strings serialise") + "\n";
            write_atomic(&dir.join("classes.json"), text.as_bytes())?;
        }
    }
    let record_path = dir.join(crate::run_record::FILE);
    let devices = cfg.device.describe(peers.is_some());
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
            plan: Some(plan_record),
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
    if writes {
        write_atomic(&record_path, record.to_json().as_bytes())?;
    }
    let mut records = match writes {
        true => records::Records::open(dir, cfg.resume, start_step)?,
        false => records::Records::none(),
    };
    let logged = continued(dir, writes && cfg.resume, start_step, total)?;

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
        skipped_files,
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
    // Every rank gathers the tensors (the same reads in the same order); one writes them.
    let save_checkpoint = |exec: &dyn Backend, step: u64| {
        let meta = crate::checkpoint::Meta {
            step,
            run_id: id.clone(),
            model: model.clone(),
            plan: plan_label.clone(),
        };
        let values = crate::checkpoint::values(exec)?;
        let path = crate::checkpoint::path_for(dir, step);
        if writes {
            crate::checkpoint::write(dir, values, &file_shapes, &meta, keep)?;
        }
        Ok::<_, TrainError>(path)
    };
    for step in start_step..total {
        let Some(batch) = loader.next() else {
            let why = loader.failure().map_or_else(
                || TrainError::Model("the data loader stopped".into()),
                TrainError::from,
            );
            return Err(why);
        };
        if labelled_but_all_ignored(&exp.loss, &batch.targets) {
            without_labels += 1;
            if without_labels == 1 {
                on_event(&Event::Warning(format!(
                    "step {}: every label of this batch is ignored ({}), so it trains nothing; the summary counts such batches",
                    step + 1,
                    crate::exec::IGNORE
                )));
            }
        }
        let t = Instant::now();
        feed(exec.as_mut(), &input, batch.size, &batch.inputs)?;
        feed(exec.as_mut(), &target, batch.size, &batch.targets)?;
        let scalars = set_scalars(exec.as_mut(), &optimizer, step, total)?;
        let at_step = |source| TrainError::Step {
            step: step + 1,
            source,
        };
        exec.run(batch.size, Mode::Train, step, 0)
            .map_err(at_step)?;
        // Reading the loss waits for an asynchronous backend's step to finish.
        let loss = exec.loss(batch.size).map_err(at_step)?;
        times.push(t.elapsed().as_secs_f64());
        samples += batch.size;
        // The loss misses a NaN that a ReLU or a max-pooling hides: every tensor is checked.
        let tensor = exec.first_non_finite().map_err(at_step)?;
        if !loss.is_finite() || tensor.is_some() {
            return Err(TrainError::NonFinite {
                step: step + 1,
                epoch: None,
                what: non_finite(loss, tensor),
                lr: scalars[0].1,
            });
        }
        last_loss = loss;
        records.line(
            serde_json::json!({"step": step + 1, "epoch": batch.epoch, "loss": loss, "lr": scalars[0].1}),
        )?;
        records.scalar("train/loss", step + 1, loss)?;
        records.scalar("train/lr", step + 1, scalars[0].1)?;
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
            records.line(
                serde_json::json!({"step": step + 1, "epoch": batch.epoch, "val_loss": l, "val_accuracy": a}),
            )?;
            records.scalar("val/loss", step + 1, l as f32)?;
            if let Some(a) = a {
                records.scalar("val/accuracy", step + 1, a as f32)?;
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
            records.flush()?;
            saved = Some(save_checkpoint(exec.as_ref(), step + 1)?);
        }
        // A signal stops the run here, its step done and saved, unless this was the last;
        // the ranks of a job vote, so that all stop after the same step.
        let mut signal = cfg.stop.as_ref().map_or(0, |s| s.load(Ordering::SeqCst));
        if let Some(p) = &peers {
            let any = lock(p).any(signal != 0).map_err(|e| TrainError::Step {
                step: step + 1,
                source: e.into(),
            })?;
            if any && signal == 0 {
                signal = job::SIGNALLED_ELSEWHERE;
            }
        }
        if signal != 0 && step + 1 < total {
            records.flush()?;
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
    if start_step == total && start_step > 0 {
        // The run stopped after its last checkpoint, before its final files: finish it.
        last_loss = logged.0.unwrap_or(f32::NAN);
        // Every rank validates (the same collectives); the line is logged once.
        if validator.set.len > 0 {
            let (l, a) = validator.run(exec.as_mut(), total - 1)?;
            if logged.1.is_none() {
                records
                    .line(serde_json::json!({"step": total, "val_loss": l, "val_accuracy": a}))?;
            }
            val = (Some(l), a);
        }
    }
    records.flush()?;
    let weights_path = dir.join("final.safetensors");
    let (params, stats) = weights::model_values(exec.as_ref())?;
    if writes {
        weights::write(params, stats, &file_shapes, &weights_path)?;
    }

    let median = steady_median(&times);
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
        skipped_files: (skipped_files > 0).then_some(skipped_files as u64),
    };
    let summary_path = dir.join(crate::resume::SUMMARY);
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
) -> Result<crate::resume::Logged, TrainError> {
    if !continues {
        return Ok((None, None));
    }
    let path = dir.join(crate::resume::SUMMARY);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(&path)(e)),
        _ => {}
    }
    if at != total || at == 0 {
        return Ok((None, None));
    }
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
    Ok(crate::resume::logged_at(&text, total))
}

/// A backend, and what each device of a partitioned plan allocated.
type Built = (Box<dyn Backend>, Option<Vec<u64>>);

/// What runs `plan` on `device` (one rank's devices of a job over `peers`), and what each
/// device of a partitioned plan allocated.
fn backend(
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
    crate::files::write_atomic(path, bytes).map_err(io_err(path))
}
