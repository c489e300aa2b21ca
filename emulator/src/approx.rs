//! The approximate functions (`ex2.approx`, `lg2.approx`, `rcp.approx`, `tanh.approx`, ...),
//! modelled as correctly rounded results, with the PTX ISA's documented error bounds.
//!
//! The GPU's exact bits are undocumented, so each function here is the exact function rounded
//! to nearest f32: `rcp` and `sqrt` by IEEE f32 division and square root (correctly rounded by
//! definition); the others computed in f64 and rounded once to f32, which is the correctly
//! rounded value except when the f64 result falls within its own error of an f32 rounding
//! boundary (about one input in 2^29). A GPU result may differ from these by the documented
//! bound (`documented_error`), which is what check tolerances derive from.
//!
//! Special values follow the tables of the PTX ISA's sections "Floating Point Instructions:
//! rcp / sqrt / rsqrt / sin / cos / lg2 / ex2 / tanh" (9.7.3.13-22 in PTX ISA 9.x). `ftz`
//! ("flushes subnormal inputs and results to sign-preserving zero") is applied to the input and
//! to the result. A NaN result is the canonical NaN `0x7FFFFFFF`; compare NaNs as a class.

use crate::convert::{ftz as flush, CANONICAL_NAN_F32};

/// Which approximate function (`documented_error`'s key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApproxOp {
    Ex2,
    Lg2,
    Rcp,
    Rsqrt,
    Sqrt,
    Sin,
    Cos,
    Tanh,
}

/// A documented maximum error. `ulp`: in units in the last place of the correctly rounded
/// result; `abs`: absolute; `rel`: relative. Where the ISA gives different bounds on different
/// input ranges, `note` quotes the whole statement and the fields hold the bound that applies to
/// the named range (see each op).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorBound {
    pub ulp: Option<f64>,
    pub abs: Option<f64>,
    pub rel: Option<f64>,
    pub note: &'static str,
}

/// The PTX ISA's documented maximum error of each `.approx.f32` function, quoted from the ISA's
/// "Floating Point Instructions" sections (PTX ISA 9.x).
/// - `Lg2`: `abs` = 2^-22 for inputs in (0.5, 2), `rel` = 2^-22 for other positive finite inputs.
/// - `Sin`/`Cos`: `abs` = 2^-20.5 on [-2pi, 2pi]; 2^-14.7 on [-100pi, 100pi] (in the note; see
///   `documented_error_at`); no bound beyond.
pub fn documented_error(op: ApproxOp) -> ErrorBound {
    let none = ErrorBound {
        ulp: None,
        abs: None,
        rel: None,
        note: "",
    };
    match op {
        ApproxOp::Ex2 => ErrorBound {
            ulp: Some(2.0),
            note: "ex2.approx.f32: \"The maximum ulp error is 2 ulp from correctly rounded \
                   result across the full range of inputs.\"",
            ..none
        },
        ApproxOp::Lg2 => ErrorBound {
            abs: Some(2f64.powi(-22)),
            rel: Some(2f64.powi(-22)),
            note: "lg2.approx.f32: \"The maximum absolute error is 2^-22 when the input operand \
                   is in the range (0.5, 2). For positive finite inputs outside of this \
                   interval, maximum relative error is 2^-22.\"",
            ..none
        },
        ApproxOp::Rcp => ErrorBound {
            ulp: Some(1.0),
            note: "rcp.approx.f32: \"The maximum ulp error is 1 across the full range of \
                   inputs.\"",
            ..none
        },
        ApproxOp::Rsqrt => ErrorBound {
            rel: Some(2f64.powf(-22.9)),
            note: "rsqrt.approx.f32: \"The maximum relative error for rsqrt.f32 over the \
                   entire positive finite floating-point range is 2^-22.9.\"",
            ..none
        },
        ApproxOp::Sqrt => ErrorBound {
            rel: Some(2f64.powi(-23)),
            note: "sqrt.approx.f32: \"The maximum relative error over the entire positive \
                   finite floating-point range is 2^-23.\"",
            ..none
        },
        ApproxOp::Sin => ErrorBound {
            abs: Some(2f64.powf(-20.5)),
            note: "sin.approx.f32: \"The maximum absolute error over input range is as \
                   follows: Range [-2pi .. 2pi]: 2^-20.5; [-100pi .. +100pi]: 2^-14.7. Outside \
                   of the range [-100pi .. +100pi], only best effort is provided. There are no \
                   defined error guarantees.\"",
            ..none
        },
        ApproxOp::Cos => ErrorBound {
            abs: Some(2f64.powf(-20.5)),
            note: "cos.approx.f32: \"The maximum absolute error over input range is as \
                   follows: Range [-2pi .. 2pi]: 2^-20.5; [-100pi .. +100pi]: 2^-14.7. Outside \
                   of the range [-100pi .. +100pi], only best effort is provided. There are no \
                   defined error guarantees.\"",
            ..none
        },
        ApproxOp::Tanh => ErrorBound {
            rel: Some(2f64.powi(-11)),
            note: "tanh.approx.f32: \"The maximum relative error over the entire floating \
                   point range is 2^-11.\"",
            ..none
        },
    }
}

