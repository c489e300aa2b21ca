//! What a plan with `devices.activations: Bf16` stores in bf16 (the `storage` pass's rule,
//! which the verifier and the planner apply too): activations, and the bf16 copies of
//! weights (`RoundBf16`).

use super::dim::BATCH;
use super::op::OpKind;
use super::ops::OpClass;
use super::{DType, Graph, NodeIndex, Phase};

/// Whether value `n` is kept in bf16 when stored: an activation, or a weight's bf16 copy.
pub fn stored_in_bf16(g: &Graph, n: NodeIndex) -> bool {
    is_activation(g, n) || g.g[n].op.kind() == OpKind::RoundBf16
}

/// Whether value `n` is an activation: an f32 value of the forward or backward that
/// holds something per sample (its shape carries the batch), made by an op whose output is
/// a tensor of features rather than a statistic of them.
fn is_activation(g: &Graph, n: NodeIndex) -> bool {
    let node = &g.g[n];
    node.ty.dtype == DType::F32
        && node.phase != Phase::Update
        && node.ty.shape.iter().any(|d| d.syms.contains(&BATCH))
        && makes_features(node.op.kind(), node.op.def().class)
}

fn makes_features(kind: OpKind, class: OpClass) -> bool {
    match class {
        OpClass::Gemm | OpClass::Conv | OpClass::Elementwise | OpClass::Layout => true,
        // The log-sum-exp is a row statistic that the backward reads (FlashAttention keeps it
        // in f32 too).
        OpClass::Attention => kind != OpKind::AttentionLse,
        // Of the reductions, those that give back a row of features per row: sums, means
        // and losses are statistics.
        OpClass::Reduction => matches!(
            kind,
            OpKind::Softmax
                | OpKind::SoftmaxGrad
                | OpKind::LayerNorm
                | OpKind::LayerNormGrad
                | OpKind::RmsNorm
                | OpKind::RmsNormGrad
                | OpKind::Pool2d
                | OpKind::Pool2dGrad
                | OpKind::CrossEntropyGrad
        ),
        OpClass::Source | OpClass::Collective => false,
    }
}
