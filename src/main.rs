//! The `parallax` command line: the only place that prints errors and picks exit codes
//! (0 ok, 1 a bad experiment file, 2 a bad command line).

use clap::{Parser, Subcommand, ValueEnum};
use parallax_compiler::diag::Diagnostic;
use parallax_compiler::dsl::overrides::{self, Override};
use parallax_compiler::passes::pass_names;
use parallax_compiler::{compile, parse_bytes, Compiled, Options, Source};
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

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Backend {
    Auto,
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PrecisionArg {
    Fp32,
    Tf32,
    Bf16,
}

impl PrecisionArg {
    pub(crate) fn runtime(self) -> Result<parallax_runtime::cuda::Precision, Exit> {
        Ok(match self {
            PrecisionArg::Fp32 => parallax_runtime::cuda::Precision::Fp32,
            PrecisionArg::Tf32 => parallax_runtime::cuda::Precision::Tf32,
            PrecisionArg::Bf16 => parallax_runtime::cuda::Precision::Bf16,
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum MmaArg {
    OracleOrder,
    Hopper,
}

impl MmaArg {
    fn model(self) -> parallax_emulator::MmaModel {
        match self {
            MmaArg::OracleOrder => parallax_emulator::MmaModel::OracleOrder,
            MmaArg::Hopper => parallax_emulator::MmaModel::Hopper,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Emit {
    /// The IR as stable text (`graph.ir`).
    Ir,
    /// The IR as a Graphviz graph (`graph.dot`).
    Dot,
    /// The plan as JSON (`plan.json`).
    Plan,
    /// One PTX file per kernel and `manifest.json` (each kernel's launches and fused ops);
    /// needs `--out`.
    Ptx,
}

impl Emit {
    fn file_name(self) -> &'static str {
        match self {
            Emit::Ir => "graph.ir",
            Emit::Dot => "graph.dot",
            Emit::Plan => "plan.json",
            Emit::Ptx => "manifest.json",
        }
    }
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
    /// Check the CUDA backend against the CPU oracle: a few training steps from identical
    /// weights on both (largest relative difference of losses and parameters), then the GPU
    /// step time. Prints a `ROW|...` line for `scripts/gpu-check.sh`.
    GpuCheck {
        file: PathBuf,
        #[arg(long, default_value_t = 3)]
        steps: u64,
        #[arg(long, value_enum, default_value = "fp32")]
        precision: PrecisionArg,
        /// Timed steps (median reported, after 3 warm-up steps).
        #[arg(long, default_value_t = 20)]
        time_steps: u64,
        /// Compare every kernel's values with the oracle's (and resynchronise), naming each
        /// kernel that disagrees.
        #[arg(long)]
        lockstep: bool,
        /// Also time every launch of one step and print the slowest kinds.
        #[arg(long)]
        profile: bool,
        /// In lockstep (implied), also run every kernel on the PTX interpreter from the same
        /// inputs and print where the GPU's values differ from its in bits.
        #[arg(long)]
        interpreter: bool,
        /// The interpreter's model of the tensor cores (`--interpreter`).
        #[arg(long, value_enum, default_value = "hopper")]
        mma: MmaArg,
        /// Override a value of the experiment, as `train --set` does (repeatable).
        #[arg(long, value_name = "PATH=VALUE")]
        set: Vec<String>,
    },
    /// Run one training step of the plan's generated GPU kernels on the PTX interpreter,
    /// kernel by kernel against the CPU oracle, with sanitizer checks (out-of-bounds,
    /// uninitialised reads, shared-memory races, misalignment, divergent barriers, pending
    /// cp.async reads). No GPU needed. Exit 1 on any difference beyond tolerance or finding.
    CheckKernels {
        file: PathBuf,
        #[arg(long, value_enum, default_value = "fp32")]
        precision: PrecisionArg,
        /// Override a value of the experiment, as `train --set` does (repeatable).
        #[arg(long, value_name = "PATH=VALUE")]
        set: Vec<String>,
        /// Run `DIR/<entry>.ptx` in place of each generated entry of that name (the files
        /// `compile --emit ptx --out DIR` writes, changed by hand).
        #[arg(long, value_name = "DIR")]
        ptx: Option<PathBuf>,
        /// How `mma.sync` adds its products: the oracle's order, or Hopper's measured
        /// arithmetic (aligned to the largest exponent, truncated).
        #[arg(long, value_enum, default_value = "oracle-order")]
        mma: MmaArg,
        /// Check the kernels of the plan `train --gpus N` runs: every device's (each
        /// pipeline stage's, each tensor rank's), each against its own oracle.
        #[arg(long, default_value_t = 1)]
        gpus: u32,
        /// The split for `--gpus`, as `train --strategy` takes it (`dp2`, `pp2`, `tp2`, ...).
        #[arg(long)]
        strategy: Option<String>,
        /// ZeRO stage over the data-parallel ranks, as `train --zero` takes it.
        #[arg(long)]
        zero: Option<u8>,
        #[arg(long, value_enum, default_value = "text")]
        format: Format,
    },
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
    /// Turn text files (concatenated in order) into llm.c token files for `Tokens`:
    /// `PREFIX_train.bin` and `PREFIX_val.bin` (or `PREFIX.bin` without a validation part), and
    /// for characters the vocabulary `PREFIX_vocab.json`.
    Tokenize(tokenize::Args),
    /// Evaluate a trained run's weights on its validation data (or `--data`): mean loss,
    /// accuracy and top-5 for classifiers, perplexity for language models; every sample once
    /// on any device count.
    Eval(trained::EvalArgs),
    /// A trained classifier's class probabilities and top-k labels for inputs (`.npy`, `.csv`).
    Predict(trained::PredictArgs),
    /// Text from a trained language model: `--prompt`, `--max-new-tokens`, `--temperature`,
    /// `--top-k`, `--top-p`, `--seed` (the same seed, the same text); decoded with the
    /// tokenizer its token files were written with.
    Sample(sample::Args),
    /// Check collectives on the GPU: NCCL all-reduce at world size 1, and a 4-rank
    /// data-parallel gradient step on simulated ranks against the 1-rank step of FILE.
    CollectivesCheck { file: PathBuf },
    /// Check the communicator between ranks started by `mpirun` or `srun` (a build with
    /// `--features mpi`): the tree all-reduce over 1 to 9 shards with the bits of one device,
    /// reduce, broadcast, sends, barrier and the failure flag. Exits non-zero, naming the
    /// rank and the collective, when a rank fails or stops answering.
    CommCheck {
        /// Seconds a rank waits for another before it gives up.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// Make this rank fail (at the 5-shard all-reduce), to see what the others report.
        #[arg(long, value_name = "RANK")]
        fail_rank: Option<usize>,
        /// Make this rank stop answering (at the same point) for as long.
        #[arg(long, value_name = "RANK")]
        hang_rank: Option<usize>,
        /// Instead of the check, time the fixed-tree all-reduce against MPI_Allreduce on the
        /// same buffers (a table on rank 0).
        #[arg(long)]
        bench: bool,
        /// `cuda`: instead, the fixed-tree all-reduce on GPUs over NCCL (each rank binds GPU
        /// local rank % GPU count; the NCCL id goes out over MPI), compared bit for bit with
        /// the host's sum for several lengths and shard layouts (a table on rank 0).
        /// `--fail-rank` then makes that rank exit in the middle.
        #[arg(long, value_enum, default_value = "cpu")]
        backend: comm_check::CommBackend,
    },
    /// Compile an experiment into a plan.
    Compile {
        file: PathBuf,
        /// Override a field of the file, as `train --set` does: `--set devices.gpus=4`.
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
        /// GPUs to plan for: the partition planner picks data, tensor and pipeline
        /// parallelism for them (the file's `devices.gpus` when absent).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
        gpus: Option<u32>,
        /// Nodes the GPUs are spread over (default: 8 GPUs per node).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
        nodes: Option<u32>,
        /// Force a strategy: `dp4`, `tp8`, `dp2.tp2.pp2` (degrees not named are 1; their
        /// product must be the GPU count).
        #[arg(long, value_name = "S")]
        strategy: Option<String>,
        /// Print the partition candidates, the choice and each pipeline stage.
        #[arg(long)]
        explain: bool,
        /// The device kind to plan for (overrides the file's `devices.kind`): h100, h200,
        /// a100-80gb, a100-40gb, l4, cpu.
        #[arg(long, value_name = "KIND")]
        device: Option<String>,
        /// Each GPU's memory (overrides the profile's), e.g. `24GiB`.
        #[arg(long, value_name = "SIZE", value_parser = parallax_compiler::devices::parse_bytes)]
        gpu_memory: Option<u64>,
        /// What to write: the IR text, its DOT graph, or the plan (comma-separated).
        #[arg(long, value_enum, value_delimiter = ',')]
        emit: Vec<Emit>,
        /// The CUDA precision whose kernels `--emit ptx` writes, as `train --precision` runs
        /// them (bf16: attention on tensor cores).
        #[arg(long, value_enum, default_value = "tf32")]
        precision: PrecisionArg,
        /// The folder to write emitted files to (stdout when absent and one thing is emitted).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, value_enum, default_value = "text")]
        format: Format,
        /// Print how long each pass took (to stderr).
        #[arg(long)]
        timings: bool,
        /// Print the IR after a pass (to stderr), e.g. `after:lower`.
        #[arg(long, value_name = "after:PASS", value_parser = parse_dump)]
        dump_ir: Vec<String>,
    },
}

fn parse_dump(s: &str) -> Result<String, String> {
    let names = pass_names();
    let Some(pass) = s.strip_prefix("after:") else {
        return Err(format!(
            "expected `after:PASS`, where PASS is one of: {}",
            names.join(", ")
        ));
    };
    if names.contains(&pass) || pass == "all" {
        Ok(pass.to_string())
    } else {
        Err(format!(
            "unknown pass `{pass}`; the passes are: {}, or `all`",
            names.join(", ")
        ))
    }
}

#[macro_use]
mod out;
mod check_kernels;
mod comm_check;
mod compile;
mod gpu;
mod job;
mod prepare;
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
        Command::Compile {
            file,
            set,
            gpus,
            nodes,
            strategy,
            explain,
            device,
            gpu_memory,
            emit,
            precision,
            out,
            format,
            timings,
            dump_ir,
        } => precision.runtime().and_then(|precision| {
            compile::compile_cmd(
                &file,
                &set,
                compile::Target {
                    gpus,
                    device,
                    gpu_memory,
                    nodes,
                    strategy,
                    explain,
                    precision,
                },
                &emit,
                out.as_deref(),
                format,
                timings,
                &dump_ir,
            )
        }),
        Command::Train(args) => train::run(args),
        Command::Devices { format } => gpu::devices(format),
        Command::CheckKernels {
            file,
            precision,
            set,
            ptx,
            mma,
            gpus,
            strategy,
            zero,
            format,
        } => precision.runtime().and_then(|precision| {
            let args = parallax_runtime::checks::kernels::KernelCheckArgs {
                precision,
                ptx_dir: ptx,
                mma: mma.model(),
            };
            let split = (gpus, strategy.as_deref(), zero);
            check_kernels::run(&file, &set, split, &args, format)
        }),
        Command::GpuCheck {
            file,
            steps,
            precision,
            time_steps,
            lockstep,
            profile,
            interpreter,
            mma,
            set,
        } => precision.runtime().and_then(|precision| {
            gpu::gpu_check(
                &file,
                &set,
                &parallax_runtime::checks::gpu::CheckArgs {
                    profile,
                    steps,
                    precision,
                    time_steps,
                    lockstep: lockstep || interpreter,
                    interpreter: interpreter.then(|| mma.model()),
                },
            )
        }),
        Command::CollectivesCheck { file } => gpu::collectives_check(&file),
        Command::CommCheck {
            timeout,
            fail_rank,
            hang_rank,
            bench,
            backend,
        } => match (backend, bench) {
            (comm_check::CommBackend::Cuda, _) => comm_check::cuda(timeout, fail_rank),
            (_, true) => comm_check::bench(timeout),
            (_, false) => comm_check::run(timeout, fail_rank, hang_rank),
        },
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

/// Reads and parses the file, reporting any error; returns the source and the parse time.
pub(crate) fn load(file: &Path, format: Format) -> Result<(Source, Duration), Exit> {
    let name = file.display().to_string();
    let bytes = std::fs::read(file).map_err(|e| {
        report(
            &name,
            "",
            &[Diagnostic::new(format!("cannot read the file: {e}"), None)],
            format,
        );
        Exit(1)
    })?;
    let t = Instant::now();
    let parsed = parse_bytes(&bytes);
    let elapsed = t.elapsed();
    parsed.map(|s| (s, elapsed)).map_err(|e| {
        let text = String::from_utf8_lossy(&bytes);
        report(&name, &text, &e.diagnostics(), format);
        Exit(1)
    })
}

/// The file's experiment with the `--set PATH=VALUE` overrides applied, reporting any error
/// (exit 2 for an argument that is not PATH=VALUE, 1 for a value the experiment refuses).
pub(crate) fn apply_set(
    file: &Path,
    source: Source,
    set: &[String],
    format: Format,
) -> Result<Source, Exit> {
    if set.is_empty() {
        return Ok(source);
    }
    let overrides = set
        .iter()
        .map(|s| Override::parse(s))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            errln!("error: --set {e}");
            Exit(2)
        })?;
    overrides::apply(&source, &overrides).map_err(|e| {
        report(&file.display().to_string(), "", &e.diagnostics(), format);
        Exit(1)
    })
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

fn check(file: &Path, set: &[String], format: Format) -> Result<(), Exit> {
    let (source, _) = load(file, format)?;
    let source = apply_set(file, source, set, format)?;
    // Checking needs the forward graph and its shapes; training passes are `compile`'s.
    let options = Options {
        stop_after: Some("shapes"),
        ..Options::default()
    };
    let compiled = run_pipeline(file, &source, &options, format, &mut |_, _| {})?;
    let summary = compiled.summary(&source);
    match format {
        Format::Text => outln!("{}", summary.line())?,
        Format::Json => {
            let mut v = serde_json::to_value(&summary).expect("a summary serialises");
            v["ok"] = serde_json::Value::Bool(true);
            outln!("{v}")?;
        }
    }
    Ok(())
}
