//! Weight copies: with `devices.activations: Bf16`, each weight a matmul or convolution
//! multiplies is rounded to bf16 once per step (`RoundBf16`) and the products read that
//! copy, as a bf16 GEMM multiplies bf16 operands (PyTorch's autocast casts the weight the
//! same way). The f32 parameter stays the master copy the optimizer updates; the copy's
//! gradient passes to it unchanged. A matmul's other operands that stay f32 (an input, a
//! mean) are read through such a copy too: a GEMM library multiplies two operands of one
//! type, so every backend multiplies the same bf16 values. Before autodiff, so that the
//! backward's products read the copies too.

use super::Ctx;
use crate::diag::Diagnostic;
use crate::dsl::ast::Storage;
use crate::ir::storage::stored_in_bf16;
use crate::ir::{DType, Graph, NodeIndex, Op, OpKind};
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
    // One copy per value, however many products read it (tied weights).
    let mut copy_of: HashMap<NodeIndex, NodeIndex> = HashMap::new();
    for n in products {
        let matmul = g.g[n].op.kind() == OpKind::MatMul;
        for (slot, p) in g.operands(n).into_iter().enumerate() {
            let weight = g.g[p].op.kind() == OpKind::Param;
            // (A convolution's kernel reads each operand as stored, so only its weight.)
            let stays_f32 = matmul && g.g[p].ty.dtype == DType::F32 && !stored_in_bf16(g, p);
            if !weight && !stays_f32 {
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
