//! Transcendental functions for the kernels, written without branches or library calls so
//! that a loop over them compiles to vector instructions (see `simd`). Each is a plain
//! sequence of f32 adds, multiplies, fused multiply-adds, divides and selects, which IEEE 754
//! rounds the same way at any vector width, so the scalar and vector forms give the same bits.
//! Polynomials run in fused multiply-adds: half the instructions and a shorter dependency
//! chain (GELU 0.78 -> 0.65 ms and its gradient 2.1 -> 1.5 ms over 1M elements, one thread).

use std::f32::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};

/// Adding then subtracting this rounds an f32 of magnitude below 2^22 to the nearest integer.
const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23

/// `c[0] x^(n-1) + ... + c[n-1]` by Horner's rule in fused multiply-adds.
#[inline(always)]
fn poly(x: f32, c: &[f32]) -> f32 {
    c[1..].iter().fold(c[0], |acc, &k| acc.mul_add(x, k))
}

/// `e^x` to within 2 ulp (Cephes' `expf`: `x = k ln 2 + r`, a degree-6 polynomial for `e^r`,
/// `2^k` built in the exponent bits). Overflows to infinity above 88.72, is 0 below -103.97
/// (subnormal results on the way), and keeps NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const HI: f32 = 88.722_84;
    const LO: f32 = -103.972_08;
    let (y, ki) = exp_parts(x.clamp(LO, HI));
    // `2^k` as two factors, each a normal number for every `k` in [-150, 128].
    let k1 = ki >> 1;
    let v = (y * two_to(k1)) * two_to(ki - k1);
    if x > HI {
        f32::INFINITY
    } else if x < LO {
        0.0
    } else {
        v
    }
}

/// `e^x` for `x <= 0` (a score less its softmax's maximum) with results below 1.22e-38 (`x <
/// -87.3`: the subnormal ones among them) flushed to 0: the same bits as [`exp`] wherever
/// that is at least 1.22e-38 (one power-of-two factor then makes the same product as two,
/// both exact), in fewer instructions, and no subnormal probabilities: a product reading
/// them takes microcode assists (attention with scores 16 times the bench model's ran
/// 30-45% slower). A GPU's `ex2.approx.ftz` flushes them too. Positive `x` gives 1: outside
/// the contract.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LO: f32 = -87.3;
    let (y, ki) = exp_parts(x.clamp(LO, 0.0));
    let v = y * two_to(ki);
    if x < LO {
        0.0
    } else {
        v
    }
}

/// `e^x` as `y 2^k` for a clamped `x`: `y = e^r` by the polynomial, `k` as an integer.
#[inline(always)]
fn exp_parts(xc: f32) -> (f32, i32) {
    let shifted = xc * std::f32::consts::LOG2_E + ROUND;
    let k = shifted - ROUND;
    // The integer k from the mantissa bits (a float-to-int conversion would not vectorise).
    let ki = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    // ln 2 in two parts so that `k * LN2_HI` is exact.
    let r = (xc - k * 0.693_359_4) - k * -2.121_944_4e-4;
    let p = poly(
        r,
        &[
            1.987_569_1e-4,
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            0.166_666_65,
            0.5,
        ],
    );
    (p.mul_add(r * r, r) + 1.0, ki)
}

/// `2^e` for `e` in [-126, 127], built in the exponent bits.
#[inline(always)]
fn two_to(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// `tanh(x)` (Cephes' `tanhf`): an odd polynomial below 0.625, else `1 - 2 / (e^2|x| + 1)`.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let s = x * x;
    let small = ((((-5.704_988_7e-3 * s + 2.063_909e-2) * s - 5.373_971_6e-2) * s + 0.133_314_42)
        * s
        - 0.333_332_8)
        * s
        * x
        + x;
    let large = (1.0 - 2.0 / (exp(2.0 * a) + 1.0)).copysign(x);
    if a < 0.625 {
        small
    } else {
        large
    }
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// erf to within 4e-7: `x P(x^2) / Q(x^2)` on |x| <= 3.92 (a degree-5/5 rational fit of
/// erf(x)/x, weighted for absolute error, made for this function; beyond 3.92 erf is 1 in
/// f32). No `exp` and one division, so it is cheaper than a form in `exp(-x^2)`.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let x = x.clamp(-3.92, 3.92);
    let u = x * x;
    let p = poly(
        u,
        &[
            2.069_511e-6,
            2.862_224_6e-4,
            3.762_944e-3,
            5.273_993_7e-2,
            0.190_157_07,
            FRAC_2_SQRT_PI,
        ],
    );
    let q = poly(
        u,
        &[
            3.836_489e-5,
            1.164_614_9e-3,
            1.496_074_5e-2,
            0.114_028_77,
            0.501_854_54,
            1.0,
        ],
    );
    // The fit overshoots 1 by an ulp near the clamp.
    (x * (p / q)).clamp(-1.0, 1.0)
}

/// The exact GELU, `x * Phi(x)`, as PyTorch's default.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * FRAC_1_SQRT_2))
}

/// `d gelu / dx = Phi(x) + x * phi(x)`. The exponent of `phi`, `-x^2 / 2`, is never
/// positive, so it takes [`exp_nonpositive`]: the bits of [`exp`] down to 1.22e-38, 0 below
/// (a subnormal `x * phi(x)` for `x` in (-14.4, -13.2), where `Phi(x)` is 0, becomes 0),
/// and 15% fewer cycles for the whole gradient (AVX2, Zen 5: 27 -> 23 a vector).
#[inline(always)]
pub fn gelu_grad(x: f32) -> f32 {
    let a = x * FRAC_1_SQRT_2;
    let cdf = 0.5 * (1.0 + erf(a));
    cdf + x * exp_nonpositive(-a * a) * 0.398_942_3
}

