//! The IR's invariants, checked after every pass in tests and debug builds.

use super::graph::Graph;
use super::ops::{Arity, OpKind};
use petgraph::Direction;
use std::collections::HashSet;

/// Checks that the graph is well formed; the message names the first broken invariant.
pub fn verify(g: &Graph) -> Result<(), String> {
    let order = g.topo_order().ok_or("the graph has a cycle")?;
    let names = g.sym_names();
    let mut params = HashSet::new();
    let mut inputs = HashSet::new();
    for &n in &order {
        let node = &g.g[n];
        let def = node.op.def();
        let mut slots: Vec<u16> =
            g.g.edges_directed(n, Direction::Incoming)
                .map(|e| *e.weight())
                .collect();
        slots.sort();
        let Arity::Exactly(k) = def.arity;
        if slots.len() != k || slots.iter().enumerate().any(|(i, &s)| s as usize != i) {
            return Err(format!(
                "node `{}` ({}) has operand slots {slots:?}, expected 0..{k}",
                node.layer, def.name
            ));
        }
        let ops = g.operands(n);
        let tys: Vec<_> = ops.iter().map(|&o| &g.g[o].ty).collect();
        let inferred = node
            .op
            .infer(&tys, &names)
            .map_err(|e| format!("node `{}` ({}): {e}", node.layer, def.name))?;
        if inferred != node.ty {
            return Err(format!(
                "node `{}` ({}) is typed {} but its operands give {}",
                node.layer,
                def.name,
                node.ty.show(&names),
                inferred.show(&names)
            ));
        }
        match &node.op {
            super::ops::Op::Param { name, .. } => {
                if !node.ty.shape.iter().all(|d| d.is_known()) {
                    return Err(format!("parameter `{name}` has a symbolic size"));
                }
                if !params.insert(name.clone()) {
                    return Err(format!("two parameters are named `{name}`"));
                }
            }
            super::ops::Op::Input { name, .. } => {
                if !inputs.insert(name.clone()) {
                    return Err(format!("two inputs are named `{name}`"));
                }
                if !g.inputs.contains(&n) {
                    return Err(format!("input `{name}` is not listed as an input"));
                }
            }
            _ => {}
        }
    }
    for &i in &g.inputs {
        if !g.g.contains_node(i) || g.g[i].op.kind() != OpKind::Input {
            return Err("a listed input is not an input node".into());
        }
    }
    let mut out_names = HashSet::new();
    for (name, n) in &g.outputs {
        if !g.g.contains_node(*n) {
            return Err(format!("output `{name}` refers to a removed node"));
        }
        if !out_names.insert(name) {
            return Err(format!("two outputs are named `{name}`"));
        }
    }
    for (p, d) in &g.grads {
        if !g.g.contains_node(*p) || !g.g.contains_node(*d) {
            return Err("a gradient refers to a removed node".into());
        }
        if g.g[*p].op.kind() != OpKind::Param || g.g[*p].ty != g.g[*d].ty {
            return Err(format!(
                "the gradient of `{}` is typed {}, not like its parameter",
                g.g[*p].layer,
                g.g[*d].ty.show(&names)
            ));
        }
    }
    for (p, u) in &g.updates {
        if !g.g.contains_node(*p) || !g.g.contains_node(*u) {
            return Err("an update refers to a removed node".into());
        }
        if !matches!(g.g[*p].op.kind(), OpKind::Param | OpKind::State) {
            return Err("only parameters and optimizer state are updated".into());
        }
        if g.g[*p].ty != g.g[*u].ty {
            return Err(format!(
                "the update of `{}` is typed {}, not {}",
                g.g[*p].layer,
                g.g[*u].ty.show(&names),
                g.g[*p].ty.show(&names)
            ));
        }
    }
    if g.outputs.is_empty() {
        return Err("the graph has no outputs".into());
    }
    Ok(())
}
