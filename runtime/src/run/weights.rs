//! Parameters as safetensors files, named after the model's layers, in PyTorch's layouts, so
//! weights move between Parallax and PyTorch unchanged. BatchNorm's running statistics go
//! with them (`{layer}.running_mean`, `{layer}.running_var`), as in a PyTorch `state_dict`.
//!
//! Every file holds PyTorch's shapes, whatever the plan uses inside: a Conv2d bias and
//! BatchNorm2d's weight and bias are `[C]` in files and `[C, 1, 1]` in the plan (the plan's
//! `file_shapes`; the same elements in the same order, so the mapping is a reshape at the file
//! boundary). Files written before that, with `[C, 1, 1]`, are read as well.

use crate::backend::{Backend, ParamValues};
use crate::exec::finite;
use crate::exec::ExecError;
use parallax_compiler::passes::lower::is_running_statistic;
use parallax_compiler::Plan;
use safetensors::tensor::{Dtype, TensorView};
use std::path::Path;

/// The shapes parameters and states take in files where they differ from the plan's (a
/// [`Plan`]'s `file_shapes`, kept apart from the plan that the executor consumes).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FileShapes(Vec<(String, Vec<usize>)>);

impl FileShapes {
    pub fn of(plan: &Plan) -> FileShapes {
        FileShapes(
            plan.file_shapes
                .iter()
                .map(|(n, s)| (n.clone(), s.iter().map(|&d| d as usize).collect()))
                .collect(),
        )
    }

