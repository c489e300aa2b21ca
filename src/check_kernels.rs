//! `parallax check-kernels`: prints the interpreter's kernel-by-kernel comparison with the
//! oracle (`parallax_runtime::checks::kernels`) as a table, then every sanitizer finding; exit 1
//! on any difference beyond tolerance or any finding.

use crate::fail;
use crate::gpu::compiled;
use crate::{Exit, Format, MmaArg, PrecisionArg};
use parallax_compiler::target;
use parallax_runtime::checks::kernels::{self, report, KernelCheckArgs};
use std::path::PathBuf;
use std::time::Instant;

/// `parallax check-kernels`' arguments.
#[derive(clap::Args)]
pub(crate) struct Args {
    pub file: PathBuf,
    #[arg(long, value_enum, default_value = "fp32")]
    pub precision: PrecisionArg,
    /// Override a value of the experiment, as `train --set` does (repeatable).
    #[arg(long, value_name = "PATH=VALUE")]
    pub set: Vec<String>,
    /// Run `DIR/<entry>.ptx` in place of each generated entry of that name (the files
    /// `compile --emit ptx --out DIR` writes, changed by hand).
    #[arg(long, value_name = "DIR")]
    pub ptx: Option<PathBuf>,
    /// How `mma.sync` adds its products: the oracle's order, or Hopper's measured
    /// arithmetic (aligned to the largest exponent, truncated).
    #[arg(long, value_enum, default_value = "oracle-order")]
    pub mma: MmaArg,
    /// The plan `train --gpus N` runs: every device's kernels (each pipeline stage's, each
    /// tensor rank's), each against its own oracle.
    #[command(flatten)]
    pub split: crate::SplitArgs,
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
}

pub(crate) fn run(args: Args) -> Result<(), Exit> {
    let (file, set, format) = (args.file.as_path(), args.set.as_slice(), args.format);
    let split = &args.split;
    let a = KernelCheckArgs {
        precision: args.precision.value(),
        ptx_dir: args.ptx,
        mma: args.mma.value(),
    };
    let (source, plan, base) = compiled(file, set)?;
    // Several devices: the plan `train` runs on them (the same choice of split).
    let plan = match split.gpus.unwrap_or(source.experiment.devices.gpus) {
        1 => plan,
        gpus => {
            let request = target::Request {
                gpus,
                strategy: split.strategy.as_deref(),
                zero: split.zero,
                memory: split.gpu_memory,
                ..target::Request::default()
            };
            let split = target::split(&source, &request).map_err(|e| fail(file, e))?;
            let (_, plan) = target::compile_split(&source, &split, &mut |_, _| {})
                .map_err(|e| fail(file, e))?;
            let name = parallax_compiler::partition::strategy_name(&split.strategy);
            errln!("{}: --gpus {gpus}: {name}", source.experiment.name);
            plan
        }
    };
    let t = Instant::now();
    let r = kernels::check(&source, &plan, &base, &a).map_err(|e| fail(file, e))?;
    let seconds = t.elapsed().as_secs_f64();
    match format {
        Format::Json => outln!("{}", report::json(&r, seconds))?,
        Format::Text => out!("{}", report::text(&source.experiment.name, &r, seconds))?,
    }
    crate::ok_if(r.ok())
}
