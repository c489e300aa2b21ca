//! Scheduling: kernels run in the fuse pass's order; every stored value gets a buffer, and a
//! buffer is reused once every reader of its value has run. Parameters, optimizer state and
//! inputs keep buffers of their own. An update is written over its parameter or state (as an
//! in-place optimizer step) where every other reader of the old value has run before it, so
//! the step ends without copying. An elementwise kernel's result is written over the buffer
//! of an operand it reads last, element by element. A reshape of a stored intermediate is a
//! view: it shares its operand's buffer, which lives until the last reader of either. The
//! result states the step's exact peak memory at the training batch size.

use super::fuse::{stored, streamable};
use super::Ctx;
use crate::ir::ops::OpClass;
use crate::ir::{Buffer, BufferSchedule, DType, Graph, NodeIndex, Op};
use crate::passes::lower::{is_cache, is_running_statistic};
use crate::Error;
use std::collections::{BTreeSet, HashMap};

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    let batch = ctx.options.plan_batch(ctx.source);
    g.schedule = Some(plan_buffers(g, batch));
    Ok(())
}

fn elements(g: &Graph, n: NodeIndex, batch: u64) -> u64 {
    let value = g.sym_value(batch);
    g.g[n]
        .ty
        .shape
        .iter()
        .fold(1u64, |a, d| a.saturating_mul(d.eval(&value)))
}

pub fn plan_buffers(g: &Graph, batch: u64) -> BufferSchedule {
    let mut s = BufferSchedule {
        batch,
        ..BufferSchedule::default()
    };
    let bytes = |n: NodeIndex| elements(g, n, batch).saturating_mul(g.stored_dtype(n).bytes());
    // Dedicated buffers for sources.
    for n in g.g.node_indices() {
        let node = &g.g[n];
        if !node.op.is_source() {
            continue;
        }
        let b = bytes(n);
        let m = &mut s.memory;
        let total = match &node.op {
            Op::Param { .. } => &mut m.parameter_bytes,
            Op::State { name, .. } if is_running_statistic(name) => &mut m.statistics_bytes,
            Op::State { name, .. } if is_cache(name) => &mut m.cache_bytes,
            Op::State { .. } => &mut m.optimizer_state_bytes,
            _ => &mut m.input_bytes,
        };
        *total = total.saturating_add(b);
        s.buffer_of.insert(n, s.buffers.len());
        s.buffers.push(Buffer {
            dtype: node.ty.dtype,
            elements: elements(g, n, batch),
            dedicated: true,
        });
    }
    let dedicated_bytes = s.memory.dedicated_bytes();
    // When each stored value is made and last read, in kernel order.
    let end = g.kernels.len();
    let kernel_of = g.kernel_of();
    let mut roots: std::collections::HashSet<NodeIndex> = g.roots().into_iter().collect();
    // Outputs kept only through the forward kernels (what an eval step runs): a training
    // step writes the logits' gradient over them.
    let forward_only = g.outputs_kept_through_forward();
    roots.retain(|v| !forward_only.contains(v));
    let last_forward = g.last_forward_kernel();
    let mut frees_after: Vec<Vec<NodeIndex>> = vec![Vec::new(); end + 1];
    let values = stored(g);
    let views = reshape_views(g, &values);
    // A value and its views share one buffer, freed after the last reader of any of them.
    let mut last_use: HashMap<NodeIndex, usize> = HashMap::new();
    for (k, vals) in values.iter().enumerate() {
        for &v in vals {
            let last = if roots.contains(&v) {
                end
            } else {
                g.g.neighbors_directed(v, petgraph::Direction::Outgoing)
                    .filter_map(|u| kernel_of.get(&u))
                    .copied()
                    .max()
                    .unwrap_or(k)
            };
            let last = if forward_only.contains(&v) {
                last.max(last_forward)
            } else {
                last
            };
            let owner = views.get(&v).copied().unwrap_or(v);
            let e = last_use.entry(owner).or_insert(0);
            *e = (*e).max(last.max(k));
        }
    }
    for (&v, &last) in &last_use {
        frees_after[last].push(v);
    }
    for f in &mut frees_after {
        f.sort();
    }
    let in_place = in_place_updates(g, &kernel_of);
    let over_operands = written_over_operands(g, &values, &views, &last_use, &in_place);
    // Free buffers by (type, size, id), for best-fit lookups.
    let mut free: BTreeSet<(DType, u64, usize)> = BTreeSet::new();
    let handed_on: std::collections::HashSet<NodeIndex> = over_operands.values().copied().collect();
    let (mut live, mut peak, mut without_reuse) = (0u64, 0u64, 0u64);
    for (k, vals) in values.iter().enumerate() {
        for &v in vals {
            let (dtype, need) = (g.stored_dtype(v), elements(g, v, batch));
            without_reuse = without_reuse.saturating_add(bytes(v));
            if let Some(&old) = in_place.get(&v).or_else(|| views.get(&v)) {
                s.buffer_of.insert(v, s.buffer_of[&old]);
                continue;
            }
            // The buffer of an operand this kernel reads last: the value takes its place
            // (and its bytes), and the operand's free below hands the buffer on.
            if let Some(&old) = over_operands.get(&v) {
                s.buffer_of.insert(v, s.buffer_of[&old]);
                continue;
            }
            // The smallest free buffer of the type that fits, else the largest (grown).
            let fits = free
                .range((dtype, need, 0)..)
                .next()
                .filter(|f| f.0 == dtype)
                .or_else(|| {
                    free.range(..(dtype, need, 0))
                        .next_back()
                        .filter(|f| f.0 == dtype)
                })
                .copied();
            let b = match fits {
                Some(f) => {
                    free.remove(&f);
                    f.2
                }
                None => {
                    s.buffers.push(Buffer {
                        dtype,
                        elements: 0,
                        dedicated: false,
                    });
                    s.buffers.len() - 1
                }
            };
            s.buffers[b].elements = s.buffers[b].elements.max(need);
            s.buffer_of.insert(v, b);
            live = live.saturating_add(bytes(v));
        }
        peak = peak.max(live);
        for &v in &frees_after[k] {
            if in_place.contains_key(&v) || handed_on.contains(&v) {
                continue;
            }
            live = live.saturating_sub(bytes(v));
            let b = s.buffer_of[&v];
            free.insert((s.buffers[b].dtype, s.buffers[b].elements, b));
        }
    }
    s.memory.activation_bytes = s
        .buffers
        .iter()
        .filter(|b| !b.dedicated)
        .fold(0u64, |a, b| {
            a.saturating_add(b.elements.saturating_mul(b.dtype.bytes()))
        });
    s.memory.activation_bytes_without_reuse = without_reuse;
    s.memory.peak_bytes = dedicated_bytes.saturating_add(peak);
    s
}

