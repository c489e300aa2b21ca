//! Using a trained run: `parallax eval` gives the validation figures training gave, the same on
//! 1, 2 and 3 devices, every sample of `--data` once; `predict`'s probabilities agree with
//! `eval`'s accuracy on the same samples; bad requests are refused with exit 1.

mod common;
use common::{char_model, f32_bytes, i32_bytes, run_args, run_ok, temp_dir, write_npy};

use parallax_runtime::data::digits;
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(300);

fn run(args: &[&str]) -> (Option<i32>, String, String) {
    run_args(args, LIMIT)
}

fn ok(args: &[&str]) -> String {
    run_ok(args, LIMIT)
}

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ok(args)).unwrap()
}

/// The embedded digits as `x.npy` (f32 [n, 64]) and `y.npy` (i32 [n]), the first `n`.
fn digits_npy(dir: &Path, n: usize) -> (String, String, Vec<i32>) {
    let (x, y) = digits::decode().unwrap();
    let (x, y) = (&x[..n * digits::PIXELS], &y[..n]);
    let (xp, yp) = (dir.join("x.npy"), dir.join("y.npy"));
    write_npy(&xp, "<f4", &[n, digits::PIXELS], &f32_bytes(x));
    write_npy(&yp, "<i4", &[n], &i32_bytes(y));
    (
        xp.display().to_string(),
        yp.display().to_string(),
        y.to_vec(),
    )
}

