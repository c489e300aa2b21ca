//! The transformer's blocks: `Attention` and `Mlp`, whole or, when tensor parallel, one
//! rank's slices (heads and hidden features split, an all-reduce where the slices meet).

use super::*;

impl Lowerer<'_> {
    /// `Mlp`: `fc2(act(fc1(x)))`, or gated (SwiGLU with `act: Silu`, as LLaMA):
    /// `down_proj(act(gate_proj(x)) * up_proj(x))`; one tensor rank's slices when tensor
    /// parallel (the first projections by columns, the last by rows).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mlp(
        &mut self,
        x: NodeIndex,
        hidden: &DimExpr,
        act: Activation,
        bias: bool,
        gated: bool,
        name: &str,
        p: &Path,
    ) -> Result<NodeIndex, Error> {
        let (kind, span) = ("Mlp", self.head(p));
        if gated {
            return self.gated_mlp(x, hidden, act, bias, name, p);
        }
        let d = self.features(x, name, kind, span)?;
        let h = self.known(hidden, &p.join("hidden"), "`hidden`")?;
        if self.tensor_parallel > 1 {
            // fc1 by columns, fc2 by rows: one all-reduce forward, one backward.
            self.splits(h, "hidden features", name, span)?;
            let x = self.add(Op::TensorParallelCopy, &[x], name, span)?;
            let fc1 = format!("{name}.fc1");
            let y = self.linear_split(x, h, bias, Split::Column, &fc1, span)?;
            let y = self.activation(y, act, name, span)?;
            let fc2 = format!("{name}.fc2");
            return self.linear_split(y, d, bias, Split::Row, &fc2, span);
        }
        let y = self.linear(x, h, bias, &format!("{name}.fc1"), span)?;
        let y = self.activation(y, act, name, span)?;
        self.linear(y, d, bias, &format!("{name}.fc2"), span)
    }

    fn gated_mlp(
        &mut self,
        x: NodeIndex,
        hidden: &DimExpr,
        act: Activation,
        bias: bool,
        name: &str,
        p: &Path,
    ) -> Result<NodeIndex, Error> {
        let (kind, span) = ("Mlp", self.head(p));
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
            let g = self.linear_split(x, h, bias, Split::Column, &gate, span)?;
            let u = self.linear_split(x, h, bias, Split::Column, &up, span)?;
            let g = self.activation(g, act, name, span)?;
            let y = self.add(Op::Mul, &[g, u], name, span)?;
            return self.linear_split(y, d, bias, Split::Row, &down, span);
        }
        let g = self.linear(x, h, bias, &gate, span)?;
        let u = self.linear(x, h, bias, &up, span)?;
        let g = self.activation(g, act, name, span)?;
        let y = self.add(Op::Mul, &[g, u], name, span)?;
        self.linear(y, d, bias, &down, span)
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
            // Token-major heads `[B, S, H, hd]`: a view of the projection, no permute.
            l.reshape(y, split.clone(), name, span)
        };
        let q = heads_of(self, "q")?;
        let k = heads_of(self, "k")?;
        let v = heads_of(self, "v")?;
        let scale = 1.0 / (hd as f64).sqrt();
        let ctx = if self.decode.is_some() {
            self.decode_attention((q, k, v), scale, name, span)?
        } else {
            self.add(Op::Attention { causal, scale }, &[q, k, v], name, span)?
        };
        let ctx = self.reshape(ctx, vec![b, s, Dim::known(d_local)], name, span)?;
        let out = format!("{name}.out");
        if tp > 1 {
            return self.linear_split(ctx, d, bias, Split::Row, &out, span);
        }
        self.linear(ctx, d, bias, &out, span)
    }
}
