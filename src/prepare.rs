//! `parallax train`'s preparation, before anything is loaded or allocated: the experiment (a
//! file, a resumed run's, or a plan's), the device count, the split (chosen by
//! `target::split`, the function `compile --gpus N` reports), the per-device plan, and what
//! runs it.

use crate::train::Args;
use crate::{apply_set, load, Backend, Exit, Format};
use parallax_compiler::target::TargetError;
use parallax_compiler::{partition, Plan, Source};
use parallax_runtime::comm::world::World;
use parallax_runtime::train::prepare::{self, PrepareError, Want};
use parallax_runtime::train::Device;
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

impl Backend {
    pub(crate) fn choice(self) -> prepare::BackendChoice {
        match self {
            Backend::Auto => prepare::BackendChoice::Auto,
            Backend::Cpu => prepare::BackendChoice::Cpu,
            Backend::Cuda => prepare::BackendChoice::Cuda,
        }
    }
}

impl Args {
    fn want(&self) -> Result<Want<'_>, Exit> {
        Ok(Want {
            gpus: self.gpus,
            strategy: self.strategy.as_deref(),
            zero: self.zero,
            backend: self.backend.choice(),
            precision: self.precision.runtime()?,
            gpu_memory: self.gpu_memory,
            collective_timeout: std::time::Duration::from_secs(self.collective_timeout),
            resume: self.resume.as_deref(),
        })
    }
}

/// Decides what `args` runs (nothing is trained or written).
pub(crate) fn prepare(args: &Args) -> Result<Prepared, Exit> {
    let (file, source, given) = experiment(args)?;
    decide(file, source, given, &args.want()?)
}

/// Decides where `source` (or the `given` plan) runs as `want` asks (`train::prepare`): the
/// split, the per-device plan and the device; says its notes.
pub(crate) fn decide(
    file: PathBuf,
    source: Source,
    given: Option<Plan>,
    want: &Want,
) -> Result<Prepared, Exit> {
    let at = file.display().to_string();
    let d = prepare::decide(&source, given, want, &|k| std::env::var(k).ok())
        .map_err(|e| refuse(&at, &source, e))?;
    for note in &d.notes {
        errln!("{at}: note: {note}");
    }
    Ok(Prepared {
        file,
        source,
        plan: d.plan,
        device: d.device,
        world: d.world,
        in_job: d.in_job,
    })
}

/// A refusal, printed: a compile error with its line of the file, else the error and its hint.
fn refuse(at: &str, source: &Source, e: PrepareError) -> Exit {
    let diagnostics = match &e {
        PrepareError::Compile(e) => Some(e.diagnostics()),
        PrepareError::Split(TargetError::Compile(e)) => Some(e.diagnostics()),
        _ => None,
    };
    if let Some(d) = diagnostics {
        let (text, diags) = source.for_user(d);
        crate::report(at, text, &diags, Format::Text);
        return Exit(1);
    }
    errln!("{at}: error: {e}");
    if let Some(hint) = e.hint() {
        errln!("  = hint: {hint}");
    }
    Exit(match e {
        PrepareError::Usage(_) => 2,
        _ => 1,
    })
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
