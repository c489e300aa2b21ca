//! Adam and AdamW as `torch.optim.Adam` / `AdamW`: moments `{param}.adam_m` and
//! `{param}.adam_v`, weight decay added to the gradient (Adam) or decoupled (AdamW), and the
//! bias corrections fed each step as two scalar inputs, so a schedule never recompiles.

use super::{Builder, Method, Updates};
use crate::ir::{NodeIndex, Op};
use crate::Error;

/// `lr / (1 - beta1^t)`
pub const ADAM_STEP_SIZE: &str = "adam_step_size";
/// `sqrt(1 - beta2^t)`
pub const ADAM_BC2_SQRT: &str = "adam_bc2_sqrt";

pub(super) struct Adam {
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW: the decay shrinks the parameter instead of joining the gradient.
    pub decoupled: bool,
}

impl Method for Adam {
    fn inputs(&self) -> &'static [&'static str] {
        &[ADAM_STEP_SIZE, ADAM_BC2_SQRT]
    }

    /// The step size `lr / (1 - beta1^t)` and `sqrt(1 - beta2^t)`, `t = step + 1`.
    fn step_scalars(&self, lr: f64, step: u64) -> Vec<f32> {
        let t = (step + 1) as i32;
        vec![
            (lr / (1.0 - self.betas.0.powi(t))) as f32,
            (1.0 - self.betas.1.powi(t)).sqrt() as f32,
        ]
    }

    fn update(
        &self,
        b: &mut Builder,
        (p, d): (NodeIndex, NodeIndex),
        lr: NodeIndex,
        inputs: &[NodeIndex],
        updates: &mut Updates,
    ) -> Result<(), Error> {
        let layer = b.g.g[p].layer.clone();
        let l = layer.as_str();
        let (step_size, bc2_sqrt) = (inputs[0], inputs[1]);
        let mut d = d;
        let mut base = p;
        if self.weight_decay != 0.0 {
            let decay = b.scale(p, self.weight_decay, l)?;
            if self.decoupled {
                // p = p - lr * wd * p
                let shrink = b.bin(Op::Mul, decay, lr, l)?;
                base = b.bin(Op::Sub, p, shrink, l)?;
            } else {
                d = b.bin(Op::Add, d, decay, l)?;
            }
        }
        let (b1, b2) = self.betas;
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
        let denom = b.op(Op::AddScalar { value: self.eps }, &[root], l)?;
        let ratio = b.bin(Op::Div, m_new, denom, l)?;
        let step = b.bin(Op::Mul, ratio, step_size, l)?;
        updates.push((m, m_new));
        updates.push((v, v_new));
        updates.push((p, b.bin(Op::Sub, base, step, l)?));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::dsl::ast::{Optimizer, Schedule};

    #[test]
    fn adam_bias_corrections() {
        let a = Optimizer::Adam {
            lr: 0.001,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            clip_norm: None,
            schedule: Schedule::Constant,
        };
        let s = a.step_scalars(0, 10);
        assert_eq!(s[0].0, "lr");
        assert!((s[1].1 - 0.01).abs() < 1e-7); // 0.001 / (1 - 0.9)
        assert!((s[2].1 - 0.001f32.sqrt()).abs() < 1e-7); // sqrt(1 - 0.999)
    }
}
