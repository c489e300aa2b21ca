//! The group pass: like update kernels (each parameter's optimizer step, each gradient's
//! squared norm for clipping) run as one grouped kernel, the graph still verifies, and a
//! grouped plan trains to the same bits as the same plan without grouping.

mod common;

use parallax_compiler::ir::verify::verify;
use parallax_compiler::ir::{Graph, KernelKind, Phase};
use parallax_compiler::passes::{fuse, schedule};
use parallax_compiler::plan::Plan;
use parallax_compiler::{compile, parse_bytes, Options, Source};

fn model(name: &str) -> String {
    let path = format!("{}/models/{name}.ron", env!("CARGO_MANIFEST_DIR"));
    String::from_utf8(std::fs::read(path).unwrap()).unwrap()
}

/// `mlp` with another optimizer line.
fn mlp_with(optimizer: &str) -> Source {
    let text = model("mlp");
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("optimizer:"))
        .unwrap();
    let text = text.replace(line, &format!("    optimizer: {optimizer},"));
    parse_bytes(text.as_bytes()).unwrap()
}

/// The graph as compiled (grouped), and the same graph with the fuse pass's kernels and a
/// schedule of its own (what the pipeline built before the group pass).
fn graphs(s: &Source) -> (Graph, Graph) {
    let options = Options::default();
    let grouped = compile(s, &options, &mut |_, _| {}).unwrap().graph;
    let mut plain = grouped.clone();
    plain.kernels = fuse::plan_kernels(&plain);
    plain.schedule = Some(schedule::plan_buffers(&plain, options.plan_batch(s)));
    (grouped, plain)
}

fn grouped(g: &Graph, reduce: bool) -> Vec<u32> {
    g.kernels
        .iter()
        .filter_map(|k| match k.kind {
            KernelKind::Grouped { members, reduce: r } if r == reduce => Some(members),
            _ => None,
        })
        .collect()
}

/// Update-phase kernels that are not grouped and touch a parameter-sized tensor.
fn lone_updates(g: &Graph) -> usize {
    g.kernels
        .iter()
        .filter(|k| {
            !matches!(k.kind, KernelKind::Grouped { .. })
                && k.nodes.iter().all(|&n| g.g[n].phase == Phase::Update)
                && k.nodes.len() > 1
        })
        .count()
}

#[test]
fn transformer_steps_every_parameter_in_a_few_launches() {
    let s = parse_bytes(model("transformer").as_bytes()).unwrap();
    let (g, plain) = graphs(&s);
    verify(&g).unwrap();
    verify(&plain).unwrap();
    let params = g.grads.len() as u32;
    // Before: a kernel per parameter for its step and one for its squared norm.
    assert!(grouped(&plain, false).is_empty() && grouped(&plain, true).is_empty());
    assert!(
        lone_updates(&plain) as u32 >= 2 * params,
        "{}",
        lone_updates(&plain)
    );
    // After: every AdamW step but the embedding's (no decay: its own structure) is one
    // kernel; the squared norms are one kernel per gradient rank.
    let steps = grouped(&g, false);
    assert_eq!(steps, vec![params - 1], "{steps:?}");
    let norms = grouped(&g, true);
    assert_eq!(norms.len(), 2, "{norms:?}");
    assert_eq!(norms.iter().sum::<u32>(), params);
    // Nothing else changed: each group of n kernels became one.
    let groups = steps.len() + norms.len();
    let members = (steps.iter().sum::<u32>() + params) as usize;
    assert_eq!(plain.kernels.len() - g.kernels.len(), members - groups);
}

#[test]
fn a_broken_group_fails_verification() {
    let s = parse_bytes(model("transformer").as_bytes()).unwrap();
    let (g, _) = graphs(&s);
    let k = g
        .kernels
        .iter()
        .position(|k| matches!(k.kind, KernelKind::Grouped { reduce: false, .. }))
        .unwrap();
    // Members of unequal sizes.
    let mut bad = g.clone();
    if let KernelKind::Grouped { members, .. } = &mut bad.kernels[k].kind {
        *members += 1;
    }
    let e = verify(&bad).unwrap_err();
    assert!(e.contains("equal members"), "{e}");
    // Two members writing one buffer.
    let mut bad = g.clone();
    let members = bad.kernels[k].members().len();
    let per = bad.kernels[k].nodes.len() / members;
    let (a, b) = (
        bad.kernels[k].nodes[per - 1],
        bad.kernels[k].nodes[2 * per - 1],
    );
    let schedule = bad.schedule.as_mut().unwrap();
    let ba = schedule.buffer_of[&a];
    schedule.buffer_of.insert(b, ba);
    assert!(verify(&bad).is_err());
}

#[test]
fn grouped_plans_train_to_the_same_bits() {
    let cases = [
        (
            "transformer (AdamW, clipped)",
            parse_bytes(model("transformer").as_bytes()).unwrap(),
        ),
        (
            "mlp (SGD, Nesterov momentum, decay, clipped)",
            mlp_with(
                "Sgd(lr: 0.05, momentum: 0.9, nesterov: true, weight_decay: 1e-4, clip_norm: 0.5)",
            ),
        ),
        (
            "mlp (Adam, decay, clipped)",
            mlp_with("Adam(lr: 1e-2, weight_decay: 0.01, clip_norm: 0.1)"),
        ),
    ];
    let options = Options::default();
    for (name, s) in cases {
        let (g, plain) = graphs(&s);
        assert!(!grouped(&g, false).is_empty(), "{name}: no grouped step");
        assert!(!grouped(&g, true).is_empty(), "{name}: no grouped norm");
        let a = common::train_steps(&s, Plan::single_device(&g, &s, &options), 3);
        let b = common::train_steps(&s, Plan::single_device(&plain, &s, &options), 3);
        assert_eq!(
            a.output("loss").unwrap().f32(),
            b.output("loss").unwrap().f32(),
            "{name}"
        );
        let mut n = 0;
        for ((p, x), (_, y)) in a.params().zip(b.params()) {
            let same = x
                .f32()
                .iter()
                .zip(y.f32())
                .all(|(u, v)| u.to_bits() == v.to_bits());
            assert!(same, "{name}: parameter {p}");
            n += 1;
        }
        assert_eq!(n, g.grads.len(), "{name}");
    }
}
