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
    /// Elementwise ops ending in a reduction.
    ElementwiseReduce,
    /// A matmul, then optionally a bias add and an activation.
    Gemm {
        bias: bool,
        activation: Option<OpKind>,
    },
}

#[derive(Debug, Clone)]
pub struct Kernel {
    pub kind: KernelKind,
    /// In execution order; the last is the kernel's main result.
    pub nodes: Vec<NodeIndex>,
}
