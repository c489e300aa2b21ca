//! A run folder is one run's alone: refused when it is a file, someone else's files or
//! another run, held against a second `train`; a resume takes only the run's own checkpoint,
//! experiment and data, and checkpoints as the run did; write errors and signals stop the
//! run with a message, the files whole, and (for signals) a checkpoint to resume from.

mod common;
use common::{
    argv, cli_exits, f32_bytes, i32_bytes, parallax, stderr, temp, temp_dir, write_npy, Running,
};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn refused(args: &[&str], expect: &[&str]) {
    let o = parallax(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
    for e in expect {
        assert!(err.contains(e), "{args:?}: expected `{e}` in: {err}");
    }
}

fn train(args: &[&str]) {
    let o = parallax(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.lines().count())
}

fn checkpoints(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn record(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap()).unwrap()
}

#[test]
fn a_file_a_foreign_folder_and_another_run_are_refused() {
    let base = temp_dir("refusals");
    let file = base.join("passwd");
    std::fs::write(&file, "root:x:0:0\n").unwrap();
    let mlp = ["train", "models/mlp.ron", "--steps", "2", "--run-dir"];
    refused(
        &[&mlp[..], &[s(&file)]].concat(),
        &["is a file, not a folder"],
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "root:x:0:0\n");

    // The user's own files, named like a run's, are not overwritten.
    let own = base.join("own");
    std::fs::create_dir_all(&own).unwrap();
    std::fs::write(own.join("summary.json"), "mine").unwrap();
    refused(
        &[&mlp[..], &[s(&own)]].concat(),
        &[
            "not a Parallax run (`summary.json`)",
            "choose a new or empty folder",
        ],
    );
    assert_eq!(
        std::fs::read_to_string(own.join("summary.json")).unwrap(),
        "mine"
    );
    refused(&["train", "--resume", s(&own)], &["experiment.ron"]);

    let run = base.join("run");
    train(&[&mlp[..], &[s(&run)]].concat());
    refused(
        &[&mlp[..], &[s(&run)]].concat(),
        &["already holds a run", "--resume"],
    );

    // --accept-changes belongs to --resume.
    let err = cli_exits(2, "train models/mlp.ron --steps 1 --accept-changes", &[]);
    assert!(err.contains("--accept-changes continues a run with --resume"));

    // A run that cannot start leaves no folder behind.
    let never = base.join("never");
    refused(
        &[&mlp[..], &[s(&never), "--init", s(&file)]].concat(),
        &["passwd"],
    );
    assert!(!never.exists());
    let _ = std::fs::remove_dir_all(&base);
}

/// The second `train` in a held folder is refused naming the first one's pid; SIGTERM then
/// stops the first after its step, with a checkpoint, exit 143.
#[test]
fn a_held_folder_is_refused_and_sigterm_stops_with_a_checkpoint() {
    let dir = temp("held");
    let mut first = Running::start(&argv(
        "train models/mlp.ron --steps 1000000 --run-dir",
        &[s(&dir)],
    ));
    let metrics = dir.join("metrics.jsonl");
    first.wait_until(LIMIT, || lines(&metrics) > 3);
    refused(
        &argv("train models/mlp.ron --steps 2 --run-dir", &[s(&dir)]),
        &[&format!(
            "in use by another `parallax train` (pid {})",
            first.child.id()
        )],
    );
    first.signal(libc::SIGTERM);
    assert_eq!(first.exit_code(LIMIT), Some(143), "{}", first.stderr());
    let err = first.stderr();
    assert!(err.contains("stopped by SIGTERM after step"), "{err}");
    assert!(
        err.contains(&format!("parallax train --resume {}", s(&dir))),
        "{err}"
    );
    let saved = checkpoints(&dir);
    assert_eq!(saved.len(), 1, "{saved:?}");
    // The stopped run reports its curves so far, a line torn by a crash left out.
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.push_str("{\"epoch\":3,\"lo");
    std::fs::write(&metrics, text).unwrap();
    let o = parallax(&["report", s(&dir)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(dir.join("report.html").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGINT: the step finishes, a checkpoint and whole metrics are written, exit 130, and the
/// resumed run ends with the bytes of one never interrupted. A second SIGINT during a long
/// step ends the process at once, without waiting for the step.
#[test]
fn sigint_stops_after_the_step_and_the_run_resumes_to_the_same_bytes() {
    let base = temp("sigint");
    let steps = "3000";
    let whole = base.join("whole");
    let line = format!("train models/mlp.ron --steps {steps} --run-dir");
    train(&argv(&line, &[s(&whole)]));

    let dir = base.join("stopped");
    let mut run = Running::start(&argv(&line, &[s(&dir)]));
    let metrics = dir.join("metrics.jsonl");
    run.wait_until(LIMIT, || lines(&metrics) > 20);
    run.signal(libc::SIGINT);
    assert_eq!(run.exit_code(LIMIT), Some(130), "{}", run.stderr());
    let err = run.stderr();
    assert!(err.contains("stopped by SIGINT after step"), "{err}");
    assert!(
        !dir.join("final.safetensors").exists(),
        "the run finished first"
    );
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert!(text.ends_with('\n'), "a torn metrics line");
    let saved = checkpoints(&dir);
    let step: u64 = saved[0]["step-".len()..saved[0].len() - ".safetensors".len()]
        .parse()
        .unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(
        last["step"].as_u64(),
        Some(step),
        "metrics end at the checkpoint"
    );
    train(&["train", "--resume", s(&dir)]);
    assert!(
        std::fs::read(dir.join("final.safetensors")).unwrap()
            == std::fs::read(whole.join("final.safetensors")).unwrap(),
        "the resumed run's weights differ"
    );
    assert_eq!(
        std::fs::read_to_string(&metrics).unwrap(),
        std::fs::read_to_string(whole.join("metrics.jsonl")).unwrap()
    );

    // Steps of about a second: the second signal lands inside one.
    let slow = base.join("slow");
    let mut run = Running::start(&argv(
        "train models/transformer.ron --set train.batch_size=512 --run-dir",
        &[s(&slow)],
    ));
    let metrics = slow.join("metrics.jsonl");
    run.wait_until(LIMIT, || lines(&metrics) >= 1);
    run.signal(libc::SIGINT);
    std::thread::sleep(Duration::from_millis(100));
    run.signal(libc::SIGINT);
    assert_eq!(
        run.exit_code(Duration::from_secs(5)),
        Some(130),
        "{}",
        run.stderr()
    );
    assert!(!run.stderr().contains("stopped by"), "{}", run.stderr());
    let _ = std::fs::remove_dir_all(&base);
}

/// A short MLP run with a checkpoint every 10 steps.
fn short_run(dir: &Path, seed: &str) {
    let line = format!("train models/mlp.ron --steps 20 --seed {seed} --checkpoint-every 10");
    train(&argv(&line, &["--run-dir", s(dir)]));
}

#[test]
fn a_resume_takes_only_the_run_s_own_checkpoint_budget_and_experiment() {
    let base = temp("identity");
    let (dir, other) = (base.join("run"), base.join("other"));
    short_run(&dir, "1");
    short_run(&other, "2");
    let newest = dir.join("checkpoints/step-00000020.safetensors");
    let good = std::fs::read(&newest).unwrap();
    let resume = ["train", "--resume", s(&dir), "--steps", "30"];

    // Another run of the same model, same step.
    std::fs::copy(other.join("checkpoints/step-00000020.safetensors"), &newest).unwrap();
    refused(
        &resume,
        &["step-00000020.safetensors was written by another run"],
    );
    // The run's own checkpoint, renamed: the step it records wins over its name.
    std::fs::write(&newest, &good).unwrap();
    let renamed = dir.join("checkpoints/step-00000025.safetensors");
    std::fs::copy(&newest, &renamed).unwrap();
    refused(&resume, &["named for step 25 but records step 20"]);
    std::fs::remove_file(&renamed).unwrap();
    // A budget the checkpoint has passed.
    refused(
        &["train", "--resume", s(&dir), "--steps", "10"],
        &[
            "newest checkpoint is at step 20, past the 10 steps asked for",
            "--steps N, N > 20",
        ],
    );
    // A finished run says so, and that is no failure.
    let err = cli_exits(0, "train --resume", &[s(&dir)]);
    assert!(err.contains("all done"), "{err}");

    // An edited experiment: refused, or taken with --accept-changes and recorded.
    let exp = dir.join("experiment.ron");
    let text = std::fs::read_to_string(&exp).unwrap();
    assert!(text.contains("lr: 0.005,"), "{text}");
    std::fs::write(&exp, text.replace("lr: 0.005,", "lr: 0.004,")).unwrap();
    refused(&resume, &["its experiment.ron changed", "--accept-changes"]);
    train(&[&resume[..], &["--accept-changes"]].concat());
    let r = record(&dir);
    assert_eq!(
        r["resumes"][0]["accepted_changes"],
        serde_json::json!(["experiment"])
    );
    // The run's cadence carried on without --checkpoint-every; the changed run continues.
    assert_eq!(
        checkpoints(&dir),
        [
            "step-00000010.safetensors",
            "step-00000020.safetensors",
            "step-00000030.safetensors"
        ]
    );
    train(&["train", "--resume", s(&dir), "--steps", "40"]);
    assert_eq!(
        checkpoints(&dir).last().unwrap(),
        "step-00000040.safetensors"
    );
    assert!(record(&dir)["resumes"][1]["accepted_changes"].is_null());
    let _ = std::fs::remove_dir_all(&base);
}

fn write_data(dir: &Path, shift: f32) {
    let x: Vec<f32> = (0..64)
        .map(|i| ((i * 7) % 13) as f32 / 13.0 + shift)
        .collect();
    let y: Vec<i32> = (0..16).map(|i| i % 2).collect();
    write_npy(&dir.join("x.npy"), "<f4", &[16, 4], &f32_bytes(&x));
    write_npy(&dir.join("y.npy"), "<i4", &[16], &i32_bytes(&y));
}

fn npy_experiment(dir: &Path, labels: &str) -> PathBuf {
    let file = dir.join("exp.ron");
    std::fs::write(
        &file,
        format!(
            r#"Experiment(
    name: "npy",
    model: Sequential(input: (shape: [4]), layers: [Linear(out: 2)]),
    loss: CrossEntropy,
    data: Npy(inputs: "x.npy", labels: "{labels}", validation: 0.0),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 4, steps: 4, seed: 1, shuffle: false),
)"#
        ),
    )
    .unwrap();
    file
}

#[test]
fn a_resume_refuses_data_that_changed() {
    let base = temp_dir("data-changed");
    write_data(&base, 0.0);
    let file = npy_experiment(&base, "y.npy");
    let run = base.join("run");
    train(&[
        "train",
        s(&file),
        "--checkpoint-every",
        "2",
        "--run-dir",
        s(&run),
    ]);
    write_data(&base, 0.5);
    let resume = ["train", "--resume", s(&run), "--steps", "6"];
    refused(&resume, &["its data", "changed since the run was written"]);
    train(&[&resume[..], &["--accept-changes"]].concat());
    assert_eq!(
        record(&run)["resumes"][0]["accepted_changes"],
        serde_json::json!(["data"])
    );
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_batch_whose_labels_are_all_ignored_is_reported() {
    let base = temp_dir("all-ignored");
    write_data(&base, 0.0);
    // The second batch of four (in file order) has no counted label.
    let y: Vec<i32> = (0..16)
        .map(|i| if (4..8).contains(&i) { -100 } else { i % 2 })
        .collect();
    write_npy(&base.join("ignored.npy"), "<i4", &[16], &i32_bytes(&y));
    let file = npy_experiment(&base, "ignored.npy");
    let run = base.join("run");
    let o = parallax(&["train", s(&file), "--steps", "8", "--run-dir", s(&run)]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("step 2: every label of this batch is ignored (-100)"),
        "{err}"
    );
    assert_eq!(err.matches("every label").count(), 1, "{err}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["batches_without_labels"], 2);
    let _ = std::fs::remove_dir_all(&base);
}

/// A file-size limit (`ulimit -f`, as a full disk would) fails a checkpoint, then the
/// metrics: each stops the run with exit 1 naming the file, and leaves no temporary behind.
#[test]
fn write_errors_stop_the_run_naming_the_file() {
    let base = temp_dir("write-errors");
    let limited = |kib: u32, args: &[&str]| {
        // SIGXFSZ ignored, so a write past the limit fails with EFBIG instead of killing.
        let o = Command::new("bash")
            .arg("-c")
            .arg(format!("trap '' XFSZ; ulimit -f {kib}; exec \"$0\" \"$@\""))
            .arg(env!("CARGO_BIN_EXE_parallax"))
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        (o.status.code(), stderr(&o))
    };
    // A checkpoint of the MLP is about 116 KB.
    let ckpt = base.join("checkpoint");
    let line = "train models/mlp.ron --steps 40 --checkpoint-every 20 --run-dir";
    let (code, err) = limited(64, &argv(line, &[s(&ckpt)]));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("checkpoints/step-00000020.safetensors: File too large"),
        "{err}"
    );
    assert!(checkpoints(&ckpt).is_empty(), "{:?}", checkpoints(&ckpt));
    // The metrics and the event file grow by about 100 bytes a step each.
    let logs = base.join("logs");
    let line = "train models/mlp.ron --steps 2000 --run-dir";
    let (code, err) = limited(16, &argv(line, &[s(&logs)]));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(s(&logs)) && err.contains("File too large"),
        "{err}"
    );
    assert!(!logs.join("final.safetensors").exists());
    let _ = std::fs::remove_dir_all(&base);
}