/// The documented bound that applies at input `x`: for `Lg2` only `abs` inside (0.5, 2) and
/// only `rel` outside; for `Sin`/`Cos` `abs` 2^-20.5 on [-2pi, 2pi], 2^-14.7 on
/// [-100pi, 100pi], none beyond (all fields `None`); the others as `documented_error`.
pub fn documented_error_at(op: ApproxOp, x: f32) -> ErrorBound {
    let b = documented_error(op);
    let pi = std::f64::consts::PI;
    let x = x as f64;
    match op {
        ApproxOp::Lg2 if x > 0.5 && x < 2.0 => ErrorBound { rel: None, ..b },
        ApproxOp::Lg2 => ErrorBound { abs: None, ..b },
        ApproxOp::Sin | ApproxOp::Cos => {
            let abs = if x.abs() <= 2.0 * pi {
                Some(2f64.powf(-20.5))
            } else if x.abs() <= 100.0 * pi {
                Some(2f64.powf(-14.7))
            } else {
                None
            };
            ErrorBound { abs, ..b }
        }
        _ => b,
    }
}

fn nan() -> f32 {
    f32::from_bits(CANONICAL_NAN_F32)
}

/// Input and result flushing for `.ftz`, and the canonical NaN.
fn finish(y: f32, ftz: bool) -> f32 {
    if y.is_nan() {
        nan()
    } else if ftz {
        flush(y)
    } else {
        y
    }
}

fn input(x: f32, ftz: bool) -> f32 {
    if ftz {
        flush(x)
    } else {
        x
    }
}

/// `ex2.approx{.ftz}.f32`: 2^x. ISA table: -Inf -> +0.0, ±0.0 -> +1.0, +Inf -> +Inf, NaN -> NaN.
/// Documented error: "The maximum ulp error is 2 ulp from correctly rounded result across the
/// full range of inputs."
pub fn ex2(x: f32, ftz: bool) -> f32 {
    let x = input(x, ftz);
    finish((x as f64).exp2() as f32, ftz)
}

/// `lg2.approx{.ftz}.f32`: log2(x). ISA table: -Inf -> NaN, -normal -> NaN, ±0.0 -> -Inf,
/// +Inf -> +Inf, NaN -> NaN (a negative subnormal flushed by `.ftz` is -0.0, so -Inf).
/// Documented error: "The maximum absolute error is 2^-22 when the input operand is in the
/// range (0.5, 2). For positive finite inputs outside of this interval, maximum relative error
/// is 2^-22."
pub fn lg2(x: f32, ftz: bool) -> f32 {
    let x = input(x, ftz);
    if x == 0.0 {
        return f32::NEG_INFINITY;
    }
    finish((x as f64).log2() as f32, ftz)
}

/// `rcp.approx{.ftz}.f32`: 1/x, as IEEE f32 division (correctly rounded). ISA table:
/// -Inf -> -0.0, -0.0 -> -Inf, +0.0 -> +Inf, +Inf -> +0.0, NaN -> NaN. Documented error: "The
/// maximum ulp error is 1 across the full range of inputs."
pub fn rcp(x: f32, ftz: bool) -> f32 {
    let x = input(x, ftz);
    finish(1.0 / x, ftz)
}

