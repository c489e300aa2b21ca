//! Per-layer aggregates of a compiled training graph, computed once per model: what the cost
//! model needs of each top-level layer group (`emb`, each repeated block instance `h.3`,
//! `logits`, `loss`), split into the part tensor parallelism divides and the part it
//! replicates. Repeated blocks are costed once (instance 0) and shared by every instance, so
//! the planner's work does not grow with depth beyond one entry per instance.

use crate::ir::dim::BATCH;
use crate::ir::{DType, Graph, NodeIndex, OpKind, Phase};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// A quantity with a part divided by the tensor-parallel degree and a replicated part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Split {
    pub split: f64,
    pub replicated: f64,
}

impl Split {
    /// Per device at tensor-parallel degree `tp`.
    pub fn at(self, tp: u32) -> f64 {
        self.split / tp as f64 + self.replicated
    }
    fn add(&mut self, split: bool, v: f64) {
        if split {
            self.split += v
        } else {
            self.replicated += v
        }
    }
    pub fn total(self) -> f64 {
        self.split + self.replicated
    }
}

impl std::ops::AddAssign for Split {
    fn add_assign(&mut self, o: Split) {
        self.split += o.split;
        self.replicated += o.replicated;
    }
}

/// One layer group's costs. Per-sample quantities are at the symbols' nominal sizes.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GroupCost {
    /// GEMM and convolution FLOPs per sample, forward and backward.
    pub matmul_flops: Split,
    /// Bytes the other ops read and write per sample, forward and backward (unfused: an upper
    /// bound on their memory traffic).
    pub traffic_bytes: Split,
    /// Parameter bytes.
    pub param_bytes: Split,
    /// Forward values read by the backward pass, per sample: kept from forward to backward.
    pub saved_bytes: Split,
    /// The largest single value per sample: with its gradient, the working set on top of the
    /// saved values while the group runs backward.
    pub largest_value_bytes: Split,
    /// The group's forward output per sample: what a pipeline stage boundary sends.
    pub output_bytes: f64,
    /// Tensor-parallel all-reduces per forward pass (as many again in backward) and the bytes
    /// of each per sample.
    pub tp_allreduces: u32,
    pub tp_allreduce_bytes: f64,
    /// Kernels launched per micro-batch, forward and backward (after fusion): a floor on the
    /// group's time when its work is too small to hide the launches.
    pub kernels: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct Group {
    /// `emb`, `h.3`, `logits`.
    pub name: String,
    /// The repeat a block instance belongs to (`h`).
    pub block: Option<String>,
    /// Index into [`ModelCost::costs`]: every instance of a repeat shares one.
    pub cost: usize,
}

/// What the planner knows of one model, computed once.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCost {
    pub name: String,
    /// The global batch (`train.batch_size`).
    pub batch: u64,
    /// In forward order; the loss group (if any) last.
    pub groups: Vec<Group>,
    pub costs: Vec<GroupCost>,
    /// Attention heads (the smallest over the model's attention layers); tensor parallelism is
    /// offered only when there are heads to split.
    pub heads: Option<u64>,
    /// Repeated block instances (the pipeline can have at most this many stages, or as many as
    /// there are groups with parameters when nothing repeats).
    pub blocks: usize,
    pub param_bytes: u64,
    pub optimizer_state_bytes: u64,
    /// Inputs: bytes per sample (tokens, labels) and bytes that do not scale with the batch
    /// (the learning rate).
    pub input_bytes_per_sample: u64,
    pub input_bytes_fixed: u64,
    /// Matmuls run at this precision's rate: `tf32` for an fp32 plan (cuBLAS with TF32 tensor
    /// cores allowed, as PyTorch's default for convolutions), `bf16` when parameters are bf16
    /// or activations are stored in bf16 (the products multiply bf16 weight copies).
    pub precision: &'static str,
    /// Kernels of the optimizer update (the same count however the state is sharded).
    pub update_kernels: u32,
}

impl ModelCost {
    pub fn cost(&self, g: usize) -> &GroupCost {
        &self.costs[self.groups[g].cost]
    }

    /// Bytes of optimizer state per parameter byte (2 for Adam, 1 for momentum).
    pub fn state_ratio(&self) -> f64 {
        if self.param_bytes == 0 {
            0.0
        } else {
            self.optimizer_state_bytes as f64 / self.param_bytes as f64
        }
    }
}

