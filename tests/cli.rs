//! The command line as users (and the README) run it.

mod common;
use common::{cli, cli_exits, cli_ok, parallax, stderr, stdout, temp, temp_dir};

use std::path::Path;

#[test]
fn check_prints_a_summary_for_every_model() {
    for (model, params) in [
        ("mlp", "9,610 parameters"),
        ("cnn", "13,770 parameters"),
        ("transformer", "106,256 parameters"),
        ("gpt-large", "13,110,702,080 parameters"),
    ] {
        let o = parallax(&["check", &format!("models/{model}.ron")]);
        assert!(o.status.success(), "{model}: {}", stderr(&o));
        let out = stdout(&o);
        assert_eq!(out.lines().count(), 1, "{out}");
        assert!(out.contains(params), "{model}: {out}");
    }
}

#[test]
fn check_json_has_the_contract_fields() {
    let o = parallax(&["check", "models/mlp.ron", "--format", "json"]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    // 64*128 + 128 + 128*10 + 10, as PyTorch counts it.
    assert_eq!(v["parameters"].as_u64(), Some(9610));
    assert_eq!(v["layers"].as_u64(), Some(4));
    // Two GEMMs (2*64*128 + 2*128*10) plus the elementwise work.
    let flops = v["flops_per_sample"].as_u64().unwrap();
    assert!((18944..20000).contains(&flops), "{flops}");
}

#[test]
fn check_json_reports_errors_as_json_too() {
    let dir = temp_dir("json-err");
    let f = dir.join("bad.ron");
    let text = std::fs::read_to_string("models/mlp.ron")
        .unwrap()
        .replace("Relu,", "Relux,");
    std::fs::write(&f, text).unwrap();
    let o = parallax(&["check", f.to_str().unwrap(), "--format", "json"]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["errors"][0]["line"], 9);
    assert_eq!(v["errors"][0]["col"], 13);
    assert!(stderr(&o).contains(":9:13: error: unknown layer `Relux`"));
}

#[test]
fn compile_emits_ir_dot_and_plan() {
    let dir = temp("emit");
    let o = cli_ok(
        "compile models/cnn.ron --gpus 4 --emit ir,dot,plan --out",
        &[dir.to_str().unwrap()],
    );
    let ir = std::fs::read_to_string(dir.join("graph.ir")).unwrap();
    assert!(ir.starts_with("graph \"cnn-digits\" {"));
    assert!(ir.contains("conv2d("));
    let dot = std::fs::read_to_string(dir.join("graph.dot")).unwrap();
    assert!(dot.starts_with("digraph"));
    assert!(dot.matches(" -> ").count() > 10);
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
    assert_eq!(plan["gpus_requested"], 4);
    // The partition planner's choice for 4 GPUs: data parallelism for a small CNN.
    assert_eq!(plan["strategy"]["dp"], 4);
    assert_eq!(plan["parameters"], 13770);
    assert_eq!(plan["memory"]["parameter_bytes"].as_u64(), Some(13770 * 4));
    assert!(stdout(&o).contains("strategy:   dp4"), "{}", stdout(&o));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn compile_emits_one_thing_to_stdout() {
    let o = parallax(&["compile", "models/mlp.ron", "--emit", "ir"]);
    assert!(o.status.success());
    // The IR after the whole pipeline, with its kernels and buffers.
    let golden = std::fs::read_to_string("tests/golden/mlp.scheduled.ir").unwrap();
    assert_eq!(stdout(&o), golden);
    // Several things need a folder.
    let o = parallax(&["compile", "models/mlp.ron", "--emit", "ir,dot"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn compile_json_records_gpus() {
    let o = cli_ok("compile models/gpt-large.ron --gpus 8 --format json", &[]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["gpus_requested"], 8);
    assert_eq!(v["parameters"].as_u64(), Some(13_110_702_080));
    assert!(v["memory"]["parameter_bytes"].as_u64().unwrap() > 52_000_000_000);
}

#[test]
fn timings_and_ir_dumps() {
    let o = cli_ok(
        "compile models/mlp.ron --timings --dump-ir after:lower",
        &[],
    );
    let err = stderr(&o);
    for pass in ["parse", "lower", "shapes", "simplify", "plan", "total"] {
        assert!(
            err.lines()
                .any(|l| l.trim_start().starts_with(pass) && l.ends_with(" ms")),
            "no timing for {pass}: {err}"
        );
    }
    assert!(err.contains("// IR after pass `lower`"));
    assert!(err.contains("%2 = matmul(%0, %1; trans_b) : f32[B, 128]"));
    // Unknown passes are a command-line error.
    let o = parallax(&["compile", "models/mlp.ron", "--dump-ir", "after:fuse2"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("unknown pass `fuse2`"));
}

#[test]
fn bad_command_lines_exit_2() {
    for args in [
        vec!["check"],
        vec!["compile", "models/mlp.ron", "--gpus", "0"],
        vec!["compile", "models/mlp.ron", "--emit", "asm"],
        vec!["check", "models/mlp.ron", "--format", "yaml"],
        vec!["frobnicate"],
    ] {
        let o = parallax(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
    }
}

#[test]
fn a_missing_file_exits_1() {
    let o = parallax(&["check", "models/nope.ron"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).starts_with("models/nope.ron: error: cannot read the file"));
    assert!(!Path::new("models/nope.ron").exists());
}

#[test]
fn compile_checks_the_plan_fits_the_device_before_anything_runs() {
    let o = parallax(&["compile", "models/mlp.ron", "--device", "l4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("NVIDIA L4 24GB") && stdout(&o).contains("fits"),
        "{}",
        stdout(&o)
    );

    // One GPU that cannot hold the model: exit 1 and the memory table.
    let o = parallax(&["compile", "models/gpt-large.ron", "--gpus", "1"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    for row in [
        "parameters",
        "optimizer state",
        "activations at the peak",
        "total at the peak",
    ] {
        assert!(err.contains(row), "{row}: {err}");
    }
    assert!(err.contains("48.84 GiB") && err.contains("H100"), "{err}");
    let o = cli("compile models/gpt-large.ron --gpus 1 --format json", &[]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["device"]["fits_one_device"], false);

    // --gpu-memory overrides the profile's memory.
    let o = parallax(&["compile", "models/mlp.ron", "--gpu-memory", "100KiB"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let o = parallax(&["compile", "models/mlp.ron", "--gpu-memory", "lots"]);
    assert_eq!(o.status.code(), Some(2));
    let o = parallax(&["compile", "models/mlp.ron", "--device", "h300"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("did you mean `h100`"), "{}", stderr(&o));
}

/// Launchers' variables are read: a torchrun-style world whose other rank never comes (rank
/// 0 gives up after the collective timeout, naming it), a world too large for `--gpus`,
/// refused before anything runs; `--strategy` without a device count is a usage error.
#[test]
fn launcher_variables_that_cannot_be_honoured_are_refused() {
    let dir = temp("launcher-refused");
    let d = dir.to_str().unwrap();
    let port = common::job_port().to_string();
    let mut c = common::binary();
    c.args(["train", "models/mlp.ron", "--steps", "1", "--run-dir", d])
        .args(["--collective-timeout", "2"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port);
    let o = common::run_limited(c, std::time::Duration::from_secs(60));
    assert_eq!(o.code, Some(1), "{}", o.stderr);
    assert!(
        o.stderr
            .contains("rank 0: rank(s) [1] of 2 never connected within 2s"),
        "{}",
        o.stderr
    );
    let o = common::binary()
        .args(["train", "models/mlp.ron", "--run-dir", d])
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("sets WORLD_SIZE but not RANK"),
        "{}",
        stderr(&o)
    );
    let err = cli_exits(2, "train models/mlp.ron --strategy pp2 --run-dir", &[d]);
    assert!(err.contains("--strategy splits the work of several devices"));
    assert!(!dir.exists());
}
