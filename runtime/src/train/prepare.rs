//! Where a plan runs, decided once for `train`, `eval`, `predict` and `sample`: the device
//! count (a launcher's world, `--gpus`, a resumed run's record), the split (chosen by
//! `target::split`, the function `compile --gpus N` reports), the per-device plan, the GPUs'
//! placement and the device that runs it. Nothing is printed: what the user should know comes
//! back as notes, what stops the run as a [`PrepareError`].

use super::config::{parallel_devices, CudaRanks, Device, Simulated};
use crate::comm::world::{LaunchError, Launcher, World};
use crate::cuda::{CudaError, Devices, Precision};
use crate::ranks::placement::{self, PlacementError};
use crate::run::record::RunRecord;
use parallax_compiler::target::{self, Split, TargetError};
use parallax_compiler::{partition, Options, Plan, Source};
use std::path::Path;
use std::time::Duration;

/// Where the user asked the plan to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// A GPU when one is usable, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// What the command line asks for.
#[derive(Debug, Clone)]
pub struct Want<'a> {
    pub gpus: Option<u32>,
    pub strategy: Option<&'a str>,
    pub zero: Option<u8>,
    pub backend: BackendChoice,
    pub precision: Precision,
    pub gpu_memory: Option<u64>,
    pub collective_timeout: Duration,
    /// The run being continued (its recorded split is kept).
    pub resume: Option<&'a Path>,
}

impl Want<'_> {
    /// Placed on `backend` at `precision`, the rest as the experiment says (a collective
    /// waits 300 s for a silent peer).
    pub fn on(backend: BackendChoice, precision: Precision) -> Self {
        Want {
            gpus: None,
            strategy: None,
            zero: None,
            backend,
            precision,
            gpu_memory: None,
            collective_timeout: Duration::from_secs(300),
            resume: None,
        }
    }
}

