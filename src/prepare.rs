//! `parallax train`'s preparation, before anything is loaded or allocated: the experiment (a
//! file, a resumed run's, or a plan's), the device count, the split (chosen by
//! `target::split`, the function `compile --gpus N` reports), the per-device plan, and what
//! runs it.

use crate::train::Args;
use crate::{apply_set, load, run_pipeline, Backend, Exit, Format, PrecisionArg};
use parallax_compiler::target::{self, Split};
use parallax_compiler::{partition, Options, Plan, Source};
use parallax_runtime::gpu_placement;
use parallax_runtime::launch::World;
use parallax_runtime::run_record::RunRecord;
use parallax_runtime::train::{parallel_devices, CudaRanks, Device, Simulated};
use std::path::{Path, PathBuf};

/// What `train` runs, decided.
pub(crate) struct Prepared {
    /// The file errors name: the experiment, the resumed run's `experiment.ron`, or the plan.
    pub file: PathBuf,
    pub source: Source,
    pub plan: Plan,
    pub device: Device,
    pub world: World,
    pub in_job: bool,
}

impl Prepared {
    /// What `--dry-run` prints: the split that would run, as data.
    pub fn describe(&self) -> serde_json::Value {
        let p = &self.plan;
        serde_json::json!({
            "name": p.name,
            "strategy": p.strategy,
            "zero": p.zero_stage,
            "schedule": p.schedule.unwrap_or(partition::PipelineSchedule::Sequential),
            "micro_shards": p.sharding.map(|s| s.shards),
            "partitioned": p.sharding.is_some(),
        })
    }
}

/// Where and how a plan runs: the flags `train`, `eval`, `predict` and `sample` share.
pub(crate) struct Want<'a> {
    pub gpus: Option<u32>,
    pub strategy: Option<&'a str>,
    pub zero: Option<u8>,
    pub backend: Backend,
    pub precision: PrecisionArg,
    pub gpu_memory: Option<u64>,
    pub collective_timeout: u64,
    /// The run being continued (its recorded split is kept).
    pub resume: Option<&'a Path>,
}

impl Args {
    fn want(&self) -> Want<'_> {
        Want {
            gpus: self.gpus,
            strategy: self.strategy.as_deref(),
            zero: self.zero,
            backend: self.backend,
            precision: self.precision,
            gpu_memory: self.gpu_memory,
            collective_timeout: self.collective_timeout,
            resume: self.resume.as_deref(),
        }
    }
}

/// Decides what `args` runs (nothing is trained or written).
pub(crate) fn prepare(args: &Args) -> Result<Prepared, Exit> {
    let (file, source, given) = experiment(args)?;
    decide(file, source, given, &args.want())
}

/// Decides where `source` (or the `given` plan) runs as `want` asks: the split, the
/// per-device plan and the device.
pub(crate) fn decide(
    file: PathBuf,
    source: Source,
    given: Option<Plan>,
    want: &Want,
) -> Result<Prepared, Exit> {
    let lead_file = file.as_path();
    // Under a launcher the world is the device count.
    let world = crate::job::world(lead_file)?;
    let in_job = crate::job::in_job(&world);
    let wanted = match &given {
        Some(plan) => plan.sharding.map(|_| devices_of(plan)),
        None => want.gpus,
    };
    let gpus = match in_job {
        true => Some(
            world
                .devices(wanted, source.experiment.devices.gpus)
                .map_err(|e| {
                    errln!("{}: error: {e}", lead_file.display());
                    Exit(1)
                })?,
        ),
        false => wanted,
    };
    // (Not clap's `requires`: under a launcher the world says how many devices.)
    if gpus.is_none() && (want.strategy.is_some() || want.zero.is_some()) {
        let flag = match want.strategy {
            Some(_) => "--strategy",
            None => "--zero",
        };
        errln!("error: {flag} splits the work of several devices: give --gpus N (or start the ranks with mpirun)");
        return Err(Exit(2));
    }
    let (parallel, resumed) = match &given {
        Some(_) => (gpus, None),
        None => devices(want, lead_file, gpus, &source, world.rank == 0),
    };
    let found = probe(want.backend, lead_file)?;
    let cuda = match found {
        Some(_) => Some(want.precision.runtime()?),
        None => None,
    };
    // GPU ranks: which GPU each binds, and the memory each plans for.
    let placement = match (parallel, &found) {
        (Some(n), Some(found)) => Some(gpu_placement(lead_file, n, in_job, &world, found)?),
        _ => None,
    };
    let memory = want.gpu_memory.or(placement.map(|p| p.capacity));
    let plan = match given {
        Some(plan) => plan,
        None => plan_for(
            want,
            lead_file,
            &source,
            parallel,
            resumed,
            memory,
            world.rank == 0,
        )?,
    };
    let capacity = memory.or(plan.device_memory_bytes).unwrap_or(u64::MAX);
    let partition = Simulated::of_plan(&plan, capacity);
    let device = match (partition, cuda, placement) {
        (Some(ranks), Some(precision), Some(p)) => Device::CudaRanks(CudaRanks {
            ranks,
            precision,
            first_gpu: p.first_gpu,
            gpus: p.gpus,
            nccl: (std::env::var(parallax_runtime::ranks::nccl_sum::ENV).as_deref() == Ok("1"))
                .then(|| std::time::Duration::from_secs(want.collective_timeout)),
        }),
        (Some(s), _, _) => Device::Simulated(s),
        (None, Some(p), _) => Device::Cuda(p),
        (None, None, _) => Device::Cpu,
    };
    Ok(Prepared {
        file,
        source,
        plan,
        device,
        world,
        in_job,
    })
}

