//! The experiment's settings besides the model and its loss, as serde reads them: the data,
//! the optimizer and its schedule, training and devices (re-exported by `ast`).

use super::ast::{minus_one, yes};
use serde::{Deserialize, Serialize};

fn validation_default() -> f64 {
    0.2
}
fn no_validation() -> f64 {
    0.0
}
fn std_one() -> f64 {
    1.0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum SeqTask {
    Copy,
    Reverse,
    Sort,
}

/// The width of a raw token file's ids (an llm.c file's header says its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
pub enum TokenDtype {
    /// nanoGPT's `train.bin`: little-endian `uint16`.
    #[default]
    U16,
    U32,
}

fn validation_windows() -> u64 {
    1024
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub enum Data {
    /// The embedded 8x8 handwritten digits (1,797 images, 64 pixels, 10 classes).
    Digits {
        #[serde(default = "validation_default")]
        validation: f64,
    },
    /// IDX files, the MNIST format.
    Idx {
        images: String,
        labels: String,
        #[serde(default = "validation_default")]
        validation: f64,
    },
    Csv {
        path: String,
        /// The label's column, negative from the end.
        #[serde(default = "minus_one")]
        label_column: i64,
        #[serde(default)]
        header: bool,
        #[serde(default = "validation_default")]
        validation: f64,
    },
    Npy {
        inputs: String,
        labels: String,
        #[serde(default = "validation_default")]
        validation: f64,
    },
    /// Seeded Gaussian blobs, one per class.
    Blobs {
        samples: u64,
        classes: u64,
        features: u64,
        #[serde(default = "std_one")]
        std: f64,
        #[serde(default = "validation_default")]
        validation: f64,
    },
    /// Seeded token sequences and their transformation.
    Sequence {
        task: SeqTask,
        length: u64,
        vocab: u64,
        samples: u64,
        #[serde(default = "validation_default")]
        validation: f64,
    },
    /// Seeded random inputs and targets of the model's shapes (benchmarks).
    Synthetic {
        samples: u64,
        #[serde(default = "no_validation")]
        validation: f64,
    },
    /// Token files (nanoGPT's raw `uint16`, or llm.c's with a 1,024-byte header), memory-mapped:
    /// windows of the model's sequence length plus one (inputs, and targets shifted by one).
    Tokens {
        train: String,
        /// A second token file; its first `validation_windows` non-overlapping windows.
        #[serde(default)]
        validation: Option<String>,
        #[serde(default)]
        dtype: TokenDtype,
        #[serde(default = "validation_windows")]
        validation_windows: u64,
        /// The tokenizer file `parallax tokenize` recorded (`parallax sample` decodes with
        /// it); by default `PREFIX_tokenizer.json` beside a train file `PREFIX_train.bin` or
        /// `PREFIX.bin`, if it exists.
        #[serde(default)]
        tokenizer: Option<String>,
    },
    /// A folder of images, one subfolder per class (torchvision's `ImageFolder`), decoded per
    /// batch; the image size and channels are the model input's `[C, H, W]`.
    ImageFolder {
        train: String,
        /// A second folder of the same classes, read whole with the evaluation transform.
        #[serde(default)]
        validation: Option<String>,
        /// Without a `validation` folder: the fraction of `train` held out for validation
        /// (default 0.1). Not allowed with one.
        #[serde(default)]
        validation_split: Option<f64>,
        /// Training transform: RandomResizedCrop and a horizontal flip; off, training images
        /// get the evaluation transform.
        #[serde(default = "yes")]
        augment: bool,
        /// The evaluation transform's short side before the centre crop (default
        /// `round(H * 256 / 224)`, torchvision's evaluation preset).
        #[serde(default)]
        resize: Option<u64>,
        /// Per-channel mean and standard deviation of `[0, 1]` pixels (default ImageNet's for
        /// 3 channels; for 1 channel their averages, 0.449 and 0.226).
        #[serde(default)]
        normalize: Option<Normalize>,
        /// Leave out (and count) files that are not images of a decodable format, instead
        /// of stopping.
        #[serde(default)]
        skip_corrupt: bool,
    },
}

/// `Normalize`: `(pixel - mean[c]) / std[c]` for channel `c`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Normalize {
    pub mean: Vec<f64>,
    pub std: Vec<f64>,
}

/// The fields of a data source that are file paths, by name: the one list, expanded over
/// `&Data` (`Data::files`) and `&mut Data` (`Data::files_mut`), the bindings following.
macro_rules! path_fields {
    ($data:expr) => {
        match $data {
            Data::Idx { images, labels, .. } => vec![("images", images), ("labels", labels)],
            Data::Csv { path, .. } => vec![("path", path)],
            Data::Npy { inputs, labels, .. } => vec![("inputs", inputs), ("labels", labels)],
            Data::Tokens {
                train,
                validation,
                tokenizer,
                ..
            } => {
                let mut v = vec![("train", train)];
                v.extend(validation.into_iter().map(|p| ("validation", p)));
                v.extend(tokenizer.into_iter().map(|p| ("tokenizer", p)));
                v
            }
            Data::ImageFolder {
                train, validation, ..
            } => {
                let mut v = vec![("train", train)];
                v.extend(validation.into_iter().map(|p| ("validation", p)));
                v
            }
            Data::Digits { .. }
            | Data::Blobs { .. }
            | Data::Sequence { .. }
            | Data::Synthetic { .. } => Vec::new(),
        }
    };
}

impl Data {
    /// The fields that are file paths, by name (relative to the experiment file until the
    /// run records them absolute): the one list that checks, messages and runs use.
    pub fn files(&self) -> Vec<(&'static str, &String)> {
        path_fields!(self)
    }

    /// [`Data::files`], to change (make absolute).
    pub fn files_mut(&mut self) -> Vec<&mut String> {
        let named: Vec<(&'static str, &mut String)> = path_fields!(self);
        named.into_iter().map(|(_, p)| p).collect()
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub enum Schedule {
    Constant,
    /// Multiply by `gamma` every `every` steps.
    Step {
        every: u64,
        gamma: f64,
    },
    /// Linear warm-up, then cosine decay toward `min_lr`, which step `total` (the one after
    /// the last) would have: PyTorch's `CosineAnnealingLR(T_max = total - warmup)`.
    Cosine {
        #[serde(default)]
        warmup: u64,
        #[serde(default)]
        min_lr: f64,
    },
    /// Linear warm-up, then linear decay toward `end_lr`, which step `total` (the one after
    /// the last) would have: PyTorch's `LinearLR(total_iters = total - warmup)`.
    Linear {
        #[serde(default)]
        warmup: u64,
        #[serde(default)]
        end_lr: f64,
    },
    /// Linear warm-up over `steps`, then constant.
    Warmup {
        steps: u64,
    },
}

fn constant() -> Schedule {
    Schedule::Constant
}
fn betas() -> (f64, f64) {
    (0.9, 0.999)
}
fn adam_eps() -> f64 {
    1e-8
}
fn adamw_decay() -> f64 {
    0.01
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub enum Optimizer {
    Sgd {
        lr: f64,
        #[serde(default)]
        momentum: f64,
        #[serde(default)]
        nesterov: bool,
        #[serde(default)]
        weight_decay: f64,
        #[serde(default)]
        clip_norm: Option<f64>,
        #[serde(default = "constant")]
        schedule: Schedule,
    },
    Adam {
        lr: f64,
        #[serde(default = "betas")]
        betas: (f64, f64),
        #[serde(default = "adam_eps")]
        eps: f64,
        #[serde(default)]
        weight_decay: f64,
        #[serde(default)]
        clip_norm: Option<f64>,
        #[serde(default = "constant")]
        schedule: Schedule,
    },
    AdamW {
        lr: f64,
        #[serde(default = "betas")]
        betas: (f64, f64),
        #[serde(default = "adam_eps")]
        eps: f64,
        #[serde(default = "adamw_decay")]
        weight_decay: f64,
        #[serde(default)]
        clip_norm: Option<f64>,
        #[serde(default = "constant")]
        schedule: Schedule,
    },
}

impl Optimizer {
    /// The settings every optimizer has: `(lr, weight_decay, clip_norm, schedule)`.
    fn common(&self) -> (f64, f64, Option<f64>, &Schedule) {
        match self {
            Optimizer::Sgd {
                lr,
                weight_decay,
                clip_norm,
                schedule,
                ..
            }
            | Optimizer::Adam {
                lr,
                weight_decay,
                clip_norm,
                schedule,
                ..
            }
            | Optimizer::AdamW {
                lr,
                weight_decay,
                clip_norm,
                schedule,
                ..
            } => (*lr, *weight_decay, *clip_norm, schedule),
        }
    }

    pub fn lr(&self) -> f64 {
        self.common().0
    }

    pub fn weight_decay(&self) -> f64 {
        self.common().1
    }

    /// The bound on the global gradient norm, if it clips.
    pub fn clip_norm(&self) -> Option<f64> {
        self.common().2
    }

    pub fn schedule(&self) -> &Schedule {
        self.common().3
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Train {
    /// The global batch, split across data-parallel replicas.
    pub batch_size: u64,
    #[serde(default)]
    pub steps: Option<u64>,
    #[serde(default)]
    pub epochs: Option<u64>,
    #[serde(default)]
    pub seed: u64,
    /// Drop the last partial batch of an epoch instead of running it smaller.
    #[serde(default)]
    pub drop_last: bool,
    /// Visit the training set in a new seeded order each epoch; `false` reads it in file
    /// order every epoch (what a reference run in another framework can mirror).
    #[serde(default = "yes")]
    pub shuffle: bool,
}

fn gpus_one() -> u32 {
    1
}
fn kind_default() -> String {
    "h100".into()
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Devices {
    #[serde(default = "gpus_one")]
    pub gpus: u32,
    #[serde(default = "kind_default")]
    pub kind: String,
    #[serde(default = "gpus_one")]
    pub nodes: u32,
    /// The fixed pieces data parallelism splits each batch into: every GPU count up to this
    /// gives the same bits (each GPU takes whole pieces; their gradients sum in a fixed order).
    #[serde(default = "micro_shards_default")]
    pub micro_shards: u32,
    /// Data parallelism all-reduces gradients in buckets of about this many MiB.
    #[serde(default = "gradient_bucket_default")]
    pub gradient_bucket_mb: f64,
    /// How activations (the per-sample values a step stores between kernels, and their
    /// gradients) are kept in memory; the arithmetic is f32 either way.
    #[serde(default)]
    pub activations: Storage,
}

/// An element type for stored activations: `Bf16` halves their memory (each value rounded to
/// nearest even when stored), as mixed-precision training keeps them; parameters, their
/// gradients, optimizer state, losses and row statistics stay f32.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum Storage {
    #[default]
    F32,
    Bf16,
}

fn micro_shards_default() -> u32 {
    8
}

/// PyTorch DDP's `bucket_cap_mb`.
fn gradient_bucket_default() -> f64 {
    25.0
}

impl Default for Devices {
    fn default() -> Self {
        Devices {
            gpus: 1,
            kind: kind_default(),
            nodes: 1,
            micro_shards: micro_shards_default(),
            gradient_bucket_mb: gradient_bucket_default(),
            activations: Storage::F32,
        }
    }
}
