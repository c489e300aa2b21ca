//! Every generated GPU kernel on the PTX interpreter against the CPU oracle, with the
//! sanitizer (`parallax check-kernels`): the listed models at fp32, tf32 and bf16 and with
//! bf16-stored activations, shrunk by `--set` (shapes, not coverage); the pipeline-stage,
//! tensor-parallel and ZeRO plans' kernels; both models of the tensor cores. Then the
//! coverage gate (every PTX file `compile --emit ptx` writes, for every model and
//! precision, parses: an instruction form the interpreter does not model is an error), and
//! bugs planted by hand in PTX files, which `check-kernels --ptx` must catch.

mod common;

use common::{binary, run_limited, temp_dir};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Each run's limit: a hang fails the test, never CI.
const LIMIT: Duration = Duration::from_secs(300);

/// `check-kernels FILE ARGS --format json`: its exit code and report.
fn check_json(file: &str, args: &[&str]) -> (Option<i32>, Value, String) {
    let mut c = binary();
    c.args(["check-kernels", file, "--format", "json"])
        .args(args);
    let r = run_limited(c, LIMIT);
    let report = serde_json::from_str(&r.stdout).unwrap_or(Value::Null);
    (r.code, report, format!("{}{}", r.stdout, r.stderr))
}

/// Checks `file` with each of `configs` added to `args`: every run passes, and the report
/// holds the families `expect` names.
fn passes(file: &str, args: &[&str], configs: &[&[&str]], expect: &[&str]) {
    for config in configs {
        let all: Vec<&str> = args.iter().chain(config.iter()).copied().collect();
        let (code, r, out) = check_json(file, &all);
        assert_eq!(code, Some(0), "{file} {all:?}:\n{out}");
        assert_eq!(r["ok"], true, "{file} {all:?}:\n{out}");
        let kernels = r["kernels"].as_array().expect("kernels");
        assert!(!kernels.is_empty(), "{out}");
        for family in expect {
            assert!(
                kernels.iter().any(|k| k["family"] == *family),
                "{file} {all:?}: no `{family}` kernel:\n{out}"
            );
        }
        // Every kernel compared, each within its tolerance; nothing found.
        for k in kernels {
            assert!(
                k["difference"].as_f64().unwrap() <= k["tolerance"].as_f64().unwrap(),
                "{k}"
            );
        }
        assert_eq!(r["findings"].as_array().map(Vec::len), Some(0), "{out}");
    }
}

const PRECISIONS: [&[&str]; 4] = [
    &["--precision", "fp32"],
    &["--precision", "tf32"],
    &["--precision", "bf16"],
    &["--precision", "bf16", "--set", "devices.activations=Bf16"],
];

#[test]
fn mlp_every_precision() {
    passes(
        "models/mlp.ron",
        &[],
        &PRECISIONS,
        &["gemm", "exact", "approx"],
    );
}

#[test]
fn cnn_every_precision() {
    passes("models/cnn.ron", &[], &PRECISIONS, &["reordered", "exact"]);
}

#[test]
fn transformer_every_precision() {
    let small = ["--set", "train.batch_size=8"];
    passes(
        "models/transformer.ron",
        &small,
        &PRECISIONS,
        &["approx", "gemm"],
    );
}

#[test]
fn bench_transformer_every_precision() {
    // Head width 64: the tensor-core attention at bf16.
    let small = ["--set", "train.batch_size=2", "--set", "params.seq=32"];
    passes(
        "benches/models/transformer.ron",
        &small,
        &PRECISIONS,
        &["gemm"],
    );
    passes(
        "benches/models/transformer.ron",
        &small,
        &[&["--precision", "bf16"]],
        &["tensor-core"],
    );
}

/// gpt-gpu with one layer, a short sequence and a small vocabulary, at head width `width`.
fn gpt(width: u32) -> Vec<String> {
    let sets = [
        "params.layers=1".to_string(),
        format!("params.d_model={}", 2 * width),
        "params.heads=2".into(),
        "params.vocab=256".into(),
        "params.seq=64".into(),
        "train.batch_size=2".into(),
    ];
    sets.into_iter()
        .flat_map(|s| ["--set".to_string(), s])
        .collect()
}

