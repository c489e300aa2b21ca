//! `BatchNorm2d` as primitive ops.
//!
//! Per channel of `x [B, C, H, W]`:
//! - the batch's mean and (biased) variance, from sums over the batch and spatial axes. In a
//!   plan built per micro-shard the sums are all-reduced over every shard and divided by the
//!   whole batch's sample count, so the statistics are the whole batch's on any device count;
//! - the normalisation uses the batch's statistics when training and the running ones in an
//!   evaluation, blended per channel by the graph's `training` flag (`1 * batch + 0 * running`
//!   is exactly the batch's value, so training gets the same bits as without running
//!   statistics);
//! - in the update phase (training steps only), the running averages `{layer}.running_mean`
//!   and `{layer}.running_var` (states starting at 0 and 1) move toward the batch's by
//!   `momentum`, the variance unbiased by `n / (n - 1)`, as PyTorch's `BatchNorm2d` does.

use crate::diag::Span;
use crate::ir::{DType, Dim, Graph, Group, NodeIndex, Op, Phase, TensorType};
use crate::shards::INV_BATCH;

/// The running statistics' names after their layer's: `{layer}.running_mean`, as PyTorch's.
pub const RUNNING_MEAN: &str = "running_mean";
pub const RUNNING_VAR: &str = "running_var";

/// Whether a state is a model's running statistic (saved with its parameters), rather than
/// optimizer state.
pub fn is_running_statistic(state: &str) -> bool {
    state
        .rsplit_once('.')
        .is_some_and(|(_, what)| what == RUNNING_MEAN || what == RUNNING_VAR)
}

pub struct BatchNorm {
    pub eps: f64,
    pub momentum: f64,
    pub channels: u64,
    /// `H * W`
    pub spatial: u64,
    /// The plan is built per micro-shard: statistics are all-reduced.
    pub sharded: bool,
}

impl BatchNorm {
    /// Adds the ops normalising `x` (no affine: that is the layer's Mul and Add).
    pub fn lower(
        &self,
        g: &mut Graph,
        x: NodeIndex,
        layer: &str,
        span: Option<Span>,
    ) -> Result<NodeIndex, String> {
        let op = |g: &mut Graph, op: Op, ins: &[NodeIndex]| g.add(op, ins, layer, span);
        let scalar = TensorType::scalar(DType::F32);
        let per_channel = TensorType::f32(vec![Dim::known(self.channels)]);
        let state = |what: &str, start: f64| Op::State {
            name: format!("{layer}.{what}"),
            ty: per_channel.clone(),
            start,
        };
        let running_mean = op(g, state(RUNNING_MEAN, 0.0), &[])?;
        let running_var = op(g, state(RUNNING_VAR, 1.0), &[])?;
        let one = op(
            g,
            Op::Fill {
                value: 1.0,
                ty: scalar,
            },
            &[],
        )?;
        let training = g.training(layer)?;
        let evaluating = op(g, Op::Sub, &[one, training])?;
        // 1 / samples in the (whole) batch.
        let inv_batch = if self.sharded {
            g.scalar_input(INV_BATCH, layer)?
        } else {
            let ones = Op::Fill {
                value: 1.0,
                ty: TensorType::f32(vec![Dim::batch()]),
            };
            let ones = op(g, ones, &[])?;
            let samples = op(g, Op::ReduceSum { axes: vec![0] }, &[ones])?;
            op(g, Op::Div, &[one, samples])?
        };
        let per_sample = 1.0 / self.spatial as f64;
        // The mean over the batch and spatial axes, per channel.
        let channel_mean = |g: &mut Graph, v: NodeIndex| {
            let mut sum = op(
                g,
                Op::ReduceSum {
                    axes: vec![0, 2, 3],
                },
                &[v],
            )?;
            if self.sharded {
                let all = Op::AllReduce {
                    group: Group::Shards,
                };
                sum = op(g, all, &[sum])?;
            }
            let mean = op(g, Op::Mul, &[sum, inv_batch])?;
            op(g, Op::Scale { by: per_sample }, &[mean])
        };
        let blend = |g: &mut Graph, batch: NodeIndex, running: NodeIndex| {
            let b = op(g, Op::Mul, &[batch, training])?;
            let r = op(g, Op::Mul, &[running, evaluating])?;
            op(g, Op::Add, &[b, r])
        };
        let channels = vec![
            Dim::known(1),
            Dim::known(self.channels),
            Dim::known(1),
            Dim::known(1),
        ];
        let to_channels = |g: &mut Graph, v: NodeIndex| {
            let shape = channels.clone();
            g.add(Op::Reshape { shape }, &[v], layer, span)
        };

        let batch_mean = channel_mean(g, x)?;
        let mean = blend(g, batch_mean, running_mean)?;
        let mean = to_channels(g, mean)?;
        let centred = op(g, Op::Sub, &[x, mean])?;
        let square = op(g, Op::Mul, &[centred, centred])?;
        let batch_var = channel_mean(g, square)?;
        let var = blend(g, batch_var, running_var)?;
        let var = op(g, Op::AddScalar { value: self.eps }, &[var])?;
        let std = op(g, Op::Sqrt, &[var])?;
        let inv_std = op(g, Op::Div, &[one, std])?;
        let inv_std = to_channels(g, inv_std)?;
        let y = op(g, Op::Mul, &[centred, inv_std])?;

        let saved = std::mem::replace(&mut g.phase, Phase::Update);
        let m = self.momentum;
        let toward = |g: &mut Graph, running: NodeIndex, batch: NodeIndex| {
            let keep = op(g, Op::Scale { by: 1.0 - m }, &[running])?;
            let step = op(g, Op::Scale { by: m }, &[batch])?;
            let new = op(g, Op::Add, &[keep, step])?;
            g.updates.push((running, new));
            Ok::<(), String>(())
        };
        toward(g, running_mean, batch_mean)?;
        // n / (n - 1) = 1 / (1 - 1/n) over n = samples * H * W values; at most 2 (a single
        // value has no spread: its batch variance is 0 whatever the factor).
        let inv_n = op(g, Op::Scale { by: per_sample }, &[inv_batch])?;
        let rest = op(g, Op::Sub, &[one, inv_n])?;
        let bessel = op(g, Op::Div, &[one, rest])?;
        let bessel = op(g, Op::ClampMax { value: 2.0 }, &[bessel])?;
        let unbiased = op(g, Op::Mul, &[batch_var, bessel])?;
        toward(g, running_var, unbiased)?;
        g.phase = saved;
        Ok(y)
    }
}
