//! `parallax eval` and `parallax predict`: a trained run's weights, used (the library part is
//! `parallax_runtime::trained`). The run's `experiment.ron` is compiled and placed as `train`
//! does it (`prepare::decide`).

use crate::prepare::{decide, Prepared};
use crate::{fail, load, Backend, Exit, Format, PrecisionArg};
use parallax_runtime::data::inputs;
use parallax_runtime::train::prepare::Want;
use parallax_runtime::trained::{self, eval, predict, Weights};
use std::path::{Path, PathBuf};

/// The run, the weights and where they run: what the three commands share.
#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// The run directory `parallax train` wrote.
    pub run: PathBuf,
    /// Use the checkpoint of this step instead of the final weights (default: final.safetensors,
    /// or the newest checkpoint of a run that has not finished).
    #[arg(long, value_name = "STEP")]
    pub step: Option<u64>,
    /// Where to run: `cuda` needs an NVIDIA GPU; `auto` uses one when present.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// GEMM precision on CUDA, as `train --precision`.
    #[arg(long, value_enum, default_value = "tf32")]
    pub precision: PrecisionArg,
}

#[derive(clap::Args)]
pub(crate) struct EvalArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Evaluate every sample of this data source (written as the experiment's `data:` field,
    /// paths relative to the current directory) instead of the run's validation data, e.g.
    /// `--data 'Tokens(train: "test.bin")'` or `--data 'Npy(inputs: "x.npy", labels: "y.npy")'`.
    #[arg(long, value_name = "RON")]
    data: Option<String>,
    /// Devices to evaluate on (simulated on the CPU), each batch cut as `train --gpus` cuts it:
    /// every sample is counted once whatever the count.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    gpus: Option<u32>,
    /// How the devices split the work (`train --strategy`).
    #[arg(long, value_name = "STRATEGY")]
    strategy: Option<String>,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
}

#[derive(clap::Args)]
pub(crate) struct PredictArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Input files: `.npy` (one input of the model's shape, or many along the first axis),
    /// `.csv` (an input a line), or image files and folders of them (for a model trained on
    /// an image folder: its evaluation transform).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The most likely classes listed per input.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    top_k: u64,
    /// Also write every input's probabilities (or a regression's outputs) to this `.npy` file.
    #[arg(long, value_name = "FILE.npy")]
    probabilities: Option<PathBuf>,
    /// `text`: CSV, a line per input; `json`: a list of objects.
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
}

/// The run's weights, and its experiment placed on the devices `want` asks for, with `sets`
/// (`data=...`) applied.
pub(crate) fn open(
    args: &RunArgs,
    sets: &[String],
    gpus: Option<u32>,
    strategy: Option<&str>,
) -> Result<(Prepared, Weights), Exit> {
    let weights = Weights::of_run(&args.run, args.step).map_err(|e| fail(&args.run, e))?;
    let file = args.run.join("experiment.ron");
    let (source, _) = load(&file, sets, Format::Text)?;
    let want = Want {
        gpus,
        strategy,
        ..Want::on(args.backend.value(), args.precision.value())
    };
    Ok((decide(file, source, None, &want)?, weights))
}

pub(crate) fn eval(args: EvalArgs) -> Result<(), Exit> {
    let sets: Vec<String> = args.data.iter().map(|d| format!("data={d}")).collect();
    let (p, weights) = open(&args.run, &sets, args.gpus, args.strategy.as_deref())?;
    let data = args.data.as_ref().map(|_| &p.source.experiment.data);
    let e = eval::evaluate(eval::Request {
        source: &p.source,
        plan: p.decided.plan,
        device: p.decided.device,
        weights: &weights,
        data,
        base_dir: Path::new("."),
    })
    .map_err(|e| fail(&args.run.run, e))?;
    match args.format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&e).unwrap_or_default()),
        Format::Text => out!("{}", e.text()),
    }
}

pub(crate) fn predict(args: PredictArgs) -> Result<(), Exit> {
    let (p, weights) = open(&args.run, &[], None, None)?;
    let (run, source, d) = (args.run.run.as_path(), &p.source, p.decided);
    let (spec, images) = predict::input_of(source, &d.plan).map_err(|e| fail(run, e))?;
    let read = inputs::read_all(&args.inputs, &spec, images.as_ref()).map_err(crate::error)?;
    let (names, values) = (read.names, read.values);
    let r = predict::predict(source, d.plan, d.device, &weights, &values, names.len())
        .map_err(|e| fail(run, e))?;
    if let Some(path) = &args.probabilities {
        std::fs::write(path, r.npy()).map_err(|e| fail(path, format!("cannot write: {e}")))?;
    }
    let classes = trained::class_names(run).map_err(|e| fail(run, e))?;
    let (k, classes) = (args.top_k as usize, classes.as_deref());
    match args.format {
        Format::Json => {
            let list = serde_json::to_string_pretty(&r.json(&names, k, classes));
            outln!("{}", list.unwrap_or_default())
        }
        Format::Text => out!("{}", r.csv(&names, k, classes)),
    }
}