/// `rsqrt.approx{.ftz}.f32`: 1/sqrt(x). ISA table: -Inf -> NaN, -normal -> NaN, -0.0 -> -Inf,
/// +0.0 -> +Inf, +Inf -> +0.0, NaN -> NaN. Documented error: "The maximum relative error for
/// rsqrt.f32 over the entire positive finite floating-point range is 2^-22.9."
pub fn rsqrt(x: f32, ftz: bool) -> f32 {
    let x = input(x, ftz);
    if x == 0.0 {
        // 1 / sqrt(±0) = 1 / ±0 = ±Inf.
        return if x.is_sign_negative() {
            f32::NEG_INFINITY
        } else {
            f32::INFINITY
        };
    }
    if x < 0.0 {
        return nan();
    }
    finish((1.0 / (x as f64).sqrt()) as f32, ftz)
}

/// `sqrt.approx{.ftz}.f32`: sqrt(x), as IEEE f32 square root (correctly rounded). ISA table:
/// -Inf -> NaN, -normal -> NaN, -0.0 -> -0.0, +0.0 -> +0.0, +Inf -> +Inf, NaN -> NaN.
/// Documented error: "The maximum relative error over the entire positive finite
/// floating-point range is 2^-23."
pub fn sqrt(x: f32, ftz: bool) -> f32 {
    let x = input(x, ftz);
    finish(x.sqrt(), ftz)
}

/// `sin.approx{.ftz}.f32`: sin(x) (radians). ISA table: ±Inf -> NaN, -0.0 -> -0.0,
/// +0.0 -> +0.0, NaN -> NaN. Documented error: absolute 2^-20.5 on [-2pi, 2pi], 2^-14.7 on
/// [-100pi, 100pi], "Outside of the range [-100pi .. +100pi], only best effort is provided."
pub fn sin(x: f32, ftz: bool) -> f32 {
    let x = input(x, ftz);
    finish((x as f64).sin() as f32, ftz)
}

/// `cos.approx{.ftz}.f32`: cos(x) (radians). ISA table: ±Inf -> NaN, ±0.0 -> +1.0,
/// NaN -> NaN. Documented error: as `sin`.
pub fn cos(x: f32, ftz: bool) -> f32 {
    let x = input(x, ftz);
    finish((x as f64).cos() as f32, ftz)
}

