//! `parallax report` and `parallax diff` (the library part is `parallax_runtime::run::report`): a
//! bad input is reported as `error: <path>: <what>` with exit code 1.

use crate::out::emit;
use crate::Exit;
use parallax_runtime::run::report;
use std::path::{Path, PathBuf};

pub fn report(runs: &[PathBuf], out: Option<&Path>) -> Result<(), Exit> {
    let written = report::report(runs, out).map_err(crate::error)?;
    let lines: String = written
        .iter()
        .map(|p| format!("{}\n", p.display()))
        .collect();
    emit(&lines)
}

pub fn diff(a: &Path, b: &Path) -> Result<(), Exit> {
    emit(&report::diff(a, b).map_err(crate::error)?)
}
