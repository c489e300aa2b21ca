//! Parallax against PyTorch: the fixtures under `tests/reference/` (written by
//! `tests/reference/make.py` with PyTorch; this test needs none) are trained from PyTorch's
//! weights (`--init init.safetensors`, PyTorch's names and shapes) on the same batches, on one
//! device unsplit and on every partitioned grid, and every step's loss and every final tensor
//! (parameters and BatchNorm's running statistics) are compared with PyTorch's.
//!
//! Tolerances: a loss within 1e-5 of PyTorch's, relative; a tensor within 1e-4, relative to
//! the tensor's largest magnitude: `max |a - b| / max(max |b|, f32::MIN_POSITIVE)`. A tensor's
//! scale rather than each element's, because float32 rounding is relative to the magnitudes
//! that were summed, not to an element that happens to end near zero (a per-element ratio
//! there measures cancellation, not disagreement). `final.safetensors` must also hold exactly
//! PyTorch's names and shapes (its `num_batches_tracked` aside, which Parallax does not keep).
//!
//! `cargo test --test reference -- --nocapture` prints the largest differences per grid.

mod common;
use common::{f32_tensors as tensors, metric, parallax, scaled_difference, stderr, temp};

use std::path::Path;

const LOSS_TOL: f64 = 1e-5;
const TENSOR_TOL: f64 = 1e-4;

/// The grids every case trains on: none (one device, batches unsplit), then the partitioned
/// plans of README "Several devices".
const GRIDS: &[&[&str]] = &[
    &[],
    &["--gpus", "1"],
    &["--gpus", "2"],
    &["--gpus", "3"],
    &["--gpus", "2", "--strategy", "pp2"],
    &["--gpus", "4", "--strategy", "dp2.pp2"],
    &["--gpus", "2", "--zero", "1"],
    &["--gpus", "2", "--zero", "2"],
    &["--gpus", "2", "--zero", "3"],
];

/// Tensor-parallel grids, for the cases with Attention or Mlp layers.
const TP_GRIDS: &[&[&str]] = &[
    &["--gpus", "2", "--strategy", "tp2"],
    &["--gpus", "4", "--strategy", "dp2.tp2"],
    &["--gpus", "8", "--strategy", "dp2.tp2.pp2"],
    &["--gpus", "4", "--strategy", "dp2.tp2", "--zero", "2"],
    &["--gpus", "4", "--strategy", "dp2.tp2", "--zero", "3"],
];

