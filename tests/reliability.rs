//! Never a panic or an abort: closed and full standard streams, absurd numbers on the
//! command line (step and epoch counts past any budget, batches past any memory), each
//! either refused with exit 1 and a message, or run.

mod common;
use common::{binary, cli_ok, parallax, run_for, temp, temp_dir, train_ok, write_experiment};

use std::io::Read;
use std::process::Stdio;
use std::time::Duration;

#[test]
fn a_full_stdout_is_an_error_not_a_panic() {
    let full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap()
    };
    for args in [
        &["check", "models/mlp.ron"][..],
        &["compile", "models/transformer.ron", "--emit", "ir"],
        &["compile", "models/mlp.ron", "--gpus", "2", "--explain"],
    ] {
        let o = binary().args(args).stdout(full()).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("cannot write to standard output") && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
    // `diff` of two runs, to a full stdout.
    let (a, b) = (temp("full-a"), temp("full-b"));
    for (dir, seed) in [(&a, "1"), (&b, "2")] {
        train_ok("models/mlp.ron", dir, &["--steps", "2", "--seed", seed]);
    }
    let o = binary()
        .args(["diff", a.to_str().unwrap(), b.to_str().unwrap()])
        .stdout(full())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    // A training run writes its run first: the run is whole, the exit code says what failed.
    let c = temp("full-train");
    let o = binary()
        .args(["train", "models/mlp.ron", "--steps", "2", "--run-dir"])
        .arg(&c)
        .stdout(full())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(c.join("final.safetensors").exists());
    for d in [a, b, c] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// `parallax compile ... | head -1`: the reader goes away after one line.
#[test]
fn a_closed_pipe_ends_the_output_quietly() {
    for (args, stream) in [
        (
            &["compile", "models/transformer.ron", "--emit", "ir"][..],
            1,
        ),
        (
            &["train", "models/mlp.ron", "--steps", "30", "--run-dir"],
            2,
        ),
    ] {
        let run = temp(&format!("pipe-{stream}"));
        let mut cmd = binary();
        cmd.args(args);
        if stream == 2 {
            cmd.arg(&run);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Read one byte of the stream under test, then close it.
        let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let mut first = [0u8; 1];
        let mut kept = String::new();
        if stream == 1 {
            out.read_exact(&mut first).unwrap();
            drop(out);
            err.read_to_string(&mut kept).unwrap();
        } else {
            err.read_exact(&mut first).unwrap();
            drop(err);
            out.read_to_string(&mut kept).unwrap();
        }
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "{args:?}: {kept}");
        assert!(!kept.contains("panicked"), "{kept}");
        if stream == 2 {
            // Training went on to the end with nobody reading its progress.
            assert!(run.join("final.safetensors").exists());
        }
        let _ = std::fs::remove_dir_all(run);
    }
}

/// Every numeric argument and `--set` value, at the edges of its type: exit 0, 1 or 2 with
/// a message, or still training when stopped; never a panic, an abort or a signal.
#[test]
fn no_number_on_the_command_line_panics() {
    let numbers = [
        "0",
        "1",
        "-1",
        "3.5",
        "1e400",
        "4294967296",
        "1000000000000",
        "2305843009213693952",
        "9223372036854775808",
        "18446744073709551615",
        "18446744073709551616",
        "NaN",
    ];
    let run = temp("numbers");
    let run_dir = run.to_str().unwrap();
    let mut cases: Vec<Vec<String>> = Vec::new();
    for n in numbers {
        for flag in [
            "--steps",
            "--epochs",
            "--seed",
            "--checkpoint-every",
            "--gpus",
        ] {
            cases.push(vec![flag.into(), n.into()]);
        }
        for field in [
            "train.batch_size",
            "train.steps",
            "optimizer.lr",
            "devices.micro_shards",
            "params.hidden",
        ] {
            cases.push(vec!["--set".into(), format!("{field}={n}")]);
        }
    }
    for extra in cases {
        let mut args = vec!["train", "models/mlp.ron", "--run-dir", run_dir];
        args.extend(extra.iter().map(String::as_str));
        let (code, err) = run_for(&args, Duration::from_secs(3));
        assert!(
            matches!(code, None | Some(0..=2)) && !err.contains("panicked"),
            "{extra:?}: exit {code:?}\n{err}"
        );
        if code == Some(1) || code == Some(2) {
            assert!(err.contains("error"), "{extra:?}: no message\n{err}");
        }
        let _ = std::fs::remove_dir_all(&run);
    }
}

/// A batch past the machine's memory is refused before anything is allocated, with the
/// plan's memory table and a hint.
#[test]
fn a_plan_larger_than_the_machine_is_refused_before_allocating() {
    for (file, set, gpus) in [
        ("models/mlp.ron", "train.batch_size=1000000000", None),
        ("models/transformer.ron", "train.batch_size=100000000", None),
        ("models/mlp.ron", "train.batch_size=100000000", Some("2")),
    ] {
        let run = temp("too-big");
        let mut args = vec!["train", file, "--set", set, "--steps", "1"];
        args.extend(["--run-dir", run.to_str().unwrap()]);
        if let Some(n) = gpus {
            args.extend(["--gpus", n, "--gpu-memory", "1000000TB"]);
        }
        let (code, err) = run_for(&args, Duration::from_secs(60));
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(
            err.contains("of memory")
                && err.contains("available")
                && err.contains("total at the peak")
                && err.contains("hint"),
            "{args:?}: {err}"
        );
        assert!(!run.join("final.safetensors").exists());
        let _ = std::fs::remove_dir_all(run);
    }
}

/// A run on data files given relative to the experiment resumes: the run's own
/// `experiment.ron` records them absolute (it used to look for them in the run folder).
#[test]
fn a_run_on_relative_data_files_resumes() {
    let dir = temp("relative-data");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    let mut csv = String::new();
    for i in 0..40 {
        let x: Vec<String> = (0..4)
            .map(|j| format!("{}", ((i * 7 + j * 3) % 11) as f32 / 10.0))
            .collect();
        csv += &format!("{},{}\n", x.join(","), i % 3);
    }
    std::fs::write(dir.join("data/points.csv"), csv).unwrap();
    let file = write_experiment(
        &dir.join("exp.ron"),
        r#"Experiment(
    name: "relative",
    model: Sequential(input: (shape: [4]), layers: [Linear(out: 3)]),
    loss: CrossEntropy,
    data: Csv(path: "data/points.csv", validation: 0.0),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 8, steps: 4, seed: 1),
)"#,
    );
    let run = dir.join("run");
    train_ok(&file, &run, &["--checkpoint-every", "2"]);
    cli_ok("train --resume", &[run.to_str().unwrap(), "--steps", "6"]);
    let recorded = std::fs::read_to_string(run.join("experiment.ron")).unwrap();
    let data = dir.join("data/points.csv");
    assert!(recorded.contains(data.to_str().unwrap()), "{recorded}");
    let _ = std::fs::remove_dir_all(dir);
}

