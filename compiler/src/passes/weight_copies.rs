//! Weight copies: with `devices.activations: Bf16`, each weight a matmul or convolution
//! multiplies is rounded to bf16 once per step (`RoundBf16`) and the products read that
//! copy, as a bf16 GEMM multiplies bf16 operands (PyTorch's autocast casts the weight the
//! same way). The f32 parameter stays the master copy the optimizer updates; the copy's
//! gradient passes to it unchanged. Before autodiff, so that the backward's products read
//! the copy too.

use super::Ctx;
use crate::diag::Diagnostic;
use crate::dsl::ast::Storage;
use crate::ir::{Graph, NodeIndex, Op, OpKind};
use crate::Error;
use std::collections::HashMap;

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    if ctx.source.experiment.devices.activations != Storage::Bf16 {
        return Ok(());
    }
    let products: Vec<NodeIndex> =
        g.g.node_indices()
            .filter(|&n| matches!(g.g[n].op.kind(), OpKind::MatMul | OpKind::Conv2d))
            .collect();
    // One copy per parameter, however many products read it (tied weights).
    let mut copy_of: HashMap<NodeIndex, NodeIndex> = HashMap::new();
    for n in products {
        for (slot, p) in g.operands(n).into_iter().enumerate() {
            if g.g[p].op.kind() != OpKind::Param {
                continue;
            }
            let copy = match copy_of.get(&p) {
                Some(&c) => c,
                None => {
                    let (layer, span) = (g.g[p].layer.clone(), g.g[p].span);
                    let c = g.add(Op::RoundBf16, &[p], &layer, span).map_err(|m| {
                        Error::Model(Diagnostic::new(
                            format!("the bf16 copy of `{layer}`: {m}"),
                            span,
                        ))
                    })?;
                    copy_of.insert(p, c);
                    c
                }
            };
            g.replace_operand(n, slot, copy);
        }
    }
    Ok(())
}
