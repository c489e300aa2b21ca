//! Reading back the files `parallax train` writes in a run directory (`summary.json`,
//! `metrics.jsonl`), for `parallax report` and `parallax diff`. Nothing here panics on a
//! malformed file: each error names the file. Summaries are read as untyped JSON so that
//! fields added by later versions (or missing from older ones) only add (or blank) rows.

use serde_json::{Map, Value};
use std::fmt::Display;
use std::path::{Path, PathBuf};

/// A file of a run that cannot be read: `<path>: <what>`.
#[derive(Debug, thiserror::Error)]
#[error("{}: {what}", path.display())]
pub struct ReadError {
    pub path: PathBuf,
    what: String,
}

fn fail(path: &Path, what: impl Display) -> ReadError {
    ReadError {
        path: path.to_path_buf(),
        what: what.to_string(),
    }
}

/// The file's text.
pub fn read(path: &Path) -> Result<String, ReadError> {
    std::fs::read_to_string(path).map_err(|e| fail(path, e))
}

/// `(step, value)` points of a curve.
pub type Points = Vec<(f64, f64)>;

/// The curves [`curves`] reads, in its order.
pub const CURVES: [&str; 3] = ["loss", "val_loss", "val_accuracy"];

/// The run's `summary.json`; for a run that did not finish, `{"finished": false}`.
pub fn summary(dir: &Path) -> Result<Map<String, Value>, ReadError> {
    if !dir.is_dir() {
        let what = if dir.exists() {
            "not a folder"
        } else {
            "no such run folder"
        };
        return Err(fail(dir, what));
    }
    let path = dir.join("summary.json");
    // A run stopped by a signal, a crash or a full disk has its record but no summary: its
    // curves so far are still worth a report.
    if !path.exists() && dir.join("run.json").exists() {
        let mut map = Map::new();
        map.insert("finished".into(), Value::Bool(false));
        return Ok(map);
    }
    match serde_json::from_str(&read(&path)?) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(fail(&path, "expected a JSON object")),
        Err(e) => Err(fail(&path, format_args!("invalid JSON: {e}"))),
    }
}

/// The training loss, validation loss and validation accuracy of the run's `metrics.jsonl`.
pub fn curves(dir: &Path) -> Result<[Points; 3], ReadError> {
    let path = dir.join("metrics.jsonl");
    let mut curves: [Points; 3] = Default::default();
    let text = read(&path)?;
    // A run that did not finish (no summary) may have been cut off mid-line: that last line
    // is not part of it. In a finished run every line is whole, so a torn one is damage.
    let unfinished = !dir.join("summary.json").exists();
    let whole = match text.rfind('\n') {
        _ if !unfinished || text.ends_with('\n') => &text,
        Some(end) => &text[..=end],
        None => "",
    };
    for (i, line) in whole.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: &dyn Display| fail(&path, format_args!("line {}: {what}", i + 1));
        let obj: Value = serde_json::from_str(line).map_err(|e| {
            // serde_json counts lines within the one line it was given: keep the column only.
            let msg = e.to_string();
            let msg = msg
                .rsplit_once(" at line ")
                .map_or(msg.as_str(), |(m, _)| m);
            bad(&format_args!("column {}: {msg}", e.column()))
        })?;
        let Some(step) = obj.get("step").and_then(Value::as_f64) else {
            return Err(bad(&"no numeric \"step\""));
        };
        // Lines of other kinds (from later versions) add nothing, and a null (a regression
        // loss has no accuracy) is no point.
        for (key, curve) in CURVES.iter().zip(&mut curves) {
            if let Some(v) = obj.get(*key).and_then(Value::as_f64) {
                curve.push((step, v));
            }
        }
    }
    Ok(curves)
}
