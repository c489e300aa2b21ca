//! The fuse and schedule passes: which ops became one kernel, that fused plans compute the
//! same bits as one op per kernel, and that buffer reuse never lets two live values share a
//! buffer.

mod common;
use common::{fused_and_plain, plan_of};

use parallax_compiler::ir::ops::OpClass;
use parallax_compiler::ir::KernelKind;
use parallax_compiler::ir::{Op, Phase};
use parallax_compiler::plan::Plan;
use parallax_compiler::{parse_bytes, Options, Source};
use parallax_runtime::cpu::{Executor, Mode};
use parallax_runtime::data::Values;
use parallax_runtime::train::{feed, set_scalars, Session};
use std::collections::HashMap;

fn source(name: &str) -> Source {
    let path = format!("{}/models/{name}.ron", env!("CARGO_MANIFEST_DIR"));
    parse_bytes(&std::fs::read(path).unwrap()).unwrap()
}

/// The plan as compiled, and the same graph run one op per kernel without buffer reuse
/// planning from the fuse pass.
fn plans(name: &str) -> (Source, Plan, Plan) {
    plans_of(source(name))
}

/// Op names of each multi-op kernel, with its kind.
fn fused_kernels(p: &Plan) -> Vec<(KernelKind, Vec<&'static str>)> {
    p.kernels
        .iter()
        .filter(|k| k.steps.len() > 1)
        .map(|k| {
            (
                k.kind,
                k.steps.iter().map(|&s| p.steps[s].op.name()).collect(),
            )
        })
        .collect()
}

/// Each step's kernel in plan `p`.
fn kernel_of(p: &Plan) -> HashMap<usize, usize> {
    p.kernels
        .iter()
        .enumerate()
        .flat_map(|(k, kern)| kern.steps.iter().map(move |&s| (s, k)))
        .collect()
}

#[test]
fn mlp_fuses_gemm_epilogues_and_optimizer_updates() {
    let (_, p, plain) = plans("mlp");
    let k = fused_kernels(&p);
    // Layer 0: matmul, bias and ReLU in one kernel; the classifier: matmul and bias.
    assert!(k.contains(&(
        KernelKind::Gemm {
            bias: true,
            activation: Some(parallax_compiler::ir::OpKind::Relu)
        },
        vec!["matmul", "add", "relu"]
    )));
    assert!(k.contains(&(
        KernelKind::Gemm {
            bias: true,
            activation: None
        },
        vec!["matmul", "add"]
    )));
    // AdamW for each parameter: decay, both moments and the step, one pass over memory.
    let mut adamw = vec![
        "scale",
        "mul",
        "sub",
        "scale",
        "scale",
        "add",
        "mul",
        "scale",
        "scale",
        "add",
        "sqrt",
        "div",
        "add_scalar",
        "div",
        "mul",
        "sub",
    ];
    adamw.sort_unstable();
    // (All four run as one grouped kernel, a member each: see tests/grouping.rs.)
    let updates: usize = k
        .iter()
        .map(|(kind, ops)| {
            let members = match kind {
                KernelKind::Elementwise => 1,
                KernelKind::Grouped {
                    members,
                    reduce: false,
                } => *members as usize,
                _ => return 0,
            };
            ops.chunks(ops.len() / members)
                .filter(|ops| {
                    let mut sorted = ops.to_vec();
                    sorted.sort_unstable();
                    sorted == adamw && ops.last() == Some(&"sub")
                })
                .count()
        })
        .sum();
    assert_eq!(updates, 4, "{k:?}");
    // The backward ReLU and dropout mask run together.
    assert!(
        k.iter()
            .any(|(_, ops)| ops == &vec!["dropout", "relu_grad"]),
        "{k:?}"
    );
    assert_eq!(plain.kernels.len(), p.ops);
    assert!(
        p.kernels.len() * 2 < p.ops,
        "{} kernels for {} ops",
        p.kernels.len(),
        p.ops
    );
}

