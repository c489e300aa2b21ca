//! Checkpoints: the parameters and the optimizer state in their logical (unsharded) layout,
//! as one safetensors file whose header records the step, the model's fingerprint and a
//! SHA-256 of every tensor's bytes. Written to a temporary file, synced, then renamed, so a
//! crash at any instant leaves the previous checkpoint whole; read back only when everything
//! checks out, so nothing half-loaded is ever trained on. Tensors hold PyTorch's shapes (see
//! `crate::run::weights`): a Conv2d bias and its optimizer state are `[C]`; checkpoints written
//! with the plan's `[C, 1, 1]` are read as well (the same elements, the same checksum).

use crate::backend::{Backend, ParamValues};
use crate::exec::finite;
use crate::run::weights::FileShapes;
use safetensors::tensor::{Dtype, TensorView};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "parallax-checkpoint-1";
const PARAM: &str = "param/";
const STATE: &str = "state/";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a readable checkpoint (truncated or corrupted?): {message}")]
    Format { path: String, message: String },
    #[error("{path}: the tensor data does not match its checksum: the file is corrupted")]
    Checksum { path: String },
    #[error("{path}: tensor `{name}`: {message}")]
    Tensor {
        path: String,
        name: String,
        message: String,
    },
    #[error("{path}: written for another model (fingerprint {found}, this model's is {expected}); resume with the experiment that wrote it")]
    OtherModel {
        path: String,
        found: String,
        expected: String,
    },
    #[error("{0}")]
    Backend(String),
}

/// What a checkpoint says besides its tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct Meta {
    /// Training steps completed; the next step to run.
    pub step: u64,
    /// The run's identity (hash of its experiment and data).
    pub run_id: String,
    /// The model's fingerprint: its parameters' and states' names and shapes.
    pub model: String,
    /// The plan it was written under (`dp1.tp1.pp1` and the device kind).
    pub plan: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fingerprint of the names and shapes of a model's parameters and optimizer state.
pub fn fingerprint(params: &ParamValues, states: &ParamValues) -> String {
    let mut h = Sha256::new();
    for (kind, list) in [("param", params), ("state", states)] {
        for (name, shape, _) in list {
            h.update(format!("{kind} {name} {shape:?}\n").as_bytes());
        }
    }
    hex(&h.finalize())[..16].to_string()
}

/// `checkpoints/step-00000123.safetensors` in a run directory.
pub fn path_for(run_dir: &Path, step: u64) -> PathBuf {
    run_dir
        .join("checkpoints")
        .join(format!("step-{step:08}.safetensors"))
}

/// The run's checkpoints, oldest first.
pub fn list(run_dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(run_dir.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name
                .strip_prefix("step-")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()?;
            Some((step, e.path()))
        })
        .collect();
    v.sort();
    v
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn backend(e: crate::exec::ExecError) -> CheckpointError {
    CheckpointError::Backend(e.to_string())
}

/// Writes a checkpoint of `exec` after `meta.step` steps, its tensors in the shapes of
/// `files`, then keeps only the newest `keep`. A NaN or an infinity in any tensor writes
/// nothing (and removes no older checkpoint): resuming from it could only diverge again.
pub fn save(
    run_dir: &Path,
    exec: &dyn Backend,
    files: &FileShapes,
    meta: &Meta,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    write(run_dir, values(exec)?, files, meta, keep)
}

/// What a checkpoint holds: the parameters and the states, whole, in plan order.
pub fn values(exec: &dyn Backend) -> Result<(ParamValues, ParamValues), CheckpointError> {
    Ok((
        exec.param_values().map_err(backend)?,
        exec.state_values().map_err(backend)?,
    ))
}

