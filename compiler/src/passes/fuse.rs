//! Fusion: groups ops into kernels. Chains of elementwise ops become one kernel (one pass over
//! memory, intermediates never stored); an elementwise chain feeding a reduction (the MSE's
//! mean, the gradient norm, a scaled softmax) becomes one kernel, and before a layer or RMS
//! norm its value may also be stored (the residual stream: one pass adds, stores and
//! normalizes); a norm's gradient and the add of the residual's gradient after it are one
//! kernel; a bias add and an
//! activation after a matmul become its epilogue; an attention and its saved log-sum-exp are
//! one pass over the keys, its key and value gradients one pass over the queries. Every
//! other op is a kernel of its own. The
//! ops themselves are unchanged: a kernel is a list of nodes, and `Graph::kernels` lists them
//! in execution order.

use super::Ctx;
use crate::ir::maps::Elementwise;
use crate::ir::ops::OpClass;
use crate::ir::{Graph, Kernel, KernelKind, NodeIndex, Op, OpKind, Phase, TensorType};
use crate::Error;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

/// Elementwise ops a fused kernel can evaluate element by element.
pub fn fusable(op: &Op) -> bool {
    op.def().class == OpClass::Elementwise
}

/// Reductions that can end an elementwise kernel: along the last axis or over everything.
fn reduction_tail(op: &Op, input: &TensorType) -> bool {
    let rank = input.rank();
    match op {
        Op::Softmax { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => rank >= 1,
        Op::ReduceSum { axes } | Op::ReduceMean { axes } => {
            *axes == [rank.saturating_sub(1)] || axes.len() == rank
        }
        _ => false,
    }
}

fn is_norm(op: &Op) -> bool {
    matches!(op, Op::LayerNorm { .. } | Op::RmsNorm { .. })
}

fn is_norm_grad(op: &Op) -> bool {
    matches!(op, Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. })
}

/// An operand a fused elementwise kernel can read at element `i` of its output: the same
/// shape, one value, or a shape the output repeats along its leading axes (a bias).
pub fn streamable(operand: &TensorType, out: &TensorType) -> bool {
    operand.shape == out.shape
        || operand.shape.iter().all(|d| d.as_known() == Some(1))
        || (operand.rank() <= out.rank()
            && out.shape[out.rank() - operand.rank()..] == operand.shape[..])
}

/// The ops an attention op shares its kernel with, those the graph has: the `AttentionLse`
/// of an `Attention`'s queries and keys (and the other way round), the other gradients of
/// an attention's inputs with the same operands. None reads another, so one kernel
/// computing them makes no cycle.
fn attention_partners(g: &Graph, n: NodeIndex) -> Option<(Vec<NodeIndex>, KernelKind)> {
    let operands = g.operands(n);
    let (shared, kind) = match g.g[n].op {
        Op::Attention { .. } | Op::AttentionLse { .. } => (2, KernelKind::Attention),
        Op::AttentionGrad { .. } => (6, KernelKind::AttentionGrads),
        _ => return None,
    };
    let partner = |op: &Op| match (&g.g[n].op, op) {
        (
            Op::Attention { causal, scale },
            Op::AttentionLse {
                causal: c,
                scale: s,
            },
        )
        | (
            Op::AttentionLse { causal, scale },
            Op::Attention {
                causal: c,
                scale: s,
            },
        ) => (causal, scale) == (c, s),
        (
            Op::AttentionGrad { causal, scale, wrt },
            Op::AttentionGrad {
                causal: c,
                scale: s,
                wrt: w,
            },
        ) => (causal, scale) == (c, s) && wrt != w,
        _ => false,
    };
    let q = *operands.first()?;
    let partners: Vec<NodeIndex> = g
        .users(q)
        .into_iter()
        .filter(|&u| {
            u != n
                && partner(&g.g[u].op)
                && g.g[u].phase == g.g[n].phase
                && g.place(u) == g.place(n)
                && g.operands(u).get(..shared) == operands.get(..shared)
        })
        .collect();
    (!partners.is_empty()).then_some((partners, kind))
}

struct Group {
    kind: KernelKind,
    nodes: Vec<NodeIndex>,
    /// The position of its first node: outside operands must come before it (or be sources),
    /// so joining never makes a cycle between kernels.
    first: usize,
    /// Operands from outside the group that are not sources.
    outside: Vec<NodeIndex>,
    closed: bool,
}