/// What runs, decided.
pub struct Decided {
    pub plan: Plan,
    pub device: Device,
    pub world: World,
    /// Whether this process is one rank of a launcher's job.
    pub in_job: bool,
    /// What the user should know (said by the lead rank only).
    pub notes: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error(transparent)]
    World(#[from] LaunchError),
    /// A request that cannot be read (the command line's exit code 2).
    #[error("{0}")]
    Usage(String),
    #[error("--backend cuda: {0}")]
    Cuda(#[from] CudaError),
    #[error("--backend cuda: {0}")]
    Placement(#[from] PlacementError),
    #[error(transparent)]
    Split(#[from] TargetError),
    /// The experiment does not compile (its diagnostics point into the file).
    #[error("{0}")]
    Compile(parallax_compiler::Error),
}

impl PrepareError {
    /// What to do about it, where there is something to say.
    pub fn hint(&self) -> Option<String> {
        match self {
            PrepareError::Cuda(_) => Some(
                "`parallax devices` says what was found; `--backend cpu` runs on the CPU".into(),
            ),
            PrepareError::Placement(e) => Some(e.hint()),
            PrepareError::Split(e) => e.hint(),
            _ => None,
        }
    }
}

/// Why a plan file (`compile --emit plan`) cannot be trained.
#[derive(Debug, thiserror::Error)]
pub enum PlanFileError {
    #[error("cannot read the plan: {0}")]
    Read(std::io::Error),
    #[error(transparent)]
    Plan(#[from] parallax_compiler::plan::PlanError),
    #[error("the plan carries no experiment to train; write it with `parallax compile FILE --emit plan` (this version)")]
    NoExperiment,
    /// The experiment it carries does not parse: the diagnostics point into `text`.
    #[error("{error}")]
    Experiment {
        text: String,
        error: parallax_compiler::Error,
    },
}

/// A plan written by `compile --emit plan`, and the experiment it carries.
pub fn read_plan(path: &Path) -> Result<(Source, Plan), PlanFileError> {
    let text = std::fs::read_to_string(path).map_err(PlanFileError::Read)?;
    let mut plan = Plan::from_json(&text)?;
    let text = plan.experiment.take().ok_or(PlanFileError::NoExperiment)?;
    match parallax_compiler::parse_bytes(text.as_bytes()) {
        Ok(source) => Ok((source, plan)),
        Err(error) => Err(PlanFileError::Experiment { text, error }),
    }
}

/// Whether the process is one rank of a launcher's job (a lone torchrun rank is not).
pub fn in_job(world: &World) -> bool {
    match world.launcher {
        Launcher::OpenMpi | Launcher::Slurm | Launcher::Pmi => true,
        Launcher::Torchrun => world.size > 1,
        Launcher::None => false,
    }
}

fn devices_of(plan: &Plan) -> u32 {
    let s = plan.strategy;
    s.dp * s.tp * s.pp
}

/// Decides where `source` (or the `given` plan, which carries its split) runs as `want` asks;
/// `env` reads the environment (the launcher's variables, the GPU switches).
pub fn decide(
    source: &Source,
    given: Option<Plan>,
    want: &Want,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Decided, PrepareError> {
    // Under a launcher the world is the device count.
    let world = World::from_env(env)?;
    let in_job = in_job(&world);
    let lead = world.rank == 0;
    let mut notes = Vec::new();
    let wanted = match &given {
        Some(plan) => plan.sharding.map(|_| devices_of(plan)),
        None => want.gpus,
    };
    let gpus = match in_job {
        true => Some(world.devices(wanted, source.experiment.devices.gpus)?),
        false => wanted,
    };
    // (Not the command line's own check: under a launcher the world says how many devices.)
    if gpus.is_none() && (want.strategy.is_some() || want.zero.is_some()) {
        let flag = match want.strategy {
            Some(_) => "--strategy",
            None => "--zero",
        };
        return Err(PrepareError::Usage(format!(
            "{flag} splits the work of several devices: give --gpus N (or start the ranks with mpirun)"
        )));
    }
    let (parallel, resumed) = match &given {
        Some(_) => (gpus, None),
        None => {
            let (parallel, resumed, splits_unsplit) =
                parallel_devices(want.resume, gpus, source.experiment.devices.gpus);
            if let (true, Some(n)) = (splits_unsplit, parallel) {
                notes.push(format!("this run trained on one device with its batches unsplit; continuing on {n} device(s) cuts them into micro-shards, so from here the bits differ from an uninterrupted run's (by rounding; any device count then resumes this one with the same bits)"));
            }
            (parallel, resumed)
        }
    };
    let found = match want.backend {
        BackendChoice::Cpu => None,
        BackendChoice::Cuda => Some(crate::cuda::probe()?),
        BackendChoice::Auto => crate::cuda::probe().ok(),
    };
    // GPU ranks: which GPU each binds, and the memory each plans for.
    let placement = match (parallel, &found) {
        (Some(n), Some(found)) => Some(placement(n, in_job, &world, found, env)?),
        _ => None,
    };
    let memory = want.gpu_memory.or(placement.map(|p| p.capacity));
    let plan = match given {
        Some(plan) => plan,
        None => plan_for(want, source, parallel, resumed, memory, &mut notes)?,
    };
    let capacity = memory.or(plan.device_memory_bytes).unwrap_or(u64::MAX);
    let partition = Simulated::of_plan(&plan, capacity);
    let cuda = found.map(|_| want.precision);
    let device = match (partition, cuda, placement) {
        (Some(ranks), Some(precision), Some(p)) => Device::CudaRanks(CudaRanks {
            ranks,
            precision,
            first_gpu: p.first_gpu,
            gpus: p.gpus,
            nccl: (env(crate::cuda::nccl::sum::ENV).as_deref() == Some("1"))
                .then_some(want.collective_timeout),
        }),
        (Some(s), _, _) => Device::Simulated(s),
        (None, Some(p), _) => Device::Cuda(p),
        (None, None, _) => Device::Cpu,
    };
    if !lead {
        notes.clear();
    }
    Ok(Decided {
        plan,
        device,
        world,
        in_job,
        notes,
    })
}

/// Where GPU ranks run: a rank per GPU (this process's `n`, or this rank of a job).
fn placement(
    n: u32,
    in_job: bool,
    world: &World,
    found: &Devices,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<placement::Placement, PlacementError> {
    let memory: Vec<u64> = found.gpus.iter().map(|g| g.memory_bytes).collect();
    let share = placement::share_asked(env);
    match in_job {
        true => placement::in_job(world.rank, world.local_rank, &memory, share),
        false => placement::in_process(n as usize, &memory, share),
    }
}

/// The plan for `parallel` devices: the per-device plan of the split, or the whole plan.
fn plan_for(
    want: &Want,
    source: &Source,
    parallel: Option<u32>,
    resumed: Option<target::Recorded>,
    memory: Option<u64>,
    notes: &mut Vec<String>,
) -> Result<Plan, PrepareError> {
    let Some(n) = parallel else {
        let options = Options::default();
        let compiled = parallax_compiler::compile(source, &options, &mut |_, _| {})
            .map_err(PrepareError::Compile)?;
        return Ok(compiled.plan(source, &options));
    };
    let request = target::Request {
        gpus: n,
        strategy: want.strategy,
        zero: want.zero,
        memory,
        resumed,
        ..target::Request::default()
    };
    let split = target::split(source, &request)?;
    notes.extend(split_said(&request, &split));
    notes.extend(tp_note(want, &split));
    Ok(target::compile_split(source, &split, &mut |_, _| {})?.1)
}

/// The cost model's choice, said when it made it.
fn split_said(request: &target::Request, split: &Split) -> Option<String> {
    if !split.chosen {
        return None;
    }
    // What the devices will run: `--zero` wins, but needs data-parallel ranks.
    let zero_said = match request.zero {
        Some(z) if split.strategy.dp > 1 => format!("ZeRO {z} as --zero asks"),
        Some(_) => "ZeRO 0 (one data-parallel rank: --zero has nothing to shard)".to_string(),
        None => format!("ZeRO {}", split.zero),
    };
    Some(format!(
        "--gpus {}: the cost model chooses {} with {zero_said} (`--strategy` forces another)",
        request.gpus,
        partition::strategy_name(&split.strategy)
    ))
}

/// Data and pipeline degrees never change the bits; the tensor-parallel degree changes the
/// rounding of the row-parallel sums (checkpoints are whole tensors, so the state is
/// re-sliced for any degree).
fn tp_note(want: &Want, split: &Split) -> Option<String> {
    let old = want.resume.and_then(RunRecord::split_of)?;
    (old.strategy.tp != split.strategy.tp).then(|| format!(
        "this run trained with tensor parallelism of degree {}; continuing with {} changes the rounding, so the continuation matches an uninterrupted run within about 1e-5, not bit for bit",
        old.strategy.tp, split.strategy.tp
    ))
}

/// What `compile --emit plan` writes: the plan `train` runs (for several devices, the
/// per-device plan of the split), with its experiment as `train` records it (every default
/// and override resolved, data paths absolute from `base_dir`), so that `train --plan` runs
/// it without the file.
pub fn plan_to_emit(
    source: &Source,
    plan: &Plan,
    split: Result<Split, TargetError>,
    base_dir: &Path,
) -> Result<Plan, TargetError> {
    let mut emitted = match (split, plan.gpus_requested > 1) {
        (Err(e), true) => return Err(e),
        (Ok(split), true) => target::compile_split(source, &split, &mut |_, _| {})?.1,
        (_, false) => plan.clone(),
    };
    let cfg = super::TrainConfig {
        base_dir: base_dir.to_path_buf(),
        ..Default::default()
    };
    let experiment = super::resolved(&source.experiment, &cfg);
    emitted.experiment = Some(parallax_compiler::dsl::to_ron(&experiment));
    Ok(emitted)
}

/// What `train --dry-run` prints: the split that would run, as data.
pub fn describe(p: &Plan) -> serde_json::Value {
    serde_json::json!({
        "name": p.name,
        "strategy": p.strategy,
        "zero": p.zero_stage,
        "schedule": p.schedule.unwrap_or(partition::PipelineSchedule::Sequential),
        "micro_shards": p.sharding.map(|s| s.shards),
        "partitioned": p.sharding.is_some(),
    })
}
