//! The passes on their own: each model through the pipeline with the verifier after every
//! pass, and each pass on a hand-built graph where it must change something.

mod common;
use common::{fused_and_plain, model, plan_of};

use parallax_compiler::ir::dim::Dim;
use parallax_compiler::ir::verify::verify;
use parallax_compiler::ir::{Graph, Op, OpKind, TensorType};
use parallax_compiler::passes::{pass_names, shapes, simplify, Ctx};
use parallax_compiler::{compile, parse_bytes, Options};

#[test]
fn every_pass_leaves_a_valid_graph_for_every_model() {
    for name in ["mlp", "cnn", "transformer", "gpt-large"] {
        let source = model(name);
        let mut seen = Vec::new();
        let options = Options {
            verify: false,
            ..Options::default()
        };
        compile(&source, &options, &mut |pass, g| {
            verify(g).unwrap_or_else(|e| panic!("{name}: after `{pass}`: {e}"));
            seen.push(pass.to_string());
        })
        .unwrap();
        assert_eq!(seen, pass_names(), "{name}");
    }
}

fn f32(shape: &[u64]) -> TensorType {
    let mut s = vec![Dim::batch()];
    s.extend(shape.iter().map(|&d| Dim::known(d)));
    TensorType::f32(s)
}

fn input(g: &mut Graph, name: &str, shape: &[u64]) -> parallax_compiler::ir::NodeIndex {
    g.add(
        Op::Input {
            name: name.into(),
            ty: f32(shape),
        },
        &[],
        "",
        None,
    )
    .unwrap()
}

fn count(g: &Graph, kind: OpKind) -> usize {
    g.g.node_indices()
        .filter(|&n| g.g[n].op.kind() == kind)
        .count()
}

#[test]
fn simplify_merges_common_subexpressions() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", &[8]);
    let a = g.add(Op::Relu, &[x], "a", None).unwrap();
    let b = g.add(Op::Relu, &[x], "b", None).unwrap();
    let s1 = g.add(Op::Scale { by: 2.0 }, &[a], "s1", None).unwrap();
    let s2 = g.add(Op::Scale { by: 3.0 }, &[b], "s2", None).unwrap();
    let d1 = g
        .add(Op::Dropout { p: 0.5, stream: 0 }, &[x], "d1", None)
        .unwrap();
    let d2 = g
        .add(Op::Dropout { p: 0.5, stream: 0 }, &[x], "d2", None)
        .unwrap();
    let sum = g.add(Op::Add, &[s1, s2], "sum", None).unwrap();
    let sum = g.add(Op::Add, &[sum, d1], "sum", None).unwrap();
    let sum = g.add(Op::Add, &[sum, d2], "sum", None).unwrap();
    g.outputs.push(("y".into(), sum));
    simplify::merge_common(&mut g);
    simplify::remove_dead(&mut g);
    verify(&g).unwrap();
    // The two relus of x merge; scales by different factors do not; dropouts never do.
    assert_eq!(count(&g, OpKind::Relu), 1);
    assert_eq!(count(&g, OpKind::Scale), 2);
    assert_eq!(count(&g, OpKind::Dropout), 2);
    let relu =
        g.g.node_indices()
            .find(|&n| g.g[n].op.kind() == OpKind::Relu)
            .unwrap();
    assert_eq!(g.users(relu).len(), 2);
}

#[test]
fn simplify_removes_dead_code_and_keeps_inputs() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", &[4]);
    let unused_input = input(&mut g, "mask", &[4]);
    let y = g.add(Op::Tanh, &[x], "y", None).unwrap();
    let dead = g.add(Op::Sigmoid, &[x], "dead", None).unwrap();
    let _dead2 = g.add(Op::Relu, &[dead], "dead2", None).unwrap();
    g.outputs.push(("y".into(), y));
    assert_eq!(g.g.node_count(), 5);
    simplify::remove_dead(&mut g);
    verify(&g).unwrap();
    assert_eq!(g.g.node_count(), 3);
    assert!(g.g.contains_node(unused_input));
    assert_eq!(count(&g, OpKind::Sigmoid), 0);
    assert_eq!(count(&g, OpKind::Relu), 0);
}