/// The updates written over their old values: `update -> old`. Allowed where every reader of
/// the old value runs in an earlier kernel, except in the update's own kernel when that is
/// elementwise and reads the old value only at or before the op that makes the update
/// (element by element, each read then comes before its write), or rewrites rows in place
/// (a decode step's cache write).
fn in_place_updates(
    g: &Graph,
    kernel_of: &HashMap<NodeIndex, usize>,
) -> HashMap<NodeIndex, NodeIndex> {
    let mut out = HashMap::new();
    for &(old, new) in &g.updates {
        let (Some(&k), true) = (kernel_of.get(&new), g.g[old].op.is_source()) else {
            continue;
        };
        if g.g[old].ty != g.g[new].ty || g.stored_dtype(old) != g.stored_dtype(new) {
            continue;
        }
        let nodes = &g.kernels[k].nodes;
        let at = nodes.iter().position(|&n| n == new);
        let mut read_here = false;
        let readers_ok =
            g.g.neighbors_directed(old, petgraph::Direction::Outgoing)
                .all(|r| match kernel_of.get(&r) {
                    Some(&kr) if kr == k => {
                        read_here = true;
                        nodes.iter().position(|&n| n == r) <= at
                    }
                    Some(&kr) => kr < k,
                    None => false,
                });
        let in_order =
            !read_here || element_by_element(g, nodes) || g.rewrites_rows_in_place(nodes);
        if at.is_some() && readers_ok && in_order {
            out.insert(new, old);
        }
    }
    out
}

/// Whether a kernel's ops are all elementwise, each reading its operands at the element's own
/// index or repeated whole (a bias), so that it can run element by element, each element's
/// reads before its write. An elementwise op alone may broadcast otherwise (`[1, C, 1, 1]`
/// over `[B, C, H, W]`), and is then not run element by element.
fn element_by_element(g: &Graph, nodes: &[NodeIndex]) -> bool {
    nodes.iter().all(|&n| {
        g.g[n].op.def().class == OpClass::Elementwise
            && g.g
                .neighbors_directed(n, petgraph::Direction::Incoming)
                .all(|o| streamable(&g.g[o].ty, &g.g[n].ty))
    })
}

