//! The data pipeline: reads the data set an experiment names, fits it to the compiled model's
//! input and target, splits it into train and validation sets, and serves seeded batches.
//!
//! Every random choice is keyed by `(seed, purpose, index)` through [`crate::rng`]:
//!
//! - the train/validation split is `permutation(stream(seed, Split, 0), len)`: its first
//!   `round(len * validation)` entries form the validation set, the rest the train set (each
//!   kept in file order);
//! - epoch `e` visits the train set in the order `permutation(stream(seed, Shuffle, e), len)`
//!   (see [`Loader`] for the batching rules);
//! - generated data (`Blobs`, `Sequence`, `Synthetic`) use `Purpose::Synthetic` streams (the
//!   rules are stated in `synthetic.rs`).
//!
//! The same file and seed therefore give the same samples, in the same batches, on any machine
//! and with any timing.
//!
//! Inputs are `f32` for float model inputs (`F32`, `BF16`, `F16`) and `i32` for integer ones
//! (`I32`, `I64`, e.g. token ids). Targets are `i32` class labels when the target's dtype is an
//! integer (cross-entropy) and `f32` otherwise (MSE); class labels fed to an `f32` target of
//! the same element count are converted to numbers, and a single label per sample fed to a
//! wider `f32` target becomes a one-hot vector.

mod array;
pub mod codec;
mod csv;
pub mod digits;
pub mod eval_set;
mod fit;
mod idx;
pub mod image_folder;
pub mod inputs;
pub mod loader;
mod npy;
pub mod shards;
mod synthetic;
pub mod tokenize;
pub mod tokens;
pub mod transform;

#[cfg(test)]
pub(crate) mod testutil;

use crate::rng::{self, Purpose};
use parallax_compiler::dsl::ast::Data;
use std::path::{Path, PathBuf};

pub use eval_set::EvalSet;
pub(crate) use fit::fit;
pub use image_folder::{class_names, eval_image};
pub use loader::{epoch_order, Batch, Loader};
pub use parallax_compiler::ir::DType;
pub use transform::ImageSpec;

/// A flat buffer of elements: samples one after another, each in C order.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

impl Values {
    /// Samples `from..to` of a batch whose samples hold `per` values each.
    pub fn samples(&self, per: usize, from: usize, to: usize) -> Values {
        match self {
            Values::F32(x) => Values::F32(x[from * per..to * per].to_vec()),
            Values::I32(x) => Values::I32(x[from * per..to * per].to_vec()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::I32(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            Values::F32(_) => DType::F32,
            Values::I32(_) => DType::I32,
        }
    }
    /// The samples of `self`, then those of `other` (of the same element type).
    pub fn concat(self, other: Values) -> Result<Values, DataError> {
        match (self, other) {
            (Values::F32(mut a), Values::F32(b)) => {
                a.extend(b);
                Ok(Values::F32(a))
            }
            (Values::I32(mut a), Values::I32(b)) => {
                a.extend(b);
                Ok(Values::I32(a))
            }
            (a, b) => Err(DataError::Config(format!(
                "cannot join {} values to {} values",
                b.dtype().name(),
                a.dtype().name()
            ))),
        }
    }
    /// An empty buffer of the same element type, with room for `n` elements.
    pub fn empty_like(&self, n: usize) -> Values {
        match self {
            Values::F32(_) => Values::F32(Vec::with_capacity(n)),
            Values::I32(_) => Values::I32(Vec::with_capacity(n)),
        }
    }
    /// Keeps the samples `kept` (ascending, each `per` elements long) and drops the rest, in
    /// place: each moves down to its new position, never past one not yet moved.
    fn keep(&mut self, kept: &[usize], per: usize) {
        fn compact<T: Copy>(v: &mut Vec<T>, kept: &[usize], per: usize) {
            for (to, &from) in kept.iter().enumerate() {
                debug_assert!(to <= from, "kept samples ascend");
                v.copy_within(from * per..(from + 1) * per, to * per);
            }
            v.truncate(kept.len() * per);
            v.shrink_to_fit();
        }
        match self {
            Values::F32(v) => compact(v, kept, per),
            Values::I32(v) => compact(v, kept, per),
        }
    }
    /// The samples `indices` (each `per` elements long), in that order.
    pub fn gather(&self, indices: &[usize], per: usize) -> Values {
        fn pick<T: Copy>(v: &[T], indices: &[usize], per: usize) -> Vec<T> {
            let mut out = Vec::with_capacity(indices.len() * per);
            for &i in indices {
                out.extend_from_slice(&v[i * per..(i + 1) * per]);
            }
            out
        }
        match self {
            Values::F32(v) => Values::F32(pick(v, indices, per)),
            Values::I32(v) => Values::I32(pick(v, indices, per)),
        }
    }
}

/// The type of one sample (no batch dimension).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn new(dtype: DType, shape: Vec<usize>) -> Self {
        TensorSpec { dtype, shape }
    }
    /// Elements in one sample (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// `f32[1, 8, 8]`
    pub fn show(&self) -> String {
        let dims: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        format!("{}[{}]", self.dtype.name(), dims.join(", "))
    }
}

