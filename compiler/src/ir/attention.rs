//! The attention family of the op table (`Attention`, `AttentionLse`, `AttentionGrad`):
//! shape and cost rules. Attention is one op rather than two products and a softmax so that
//! the `T x S` scores are never stored: a value of `O(T)` per head (the output, the
//! log-sum-exp) is all the backward reads.
//!
//! The operands are token-major, `[.., T, H, D]`: each of the `H` heads is a strided matrix
//! (rows `H * D` apart), which is how a projection's output `[.., T, H * D]` is laid out, so
//! no permute runs before or after the op. One head per row, `[.., T, 1, D]`, is the plain
//! `[.., T, D]` attention.

use super::attrs::{self, Attrs};
use super::op::AttentionInput;
use super::types::TensorType;

type Rule = Result<TensorType, String>;

/// `(q [.., T, H, D], k [.., S, H, D], v [.., S, H, E])`: checked, to the output type
/// `[.., T, H, E]`, for the op `name` (`causal` if it masks keys after the query).
fn output(name: &str, causal: bool, x: &[&TensorType], names: &[String]) -> Rule {
    let (q, k, v) = (x[0], x[1], x[2]);
    let show = |t: &TensorType| t.show(names);
    if !q.dtype.is_float() || k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(format!(
            "{} needs q, k and v of one floating-point type, got {}, {} and {}",
            name,
            show(q),
            show(k),
            show(v)
        ));
    }
    let r = q.rank();
    if r < 3 || k.rank() != r || v.rank() != r {
        return Err(format!(
            "{} needs q [.., T, H, D], k [.., S, H, D] and v [.., S, H, E] of one rank (3 or more), got {}, {} and {}",
            name,
            show(q),
            show(k),
            show(v)
        ));
    }
    let (lead, heads) = (r - 3, r - 2);
    let same = |a: &TensorType, b: &TensorType| {
        a.shape[..lead] == b.shape[..lead] && a.shape[heads] == b.shape[heads]
    };
    if !same(q, k) || !same(q, v) {
        return Err(format!(
            "{}: the batch or head axes of q, k and v differ: {}, {} and {}",
            name,
            show(q),
            show(k),
            show(v)
        ));
    }
    if q.shape[r - 1] != k.shape[r - 1] {
        return Err(format!(
            "{}: queries and keys differ in width: {} and {}",
            name,
            show(q),
            show(k)
        ));
    }
    if k.shape[r - 3] != v.shape[r - 3] {
        return Err(format!(
            "{}: keys and values differ in count: {} and {}",
            name,
            show(k),
            show(v)
        ));
    }
    if causal && q.shape[r - 3] != k.shape[r - 3] {
        return Err(format!(
            "a causal {} needs as many queries as keys, got {} and {}",
            name,
            show(q),
            show(k)
        ));
    }
    let mut shape = q.shape[..r - 1].to_vec();
    shape.push(v.shape[r - 1].clone());
    Ok(TensorType::new(q.dtype, shape))
}

/// One value per query and head: `[.., T, H]`.
fn per_query(q: &TensorType) -> TensorType {
    TensorType::new(q.dtype, q.shape[..q.rank() - 1].to_vec())
}

pub fn attention_shape(
    attrs::Attention { causal, .. }: attrs::Attention,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    output(attrs::Attention::NAME, *causal, x, names)
}

pub fn attention_lse_shape(
    attrs::AttentionLse { causal, .. }: attrs::AttentionLse,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    // The values' shape does not matter to the statistics: check q and k as if v were k.
    output(
        attrs::AttentionLse::NAME,
        *causal,
        &[x[0], x[1], x[1]],
        names,
    )?;
    Ok(per_query(x[0]))
}

