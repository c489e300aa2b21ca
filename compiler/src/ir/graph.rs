//! The IR graph: a petgraph `StableGraph` of primitive ops. Edges run from operand to user
//! and carry the operand's position.

use super::dim::{Sym, BATCH};
use super::op::{Op, OpKind};
use super::ops::OpClass;
use super::types::{DType, TensorType};
use crate::diag::Span;
use petgraph::stable_graph::{NodeIndex, StableGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};
use petgraph::Direction;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

/// Which part of a training step a node belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Phase {
    Forward,
    Backward,
    Update,
}

#[derive(Debug, Clone)]
pub struct Node {
    pub op: Op,
    pub ty: TensorType,
    pub phase: Phase,
    /// The layer it came from, as a dotted path (`h.3.att.q`).
    pub layer: String,
    /// Where that layer is written in the file.
    pub span: Option<Span>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Symbol {
    pub name: String,
    /// The size used for cost and memory estimates (the batch uses the training batch).
    pub nominal: u64,
}

#[derive(Debug, Clone)]
pub struct Graph {
    pub g: StableGraph<Node, u16>,
    pub inputs: Vec<NodeIndex>,
    pub outputs: Vec<(String, NodeIndex)>,
    pub symbols: Vec<Symbol>,
    /// The symbols' names, for messages (kept with `symbols` by `add_symbol`).
    names: Vec<String>,
    /// Layers as the user wrote them, counted after expanding repeats.
    pub layers: usize,
    /// Each trainable parameter and its gradient (after autodiff).
    pub grads: Vec<(NodeIndex, NodeIndex)>,
    /// Persistent values (parameters, optimizer state) and what replaces them at the end of a
    /// step (after the optimizer pass).
    pub updates: Vec<(NodeIndex, NodeIndex)>,
    /// What autodiff differentiates when it is not the `loss` output: a sharded plan's own
    /// weighted share of the loss (its `loss` output is the sum over every shard).
    pub objective: Option<NodeIndex>,
    /// Parameters that are one tensor-parallel rank's slice of a layer's, and the axis the
    /// slices are cut along.
    pub param_splits: Vec<(NodeIndex, usize)>,
    /// Parameters whose files (`--init`, `final.safetensors`, checkpoints) hold another shape
    /// than the graph's, and that shape: PyTorch's, the same elements in the same order (a
    /// Conv2d bias is `[C]` in PyTorch, `[C, 1, 1]` here so that it broadcasts over `H, W`).
    pub file_shapes: Vec<(NodeIndex, Vec<u64>)>,
    /// The pipeline stage of each node (after the `pipeline` pass; none: one stage).
    pub stages: Option<HashMap<NodeIndex, u32>>,
    /// The data-parallel rank that alone computes (or holds) a node (after the `zero` pass;
    /// absent: every rank).
    pub owners: HashMap<NodeIndex, u32>,
    /// The phase new nodes are added in.
    pub phase: Phase,
    /// Kernels in execution order (after the fuse pass).
    pub kernels: Vec<super::Kernel>,
    /// Buffers and memory (after the schedule pass).
    pub schedule: Option<super::BufferSchedule>,
    /// Values computed in f32 but stored in bf16 (after the `storage` pass).
    pub bf16_stored: std::collections::BTreeSet<NodeIndex>,
}

impl Default for Graph {
    fn default() -> Self {
        Self::new()
    }
}

impl Graph {
    pub fn new() -> Graph {
        Graph {
            g: StableGraph::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            symbols: vec![Symbol {
                name: "B".into(),
                nominal: 1,
            }],
            names: vec!["B".into()],
            layers: 0,
            grads: Vec::new(),
            updates: Vec::new(),
            objective: None,
            param_splits: Vec::new(),
            file_shapes: Vec::new(),
            stages: None,
            owners: HashMap::new(),
            phase: Phase::Forward,
            kernels: Vec::new(),
            schedule: None,
            bf16_stored: Default::default(),
        }
    }

    pub fn add_symbol(&mut self, name: &str, nominal: u64) -> Sym {
        self.symbols.push(Symbol {
            name: name.into(),
            nominal,
        });
        self.names.push(name.into());
        Sym(self.symbols.len() as u32 - 1)
    }

    pub fn sym_names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// The symbols' names, by index.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Adds a node, its type inferred by the op table. The error is the shape rule's.
    pub fn add(
        &mut self,
        op: Op,
        operands: &[NodeIndex],
        layer: &str,
        span: Option<Span>,
    ) -> Result<NodeIndex, String> {
        let tys: Vec<&TensorType> = operands.iter().map(|&o| &self.g[o].ty).collect();
        let ty = op.infer(&tys, &self.names)?;
        let is_input = op.kind() == OpKind::Input;
        let n = self.g.add_node(Node {
            op,
            ty,
            phase: self.phase,
            layer: layer.to_string(),
            span,
        });
        for (i, &o) in operands.iter().enumerate() {
            self.g.add_edge(o, n, i as u16);
        }
        if is_input {
            self.inputs.push(n);
        }
        Ok(n)
    }

