//! `parallax compile`: the plan, its kernels and memory, the device check, and what `--emit`
//! writes (IR, DOT, plan JSON, PTX).

use crate::{base_dir, fail, load, run_pipeline, Exit, Format, PrecisionArg};
use clap::ValueEnum;
use parallax_compiler::ir::print::{to_dot, to_text};
use parallax_compiler::partition::summary;
use parallax_compiler::passes::dump_after;
use parallax_compiler::target;
use parallax_compiler::verdict;
use parallax_compiler::{codegen, Options, Plan};
use parallax_runtime::cuda::Precision;
use parallax_runtime::train::prepare;
use std::path::{Path, PathBuf};

/// `parallax compile`'s arguments.
#[derive(clap::Args)]
pub(crate) struct Args {
    pub file: PathBuf,
    /// Override a field of the file, as `train --set` does: `--set devices.gpus=4`.
    #[arg(long = "set", value_name = "PATH=VALUE")]
    pub set: Vec<String>,
    #[command(flatten)]
    pub split: crate::SplitArgs,
    /// Nodes the GPUs are spread over (default: 8 GPUs per node).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub nodes: Option<u32>,
    /// Print the partition candidates, the choice and each pipeline stage.
    #[arg(long)]
    pub explain: bool,
    /// The device kind to plan for (overrides the file's `devices.kind`): h100, h200,
    /// a100-80gb, a100-40gb, l4, cpu.
    #[arg(long, value_name = "KIND")]
    pub device: Option<String>,
    /// What to write: the IR text, its DOT graph, or the plan (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub emit: Vec<Emit>,
    /// The CUDA precision whose kernels `--emit ptx` writes, as `train --precision` runs
    /// them (bf16: attention on tensor cores).
    #[arg(long, value_enum, default_value = "tf32")]
    pub precision: PrecisionArg,
    /// The folder to write emitted files to (stdout when absent and one thing is emitted).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
    /// Print how long each pass took (to stderr).
    #[arg(long)]
    pub timings: bool,
    /// Print the IR after a pass (to stderr), e.g. `after:lower`.
    #[arg(long, value_name = "after:PASS", value_parser = dump_after)]
    pub dump_ir: Vec<String>,
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

pub(crate) fn run(args: Args) -> Result<(), Exit> {
    let (file, out, emit, format) = (
        args.file.as_path(),
        args.out.as_deref(),
        &args.emit[..],
        args.format,
    );
    if out.is_none() && (emit.len() > 1 || emit.contains(&Emit::Ptx)) {
        return Err(crate::usage("emitting several files needs `--out DIR`"));
    }
    let (source, parse_time) = load(file, &args.set, format)?;
    let options = Options {
        gpus: args.split.gpus,
        ..Options::default()
    };
    let kind = args
        .device
        .as_deref()
        .unwrap_or(&source.experiment.devices.kind);
    let profile = parallax_compiler::devices::find(kind).map_err(crate::usage)?;
    let title = source.experiment.name.clone();
    let mut dump = |pass: &str, g: &parallax_compiler::ir::Graph| {
        if args.dump_ir.iter().any(|d| d == pass || d == "all") {
            errln!("// IR after pass `{pass}`");
            err!("{}", to_text(g, &title));
        }
    };
    let compiled = run_pipeline(file, &source, &options, format, &mut dump)?;
    let capacity = args.split.gpu_memory.unwrap_or(profile.memory);
    let request = target::Request {
        strategy: args.split.strategy.as_deref(),
        zero: args.split.zero,
        memory: args.split.gpu_memory,
        kind: Some(profile.kind),
        nodes: args.nodes,
        ..target::Request::default()
    };
    let planned = verdict::plan(&source, &compiled, &options, request).map_err(refused)?;
    let (plan, partitioned) = (&planned.plan, &planned.partitioned);
    let mut pass_times = compiled.timings.clone();
    pass_times.extend(planned.times);
    let emitted = match emit.contains(&Emit::Plan) {
        true => Some(
            prepare::plan_to_emit(&source, plan, planned.split, &base_dir(file))
                .map_err(refused)?,
        ),
        false => None,
    };
    if args.timings {
        pass_times.insert(0, ("parse", parse_time));
        err!("{}", summary::timings(&pass_times));
    }
    let render = |e: Emit| -> String {
        match e {
            Emit::Ir => to_text(&compiled.graph, &title),
            Emit::Dot => to_dot(&compiled.graph, &title),
            Emit::Plan => emitted.as_ref().unwrap_or(plan).to_json(),
            Emit::Ptx => String::new(),
        }
    };
    match (out, emit) {
        (None, [e]) => {
            out!("{}", render(*e))?;
            return Ok(());
        }
        (Some(dir), _) if !emit.is_empty() => {
            std::fs::create_dir_all(dir)
                .map_err(|e| crate::error(format!("cannot create `{}`: {e}", dir.display())))?;
            for &e in emit {
                if e == Emit::Ptx {
                    emit_ptx(plan, dir, file, args.precision.value())?;
                    continue;
                }
                let path = dir.join(e.file_name());
                std::fs::write(&path, render(e))
                    .map_err(|e| crate::error(format!("cannot write `{}`: {e}", path.display())))?;
                errln!("wrote {}", path.display());
            }
        }
        _ => {}
    }
    let simulated = planned.simulated.as_deref();
    match format {
        Format::Json => {
            let part = &partitioned.partition;
            let v = summary::json(plan, part, simulated, profile, capacity, &pass_times);
            outln!("{v}")?;
        }
        Format::Text => out!("{}", summary::text(plan, &partitioned.partition, simulated))?,
    }
    let text = format == Format::Text;
    let v = verdict::verdict(
        plan,
        partitioned,
        profile.name,
        capacity,
        text,
        args.explain,
    );
    out!("{}", v.out)?;
    err!("{}", v.err);
    crate::ok_if(!v.refused)
}

/// Writes `DIR/<kernel>.ptx` for each generated entry and `DIR/manifest.json`.
fn emit_ptx(plan: &Plan, dir: &Path, file: &Path, precision: Precision) -> Result<(), Exit> {
    let options = parallax_runtime::cuda::codegen_options(precision);
    let module = codegen::generate_with(plan, plan.batch_size, "sm_80", &options)
        .map_err(|e| fail(file, e))?;
    module
        .write_files(dir)
        .map_err(|(path, e)| fail(&path, format!("cannot write: {e}")))?;
    let (files, kernels) = (module.entries.len(), module.kernels.len());
    errln!(
        "wrote {files} PTX files and manifest.json for {kernels} kernels to {}",
        dir.display()
    );
    Ok(())
}

/// A refusal of the split or its plan, printed.
fn refused(e: target::TargetError) -> Exit {
    crate::hinted(None, &e, e.hint())
}