fn reference_losses(dir: &Path) -> Vec<f64> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("losses.json")).unwrap()).unwrap();
    v["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Trains `case` on every grid; returns the table's lines and what failed.
fn check(case: &str, tensor_parallel: bool) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/reference")
        .join(case);
    let want_losses = reference_losses(&dir);
    let want = tensors(&dir.join("final.safetensors"));
    let steps = want_losses.len().to_string();
    let exp = format!("tests/reference/{case}/experiment.ron");
    let init = format!("tests/reference/{case}/init.safetensors");
    let grids = GRIDS
        .iter()
        .chain(if tensor_parallel { TP_GRIDS } else { &[] });
    let mut table = vec![format!(
        "{case:<10} {:<44} {:>9} {:>5}  {:>9}  tensor",
        "grid", "loss", "step", "tensors"
    )];
    let mut failed = Vec::new();
    for (i, grid) in grids.enumerate() {
        let run = temp(&format!("reference-{case}-{i}"));
        let run_s = run.to_str().unwrap();
        let mut args = vec![
            "train",
            &exp,
            "--init",
            &init,
            "--steps",
            &steps,
            "--run-dir",
            run_s,
        ];
        args.extend_from_slice(grid);
        let label = if grid.is_empty() {
            "one device, unsplit".to_string()
        } else {
            grid.join(" ")
        };
        let out = parallax(&args);
        if !out.status.success() {
            failed.push(format!(
                "{case} [{label}]: the run failed: {}",
                stderr(&out)
            ));
            continue;
        }
        let got_losses = metric(&run, "loss");
        assert_eq!(got_losses.len(), want_losses.len(), "{case} [{label}]");
        let (loss_step, loss_diff) = got_losses
            .iter()
            .zip(&want_losses)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-30))
            .enumerate()
            .fold((0, 0.0), |w, (s, d)| if d > w.1 { (s + 1, d) } else { w });
        let got = tensors(&run.join("final.safetensors"));
        let names: Vec<&String> = got.keys().collect();
        assert_eq!(
            names,
            want.keys().collect::<Vec<_>>(),
            "{case} [{label}]: final.safetensors names differ from PyTorch's state_dict"
        );
        let mut worst = (String::new(), 0.0f64);
        for (name, (shape, v)) in &got {
            let (want_shape, w) = &want[name];
            assert_eq!(
                shape, want_shape,
                "{case} [{label}]: `{name}` has shape {shape:?}, PyTorch's is {want_shape:?}"
            );
            let d = scaled_difference(v, w);
            if d > worst.1 || worst.0.is_empty() {
                worst = (name.clone(), d);
            }
        }
        table.push(format!(
            "{case:<10} {label:<44} {loss_diff:>9.2e} {loss_step:>5}  {:>9.2e}  {}",
            worst.1, worst.0
        ));
        if loss_diff > LOSS_TOL {
            failed.push(format!(
                "{case} [{label}]: step {loss_step}'s loss is {loss_diff:.3e} from PyTorch's (relative; tolerance {LOSS_TOL:e})"
            ));
        }
        if worst.1 > TENSOR_TOL {
            failed.push(format!(
                "{case} [{label}]: `{}` is {:.3e} from PyTorch's (relative; tolerance {TENSOR_TOL:e})",
                worst.0, worst.1
            ));
        }
        let _ = std::fs::remove_dir_all(&run);
    }
    println!("{}\n", table.join("\n"));
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// Linear, LayerNorm, Gelu, Dropout(0), RmsNorm, Tanh, Sigmoid, Mlp; label smoothing; AdamW
/// with active clipping and a cosine schedule after warm-up.
#[test]
fn mlp() {
    check("mlp", true);
}

/// Strided and grouped Conv2d, BatchNorm2d (affine and not), MaxPool2d, AvgPool2d with
/// padding, Flatten; label smoothing; SGD with Nesterov momentum, weight decay, active
/// clipping and a step schedule.
#[test]
fn cnn() {
    check("cnn", false);
}

/// Embedding, PositionalEmbedding, repeated blocks of LayerNorm, causal Attention, Mlp and
/// residuals; ignored labels varying in count per sample, with label smoothing; Adam with L2
/// decay, active clipping and a linear schedule after warm-up.
#[test]
fn gpt() {
    check("gpt", true);
}

/// Permute, Linear, Sigmoid, Mul, Concat, Reshape, Transpose, Softmax over another axis, Add,
/// Flatten; MSE; plain SGD with weight decay, active clipping and a warm-up schedule.
#[test]
fn mse() {
    check("mse", false);
}

/// Attention without mask or biases, RmsNorm, Mlp without biases; SGD with momentum, a
/// constant rate, no clipping.
#[test]
fn attention() {
    check("attention", true);
}

/// Each case is a test above, and each test's fixture is complete.
/// The gated Mlp (SwiGLU: LLaMA's MLP, its parameter names) with and without biases and a
/// standalone SiLU; AdamW with active clipping and a linear schedule; also tensor parallel.
#[test]
fn swiglu() {
    check("swiglu", true);
}

#[test]
fn every_fixture_is_tested() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference");
    let mut cases: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    cases.sort();
    assert_eq!(cases, ["attention", "cnn", "gpt", "mlp", "mse", "swiglu"]);
    for c in &cases {
        for f in [
            "experiment.ron",
            "init.safetensors",
            "final.safetensors",
            "losses.json",
            "x.npy",
            "y.npy",
        ] {
            assert!(
                root.join(c).join(f).exists(),
                "tests/reference/{c}/{f} is missing (python3 tests/reference/make.py)"
            );
        }
    }
}