#[test]
fn transformer_fuses_reductions_after_elementwise_chains() {
    let (_, p, _) = plans("transformer");
    let k = fused_kernels(&p);
    // Attention is one op: each layer's forward and its saved log-sum-exp run as one
    // kernel, its query, key and value gradients as another; no scores.
    let count = |kind: KernelKind, ops: &[&str]| {
        k.iter()
            .filter(|(kd, o)| {
                let mut o = o.clone();
                o.sort_unstable();
                *kd == kind && o == ops
            })
            .count()
    };
    assert_eq!(
        count(KernelKind::Attention, &["attention", "attention_lse"]),
        2,
        "{k:?}"
    );
    let grads = ["attention_grad", "attention_grad", "attention_grad"];
    assert_eq!(count(KernelKind::AttentionGrads, &grads), 2, "{k:?}");
    assert!(!k.iter().any(|(_, o)| o.contains(&"softmax")), "{k:?}");
    // Gradient clipping: each gradient's square feeds its sum (the group pass runs them
    // as grouped kernels, a member each).
    let norms: usize = k
        .iter()
        .map(|(kind, ops)| match kind {
            KernelKind::ElementwiseReduce if ops == &vec!["mul", "reduce_sum"] => 1,
            KernelKind::Grouped {
                members,
                reduce: true,
            } => *members as usize,
            _ => 0,
        })
        .sum();
    // (and each attention's `delta = rowsum(dy * y)` for its gradients).
    assert_eq!(norms, p.grads.len() + 2);
    // MLP: matmul, bias and GELU.
    assert!(k.contains(&(
        KernelKind::Gemm {
            bias: true,
            activation: Some(parallax_compiler::ir::OpKind::Gelu)
        },
        vec!["matmul", "add", "gelu"]
    )));
}

/// The plan as compiled and one op per kernel (as `plans`), for a source's text.
fn plans_of(s: Source) -> (Source, Plan, Plan) {
    let (fused, plain) = fused_and_plain(&s);
    (s, fused, plain)
}

/// The transformer with RMS norms in place of its layer norms.
fn rms_transformer() -> Source {
    let path = format!("{}/models/transformer.ron", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains("LayerNorm"));
    parse_bytes(text.replace("LayerNorm", "RmsNorm").as_bytes()).unwrap()
}

/// Pre-LN residual blocks: each residual add runs in its norm's kernel (the sum stored for
/// the next residual add and normalized in one pass), and each norm's gradient in the kernel
/// of the add of the residual's gradient after it. With layer norms and with RMS norms.
#[test]
fn residual_adds_fuse_with_norms_and_their_gradients() {
    for (s, norm, grad) in [
        (source("transformer"), "layer_norm", "layer_norm_grad"),
        (rms_transformer(), "rms_norm", "rms_norm_grad"),
    ] {
        let (_, p, _) = plans_of(s);
        let kernel_of = kernel_of(&p);
        let is = |s: usize, name: &str| p.steps[s].op.name() == name;
        let (mut norms, mut grads) = (0, 0);
        for st in &p.steps {
            let k = kernel_of.get(&st.id);
            // Every norm of an add: one kernel, the add stored (the residual stream).
            if st.op.name() == norm && is(st.operands[0], "add") {
                let kern = &p.kernels[k.copied().unwrap()];
                assert_eq!(kern.kind, KernelKind::ElementwiseReduce, "{norm}");
                assert_eq!(kern.steps, [st.operands[0], st.id], "{norm}");
                assert!(p.steps[st.operands[0]].buffer.is_some(), "{norm}");
                norms += 1;
            }
            // Every add of a norm's gradient read by nothing else: one kernel.
            if st.op.name() == "add" && st.operands.iter().any(|&o| is(o, grad)) {
                let kern = &p.kernels[k.copied().unwrap()];
                assert_eq!(kern.kind, KernelKind::NormGradAdd, "{grad}");
                let ng = kern.steps[0];
                assert!(is(ng, grad) && kern.steps == [ng, st.id], "{grad}");
                assert!(p.steps[ng].buffer.is_none(), "{grad}");
                grads += 1;
            }
        }
        // Two per layer and the final norm; the final norm's gradient is read by its layer's
        // gradients too, so it is added where the next norm's gradient is.
        assert_eq!((norms, grads), (5, 4), "{norm}");
    }
}

#[test]
fn fused_plans_compute_the_same_bits() {
    let sources = ["mlp", "cnn", "transformer"].map(|name| (name, source(name)));
    for (name, s) in sources
        .into_iter()
        .chain([("rms transformer", rms_transformer())])
    {
        let (s, fused, plain) = plans_of(s);
        let (a, b) = (
            common::train_steps(&s, fused, 3),
            common::train_steps(&s, plain, 3),
        );
        same_loss_and_parameters(&a, &b, name);
    }
}

