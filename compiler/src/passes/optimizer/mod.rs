//! The optimizer as ops: clipping by the global gradient norm, then each parameter's update,
//! recorded in `Graph::updates`. Each optimizer is a file (`sgd.rs`, `adam.rs`) holding its
//! update and its per-step scalars; `method` picks it. The learning rate (and Adam's bias
//! corrections) are scalar inputs fed every step (`Optimizer::step_scalars`, which the runtime
//! calls), so a schedule never recompiles. The formulas follow PyTorch's `torch.optim`.

mod adam;
mod sgd;

use super::Ctx;
use crate::diag::Diagnostic;
use crate::dsl::ast::Optimizer;
use crate::ir::{DType, Graph, Group, NodeIndex, Op, Phase, TensorType};
use crate::Error;

pub use adam::{ADAM_BC2_SQRT, ADAM_STEP_SIZE};

/// The scalar input every optimizer reads: the step's learning rate.
pub const LR: &str = "lr";

/// `(state or parameter, its new value)` pairs, for `Graph::updates`.
type Updates = Vec<(NodeIndex, NodeIndex)>;

/// One optimizer: the scalar inputs it reads each step besides the learning rate, their
/// values, and the update of one parameter.
trait Method {
    /// The names of its scalar inputs besides `LR`, in the order `step_scalars` gives them.
    fn inputs(&self) -> &'static [&'static str];
    /// Their values at step `step` (from 0), whose learning rate is `lr`.
    fn step_scalars(&self, lr: f64, step: u64) -> Vec<f32>;
    /// Appends the update of parameter `p` by its (clipped) gradient `d` to `updates`; `lr`
    /// and `inputs` (those of `inputs()`) are the scalar inputs' nodes.
    fn update(
        &self,
        b: &mut Builder,
        p_d: (NodeIndex, NodeIndex),
        lr: NodeIndex,
        inputs: &[NodeIndex],
        updates: &mut Updates,
    ) -> Result<(), Error>;
}

/// The optimizer's file, with its settings.
fn method(opt: &Optimizer) -> Box<dyn Method> {
    let weight_decay = opt.weight_decay();
    match *opt {
        Optimizer::Sgd {
            momentum, nesterov, ..
        } => Box::new(sgd::Sgd {
            momentum,
            nesterov,
            weight_decay,
        }),
        Optimizer::Adam { betas, eps, .. } | Optimizer::AdamW { betas, eps, .. } => {
            Box::new(adam::Adam {
                betas,
                eps,
                weight_decay,
                decoupled: matches!(opt, Optimizer::AdamW { .. }),
            })
        }
    }
}

impl Optimizer {
    /// Every scalar input of step `step` (from 0) of `total`: the learning rate and the
    /// optimizer's own (Adam's bias corrections, as `torch.optim.Adam`).
    pub fn step_scalars(&self, step: u64, total: u64) -> Vec<(&'static str, f32)> {
        let lr = self.learning_rate(step, total);
        let m = method(self);
        let own = m.inputs().iter().copied().zip(m.step_scalars(lr, step));
        std::iter::once((LR, lr as f32)).chain(own).collect()
    }
}

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
    let grads = b.g.grads.clone();
    let grads: Vec<(NodeIndex, NodeIndex)> = match opt.clip_norm() {
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
    let m = method(opt);
    let inputs = m
        .inputs()
        .iter()
        .map(|name| b.scalar_input(name))
        .collect::<Result<Vec<_>, _>>()?;
    let mut updates = Vec::new();
    for p_d in grads {
        m.update(&mut b, p_d, lr, &inputs, &mut updates)?;
    }
    b.g.updates.extend(updates);
    Ok(())
}
