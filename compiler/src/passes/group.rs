//! Grouping: the update phase's kernels that do the same ops to different tensors (each
//! parameter's optimizer step, each gradient's squared norm for clipping), and the weights'
//! bf16 copies the forward makes, become one grouped kernel, one launch over every member's
//! tensors, as apex's `multi_tensor_apply` and llm.c's flat AdamW do. A model of 150
//! parameters then steps in a few launches instead of hundreds.
//!
//! Members are structurally identical: the same ops with the same attributes, the same
//! wiring inside, the same stored values, on one stage for one owner. Each reads its own
//! tensors (its parameter, gradient, moments) and the same one-value operands as the others
//! (the learning rate, Adam's step size, the clip coefficient). Each member computes what
//! its kernel computed alone, so the values are the same bits; the clip's norm still adds
//! the members' sums in its fixed order, in the scalar kernels after the group.
//!
//! A grouped kernel runs where its first member ran, so every member's operands must be
//! computed by then; members never read one another, and no member writes what another (or
//! the shared operands) holds, so all of them may run at once.

use super::Ctx;
use crate::ir::{DType, Graph, Kernel, KernelKind, NodeIndex, Op, Phase};
use crate::Error;
use std::collections::{HashMap, HashSet};

pub fn run(g: &mut Graph, _: &Ctx) -> Result<(), Error> {
    g.kernels = group_kernels(g);
    Ok(())
}

/// Where a node's operand comes from: a node of the same member, or an operand slot from
/// outside (numbered by first use, so a value read twice is one slot).
#[derive(Debug, Clone, PartialEq)]
enum Wire {
    Inside(usize),
    Outside(usize),
}

/// What members of one group share exactly.
#[derive(Debug, Clone, PartialEq)]
struct Signature {
    reduce: bool,
    place: (Option<u32>, Option<u32>),
    ops: Vec<(Op, Vec<Wire>)>,
    /// Whether each node's value is stored (read outside its kernel, or a root).
    stored: Vec<bool>,
    /// Each outside slot's type and whether it is one value (else of the member's shape).
    slots: Vec<(DType, bool)>,
}

/// A kernel that could be a member: its signature and its outside operands by slot.
struct Candidate {
    sig: Signature,
    outside: Vec<NodeIndex>,
    /// Values only this member may read or write: its nodes, its own operands and the
    /// values its updates are written over.
    touched: HashSet<NodeIndex>,
    /// Its nodes in `canonical` order.
    nodes: Vec<NodeIndex>,
}

/// A bf16 copy of a source (`RoundBf16` of a parameter or an input, made in the forward):
/// it reads nothing a step computes, so every copy can be made at once.
fn weight_copy(g: &Graph, n: NodeIndex) -> bool {
    matches!(g.g[n].op, Op::RoundBf16)
        && g.operands(n)
            .iter()
            .all(|&o| matches!(g.g[o].op, Op::Param { .. } | Op::Input { .. }))
}

fn one_value(g: &Graph, n: NodeIndex) -> bool {
    g.g[n].ty.shape.iter().all(|d| d.as_known() == Some(1))
}

/// A kernel's nodes in an order fixed by its structure alone (the fuse pass's order depends
/// on where each value was first needed): after its operands, in operand order, depth first
/// from the main result, then from the other nodes nothing inside reads.
fn canonical(g: &Graph, nodes: &[NodeIndex]) -> Vec<NodeIndex> {
    let mut out: Vec<NodeIndex> = Vec::with_capacity(nodes.len());
    let roots = nodes.iter().rev().copied();
    for root in roots {
        let mut stack = vec![(root, false)];
        while let Some((n, expanded)) = stack.pop() {
            if out.contains(&n) {
                continue;
            }
            if expanded {
                out.push(n);
                continue;
            }
            stack.push((n, true));
            for o in g.operands(n).into_iter().rev() {
                if nodes.contains(&o) && !out.contains(&o) {
                    stack.push((o, false));
                }
            }
        }
    }
    out
}

