//! Activations stored in bf16 (`devices.activations: Bf16`): the storage pass keeps the
//! activations, their gradients and the weights' bf16 copies that products multiply in bf16
//! and nothing else, the memory plan and the planner count them at 2 bytes, the CPU rounds
//! each to bf16 as its kernel stores it, training stays within bf16's tolerance of the f32
//! plan, and every device grid gives the same bits. (The CUDA code's bf16 loads, stores and
//! GEMMs are checked in `codegen`'s tests, and against this oracle by `scripts/gpu-check.sh`.)

mod common;
use common::{parallax, scaled_difference, stdout, temp, train_steps};

use parallax_compiler::dsl::ast::Storage;
use parallax_compiler::ir::verify::verify;
use parallax_compiler::ir::{DType, Graph, OpKind, Phase};
use parallax_compiler::plan::Plan;
use parallax_compiler::{compile, parse_bytes, Options, Source};
use parallax_runtime::cpu::Mode;
use std::collections::HashMap;

fn source(path: &str, storage: Storage) -> Source {
    let path = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    let mut s = parse_bytes(&std::fs::read(path).unwrap()).unwrap();
    s.experiment.devices.activations = storage;
    s
}

fn compiled(s: &Source) -> (Graph, Plan) {
    let options = Options::default();
    let c = compile(s, &options, &mut |_, _| {}).unwrap();
    let plan = c.plan(s, &options);
    (c.graph, plan)
}

#[test]
fn the_storage_pass_keeps_activations_and_their_gradients_in_bf16_and_nothing_else() {
    let (g, plan) = compiled(&source("models/transformer.ron", Storage::Bf16));
    verify(&g).unwrap();
    let stored: Vec<_> = parallax_compiler::passes::fuse::stored(&g)
        .into_iter()
        .flatten()
        .collect();
    let kind_of = |k: OpKind| -> Vec<parallax_compiler::ir::NodeIndex> {
        stored
            .iter()
            .copied()
            .filter(|&n| g.g[n].op.kind() == k)
            .collect()
    };
    // Every stored attention output, layer norm and matmul of a batch: bf16.
    for k in [OpKind::Attention, OpKind::LayerNorm, OpKind::AttentionGrad] {
        assert!(!kind_of(k).is_empty(), "{k:?}");
        for n in kind_of(k) {
            assert_eq!(g.stored_dtype(n), DType::BF16, "{k:?} `{}`", g.g[n].layer);
        }
    }
    let per_sample =
        |n: parallax_compiler::ir::NodeIndex| g.g[n].ty.shape.iter().any(|d| !d.syms.is_empty());
    let matmuls: Vec<_> = kind_of(OpKind::MatMul)
        .into_iter()
        .filter(|&n| per_sample(n))
        .collect();
    assert!(matmuls.iter().all(|&n| g.stored_dtype(n) == DType::BF16));
    // Statistics, losses, parameters, their gradients and updates, state: f32.
    for k in [
        OpKind::AttentionLse,
        OpKind::CrossEntropy,
        OpKind::ReduceSum,
    ] {
        for n in kind_of(k) {
            assert_eq!(g.stored_dtype(n), DType::F32, "{k:?} `{}`", g.g[n].layer);
        }
    }
    for &(p, grad) in &g.grads {
        assert_eq!(g.stored_dtype(p), DType::F32);
        assert_eq!(
            g.stored_dtype(grad),
            DType::F32,
            "gradient `{}`",
            g.g[grad].layer
        );
    }
    for &(old, new) in &g.updates {
        assert_eq!(g.stored_dtype(old), DType::F32);
        assert_eq!(g.stored_dtype(new), DType::F32);
    }
    assert!(g
        .bf16_stored
        .iter()
        .all(|&n| g.g[n].phase != Phase::Update && g.g[n].ty.dtype == DType::F32));
    assert!(plan.bf16_activations());
    // Every product multiplies a weight's bf16 copy, never the f32 parameter, and each copy
    // (one per parameter) is stored in bf16.
    let copies: Vec<_> =
        g.g.node_indices()
            .filter(|&n| g.g[n].op.kind() == OpKind::RoundBf16)
            .collect();
    assert!(!copies.is_empty());
    for &c in &copies {
        let [p] = g.operands(c)[..] else {
            panic!("one operand")
        };
        assert_eq!(g.g[p].op.kind(), OpKind::Param);
        assert_eq!(g.stored_dtype(c), DType::BF16, "`{}`", g.g[c].layer);
    }
    // The copies are made by one grouped kernel (one launch).
    let kernel_of = g.kernel_of();
    let k = kernel_of[&copies[0]];
    assert!(copies.iter().all(|c| kernel_of[c] == k));
    assert!(matches!(
        g.kernels[k].kind,
        parallax_compiler::ir::KernelKind::Grouped { members, .. } if members as usize == copies.len()
    ));
    for n in g.g.node_indices() {
        if g.g[n].op.kind() == OpKind::MatMul {
            assert!(g
                .operands(n)
                .iter()
                .all(|&o| g.g[o].op.kind() != OpKind::Param));
        }
    }

    // The verifier refuses a parameter's gradient stored in bf16.
    let mut bad = g.clone();
    bad.bf16_stored.insert(g.grads[0].1);
    let e = verify(&bad).unwrap_err();
    assert!(
        e.contains("stored in bf16 but is no activation nor a bf16 copy"),
        "{e}"
    );

    // With f32 storage nothing is bf16.
    let (g32, plan32) = compiled(&source("models/transformer.ron", Storage::F32));
    assert!(g32.bf16_stored.is_empty() && !plan32.bf16_activations());
}

