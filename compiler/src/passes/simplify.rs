//! Simplification: common subexpressions are merged, then nodes that no output depends on
//! are removed.

use super::Ctx;
use crate::ir::{Graph, OpKind};
use crate::Error;
use petgraph::stable_graph::NodeIndex;
use petgraph::visit::{EdgeRef, NodeIndexable};
use petgraph::Direction;
use std::collections::HashMap;

pub fn run(g: &mut Graph, _: &Ctx) -> Result<(), Error> {
    merge_common(g);
    remove_dead(g);
    Ok(())
}

/// Ops with the same kind, attributes and operands compute the same value: keep the first.
/// Sources (inputs, parameters) and dropout (random) are never merged.
pub fn merge_common(g: &mut Graph) {
    let Some(order) = g.topo_order() else { return };
    let names = g.sym_names();
    let mut seen: HashMap<(String, String, Vec<NodeIndex>), NodeIndex> = HashMap::new();
    for n in order {
        let kind = g.g[n].op.kind();
        if matches!(kind, OpKind::Input | OpKind::Param | OpKind::Dropout) {
            continue;
        }
        let key = (
            g.g[n].op.name().to_string(),
            g.g[n].op.attrs(&names),
            g.operands(n),
        );
        match seen.get(&key) {
            Some(&first) => replace_uses(g, n, first),
            None => {
                seen.insert(key, n);
            }
        }
    }
}

/// Points every use of `old` at `new` (edges and outputs); `old` is left unused.
pub fn replace_uses(g: &mut Graph, old: NodeIndex, new: NodeIndex) {
    let uses: Vec<(NodeIndex, u16)> =
        g.g.edges_directed(old, Direction::Outgoing)
            .map(|e| (e.target(), *e.weight()))
            .collect();
    for (user, slot) in uses {
        if let Some(e) = g.g.find_edge(old, user) {
            g.g.remove_edge(e);
        }
        g.g.add_edge(new, user, slot);
    }
    for (_, o) in g.outputs.iter_mut() {
        if *o == old {
            *o = new;
        }
    }
}

/// Removes nodes no output depends on. Inputs stay: they are the plan's interface.
pub fn remove_dead(g: &mut Graph) {
    let mut live = vec![false; g.g.node_bound()];
    let mut stack: Vec<NodeIndex> = g.outputs.iter().map(|(_, n)| *n).collect();
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
