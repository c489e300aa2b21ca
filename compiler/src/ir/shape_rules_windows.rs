//! The shape rules of the sliding-window ops: convolutions (and their two gradients) and
//! poolings (and their gradient), with the window arithmetic every backend shares.

use super::super::attrs;
use super::super::dim::Dim;
use super::super::types::TensorType;
use super::{known, show, Rule};

/// `(size + 2 padding - kernel) / stride + 1`, if at least 1 (`None` for a zero kernel or
/// stride): the one rule, which the CPU's kernels and the generated ones read too.
pub fn window_out(size: u64, kernel: u64, stride: u64, padding: u64) -> Option<u64> {
    let padded = size.checked_add(padding.checked_mul(2)?)?;
    if stride == 0 || kernel == 0 || padded < kernel {
        return None;
    }
    Some((padded - kernel) / stride + 1)
}

fn rank4(t: &TensorType, what: &str, names: &[String]) -> Result<(), String> {
    if t.rank() != 4 {
        return Err(format!(
            "{what} must be [N, C, H, W], got {}",
            show(names, t)
        ));
    }
    Ok(())
}

/// The output of a convolution of `x` by `w`, checked.
fn conv_out(
    x: &TensorType,
    w: &TensorType,
    stride: u64,
    padding: u64,
    groups: u64,
    names: &[String],
) -> Rule {
    rank4(x, "the convolution's input", names)?;
    rank4(w, "the convolution's weights", names)?;
    let c = known(&x.shape[1], "the channel count")?;
    let (h, wd) = (
        known(&x.shape[2], "the height")?,
        known(&x.shape[3], "the width")?,
    );
    let o = known(&w.shape[0], "the output channel count")?;
    let (cg, kh, kw) = (
        known(&w.shape[1], "channels per group")?,
        known(&w.shape[2], "the kernel height")?,
        known(&w.shape[3], "the kernel width")?,
    );
    if groups == 0 || c % groups != 0 || o % groups != 0 || cg * groups != c {
        return Err(format!(
            "{c} input and {o} output channels do not split into {groups} groups of {cg}"
        ));
    }
    let (Some(ho), Some(wo)) = (
        window_out(h, kh, stride, padding),
        window_out(wd, kw, stride, padding),
    ) else {
        return Err(format!(
            "a {kh}x{kw} kernel does not fit a {h}x{wd} input with padding {padding}"
        ));
    };
    Ok(TensorType::new(
        x.dtype,
        vec![
            x.shape[0].clone(),
            Dim::known(o),
            Dim::known(ho),
            Dim::known(wo),
        ],
    ))
}

pub fn conv_shape(
    attrs::Conv2d {
        stride,
        padding,
        groups,
    }: attrs::Conv2d,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    conv_out(x[0], x[1], *stride, *padding, *groups, names)
}

pub fn conv_grad_input_shape(
    attrs::Conv2dGradInput {
        stride,
        padding,
        groups,
        in_h,
        in_w,
    }: attrs::Conv2dGradInput,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let (dy, w) = (x[0], x[1]);
    rank4(dy, "the output gradient", names)?;
    rank4(w, "the weights", names)?;
    let c = known(&w.shape[1], "channels per group")? * groups;
    let input = TensorType::new(
        dy.dtype,
        vec![
            dy.shape[0].clone(),
            Dim::known(c),
            Dim::known(*in_h),
            Dim::known(*in_w),
        ],
    );
    let out = conv_out(&input, w, *stride, *padding, *groups, names)?;
    matches_output(dy, &out, "convolution", names)?;
    Ok(input)
}

pub fn conv_grad_weight_shape(
    attrs::Conv2dGradWeight {
        stride,
        padding,
        groups,
        kernel,
    }: attrs::Conv2dGradWeight,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let (input, dy) = (x[0], x[1]);
    rank4(input, "the convolution's input", names)?;
    rank4(dy, "the output gradient", names)?;
    let c = known(&input.shape[1], "the channel count")?;
    let o = known(&dy.shape[1], "the output channel count")?;
    if *groups == 0 || c % groups != 0 {
        return Err(format!("{c} channels do not split into {groups} groups"));
    }
    let w = TensorType::new(
        input.dtype,
        vec![
            Dim::known(o),
            Dim::known(c / groups),
            Dim::known(*kernel),
            Dim::known(*kernel),
        ],
    );
    let out = conv_out(input, &w, *stride, *padding, *groups, names)?;
    matches_output(dy, &out, "convolution", names)?;
    Ok(w)
}

/// The output of a pooling of `inp` by a `kernel` square window, checked.
fn pool_out(kernel: u64, stride: u64, padding: u64, inp: &TensorType, names: &[String]) -> Rule {
    rank4(inp, "pooling's input", names)?;
    if padding * 2 > kernel {
        return Err(format!(
            "padding {padding} is more than half the kernel {kernel}"
        ));
    }
    let (h, w) = (
        known(&inp.shape[2], "the height")?,
        known(&inp.shape[3], "the width")?,
    );
    let (Some(ho), Some(wo)) = (
        window_out(h, kernel, stride, padding),
        window_out(w, kernel, stride, padding),
    ) else {
        return Err(format!(
            "a {kernel}x{kernel} window does not fit a {h}x{w} input"
        ));
    };
    let mut shape = inp.shape.clone();
    shape[2] = Dim::known(ho);
    shape[3] = Dim::known(wo);
    Ok(TensorType::new(inp.dtype, shape))
}

pub fn pool_shape(
    attrs::Pool2d {
        kernel,
        stride,
        padding,
        ..
    }: attrs::Pool2d,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    pool_out(*kernel, *stride, *padding, x[0], names)
}

pub fn pool_grad_shape(
    attrs::Pool2dGrad {
        kernel,
        stride,
        padding,
        ..
    }: attrs::Pool2dGrad,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let out = pool_out(*kernel, *stride, *padding, x[0], names)?;
    matches_output(x[1], &out, "pooling", names)?;
    Ok(x[0].clone())
}

/// A gradient `dy` of the `op`'s output, which has the type `out`.
fn matches_output(
    dy: &TensorType,
    out: &TensorType,
    op: &str,
    names: &[String],
) -> Result<(), String> {
    if dy == out {
        return Ok(());
    }
    Err(format!(
        "the gradient {} does not match the {op}'s output {}",
        show(names, dy),
        show(names, out)
    ))
}

#[cfg(test)]
mod tests {
    use super::window_out;

    #[test]
    fn window_arithmetic_and_its_refusals() {
        // (size + 2 padding - kernel) / stride + 1, as PyTorch's Conv2d and MaxPool2d size it.
        assert_eq!(window_out(28, 3, 1, 1), Some(28));
        assert_eq!(window_out(28, 2, 2, 0), Some(14));
        assert_eq!(window_out(7, 3, 2, 1), Some(4));
        // A window larger than the padded input, a zero kernel or stride, an overflow.
        assert_eq!(window_out(3, 5, 1, 0), None);
        assert_eq!(window_out(3, 5, 1, 1), Some(1));
        assert_eq!(window_out(5, 0, 1, 0), None);
        assert_eq!(window_out(5, 3, 0, 0), None);
        assert_eq!(window_out(u64::MAX, 3, 1, 1), None);
    }
}
