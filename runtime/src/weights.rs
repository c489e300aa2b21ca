//! Parameters as safetensors files, named after the model's layers (PyTorch's layouts), so
//! weights move between Parallax and PyTorch unchanged. BatchNorm's running statistics go
//! with them (`{layer}.running_mean`, `{layer}.running_var`), as in a PyTorch `state_dict`.

use crate::backend::{Backend, ParamValues};
use crate::cpu::ExecError;
use parallax_compiler::passes::lower::is_running_statistic;
use safetensors::tensor::{Dtype, TensorView};
use std::path::Path;

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

/// The executor's parameters as safetensors bytes (deterministic: same values, same bytes).
pub fn to_bytes(e: &dyn Backend) -> Result<Vec<u8>, String> {
    let (params, stats) = model_values(e).map_err(|err| err.to_string())?;
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = params
        .into_iter()
        .chain(stats)
        .map(|(name, shape, v)| {
            let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
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
fn model_values(e: &dyn Backend) -> Result<(ParamValues, ParamValues), ExecError> {
    let stats = e.state_values()?.into_iter();
    let stats = stats.filter(|(name, _, _)| is_running_statistic(name));
    Ok((e.param_values()?, stats.collect()))
}

/// Writes the parameters whole or not at all.
pub fn save(e: &dyn Backend, path: &Path) -> Result<(), WeightsError> {
    let p = path.display().to_string();
    let bytes = to_bytes(e).map_err(|message| WeightsError::Format {
        path: p.clone(),
        message,
    })?;
    crate::files::write_atomic(path, &bytes)
        .map_err(|source| WeightsError::Write { path: p, source })
}

/// Loads every parameter and running statistic from `path`; each must be present, f32 and of
/// the right shape, and the file may hold nothing else (but PyTorch's `num_batches_tracked`
/// beside a running statistic, which Parallax does not use). Nothing is changed unless
/// everything fits.
pub fn load(e: &mut dyn Backend, path: &Path) -> Result<(), WeightsError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| WeightsError::Read {
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
        let view = st
            .tensor(name)
            .map_err(|_| bad(name, "missing from the file".into()))?;
        if view.dtype() != Dtype::F32 {
            return Err(bad(name, format!("is {:?}, expected F32", view.dtype())));
        }
        if view.shape() != shape.as_slice() {
            return Err(bad(
                name,
                format!(
                    "has shape {:?}, the model expects {:?}",
                    view.shape(),
                    shape
                ),
            ));
        }
        let v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
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
