//! Ranks started by hand with torchrun-style variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`), as `torchrun --no-python parallax train ...` starts them,
//! meeting over TCP through rank 0 (no MPI): the bits of one device, rank 0 alone writing the
//! run; a rank killed mid-run ends the others at once, naming it, and the run resumes. Every
//! process has a hard time limit, so a hang fails the test.

mod common;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(240);

struct Rank {
    child: Child,
    err: std::path::PathBuf,
}

/// `n` ranks of `parallax ARGS` with torchrun's variables; each one's exit code (`None`:
/// killed at the limit) and stderr, and how long the slowest took.
fn ranks(n: usize, args: &[&str], tag: &str) -> (Vec<(Option<i32>, String)>, Duration) {
    ranks_at(n, args, tag, common::job_port(), &[])
}

/// `ranks` with `MASTER_PORT=port` and the variables `env`.
fn ranks_at(
    n: usize,
    args: &[&str],
    tag: &str,
    port: u16,
    env: &[(&str, &str)],
) -> (Vec<(Option<i32>, String)>, Duration) {
    let port = port.to_string();
    let started = Instant::now();
    let mut running: Vec<Rank> = (0..n)
        .map(|r| {
            let err = common::temp(&format!("torchrun-{tag}-{r}.err"));
            let child = Command::new(env!("CARGO_BIN_EXE_parallax"))
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .args(args)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&err).unwrap())
                .spawn()
                .unwrap();
            Rank { child, err }
        })
        .collect();
    let mut codes: Vec<Option<Option<i32>>> = vec![None; n];
    while codes.iter().any(Option::is_none) {
        for (r, rank) in running.iter_mut().enumerate() {
            if codes[r].is_none() {
                if let Some(s) = rank.child.try_wait().unwrap() {
                    codes[r] = Some(s.code());
                }
            }
        }
        if started.elapsed() > LIMIT {
            for (r, rank) in running.iter_mut().enumerate() {
                if codes[r].is_none() {
                    let _ = rank.child.kill();
                    let _ = rank.child.wait();
                    codes[r] = Some(None);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = started.elapsed();
    let out = running
        .iter()
        .zip(codes)
        .map(|(rank, code)| {
            let err = std::fs::read_to_string(&rank.err).unwrap_or_default();
            (code.flatten(), err)
        })
        .collect();
    (out, took)
}

fn final_bytes(dir: &std::path::Path) -> Vec<u8> {
    let path = dir.join("final.safetensors");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn fresh(tag: &str) -> std::path::PathBuf {
    let dir = common::temp(&format!("torchrun-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// One device in one process (`--gpus 1`), the reference.
fn one(model: &str, steps: &str, tag: &str) -> Vec<u8> {
    let dir = fresh(&format!("{tag}-one"));
    let d = dir.to_str().unwrap();
    let (code, err) = common::run_for(&common::one_device(model, steps, d), LIMIT);
    assert_eq!(code, Some(0), "{err}");
    final_bytes(&dir)
}

#[test]
fn torchrun_ranks_train_the_bits_of_one_device() {
    for (model, steps, n, extra) in [
        ("models/mlp.ron", "3", 3, &[][..]),
        ("models/transformer.ron", "2", 2, &["--strategy", "pp2"][..]),
    ] {
        let reference = one(model, steps, "bits");
        let dir = fresh(&format!("bits-{n}"));
        let d = dir.to_str().unwrap();
        let mut args = vec!["train", model, "--steps", steps, "--run-dir", d];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--collective-timeout", "60"]);
        let (out, _) = ranks(n, &args, &format!("bits-{n}"));
        for (r, (code, err)) in out.iter().enumerate() {
            assert_eq!(*code, Some(0), "{model}, rank {r} of {n}: {err}");
        }
        assert!(
            out[0].1.contains("rank(s) under torchrun-style variables"),
            "{}",
            out[0].1
        );
        assert!(
            final_bytes(&dir) == reference,
            "{model} on {n} torchrun ranks: final.safetensors differs from one device's"
        );
    }
}

/// Rank 1 killed (`kill -9`) after step 2: the others exit non-zero at once (their waits on
/// it end when its connection closes), naming it; the newest checkpoint resumes to the
/// bytes of an uninterrupted run, on another count of ranks.
#[test]
fn a_killed_torchrun_rank_ends_the_others_and_the_run_resumes() {
    let model = "models/mlp.ron";
    let reference = one(model, "6", "kill");
    let dir = fresh("kill");
    let d = dir.to_str().unwrap();
    let args = [
        "train",
        model,
        "--steps",
        "6",
        "--run-dir",
        d,
        "--checkpoint-every",
        "1",
        "--collective-timeout",
        "120",
        "--crash-after",
        "1:2",
    ];
    let (out, took) = ranks(3, &args, "kill");
    assert!(took < Duration::from_secs(60), "the job took {took:?}");
    for r in [0, 2] {
        let (code, err) = &out[r];
        assert_eq!(*code, Some(1), "rank {r}: {err}");
        assert!(err.contains("rank 1"), "rank {r}: {err}");
    }
    // Resumed on 2 ranks.
    let (out, _) = ranks(
        2,
        &["train", "--resume", d, "--collective-timeout", "60"],
        "resume",
    );
    for (r, (code, err)) in out.iter().enumerate() {
        assert_eq!(*code, Some(0), "resume, rank {r}: {err}");
    }
    assert!(
        final_bytes(&dir) == reference,
        "the resumed run's bytes differ from an uninterrupted run's"
    );
}

/// Under torchrun its agent holds `MASTER_PORT` for its own store and tells the workers so
/// (`TORCHELASTIC_USE_AGENT_STORE=True`): the ranks meet at the next port.
#[test]
fn under_torchrun_the_ranks_meet_beside_the_agents_store() {
    let reference = one("models/mlp.ron", "2", "agent");
    // The agent's store, listening.
    let port = common::job_port();
    let agent = TcpListener::bind(("0.0.0.0", port)).unwrap();
    let dir = fresh("agent");
    let d = dir.to_str().unwrap();
    let args = ["train", "models/mlp.ron", "--steps", "2", "--run-dir", d];
    let env = [("TORCHELASTIC_USE_AGENT_STORE", "True")];
    let (out, _) = ranks_at(2, &args, "agent", port, &env);
    drop(agent);
    for (r, (code, err)) in out.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {r}: {err}");
    }
    assert!(final_bytes(&dir) == reference);
}
