//! The op table: a row per op of `op.rs`'s list, in `OpKind` order, with its rule columns
//! resolved here: shape (`shape_rules.rs`, `attention.rs`), cost (`cost.rs`), VJP (`vjp.rs`)
//! and, for a plain elementwise map, its backend columns (`maps.rs`: CPU function and vector
//! loop, f64 reference, PTX body, epilogue flag). Each row's rule columns destructure the op
//! once, into its attribute struct (`attrs.rs`), and call the rules with it. Layers
//! (`dsl::ast::Layer`) lower into these ops in `passes::lower`; `passes::autodiff` builds the
//! backward graph from the VJP column alone.

use super::attention::*;
use super::attrs;
use super::cost::*;
use super::maps::{self, Binary, Elementwise, Map, Unary};
pub use super::op::{elementwise_examples, Op, OpKind, OP_COUNT};
use super::shape_rules::*;
use super::types::TensorType;
use super::vjp::{self, Grads, Vjp, VjpRule};
use petgraph::stable_graph::NodeIndex;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum Arity {
    Exactly(usize),
}

impl Arity {
    pub fn accepts(self, n: usize) -> bool {
        match self {
            Arity::Exactly(k) => n == k,
        }
    }
}

/// What kind of kernel an op becomes; the fuse pass groups by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum OpClass {
    Source,
    Gemm,
    Conv,
    Elementwise,
    /// Reduces along an axis (softmax, norms, sums, losses, pooling).
    Reduction,
    /// Moves data without arithmetic.
    Layout,
    /// Communicates between devices: a kernel of its own, run by the collective library.
    Collective,
    /// Products and a softmax over tiles of keys: attention and its gradients.
    Attention,
}

/// Infers the output type; `names` names the symbols for messages. A row's is made from its
/// entry: the op's attributes taken out of it, given to the entry's shape rule.
pub type ShapeRule = fn(&Op, &[&TensorType], &[String]) -> Result<TensorType, String>;
/// FLOPs of one execution, from concrete operand and output sizes (made as `ShapeRule`).
pub type CostRule = fn(&Op, &[Vec<u64>], &[u64]) -> u64;

pub struct OpDef {
    pub kind: OpKind,
    pub name: &'static str,
    pub arity: Arity,
    pub class: OpClass,
    pub shape: ShapeRule,
    pub flops: CostRule,
    /// The vector-Jacobian product: the gradients of the operands from the output's.
    pub vjp: VjpRule,
    /// Whether it has a gradient rule (ops of backward and update graphs have `vjp::none`).
    pub has_vjp: bool,
    /// A plain elementwise map's backend columns (`maps`): CPU, f64 reference, PTX.
    pub map: Option<&'static Map>,
    /// The attribute a unary map takes as its `p` (the entry's `map maps::ROW { field }`; 0
    /// without one).
    pub map_param: fn(&Op) -> f64,
}

/// The attributes of the op a row's rule is called on: always the row's own (`Op::def`).
fn own<A>(attrs: Option<A>) -> A {
    attrs.expect("a row's rules are called on its own op")
}

/// The entries of `op.rs` made into the table's rows: each rule column a function that takes
/// the op's attributes out of it (`attrs::X::of`) and calls the entry's rule with them.
macro_rules! table {
    ($($doc:tt $op:ident $fields:tt $name:literal $arity:literal $class:ident $shape:tt
        $flops:tt $vjp:tt [$($map:tt $({ $param:ident })?)?] $example:tt $attrs:tt;)*) => {
        /// The table, in `OpKind` order.
        pub static OPS: [OpDef; OP_COUNT] = [$(OpDef {
            kind: OpKind::$op,
            name: $name,
            arity: Arity::Exactly($arity),
            class: OpClass::$class,
            shape: {
                fn shape(
                    op: &Op,
                    x: &[&TensorType],
                    names: &[String],
                ) -> Result<TensorType, String> {
                    $shape(own(attrs::$op::of(op)), x, names)
                }
                shape
            },
            flops: {
                fn flops(op: &Op, ins: &[Vec<u64>], out: &[u64]) -> u64 {
                    $flops(own(attrs::$op::of(op)), ins, out)
                }
                flops
            },
            vjp: {
                fn vjp(v: &mut dyn Vjp, n: NodeIndex, ins: &[NodeIndex], dy: NodeIndex) -> Grads {
                    let op = v.op(n);
                    vjp::$vjp(own(attrs::$op::of(&op)), v, n, ins, dy)
                }
                vjp
            },
            has_vjp: table!(@has_vjp $vjp),
            map: table!(@map $($map)?),
            map_param: table!(@param $op $($($param)?)?),
        },)*];
    };
    (@has_vjp none) => {
        false
    };
    (@has_vjp $vjp:ident) => {
        true
    };
    (@map) => {
        None
    };
    (@map $map:tt) => {
        Some(&$map)
    };
    (@param $op:ident) => {{
        fn param(_: &Op) -> f64 {
            0.0
        }
        param
    }};
    (@param $op:ident $param:ident) => {{
        fn param(op: &Op) -> f64 {
            let attrs::$op { $param, .. } = own(attrs::$op::of(op));
            *$param
        }
        param
    }};
}

crate::__parallax_ops!(table);

impl Op {
    pub fn def(&self) -> &'static OpDef {
        &OPS[self.kind() as usize]
    }

    /// Whether the op is a source (no operands; its value comes from outside or persists).
    pub fn is_source(&self) -> bool {
        self.def().class == OpClass::Source
    }

    /// The op's type for these operands, by its table row (arity checked first).
    pub fn infer(&self, operands: &[&TensorType], names: &[String]) -> Result<TensorType, String> {
        let def = self.def();
        if !def.arity.accepts(operands.len()) {
            let Arity::Exactly(k) = def.arity;
            return Err(format!(
                "{} takes {k} operand(s), got {}",
                def.name,
                operands.len()
            ));
        }
        (def.shape)(self, operands, names)
    }

    /// The op's map, if it is a plain elementwise map (dropout is not).
    pub fn map(&self) -> Option<Elementwise> {
        Some(match self.def().map? {
            Map::Unary(m) => Elementwise::Unary(Unary {
                map: m,
                p: (self.def().map_param)(self) as f32,
            }),
            Map::Binary(m) => Elementwise::Binary(Binary(m)),
        })
    }
}

impl Unary {
    /// `op`'s map, if it is a unary one.
    pub fn of(op: &Op) -> Option<Unary> {
        match op.map()? {
            Elementwise::Unary(u) => Some(u),
            Elementwise::Binary(_) => None,
        }
    }
}

impl Binary {
    /// `op`'s map, if it is a binary one.
    pub fn of(op: &Op) -> Option<Binary> {
        match op.map()? {
            Elementwise::Binary(b) => Some(b),
            Elementwise::Unary(_) => None,
        }
    }
}

#[cfg(test)]
#[path = "ops_tests.rs"]
mod tests;
