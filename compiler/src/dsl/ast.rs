//! The experiment file, as serde reads it. Every section parses here; semantic checks live
//! in `validate` (sections) and the `lower` pass (the model).

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::fmt;

pub use super::settings::*;

/// A size or count as written: an integer, or an expression over the parameters.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum DimExpr {
    Int(i64),
    Expr(String),
}

impl DimExpr {
    pub fn text(&self) -> String {
        match self {
            DimExpr::Int(n) => n.to_string(),
            DimExpr::Expr(s) => s.clone(),
        }
    }
}

impl From<i64> for DimExpr {
    fn from(n: i64) -> Self {
        DimExpr::Int(n)
    }
}

impl<'de> Deserialize<'de> for DimExpr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = DimExpr;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer size or a size expression in quotes, e.g. \"d * 4\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<DimExpr, E> {
                Ok(DimExpr::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<DimExpr, E> {
                i64::try_from(v)
                    .map(DimExpr::Int)
                    .map_err(|_| E::custom(format!("{v} is far too large for a size")))
            }
            fn visit_i128<E: de::Error>(self, v: i128) -> Result<DimExpr, E> {
                Err(E::custom(format!("{v} is far too large for a size")))
            }
            fn visit_u128<E: de::Error>(self, v: u128) -> Result<DimExpr, E> {
                Err(E::custom(format!("{v} is far too large for a size")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<DimExpr, E> {
                // An integer literal too large for 64 bits reaches us as a float.
                if v.is_finite() && v.fract() == 0.0 && v.abs() >= 9.2e18 {
                    return Err(E::custom(format!("{v:e} is far too large for a size")));
                }
                Err(E::custom(format!(
                    "expected an integer size, found the number {v}"
                )))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<DimExpr, E> {
                Ok(DimExpr::Expr(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A map that refuses duplicate keys (a silently dropped entry is lost data), in file order.
#[derive(Debug, Clone, PartialEq)]
pub struct UniqueMap<V>(pub Vec<(String, V)>);

impl<V: Serialize> Serialize for UniqueMap<V> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl<V> Default for UniqueMap<V> {
    fn default() -> Self {
        UniqueMap(Vec::new())
    }
}

impl<V> UniqueMap<V> {
    pub fn get(&self, k: &str) -> Option<&V> {
        self.0.iter().find(|(n, _)| n == k).map(|(_, v)| v)
    }
    pub fn keys(&self) -> impl Iterator<Item = &str> + Clone {
        self.0.iter().map(|(k, _)| k.as_str())
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for UniqueMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MV<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for MV<V> {
            type Value = UniqueMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map such as { \"name\": value }")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out: Vec<(String, V)> = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    if out.iter().any(|(n, _)| *n == k) {
                        return Err(de::Error::custom(format!(
                            "duplicate key `{k}`: each name may appear once"
                        )));
                    }
                    let v = m.next_value()?;
                    out.push((k, v));
                }
                Ok(UniqueMap(out))
            }
        }
        d.deserialize_map(MV(std::marker::PhantomData))
    }
}

pub type Params = UniqueMap<DimExpr>;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Experiment {
    pub name: String,
    #[serde(default)]
    pub params: Params,
    pub model: Model,
    pub loss: Loss,
    pub data: Data,
    pub optimizer: Optimizer,
    pub train: Train,
    #[serde(default)]
    pub devices: Devices,
}

/// Element types are the IR's: one enum, read from files as written in them.
pub use crate::ir::DType;

fn f32_dtype() -> DType {
    DType::F32
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct InputSpec {
    /// The shape of one sample; the batch dimension is implicit.
    pub shape: Vec<DimExpr>,
    #[serde(default = "f32_dtype")]
    pub dtype: DType,
}

/// `(name, layer, [inputs])`
pub type NodeDecl = (String, Layer, Vec<String>);

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub enum Model {
    Sequential {
        #[serde(default)]
        params: Params,
        /// Symbolic dimensions with the size used for cost estimates, e.g. `{"seq": 128}`.
        #[serde(default)]
        symbols: Params,
        input: InputSpec,
        layers: Vec<Layer>,
    },
    Graph {
        #[serde(default)]
        params: Params,
        #[serde(default)]
        symbols: Params,
        inputs: UniqueMap<InputSpec>,
        #[serde(default)]
        blocks: UniqueMap<Vec<NodeDecl>>,
        nodes: Vec<NodeDecl>,
        /// The model's outputs; the last node when absent. The loss reads the first.
        #[serde(default)]
        outputs: Option<Vec<String>>,
    },
}

pub(super) fn yes() -> bool {
    true
}
fn one() -> DimExpr {
    DimExpr::Int(1)
}
fn zero() -> DimExpr {
    DimExpr::Int(0)
}
pub(super) fn minus_one() -> i64 {
    -1
}
fn eps_norm() -> f64 {
    1e-5
}
fn eps_rms() -> f64 {
    1e-6
}
fn bn_momentum() -> f64 {
    0.1
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum Activation {
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
    Silu,
    Relu6,
}

fn is_false(b: &bool) -> bool {
    !b
}

fn gelu() -> Activation {
    Activation::Gelu
}

/// The layers a model is written with. Each lowers to primitive ops in `passes::lower`.
/// Axes count the dimensions of one sample (the batch is not counted), negative from the end.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub enum Layer {
    Linear {
        out: DimExpr,
        #[serde(default = "yes")]
        bias: bool,
    },
    Conv2d {
        out: DimExpr,
        kernel: DimExpr,
        #[serde(default = "one")]
        stride: DimExpr,
        #[serde(default = "zero")]
        padding: DimExpr,
        #[serde(default = "one")]
        groups: DimExpr,
        #[serde(default = "yes")]
        bias: bool,
    },
    MaxPool2d {
        kernel: DimExpr,
        #[serde(default)]
        stride: Option<DimExpr>,
        #[serde(default = "zero")]
        padding: DimExpr,
    },
    AvgPool2d {
        kernel: DimExpr,
        #[serde(default)]
        stride: Option<DimExpr>,
        #[serde(default = "zero")]
        padding: DimExpr,
    },
    Flatten,
    Reshape(Vec<DimExpr>),
    Transpose(i64, i64),
    Permute(Vec<i64>),
    Concat {
        #[serde(default = "minus_one")]
        axis: i64,
    },
    Add,
    Mul,
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
    Silu,
    /// `min(max(x, 0), 6)`, as PyTorch's `nn.ReLU6`.
    Relu6,
    Softmax {
        #[serde(default = "minus_one")]
        axis: i64,
    },
    LayerNorm {
        #[serde(default = "eps_norm")]
        eps: f64,
        #[serde(default = "yes")]
        affine: bool,
    },
    RmsNorm {
        #[serde(default = "eps_rms")]
        eps: f64,
        #[serde(default = "yes")]
        affine: bool,
    },
    BatchNorm2d {
        #[serde(default = "eps_norm")]
        eps: f64,
        #[serde(default = "bn_momentum")]
        momentum: f64,
        #[serde(default = "yes")]
        affine: bool,
    },
    Embedding {
        vocab: DimExpr,
        dim: DimExpr,
    },
    /// Learned positions added to a `[seq, dim]` input.
    PositionalEmbedding {
        max_len: DimExpr,
    },
    Dropout(f64),
    /// Multi-head self-attention over a `[seq, dim]` input.
    Attention {
        heads: DimExpr,
        #[serde(default)]
        causal: bool,
        #[serde(default = "yes")]
        bias: bool,
    },
    /// Linear to `hidden`, activation, Linear back to the input's width (`fc1`, `fc2`).
    /// Gated (SwiGLU with `act: Silu`, as LLaMA): `down_proj(act(gate_proj(x)) * up_proj(x))`.
    Mlp {
        hidden: DimExpr,
        #[serde(default = "gelu")]
        act: Activation,
        #[serde(default = "yes")]
        bias: bool,
        /// Written out only when set, so ungated experiments keep their text (and run ids).
        #[serde(default, skip_serializing_if = "is_false")]
        gated: bool,
    },
    /// A named block of the graph, `times` copies in a row; `args` override parameters.
    Repeat {
        block: String,
        #[serde(default = "one")]
        times: DimExpr,
        #[serde(default)]
        args: Params,
    },
}

impl Layer {
    /// The variant's name as written in files.
    pub fn kind(&self) -> &'static str {
        match self {
            Layer::Linear { .. } => "Linear",
            Layer::Conv2d { .. } => "Conv2d",
            Layer::MaxPool2d { .. } => "MaxPool2d",
            Layer::AvgPool2d { .. } => "AvgPool2d",
            Layer::Flatten => "Flatten",
            Layer::Reshape(_) => "Reshape",
            Layer::Transpose(..) => "Transpose",
            Layer::Permute(_) => "Permute",
            Layer::Concat { .. } => "Concat",
            Layer::Add => "Add",
            Layer::Mul => "Mul",
            Layer::Relu => "Relu",
            Layer::Gelu => "Gelu",
            Layer::Tanh => "Tanh",
            Layer::Sigmoid => "Sigmoid",
            Layer::Silu => "Silu",
            Layer::Relu6 => "Relu6",
            Layer::Softmax { .. } => "Softmax",
            Layer::LayerNorm { .. } => "LayerNorm",
            Layer::RmsNorm { .. } => "RmsNorm",
            Layer::BatchNorm2d { .. } => "BatchNorm2d",
            Layer::Embedding { .. } => "Embedding",
            Layer::PositionalEmbedding { .. } => "PositionalEmbedding",
            Layer::Dropout(_) => "Dropout",
            Layer::Attention { .. } => "Attention",
            Layer::Mlp { .. } => "Mlp",
            Layer::Repeat { .. } => "Repeat",
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub enum Loss {
    /// Cross-entropy over integer class labels (the last axis of the output holds the classes).
    CrossEntropy {
        #[serde(default)]
        label_smoothing: f64,
        #[serde(default)]
        output: Option<String>,
    },
    /// Mean squared error against a target of the output's shape.
    Mse {
        #[serde(default)]
        output: Option<String>,
    },
}

/// Variants whose settings are all optional, so they may be written bare (`LayerNorm`).
pub const BARE_OK: &[&str] = &[
    "Concat",
    "Softmax",
    "LayerNorm",
    "RmsNorm",
    "BatchNorm2d",
    "CrossEntropy",
    "Mse",
    "Digits",
    "Cosine",
    "Linear",
];

/// Device kinds the cost model knows.
pub const DEVICE_KINDS: &[&str] = &["h100", "h200", "a100-80gb", "a100-40gb", "l4", "cpu"];
