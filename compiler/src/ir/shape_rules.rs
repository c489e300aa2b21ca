//! The shape rules of the op table: each infers an op's output type from its operands and
//! explains a mismatch with both shapes. Each takes its op's attributes (`attrs`), binding
//! the ones it reads.

use super::attrs::{self, Attrs};
use super::dim::Dim;
use super::types::{DType, TensorType};

type Rule = Result<TensorType, String>;

#[path = "shape_rules_windows.rs"]
mod windows;
pub use windows::*;

fn show(names: &[String], t: &TensorType) -> String {
    t.show(names)
}

/// A source's declared type.
pub fn input_shape(attrs::Input { ty, .. }: attrs::Input, _: &[&TensorType], _: &[String]) -> Rule {
    Ok(ty.clone())
}

pub fn param_shape(attrs::Param { ty, .. }: attrs::Param, _: &[&TensorType], _: &[String]) -> Rule {
    Ok(ty.clone())
}

pub fn state_shape(attrs::State { ty, .. }: attrs::State, _: &[&TensorType], _: &[String]) -> Rule {
    Ok(ty.clone())
}

pub fn fill_shape(attrs::Fill { ty, .. }: attrs::Fill, _: &[&TensorType], _: &[String]) -> Rule {
    Ok(ty.clone())
}

/// The training flag: an f32 scalar.
pub fn training_shape(_: attrs::Training, _: &[&TensorType], _: &[String]) -> Rule {
    Ok(TensorType::scalar(DType::F32))
}

/// The operand's type, whatever its dtype (data movement).
pub fn any_same(_: impl Attrs, x: &[&TensorType], _: &[String]) -> Rule {
    Ok(x[0].clone())
}

pub fn float_same(_: impl Attrs, x: &[&TensorType], names: &[String]) -> Rule {
    if !x[0].dtype.is_float() {
        return Err(format!(
            "expects a floating-point tensor, got {}",
            show(names, x[0])
        ));
    }
    Ok(x[0].clone())
}

/// Two operands of one float type (a forward value and its gradient): that type.
pub fn same_pair<A: Attrs>(op: A, x: &[&TensorType], names: &[String]) -> Rule {
    if x[0] != x[1] {
        return Err(format!(
            "{} needs two operands of one type, got {} and {}",
            A::NAME,
            show(names, x[0]),
            show(names, x[1])
        ));
    }
    float_same(op, x, names)
}

fn known(d: &Dim, what: &str) -> Result<u64, String> {
    d.as_known()
        .ok_or_else(|| format!("{what} must be a known size, not symbolic"))
}

/// Numpy broadcasting, aligned at the last axis.
pub fn broadcast(a: &TensorType, b: &TensorType, names: &[String]) -> Rule {
    if a.dtype != b.dtype {
        return Err(format!(
            "element types differ: {} and {}",
            show(names, a),
            show(names, b)
        ));
    }
    let rank = a.rank().max(b.rank());
    let one = Dim::known(1);
    let mut shape = Vec::with_capacity(rank);
    for i in 0..rank {
        let da = (i + a.rank())
            .checked_sub(rank)
            .map_or(&one, |j| &a.shape[j]);
        let db = (i + b.rank())
            .checked_sub(rank)
            .map_or(&one, |j| &b.shape[j]);
        let d = if da == db || *db == one {
            da
        } else if *da == one {
            db
        } else {
            return Err(format!(
                "shapes {} and {} do not broadcast",
                show(names, a),
                show(names, b)
            ));
        };
        shape.push(d.clone());
    }
    Ok(TensorType::new(a.dtype, shape))
}

pub fn broadcast_shape(_: impl Attrs, x: &[&TensorType], names: &[String]) -> Rule {
    broadcast(x[0], x[1], names)
}

pub fn matmul_shape(
    attrs::MatMul { trans_a, trans_b }: attrs::MatMul,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let (a, b) = (x[0], x[1]);
    if a.rank() < 2 || b.rank() < 2 {
        return Err(format!(
            "matmul needs operands of rank 2 or more, got {} and {}",
            show(names, a),
            show(names, b)
        ));
    }
    if !a.dtype.is_float() || a.dtype != b.dtype {
        return Err(format!(
            "matmul needs two floating-point operands of one type, got {} and {}",
            show(names, a),
            show(names, b)
        ));
    }
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k) = if *trans_a {
        (&a.shape[ra - 1], &a.shape[ra - 2])
    } else {
        (&a.shape[ra - 2], &a.shape[ra - 1])
    };
    let (kb, n) = if *trans_b {
        (&b.shape[rb - 1], &b.shape[rb - 2])
    } else {
        (&b.shape[rb - 2], &b.shape[rb - 1])
    };
    if k != kb {
        return Err(format!(
            "inner dimensions differ: {} x {}",
            show(names, a),
            show(names, b)
        ));
    }
    let batch_a = &a.shape[..ra - 2];
    let batch_b = &b.shape[..rb - 2];
    if !batch_b.is_empty() && batch_a != batch_b {
        return Err(format!(
            "batch dimensions differ: {} x {}",
            show(names, a),
            show(names, b)
        ));
    }
    let mut shape = batch_a.to_vec();
    shape.push(m.clone());
    shape.push(n.clone());
    Ok(TensorType::new(a.dtype, shape))
}