/// `h.3.att.q` -> (`h.3`, Some(`h`), 3, `att.q`); `emb` -> (`emb`, None, 0, ``).
fn split_layer(layer: &str) -> (&str, Option<(&str, u64)>, &str) {
    let mut parts = layer.splitn(3, '.');
    let first = parts.next().unwrap_or("");
    match parts.next() {
        Some(second) if second.parse::<u64>().is_ok() => {
            let group_len = first.len() + 1 + second.len();
            let rest = parts.next().unwrap_or("");
            (
                &layer[..group_len],
                Some((first, second.parse().unwrap_or(0))),
                rest,
            )
        }
        Some(_) => (first, None, &layer[first.len() + 1..]),
        None => (first, None, ""),
    }
}

/// How a node's cost divides under Megatron-style tensor parallelism.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Tp {
    /// LayerNorm, residuals, embeddings: every tensor-parallel rank computes it whole.
    Replicated,
    /// Column-parallel Linears (attention q/k/v, MLP fc1), attention scores and heads, the MLP
    /// hidden activation, vocab-parallel logits and cross-entropy.
    Split,
    /// Row-parallel Linears (attention out, MLP fc2): the GEMM and weight are split, the bias
    /// and the output (after the all-reduce) are whole.
    Row,
}

/// The tensor-parallel units of one group: attention layers (`p.q`, `p.k`, `p.v`, `p.out`)
/// and MLPs (`p.fc1`, `p.fc2`), by their relative paths.
struct Units {
    column: HashSet<String>,
    inner: HashSet<String>,
    row: HashSet<String>,
}

impl Units {
    fn of(paths: &HashSet<&str>) -> Units {
        let mut u = Units {
            column: HashSet::new(),
            inner: HashSet::new(),
            row: HashSet::new(),
        };
        let join = |p: &str, s: &str| {
            if p.is_empty() {
                s.to_string()
            } else {
                format!("{p}.{s}")
            }
        };
        for &p in paths {
            let attention = ["q", "k", "v", "out"]
                .iter()
                .all(|s| paths.contains(join(p, s).as_str()));
            let mlp = ["fc1", "fc2"]
                .iter()
                .all(|s| paths.contains(join(p, s).as_str()));
            if attention {
                u.inner.insert(p.to_string());
                for s in ["q", "k", "v"] {
                    u.column.insert(join(p, s));
                }
                u.row.insert(join(p, "out"));
            }
            if mlp {
                u.inner.insert(p.to_string());
                u.column.insert(join(p, "fc1"));
                u.row.insert(join(p, "fc2"));
            }
            // A gated Mlp (SwiGLU): gate and up by columns, down by rows.
            let gated = ["gate_proj", "up_proj", "down_proj"]
                .iter()
                .all(|s| paths.contains(join(p, s).as_str()));
            if gated {
                u.inner.insert(p.to_string());
                u.column.insert(join(p, "gate_proj"));
                u.column.insert(join(p, "up_proj"));
                u.row.insert(join(p, "down_proj"));
            }
        }
        u
    }

    fn class(&self, rel: &str) -> Tp {
        if self.row.contains(rel) {
            Tp::Row
        } else if self.column.contains(rel) || self.inner.contains(rel) {
            Tp::Split
        } else {
            Tp::Replicated
        }
    }
}

/// Products, timed at the GEMM rate: matmuls, convolutions, and attention (its products
/// run on the same units; its softmax is a small part of its FLOPs).
fn is_matmul(k: OpKind) -> bool {
    matches!(
        k,
        OpKind::MatMul
            | OpKind::Conv2d
            | OpKind::Conv2dGradInput
            | OpKind::Conv2dGradWeight
            | OpKind::Attention
            | OpKind::AttentionLse
            | OpKind::AttentionGrad
    )
}

