//! NaN and infinities that the loss does not show (a ReLU or a max-pooling hides them) are
//! caught where they start: in the data as loaded, in an `--init` file, in any gradient,
//! parameter or state after a step (the same answer on one device and on simulated ones),
//! and never written to the final weights or a checkpoint.

mod common;
use common::{
    argv, f32_bytes, f32_tensors, i32_bytes, parallax, plan_of, stderr, temp, temp_dir, train_ok,
    write_experiment, write_f32_tensors, write_npy,
};

use parallax_compiler::shards::Sharding;
use parallax_compiler::{parse_bytes, Options, Plan};
use parallax_runtime::backend::Backend;
use parallax_runtime::cpu::{Executor, Mode};
use parallax_runtime::data::Values;
use parallax_runtime::exec::finite::{Count, Kind, NonFinite};
use parallax_runtime::ranks::{Grid, Ranks};
use parallax_runtime::run::weights::FileShapes;
use std::path::Path;

/// Runs `parallax train` and expects it refused: exit 1, no panic; returns stderr.
fn refused(args: &[&str]) -> String {
    let o = parallax(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// Writes the experiment `text` as `dir/exp.ron` and trains it into `dir/run`, refused (see
/// [`refused`]); returns stderr.
fn refused_experiment(dir: &Path, text: &str) -> String {
    let exp = write_experiment(&dir.join("exp.ron"), text);
    refused(&[
        "train",
        &exp,
        "--run-dir",
        dir.join("run").to_str().unwrap(),
    ])
}

/// Every value of every tensor of the safetensors files in `dir` and below.
fn assert_files_finite(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            assert_files_finite(&path);
        } else if path.extension().is_some_and(|e| e == "safetensors") {
            for (name, (_, v)) in f32_tensors(&path) {
                let bad = v.iter().filter(|x| !x.is_finite()).count();
                assert_eq!(
                    bad,
                    0,
                    "{}: `{name}` holds {bad} non-finite values",
                    path.display()
                );
            }
        }
    }
}

/// A CNN at a learning rate of 100 makes non-finite values that its ReLUs and max-poolings
/// hide from the loss (it saved thousands of NaN and exited 0); the step that makes them stops the run, naming the tensor and the learning rate, and
/// nothing non-finite is written. Simulated devices stop at the same step on the same tensor.
#[test]
fn a_diverging_cnn_stops_at_the_step_naming_the_tensor() {
    let mut messages = Vec::new();
    for grid in [
        &[][..],
        &["--gpus", "2"],
        &["--gpus", "2", "--strategy", "pp2"],
        &["--gpus", "2", "--strategy", "dp2", "--zero", "2"],
    ] {
        let run = temp(&format!("nan-cnn-{}", grid.join("-")));
        let tail = [&[run.to_str().unwrap()][..], grid].concat();
        let err = refused(&argv(
            "train models/cnn.ron --steps 30 --set optimizer.lr=100.0 --checkpoint-every 1 --run-dir",
            &tail,
        ));
        assert!(err.contains(STEP_AND_TENSOR), "{grid:?}: {err}");
        assert!(
            err.contains("lower the learning rate (now 100)") && err.contains("clip_norm"),
            "{err}"
        );
        assert!(!run.join("final.safetensors").exists(), "{err}");
        // The checkpoints of the 3 steps before are there, and finite.
        let checkpoints = std::fs::read_dir(run.join("checkpoints")).unwrap().count();
        assert_eq!(checkpoints, 3, "{err}");
        assert_files_finite(&run);
        // The loss differs in its last bits between the unsplit batch and micro-shards.
        messages.push(
            err[err.find("error:").unwrap()..err.find("which the loss").unwrap()].to_string(),
        );
        let _ = std::fs::remove_dir_all(&run);
    }
    assert!(messages.iter().all(|m| *m == messages[0]), "{messages:#?}");
}

/// What the CNN at a learning rate of 100 stops with (seed 7, the file's).
const STEP_AND_TENSOR: &str =
    "error: step 4: the state `4.running_var` (21 of 32 values are infinite) went non-finite, which the loss (";

