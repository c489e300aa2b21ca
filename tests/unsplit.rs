//! Every partitioned plan against the unsplit one-device plan, on data where the split
//! matters: labels ignored (-100) in numbers that vary from sample to sample (some shards have
//! none counted), clipping by the global norm active in every step, label smoothing,
//! BatchNorm's batch statistics, and a validation pass. Data, pipeline and tensor
//! parallelism, their products and ZeRO 1-3: every step's loss within 1e-5 and every final
//! tensor within 1e-4 (relative) of one device running the batch whole.

mod common;
use common::{
    f32_bytes, f32_tensors, i32_bytes, metric, scaled_difference, temp, temp_dir, train_ok,
    write_npy as npy,
};

use std::collections::BTreeMap;
use std::path::Path;

/// A fixed pseudo-random stream (splitmix64), so the data never depends on anything else.
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> u64 {
        common::splitmix64(&mut self.0)
    }
    /// Uniform in [-1, 1).
    fn value(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// A class below `classes`, or -100 with probability `ignored`.
    fn label(&mut self, classes: u64, ignored: f64) -> i32 {
        if (self.next() >> 11) as f64 / (1u64 << 53) as f64 > ignored {
            self.below(classes) as i32
        } else {
            -100
        }
    }
}

/// A small experiment in its own folder: inputs `x.npy`, labels `y.npy`.
struct Case {
    name: &'static str,
    /// The experiment, reading `x.npy` and `y.npy` beside it.
    ron: &'static str,
    steps: &'static str,
    /// (`--gpus`, `--strategy`, `--zero`)
    grids: &'static [(&'static str, &'static str, &'static str)],
}

/// A classifier with a tensor-parallel Mlp between plain layers: SGD with momentum and
/// weight decay, whose update clipping scales directly (Adam's would mostly cancel it).
const MLP: &str = r#"Experiment(
    name: "unsplit-mlp",
    model: Sequential(
        input: (shape: [6]),
        layers: [Linear(out: 8), Tanh, Mlp(hidden: 16, act: Gelu), Linear(out: 5)],
    ),
    loss: CrossEntropy,
    data: Npy(inputs: "x.npy", labels: "y.npy", validation: 0.2),
    optimizer: Sgd(lr: 0.5, momentum: 0.9, weight_decay: 0.01, clip_norm: 0.02),
    train: (batch_size: 16, steps: 4, seed: 3),
    devices: (micro_shards: 8),
)"#;

/// A small GPT on token sequences with ignored positions, label smoothing, AdamW with a
/// schedule and clipping. Attention has no biases: a key bias gets no gradient in exact
/// arithmetic, so Adam would scale rounding noise up to whole steps.
const GPT: &str = r#"Experiment(
    name: "unsplit-gpt",
    params: { "d": 16 },
    model: Graph(
        symbols: { "seq": 8 },
        inputs: { "tokens": (shape: ["seq"], dtype: I32) },
        blocks: {
            "decoder": [
                ("n1",  LayerNorm,                          ["x"]),
                ("att", Attention(heads: 2, causal: true, bias: false), ["n1"]),
                ("r1",  Add,                                ["x", "att"]),
                ("n2",  LayerNorm,                          ["r1"]),
                ("mlp", Mlp(hidden: "d * 2", act: Gelu),    ["n2"]),
                ("out", Add,                                ["r1", "mlp"]),
            ],
        },
        nodes: [
            ("emb",    Embedding(vocab: 11, dim: "d"),      ["tokens"]),
            ("pos",    PositionalEmbedding(max_len: 8),     ["emb"]),
            ("h",      Repeat(block: "decoder", times: 2),  ["pos"]),
            ("norm",   LayerNorm,                           ["h"]),
            ("logits", Linear(out: 11),                     ["norm"]),
        ],
    ),
    loss: CrossEntropy(label_smoothing: 0.1),
    data: Npy(inputs: "x.npy", labels: "y.npy", validation: 0.0),
    optimizer: AdamW(lr: 1e-2, weight_decay: 0.01, clip_norm: 0.05, schedule: Cosine(warmup: 1)),
    train: (batch_size: 8, steps: 3, seed: 5),
    devices: (micro_shards: 4),
)"#;

