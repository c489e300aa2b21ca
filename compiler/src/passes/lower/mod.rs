//! Lowering: the experiment's model and loss become primitive ops. Layers size their
//! parameters from their input's shape (as PyTorch's lazy modules do), using the op table's
//! shape rules as they go, so a mismatch is caught at the layer that causes it.

mod batch_norm;
mod blocks;
mod decode;
mod layers;
mod loss;
mod models;

pub use batch_norm::is_running_statistic;
pub use decode::is_cache;

use super::Ctx;
use crate::diag::{suggest, Diagnostic, Span};
use crate::dsl::ast::{Activation, Data, DimExpr, InputSpec, Layer, Loss, Model, NodeDecl, Params};
use crate::dsl::expr::{eval_int, eval_size, Evaluator, ExprError};
use crate::dsl::spans::Path;
use crate::dsl::Source;
use crate::ir::dim::{product, Dim, MAX_DIM};
use crate::ir::{DType, Graph, Group, Init, Op, TensorType};
use crate::path;
use crate::Error;
use petgraph::stable_graph::NodeIndex;
use std::collections::HashMap;

/// Layer instances after expanding repeats; beyond this a model is refused, not built.
pub const MAX_LAYERS: usize = 100_000;
/// Primitive ops in one graph.
pub const MAX_NODES: usize = 2_000_000;
/// Elements in one parameter tensor (2^40: 4 TiB in f32).
pub const MAX_PARAM_ELEMENTS: u64 = 1 << 40;
/// Nesting of blocks repeating blocks.
pub const MAX_BLOCK_DEPTH: usize = 32;

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    let mut l = Lowerer {
        src: ctx.source,
        g: Graph::new(),
        scopes: Vec::new(),
        dropout_streams: 0,
        block_stack: Vec::new(),
        tensor_parallel: u64::from(ctx.options.tensor_parallel.unwrap_or(1)).max(1),
        sharded: ctx.options.shards.is_some(),
        decode: ctx.options.decode.map(|_| decode::Decode::default()),
    };
    l.experiment()?;
    *g = l.g;
    Ok(())
}

type Scope = Vec<(String, Dim)>;

struct Lowerer<'a> {
    src: &'a Source,
    g: Graph,
    /// Parameter bindings, innermost last (block `args` push a scope).
    scopes: Vec<Scope>,
    dropout_streams: u64,
    block_stack: Vec<String>,
    /// Tensor-parallel degree: Attention and Mlp layers split their weights this many ways.
    tensor_parallel: u64,
    /// The plan is built per micro-shard (`crate::shards`): BatchNorm's statistics are sums
    /// all-reduced over every shard.
    sharded: bool,
    /// Lowering the decode step (`Options::decode`): one token per sample, key/value caches.
    decode: Option<decode::Decode>,
}

/// How a tensor-parallel Linear splits its weight `[out, in]` (Megatron-LM).
#[derive(Clone, Copy)]
enum Split {
    /// By output features: each rank computes a slice of the output.
    Column,
    /// By input features: each rank multiplies its slice of the input, then the partial
    /// products are summed across ranks.
    Row,
}

fn model_err(msg: impl Into<String>, span: Option<Span>) -> Error {
    Error::Model(Diagnostic::new(msg, span))
}

