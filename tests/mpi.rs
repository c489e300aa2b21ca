//! Ranks in separate processes over Open MPI (the `mpi` feature; `scripts/test.sh` installs
//! Open MPI and runs these). Every run has a hard limit, so a hang fails the test, not CI.
#![cfg(feature = "mpi")]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{mpirun, mpirun_command};

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
    // A rank may hear of it from another rank that heard first (under load, rank 2 waiting
    // on rank 0 hears it from rank 0), so each names the failed rank, not whom it waited on.
    assert!(
        err.lines()
            .any(|l| l.contains("all-reduce stopped waiting for rank")
                && l.contains("rank 1 failed")),
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

/// `parallax ARGS` in this process's way (`--gpus N` or unsplit), for at most `limit`.
fn alone(args: &[&str], limit: Duration) -> common::Limited {
    let mut c = common::binary();
    c.args(args).current_dir(env!("CARGO_MANIFEST_DIR"));
    common::run_limited(c, limit)
}

fn final_bytes(dir: &std::path::Path) -> Vec<u8> {
    let path = dir.join("final.safetensors");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

const LIMIT: Duration = Duration::from_secs(300);

/// That no rank of the job writing `dir` is still running (mpirun ended them all).
fn no_rank_left(dir: &std::path::Path) {
    let o = Command::new("pgrep")
        .args([
            "-f",
            &format!(
                "{} train .*{}",
                env!("CARGO_BIN_EXE_parallax"),
                dir.display()
            ),
        ])
        .output()
        .unwrap();
    let left = String::from_utf8_lossy(&o.stdout);
    assert!(left.trim().is_empty(), "ranks left behind: {left}");
}

/// `parallax train MODEL --steps STEPS` on `n` processes (and `extra`), into a fresh folder.
fn train_ranks(
    n: usize,
    model: &str,
    steps: &str,
    extra: &[&str],
    tag: &str,
) -> std::path::PathBuf {
    let dir = common::temp(&format!("mpi-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    let mut args = vec![
        "train",
        model,
        "--steps",
        steps,
        "--run-dir",
        dir.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--collective-timeout", "60"]);
    let r = mpirun(n, &args, LIMIT);
    assert_eq!(r.code, Some(0), "{tag}: {}", r.stderr);
    dir
}

/// One device in one process (`--gpus 1`: the per-shard plan), the reference.
fn train_one(model: &str, steps: &str, tag: &str) -> std::path::PathBuf {
    let dir = common::temp(&format!("mpi-{tag}-one"));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let r = alone(&common::one_device(model, steps, d), LIMIT);
    assert_eq!(r.code, Some(0), "{tag}: {}", r.stderr);
    dir
}

/// Each model on 1 to 4 processes (the cost model's split), and pipeline and ZeRO splits
/// across processes: `final.safetensors` byte for byte that of one device in one process;
/// rank 0 alone wrote the run folder (the others' folders do not exist).
#[test]
fn every_count_of_processes_trains_the_bits_of_one_device() {
    for (model, steps) in [
        ("models/mlp.ron", "6"),
        ("models/cnn.ron", "3"),
        ("models/transformer.ron", "2"),
    ] {
        let name = std::path::Path::new(model)
            .file_stem()
            .unwrap()
            .to_str()
            .unwrap();
        let one = train_one(model, steps, name);
        let want = final_bytes(&one);
        for n in 1..=4 {
            let dir = train_ranks(n, model, steps, &[], &format!("{name}-{n}"));
            assert!(
                final_bytes(&dir) == want,
                "{model} on {n} process(es): other bytes"
            );
            let record: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap())
                    .unwrap();
            let devices = record["devices"].as_str().unwrap();
            assert!(
                devices.starts_with(&format!("{n} rank(s) in separate processes")),
                "{devices}"
            );
            let _ = std::fs::remove_dir_all(dir);
        }
        let _ = std::fs::remove_dir_all(one);
    }
    let one = train_one("models/mlp.ron", "6", "mlp-split");
    let want = final_bytes(&one);
    for (n, extra) in [
        (2, &["--strategy", "pp2"][..]),
        (4, &["--strategy", "dp2.pp2"][..]),
        (2, &["--strategy", "dp2", "--zero", "1"][..]),
        (2, &["--strategy", "dp2", "--zero", "2"][..]),
        (3, &["--strategy", "dp3", "--zero", "3"][..]),
    ] {
        let tag = format!("mlp-{}", extra.join("-").replace("--", ""));
        let dir = train_ranks(n, "models/mlp.ron", "6", extra, &tag);
        assert!(final_bytes(&dir) == want, "{tag}: other bytes");
        let _ = std::fs::remove_dir_all(dir);
    }
    let _ = std::fs::remove_dir_all(one);
}

/// Tensor parallelism across processes: the bits of the same split in one process, and
/// within 1e-5 of one device (the row-parallel sums round in another order).
#[test]
fn tensor_parallel_processes_match_the_threads_and_come_close_to_one_device() {
    let model = "models/transformer.ron";
    let one = train_one(model, "2", "tp");
    let threads = common::temp("mpi-tp-threads");
    let _ = std::fs::remove_dir_all(&threads);
    let t = threads.to_str().unwrap();
    let args = [
        "train",
        model,
        "--steps",
        "2",
        "--gpus",
        "2",
        "--strategy",
        "tp2",
        "--run-dir",
        t,
    ];
    let r = alone(&args, LIMIT);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let ranks = train_ranks(2, model, "2", &["--strategy", "tp2"], "tp2");
    assert!(
        final_bytes(&ranks) == final_bytes(&threads),
        "tp2: processes and threads differ"
    );
    let (a, b) = (
        common::f32_tensors(&ranks.join("final.safetensors")),
        common::f32_tensors(&one.join("final.safetensors")),
    );
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, (shape, v)) in &a {
        assert_eq!(shape, &b[name].0, "{name}");
        let d = common::scaled_difference(v, &b[name].1);
        assert!(d < 1e-5, "{name}: tp2 differs from one device by {d:e}");
    }
    for d in [one, threads, ranks] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A rank killed (`kill -9`) after a step: the job ends within the time limit, mpirun naming
/// the rank; the newest checkpoint is whole, and `--resume` on 3 processes ends with the
/// bytes of a run never interrupted. The steps are drawn from a seeded generator, printed.
#[test]
fn a_killed_rank_ends_the_job_and_the_run_resumes_on_three_processes() {
    let model = "models/mlp.ron";
    let steps = 10u64;
    let one = train_one(model, &steps.to_string(), "kill");
    let want = final_bytes(&one);
    // A small LCG: the steps differ from one kill to the next but never between runs.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut draw = |below: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % below
    };
    for kill in 0..3 {
        let rank = draw(4) as usize;
        // After the first checkpoint (step 2), before the last step.
        let step = 3 + draw(steps - 4);
        eprintln!("kill {kill}: rank {rank} after step {step}");
        let dir = common::temp(&format!("mpi-kill-{kill}"));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.to_str().unwrap();
        let crash = format!("{rank}:{step}");
        let args = [
            "train",
            model,
            "--steps",
            &steps.to_string(),
            "--checkpoint-every",
            "2",
            "--run-dir",
            d,
            "--collective-timeout",
            "20",
            "--crash-after",
            &crash,
        ];
        let r = mpirun(4, &args, Duration::from_secs(120));
        assert!(
            matches!(r.code, Some(c) if c != 0),
            "exit {:?}: {}",
            r.code,
            r.stderr
        );
        assert!(
            r.stderr.contains(&format!("process rank {rank} ")) && r.stderr.contains("signal 9"),
            "mpirun does not name rank {rank}:\n{}",
            r.stderr
        );
        assert!(r.took < Duration::from_secs(60), "took {:?}", r.took);
        no_rank_left(&dir);
        assert!(!dir.join("final.safetensors").exists());
        let r = mpirun(3, &["train", "--resume", d], LIMIT);
        assert_eq!(r.code, Some(0), "resume after kill {kill}: {}", r.stderr);
        assert!(
            final_bytes(&dir) == want,
            "kill {kill}: the resumed run's bytes differ"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
    let _ = std::fs::remove_dir_all(one);
}

/// Ranks that run different experiments refuse to start, every one with the same message,
/// and write nothing.
#[test]
fn ranks_that_disagree_on_the_experiment_all_refuse() {
    let dir = common::temp("mpi-disagree");
    let _ = std::fs::remove_dir_all(&dir);
    // mpirun's MPMD form: rank 0 and rank 1 run different seeds.
    let d = dir.to_str().unwrap();
    let bin = env!("CARGO_BIN_EXE_parallax");
    let side = |seed: &'static str| {
        vec![
            "-np",
            "1",
            bin,
            "train",
            "models/mlp.ron",
            "--steps",
            "2",
            "--seed",
            seed,
            "--run-dir",
            d,
        ]
    };
    let mut c = mpirun_command();
    c.args(side("1")).arg(":").args(side("2"));
    let r = common::run_limited(c, Duration::from_secs(120));
    assert!(
        matches!(r.code, Some(c) if c != 0),
        "exit {:?}: {}",
        r.code,
        r.stderr
    );
    let line = "the ranks disagree: rank 0 read an experiment with hash";
    assert!(r.stderr.contains(line), "{}", r.stderr);
    assert!(!dir.exists(), "a refused job wrote {}", dir.display());
}

/// `--gpus` under a launcher must be the world's size.
#[test]
fn gpus_other_than_the_world_size_is_refused() {
    let r = mpirun(
        2,
        &["train", "models/mlp.ron", "--steps", "1", "--gpus", "3"],
        Duration::from_secs(120),
    );
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr
            .contains("--gpus 3 differs from the 2 rank(s) mpirun started"),
        "{}",
        r.stderr
    );
}

/// A rank that stops answering mid-run: the others give up after the collective timeout,
/// naming the step, the collective and the rank; mpirun then ends the silent one (it would
/// sleep an hour), so the job is over in seconds.
#[test]
fn a_rank_that_stops_answering_mid_run_ends_the_job_naming_it() {
    let dir = common::temp("mpi-stall");
    let _ = std::fs::remove_dir_all(&dir);
    let args = [
        "train",
        "models/mlp.ron",
        "--steps",
        "10",
        "--run-dir",
        dir.to_str().unwrap(),
        "--collective-timeout",
        "3",
        "--stall-after",
        "2:5",
    ];
    let r = mpirun(3, &args, Duration::from_secs(120));
    assert!(
        matches!(r.code, Some(c) if c != 0),
        "exit {:?}: {}",
        r.code,
        r.stderr
    );
    let line = "error: training step 5: rank 0: vote waited 3s for rank 2, which never arrived";
    assert!(r.stderr.contains(line), "{}", r.stderr);
    assert!(r.took < Duration::from_secs(60), "took {:?}", r.took);
    no_rank_left(&dir);
    let _ = std::fs::remove_dir_all(dir);
}

/// Two network namespaces joined by a veth pair: two hosts on one machine, each with its
/// own address, removed when dropped.
struct TwoHosts {
    names: [String; 2],
    addresses: [String; 2],
    folder: std::path::PathBuf,
}

/// Runs `ip ARGS`, failing the test with what `ip` said (this test needs root and
/// iproute2: `scripts/test.sh` installs it).
fn ip(args: &[&str]) {
    let o = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `ip {}`: {e}", args.join(" ")));
    assert!(
        o.status.success(),
        "`ip {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
}

impl TwoHosts {
    fn new() -> TwoHosts {
        let id = std::process::id();
        let names = [format!("px{id}a"), format!("px{id}b")];
        // A subnet of this process's own, so that runs side by side do not meet.
        let net = format!("10.{}.{}", 100 + id % 100, id / 100 % 250);
        let addresses = [format!("{net}.1"), format!("{net}.2")];
        let veth = [format!("pv{id}a"), format!("pv{id}b")];
        let hosts = TwoHosts {
            names: names.clone(),
            addresses: addresses.clone(),
            folder: common::temp("mpi-two-hosts"),
        };
        for n in &names {
            ip(&["netns", "add", n]);
        }
        ip(&[
            "link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1],
        ]);
        for i in 0..2 {
            let (n, v) = (&names[i], &veth[i]);
            ip(&["link", "set", v, "netns", n]);
            ip(&[
                "-n",
                n,
                "addr",
                "add",
                &format!("{}/24", addresses[i]),
                "dev",
                v,
            ]);
            ip(&["-n", n, "link", "set", v, "up"]);
            ip(&["-n", n, "link", "set", "lo", "up"]);
        }
        std::fs::create_dir_all(&hosts.folder).unwrap();
        // Open MPI's rsh agent: `agent HOST COMMAND...` runs COMMAND in HOST's namespace.
        let cases: String = (0..2)
            .map(|i| format!("  {}) ns={} ;;\n", addresses[i], names[i]))
            .collect();
        let agent = format!(
            "#!/bin/sh\nhost=$1; shift\ncase \"$host\" in\n{cases}  *) echo \"agent: no host $host\" >&2; exit 1 ;;\nesac\nexec ip netns exec \"$ns\" /bin/sh -c \"$*\"\n"
        );
        let path = hosts.folder.join("agent");
        std::fs::write(&path, agent).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        let hostfile = format!("{} slots=1\n{} slots=1\n", addresses[0], addresses[1]);
        std::fs::write(hosts.folder.join("hosts"), hostfile).unwrap();
        hosts
    }

    /// `mpirun PROGRAM ARGS` started on the first host, one rank on each, over TCP between
    /// them.
    fn mpirun(&self, program: &str, args: &[&str], limit: Duration) -> common::Limited {
        let net = format!("{}/24", self.addresses[0]);
        let mut c = mpirun_command();
        c.args(["-np", "2", "--hostfile"])
            .arg(self.folder.join("hosts"))
            .args(["--mca", "plm_rsh_agent"])
            .arg(self.folder.join("agent"))
            .args(["--mca", "btl", "tcp,self"])
            .args(["--mca", "btl_tcp_if_include", &net])
            .args(["--mca", "oob_tcp_if_include", &net])
            .arg(program)
            .args(args);
        // mpirun itself runs on the first host.
        let program = c.get_program().to_owned();
        let rest: Vec<_> = c.get_args().map(|a| a.to_owned()).collect();
        let envs: Vec<_> = c
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
            .collect();
        let mut inside = Command::new("ip");
        inside
            .args(["netns", "exec", &self.names[0]])
            .arg(program)
            .args(rest)
            .envs(envs)
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        common::run_limited(inside, limit)
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        // The veth pair goes with its namespaces.
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

/// Two hosts on one machine (network namespaces joined by a veth pair, mpirun reaching the
/// second through an rsh agent that enters its namespace): each rank on its own host, over
/// TCP; the ranks report their namespaces, and training has the bits of one device.
#[test]
fn two_hosts_joined_by_a_veth_pair_train_the_bits_of_one_device() {
    let hosts = TwoHosts::new();
    let limit = Duration::from_secs(180);
    let script = "echo rank $OMPI_COMM_WORLD_RANK in $(ip netns identify $$)";
    let r = hosts.mpirun("sh", &["-c", script], limit);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    for (rank, ns) in hosts.names.iter().enumerate() {
        let line = format!("rank {rank} in {ns}");
        assert!(r.stdout.contains(&line), "no `{line}` in {}", r.stdout);
    }
    let bin = env!("CARGO_BIN_EXE_parallax");
    let probe = hosts.mpirun(bin, &["comm-check", "--timeout", "30"], limit);
    assert_eq!(probe.code, Some(0), "{}", probe.stderr);
    assert!(
        probe
            .stdout
            .contains("all-reduce over 9 shards on 2 rank(s): the bits of one device"),
        "{}",
        probe.stdout
    );
    let one = train_one("models/mlp.ron", "6", "two-hosts");
    let dir = hosts.folder.join("run");
    let d = dir.to_str().unwrap();
    let args = ["train", "models/mlp.ron", "--steps", "6", "--run-dir", d];
    let r = hosts.mpirun(bin, &args, limit);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(
        final_bytes(&dir) == final_bytes(&one),
        "two hosts: other bytes"
    );
    let _ = std::fs::remove_dir_all(one);
}

/// SIGTERM to one rank stops every rank after the same step, with a checkpoint (the ranks
/// vote after each step); `--resume` then ends with the bytes of a run never interrupted.
#[test]
fn a_signal_to_one_rank_stops_the_job_after_one_step_with_a_checkpoint() {
    let (model, steps) = ("models/cnn.ron", "300");
    let one = train_one(model, steps, "signal");
    let dir = common::temp("mpi-signal");
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap().to_string();
    let bin = env!("CARGO_BIN_EXE_parallax");
    let mut c = mpirun_command();
    c.args([
        "-np",
        "2",
        bin,
        "train",
        model,
        "--steps",
        steps,
        "--run-dir",
        &d,
    ]);
    let mut job = common::Running::spawn(c);
    let metrics = dir.join("metrics.jsonl");
    job.wait_until(Duration::from_secs(120), || {
        std::fs::read_to_string(&metrics).is_ok_and(|m| m.lines().count() >= 5)
    });
    // The ranks' processes, not mpirun's (whose arguments name the folder too).
    let pgrep = Command::new("pgrep")
        .args(["-f", &format!("^{bin} train {model} .*{d}")])
        .output()
        .unwrap();
    let pids: Vec<i32> = String::from_utf8_lossy(&pgrep.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert_eq!(pids.len(), 2, "the ranks' pids: {pids:?}");
    // SAFETY: kill(2) on a process this test started has no memory effects.
    assert_eq!(unsafe { libc::kill(pids[1], libc::SIGTERM) }, 0);
    let code = job.exit_code(Duration::from_secs(120));
    let err = job.stderr();
    assert_eq!(code, Some(143), "{err}");
    assert!(err.contains("stopped by SIGTERM after step"), "{err}");
    assert!(!dir.join("final.safetensors").exists());
    let r = mpirun(2, &["train", "--resume", &d], LIMIT);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(
        final_bytes(&dir) == final_bytes(&one),
        "resumed after the signal: other bytes"
    );
    for d in [dir, one] {
        let _ = std::fs::remove_dir_all(d);
    }
}
