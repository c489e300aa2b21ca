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
    /// Check the kernels of the plan `train --gpus N` runs: every device's (each
    /// pipeline stage's, each tensor rank's), each against its own oracle.
    #[arg(long, default_value_t = 1)]
    pub gpus: u32,
    /// The split for `--gpus`, as `train --strategy` takes it (`dp2`, `pp2`, `tp2`, ...).
    #[arg(long)]
    pub strategy: Option<String>,
    /// ZeRO stage over the data-parallel ranks, as `train --zero` takes it.
    #[arg(long)]
    pub zero: Option<u8>,
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
}

pub(crate) fn run(args: Args) -> Result<(), Exit> {
    let (file, set, format) = (args.file.as_path(), args.set.as_slice(), args.format);
    let (gpus, strategy, zero) = (args.gpus, args.strategy.as_deref(), args.zero);
    let a = KernelCheckArgs {
        precision: args.precision.value(),
        ptx_dir: args.ptx,
        mma: args.mma.value(),
    };
    let (source, plan, base) = compiled(file, set)?;
    // Several devices: the plan `train --gpus N` runs (the same choice of split).
    let plan = if gpus > 1 {
        let request = target::Request {
            gpus,
            strategy,
            zero,
            ..target::Request::default()
        };
        let split = target::split(&source, &request).map_err(|e| fail(file, e))?;
        let (_, plan) =
            target::compile_split(&source, &split, &mut |_, _| {}).map_err(|e| fail(file, e))?;
        errln!(
            "{}: --gpus {gpus}: {}",
            source.experiment.name,
            parallax_compiler::partition::strategy_name(&split.strategy)
        );
        plan
    } else {
        plan
    };
    let t = Instant::now();
    let r = kernels::check(&source, &plan, &base, &a).map_err(|e| fail(file, e))?;
    let seconds = t.elapsed().as_secs_f64();
    match format {
        Format::Json => outln!("{}", report::json(&r, seconds))?,
        Format::Text => out!("{}", report::text(&source.experiment.name, &r, seconds))?,
    }
    if r.ok() {
        Ok(())
    } else {
        Err(Exit(1))
    }
}
