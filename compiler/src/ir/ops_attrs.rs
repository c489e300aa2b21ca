//! An op's attributes as stable text (`%3 = conv2d(%1, %2; stride=2, padding=1, groups=1)`),
//! for the IR printer and messages.

use super::*;

impl Op {
    /// Attributes as stable text, `stride=2, padding=1` (empty when none).
    pub fn attrs(&self, names: &[String]) -> String {
        let dims = |d: &[Dim]| {
            let v: Vec<String> = d.iter().map(|x| x.show(names)).collect();
            format!("[{}]", v.join(", "))
        };
        let flag = |on: bool, s: &str| if on { s.to_string() } else { String::new() };
        match self {
            Op::Input { name, .. } => format!("\"{name}\""),
            Op::Param { name, init, .. } => format!("\"{name}\", init={}", init.show()),
            Op::State { name, start, .. } if *start != 0.0 => format!("\"{name}\", start={start}"),
            Op::State { name, .. } => format!("\"{name}\""),
            Op::Fill { value, .. } => format!("value={value}"),
            Op::MatMul { trans_a, trans_b } => {
                let t: Vec<&str> = [(*trans_a, "trans_a"), (*trans_b, "trans_b")]
                    .iter()
                    .filter(|(on, _)| *on)
                    .map(|(_, s)| *s)
                    .collect();
                t.join(", ")
            }
            Op::Conv2d {
                stride,
                padding,
                groups,
            } => {
                format!("stride={stride}, padding={padding}, groups={groups}")
            }
            Op::Conv2dGradInput {
                stride,
                padding,
                groups,
                in_h,
                in_w,
            } => format!("stride={stride}, padding={padding}, groups={groups}, in={in_h}x{in_w}"),
            Op::Conv2dGradWeight {
                stride,
                padding,
                groups,
                kernel,
            } => format!("stride={stride}, padding={padding}, groups={groups}, kernel={kernel}"),
            Op::Pool2d {
                max,
                kernel,
                stride,
                padding,
            }
            | Op::Pool2dGrad {
                max,
                kernel,
                stride,
                padding,
            } => format!(
                "{}, kernel={kernel}, stride={stride}, padding={padding}",
                if *max { "max" } else { "avg" }
            ),
            Op::Reshape { shape } => dims(shape),
            Op::Permute { perm } => format!("{perm:?}"),
            Op::Concat { axis } => format!("axis={axis}"),
            Op::Slice { axis, start, len } => {
                format!("axis={axis}, start={start}, len={}", len.show(names))
            }
            Op::Pad { axis, start, size } => {
                format!("axis={axis}, start={start}, size={}", size.show(names))
            }
            Op::ScatterAdd { rows } => format!("rows={rows}"),
            Op::Scale { by } => format!("by={by}"),
            Op::AddScalar { value } | Op::ClampMax { value } => format!("value={value}"),
            Op::Softmax { causal } => flag(*causal, "causal"),
            Op::LayerNorm { eps }
            | Op::LayerNormGrad { eps }
            | Op::RmsNorm { eps }
            | Op::RmsNormGrad { eps } => format!("eps={eps:e}"),
            Op::ReduceSum { axes } | Op::ReduceMean { axes } => format!("axes={axes:?}"),
            Op::SumTo { shape } => dims(shape),
            Op::Expand { axes, shape, mean } => {
                format!("axes={axes:?}, {}{}", dims(shape), flag(*mean, ", mean"))
            }
            Op::Dropout { p, stream } => format!("p={p}, stream={stream}"),
            Op::CrossEntropy { smoothing } | Op::CrossEntropyGrad { smoothing } => {
                flag(*smoothing != 0.0, &format!("smoothing={smoothing}"))
            }
            Op::Attention { causal, scale } | Op::AttentionLse { causal, scale } => {
                format!("scale={scale}{}", flag(*causal, ", causal"))
            }
            Op::CachedAttention { scale } => format!("scale={scale}"),
            Op::AttentionGrad { causal, scale, wrt } => {
                format!("wrt={wrt:?}, scale={scale}{}", flag(*causal, ", causal"))
            }
            Op::AllReduce { group } => match group {
                Group::Shards => "group=shards".to_string(),
                Group::Tensor => "group=tensor".to_string(),
            },
            Op::Transfer { from, to } => format!("from={from}, to={to}"),
            Op::Broadcast { root } | Op::Reduce { root } => format!("root={root}"),
            Op::TensorParallelCopy
            | Op::CacheWrite
            | Op::Gather
            | Op::Add
            | Op::Sub
            | Op::Mul
            | Op::Div
            | Op::Sqrt
            | Op::Relu
            | Op::Gelu
            | Op::Tanh
            | Op::Sigmoid
            | Op::Silu
            | Op::ReluGrad
            | Op::GeluGrad
            | Op::TanhGrad
            | Op::SigmoidGrad
            | Op::SiluGrad
            | Op::RoundBf16
            | Op::SoftmaxGrad
            | Op::Training => String::new(),
        }
    }
}
