//! Validation after an epoch: the mean loss over the validation set, and accuracy for class
//! labels.

use super::session::feed;
use crate::backend::Backend;
use crate::data::{Dataset, Values};
use crate::exec::tensor::Tensor;
use crate::exec::{ExecError, Mode};

/// Correct predictions and positions: the argmax of the logits' last axis against labels.
fn correct(logits: &Tensor, labels: &[i32]) -> (usize, usize) {
    let c = *logits.shape.last().unwrap_or(&1);
    let v = logits.f32();
    let ignore = crate::exec::IGNORE;
    let counted = labels.iter().filter(|&&l| l != ignore).count();
    let hits = labels
        .iter()
        .enumerate()
        .filter(|&(_, &l)| l != ignore)
        .filter(|&(i, &l)| {
            let row = &v[i * c..(i + 1) * c];
            let best = row
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (j, &x)| if x > b.1 { (j, x) } else { b },
                )
                .0;
            best as i32 == l
        })
        .count();
    (hits, counted)
}

pub(super) struct Validator<'a> {
    pub(super) set: &'a Dataset,
    pub(super) input: &'a str,
    pub(super) target: &'a str,
    pub(super) output: String,
    pub(super) batch: usize,
}

impl Validator<'_> {
    /// Mean loss over the set (weighted by batch size) and accuracy for class labels.
    pub(super) fn run(
        &self,
        e: &mut dyn Backend,
        step: u64,
    ) -> Result<(f64, Option<f64>), ExecError> {
        let n = self.set.len;
        let (per_in, per_t) = (self.set.input.numel(), self.set.target.numel());
        let (mut loss, mut hits, mut total) = (0f64, 0usize, 0usize);
        let mut from = 0;
        while from < n {
            let to = (from + self.batch).min(n);
            let b = to - from;
            feed(e, self.input, b, &self.set.inputs.samples(per_in, from, to))?;
            let targets = self.set.targets.samples(per_t, from, to);
            feed(e, self.target, b, &targets)?;
            e.run(b, Mode::Eval, step, from as u64)?;
            loss += e.loss(b)? as f64 * b as f64;
            if let (Values::I32(labels), Some(out)) = (&targets, e.output_values(&self.output, b)?)
            {
                let (h, t) = correct(&out, labels);
                hits += h;
                total += t;
            }
            from = to;
        }
        let acc = (total > 0).then(|| hits as f64 / total as f64);
        Ok((loss / n.max(1) as f64, acc))
    }
}
