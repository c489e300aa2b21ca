//! Kernels: the fuse pass's grouping of the graph's ops, in execution order. An annotation of
//! the graph (like its stages and owners) that the plan carries to every backend.

use super::{NodeIndex, OpKind};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KernelKind {
    /// One op.
    Single,
    /// A chain of elementwise ops.
    Elementwise,
    /// Elementwise ops ending in a reduction. Before a layer or RMS norm the chain's last
    /// value may also be stored (a residual stream): one pass computes, stores and normalizes it.
    ElementwiseReduce,
    /// A matmul, then optionally a bias add and an activation.
    Gemm {
        bias: bool,
        activation: Option<OpKind>,
    },
    /// `Attention` and the `AttentionLse` of the same queries and keys, in one pass over
    /// the keys (or either alone).
    Attention,
    /// The gradients of one attention's inputs (`AttentionGrad` by `Query`, `Key` and
    /// `Value`, two or three of them) from one recomputation of its probabilities.
    AttentionGrads,
    /// `members` kernels that do the same ops to different tensors (each parameter's
    /// update, or its squared norm when `reduce`), run as one launch over all of them (the
    /// group pass). Their nodes are concatenated, member by member, equally many each; each
    /// member alone is an `Elementwise` kernel (`Single` if one op), or with `reduce` an
    /// `ElementwiseReduce` summing everything.
    Grouped { members: u32, reduce: bool },
    /// A layer or RMS norm's gradient, then an `add` of it and another value of its shape
    /// (the residual stream's gradient), row by row; the norm's gradient is not stored.
    NormGradAdd,
}

#[derive(Debug, Clone)]
pub struct Kernel {
    pub kind: KernelKind,
    /// In execution order; the last is the kernel's main result.
    pub nodes: Vec<NodeIndex>,
}

impl KernelKind {
    /// A short name for the IR text: `elementwise`, `gemm+bias+gelu`, ...
    pub fn name(&self) -> String {
        match self {
            KernelKind::Single => "single".into(),
            KernelKind::Elementwise => "elementwise".into(),
            KernelKind::ElementwiseReduce => "elementwise+reduce".into(),
            KernelKind::Attention => "attention".into(),
            KernelKind::AttentionGrads => "attention_grads".into(),
            KernelKind::Grouped { members, reduce } => {
                let of = if *reduce {
                    "elementwise+reduce"
                } else {
                    "elementwise"
                };
                format!("grouped({members}x{of})")
            }
            KernelKind::NormGradAdd => "norm_grad+add".into(),
            KernelKind::Gemm { bias, activation } => {
                let mut s = String::from("gemm");
                if *bias {
                    s.push_str("+bias");
                }
                if let Some(a) = activation {
                    s.push('+');
                    s.push_str(&format!("{a:?}").to_lowercase());
                }
                s
            }
        }
    }
}

/// The members of a kernel of `kind` over `nodes` (plan steps or graph nodes): each member's
/// kind as a kernel of its own and its share of `nodes`; a kernel that is not grouped is its
/// own one member.
pub fn members_of<T>(kind: KernelKind, nodes: &[T]) -> impl Iterator<Item = (KernelKind, &[T])> {
    // Runs every training step (the CPU executor), so it collects nothing.
    let (per, reduce) = match kind {
        KernelKind::Grouped { members, reduce } => {
            (nodes.len() / (members.max(1) as usize), Some(reduce))
        }
        _ => (nodes.len(), None),
    };
    nodes.chunks(per.max(1)).map(move |m| {
        let kind = match (reduce, m.len()) {
            (None, _) => kind,
            (Some(true), _) => KernelKind::ElementwiseReduce,
            (Some(false), 1) => KernelKind::Single,
            (Some(false), _) => KernelKind::Elementwise,
        };
        (kind, m)
    })
}

impl Kernel {
    /// See `members_of`.
    pub fn members(&self) -> Vec<(KernelKind, &[NodeIndex])> {
        members_of(self.kind, &self.nodes).collect()
    }
}
