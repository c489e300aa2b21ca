//! The intermediate representation: primitive ops (the op table and its shape, cost and VJP
//! rules), tensor types, the graph, its kernels and buffers, its printers and its verifier.

pub mod attention;
pub mod attrs;
pub mod buffers;
pub mod cost;
pub mod dim;
pub mod graph;
pub mod kernels;
pub mod maps;
pub mod op;
pub mod ops;
pub mod print;
pub mod shape_rules;
pub mod storage;
pub mod types;
pub mod verify;
pub mod vjp;

pub use buffers::{Buffer, BufferSchedule, Memory};
pub use dim::{Dim, Sym};
pub use graph::{Graph, Node, Phase};
pub use kernels::{Kernel, KernelKind};
pub use op::{AttentionInput, Group, Init, Op, OpKind};
pub use ops::OPS;
pub use petgraph::stable_graph::NodeIndex;
pub use types::{DType, TensorType};
