//! A decode step's key/value cache (`CacheWrite`) and attention over it (`CachedAttention`).
//! Caches are token-major `[B, S, H, D]` (the layout of a projection's output), one per
//! attention layer and operand; the rows of sample `b` at and after `pos[b] + T` are never
//! read, so a cache needs no clearing between prompts.

use super::layout::{bad, f32s, f32s_mut, typed};
use super::{math, KernelError};
use crate::cpu::tensor::Tensor;

/// `(B, S, H, D)` of a `[.., S, H, D]` tensor, the leading axes flattened.
fn dims(t: &Tensor) -> Option<(usize, usize, usize, usize)> {
    let r = t.shape.len();
    (r >= 3).then(|| {
        let b = t.shape[..r - 3].iter().product();
        (b, t.shape[r - 3], t.shape[r - 2], t.shape[r - 1])
    })
}

/// Each sample's first position, checked so that `rows` rows from it fit in `s`.
fn positions<'a>(
    op: &'static str,
    pos: &'a Tensor,
    batch: usize,
    rows: usize,
    s: usize,
) -> Result<&'a [i32], KernelError> {
    let p = typed::<i32>(op, pos, "the positions")?;
    if p.len() != batch {
        return Err(bad(
            op,
            format!("{} positions for a batch of {batch}", p.len()),
        ));
    }
    match p.iter().find(|&&x| x < 0 || x as usize + rows > s) {
        Some(x) => Err(bad(
            op,
            format!("position {x} with {rows} new row(s) is outside the cache of {s} rows"),
        )),
        None => Ok(p),
    }
}

/// `cache` with rows `pos[b]..pos[b] + T` of each sample replaced by `rows`, into `out`.
pub fn cache_write(
    cache: &Tensor,
    rows: &Tensor,
    pos: &Tensor,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    let c = f32s("cache_write", cache, "the cache")?;
    if out.shape != cache.shape {
        return Err(bad(
            "cache_write",
            format!(
                "the output {:?} is not the cache's {:?}",
                out.shape, cache.shape
            ),
        ));
    }
    f32s_mut("cache_write", out)?.copy_from_slice(c);
    write_rows(out, rows, pos)
}

/// Writes `rows [B, T, H, D]` into `cache [B, S, H, D]` at each sample's position: the
/// in-place form of [`cache_write`], what a decode step runs.
pub fn write_rows(cache: &mut Tensor, rows: &Tensor, pos: &Tensor) -> Result<(), KernelError> {
    const OP: &str = "cache_write";
    let (Some((b, s, h, d)), Some((rb, t, rh, rd))) = (dims(cache), dims(rows)) else {
        return Err(bad(OP, "the cache and the rows must be [.., S, H, D]"));
    };
    if (rb, rh, rd) != (b, h, d) || t > s {
        return Err(bad(
            OP,
            format!(
                "rows {:?} do not fit the cache {:?}",
                rows.shape, cache.shape
            ),
        ));
    }
    let p = positions(OP, pos, b, t, s)?;
    let r = f32s(OP, rows, "the rows")?;
    let c = f32s_mut(OP, cache)?;
    let row = h * d;
    for (i, &at) in p.iter().enumerate() {
        let to = (i * s + at as usize) * row;
        c[to..to + t * row].copy_from_slice(&r[i * t * row..(i + 1) * t * row]);
    }
    Ok(())
}

/// `softmax(scale * q k^T) v` per sample and head, query `t` of sample `b` over cache rows
/// `0..=pos[b] + t`: `q [B, T, H, D]`, `k [B, S, H, D]`, `v [B, S, H, E]` to `[B, T, H, E]`.
/// In f32, the scores of one query in order, then their exponentials and sum.
pub fn cached_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: &Tensor,
    scale: f64,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "cached_attention";
    let (Some((b, t, h, d)), Some((kb, s, kh, kd)), Some((vb, vs, vh, e))) =
        (dims(q), dims(k), dims(v))
    else {
        return Err(bad(OP, "q, k and v must be [.., T, H, D]"));
    };
    if (kb, kh, kd) != (b, h, d) || (vb, vs, vh) != (b, s, h) || dims(out) != Some((b, t, h, e)) {
        return Err(bad(
            OP,
            format!(
                "q {:?}, k {:?}, v {:?} and the output {:?} do not fit together",
                q.shape, k.shape, v.shape, out.shape
            ),
        ));
    }
    let p = positions(OP, pos, b, t, s)?;
    let (qv, kv, vv) = (
        f32s(OP, q, "q")?,
        f32s(OP, k, "the key cache")?,
        f32s(OP, v, "the value cache")?,
    );
    let o = f32s_mut(OP, out)?;
    let scale = scale as f32;
    let mut w = vec![0f32; s];
    for (bi, &at) in p.iter().enumerate() {
        for ti in 0..t {
            let seen = at as usize + ti + 1;
            for hi in 0..h {
                let qr = &qv[((bi * t + ti) * h + hi) * d..][..d];
                let mut mx = f32::NEG_INFINITY;
                for (j, wj) in w[..seen].iter_mut().enumerate() {
                    let kr = &kv[((bi * s + j) * h + hi) * d..][..d];
                    *wj = scale * qr.iter().zip(kr).fold(0.0f32, |a, (x, y)| a + x * y);
                    mx = mx.max(*wj);
                }
                let mut sum = 0.0f32;
                for wj in &mut w[..seen] {
                    *wj = math::exp_nonpositive(*wj - mx);
                    sum += *wj;
                }
                let or = &mut o[((bi * t + ti) * h + hi) * e..][..e];
                or.fill(0.0);
                for (j, &wj) in w[..seen].iter().enumerate() {
                    let vr = &vv[((bi * s + j) * h + hi) * e..][..e];
                    for (y, &x) in or.iter_mut().zip(vr) {
                        *y += wj * x;
                    }
                }
                for y in or.iter_mut() {
                    *y /= sum;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "cache_tests.rs"]
mod tests;
