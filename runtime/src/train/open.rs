//! A run opened for its steps: the experiment resolved with this command's budget, where a
//! resumed run starts and how it checkpoints, the data, the backend with its weights (fresh,
//! `--init`'s or the checkpoint's), the run's identity; `experiment.ron` and `run.json`
//! written (by the rank that writes).

use super::records::{self, Records};
use super::session::{run_id, SessionData};
use super::{backend, continued, job, resolved, write_atomic, Device, TrainConfig, TrainError};
use crate::backend::Backend;
use crate::ranks::{lock, Peers};
use crate::run::resume::Logged;
use crate::run::weights::{self, FileShapes};
use parallax_compiler::dsl::ast::Experiment;
use parallax_compiler::{Plan, Source};

/// What the steps start from.
pub(super) struct Opened {
    pub exp: Experiment,
    pub batch_size: usize,
    pub output: String,
    pub parameters: u64,
    pub start_step: u64,
    pub checkpoint_every: u64,
    pub keep: usize,
    /// The split the checkpoints record (`dp1.tp1.pp1` and the device kind).
    pub plan_label: String,
    pub session: SessionData,
    /// The run's identity: a hash of its resolved experiment and data.
    pub id: String,
    /// The model's fingerprint (its parameters' and states' names and shapes).
    pub model: String,
    pub file_shapes: FileShapes,
    pub exec: Box<dyn Backend>,
    pub per_epoch: u64,
    pub total: u64,
    pub records: Records,
    /// What a resumed run had logged at its last step (a run finished from its checkpoint).
    pub logged: Logged,
}

/// Opens the run of `cfg` for `plan` (one rank of a job over `peers`; `writes`: this process
/// writes the run directory).
pub(super) fn open(
    source: &Source,
    plan: Plan,
    cfg: &TrainConfig,
    peers: &Option<Peers>,
    writes: bool,
) -> Result<Opened, TrainError> {
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
    let dir = &cfg.run_dir;
    let (resume, start_step, checkpoint_every, keep) = resumption(cfg)?;
    let plan_label = format!(
        "dp{}.tp{}.pp{} {}",
        plan.strategy.dp, plan.strategy.tp, plan.strategy.pp, plan.device_kind
    );
    let plan_record = crate::run::record::PlanRecord::of(&plan);
    // Checked before the data is loaded or anything allocated (a GPU's is `compile`'s).
    if !matches!(cfg.device, Device::Cuda(_) | Device::CudaRanks(_)) {
        crate::exec::host_memory::check(&plan, cfg.device.simulated().map(|s| s.grid))?;
    }
    let mut session =
        SessionData::load(source, &plan, batch_size, seed, &cfg.base_dir, start_step)?;
    if let Some(p) = peers {
        job::agree_on_data(p, &session.data_hash)?;
    }
    let exp_text = parallax_compiler::dsl::to_ron(&exp);
    let id = run_id(&exp_text, &session.data_hash);
    let file_shapes = weights::FileShapes::of(&plan);
    let (mut exec, device_memory) = backend(plan, cfg.device, peers, batch_size, seed)?;
    // A process of a job reads only its devices' samples of each batch.
    if let Some(wanted) = exec.samples_here() {
        session.loader.only(wanted)?;
    }
    if let Some(init) = &cfg.init {
        weights::load(exec.as_mut(), &file_shapes, init)?;
    }
    let model = crate::run::checkpoint::fingerprint(&exec.param_values()?, &exec.state_values()?);
    let mut changes = Vec::new();
    if let Some(r) = &resume {
        crate::run::checkpoint::load(&r.checkpoint, exec.as_mut(), &file_shapes)?;
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
    let total = budget(&exp, per_epoch)?;
    if let Some(r) = &resume {
        r.check_budget(total)?;
    }
    // Every rank reads the run's state before rank 0 writes anything over it.
    if let Some(p) = peers {
        lock(p).barrier().map_err(|e| TrainError::Exec(e.into()))?;
    }
    let exp_path = dir.join("experiment.ron");
    if writes {
        write_atomic(&exp_path, exp_text.as_bytes())?;
        // An image folder's class names in index order, for `predict` and the user.
        if let Some(classes) = &session.classes {
            let text = serde_json::to_string(classes).expect("strings serialise") + "\n";
            write_atomic(&dir.join(super::CLASSES), text.as_bytes())?;
        }
    }
    let record_path = dir.join(crate::run::record::FILE);
    let devices = cfg.device.describe(peers.is_some());
    let record = match &resume {
        // The record of the run being continued, with this continuation noted.
        Some(r) => r.record_with(crate::run::record::Continuation {
            from_step: start_step,
            run_id: id.clone(),
            data_sha256: Some(session.data_hash.clone()),
            devices,
            checkpoint_every: Some(checkpoint_every),
            keep: Some(keep),
            accepted_changes: changes.iter().map(|c| c.to_string()).collect(),
            plan: Some(plan_record),
        }),
        None => crate::run::record::RunRecord {
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
    let records = match writes {
        true => records::Records::open(dir, cfg.resume, start_step)?,
        false => records::Records::none(),
    };
    let logged = continued(dir, writes && cfg.resume, start_step, total)?;
    Ok(Opened {
        exp,
        batch_size,
        output,
        parameters,
        start_step,
        checkpoint_every,
        keep,
        plan_label,
        session,
        id,
        model,
        file_shapes,
        exec,
        per_epoch,
        total,
        records,
        logged,
    })
}

/// The steps the experiment asks for: `steps`, or `epochs` of `per_epoch`, or one epoch.
fn budget(exp: &Experiment, per_epoch: u64) -> Result<u64, TrainError> {
    Ok(match (exp.train.steps, exp.train.epochs) {
        (Some(s), _) => s,
        (None, Some(ep)) => ep.checked_mul(per_epoch).ok_or_else(|| {
            TrainError::Model(format!(
                "{ep} epochs of {per_epoch} steps each is more steps than can be counted; ask for fewer epochs"
            ))
        })?,
        (None, None) => per_epoch,
    })
}

/// Where a resumed run starts (its newest checkpoint's own record, read before the data,
/// whose order it sets) and how it checkpoints: the continuation keeps the run's cadence, so
/// a second crash loses no more. A run that is done is refused as such.
fn resumption(
    cfg: &TrainConfig,
) -> Result<(Option<crate::run::resume::Resume>, u64, u64, usize), TrainError> {
    let dir = &cfg.run_dir;
    if let Some(steps) = cfg
        .resume
        .then(|| crate::run::resume::finished(dir, cfg.steps))
        .flatten()
    {
        return Err(TrainError::Finished {
            dir: dir.display().to_string(),
            steps,
        });
    }
    let resume = if cfg.resume {
        Some(crate::run::resume::Resume::newest(dir)?)
    } else {
        None
    };
    let start_step = resume.as_ref().map_or(0, |r| r.step());
    let (run_every, run_keep) = resume.as_ref().map_or((None, None), |r| {
        let (every, keep) = r.record.cadence();
        (Some(every), keep)
    });
    let checkpoint_every = cfg.checkpoint_every.or(run_every).unwrap_or(0);
    let keep = cfg.keep.or(run_keep).unwrap_or(3);
    Ok((resume, start_step, checkpoint_every, keep))
}
