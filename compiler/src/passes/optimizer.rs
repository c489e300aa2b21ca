//! The optimizer as ops: clipping by the global gradient norm, then SGD (momentum, Nesterov,
//! weight decay), Adam or AdamW, each parameter's update recorded in `Graph::updates`. The
//! learning rate (and Adam's bias corrections) are scalar inputs fed every step, so a schedule
//! never recompiles. The formulas follow PyTorch's `torch.optim`.

use super::Ctx;
use crate::diag::Diagnostic;
use crate::dsl::ast::Optimizer;
use crate::ir::{DType, Graph, Group, NodeIndex, Op, Phase, TensorType};
use crate::Error;

/// Scalar inputs the runtime feeds each step.
pub const LR: &str = "lr";
/// `lr / (1 - beta1^t)`
pub const ADAM_STEP_SIZE: &str = "adam_step_size";
/// `sqrt(1 - beta2^t)`
pub const ADAM_BC2_SQRT: &str = "adam_bc2_sqrt";

fn failed(m: String) -> Error {
    Error::Model(Diagnostic::new(format!("optimizer: {m}"), None))
}

struct Builder<'g> {
    g: &'g mut Graph,
}

impl Builder<'_> {
    fn op(&mut self, op: Op, ins: &[NodeIndex], layer: &str) -> Result<NodeIndex, Error> {
        self.g.add(op, ins, layer, None).map_err(failed)
    }
    fn scalar_input(&mut self, name: &str) -> Result<NodeIndex, Error> {
        self.g.scalar_input(name, "optimizer").map_err(failed)
    }
    fn state(&mut self, param: NodeIndex, what: &str) -> Result<NodeIndex, Error> {
        let (name, ty) = match &self.g.g[param].op {
            Op::Param { name, ty, .. } => (format!("{name}.{what}"), ty.clone()),
            _ => unreachable!("updates are for parameters"),
        };
        let layer = self.g.g[param].layer.clone();
        self.op(
            Op::State {
                name,
                ty,
                start: 0.0,
            },
            &[],
            &layer,
        )
    }
    fn scale(&mut self, x: NodeIndex, by: f64, layer: &str) -> Result<NodeIndex, Error> {
        self.op(Op::Scale { by }, &[x], layer)
    }
    fn bin(&mut self, op: Op, a: NodeIndex, b: NodeIndex, layer: &str) -> Result<NodeIndex, Error> {
        self.op(op, &[a, b], layer)
    }
}

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    // A model without trainable parameters has nothing to update (`train` refuses it).
    if g.grads.is_empty() {
        return Ok(());
    }
    g.phase = Phase::Update;
    let opt = &ctx.source.experiment.optimizer;
    let mut b = Builder { g };
    let lr = b.scalar_input(LR)?;
    let clip = match opt {
        Optimizer::Sgd { clip_norm, .. }
        | Optimizer::Adam { clip_norm, .. }
        | Optimizer::AdamW { clip_norm, .. } => *clip_norm,
    };
    let grads = b.g.grads.clone();
    let grads: Vec<(NodeIndex, NodeIndex)> = match clip {
        None => grads,
        Some(max_norm) => {
            // coef = min(1, max_norm / (||g|| + 1e-6)), as torch.nn.utils.clip_grad_norm_.
            // Under tensor parallelism each rank holds a slice of the split parameters: their
            // squared norms are summed over the tensor ranks, and each replicated parameter
            // (the same on every rank) counts once.
            let (mut split, mut whole) = (None, None);
            for &(p, d) in &grads {
                let sq = b.bin(Op::Mul, d, d, "optimizer")?;
                let axes = (0..b.g.g[d].ty.rank()).collect();
                let s = b.op(Op::ReduceSum { axes }, &[sq], "optimizer")?;
                let sum = if b.g.param_splits.iter().any(|&(q, _)| q == p) {
                    &mut split
                } else {
                    &mut whole
                };
                *sum = Some(match *sum {
                    None => s,
                    Some(t) => b.bin(Op::Add, t, s, "optimizer")?,
                });
            }
            if let Some(s) = split {
                let tensor = Op::AllReduce {
                    group: Group::Tensor,
                };
                split = Some(b.op(tensor, &[s], "optimizer")?);
            }
            let total = match (split, whole) {
                (Some(a), Some(c)) => b.bin(Op::Add, a, c, "optimizer")?,
                (a, c) => a.or(c).expect("at least one gradient"),
            };
            let norm = b.op(Op::Sqrt, &[total], "optimizer")?;
            let denom = b.op(Op::AddScalar { value: 1e-6 }, &[norm], "optimizer")?;
            let max = b.op(
                Op::Fill {
                    value: max_norm,
                    ty: TensorType::scalar(DType::F32),
                },
                &[],
                "optimizer",
            )?;
            let coef = b.bin(Op::Div, max, denom, "optimizer")?;
            let coef = b.op(Op::ClampMax { value: 1.0 }, &[coef], "optimizer")?;
            let mut clipped = Vec::new();
            for &(p, d) in &grads {
                let layer = b.g.g[p].layer.clone();
                clipped.push((p, b.bin(Op::Mul, d, coef, &layer)?));
            }
            clipped
        }
    };
    let adam_scalars = match opt {
        Optimizer::Adam { .. } | Optimizer::AdamW { .. } => Some((
            b.scalar_input(ADAM_STEP_SIZE)?,
            b.scalar_input(ADAM_BC2_SQRT)?,
        )),
        Optimizer::Sgd { .. } => None,
    };
    let mut updates = Vec::new();
    for (p, d) in grads {
        let layer = b.g.g[p].layer.clone();
        let l = layer.as_str();
        match opt {
            Optimizer::Sgd {
                momentum,
                nesterov,
                weight_decay,
                ..
            } => {
                let mut d = d;
                if *weight_decay != 0.0 {
                    let decay = b.scale(p, *weight_decay, l)?;
                    d = b.bin(Op::Add, d, decay, l)?;
                }
                if *momentum != 0.0 {
                    // buf = momentum * buf + d (a zero buffer makes the first step buf = d).
                    let buf = b.state(p, "momentum")?;
                    let kept = b.scale(buf, *momentum, l)?;
                    let buf_new = b.bin(Op::Add, kept, d, l)?;
                    updates.push((buf, buf_new));
                    d = if *nesterov {
                        let ahead = b.scale(buf_new, *momentum, l)?;
                        b.bin(Op::Add, d, ahead, l)?
                    } else {
                        buf_new
                    };
                }
                let step = b.bin(Op::Mul, d, lr, l)?;
                updates.push((p, b.bin(Op::Sub, p, step, l)?));
            }
            Optimizer::Adam {
                betas,
                eps,
                weight_decay,
                ..
            }
            | Optimizer::AdamW {
                betas,
                eps,
                weight_decay,
                ..
            } => {
                let decoupled = matches!(opt, Optimizer::AdamW { .. });
                let (step_size, bc2_sqrt) = adam_scalars.expect("adam scalars");
                let mut d = d;
                let mut base = p;
                if *weight_decay != 0.0 {
                    let decay = b.scale(p, *weight_decay, l)?;
                    if decoupled {
                        // p = p - lr * wd * p
                        let shrink = b.bin(Op::Mul, decay, lr, l)?;
                        base = b.bin(Op::Sub, p, shrink, l)?;
                    } else {
                        d = b.bin(Op::Add, d, decay, l)?;
                    }
                }
                let (b1, b2) = *betas;
                let m = b.state(p, "adam_m")?;
                let v = b.state(p, "adam_v")?;
                let m_kept = b.scale(m, b1, l)?;
                let m_in = b.scale(d, 1.0 - b1, l)?;
                let m_new = b.bin(Op::Add, m_kept, m_in, l)?;
                let d2 = b.bin(Op::Mul, d, d, l)?;
                let v_kept = b.scale(v, b2, l)?;
                let v_in = b.scale(d2, 1.0 - b2, l)?;
                let v_new = b.bin(Op::Add, v_kept, v_in, l)?;
                let root = b.op(Op::Sqrt, &[v_new], l)?;
                let root = b.bin(Op::Div, root, bc2_sqrt, l)?;
                let denom = b.op(Op::AddScalar { value: *eps }, &[root], l)?;
                let ratio = b.bin(Op::Div, m_new, denom, l)?;
                let step = b.bin(Op::Mul, ratio, step_size, l)?;
                updates.push((m, m_new));
                updates.push((v, v_new));
                updates.push((p, b.bin(Op::Sub, base, step, l)?));
            }
        }
    }
    b.g.updates.extend(updates);
    Ok(())
}
