//! Helpers shared by the integration tests that run the `parallax` binary.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs the binary from the repository root (so `models/...` paths resolve).
pub fn parallax(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_parallax"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the binary runs")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh directory path for test `name` in this process (removed if it exists).
pub fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("parallax-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}