/// Aggregates the compiled training graph `g` (after autodiff and the optimizer pass) for the
/// planner, at global batch `batch`.
pub fn model_cost(g: &Graph, name: &str, batch: u64) -> ModelCost {
    let one = g.sym_value(1);
    let numel = |n: NodeIndex| -> f64 {
        g.g[n]
            .ty
            .shape
            .iter()
            .map(|d| d.eval(&one) as f64)
            .product::<f64>()
    };
    // Activations count at the bytes they are stored in (bf16 when the plan keeps them so).
    let bf16_activations = !g.bf16_stored.is_empty();
    let bytes = |n: NodeIndex| {
        let dtype = if bf16_activations && crate::ir::storage::stored_in_bf16(g, n) {
            DType::BF16
        } else {
            g.g[n].ty.dtype
        };
        numel(n) * dtype.bytes() as f64
    };
    let per_sample = |n: NodeIndex| g.g[n].ty.shape.iter().any(|d| d.syms.contains(&BATCH));

    // Groups in forward order (node creation order follows the model), and which nodes are
    // costed: all of a plain group, instance 0 of a repeat.
    let mut order: Vec<String> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut block_of: HashMap<String, (String, u64)> = HashMap::new();
    let mut costed: HashMap<String, Vec<NodeIndex>> = HashMap::new();
    let (mut param_bytes, mut state_bytes) = (0u64, 0u64);
    let (mut input_sample, mut input_fixed) = (0u64, 0u64);
    let mut bf16 = false;
    for n in g.g.node_indices() {
        let node = &g.g[n];
        let b = bytes(n) as u64;
        match node.op.kind() {
            OpKind::Param => {
                param_bytes += b;
                bf16 |= node.ty.dtype == DType::BF16;
            }
            OpKind::State => state_bytes += b,
            OpKind::Input if per_sample(n) => input_sample += b,
            OpKind::Input => input_fixed += b,
            _ => {}
        }
        if node.layer.is_empty() || node.layer == "optimizer" || node.phase == Phase::Update {
            continue;
        }
        let (group, repeat, _) = split_layer(&node.layer);
        if !index.contains_key(group) && node.phase == Phase::Forward {
            index.insert(group.to_string(), order.len());
            order.push(group.to_string());
            if let Some((r, i)) = repeat {
                block_of.insert(group.to_string(), (r.to_string(), i));
            }
        }
        if repeat.is_none_or(|(_, i)| i == 0) {
            costed.entry(group.to_string()).or_default().push(n);
        }
    }
    // The loss group runs last whatever its creation order.
    if let Some(i) = order.iter().position(|g| g == crate::plan::LOSS) {
        let l = order.remove(i);
        order.push(l);
    }

    // Kernels per group (fused kernels when the fuse pass ran, else one per op), counted
    // where the group is costed.
    let mut kernels: HashMap<&str, u32> = HashMap::new();
    let firsts: Vec<NodeIndex> = if g.kernels.is_empty() {
        g.g.node_indices()
            .filter(|&n| !g.g[n].op.is_source())
            .collect()
    } else {
        g.kernels
            .iter()
            .filter_map(|k| k.nodes.last().copied())
            .collect()
    };
    let mut update_kernels = 0u32;
    for n in firsts {
        let node = &g.g[n];
        if node.phase == Phase::Update {
            update_kernels += 1;
            continue;
        }
        if node.layer.is_empty() {
            continue;
        }
        let (group, repeat, _) = split_layer(&node.layer);
        if repeat.is_none_or(|(_, i)| i == 0) {
            *kernels.entry(group).or_default() += 1;
        }
    }

    let mut heads: Option<u64> = None;
    let mut cost_of: HashMap<String, usize> = HashMap::new();
    let mut costs: Vec<GroupCost> = Vec::new();
    let last_linear = order
        .iter()
        .rev()
        .find(|name| name.as_str() != crate::plan::LOSS)
        .cloned();
    let mut groups = Vec::with_capacity(order.len());
    for name in &order {
        let block = block_of.get(name).cloned();
        // Instances of a repeat share instance 0's cost.
        let key = match &block {
            Some((r, _)) => format!("{r}.0"),
            None => name.clone(),
        };
        if let Some(&c) = cost_of.get(&key) {
            groups.push(Group {
                name: name.clone(),
                block: block.map(|b| b.0),
                cost: c,
            });
            continue;
        }
        let nodes = costed.get(&key).map(Vec::as_slice).unwrap_or(&[]);
        let prefix_len = key.len();
        let rel = |n: NodeIndex| -> &str {
            let l = g.g[n].layer.as_str();
            if l.len() > prefix_len {
                &l[prefix_len + 1..]
            } else {
                ""
            }
        };
        let paths: HashSet<&str> = nodes.iter().map(|&n| rel(n)).collect();
        let units = Units::of(&paths);
        let has_units = !units.inner.is_empty();
        // Vocab-parallel logits and cross-entropy: the last Linear and the loss split by vocab.
        let has_weight = nodes
            .iter()
            .any(|&n| g.g[n].op.kind() == OpKind::Param && g.g[n].ty.shape.len() == 2);
        let vocab_parallel = name == crate::plan::LOSS
            || (Some(name) == last_linear.as_ref() && has_weight && !has_units);
        let mut c = GroupCost::default();
        let mut last_forward: Option<NodeIndex> = None;
        for &n in nodes {
            let node = &g.g[n];
            let kind = node.op.kind();
            let class = if vocab_parallel {
                Tp::Split
            } else {
                units.class(rel(n))
            };
            if kind == OpKind::Param {
                // A row-parallel Linear splits its weight, not its bias.
                let split = class == Tp::Split || (class == Tp::Row && node.ty.shape.len() > 1);
                c.param_bytes.add(split, bytes(n));
                continue;
            }
            if node.op.is_source() {
                continue;
            }
            if node.phase == Phase::Forward {
                last_forward = Some(n);
                if inner_reshape_heads(g, n, &units, rel(n)) {
                    let h = node.ty.shape[2].eval(&one);
                    heads = Some(heads.map_or(h, |x| x.min(h)));
                }
            }
            let ins: Vec<Vec<u64>> = g
                .operands(n)
                .iter()
                .map(|&o| g.g[o].ty.concrete(&one))
                .collect();
            let out = node.ty.concrete(&one);
            let flops = (node.op.def().flops)(&node.op, &ins, &out) as f64;
            let split = class != Tp::Replicated;
            if is_matmul(kind) {
                // Weight-gradient GEMMs have no batch axis in their output, but their work
                // scales with the batch as the others' does.
                c.matmul_flops.add(split, flops);
            } else if kind != OpKind::Reshape {
                let traffic = bytes(n)
                    + g.operands(n)
                        .iter()
                        .filter(|&&o| per_sample(o))
                        .map(|&o| bytes(o))
                        .sum::<f64>();
                let split = class == Tp::Split;
                c.traffic_bytes
                    .add(split, if per_sample(n) { traffic } else { 0.0 });
            }
            if node.phase == Phase::Forward && per_sample(n) {
                let split = class == Tp::Split;
                let saved =
                    g.g.neighbors_directed(n, Direction::Outgoing)
                        .any(|u| g.g[u].phase == Phase::Backward);
                if saved {
                    c.saved_bytes.add(split, bytes(n));
                }
                // A cross-entropy's logits take their gradient in their own buffer (the
                // schedule writes it over them): the pair counts once in the working set.
                let over = g.g.edges_directed(n, Direction::Outgoing).any(|e| {
                    *e.weight() == 0 && g.g[e.target()].op.kind() == OpKind::CrossEntropyGrad
                });
                let b = if over { bytes(n) / 2.0 } else { bytes(n) };
                let cur = c.largest_value_bytes.at(1);
                if b > cur {
                    c.largest_value_bytes = Split::default();
                    c.largest_value_bytes.add(split, b);
                }
                if class == Tp::Row && is_matmul(kind) && has_units {
                    c.tp_allreduces += 1;
                    c.tp_allreduce_bytes = c.tp_allreduce_bytes.max(b);
                }
            }
        }
        if let Some(n) = last_forward {
            c.output_bytes = bytes(n);
        }
        c.kernels = kernels.get(key.as_str()).copied().unwrap_or(0);
        cost_of.insert(key, costs.len());
        groups.push(Group {
            name: name.clone(),
            block: block.map(|b| b.0),
            cost: costs.len(),
        });
        costs.push(c);
    }
    let blocks = groups.iter().filter(|g| g.block.is_some()).count();
    ModelCost {
        name: name.to_string(),
        batch,
        groups,
        costs,
        heads,
        blocks,
        param_bytes,
        optimizer_state_bytes: state_bytes,
        input_bytes_per_sample: input_sample,
        input_bytes_fixed: input_fixed,
        precision: if bf16 || bf16_activations {
            "bf16"
        } else {
            "tf32"
        },
        update_kernels,
    }
}

/// An attention's head split: the 4-D reshape `[B, seq, heads, d/heads]` inside the unit.
fn inner_reshape_heads(g: &Graph, n: NodeIndex, units: &Units, rel: &str) -> bool {
    let node = &g.g[n];
    node.op.kind() == OpKind::Reshape
        && node.ty.shape.len() == 4
        && units.inner.contains(rel)
        && units.column.contains(&if rel.is_empty() {
            "q".to_string()
        } else {
            format!("{rel}.q")
        })
}
