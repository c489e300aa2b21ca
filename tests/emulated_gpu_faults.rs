//! What the emulated GPU must catch in the CUDA path, and gpu-check's variants there. Bugs
//! planted on purpose (`PARALLAX_PLANT_BUG`, read by the runtime for tests only) must fail:
//! a launch parameter dropped, a graph's stream not joined before the host reads the step,
//! a synchronous copy inside a capture; each beside the same run without the bug. A plan
//! too large for the device is refused before anything is allocated. gpu-check passes with
//! every GEMM on cuBLAS (`PARALLAX_CUBLASLT=0`) and without the bias epilogue
//! (`PARALLAX_GEMM_BIAS=0`), and CUDA graph replays give the direct launches' bytes.

mod common;

use common::emulated_gpu::on_emulated_gpu_with;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(300);
const PLANT: &str = "PARALLAX_PLANT_BUG";

/// `gpu-check models/<model>.ron` at `precision` for 2 steps with `more` and `env`: its
/// exit code and output.
fn gpu_check(model: &str, precision: &str, more: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let file = format!("models/{model}.ron");
    let mut args = vec!["gpu-check", &file, "--precision", precision];
    args.extend_from_slice(&["--steps", "2", "--time-steps", "1"]);
    args.extend_from_slice(more);
    let r = on_emulated_gpu_with(&args, env, LIMIT);
    let all = format!("{}{}", r.stdout, r.stderr);
    assert!(!all.contains("panicked"), "{all}");
    (r.code.unwrap_or(-1), all)
}

/// `train models/<model>.ron --backend cuda` for `steps` steps with `env`, validating on 2%
/// of the data (the interpreter's time goes to training): its exit code, output and
/// `final.safetensors` (empty if it wrote none).
fn train(tag: &str, model: &str, steps: &str, env: &[(&str, &str)]) -> (i32, String, Vec<u8>) {
    let dir = common::temp(&format!("emulated-gpu-faults-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    let file = format!("models/{model}.ron");
    let args = [
        "train",
        &file,
        "--backend",
        "cuda",
        "--steps",
        steps,
        "--set",
        "data.validation=0.02",
        "--run-dir",
        dir.to_str().unwrap(),
    ];
    let r = on_emulated_gpu_with(&args, env, LIMIT);
    let all = format!("{}{}", r.stdout, r.stderr);
    assert!(!all.contains("panicked"), "{tag}: {all}");
    let bytes = std::fs::read(dir.join("final.safetensors")).unwrap_or_default();
    (r.code.unwrap_or(-1), all, bytes)
}

/// Every kernel launch one parameter short: the emulated driver reads the entry's `.param`
/// list, so the launch fails (the shifted address faults in the sanitizer, or the read
/// past the array fails) and the run with it, where the real driver would run on garbage.
#[test]
fn a_dropped_launch_parameter_fails_the_run() {
    let (code, all, _) = train("drop", "mlp", "1", &[(PLANT, "drop-launch-param")]);
    assert_eq!(code, 1, "{all}");
    assert!(all.contains("emulated GPU: "), "{all}");
    assert!(all.contains("the GPU rejected kernel"), "{all}");
    let (code, all, bytes) = train("drop-none", "mlp", "1", &[]);
    assert_eq!(code, 0, "{all}");
    assert!(
        !bytes.is_empty() && !all.contains("emulated GPU: "),
        "{all}"
    );
}

/// cnn (no dropout, so its steps replay) trained as CUDA graphs gives the direct launches'
/// bytes. With the graph's stream not joined back before the host reads (the step's loss,
/// the parameters at the end), the reads see stale values and the bytes differ; that they
/// differ also shows the replays ran. A synchronous copy of the step's constants inside the
/// capture is refused by the driver and the capture with it (the executor then turns
/// graphs off and runs directly, as it does on a GPU).
#[test]
fn graph_replays_give_the_direct_bytes_and_planted_stream_bugs_are_caught() {
    let graphs = ("PARALLAX_CUDA_GRAPH", "1");
    let (code, all, direct) = train("direct", "cnn", "3", &[]);
    assert_eq!(code, 0, "{all}");
    let (code, all, replayed) = train("graph", "cnn", "3", &[graphs]);
    assert_eq!(code, 0, "{all}");
    assert!(!all.contains("emulated GPU: "), "{all}");
    assert!(replayed == direct, "graph replays changed the parameters");

    let (code, all, stale) = train(
        "no-join",
        "cnn",
        "3",
        &[graphs, (PLANT, "no-sync-before-read")],
    );
    assert!(
        code != 0 || stale != direct,
        "a missing join went unseen: {all}"
    );

    let (code, all, _) = train(
        "sync-copy",
        "cnn",
        "3",
        &[graphs, (PLANT, "sync-copy-in-capture")],
    );
    assert_eq!(code, 0, "{all}");
    assert!(
        all.contains("emulated GPU: cuMemcpyHtoD during a stream capture that forbids it"),
        "{all}"
    );
    assert!(
        all.contains("the capture was invalidated by cuMemcpyHtoD"),
        "{all}"
    );
}

/// A device smaller than the plan: `train --backend cuda` fails before allocating, naming
/// the memory needed and the memory free, and exits 1 without a panic.
#[test]
fn a_plan_too_large_for_the_device_is_refused_before_allocating() {
    let small = [("PARALLAX_EMULATED_GPU_MEMORY", "65536")];
    let (code, all, bytes) = train("oom", "mlp", "1", &small);
    assert_eq!(code, 1, "{all}");
    assert!(bytes.is_empty(), "{all}");
    assert!(all.contains("bytes of memory on GPU 0"), "{all}");
    assert!(
        all.contains("but 65536 of its 65536 bytes are free"),
        "{all}"
    );
    assert!(all.contains("nothing was allocated"), "{all}");
    assert!(!all.contains("out of GPU memory allocating"), "{all}");
}

/// gpu-check's A/B variants pass against the oracle: tf32 with every GEMM on cuBLAS, and
/// bf16 with the biases added by their own launches (the profile names no `gemm+bias`).
#[test]
fn gpu_check_passes_without_cublaslt_and_without_the_bias_epilogue() {
    let (code, all) = gpu_check("mlp", "tf32", &[], &[("PARALLAX_CUBLASLT", "0")]);
    assert_eq!(code, 0, "{all}");
    assert!(all.contains("|tf32|") && all.contains("|ok|"), "{all}");
    assert!(!all.contains("cuBLASLt ran"), "{all}");

    let profile = ["--profile"];
    let (code, all) = gpu_check("mlp", "bf16", &profile, &[("PARALLAX_GEMM_BIAS", "0")]);
    assert_eq!(code, 0, "{all}");
    assert!(all.contains("|bf16|") && all.contains("|ok|"), "{all}");
    assert!(all.contains("gemm (Bf16)"), "{all}");
    assert!(!all.contains("gemm+bias"), "{all}");
    assert!(!all.contains("emulated GPU: "), "{all}");
}