/// What the compiled model reads: its input, and the loss's target (integer class labels for
/// cross-entropy, shape = output shape without the class axis, e.g. `[]` or `[seq]`; `f32` of
/// the output's shape for MSE). `classes`: number of classes for cross-entropy. `input_range`:
/// for integer inputs (token ids) the exclusive upper bound (the embedding's vocab), if known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIo {
    pub input: TensorSpec,
    pub target: TensorSpec,
    pub classes: Option<usize>,
    pub input_range: Option<usize>,
}

impl ModelIo {
    /// Whether the target holds integer class labels (cross-entropy) rather than numbers.
    pub fn class_target(&self) -> bool {
        !self.target.dtype.is_float()
    }
    /// Whether the model reads integers (token ids).
    pub fn integer_input(&self) -> bool {
        !self.input.dtype.is_float()
    }
}

/// Samples fitted to a model: `len` inputs of `input`'s shape and `len` targets of `target`'s.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    pub inputs: Values,
    pub targets: Values,
    pub input: TensorSpec,
    pub target: TensorSpec,
    pub len: usize,
}

impl Dataset {
    /// The samples `indices`, in that order.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        Dataset {
            inputs: self.inputs.gather(indices, self.input.numel()),
            targets: self.targets.gather(indices, self.target.numel()),
            input: self.input.clone(),
            target: self.target.clone(),
            len: indices.len(),
        }
    }

    /// Only the samples `kept` (ascending), in that order, moved in place: splitting a data
    /// set holds it once, not twice.
    fn keep(mut self, kept: &[usize]) -> Dataset {
        self.inputs.keep(kept, self.input.numel());
        self.targets.keep(kept, self.target.numel());
        self.len = kept.len();
        self
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Splits {
    pub train: Dataset,
    pub validation: Dataset,
}

/// What went wrong reading or fitting data; messages name the file (or data set) and say what
/// was found and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file's contents are not what its format requires.
    #[error("{file}: {message}")]
    Format { file: String, message: String },
    /// The data and the model disagree (shape, dtype, classes).
    #[error("{data}: {message}")]
    Mismatch { data: String, message: String },
    #[error("{data}: label {label} of sample {sample} is out of range: the model has {classes} classes, so labels must be in 0..{classes}")]
    Label {
        data: String,
        sample: usize,
        label: i64,
        classes: usize,
    },
    /// A setting that cannot be used (a fraction out of range, a zero count, ...).
    #[error("{0}")]
    Config(String),
    /// A NaN or an infinity among the samples (before the split: `sample` counts from the
    /// file's first, validation samples included).
    #[error("{file}: {part} {index} of sample {sample} is {value}; {count} value(s) in {samples} sample(s) are NaN or infinite: training needs finite data, so fix or drop those samples")]
    NonFinite {
        file: String,
        /// `feature` (an input's, counted in the flattened sample) or `target value`.
        part: &'static str,
        sample: usize,
        index: usize,
        value: f32,
        count: usize,
        samples: usize,
    },
}

impl DataError {
    pub(crate) fn format(file: impl std::fmt::Display, message: impl Into<String>) -> Self {
        DataError::Format {
            file: file.to_string(),
            message: message.into(),
        }
    }
    pub(crate) fn mismatch(data: impl std::fmt::Display, message: impl Into<String>) -> Self {
        DataError::Mismatch {
            data: data.to_string(),
            message: message.into(),
        }
    }
}

/// Labels as read, before they are fitted to the model's target.
#[derive(Debug, Clone)]
pub(crate) enum Labels {
    Classes(Vec<i32>),
    Floats(Vec<f32>),
}

/// Samples as read: `n` inputs of `input_shape` (per sample) and their labels.
pub(crate) struct Raw {
    /// The data set or file(s), for messages.
    pub source: String,
    pub n: usize,
    pub inputs: Values,
    pub input_shape: Vec<usize>,
    pub labels: Labels,
}

/// Reads the data set `data` names (files relative to `base_dir`), fits it to the model's
/// input and target, and splits it by the seed.
pub fn load(data: &Data, io: &ModelIo, seed: u64, base_dir: &Path) -> Result<Splits, DataError> {
    let (raw, validation) = match data {
        Data::Digits { validation } => (digits::load()?, *validation),
        Data::Idx {
            images,
            labels,
            validation,
        } => (
            idx::load(&base_dir.join(images), &base_dir.join(labels), io)?,
            *validation,
        ),
        Data::Csv {
            path,
            label_column,
            header,
            validation,
        } => (
            csv::load(&base_dir.join(path), *label_column, *header, io)?,
            *validation,
        ),
        Data::Npy {
            inputs,
            labels,
            validation,
        } => (
            npy::load(&base_dir.join(inputs), &base_dir.join(labels), io)?,
            *validation,
        ),
        Data::Blobs {
            samples,
            classes,
            features,
            std,
            validation,
        } => (
            synthetic::blobs(*samples, *classes, *features, *std, seed)?,
            *validation,
        ),
        Data::Sequence {
            task,
            length,
            vocab,
            samples,
            validation,
        } => (
            synthetic::sequence(*task, *length, *vocab, *samples, seed, io)?,
            *validation,
        ),
        Data::Synthetic {
            samples,
            validation,
        } => (synthetic::synthetic(*samples, seed, io)?, *validation),
        Data::Tokens { .. } => {
            return Err(DataError::Config(
                "token files are read as windows (`data::tokens::Tokens::open`), not loaded whole"
                    .into(),
            ))
        }
        Data::ImageFolder { .. } => return Err(DataError::Config(
            "image folders are decoded per batch (`data::image_folder::open`), not loaded whole"
                .into(),
        )),
    };
    let (inputs_file, labels_file) =
        files(data, base_dir).unwrap_or_else(|| (raw.source.clone(), raw.source.clone()));
    if let Values::F32(v) = &raw.inputs {
        check_finite(v, raw.n, &inputs_file, "feature")?;
    }
    if let Labels::Floats(v) = &raw.labels {
        check_finite(v, raw.n, &labels_file, "target value")?;
    }
    let dataset = fit(raw, io)?;
    split(dataset, validation, seed)
}

