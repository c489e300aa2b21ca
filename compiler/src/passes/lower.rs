//! Lowering: the experiment's model and loss become primitive ops. Layers size their
//! parameters from their input's shape (as PyTorch's lazy modules do), using the op table's
//! shape rules as they go, so a mismatch is caught at the layer that causes it.

use super::batch_norm::BatchNorm;
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

    // ---- layers ----

    /// Lowers one layer applied to `ins`. `p` is where the layer is written.
    fn layer(
        &mut self,
        layer: &Layer,
        ins: &[NodeIndex],
        name: &str,
        p: &Path,
    ) -> Result<NodeIndex, Error> {
        let kind = layer.kind();
        let span = self.head(p);
        let multi = matches!(layer, Layer::Add | Layer::Mul | Layer::Concat { .. });
        if multi && ins.len() < 2 {
            return Err(model_err(
                format!("{kind} `{name}` needs at least 2 inputs, got {}", ins.len()),
                span,
            )
            .with_hint_model("list its inputs in a Graph model: (\"sum\", Add, [\"a\", \"b\"])"));
        }
        if !multi && ins.len() != 1 {
            return Err(model_err(
                format!("{kind} `{name}` takes 1 input, got {}", ins.len()),
                span,
            ));
        }
        if !matches!(layer, Layer::Repeat { .. }) {
            self.g.layers += 1;
            if self.g.layers > MAX_LAYERS {
                return Err(model_err(
                    format!("the model has more than {MAX_LAYERS} layers"),
                    span,
                ));
            }
        }
        let x = ins[0];
        match layer {
            Layer::Linear { out, bias } => {
                let out = self.known(out, &p.join("out"), "`out`")?;
                self.linear(x, out, *bias, name, span)
            }
            Layer::Conv2d {
                out,
                kernel,
                stride,
                padding,
                groups,
                bias,
            } => {
                self.needs_rank(x, 4, "an image [C, H, W]", name, kind, span)?;
                let o = self.known(out, &p.join("out"), "`out`")?;
                let k = self.known(kernel, &p.join("kernel"), "`kernel`")?;
                let s = self.known(stride, &p.join("stride"), "`stride`")?;
                let pad = self.non_negative(padding, &p.join("padding"), "`padding`")?;
                let g = self.known(groups, &p.join("groups"), "`groups`")?;
                let c = self.ty(x).shape[1].as_known().ok_or_else(|| {
                    model_err(format!("Conv2d `{name}` needs a known channel count"), span)
                })?;
                if c % g != 0 || o % g != 0 {
                    return Err(model_err(
                        format!(
                            "Conv2d `{name}`: {c} input and {o} output channels do not split into {g} groups"
                        ),
                        self.span(&p.join("groups")),
                    ));
                }
                // Saturating: a huge kernel is refused by `param` below, not by an overflow.
                let fan_in = (c / g).saturating_mul(k).saturating_mul(k);
                let bound = 1.0 / (fan_in as f64).sqrt();
                let w = self.param(
                    name,
                    "weight",
                    &[o, c / g, k, k],
                    Init::Uniform { bound },
                    span,
                )?;
                let mut y = self.add(
                    Op::Conv2d {
                        stride: s,
                        padding: pad,
                        groups: g,
                    },
                    &[x, w],
                    name,
                    span,
                )?;
                if *bias {
                    let b = self.param(name, "bias", &[o, 1, 1], Init::Uniform { bound }, span)?;
                    y = self.add(Op::Add, &[y, b], name, span)?;
                }
                Ok(y)
            }
            Layer::MaxPool2d {
                kernel,
                stride,
                padding,
            }
            | Layer::AvgPool2d {
                kernel,
                stride,
                padding,
            } => {
                self.needs_rank(x, 4, "an image [C, H, W]", name, kind, span)?;
                let (k, s, pad) = self.pool_params(kernel, stride, padding, p)?;
                let max = matches!(layer, Layer::MaxPool2d { .. });
                self.add(
                    Op::Pool2d {
                        max,
                        kernel: k,
                        stride: s,
                        padding: pad,
                    },
                    &[x],
                    name,
                    span,
                )
            }
            Layer::Flatten => {
                let t = self.ty(x);
                let rest =
                    product(&t.shape[1..]).ok_or_else(|| model_err("size overflow", span))?;
                let shape = vec![t.shape[0].clone(), rest];
                self.reshape(x, shape, name, span)
            }
            Layer::Reshape(dims) => {
                let t = self.ty(x).clone();
                let total =
                    product(&t.shape[1..]).ok_or_else(|| model_err("size overflow", span))?;
                let mut shape = vec![t.shape[0].clone()];
                let mut infer_at = None;
                for (i, d) in dims.iter().enumerate() {
                    if *d == DimExpr::Int(-1) {
                        if infer_at.replace(i + 1).is_some() {
                            return Err(model_err(
                                "only one dimension of a Reshape may be -1",
                                self.span(&p.join(i)),
                            ));
                        }
                        shape.push(Dim::known(1));
                    } else {
                        shape.push(self.size(d, &p.join(i), "a Reshape dimension")?);
                    }
                }
                if let Some(i) = infer_at {
                    let known =
                        product(&shape[1..]).ok_or_else(|| model_err("size overflow", span))?;
                    shape[i] = total.div_exact(&known).ok_or_else(|| {
                        model_err(
                            format!(
                                "Reshape `{name}`: {} elements per sample do not divide into {:?}",
                                total.show(&self.g.sym_names()),
                                dims.iter().map(|d| d.text()).collect::<Vec<_>>()
                            ),
                            span,
                        )
                    })?;
                }
                self.reshape(x, shape, name, span)
            }
            Layer::Transpose(a, b) => {
                let a = self.axis(x, *a, p)?;
                let b = self.axis(x, *b, p)?;
                let mut perm: Vec<usize> = (0..self.ty(x).rank()).collect();
                perm.swap(a, b);
                self.permute(x, perm, name, span)
            }
            Layer::Permute(axes) => {
                let sample_rank = self.ty(x).rank() - 1;
                let mut perm = vec![0];
                for &a in axes {
                    perm.push(self.axis(x, a, p)?);
                }
                let mut sorted = perm.clone();
                sorted.sort();
                if perm.len() != sample_rank + 1 || sorted.windows(2).any(|w| w[0] == w[1]) {
                    return Err(model_err(
                        format!(
                            "Permute `{name}`: {axes:?} is not a permutation of the {sample_rank} axes of a sample ({})",
                            self.show(x)
                        ),
                        span,
                    ));
                }
                self.permute(x, perm, name, span)
            }
            Layer::Concat { axis } => {
                let a = self.axis(x, *axis, p)?;
                let mut y = x;
                for &other in &ins[1..] {
                    y = self.add(Op::Concat { axis: a }, &[y, other], name, span)?;
                }
                Ok(y)
            }
            Layer::Add | Layer::Mul => {
                let op = if matches!(layer, Layer::Add) {
                    Op::Add
                } else {
                    Op::Mul
                };
                let mut y = x;
                for &other in &ins[1..] {
                    y = self.add(op.clone(), &[y, other], name, span)?;
                }
                Ok(y)
            }
            Layer::Relu => self.activation(x, Activation::Relu, name, span),
            Layer::Gelu => self.activation(x, Activation::Gelu, name, span),
            Layer::Tanh => self.activation(x, Activation::Tanh, name, span),
            Layer::Sigmoid => self.activation(x, Activation::Sigmoid, name, span),
            Layer::Softmax { axis } => {
                let a = self.axis(x, *axis, p)?;
                let last = self.ty(x).rank() - 1;
                if a == last {
                    return self.add(Op::Softmax { causal: false }, &[x], name, span);
                }
                let mut perm: Vec<usize> = (0..=last).collect();
                perm.swap(a, last);
                let t = self.permute(x, perm.clone(), name, span)?;
                let s = self.add(Op::Softmax { causal: false }, &[t], name, span)?;
                self.permute(s, perm, name, span)
            }
            Layer::LayerNorm { eps, affine } | Layer::RmsNorm { eps, affine } => {
                let eps = self.norm_eps(*eps, p)?;
                let d = self.features(x, name, kind, span)?;
                let rms = matches!(layer, Layer::RmsNorm { .. });
                let op = if rms {
                    Op::RmsNorm { eps }
                } else {
                    Op::LayerNorm { eps }
                };
                let mut y = self.add(op, &[x], name, span)?;
                if *affine {
                    let w = self.param(name, "weight", &[d], Init::Ones, span)?;
                    y = self.add(Op::Mul, &[y, w], name, span)?;
                    if !rms {
                        let b = self.param(name, "bias", &[d], Init::Zeros, span)?;
                        y = self.add(Op::Add, &[y, b], name, span)?;
                    }
                }
                Ok(y)
            }
            Layer::BatchNorm2d {
                eps,
                momentum,
                affine,
            } => {
                let eps = self.norm_eps(*eps, p)?;
                if !(*momentum > 0.0 && *momentum <= 1.0) {
                    return Err(model_err(
                        format!("`momentum` must be in (0, 1], got {momentum}"),
                        self.span(&p.join("momentum")),
                    ));
                }
                self.needs_rank(x, 4, "an image [C, H, W]", name, kind, span)?;
                let known = |i: usize| self.ty(x).shape[i].as_known();
                let spatial = known(2).zip(known(3)).and_then(|(h, w)| h.checked_mul(w));
                let (Some(c), Some(spatial)) = (known(1), spatial) else {
                    return Err(model_err(
                        format!(
                            "BatchNorm2d `{name}` needs a known channel count and image size, got {}",
                            self.show(x)
                        ),
                        span,
                    ));
                };
                let bn = BatchNorm {
                    eps,
                    momentum: *momentum,
                    channels: c,
                    spatial,
                    sharded: self.sharded,
                };
                let mut y = bn
                    .lower(&mut self.g, x, name, span)
                    .map_err(|m| model_err(format!("in layer `{name}`: {m}"), span))?;
                if *affine {
                    let w = self.param(name, "weight", &[c, 1, 1], Init::Ones, span)?;
                    let b = self.param(name, "bias", &[c, 1, 1], Init::Zeros, span)?;
                    y = self.add(Op::Mul, &[y, w], name, span)?;
                    y = self.add(Op::Add, &[y, b], name, span)?;
                }
                Ok(y)
            }
            Layer::Embedding { vocab, dim } => {
                let v = self.known(vocab, &p.join("vocab"), "`vocab`")?;
                let d = self.known(dim, &p.join("dim"), "`dim`")?;
                if self.ty(x).dtype.is_float() {
                    return Err(model_err(
                        format!(
                            "Embedding `{name}` needs integer token ids, got {}",
                            self.show(x)
                        ),
                        span,
                    )
                    .with_hint_model("declare the input with `dtype: I32`"));
                }
                let table = self.param(name, "weight", &[v, d], Init::Normal { std: 1.0 }, span)?;
                self.add(Op::Gather, &[table, x], name, span)
            }
            Layer::PositionalEmbedding { max_len } => {
                let m = self.known(max_len, &p.join("max_len"), "`max_len`")?;
                self.needs_rank(x, 3, "a sequence [seq, dim]", name, kind, span)?;
                let t = self.ty(x).clone();
                let d = self.features(x, name, kind, span)?;
                let seq = t.shape[1].clone();
                let seq_nominal = seq.eval(&self.g.sym_value(1));
                if seq_nominal > m {
                    return Err(model_err(
                        format!(
                            "PositionalEmbedding `{name}`: the sequence ({} = {seq_nominal}) is longer than `max_len` {m}",
                            seq.show(&self.g.sym_names())
                        ),
                        self.span(&p.join("max_len")),
                    ));
                }
                let table =
                    self.param(name, "weight", &[m, d], Init::Normal { std: 0.02 }, span)?;
                let pos = self.add(
                    Op::Slice {
                        axis: 0,
                        start: 0,
                        len: seq,
                    },
                    &[table],
                    name,
                    span,
                )?;
                self.add(Op::Add, &[x, pos], name, span)
            }
            Layer::Dropout(rate) => {
                if !(0.0..1.0).contains(rate) {
                    return Err(model_err(
                        format!("the dropout rate must be in [0, 1), got {rate}"),
                        self.span(&p.join(0)),
                    ));
                }
                let stream = self.dropout_streams;
                self.dropout_streams += 1;
                self.add(Op::Dropout { p: *rate, stream }, &[x], name, span)
            }
            Layer::Attention {
                heads,
                causal,
                bias,
            } => self.attention(x, heads, *causal, *bias, name, p),
            Layer::Mlp { hidden, act, bias } => {
                let d = self.features(x, name, kind, span)?;
                let h = self.known(hidden, &p.join("hidden"), "`hidden`")?;
                if self.tensor_parallel > 1 {
                    // fc1 by columns, fc2 by rows: one all-reduce forward, one backward.
                    self.splits(h, "hidden features", name, span)?;
                    let x = self.add(Op::TensorParallelCopy, &[x], name, span)?;
                    let fc1 = format!("{name}.fc1");
                    let y = self.linear_split(x, h, *bias, Split::Column, &fc1, span)?;
                    let y = self.activation(y, *act, name, span)?;
                    let fc2 = format!("{name}.fc2");
                    return self.linear_split(y, d, *bias, Split::Row, &fc2, span);
                }
                let y = self.linear(x, h, *bias, &format!("{name}.fc1"), span)?;
                let y = self.activation(y, *act, name, span)?;
                self.linear(y, d, *bias, &format!("{name}.fc2"), span)
            }
            Layer::Repeat { .. } => Err(model_err(
                format!("Repeat `{name}` needs a Graph model with `blocks`"),
                span,
            )),
        }
    }

    fn attention(
        &mut self,
        x: NodeIndex,
        heads: &DimExpr,
        causal: bool,
        bias: bool,
        name: &str,
        p: &Path,
    ) -> Result<NodeIndex, Error> {
        let span = self.head(p);
        self.needs_rank(x, 3, "a sequence [seq, dim]", name, "Attention", span)?;
        let d = self.features(x, name, "Attention", span)?;
        let h = self.known(heads, &p.join("heads"), "`heads`")?;
        if d % h != 0 {
            return Err(model_err(
                format!("Attention `{name}`: the width {d} does not split into {h} heads"),
                self.span(&p.join("heads")),
            ));
        }
        let hd = d / h;
        let t = self.ty(x).clone();
        let (b, s) = (t.shape[0].clone(), t.shape[1].clone());
        // Tensor parallel: each rank holds `h / tp` heads (q, k, v by columns, out by rows).
        let tp = self.tensor_parallel;
        if tp > 1 {
            self.splits(h, "heads", name, span)?;
        }
        let (h, d_local) = (h / tp, d / tp);
        let x = if tp > 1 {
            self.add(Op::TensorParallelCopy, &[x], name, span)?
        } else {
            x
        };
        let split = vec![b.clone(), s.clone(), Dim::known(h), Dim::known(hd)];
        let heads_of = |l: &mut Self, which: &str| -> Result<NodeIndex, Error> {
            let layer = format!("{name}.{which}");
            let y = if tp > 1 {
                l.linear_split(x, d, bias, Split::Column, &layer, span)?
            } else {
                l.linear(x, d, bias, &layer, span)?
            };
            let y = l.reshape(y, split.clone(), name, span)?;
            l.permute(y, vec![0, 2, 1, 3], name, span)
        };
        let q = heads_of(self, "q")?;
        let k = heads_of(self, "k")?;
        let v = heads_of(self, "v")?;
        let scores = self.add(
            Op::MatMul {
                trans_a: false,
                trans_b: true,
            },
            &[q, k],
            name,
            span,
        )?;
        let scaled = self.add(
            Op::Scale {
                by: 1.0 / (hd as f64).sqrt(),
            },
            &[scores],
            name,
            span,
        )?;
        let probs = self.add(Op::Softmax { causal }, &[scaled], name, span)?;
        let ctx = self.add(
            Op::MatMul {
                trans_a: false,
                trans_b: false,
            },
            &[probs, v],
            name,
            span,
        )?;
        let ctx = self.permute(ctx, vec![0, 2, 1, 3], name, span)?;
        let ctx = self.reshape(ctx, vec![b, s, Dim::known(d_local)], name, span)?;
        let out = format!("{name}.out");
        if tp > 1 {
            return self.linear_split(ctx, d, bias, Split::Row, &out, span);
        }
        self.linear(ctx, d, bias, &out, span)
    }

    // ---- models ----

    fn input(&mut self, name: &str, spec: &InputSpec, p: &Path) -> Result<NodeIndex, Error> {
        let mut shape = vec![Dim::batch()];
        for (i, d) in spec.shape.iter().enumerate() {
            shape.push(self.size(d, &p.join("shape").join(i), "an input dimension")?);
        }
        let ty = TensorType::new(DType::from(spec.dtype), shape);
        self.add(
            Op::Input {
                name: name.to_string(),
                ty,
            },
            &[],
            "",
            self.head(p),
        )
    }

    fn symbols(&mut self, symbols: &Params, base: &Path) -> Result<(), Error> {
        for (name, nominal) in &symbols.0 {
            let p = base.join(name.as_str());
            if self.lookup(name).is_some() {
                return Err(self.err(&p, format!("`{name}` is both a parameter and a symbol")));
            }
            let n = self.known(nominal, &p, &format!("the nominal size of `{name}`"))?;
            let s = self.g.add_symbol(name, n);
            self.scopes
                .last_mut()
                .expect("a scope")
                .push((name.clone(), Dim::sym(s)));
        }
        Ok(())
    }

    fn experiment(&mut self) -> Result<(), Error> {
        let e = &self.src.experiment;
        self.scopes.push(Vec::new());
        self.bind(&e.params, &path!["params"])?;
        let (model_params, symbols) = match &e.model {
            Model::Sequential {
                params, symbols, ..
            }
            | Model::Graph {
                params, symbols, ..
            } => (params, symbols),
        };
        for (name, _) in &model_params.0 {
            if e.params.get(name).is_some() {
                return Err(self.err(
                    &path!["model", "params", name.as_str()],
                    format!("the parameter `{name}` is defined both in the file's and the model's `params`"),
                ));
            }
        }
        self.bind(model_params, &path!["model", "params"])?;
        self.symbols(symbols, &path!["model", "symbols"])?;
        let outputs = match &e.model {
            Model::Sequential { input, layers, .. } => {
                let mut x = self.input("x", input, &path!["model", "input"])?;
                for (i, layer) in layers.iter().enumerate() {
                    x = self.layer(layer, &[x], &i.to_string(), &path!["model", "layers", i])?;
                }
                if layers.is_empty() {
                    return Err(self.err(&path!["model", "layers"], "the model has no layers"));
                }
                vec![("output".to_string(), x)]
            }
            Model::Graph {
                inputs,
                blocks,
                nodes,
                outputs,
                ..
            } => {
                let mut env = Vec::new();
                for (name, spec) in &inputs.0 {
                    let n = self.input(name, spec, &path!["model", "inputs", name.as_str()])?;
                    env.push((name.clone(), n));
                }
                if inputs.0.is_empty() {
                    return Err(self.err(&path!["model", "inputs"], "the model has no inputs"));
                }
                if nodes.is_empty() {
                    return Err(self.err(&path!["model", "nodes"], "the model has no nodes"));
                }
                let values = self.nodes(nodes, &path!["model", "nodes"], env, "", blocks)?;
                match outputs {
                    None => vec![values.last().cloned().expect("nodes are not empty")],
                    Some(names) => {
                        if names.is_empty() {
                            return Err(self.err(&path!["model", "outputs"], "`outputs` is empty"));
                        }
                        let mut outs = Vec::new();
                        for (i, o) in names.iter().enumerate() {
                            let Some((_, n)) = values.iter().find(|(k, _)| k == o) else {
                                return Err(model_err(
                                    format!("unknown output `{o}`"),
                                    self.span(&path!["model", "outputs", i]),
                                )
                                .with_hint_model(suggest(
                                    o,
                                    "nodes",
                                    values.iter().map(|(k, _)| k.as_str()),
                                )));
                            };
                            if outs.iter().any(|(k, _)| k == o) {
                                return Err(model_err(
                                    format!("`{o}` is listed twice in `outputs`"),
                                    self.span(&path!["model", "outputs", i]),
                                ));
                            }
                            outs.push((o.clone(), *n));
                        }
                        outs
                    }
                }
            }
        };
        self.g.outputs = outputs;
        self.loss()?;
        self.data_contract()
    }

    /// Lowers a list of named nodes in dependency order; `env` holds the names already bound.
    /// Returns every binding, the declared nodes in file order last.
    fn nodes(
        &mut self,
        decls: &[NodeDecl],
        base: &Path,
        env: Vec<(String, NodeIndex)>,
        prefix: &str,
        blocks: &crate::dsl::ast::UniqueMap<Vec<NodeDecl>>,
    ) -> Result<Vec<(String, NodeIndex)>, Error> {
        // Names: unique, not shadowing an input.
        let mut index: HashMap<&str, usize> = HashMap::new();
        for (i, (name, _, _)) in decls.iter().enumerate() {
            let np = base.join(i).join(0);
            if name.is_empty() {
                return Err(model_err("a node needs a name", self.span(&np)));
            }
            if env.iter().any(|(k, _)| k == name) {
                return Err(model_err(
                    format!("the node `{name}` has the name of an input"),
                    self.span(&np),
                ));
            }
            if index.insert(name.as_str(), i).is_some() {
                return Err(
                    model_err(format!("two nodes are named `{name}`"), self.span(&np))
                        .with_hint_model("node names must be unique; rename one"),
                );
            }
        }
        // Every input must name an earlier binding or a node; order by dependencies.
        let mut deps: Vec<Vec<usize>> = vec![Vec::new(); decls.len()];
        for (i, (_, _, ins)) in decls.iter().enumerate() {
            for (j, input) in ins.iter().enumerate() {
                if let Some(&k) = index.get(input.as_str()) {
                    deps[i].push(k);
                } else if !env.iter().any(|(k, _)| k == input) {
                    let known: Vec<&str> = env
                        .iter()
                        .map(|(k, _)| k.as_str())
                        .chain(decls.iter().map(|d| d.0.as_str()))
                        .collect();
                    return Err(model_err(
                        format!("unknown input `{input}` of node `{}`", decls[i].0),
                        self.span(&base.join(i).join(2).join(j)),
                    )
                    .with_hint_model(suggest(
                        input,
                        "names",
                        known.iter().copied(),
                    )));
                }
            }
        }
        let order = dependency_order(&deps).map_err(|cycle| {
            let names: Vec<&str> = cycle.iter().map(|&i| decls[i].0.as_str()).collect();
            model_err(
                format!(
                    "the nodes form a cycle: {} -> {}",
                    names.join(" -> "),
                    names[0]
                ),
                self.span(&base.join(cycle[0])),
            )
            .with_hint_model("a node may only use inputs and nodes that do not depend on it")
        })?;
        let mut values: HashMap<String, NodeIndex> = env.iter().cloned().collect();
        for i in order {
            let (name, layer, ins) = &decls[i];
            let p = base.join(i).join(1);
            let args: Vec<NodeIndex> = ins.iter().map(|n| values[n.as_str()]).collect();
            let full = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            let out = match layer {
                Layer::Repeat {
                    block,
                    times,
                    args: block_args,
                } => self.repeat(block, times, block_args, &args, &full, &p, blocks)?,
                _ => self.layer(layer, &args, &full, &p)?,
            };
            values.insert(name.clone(), out);
        }
        let mut out = env;
        for (name, _, _) in decls {
            out.push((name.clone(), values[name.as_str()]));
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn repeat(
        &mut self,
        block: &str,
        times: &DimExpr,
        args: &Params,
        ins: &[NodeIndex],
        name: &str,
        p: &Path,
        blocks: &crate::dsl::ast::UniqueMap<Vec<NodeDecl>>,
    ) -> Result<NodeIndex, Error> {
        let span = self.head(p);
        let Some(decls) = blocks.get(block) else {
            return Err(model_err(
                format!("unknown block `{block}`"),
                self.span(&p.join("block")),
            )
            .with_hint_model(suggest(block, "blocks", blocks.keys())));
        };
        if ins.len() != 1 {
            return Err(model_err(
                format!(
                    "Repeat `{name}` takes 1 input (the block's `x`), got {}",
                    ins.len()
                ),
                span,
            ));
        }
        if decls.is_empty() {
            return Err(model_err(format!("the block `{block}` has no nodes"), span));
        }
        if let Some(i) = self.block_stack.iter().position(|b| b == block) {
            let chain = self.block_stack[i..].join(" -> ");
            return Err(model_err(
                format!("the block `{block}` repeats itself: {chain} -> {block}"),
                self.span(&p.join("block")),
            ));
        }
        if self.block_stack.len() >= MAX_BLOCK_DEPTH {
            return Err(model_err(
                format!("blocks nest more than {MAX_BLOCK_DEPTH} deep"),
                span,
            ));
        }
        let n = self.known(times, &p.join("times"), "`times`")?;
        self.scopes.push(Vec::new());
        self.bind(args, &p.join("args"))?;
        // Refuse a model too large to build before building any of it, counting the layers
        // of blocks that this block repeats in turn.
        let mut visiting = self.block_stack.clone();
        let per_copy = self.block_layers(block, blocks, &mut visiting);
        let made = n.saturating_mul(per_copy);
        let total = made.saturating_add(self.g.layers as u64);
        if total > MAX_LAYERS as u64 {
            let detail = if made > MAX_LAYERS as u64 {
                String::new()
            } else {
                format!(" ({total} in the model)")
            };
            return Err(model_err(
                format!(
                    "Repeat `{name}` would make {made} layers{detail}; Parallax builds at most {MAX_LAYERS}"
                ),
                self.span(&p.join("times")),
            ));
        }
        self.block_stack.push(block.to_string());
        let base = path!["model", "blocks", block];
        let mut x = ins[0];
        for i in 0..n {
            let values = self.nodes(
                decls,
                &base,
                vec![("x".to_string(), x)],
                &format!("{name}.{i}"),
                blocks,
            )?;
            x = values.last().expect("a block has nodes").1;
        }
        self.block_stack.pop();
        self.scopes.pop();
        Ok(x)
    }

    /// The layers one copy of `block` expands to, nested repeats included (saturating, and
    /// stopping once past [`MAX_LAYERS`]). Anything that does not resolve (an unknown block, a
    /// cycle, a bad `times`) counts as one layer: building the block reports it.
    fn block_layers(
        &mut self,
        block: &str,
        blocks: &crate::dsl::ast::UniqueMap<Vec<NodeDecl>>,
        visiting: &mut Vec<String>,
    ) -> u64 {
        let Some(decls) = blocks.get(block) else {
            return 1;
        };
        if decls.is_empty()
            || visiting.len() >= MAX_BLOCK_DEPTH
            || visiting.iter().any(|b| b == block)
        {
            return 1;
        }
        visiting.push(block.to_string());
        let mut total = 0u64;
        for (_, layer, _) in decls {
            let n = match layer {
                Layer::Repeat {
                    block: inner,
                    times,
                    args,
                } => {
                    let t = self.known(times, &Path::root(), "`times`").unwrap_or(1);
                    self.scopes.push(Vec::new());
                    let per = match self.bind(args, &Path::root()) {
                        Ok(()) => self.block_layers(inner, blocks, visiting),
                        Err(_) => 1,
                    };
                    self.scopes.pop();
                    t.saturating_mul(per)
                }
                _ => 1,
            };
            total = total.saturating_add(n);
            if total > MAX_LAYERS as u64 {
                break;
            }
        }
        visiting.pop();
        total
    }

    fn loss(&mut self) -> Result<(), Error> {
        let e = &self.src.experiment;
        let (which, lp) = match &e.loss {
            Loss::CrossEntropy { output, .. } | Loss::Mse { output } => {
                (output.clone(), path!["loss"])
            }
        };
        let out = match which {
            None => self.g.outputs[0].1,
            Some(name) => match self.g.outputs.iter().find(|(k, _)| *k == name) {
                Some((_, n)) => *n,
                None => {
                    return Err(model_err(
                        format!("the loss reads `{name}`, which is not an output of the model"),
                        self.span(&lp.join("output")),
                    )
                    .with_hint_model(suggest(
                        &name,
                        "outputs",
                        self.g.outputs.iter().map(|(k, _)| k.as_str()),
                    )))
                }
            },
        };
        let span = self.head(&lp);
        let t = self.ty(out).clone();
        let loss = match &e.loss {
            Loss::CrossEntropy {
                label_smoothing, ..
            } => {
                if t.rank() < 2 || !t.dtype.is_float() || !t.shape[t.rank() - 1].is_known() {
                    return Err(model_err(
                        format!(
                            "cross-entropy needs float logits [.., classes] with a known class count, but the model gives {}",
                            self.show(out)
                        ),
                        span,
                    ));
                }
                let labels_ty = TensorType::new(DType::I32, t.shape[..t.rank() - 1].to_vec());
                let labels = self.add(
                    Op::Input {
                        name: "labels".into(),
                        ty: labels_ty,
                    },
                    &[],
                    "loss",
                    span,
                )?;
                self.add(
                    Op::CrossEntropy {
                        smoothing: *label_smoothing,
                    },
                    &[out, labels],
                    "loss",
                    span,
                )?
            }
            Loss::Mse { .. } => {
                if !t.dtype.is_float() {
                    return Err(model_err(
                        format!(
                            "MSE needs a float output, but the model gives {}",
                            self.show(out)
                        ),
                        span,
                    ));
                }
                let target = self.add(
                    Op::Input {
                        name: "target".into(),
                        ty: t.clone(),
                    },
                    &[],
                    "loss",
                    span,
                )?;
                let diff = self.add(Op::Sub, &[out, target], "loss", span)?;
                let sq = self.add(Op::Mul, &[diff, diff], "loss", span)?;
                let axes = (0..t.rank()).collect();
                self.add(Op::ReduceMean { axes }, &[sq], "loss", span)?
            }
        };
        if self.g.outputs.iter().any(|(k, _)| k == "loss") {
            return Err(model_err("a model output may not be named `loss`", span));
        }
        self.g.outputs.push(("loss".into(), loss));
        Ok(())
    }

    /// The built-in data sets fix the model's input and class count: check them now.
    fn data_contract(&self) -> Result<(), Error> {
        let e = &self.src.experiment;
        let (features, classes, what) = match &e.data {
            Data::Digits { .. } => (64u64, 10u64, "the digits data set (8x8 images)".to_string()),
            Data::Blobs {
                features, classes, ..
            } => (
                *features,
                *classes,
                format!("`Blobs` with {features} features"),
            ),
            Data::Sequence { length, vocab, .. } => {
                (*length, *vocab, format!("`Sequence` of length {length}"))
            }
            _ => return Ok(()),
        };
        let sample_inputs: Vec<NodeIndex> = self
            .g
            .inputs
            .iter()
            .copied()
            .filter(|&n| self.g.g[n].layer.is_empty())
            .collect();
        let dp = path!["data"];
        if sample_inputs.len() != 1 {
            return Err(model_err(
                format!(
                    "{what} feeds one input, but the model has {}",
                    sample_inputs.len()
                ),
                self.head(&dp),
            ));
        }
        let x = sample_inputs[0];
        let per_sample = product(&self.ty(x).shape[1..]).map(|d| d.eval(&self.g.sym_value(1)));
        // A sequence task also feeds a causal model its tokens followed by the answer.
        let prompted = matches!(e.data, Data::Sequence { .. }) && per_sample == Some(2 * features);
        if per_sample != Some(features) && !prompted {
            let also = if matches!(e.data, Data::Sequence { .. }) {
                format!(
                    " (or {} for a causal model reading tokens then answer)",
                    2 * features
                )
            } else {
                String::new()
            };
            return Err(model_err(
                format!(
                    "{what} gives {features} values per sample{also}, but the model's input is {}",
                    self.show(x)
                ),
                self.head(&dp),
            ));
        }
        if matches!(e.data, Data::Sequence { .. }) && self.ty(x).dtype.is_float() {
            return Err(model_err(
                format!(
                    "{what} gives token ids, but the model's input is {}",
                    self.show(x)
                ),
                self.head(&dp),
            )
            .with_hint_model("declare the input with `dtype: I32`"));
        }
        if let Loss::CrossEntropy { .. } = e.loss {
            let out = self.g.outputs[0].1;
            let t = self.ty(out);
            let c = t.shape.last().and_then(|d| d.as_known()).unwrap_or(0);
            if c < classes {
                return Err(model_err(
                    format!("{what} has {classes} classes, but the model's output has {c}"),
                    self.head(&dp),
                )
                .with_hint_model(format!("make the last layer `Linear(out: {classes})`")));
            }
        }
        Ok(())
    }
}

/// A topological order of declarations (ties in file order), or one cycle.
fn dependency_order(deps: &[Vec<usize>]) -> Result<Vec<usize>, Vec<usize>> {
    let n = deps.len();
    let mut state = vec![0u8; n]; // 0 new, 1 on the stack, 2 done
    let mut order = Vec::with_capacity(n);
    for root in 0..n {
        if state[root] != 0 {
            continue;
        }
        // Iterative DFS: (node, next dependency to visit).
        let mut stack = vec![(root, 0usize)];
        state[root] = 1;
        while let Some(&mut (v, ref mut next)) = stack.last_mut() {
            if *next < deps[v].len() {
                let w = deps[v][*next];
                *next += 1;
                match state[w] {
                    0 => {
                        state[w] = 1;
                        stack.push((w, 0));
                    }
                    1 => {
                        let start = stack.iter().position(|&(u, _)| u == w).unwrap_or(0);
                        let mut cycle: Vec<usize> =
                            stack[start..].iter().map(|&(u, _)| u).collect();
                        cycle.reverse();
                        return Err(cycle);
                    }
                    _ => {}
                }
            } else {
                state[v] = 2;
                order.push(v);
                stack.pop();
            }
        }
    }
    Ok(order)
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

#[cfg(test)]
mod tests {
    use super::dependency_order;

    #[test]
    fn orders_dependencies_and_finds_cycles() {
        assert_eq!(
            dependency_order(&[vec![1], vec![], vec![0]]).unwrap(),
            vec![1, 0, 2]
        );
        let cycle = dependency_order(&[vec![1], vec![2], vec![0]]).unwrap_err();
        assert_eq!(cycle.len(), 3);
        assert!(dependency_order(&[vec![0]]).is_err());
    }
}
