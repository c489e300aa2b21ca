//! SGD as `torch.optim.SGD`: weight decay added to the gradient, then momentum (a buffer
//! `{param}.momentum`), Nesterov's look-ahead if asked. No scalar inputs but the learning rate.

use super::{Builder, Method, Updates};
use crate::ir::{NodeIndex, Op};
use crate::Error;

pub(super) struct Sgd {
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
}

impl Method for Sgd {
    fn inputs(&self) -> &'static [&'static str] {
        &[]
    }

    fn step_scalars(&self, _: f64, _: u64) -> Vec<f32> {
        Vec::new()
    }

    fn update(
        &self,
        b: &mut Builder,
        (p, d): (NodeIndex, NodeIndex),
        lr: NodeIndex,
        _: &[NodeIndex],
        updates: &mut Updates,
    ) -> Result<(), Error> {
        let layer = b.g.g[p].layer.clone();
        let l = layer.as_str();
        let mut d = d;
        if self.weight_decay != 0.0 {
            let decay = b.scale(p, self.weight_decay, l)?;
            d = b.bin(Op::Add, d, decay, l)?;
        }
        if self.momentum != 0.0 {
            // buf = momentum * buf + d (a zero buffer makes the first step buf = d).
            let buf = b.state(p, "momentum")?;
            let kept = b.scale(buf, self.momentum, l)?;
            let buf_new = b.bin(Op::Add, kept, d, l)?;
            updates.push((buf, buf_new));
            d = if self.nesterov {
                let ahead = b.scale(buf_new, self.momentum, l)?;
                b.bin(Op::Add, d, ahead, l)?
            } else {
                buf_new
            };
        }
        let step = b.bin(Op::Mul, d, lr, l)?;
        updates.push((p, b.bin(Op::Sub, p, step, l)?));
        Ok(())
    }
}
