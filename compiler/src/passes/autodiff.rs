//! Autodiff: appends the backward graph. Walking the forward graph from the loss backwards,
//! each op's VJP rule (its row of the op table) turns the gradient of its output into the
//! gradients of its operands; contributions to one value are summed in a fixed order. The
//! result is each parameter's gradient in `Graph::grads`. No tape, no per-layer backward.

use super::Ctx;
use crate::diag::{Diagnostic, Span};
use crate::ir::vjp::Vjp;
use crate::ir::{DType, Graph, NodeIndex, Op, OpKind, Phase, TensorType};
use crate::Error;
use petgraph::visit::NodeIndexable;
use std::collections::HashMap;

pub fn run(g: &mut Graph, _: &Ctx) -> Result<(), Error> {
    let internal = |m: String| Error::Model(Diagnostic::new(m, None));
    let loss = g
        .objective
        .or_else(|| {
            g.outputs
                .iter()
                .find(|(k, _)| k == crate::plan::LOSS)
                .map(|(_, n)| *n)
        })
        .ok_or_else(|| internal("the graph has no `loss` output to differentiate".into()))?;
    let order = g
        .topo_order()
        .ok_or_else(|| internal("the graph has a cycle".into()))?;
    let bound = g.g.node_bound();
    // A node needs a gradient if a parameter reaches it and it reaches the loss.
    let mut from_param = vec![false; bound];
    for &n in &order {
        from_param[n.index()] = g.g[n].op.kind() == OpKind::Param
            || g.operands(n).iter().any(|o| from_param[o.index()]);
    }
    let mut to_loss = vec![false; bound];
    to_loss[loss.index()] = true;
    for &n in order.iter().rev() {
        if to_loss[n.index()] {
            for o in g.operands(n) {
                to_loss[o.index()] = true;
            }
        }
    }
    let needs = |n: NodeIndex| from_param[n.index()] && to_loss[n.index()];

    g.phase = Phase::Backward;
    let (loss_layer, loss_span) = (g.g[loss].layer.clone(), g.g[loss].span);
    let seed = g
        .add(
            Op::Fill {
                value: 1.0,
                ty: TensorType::scalar(DType::F32),
            },
            &[],
            &loss_layer,
            loss_span,
        )
        .map_err(internal)?;
    let mut pending: HashMap<NodeIndex, Vec<NodeIndex>> = HashMap::new();
    pending.insert(loss, vec![seed]);
    let mut param_grads: HashMap<NodeIndex, NodeIndex> = HashMap::new();
    for &n in order.iter().rev() {
        if !needs(n) {
            continue;
        }
        let Some(parts) = pending.remove(&n) else {
            continue;
        };
        let (layer, span) = (g.g[n].layer.clone(), g.g[n].span);
        let mut dy = parts[0];
        for &p in &parts[1..] {
            dy = g.add(Op::Add, &[dy, p], &layer, span).map_err(internal)?;
        }
        if g.g[n].op.kind() == OpKind::Param {
            param_grads.insert(n, dy);
            continue;
        }
        let operands = g.operands(n);
        let rule = g.g[n].op.def().vjp;
        let op_name = g.g[n].op.name();
        let mut v = Tape {
            g,
            layer: layer.clone(),
            span,
        };
        let grads = rule(&mut v, n, &operands, dy).map_err(|m| {
            Error::Model(Diagnostic::new(
                format!("cannot differentiate `{op_name}` in layer `{layer}`: {m}"),
                span,
            ))
        })?;
        for (&o, d) in operands.iter().zip(grads) {
            if let (Some(d), true) = (d, needs(o)) {
                pending.entry(o).or_default().push(d);
            }
        }
    }
    g.grads = g
        .params()
        .into_iter()
        .filter_map(|p| param_grads.get(&p).map(|&d| (p, d)))
        .collect();
    Ok(())
}

/// Where a VJP rule adds its ops: the graph, and the layer the forward op came from.
struct Tape<'a> {
    g: &'a mut Graph,
    layer: String,
    span: Option<Span>,
}

impl Vjp for Tape<'_> {
    fn add(&mut self, op: Op, ins: &[NodeIndex]) -> Result<NodeIndex, String> {
        self.g.add(op, ins, &self.layer, self.span)
    }
    fn add_forward(&mut self, op: Op, ins: &[NodeIndex]) -> Result<NodeIndex, String> {
        let phase = std::mem::replace(&mut self.g.phase, Phase::Forward);
        let n = self.add(op, ins);
        self.g.phase = phase;
        n
    }
    fn ty(&self, n: NodeIndex) -> TensorType {
        self.g.g[n].ty.clone()
    }
    fn op(&self, n: NodeIndex) -> Op {
        self.g.g[n].op.clone()
    }
}