#[test]
fn eval_and_predict_a_trained_classifier() {
    let dir = temp_dir("use-classifier");
    let run_dir = dir.join("run");
    let r = run_dir.to_str().unwrap();
    ok(&["train", "models/mlp.ron", "--steps", "40", "--run-dir", r]);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("summary.json")).unwrap())
            .unwrap();

    // The validation figures training wrote (summary.json keeps them in f32).
    let e = json(&["eval", r, "--format", "json"]);
    let loss = e["loss"].as_f64().unwrap();
    assert!(
        (loss - summary["val_loss"].as_f64().unwrap()).abs() < 1e-6,
        "{e}"
    );
    assert_eq!(e["accuracy"], summary["val_accuracy"], "{e}");
    assert_eq!(e["samples"], 359);
    let top5 = e["top5"].as_f64().unwrap();
    assert!(
        top5 >= e["accuracy"].as_f64().unwrap() && top5 <= 1.0,
        "{e}"
    );
    // Every sample once on any device count: the same figures to the bit on 1, 2 and 3
    // devices (batches cut into micro-shards, summed in a fixed tree), and within rounding of
    // the unsplit batches'.
    let one = json(&["eval", r, "--gpus", "1", "--format", "json"]);
    assert!(
        (one["loss"].as_f64().unwrap() - loss).abs() < 1e-6 * loss,
        "{one}"
    );
    assert_eq!(one["accuracy"], e["accuracy"]);
    for gpus in ["2", "3"] {
        let g = json(&["eval", r, "--gpus", gpus, "--format", "json"]);
        assert_eq!(g, one, "--gpus {gpus}");
    }

    // predict on 200 samples agrees with eval --data on the same samples.
    let (x, y, labels) = digits_npy(&dir, 200);
    let data = format!(r#"Npy(inputs: "{x}", labels: "{y}", validation: 0.0)"#);
    let d = json(&["eval", r, "--data", &data, "--format", "json"]);
    assert_eq!(d["samples"], 200);
    let probs = dir.join("p.npy");
    let p = json(&[
        "predict",
        r,
        &x,
        "--top-k",
        "3",
        "--probabilities",
        probs.to_str().unwrap(),
        "--format",
        "json",
    ]);
    let list = p.as_array().unwrap();
    assert_eq!(list.len(), 200);
    let hits = list
        .iter()
        .zip(&labels)
        .filter(|(row, &l)| row["top"][0]["class"] == l)
        .count();
    assert_eq!(hits as f64 / 200.0, d["accuracy"].as_f64().unwrap());
    // The probabilities file: 200 rows of 10 that sum to 1, its top-1 the listed one.
    let bytes = std::fs::read(&probs).unwrap();
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(header.contains("'shape': (200, 10)"), "{header}");
    let v: Vec<f32> = bytes[10 + header_len..]
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for (row, listed) in v.chunks(10).zip(list) {
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        let p0 = listed["top"][0]["probability"].as_f64().unwrap() as f32;
        assert_eq!(row.iter().cloned().fold(0f32, f32::max), p0);
    }
    // CSV: a header and a line per input.
    let csv = ok(&["predict", r, &x, "--top-k", "2"]);
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(
        lines[0],
        "input,label_1,probability_1,label_2,probability_2"
    );
    assert_eq!(lines.len(), 201);
    assert!(lines[1].starts_with(&format!("{x}[0],")), "{}", lines[1]);

    // Refusals: exit 1 and a message that names the problem.
    let bad = |args: &[&str], says: &str| {
        let (code, _, err) = run(args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    };
    bad(&["eval", r, "--step", "7"], "no checkpoint at step 7");
    bad(&["eval", dir.to_str().unwrap()], "no experiment.ron");
    let wrong = dir.join("wrong.npy");
    write_npy(&wrong, "<f4", &[2, 3], &f32_bytes(&[0.0; 6]));
    bad(
        &["predict", r, wrong.to_str().unwrap()],
        "neither that nor a list of it",
    );
    bad(
        &["predict", r, "Cargo.toml"],
        "inputs are read from .npy, .csv or image files",
    );
    let png = dir.join("x.png");
    std::fs::write(&png, b"not decoded").unwrap();
    bad(
        &["predict", r, png.to_str().unwrap()],
        "images are read for a model trained on an image folder",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tokenize_train_eval_and_sample_a_language_model() {
    let dir = temp_dir("use-lm");
    let text = "abcdefghijklmnopqrstuvwxyz\n".repeat(300);
    let input = dir.join("input.txt");
    std::fs::write(&input, &text).unwrap();
    let prefix = dir.join("letters");
    let p = prefix.to_str().unwrap();
    ok(&[
        "tokenize",
        input.to_str().unwrap(),
        "--tokenizer",
        "chars",
        "--out",
        p,
    ]);
    let exp = char_model(&dir, p, 27);
    let run_dir = dir.join("run");
    let r = run_dir.to_str().unwrap();
    ok(&["train", &exp, "--run-dir", r]);

    // Perplexity is exp of the mean loss per token; 20 windows of 16 tokens.
    let e = json(&["eval", r, "--format", "json"]);
    assert_eq!(e["samples"], 20);
    assert_eq!(e["tokens"], 320);
    let loss = e["loss"].as_f64().unwrap();
    assert!((e["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-12);
    let val = common::metric(&run_dir, "val_loss");
    assert!((loss - val[val.len() - 1]).abs() < 1e-6, "{loss} {val:?}");
    // The alphabet is learnt: the next letter is predicted almost always.
    assert!(e["accuracy"].as_f64().unwrap() > 0.9, "{e}");
    // --data: every window of another file, once: (810 - 1) / 16 = 50 of the validation file.
    let data = format!(r#"Tokens(train: "{p}_val.bin")"#);
    let d = json(&["eval", r, "--data", &data, "--format", "json"]);
    assert_eq!(d["samples"], 50, "{d}");

    // Greedy sampling continues the alphabet; a seed gives the same text twice.
    let greedy = ok(&[&["sample", r][..], common::GREEDY_ABC].concat());
    assert!(
        greedy.starts_with("abcdefghijklmnopqrstuvwxyz\nabcdef"),
        "{greedy:?}"
    );
    let drawn = |seed: &str| {
        ok(&[
            "sample",
            r,
            "--prompt",
            "k",
            "--max-new-tokens",
            "40",
            "--seed",
            seed,
            "--temperature",
            "1.5",
        ])
    };
    assert_eq!(drawn("1"), drawn("1"));
    assert_ne!(drawn("1"), drawn("2"));
    // Ids the tokenizer lacks, and a classifier, are refused.
    let (code, _, err) = run(&["sample", r, "--prompt", "ABC"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--prompt"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
