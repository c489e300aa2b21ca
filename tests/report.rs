//! `parallax report` and `parallax diff` end to end: three 30-step runs of the embedded-digits
//! MLP (the model as shipped, another seed, another learning rate), trained once for all the
//! tests, and run folders damaged by hand for the error paths.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn parallax(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_parallax"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the binary runs")
}

fn text(o: &Output) -> (String, String) {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    (out, String::from_utf8_lossy(&o.stderr).into_owned())
}

/// Runs the command, expecting success; returns its stdout.
fn ok(args: &[&Path]) -> String {
    let o = parallax(args);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{args:?}\n{out}\n{err}");
    out
}

/// Runs the command, expecting exit code 1 without a panic; returns its stderr.
fn fails(args: &[&Path]) -> String {
    let o = parallax(args);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{args:?}\n{out}\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn p(s: &str) -> &Path {
    Path::new(s)
}

struct Runs {
    tmp: PathBuf,
    base: PathBuf,
    seed: PathBuf,
    lr: PathBuf,
}

fn runs() -> &'static Runs {
    static RUNS: OnceLock<Runs> = OnceLock::new();
    RUNS.get_or_init(|| {
        let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("report");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        // No `--set` override yet: a copy of the experiment with another learning rate (the
        // MLP reads the embedded digits, so the copy needs nothing next to it).
        let mlp = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/mlp.ron");
        let src = std::fs::read_to_string(&mlp).unwrap();
        let changed = src.replace("lr: 5e-3", "lr: 2e-3");
        assert_ne!(src, changed, "models/mlp.ron no longer says `lr: 5e-3`");
        let lr_file = tmp.join("mlp-lr.ron");
        std::fs::write(&lr_file, changed).unwrap();

        let train = |file: &Path, name: &str, extra: &[&Path]| {
            let run = tmp.join(name);
            let mut args = vec![p("train"), file, p("--run-dir"), &run];
            args.extend([p("--steps"), p("30"), p("--backend"), p("cpu")]);
            args.extend(extra);
            ok(&args);
            run
        };
        Runs {
            base: train(&mlp, "base", &[]),
            seed: train(&mlp, "seed", &[p("--seed"), p("3")]),
            lr: train(&lr_file, "lr", &[]),
            tmp: tmp.clone(),
        }
    })
}

