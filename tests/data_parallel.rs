//! Data and pipeline parallelism on simulated devices: the same bits on any device grid
//! (uneven splits, a short last batch, synchronised BatchNorm and clipping across stages
//! included), close to the unsplit run, the memory each device allocates equal to what the
//! compiler predicts, and clear refusals.

mod common;
use common::{cli_exits, cli_ok, exits_1, metric, plan_of, stderr, temp, train_ok};

use parallax_compiler::shards::{assign, device_bytes, Sharding};
use parallax_compiler::{parse_bytes, Options};
use parallax_runtime::ranks::{Grid, Ranks};

/// Trains `file` with the words of `line` in the fresh folder `temp(name)`; returns the final
/// weights' bytes and each step's loss.
fn train(file: &str, name: &str, line: &str) -> (Vec<u8>, Vec<f64>) {
    let run = &temp(name);
    train_ok(file, run, &line.split_whitespace().collect::<Vec<_>>());
    let weights = std::fs::read(run.join("final.safetensors")).unwrap();
    let losses = metric(run, "loss");
    let _ = std::fs::remove_dir_all(run);
    (weights, losses)
}

fn relative(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-12))
        .fold(0.0, f64::max)
}

/// Every model (BatchNorm in `cnn`, dropout in `mlp`), every device count: byte-identical
/// weights and identical losses; and close to one device running the batch unsplit.
#[test]
fn every_model_gives_the_same_bits_on_any_device_count() {
    for (model, steps) in [("mlp", "3"), ("cnn", "3"), ("transformer", "2")] {
        let file = format!("models/{model}.ron");
        let (one, losses) = train(&file, model, &format!("--gpus 1 --steps {steps}"));
        let grids = [
            ("2", "dp2"),
            ("3", "dp3"),
            ("4", "dp4"),
            ("8", "dp8"),
            ("2", "pp2"),
            ("3", "pp3"),
            ("4", "dp2.pp2"),
        ];
        for (n, strategy) in grids {
            let args = format!("--gpus {n} --strategy {strategy} --steps {steps}");
            let (w, l) = train(&file, &format!("{model}-{strategy}"), &args);
            assert_eq!(l, losses, "{model} as {strategy}: losses");
            assert!(w == one, "{model} as {strategy}: final.safetensors differs");
        }
        let (_, unsplit) = train(&file, &format!("{model}-u"), &format!("--steps {steps}"));
        let r = relative(&losses, &unsplit);
        assert!(
            r < 1e-5,
            "{model}: sharded vs unsplit losses differ by {r:e}"
        );
    }
}

/// An epoch's short last batch (1438 samples in batches of 64: 30 left over) and a batch that
/// does not divide into the shards (60 in 8 shards of 8, the last of 4, with small gradient
/// buckets), on 3 devices.
#[test]
fn uneven_batches_keep_the_same_bits() {
    let (one, _) = train("models/mlp.ron", "short-1", "--gpus 1 --steps 24");
    let (three, _) = train("models/mlp.ron", "short-3", "--gpus 3 --steps 24");
    assert!(one == three, "the short last batch changed the bits");
    let set = "--set train.batch_size=60 --set devices.gradient_bucket_mb=0.01 --steps 3 --gpus";
    let (a, _) = train("models/mlp.ron", "b60-1", &format!("{set} 1"));
    let (b, _) = train("models/mlp.ron", "b60-3", &format!("{set} 3"));
    assert!(a == b, "uneven shards changed the bits");
}

/// More micro-shards allow more devices, with the same bits among themselves.
#[test]
fn more_devices_need_more_micro_shards() {
    let err = exits_1("train models/mlp.ron --gpus 16 --strategy dp16 --steps 1");
    assert!(
        err.contains("8 micro-shards") && err.contains("devices.micro_shards=16"),
        "{err}"
    );
    let set = "--set devices.micro_shards=16 --steps 2 --gpus";
    let (a, _) = train("models/mlp.ron", "m16-1", &format!("{set} 1"));
    let (b, _) = train(
        "models/mlp.ron",
        "m16-16",
        &format!("{set} 16 --strategy dp16"),
    );
    assert!(a == b);
}

#[test]
fn strategies_that_cannot_run_are_refused() {
    for (n, strategy, expect) in [
        ("4", "dp2.pp3", "uses 6 GPUs, not the 4 asked for"),
        ("2", "tp2", "this model has none"),
        ("2", "dq2", "`dq` is not dp, tp or pp"),
        ("16", "pp16", "16 pipeline stages need at least 16 layers"),
    ] {
        let err = cli_exits(
            1,
            &format!("train models/cnn.ron --gpus {n} --strategy {strategy} --steps 1 --run-dir"),
            &[temp("refused").to_str().unwrap()],
        );
        assert!(
            err.contains(expect) && !err.contains("panicked"),
            "{strategy}: {err}"
        );
    }
}