#[test]
fn merged_outputs_follow_the_kept_node() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", &[4]);
    let a = g.add(Op::Gelu, &[x], "a", None).unwrap();
    let b = g.add(Op::Gelu, &[x], "b", None).unwrap();
    g.outputs.push(("a".into(), a));
    g.outputs.push(("b".into(), b));
    simplify::merge_common(&mut g);
    simplify::remove_dead(&mut g);
    verify(&g).unwrap();
    assert_eq!(g.outputs[0].1, g.outputs[1].1);
    assert_eq!(count(&g, OpKind::Gelu), 1);
}

#[test]
fn shapes_rederives_stale_types_and_verify_catches_them() {
    let source = model("mlp");
    let options = Options::default();
    let ctx = Ctx {
        source: &source,
        options: &options,
    };
    let mut g = Graph::new();
    let x = input(&mut g, "x", &[16]);
    let y = g.add(Op::Relu, &[x], "y", None).unwrap();
    g.outputs.push(("y".into(), y));
    // A pass that rewrote an op and left its old type behind.
    g.g[y].ty = f32(&[3]);
    let e = verify(&g).unwrap_err();
    assert!(
        e.contains("is typed f32[B, 3] but its operands give f32[B, 16]"),
        "{e}"
    );
    shapes::run(&mut g, &ctx).unwrap();
    verify(&g).unwrap();
    assert_eq!(g.g[y].ty, f32(&[16]));
}

#[test]
fn verify_catches_broken_invariants() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", &[4]);
    let y = g.add(Op::Relu, &[x], "y", None).unwrap();
    // No outputs.
    assert!(verify(&g).unwrap_err().contains("no outputs"));
    g.outputs.push(("y".into(), y));
    verify(&g).unwrap();
    // A second operand on a unary op.
    g.g.add_edge(x, y, 1);
    assert!(verify(&g).unwrap_err().contains("operand slots"));
    // A cycle.
    let mut g = Graph::new();
    let x = input(&mut g, "x", &[4]);
    let a = g.add(Op::Relu, &[x], "a", None).unwrap();
    let b = g.add(Op::Relu, &[a], "b", None).unwrap();
    g.g.add_edge(b, a, 1);
    g.outputs.push(("b".into(), b));
    assert!(verify(&g).unwrap_err().contains("cycle"));
}

