//! BatchNorm2d's running statistics against PyTorch's formulas in f64: a training step
//! normalises by the batch's statistics and moves `running_mean` / `running_var` toward them
//! by `momentum` (the variance unbiased); an evaluation normalises by the running ones and
//! changes nothing; a gradient step changes nothing either. The statistics travel with the
//! parameters in the weights file.

mod common;
use common::plan_of;

use parallax_compiler::{parse, Options};
use parallax_runtime::backend::Backend;
use parallax_runtime::cpu::{Executor, Mode};
use parallax_runtime::rng;

const EPS: f64 = 1e-5;
const MOMENTUM: f64 = 0.25;
const SHAPE: [usize; 4] = [4, 2, 3, 3];

fn executor() -> Executor {
    let text = r#"Experiment(
    name: "bn",
    model: Sequential(input: (shape: [2, 3, 3]), layers: [BatchNorm2d(momentum: 0.25)]),
    loss: Mse,
    data: Synthetic(samples: 16),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 4, steps: 1),
)"#;
    let source = parse(text).unwrap();
    let plan = plan_of(&source, &Options::default());
    Executor::new(plan, SHAPE[0], 0)
}

fn sample(key: u64, shift: f32) -> Vec<f32> {
    let key = rng::stream(3, rng::Purpose::Synthetic, key);
    let n: usize = SHAPE.iter().product();
    (0..n)
        .map(|i| 2.0 * rng::normal(key, i as u64) + shift)
        .collect()
}

/// Per channel: (mean, biased variance) of `x [N, C, H, W]`.
fn stats(x: &[f32]) -> Vec<(f64, f64)> {
    let [n, c, h, w] = SHAPE;
    (0..c)
        .map(|ch| {
            let vals: Vec<f64> = (0..n)
                .flat_map(|b| (0..h * w).map(move |k| (b * c + ch) * h * w + k))
                .map(|i| x[i] as f64)
                .collect();
            let m = vals.iter().sum::<f64>() / vals.len() as f64;
            let v = vals.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / vals.len() as f64;
            (m, v)
        })
        .collect()
}

fn normalised(x: &[f32], by: &[(f64, f64)]) -> Vec<f64> {
    let [_, c, h, w] = SHAPE;
    x.iter()
        .enumerate()
        .map(|(i, &a)| {
            let (m, v) = by[(i / (h * w)) % c];
            (a as f64 - m) / (v + EPS).sqrt()
        })
        .collect()
}

fn state(e: &Executor, name: &str) -> Vec<f64> {
    let (_, t) = e.states().into_iter().find(|(n, _)| *n == name).unwrap();
    t.f32().iter().map(|&v| v as f64).collect()
}

fn close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g}, expected {w}"
        );
    }
}

/// One step on `x`. The learning rate is never fed (0), so the affine parameters keep their
/// first values, 1 and 0, while the optimizer's updates still run beside the statistics'.
fn step(e: &mut Executor, x: &[f32], mode: Mode) -> Vec<f64> {
    e.set_f32("x", SHAPE[0], x).unwrap();
    e.set_f32("target", SHAPE[0], &vec![0.0; x.len()]).unwrap();
    e.run(SHAPE[0], mode, 0, 0).unwrap();
    let out = e.output("output").unwrap().f32();
    out.iter().map(|&v| v as f64).collect()
}