/// Elementwise results written over an operand's buffer: `value -> operand`. Allowed where
/// the kernel is all elementwise, reading each operand element by element (or is a
/// cross-entropy's gradient, row by row), the operand is an intermediate of the same type
/// and storage (no source, no reshape view, no view of it) whose last readers are in this kernel at or before the op
/// that makes the value: element by element, each read then comes before the write, on the
/// CPU as on the GPU. The step reads and writes one buffer instead of two (a cold one).
fn written_over_operands(
    g: &Graph,
    values: &[Vec<NodeIndex>],
    views: &HashMap<NodeIndex, NodeIndex>,
    last_use: &HashMap<NodeIndex, usize>,
    in_place: &HashMap<NodeIndex, NodeIndex>,
) -> HashMap<NodeIndex, NodeIndex> {
    let viewed: std::collections::HashSet<NodeIndex> = views.values().copied().collect();
    let mut out = HashMap::new();
    let mut taken = std::collections::HashSet::new();
    for (k, kernel) in g.kernels.iter().enumerate() {
        let nodes = &kernel.nodes;
        // A chain before a norm also runs element by element; the norm reads only its last value.
        let chain_then_norm = matches!(
            nodes.split_last(),
            Some((r, chain)) if matches!(g.g[*r].op, Op::LayerNorm { .. } | Op::RmsNorm { .. })
                && !chain.is_empty()
                && element_by_element(g, chain)
        );
        if !element_by_element(g, nodes) && !g.rewrites_rows_in_place(nodes) && !chain_then_norm {
            continue;
        }
        for &v in &values[k] {
            if in_place.contains_key(&v) || views.contains_key(&v) {
                continue;
            }
            let at = nodes.iter().position(|&n| n == v);
            let operand =
                g.g.neighbors_directed(v, petgraph::Direction::Incoming)
                    .find(|&u| {
                        !g.g[u].op.is_source()
                            && g.g[u].ty == g.g[v].ty
                            && g.stored_dtype(u) == g.stored_dtype(v)
                            && !nodes.contains(&u)
                            && !views.contains_key(&u)
                            && !viewed.contains(&u)
                            && !taken.contains(&u)
                            && last_use.get(&u) == Some(&k)
                            && g.g
                                .neighbors_directed(u, petgraph::Direction::Outgoing)
                                .all(|r| {
                                    !nodes.contains(&r) || nodes.iter().position(|&n| n == r) <= at
                                })
                    });
            if let Some(u) = operand {
                taken.insert(u);
                out.insert(v, u);
            }
        }
    }
    out
}

/// Reshapes that share their operand's buffer: `reshape -> the value owning the buffer`.
/// Only reshapes of stored intermediates (not of sources, whose buffers updates overwrite),
/// and only where no op reads two values of one buffer (they would need two shapes at once).
fn reshape_views(g: &Graph, values: &[Vec<NodeIndex>]) -> HashMap<NodeIndex, NodeIndex> {
    let stored: std::collections::HashSet<NodeIndex> = values.iter().flatten().copied().collect();
    let mut owner: HashMap<NodeIndex, NodeIndex> = HashMap::new();
    for kernel in &g.kernels {
        let &[v] = kernel.nodes.as_slice() else {
            continue;
        };
        if !matches!(g.g[v].op, crate::ir::Op::Reshape { .. }) || !stored.contains(&v) {
            continue;
        }
        let Some(x) =
            g.g.neighbors_directed(v, petgraph::Direction::Incoming)
                .next()
        else {
            continue;
        };
        if !stored.contains(&x) || g.g[x].op.is_source() || g.stored_dtype(x) != g.stored_dtype(v) {
            continue;
        }
        let root = owner.get(&x).copied().unwrap_or(x);
        // Another value of the group read by the same op as `v`.
        let group = |n: NodeIndex| n == root || owner.get(&n) == Some(&root);
        let clash =
            g.g.neighbors_directed(v, petgraph::Direction::Outgoing)
                .any(|c| {
                    g.g.neighbors_directed(c, petgraph::Direction::Incoming)
                        .any(|o| o != v && group(o))
                });
        if !clash {
            owner.insert(v, root);
        }
    }
    owner
}