/// `x` rounded to the nearest bf16 (ties to even), kept in f32: its low 16 bits zero. A NaN
/// stays a (quiet) NaN, a finite value past bf16's largest becomes infinity, as PTX's
/// `cvt.rn.bf16.f32` rounds; branch-free, so that a loop over it vectorises.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    let nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    f32::from_bits(if nan {
        (bits | 0x0040_0000) & 0xffff_0000
    } else {
        rounded
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between `got` and the f64 value `want`.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        if got == w {
            return 0.0;
        }
        let spacing = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
        (got as f64 - want).abs() / spacing
    }

    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0f64;
        for i in -100_000..=100_000 {
            let x = i as f32 * 8.8e-4;
            worst = worst.max(ulps(exp(x), (x as f64).exp()));
        }
        for x in [-87.0f32, -80.5, 60.25, 88.5, 88.72] {
            worst = worst.max(ulps(exp(x), (x as f64).exp()));
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn exp_at_the_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        // Subnormal results stay close to the true value.
        let x = -95.0f32;
        let want = (x as f64).exp();
        assert!((exp(x) as f64 - want).abs() < 1e-44, "{}", exp(x));
    }

    /// The flushed form is `exp` bit for bit from 0 down to -87.3 (every float in [-1, 0]
    /// on a fine grid, a grid below, the edge), 0 below, NaN kept: no result is subnormal.
    #[test]
    fn exp_of_nonpositive_is_exp_or_zero() {
        let mut xs: Vec<f32> = (0..=1 << 20)
            .map(|i| -(i as f32) / (1 << 20) as f32)
            .collect();
        xs.extend((0..=873_000).map(|i| i as f32 * -1e-4));
        xs.extend([-87.3f32, -87.299_99, -0.0, -f32::MIN_POSITIVE]);
        for x in xs {
            let (got, want) = (exp_nonpositive(x), exp(x));
            if x >= -87.3 {
                assert_eq!(got.to_bits(), want.to_bits(), "exp({x})");
                assert!(got >= 1.2e-38 && got.is_normal(), "exp({x}) = {got}");
            } else {
                assert_eq!(got, 0.0, "exp({x})");
            }
        }
        for x in [-87.31f32, -87.34, -95.0, -103.0, -200.0, f32::NEG_INFINITY] {
            assert_eq!(exp_nonpositive(x).to_bits(), 0, "exp({x}) flushed");
        }
        assert!(exp_nonpositive(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_and_sigmoid() {
        let mut worst = 0f64;
        for i in -20_000..=20_000 {
            let x = i as f32 * 1e-3;
            worst = worst.max(ulps(tanh(x), (x as f64).tanh()));
            let s = sigmoid(x) as f64 - 1.0 / (1.0 + (-(x as f64)).exp());
            assert!(s.abs() < 2e-7, "sigmoid({x}) off by {s}");
        }
        assert!(worst <= 3.0, "tanh: worst error {worst} ulp");
        assert_eq!(tanh(50.0), 1.0);
        assert_eq!(tanh(-f32::INFINITY), -1.0);
        assert!(tanh(f32::NAN).is_nan());
        assert_eq!(sigmoid(-200.0), 0.0);
        assert_eq!(sigmoid(200.0), 1.0);
    }

    #[test]
    fn erf_is_within_its_bound() {
        for i in -60_000..60_000 {
            let x = i as f64 / 10_000.0;
            let e = (erf(x as f32) as f64 - libm::erf(x)).abs();
            assert!(e < 4e-7, "{x}: {e}");
        }
        // Odd, and relatively exact near 0 where erf(x) ~ 2x / sqrt(pi).
        assert_eq!(erf(-0.7), -erf(0.7));
        let x = 1e-6f32;
        assert!(
            ((erf(x) as f64) / (x as f64 * std::f64::consts::FRAC_2_SQRT_PI) - 1.0).abs() < 1e-6
        );
        assert_eq!(erf(10.0), 1.0);
        assert!(erf(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_and_its_gradient() {
        // Reference values of x * Phi(x).
        for (x, want) in [
            (0.0f32, 0.0f64),
            (1.0, 0.841_344_746),
            (-1.0, -0.158_655_254),
            (3.0, 2.995_950_3),
        ] {
            assert!((gelu(x) as f64 - want).abs() < 1e-6, "{x}");
        }
        for i in -40..40 {
            let x = i as f64 / 10.0;
            let h = 1e-3;
            let g = |x: f64| 0.5 * x * (1.0 + libm::erf(x / 2f64.sqrt()));
            let fd = (g(x + h) - g(x - h)) / (2.0 * h);
            assert!((gelu_grad(x as f32) as f64 - fd).abs() < 1e-5, "{x}");
        }
        // The flushed exponential gives the bits of the full one wherever that is normal.
        let full = |x: f32| {
            let a = x * FRAC_1_SQRT_2;
            0.5 * (1.0 + erf(a)) + x * exp(-a * a) * 0.398_942_3
        };
        for i in -132_000..=200_000 {
            let x = i as f32 * 1e-4;
            assert_eq!(gelu_grad(x).to_bits(), full(x).to_bits(), "{x}");
        }
        for x in [-13.5f32, -14.0, -20.0] {
            assert_eq!(gelu_grad(x), 0.0, "{x}");
        }
        // As the full form: infinity times a zero density.
        for x in [f32::NAN, f32::NEG_INFINITY, f32::INFINITY] {
            assert!(gelu_grad(x).is_nan() && full(x).is_nan(), "{x}");
        }
    }
}