#[test]
fn running_statistics_follow_pytorch() {
    let mut e = executor();
    assert_eq!(state(&e, "0.running_mean"), [0.0, 0.0]);
    assert_eq!(state(&e, "0.running_var"), [1.0, 1.0]);
    let count = (SHAPE[0] * SHAPE[2] * SHAPE[3]) as f64;
    let (mut mean, mut var) = (vec![0.0; 2], vec![1.0; 2]);

    // Two training steps: batch statistics, then the running averages move.
    for (k, shift) in [(1, 0.5f32), (2, -1.5)] {
        let x = sample(k, shift);
        let s = stats(&x);
        let y = step(&mut e, &x, Mode::Train);
        close(&y, &normalised(&x, &s), 1e-5, "training output");
        for ch in 0..2 {
            mean[ch] = (1.0 - MOMENTUM) * mean[ch] + MOMENTUM * s[ch].0;
            let unbiased = s[ch].1 * count / (count - 1.0);
            var[ch] = (1.0 - MOMENTUM) * var[ch] + MOMENTUM * unbiased;
        }
        close(&state(&e, "0.running_mean"), &mean, 1e-6, "running_mean");
        close(&state(&e, "0.running_var"), &var, 1e-6, "running_var");
    }

    // An evaluation normalises by the running statistics and leaves them alone; so does a
    // gradient computation.
    let running: Vec<(f64, f64)> = mean.iter().copied().zip(var.iter().copied()).collect();
    let x = sample(3, 4.0);
    let y = step(&mut e, &x, Mode::Eval);
    close(&y, &normalised(&x, &running), 1e-5, "evaluation output");
    let y = step(&mut e, &x, Mode::Gradients);
    close(
        &y,
        &normalised(&x, &stats(&x)),
        1e-5,
        "gradient step output",
    );
    close(
        &state(&e, "0.running_mean"),
        &mean,
        1e-6,
        "running_mean after eval",
    );
    close(
        &state(&e, "0.running_var"),
        &var,
        1e-6,
        "running_var after eval",
    );
}

#[test]
fn running_statistics_are_saved_and_loaded_with_the_weights() {
    let mut e = executor();
    step(&mut e, &sample(1, 2.0), Mode::Train);
    let trained = (state(&e, "0.running_mean"), state(&e, "0.running_var"));
    let shapes = parallax_runtime::run::weights::FileShapes::of(e.plan());
    let bytes = parallax_runtime::run::weights::to_bytes(&e, &shapes).unwrap();
    let file = std::env::temp_dir().join(format!("bn-weights-{}.safetensors", std::process::id()));
    std::fs::write(&file, &bytes).unwrap();

    let mut fresh = executor();
    parallax_runtime::run::weights::load(&mut fresh as &mut dyn Backend, &shapes, &file).unwrap();
    assert_eq!(state(&fresh, "0.running_mean"), trained.0);
    assert_eq!(state(&fresh, "0.running_var"), trained.1);

    // PyTorch's state_dict also holds `num_batches_tracked`: accepted, unused. Anything else
    // unknown is refused.
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    let counter = 7i64.to_le_bytes();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![], &counter);
    tensors.push(("0.num_batches_tracked".into(), view.unwrap()));
    std::fs::write(
        &file,
        safetensors::serialize(tensors.clone(), None).unwrap(),
    )
    .unwrap();
    parallax_runtime::run::weights::load(&mut fresh as &mut dyn Backend, &shapes, &file).unwrap();
    tensors.push((
        "1.num_batches_tracked".into(),
        tensors.last().unwrap().1.clone(),
    ));
    std::fs::write(&file, safetensors::serialize(tensors, None).unwrap()).unwrap();
    let err = parallax_runtime::run::weights::load(&mut fresh as &mut dyn Backend, &shapes, &file)
        .unwrap_err();
    assert!(err.to_string().contains("1.num_batches_tracked"), "{err}");
    std::fs::remove_file(&file).ok();
}

#[test]
fn the_memory_report_counts_running_statistics_apart_from_optimizer_state() {
    // Two channels: a running mean and variance each (16 bytes); plain SGD keeps no state.
    let plan = executor().plan().clone();
    let m = &plan.memory;
    assert_eq!(m.statistics_bytes, 16);
    assert_eq!(m.optimizer_state_bytes, 0);
    assert_eq!(
        m.dedicated_bytes(),
        m.parameter_bytes + m.statistics_bytes + m.input_bytes
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_parallax"))
        .args(["compile", "models/cnn.ron"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    // models/cnn.ron: one BatchNorm2d of 32 channels; SGD's momentum mirrors the parameters.
    assert!(text.contains("+ running statistics 256 B +"), "{text}");
    let line = text.lines().find(|l| l.contains("memory:")).unwrap();
    let after = |what: &str| line.split(what).nth(1).unwrap().split(" +").next().unwrap();
    assert_eq!(after("parameters "), after("optimizer state "), "{line}");
}
