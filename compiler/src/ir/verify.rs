//! The IR's invariants, checked after every pass in tests and debug builds.

use super::graph::Graph;
use super::op::{Op, OpKind};
use super::ops::{Arity, OpClass};
use super::{BufferSchedule, KernelKind, NodeIndex};
use petgraph::Direction;
use std::collections::{HashMap, HashSet};

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
            Op::Param { name, .. } => {
                if !node.ty.shape.iter().all(|d| d.is_known()) {
                    return Err(format!("parameter `{name}` has a symbolic size"));
                }
                if !params.insert(name.clone()) {
                    return Err(format!("two parameters are named `{name}`"));
                }
            }
            Op::Input { name, .. } => {
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
    if !g.kernels.is_empty() {
        verify_kernels(g)?;
    }
    verify_bf16_stored(g)?;
    if let Some(schedule) = &g.schedule {
        verify_buffers(g, schedule)?;
        verify_groups(g, schedule)?;
    }
    Ok(())
}

/// Values stored in bf16 are activations that a kernel makes (the `storage` pass's rule):
/// never a parameter, its gradient or update, optimizer state, a loss or a statistic.
fn verify_bf16_stored(g: &Graph) -> Result<(), String> {
    if g.bf16_stored.is_empty() {
        return Ok(());
    }
    let kernel_of = g.kernel_of();
    for &n in &g.bf16_stored {
        if !g.g.contains_node(n) {
            return Err("a removed node is stored in bf16".into());
        }
        if !kernel_of.contains_key(&n) || !super::storage::stored_in_bf16(g, n) {
            let node = &g.g[n];
            return Err(format!(
                "`{}` ({}, {}) is stored in bf16 but is no activation nor a bf16 copy",
                node.layer,
                node.op.name(),
                node.ty.dtype.name()
            ));
        }
    }
    Ok(())
}

