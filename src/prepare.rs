//! `parallax train`'s preparation, before anything is loaded or allocated: the experiment (a
//! file, a resumed run's, or a plan's), the device count, the split (chosen by
//! `target::split`, the function `compile --gpus N` reports), the per-device plan, and what
//! runs it.

use crate::train::Args;
use crate::{load, Exit, Format};
use parallax_compiler::target::TargetError;
use parallax_compiler::{Plan, Source};
use parallax_runtime::train::prepare::{self, Decided, PlanFileError, PrepareError, Want};
use std::path::{Path, PathBuf};

/// What `train` runs, decided.
pub(crate) struct Prepared {
    /// The file errors name: the experiment, the resumed run's `experiment.ron`, or the plan.
    pub file: PathBuf,
    pub source: Source,
    pub decided: Decided,
}

impl Args {
    fn want(&self) -> Want<'_> {
        Want {
            gpus: self.split.gpus,
            strategy: self.split.strategy.as_deref(),
            zero: self.split.zero,
            gpu_memory: self.split.gpu_memory,
            collective_timeout: std::time::Duration::from_secs(self.collective_timeout),
            resume: self.resume.as_deref(),
            ..Want::on(self.backend.value(), self.precision.value())
        }
    }
}

/// Decides what `args` runs (nothing is trained or written).
pub(crate) fn prepare(args: &Args) -> Result<Prepared, Exit> {
    let (file, source, given) = experiment(args)?;
    decide(file, source, given, &args.want())
}

/// Decides where `source` (or the `given` plan) runs as `want` asks (`train::prepare`): the
/// split, the per-device plan and the device; says its notes.
pub(crate) fn decide(
    file: PathBuf,
    source: Source,
    given: Option<Plan>,
    want: &Want,
) -> Result<Prepared, Exit> {
    let decided = prepare::decide(&source, given, want, &|k| std::env::var(k).ok())
        .map_err(|e| refuse(&file, &source, e))?;
    for note in &decided.notes {
        errln!("{}: note: {note}", file.display());
    }
    Ok(Prepared {
        file,
        source,
        decided,
    })
}

/// A refusal, printed: a compile error with its line of the file, else the error and its hint.
fn refuse(at: &Path, source: &Source, e: PrepareError) -> Exit {
    let diagnostics = match &e {
        PrepareError::Compile(e) => Some(e.diagnostics()),
        PrepareError::Split(TargetError::Compile(e)) => Some(e.diagnostics()),
        _ => None,
    };
    if let Some(d) = diagnostics {
        let (text, diags) = source.for_user(d);
        crate::report(&at.display().to_string(), text, &diags, Format::Text);
        return Exit(1);
    }
    crate::hinted(Some(at), &e, e.hint());
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
    let (source, _) = load(&file, &args.set, Format::Text)?;
    Ok((file, source, None))
}

/// A plan written by `compile --emit plan`, and the experiment it carries.
fn load_plan(path: &Path) -> Result<(Source, Plan), Exit> {
    prepare::read_plan(path).map_err(|e| match e {
        PlanFileError::Experiment { text, error } => {
            let at = format!("{} (its experiment)", path.display());
            crate::report(&at, &text, &error.diagnostics(), Format::Text);
            Exit(1)
        }
        e => crate::fail(path, e),
    })
}