pub fn attention_grad_shape(
    attrs::AttentionGrad { causal, wrt, .. }: attrs::AttentionGrad,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let y = output(attrs::AttentionGrad::NAME, *causal, &x[..3], names)?;
    if x[3] != &y {
        return Err(format!(
            "attention_grad: the output's gradient must be {}, got {}",
            y.show(names),
            x[3].show(names)
        ));
    }
    let rows = per_query(x[0]);
    for (what, t) in [("lse", x[4]), ("delta", x[5])] {
        if t != &rows {
            return Err(format!(
                "attention_grad: `{what}` must be {}, got {}",
                rows.show(names),
                t.show(names)
            ));
        }
    }
    Ok(x[wrt.index()].clone())
}

/// The sizes of one attention, read from its operands' concrete shapes as a kernel gets
/// them: `problems` (the batch axes' product times `heads`) of `t` queries and `s` keys of
/// width `d`, values of width `e` (0 without values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    pub problems: u64,
    pub heads: u64,
    pub t: u64,
    pub s: u64,
    pub d: u64,
    pub e: u64,
}

impl Sizes {
    /// Checks `q [.., T, H, D]`, `k [.., S, H, D]` and `v [.., S, H, E]` (one batch shape
    /// `..`; without `v`, `k` stands in for it and `e` is 0), and `T = S` where
    /// `same_length` (a causal attention over its own sequence): the sizes, or what is wrong.
    /// The CPU's kernels and the generated ones both check their operands here.
    pub fn of<T>(q: &[T], k: &[T], v: Option<&[T]>, same_length: bool) -> Result<Sizes, String>
    where
        T: Copy + PartialEq + std::fmt::Debug + TryInto<u64>,
    {
        let r = q.len();
        let vs = v.unwrap_or(k);
        // The batch axes and the heads, which all three share. No allocation: the CPU's
        // kernels check here at every step.
        let like_q = |o: &[T]| o.len() == r && o[..r - 3] == q[..r - 3] && o[r - 2] == q[r - 2];
        let fits =
            r >= 3 && like_q(k) && like_q(vs) && q[r - 1] == k[r - 1] && k[r - 3] == vs[r - 3];
        if !fits {
            return Err(format!(
                "needs q [.., T, H, D], k [.., S, H, D], v [.., S, H, E], got {q:?}, {k:?}, {vs:?}"
            ));
        }
        let n = |x: T| x.try_into().unwrap_or(u64::MAX);
        let heads = n(q[r - 2]);
        let sizes = Sizes {
            problems: q[..r - 3].iter().map(|&x| n(x)).product::<u64>() * heads,
            heads,
            t: n(q[r - 3]),
            s: n(k[r - 3]),
            d: n(q[r - 1]),
            e: v.map_or(0, |v| n(v[r - 1])),
        };
        if same_length && sizes.t != sizes.s {
            return Err(format!(
                "a causal attention needs T = S, got T = {} and S = {}",
                sizes.t, sizes.s
            ));
        }
        Ok(sizes)
    }
}

/// `(problems, T, S, D, E)` of operands `q, k, v` (or `q, k`: `E = D`), problems being
/// batch times heads, and the share of the `T x S` scores a `causal` mask keeps (about half).
fn sizes(causal: bool, ins: &[Vec<u64>]) -> (u64, u64, u64, u64, u64, f64) {
    let (q, k) = (&ins[0], &ins[1]);
    let r = q.len();
    let at = |s: &Vec<u64>, i: usize| s.get(i).copied().unwrap_or(1);
    let heads = at(q, r.wrapping_sub(2));
    let batch: u64 = q.iter().take(r.saturating_sub(3)).product::<u64>() * heads;
    let (t, d) = (at(q, r.wrapping_sub(3)), at(q, r.wrapping_sub(1)));
    let s = at(k, r.wrapping_sub(3));
    let e = ins.get(2).map_or(d, |v| at(v, r.wrapping_sub(1)));
    (batch, t, s, d, e, if causal { 0.5 } else { 1.0 })
}

fn scaled(n: u64, share: f64) -> u64 {
    (n as f64 * share) as u64
}