/// A product's other f32 operands get bf16 copies too (mlp: the input, forward and in the
/// first weight's gradient), so every matmul of the forward and the backward multiplies two
/// bf16-stored values, as a GEMM library does, on every backend alike.
#[test]
fn every_product_multiplies_two_bf16_values() {
    for model in ["models/mlp.ron", "models/transformer.ron"] {
        let (g, _) = compiled(&source(model, Storage::Bf16));
        let mut products = 0;
        for n in g.g.node_indices() {
            if g.g[n].op.kind() == OpKind::MatMul {
                products += 1;
                for o in g.operands(n) {
                    assert_eq!(
                        g.stored_dtype(o),
                        DType::BF16,
                        "{model}: `{}`",
                        g.g[o].layer
                    );
                }
            }
        }
        assert!(products > 0);
    }
    let (g, _) = compiled(&source("models/mlp.ron", Storage::Bf16));
    let copies: Vec<_> =
        g.g.node_indices()
            .filter(|&n| g.g[n].op.kind() == OpKind::RoundBf16)
            .collect();
    let of_input = |n: &&_| {
        g.operands(**n)
            .iter()
            .all(|&o| g.g[o].op.kind() == OpKind::Input)
    };
    assert_eq!(copies.iter().filter(of_input).count(), 1);
    // The input's copy is made with the weights', in one grouped launch.
    let kernel_of = g.kernel_of();
    assert!(copies.iter().all(|c| kernel_of[c] == kernel_of[&copies[0]]));
}

