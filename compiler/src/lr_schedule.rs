//! Learning-rate schedules: the learning rate of each step, which the runtime feeds the
//! compiled graph with the optimizer's own scalars (`Optimizer::step_scalars`, in
//! `passes::optimizer`), so a schedule never recompiles.

use crate::dsl::ast::{Optimizer, Schedule};

impl Optimizer {
    /// The learning rate of step `step` (from 0) of `total`.
    pub fn learning_rate(&self, step: u64, total: u64) -> f64 {
        let lr = self.lr();
        let warm = |w: u64| (w > 0 && step < w).then(|| lr * (step + 1) as f64 / w as f64);
        let progress = |w: u64| {
            let span = total.saturating_sub(w).max(1) as f64;
            (step.saturating_sub(w) as f64 / span).min(1.0)
        };
        match *self.schedule() {
            Schedule::Constant => lr,
            Schedule::Step { every, gamma } => lr * gamma.powi((step / every.max(1)) as i32),
            Schedule::Cosine { warmup, min_lr } => warm(warmup).unwrap_or_else(|| {
                let p = progress(warmup);
                min_lr + (lr - min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }),
            Schedule::Linear { warmup, end_lr } => {
                warm(warmup).unwrap_or_else(|| lr + (end_lr - lr) * progress(warmup))
            }
            Schedule::Warmup { steps } => warm(steps).unwrap_or(lr),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::dsl::ast::{Optimizer, Schedule};

    fn sgd(schedule: Schedule) -> Optimizer {
        Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            clip_norm: None,
            schedule,
        }
    }

    #[test]
    fn schedules() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(sgd(Schedule::Constant).learning_rate(500, 1000), 0.1));
        let s = sgd(Schedule::Step {
            every: 10,
            gamma: 0.5,
        });
        assert!(close(s.learning_rate(9, 100), 0.1));
        assert!(close(s.learning_rate(25, 100), 0.025));
        let c = sgd(Schedule::Cosine {
            warmup: 10,
            min_lr: 0.0,
        });
        assert!(close(c.learning_rate(0, 110), 0.01));
        assert!(close(c.learning_rate(9, 110), 0.1));
        assert!(close(c.learning_rate(10, 110), 0.1));
        assert!(close(c.learning_rate(60, 110), 0.05));
        assert!(c.learning_rate(109, 110) < 0.0001);
        let l = sgd(Schedule::Linear {
            warmup: 0,
            end_lr: 0.0,
        });
        assert!(close(l.learning_rate(50, 100), 0.05));
        let w = sgd(Schedule::Warmup { steps: 4 });
        assert!(close(w.learning_rate(1, 100), 0.05));
        assert!(close(w.learning_rate(40, 100), 0.1));
    }
}