pub fn reshape_shape(
    attrs::Reshape { shape }: attrs::Reshape,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let to = TensorType::new(x[0].dtype, shape.clone());
    if x[0].numel() != to.numel() {
        return Err(format!(
            "cannot reshape {} to {}: element counts differ",
            show(names, x[0]),
            show(names, &to)
        ));
    }
    Ok(to)
}

pub fn permute_shape(
    attrs::Permute { perm }: attrs::Permute,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let mut seen = vec![false; x[0].rank()];
    if perm.len() != x[0].rank()
        || perm
            .iter()
            .any(|&p| p >= seen.len() || std::mem::replace(&mut seen[p], true))
    {
        return Err(format!(
            "{perm:?} is not a permutation of the {} axes of {}",
            x[0].rank(),
            show(names, x[0])
        ));
    }
    let shape = perm.iter().map(|&p| x[0].shape[p].clone()).collect();
    Ok(TensorType::new(x[0].dtype, shape))
}

pub fn concat_shape(
    attrs::Concat { axis }: attrs::Concat,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let (a, b) = (x[0], x[1]);
    if a.rank() != b.rank() || *axis >= a.rank() || a.dtype != b.dtype {
        return Err(format!(
            "cannot concatenate {} and {} along axis {axis}",
            show(names, a),
            show(names, b)
        ));
    }
    for i in 0..a.rank() {
        if i != *axis && a.shape[i] != b.shape[i] {
            return Err(format!(
                "cannot concatenate {} and {} along axis {axis}: axis {i} differs",
                show(names, a),
                show(names, b)
            ));
        }
    }
    let sa = known(&a.shape[*axis], "the concatenated axis")?;
    let sb = known(&b.shape[*axis], "the concatenated axis")?;
    let mut shape = a.shape.clone();
    let total = sa
        .checked_add(sb)
        .ok_or_else(|| format!("the concatenated axis is too large ({sa} + {sb})"))?;
    shape[*axis] = Dim::known(total);
    Ok(TensorType::new(a.dtype, shape))
}

pub fn slice_shape(
    attrs::Slice { axis, start, len }: attrs::Slice,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let t = x[0];
    if *axis >= t.rank() {
        return Err(format!(
            "axis {axis} is out of range for {}",
            show(names, t)
        ));
    }
    if let (Some(size), Some(l)) = (t.shape[*axis].as_known(), len.as_known()) {
        if start.saturating_add(l) > size {
            return Err(format!(
                "slice [{start}, {start}+{l}) is outside axis {axis} of {}",
                show(names, t)
            ));
        }
    }
    let mut shape = t.shape.clone();
    shape[*axis] = len.clone();
    Ok(TensorType::new(t.dtype, shape))
}

pub fn pad_shape(
    attrs::Pad { axis, start, size }: attrs::Pad,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let t = x[0];
    if *axis >= t.rank() {
        return Err(format!(
            "axis {axis} is out of range for {}",
            show(names, t)
        ));
    }
    if let (Some(total), Some(l)) = (size.as_known(), t.shape[*axis].as_known()) {
        if start.saturating_add(l) > total {
            return Err(format!(
                "{} does not fit in {total} at {start}",
                show(names, t)
            ));
        }
    }
    let mut shape = t.shape.clone();
    shape[*axis] = size.clone();
    Ok(TensorType::new(t.dtype, shape))
}

pub fn softmax_shape(op: attrs::Softmax, x: &[&TensorType], names: &[String]) -> Rule {
    let t = last_axis_norm(op, x, names)?;
    if *op.causal && (t.rank() < 2 || t.shape[t.rank() - 1] != t.shape[t.rank() - 2]) {
        return Err(format!(
            "a causal softmax needs square [.., S, S] scores, got {}",
            show(names, &t)
        ));
    }
    Ok(t)
}