/// The activations at the peak halve; parameters and optimizer state do not change; the
/// planner's estimate of a device's peak falls with them.
#[test]
fn the_memory_plan_counts_bf16_activations_at_two_bytes() {
    for model in ["models/transformer.ron", "models/cnn.ron"] {
        let (_, p32) = compiled(&source(model, Storage::F32));
        let (_, p16) = compiled(&source(model, Storage::Bf16));
        let (m32, m16) = (&p32.memory, &p16.memory);
        assert_eq!(m32.parameter_bytes, m16.parameter_bytes);
        assert_eq!(m32.optimizer_state_bytes, m16.optimizer_state_bytes);
        assert_eq!(m32.input_bytes, m16.input_bytes);
        let ratio = m16.activation_bytes_at_peak() as f64 / m32.activation_bytes_at_peak() as f64;
        assert!(
            (0.45..0.62).contains(&ratio),
            "{model}: activations at the peak {} -> {} bytes ({ratio})",
            m32.activation_bytes_at_peak(),
            m16.activation_bytes_at_peak()
        );
    }
    let report = |storage: &str| {
        let o = parallax(&[
            "compile",
            "models/transformer.ron",
            "--set",
            &format!("devices.activations={storage}"),
        ]);
        assert!(o.status.success(), "{}", common::stderr(&o));
        stdout(&o)
    };
    let peak = |text: &str| -> f64 {
        // `per-GPU peak 26.32 MiB of ...`
        let at = text.find("per-GPU peak ").unwrap() + "per-GPU peak ".len();
        let mut words = text[at..].split_whitespace();
        let value: f64 = words.next().unwrap().parse().unwrap();
        let unit = match words.next().unwrap() {
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            u => panic!("unit {u}"),
        };
        value * unit
    };
    let (f32_report, bf16_report) = (report("F32"), report("Bf16"));
    assert!(bf16_report.contains(" in bf16 ("), "{bf16_report}");
    assert!(!f32_report.contains("in bf16"), "{f32_report}");
    // The planner times the products at the bf16 rate: they multiply bf16 copies.
    for (storage, rate) in [("F32", "matmuls at tf32"), ("Bf16", "matmuls at bf16")] {
        let set = format!("devices.activations={storage}");
        let o = parallax(&[
            "compile",
            "models/transformer.ron",
            "--set",
            &set,
            "--explain",
        ]);
        let text = format!("{}{}", stdout(&o), common::stderr(&o));
        assert!(
            o.status.success() && text.contains(rate),
            "{storage}: {text}"
        );
    }
    assert!(
        peak(&bf16_report) < 0.8 * peak(&f32_report),
        "the planner's peak: {f32_report}\n{bf16_report}"
    );
}

fn is_bf16(values: &[f32]) -> bool {
    values.iter().all(|x| x.to_bits() & 0xffff == 0)
}

/// The stored bf16 values of every kernel, as each kernel finishes (run kernel by kernel),
/// and every bf16 buffer at the end of a normal step (folded permutes included): each value
/// is a bf16, and some were not before rounding.
#[test]
fn the_cpu_rounds_every_value_it_stores_in_bf16() {
    for model in ["models/transformer.ron", "models/cnn.ron", "models/mlp.ron"] {
        let s = source(model, Storage::Bf16);
        let (_, plan) = compiled(&s);
        let bf16 = |step: usize| {
            plan.steps[step]
                .buffer
                .is_some_and(|b| plan.buffers[b].dtype == DType::BF16)
        };
        let mut e = train_steps(&s, plan.clone(), 1);
        let batch = 8;
        let mut checked = 0;
        e.run_observed(batch, (Mode::Train, None), 1, 0, &mut |k, e| {
            for &step in &e.plan().kernels[k].stored {
                if bf16(step) {
                    let v = e.value(step).expect("stored").f32();
                    assert!(
                        is_bf16(v),
                        "{model}: step {step} ({})",
                        e.plan().steps[step].op.name()
                    );
                    checked += 1;
                }
            }
        })
        .unwrap();
        assert!(checked > 0, "{model}");
        // The last value each bf16 buffer received in a normal step.
        e.run(batch, Mode::Train, 2, 0).unwrap();
        let mut last: HashMap<usize, usize> = HashMap::new();
        for k in &plan.kernels {
            for &step in &k.stored {
                if bf16(step) {
                    last.insert(plan.steps[step].buffer.unwrap(), step);
                }
            }
        }
        for (&b, &step) in &last {
            let v = e.value(step).expect("stored").f32();
            assert!(is_bf16(v), "{model}: buffer b{b} after a step");
        }
    }
}

