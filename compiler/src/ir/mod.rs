//! The intermediate representation: primitive ops (the op table), tensor types, the graph,
//! its printers and its verifier.

pub mod dim;
pub mod graph;
pub mod ops;
pub mod print;
pub mod types;
pub mod verify;

pub use dim::{Dim, Sym};
pub use graph::{Graph, Node};
pub use ops::{Init, Op, OpKind, OPS};
pub use petgraph::stable_graph::NodeIndex;
pub use types::{DType, TensorType};
