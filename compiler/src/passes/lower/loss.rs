//! The loss, and the contract between the model, the loss and the data.

use super::*;

use crate::plan::{LABELS, LOSS, TARGET};

impl Lowerer<'_> {
    pub(super) fn loss(&mut self) -> Result<(), Error> {
        let e = &self.src.experiment;
        let (which, lp) = match &e.loss {
            Loss::CrossEntropy { output, .. } | Loss::Mse { output } => {
                (output.clone(), path!["loss"])
            }
        };
        let out = match which {
            None => self.g.outputs[0].1,
            Some(name) => match self.g.outputs.iter().find(|(k, _)| *k == name) {
                Some((_, n)) => *n,
                None => {
                    return Err(model_err(
                        format!("the loss reads `{name}`, which is not an output of the model"),
                        self.span(&lp.join("output")),
                    )
                    .with_hint_model(suggest(
                        &name,
                        "outputs",
                        self.g.outputs.iter().map(|(k, _)| k.as_str()),
                    )))
                }
            },
        };
        let span = self.head(&lp);
        let t = self.ty(out).clone();
        let loss = match &e.loss {
            Loss::CrossEntropy {
                label_smoothing, ..
            } => {
                if t.rank() < 2 || !t.dtype.is_float() || !t.shape[t.rank() - 1].is_known() {
                    return Err(model_err(
                        format!(
                            "cross-entropy needs float logits [.., classes] with a known class count, but the model gives {}",
                            self.show(out)
                        ),
                        span,
                    ));
                }
                let labels_ty = TensorType::new(DType::I32, t.shape[..t.rank() - 1].to_vec());
                let labels = self.add(
                    Op::Input {
                        name: LABELS.into(),
                        ty: labels_ty,
                    },
                    &[],
                    LOSS,
                    span,
                )?;
                self.add(
                    Op::CrossEntropy {
                        smoothing: *label_smoothing,
                    },
                    &[out, labels],
                    LOSS,
                    span,
                )?
            }
            Loss::Mse { .. } => {
                if !t.dtype.is_float() {
                    return Err(model_err(
                        format!(
                            "MSE needs a float output, but the model gives {}",
                            self.show(out)
                        ),
                        span,
                    ));
                }
                let target = self.add(
                    Op::Input {
                        name: TARGET.into(),
                        ty: t.clone(),
                    },
                    &[],
                    LOSS,
                    span,
                )?;
                let diff = self.add(Op::Sub, &[out, target], LOSS, span)?;
                let sq = self.add(Op::Mul, &[diff, diff], LOSS, span)?;
                let axes = (0..t.rank()).collect();
                self.add(Op::ReduceMean { axes }, &[sq], LOSS, span)?
            }
        };
        if self.g.outputs.iter().any(|(k, _)| k == LOSS) {
            return Err(model_err("a model output may not be named `loss`", span));
        }
        self.g.outputs.push((LOSS.into(), loss));
        Ok(())
    }

    /// The built-in data sets fix the model's input and class count: check them now.
    pub(super) fn data_contract(&self) -> Result<(), Error> {
        let e = &self.src.experiment;
        let (features, classes, what) = match &e.data {
            Data::Digits { .. } => (64u64, 10u64, "the digits data set (8x8 images)".to_string()),
            Data::Blobs {
                features, classes, ..
            } => (
                *features,
                *classes,
                format!("`Blobs` with {features} features"),
            ),
            Data::Sequence { length, vocab, .. } => {
                (*length, *vocab, format!("`Sequence` of length {length}"))
            }
            _ => return Ok(()),
        };
        let sample_inputs: Vec<NodeIndex> = self
            .g
            .inputs
            .iter()
            .copied()
            .filter(|&n| self.g.g[n].layer.is_empty())
            .collect();
        let dp = path!["data"];
        if sample_inputs.len() != 1 {
            return Err(model_err(
                format!(
                    "{what} feeds one input, but the model has {}",
                    sample_inputs.len()
                ),
                self.head(&dp),
            ));
        }
        let x = sample_inputs[0];
        let per_sample = product(&self.ty(x).shape[1..]).map(|d| d.eval(&self.g.sym_value(1)));
        // A sequence task also feeds a causal model its tokens followed by the answer.
        let prompted = matches!(e.data, Data::Sequence { .. }) && per_sample == Some(2 * features);
        if per_sample != Some(features) && !prompted {
            let also = if matches!(e.data, Data::Sequence { .. }) {
                format!(
                    " (or {} for a causal model reading tokens then answer)",
                    2 * features
                )
            } else {
                String::new()
            };
            return Err(model_err(
                format!(
                    "{what} gives {features} values per sample{also}, but the model's input is {}",
                    self.show(x)
                ),
                self.head(&dp),
            ));
        }
        if matches!(e.data, Data::Sequence { .. }) && self.ty(x).dtype.is_float() {
            return Err(model_err(
                format!(
                    "{what} gives token ids, but the model's input is {}",
                    self.show(x)
                ),
                self.head(&dp),
            )
            .with_hint_model("declare the input with `dtype: I32`"));
        }
        if let Loss::CrossEntropy { .. } = e.loss {
            let out = self.g.outputs[0].1;
            let t = self.ty(out);
            let c = t.shape.last().and_then(|d| d.as_known()).unwrap_or(0);
            if c < classes {
                return Err(model_err(
                    format!("{what} has {classes} classes, but the model's output has {c}"),
                    self.head(&dp),
                )
                .with_hint_model(format!("make the last layer `Linear(out: {classes})`")));
            }
        }
        Ok(())
    }
}