/// From the same initial weights: one step's gradients, and the loss after three training
/// steps, within bf16's tolerance (2e-2 of their scale) of the f32 plan's, and not equal to
/// them (the rounding happened). Parameters after several steps are not compared: Adam
/// divides each gradient by its own magnitude, so on a gradient near zero (a first layer
/// norm's bias) it turns rounding into whole steps of either sign.
#[test]
fn bf16_activations_train_within_bf16_tolerance_of_f32() {
    for model in ["models/transformer.ron", "models/cnn.ron", "models/mlp.ron"] {
        let run = |storage| {
            let s = source(model, storage);
            let (_, plan) = compiled(&s);
            let mut e = train_steps(&s, plan, 0);
            e.run(8, Mode::Gradients, 0, 0).unwrap();
            let grads: Vec<(String, Vec<f32>)> = e
                .gradients()
                .into_iter()
                .map(|(n, _, g)| (n.to_string(), g.f32().to_vec()))
                .collect();
            let first = e.output("loss").unwrap().f32().to_vec();
            for step in 0..3 {
                e.run(8, Mode::Train, step, 0).unwrap();
            }
            let last = e.output("loss").unwrap().f32().to_vec();
            (first, grads, last)
        };
        let (first32, grads32, last32) = run(Storage::F32);
        let (first16, grads16, last16) = run(Storage::Bf16);
        for (what, a, b) in [("first", &first16, &first32), ("last", &last16, &last32)] {
            let d = scaled_difference(a, b);
            assert!(d < 2e-2, "{model}: {what} loss differs by {d:e}");
        }
        assert_ne!(first16, first32, "{model}: bf16 storage changed nothing");
        assert_eq!(grads16.len(), grads32.len());
        let (mut num, mut den) = (0f64, 0f64);
        for ((_, a), (_, b)) in grads16.iter().zip(&grads32) {
            for (x, y) in a.iter().zip(b) {
                num += (f64::from(*x) - f64::from(*y)).powi(2);
                den += f64::from(*y).powi(2);
            }
        }
        // The whole gradient's relative L2 difference: ~0.5% for the transformer (GELU);
        // ~3-4% for the ReLU nets at a batch of 8. There the weights' rounding to bf16 moves
        // a few pre-activations near zero across ReLU's kink, each taking or giving a whole
        // sample's share of a first layer's gradient, and the CNN's BatchNorm statistics
        // cancel most of the gradient that reaches them (its conv bias gets none at all),
        // magnifying the rest. Per tensor, the layers after those are compared.
        let l2 = (num / den).sqrt();
        let (bound, compared): (f64, &[&str]) = match model {
            "models/cnn.ron" => (5e-2, &["8.", "10."]),
            "models/mlp.ron" => (5e-2, &["3."]),
            _ => (1e-2, &[""]),
        };
        assert!(l2 < bound, "{model}: gradients differ by {l2:e} (L2)");
        let largest = |v: &[f32]| v.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = grads32.iter().map(|(_, g)| largest(g)).fold(0f32, f32::max);
        for ((name, a), (_, b)) in grads16.iter().zip(&grads32) {
            if name.ends_with("att.k.bias") {
                // Softmax cancels a key bias (it adds one number to a whole row of scores):
                // its exact gradient is zero, and both plans give rounding noise, far below
                // every other gradient.
                assert!(
                    largest(a).max(largest(b)) < 1e-4 * scale,
                    "{model}: `{name}`"
                );
                continue;
            }
            if !compared.iter().any(|l| name.starts_with(l)) {
                continue;
            }
            let d = scaled_difference(a, b);
            assert!(
                d < 2e-2,
                "{model}: the gradient of `{name}` differs by {d:e}"
            );
        }
    }
}

fn train(args: &[&str], run: &std::path::Path) -> Vec<u8> {
    let mut all = vec!["train", "--run-dir", run.to_str().unwrap()];
    all.extend_from_slice(args);
    let o = parallax(&all);
    assert!(o.status.success(), "{all:?}\n{}", common::stderr(&o));
    let w = std::fs::read(run.join("final.safetensors")).unwrap();
    let _ = std::fs::remove_dir_all(run);
    w
}

