//! `parallax train`: compile, train on the CPU, show progress, report where the run went.

use crate::{load, report, run_pipeline, Backend, Exit, Format, PrecisionArg};
use indicatif::{ProgressBar, ProgressStyle};
use parallax_compiler::dsl::overrides::{self, Override};
use parallax_compiler::Options;
use parallax_runtime::train::{train, Event, TrainConfig};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// `YYYYMMDD-HHMMSS` in UTC, from the system clock (names the run directory only).
fn timestamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn default_run_dir(name: &str) -> PathBuf {
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let base = PathBuf::from("runs").join(format!("{safe}-{}", timestamp()));
    let mut dir = base.clone();
    let mut k = 2;
    while dir.exists() {
        dir = PathBuf::from(format!("{}-{k}", base.display()));
        k += 1;
    }
    dir
}

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
    /// Keep the newest K checkpoints (0 keeps all).
    #[arg(long, value_name = "K", default_value_t = 3)]
    pub keep: usize,
    /// Continue the run in RUN_DIR from its newest checkpoint (bit for bit as if never
    /// interrupted); `--steps` may extend it.
    #[arg(long, value_name = "RUN_DIR", conflicts_with_all = ["file", "epochs", "seed", "run_dir", "init", "set"])]
    pub resume: Option<PathBuf>,
    /// GPUs to train on (one until the partition pass exists; more is refused clearly).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub gpus: u32,
    /// Where to run: `cuda` needs an NVIDIA GPU; `auto` uses one when present.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// GEMM precision on CUDA: exact fp32, tf32 tensor cores (the default), or bf16
    /// products with fp32 accumulation (fp32 master weights).
    #[arg(long, value_enum, default_value = "tf32")]
    pub precision: PrecisionArg,
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
        gpus,
        backend,
        precision,
    } = args;
    let checkpoint_every = checkpoint_every.unwrap_or(0);
    // A resumed run reads the experiment it recorded (every default and override resolved).
    let file = match (&resume, file) {
        (Some(dir), _) => dir.join("experiment.ron"),
        (None, Some(f)) => f,
        (None, None) => unreachable!("clap requires FILE unless --resume"),
    };
    let file = file.as_path();
    let run_dir = resume.clone().or(run_dir);
    let (source, _) = load(file, Format::Text)?;
    let overrides = set
        .iter()
        .map(|s| Override::parse(s))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            eprintln!("error: --set {e}");
            Exit(2)
        })?;
    let source = if overrides.is_empty() {
        source
    } else {
        overrides::apply(&source, &overrides).map_err(|e| {
            report(
                &file.display().to_string(),
                "",
                &e.diagnostics(),
                Format::Text,
            );
            Exit(1)
        })?
    };
    if gpus > 1 {
        // Say what is missing, and whether the GPUs are even there.
        let found = match parallax_runtime::cuda::probe() {
            Ok(d) => format!("{} GPU(s) here", d.gpus.len()),
            Err(e) => format!("no usable GPU here: {e}"),
        };
        eprintln!(
            "{}: error: --gpus {gpus}: training on several devices needs the partition pass, which is not built yet",
            file.display()
        );
        eprintln!("  = note: {found}");
        eprintln!("  = hint: `parallax compile FILE --gpus {gpus}` shows the plan's memory; train with --gpus 1");
        return Err(Exit(1));
    }
    let cuda = match backend {
        Backend::Cpu => false,
        Backend::Cuda => match parallax_runtime::cuda::probe() {
            Ok(_) => true,
            Err(e) => {
                eprintln!("{}: error: --backend cuda: {e}", file.display());
                eprintln!("  = hint: `parallax devices` says what was found; `--backend cpu` trains on the CPU");
                return Err(Exit(1));
            }
        },
        Backend::Auto => parallax_runtime::cuda::probe().is_ok(),
    };
    let cuda = if cuda {
        Some(precision.runtime()?)
    } else {
        None
    };
    let options = Options::default();
    let compiled = run_pipeline(file, &source, &options, Format::Text, &mut |_, _| {})?;
    let plan = compiled.plan(&source, &options);
    let run_dir = run_dir.unwrap_or_else(|| default_run_dir(&source.experiment.name));
    let cfg = TrainConfig {
        steps,
        epochs,
        seed,
        run_dir: run_dir.clone(),
        init,
        base_dir: file.parent().map(Path::to_path_buf).unwrap_or_default(),
        cuda,
        checkpoint_every,
        keep,
        resume: resume.is_some(),
        overrides: set,
    };
    let backend_name = if cuda.is_some() {
        "CUDA backend (GPU 0)"
    } else {
        "CPU backend"
    };
    let terminal = std::io::stderr().is_terminal();
    let mut bar: Option<ProgressBar> = None;
    let mut every = 1;
    let name = source.experiment.name.clone();
    let mut on_event = |e: &Event| match e {
        Event::Start {
            total_steps,
            train_samples,
            validation_samples,
            ..
        } => {
            eprintln!(
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
            None if step % every == 0 || step == total => eprintln!(
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
                None => eprintln!("{line}"),
            }
        }
    };
    let result = train(&source, plan, &cfg, &mut on_event);
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    match result {
        Ok(s) => {
            let acc = s.val_accuracy.map_or(String::new(), |a| {
                format!(", validation accuracy {:.2}%", a * 100.0)
            });
            let val = s
                .val_loss
                .map_or(String::new(), |l| format!(", validation loss {l:.4}"));
            println!(
                "{}: {} steps, train loss {:.4}{val}{acc}, {:.0} samples/s, {:.1} s",
                s.name, s.steps, s.final_train_loss, s.samples_per_sec, s.wall_seconds
            );
            println!("run: {}", run_dir.display());
            Ok(())
        }
        Err(e) => {
            eprintln!("{}: error: {e}", file.display());
            Err(Exit(1))
        }
    }
}
