//! The CUDA backend's command line on a machine without a GPU (as CI is): clear refusals,
//! never panics; and the PTX emission that needs no GPU. The child's environment hides any
//! GPU (`CUDA_VISIBLE_DEVICES` empty), so on a GPU machine these check the same path.

use std::process::{Command, Output};

fn parallax(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_parallax"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        // Hide any GPU, so the test means the same on every machine.
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .expect("the binary runs")
}

/// Runs the words of `line`, which must exit 1; returns stderr.
fn exits_1(line: &str) -> String {
    let o = parallax(&line.split_whitespace().collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{err}");
    err
}

#[test]
fn train_on_cuda_without_a_gpu_exits_1_with_a_clear_message() {
    let err = exits_1("train models/mlp.ron --backend cuda --steps 1");
    assert!(
        err.contains("models/mlp.ron: error: --backend cuda:"),
        "{err}"
    );
    assert!(
        err.contains("libcuda") || err.contains("no usable GPU"),
        "{err}"
    );
    assert!(err.contains("--backend cpu"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn devices_says_why_no_gpu_is_usable() {
    let o = parallax(&["devices"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("no usable GPU"), "{out}");
    assert!(out.contains("CPU backend"), "{out}");
}

#[test]
fn gpu_check_without_a_gpu_exits_1() {
    let err = exits_1("gpu-check models/mlp.ron --steps 1");
    assert!(err.contains("error:") && !err.contains("panicked"), "{err}");
}

#[test]
fn comm_check_on_cuda_without_a_gpu_exits_1_before_any_rank_waits() {
    // Without mpirun too: the GPU is looked for first, so a machine without one (or a build
    // without MPI) fails at once, on every rank alike.
    let t = std::time::Instant::now();
    let err = exits_1("comm-check --backend cuda --timeout 5");
    assert!(err.contains("error: comm-check --backend cuda:"), "{err}");
    assert!(
        err.contains("libcuda") || err.contains("no usable GPU"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn compile_emits_one_ptx_file_per_kernel_and_a_manifest() {
    let dir = std::env::temp_dir().join(format!("parallax-ptx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().to_string();
    let o = parallax(&["compile", "models/mlp.ron", "--emit", "ptx", "--out", &d]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let entries = manifest["entries"].as_array().unwrap();
    let kernels = manifest["kernels"].as_array().unwrap();
    assert!(entries.len() >= 3, "{manifest}");
    // Its four parameters' updates are one grouped kernel.
    assert_eq!(kernels.len(), 12, "the mlp plan has 12 kernels");
    for e in entries {
        let text = std::fs::read_to_string(dir.join(e.as_str().unwrap())).unwrap();
        assert!(text.starts_with(".version 8.0\n.target sm_80\n"), "{text}");
        assert!(text.contains(".visible .entry"), "{text}");
    }
    // Every kernel names its fused ops and its launches (a PTX entry or a GEMM).
    for k in kernels {
        assert!(!k["ops"].as_array().unwrap().is_empty(), "{k}");
        assert!(!k["launches"].as_array().unwrap().is_empty(), "{k}");
    }
    let o = parallax(&["compile", "models/mlp.ron", "--emit", "ptx"]);
    assert_eq!(o.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `compile --emit ptx --precision P` writes the kernels `train --precision P` runs: bf16
/// attention on tensor cores (heads of width 64), staged straight from bf16 when the plan
/// stores activations in bf16; the default (tf32) keeps the f32 attention kernels.
#[test]
fn emitted_ptx_follows_the_precision_train_runs() {
    let mma_entries = |extra: &[&str], tag: &str| -> (usize, usize) {
        let dir = std::env::temp_dir().join(format!("parallax-ptx-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.to_string_lossy().to_string();
        let mut args = vec!["compile", "benches/models/transformer.ron", "--emit", "ptx"];
        args.extend_from_slice(&["--out", &d]);
        args.extend_from_slice(extra);
        let o = parallax(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let texts: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "ptx"))
            .map(|e| std::fs::read_to_string(e.path()).unwrap())
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        let mma: Vec<&String> = texts.iter().filter(|t| t.contains("mma.sync")).collect();
        let from_bf16 = mma
            .iter()
            .filter(|t| t.contains("ld.global.nc.v2.b32"))
            .count();
        (mma.len(), from_bf16)
    };
    assert_eq!(mma_entries(&[], "tf32"), (0, 0));
    assert_eq!(mma_entries(&["--precision", "bf16"], "bf16"), (3, 0));
    let stored = ["--precision", "bf16", "--set", "devices.activations=Bf16"];
    assert_eq!(mma_entries(&stored, "bf16-stored"), (3, 3));
}