#[test]
fn shape_errors_name_the_layer_both_shapes_and_the_place() {
    let text = std::fs::read_to_string(format!(
        "{}/models/transformer.ron",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
    .replace(
        "(\"mlp\", Mlp(hidden: \"d * 4\", act: Gelu),         [\"n2\"]),",
        "(\"mlp\", Linear(out: 32),                           [\"n2\"]),",
    );
    let source = parse_bytes(text.as_bytes()).unwrap();
    let e = compile(&source, &Options::default(), &mut |_, _| {})
        .err()
        .expect("a mismatch");
    let d = &e.diagnostics()[0];
    assert_eq!(
        d.message,
        "in layer `h.0.out`: shapes f32[B, seq, 64] and f32[B, seq, 32] do not broadcast"
    );
    let loc = d.loc(&text).unwrap();
    let line = text.lines().nth(loc.line - 1).unwrap();
    assert!(line.contains("(\"out\", Add"), "{line}");
    assert_eq!(&line[loc.col - 1..loc.col + 2], "Add");
}

/// Per-shard plans: every pass leaves a valid graph; BatchNorm is synchronised (its two
/// statistics all-reduced, and their gradients in backward); every gradient is all-reduced, and the first of those runs
/// before the backward pass ends (communication overlaps the rest of backward).
#[test]
fn sharded_plans_synchronise_and_overlap_gradient_sums() {
    use parallax_compiler::ir::Phase;
    use parallax_compiler::shards::Sharding;
    for name in ["mlp", "cnn", "transformer"] {
        let mut source = model(name);
        // Every gradient in a bucket of its own.
        source.experiment.devices.gradient_bucket_mb = 0.0;
        let options = Options {
            verify: false,
            shards: Some(Sharding::new(8, source.experiment.train.batch_size)),
            ..Options::default()
        };
        let compiled = compile(&source, &options, &mut |pass, g| {
            verify(g).unwrap_or_else(|e| panic!("{name}: after `{pass}`: {e}"));
        })
        .unwrap();
        let g = &compiled.graph;
        let norms = if name == "cnn" { 1 } else { 0 };
        assert_eq!(
            count(g, OpKind::AllReduce),
            g.grads.len() + 1 + 4 * norms,
            "{name}: one per gradient, one for the loss, two per BatchNorm and their two VJPs"
        );
        let plan = compiled.plan(&source, &options);
        let phase_of = |k: &parallax_compiler::plan::PlanKernel| {
            let s = &plan.steps[*k.steps.last().unwrap()];
            (s.phase, matches!(s.op, Op::AllReduce { .. }))
        };
        let kernels: Vec<_> = plan.kernels.iter().map(phase_of).collect();
        let first_sync = kernels
            .iter()
            .position(|&(p, c)| p == Phase::Backward && c)
            .unwrap();
        let last_backward = kernels
            .iter()
            .rposition(|&(p, c)| p == Phase::Backward && !c)
            .unwrap();
        assert!(
            first_sync < last_backward,
            "{name}: gradient sums wait for backward to end"
        );
    }
}

/// Pipeline plans: every pass leaves a valid graph (tensor parallelism, micro-shards and ZeRO-1
/// too); every kernel is on one stage and one owner, every value a stage reads from another
/// arrives by a transfer, and every stage has work.
#[test]
fn pipeline_plans_transfer_every_value_between_stages() {
    use parallax_compiler::shards::Sharding;
    for (name, tp, pp, zero) in [
        ("mlp", 1, 3, None),
        ("cnn", 1, 2, Some(2)),
        ("transformer", 2, 2, Some(2)),
    ] {
        let source = model(name);
        let options = Options {
            verify: false,
            shards: Some(Sharding::new(8, source.experiment.train.batch_size)),
            tensor_parallel: (tp > 1).then_some(tp),
            pipeline_stages: Some(pp),
            optimizer_shards: zero,
            ..Options::default()
        };
        let compiled = compile(&source, &options, &mut |pass, g| {
            verify(g).unwrap_or_else(|e| panic!("{name}: after `{pass}`: {e}"));
        })
        .unwrap();
        assert!(count(&compiled.graph, OpKind::Transfer) > 0, "{name}");
        let plan = compiled.plan(&source, &options);
        for k in &plan.kernels {
            let stage = plan.steps[k.steps[0]].stage;
            let owner = plan.steps[k.steps[0]].owner;
            for &s in &k.steps {
                let step = &plan.steps[s];
                assert_eq!(step.stage, stage, "{name}: a kernel spans stages");
                assert_eq!(step.owner, owner, "{name}: a kernel spans ZeRO owners");
                for &o in &step.operands {
                    let from = &plan.steps[o];
                    let crosses = !from.op.is_source() && from.stage != stage;
                    let sent = matches!(step.op, Op::Transfer { from: f, to } if f == from.stage && to == stage);
                    assert!(
                        !crosses || sent,
                        "{name}: step {s} reads stage {} without a transfer",
                        from.stage
                    );
                }
            }
        }
        let stages = plan.kernel_stages();
        for s in 0..pp {
            assert!(stages.contains(&s), "{name}: stage {s} has no kernels");
        }
    }
}

/// ZeRO-2: every gradient's all-reduce becomes a reduce to its parameter's rank, and what the
/// shared clipping reads from each rank arrives as a scalar (its squared norm), not a tensor.
#[test]
fn zero_two_reduces_gradients_and_broadcasts_only_scalars_and_updates() {
    use parallax_compiler::shards::Sharding;
    let source = model("transformer");
    let options = Options {
        verify: true,
        shards: Some(Sharding::new(8, source.experiment.train.batch_size)),
        optimizer_shards: Some(4),
        zero_stage: 2,
        ..Options::default()
    };
    let g = compile(&source, &options, &mut |_, _| {}).unwrap().graph;
    assert_eq!(count(&g, OpKind::Reduce), g.grads.len());
    let updated: Vec<_> = g.updates.iter().map(|u| u.1).collect();
    for n in g.g.node_indices() {
        if let Op::Broadcast { .. } = g.g[n].op {
            let scalar = g.g[n].ty.shape.iter().all(|d| d.factor == 1);
            assert!(
                updated.contains(&n) || scalar,
                "a tensor broadcast that is not an update"
            );
        }
    }
    let owned = |r: u32| g.owners.values().filter(|&&o| o == r).count();
    assert!((0..4).all(|r| owned(r) > 0), "a rank owns nothing");
}

/// Gradient buckets: with DDP's 25 MiB the small transformer's gradients go in one
/// all-reduce; with 0.05 MiB in several, in the order they become ready, the first before the
/// backward pass ends.
#[test]
fn gradients_are_all_reduced_in_buckets() {
    use parallax_compiler::ir::{Group, Phase};
    use parallax_compiler::shards::Sharding;
    let count_sums = |bucket_mb: f64| {
        let mut source = model("transformer");
        source.experiment.devices.gradient_bucket_mb = bucket_mb;
        let options = Options {
            shards: Some(Sharding::new(8, source.experiment.train.batch_size)),
            ..Options::default()
        };
        let compiled = compile(&source, &options, &mut |_, _| {}).unwrap();
        let plan = compiled.plan(&source, &options);
        let sums: Vec<usize> = plan
            .kernels
            .iter()
            .enumerate()
            .filter(|(_, k)| {
                let s = &plan.steps[*k.steps.last().unwrap()];
                s.phase == Phase::Backward
                    && s.op
                        == Op::AllReduce {
                            group: Group::Shards,
                        }
            })
            .map(|(i, _)| i)
            .collect();
        let last_backward = plan
            .kernels
            .iter()
            .rposition(|k| plan.steps[*k.steps.last().unwrap()].phase == Phase::Backward)
            .unwrap();
        (sums, last_backward, compiled.graph.grads.len())
    };
    let (one, _, grads) = count_sums(25.0);
    assert_eq!(one.len(), 1, "25 MiB holds the whole model's gradients");
    let (several, last_backward, _) = count_sums(0.05);
    assert!(
        several.len() > 1 && several.len() < grads,
        "{} buckets",
        several.len()
    );
    assert!(several[0] < last_backward);
}

/// Every update (SGD with momentum, Adam) is written over its parameter or state: no update
/// has a buffer of its own, so the step ends without copying; a plan without fusion (one op
/// per kernel) does the same.
#[test]
fn updates_are_written_in_place() {
    for name in ["mlp", "transformer"] {
        let source = model(name);
        let (fused, plain) = fused_and_plain(&source);
        for plan in [fused, plain] {
            assert!(!plan.updates.is_empty());
            for &(old, new) in &plan.updates {
                assert_eq!(
                    plan.steps[old].buffer, plan.steps[new].buffer,
                    "{name}: the update of `{}` has a buffer of its own",
                    plan.steps[old].layer
                );
            }
        }
    }
}

/// A reshape of an intermediate is a view: the transformer's (heads split and joined, batch
/// folded for the weight gradients) share their operands' buffers.
#[test]
fn reshapes_share_their_operands_buffers() {
    let source = model("transformer");
    let options = Options::default();
    let plan = plan_of(&source, &options);
    let (mut views, mut reshapes) = (0, 0);
    for s in &plan.steps {
        if let Op::Reshape { .. } = s.op {
            reshapes += 1;
            if s.buffer.is_some() && s.buffer == plan.steps[s.operands[0]].buffer {
                views += 1;
            }
        }
    }
    assert!(
        reshapes > 0 && views == reshapes,
        "{views} of {reshapes} reshapes are views"
    );
}

/// The decode step (`compile_decode`, the verifier after each of its passes) of every model:
/// built for the causal language models, with their caches' bytes; refused with a message
/// for the others; a plan that reads back from `plan.json`.
#[test]
fn the_decode_step_of_every_model_is_built_or_refused() {
    use parallax_compiler::{compile_decode, Plan};
    for (name, want) in [
        ("mlp", Err("reads token ids [seq]")),
        ("cnn", Err("reads token ids [seq]")),
        // 2 layers * (keys + values) * seq (a symbol, at its nominal 32) * width 64 * 4 bytes.
        ("transformer", Ok(2 * 2 * 32 * 64 * 4)),
        // 4 layers of width 128 and seq 64.
        ("shakespeare", Ok(4 * 2 * 64 * 128 * 4)),
    ] {
        match (compile_decode(&model(name), 1, true), want) {
            (Ok(plan), Ok(bytes)) => {
                assert_eq!(plan.memory.cache_bytes, bytes, "{name}");
                let back = Plan::from_json(&plan.to_json()).unwrap();
                assert_eq!(back.to_json(), plan.to_json(), "{name}");
            }
            (Err(e), Err(m)) => assert!(e.to_string().contains(m), "{name}: {e}"),
            (got, _) => panic!("{name}: {:?}", got.map(|p| p.memory)),
        }
    }
}