/// The forward: `2 T S (D + E)` for the two products and about 5 per score for the online
/// softmax.
pub fn attention_flops(
    attrs::Attention { causal, .. }: attrs::Attention,
    ins: &[Vec<u64>],
    _: &[u64],
) -> u64 {
    let (batch, t, s, d, e, share) = sizes(*causal, ins);
    let scores = batch.saturating_mul(t).saturating_mul(s);
    scaled(scores.saturating_mul(2 * (d + e) + 5), share)
}

/// `AttentionLse` runs inside the same kernel as `Attention`: only its per-row log is its own.
pub fn attention_lse_flops(_: attrs::AttentionLse, ins: &[Vec<u64>], _: &[u64]) -> u64 {
    let (batch, t, ..) = sizes(false, ins);
    batch.saturating_mul(t)
}

/// The backward, as it runs (the key and value gradients in one kernel): the query's pass
/// recomputes the scores and `dP` (`2 T S (D + E)`) and multiplies `dS K`; the keys' pass
/// recomputes both too and multiplies `dS^T Q`; the values' `P^T dy` shares that pass.
pub fn attention_grad_flops(
    attrs::AttentionGrad { causal, wrt, .. }: attrs::AttentionGrad,
    ins: &[Vec<u64>],
    _: &[u64],
) -> u64 {
    let (batch, t, s, d, e, share) = sizes(*causal, ins);
    let scores = batch.saturating_mul(t).saturating_mul(s);
    let per_score = match wrt {
        AttentionInput::Value => 2 * e + 1,
        _ => 2 * (d + e) + 2 * d + 5,
    };
    scaled(scores.saturating_mul(per_score), share)
}

/// `pos [..]`: one integer per leading index of `of` (`[.., T, H, D]`).
fn positions(what: &str, of: &TensorType, pos: &TensorType, names: &[String]) -> Rule {
    let lead = &of.shape[..of.rank() - 3];
    if pos.dtype.is_float() || pos.shape != lead {
        let want = TensorType::new(super::types::DType::I32, lead.to_vec());
        return Err(format!(
            "{what}: the positions must be integers {}, got {}",
            want.show(names),
            pos.show(names)
        ));
    }
    Ok(of.clone())
}

/// `(cache [.., S, H, D], rows [.., T, H, D], pos [..])` to the cache's type; `T <= S`.
pub fn cache_write_shape(_: attrs::CacheWrite, x: &[&TensorType], names: &[String]) -> Rule {
    let (cache, rows) = (x[0], x[1]);
    let r = cache.rank();
    let fits = r >= 3
        && rows.rank() == r
        && rows.dtype == cache.dtype
        && rows.shape[..r - 3] == cache.shape[..r - 3]
        && rows.shape[r - 2..] == cache.shape[r - 2..]
        && match (rows.shape[r - 3].as_known(), cache.shape[r - 3].as_known()) {
            (Some(t), Some(s)) => t <= s,
            _ => false,
        };
    if !fits {
        return Err(format!(
            "cache_write needs a cache [.., S, H, D] and rows [.., T, H, D] of one type with known T <= S, got {} and {}",
            cache.show(names),
            rows.show(names)
        ));
    }
    positions("cache_write", cache, x[2], names)
}

/// `(q [.., T, H, D], k [.., S, H, D], v [.., S, H, E], pos [..])` to `[.., T, H, E]`.
pub fn cached_attention_shape(
    _: attrs::CachedAttention,
    x: &[&TensorType],
    names: &[String],
) -> Rule {
    let y = output(attrs::CachedAttention::NAME, false, &x[..3], names)?;
    positions("cached_attention", x[0], x[3], names)?;
    Ok(y)
}

/// The products over the whole cache (the kernel reads only rows up to the position, so
/// this is the most one step costs) and about 5 per score for the softmax.
pub fn cached_attention_flops(_: attrs::CachedAttention, ins: &[Vec<u64>], _: &[u64]) -> u64 {
    let (batch, t, s, d, e, _) = sizes(false, ins);
    batch
        .saturating_mul(t)
        .saturating_mul(s)
        .saturating_mul(2 * (d + e) + 5)
}