/// Kernel `k` as a possible member: update-phase f32 ops that map element by element, each
/// outside operand of the member's shape or one value, optionally ending in a sum of
/// everything (`reduce_sum` over all axes).
fn candidate(
    g: &Graph,
    k: &Kernel,
    stored: &HashSet<NodeIndex>,
    roots: &HashSet<NodeIndex>,
) -> Option<Candidate> {
    let (chain, reduce) = match k.kind {
        KernelKind::Elementwise | KernelKind::Single => (&k.nodes[..], false),
        KernelKind::ElementwiseReduce => {
            let (&last, chain) = k.nodes.split_last()?;
            let rank = g.g[*chain.last()?].ty.rank();
            match &g.g[last].op {
                Op::ReduceSum { axes } if axes.len() == rank && one_value(g, last) => {}
                _ => return None,
            }
            (chain, true)
        }
        _ => return None,
    };
    let nodes = canonical(g, &k.nodes);
    let shape = &g.g[*chain.first()?].ty;
    let mut outside: Vec<NodeIndex> = Vec::new();
    let mut slots = Vec::new();
    let mut ops = Vec::new();
    for &n in &nodes {
        let node = &g.g[n];
        let tail = reduce && Some(&n) == nodes.last();
        if (node.phase != Phase::Update && !weight_copy(g, n))
            || node.ty.dtype != DType::F32
            || !(tail || node.op.map().is_some() && node.ty == *shape)
        {
            return None;
        }
        let mut wires = Vec::new();
        for o in g.operands(n) {
            if let Some(i) = nodes.iter().position(|&x| x == o) {
                wires.push(Wire::Inside(i));
                continue;
            }
            let ty = &g.g[o].ty;
            let one = one_value(g, o);
            if ty.dtype != DType::F32 || !(one || ty.shape == shape.shape) {
                return None;
            }
            let slot = match outside.iter().position(|&x| x == o) {
                Some(s) => s,
                None => {
                    outside.push(o);
                    slots.push((ty.dtype, one));
                    outside.len() - 1
                }
            };
            wires.push(Wire::Outside(slot));
        }
        ops.push((node.op.clone(), wires));
    }
    // A stored value that is neither kept to the end (a root) nor one value would, with all
    // members at once, live beside every other member's (a ZeRO rank's updates before their
    // broadcasts): grouping would raise the peak, so such kernels stay alone.
    // The weights' bf16 copies are the exception: the backward reads every one of them, so
    // each lives across the turn from forward to backward, where the peak is, either way.
    if nodes.iter().any(|&n| {
        stored.contains(&n) && !roots.contains(&n) && !one_value(g, n) && !weight_copy(g, n)
    }) {
        return None;
    }
    let mut touched: HashSet<NodeIndex> = nodes.iter().copied().collect();
    for &(old, new) in &g.updates {
        if touched.contains(&new) {
            touched.insert(old);
        }
    }
    Some(Candidate {
        sig: Signature {
            reduce,
            place: g.place(nodes[0]),
            ops,
            stored: nodes.iter().map(|n| stored.contains(n)).collect(),
            slots,
        },
        outside,
        touched,
        nodes,
    })
}

struct Group {
    /// The kernel index it runs at (its first member's).
    anchor: usize,
    members: Vec<usize>,
    /// Which slots every member shares (known from the second member on).
    shared: Option<Vec<bool>>,
    /// Every member's own values (`Candidate::touched` and its unshared operands).
    touched: HashSet<NodeIndex>,
}