/// Convolutions (grouped) and synchronised BatchNorm, Adam with clipping. The convolution
/// before BatchNorm has no bias, which BatchNorm would cancel (see the GPT's attention).
const CNN: &str = r#"Experiment(
    name: "unsplit-cnn",
    model: Sequential(
        input: (shape: [1, 6, 6]),
        layers: [
            Conv2d(out: 4, kernel: 3, padding: 1, bias: false),
            BatchNorm2d,
            Relu,
            MaxPool2d(kernel: 2),
            Conv2d(out: 4, kernel: 2, groups: 2),
            Relu,
            Flatten,
            Linear(out: 3),
        ],
    ),
    loss: CrossEntropy,
    data: Npy(inputs: "x.npy", labels: "y.npy", validation: 0.0),
    optimizer: Adam(lr: 1e-2, clip_norm: 0.05),
    train: (batch_size: 12, steps: 3, seed: 9),
    devices: (micro_shards: 4),
)"#;

const CASES: &[Case] = &[
    Case {
        name: "mlp",
        ron: MLP,
        steps: "4",
        grids: &[
            ("1", "dp1", ""),
            ("2", "dp2", ""),
            ("4", "dp4", ""),
            ("2", "pp2", ""),
            ("2", "tp2", ""),
            ("4", "dp2.tp2", ""),
            ("4", "tp2.pp2", ""),
            ("8", "dp2.tp2.pp2", ""),
            ("2", "dp2", "1"),
            ("2", "dp2", "2"),
            ("2", "dp2", "3"),
            ("4", "dp2.tp2", "2"),
        ],
    },
    Case {
        name: "gpt",
        ron: GPT,
        steps: "3",
        grids: &[
            ("2", "dp2", ""),
            ("2", "pp2", ""),
            ("2", "tp2", ""),
            ("4", "dp2.tp2", ""),
            ("4", "dp2.pp2", ""),
            ("2", "dp2", "3"),
        ],
    },
    Case {
        name: "cnn",
        ron: CNN,
        steps: "3",
        grids: &[
            ("2", "dp2", ""),
            ("4", "dp4", ""),
            ("2", "pp2", ""),
            ("4", "dp2.pp2", ""),
            ("2", "dp2", "1"),
            ("2", "dp2", "2"),
            ("2", "dp2", "3"),
        ],
    },
];

/// Writes the case's experiment and data into `dir`.
fn write_case(case: &Case, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("experiment.ron"), case.ron).unwrap();
    let mut s = Stream(0x5eed ^ case.name.len() as u64);
    match case.name {
        "mlp" => {
            let n = 40;
            let x: Vec<f32> = (0..n * 6).map(|_| s.value()).collect();
            let y: Vec<i32> = (0..n).map(|_| s.label(5, 0.35)).collect();
            npy(&dir.join("x.npy"), "<f4", &[n, 6], &f32_bytes(&x));
            npy(&dir.join("y.npy"), "<i4", &[n], &i32_bytes(&y));
        }
        "gpt" => {
            let n = 24;
            let x: Vec<i32> = (0..n * 8).map(|_| s.below(11) as i32).collect();
            // Each sequence ignores a different number of positions (a prompt of 0-7).
            let mut y = Vec::new();
            for i in 0..n {
                let prompt = s.below(8) as usize;
                for t in 0..8 {
                    y.push(if t < prompt {
                        -100
                    } else {
                        x[i * 8 + (t + 1) % 8]
                    });
                }
            }
            npy(&dir.join("x.npy"), "<i4", &[n, 8], &i32_bytes(&x));
            npy(&dir.join("y.npy"), "<i4", &[n, 8], &i32_bytes(&y));
        }
        "cnn" => {
            let n = 30;
            let x: Vec<f32> = (0..n * 36).map(|_| s.value()).collect();
            let y: Vec<i32> = (0..n).map(|_| s.label(3, 0.4)).collect();
            npy(&dir.join("x.npy"), "<f4", &[n, 1, 6, 6], &f32_bytes(&x));
            npy(&dir.join("y.npy"), "<i4", &[n], &i32_bytes(&y));
        }
        other => panic!("no data for {other}"),
    }
}

/// What a run leaves to compare: each step's loss, each validation loss, the final tensors.
struct Outcome {
    losses: Vec<f64>,
    val_losses: Vec<f64>,
    tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

fn train(file: &Path, run: &Path, args: &[&str]) -> Outcome {
    train_ok(file.to_str().unwrap(), run, args);
    let outcome = Outcome {
        losses: metric(run, "loss"),
        val_losses: metric(run, "val_loss"),
        tensors: f32_tensors(&run.join("final.safetensors")),
    };
    let _ = std::fs::remove_dir_all(run);
    outcome
}

/// The largest `|a - b| / max(|a|, |b|)` over paired values.
fn relative(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "different numbers of values");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-30))
        .fold(0.0, f64::max)
}

