//! `parallax compile --gpus N`: the partition planner as users run it.

mod common;
use common::{parallax, stderr, stdout};

use std::process::Output;

/// `compile models/gpt-large.ron` with `args`.
fn gpt_large(args: &[&str]) -> Output {
    parallax(&[&["compile", "models/gpt-large.ron"][..], args].concat())
}

fn json(args: &[&str]) -> (Output, serde_json::Value) {
    let o = parallax(args);
    let v = serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)));
    (o, v)
}

#[test]
fn mlp_on_four_gpus_is_data_parallel_with_integer_degrees() {
    let (o, v) = json(&[
        "compile",
        "models/mlp.ron",
        "--gpus",
        "4",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(v["ok"], true);
    let s = &v["partition"]["strategy"];
    assert_eq!(
        (s["dp"].as_u64(), s["tp"].as_u64(), s["pp"].as_u64()),
        (Some(4), Some(1), Some(1))
    );
    assert_eq!(v["strategy"], *s, "the plan's strategy is the choice");
    assert!(v["partition"]["per_device_peak_bytes"].as_u64().unwrap() > 0);
    assert!(v["partition"]["step_time_s"].as_f64().unwrap() > 0.0);
    assert!(!v["partition"]["candidates"].as_array().unwrap().is_empty());
}

#[test]
fn gpt_large_on_eight_h100_explains_a_model_parallel_choice() {
    let o = gpt_large(&["--gpus", "8", "--device", "h100", "--explain"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "candidates (",
        "rejected: needs",
        "chosen: ",
        "stage 0: ",
        "fits (",
    ] {
        assert!(out.contains(needle), "{needle}: {out}");
    }
    let (_, v) = json(&[
        "compile",
        "models/gpt-large.ron",
        "--gpus",
        "8",
        "--device",
        "h100",
        "--format",
        "json",
    ]);
    // 13.1 B parameters with their Adam state do not fit one H100 whole: the choice splits
    // the model (tp, pp) or shards all of its state (ZeRO-3; with attention one op, a
    // sample's activations fit beside it).
    let (p, s) = (&v["partition"], &v["partition"]["strategy"]);
    assert!(
        s["tp"].as_u64().unwrap() * s["pp"].as_u64().unwrap() > 1 || p["zero"] == 3,
        "{p}"
    );
    assert!(
        v["partition"]["per_device_peak_bytes"].as_u64().unwrap()
            <= v["partition"]["capacity_bytes"].as_u64().unwrap()
    );
}

#[test]
fn gpt_large_on_one_h100_exits_1_with_the_table_and_the_smallest_count() {
    let o = gpt_large(&["--gpus", "1", "--device", "h100"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    for needle in [
        "parameters",
        "optimizer state",
        "activations at the peak",
        "total at the peak",
        "the smallest GPU count that fits is",
    ] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

#[test]
fn forced_strategies() {
    // `compile MODEL --gpus GPUS --strategy STRATEGY`.
    let compile = |model: &str, gpus: &str, strategy: &str| {
        parallax(&["compile", model, "--gpus", gpus, "--strategy", strategy])
    };
    let o = compile("models/gpt-large.ron", "8", "tp4.pp2");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("tp4.pp2"), "{}", stdout(&o));
    // Does not fit (even with ZeRO-3, half the state and a sample's activations are too
    // much): its numbers, exit 1.
    let o = compile("models/gpt-large.ron", "2", "dp2");
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("strategy dp2 does not fit")
            && stderr(&o).contains("total at the peak"),
        "{}",
        stderr(&o)
    );
    // Wrong product, bad text: a clear error, exit 1.
    let o = compile("models/mlp.ron", "8", "dp4");
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("uses 4 GPUs, not the 8"),
        "{}",
        stderr(&o)
    );
    let o = compile("models/mlp.ron", "4", "dq4");
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("not a strategy"), "{}", stderr(&o));
}

#[test]
fn every_model_plans_for_small_gpu_counts() {
    for model in ["mlp", "cnn", "transformer"] {
        for n in ["1", "2", "3", "4", "8"] {
            let (o, v) = json(&[
                "compile",
                &format!("models/{model}.ron"),
                "--gpus",
                n,
                "--format",
                "json",
            ]);
            assert!(o.status.success(), "{model} on {n}: {}", stderr(&o));
            let s = &v["partition"]["strategy"];
            let product =
                s["dp"].as_u64().unwrap() * s["tp"].as_u64().unwrap() * s["pp"].as_u64().unwrap();
            assert_eq!(product.to_string(), n, "{model}");
        }
    }
}

#[test]
fn nodes_bound_tensor_parallelism_to_a_node() {
    let (o, v) = json(&[
        "compile",
        "models/gpt-large.ron",
        "--gpus",
        "16",
        "--nodes",
        "4",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let p = &v["partition"];
    assert_eq!(p["gpus_per_node"], 4);
    for c in p["candidates"].as_array().unwrap() {
        assert!(c["strategy"]["tp"].as_u64().unwrap() <= 4, "{c}");
    }
}

#[test]
fn nothing_fits_anywhere_is_said_plainly() {
    let o = gpt_large(&["--gpus", "8", "--gpu-memory", "256MiB"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("fits on no strategy for 8 x h100"), "{err}");
    assert!(err.contains("no GPU count up to 65536 fits"), "{err}");
}

#[test]
fn one_gpu_that_fits_only_with_accumulation_says_so() {
    let o = parallax(&["compile", "models/transformer.ron", "--gpu-memory", "20MiB"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("gradient accumulation") && err.contains("--gpus 2"),
        "{err}"
    );
}

/// What `compile --gpus N` reports is what `train --gpus N` runs: the same strategy, ZeRO
/// stage and pipeline schedule (or both refuse), for every model at several device counts.
/// `train --dry-run` decides and compiles, and allocates nothing.
#[test]
fn compile_reports_the_split_that_train_runs() {
    let mut files: Vec<String> = ["models", "benches/models"]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).unwrap())
        .map(|e| e.unwrap().path().display().to_string())
        .filter(|p| p.ends_with(".ron"))
        .collect();
    files.sort();
    assert!(files.len() >= 10, "{files:?}");
    let split = |v: &serde_json::Value| {
        (
            v["strategy"].clone(),
            v["zero"].clone(),
            v["schedule"].clone(),
        )
    };
    std::thread::scope(|scope| {
        for file in &files {
            scope.spawn(move || {
                for n in ["1", "2", "3", "4", "8", "16"] {
                    let c = parallax(&["compile", file, "--gpus", n, "--format", "json"]);
                    let t =
                        parallax(&["train", file, "--gpus", n, "--backend", "cpu", "--dry-run"]);
                    let what = format!("{file} on {n}: {}\n{}", stderr(&c), stderr(&t));
                    assert_eq!(c.status.success(), t.status.success(), "{what}");
                    if !c.status.success() {
                        assert_eq!((c.status.code(), t.status.code()), (Some(1), Some(1)));
                        continue;
                    }
                    let compiled: serde_json::Value = serde_json::from_str(&stdout(&c)).unwrap();
                    let trained: serde_json::Value = serde_json::from_str(&stdout(&t)).unwrap();
                    assert_eq!(split(&compiled["partition"]), split(&trained), "{what}");
                    assert_eq!(compiled["strategy"], trained["strategy"], "{what}");
                }
            });
        }
    });
}

/// `compile models/cnn.ron --gpus 16` reports the split train can feed from the batch's 8
/// micro-shards (the cost model alone would pick dp16).
#[test]
fn a_split_with_more_ranks_than_micro_shards_is_not_reported() {
    let (o, v) = json(&[
        "compile",
        "models/cnn.ron",
        "--gpus",
        "16",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = &v["partition"]["strategy"];
    assert!(s["dp"].as_u64().unwrap() <= 8, "{s}");
    let fastest = &v["partition"]["candidates"][0]["strategy"];
    assert_eq!(
        fastest["dp"], 16,
        "the cost model still lists its fastest: {fastest}"
    );
}

/// `compile` and `train` take the split's arguments alike (`SplitArgs`): a forced strategy,
/// ZeRO stage and device memory give the same split in both.
#[test]
fn compile_and_train_take_strategy_zero_and_memory_alike() {
    let split = |v: &serde_json::Value| (v["strategy"].clone(), v["zero"].clone());
    for args in [
        "--gpus 4 --zero 2",
        "--gpus 4 --strategy dp2.pp2 --zero 1",
        "--gpus 2 --strategy dp2 --gpu-memory 64GiB --zero 3",
    ] {
        let args: Vec<&str> = args.split(' ').collect();
        let args = &args[..];
        let file = "models/mlp.ron";
        let c = parallax(&[&["compile", file, "--format", "json"], args].concat());
        let t = parallax(&[&["train", file, "--backend", "cpu", "--dry-run"], args].concat());
        let what = format!("{args:?}: {}\n{}", stderr(&c), stderr(&t));
        assert!(c.status.success() && t.status.success(), "{what}");
        let compiled: serde_json::Value = serde_json::from_str(&stdout(&c)).unwrap();
        let trained: serde_json::Value = serde_json::from_str(&stdout(&t)).unwrap();
        assert_eq!(split(&compiled["partition"]), split(&trained), "{what}");
        let zero = args[args.len() - 1].parse::<u64>().unwrap();
        assert_eq!(trained["zero"], zero, "{what}");
    }
}