pub fn run(g: &mut Graph, _: &Ctx) -> Result<(), Error> {
    g.kernels = plan_kernels(g);
    Ok(())
}

/// Nodes in the order their values are first needed: a depth-first walk from the outputs,
/// then the gradients, then the updates. An op whose operands are all sources (a decay of a
/// parameter) then sits next to its use, where it can join its consumers' kernel.
fn demand_order(g: &Graph) -> Vec<NodeIndex> {
    let mut seen = HashSet::new();
    let mut order = Vec::with_capacity(g.g.node_count());
    for root in g.roots() {
        let mut stack = vec![(root, false)];
        while let Some((n, expanded)) = stack.pop() {
            if expanded {
                order.push(n);
                continue;
            }
            if !seen.insert(n) {
                continue;
            }
            stack.push((n, true));
            for o in g.operands(n).into_iter().rev() {
                if !seen.contains(&o) {
                    stack.push((o, false));
                }
            }
        }
    }
    // Inputs nothing reads still belong to the plan.
    order.extend(g.g.node_indices().filter(|n| !seen.contains(n)));
    order
}

/// The kernels (`deps[k]`: the kernels `k` reads) in an order that runs each after what it
/// reads. Of the kernels ready, the one with the least first node; with `by_readiness`, the
/// one that became ready first (ties by first node), except that those it marks `true` wait
/// until nothing else is ready.
fn dependency_order(
    firsts: &[usize],
    deps: &[Vec<usize>],
    by_readiness: Option<&[bool]>,
) -> Vec<usize> {
    let mut remaining: Vec<usize> = deps.iter().map(Vec::len).collect();
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); deps.len()];
    for (k, d) in deps.iter().enumerate() {
        for &j in d {
            users[j].push(k);
        }
    }
    let mut ready: BinaryHeap<Reverse<(usize, usize, usize)>> = (0..deps.len())
        .filter(|&k| remaining[k] == 0)
        .map(|k| Reverse((0, firsts[k], k)))
        .collect();
    let mut order = Vec::with_capacity(deps.len());
    while let Some(Reverse((_, _, k))) = ready.pop() {
        order.push(k);
        for &u in &users[k] {
            remaining[u] -= 1;
            if remaining[u] == 0 {
                let t = match by_readiness {
                    None => 0,
                    Some(last) if last[u] => usize::MAX,
                    Some(_) => order.len(),
                };
                ready.push(Reverse((t, firsts[u], u)));
            }
        }
    }
    debug_assert_eq!(order.len(), deps.len(), "kernels form a cycle");
    order
}