/// The largest over tensors of `max |a - b| / max |b|`: a tensor's error against its scale.
fn tensor_relative(got: &Outcome, want: &Outcome) -> (f64, String) {
    let names = |o: &Outcome| o.tensors.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "different tensors");
    let mut worst = (0.0, String::new());
    for (name, (shape, b)) in &want.tensors {
        let (s, a) = &got.tensors[name];
        assert_eq!(s, shape, "`{name}`: shape");
        let r = scaled_difference(a, b);
        if r >= worst.0 {
            worst = (r, name.clone());
        }
    }
    worst
}

#[test]
fn every_partitioned_plan_computes_what_one_device_computes() {
    let mut failures = Vec::new();
    for case in CASES {
        let dir = temp(&format!("unsplit-{}", case.name));
        write_case(case, &dir);
        let file = dir.join("experiment.ron");
        let unsplit = train(&file, &dir.join("run-unsplit"), &["--steps", case.steps]);
        assert!(
            unsplit.losses.iter().all(|l| l.is_finite() && *l > 0.0),
            "{}: {:?}",
            case.name,
            unsplit.losses
        );
        // Run the grids two at a time (the machine has two cores).
        let outcomes: Vec<(String, Outcome)> = std::thread::scope(|scope| {
            let mut out = Vec::new();
            for pair in case.grids.chunks(2) {
                let handles: Vec<_> = pair
                    .iter()
                    .map(|&(gpus, strategy, zero)| {
                        let label = if zero.is_empty() {
                            strategy.to_string()
                        } else {
                            format!("{strategy} zero{zero}")
                        };
                        let run = dir.join(format!("run-{}", label.replace(' ', "-")));
                        let file = &file;
                        scope.spawn(move || {
                            let mut args = vec![
                                "--steps",
                                case.steps,
                                "--gpus",
                                gpus,
                                "--strategy",
                                strategy,
                            ];
                            if !zero.is_empty() {
                                args.extend(["--zero", zero]);
                            }
                            (label, train(file, &run, &args))
                        })
                    })
                    .collect();
                out.extend(handles.into_iter().map(|h| h.join().unwrap()));
            }
            out
        });
        for (label, got) in outcomes {
            let loss = relative(&got.losses, &unsplit.losses);
            let val = relative(&got.val_losses, &unsplit.val_losses);
            let (tensor, which) = tensor_relative(&got, &unsplit);
            println!(
                "{:4} {:16} loss {loss:.1e}  val_loss {val:.1e}  tensors {tensor:.1e} ({which})",
                case.name, label
            );
            if loss > 1e-5 || val > 1e-5 || tensor > 1e-4 {
                failures.push(format!(
                    "{} as {label}: loss {loss:e}, val_loss {val:e}, `{which}` {tensor:e}",
                    case.name
                ));
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Writes `tensors` (name, shape, values) as a safetensors file.
fn write_safetensors(path: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| f32_bytes(v)).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b);
            (name.to_string(), view.unwrap())
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// The issue's smallest case: `Linear(3 -> 2)`, labels `[0, -100, 1, 1]`, one batch of 4 in
/// 2 micro-shards (one counted label in the first, two in the second). The step's loss is
/// the sum over the 3 counted labels over 3, on one device and on every device count, and
/// the first bias update follows from it (both computed here in f64 from the same weights).
#[test]
fn ignored_labels_weigh_shards_by_their_counted_labels() {
    let dir = temp_dir("ignored-labels");
    let x: [[f32; 3]; 4] = [
        [0.5, -1.0, 2.0],
        [1.5, 0.25, -0.5],
        [-1.0, 1.0, 0.0],
        [0.3, 0.7, -0.2],
    ];
    let y = [0, -100, 1, 1];
    let w: [[f32; 3]; 2] = [[0.2, -0.4, 0.1], [-0.3, 0.5, 0.25]];
    let b = [0.05f32, -0.1];
    npy(
        &dir.join("x.npy"),
        "<f4",
        &[4, 3],
        &f32_bytes(x.as_flattened()),
    );
    npy(&dir.join("y.npy"), "<i4", &[4], &i32_bytes(&y));
    let init = dir.join("init.safetensors");
    write_safetensors(
        &init,
        &[
            ("0.weight", vec![2, 3], w.as_flattened().to_vec()),
            ("0.bias", vec![2], b.to_vec()),
        ],
    );
    std::fs::write(
        dir.join("experiment.ron"),
        r#"Experiment(
    name: "ignored-labels",
    model: Sequential(input: (shape: [3]), layers: [Linear(out: 2)]),
    loss: CrossEntropy,
    data: Npy(inputs: "x.npy", labels: "y.npy", validation: 0.0),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 4, steps: 1, seed: 1),
    devices: (micro_shards: 2),
)"#,
    )
    .unwrap();
    // The reference: mean over the counted labels of -log softmax, and its bias gradient.
    let (mut loss, mut grad_b, mut counted) = (0f64, [0f64; 2], 0f64);
    for (xi, &yi) in x.iter().zip(&y) {
        if yi == -100 {
            continue;
        }
        let z: Vec<f64> = (0..2)
            .map(|o| {
                f64::from(b[o])
                    + (0..3)
                        .map(|k| f64::from(w[o][k]) * f64::from(xi[k]))
                        .sum::<f64>()
            })
            .collect();
        let lse = z.iter().map(|v| v.exp()).sum::<f64>().ln();
        loss += lse - z[yi as usize];
        for o in 0..2 {
            grad_b[o] += (z[o] - lse).exp() - f64::from(u8::from(o == yi as usize));
        }
        counted += 1.0;
    }
    let loss = loss / counted;
    let bias: Vec<f64> = (0..2)
        .map(|o| f64::from(b[o]) - 0.1 * grad_b[o] / counted)
        .collect();
    let file = dir.join("experiment.ron");
    let init = init.to_str().unwrap();
    for gpus in [None, Some("1"), Some("2")] {
        let run = dir.join(format!("run-{gpus:?}"));
        let mut args = vec!["--init", init];
        if let Some(n) = gpus {
            args.extend(["--gpus", n]);
        }
        let got = train(&file, &run, &args);
        let r = relative(&got.losses, &[loss]);
        assert!(
            r < 1e-6,
            "--gpus {gpus:?}: loss {:?}, want {loss}",
            got.losses
        );
        let (_, new_bias) = &got.tensors["0.bias"];
        let new_bias: Vec<f64> = new_bias.iter().map(|&v| f64::from(v)).collect();
        let r = relative(&new_bias, &bias);
        assert!(
            r < 1e-6,
            "--gpus {gpus:?}: bias {new_bias:?}, want {bias:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The issue's smallest case of clipping under tensor parallelism: one `Mlp(hidden: 8)`
/// clipped to 0.001. Each tensor rank holds half of fc1 and fc2.weight, and both hold all of
/// fc2.bias: the global norm sums the halves over the ranks and counts fc2.bias once, so both
/// ranks scale by the one device's factor.
#[test]
fn clipping_under_tensor_parallelism_uses_the_global_norm() {
    let dir = temp_dir("clip-tp");
    let mut s = Stream(17);
    let x: Vec<f32> = (0..32).map(|_| s.value()).collect();
    let y: Vec<f32> = (0..32).map(|_| s.value()).collect();
    npy(&dir.join("x.npy"), "<f4", &[8, 4], &f32_bytes(&x));
    npy(&dir.join("y.npy"), "<f4", &[8, 4], &f32_bytes(&y));
    std::fs::write(
        dir.join("experiment.ron"),
        r#"Experiment(
    name: "clip-tp",
    model: Sequential(input: (shape: [4]), layers: [Mlp(hidden: 8)]),
    loss: Mse,
    data: Npy(inputs: "x.npy", labels: "y.npy", validation: 0.0),
    optimizer: Sgd(lr: 1.0, clip_norm: 0.001),
    train: (batch_size: 8, steps: 3, seed: 1),
)"#,
    )
    .unwrap();
    let file = dir.join("experiment.ron");
    let one = train(&file, &dir.join("run-1"), &[]);
    for strategy in ["tp2", "dp2.tp2"] {
        let n = if strategy == "tp2" { "2" } else { "4" };
        let args = ["--gpus", n, "--strategy", strategy];
        let got = train(&file, &dir.join(format!("run-{strategy}")), &args);
        let (r, which) = tensor_relative(&got, &one);
        assert!(r < 1e-5, "{strategy}: `{which}` differs by {r:e}");
        let r = relative(&got.losses, &one.losses);
        assert!(r < 1e-6, "{strategy}: losses differ by {r:e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
