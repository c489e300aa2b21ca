//! `parallax train` end to end: accuracy on the embedded digits, the run directory, bitwise
//! reproducibility, `--init`, and a transformer learning a sequence task.

mod common;
use common::{cli_exits, cli_ok, temp, temp_dir, train_ok};

use std::path::Path;

fn train(file: &str, run: &Path, extra: &[&str]) -> serde_json::Value {
    train_ok(file, run, extra);
    serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap()
}

fn metrics(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The README's main job: the MLP on the embedded digits, default settings.
#[test]
fn mlp_learns_the_digits_and_writes_its_run() {
    let run = temp("mlp");
    let s = train("models/mlp.ron", &run, &[]);
    let acc = s["val_accuracy"].as_f64().unwrap();
    assert!(acc >= 0.95, "validation accuracy {acc}");
    assert_eq!(s["steps"], 690); // 30 epochs of ceil(1438 / 64) batches
    for key in [
        "final_train_loss",
        "val_loss",
        "samples_per_sec",
        "step_time_ms_median",
        "data_wait_seconds",
        "data_wait_share",
        "wall_seconds",
    ] {
        assert!(
            s[key].as_f64().is_some_and(|v| v.is_finite() && v >= 0.0),
            "{key}: {s}"
        );
    }
    // One line per step, and the validation of each of the 30 epochs.
    let m = metrics(&run);
    let steps: Vec<&serde_json::Value> = m.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 690);
    assert_eq!(steps[0]["step"], 1);
    let first = steps[0]["loss"].as_f64().unwrap();
    assert!(
        (first - 10f64.ln()).abs() < 0.3,
        "an untrained 10-class loss is about ln 10: {first}"
    );
    assert_eq!(
        m.iter().filter(|l| l.get("val_accuracy").is_some()).count(),
        30
    );
    // The resolved experiment parses back, every default written out.
    cli_ok("check", &[run.join("experiment.ron").to_str().unwrap()]);
    let text = std::fs::read_to_string(run.join("experiment.ron")).unwrap();
    assert!(
        text.contains("weight_decay: 0.01") && text.contains("drop_last: false"),
        "{text}"
    );
    // The weights are named after the layers, in PyTorch's layouts.
    let bytes = std::fs::read(run.join("final.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header["0.weight"]["shape"], serde_json::json!([128, 64]));
    assert_eq!(header["3.bias"]["shape"], serde_json::json!([10]));
    assert_eq!(header["0.weight"]["dtype"], "F32");
    let _ = std::fs::remove_dir_all(run);
}

#[test]
fn the_same_seed_gives_the_same_bits() {
    let (a, b, c) = (temp("det-a"), temp("det-b"), temp("det-c"));
    for r in [&a, &b] {
        train("models/cnn.ron", r, &["--steps", "30"]);
    }
    train("models/cnn.ron", &c, &["--steps", "30", "--seed", "8"]);
    let losses = |r: &Path| -> Vec<f64> {
        metrics(r)
            .iter()
            .filter_map(|l| l.get("loss").and_then(|v| v.as_f64()))
            .collect()
    };
    assert_eq!(losses(&a), losses(&b));
    assert_ne!(losses(&a), losses(&c));
    let w = |r: &Path| std::fs::read(r.join("final.safetensors")).unwrap();
    assert_eq!(w(&a), w(&b));
    assert_ne!(w(&a), w(&c));
    for r in [a, b, c] {
        let _ = std::fs::remove_dir_all(r);
    }
}

#[test]
fn init_starts_from_saved_weights_and_refuses_mismatches() {
    let (a, b) = (temp("init-a"), temp("init-b"));
    train("models/mlp.ron", &a, &["--epochs", "10"]);
    let weights = a.join("final.safetensors");
    train(
        "models/mlp.ron",
        &b,
        &["--steps", "1", "--init", weights.to_str().unwrap()],
    );
    let first = |r: &Path| metrics(r)[0]["loss"].as_f64().unwrap();
    // A trained start has a far lower first loss than a fresh one (about ln 10).
    assert!(first(&b) < 0.6, "{}", first(&b));
    // The CNN has other parameters: refused, naming the file and the tensor.
    let c = temp("init-c");
    let err = cli_exits(
        1,
        "train models/cnn.ron --run-dir",
        &[c.to_str().unwrap(), "--init", weights.to_str().unwrap()],
    );
    assert!(
        err.contains("final.safetensors") && err.contains("tensor `0.weight`"),
        "{err}"
    );
    for r in [a, b, c] {
        let _ = std::fs::remove_dir_all(r);
    }
}

/// A GPT-style decoder reads 8 tokens and writes them reversed.
#[test]
fn a_transformer_learns_to_reverse_sequences() {
    let dir = temp_dir("reverse");
    let file = dir.join("reverse.ron");
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/models/transformer.ron"
    ))
    .unwrap()
    .replace("\"d\": 64", "\"d\": 48")
    .replace("\"vocab\": 16", "\"vocab\": 8")
    .replace("\"seq\": 32", "\"seq\": 16")
    .replace(
        "length: 16, vocab: 16, samples: 8192",
        "length: 8, vocab: 8, samples: 4096",
    )
    .replace("steps: 2000", "steps: 500");
    std::fs::write(&file, text).unwrap();
    let run = dir.join("run");
    let s = train(file.to_str().unwrap(), &run, &[]);
    let acc = s["val_accuracy"].as_f64().unwrap();
    assert!(acc >= 0.99, "token accuracy {acc}");
    let _ = std::fs::remove_dir_all(dir);
}