/// `a` and `b` end their steps with the same loss and parameters, bit for bit.
fn same_loss_and_parameters(a: &Executor, b: &Executor, at: &str) {
    let loss = |e: &Executor| e.output("loss").unwrap().f32().to_vec();
    assert_eq!(loss(a), loss(b), "{at}");
    for ((n, x), (_, y)) in a.params().zip(b.params()) {
        assert_eq!(x.f32(), y.f32(), "{at}: parameter {n}");
    }
}

#[test]
fn the_logits_gradient_is_written_over_the_logits() {
    // A cross-entropy's gradient takes its logits' buffer (one pass over the vocabulary
    // instead of two buffers of it); the logits stay readable after an eval step, and a
    // read after a training step is refused rather than giving the gradient.
    for name in ["mlp", "transformer"] {
        let (s, fused, plain) = plans(name);
        let grad = fused
            .steps
            .iter()
            .find(|x| matches!(x.op, Op::CrossEntropyGrad { .. }))
            .unwrap();
        let output = fused
            .output_steps
            .iter()
            .find(|o| o.step == grad.operands[0])
            .expect("the logits are an output")
            .clone();
        assert_eq!(grad.buffer, fused.steps[output.step].buffer, "{name}");
        assert!(!fused.kept_after_training(output.step), "{name}");
        let (mut a, mut b) = (
            common::train_steps(&s, fused, 2),
            common::train_steps(&s, plain, 2),
        );
        let err = a.output_kept(&output.name).unwrap_err().to_string();
        assert!(err.contains(&format!("`{}`", output.name)), "{err}");
        assert!(a.output(&output.name).is_none(), "{name}");
        for e in [&mut a, &mut b] {
            e.run(8, Mode::Eval, 2, 0).unwrap();
        }
        assert_eq!(
            a.output(&output.name).unwrap().f32(),
            b.output(&output.name).unwrap().f32(),
            "{name}: the logits after an eval step"
        );
    }
}

#[test]
fn buffers_are_reused_but_never_shared_by_live_values() {
    for name in ["mlp", "cnn", "transformer", "gpt-large"] {
        let (_, p, _) = plans(name);
        let m = &p.memory;
        assert!(
            m.activation_bytes < m.activation_bytes_without_reuse,
            "{name}: {m:?}"
        );
        let dedicated = m.dedicated_bytes();
        assert!(
            m.peak_bytes >= dedicated && m.peak_bytes <= dedicated + m.activation_bytes,
            "{name}: {m:?}"
        );
        // When each stored value is written and last read, in kernel order.
        let kernel_of = kernel_of(&p);
        // Outputs a training step writes over (a cross-entropy's logits) are kept through
        // the forward kernels only, what an eval step runs.
        let last_forward = p
            .kernels
            .iter()
            .rposition(|k| p.steps[*k.steps.last().unwrap()].phase == Phase::Forward)
            .unwrap();
        let forward_only: Vec<usize> = p
            .output_steps
            .iter()
            .map(|o| o.step)
            .filter(|&s| !p.kept_after_training(s))
            .collect();
        let roots: Vec<usize> = p
            .output_steps
            .iter()
            .map(|o| o.step)
            .filter(|s| !forward_only.contains(s))
            .chain(p.grads.iter().map(|g| g.1))
            .chain(p.updates.iter().map(|u| u.1))
            .collect();
        // A reshape sharing its operand's buffer is a view: its interval joins the operand's.
        let owner = |mut id: usize| {
            while matches!(p.steps[id].op, Op::Reshape { .. })
                && p.steps[id].buffer == p.steps[p.steps[id].operands[0]].buffer
            {
                id = p.steps[id].operands[0];
            }
            id
        };
        let mut spans: HashMap<usize, (usize, usize)> = HashMap::new();
        for s in &p.steps {
            let (Some(_), Some(&k)) = (s.buffer, kernel_of.get(&s.id)) else {
                continue;
            };
            let last = if roots.contains(&s.id) {
                usize::MAX
            } else {
                p.steps
                    .iter()
                    .filter(|u| u.operands.contains(&s.id))
                    .filter_map(|u| kernel_of.get(&u.id))
                    .copied()
                    .max()
                    .unwrap_or(k)
            };
            let last = if forward_only.contains(&s.id) {
                last.max(last_forward)
            } else {
                last
            };
            let span = spans.entry(owner(s.id)).or_insert((k, last));
            span.0 = span.0.min(k);
            span.1 = span.1.max(last);
        }
        let mut intervals: HashMap<usize, Vec<(usize, usize, usize)>> = HashMap::new();
        for (&id, &(first, last)) in &spans {
            let b = p.steps[id].buffer.expect("stored");
            intervals.entry(b).or_default().push((first, last, id));
        }
        let mut handed_on = 0;
        for (b, mut iv) in intervals {
            iv.sort();
            for w in iv.windows(2) {
                // The next value may be written only after the previous one's last reader ran,
                // or by that reader, an elementwise kernel writing over its operand (or a
                // cross-entropy's gradient over its logits, row by row, a chain before a norm,
                // a norm gradient's add over its other operand).
                let (steps, kind) = (&p.kernels[w[1].0].steps, p.kernels[w[1].0].kind);
                let norm_last = steps.last().is_some_and(|&x| {
                    matches!(p.steps[x].op, Op::LayerNorm { .. } | Op::RmsNorm { .. })
                });
                let over = w[1].0 == w[0].1
                    && p.steps[w[1].2].operands.contains(&w[0].2)
                    && (steps
                        .iter()
                        .all(|&x| p.steps[x].op.def().class == OpClass::Elementwise)
                        || matches!(steps[..], [x] if matches!(p.steps[x].op, Op::CrossEntropyGrad { .. }))
                        || (kind == KernelKind::ElementwiseReduce
                            && norm_last
                            && p.steps[w[1].2].op.def().class == OpClass::Elementwise)
                        || kind == KernelKind::NormGradAdd);
                handed_on += usize::from(over);
                assert!(
                    w[1].0 > w[0].1 || over,
                    "{name}: buffer {b} holds steps {} and {} at once",
                    w[0].2,
                    w[1].2
                );
            }
        }
        assert!(handed_on > 0, "{name}: no value written over its operand");
    }
}