/// [`save`] of values already gathered (`values`).
pub fn write(
    run_dir: &Path,
    (params, states): (ParamValues, ParamValues),
    files: &FileShapes,
    meta: &Meta,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    let all = params.iter().chain(&states);
    if let Some((name, c)) = finite::first_in(all.map(|(n, _, v)| (n.as_str(), v.as_slice()))) {
        return Err(CheckpointError::Tensor {
            path: path_for(run_dir, meta.step).display().to_string(),
            name: name.to_string(),
            message: format!(
                "{}: not written, a checkpoint must be finite",
                finite::refusal(&c)
            ),
        });
    }
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = params
        .iter()
        .map(|p| (PARAM, p))
        .chain(states.iter().map(|s| (STATE, s)))
        .map(|(prefix, (name, shape, v))| {
            let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            (
                format!("{prefix}{name}"),
                files.file_shape(name, shape),
                bytes,
            )
        })
        .collect();
    // The checksum covers every name and its bytes, in name order.
    let mut order: Vec<&(String, Vec<usize>, Vec<u8>)> = tensors.iter().collect();
    order.sort_by(|a, b| a.0.cmp(&b.0));
    let mut sum = Sha256::new();
    for (name, _, bytes) in order {
        sum.update(name.as_bytes());
        sum.update(bytes);
    }
    let info: HashMap<String, String> = [
        ("format", FORMAT.to_string()),
        ("step", meta.step.to_string()),
        ("run_id", meta.run_id.clone()),
        ("model", meta.model.clone()),
        ("plan", meta.plan.clone()),
        ("sha256", hex(&sum.finalize())),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, s, b)| {
            TensorView::new(Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| CheckpointError::Backend(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    let bytes = safetensors::serialize(views, Some(info))
        .map_err(|e| CheckpointError::Backend(e.to_string()))?;

    let path = path_for(run_dir, meta.step);
    let dir = path.parent().expect("a checkpoints folder");
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    crate::run::atomic::write_atomic(&path, &bytes).map_err(io(&path))?;
    let all = list(run_dir);
    if keep > 0 && all.len() > keep {
        for (_, old) in &all[..all.len() - keep] {
            let _ = std::fs::remove_file(old);
        }
    }
    Ok(path)
}

/// Reads a checkpoint and loads it into `exec` if, and only if, everything checks out: the
/// format, the checksum, the model's fingerprint, every tensor present with its shape (that of
/// `files`, or the plan's).
pub fn load(
    path: &Path,
    exec: &mut dyn Backend,
    files: &FileShapes,
) -> Result<Meta, CheckpointError> {
    let p = path.display().to_string();
    let bytes = crate::exec::host_memory::read_whole(path).map_err(io(path))?;
    let format_err = |message: String| CheckpointError::Format {
        path: p.clone(),
        message,
    };
    let (_, header) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| format_err(e.to_string()))?;
    let st =
        safetensors::SafeTensors::deserialize(&bytes).map_err(|e| format_err(e.to_string()))?;
    let info = header
        .metadata()
        .clone()
        .ok_or_else(|| format_err("no checkpoint metadata".into()))?;
    let meta = meta_of(&info, &p)?;
    let field = |k: &str| {
        info.get(k)
            .cloned()
            .ok_or_else(|| format_err(format!("no `{k}` in its metadata")))
    };
    let mut names: Vec<&str> = st.names();
    names.sort();
    let mut sum = Sha256::new();
    for n in names {
        let t = st.tensor(n).map_err(|e| format_err(e.to_string()))?;
        sum.update(n.as_bytes());
        sum.update(t.data());
    }
    if hex(&sum.finalize()) != field("sha256")? {
        return Err(CheckpointError::Checksum { path: p });
    }
    let params = exec.param_values().map_err(backend)?;
    let states = exec.state_values().map_err(backend)?;
    let expected = fingerprint(&params, &states);
    let model = meta.model.clone();
    let tensor_err = |name: &str, message: String| CheckpointError::Tensor {
        path: p.clone(),
        name: name.to_string(),
        message,
    };
    // Everything is read and checked before anything is set.
    let mut loaded: Vec<(bool, String, Vec<f32>)> = Vec::new();
    for (is_param, prefix, list) in [(true, PARAM, &params), (false, STATE, &states)] {
        for (name, shape, _) in list {
            let key = format!("{prefix}{name}");
            // Checkpoints written before non-finite values were refused may hold them.
            let diverged =
                "delete this checkpoint to resume from an earlier one, before the run diverged";
            let v = files
                .read(&st, &key, (name, shape), "the checkpoint", diverged)
                .map_err(|m| tensor_err(name, m))?;
            loaded.push((is_param, name.clone(), v));
        }
    }
    if let Some(extra) = st.names().into_iter().find(|n| {
        !loaded.iter().any(|(is_param, name, _)| {
            **n == format!("{}{name}", if *is_param { PARAM } else { STATE })
        })
    }) {
        return Err(tensor_err(extra, "is not part of this model".into()));
    }
    if model != expected {
        return Err(CheckpointError::OtherModel {
            path: p,
            found: model,
            expected,
        });
    }
    for (is_param, name, v) in loaded {
        let shape = params
            .iter()
            .find(|x| x.0 == name)
            .map(|x| x.1.clone())
            .unwrap_or_default();
        let r = if is_param {
            exec.set_param(&name, &shape, &v)
        } else {
            exec.set_state(&name, &v)
        };
        r.map_err(backend)?;
    }
    Ok(meta)
}

/// The record in a checkpoint's metadata.
fn meta_of(info: &HashMap<String, String>, path: &str) -> Result<Meta, CheckpointError> {
    let format_err = |message: String| CheckpointError::Format {
        path: path.to_string(),
        message,
    };
    let field = |k: &str| {
        info.get(k)
            .cloned()
            .ok_or_else(|| format_err(format!("no `{k}` in its metadata")))
    };
    if field("format")? != FORMAT {
        return Err(format_err(format!("format `{}`", field("format")?)));
    }
    let step = field("step")?
        .parse()
        .map_err(|_| format_err("a step that is not a number".into()))?;
    Ok(Meta {
        step,
        run_id: field("run_id")?,
        model: field("model")?,
        plan: field("plan")?,
    })
}

/// A checkpoint's record, read from its header alone (what a resume needs to know before
/// loading its data; [`load`] checks the whole file again).
pub fn read_meta(path: &Path) -> Result<Meta, CheckpointError> {
    use std::io::Read;
    let p = path.display().to_string();
    let format_err = |message: &str| CheckpointError::Format {
        path: p.clone(),
        message: message.to_string(),
    };
    let mut file = std::fs::File::open(path).map_err(io(path))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| format_err("shorter than a safetensors header"))?;
    let len = u64::from_le_bytes(len);
    // safetensors' own bound on a header.
    if len > 100_000_000 {
        return Err(format_err("a header longer than 100 MB"));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header)
        .map_err(|_| format_err("a header cut short"))?;
    let header: serde_json::Value =
        serde_json::from_slice(&header).map_err(|_| format_err("a header that is not JSON"))?;
    let info: HashMap<String, String> = serde_json::from_value(header["__metadata__"].clone())
        .map_err(|_| format_err("no checkpoint metadata"))?;
    meta_of(&info, &p)
}