pub fn plan_kernels(g: &Graph) -> Vec<Kernel> {
    let order = demand_order(g);
    let pos: HashMap<NodeIndex, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let roots: HashSet<NodeIndex> = g.roots().into_iter().collect();
    let mut groups: Vec<Group> = Vec::new();
    let mut group_of: HashMap<NodeIndex, usize> = HashMap::new();
    // Ops fuse only where they run: on one pipeline stage, for one ZeRO owner (or all ranks).
    for &n in &order {
        let node = &g.g[n];
        if node.op.is_source() {
            continue;
        }
        let operands = g.operands(n);
        // A value used only inside its kernel need not be stored.
        let only_used_by =
            |o: NodeIndex, user: NodeIndex| !roots.contains(&o) && g.users(o) == [user];
        let mut joined = None;
        // An elementwise op that broadcasts in other ways (a conv bias [C, 1, 1]) runs alone.
        let streams =
            fusable(&node.op) && operands.iter().all(|&o| streamable(&g.g[o].ty, &node.ty));
        // `add(other, norm_grad)`: the add becomes the gradient's epilogue where nothing
        // else reads the gradient and `other` is ready before it (no cycle).
        if streams && node.op == Op::Add && operands.len() == 2 {
            joined = (0..2).find_map(|j| {
                let (o, other) = (operands[j], operands[1 - j]);
                let &gi = group_of.get(&o)?;
                let grp = &groups[gi];
                let fits = grp.nodes == [o]
                    && is_norm_grad(&g.g[o].op)
                    && other != o
                    && only_used_by(o, n)
                    && g.g[o].phase == node.phase
                    && g.place(o) == g.place(n)
                    && g.g[o].ty == node.ty
                    && g.g[other].ty == node.ty
                    && (g.g[other].op.is_source() || pos[&other] < grp.first);
                fits.then_some(gi)
            });
            if let Some(gi) = joined {
                groups[gi].kind = KernelKind::NormGradAdd;
            }
        }
        if streams && joined.is_none() {
            // Open elementwise kernels of this shape and phase that compute an operand.
            let mut merge: Vec<usize> = operands
                .iter()
                .filter_map(|o| group_of.get(o).copied())
                .filter(|&gi| {
                    let grp = &groups[gi];
                    grp.kind == KernelKind::Elementwise
                        && !grp.closed
                        && g.g[grp.nodes[0]].phase == node.phase
                        && g.g[grp.nodes[0]].ty.shape == node.ty.shape
                        && g.place(grp.nodes[0]) == g.place(n)
                })
                .collect();
            merge.sort_unstable();
            merge.dedup();
            // They merge (with this op) if every outside operand of the union comes before it.
            if !merge.is_empty() {
                let first = merge
                    .iter()
                    .map(|&gi| groups[gi].first)
                    .min()
                    .unwrap_or(usize::MAX);
                let inside =
                    |x: &NodeIndex| merge.contains(&group_of.get(x).copied().unwrap_or(usize::MAX));
                let outside: Vec<NodeIndex> = merge
                    .iter()
                    .flat_map(|&gi| groups[gi].outside.iter().copied())
                    .chain(operands.iter().copied().filter(|o| !g.g[*o].op.is_source()))
                    .filter(|x| !inside(x))
                    .collect();
                if outside.iter().all(|x| pos[x] < first) {
                    let target = merge[0];
                    for &gi in &merge[1..] {
                        let moved = std::mem::take(&mut groups[gi].nodes);
                        for &m in &moved {
                            group_of.insert(m, target);
                        }
                        groups[target].nodes.extend(moved);
                        groups[gi].closed = true;
                    }
                    let mut outside = outside;
                    outside.sort_unstable();
                    outside.dedup();
                    groups[target].outside = outside;
                    groups[target].first = first;
                    joined = Some(target);
                }
            }
            // Epilogues of a matmul: a bias (a vector along the last axis), then an activation.
            if joined.is_none() {
                if let Some(&o) = operands.first() {
                    if let Some(&gi) = group_of.get(&o) {
                        let grp = &groups[gi];
                        if let (
                            KernelKind::Gemm {
                                bias,
                                activation: None,
                            },
                            false,
                        ) = (grp.kind, grp.closed)
                        {
                            let last = *grp.nodes.last().expect("a kernel has nodes");
                            let other = operands.get(1);
                            let is_bias = !bias
                                && node.op == Op::Add
                                && other.is_some_and(|&b| {
                                    g.g[b].op.is_source() && g.g[b].ty.rank() == 1
                                });
                            let is_act = matches!(
                                node.op.map(),
                                Some(Elementwise::Unary(m)) if m.map.epilogue
                            );
                            if o == last
                                && g.g[o].ty.shape == node.ty.shape
                                && (is_bias || is_act)
                                && g.place(o) == g.place(n)
                            {
                                groups[gi].kind = KernelKind::Gemm {
                                    bias: bias || is_bias,
                                    activation: is_act.then(|| node.op.kind()),
                                };
                                groups[gi].closed = is_act;
                                joined = Some(gi);
                            }
                        }
                    }
                }
            }
        } else if node.op.def().class == OpClass::Reduction && operands.len() == 1 {
            let o = operands[0];
            if let Some(&gi) = group_of.get(&o) {
                let grp = &groups[gi];
                if grp.kind == KernelKind::Elementwise
                    && !grp.closed
                    && g.g[grp.nodes[0]].phase == node.phase
                    && g.place(grp.nodes[0]) == g.place(n)
                    && reduction_tail(&node.op, &g.g[o].ty)
                    // The reduction reads the chain's last value (the one staged for it).
                    && grp.nodes.iter().max_by_key(|&m| pos[m]) == Some(&o)
                    && (only_used_by(o, n) || is_norm(&node.op))
                {
                    groups[gi].kind = KernelKind::ElementwiseReduce;
                    groups[gi].closed = true;
                    joined = Some(gi);
                }
            }
        }
        if joined.is_none() {
            if let Some((partners, kind)) = attention_partners(g, n) {
                // The kernel of partners already placed, if it holds nothing else.
                joined = partners.iter().find_map(|p| {
                    let &gi = group_of.get(p)?;
                    groups[gi]
                        .nodes
                        .iter()
                        .all(|m| partners.contains(m))
                        .then_some(gi)
                });
                if let Some(gi) = joined {
                    groups[gi].kind = kind;
                }
            }
        }
        match joined {
            Some(gi) => {
                groups[gi].nodes.push(n);
                group_of.insert(n, gi);
            }
            None => {
                let kind = if node.op.kind() == OpKind::MatMul {
                    KernelKind::Gemm {
                        bias: false,
                        activation: None,
                    }
                } else if let Some((_, kind)) = attention_partners(g, n) {
                    kind
                } else if streams {
                    KernelKind::Elementwise
                } else {
                    KernelKind::Single
                };
                group_of.insert(n, groups.len());
                groups.push(Group {
                    kind,
                    nodes: vec![n],
                    first: pos[&n],
                    outside: operands
                        .iter()
                        .copied()
                        .filter(|o| !g.g[*o].op.is_source())
                        .collect(),
                    closed: kind == KernelKind::Single,
                });
            }
        }
    }
    // Merged-away groups are empty; each kernel lists its nodes in order.
    let groups: Vec<Group> = groups
        .into_iter()
        .filter(|grp| !grp.nodes.is_empty())
        .map(|mut grp| {
            grp.nodes.sort_by_key(|n| pos[n]);
            grp
        })
        .collect();
    let group_of: HashMap<NodeIndex, usize> = groups
        .iter()
        .enumerate()
        .flat_map(|(gi, grp)| grp.nodes.iter().map(move |&n| (n, gi)))
        .collect();
    let mut deps: Vec<Vec<usize>> = groups
        .iter()
        .enumerate()
        .map(|(gi, grp)| {
            let mut d: Vec<usize> = grp
                .nodes
                .iter()
                .flat_map(|&n| g.operands(n))
                .filter_map(|o| group_of.get(&o).copied())
                .filter(|&j| j != gi)
                .collect();
            d.sort_unstable();
            d.dedup();
            d
        })
        .collect();
    // Kernels in dependency order (the join rule keeps it acyclic): of the kernels ready to
    // run, the one that became ready first, ties by first node. A weight's gradient then runs
    // beside the input gradient that reads the same output gradient, while that is in cache,
    // not after every other gradient (paired: the MLP bench 0.98-0.99x, the transformers
    // 0.99-1.00x; the transformer's peak 24.9 -> 21.9 MiB). A kernel of sources alone (a
    // mean's gradient, a parameter's decay) keeps its place in the order of first nodes,
    // after the kernel before it there, not at the very start, where it would hold its
    // buffer through the forward. The updates still run last, in one grouped kernel (one
    // launch on a GPU); run beside their gradients they were no faster on the CPU (1.00x).
    let firsts: Vec<usize> = groups.iter().map(|grp| grp.first).collect();
    let updates: Vec<bool> = groups
        .iter()
        .map(|grp| grp.nodes.iter().all(|&n| g.g[n].phase == Phase::Update))
        .collect();
    let by_first = dependency_order(&firsts, &deps, None);
    for w in by_first.windows(2) {
        if deps[w[1]].is_empty() {
            deps[w[1]].push(w[0]);
        }
    }
    let order_of_groups = dependency_order(&firsts, &deps, Some(&updates));
    let mut slots: Vec<Option<Group>> = groups.into_iter().map(Some).collect();
    order_of_groups
        .into_iter()
        .filter_map(|gi| slots[gi].take())
        .map(|grp| {
            let kind = match grp.kind {
                KernelKind::Elementwise if grp.nodes.len() == 1 => KernelKind::Single,
                k => k,
            };
            Kernel {
                kind,
                nodes: grp.nodes,
            }
        })
        .collect()
}

/// For each kernel, the values that must be stored: used by another kernel, or an output,
/// a gradient or an update.
pub fn stored(g: &Graph) -> Vec<Vec<NodeIndex>> {
    let roots: HashSet<NodeIndex> = g.roots().into_iter().collect();
    let kernel_of = g.kernel_of();
    g.kernels
        .iter()
        .enumerate()
        .map(|(k, kernel)| {
            kernel
                .nodes
                .iter()
                .copied()
                .filter(|&n| {
                    roots.contains(&n)
                        || g.g
                            .neighbors_directed(n, petgraph::Direction::Outgoing)
                            .any(|u| kernel_of.get(&u) != Some(&k))
                })
                .collect()
        })
        .collect()
}
