//! What a run logs as it goes: `metrics.jsonl` (a line per step and per validation) and
//! TensorBoard's events file. Only the process that writes the run directory keeps them; the
//! other ranks of a job log nothing, through the same calls.

use super::TrainError;
use crate::run::tensorboard::EventWriter;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

pub(super) struct Records {
    /// `None` on a rank that does not write the run directory.
    files: Option<Files>,
}

struct Files {
    metrics: BufWriter<File>,
    metrics_path: PathBuf,
    events: EventWriter,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl Records {
    /// Nothing is logged.
    pub(super) fn none() -> Records {
        Records { files: None }
    }

    /// The records of run directory `dir`. A resumed run keeps the metrics lines up to its
    /// checkpoint at `start_step` (a crashed run may have logged steps after it) and appends
    /// from there; its TensorBoard session starts at the next step.
    pub(super) fn open(dir: &Path, resume: bool, start_step: u64) -> Result<Records, TrainError> {
        let metrics_path = dir.join("metrics.jsonl");
        if resume {
            let old = std::fs::read_to_string(&metrics_path).unwrap_or_default();
            let kept = crate::run::resume::metrics_through(&old, start_step);
            crate::run::atomic::write_atomic(&metrics_path, kept.as_bytes())
                .map_err(io_err(&metrics_path))?;
        }
        let metrics = BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&metrics_path)
                .map_err(io_err(&metrics_path))?,
        );
        let mut events = EventWriter::create(dir).map_err(io_err(dir))?;
        if resume {
            let path = events.path().to_path_buf();
            events
                .session_start(start_step + 1)
                .map_err(io_err(&path))?;
        }
        Ok(Records {
            files: Some(Files {
                metrics,
                metrics_path,
                events,
            }),
        })
    }

    /// One metrics line. Every write error stops the run, naming the file (a metrics file
    /// with holes would misreport the run); each line reaches the file whole, as its step
    /// ends, for whoever follows the run.
    pub(super) fn line(&mut self, line: serde_json::Value) -> Result<(), TrainError> {
        let Some(f) = &mut self.files else {
            return Ok(());
        };
        writeln!(f.metrics, "{line}")
            .and_then(|_| f.metrics.flush())
            .map_err(io_err(&f.metrics_path))
    }

    /// One TensorBoard scalar.
    pub(super) fn scalar(&mut self, tag: &str, step: u64, value: f32) -> Result<(), TrainError> {
        let Some(f) = &mut self.files else {
            return Ok(());
        };
        f.events
            .scalar(tag, step, value)
            .map_err(io_err(f.events.path()))
    }

    /// Both files, on disk.
    pub(super) fn flush(&mut self) -> Result<(), TrainError> {
        let Some(f) = &mut self.files else {
            return Ok(());
        };
        f.metrics.flush().map_err(io_err(&f.metrics_path))?;
        f.events.flush().map_err(io_err(f.events.path()))
    }
}
