//! `plan.json` reads back: every model's plan, unsplit and partitioned, survives the round
//! trip unchanged, and the loaded copy trains to the same bits as the plan it was written
//! from; `parallax compile --emit plan` writes what loads; another format is refused.

mod common;
use common::{cli_ok, model, parallax, plan_of, stderr, temp, temp_dir};

use parallax_compiler::plan::{Plan, PlanError, Strategy};
use parallax_compiler::{Options, Source};
use parallax_runtime::ranks::Grid;
use parallax_runtime::train::{train, Device, Simulated, TrainConfig};

/// Plans are long: a difference is shown as its first differing line.
fn same_text(got: &str, want: &str) {
    if let Some((i, (g, w))) = got
        .lines()
        .zip(want.lines())
        .enumerate()
        .find(|(_, (g, w))| g != w)
    {
        panic!("line {}: `{g}` where `{w}` was written", i + 1);
    }
    assert_eq!(got.lines().count(), want.lines().count());
}

/// Trains `plan` for 3 steps into a fresh folder; returns `final.safetensors`.
fn trained(source: &Source, plan: Plan, device: Device, name: &str) -> Vec<u8> {
    let dir = temp(name);
    let cfg = TrainConfig {
        steps: Some(3),
        run_dir: dir.clone(),
        base_dir: env!("CARGO_MANIFEST_DIR").into(),
        device,
        ..TrainConfig::default()
    };
    train(source, plan, &cfg, &mut |_| {}).unwrap();
    let bytes = std::fs::read(dir.join("final.safetensors")).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    bytes
}

#[test]
fn every_plan_round_trips_and_its_loaded_copy_trains_to_the_same_bits() {
    let splits = [
        ("mlp", None),
        ("cnn", None),
        ("transformer", None),
        (
            "mlp",
            Some((
                Strategy {
                    dp: 2,
                    tp: 1,
                    pp: 1,
                },
                2,
            )),
        ),
        (
            "cnn",
            Some((
                Strategy {
                    dp: 1,
                    tp: 1,
                    pp: 2,
                },
                0,
            )),
        ),
        (
            "transformer",
            Some((
                Strategy {
                    dp: 1,
                    tp: 2,
                    pp: 1,
                },
                0,
            )),
        ),
        (
            "transformer",
            Some((
                Strategy {
                    dp: 2,
                    tp: 1,
                    pp: 1,
                },
                3,
            )),
        ),
    ];
    for (name, split) in splits {
        let mut source = model(name);
        // A small batch keeps the runs short; the plans are those of the file otherwise.
        source.experiment.train.batch_size = 8;
        source.experiment.devices.micro_shards = 4;
        let (options, device) = match split {
            None => (Options::default(), Device::Cpu),
            Some((s, zero)) => (
                Options::partitioned(&source, s, zero),
                Device::Simulated(Simulated {
                    grid: Grid {
                        dp: s.dp as usize,
                        tp: s.tp as usize,
                        pp: s.pp as usize,
                    },
                    zero,
                    capacity: u64::MAX,
                }),
            ),
        };
        let original = plan_of(&source, &options);
        let text = original.to_json();
        let loaded = Plan::from_json(&text).unwrap_or_else(|e| panic!("{name} {split:?}: {e}"));
        same_text(&loaded.to_json(), &text);
        let label = format!("plan-json-{name}-{}", split.is_some());
        let want = trained(&source, original, device, &format!("{label}-a"));
        let got = trained(&source, loaded, device, &format!("{label}-b"));
        assert!(
            want == got,
            "{name} {split:?}: the loaded plan trains differently"
        );
    }
}

#[test]
fn the_emitted_plan_loads_and_another_format_is_refused() {
    let dir = temp("emit-plan");
    cli_ok(
        "compile models/gpt-large.ron --emit plan --out",
        &[dir.to_str().unwrap()],
    );
    let text = std::fs::read_to_string(dir.join("plan.json")).unwrap();
    let loaded = Plan::from_json(&text).unwrap();
    assert_eq!(loaded.name, "gpt-large");
    same_text(&loaded.to_json(), &text);

    let format = parallax_compiler::plan::PLAN_FORMAT;
    let future = text.replacen(
        &format!("\"format\": {format}"),
        &format!("\"format\": {}", format + 1),
        1,
    );
    assert!(matches!(
        Plan::from_json(&future),
        Err(PlanError::Format { found }) if found == u64::from(format) + 1
    ));
    let err = Plan::from_json("{\"format\": 1}").unwrap_err().to_string();
    assert!(
        err.starts_with("not a Parallax plan: missing field"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Trains with `args` into a fresh folder; returns `final.safetensors` and the losses.
fn cli_trained(args: &[&str], name: &str) -> (Vec<u8>, String) {
    let dir = temp(name);
    let _ = std::fs::remove_dir_all(&dir);
    let o = parallax(
        &[
            args,
            &["--backend", "cpu", "--run-dir", dir.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    let bytes = std::fs::read(dir.join("final.safetensors")).unwrap();
    let losses: String = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].to_string())
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    (bytes, losses)
}

/// The plan is the seam: `compile FILE --gpus N --emit plan` writes the per-device plan that
/// `train FILE --gpus N` runs, with its split and experiment, and `train --plan` trains it to
/// the same bits.
#[test]
fn train_plan_runs_the_emitted_partitioned_plan_to_the_same_bits() {
    for (file, gpus, strategy, steps) in [
        ("models/mlp.ron", "2", None, "3"),
        ("models/transformer.ron", "2", Some("pp2"), "2"),
    ] {
        let dir = temp(&format!("seam-{gpus}-{}", strategy.unwrap_or("chosen")));
        let mut compile_args = vec!["compile", file, "--gpus", gpus];
        let mut train_args = vec!["train", file, "--gpus", gpus, "--steps", steps];
        if let Some(s) = strategy {
            compile_args.extend(["--strategy", s]);
            train_args.extend(["--strategy", s]);
        }
        let o = parallax(
            &[
                &compile_args[..],
                &["--emit", "plan", "--out", dir.to_str().unwrap()],
            ]
            .concat(),
        );
        assert!(o.status.success(), "{}", stderr(&o));
        let path = dir.join("plan.json");
        let plan = Plan::from_json(&std::fs::read_to_string(&path).unwrap()).unwrap();
        // What the ranks layer takes: a per-shard plan whose stages match its strategy.
        assert!(plan.sharding.is_some(), "{file}: not a per-shard plan");
        assert_eq!(plan.pipeline_stages, plan.strategy.pp, "{file}");
        assert!(
            plan.schedule.is_some() && plan.experiment.is_some(),
            "{file}"
        );
        let want = cli_trained(&train_args, &format!("seam-file-{gpus}"));
        let got = cli_trained(
            &["train", "--plan", path.to_str().unwrap(), "--steps", steps],
            &format!("seam-plan-{gpus}"),
        );
        assert_eq!(want.1, got.1, "{file}: the losses differ");
        assert!(want.0 == got.0, "{file}: the final weights differ");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_plan_without_its_experiment_is_refused() {
    let dir = temp_dir("seam-bare");
    let path = dir.join("plan.json");
    std::fs::write(&path, plan_of(&model("mlp"), &Options::default()).to_json()).unwrap();
    let o = parallax(&["train", "--plan", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("carries no experiment"),
        "{}",
        stderr(&o)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
