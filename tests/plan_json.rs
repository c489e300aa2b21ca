//! `plan.json` reads back: every model's plan, unsplit and partitioned, survives the round
//! trip unchanged, and the loaded copy trains to the same bits as the plan it was written
//! from; `parallax compile --emit plan` writes what loads; another format is refused.

mod common;
use common::{parallax, stderr, temp};

use parallax_compiler::plan::{Plan, PlanError, Strategy};
use parallax_compiler::{compile, parse_bytes, Options, Source};
use parallax_runtime::ranks::Grid;
use parallax_runtime::train::{train, Device, Simulated, TrainConfig};
use std::path::Path;

fn model(name: &str) -> Source {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("models/{name}.ron"));
    parse_bytes(&std::fs::read(path).unwrap()).unwrap()
}

fn plan(source: &Source, options: &Options) -> Plan {
    compile(source, options, &mut |_, _| {})
        .unwrap()
        .plan(source, options)
}

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
        let original = plan(&source, &options);
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
    let o = parallax(&[
        "compile",
        "models/gpt-large.ron",
        "--emit",
        "plan",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(dir.join("plan.json")).unwrap();
    let loaded = Plan::from_json(&text).unwrap();
    assert_eq!(loaded.name, "gpt-large");
    same_text(&loaded.to_json(), &text);

    let future = text.replacen("\"format\": 1", "\"format\": 2", 1);
    assert!(matches!(
        Plan::from_json(&future),
        Err(PlanError::Format { found: 2 })
    ));
    let err = Plan::from_json("{\"format\": 1}").unwrap_err().to_string();
    assert!(
        err.starts_with("not a Parallax plan: missing field"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
