//! `parallax report` and `parallax diff`: reading run directories (being written).

use crate::Exit;
use std::path::Path;
use std::path::PathBuf;

pub fn report(runs: &[PathBuf], out: Option<&Path>) -> Result<(), Exit> {
    let _ = (runs, out);
    eprintln!("error: `parallax report` is not built yet");
    Err(Exit(1))
}

pub fn diff(a: &Path, b: &Path) -> Result<(), Exit> {
    let _ = (a, b);
    eprintln!("error: `parallax diff` is not built yet");
    Err(Exit(1))
}
