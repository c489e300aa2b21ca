//! `parallax check-kernels`: prints the interpreter's kernel-by-kernel comparison with the
//! oracle (`parallax_runtime::checks::kernels`) as a table, then every sanitizer finding; exit 1
//! on any difference beyond tolerance or any finding.

use crate::gpu::{compiled, fail};
use crate::{Exit, Format};
use parallax_compiler::target;
use parallax_runtime::checks::kernels::{self, report, KernelCheckArgs};
use std::path::Path;
use std::time::Instant;

pub fn run(
    file: &Path,
    set: &[String],
    (gpus, strategy, zero): (u32, Option<&str>, Option<u8>),
    a: &KernelCheckArgs,
    format: Format,
) -> Result<(), Exit> {
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
    let r = kernels::check(&source, &plan, &base, a).map_err(|e| fail(file, e))?;
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