/// A small classifier of 6 features read from NPY files in `dir`.
const NPY_MLP: &str = r#"Experiment(
    name: "nan-data",
    model: Sequential(input: (shape: [6]), layers: [Linear(out: 8), Relu, Linear(out: 3)]),
    loss: CrossEntropy,
    data: Npy(inputs: "x.npy", labels: "y.npy", validation: 0.2),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 10, steps: 5, seed: 3),
)"#;

/// NaN in one feature of every tenth sample is refused as the data are loaded, naming the
/// file, the first such sample and feature, and how many there are; nothing is trained.
#[test]
fn nan_inputs_are_refused_at_load() {
    let dir = temp_dir("nan-inputs");
    let n = 100;
    let mut x: Vec<f32> = (0..n * 6).map(|i| (i % 7) as f32 / 7.0).collect();
    for s in (3..n).step_by(10) {
        x[s * 6 + 2] = f32::NAN;
    }
    let y: Vec<i32> = (0..n as i32).map(|i| i % 3).collect();
    write_npy(&dir.join("x.npy"), "<f4", &[n, 6], &f32_bytes(&x));
    write_npy(&dir.join("y.npy"), "<i4", &[n], &i32_bytes(&y));
    let run = dir.join("run");
    let err = refused_experiment(&dir, NPY_MLP);
    let file = dir.join("x.npy").display().to_string();
    assert!(
        err.contains(&format!(
            "{file}: feature 2 of sample 3 is NaN; 10 value(s) in 10 sample(s) are NaN or infinite"
        )),
        "{err}"
    );
    assert!(err.contains("fix or drop those samples"), "{err}");
    assert!(!run.exists(), "trained on bad data: {err}");

    // Any loader: a CSV file (features, then the label) with an infinity in sample 4.
    let rows: Vec<String> = (0..20)
        .map(|i| {
            let f = if i == 4 {
                "inf".to_string()
            } else {
                format!("0.{i}")
            };
            format!("0.5,{f},1,2,3,4,{}", i % 3)
        })
        .collect();
    std::fs::write(dir.join("d.csv"), rows.join("\n")).unwrap();
    let csv = NPY_MLP.replace(
        r#"Npy(inputs: "x.npy", labels: "y.npy", validation: 0.2)"#,
        r#"Csv(path: "d.csv", validation: 0.2)"#,
    );
    let err = refused_experiment(&dir, &csv);
    let file = dir.join("d.csv").display().to_string();
    assert!(
        err.contains(&format!(
            "{file}: feature 1 of sample 4 is inf; 1 value(s) in 1 sample(s) are NaN or infinite"
        )),
        "{err}"
    );
    assert!(!run.exists(), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A regression model reading 3 features and 2 targets from NPY files.
const NPY_MSE: &str = r#"Experiment(
    name: "nan-target",
    model: Sequential(input: (shape: [3]), layers: [Linear(out: 4), Relu, Linear(out: 2)]),
    loss: Mse,
    data: Npy(inputs: "x.npy", labels: "y.npy", validation: 0.2),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 8, steps: 4, seed: 5),
)"#;