/// A grouped kernel's members run at once: equally many ops each, none reading another's
/// values, and no buffer one member writes read or written by another.
fn verify_groups(g: &Graph, s: &BufferSchedule) -> Result<(), String> {
    for (k, kernel) in g.kernels.iter().enumerate() {
        let KernelKind::Grouped { members, .. } = kernel.kind else {
            continue;
        };
        if members == 0 || kernel.nodes.len() % members as usize != 0 {
            return Err(format!(
                "grouped kernel {k} has {} ops, not {members} equal members",
                kernel.nodes.len()
            ));
        }
        let parts = kernel.members();
        let member_of: HashMap<NodeIndex, usize> = parts
            .iter()
            .enumerate()
            .flat_map(|(m, (_, nodes))| nodes.iter().map(move |&n| (n, m)))
            .collect();
        // Buffers each member writes, and those it reads or writes.
        let mut writes: Vec<HashSet<usize>> = vec![HashSet::new(); parts.len()];
        let mut uses: Vec<HashSet<usize>> = vec![HashSet::new(); parts.len()];
        for (m, (_, nodes)) in parts.iter().enumerate() {
            for &n in nodes.iter() {
                if let Some(&b) = s.buffer_of.get(&n) {
                    writes[m].insert(b);
                    uses[m].insert(b);
                }
                for o in g.operands(n) {
                    if member_of.get(&o).is_some_and(|&x| x != m) {
                        return Err(format!(
                            "grouped kernel {k}: a member reads another's `{}` ({})",
                            g.g[o].layer,
                            g.g[o].op.name()
                        ));
                    }
                    if let Some(&b) = s.buffer_of.get(&o) {
                        uses[m].insert(b);
                    }
                }
            }
        }
        for (m, w) in writes.iter().enumerate() {
            for (x, u) in uses.iter().enumerate() {
                if let Some(b) = (x != m).then(|| w.intersection(u).next()).flatten() {
                    return Err(format!(
                        "grouped kernel {k}: members {m} and {x} both use buffer b{b}, which {m} writes"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The fuse pass's kernels partition the computing ops (sources in none), in an order that
/// computes every operand first, each kernel on one stage for one owner.
fn verify_kernels(g: &Graph) -> Result<(), String> {
    let mut kernel_of: HashMap<NodeIndex, (usize, usize)> = HashMap::new();
    for (k, kernel) in g.kernels.iter().enumerate() {
        let first = *kernel
            .nodes
            .first()
            .ok_or(format!("kernel {k} has no ops"))?;
        for (i, &n) in kernel.nodes.iter().enumerate() {
            if !g.g.contains_node(n) {
                return Err(format!("kernel {k} holds a removed node"));
            }
            let node = &g.g[n];
            if node.op.is_source() {
                return Err(format!("kernel {k} holds the source `{}`", node.layer));
            }
            if kernel_of.insert(n, (k, i)).is_some() {
                return Err(format!(
                    "`{}` ({}) is in two kernels",
                    node.layer,
                    node.op.name()
                ));
            }
            if g.place(n) != g.place(first) {
                return Err(format!(
                    "kernel {k} mixes stages or owners (`{}` and `{}`)",
                    g.g[first].layer, node.layer
                ));
            }
        }
    }
    let roots: HashSet<NodeIndex> = g.roots().into_iter().collect();
    for (k, kernel) in g.kernels.iter().enumerate() {
        kernel_shape(g, kernel.kind, &kernel.nodes, &roots)
            .map_err(|e| format!("kernel {k}: {e}"))?;
    }
    for n in g.g.node_indices() {
        let node = &g.g[n];
        let Some(&(k, i)) = kernel_of.get(&n) else {
            if node.op.is_source() {
                continue;
            }
            return Err(format!(
                "`{}` ({}) is in no kernel",
                node.layer,
                node.op.name()
            ));
        };
        for o in g.operands(n) {
            if g.g[o].op.is_source() {
                continue;
            }
            let (ko, io) = kernel_of[&o];
            if (ko, io) >= (k, i) {
                return Err(format!(
                    "kernel {k} reads `{}` ({}) before kernel {ko} computes it",
                    g.g[o].layer,
                    g.g[o].op.name()
                ));
            }
        }
    }
    Ok(())
}

/// The shapes the backends rely on: a fused reduction reads the last value of its
/// elementwise chain; a norm gradient's add reads the gradient, which nothing else reads, and
/// another value of its type.
fn kernel_shape(
    g: &Graph,
    kind: KernelKind,
    nodes: &[NodeIndex],
    roots: &HashSet<NodeIndex>,
) -> Result<(), String> {
    let elementwise = |n: &NodeIndex| g.g[*n].op.def().class == OpClass::Elementwise;
    let ok = match (kind, nodes) {
        (KernelKind::ElementwiseReduce, [chain @ .., last, red]) => {
            chain.iter().chain([last]).all(elementwise)
                && g.g[*red].op.def().class == OpClass::Reduction
                && g.operands(*red) == [*last]
        }
        (KernelKind::NormGradAdd, [ng, add]) => {
            let ops = g.operands(*add);
            let other = ops.iter().find(|&&o| o != *ng);
            matches!(
                g.g[*ng].op,
                Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. }
            ) && g.g[*add].op == Op::Add
                && ops.iter().filter(|&&o| o == *ng).count() == 1
                && g.users(*ng) == [*add]
                && !roots.contains(ng)
                && g.g[*ng].ty == g.g[*add].ty
                && other.is_some_and(|&o| g.g[o].ty == g.g[*add].ty)
        }
        (KernelKind::ElementwiseReduce | KernelKind::NormGradAdd, _) => false,
        _ => true,
    };
    match (ok, kind) {
        (true, _) => Ok(()),
        (false, KernelKind::NormGradAdd) => Err(
            "a norm gradient's add must read the gradient (read by nothing else) and a value of \
             its type"
                .into(),
        ),
        (false, _) => {
            Err("a fused reduction must read the last value of an elementwise chain".into())
        }
    }
}

/// The schedule pass's buffers: each value's buffer is of its type and large enough, and no
/// two values are live in one buffer at once, except where the schedule documents it: an
/// update written over its parameter or state, an elementwise result written over an operand
/// its kernel reads last, and a reshape viewing its operand's buffer.
fn verify_buffers(g: &Graph, s: &BufferSchedule) -> Result<(), String> {
    let value = g.sym_value(s.batch);
    let end = g.kernels.len();
    let kernel_of = g.kernel_of();
    let roots: HashSet<NodeIndex> = g.roots().into_iter().collect();
    let (forward_only, last_forward) = (g.outputs_kept_through_forward(), g.last_forward_kernel());
    // A reshape sharing its operand's buffer is one value with it.
    let owner = |mut n: NodeIndex| {
        while let (Op::Reshape { .. }, [o]) = (&g.g[n].op, g.operands(n).as_slice()) {
            if s.buffer_of.get(o) != s.buffer_of.get(&n) {
                break;
            }
            n = *o;
        }
        n
    };
    // Each value's life, in kernel order: made (sources before the first kernel), last read.
    let mut life: HashMap<NodeIndex, (usize, usize)> = HashMap::new();
    let mut by_buffer: HashMap<usize, HashSet<NodeIndex>> = HashMap::new();
    for (&n, &b) in &s.buffer_of {
        if !g.g.contains_node(n) {
            return Err(format!("buffer b{b} holds a removed node"));
        }
        let node = &g.g[n];
        let buf = s.buffers.get(b).ok_or(format!(
            "`{}` has buffer b{b}, which does not exist",
            node.layer
        ))?;
        let elements = node
            .ty
            .shape
            .iter()
            .fold(1u64, |a, d| a.saturating_mul(d.eval(&value)));
        if buf.dtype != g.stored_dtype(n) || buf.elements < elements {
            return Err(format!(
                "`{}` ({}, {elements} elements) is in buffer b{b} ({}, {} elements)",
                node.layer,
                g.stored_dtype(n).name(),
                buf.dtype.name(),
                buf.elements
            ));
        }
        let made = if node.op.is_source() {
            0
        } else {
            kernel_of.get(&n).map_or(0, |k| k + 1)
        };
        let read = if (roots.contains(&n) && !forward_only.contains(&n)) || node.op.is_source() {
            end + 1
        } else {
            let last = g
                .users(n)
                .iter()
                .filter_map(|u| kernel_of.get(u))
                .map(|k| k + 1)
                .max()
                .unwrap_or(made);
            // Kept for an eval step, which runs the forward kernels.
            if forward_only.contains(&n) {
                last.max(last_forward + 1)
            } else {
                last
            }
        };
        let v = owner(n);
        let e = life.entry(v).or_insert((made, read));
        *e = (e.0.min(made), e.1.max(read));
        by_buffer.entry(b).or_default().insert(v);
    }
    let updated: HashSet<(NodeIndex, NodeIndex)> = g.updates.iter().copied().collect();
    // Whether the kernel numbered `made` (from 1) works element by element, so that it may
    // write over a value it reads.
    let elementwise = |made: usize| {
        made >= 1 && {
            let k = &g.kernels[made - 1];
            matches!(
                k.kind,
                KernelKind::Elementwise
                    | KernelKind::ElementwiseReduce
                    | KernelKind::Grouped { .. }
            ) || k.kind == KernelKind::Single
                && g.g[k.nodes[0]].op.def().class == OpClass::Elementwise
                || g.rewrites_rows_in_place(&k.nodes)
        }
    };
    // Every reader of `old` runs at or before the kernel numbered `at`.
    let read_by = |old: NodeIndex, at: usize| {
        g.users(old)
            .iter()
            .filter_map(|u| kernel_of.get(u))
            .all(|&k| k < at)
    };
    for (b, values) in by_buffer {
        let mut values: Vec<NodeIndex> = values.into_iter().collect();
        values.sort_by_key(|v| (life[v], v.index()));
        for (i, &a) in values.iter().enumerate() {
            for &c in &values[i + 1..] {
                let (read_a, made_c) = (life[&a].1, life[&c].0);
                let clash = if updated.contains(&(a, c)) {
                    !read_by(a, made_c)
                } else {
                    made_c < read_a || made_c == read_a && !elementwise(made_c)
                };
                if clash {
                    return Err(format!(
                        "buffer b{b} holds `{}` ({}) while `{}` ({}) still needs it",
                        g.g[c].layer,
                        g.g[c].op.name(),
                        g.g[a].layer,
                        g.g[a].op.name()
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The MLP's training graph after the whole pipeline (fused and scheduled).
    fn scheduled() -> Graph {
        let source =
            crate::parse_bytes(include_str!("../../../models/mlp.ron").as_bytes()).unwrap();
        crate::compile(&source, &crate::Options::default(), &mut |_, _| {})
            .unwrap()
            .graph
    }

    #[test]
    fn kernels_out_of_order_or_missing_are_caught() {
        let g = scheduled();
        assert_eq!(verify(&g), Ok(()));
        let mut swapped = g.clone();
        let last = swapped.kernels.len() - 1;
        swapped.kernels.swap(0, last);
        let err = verify(&swapped).unwrap_err();
        assert!(err.contains("before kernel"), "{err}");
        let mut dropped = g.clone();
        dropped.kernels.remove(1);
        let err = verify(&dropped).unwrap_err();
        assert!(err.contains("is in no kernel"), "{err}");
        let mut twice = g;
        let again = twice.kernels[0].clone();
        twice.kernels.push(again);
        let err = verify(&twice).unwrap_err();
        assert!(err.contains("in two kernels"), "{err}");
    }

    #[test]
    fn two_live_values_in_one_buffer_are_caught() {
        let g = scheduled();
        let s = g.schedule.clone().unwrap();
        // A parameter's buffer given to the first value a kernel stores: both live at once.
        let param =
            g.g.node_indices()
                .find(|&n| g.g[n].op.kind() == OpKind::Param)
                .unwrap();
        let made = g
            .kernels
            .iter()
            .flat_map(|k| k.nodes.iter().copied())
            .find(|n| s.buffer_of.contains_key(n))
            .unwrap();
        let mut clash = g.clone();
        let mut sched = s.clone();
        let b = sched.buffer_of[&param];
        sched.buffers[b].elements = u64::MAX;
        sched.buffers[b].dtype = g.g[made].ty.dtype;
        sched.buffer_of.insert(made, b);
        clash.schedule = Some(sched);
        let err = verify(&clash).unwrap_err();
        assert!(err.contains("still needs it"), "{err}");
        // A buffer too small for its value.
        let mut small = g.clone();
        let mut sched = s;
        let b = sched.buffer_of[&made];
        sched.buffers[b].elements = 0;
        small.schedule = Some(sched);
        let err = verify(&small).unwrap_err();
        assert!(err.contains("elements) is in buffer"), "{err}");
    }
}
