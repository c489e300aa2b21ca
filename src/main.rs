//! The `parallax` command line: the only place that prints errors and picks exit codes
//! (0 ok, 1 a bad experiment file, 2 a bad command line).

use clap::{Parser, Subcommand, ValueEnum};
use parallax_compiler::diag::Diagnostic;
use parallax_compiler::dsl::overrides::{self, Override};
use parallax_compiler::{compile, parse_bytes, Compiled, Options, Source};
use parallax_emulator::MmaModel;
use parallax_runtime::cuda::Precision;
use parallax_runtime::train::prepare::BackendChoice;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    name = "parallax",
    version,
    about = "Compile and train neural networks declared in one RON file"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Format {
    Text,
    Json,
}

/// A command-line enum naming a library's values one for one, and its mapping.
macro_rules! arg_enum {
    ($arg:ident => $lib:ident { $($(#[$doc:meta])* $v:ident),+ }) => {
        #[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
        pub(crate) enum $arg { $($(#[$doc])* $v),+ }
        impl $arg {
            pub(crate) fn value(self) -> $lib {
                match self { $($arg::$v => $lib::$v),+ }
            }
        }
    };
}
arg_enum!(Backend => BackendChoice { Auto, Cpu, Cuda });
arg_enum!(PrecisionArg => Precision { Fp32, Tf32, Bf16 });
arg_enum!(MmaArg => MmaModel { OracleOrder, Hopper });

/// The devices a plan runs on and how they split it: `train`, `compile` and `check-kernels`
/// take them alike, and choose the same split from them (`target::split`).
#[derive(clap::Args)]
pub(crate) struct SplitArgs {
    /// Devices (simulated ones on the CPU backend): each batch is cut into the file's
    /// `devices.micro_shards` pieces, so any count up to that gives the same bits (the file's
    /// `devices.gpus` when absent).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub gpus: Option<u32>,
    /// How the devices split the work: `dp4`, `tp8`, `dp2.tp2.pp2` (degrees not named are 1;
    /// their product is `--gpus`). Default: the cost model's choice.
    #[arg(long, value_name = "STRATEGY")]
    pub strategy: Option<String>,
    /// ZeRO stage over the data-parallel ranks: 1 shards the optimizer state, 2 the reduced
    /// gradients too, 3 the parameters too. Default: the cost model's, or 0 with --strategy.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: Option<u8>,
    /// Each device's memory (default: the device kind's), e.g. `24GiB`.
    #[arg(long, value_name = "SIZE", value_parser = parallax_compiler::devices::parse_bytes)]
    pub gpu_memory: Option<u64>,
}

#[derive(Subcommand)]
enum Command {
    /// Parse and type-check an experiment; print its parameters, layers and FLOPs per sample.
    Check {
        file: PathBuf,
        /// Override a field of the file, as `train --set` does: `--set train.batch_size=256`.
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
        #[arg(long, value_enum, default_value = "text")]
        format: Format,
    },
    /// Train an experiment (on the CPU, or on GPU 0 with `--backend cuda`) and write its run
    /// directory; or continue a run from its newest checkpoint with `--resume RUN_DIR`.
    Train(train::Args),
    /// List the GPUs found, with memory, compute capability and library versions, or say why
    /// none is usable.
    Devices {
        #[arg(long, value_enum, default_value = "text")]
        format: Format,
    },
    /// Check the CUDA backend against the CPU oracle from identical weights (losses and
    /// parameters after a few steps), then time its step; `ROW|...` for scripts/gpu-check.sh.
    GpuCheck(gpu::Args),
    /// Run a training step's GPU kernels on the PTX interpreter against the CPU oracle, with
    /// sanitizer checks (bounds, uninitialised reads, races, alignment, barriers); no GPU needed.
    CheckKernels(check_kernels::Args),
    /// Draw the training and validation curves of one or more runs (SVG, shared axes) and
    /// write an HTML page with their summaries side by side.
    Report {
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Where to write `report.html` and the plots (default: the first run's folder).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// List the experiment fields that differ between two runs, and each run's final metrics.
    Diff { a: PathBuf, b: PathBuf },
    /// Turn text files (concatenated in order) into llm.c token files for `Tokens`, with the
    /// tokenizer beside them.
    Tokenize(tokenize::Args),
    /// Evaluate a trained run on its validation data (or `--data`): loss, accuracy and top-5,
    /// or perplexity; every sample once on any device count.
    Eval(trained::EvalArgs),
    /// A trained classifier's class probabilities and top-k labels for inputs (`.npy`, `.csv`).
    Predict(trained::PredictArgs),
    /// Text from a trained language model (the same seed, the same text), decoded with the
    /// tokenizer its token files were written with.
    Sample(sample::Args),
    /// Check collectives on the GPU: NCCL all-reduce at world size 1, and a 4-rank
    /// data-parallel gradient step on simulated ranks against the 1-rank step of FILE.
    CollectivesCheck { file: PathBuf },
    /// Check the communicator between ranks `mpirun` or `srun` started (`--features mpi`):
    /// each collective's bits against one device's, and a failing or silent rank named.
    CommCheck(comm_check::Args),
    /// Compile an experiment into a plan.
    Compile(compile::Args),
}

#[macro_use]
mod out;
mod check_kernels;
mod comm_check;
mod compile;
mod gpu;
mod prepare;
mod progress;
mod report;
mod sample;
mod tokenize;
mod train;
mod trained;

/// A failure already reported to the user, with its exit code.
pub(crate) struct Exit(u8);

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Check { file, set, format } => check(&file, &set, format),
        Command::Compile(args) => compile::run(args),
        Command::Train(args) => train::run(args),
        Command::Devices { format } => gpu::devices(format),
        Command::CheckKernels(args) => check_kernels::run(args),
        Command::GpuCheck(args) => gpu::gpu_check(args),
        Command::CollectivesCheck { file } => gpu::collectives_check(&file),
        Command::CommCheck(args) => comm_check::run(args),
        Command::Report { runs, out } => report::report(&runs, out.as_deref()),
        Command::Diff { a, b } => report::diff(&a, &b),
        Command::Tokenize(args) => tokenize::run(args),
        Command::Eval(args) => trained::eval(args),
        Command::Predict(args) => trained::predict(args),
        Command::Sample(args) => sample::run(args),
    };
    match r {
        Ok(()) if out::failed() => ExitCode::from(1),
        Ok(()) => ExitCode::SUCCESS,
        Err(Exit(code)) => ExitCode::from(code),
    }
}

/// Reads and parses the file and applies the `--set PATH=VALUE` overrides, reporting any
/// error (exit 2 for an argument that is not PATH=VALUE, 1 for a file or value the experiment
/// refuses); returns the source and the parse time.
pub(crate) fn load(file: &Path, set: &[String], fmt: Format) -> Result<(Source, Duration), Exit> {
    let name = file.display().to_string();
    let refuse = |text: &str, diagnostics: &[Diagnostic]| {
        report(&name, text, diagnostics, fmt);
        Exit(1)
    };
    let unread = |e| [Diagnostic::new(format!("cannot read the file: {e}"), None)];
    let bytes = std::fs::read(file).map_err(|e| refuse("", &unread(e)))?;
    let t = Instant::now();
    let parsed = parse_bytes(&bytes);
    let elapsed = t.elapsed();
    let source = parsed.map_err(|e| refuse(&String::from_utf8_lossy(&bytes), &e.diagnostics()))?;
    if set.is_empty() {
        return Ok((source, elapsed));
    }
    let overrides: Result<Vec<_>, _> = set.iter().map(|s| Override::parse(s)).collect();
    let overrides = overrides.map_err(|e| usage(format!("--set {e}")))?;
    let source = overrides::apply(&source, &overrides).map_err(|e| refuse("", &e.diagnostics()))?;
    Ok((source, elapsed))
}

/// Errors go to stderr with the source line and a caret; with `--format json` also as one
/// JSON object on stdout.
pub(crate) fn report(file: &str, src: &str, diags: &[Diagnostic], format: Format) {
    let mut err = std::io::stderr().lock();
    for d in diags {
        let _ = write!(err, "{}", d.render(file, src));
    }
    if diags.len() > 1 {
        let _ = writeln!(err, "{file}: {} errors", diags.len());
    }
    if format == Format::Json {
        let errors: Vec<serde_json::Value> = diags.iter().map(|d| d.to_json(file, src)).collect();
        // Already failing: a write error here changes nothing about the exit code.
        let _ = outln!("{}", serde_json::json!({ "ok": false, "errors": errors }));
    }
}

pub(crate) fn run_pipeline(
    file: &Path,
    source: &Source,
    options: &Options,
    format: Format,
    after_pass: &mut dyn FnMut(&str, &parallax_compiler::ir::Graph),
) -> Result<Compiled, Exit> {
    compile(source, options, after_pass).map_err(|e| {
        let (text, diags) = source.for_user(e.diagnostics());
        report(&file.display().to_string(), text, &diags, format);
        Exit(1)
    })
}

/// A failure at `at` (a file or folder), reported.
pub(crate) fn fail(at: &Path, e: impl std::fmt::Display) -> Exit {
    hinted(Some(at), e, None)
}

/// Exit 1 unless `ok` (a check that found a difference, a plan refused).
pub(crate) fn ok_if(ok: bool) -> Result<(), Exit> {
    ok.then_some(()).ok_or(Exit(1))
}

/// A command line that cannot be run, reported (exit 2).
pub(crate) fn usage(e: impl std::fmt::Display) -> Exit {
    errln!("error: {e}");
    Exit(2)
}

/// A failure that names its file itself (or none), reported.
pub(crate) fn error(e: impl std::fmt::Display) -> Exit {
    hinted(None, e, None)
}

/// A failure (at a file or folder, when it has one) and what to do about it, reported.
pub(crate) fn hinted(at: Option<&Path>, e: impl std::fmt::Display, hint: Option<String>) -> Exit {
    match at {
        Some(at) => errln!("{}: error: {e}", at.display()),
        None => errln!("error: {e}"),
    }
    if let Some(hint) = hint {
        errln!("  = hint: {hint}");
    }
    Exit(1)
}

/// The folder a file's relative paths start from.
pub(crate) fn base_dir(file: &Path) -> PathBuf {
    file.parent().map(Path::to_path_buf).unwrap_or_default()
}

fn check(file: &Path, set: &[String], format: Format) -> Result<(), Exit> {
    let (source, _) = load(file, set, format)?;
    // Checking needs the forward graph and its shapes; training passes are `compile`'s.
    let options = Options {
        stop_after: Some("shapes"),
        ..Options::default()
    };
    let compiled = run_pipeline(file, &source, &options, format, &mut |_, _| {})?;
    let summary = compiled.summary(&source);
    match format {
        Format::Text => outln!("{}", summary.line()),
        Format::Json => outln!("{}", summary.json()),
    }
}