/// A NaN target in a validation sample (which made every validation loss NaN, and null in
/// the metrics) is refused as the data are loaded, naming the labels file and the sample.
#[test]
fn a_nan_validation_target_is_refused_at_load() {
    use parallax_runtime::rng::{permutation, stream, Purpose};
    let dir = temp_dir("nan-target");
    let n = 40;
    let x: Vec<f32> = (0..n * 3).map(|i| (i % 5) as f32 / 5.0).collect();
    let mut y: Vec<f32> = (0..n * 2).map(|i| (i % 3) as f32).collect();
    // The split's first sample is a validation sample (see `data::split`), seed 5.
    let val = permutation(stream(5, Purpose::Split, 0), n)[0];
    y[val * 2 + 1] = f32::NAN;
    write_npy(&dir.join("x.npy"), "<f4", &[n, 3], &f32_bytes(&x));
    write_npy(&dir.join("y.npy"), "<f4", &[n, 2], &f32_bytes(&y));
    let run = dir.join("run");
    let err = refused_experiment(&dir, NPY_MSE);
    let file = dir.join("y.npy").display().to_string();
    assert!(
        err.contains(&format!(
            "{file}: target value 1 of sample {val} is NaN; 1 value(s) in 1 sample(s)"
        )),
        "{err}"
    );
    assert!(!run.exists(), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A validation sample that is finite but huge makes the validation loss overflow: the run
/// stops naming the epoch (it printed `validation loss inf` and went on) and writes no
/// weights.
#[test]
fn a_non_finite_validation_loss_stops_the_run() {
    use parallax_runtime::rng::{permutation, stream, Purpose};
    let dir = temp_dir("inf-validation");
    let n = 40;
    let mut x: Vec<f32> = (0..n * 3).map(|i| (i % 5) as f32 / 5.0).collect();
    let y: Vec<f32> = (0..n * 2).map(|i| (i % 3) as f32).collect();
    let val = permutation(stream(5, Purpose::Split, 0), n)[0];
    x[val * 3..val * 3 + 3].fill(3e38);
    write_npy(&dir.join("x.npy"), "<f4", &[n, 3], &f32_bytes(&x));
    write_npy(&dir.join("y.npy"), "<f4", &[n, 2], &f32_bytes(&y));
    let run = dir.join("run");
    let err = refused_experiment(&dir, NPY_MSE);
    assert!(
        err.contains("error: the validation after epoch 0 (step 4): the validation loss is inf, though every tensor of the step was finite;"),
        "{err}"
    );
    assert!(!err.contains("validation loss inf"), "{err}");
    assert!(!run.join("final.safetensors").exists(), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An `--init` file whose first layer is all NaN is refused, naming the file and tensor.
#[test]
fn a_nan_init_tensor_is_refused() {
    let dir = temp("nan-init");
    let first = dir.join("first");
    train_ok("models/mlp.ron", &first, &["--steps", "1"]);
    let mut tensors = f32_tensors(&first.join("final.safetensors"));
    let (_, v) = tensors.get_mut("0.weight").unwrap();
    v.fill(f32::NAN);
    let n = v.len();
    let init = dir.join("nan.safetensors");
    write_f32_tensors(&init, &tensors);
    let run = dir.join("run");
    let err = refused(&argv(
        "train models/mlp.ron --steps 1 --init",
        &[init.to_str().unwrap(), "--run-dir", run.to_str().unwrap()],
    ));
    assert!(
        err.contains(&format!(
            "{}: tensor `0.weight`: value 0 is NaN ({n} of {n} values are NaN): the weights must be finite",
            init.display()
        )),
        "{err}"
    );
    assert!(!run.exists(), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A two-layer classifier, split into 2 micro-shards for simulated devices.
const TINY: &str = r#"Experiment(
    name: "tiny",
    model: Sequential(input: (shape: [4]), layers: [Linear(out: 8), Relu, Linear(out: 3)]),
    loss: CrossEntropy,
    data: Synthetic(samples: 8),
    optimizer: Sgd(lr: 0.1, momentum: 0.9),
    train: (batch_size: 4, steps: 1, seed: 1),
    devices: (micro_shards: 2),
)"#;

fn tiny_plan(sharded: bool) -> Plan {
    let source = parse_bytes(TINY.as_bytes()).unwrap();
    let options = Options {
        shards: sharded.then(|| Sharding::new(2, 4)),
        ..Options::default()
    };
    plan_of(&source, &options)
}

/// The CPU executor and two simulated devices, the same parameters.
fn backends() -> (Executor, Ranks) {
    let cpu = Executor::new(tiny_plan(false), 4, 1);
    let grid = Grid {
        dp: 2,
        tp: 1,
        pp: 1,
    };
    let sim = Ranks::in_process(tiny_plan(true), grid, 1, u64::MAX).unwrap();
    (cpu, sim)
}

/// One training step on a batch of 4 whose inputs are `x`.
fn step(e: &mut dyn Backend, x: &[f32]) {
    let plan = tiny_plan(false);
    let source = parse_bytes(TINY.as_bytes()).unwrap();
    let (_, input, target) =
        parallax_runtime::train::model_io(&plan, &source.experiment.loss).unwrap();
    e.set_input(&input, 4, &Values::F32(x.to_vec())).unwrap();
    e.set_input(&target, 4, &Values::I32(vec![0, 1, 2, 0]))
        .unwrap();
    parallax_runtime::train::set_scalars(e, &source.experiment.optimizer, 0, 1).unwrap();
    e.run(4, Mode::Train, 0, 0).unwrap();
}

/// A NaN planted in a parameter, and one in an input (it reaches the first layer's gradient
/// and, through the update, its weights): the CPU executor and the simulated devices find
/// the same first tensor, with the same counts.
#[test]
fn first_non_finite_is_the_same_on_one_device_and_simulated_ones() {
    let (mut cpu, mut sim) = backends();
    assert_eq!(Backend::first_non_finite(&cpu).unwrap(), None);
    assert_eq!(sim.first_non_finite().unwrap(), None);
    let (name, shape, mut v) = cpu.param_values().unwrap().swap_remove(2);
    assert_eq!((name.as_str(), shape.as_slice()), ("2.weight", &[3, 8][..]));
    v[5] = f32::NAN;
    let expected = NonFinite {
        kind: Kind::Parameter,
        name: "2.weight".into(),
        count: Count {
            first: 5,
            value: f32::NAN,
            nan: 1,
            infinite: 0,
            len: 24,
        },
    };
    for e in [&mut cpu as &mut dyn Backend, &mut sim] {
        e.set_param(&name, &shape, &v).unwrap();
        let found = e.first_non_finite().unwrap().expect("the planted NaN");
        // NaN != NaN: compare the rest, then the value's class.
        assert!(found.count.value.is_nan());
        let found = NonFinite {
            count: Count {
                value: f32::NAN,
                ..found.count
            },
            ..found
        };
        assert_eq!(format!("{found:?}"), format!("{expected:?}"));
        assert_eq!(
            found.to_string(),
            "the parameter `2.weight` (1 of 24 values is NaN)"
        );
    }

    // Feature 1 of sample 2 is NaN: the first layer's gradient is NaN in column 1 (every
    // unit's), which the gradients before the parameters name first.
    let (mut cpu, mut sim) = backends();
    let mut x: Vec<f32> = (0..16).map(|i| i as f32 / 16.0 - 0.4).collect();
    x[2 * 4 + 1] = f32::NAN;
    step(&mut cpu, &x);
    step(&mut sim, &x);
    let (a, b) = (
        Backend::first_non_finite(&cpu).unwrap().unwrap(),
        sim.first_non_finite().unwrap().unwrap(),
    );
    assert_eq!((a.kind, a.name.as_str()), (Kind::Gradient, "0.weight"));
    assert_eq!((a.count.nan, a.count.infinite, a.count.len), (8, 0, 32));
    assert_eq!(a.to_string(), b.to_string());
    assert_eq!(a.count.first, b.count.first);
}

/// The final weights and a checkpoint refuse a non-finite tensor (the CUDA executor relies
/// on it), naming it, and write nothing.
#[test]
fn weights_and_checkpoints_are_never_written_non_finite() {
    let (mut cpu, _) = backends();
    let (name, shape, mut v) = cpu.param_values().unwrap().swap_remove(1);
    v[3] = f32::INFINITY;
    cpu.set_param(&name, &shape, &v).unwrap();
    let dir = temp_dir("nan-save");
    let files = FileShapes::of(cpu.plan());
    let path = dir.join("final.safetensors");
    let err = parallax_runtime::run::weights::save(&cpu, &files, &path).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}: tensor `0.bias`: value 3 is inf (1 of 8 values is infinite): not written, the weights must be finite",
            path.display()
        )
    );
    assert!(!path.exists());
    let meta = parallax_runtime::run::checkpoint::Meta {
        step: 4,
        run_id: "r".into(),
        model: "m".into(),
        plan: "p".into(),
    };
    let err = parallax_runtime::run::checkpoint::save(&dir, &cpu, &files, &meta, 0).unwrap_err();
    assert!(
        err.to_string()
            .contains("step-00000004.safetensors: tensor `0.bias`: value 3 is inf"),
        "{err}"
    );
    assert!(!dir
        .join("checkpoints")
        .join("step-00000004.safetensors")
        .exists());
    let _ = std::fs::remove_dir_all(&dir);
}