pub fn last_axis_norm<A: Attrs>(op: A, x: &[&TensorType], names: &[String]) -> Rule {
    let t = float_same(op, x, names)?;
    if t.rank() == 0 {
        return Err(format!("{} needs at least one axis", A::NAME));
    }
    Ok(t)
}

pub fn reduce_sum_shape(
    attrs::ReduceSum { axes }: attrs::ReduceSum,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    reduced(axes, x[0], names)
}

pub fn reduce_mean_shape(
    attrs::ReduceMean { axes }: attrs::ReduceMean,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    reduced(axes, x[0], names)
}

/// `t` without `axes`, checked.
fn reduced(axes: &[usize], t: &TensorType, names: &[String]) -> Rule {
    if axes.iter().any(|&a| a >= t.rank()) || axes.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!(
            "axes {axes:?} must be ascending axes of {}",
            show(names, t)
        ));
    }
    let shape = (0..t.rank())
        .filter(|i| !axes.contains(i))
        .map(|i| t.shape[i].clone())
        .collect();
    Ok(TensorType::new(t.dtype, shape))
}

pub fn sum_to_shape(
    attrs::SumTo { shape }: attrs::SumTo,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let to = TensorType::new(x[0].dtype, shape.clone());
    match broadcast(x[0], &to, names) {
        Ok(b) if b == *x[0] => Ok(to),
        _ => Err(format!(
            "{} does not sum down to {}",
            show(names, x[0]),
            show(names, &to)
        )),
    }
}

pub fn expand_shape(
    attrs::Expand { axes, shape, .. }: attrs::Expand,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let kept: Vec<Dim> = (0..shape.len())
        .filter(|i| !axes.contains(i))
        .map(|i| shape[i].clone())
        .collect();
    if kept != x[0].shape || axes.iter().any(|&a| a >= shape.len()) {
        return Err(format!(
            "{} does not expand along {axes:?} to {:?}",
            show(names, x[0]),
            shape.iter().map(|d| d.show(names)).collect::<Vec<_>>()
        ));
    }
    Ok(TensorType::new(x[0].dtype, shape.clone()))
}

pub fn gather_shape(_: attrs::Gather, x: &[&TensorType], names: &[String]) -> Rule {
    let (table, idx) = (x[0], x[1]);
    if table.rank() != 2 || !table.dtype.is_float() {
        return Err(format!(
            "gather needs a float table [V, D], got {}",
            show(names, table)
        ));
    }
    if idx.dtype.is_float() {
        return Err(format!(
            "indices must be integers (dtype: I32), got {}",
            show(names, idx)
        ));
    }
    let mut shape = idx.shape.clone();
    shape.push(table.shape[1].clone());
    Ok(TensorType::new(table.dtype, shape))
}

pub fn scatter_add_shape(
    attrs::ScatterAdd { rows }: attrs::ScatterAdd,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let (idx, dy) = (x[0], x[1]);
    if idx.dtype.is_float()
        || dy.rank() != idx.rank() + 1
        || dy.shape[..idx.rank()] != idx.shape[..]
    {
        return Err(format!(
            "scatter_add needs indices [..] and values [.., D], got {} and {}",
            show(names, idx),
            show(names, dy)
        ));
    }
    Ok(TensorType::new(
        dy.dtype,
        vec![Dim::known(*rows), dy.shape[dy.rank() - 1].clone()],
    ))
}

fn labels_match(logits: &TensorType, labels: &TensorType, names: &[String]) -> Result<(), String> {
    if logits.rank() == 0 || !logits.dtype.is_float() {
        return Err(format!(
            "cross-entropy needs float logits [.., classes], got {}",
            show(names, logits)
        ));
    }
    if labels.dtype.is_float() || labels.shape[..] != logits.shape[..logits.rank() - 1] {
        let want = TensorType::new(DType::I32, logits.shape[..logits.rank() - 1].to_vec());
        return Err(format!(
            "labels must be {} for logits {}, got {}",
            show(names, &want),
            show(names, logits),
            show(names, labels)
        ));
    }
    Ok(())
}

pub fn xent_shape(_: attrs::CrossEntropy, x: &[&TensorType], names: &[String]) -> Rule {
    labels_match(x[0], x[1], names)?;
    Ok(TensorType::scalar(DType::F32))
}

pub fn xent_grad_shape(_: attrs::CrossEntropyGrad, x: &[&TensorType], names: &[String]) -> Rule {
    labels_match(x[0], x[1], names)?;
    if x[2].rank() != 0 {
        return Err(format!(
            "the loss gradient must be a scalar, got {}",
            show(names, x[2])
        ));
    }
    Ok(x[0].clone())
}