/// More GPUs than any split can use: the refusal says why each kind of split cannot run
/// (it used to say "no GPUs to plan for (asked for 0)").
#[test]
fn gpus_no_split_can_use_are_refused_with_the_reasons() {
    let compile = ["compile", "models/mlp.ron", "--gpus", "256"];
    let train = ["train", "models/mlp.ron", "--gpus", "256", "--steps", "1"];
    for args in [&compile[..], &train[..]] {
        let (cmd, o) = (args[0], parallax(args));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {err}");
        assert!(
            err.contains("cannot be split over 256 GPUs")
                && err.contains("dp256: dp 256 > the batch size 64")
                && err.contains("no attention"),
            "{cmd}: {err}"
        );
    }
}

/// A file larger than the memory left (here under `ulimit -v`) is refused with both sizes
/// before it is read.
#[test]
fn a_file_larger_than_the_memory_left_is_refused_with_its_size() {
    let dir = temp_dir("huge-init");
    let huge = dir.join("huge.safetensors");
    // Sparse: no disk is used.
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let o = std::process::Command::new("bash")
        .arg("-c")
        .arg("ulimit -v 600000; exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_parallax"))
        .args(["train", "models/mlp.ron", "--steps", "1", "--init"])
        .arg(&huge)
        .args(["--run-dir", dir.join("run").to_str().unwrap()])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the file is 1.00 GiB, more than the") && err.contains("available"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