#[test]
fn heads_that_do_not_split_are_refused() {
    let err = exits_1("train models/transformer.ron --gpus 3 --strategy tp3 --steps 1");
    assert!(
        err.contains("4 heads do not split over 3 tensor-parallel ranks") && err.contains("^"),
        "{err}"
    );
}

/// Every tensor's values from a safetensors file, by name.
fn tensors(bytes: &[u8]) -> Vec<(String, Vec<f32>)> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out: Vec<(String, Vec<f32>)> = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let at = |i: usize| v["data_offsets"][i].as_u64().unwrap() as usize;
            let values = data[at(0)..at(1)]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (k.clone(), values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Tensor parallelism (Megatron: attention heads and the MLP split, the row-parallel
/// products summed across ranks) on its own and with data and pipeline parallelism: losses
/// within 1e-5 of one device, weights within 1e-5 (relative norm), the same bits on any grid
/// with the same tensor-parallel degree.
#[test]
fn tensor_parallel_transformer_matches_one_device() {
    let file = "models/transformer.ron";
    let (one, losses) = train(file, "tp-1", "--gpus 1 --steps 3");
    let mut tp2 = None;
    for (n, strategy) in [
        ("2", "tp2"),
        ("4", "tp4"),
        ("4", "dp2.tp2"),
        ("8", "dp2.tp2.pp2"),
    ] {
        let args = format!("--gpus {n} --strategy {strategy} --steps 3");
        let (w, l) = train(file, &format!("tp-{strategy}"), &args);
        let r = relative(&l, &losses);
        assert!(r < 1e-5, "{strategy}: losses differ by {r:e}");
        let (mine, reference) = (tensors(&w), tensors(&one));
        assert_eq!(mine.len(), reference.len());
        for ((name, a), (other, b)) in mine.iter().zip(reference) {
            assert_eq!(*name, other);
            assert_eq!(a.len(), b.len(), "{strategy}: `{name}`");
            let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            let diff: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
            let r = norm(&diff) / norm(&b).max(1e-12);
            assert!(r < 1e-5, "{strategy}: `{name}` differs by {r:e}");
        }
        if strategy.contains("tp2") {
            match &tp2 {
                None => tp2 = Some(w),
                Some(first) => assert!(*first == w, "{strategy}: bits differ from tp2"),
            }
        }
    }
}

/// `compile --gpus N --format json` states what each simulated device will allocate; the run
/// records what they did allocate (`run.json`): the same numbers.
#[test]
fn compile_predicts_the_memory_training_allocates() {
    for (file, n, strategy) in [
        ("models/cnn.ron", "4", "dp2.pp2"),
        ("models/transformer.ron", "8", "dp2.tp2.pp2"),
        ("models/mlp.ron", "3", "dp3"),
    ] {
        let o = cli_ok(
            &format!("compile {file} --gpus {n} --strategy {strategy} --format json"),
            &[],
        );
        let compiled: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let predicted = compiled["simulated_device_bytes"].clone();
        assert!(predicted
            .as_array()
            .is_some_and(|a| a.len() == n.parse::<usize>().unwrap()));
        let args = ["--gpus", n, "--strategy", strategy, "--steps", "1"];
        let run = temp(&format!("mem-{strategy}"));
        train_ok(file, &run, &args);
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("run.json")).unwrap()).unwrap();
        assert_eq!(
            record["device_memory_bytes"], predicted,
            "{file} as {strategy}"
        );
        let _ = std::fs::remove_dir_all(run);
    }
}

/// ZeRO-1: each parameter's optimizer state and update on one data-parallel rank, the new
/// value broadcast; ZeRO-2: its reduced gradient there too; ZeRO-3: the parameter too,
/// broadcast before use. The same bits (clipping included), and less memory per device.
#[test]
fn sharded_optimizer_state_keeps_the_bits() {
    let file = "models/transformer.ron";
    let (one, _) = train(file, "z-1", "--gpus 1 --steps 2");
    let mut bytes = Vec::new();
    let cases = [
        ("dp4", "0"),
        ("dp4", "1"),
        ("dp2.pp2", "1"),
        ("dp4", "2"),
        ("dp4", "3"),
        ("dp2.pp2", "3"),
    ];
    for (strategy, zero) in cases {
        let run = temp(&format!("z-{strategy}-{zero}"));
        let args = [
            "--gpus",
            "4",
            "--strategy",
            strategy,
            "--zero",
            zero,
            "--steps",
            "2",
        ];
        train_ok(file, &run, &args);
        assert!(
            std::fs::read(run.join("final.safetensors")).unwrap() == one,
            "{strategy} zero {zero}"
        );
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("run.json")).unwrap()).unwrap();
        let most = record["device_memory_bytes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_u64())
            .max();
        bytes.push(most.unwrap());
        let _ = std::fs::remove_dir_all(run);
    }
    assert!(bytes[1] < bytes[0], "ZeRO-1 saves nothing: {bytes:?}");
}

