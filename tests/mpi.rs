//! Ranks in separate processes over Open MPI (the `mpi` feature; `scripts/test.sh` installs
//! Open MPI and runs these). Every run has a hard limit, so a hang fails the test, not CI.
#![cfg(feature = "mpi")]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `mpirun -np N parallax ARGS` for at most `limit`: exit code (`None`: killed at the limit),
/// stdout, stderr, and how long it ran.
fn mpirun(n: usize, args: &[&str], limit: Duration) -> (Option<i32>, String, String, Duration) {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (out_file, err_file) = (
        common::temp(&format!("mpi-out-{k}")),
        common::temp(&format!("mpi-err-{k}")),
    );
    let np = n.to_string();
    let mut child = Command::new("mpirun")
        // Root in CI; more ranks than cores; no CMA single-copy inside containers.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .args([
            "--oversubscribe",
            "-np",
            &np,
            env!("CARGO_BIN_EXE_parallax"),
        ])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(std::fs::File::create(&out_file).unwrap())
        .stderr(std::fs::File::create(&err_file).unwrap())
        .stdin(Stdio::null())
        .spawn()
        .expect("mpirun runs (scripts/test.sh installs Open MPI)");
    let start = Instant::now();
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if start.elapsed() > limit {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = start.elapsed();
    let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap_or_default();
    let (out, err) = (read(&out_file), read(&err_file));
    let _ = (
        std::fs::remove_file(out_file),
        std::fs::remove_file(err_file),
    );
    (code, out, err, took)
}

#[test]
fn the_tree_all_reduce_has_one_devices_bits_on_1_to_4_processes() {
    for n in 1..=4 {
        let (code, out, err, _) = mpirun(
            n,
            &["comm-check", "--timeout", "30"],
            Duration::from_secs(120),
        );
        assert_eq!(code, Some(0), "{n} rank(s): {err}");
        for leaves in 1..=9 {
            let line =
                format!("all-reduce over {leaves} shards on {n} rank(s): the bits of one device");
            assert!(out.contains(&line), "{n} rank(s): no `{line}` in\n{out}");
        }
        assert!(
            out.contains("reduce, broadcast and a ring of sends: as sent"),
            "{out}"
        );
        assert!(
            out.contains(&format!("barrier and failure flag on {n} rank(s): ok")),
            "{out}"
        );
    }
}

#[test]
fn a_failing_rank_ends_the_others_at_once_naming_it() {
    // The others would wait a minute for it; they stop as soon as it says it failed.
    let (code, _, err, took) = mpirun(
        3,
        &["comm-check", "--timeout", "60", "--fail-rank", "1"],
        Duration::from_secs(120),
    );
    assert!(matches!(code, Some(c) if c != 0), "exit {code:?}: {err}");
    assert!(
        err.contains("all-reduce stopped waiting for rank 1: rank 1 failed"),
        "{err}"
    );
    assert!(took < Duration::from_secs(40), "took {took:?}");
}

#[test]
fn a_rank_that_stops_answering_times_the_others_out_naming_it() {
    let (code, _, err, took) = mpirun(
        2,
        &["comm-check", "--timeout", "2", "--hang-rank", "1"],
        Duration::from_secs(120),
    );
    assert!(matches!(code, Some(c) if c != 0), "exit {code:?}: {err}");
    assert!(
        err.contains("rank 0: all-reduce waited 2s for rank 1, which never arrived"),
        "{err}"
    );
    // mpirun ends the silent rank too (it would sleep 6 s): the job is over well before.
    assert!(took < Duration::from_secs(30), "took {took:?}");
}
