//! The CPU's vector loops: the elementwise maps come from the op table (`ir::maps`, each
//! row's function compiled into a loop for the CPU's vector level, see
//! `parallax_compiler::scalar::simd`); here are the fixed-order sums the row kernels use.

pub use parallax_compiler::ir::maps::{Binary, Elementwise, Unary};
pub use parallax_compiler::scalar::simd::{level, Level, Operand};
pub(crate) use parallax_compiler::vectorised;

/// The f64 sum of `f(v[i])` in a fixed order that vectorises: eight running sums, over the
/// indices equal to 0..8 mod 8, then added pairwise. The order depends only on the length,
/// never on threads or the vector level. Iterating over whole chunks of the slice (not
/// indexing it) leaves no bounds checks in the loop, which kept it from vectorising (a layer
/// norm's row 2.5x slower).
#[inline(always)]
pub fn sum8(v: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    sum8_pair(v, v, |x, _| f(x))
}

/// [`sum8`] of `f(a[i], b[i])` over the shorter slice.
#[inline(always)]
pub fn sum8_pair(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f64) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f64; 8];
    let (mut ac, mut bc) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in (&mut ac).zip(&mut bc) {
        for l in 0..8 {
            acc[l] += f(x[l], y[l]);
        }
    }
    for ((s, &x), &y) in acc.iter_mut().zip(ac.remainder()).zip(bc.remainder()) {
        *s += f(x, y);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eight_lane_sums_are_exact_where_f64_is() {
        for n in [0, 1, 7, 8, 9, 63, 64, 1000] {
            let v: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
            let want: f64 = v.iter().map(|&x| x as f64).sum();
            assert_eq!(sum8(&v, |x| x as f64), want, "{n}");
            // The pair form, by lanes: lane l holds the elements l, l + 8, ...
            let w: Vec<f32> = v.iter().map(|x| x * 0.5).collect();
            let mut lanes = [0f64; 8];
            for (i, (&x, &y)) in v.iter().zip(&w).enumerate() {
                lanes[i % 8] += x as f64 * y as f64;
            }
            let by_lanes = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
                + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
            assert_eq!(
                sum8_pair(&v, &w, |x, y| x as f64 * y as f64),
                by_lanes,
                "{n}"
            );
        }
    }
}
