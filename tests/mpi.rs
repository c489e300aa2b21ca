//! Ranks in separate processes over Open MPI (the `mpi` feature; `scripts/test.sh` installs
//! Open MPI and runs these). Every run has a hard limit, so a hang fails the test, not CI.
#![cfg(feature = "mpi")]

mod common;

use std::process::Command;
use std::time::Duration;

/// `mpirun -np N parallax ARGS` for at most `limit`.
fn mpirun(n: usize, args: &[&str], limit: Duration) -> common::Limited {
    let mut c = Command::new("mpirun");
    // Root in CI; more ranks than cores; no CMA single-copy inside containers.
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .args([
            "--oversubscribe",
            "-np",
            &n.to_string(),
            env!("CARGO_BIN_EXE_parallax"),
        ])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    common::run_limited(c, limit)
}

#[test]
fn the_tree_all_reduce_has_one_devices_bits_on_1_to_4_processes() {
    for n in 1..=4 {
        let common::Limited {
            code,
            stdout: out,
            stderr: err,
            ..
        } = mpirun(
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
    let common::Limited {
        code,
        stderr: err,
        took,
        ..
    } = mpirun(
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
    let common::Limited {
        code,
        stderr: err,
        took,
        ..
    } = mpirun(
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
