//! Stable text and DOT renderings of the IR. The text form is what golden tests compare, so
//! it depends only on the graph: nodes numbered in topological order, attributes in a fixed
//! order.

use super::graph::Graph;
use petgraph::stable_graph::NodeIndex;
use std::collections::HashMap;
use std::fmt::Write;

fn numbering(g: &Graph) -> (Vec<NodeIndex>, HashMap<NodeIndex, usize>) {
    let order = g
        .topo_order()
        .unwrap_or_else(|| g.g.node_indices().collect());
    let ids = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    (order, ids)
}

pub fn to_text(g: &Graph, title: &str) -> String {
    let names = g.sym_names();
    let (order, ids) = numbering(g);
    let mut out = String::new();
    let _ = writeln!(out, "graph \"{title}\" {{");
    let syms: Vec<String> = g
        .symbols
        .iter()
        .map(|s| {
            if s.name == "B" {
                "B".to_string()
            } else {
                format!("{}~{}", s.name, s.nominal)
            }
        })
        .collect();
    let _ = writeln!(out, "  symbols {}", syms.join(", "));
    for &n in &order {
        let node = &g.g[n];
        let operands: Vec<String> = g
            .operands(n)
            .iter()
            .map(|o| format!("%{}", ids[o]))
            .collect();
        let attrs = node.op.attrs(&names);
        let mut args = operands.join(", ");
        if !attrs.is_empty() {
            if !args.is_empty() {
                args.push_str("; ");
            }
            args.push_str(&attrs);
        }
        let _ = write!(
            out,
            "  %{} = {}({}) : {}",
            ids[&n],
            node.op.name(),
            args,
            node.ty.show(&names)
        );
        if !node.layer.is_empty() {
            let _ = write!(out, "  @{}", node.layer);
        }
        match node.phase {
            super::graph::Phase::Forward => {}
            super::graph::Phase::Backward => out.push_str("  [backward]"),
            super::graph::Phase::Update => out.push_str("  [update]"),
        }
        // What the partitioning and schedule passes decided, once they have run.
        if let Some(stage) = g.stages.as_ref().and_then(|s| s.get(&n)) {
            let _ = write!(out, "  stage {stage}");
        }
        if let Some(owner) = g.owners.get(&n) {
            let _ = write!(out, "  owner {owner}");
        }
        if g.bf16_stored.contains(&n) {
            out.push_str("  stored bf16");
        }
        if let Some(b) = g.schedule.as_ref().and_then(|s| s.buffer_of.get(&n)) {
            let _ = write!(out, "  -> b{b}");
        }
        out.push('\n');
    }
    for (k, kernel) in g.kernels.iter().enumerate() {
        let nodes: Vec<String> = kernel
            .nodes
            .iter()
            .map(|n| format!("%{}", ids[n]))
            .collect();
        let _ = writeln!(
            out,
            "  kernel {k} {}: {}",
            kernel.kind.name(),
            nodes.join(" ")
        );
    }
    if let Some(s) = &g.schedule {
        for (b, buf) in s.buffers.iter().enumerate() {
            let dedicated = if buf.dedicated { " dedicated" } else { "" };
            let _ = writeln!(
                out,
                "  buffer b{b} {} x {}{dedicated}",
                buf.dtype.name(),
                buf.elements
            );
        }
        let m = &s.memory;
        let _ = writeln!(
            out,
            "  memory at batch {}: peak {} bytes, activations {}, dedicated {}",
            s.batch,
            m.peak_bytes,
            m.activation_bytes,
            m.dedicated_bytes()
        );
    }
    for (name, n) in &g.outputs {
        let _ = writeln!(out, "  output {name} = %{}", ids[n]);
    }
    for (p, d) in &g.grads {
        let _ = writeln!(out, "  grad %{} = %{}", ids[p], ids[d]);
    }
    for (p, u) in &g.updates {
        let _ = writeln!(out, "  update %{} <- %{}", ids[p], ids[u]);
    }
    out.push_str("}\n");
    out
}

pub fn to_dot(g: &Graph, title: &str) -> String {
    let names = g.sym_names();
    let (order, ids) = numbering(g);
    let mut out = String::new();
    let _ = writeln!(out, "digraph \"{}\" {{", title.replace('"', "'"));
    out.push_str("  rankdir=TB;\n  node [shape=box, fontname=\"monospace\", fontsize=10];\n");
    for &n in &order {
        let node = &g.g[n];
        let style = match node.op.kind() {
            super::op::OpKind::Param => ", style=filled, fillcolor=\"#e8f0ff\"",
            super::op::OpKind::Input => ", style=filled, fillcolor=\"#e8ffe8\"",
            _ => "",
        };
        let label = format!(
            "%{} {}\\n{}\\n{}",
            ids[&n],
            node.op.name(),
            node.ty.show(&names),
            node.layer
        )
        .replace('"', "'");
        let _ = writeln!(out, "  n{} [label=\"{label}\"{style}];", ids[&n]);
    }
    for &n in &order {
        for (i, o) in g.operands(n).iter().enumerate() {
            let _ = writeln!(out, "  n{} -> n{} [label=\"{i}\"];", ids[o], ids[&n]);
        }
    }
    for (name, n) in &g.outputs {
        let _ = writeln!(
            out,
            "  out_{name} [label=\"{name}\", shape=ellipse];\n  n{} -> out_{name};",
            ids[n]
        );
    }
    out.push_str("}\n");
    out
}
