//! Simplification: common subexpressions are merged, then nodes that no output depends on
//! are removed.

use super::Ctx;
use crate::ir::{Graph, OpKind};
use crate::Error;
use petgraph::stable_graph::NodeIndex;
use petgraph::visit::NodeIndexable;
use petgraph::Direction;
use std::collections::HashMap;

pub fn run(g: &mut Graph, _: &Ctx) -> Result<(), Error> {
    merge_common(g);
    remove_dead(g);
    Ok(())
}

/// Ops with the same kind, attributes and operands compute the same value: keep the first.
/// Sources (inputs, parameters, state) and dropout (random) are never merged.
pub fn merge_common(g: &mut Graph) {
    let Some(order) = g.topo_order() else { return };
    // Candidates by kind and operands; attributes are compared among them.
    let mut seen: HashMap<(OpKind, Vec<NodeIndex>), Vec<NodeIndex>> = HashMap::new();
    for n in order {
        let kind = g.g[n].op.kind();
        if g.g[n].op.is_source() || kind == OpKind::Dropout {
            continue;
        }
        let candidates = seen.entry((kind, g.operands(n))).or_default();
        match candidates.iter().find(|&&c| g.g[c].op == g.g[n].op) {
            Some(&first) => g.replace_uses(n, first),
            None => candidates.push(n),
        }
    }
}

/// Removes nodes no output, gradient or update depends on. Inputs stay: they are the plan's
/// interface.
pub fn remove_dead(g: &mut Graph) {
    let mut live = vec![false; g.g.node_bound()];
    let mut stack = g.roots();
    stack.extend(g.inputs.iter().copied());
    while let Some(n) = stack.pop() {
        if std::mem::replace(&mut live[n.index()], true) {
            continue;
        }
        stack.extend(g.g.neighbors_directed(n, Direction::Incoming));
    }
    let dead: Vec<NodeIndex> = g.g.node_indices().filter(|n| !live[n.index()]).collect();
    for n in dead {
        g.g.remove_node(n);
    }
}
