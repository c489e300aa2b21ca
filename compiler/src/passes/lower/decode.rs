//! The decode step (`Options::decode`): the model lowered for one new token per sample at
//! position `pos` (the input `POSITION`), each causal attention reading and updating a key and
//! a value cache of `[B, seq, heads, head_dim]`: `State`s named `{layer}.key_cache` and
//! `{layer}.value_cache` that persist between steps and that no file holds. The parameters
//! are the training plan's, by name and shape, so the same weights load. A model whose
//! output at a position depends on other positions except through causal attention (a
//! convolution, a pooling, a reshape or a softmax across positions) cannot be cached, and
//! is refused here.

use super::*;
use crate::plan::POSITION;

/// Whether a state is a decode step's key or value cache (`schedule` counts its bytes apart).
pub fn is_cache(state: &str) -> bool {
    state.ends_with(".key_cache") || state.ends_with(".value_cache")
}

/// What the decode step's lowering carries.
#[derive(Debug, Clone, Default)]
pub(super) struct Decode {
    /// The cache's rows: the model's sequence length (its input's `seq`).
    pub seq: u64,
    /// The input `POSITION` (`[B]`, integer), once the model's input is lowered.
    pub pos: Option<NodeIndex>,
}

impl Lowerer<'_> {
    /// The decode step's token input: `[B, 1]` for a model reading `[B, seq]` token ids,
    /// and the position input beside it.
    pub(super) fn decode_input(
        &mut self,
        name: &str,
        mut shape: Vec<Dim>,
        spec: &InputSpec,
        p: &Path,
    ) -> Result<Vec<Dim>, Error> {
        let span = self.head(p);
        if self.decode.as_ref().is_some_and(|d| d.pos.is_some()) {
            return Err(model_err(
                format!("the decode step reads one input of token ids; `{name}` is a second"),
                span,
            ));
        }
        if spec.dtype.is_float() || shape.len() != 2 {
            return Err(model_err(
                format!(
                    "the decode step reads token ids [seq]; the input `{name}` is {}",
                    TensorType::new(spec.dtype, shape).show(&self.g.sym_names())
                ),
                span,
            ));
        }
        let seq = shape[1].eval(&self.g.sym_value(1));
        shape[1] = Dim::known(1);
        let ty = TensorType::new(DType::I32, vec![Dim::batch()]);
        let pos = self.add(
            Op::Input {
                name: POSITION.into(),
                ty,
            },
            &[],
            "",
            span,
        )?;
        self.decode = Some(Decode {
            seq,
            pos: Some(pos),
        });
        Ok(shape)
    }

    /// The position input (`[B]`); set once the model's input is lowered.
    fn position(&self, span: Option<Span>) -> Result<NodeIndex, Error> {
        self.decode
            .as_ref()
            .and_then(|d| d.pos)
            .ok_or_else(|| model_err("the decode step needs a token input first", span))
    }

    /// Refuses a layer that mixes positions other than through causal attention: cached,
    /// its output at one position would need the others'.
    pub(super) fn decode_refuses(
        &self,
        layer: &Layer,
        x: NodeIndex,
        name: &str,
        p: &Path,
    ) -> Result<(), Error> {
        if self.decode.is_none() {
            return Ok(());
        }
        let last = self.ty(x).rank().saturating_sub(2) as i64;
        let last_axis = |axis: i64| axis == -1 || axis == last;
        let why = match layer {
            Layer::Attention { causal: false, .. } => {
                "attends to later positions (`causal: false`)"
            }
            Layer::Softmax { axis } | Layer::Concat { axis } if !last_axis(*axis) => {
                "works across positions (an axis other than the last)"
            }
            Layer::Conv2d { .. }
            | Layer::MaxPool2d { .. }
            | Layer::AvgPool2d { .. }
            | Layer::BatchNorm2d { .. }
            | Layer::Flatten
            | Layer::Reshape(_)
            | Layer::Transpose(..)
            | Layer::Permute(_) => "mixes or moves positions",
            _ => return Ok(()),
        };
        Err(model_err(
            format!(
                "the model cannot be run a token at a time with a key/value cache: {} `{name}` {why}",
                layer.kind()
            ),
            self.head(p),
        )
        .with_hint_model("`parallax sample` then runs the model's whole window for each token"))
    }

    /// `PositionalEmbedding` at the decode step: row `pos` of the table for each sample.
    pub(super) fn decode_positional(
        &mut self,
        x: NodeIndex,
        (table, max_len): (NodeIndex, u64),
        name: &str,
        span: Option<Span>,
    ) -> Result<NodeIndex, Error> {
        let pos = self.position(span)?;
        let seq = self.decode.as_ref().map_or(1, |d| d.seq);
        if seq > max_len {
            return Err(model_err(
                format!("PositionalEmbedding `{name}`: the sequence ({seq}) is longer than `max_len` {max_len}"),
                span,
            ));
        }
        let rows = vec![Dim::batch(), Dim::known(1)];
        let at = self.reshape(pos, rows, name, span)?;
        let row = self.add(Op::Gather, &[table, at], name, span)?;
        self.add(Op::Add, &[x, row], name, span)
    }

    /// A causal attention at the decode step: the new key and value (`[B, 1, H, hd]`)
    /// written into the layer's caches at `pos`, the query attending to rows `0..=pos`.
    pub(super) fn decode_attention(
        &mut self,
        (q, k, v): (NodeIndex, NodeIndex, NodeIndex),
        scale: f64,
        name: &str,
        span: Option<Span>,
    ) -> Result<NodeIndex, Error> {
        let pos = self.position(span)?;
        let seq = self.decode.as_ref().map_or(1, |d| d.seq);
        let mut cached = Vec::with_capacity(2);
        for (what, new) in [("key_cache", k), ("value_cache", v)] {
            let mut shape = self.ty(new).shape.clone();
            shape[1] = Dim::known(seq);
            let ty = TensorType::new(self.ty(new).dtype, shape);
            let state = Op::State {
                name: format!("{name}.{what}"),
                ty,
                start: 0.0,
            };
            let cache = self.add(state, &[], name, span)?;
            let written = self.add(Op::CacheWrite, &[cache, new, pos], name, span)?;
            // An update of its state: the schedule writes it in place, so it persists.
            self.g.updates.push((cache, written));
            cached.push(written);
        }
        let op = Op::CachedAttention { scale };
        self.add(op, &[q, cached[0], cached[1], pos], name, span)
    }
}