/// A model that splits a projection into heads by hand (`Reshape`, `Permute`), mixes each
/// head's features with a `Linear`, and joins them back: the layout attention used before it
/// read its heads in place, and what a user's own `Permute` layers give.
const HEADS_BY_HAND: &str = r#"Experiment(
    name: "heads-by-hand",
    model: Graph(
        symbols: { "seq": 32 },
        inputs: { "tokens": (shape: ["seq"], dtype: I32) },
        nodes: [
            ("emb",    Embedding(vocab: 16, dim: 24), ["tokens"]),
            ("proj",   Linear(out: 24),               ["emb"]),
            ("split",  Reshape(["seq", 4, 6]),        ["proj"]),
            ("heads",  Permute([1, 0, 2]),            ["split"]),
            ("mix",    Linear(out: 6),                ["heads"]),
            ("back",   Permute([1, 0, 2]),            ["mix"]),
            ("join",   Reshape(["seq", 24]),          ["back"]),
            ("logits", Linear(out: 16),               ["join"]),
        ],
    ),
    loss: CrossEntropy,
    data: Sequence(task: Reverse, length: 16, vocab: 16, samples: 64),
    optimizer: AdamW(lr: 3e-3),
    train: (batch_size: 8, steps: 4, seed: 1),
)"#;

#[test]
fn permutes_folded_into_their_operands_kernels_change_no_bits() {
    // `run` folds permutes into the matmuls and epilogues that compute their operands, as
    // the plan allows; `run_observed` runs every kernel as it is.
    let s = parse_bytes(HEADS_BY_HAND.as_bytes()).unwrap();
    let options = Options::default();
    let plan = plan_of(&s, &options);
    let permutes = plan
        .steps
        .iter()
        .filter(|s| matches!(s.op, Op::Permute { .. }))
        .count();
    // The plan records the rewrites (`plan::views`), and the CPU executor takes each.
    let folds = plan.views.folds.len();
    assert!(folds >= 2 && folds <= permutes, "{folds} of {permutes}");
    let mut a = Session::new(&s, plan.clone(), 8, 1, std::path::Path::new(".")).unwrap();
    let mut b = Session::new(&s, plan, 8, 1, std::path::Path::new(".")).unwrap();
    let batch = a.next_batch().unwrap().size;
    assert_eq!(b.next_batch().unwrap().size, batch);
    let (mut folded, mut plain) = (a.exec, b.exec);
    assert_eq!(folded.folded_permutes(), folds);
    for step in 0..3 {
        for e in [&mut folded, &mut plain] {
            set_scalars(e, &s.experiment.optimizer, step, 3).unwrap();
        }
        folded.run(batch, Mode::Train, step, 0).unwrap();
        plain
            .run_observed(batch, (Mode::Train, None), step, 0, &mut |_, _| {})
            .unwrap();
        assert_eq!(
            folded.output("loss").unwrap().f32(),
            plain.output("loss").unwrap().f32(),
            "step {step}"
        );
    }
    // A smaller batch (a last partial one): the strides follow the batch's shapes.
    let next = a.loader.next().unwrap();
    let first = |v: &Values, size: usize| match v {
        Values::F32(x) => Values::F32(x[..x.len() / next.size * size].to_vec()),
        Values::I32(x) => Values::I32(x[..x.len() / next.size * size].to_vec()),
    };
    for e in [&mut folded, &mut plain] {
        feed(e, &a.input, 5, &first(&next.inputs, 5)).unwrap();
        feed(e, &a.target, 5, &first(&next.targets, 5)).unwrap();
    }
    folded.run(5, Mode::Train, 3, 0).unwrap();
    plain
        .run_observed(5, (Mode::Train, None), 3, 0, &mut |_, _| {})
        .unwrap();
    same_loss_and_parameters(&folded, &plain, "a batch of 5");
}

