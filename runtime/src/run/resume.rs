//! Continuing a run: its newest checkpoint, taken only when the checkpoint, the experiment and
//! the data are those of the run (its `run.json` lists every identity the run has had), and
//! the run's own checkpoint cadence carried on.

use crate::run::checkpoint::{self, CheckpointError, Meta};
use crate::run::record::{Continuation, RunRecord, FILE};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    #[error("{path} has no checkpoint to resume from (train with --checkpoint-every N)")]
    NoCheckpoint { path: String },
    #[error("{path}: {message}")]
    Record { path: String, message: String },
    #[error("{path} is named for step {named} but records step {recorded}: it was renamed or copied; resume only from the run's own checkpoints")]
    Renamed {
        path: String,
        named: u64,
        recorded: u64,
    },
    #[error("{path} was written by another run (run_id {found}; this run has been {known}); a checkpoint moves between runs only as weights: start a new run with --init")]
    OtherRun {
        path: String,
        found: String,
        known: String,
    },
    #[error("{dir}: {what} changed since the run was written, so the continuation would not be the run it claims to be; undo the change, start a new run, or continue anyway with --accept-changes (recorded in run.json)")]
    Changed { dir: String, what: String },
    #[error("{dir}: its newest checkpoint is at step {at}, {budget}; ask for more with --steps N, N > {at}")]
    NothingToDo {
        dir: String,
        at: u64,
        budget: String,
    },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

/// The run being continued: its record and the checkpoint it continues from.
#[derive(Debug, Clone)]
pub struct Resume {
    pub dir: PathBuf,
    pub checkpoint: PathBuf,
    /// The checkpoint's own record (its step, run, model, plan), read from its header.
    pub meta: Meta,
    pub record: RunRecord,
}

impl Resume {
    /// The newest checkpoint of the run in `dir`, with the run's record.
    pub fn newest(dir: &Path) -> Result<Resume, ResumeError> {
        let record = RunRecord::read(dir).map_err(|message| ResumeError::Record {
            path: dir.join(FILE).display().to_string(),
            message,
        })?;
        let Some((named, path)) = checkpoint::list(dir).pop() else {
            return Err(ResumeError::NoCheckpoint {
                path: dir.display().to_string(),
            });
        };
        let meta = checkpoint::read_meta(&path)?;
        if meta.step != named {
            return Err(ResumeError::Renamed {
                path: path.display().to_string(),
                named,
                recorded: meta.step,
            });
        }
        Ok(Resume {
            dir: dir.to_path_buf(),
            checkpoint: path,
            meta,
            record,
        })
    }

    /// The step the continuation starts from.
    pub fn step(&self) -> u64 {
        self.meta.step
    }

    /// Refuses a checkpoint another run wrote, and an experiment or data that changed since
    /// the run was written unless `accept` (the changes are returned, to record). `as_recorded`
    /// is the identity of the run's experiment as it reads now, with its data as loaded now.
    pub fn check_identity(
        &self,
        as_recorded: &dyn Fn(&str) -> String,
        data_hash: &str,
        accept: bool,
    ) -> Result<Vec<&'static str>, ResumeError> {
        let ids = self.record.run_ids();
        if !ids.contains(&self.meta.run_id.as_str()) {
            return Err(ResumeError::OtherRun {
                path: self.checkpoint.display().to_string(),
                found: self.meta.run_id.clone(),
                known: ids.join(", "),
            });
        }
        let known = |id: String| ids.contains(&id.as_str());
        if known(as_recorded(data_hash)) {
            return Ok(Vec::new());
        }
        let hashes = self.record.data_hashes();
        let mut changed = Vec::new();
        if !hashes.iter().any(|h| known(as_recorded(h))) {
            changed.push("experiment");
        }
        if !hashes.contains(&data_hash) {
            changed.push("data");
        }
        if changed.is_empty() {
            // Each alone matches a past identity, together none: report both.
            changed = vec!["experiment", "data"];
        }
        if accept {
            return Ok(changed);
        }
        let what = changed
            .iter()
            .map(|c| match *c {
                "experiment" => "its experiment.ron",
                _ => "its data (the files' samples hash differently)",
            })
            .collect::<Vec<_>>()
            .join(" and ");
        Err(ResumeError::Changed {
            dir: self.dir.display().to_string(),
            what,
        })
    }

    /// Refuses a step budget the checkpoint has passed (at the budget, the continuation only
    /// finishes the run: validation, final weights, summary).
    pub fn check_budget(&self, total: u64) -> Result<(), ResumeError> {
        let at = self.step();
        if at <= total {
            return Ok(());
        }
        let budget = format!("past the {total} steps asked for");
        Err(ResumeError::NothingToDo {
            dir: self.dir.display().to_string(),
            at,
            budget,
        })
    }

    /// The run's record with this continuation appended.
    pub fn record_with(&self, continuation: Continuation) -> RunRecord {
        let mut record = self.record.clone();
        record.resumes.push(continuation);
        record
    }
}

/// The steps of the finished run in `dir` (its `summary.json` and `final.safetensors` are
/// written), unless `asked` asks for another budget. A continuation that trains removes the
/// summary first, so a summary is never older than the run's checkpoints.
pub fn finished(dir: &Path, asked: Option<u64>) -> Option<u64> {
    if !dir.join("final.safetensors").is_file() {
        return None;
    }
    let text = std::fs::read_to_string(dir.join(SUMMARY)).ok()?;
    let summary: serde_json::Value = serde_json::from_str(&text).ok()?;
    let steps = summary["steps"].as_u64()?;
    asked.is_none_or(|n| n == steps).then_some(steps)
}

/// The summary's file name, in the run folder.
pub const SUMMARY: &str = "summary.json";

/// A step's training loss, and its validation loss and accuracy, as logged.
pub type Logged = (Option<f32>, Option<(f64, Option<f64>)>);

/// What `metrics.jsonl`'s `text` logged at `step`: the training loss, and the validation
/// loss and accuracy (a run stopped after its last checkpoint has both).
pub fn logged_at(text: &str, step: u64) -> Logged {
    let (mut loss, mut val) = (None, None);
    for v in text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["step"].as_u64() == Some(step))
    {
        if let Some(l) = v["loss"].as_f64() {
            loss = Some(l as f32);
        }
        if let Some(l) = v["val_loss"].as_f64() {
            val = Some((l, v["val_accuracy"].as_f64()));
        }
    }
    (loss, val)
}

/// The metrics lines up to `step` (a crashed run may have logged steps after its checkpoint,
/// and a torn last line is dropped), which the continuation appends to.
pub fn metrics_through(text: &str, step: u64) -> String {
    text.lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect()
}