/// Without `--strategy` the cost model chooses, preferring splits whose bits do not depend on
/// the device count: the same bits as one device.
#[test]
fn the_cost_model_chooses_a_split_with_the_same_bits() {
    let file = "models/transformer.ron";
    let (one, _) = train(file, "auto-1", "--gpus 1 --steps 2");
    let run = temp("auto-4");
    let err = stderr(&train_ok(file, &run, &["--gpus", "4", "--steps", "2"]));
    assert!(err.contains("the cost model chooses dp2.pp2"), "{err}");
    let four = std::fs::read(run.join("final.safetensors")).unwrap();
    assert!(four == one);
    let _ = std::fs::remove_dir_all(run);
}

/// `--zero` without `--strategy`: the cost model picks the split, and the line saying so names
/// the ZeRO stage that runs (the one asked for), not the one the cost model would pick.
#[test]
fn the_chosen_split_names_the_zero_stage_asked_for() {
    let run = temp("auto-zero");
    let args = ["--gpus", "2", "--zero", "1", "--steps", "1"];
    let err = stderr(&train_ok("models/mlp.ron", &run, &args));
    assert!(
        err.contains("the cost model chooses dp2 with ZeRO 1 as --zero asks"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(run);
}

#[test]
fn a_device_too_small_is_refused_before_training() {
    let run = temp("small");
    let err = cli_exits(
        1,
        "train models/cnn.ron --gpus 2 --strategy dp2 --gpu-memory 64KiB --run-dir",
        &[run.to_str().unwrap()],
    );
    assert!(
        err.contains("simulated device 0 (rank 0, tensor rank 0, stage 0) runs out of memory")
            && !err.contains("panicked"),
        "{err}"
    );
    assert!(!run.join("metrics.jsonl").exists());
}

/// What the compiler predicts each device needs is what the simulated devices allocate; a
/// pipeline stage or a tensor-parallel rank holds less than the whole model.
#[test]
fn predicted_device_memory_is_what_the_devices_allocate() {
    let cases = [
        ("mlp", 1, 0),
        ("cnn", 1, 0),
        ("cnn", 1, 1),
        ("transformer", 1, 0),
        ("transformer", 2, 0),
        ("transformer", 1, 1),
        ("transformer", 1, 2),
        ("mlp", 1, 3),
        ("transformer", 1, 3),
    ];
    for (model, tp, zero) in cases {
        let path = format!("{}/models/{model}.ron", env!("CARGO_MANIFEST_DIR"));
        let source = parse_bytes(&std::fs::read(path).unwrap()).unwrap();
        let e = &source.experiment;
        let sharding = Sharding::new(e.devices.micro_shards, e.train.batch_size);
        let plan_for = |tp: u32, pp: u32, dp: u32| {
            let strategy = parallax_compiler::plan::Strategy { dp, tp, pp };
            let options = Options::partitioned(&source, strategy, zero);
            plan_of(&source, &options)
        };
        let whole = device_bytes(&plan_for(1, 1, 1), 1, None);
        for (dp, pp) in [(1, 1), (3, 1), (8, 1), (1, 2), (2, 2), (1, 3)] {
            let plan = plan_for(tp, pp as u32, dp as u32);
            let grid = Grid {
                dp,
                tp: tp as usize,
                pp,
            };
            let sim = Ranks::in_process(plan.clone(), grid, 1, u64::MAX).unwrap();
            let held = assign(sharding.shards as usize, dp);
            for m in sim.memory() {
                let owned = plan.kernel_mask(m.stage as u32, m.rank as u32);
                let owned = owned.as_deref();
                let predicted = device_bytes(&plan, held[m.rank].len(), owned);
                let at = format!(
                    "{model}, dp{dp}.tp{tp}.pp{pp}, zero {zero}, device {}",
                    m.device
                );
                assert_eq!(m.bytes, predicted, "{at}");
                if (pp > 1 || tp > 1) && held[m.rank].len() == 1 {
                    assert!(m.bytes < whole, "{at} holds the whole model");
                }
            }
        }
    }
}