#[test]
fn attention_reads_its_heads_in_place() {
    // Attention is token-major: q, k, v are views of their projections and its output is
    // one, so a transformer's plan has no permute at all, forward or backward.
    for s in [
        source("transformer"),
        parse_bytes(
            &std::fs::read(format!(
                "{}/benches/models/transformer.ron",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap(),
        )
        .unwrap(),
    ] {
        let options = Options::default();
        let plan = plan_of(&s, &options);
        let name = &s.experiment.name;
        assert!(
            plan.steps
                .iter()
                .all(|s| !matches!(s.op, Op::Permute { .. })),
            "{name}: a permute is left"
        );
        assert!(
            plan.steps
                .iter()
                .any(|s| matches!(s.op, Op::Attention { .. })),
            "{name}: no attention"
        );
    }
}

/// The executor's profile: one time per kernel as `run` runs it, and per kind of kernel the
/// same total, with a matmul's activation (a pass after the product) counted apart.
#[test]
fn profile_times_every_kernel_and_epilogues_apart() {
    let (s, plan, _) = plans("mlp");
    let mut a = Session::new(&s, plan, 8, 1, std::path::Path::new(".")).unwrap();
    assert!(a.exec.kernel_seconds().is_empty());
    a.exec.enable_profile();
    let steps = 2;
    for step in 0..steps {
        let b = a.next_batch().unwrap();
        set_scalars(&mut a.exec, &s.experiment.optimizer, step, steps).unwrap();
        a.exec.run(b.size, Mode::Train, step, 0).unwrap();
    }
    let kernels = a.exec.plan().kernels.len();
    let per_kernel = a.exec.kernel_seconds();
    assert_eq!(per_kernel.len(), kernels);
    assert!(per_kernel.iter().all(|&t| t > 0.0), "{per_kernel:?}");
    let kinds = a.exec.profile();
    let calls = |name: &str| kinds.iter().find(|k| k.0 == name).map(|k| k.2);
    // The MLP's layers are matmuls with a bias (and ReLU) epilogue: two per step.
    let with_epilogue = a
        .exec
        .plan()
        .kernels
        .iter()
        .filter(|k| matches!(k.kind, KernelKind::Gemm { .. }) && k.steps.len() > 1)
        .count() as u64;
    assert_eq!(with_epilogue, 2);
    assert_eq!(
        calls("matmul (with an epilogue)"),
        Some(with_epilogue * steps)
    );
    // A bias is added as the product is stored; an activation after it is a pass of its
    // own, timed apart: one of the two layers has one.
    let with_pass = a
        .exec
        .plan()
        .kernels
        .iter()
        .filter(|k| {
            matches!(
                k.kind,
                KernelKind::Gemm {
                    activation: Some(_),
                    ..
                }
            )
        })
        .count() as u64;
    assert_eq!(with_pass, 1);
    assert_eq!(calls("epilogue of a matmul"), Some(with_pass * steps));
    // Epilogue passes are extra entries; every other call is one kernel run.
    let runs: u64 = kinds.iter().map(|k| k.2).sum::<u64>() - with_pass * steps;
    assert_eq!(runs, kernels as u64 * steps);
    let total: f64 = kinds.iter().map(|k| k.1).sum();
    let summed: f64 = per_kernel.iter().sum();
    assert!(
        (total - summed).abs() <= 1e-9 * kernels as f64 + 1e-12,
        "{total} vs {summed}"
    );
}