#[test]
fn gpt_gpu_shrunk_head_width_64_and_128_both_tensor_core_models() {
    for width in [64, 128] {
        let args = gpt(width);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        passes("benches/models/gpt-gpu.ron", &args, &PRECISIONS, &["gemm"]);
        let bf16: [&[&str]; 3] = [
            &["--precision", "bf16"],
            &["--precision", "bf16", "--mma", "hopper"],
            &[
                "--precision",
                "bf16",
                "--mma",
                "hopper",
                "--set",
                "devices.activations=Bf16",
            ],
        ];
        passes("benches/models/gpt-gpu.ron", &args, &bf16, &["tensor-core"]);
    }
}

#[test]
fn partitioned_plans_every_device() {
    let small = ["--set", "train.batch_size=8"];
    let splits: [&[&str]; 3] = [
        &["--gpus", "2", "--strategy", "pp2"],
        &["--gpus", "2", "--strategy", "tp2"],
        &["--gpus", "4", "--strategy", "dp2.pp2", "--zero", "1"],
    ];
    passes("models/transformer.ron", &small, &splits, &["collective"]);
    // Every device's kernels: both stages, both tensor ranks, both state owners.
    let (_, r, out) = check_json(
        "models/transformer.ron",
        &[
            "--set",
            "train.batch_size=8",
            "--gpus",
            "4",
            "--strategy",
            "dp2.pp2",
            "--zero",
            "1",
        ],
    );
    let devices: std::collections::BTreeSet<&str> = r["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|k| k["device"].as_str())
        .collect();
    assert_eq!(devices.len(), 4, "{devices:?}\n{out}");
    // A pipeline split of the bf16-stored tensor-core model.
    let args = gpt(64);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend(["--gpus", "2", "--strategy", "pp2", "--precision", "bf16"]);
    passes(
        "benches/models/gpt-gpu.ron",
        &args,
        &[&["--set", "devices.activations=Bf16"]],
        &["tensor-core", "collective"],
    );
}

/// The PTX files `compile --emit ptx` writes for `file` at `args`, in `dir`.
fn emit(file: &str, args: &[&str], dir: &Path) {
    let mut c = binary();
    c.args(["compile", file, "--emit", "ptx", "--out"])
        .arg(dir)
        .args(args);
    let r = run_limited(c, LIMIT);
    assert_eq!(r.code, Some(0), "{file} {args:?}: {}", r.stderr);
}

fn ptx_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "ptx"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_emitted_instruction_form_is_modelled() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut models = Vec::new();
    for folder in ["models", "benches/models"] {
        for e in std::fs::read_dir(root.join(folder)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "ron") {
                models.push(p);
            }
        }
    }
    models.sort();
    assert!(models.len() >= 8, "{models:?}");
    let mut files = 0;
    for (i, model) in models.iter().enumerate() {
        for (j, config) in PRECISIONS.iter().enumerate() {
            let dir = temp_dir(&format!("coverage-{i}-{j}"));
            emit(model.to_str().unwrap(), config, &dir);
            for f in ptx_files(&dir) {
                let text = std::fs::read_to_string(&f).unwrap();
                if let Err(e) = parallax_emulator::Module::parse(&text) {
                    panic!("{} {config:?}: {}: {e}", model.display(), f.display());
                }
                files += 1;
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    assert!(files > 500, "{files} files");
}

/// The entry of the first kernel whose ops include `op` and whose PTX holds `holds`.
fn entry_with(dir: &Path, op: &str, holds: &str) -> String {
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    for k in manifest["kernels"].as_array().unwrap() {
        if !k["ops"].as_array().unwrap().iter().any(|o| o == op) {
            continue;
        }
        for l in k["launches"].as_array().unwrap() {
            let Some(entry) = l["Kernel"]["entry"].as_str() else {
                continue;
            };
            let text = std::fs::read_to_string(dir.join(format!("{entry}.ptx"))).unwrap();
            if text.contains(holds) {
                return entry.to_string();
            }
        }
    }
    panic!("no `{op}` kernel holding `{holds}` in {}", dir.display());
}

/// Plants a bug in `entry`'s file: `change` rewrites its text (which must change).
fn plant(dir: &Path, entry: &str, change: impl Fn(&str) -> String) {
    let f = dir.join(format!("{entry}.ptx"));
    let text = std::fs::read_to_string(&f).unwrap();
    let changed = change(&text);
    assert_ne!(text, changed, "the planted bug changed nothing");
    std::fs::write(&f, changed).unwrap();
}

/// `check-kernels --ptx DIR` on the planted files fails, naming what `expect` says.
fn caught(file: &str, args: &[&str], dir: &Path, entry: &str, expect: impl Fn(&Value) -> bool) {
    let mut all = args.to_vec();
    all.extend(["--ptx", dir.to_str().unwrap()]);
    let (code, r, out) = check_json(file, &all);
    assert_eq!(
        code,
        Some(1),
        "the planted bug in `{entry}` went unseen:\n{out}"
    );
    assert_eq!(r["ok"], false, "{out}");
    assert!(expect(&r), "`{entry}`:\n{out}");
}

fn finding(r: &Value, kind: &str, entry: &str) -> bool {
    r["findings"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f["kind"] == kind && f["entry"] == entry && f["line"].as_u64().unwrap() > 0)
}

#[test]
fn a_dropped_barrier_in_attention_is_a_race() {
    let args = ["--set", "train.batch_size=8"];
    let dir = temp_dir("plant-barrier");
    emit("models/transformer.ron", &args, &dir);
    let entry = entry_with(&dir, "attention", "bar.sync");
    // The barrier after staging a tile: warps then read rows others have not written.
    plant(&dir, &entry, |t| {
        let at = t
            .match_indices("bar.sync 0;")
            .nth(1)
            .expect("two barriers")
            .0;
        format!("{}{}", &t[..at], &t[at + "bar.sync 0;".len()..])
    });
    caught("models/transformer.ron", &args, &dir, &entry, |r| {
        finding(r, "SharedRace", &entry)
    });
}

#[test]
fn an_index_shifted_by_one_is_out_of_bounds() {
    let dir = temp_dir("plant-index");
    emit("models/mlp.ron", &[], &dir);
    let entry = entry_with(&dir, "dropout", "ld.global");
    // Every load one element further: the last thread reads past its buffer.
    plant(&dir, &entry, |t| {
        t.lines()
            .map(|l| {
                if l.contains("ld.global.f32") && l.ends_with("];") {
                    l.replace("];", "+4];")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    });
    caught("models/mlp.ron", &[], &dir, &entry, |r| {
        finding(r, "GlobalOutOfBounds", &entry)
    });
}

#[test]
fn a_read_before_the_async_copy_wait_is_pending() {
    let args = gpt(64);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend(["--precision", "bf16"]);
    let dir = temp_dir("plant-cp-async");
    emit("benches/models/gpt-gpu.ron", &args, &dir);
    let entry = entry_with(&dir, "attention", "cp.async.wait_all");
    plant(&dir, &entry, |t| t.replacen("cp.async.wait_all;", "", 1));
    caught("benches/models/gpt-gpu.ron", &args, &dir, &entry, |r| {
        finding(r, "AsyncCopyPending", &entry)
    });
}

#[test]
fn a_constant_one_ulp_off_is_a_difference() {
    let dir = temp_dir("plant-constant");
    emit("models/mlp.ron", &[], &dir);
    // The optimizer's update: its `1 - beta1` (0.1) nudged by one ulp, which an exact
    // kernel's bit-for-bit comparison sees.
    let entry = entry_with(&dir, "sqrt", "0f3DCCCCCD");
    plant(&dir, &entry, |t| t.replacen("0f3DCCCCCD", "0f3DCCCCCE", 1));
    caught("models/mlp.ron", &[], &dir, &entry, |r| {
        r["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["verdict"] == "DIFF" && k["difference"].as_f64().unwrap() > 0.0)
    });
}
