//! `scripts/gpu-check.sh`, the one prepared run for a GPU that is lent briefly, checked here
//! with a stand-in for the binary (no GPU needed): it keeps its time budget (a check there is
//! no time for is a SKIP row, not started), prints its table, leaves its rows and its log in
//! `$OUT`, and fails when a check fails or prints no row.

mod common;

use common::{run_limited, temp, Limited};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// What the script reads of each command: `devices`, and one ROW line per `gpu-check` (after
/// `FAKE_SLEEP` seconds), except for a model named in `FAKE_FAIL`, which fails with no row.
const STAND_IN: &str = r#"#!/usr/bin/env bash
case $1 in
devices) echo "CUDA driver supports CUDA 13.0; cuBLAS found; NCCL 2.28.3" ;;
gpu-check)
    sleep "${FAKE_SLEEP:-0}"
    if [ -n "${FAKE_FAIL:-}" ] && [ "$2" = "$FAKE_FAIL" ]; then
        echo "error: the stand-in fails here" >&2
        exit 3
    fi
    prec=fp32
    while [ $# -gt 0 ]; do [ "$1" = --precision ] && prec=$2; shift; done
    echo "step 1: loss cpu 2.3 cuda 2.3"
    echo "ROW|experiment|$prec|1.00e-06|2.00e-06|ok|12.500|100.00|10.0%"
    ;;
*) echo "stand-in: $*" ;;
esac
"#;

fn stand_in(dir: &Path) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let bin = dir.join("parallax");
    std::fs::write(&bin, STAND_IN).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin.display().to_string()
}

/// Runs the script (for at most 90 s) with the stand-in and `env`, its files in `dir/out`.
fn run_script(dir: &Path, env: &[(&str, &str)]) -> Limited {
    let bin = stand_in(dir);
    let mut c = Command::new("bash");
    c.arg("scripts/gpu-check.sh")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("PARALLAX", bin)
        .env("OUT", dir.join("out"));
    for (k, v) in env {
        c.env(k, v);
    }
    run_limited(c, Duration::from_secs(90))
}

/// The table's rows (after its header line).
fn table(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with("check "))
        .skip(1)
        .collect()
}

#[test]
fn the_script_keeps_its_budget_and_always_prints_its_table() {
    let dir = temp("gpu-script-budget");
    // 13 checks of a second each in `base`; a check starts only while 20 s are left.
    let env = [
        ("BUDGET", "26"),
        ("SECTIONS", "base speed"),
        ("FAKE_SLEEP", "1"),
    ];
    let r = run_script(&dir, &env);
    assert_eq!(r.code, Some(0), "{}\n{}", r.stdout, r.stderr);
    assert!(r.took < Duration::from_secs(26), "took {:?}", r.took);
    let rows = table(&r.stdout);
    let ok: Vec<_> = rows.iter().filter(|l| l.contains(" ok ")).collect();
    let skipped: Vec<_> = rows
        .iter()
        .filter(|l| l.contains("SKIP (budget)"))
        .collect();
    assert!(
        (4..=7).contains(&ok.len()),
        "checks run in 6 s of budget: {rows:#?}"
    );
    assert!(rows[0].starts_with("models/mlp.ron") && rows[0].contains("bf16"));
    // The speed section's first check, gpt-gpu's step, had no time left: not started.
    assert!(
        skipped.iter().any(|l| l.starts_with("gpt-gpu ")),
        "{rows:#?}"
    );
    assert_eq!(ok.len() + skipped.len() + 1, rows.len(), "{rows:#?}"); // + PyTorch's SKIP
                                                                       // What comes back from a GPU machine: the rows and the whole log.
    let out = dir.join("out");
    let saved = std::fs::read_to_string(out.join("gpu-check-rows.txt")).unwrap();
    assert_eq!(saved.lines().count(), rows.len());
    let log = std::fs::read_to_string(out.join("gpu-check.log")).unwrap();
    assert!(log.contains("took ") && log.contains("check "), "{log}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_check_that_fails_without_a_row_fails_the_script() {
    let dir = temp("gpu-script-fail");
    let env = [
        ("BUDGET", "120"),
        ("SECTIONS", "base"),
        ("FAKE_FAIL", "models/cnn.ron"),
    ];
    let r = run_script(&dir, &env);
    assert_eq!(r.code, Some(1), "{}\n{}", r.stdout, r.stderr);
    let rows = table(&r.stdout);
    let failed: Vec<_> = rows.iter().filter(|l| l.contains("FAIL")).collect();
    assert_eq!(failed.len(), 3, "cnn at each precision: {rows:#?}");
    assert!(failed
        .iter()
        .all(|l| l.starts_with("models/cnn.ron") && l.contains("FAIL (exit 3)")));
    // The other checks ran, with their precision in the row (12, and the CUDA graph's).
    assert_eq!(rows.len(), 13, "{rows:#?}");
    assert!(rows
        .iter()
        .any(|l| l.starts_with("models/transformer.ron") && l.contains("tf32")));
    assert!(r.stdout.contains("the stand-in fails here"));
    let _ = std::fs::remove_dir_all(dir);
}