    /// The shape `name` (of shape `shape` in the plan) is written with.
    pub fn file_shape(&self, name: &str, shape: &[usize]) -> Vec<usize> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map_or_else(|| shape.to_vec(), |(_, s)| s.clone())
    }

    /// Whether a file's tensor of shape `found` loads into `name` (of shape `shape` in the
    /// plan): PyTorch's shape, or the plan's own (what files written before held).
    pub fn accepts(&self, name: &str, shape: &[usize], found: &[usize]) -> bool {
        found == shape || found == self.file_shape(name, shape).as_slice()
    }

    /// The values of model tensor `name` (of `shape`) stored as `key` in `st` (a weights file
    /// or a checkpoint, `within` in messages): present, f32, of a shape this model accepts and
    /// finite (`diverged` says what to do when not). `Err` is the message about the tensor.
    pub(crate) fn read(
        &self,
        st: &safetensors::SafeTensors,
        key: &str,
        (name, shape): (&str, &[usize]),
        within: &str,
        diverged: &str,
    ) -> Result<Vec<f32>, String> {
        let view = st
            .tensor(key)
            .map_err(|_| format!("missing from {within}"))?;
        if view.dtype() != Dtype::F32 {
            return Err(format!("is {:?}, expected F32", view.dtype()));
        }
        if !self.accepts(name, shape, view.shape()) {
            return Err(format!(
                "has shape {:?}, the model expects {:?}",
                view.shape(),
                self.file_shape(name, shape)
            ));
        }
        let v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        match finite::Count::of(&v) {
            Some(c) => Err(format!("{}: {diverged}", finite::refusal(&c))),
            None => Ok(v),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a safetensors file: {message}")]
    Format { path: String, message: String },
    #[error("{path}: tensor `{name}`: {message}")]
    Tensor {
        path: String,
        name: String,
        message: String,
    },
}

/// The executor's parameters as safetensors bytes, in the shapes of `files` (deterministic:
/// same values, same bytes).
pub fn to_bytes(e: &dyn Backend, files: &FileShapes) -> Result<Vec<u8>, String> {
    let (params, stats) = model_values(e).map_err(|err| err.to_string())?;
    serialize(params, stats, files)
}

fn serialize(
    params: ParamValues,
    stats: ParamValues,
    files: &FileShapes,
) -> Result<Vec<u8>, String> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = params
        .into_iter()
        .chain(stats)
        .map(|(name, shape, v)| {
            let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            let shape = files.file_shape(&name, &shape);
            (name, shape, b)
        })
        .collect();
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            TensorView::new(Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize(views, None).map_err(|e| e.to_string())
}

/// The parameters, and the running statistics (states no gradient trains), in plan order.
pub fn model_values(e: &dyn Backend) -> Result<(ParamValues, ParamValues), ExecError> {
    let stats = e.state_values()?.into_iter();
    let stats = stats.filter(|(name, _, _)| is_running_statistic(name));
    Ok((e.param_values()?, stats.collect()))
}

/// Writes the parameters whole or not at all, and never a NaN or an infinity (nothing is
/// written then; on CUDA this is where a NaN the loss does not show is caught).
pub fn save(e: &dyn Backend, files: &FileShapes, path: &Path) -> Result<(), WeightsError> {
    let (params, stats) = model_values(e).map_err(|err| WeightsError::Format {
        path: path.display().to_string(),
        message: err.to_string(),
    })?;
    write(params, stats, files, path)
}

/// [`save`] of values already gathered (`model_values`).
pub fn write(
    params: ParamValues,
    stats: ParamValues,
    files: &FileShapes,
    path: &Path,
) -> Result<(), WeightsError> {
    let p = path.display().to_string();
    let all = params.iter().chain(&stats);
    if let Some((name, c)) = finite::first_in(all.map(|(n, _, v)| (n.as_str(), v.as_slice()))) {
        return Err(WeightsError::Tensor {
            path: p,
            name: name.to_string(),
            message: format!(
                "{}: not written, the weights must be finite",
                finite::refusal(&c)
            ),
        });
    }
    let bytes = serialize(params, stats, files).map_err(|message| WeightsError::Format {
        path: p.clone(),
        message,
    })?;
    crate::run::atomic::write_atomic(path, &bytes)
        .map_err(|source| WeightsError::Write { path: p, source })
}

/// Loads every parameter and running statistic from `path`; each must be present, f32 and of
/// the right shape (PyTorch's, as in `files`, or the plan's), and the file may hold nothing
/// else (but PyTorch's `num_batches_tracked` beside a running statistic, which Parallax does
/// not use). Nothing is changed unless everything fits.
pub fn load(e: &mut dyn Backend, files: &FileShapes, path: &Path) -> Result<(), WeightsError> {
    let p = path.display().to_string();
    let bytes =
        crate::exec::host_memory::read_whole(path).map_err(|source| WeightsError::Read {
            path: p.clone(),
            source,
        })?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|err| WeightsError::Format {
        path: p.clone(),
        message: err.to_string(),
    })?;
    let bad = |name: &str, message: String| WeightsError::Tensor {
        path: p.clone(),
        name: name.to_string(),
        message,
    };
    let mut loaded = Vec::new();
    let (params, stats) = model_values(e).map_err(|err| WeightsError::Format {
        path: p.clone(),
        message: err.to_string(),
    })?;
    let tagged = params.iter().map(|v| (v, true));
    for ((name, shape, _), trained) in tagged.chain(stats.iter().map(|v| (v, false))) {
        let name = name.as_str();
        let v = files
            .read(
                &st,
                name,
                (name, shape),
                "the file",
                "the weights must be finite (were they saved from a run that diverged?)",
            )
            .map_err(|m| bad(name, m))?;
        loaded.push((name.to_string(), shape.clone(), v, trained));
    }
    let known = |n: &str| loaded.iter().any(|(k, ..)| k == n);
    let counter = |n: &str| {
        n.strip_suffix(".num_batches_tracked")
            .is_some_and(|layer| known(&format!("{layer}.running_mean")))
    };
    if let Some(extra) = st.names().into_iter().find(|n| !known(n) && !counter(n)) {
        return Err(bad(extra, "is not a parameter of this model".into()));
    }
    for (name, shape, v, trained) in loaded {
        let set = if trained {
            e.set_param(&name, &shape, &v)
        } else {
            e.set_state(&name, &v)
        };
        set.map_err(|err| bad(&name, err.to_string()))?;
    }
    Ok(())
}
