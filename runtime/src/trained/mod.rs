//! A trained run, used: its weights (`final.safetensors`, or a checkpoint) on a backend, to
//! evaluate on data (`eval`), to predict classes (`predict`) and to generate text (`sample`).
//! The command line reads the run's `experiment.ron` and compiles its plan as `train` does;
//! what is here runs it.

mod cached;
pub mod eval;
pub mod predict;
mod report;
pub mod sample;

use crate::backend::Backend;
use crate::data::DataError;
use crate::exec::ExecError;
use crate::run::checkpoint::CheckpointError;
use crate::run::weights::{FileShapes, WeightsError};
use crate::train::TrainError;
use parallax_compiler::plan::LOSS;
use parallax_compiler::Plan;
use std::path::{Path, PathBuf};

pub use crate::train::CLASSES;

#[derive(Debug, thiserror::Error)]
pub enum UseError {
    #[error(
        "{dir} is not a run directory: it has no experiment.ron (`parallax train` writes one)"
    )]
    NotARun { dir: String },
    #[error("{dir} holds no weights: no final.safetensors and no checkpoint (the run did not finish; `parallax train --resume {dir}` continues it)")]
    NoWeights { dir: String },
    #[error("{dir} has no checkpoint at step {step}; it has {have}")]
    NoCheckpoint {
        dir: String,
        step: u64,
        have: String,
    },
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The model cannot do what was asked (`sample` on a classifier, ...).
    #[error("{0}")]
    Model(String),
    /// A value on the command line that cannot be used.
    #[error("{0}")]
    Asked(String),
}

/// Which weights of a run to use.
#[derive(Debug, Clone, PartialEq)]
pub enum Weights {
    /// `final.safetensors`: parameters and running statistics.
    Final(PathBuf),
    /// A checkpoint, at its step.
    Checkpoint(PathBuf, u64),
}

impl Weights {
    /// The run's final weights, or its checkpoint at `step`; with neither asked nor final
    /// weights written, its newest checkpoint (a run stopped before its end).
    pub fn of_run(dir: &Path, step: Option<u64>) -> Result<Weights, UseError> {
        let d = dir.display().to_string();
        if !dir.join("experiment.ron").is_file() {
            return Err(UseError::NotARun { dir: d });
        }
        let checkpoints = crate::run::checkpoint::list(dir);
        if let Some(step) = step {
            return match checkpoints.into_iter().find(|(s, _)| *s == step) {
                Some((s, p)) => Ok(Weights::Checkpoint(p, s)),
                None => Err(UseError::NoCheckpoint {
                    dir: d,
                    step,
                    have: steps_list(&crate::run::checkpoint::list(dir)),
                }),
            };
        }
        let last = dir.join("final.safetensors");
        if last.is_file() {
            return Ok(Weights::Final(last));
        }
        match checkpoints.into_iter().max_by_key(|(s, _)| *s) {
            Some((s, p)) => Ok(Weights::Checkpoint(p, s)),
            None => Err(UseError::NoWeights { dir: d }),
        }
    }

    /// What to call them in a report.
    pub fn describe(&self) -> String {
        match self {
            Weights::Final(p) => p.display().to_string(),
            Weights::Checkpoint(p, s) => format!("{} (step {s})", p.display()),
        }
    }

    /// Loads them into `exec` (whose plan's file shapes are `files`).
    pub fn load(&self, exec: &mut dyn Backend, files: &FileShapes) -> Result<(), UseError> {
        match self {
            Weights::Final(p) => crate::run::weights::load(exec, files, p)?,
            Weights::Checkpoint(p, _) => {
                crate::run::checkpoint::load(p, exec, files)?;
            }
        }
        Ok(())
    }
}

fn steps_list(checkpoints: &[(u64, PathBuf)]) -> String {
    match checkpoints {
        [] => "none".into(),
        c => {
            let steps: Vec<String> = c.iter().map(|(s, _)| s.to_string()).collect();
            format!("checkpoints at steps {}", steps.join(", "))
        }
    }
}

/// The run's class names (`classes.json`, written for data that names its classes), if any.
pub fn class_names(dir: &Path) -> Result<Option<Vec<String>>, UseError> {
    let path = dir.join(CLASSES);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(UseError::File {
                path: path.display().to_string(),
                message: e.to_string(),
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| UseError::File {
            path: path.display().to_string(),
            message: format!("not a JSON list of class names: {e}"),
        })
}

/// The plan's model output (its logits for a classifier or language model).
pub fn model_output(plan: &Plan) -> Result<String, UseError> {
    plan.output_steps
        .iter()
        .find(|o| o.name != LOSS)
        .map(|o| o.name.clone())
        .ok_or_else(|| UseError::Model("the model has no output besides its loss".into()))
}

/// Softmax over the last axis of `logits` (rows of `classes`), in f64 then rounded: the
/// probabilities `predict` writes.
pub fn softmax_rows(logits: &[f32], classes: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(logits.len());
    for row in logits.chunks(classes.max(1)) {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let e: Vec<f64> = row.iter().map(|&x| (x as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        out.extend(e.iter().map(|&v| (v / s) as f32));
    }
    out
}

/// The indices of the `k` largest values of `row`, largest first (ties: the lower index).
pub fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        let p = softmax_rows(&[1.0, 2.0, 3.0, 1000.0, 0.0, -1000.0], 3);
        assert!((p[..3].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // exp(1)/(e + e^2 + e^3)
        let e = std::f64::consts::E;
        assert!((p[0] as f64 - e / (e + e * e + e * e * e)).abs() < 1e-7);
        assert_eq!(p[3], 1.0);
        assert_eq!(p[5], 0.0);
    }

    #[test]
    fn top_k_is_largest_first_with_ties_by_index() {
        assert_eq!(top_k(&[0.1, 0.5, 0.5, 0.2], 3), vec![1, 2, 3]);
        assert_eq!(top_k(&[0.1], 5), vec![0]);
    }

    #[test]
    fn weights_of_a_folder_that_is_no_run_say_so() {
        let dir = std::env::temp_dir().join(format!("px-not-a-run-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = Weights::of_run(&dir, None).unwrap_err();
        assert!(e.to_string().contains("no experiment.ron"), "{e}");
        std::fs::write(dir.join("experiment.ron"), "").unwrap();
        let e = Weights::of_run(&dir, None).unwrap_err();
        assert!(e.to_string().contains("holds no weights"), "{e}");
        let e = Weights::of_run(&dir, Some(5)).unwrap_err();
        assert!(
            e.to_string()
                .contains("no checkpoint at step 5; it has none"),
            "{e}"
        );
        std::fs::write(dir.join("final.safetensors"), "").unwrap();
        assert_eq!(
            Weights::of_run(&dir, None).unwrap(),
            Weights::Final(dir.join("final.safetensors"))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
