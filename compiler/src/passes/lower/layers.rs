//! Layers: each `Layer` of the language as primitive ops, parameters sized from its input.

use super::batch_norm::BatchNorm;
use super::*;

impl Lowerer<'_> {
    /// Lowers one layer applied to `ins`. `p` is where the layer is written.
    pub(super) fn layer(
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
        self.decode_refuses(layer, x, name, p)?;
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
            } => self.conv2d(x, out, kernel, stride, padding, groups, *bias, name, p),
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
            Layer::Reshape(dims) => self.reshape_layer(x, dims, name, p),
            Layer::Transpose(a, b) => {
                let a = self.axis(x, *a, p)?;
                let b = self.axis(x, *b, p)?;
                let mut perm: Vec<usize> = (0..self.ty(x).rank()).collect();
                perm.swap(a, b);
                self.permute(x, perm, name, span)
            }
            Layer::Permute(axes) => self.permute_layer(x, axes, name, p),
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
            Layer::Silu => self.activation(x, Activation::Silu, name, span),
            Layer::Relu6 => self.activation(x, Activation::Relu6, name, span),
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
            } => self.batch_norm2d(x, *eps, *momentum, *affine, name, p),
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
                self.positional_embedding(x, max_len, name, p)
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
            Layer::Mlp {
                hidden,
                act,
                bias,
                gated,
            } => self.mlp(x, hidden, *act, *bias, *gated, name, p),
            Layer::Repeat { .. } => Err(model_err(
                format!("Repeat `{name}` needs a Graph model with `blocks`"),
                span,
            )),
        }
    }

    /// `Conv2d`: its weights `[O, C/groups, K, K]` (and bias), PyTorch's initialisation.
    #[allow(clippy::too_many_arguments)]
    fn conv2d(
        &mut self,
        x: NodeIndex,
        out: &DimExpr,
        kernel: &DimExpr,
        stride: &DimExpr,
        padding: &DimExpr,
        groups: &DimExpr,
        bias: bool,
        name: &str,
        p: &Path,
    ) -> Result<NodeIndex, Error> {
        let (kind, span) = ("Conv2d", self.head(p));
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
        if bias {
            // `[C, 1, 1]` broadcasts over `H, W`; PyTorch's (and the files') is `[C]`.
            let b = self.param(name, "bias", &[o, 1, 1], Init::Uniform { bound }, span)?;
            self.g.file_shapes.push((b, vec![o]));
            y = self.add(Op::Add, &[y, b], name, span)?;
        }
        Ok(y)
    }

    /// `Reshape`: the per-sample shape, one `-1` inferred.
    fn reshape_layer(
        &mut self,
        x: NodeIndex,
        dims: &[DimExpr],
        name: &str,
        p: &Path,
    ) -> Result<NodeIndex, Error> {
        let span = self.head(p);
        let t = self.ty(x).clone();
        let total = product(&t.shape[1..]).ok_or_else(|| model_err("size overflow", span))?;
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
            let known = product(&shape[1..]).ok_or_else(|| model_err("size overflow", span))?;
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

    /// `Permute`: the axes of a sample, the batch axis left first.
    fn permute_layer(
        &mut self,
        x: NodeIndex,
        axes: &[i64],
        name: &str,
        p: &Path,
    ) -> Result<NodeIndex, Error> {
        let span = self.head(p);
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

    /// `BatchNorm2d`: batch statistics (synchronised over shards), running ones, affine.
    fn batch_norm2d(
        &mut self,
        x: NodeIndex,
        eps: f64,
        momentum: f64,
        affine: bool,
        name: &str,
        p: &Path,
    ) -> Result<NodeIndex, Error> {
        let (kind, span) = ("BatchNorm2d", self.head(p));
        let eps = self.norm_eps(eps, p)?;
        if !(momentum > 0.0 && momentum <= 1.0) {
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
            momentum,
            channels: c,
            spatial,
            sharded: self.sharded,
        };
        let mut y = bn
            .lower(&mut self.g, x, name, span)
            .map_err(|m| model_err(format!("in layer `{name}`: {m}"), span))?;
        if affine {
            let w = self.param(name, "weight", &[c, 1, 1], Init::Ones, span)?;
            let b = self.param(name, "bias", &[c, 1, 1], Init::Zeros, span)?;
            // PyTorch's BatchNorm2d weight and bias are `[C]`.
            self.g.file_shapes.push((w, vec![c]));
            self.g.file_shapes.push((b, vec![c]));
            y = self.add(Op::Mul, &[y, w], name, span)?;
            y = self.add(Op::Add, &[y, b], name, span)?;
        }
        Ok(y)
    }

    /// `PositionalEmbedding`: a learned `[max_len, dim]` table, its first rows added.
    fn positional_embedding(
        &mut self,
        x: NodeIndex,
        max_len: &DimExpr,
        name: &str,
        p: &Path,
    ) -> Result<NodeIndex, Error> {
        let (kind, span) = ("PositionalEmbedding", self.head(p));
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
        let table = self.param(name, "weight", &[m, d], Init::Normal { std: 0.02 }, span)?;
        if self.decode.is_some() {
            return self.decode_positional(x, (table, m), name, span);
        }
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
}