fn devices_of(plan: &Plan) -> u32 {
    let s = plan.strategy;
    s.dp * s.tp * s.pp
}

/// The experiment to train: the file with `--set`, the resumed run's (every default and
/// override resolved), or a plan's with the plan itself.
fn experiment(args: &Args) -> Result<(PathBuf, Source, Option<Plan>), Exit> {
    if let Some(path) = &args.plan {
        let (source, plan) = load_plan(path)?;
        return Ok((path.clone(), source, Some(plan)));
    }
    let file = match (&args.resume, &args.file) {
        (Some(dir), _) => dir.join("experiment.ron"),
        (None, Some(f)) => f.clone(),
        (None, None) => unreachable!("clap requires FILE unless --resume or --plan"),
    };
    let (source, _) = load(&file, Format::Text)?;
    let source = apply_set(&file, source, &args.set, Format::Text)?;
    Ok((file, source, None))
}

/// A plan written by `compile --emit plan`, and the experiment it carries.
fn load_plan(path: &Path) -> Result<(Source, Plan), Exit> {
    let fail = |what: String| {
        errln!("{}: error: {what}", path.display());
        Exit(1)
    };
    let text =
        std::fs::read_to_string(path).map_err(|e| fail(format!("cannot read the plan: {e}")))?;
    let mut plan = Plan::from_json(&text).map_err(|e| fail(e.to_string()))?;
    let Some(experiment) = plan.experiment.take() else {
        return Err(fail(
            "the plan carries no experiment to train; write it with `parallax compile FILE --emit plan` (this version)".into(),
        ));
    };
    let source = parallax_compiler::parse_bytes(experiment.as_bytes()).map_err(|e| {
        crate::report(
            &format!("{} (its experiment)", path.display()),
            &experiment,
            &e.diagnostics(),
            Format::Text,
        );
        Exit(1)
    })?;
    Ok((source, plan))
}

/// How many devices run (`None`: one, batches unsplit), and the split a resumed run had.
fn devices(
    args: &Want,
    file: &Path,
    gpus: Option<u32>,
    source: &Source,
    lead: bool,
) -> (Option<u32>, Option<target::Recorded>) {
    let (parallel, resumed, splits_unsplit) =
        parallel_devices(args.resume, gpus, source.experiment.devices.gpus);
    if let (true, Some(n), true) = (splits_unsplit, parallel, lead) {
        errln!(
            "{}: note: this run trained on one device with its batches unsplit; continuing on {n} device(s) cuts them into micro-shards, so from here the bits differ from an uninterrupted run's (by rounding; any device count then resumes this one with the same bits)",
            file.display()
        );
    }
    (parallel, resumed)
}

