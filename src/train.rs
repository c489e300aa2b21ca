//! `parallax train`: compile, train on the CPU, show progress, report where the run went.

use crate::{apply_set, load, run_pipeline, Backend, Exit, Format, PrecisionArg};
use indicatif::{ProgressBar, ProgressStyle};
use parallax_compiler::partition;
use parallax_compiler::target;
use parallax_compiler::Options;
use parallax_runtime::gpu_placement;
use parallax_runtime::run_record::RunRecord;
use parallax_runtime::train::{
    parallel_devices, train, train_rank, CudaRanks, Device, Event, Simulated, TrainConfig,
    TrainError,
};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;

/// `parallax train`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[arg(required_unless_present = "resume")]
    pub file: Option<PathBuf>,
    /// Train for this many steps (overrides the file's `steps`/`epochs`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: Option<u64>,
    /// Train for this many epochs (overrides the file's `steps`/`epochs`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "steps")]
    pub epochs: Option<u64>,
    /// The seed (overrides the file's).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Where to write the run (default `runs/<name>-<timestamp>`).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Start from these parameters (a safetensors file named like `final.safetensors`).
    #[arg(long, value_name = "FILE.safetensors")]
    pub init: Option<PathBuf>,
    /// Override any field of the file, type-checked like the file: `--set optimizer.lr=3e-4
    /// --set train.batch_size=256` (recorded in the run's `run.json`).
    #[arg(long = "set", value_name = "PATH=VALUE")]
    pub set: Vec<String>,
    /// Write a checkpoint (parameters, optimizer state, step) every N steps.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every: Option<u64>,
    /// Keep the newest K checkpoints (0 keeps all; default 3, or what the resumed run kept).
    #[arg(long, value_name = "K")]
    pub keep: Option<usize>,
    /// Continue the run in RUN_DIR from its newest checkpoint (bit for bit as if never
    /// interrupted), checkpointing as it did; `--steps` may extend it.
    #[arg(long, value_name = "RUN_DIR", conflicts_with_all = ["file", "epochs", "seed", "run_dir", "init", "set"])]
    pub resume: Option<PathBuf>,
    /// With --resume: continue although the run's experiment.ron or data changed since it
    /// was written (recorded in its run.json); refused otherwise.
    #[arg(long, requires = "resume")]
    pub accept_changes: bool,
    /// Devices to train on, data parallel: each batch is cut into the file's
    /// `devices.micro_shards` pieces, so any count up to that gives the same bits. On the CPU
    /// backend they are simulated devices. Without it (and with `devices.gpus: 1` in the file)
    /// one device runs the whole batch unsplit.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub gpus: Option<u32>,
    /// Each simulated device's memory (default: the file's device kind's), e.g. `24GiB`.
    #[arg(long, value_name = "SIZE", value_parser = parallax_compiler::devices::parse_bytes)]
    pub gpu_memory: Option<u64>,
    /// How the devices split the work, e.g. `dp2.pp2` (data-parallel ranks times pipeline
    /// stages; degrees left out are 1; the product is `--gpus`). Default: all data parallel.
    #[arg(long, value_name = "STRATEGY")]
    pub strategy: Option<String>,
    /// ZeRO stage with --gpus: 1 shards the optimizer state over the data-parallel ranks, 2
    /// the reduced gradients too, 3 the parameters too. Default: the cost model's choice, or 0
    /// with --strategy.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: Option<u8>,
    /// Where to run: `cuda` needs an NVIDIA GPU; `auto` uses one when present.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// GEMM precision on CUDA: exact fp32, tf32 tensor cores (the default), or bf16
    /// products with fp32 accumulation (fp32 master weights).
    #[arg(long, value_enum, default_value = "tf32")]
    pub precision: PrecisionArg,
    /// Under a launcher (mpirun, srun): how long a rank waits for another in a collective
    /// before the job fails, naming the rank it waited for.
    #[arg(long, value_name = "SECS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    pub collective_timeout: u64,
    /// For tests of failure: rank RANK kills itself (SIGKILL) after step STEP.
    #[arg(long, hide = true, value_name = "RANK:STEP", value_parser = rank_step)]
    pub crash_after: Option<(usize, u64)>,
    /// For tests of failure: rank RANK stops answering (sleeps an hour) after step STEP.
    #[arg(long, hide = true, value_name = "RANK:STEP", value_parser = rank_step)]
    pub stall_after: Option<(usize, u64)>,
}

