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
                    // `[C, 1, 1]` broadcasts over `H, W`; PyTorch's (and the files') is `[C]`.
                    let b = self.param(name, "bias", &[o, 1, 1], Init::Uniform { bound }, span)?;
                    self.g.file_shapes.push((b, vec![o]));
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
            Layer::Silu => self.activation(x, Activation::Silu, name, span),
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
                    // PyTorch's BatchNorm2d weight and bias are `[C]`.
                    self.g.file_shapes.push((w, vec![c]));
                    self.g.file_shapes.push((b, vec![c]));
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
            Layer::Mlp {
                hidden,
                act,
                bias,
                gated: true,
            } => {
                let d = self.features(x, name, kind, span)?;
                let h = self.known(hidden, &p.join("hidden"), "`hidden`")?;
                let (gate, up, down) = (
                    format!("{name}.gate_proj"),
                    format!("{name}.up_proj"),
                    format!("{name}.down_proj"),
                );
                if self.tensor_parallel > 1 {
                    // gate and up by columns, down by rows: one all-reduce each way.
                    self.splits(h, "hidden features", name, span)?;
                    let x = self.add(Op::TensorParallelCopy, &[x], name, span)?;
                    let g = self.linear_split(x, h, *bias, Split::Column, &gate, span)?;
                    let u = self.linear_split(x, h, *bias, Split::Column, &up, span)?;
                    let g = self.activation(g, *act, name, span)?;
                    let y = self.add(Op::Mul, &[g, u], name, span)?;
                    return self.linear_split(y, d, *bias, Split::Row, &down, span);
                }
                let g = self.linear(x, h, *bias, &gate, span)?;
                let u = self.linear(x, h, *bias, &up, span)?;
                let g = self.activation(g, *act, name, span)?;
                let y = self.add(Op::Mul, &[g, u], name, span)?;
                self.linear(y, d, *bias, &down, span)
            }
            Layer::Mlp {
                hidden, act, bias, ..
            } => {
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

    pub(super) fn attention(
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
}