/// The files holding a data set's inputs and its labels, as the loaders name them.
fn files(data: &Data, base_dir: &Path) -> Option<(String, String)> {
    let name = |p: &str| base_dir.join(p).display().to_string();
    match data.files()[..] {
        [(_, one)] => Some((name(one), name(one))),
        [(_, inputs), (_, labels), ..] => Some((name(inputs), name(labels))),
        [] => None,
    }
}

/// Refuses a NaN or an infinity among `n` samples as read (every loader's, before the
/// split): one would reach the weights through the model, hidden from the loss by a ReLU
/// or a max-pooling, or make every validation loss NaN.
fn check_finite(v: &[f32], n: usize, file: &str, part: &'static str) -> Result<(), DataError> {
    let Some(c) = crate::exec::finite::Count::of(v) else {
        return Ok(());
    };
    let per = (v.len() / n.max(1)).max(1);
    let samples = v
        .chunks(per)
        .filter(|s| !crate::exec::finite::all_finite(s))
        .count();
    Err(DataError::NonFinite {
        file: file.to_string(),
        part,
        sample: c.first / per,
        index: c.first % per,
        value: c.value,
        count: c.nan + c.infinite,
        samples,
    })
}

/// Splits by `permutation(stream(seed, Split, 0), len)`: the first `round(len * validation)`
/// samples of it are the validation set, the rest the train set; each keeps file order.
/// `validation` must be in [0, 1) and leave at least one training sample.
pub fn split(dataset: Dataset, validation: f64, seed: u64) -> Result<Splits, DataError> {
    if !(0.0..1.0).contains(&validation) {
        return Err(DataError::Config(format!(
            "the validation fraction must be in [0, 1), got {validation}"
        )));
    }
    let n = dataset.len;
    let n_val = (n as f64 * validation).round() as usize;
    if n_val >= n {
        return Err(DataError::Config(format!(
            "the data set has {n} samples: a validation fraction of {validation} leaves none to train on"
        )));
    }
    let perm = rng::permutation(rng::stream(seed, Purpose::Split, 0), n);
    let mut val: Vec<usize> = perm[..n_val].to_vec();
    let mut train: Vec<usize> = perm[n_val..].to_vec();
    val.sort_unstable();
    train.sort_unstable();
    let validation = dataset.subset(&val);
    Ok(Splits {
        train: dataset.keep(&train),
        validation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` samples whose values name them: value `j` of sample `i` is `i * per + j`.
    fn numbered(n: usize, per: usize) -> Dataset {
        let values = |per: usize| (0..n * per).map(|v| v as f32).collect();
        Dataset {
            inputs: Values::F32(values(per)),
            targets: Values::I32((0..n as i32).collect()),
            input: TensorSpec::new(DType::F32, vec![per]),
            target: TensorSpec::new(DType::I32, vec![]),
            len: n,
        }
    }

    #[test]
    fn the_split_keeps_every_sample_once_each_set_in_file_order() {
        let (n, per) = (101, 3);
        for validation in [0.0, 0.1, 0.5, 0.9] {
            let s = split(numbered(n, per), validation, 7).unwrap();
            let ids = |set: &Dataset| -> Vec<usize> {
                let (Values::F32(x), Values::I32(t)) = (&set.inputs, &set.targets) else {
                    panic!("the types stay")
                };
                assert_eq!(x.len(), set.len * per);
                // Each sample's values are its own, whole.
                for (k, &id) in t.iter().enumerate() {
                    let want: Vec<f32> = (0..per).map(|j| (id as usize * per + j) as f32).collect();
                    assert_eq!(x[k * per..(k + 1) * per], want[..]);
                }
                t.iter().map(|&i| i as usize).collect()
            };
            let (train, val) = (ids(&s.train), ids(&s.validation));
            assert_eq!(val.len(), (n as f64 * validation).round() as usize);
            assert!(train.windows(2).all(|w| w[0] < w[1]) && val.windows(2).all(|w| w[0] < w[1]));
            let mut all = [train, val].concat();
            all.sort_unstable();
            assert_eq!(all, (0..n).collect::<Vec<_>>());
        }
    }
}