/// Whether candidate `c` (kernel `k`) can join `grp`, whose first member is `first`; sets the
/// shared slots when it is the second member.
fn joins(
    g: &Graph,
    grp: &mut Group,
    first: &Candidate,
    c: &Candidate,
    kernel_of: &HashMap<NodeIndex, usize>,
) -> bool {
    // Every operand computed before the group runs.
    let ready = c
        .outside
        .iter()
        .all(|o| g.g[*o].op.is_source() || kernel_of.get(o).is_some_and(|&k| k < grp.anchor));
    if !ready {
        return false;
    }
    let shared: Vec<bool> = match &grp.shared {
        Some(s) => s.clone(),
        None => c
            .outside
            .iter()
            .zip(&first.outside)
            .map(|(a, b)| a == b)
            .collect(),
    };
    // The first member's own operands, once the second says which slots are shared.
    let mut touched = grp.touched.clone();
    touched.extend(
        first
            .outside
            .iter()
            .zip(&shared)
            .filter(|(_, &s)| !s)
            .map(|(&o, _)| o),
    );
    let member_types: Vec<&crate::ir::TensorType> = c.touched.iter().map(|&n| &g.g[n].ty).collect();
    for (s, (&o, &is_shared)) in c.outside.iter().zip(&shared).enumerate() {
        if is_shared {
            // One value read by all: not written by any member, nor (when computed) of a
            // member value's type, which the schedule could write over it.
            let ok = o == first.outside[s]
                && c.sig.slots[s].1
                && !touched.contains(&o)
                && !c.touched.contains(&o)
                && (g.g[o].op.is_source() || member_types.iter().all(|t| **t != g.g[o].ty));
            if !ok {
                return false;
            }
        } else if o == first.outside[s] || touched.contains(&o) {
            return false;
        }
    }
    // Members' own values are theirs alone, and none is a shared operand.
    let shared_nodes: HashSet<NodeIndex> = first
        .outside
        .iter()
        .zip(&shared)
        .filter(|(_, &s)| s)
        .map(|(&o, _)| o)
        .collect();
    let own: HashSet<NodeIndex> = c
        .touched
        .iter()
        .copied()
        .chain(
            c.outside
                .iter()
                .zip(&shared)
                .filter(|(_, &s)| !s)
                .map(|(&o, _)| o),
        )
        .collect();
    if own
        .iter()
        .any(|n| touched.contains(n) || shared_nodes.contains(n))
    {
        return false;
    }
    touched.extend(own);
    grp.shared = Some(shared);
    grp.touched = touched;
    true
}

/// The fuse pass's kernels with each group of like update kernels as one `Grouped` kernel
/// at its first member's place.
pub fn group_kernels(g: &Graph) -> Vec<Kernel> {
    let kernels = &g.kernels;
    let kernel_of = g.kernel_of();
    let stored: HashSet<NodeIndex> = super::fuse::stored(g).into_iter().flatten().collect();
    let roots: HashSet<NodeIndex> = g.roots().into_iter().collect();
    let cands: Vec<Option<Candidate>> = kernels
        .iter()
        .map(|k| candidate(g, k, &stored, &roots))
        .collect();
    let mut groups: Vec<Group> = Vec::new();
    // The group each signature's next member may join.
    let mut open: Vec<usize> = Vec::new();
    for (k, c) in cands.iter().enumerate() {
        let Some(c) = c else { continue };
        let at = open.iter().position(|&gi| {
            let first = groups[gi].members[0];
            cands[first].as_ref().is_some_and(|f| f.sig == c.sig)
        });
        if let Some(at) = at {
            let gi = open[at];
            let first = cands[groups[gi].members[0]].as_ref().expect("a candidate");
            if joins(g, &mut groups[gi], first, c, &kernel_of) {
                groups[gi].members.push(k);
                continue;
            }
            open.remove(at);
        }
        let own = c.touched.iter().chain(&c.outside).copied();
        let touched = own.filter(|o| !one_value(g, *o) || c.touched.contains(o));
        open.push(groups.len());
        groups.push(Group {
            anchor: k,
            members: vec![k],
            shared: None,
            touched: touched.collect(),
        });
    }
    let mut at_anchor: HashMap<usize, usize> = HashMap::new();
    let mut moved: HashSet<usize> = HashSet::new();
    for (gi, grp) in groups.iter().enumerate() {
        if grp.members.len() >= 2 {
            at_anchor.insert(grp.anchor, gi);
            moved.extend(grp.members.iter().copied());
        }
    }
    let mut out = Vec::with_capacity(kernels.len());
    for (k, kernel) in kernels.iter().enumerate() {
        if let Some(&gi) = at_anchor.get(&k) {
            let grp = &groups[gi];
            let reduce = cands[k].as_ref().is_some_and(|c| c.sig.reduce);
            out.push(Kernel {
                kind: KernelKind::Grouped {
                    members: grp.members.len() as u32,
                    reduce,
                },
                nodes: grp
                    .members
                    .iter()
                    .filter_map(|&m| cands[m].as_ref())
                    .flat_map(|c| c.nodes.iter().copied())
                    .collect(),
            });
        } else if !moved.contains(&k) {
            out.push(kernel.clone());
        }
    }
    out
}