/// A fresh folder under the shared temporary one.
fn fresh(name: &str) -> PathBuf {
    let dir = runs().tmp.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn report_writes_a_self_contained_page_and_the_plots() {
    let r = runs();
    let out = r.tmp.join("report-out");
    let printed = ok(&[p("report"), &r.base, &r.seed, p("--out"), &out]);
    for file in ["loss.svg", "accuracy.svg", "report.html"] {
        assert!(
            printed.contains(&*out.join(file).to_string_lossy()),
            "{printed}"
        );
    }

    let html = read(&out.join("report.html"));
    assert!(html.contains("<table class=\"summary\">"), "{html}");
    for field in [
        "final_train_loss",
        "val_accuracy",
        "samples_per_sec",
        "seed",
    ] {
        assert!(html.contains(&format!("<th>{field}</th>")), "{field}");
    }
    // Both runs, by folder name, as columns and in the plots' legends.
    assert!(html.contains("<th>base</th><th>seed</th>"), "{html}");
    assert_eq!(html.matches("<svg").count(), 2);
    // Self-contained: nothing is fetched.
    for external in ["<img", "<link", "<script", "src=", "href="] {
        assert!(!html.contains(external), "{external}");
    }

    let loss = read(&out.join("loss.svg"));
    assert!(loss.starts_with("<svg"), "{}", &loss[..100.min(loss.len())]);
    for label in [
        "base train",
        "base validation",
        "seed train",
        "seed validation",
    ] {
        assert!(loss.contains(label), "legend lacks {label}");
    }
    let accuracy = read(&out.join("accuracy.svg"));
    let texts: Vec<&str> = accuracy.lines().map(str::trim).collect();
    assert!(
        texts.contains(&"base") && texts.contains(&"seed"),
        "legend lacks a run"
    );
    assert!(html.contains(&loss) && html.contains(&accuracy));
}

#[test]
fn report_writes_into_the_first_run_by_default() {
    let r = runs();
    let printed = ok(&[p("report"), &r.lr]);
    assert!(printed.ends_with(&format!("{}\n", r.lr.join("report.html").display())));
    assert!(read(&r.lr.join("report.html")).contains("<th>lr</th>"));
}

/// Copies a run's files into a new folder, for tests that damage or rename them.
fn copy_run(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for file in ["experiment.ron", "metrics.jsonl", "summary.json"] {
        std::fs::copy(from.join(file), to.join(file)).unwrap();
    }
}

#[test]
fn runs_in_folders_of_the_same_name_are_told_apart() {
    let r = runs();
    let dir = fresh("same-name");
    let (a, b) = (dir.join("a/run"), dir.join("b/run"));
    copy_run(&r.base, &a);
    copy_run(&r.seed, &b);
    ok(&[p("report"), &a, &b, p("--out"), &dir]);
    let html = read(&dir.join("report.html"));
    for run in [&a, &b] {
        let label = format!("<th>mlp-digits ({})</th>", run.display());
        assert!(html.contains(&label), "{label}\n{html}");
    }
}

#[test]
fn report_skips_accuracy_without_any_and_tolerates_new_fields() {
    let r = runs();
    let dir = fresh("regression");
    let run = dir.join("run");
    copy_run(&r.base, &run);
    // A regression run: no accuracy; and fields a later version might add.
    let mut summary: serde_json::Value =
        serde_json::from_str(&read(&run.join("summary.json"))).expect("summary.json is JSON");
    summary["val_accuracy"] = serde_json::Value::Null;
    summary["run_id"] = "abc123".into();
    std::fs::write(run.join("summary.json"), summary.to_string()).unwrap();
    let metrics = "{\"step\":1,\"epoch\":0,\"loss\":0.5,\"lr\":0.01}\n\
                   {\"step\":2,\"epoch\":0,\"loss\":0.25,\"lr\":0.01}\n\
                   {\"step\":2,\"epoch\":0,\"val_loss\":0.3,\"val_accuracy\":null}\n\
                   {\"step\":2,\"kind\":\"from the future\"}\n";
    std::fs::write(run.join("metrics.jsonl"), metrics).unwrap();
    ok(&[p("report"), &run]);
    assert!(run.join("loss.svg").exists());
    assert!(!run.join("accuracy.svg").exists());
    let html = read(&run.join("report.html"));
    assert!(html.contains("<th>run_id</th><td>abc123</td>"), "{html}");
    assert!(html.contains("<th>val_accuracy</th><td>-</td>"), "{html}");
}

#[test]
fn diff_lists_a_changed_learning_rate() {
    let r = runs();
    let out = ok(&[p("diff"), &r.base, &r.lr]);
    assert!(out.starts_with("optimizer.lr: 0.005 -> 0.002\n"), "{out}");
    assert!(!out.contains("seed"), "{out}");
    // Then the final metrics side by side, under the runs' names.
    let table = out.split("\n\n").nth(1).expect("a metrics table");
    assert!(table.lines().next().unwrap().contains("base"), "{table}");
    assert!(table.lines().next().unwrap().contains("lr"), "{table}");
    for metric in [
        "final_train_loss",
        "val_loss",
        "val_accuracy",
        "steps",
        "wall_seconds",
    ] {
        assert!(table.contains(metric), "{metric}\n{table}");
    }
    let steps = table.lines().find(|l| l.starts_with("steps")).unwrap();
    assert_eq!(
        steps.split_whitespace().collect::<Vec<_>>(),
        ["steps", "30", "30"]
    );
}

#[test]
fn diff_lists_a_changed_seed() {
    let r = runs();
    let out = ok(&[p("diff"), &r.base, &r.seed]);
    assert!(out.starts_with("train.seed: 42 -> 3\n\n"), "{out}");
}

#[test]
fn diff_of_a_run_with_itself_says_identical() {
    let r = runs();
    let out = ok(&[p("diff"), &r.base, &r.base]);
    assert!(out.starts_with("experiments are identical\n\n"), "{out}");
}

#[test]
fn diff_names_a_changed_variant() {
    let r = runs();
    let dir = fresh("variant");
    copy_run(&r.base, &dir);
    let exp = read(&dir.join("experiment.ron"));
    let sgd = "optimizer: Sgd(lr: 0.1, momentum: 0.9, schedule: Constant),\n    train:";
    let start = exp.find("optimizer:").unwrap();
    let end = exp.find("train:").unwrap();
    let exp = format!("{}{sgd}{}", &exp[..start], &exp[end + "train:".len()..]);
    std::fs::write(dir.join("experiment.ron"), exp.replace("Relu", "Gelu")).unwrap();
    let out = ok(&[p("diff"), &r.base, &dir]);
    // The old optimizer is too long to show whole; the new one is not.
    let expected = "model.layers.1: Relu -> Gelu\n\
                    optimizer: AdamW(..) -> Sgd(lr: 0.1, momentum: 0.9, schedule: Constant)\n\n";
    assert!(out.starts_with(expected), "{out}");
}

#[test]
fn a_missing_run_folder_is_an_error_naming_it() {
    let r = runs();
    let missing = r.tmp.join("no-such-run");
    let err = fails(&[p("report"), &r.base, &missing]);
    assert!(
        err.starts_with(&format!("error: {}: ", missing.display())),
        "{err}"
    );
    let err = fails(&[p("diff"), &missing, &r.base]);
    assert!(
        err.starts_with(&format!("error: {}: ", missing.display())),
        "{err}"
    );
}

#[test]
fn damaged_files_are_errors_naming_them() {
    let r = runs();
    let dir = fresh("damaged");
    copy_run(&r.base, &dir);
    let metrics = dir.join("metrics.jsonl");
    std::fs::write(&metrics, "{\"step\":1,\"loss\":2.3}\n{\"step\":2,\"lo").unwrap();
    let err = fails(&[p("report"), &dir]);
    assert!(
        err.starts_with(&format!("error: {}: line 2", metrics.display())),
        "{err}"
    );

    std::fs::remove_file(&metrics).unwrap();
    let err = fails(&[p("report"), &dir]);
    assert!(
        err.starts_with(&format!("error: {}: ", metrics.display())),
        "{err}"
    );

    let exp = dir.join("experiment.ron");
    std::fs::write(&exp, "Experiment(name: \"x\", train: (seed: 1)").unwrap();
    let err = fails(&[p("diff"), &r.base, &dir]);
    assert!(
        err.starts_with(&format!("error: {}: 1:", exp.display())),
        "{err}"
    );

    let summary = dir.join("summary.json");
    std::fs::write(&summary, "{\"name\": ").unwrap();
    let err = fails(&[p("diff"), &dir, &r.base]);
    assert!(
        err.starts_with(&format!("error: {}: invalid JSON", summary.display())),
        "{err}"
    );
}