fn rank_step(s: &str) -> Result<(usize, u64), String> {
    let (r, t) = s.split_once(':').ok_or("expected RANK:STEP")?;
    Ok((
        r.parse().map_err(|e| format!("rank: {e}"))?,
        t.parse().map_err(|e| format!("step: {e}"))?,
    ))
}

/// The split for `--gpus n` (the library's choice, said when the cost model made it) as
/// simulated devices.
fn simulated_devices(
    file: &Path,
    source: &parallax_compiler::Source,
    request: &target::Request,
    lead: bool,
) -> Result<(Simulated, target::Split), Exit> {
    let split = target::split(source, request).map_err(|e| refuse(file, source, e))?;
    let dp = split.strategy.dp;
    if split.chosen && lead {
        // What the devices will run: `--zero` wins, but needs data-parallel ranks.
        let zero_said = match request.zero {
            Some(z) if dp > 1 => format!("ZeRO {z} as --zero asks"),
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
    Ok((Simulated::from(&split), split))
}

/// Where GPU ranks run: a rank per GPU (this process's `n`, or this rank of a job).
fn gpu_placement(
    file: &Path,
    n: u32,
    in_job: bool,
    world: &parallax_runtime::launch::World,
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
fn refuse(file: &Path, source: &parallax_compiler::Source, e: target::TargetError) -> Exit {
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

pub fn run(args: Args) -> Result<(), Exit> {
    let Args {
        file,
        steps,
        epochs,
        seed,
        run_dir,
        init,
        set,
        checkpoint_every,
        keep,
        resume,
        accept_changes,
        gpus,
        gpu_memory,
        strategy,
        zero,
        backend,
        precision,
        collective_timeout,
        crash_after,
        stall_after,
    } = args;
    // clap's `requires` does not hold a bool flag to it.
    if accept_changes && resume.is_none() {
        errln!("error: --accept-changes continues a run with --resume RUN_DIR; a new run has nothing to accept");
        return Err(Exit(2));
    }
    // A resumed run reads the experiment it recorded (every default and override resolved).
    let file = match (&resume, file) {
        (Some(dir), _) => dir.join("experiment.ron"),
        (None, Some(f)) => f,
        (None, None) => unreachable!("clap requires FILE unless --resume"),
    };
    let file = file.as_path();
    let run_dir = resume.clone().or(run_dir);
    let (source, _) = load(file, Format::Text)?;
    let source = apply_set(file, source, &set, Format::Text)?;
    let devices = &source.experiment.devices;
    // Under a launcher the world is the device count.
    let world = crate::job::world(file)?;
    let in_job = crate::job::in_job(&world);
    let lead = world.rank == 0;
    let gpus = match in_job {
        true => Some(world.devices(gpus, devices.gpus).map_err(|e| {
            errln!("{}: error: {e}", file.display());
            Exit(1)
        })?),
        false => gpus,
    };
    // (Not clap's `requires`: under a launcher the world says how many devices.)
    if gpus.is_none() && (strategy.is_some() || zero.is_some()) {
        let flag = if strategy.is_some() {
            "--strategy"
        } else {
            "--zero"
        };
        errln!("error: {flag} splits the work of several devices: give --gpus N (or start the ranks with mpirun)");
        return Err(Exit(2));
    }
    let (parallel, strategy, splits_unsplit) =
        parallel_devices(resume.as_deref(), gpus, devices.gpus, strategy);
    if let (true, Some(n), true) = (splits_unsplit, parallel, lead) {
        errln!(
            "{}: note: this run trained on one device with its batches unsplit; continuing on {n} device(s) cuts them into micro-shards, so from here the bits differ from an uninterrupted run's (by rounding; any device count then resumes this one with the same bits)",
            file.display()
        );
    }
    let found = match backend {
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
    };
    let cuda = match found {
        Some(_) => Some(precision.runtime()?),
        None => None,
    };
    // GPU ranks: which GPU each binds, and the memory each plans for.
    let placement = match (parallel, &found) {
        (Some(n), Some(found)) => Some(gpu_placement(file, n, in_job, &world, found)?),
        _ => None,
    };
    let simulated = match parallel {
        Some(n) => Some(simulated_devices(
            file,
            &source,
            &target::Request {
                gpus: n,
                strategy: strategy.as_deref(),
                zero,
                memory: gpu_memory.or(placement.map(|p| p.capacity)),
            },
            lead,
        )?),
        None => None,
    };
    // Data and pipeline degrees never change the bits; the tensor-parallel degree changes
    // the rounding of the row-parallel sums (checkpoints are whole tensors, so the state is
    // re-sliced for any degree).
    let recorded = resume.as_deref().and_then(RunRecord::grid_of);
    if let (Some(old), Some((new, _))) = (recorded, simulated) {
        if old.tp != new.grid.tp {
            errln!(
                "{}: note: this run trained with tensor parallelism of degree {}; continuing with {} changes the rounding, so the continuation matches an uninterrupted run within about 1e-5, not bit for bit",
                file.display(),
                old.tp,
                new.grid.tp
            );
        }
    }
    let plan = match simulated {
        Some((_, split)) => {
            target::compile_split(&source, &split, &mut |_, _| {})
                .map_err(|e| refuse(file, &source, e))?
                .1
        }
        None => {
            let options = Options {
                gpus: parallel,
                ..Options::default()
            };
            run_pipeline(file, &source, &options, Format::Text, &mut |_, _| {})?
                .plan(&source, &options)
        }
    };
    let simulated = simulated.map(|(s, _)| s);
    let run_dir =
        run_dir.unwrap_or_else(|| parallax_runtime::run_dir::default_path(&source.experiment.name));
    let device = match (simulated, cuda, placement) {
        (Some(ranks), Some(precision), Some(p)) => Device::CudaRanks(CudaRanks {
            ranks,
            precision,
            first_gpu: p.first_gpu,
            gpus: p.gpus,
            nccl: (std::env::var(parallax_runtime::ranks::nccl_sum::ENV).as_deref() == Ok("1"))
                .then(|| std::time::Duration::from_secs(collective_timeout)),
        }),
        (Some(s), _, _) => Device::Simulated(s),
        (None, Some(p), _) => Device::Cuda(p),
        (None, None, _) => Device::Cpu,
    };
    let cfg = TrainConfig {
        steps,
        epochs,
        seed,
        run_dir: run_dir.clone(),
        init,
        base_dir: file.parent().map(Path::to_path_buf).unwrap_or_default(),
        device,
        checkpoint_every,
        keep,
        resume: resume.is_some(),
        accept_changes,
        overrides: set,
        stop: Some(stop_on_signals()?),
    };
    let backend_name = match device {
        Device::Cuda(_) => "CUDA backend (GPU 0)".to_string(),
        Device::Simulated(s) => format!(
            "CPU backend, {} {} (dp{}.tp{}.pp{}) over {} micro-shards",
            s.grid.devices(),
            match in_job {
                true => format!("rank(s) under {}", world.launcher),
                false => "simulated device(s)".to_string(),
            },
            s.grid.dp,
            s.grid.tp,
            s.grid.pp,
            plan.sharding.map_or(1, |s| s.shards)
        ),
        Device::Cpu => "CPU backend".to_string(),
        Device::CudaRanks(g) => format!(
            "CUDA backend, {} GPU {} (dp{}.tp{}.pp{}) over {} micro-shards, summed {}",
            g.ranks.grid.devices(),
            match in_job {
                true => format!("rank(s) under {}", world.launcher),
                false => format!("rank(s) in this process on {} GPU(s)", g.gpus),
            },
            g.ranks.grid.dp,
            g.ranks.grid.tp,
            g.ranks.grid.pp,
            plan.sharding.map_or(1, |s| s.shards),
            match g.nccl {
                Some(_) => "on the GPUs over NCCL",
                None => "on the host",
            }
        ),
    };
    let terminal = std::io::stderr().is_terminal();
    let mut bar: Option<ProgressBar> = None;
    let mut every = 1;
    let name = source.experiment.name.clone();
    let mut on_event = |e: &Event| match e {
        Event::Step { step, .. } if crash_after == Some((world.rank, *step)) => {
            // As `kill -9` would: no checkpoint, no goodbye.
            let _ = signal_hook::low_level::raise(signal_hook::consts::SIGKILL);
        }
        Event::Step { step, .. } if stall_after == Some((world.rank, *step)) => {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
        // The job's other ranks train silently; rank 0 speaks for it.
        _ if !lead => {}
        Event::Start {
            total_steps,
            train_samples,
            validation_samples,
            ..
        } => {
            errln!(
                "{name}: training {total_steps} steps on {train_samples} samples ({validation_samples} for validation), {backend_name}"
            );
            every = (total_steps / 10).max(1);
            if terminal {
                let b = ProgressBar::new(*total_steps);
                b.set_style(
                    ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  eta {eta}")
                        .expect("a valid template"),
                );
                bar = Some(b);
            }
        }
        Event::Step {
            step,
            total,
            epoch,
            loss,
            samples_per_sec,
        } => match &bar {
            Some(b) => {
                b.set_position(*step);
                b.set_message(format!("loss {loss:.4}  {samples_per_sec:.0} samples/s"));
            }
            None if step % every == 0 || step == total => errln!(
                "step {step}/{total}  epoch {epoch}  loss {loss:.4}  {samples_per_sec:.0} samples/s"
            ),
            None => {}
        },
        Event::Validation {
            epoch,
            loss,
            accuracy,
        } => {
            let acc = accuracy.map_or(String::new(), |a| format!("  accuracy {:.2}%", a * 100.0));
            let line = format!("epoch {epoch}: validation loss {loss:.4}{acc}");
            match &bar {
                Some(b) => b.println(line),
                None => errln!("{line}"),
            }
        }
        Event::Warning(w) => {
            let line = format!("{name}: warning: {w}");
            match &bar {
                Some(b) => b.println(line),
                None => errln!("{line}"),
            }
        }
    };
    let job = match (in_job, device) {
        (true, Device::Simulated(_) | Device::CudaRanks(_)) => Some(crate::job::start(
            file,
            &world,
            std::time::Duration::from_secs(collective_timeout),
            &cfg.stop.clone().unwrap_or_default(),
        )?),
        _ => None,
    };
    let result = match &job {
        Some(job) => train_rank(&source, plan, &cfg, job.peers.clone(), &mut on_event),
        None => train(&source, plan, &cfg, &mut on_event),
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let (Err(e), Some(job)) = (&result, &job) {
        if !matches!(e, TrainError::Interrupted { .. }) {
            // One write, so that the ranks' lines do not interleave; naming the rank once.
            let e = e.to_string();
            let rank = format!("rank {}: ", job.rank);
            let rank = if e.contains(&rank) { "" } else { rank.as_str() };
            let line = format!("{}: error: {rank}{e}\n", file.display());
            err!("{line}");
            crate::job::fail(1);
        }
    }
    if !lead {
        return match result {
            Err(TrainError::Interrupted { signal, .. }) => {
                Err(Exit(128u8.saturating_add(signal as u8)))
            }
            _ => Ok(()),
        };
    }
    match result {
        Ok(s) => {
            let acc = s.val_accuracy.map_or(String::new(), |a| {
                format!(", validation accuracy {:.2}%", a * 100.0)
            });
            let val = s
                .val_loss
                .map_or(String::new(), |l| format!(", validation loss {l:.4}"));
            outln!(
                "{}: {} steps, train loss {:.4}{val}{acc}, {:.0} samples/s, {:.1} s",
                s.name,
                s.steps,
                s.final_train_loss,
                s.samples_per_sec,
                s.wall_seconds
            )?;
            outln!("run: {}", run_dir.display())?;
            Ok(())
        }
        Err(e @ TrainError::Interrupted { signal, .. }) => {
            errln!("{}: {e}", file.display());
            Err(Exit(128u8.saturating_add(signal as u8)))
        }
        Err(e) => {
            errln!("{}: error: {e}", file.display());
            Err(Exit(1))
        }
    }
}

/// SIGINT and SIGTERM ask the run to stop after its current step, with a checkpoint; a
/// second one ends the process at once (exit 130 or 143).
fn stop_on_signals() -> Result<Arc<AtomicUsize>, Exit> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let which = Arc::new(AtomicUsize::new(0));
    let asked = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        // Registered first, so it sees the flag as it was before this signal set it.
        signal_hook::flag::register_conditional_shutdown(signal, 128 + signal, Arc::clone(&asked))
            .and_then(|_| signal_hook::flag::register(signal, Arc::clone(&asked)))
            .and_then(|_| {
                signal_hook::flag::register_usize(signal, Arc::clone(&which), signal as usize)
            })
            .map_err(|e| {
                errln!("error: cannot handle signal {signal}: {e}");
                Exit(1)
            })?;
    }
    Ok(which)
}
