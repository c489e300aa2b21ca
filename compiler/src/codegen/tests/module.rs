//! Tests of whole modules: every model assembles, kernel options, GEMM bias offers, shared
//! entries.

use super::testing::{assemble, model_module};
use super::CodegenOptions;

/// Every kernel of every model file assembles for sm_80 and sm_90 with zero errors.
#[test]
fn every_model_module_assembles() {
    let files = super::testing::model_files();
    assert!(files.len() >= 4, "{files:?}");
    for f in files {
        let m = model_module(&f);
        assemble(&m.text()).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
}

/// With `bf16_attention`, gpt-large's attention (head width 128) runs on tensor cores,
/// forward and backward, and the module assembles; the small transformer's heads (width
/// 16) keep the f32 kernels; by default nothing changes.
#[test]
fn bf16_attention_option_selects_the_mma_kernels() {
    let mma = |m: &super::Module| {
        m.entries
            .iter()
            .filter(|(_, e)| e.contains("mma.sync.aligned.m16n8k16"))
            .count()
    };
    let options = super::CodegenOptions {
        bf16_attention: true,
    };
    let with = |f: &str| super::testing::model_module_with(f, &options);
    assert_eq!(mma(&model_module("gpt-large.ron")), 0);
    let m = with("gpt-large.ron");
    // The forward, the query gradient and the fused key and value gradients: one entry
    // each, shared by every layer.
    assert_eq!(mma(&m), 3);
    assemble(&m.text()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(mma(&with("transformer.ron")), 0);
}

/// A `gemm+bias` kernel whose product only its epilogue reads offers its bias to the
/// GEMM (`Launch::Gemm::bias`): the bias parameter along the product's last axis and the
/// add's buffer, with the bias launch after it for a GEMM that cannot; a kernel with an
/// activation after the bias keeps its own epilogue.
#[test]
fn gemm_bias_kernels_offer_their_bias_to_the_gemm() {
    use super::{Arg, GemmBias, Launch};
    use crate::ir::{KernelKind, Op};
    let plan = super::testing::model_plan("transformer.ron");
    let m = model_module("transformer.ron");
    let mut offered = 0;
    for code in &m.kernels {
        let kern = &plan.kernels[code.index];
        let Some(Launch::Gemm { c, n, bias, .. }) = code.launches.first() else {
            continue;
        };
        let plain_bias = kern.kind
            == KernelKind::Gemm {
                bias: true,
                activation: None,
            };
        let Some(GemmBias { vector, out, .. }) = bias else {
            assert!(!plain_bias || *c != Arg::Scratch, "{:?}", code.ops);
            continue;
        };
        offered += 1;
        assert!(plain_bias, "{:?}", code.ops);
        assert_eq!(*c, Arg::Scratch);
        let (mm, add) = (kern.steps[0], kern.steps[1]);
        assert_eq!(*out, Arg::Value(add));
        assert_eq!(plan.steps[add].operands, [mm, vector_step(vector)]);
        let v = &plan.steps[vector_step(vector)];
        assert!(matches!(v.op, Op::Param { .. }), "{:?}", v.op);
        assert_eq!(plan.shape_at(&v.ty.shape, 1), [*n]);
        assert!(matches!(code.launches[1], Launch::Kernel { .. }));
        assert_eq!(code.launches.len(), 2);
    }
    // Per block: q, k, v, the attention's out projection and the MLP's second layer
    // (two blocks), and the logits.
    assert_eq!(offered, 11);
}

fn vector_step(a: &super::Arg) -> usize {
    match a {
        super::Arg::Value(s) => *s,
        other => panic!("a bias is a stored value, got {other:?}"),
    }
}

#[test]
fn repeated_blocks_share_their_kernels() {
    let m = model_module("gpt-large.ron");
    let launches: usize = m.kernels.iter().map(|k| k.launches.len()).sum();
    // Dozens of identical layers: far fewer entries than launches.
    assert!(
        m.entries.len() * 10 < launches,
        "{} entries for {launches} launches",
        m.entries.len()
    );
}

#[test]
fn the_decode_steps_module_assembles_with_its_cache_kernels() {
    // (The decode step's test model; the check is here: code generation comes after the
    // passes, which may not name it.) Its cached attention stays on the f32 kernel also
    // where the plan's attention would take tensor cores.
    let source = crate::passes::decode_tests::gpt(", causal: true", "");
    for batch in [1, 3] {
        let plan = crate::compile_decode(&source, batch, true).unwrap();
        for bf16_attention in [false, true] {
            let options = CodegenOptions { bf16_attention };
            let m = crate::codegen::generate_with(&plan, batch, "sm_80", &options).unwrap();
            let ops: Vec<&str> = m.kernels.iter().flat_map(|k| k.ops.clone()).collect();
            assert!(ops.contains(&"cache_write"), "{ops:?}");
            assert!(ops.contains(&"cached_attention"), "{ops:?}");
            assert!(!m.text().contains("mma.sync"));
            assemble(&m.text()).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}