/// `tanh.approx.f32`: tanh(x). ISA table: -Inf -> -1.0, ±0.0 -> ±0.0, +Inf -> 1.0, NaN -> NaN;
/// "The subnormal numbers are supported" and "The subnormal inputs gets passed through to the
/// output" (no `.ftz` form). Documented error: "The maximum relative error over the entire
/// floating point range is 2^-11."
pub fn tanh(x: f32) -> f32 {
    finish((x as f64).tanh() as f32, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUB: f32 = f32::from_bits(0x0000_0400); // a positive subnormal
    const NSUB: f32 = f32::from_bits(0x8000_0400);

    fn bits(x: f32) -> u32 {
        x.to_bits()
    }

    #[test]
    fn special_values_per_the_isa_tables() {
        const INF: f32 = f32::INFINITY;
        const NINF: f32 = f32::NEG_INFINITY;
        for ftz in [false, true] {
            // ex2
            assert_eq!(bits(ex2(NINF, ftz)), 0);
            assert_eq!(ex2(-0.0, ftz), 1.0);
            assert_eq!(ex2(0.0, ftz), 1.0);
            assert_eq!(ex2(INF, ftz), INF);
            assert!(ex2(f32::NAN, ftz).is_nan());
            assert_eq!(ex2(200.0, ftz), INF);
            assert_eq!(bits(ex2(-200.0, ftz)), 0);
            // lg2
            assert!(lg2(NINF, ftz).is_nan());
            assert!(lg2(-1.0, ftz).is_nan());
            assert_eq!(lg2(-0.0, ftz), NINF);
            assert_eq!(lg2(0.0, ftz), NINF);
            assert_eq!(lg2(INF, ftz), INF);
            assert!(lg2(f32::NAN, ftz).is_nan());
            // rcp
            assert_eq!(bits(rcp(NINF, ftz)), 0x8000_0000);
            assert_eq!(rcp(-0.0, ftz), NINF);
            assert_eq!(rcp(0.0, ftz), INF);
            assert_eq!(bits(rcp(INF, ftz)), 0);
            assert!(rcp(f32::NAN, ftz).is_nan());
            // rsqrt
            assert!(rsqrt(NINF, ftz).is_nan());
            assert!(rsqrt(-4.0, ftz).is_nan());
            assert_eq!(rsqrt(-0.0, ftz), NINF);
            assert_eq!(rsqrt(0.0, ftz), INF);
            assert_eq!(bits(rsqrt(INF, ftz)), 0);
            assert!(rsqrt(f32::NAN, ftz).is_nan());
            // sqrt
            assert!(sqrt(NINF, ftz).is_nan());
            assert!(sqrt(-4.0, ftz).is_nan());
            assert_eq!(bits(sqrt(-0.0, ftz)), 0x8000_0000);
            assert_eq!(bits(sqrt(0.0, ftz)), 0);
            assert_eq!(sqrt(INF, ftz), INF);
            assert!(sqrt(f32::NAN, ftz).is_nan());
            // sin, cos
            for f in [sin, cos] {
                assert!(f(NINF, ftz).is_nan());
                assert!(f(INF, ftz).is_nan());
                assert!(f(f32::NAN, ftz).is_nan());
            }
            assert_eq!(bits(sin(-0.0, ftz)), 0x8000_0000);
            assert_eq!(bits(sin(0.0, ftz)), 0);
            assert_eq!(cos(-0.0, ftz), 1.0);
            assert_eq!(cos(0.0, ftz), 1.0);
        }
        // tanh
        assert_eq!(tanh(NINF), -1.0);
        assert_eq!(bits(tanh(-0.0)), 0x8000_0000);
        assert_eq!(bits(tanh(0.0)), 0);
        assert_eq!(tanh(INF), 1.0);
        assert!(tanh(f32::NAN).is_nan());
        // NaN results are the canonical NaN.
        assert_eq!(bits(lg2(-1.0, false)), 0x7FFF_FFFF);
        assert_eq!(bits(sqrt(-1.0, false)), 0x7FFF_FFFF);
        assert_eq!(bits(sin(f32::INFINITY, false)), 0x7FFF_FFFF);
    }

    #[test]
    fn exact_points_are_exact() {
        for n in -149..128 {
            let p = if n >= -126 {
                f32::from_bits(((n + 127) as u32) << 23)
            } else {
                f32::from_bits(1 << (n + 149))
            };
            assert_eq!(ex2(n as f32, false), p, "ex2({n})");
            assert_eq!(lg2(p, false), n as f32, "lg2(2^{n})");
            if n > -127 {
                // 1/2^n is normal or a subnormal power of two: exact.
                assert_eq!(rcp(p, false), 1.0 / p);
            }
        }
        assert_eq!(rcp(4.0, false), 0.25);
        assert_eq!(sqrt(9.0, false), 3.0);
        assert_eq!(rsqrt(4.0, false), 0.5);
        assert_eq!(rsqrt(0.25, false), 2.0);
        assert_eq!(tanh(20.0), 1.0);
        assert_eq!(sin(0.5, false), 0.5f64.sin() as f32);
    }

    #[test]
    fn results_are_the_nearest_f32_to_the_exact_function() {
        // Against known correctly rounded constants.
        assert_eq!(ex2(0.5, false), std::f32::consts::SQRT_2);
        assert_eq!(ex2(-0.5, false), std::f32::consts::FRAC_1_SQRT_2);
        assert_eq!(lg2(10.0, false), std::f32::consts::LOG2_10);
        assert_eq!(rsqrt(2.0, false), std::f32::consts::FRAC_1_SQRT_2);
        assert_eq!(sqrt(2.0, false), std::f32::consts::SQRT_2);
        assert_eq!(rcp(3.0, false), 1.0 / 3.0);
        // A sweep: each result is within half an ulp of the f64 function (so no other f32 is
        // nearer), and within the documented bound of it.
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..20000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = f32::from_bits(s as u32 & 0x3FFF_FFFF | 0x2000_0000) * 4.0; // wide, positive
            let xs = ((s >> 32) % 2_000_001) as f32 / 100_000.0 - 10.0; // [-10, 10]
            let cases: [(f32, f64, ApproxOp, f32); 8] = [
                (ex2(xs, false), (xs as f64).exp2(), ApproxOp::Ex2, xs),
                (lg2(x, false), (x as f64).log2(), ApproxOp::Lg2, x),
                (rcp(x, false), 1.0 / x as f64, ApproxOp::Rcp, x),
                (rsqrt(x, false), 1.0 / (x as f64).sqrt(), ApproxOp::Rsqrt, x),
                (sqrt(x, false), (x as f64).sqrt(), ApproxOp::Sqrt, x),
                (sin(xs, false), (xs as f64).sin(), ApproxOp::Sin, xs),
                (cos(xs, false), (xs as f64).cos(), ApproxOp::Cos, xs),
                (tanh(xs), (xs as f64).tanh(), ApproxOp::Tanh, xs),
            ];
            for (got, exact, op, input) in cases {
                if !exact.is_finite() || got == 0.0 || got.is_subnormal() {
                    continue;
                }
                let ulp = (f32::from_bits(got.abs().to_bits() + 1) - got.abs()) as f64;
                let err = (got as f64 - exact).abs();
                assert!(err <= 0.5 * ulp * (1.0 + 1e-9), "{op:?}({input:e})");
                let b = documented_error_at(op, input);
                let ok = b.ulp.is_some_and(|u| err <= u * ulp)
                    || b.abs.is_some_and(|a| err <= a)
                    || b.rel.is_some_and(|r| err <= r * exact.abs());
                assert!(ok, "{op:?}({input:e}) outside {b:?}");
            }
        }
    }

    #[test]
    fn ftz_flushes_inputs_and_results() {
        // Subnormal inputs: flushed with .ftz, kept without.
        assert_eq!(rcp(SUB, true), f32::INFINITY);
        assert_eq!(rcp(NSUB, true), f32::NEG_INFINITY);
        // 1 / 2^-127 = 2^127 without .ftz (2^-139 would overflow to Inf anyway).
        let big_sub = f32::from_bits(0x0040_0000);
        assert_eq!(rcp(big_sub, false), 2f32.powi(127));
        assert_eq!(rcp(big_sub, true), f32::INFINITY);
        assert_eq!(lg2(SUB, true), f32::NEG_INFINITY);
        assert_eq!(lg2(NSUB, true), f32::NEG_INFINITY);
        assert_eq!(lg2(SUB, false), -139.0);
        assert_eq!(ex2(SUB, true), 1.0);
        assert_eq!(bits(sqrt(NSUB, true)), 0x8000_0000);
        assert!(sqrt(NSUB, false).is_nan());
        assert_eq!(rsqrt(NSUB, true), f32::NEG_INFINITY);
        assert_eq!(bits(sin(NSUB, true)), 0x8000_0000);
        assert_eq!(sin(NSUB, false), NSUB);
        assert_eq!(cos(SUB, true), 1.0);
        // Subnormal results: 2^-130 from ex2, 1/2^127 from rcp.
        assert_eq!(bits(ex2(-130.0, true)), 0);
        assert_eq!(bits(ex2(-130.0, false)), 1 << 19);
        assert_eq!(bits(rcp(-(2f32.powi(127)), true)), 0x8000_0000);
        assert_eq!(bits(rcp(2f32.powi(127), false)), 1 << 22);
        // tanh passes subnormals through.
        assert_eq!(tanh(SUB), SUB);
        assert_eq!(tanh(NSUB), NSUB);
    }

    #[test]
    fn documented_bounds_are_the_isa_numbers() {
        assert_eq!(documented_error(ApproxOp::Ex2).ulp, Some(2.0));
        assert_eq!(documented_error(ApproxOp::Rcp).ulp, Some(1.0));
        assert_eq!(documented_error(ApproxOp::Sqrt).rel, Some(2f64.powi(-23)));
        assert_eq!(
            documented_error(ApproxOp::Rsqrt).rel,
            Some(2f64.powf(-22.9))
        );
        assert_eq!(documented_error(ApproxOp::Tanh).rel, Some(2f64.powi(-11)));
        assert_eq!(documented_error(ApproxOp::Lg2).abs, Some(2f64.powi(-22)));
        assert_eq!(documented_error_at(ApproxOp::Lg2, 1.5).rel, None);
        assert_eq!(documented_error_at(ApproxOp::Lg2, 8.0).abs, None);
        assert_eq!(
            documented_error_at(ApproxOp::Sin, 100.0).abs,
            Some(2f64.powf(-14.7))
        );
        assert_eq!(documented_error_at(ApproxOp::Cos, 1000.0).abs, None);
        for op in [
            ApproxOp::Ex2,
            ApproxOp::Lg2,
            ApproxOp::Rcp,
            ApproxOp::Rsqrt,
            ApproxOp::Sqrt,
            ApproxOp::Sin,
            ApproxOp::Cos,
            ApproxOp::Tanh,
        ] {
            assert!(documented_error(op).note.contains(".approx.f32"));
        }
    }
}
