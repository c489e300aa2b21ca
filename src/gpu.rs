//! GPU commands: `parallax devices` and the checks `scripts/gpu-check.sh` runs on a GPU
//! machine (`gpu-check`: the CUDA backend against the CPU oracle from identical weights, and
//! its step time; `collectives-check`: NCCL and the simulated-ranks all-reduce).

use crate::{fail, load, run_pipeline, Exit, Format, MmaArg, PrecisionArg};
use parallax_compiler::{Options, Plan, Source};
use parallax_runtime::checks::collectives;
use parallax_runtime::checks::gpu::report::{Line, Report};
use parallax_runtime::checks::gpu::{self, CheckArgs, CheckError};
use parallax_runtime::cuda;
use std::path::{Path, PathBuf};

pub fn devices(format: Format) -> Result<(), Exit> {
    match (cuda::probe(), format) {
        (Ok(d), Format::Json) => outln!(
            "{}",
            serde_json::to_string_pretty(&d).expect("serialisable")
        ),
        (Ok(d), Format::Text) => out!("{d}"),
        (Err(e), _) => outln!("no usable GPU: {e}\nthe CPU backend is available (`--backend cpu`)"),
    }
}

/// The file's experiment, its plan (for one device) and the folder its data paths start from.
pub(crate) fn compiled(file: &Path, set: &[String]) -> Result<(Source, Plan, PathBuf), Exit> {
    let (source, _) = load(file, set, Format::Text)?;
    let options = Options::default();
    let compiled = run_pipeline(file, &source, &options, Format::Text, &mut |_, _| {})?;
    let plan = compiled.plan(&source, &options);
    let base = crate::base_dir(file);
    Ok((source, plan, base))
}

/// `parallax gpu-check`'s arguments.
#[derive(clap::Args)]
pub(crate) struct Args {
    pub file: PathBuf,
    #[arg(long, default_value_t = 3)]
    pub steps: u64,
    #[arg(long, value_enum, default_value = "fp32")]
    pub precision: PrecisionArg,
    /// Timed steps (median reported, after 3 warm-up steps).
    #[arg(long, default_value_t = 20)]
    pub time_steps: u64,
    /// Compare every kernel's values with the oracle's (and resynchronise), naming each
    /// kernel that disagrees.
    #[arg(long)]
    pub lockstep: bool,
    /// Also time every launch of one step and print the slowest kinds.
    #[arg(long)]
    pub profile: bool,
    /// In lockstep (implied), also run every kernel on the PTX interpreter from the same
    /// inputs and print where the GPU's values differ from its in bits.
    #[arg(long)]
    pub interpreter: bool,
    /// The interpreter's model of the tensor cores (`--interpreter`).
    #[arg(long, value_enum, default_value = "hopper")]
    pub mma: MmaArg,
    /// Override a value of the experiment, as `train --set` does (repeatable).
    #[arg(long, value_name = "PATH=VALUE")]
    pub set: Vec<String>,
}

pub(crate) fn gpu_check(args: Args) -> Result<(), Exit> {
    let (file, set) = (args.file.as_path(), args.set.as_slice());
    let a = CheckArgs {
        profile: args.profile,
        steps: args.steps,
        precision: args.precision.value(),
        time_steps: args.time_steps,
        lockstep: args.lockstep || args.interpreter,
        interpreter: args.interpreter.then(|| args.mma.value()),
    };
    let (source, plan, base) = compiled(file, set)?;
    let name = &source.experiment.name;
    let mut report = Report::new(name, a.precision.name());
    let c = gpu::check(&source, plan, &base, &a, &mut |p| {
        // A write error is reported by `say` and fails the command's next line.
        let _ = report.progress(p).map(say);
    });
    // A parameter the oracle refused names the experiment, not a line of its file.
    let c = c.map_err(|e| match e {
        CheckError::InitialParameter(_) => crate::error(format!("{name}: {e}")),
        e => fail(file, e),
    })?;
    for line in report.finish(&c) {
        say(line)?;
    }
    crate::ok_if(c.ok())
}

fn say(line: Line) -> Result<(), Exit> {
    match line {
        Line::Out(l) => outln!("{l}")?,
        Line::Err(l) => errln!("{l}"),
    }
    Ok(())
}

/// NCCL at world size 1, and a 4-rank data-parallel gradient step (simulated ranks on one
/// GPU) against the 1-rank step.
pub fn collectives_check(file: &Path) -> Result<(), Exit> {
    let (source, plan, base) = compiled(file, &[])?;
    let (rows, ok) = collectives::collectives(&source, plan, &base).map_err(|e| fail(file, e))?;
    for row in rows {
        outln!("{row}")?;
    }
    crate::ok_if(ok)
}