    /// The scalar f32 input `name`, added the first time it is asked for (the runtime feeds
    /// it every step: the learning rate, a shard's share of the batch).
    pub fn scalar_input(&mut self, name: &str, layer: &str) -> Result<NodeIndex, String> {
        let found = self
            .inputs
            .iter()
            .copied()
            .find(|&n| matches!(&self.g[n].op, Op::Input { name: k, .. } if k == name));
        match found {
            Some(n) => Ok(n),
            None => {
                let ty = TensorType::scalar(DType::F32);
                let name = name.to_string();
                self.add(Op::Input { name, ty }, &[], layer, None)
            }
        }
    }

    /// The graph's `training` flag, added the first time it is asked for.
    pub fn training(&mut self, layer: &str) -> Result<NodeIndex, String> {
        match self
            .g
            .node_indices()
            .find(|&n| self.g[n].op == Op::Training)
        {
            Some(n) => Ok(n),
            None => self.add(Op::Training, &[], layer, None),
        }
    }

    /// A node's operands, in order.
    pub fn operands(&self, n: NodeIndex) -> Vec<NodeIndex> {
        let mut e: Vec<(u16, NodeIndex)> = self
            .g
            .edges_directed(n, Direction::Incoming)
            .map(|e| (*e.weight(), e.source()))
            .collect();
        e.sort();
        e.into_iter().map(|(_, s)| s).collect()
    }

    pub fn users(&self, n: NodeIndex) -> Vec<NodeIndex> {
        let mut u: Vec<NodeIndex> = self.g.neighbors_directed(n, Direction::Outgoing).collect();
        u.sort();
        u.dedup();
        u
    }

    /// A topological order, ties broken by creation order so it is stable; `None` on a cycle.
    /// A collective goes as soon as its operand is ready, so a gradient's all-reduce starts
    /// while the rest of the backward pass still runs.
    pub fn topo_order(&self) -> Option<Vec<NodeIndex>> {
        let key = |n: NodeIndex| {
            let late = self.g[n].op.def().class != OpClass::Collective;
            Reverse((late, n))
        };
        let mut indeg: Vec<usize> = vec![0; self.g.node_bound()];
        for e in self.g.edge_references() {
            indeg[e.target().index()] += 1;
        }
        let mut ready: BinaryHeap<Reverse<(bool, NodeIndex)>> = self
            .g
            .node_indices()
            .filter(|n| indeg[n.index()] == 0)
            .map(key)
            .collect();
        let mut order = Vec::with_capacity(self.g.node_count());
        while let Some(Reverse((_, n))) = ready.pop() {
            order.push(n);
            for e in self.g.edges_directed(n, Direction::Outgoing) {
                let t = e.target();
                indeg[t.index()] -= 1;
                if indeg[t.index()] == 0 {
                    ready.push(key(t));
                }
            }
        }
        (order.len() == self.g.node_count()).then_some(order)
    }

    /// Parameter nodes, in creation order.
    pub fn params(&self) -> Vec<NodeIndex> {
        self.g
            .node_indices()
            .filter(|&n| self.g[n].op.kind() == OpKind::Param)
            .collect()
    }

    /// Trainable parameter count (exact; parameters never have symbolic sizes).
    pub fn parameter_count(&self) -> u128 {
        self.params()
            .iter()
            .map(|&p| {
                self.g[p]
                    .ty
                    .shape
                    .iter()
                    .fold(1u128, |a, d| a.saturating_mul(d.factor as u128))
            })
            .sum()
    }

    /// The value of each symbol for estimates, with the batch set to `batch`.
    pub fn sym_value(&self, batch: u64) -> impl Fn(Sym) -> u64 + '_ {
        move |s| {
            if s == BATCH {
                batch
            } else {
                self.symbols.get(s.0 as usize).map_or(1, |x| x.nominal)
            }
        }
    }

    /// FLOPs of one execution of the nodes of `phase` at batch size `batch`, by the op
    /// table's cost rules.
    pub fn flops(&self, batch: u64, phase: Phase) -> u128 {
        self.g
            .node_indices()
            .filter(|&n| self.g[n].phase == phase)
            .map(|n| self.node_flops(n, batch) as u128)
            .sum()
    }

    /// FLOPs of one execution of node `n` at batch size `batch`.
    pub fn node_flops(&self, n: NodeIndex, batch: u64) -> u64 {
        let value = self.sym_value(batch);
        let node = &self.g[n];
        let ins: Vec<Vec<u64>> = self
            .operands(n)
            .iter()
            .map(|&o| self.g[o].ty.concrete(&value))
            .collect();
        let out = node.ty.concrete(&value);
        (node.op.def().flops)(&node.op, &ins, &out)
    }

