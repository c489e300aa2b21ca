//! `parallax train`: compile, train on the CPU, show progress, report where the run went.

use crate::prepare::Prepared;
use crate::progress::Progress;
use crate::{Backend, Exit, PrecisionArg};
use parallax_runtime::train::{
    say, signals, train_placed, Fault, PlacedError, TrainConfig, TrainError,
};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// `parallax train`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[arg(required_unless_present_any = ["resume", "plan"])]
    pub file: Option<PathBuf>,
    /// Train this plan (`parallax compile FILE --gpus N --emit plan` writes it, with its
    /// experiment): the same run as `train FILE --gpus N`, without compiling again.
    #[arg(long, value_name = "PLAN.json", conflicts_with_all = ["file", "resume", "set", "gpus", "strategy", "zero"])]
    pub plan: Option<PathBuf>,
    /// Print what would run (the split, ZeRO stage, pipeline schedule) as JSON and exit,
    /// training nothing.
    #[arg(long)]
    pub dry_run: bool,
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
    #[command(flatten)]
    pub split: crate::SplitArgs,
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
    #[arg(long, hide = true, value_name = "RANK:STEP", value_parser = Fault::rank_step)]
    pub crash_after: Option<(usize, u64)>,
    /// For tests of failure: rank RANK stops answering (sleeps an hour) after step STEP.
    #[arg(long, hide = true, value_name = "RANK:STEP", value_parser = Fault::rank_step)]
    pub stall_after: Option<(usize, u64)>,
}

pub fn run(args: Args) -> Result<(), Exit> {
    // clap's `requires` does not hold a bool flag to it.
    if args.accept_changes && args.resume.is_none() {
        return Err(crate::usage("--accept-changes continues a run with --resume RUN_DIR; a new run has nothing to accept"));
    }
    let prepared = crate::prepare::prepare(&args)?;
    if args.dry_run {
        outln!(
            "{}",
            parallax_runtime::train::prepare::describe(&prepared.decided.plan)
        )?;
        return Ok(());
    }
    let Prepared {
        file,
        source,
        decided,
    } = prepared;
    let file = file.as_path();
    let lead = decided.world.rank == 0;
    let run_dir = args
        .resume
        .clone()
        .or(args.run_dir.clone())
        .unwrap_or_else(|| parallax_runtime::run::dir::default_path(&source.experiment.name));
    let cfg = TrainConfig {
        steps: args.steps,
        epochs: args.epochs,
        seed: args.seed,
        run_dir: run_dir.clone(),
        init: args.init.clone(),
        base_dir: crate::base_dir(file),
        device: decided.device,
        checkpoint_every: args.checkpoint_every,
        keep: args.keep,
        resume: args.resume.is_some(),
        accept_changes: args.accept_changes,
        overrides: args.set.clone(),
        fault: match (args.crash_after, args.stall_after) {
            (Some((rank, step)), _) => Some(Fault::Crash { rank, step }),
            (None, Some((rank, step))) => Some(Fault::Stall { rank, step }),
            (None, None) => None,
        },
        stop: Some(signals::stop_on_signals().map_err(crate::error)?),
    };
    let d = &decided;
    let devices = say::devices(&d.device, &d.plan, d.in_job, &d.world);
    let mut progress = Progress {
        log: say::Log::new(&source.experiment.name, devices),
        lead,
        terminal: std::io::stderr().is_terminal(),
        bar: None,
    };
    let timeout = std::time::Duration::from_secs(args.collective_timeout);
    let env = |k: &str| std::env::var(k).ok();
    let result = train_placed(&source, decided, &cfg, timeout, &env, &mut |e| {
        progress.on_event(e)
    });
    if let Some(b) = progress.bar.take() {
        b.finish_and_clear();
    }
    let result = match result {
        Ok(s) => Ok(s),
        Err(PlacedError::Train(e)) => Err(e),
        Err(PlacedError::Job(e)) => {
            return Err(crate::hinted(Some(file), &e, e.hint().map(String::from)))
        }
        Err(PlacedError::Rank(e)) => {
            // One write, so that the ranks' lines do not interleave; then out at once.
            err!("{}: error: {e}\n", file.display());
            std::process::exit(1);
        }
    };
    report(file, &run_dir, lead, result)
}

/// What the run ended with, said by the lead rank (exit 0, 1, or 128 + the signal).
fn report(
    file: &Path,
    run_dir: &Path,
    lead: bool,
    result: Result<parallax_runtime::train::Summary, TrainError>,
) -> Result<(), Exit> {
    let at = file.display();
    match result {
        Err(TrainError::Interrupted { signal, .. }) if !lead => Err(stopped(signal)),
        _ if !lead => Ok(()),
        Ok(s) => outln!("{}\nrun: {}", s.line(), run_dir.display()),
        Err(e @ TrainError::Finished { .. }) => {
            errln!("{at}: {e}");
            outln!("run: {}", run_dir.display())
        }
        Err(e @ TrainError::Interrupted { signal, .. }) => {
            errln!("{at}: {e}");
            Err(stopped(signal))
        }
        Err(e) => Err(crate::fail(file, e)),
    }
}

/// The exit code of a run a signal stopped: 128 + the signal, as a shell reports it.
fn stopped(signal: usize) -> Exit {
    Exit(128u8.saturating_add(signal as u8))
}
