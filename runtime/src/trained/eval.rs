//! `parallax eval`: a trained run's weights on its validation data or another data source,
//! every sample counted once whatever the device count: the mean loss, accuracy and top-5
//! for class labels, perplexity for language models.

use super::{model_output, UseError, Weights};
use crate::data::{self, Dataset, EvalSet, ModelIo};
use crate::run::weights::FileShapes;
use crate::train::{backend, model_io, Device, SessionData, Validator};
use parallax_compiler::dsl::ast::Data;
use parallax_compiler::{Plan, Source};
use serde::Serialize;
use std::path::Path;

/// What `eval` measured.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Evaluation {
    /// The weights evaluated.
    pub weights: String,
    /// The data evaluated: `validation` (the run's) or `data` (another source, every sample).
    pub data: String,
    pub samples: usize,
    /// Positions predicted, for a model that predicts a label per position (a language model:
    /// tokens).
    pub tokens: Option<usize>,
    /// The mean loss per sample (per token for a language model).
    pub loss: f64,
    /// `exp(loss)`, for a language model.
    pub perplexity: Option<f64>,
    pub accuracy: Option<f64>,
    pub top5: Option<f64>,
    pub backend: String,
}

/// What to evaluate and where.
pub struct Request<'a> {
    pub source: &'a Source,
    pub plan: Plan,
    pub device: Device,
    pub weights: &'a Weights,
    /// Another data source than the run's (every one of its samples is evaluated).
    pub data: Option<&'a Data>,
    /// What the data's relative paths are relative to.
    pub base_dir: &'a Path,
}

/// Evaluates the request's weights in batches of the experiment's batch size.
pub fn evaluate(r: Request) -> Result<Evaluation, UseError> {
    let exp = &r.source.experiment;
    let seed = exp.train.seed;
    let batch = exp.train.batch_size as usize;
    let (io, input, target) = model_io(&r.plan, &exp.loss)?;
    let output = model_output(&r.plan)?;
    let set = match r.data {
        // The set training validated on, as training loads it.
        None => SessionData::load(r.source, &r.plan, batch, seed, r.base_dir, 0)?.validation,
        Some(d) => every_sample(d, &io, seed, r.base_dir, batch)?,
    };
    if set.is_empty() {
        return Err(UseError::Asked(
            "the run's data has no validation part to evaluate; name data with --data".into(),
        ));
    }
    if !matches!(r.device, Device::Cuda(_) | Device::CudaRanks(_)) {
        crate::exec::host_memory::check(&r.plan, r.device.simulated().map(|s| s.grid))
            .map_err(crate::train::TrainError::from)?;
    }
    let files = FileShapes::of(&r.plan);
    let (mut exec, _) = backend(r.plan, r.device, &None, batch, seed)?;
    r.weights.load(exec.as_mut(), &files)?;
    let validator = Validator {
        set: &set,
        input: &input,
        target: &target,
        output,
        batch,
    };
    let t = validator.tally(exec.as_mut(), 0)?;
    let per_sample_labels = io.target.numel();
    let language = io.class_target() && !io.target.shape.is_empty();
    Ok(Evaluation {
        weights: r.weights.describe(),
        data: match r.data {
            None => "validation".into(),
            Some(_) => "data".into(),
        },
        samples: t.samples,
        tokens: language.then_some(t.samples * per_sample_labels),
        loss: t.loss(),
        perplexity: language.then(|| t.loss().exp()),
        accuracy: t.accuracy(),
        top5: t.top5(),
        backend: exec.backend_name().to_string(),
    })
}

/// Every sample of `d`: a token file's consecutive windows (its `validation` file's, if it
/// names one), every image of an image folder (its `validation` folder's, if it names one),
/// or both parts of a split source.
fn every_sample(
    d: &Data,
    io: &ModelIo,
    seed: u64,
    base_dir: &Path,
    batch: usize,
) -> Result<EvalSet, UseError> {
    // A streamed source evaluates its validation part: made the whole source here.
    let mut all = d.clone();
    match &mut all {
        Data::Tokens {
            train,
            validation,
            validation_windows,
            ..
        } => {
            validation.get_or_insert_with(|| train.clone());
            *validation_windows = u64::MAX;
            let opened = data::tokens::open(&all, io, seed, base_dir, batch, false)?;
            return Ok(opened.validation.into());
        }
        Data::ImageFolder {
            train,
            validation,
            validation_split,
            ..
        } => {
            validation.get_or_insert_with(|| train.clone());
            *validation_split = None;
            let opened = data::image_folder::open(&all, io, seed, base_dir, batch, false, false)?;
            return Ok(opened.validation);
        }
        _ => {}
    }
    let s = data::load(d, io, seed, base_dir)?;
    Ok(concat(s.train, s.validation)?.into())
}

fn concat(a: Dataset, b: Dataset) -> Result<Dataset, UseError> {
    Ok(Dataset {
        len: a.len + b.len,
        inputs: a.inputs.concat(b.inputs)?,
        targets: a.targets.concat(b.targets)?,
        input: a.input,
        target: a.target,
    })
}