    /// The element type `n`'s value is stored in: bf16 where the `storage` pass chose it,
    /// else its own.
    pub fn stored_dtype(&self, n: NodeIndex) -> super::DType {
        if self.bf16_stored.contains(&n) {
            super::DType::BF16
        } else {
            self.g[n].ty.dtype
        }
    }

    /// Each op's kernel, by index in `kernels` (after the fuse pass; sources are in none).
    pub fn kernel_of(&self) -> HashMap<NodeIndex, usize> {
        self.kernels
            .iter()
            .enumerate()
            .flat_map(|(k, kern)| kern.nodes.iter().map(move |&n| (n, k)))
            .collect()
    }

    /// Where a node runs: its pipeline stage and ZeRO owner (`None`: no stages, every rank).
    pub fn place(&self, n: NodeIndex) -> (Option<u32>, Option<u32>) {
        let stage = self.stages.as_ref().and_then(|s| s.get(&n).copied());
        (stage, self.owners.get(&n).copied())
    }

    /// The outputs that are a cross-entropy's logits (and no gradient or update): an eval
    /// step reads them after its forward kernels and nothing reads them after a training
    /// step, so the schedule keeps them through the last forward kernel only and their
    /// gradient may be written over them (`Plan::kept_after_training`).
    pub fn outputs_kept_through_forward(&self) -> HashSet<NodeIndex> {
        let other_roots: HashSet<NodeIndex> = self
            .grads
            .iter()
            .map(|(_, n)| *n)
            .chain(self.updates.iter().map(|(_, n)| *n))
            .collect();
        self.outputs
            .iter()
            .map(|(_, n)| *n)
            .filter(|&n| !other_roots.contains(&n) && !self.g[n].op.is_source())
            .filter(|&n| {
                self.g.edges_directed(n, Direction::Outgoing).any(|e| {
                    *e.weight() == 0 && matches!(self.g[e.target()].op, Op::CrossEntropyGrad { .. })
                })
            })
            .collect()
    }

    /// The last kernel an eval step runs (by the phase of its last node, as the runtime's
    /// modes decide), or 0.
    pub fn last_forward_kernel(&self) -> usize {
        self.kernels
            .iter()
            .rposition(|k| {
                k.nodes
                    .last()
                    .is_some_and(|&n| self.g[n].phase == Phase::Forward)
            })
            .unwrap_or(0)
    }

    /// Whether a kernel of `nodes` may write its result over an operand row by row: a
    /// cross-entropy's gradient alone reads each row whole (its maximum and sum) before
    /// writing any of it, and each element before its write (as llm.c does); a norm's
    /// gradient and the add after it (`KernelKind::NormGradAdd`) read each element of the
    /// add's other operand just before writing the sum there; a cache write replaces the
    /// rows at its position and reads no other row of the cache.
    pub fn rewrites_rows_in_place(&self, nodes: &[NodeIndex]) -> bool {
        match nodes {
            [n] => matches!(self.g[*n].op, Op::CrossEntropyGrad { .. } | Op::CacheWrite),
            [ng, add] => {
                matches!(
                    self.g[*ng].op,
                    Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. }
                ) && self.g[*add].op == Op::Add
            }
            _ => false,
        }
    }

    /// Every node that must survive dead-code removal: outputs, gradients, updates.
    pub fn roots(&self) -> Vec<NodeIndex> {
        let mut r: Vec<NodeIndex> = self.outputs.iter().map(|(_, n)| *n).collect();
        r.extend(self.grads.iter().map(|(_, g)| *g));
        r.extend(self.updates.iter().map(|(_, u)| *u));
        r
    }

    /// Redirects every reference to `old` (edges, outputs, gradients, updates) to `new`.
    /// Makes `new` operand `slot` of `user`.
    pub fn replace_operand(&mut self, user: NodeIndex, slot: usize, new: NodeIndex) {
        let edge = self
            .g
            .edges_directed(user, Direction::Incoming)
            .find(|e| usize::from(*e.weight()) == slot)
            .map(|e| e.id());
        if let Some(e) = edge {
            self.g.remove_edge(e);
        }
        self.g.add_edge(new, user, slot as u16);
    }

    pub fn replace_uses(&mut self, old: NodeIndex, new: NodeIndex) {
        let uses: Vec<(NodeIndex, u16)> = self
            .g
            .edges_directed(old, Direction::Outgoing)
            .map(|e| (e.target(), *e.weight()))
            .collect();
        for (user, slot) in uses {
            if let Some(e) = self.g.find_edge(old, user) {
                self.g.remove_edge(e);
            }
            self.g.add_edge(new, user, slot);
        }
        let swap = |n: &mut NodeIndex| {
            if *n == old {
                *n = new;
            }
        };
        self.outputs.iter_mut().for_each(|(_, n)| swap(n));
        self.grads.iter_mut().for_each(|(_, n)| swap(n));
        self.updates.iter_mut().for_each(|(_, n)| swap(n));
    }
}
