//! A data set evaluated batch by batch (validation, `eval`): samples held in memory, or an
//! image folder's files decoded as each batch is fed, so a large validation folder is never
//! held decoded whole (nor decoded at all by a command that does not validate).

use super::image_folder::eval_image;
use super::loader::{read_mask, Wanted};
use super::transform::ImageSpec;
use super::{DataError, Dataset, Values};
use rayon::prelude::*;
use std::path::PathBuf;

/// Files of an image folder with the evaluation transform, and their classes.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalImages {
    pub samples: Vec<(PathBuf, usize)>,
    pub spec: ImageSpec,
}

/// A data set evaluated batch by batch.
#[derive(Debug, Clone, PartialEq)]
pub enum EvalSet {
    Memory(Dataset),
    Images(EvalImages),
}

impl From<Dataset> for EvalSet {
    fn from(d: Dataset) -> EvalSet {
        EvalSet::Memory(d)
    }
}

impl EvalSet {
    /// Samples in the set.
    pub fn len(&self) -> usize {
        match self {
            EvalSet::Memory(d) => d.len,
            EvalSet::Images(i) => i.samples.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Inputs and targets of samples `from..to`, reading only the `wanted` ones of them where
    /// reading costs (an image's pixels; the others are zero, as the loader leaves them).
    pub fn batch(
        &self,
        from: usize,
        to: usize,
        wanted: Option<&Wanted>,
    ) -> Result<(Values, Values), DataError> {
        match self {
            EvalSet::Memory(d) => Ok((
                d.inputs.samples(d.input.numel(), from, to),
                d.targets.samples(d.target.numel(), from, to),
            )),
            EvalSet::Images(i) => {
                let picked = &i.samples[from..to];
                let mask = read_mask(wanted, picked.len());
                let size = i.spec.channels * i.spec.height * i.spec.width;
                let images: Vec<Vec<f32>> = (picked.par_iter().zip(&mask))
                    .map(|((path, _), &read)| match read {
                        true => eval_image(path, &i.spec),
                        false => Ok(vec![0.0; size]),
                    })
                    .collect::<Result<_, _>>()?;
                let labels = picked.iter().map(|s| s.1 as i32).collect();
                Ok((Values::F32(images.concat()), Values::I32(labels)))
            }
        }
    }
}
