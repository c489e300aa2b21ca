//! The decode-step plan (`compile_decode`): its inputs, caches and memory, the same
//! parameters as the training plan's, the verifier after each of its passes, refusals.

use super::*;
use crate::ir::Op;
use crate::plan::POSITION;

/// A tiny GPT: 2 decoder layers, 2 heads, width 16, sequence 8, vocabulary 32, with `att`
/// as the attention layer's settings and `extra` nodes before the logits.
pub(crate) fn gpt(att: &str, extra: &str) -> Source {
    crate::parse(&crate::fixtures::tiny_gpt(att, extra)).expect("the tiny GPT parses")
}

fn refusal(source: &Source) -> String {
    match compile_decode(source, 1, true) {
        Err(Error::Model(d)) => d.message,
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("the decode step was built"),
    }
}

#[test]
fn the_decode_plan_holds_its_caches_and_the_training_plans_parameters() {
    let source = gpt(", causal: true", "");
    // `verify: true`: the verifier runs after each of its passes.
    let plan = compile_decode(&source, 1, true).unwrap();
    let names = plan.names();
    let mut inputs: Vec<&str> = names.inputs.iter().map(|i| i.0.as_str()).collect();
    inputs.sort();
    assert_eq!(inputs, [POSITION, "tokens"]);
    let caches: Vec<(String, Vec<u64>)> = plan
        .steps
        .iter()
        .filter_map(|s| match &s.op {
            Op::State { name, ty, .. } => Some((name.clone(), plan.shape_at(&ty.shape, 1))),
            _ => None,
        })
        .collect();
    let want: Vec<(String, Vec<u64>)> = ["h.0.att", "h.1.att"]
        .iter()
        .flat_map(|l| ["key_cache", "value_cache"].map(|w| (format!("{l}.{w}"), vec![1, 8, 2, 8])))
        .collect();
    assert_eq!(caches, want);
    // layers * (key + value) * seq * width * 4 bytes.
    assert_eq!(plan.memory.cache_bytes, 2 * 2 * 8 * 16 * 4);
    assert!(plan.memory.dedicated_bytes() >= plan.memory.cache_bytes + plan.memory.parameter_bytes);
    // Each cache is written where it lives, and read by one cached attention per layer.
    assert_eq!(plan.updates.len(), 4);
    let count = |k: crate::ir::OpKind| plan.steps.iter().filter(|s| s.op.kind() == k).count();
    assert_eq!(count(crate::ir::OpKind::CachedAttention), 2);
    assert_eq!(count(crate::ir::OpKind::Attention), 0);
    // The logits of one token.
    let out = plan
        .output_steps
        .iter()
        .find(|o| o.name == "logits")
        .unwrap();
    assert_eq!(plan.shape_at(&plan.steps[out.step].ty.shape, 1), [1, 1, 32]);
    // The training plan's parameters, by name and shape.
    let train = compile(&source, &Options::default(), &mut |_, _| {})
        .unwrap()
        .plan(&source, &Options::default());
    let shapes = |p: &Plan| -> Vec<(String, Vec<u64>)> {
        p.params
            .iter()
            .map(|i| (i.name.clone(), i.shape.clone()))
            .collect()
    };
    assert_eq!(shapes(&plan), shapes(&train));
    // Batch 3: three rows of every cache.
    let three = compile_decode(&source, 3, true).unwrap();
    assert_eq!(three.memory.cache_bytes, 3 * plan.memory.cache_bytes);
}

#[test]
fn models_that_mix_positions_are_refused() {
    let m = refusal(&gpt("", ""));
    assert!(
        m.contains("Attention `h.0.att` attends to later positions"),
        "{m}"
    );
    let m = refusal(&gpt(", causal: true", r#"("t", Softmax(axis: 0), ["h"]),"#));
    assert!(m.contains("Softmax `t` works across positions"), "{m}");
    // A softmax over the features is per position.
    let extra = r#"("t", Softmax(axis: -1), ["h"]), ("h2", Add, ["h", "t"]),"#;
    if let Err(e) = compile_decode(&gpt(", causal: true", extra), 1, true) {
        panic!("{e}");
    }
}