/// The CUDA devices `backend` asks for (none: the CPU).
fn probe(backend: Backend, file: &Path) -> Result<Option<parallax_runtime::cuda::Devices>, Exit> {
    Ok(match backend {
        Backend::Cpu => None,
        Backend::Cuda => match parallax_runtime::cuda::probe() {
            Ok(found) => Some(found),
            Err(e) => {
                errln!("{}: error: --backend cuda: {e}", file.display());
                errln!("  = hint: `parallax devices` says what was found; `--backend cpu` trains on the CPU");
                return Err(Exit(1));
            }
        },
        Backend::Auto => parallax_runtime::cuda::probe().ok(),
    })
}

/// The plan for `parallel` devices: the per-device plan of the split, or the whole plan.
fn plan_for(
    args: &Want,
    file: &Path,
    source: &Source,
    parallel: Option<u32>,
    resumed: Option<target::Recorded>,
    memory: Option<u64>,
    lead: bool,
) -> Result<Plan, Exit> {
    let Some(n) = parallel else {
        let options = Options::default();
        return Ok(
            run_pipeline(file, source, &options, Format::Text, &mut |_, _| {})?
                .plan(source, &options),
        );
    };
    let request = target::Request {
        gpus: n,
        strategy: args.strategy,
        zero: args.zero,
        memory,
        resumed,
        ..target::Request::default()
    };
    let split = target::split(source, &request).map_err(|e| refuse(file, source, e))?;
    if lead {
        say_split(source, &request, &split);
        tp_note(args, file, &split);
    }
    Ok(target::compile_split(source, &split, &mut |_, _| {})
        .map_err(|e| refuse(file, source, e))?
        .1)
}

/// The cost model's choice, said when it made it.
fn say_split(source: &Source, request: &target::Request, split: &Split) {
    if !split.chosen {
        return;
    }
    // What the devices will run: `--zero` wins, but needs data-parallel ranks.
    let zero_said = match request.zero {
        Some(z) if split.strategy.dp > 1 => format!("ZeRO {z} as --zero asks"),
        Some(_) => "ZeRO 0 (one data-parallel rank: --zero has nothing to shard)".to_string(),
        None => format!("ZeRO {}", split.zero),
    };
    errln!(
        "{}: --gpus {}: the cost model chooses {} with {zero_said} (`--strategy` forces another)",
        source.experiment.name,
        request.gpus,
        partition::strategy_name(&split.strategy)
    );
}

/// Data and pipeline degrees never change the bits; the tensor-parallel degree changes the
/// rounding of the row-parallel sums (checkpoints are whole tensors, so the state is
/// re-sliced for any degree).
fn tp_note(args: &Want, file: &Path, split: &Split) {
    let recorded = args.resume.and_then(RunRecord::split_of);
    if let Some(old) = recorded {
        if old.strategy.tp != split.strategy.tp {
            errln!(
                "{}: note: this run trained with tensor parallelism of degree {}; continuing with {} changes the rounding, so the continuation matches an uninterrupted run within about 1e-5, not bit for bit",
                file.display(),
                old.strategy.tp,
                split.strategy.tp
            );
        }
    }
}

/// Where GPU ranks run: a rank per GPU (this process's `n`, or this rank of a job).
fn gpu_placement(
    file: &Path,
    n: u32,
    in_job: bool,
    world: &World,
    found: &parallax_runtime::cuda::Devices,
) -> Result<gpu_placement::Placement, Exit> {
    let memory: Vec<u64> = found.gpus.iter().map(|g| g.memory_bytes).collect();
    let share = gpu_placement::share_asked(&|k| std::env::var(k).ok());
    let placed = match in_job {
        true => gpu_placement::in_job(world.rank, world.local_rank, &memory, share),
        false => gpu_placement::in_process(n as usize, &memory, share),
    };
    placed.map_err(|e| {
        errln!("{}: error: --backend cuda: {e}", file.display());
        errln!("  = hint: {}", e.hint());
        Exit(1)
    })
}

/// A refusal of the split or its plan, printed (a compile error with its line of the file).
fn refuse(file: &Path, source: &Source, e: target::TargetError) -> Exit {
    if let target::TargetError::Compile(e) = &e {
        let (text, diags) = source.for_user(e.diagnostics());
        crate::report(&file.display().to_string(), text, &diags, Format::Text);
        return Exit(1);
    }
    errln!("{}: error: {e}", file.display());
    if let Some(hint) = e.hint() {
        errln!("  = hint: {hint}");
    }
    Exit(1)
}