/// The rounding is per element, so data and pipeline parallelism keep their same bits.
#[test]
fn every_device_grid_gives_the_same_bits_with_bf16_activations() {
    for (model, grids) in [
        (
            "transformer",
            &[("2", "dp2"), ("2", "pp2"), ("4", "dp2.pp2")][..],
        ),
        ("cnn", &[("2", "dp2"), ("2", "pp2")][..]),
    ] {
        let file = format!("models/{model}.ron");
        let base = [&file, "--set", "devices.activations=Bf16", "--steps", "2"];
        let one = train(
            &[&base[..], &["--gpus", "1"]].concat(),
            &temp(&format!("bf16-{model}")),
        );
        for (n, strategy) in grids {
            let args = [&base[..], &["--gpus", n, "--strategy", strategy]].concat();
            let w = train(&args, &temp(&format!("bf16-{model}-{strategy}")));
            assert!(w == one, "{model} as {strategy}: final.safetensors differs");
        }
    }
}

/// Tensor parallelism rounds each rank's partial product to bf16 before the ranks sum them
/// (as Megatron's bf16 all-reduce does), so it is close to one device rather than equal:
/// losses and every weight (relative norm) within bf16's tolerance.
#[test]
fn tensor_parallel_bf16_activations_stay_close_to_one_device() {
    let base = [
        "models/transformer.ron",
        "--set",
        "devices.activations=Bf16",
        "--steps",
        "2",
    ];
    let run = |extra: &[&str], name: &str| {
        let dir = temp(name);
        let mut all = vec!["train", "--run-dir", dir.to_str().unwrap()];
        all.extend_from_slice(&base);
        all.extend_from_slice(extra);
        let o = parallax(&all);
        assert!(o.status.success(), "{all:?}\n{}", common::stderr(&o));
        let weights = common::f32_tensors(&dir.join("final.safetensors"));
        let losses = common::metric(&dir, "loss");
        let _ = std::fs::remove_dir_all(&dir);
        (weights, losses)
    };
    let (one, losses) = run(&["--gpus", "1"], "bf16-tp-1");
    let (tp, tp_losses) = run(&["--gpus", "2", "--strategy", "tp2"], "bf16-tp-2");
    assert_eq!(losses.len(), tp_losses.len());
    for (a, b) in tp_losses.iter().zip(&losses) {
        assert!(
            (a - b).abs() < 2e-2 * b.abs(),
            "losses {tp_losses:?} vs {losses:?}"
        );
    }
    assert_eq!(one.len(), tp.len());
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    for (name, (_, b)) in &one {
        // Its exact gradient is zero (see above): Adam steps on rounding noise.
        if name.ends_with("att.k.bias") {
            continue;
        }
        let a = &tp[name].1;
        let diff: Vec<f32> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        let r = norm(&diff) / norm(b).max(1e-12);
        assert!(r < 2e-2, "tp2: `{name}` differs by {r:e}");
    }
}

/// A run interrupted after its checkpoint and resumed ends with the bits of one never
/// interrupted: the rounding depends on nothing but the values.
#[test]
fn a_resumed_bf16_run_keeps_its_bits() {
    let file = "models/transformer.ron";
    let set = ["--set", "devices.activations=Bf16"];
    let whole = train(
        &[&[file][..], &set, &["--steps", "3"]].concat(),
        &temp("bf16-whole"),
    );
    let dir = temp("bf16-resumed");
    let d = dir.to_str().unwrap();
    let args = [
        &[file][..],
        &set,
        &["--steps", "2", "--checkpoint-every", "2"],
    ]
    .concat();
    let mut all = vec!["train", "--run-dir", d];
    all.extend_from_slice(&args);
    let o = parallax(&all);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let o = parallax(&["train", "--resume", d, "--steps", "3"]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let resumed = std::fs::read(dir.join("final.safetensors")).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        resumed == whole,
        "the resumed run's final.safetensors differs"
    );
}
