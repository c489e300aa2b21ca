//! `parallax eval` and `parallax predict`: a trained run's weights, used (the library part is
//! `parallax_runtime::trained`). The run's `experiment.ron` is compiled and placed as `train`
//! does it (`prepare::decide`).

use crate::prepare::{decide, Prepared};
use crate::{apply_set, load, Backend, Exit, Format, PrecisionArg};
use parallax_runtime::data::inputs;
use parallax_runtime::train::prepare::Want;
use parallax_runtime::trained::{self, eval, predict, UseError, Weights};
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

fn fail(at: &Path) -> impl Fn(UseError) -> Exit + '_ {
    move |e| {
        errln!("{}: error: {e}", at.display());
        Exit(1)
    }
}

/// A data error names its file itself.
fn data_error(e: parallax_runtime::data::DataError) -> Exit {
    errln!("error: {e}");
    Exit(1)
}

/// The run's weights, and its experiment placed on the devices `want` asks for, with `sets`
/// (`data=...`) applied.
pub(crate) fn open(
    args: &RunArgs,
    sets: &[String],
    gpus: Option<u32>,
    strategy: Option<&str>,
) -> Result<(Prepared, Weights), Exit> {
    let weights = Weights::of_run(&args.run, args.step).map_err(fail(&args.run))?;
    let file = args.run.join("experiment.ron");
    let (source, _) = load(&file, Format::Text)?;
    let source = apply_set(&file, source, sets, Format::Text)?;
    let want = Want {
        gpus,
        strategy,
        zero: None,
        backend: args.backend.choice(),
        precision: args.precision.runtime()?,
        gpu_memory: None,
        collective_timeout: std::time::Duration::from_secs(300),
        resume: None,
    };
    Ok((decide(file, source, None, &want)?, weights))
}

pub(crate) fn eval(args: EvalArgs) -> Result<(), Exit> {
    let sets: Vec<String> = args.data.iter().map(|d| format!("data={d}")).collect();
    let (p, weights) = open(&args.run, &sets, args.gpus, args.strategy.as_deref())?;
    let data = args.data.as_ref().map(|_| &p.source.experiment.data);
    let e = eval::evaluate(eval::Request {
        source: &p.source,
        plan: p.plan,
        device: p.device,
        weights: &weights,
        data,
        base_dir: Path::new("."),
    })
    .map_err(fail(&args.run.run))?;
    if args.format == Format::Json {
        outln!("{}", serde_json::to_string_pretty(&e).unwrap_or_default())?;
        return Ok(());
    }
    let what = match data {
        None => "the run's validation data",
        Some(_) => "--data",
    };
    let tokens = e
        .tokens
        .map(|t| format!(", {t} tokens"))
        .unwrap_or_default();
    outln!(
        "{} on {what}: {} samples{tokens} ({})",
        e.weights,
        e.samples,
        e.backend
    )?;
    outln!("loss        {:.6}", e.loss)?;
    if let Some(p) = e.perplexity {
        outln!("perplexity  {p:.4}")?;
    }
    if let Some(a) = e.accuracy {
        outln!("accuracy    {:.2}%", a * 100.0)?;
    }
    if let Some(a) = e.top5.filter(|_| e.tokens.is_none()) {
        outln!("top-5       {:.2}%", a * 100.0)?;
    }
    Ok(())
}

pub(crate) fn predict(args: PredictArgs) -> Result<(), Exit> {
    let (p, weights) = open(&args.run, &[], None, None)?;
    let (spec, images) = predict::input_of(&p.source, &p.plan).map_err(fail(&args.run.run))?;
    // Every input, named for the report: the file, and its index in a file of several.
    let mut names = Vec::new();
    let mut all: Option<parallax_runtime::data::Values> = None;
    for path in &args.inputs {
        let read = inputs::read_any(path, &spec, images.as_ref()).map_err(data_error)?;
        names.extend(read.names);
        all = Some(match all {
            None => read.values,
            Some(a) => a.concat(read.values).map_err(data_error)?,
        });
    }
    let values = all.expect("clap requires an input");
    let r = predict::predict(&p.source, p.plan, p.device, &weights, &values, names.len())
        .map_err(fail(&args.run.run))?;
    if let Some(path) = &args.probabilities {
        let mut shape = vec![r.n];
        shape.extend(&r.shape);
        std::fs::write(path, inputs::npy_f32(&r.values, &shape)).map_err(|e| {
            errln!("{}: error: cannot write: {e}", path.display());
            Exit(1)
        })?;
    }
    let classes = trained::class_names(&args.run.run).map_err(fail(&args.run.run))?;
    let label = |c: usize| match classes.as_ref().and_then(|n| n.get(c)) {
        Some(name) => name.clone(),
        None => c.to_string(),
    };
    let rows = r.values.chunks(r.per);
    if args.format == Format::Json {
        let list: Vec<serde_json::Value> = names
            .iter()
            .zip(rows)
            .map(|(name, row)| match r.classifier {
                true => serde_json::json!({
                    "input": name,
                    "top": trained::top_k(row, args.top_k as usize).iter().map(|&c| serde_json::json!({
                        "class": c, "label": label(c), "probability": row[c],
                    })).collect::<Vec<_>>(),
                }),
                false => serde_json::json!({ "input": name, "output": row }),
            })
            .collect();
        outln!(
            "{}",
            serde_json::to_string_pretty(&list).unwrap_or_default()
        )?;
        return Ok(());
    }
    let k = (args.top_k as usize).min(r.per);
    let header: Vec<String> = match r.classifier {
        true => (1..=k)
            .flat_map(|i| [format!("label_{i}"), format!("probability_{i}")])
            .collect(),
        false => (0..r.per).map(|i| format!("output_{i}")).collect(),
    };
    outln!("input,{}", header.join(","))?;
    for (name, row) in names.iter().zip(rows) {
        let cells: Vec<String> = match r.classifier {
            true => trained::top_k(row, k)
                .iter()
                .flat_map(|&c| [csv_cell(&label(c)), format!("{:.6}", row[c])])
                .collect(),
            false => row.iter().map(|v| v.to_string()).collect(),
        };
        outln!("{},{}", csv_cell(name), cells.join(","))?;
    }
    Ok(())
}

/// A CSV cell, quoted when it holds a comma, a quote or a line break.
fn csv_cell(s: &str) -> String {
    match s.contains([',', '"', '\n']) {
        true => format!("\"{}\"", s.replace('"', "\"\"")),
        false => s.to_string(),
    }
}
