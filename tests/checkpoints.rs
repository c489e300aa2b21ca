//! Checkpoints and `--resume`: a run killed with SIGKILL at random points and resumed ends
//! with the same bytes as a run never interrupted; damaged or foreign checkpoints are refused.

mod common;
use common::{binary, cli_exits, cli_ok, exits_1, stderr, temp, train_ok};

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

const STEPS: &str = "1200";

fn train_args(dir: &Path) -> Vec<String> {
    [
        "train",
        "models/mlp.ron",
        "--steps",
        STEPS,
        "--checkpoint-every",
        "25",
        "--keep",
        "2",
        "--run-dir",
        dir.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn checkpoint_steps(dir: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(dir.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n.strip_prefix("step-")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_run_killed_at_random_points_resumes_to_the_same_bytes() {
    let whole = temp("whole");
    let o = binary().args(train_args(&whole)).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = std::fs::read(whole.join("final.safetensors")).unwrap();
    let want_metrics = std::fs::read_to_string(whole.join("metrics.jsonl")).unwrap();
    // Only the newest two checkpoints are kept.
    assert_eq!(checkpoint_steps(&whole), vec![1175, 1200]);

    // Kill once the run has passed a checkpoint, plus a few milliseconds that vary per case
    // (so the kill lands anywhere in a step, a validation or a checkpoint write).
    for (i, (after, extra_ms)) in [(100u64, 0u64), (450, 3), (800, 7)].into_iter().enumerate() {
        let dir = temp(&format!("killed{i}"));
        let mut child = binary()
            .args(train_args(&dir))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while checkpoint_steps(&dir).last().copied().unwrap_or(0) < after {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "no checkpoint appeared"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(extra_ms));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        assert!(
            !dir.join("final.safetensors").exists(),
            "case {i}: the run finished before it was killed"
        );
        cli_ok("train --resume", &[dir.to_str().unwrap()]);
        let got = std::fs::read(dir.join("final.safetensors")).unwrap();
        assert!(
            got == want,
            "case {i}: final.safetensors differs after resuming"
        );
        let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        assert_eq!(metrics, want_metrics, "case {i}: metrics differ");
        let record = std::fs::read_to_string(dir.join("run.json")).unwrap();
        assert!(record.contains("\"from_step\""), "{record}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    let _ = std::fs::remove_dir_all(&whole);
}

/// A short run with checkpoints, for the refusal tests.
fn short_run(name: &str, model: &str) -> PathBuf {
    let dir = temp(name);
    train_ok(model, &dir, &["--steps", "20", "--checkpoint-every", "10"]);
    dir
}

fn refused(dir: &Path, expect: &[&str]) {
    let err = cli_exits(
        1,
        "train --resume",
        &[dir.to_str().unwrap(), "--steps", "30"],
    );
    for e in expect {
        assert!(err.contains(e), "expected `{e}` in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn damaged_and_foreign_checkpoints_are_refused() {
    let dir = short_run("damaged", "models/mlp.ron");
    let ckpt = dir.join("checkpoints/step-00000020.safetensors");
    let good = std::fs::read(&ckpt).unwrap();

    // One flipped bit in the tensor data: the checksum catches it.
    let mut bad = good.clone();
    let n = bad.len();
    bad[n - 10] ^= 0x01;
    std::fs::write(&ckpt, &bad).unwrap();
    refused(
        &dir,
        &["step-00000020.safetensors", "checksum", "corrupted"],
    );

    // Truncated, as by a crash of a writer that did not rename atomically.
    std::fs::write(&ckpt, &good[..good.len() / 2]).unwrap();
    refused(
        &dir,
        &["step-00000020.safetensors", "truncated or corrupted"],
    );

    // A checkpoint of another model: the first missing tensor is named.
    let cnn = short_run("cnn", "models/cnn.ron");
    std::fs::copy(cnn.join("checkpoints/step-00000020.safetensors"), &ckpt).unwrap();
    refused(&dir, &["step-00000020.safetensors", "tensor `0.weight`"]);

    // The intact checkpoint resumes and extends the run.
    std::fs::write(&ckpt, &good).unwrap();
    cli_ok("train --resume", &[dir.to_str().unwrap(), "--steps", "30"]);
    let summary = std::fs::read_to_string(dir.join("summary.json")).unwrap();
    assert!(summary.contains("\"steps\": 30"), "{summary}");
    assert!(summary.contains("\"resumed_from\": 20"), "{summary}");

    // No checkpoint at all.
    let none = temp("none");
    train_ok("models/mlp.ron", &none, &["--steps", "3"]);
    refused(&none, &["no checkpoint to resume from"]);
    for d in [dir, cnn, none] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn overrides_are_applied_type_checked_and_recorded() {
    let dir = temp("set");
    cli_ok(
        "train models/mlp.ron --steps 3 --set optimizer.lr=0.05 --set train.batch_size=32 --run-dir",
        &[dir.to_str().unwrap()],
    );
    let exp = std::fs::read_to_string(dir.join("experiment.ron")).unwrap();
    assert!(
        exp.contains("lr: 0.05") && exp.contains("batch_size: 32"),
        "{exp}"
    );
    let record = std::fs::read_to_string(dir.join("run.json")).unwrap();
    assert!(record.contains("optimizer.lr=0.05"), "{record}");
    assert!(record.contains("\"run_id\""), "{record}");
    let _ = std::fs::remove_dir_all(&dir);

    let err = exits_1("train models/mlp.ron --steps 3 --set optimizer.lr=fast");
    assert!(err.contains("--set optimizer.lr=fast"), "{err}");
    let err = exits_1("train models/mlp.ron --steps 3 --set optimiser.lr=1");
    assert!(
        err.contains("no field `optimiser.lr`") && err.contains("optimizer"),
        "{err}"
    );
}

/// A data-parallel run resumes on another device count and ends with the same bytes as one
/// never interrupted; an unsplit run continues data parallel, saying its bits now differ.
#[test]
fn a_data_parallel_run_resumes_on_another_device_count() {
    let whole = temp("dp-whole");
    train_ok("models/mlp.ron", &whole, &["--gpus", "1", "--steps", "12"]);
    let split = temp("dp-split");
    cli_ok(
        "train models/mlp.ron --gpus 2 --steps 6 --checkpoint-every 3 --run-dir",
        &[split.to_str().unwrap()],
    );
    let dir = split.to_str().unwrap();
    cli_ok("train --resume", &[dir, "--steps", "12", "--gpus", "3"]);
    let bytes = |d: &Path| std::fs::read(d.join("final.safetensors")).unwrap();
    assert!(
        bytes(&whole) == bytes(&split),
        "resumed on 3 devices, the bytes differ"
    );
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(split.join("run.json")).unwrap()).unwrap();
    assert_eq!(
        record["resumes"][0]["devices"],
        "3 simulated device(s) on the cpu (dp3.tp1.pp1)"
    );

    // An unsplit run continues data parallel, saying that its bits now differ; from there
    // any device count continues it with the same bits.
    let unsplit = short_run("dp-unsplit", "models/mlp.ron");
    let again = temp("dp-unsplit-again");
    let _ = std::fs::remove_dir_all(&again);
    copy_dir(&unsplit, &again);
    let mut finals = Vec::new();
    for (d, gpus) in [(&unsplit, "2"), (&again, "3")] {
        let dir = d.to_str().unwrap();
        let err = stderr(&cli_ok(
            "train --resume",
            &[dir, "--steps", "30", "--gpus", gpus],
        ));
        assert!(
            err.contains(
                "note: this run trained on one device with its batches unsplit; continuing on"
            ) && err.contains("the bits differ from an uninterrupted run's"),
            "{err}"
        );
        finals.push(bytes(d));
    }
    assert!(
        finals[0] == finals[1],
        "continued on 2 and 3 devices, the bytes differ"
    );
    let _ = std::fs::remove_dir_all(again);
    for d in [whole, split, unsplit] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Checkpoints hold whole tensors: a ZeRO-1 run (state on its owner ranks) resumes on four
/// devices with the same bytes; a tensor-parallel run resumes on another degree (its
/// parameters re-sliced), close to the uninterrupted run.
#[test]
fn sharded_state_resumes_on_another_split() {
    let train = |dir: &Path, args: &[&str]| train_ok("models/transformer.ron", dir, args);
    let resume = |dir: &Path, args: &[&str]| {
        let tail = [&[dir.to_str().unwrap(), "--steps", "4"][..], args].concat();
        stderr(&cli_ok("train --resume", &tail))
    };
    let bytes = |d: &Path| std::fs::read(d.join("final.safetensors")).unwrap();
    let whole = temp("zero-whole");
    train(&whole, &["--gpus", "1", "--steps", "4"]);
    let zero = temp("zero-split");
    let first = [
        "--gpus",
        "2",
        "--strategy",
        "dp2",
        "--zero",
        "1",
        "--steps",
        "2",
    ];
    train(&zero, &[&first[..], &["--checkpoint-every", "2"]].concat());
    resume(&zero, &["--gpus", "4", "--strategy", "dp4", "--zero", "1"]);
    assert!(
        bytes(&whole) == bytes(&zero),
        "ZeRO-1 resumed on 4 devices differs"
    );

    let tp = temp("tp-split");
    let first = ["--gpus", "2", "--strategy", "tp2", "--steps", "2"];
    train(&tp, &[&first[..], &["--checkpoint-every", "2"]].concat());
    let err = resume(&tp, &["--gpus", "4", "--strategy", "tp4"]);
    assert!(err.contains("changes the rounding"), "{err}");
    let loss = |d: &Path| -> f64 {
        let s: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("summary.json")).unwrap())
                .unwrap();
        s["final_train_loss"].as_f64().unwrap()
    };
    let (a, b) = (loss(&whole), loss(&tp));
    assert!((a - b).abs() / a.abs() < 1e-5, "tp2 -> tp4: {a} vs {b}");
    for d in [whole, zero, tp] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A copy of run folder `from` (files and one level of folders) at `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// A run killed after its last checkpoint, before its final files, is finished by `--resume`
/// (validation, final weights, summary: the bytes of the run never killed); a finished run
/// says so and exits 0.
#[test]
fn a_run_stopped_after_its_last_checkpoint_is_finished_by_resume() {
    let whole = short_run("finish-whole", "models/mlp.ron");
    let summary = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("summary.json")).unwrap()).unwrap()
    };
    let want = std::fs::read(whole.join("final.safetensors")).unwrap();
    // As a kill after the step-20 checkpoint leaves it: no final files; once with the last
    // validation logged, once without (the continuation then validates).
    for logged in [true, false] {
        let cut = temp(&format!("finish-cut-{logged}"));
        let _ = std::fs::remove_dir_all(&cut);
        copy_dir(&whole, &cut);
        for f in ["final.safetensors", "summary.json"] {
            std::fs::remove_file(cut.join(f)).unwrap();
        }
        if !logged {
            let metrics = std::fs::read_to_string(cut.join("metrics.jsonl")).unwrap();
            let kept: String = metrics
                .lines()
                .filter(|l| !l.contains("val_loss"))
                .map(|l| format!("{l}\n"))
                .collect();
            std::fs::write(cut.join("metrics.jsonl"), kept).unwrap();
        }
        cli_ok("train --resume", &[cut.to_str().unwrap()]);
        assert!(
            std::fs::read(cut.join("final.safetensors")).unwrap() == want,
            "the finished run's weights differ"
        );
        let (a, b) = (summary(&whole), summary(&cut));
        for k in ["steps", "final_train_loss", "val_loss", "val_accuracy"] {
            assert_eq!(a[k], b[k], "{k}");
        }
        assert_eq!(b["resumed_from"], 20);
        let vals = std::fs::read_to_string(cut.join("metrics.jsonl")).unwrap();
        assert_eq!(vals.matches("val_loss").count(), 1, "{vals}");
        // Finished: said, exit 0, nothing rewritten.
        let err = cli_exits(0, "train --resume", &[cut.to_str().unwrap()]);
        assert!(err.contains("20 steps are all done"), "{err}");
        let _ = std::fs::remove_dir_all(&cut);
    }
    let _ = std::fs::remove_dir_all(&whole);
}

/// A resumed run keeps the ZeRO stage and pipeline schedule it recorded (as data in its
/// run.json) without `--zero` given again.
#[test]
fn a_resumed_run_keeps_its_zero_stage_and_schedule() {
    let dir = temp("keeps-zero");
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    cli_ok(
        "train models/mlp.ron --gpus 2 --zero 2 --steps 4 --checkpoint-every 2 --run-dir",
        &[d],
    );
    cli_ok("train --resume", &[d, "--steps", "6"]);
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap()).unwrap();
    for plan in [&record["plan"], &record["resumes"][0]["plan"]] {
        assert_eq!(plan["zero_stage"], 2, "{record}");
        assert_eq!(plan["schedule"], "none", "{record}");
        assert_eq!(plan["optimizer_shards"], 2, "{record}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
