//! `parallax predict`: a trained model's outputs for new inputs, in batches of the
//! experiment's batch size: class probabilities (the softmax of the logits) for a classifier,
//! the outputs themselves for a regression.

use super::{model_output, softmax_rows, UseError, Weights};
use crate::data::ImageSpec;
use crate::data::Values;
use crate::exec::Mode;
use crate::run::weights::FileShapes;
use crate::train::{backend, feed, model_io, Device};
use parallax_compiler::dsl::ast::{Data, Loss};
use parallax_compiler::{Plan, Source};

/// What `predict` computed for `n` inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Predictions {
    pub n: usize,
    /// Values per input: the classes, or the output's elements.
    pub per: usize,
    /// The output's shape for one input.
    pub shape: Vec<usize>,
    /// `n * per` values: probabilities for a classifier, outputs for a regression.
    pub values: Vec<f32>,
    /// Whether `values` are class probabilities.
    pub classifier: bool,
}

impl Predictions {
    /// The values as a `.npy` file: `[n, ..shape]` in f32.
    pub fn npy(&self) -> Vec<u8> {
        let shape: Vec<usize> = std::iter::once(self.n).chain(self.shape.clone()).collect();
        crate::data::inputs::npy_f32(&self.values, &shape)
    }
}

/// The shape one input must have, and for a model trained on an image folder the transform
/// that turns an image file into it.
pub fn input_of(
    source: &Source,
    plan: &Plan,
) -> Result<(crate::data::TensorSpec, Option<ImageSpec>), UseError> {
    let io = model_io(plan, &source.experiment.loss)?.0;
    let data = &source.experiment.data;
    let images = match data {
        Data::ImageFolder { .. } => Some(ImageSpec::of(data, &io, "the run's image folder")?),
        _ => None,
    };
    Ok((io.input, images))
}

/// Runs the model of `plan` with `weights` on `n` inputs (`inputs`, C order).
pub fn predict(
    source: &Source,
    plan: Plan,
    device: Device,
    weights: &Weights,
    inputs: &Values,
    n: usize,
) -> Result<Predictions, UseError> {
    let exp = &source.experiment;
    let (io, input, target) = model_io(&plan, &exp.loss)?;
    let classifier = matches!(exp.loss, Loss::CrossEntropy { .. });
    if classifier && !io.target.shape.is_empty() {
        return Err(UseError::Model(format!(
            "predict gives one class per input, but this model predicts a class at each of {} positions (a language model): `parallax sample` generates text with it",
            io.target.shape.iter().product::<usize>()
        )));
    }
    let per_in = io.input.numel();
    if inputs.len() != n * per_in || inputs.dtype() != io.input.dtype {
        return Err(UseError::Asked(format!(
            "the model reads {} per input; {n} inputs of that are {} values, but {} {} values were given",
            io.input.show(),
            n * per_in,
            inputs.len(),
            inputs.dtype().name()
        )));
    }
    let batch = (exp.train.batch_size as usize).max(1);
    let output = model_output(&plan)?;
    let files = FileShapes::of(&plan);
    let (mut exec, _) = backend(plan, device, &None, batch, exp.train.seed)?;
    weights.load(exec.as_mut(), &files)?;
    let per_t = io.target.numel();
    let mut values = Vec::new();
    let mut shape = Vec::new();
    let mut from = 0;
    while from < n {
        let to = (from + batch).min(n);
        let b = to - from;
        feed(exec.as_mut(), &input, b, &inputs.samples(per_in, from, to))?;
        let zeros = match classifier {
            true => Values::I32(vec![0; b * per_t]),
            false => Values::F32(vec![0.0; b * per_t]),
        };
        feed(exec.as_mut(), &target, b, &zeros)?;
        exec.run(b, Mode::Eval, 0, from as u64)?;
        let out = exec.output_values(&output, b)?.ok_or_else(|| {
            UseError::Model(format!("the model's output `{output}` was not kept"))
        })?;
        shape = out.shape[1..].to_vec();
        values.extend_from_slice(out.f32());
        from = to;
    }
    let per = shape.iter().product::<usize>().max(1);
    if classifier {
        values = softmax_rows(&values, per);
    }
    Ok(Predictions {
        n,
        per,
        shape,
        values,
        classifier,
    })
}
