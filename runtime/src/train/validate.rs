//! Validation after an epoch: the mean loss over the validation set, and accuracy for class
//! labels.

use super::session::feed;
use super::TrainError;
use crate::backend::Backend;
use crate::data::{EvalSet, Values};
use crate::exec::tensor::Tensor;
use crate::exec::Mode;

/// What an evaluation counts: the loss summed over samples (each batch's mean times its
/// size), and for class labels the labelled positions, those whose label is the argmax of the
/// logits, and those whose label is among the 5 largest.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tally {
    pub loss_sum: f64,
    pub samples: usize,
    pub positions: usize,
    pub hits: usize,
    pub top5: usize,
}

impl Tally {
    /// The mean loss per sample.
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.samples.max(1) as f64
    }
    /// Accuracy over the labelled positions (none: no class labels).
    pub fn accuracy(&self) -> Option<f64> {
        (self.positions > 0).then(|| self.hits as f64 / self.positions as f64)
    }
    /// Top-5 accuracy over the labelled positions.
    pub fn top5(&self) -> Option<f64> {
        (self.positions > 0).then(|| self.top5 as f64 / self.positions as f64)
    }

    /// Counts the argmax and top-5 hits of `logits` (the class axis last) against `labels`.
    fn count(&mut self, logits: &Tensor, labels: &[i32]) {
        let c = *logits.shape.last().unwrap_or(&1);
        let v = logits.f32();
        for (i, &l) in labels.iter().enumerate() {
            if l == crate::exec::IGNORE {
                continue;
            }
            let row = &v[i * c..(i + 1) * c];
            self.positions += 1;
            // A label beyond the classes, or a NaN logit, is a miss.
            let Some(&x) = row.get(l as usize).filter(|x| !x.is_nan()) else {
                continue;
            };
            // The label's rank: values above it, and equal values before it (argmax keeps
            // the first of equals).
            let above = row
                .iter()
                .enumerate()
                .filter(|&(j, &y)| y > x || (y == x && j < l as usize))
                .count();
            self.hits += (above == 0) as usize;
            self.top5 += (above < 5) as usize;
        }
    }
}

/// A data set evaluated on a backend, batch by batch: feeds `input` and `target`, reads `output`.
pub struct Validator<'a> {
    pub set: &'a EvalSet,
    pub input: &'a str,
    pub target: &'a str,
    pub output: String,
    pub batch: usize,
}

impl Validator<'_> {
    /// Mean loss over the set (weighted by batch size) and accuracy for class labels.
    pub(super) fn run(
        &self,
        e: &mut dyn Backend,
        step: u64,
    ) -> Result<(f64, Option<f64>), TrainError> {
        let t = self.tally(e, step)?;
        Ok((t.loss(), t.accuracy()))
    }

    /// Every sample of the set, once, in batches of `batch`: what [`Tally`] counts. A
    /// process of a job reads (decodes) only its devices' samples of each batch.
    pub fn tally(&self, e: &mut dyn Backend, step: u64) -> Result<Tally, TrainError> {
        let n = self.set.len();
        let wanted = e.samples_here();
        let mut t = Tally::default();
        let mut from = 0;
        while from < n {
            let to = (from + self.batch).min(n);
            let b = to - from;
            let (inputs, targets) = self.set.batch(from, to, wanted.as_ref())?;
            feed(e, self.input, b, &inputs)?;
            feed(e, self.target, b, &targets)?;
            e.run(b, Mode::Eval, step, from as u64)?;
            t.loss_sum += e.loss(b)? as f64 * b as f64;
            t.samples += b;
            if let (Values::I32(labels), Some(out)) = (&targets, e.output_values(&self.output, b)?)
            {
                t.count(&out, labels);
            }
            from = to;
        }
        Ok(t)
    }
}