impl Lowerer<'_> {
    // ---- locations and expressions ----

    fn span(&self, p: &Path) -> Option<Span> {
        self.src.span(p)
    }
    fn head(&self, p: &Path) -> Option<Span> {
        self.src.head(p)
    }
    fn err(&self, p: &Path, msg: impl Into<String>) -> Error {
        model_err(msg, self.head(p))
    }

    fn lookup(&self, name: &str) -> Option<Dim> {
        self.scopes.iter().rev().find_map(|s| {
            s.iter()
                .rev()
                .find(|(n, _)| n == name)
                .map(|(_, d)| d.clone())
        })
    }

    fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .scopes
            .iter()
            .flat_map(|s| s.iter().map(|(n, _)| n.clone()))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// An expression error, pointed at the spot inside the quoted expression.
    fn expr_err(&self, p: &Path, text: &str, e: ExprError) -> Error {
        let span = self.span(p).map(|s| {
            let written = &self.src.text[s.start..s.end];
            match written.rfind(text) {
                Some(i) if !text.is_empty() => {
                    Span::new(s.start + i + e.at.0, s.start + i + e.at.1.max(e.at.0 + 1))
                }
                _ => s,
            }
        });
        Error::Model(Diagnostic::new(e.message, span).hint_opt(e.hint))
    }

    fn eval_with<T>(&self, e: &DimExpr, p: &Path, f: Evaluator<T>) -> Result<T, Error> {
        let text = e.text();
        f(&text, &|n| self.lookup(n), &|| self.names()).map_err(|err| {
            let t = match e {
                DimExpr::Int(_) => String::new(),
                DimExpr::Expr(s) => s.clone(),
            };
            self.expr_err(p, &t, err)
        })
    }

    /// A positive size, possibly symbolic.
    fn size(&self, e: &DimExpr, p: &Path, what: &str) -> Result<Dim, Error> {
        if let DimExpr::Int(n) = e {
            if *n <= 0 {
                return Err(model_err(
                    format!("{what} must be positive, got {n}"),
                    self.span(p),
                ));
            }
        }
        self.eval_with(e, p, eval_size)
    }

    /// A positive size that must be known at compile time.
    fn known(&self, e: &DimExpr, p: &Path, what: &str) -> Result<u64, Error> {
        let d = self.size(e, p, what)?;
        d.as_known().ok_or_else(|| {
            model_err(
                format!(
                    "{what} must be a known size, but `{}` is symbolic",
                    e.text()
                ),
                self.span(p),
            )
        })
    }

    /// A known integer that may be zero (padding).
    fn non_negative(&self, e: &DimExpr, p: &Path, what: &str) -> Result<u64, Error> {
        let v = self.eval_with(e, p, eval_int)?;
        if v < 0 || v as u64 > MAX_DIM {
            return Err(model_err(
                format!("{what} must be between 0 and {MAX_DIM}, got {v}"),
                self.span(p),
            ));
        }
        Ok(v as u64)
    }

    /// Binds parameters in file order; each may use those before it.
    fn bind(&mut self, params: &Params, base: &Path) -> Result<(), Error> {
        for (name, value) in &params.0 {
            let p = base.join(name.as_str());
            if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || c == '_') {
                return Err(self.err(&p, format!("`{name}` is not a valid parameter name")));
            }
            let d = self.size(value, &p, &format!("the parameter `{name}`"))?;
            self.scopes
                .last_mut()
                .expect("a scope")
                .push((name.clone(), d));
        }
        Ok(())
    }

    // ---- graph building ----

    fn add(
        &mut self,
        op: Op,
        ins: &[NodeIndex],
        layer: &str,
        span: Option<Span>,
    ) -> Result<NodeIndex, Error> {
        if self.g.g.node_count() >= MAX_NODES {
            return Err(model_err(
                format!("the model has more than {MAX_NODES} primitive ops"),
                span,
            ));
        }
        self.g
            .add(op, ins, layer, span)
            .map_err(|msg| model_err(format!("in layer `{layer}`: {msg}"), span))
    }

    fn param(
        &mut self,
        layer: &str,
        what: &str,
        shape: &[u64],
        init: Init,
        span: Option<Span>,
    ) -> Result<NodeIndex, Error> {
        let elements = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= MAX_PARAM_ELEMENTS);
        if elements.is_none() {
            return Err(model_err(
                format!(
                    "in layer `{layer}`: the parameter `{what}` of shape {shape:?} is too large (more than 2^40 elements)"
                ),
                span,
            ));
        }
        let name = if layer.is_empty() {
            what.to_string()
        } else {
            format!("{layer}.{what}")
        };
        let ty = TensorType::f32(shape.iter().map(|&d| Dim::known(d)).collect());
        self.add(Op::Param { name, ty, init }, &[], layer, span)
    }

    fn ty(&self, n: NodeIndex) -> &TensorType {
        &self.g.g[n].ty
    }

    fn show(&self, n: NodeIndex) -> String {
        self.ty(n).show(&self.g.sym_names())
    }

    /// The last axis, which must be a known size.
    fn features(
        &self,
        x: NodeIndex,
        layer: &str,
        kind: &str,
        span: Option<Span>,
    ) -> Result<u64, Error> {
        let t = self.ty(x);
        if t.rank() < 2 {
            return Err(model_err(
                format!(
                    "{kind} `{layer}` needs features after the batch, got {}",
                    self.show(x)
                ),
                span,
            ));
        }
        t.shape[t.rank() - 1].as_known().ok_or_else(|| {
            model_err(
                format!(
                    "{kind} `{layer}` needs a known last dimension, got {}",
                    self.show(x)
                ),
                span,
            )
        })
    }

    /// An axis of one sample (batch not counted; negative from the end) as a tensor axis.
    fn axis(&self, x: NodeIndex, axis: i64, p: &Path) -> Result<usize, Error> {
        let rank = self.ty(x).rank() as i64;
        let sample_rank = rank - 1;
        let a = if axis < 0 { axis + sample_rank } else { axis };
        if a < 0 || a >= sample_rank {
            return Err(model_err(
                format!(
                    "axis {axis} is out of range for a sample of rank {sample_rank} ({})",
                    self.show(x)
                ),
                self.span(p),
            ));
        }
        Ok(a as usize + 1)
    }

    fn linear(
        &mut self,
        x: NodeIndex,
        out: u64,
        bias: bool,
        layer: &str,
        span: Option<Span>,
    ) -> Result<NodeIndex, Error> {
        let k = self.features(x, layer, "Linear", span)?;
        let bound = 1.0 / (k as f64).sqrt();
        // Weights are [out, in] as in PyTorch, so parameter files carry over unchanged.
        let w = self.param(layer, "weight", &[out, k], Init::Uniform { bound }, span)?;
        let mut y = self.add(
            Op::MatMul {
                trans_a: false,
                trans_b: true,
            },
            &[x, w],
            layer,
            span,
        )?;
        if bias {
            let b = self.param(layer, "bias", &[out], Init::Uniform { bound }, span)?;
            y = self.add(Op::Add, &[y, b], layer, span)?;
        }
        Ok(y)
    }

    /// A Linear layer's share on one tensor-parallel rank, its weights a slice of the whole
    /// layer's (initialised as the whole, then sliced, so any degree starts from the same
    /// numbers).
    fn linear_split(
        &mut self,
        x: NodeIndex,
        out: u64,
        bias: bool,
        split: Split,
        layer: &str,
        span: Option<Span>,
    ) -> Result<NodeIndex, Error> {
        let t = self.tensor_parallel;
        let k = self.features(x, layer, "Linear", span)?;
        let (shape, axis, full_in) = match split {
            Split::Column => ([out / t, k], 0, k),
            Split::Row => ([out, k], 1, k * t),
        };
        let bound = 1.0 / (full_in as f64).sqrt();
        let w = self.param(layer, "weight", &shape, Init::Uniform { bound }, span)?;
        self.g.param_splits.push((w, axis));
        let mm = Op::MatMul {
            trans_a: false,
            trans_b: true,
        };
        let mut y = self.add(mm, &[x, w], layer, span)?;
        if let Split::Row = split {
            let tensor = Op::AllReduce {
                group: Group::Tensor,
            };
            y = self.add(tensor, &[y], layer, span)?;
        }
        if bias {
            let local = if let Split::Column = split {
                out / t
            } else {
                out
            };
            let b = self.param(layer, "bias", &[local], Init::Uniform { bound }, span)?;
            if let Split::Column = split {
                self.g.param_splits.push((b, 0));
            }
            y = self.add(Op::Add, &[y, b], layer, span)?;
        }
        Ok(y)
    }

    /// Checks that `what` (heads, hidden features) splits over the tensor-parallel ranks.
    fn splits(&self, n: u64, what: &str, name: &str, span: Option<Span>) -> Result<(), Error> {
        let t = self.tensor_parallel;
        if n.is_multiple_of(t) {
            return Ok(());
        }
        Err(model_err(
            format!("`{name}`: {n} {what} do not split over {t} tensor-parallel ranks"),
            span,
        )
        .with_hint_model(format!("choose a tensor-parallel degree that divides {n}")))
    }

    fn activation(
        &mut self,
        x: NodeIndex,
        act: Activation,
        layer: &str,
        span: Option<Span>,
    ) -> Result<NodeIndex, Error> {
        let op = match act {
            Activation::Relu => Op::Relu,
            Activation::Gelu => Op::Gelu,
            Activation::Tanh => Op::Tanh,
            Activation::Sigmoid => Op::Sigmoid,
            Activation::Silu => Op::Silu,
            Activation::Relu6 => Op::Relu6,
        };
        self.add(op, &[x], layer, span)
    }

    fn reshape(
        &mut self,
        x: NodeIndex,
        shape: Vec<Dim>,
        layer: &str,
        span: Option<Span>,
    ) -> Result<NodeIndex, Error> {
        self.add(Op::Reshape { shape }, &[x], layer, span)
    }

    fn permute(
        &mut self,
        x: NodeIndex,
        perm: Vec<usize>,
        layer: &str,
        span: Option<Span>,
    ) -> Result<NodeIndex, Error> {
        self.add(Op::Permute { perm }, &[x], layer, span)
    }

    fn norm_eps(&self, eps: f64, p: &Path) -> Result<f64, Error> {
        if eps.is_finite() && eps > 0.0 && eps < 1.0 {
            Ok(eps)
        } else {
            Err(model_err(
                format!("`eps` must be in (0, 1), got {eps}"),
                self.span(&p.join("eps")),
            ))
        }
    }

    fn needs_rank(
        &self,
        x: NodeIndex,
        rank: usize,
        what: &str,
        layer: &str,
        kind: &str,
        span: Option<Span>,
    ) -> Result<(), Error> {
        if self.ty(x).rank() != rank {
            return Err(model_err(
                format!(
                    "{kind} `{layer}` expects {what} per sample, got {}",
                    self.show(x)
                ),
                span,
            ));
        }
        Ok(())
    }

    fn pool_params(
        &self,
        kernel: &DimExpr,
        stride: &Option<DimExpr>,
        padding: &DimExpr,
        p: &Path,
    ) -> Result<(u64, u64, u64), Error> {
        let k = self.known(kernel, &p.join("kernel"), "`kernel`")?;
        let s = match stride {
            Some(s) => self.known(s, &p.join("stride"), "`stride`")?,
            None => k,
        };
        let pad = self.non_negative(padding, &p.join("padding"), "`padding`")?;
        Ok((k, s, pad))
    }
}

trait WithHint {
    fn with_hint_model(self, hint: impl Into<String>) -> Self;
}

impl WithHint for Error {
    fn with_hint_model(self, hint: impl Into<String>) -> Self {
        match self {
            Error::Model(d) => Error::Model(d.with_hint(hint)),
            other => other,
        }
    }
}
