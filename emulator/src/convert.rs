//! `cvt`'s conversions and rounding modes, bit-exact, as the PTX ISA's section "Data Movement
//! and Conversion Instructions: cvt" (9.7.9.21 in PTX ISA 9.x) defines them.
//!
//! Every directed rounding is done once, exactly, on the integer significand (`round_bits`), never
//! by casting through a wider type, which would round twice.

use std::cmp::Ordering;

/// `cvt`'s floating-point rounding modifiers ("Floating Point Notes" of `cvt`): `.rn` nearest,
/// ties to even; `.rz` toward zero; `.rm` toward -Inf; `.rp` toward +Inf; `.rna` nearest, ties
/// away from zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    Rn,
    Rz,
    Rm,
    Rp,
    Rna,
}

/// `cvt`'s integer rounding modifiers ("Integer Notes" of `cvt`): `.rni` nearest integer, ties
/// to even; `.rzi` toward zero; `.rmi` toward -Inf; `.rpi` toward +Inf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntRounding {
    Rni,
    Rzi,
    Rmi,
    Rpi,
}

/// The canonical f32 NaN the GPU writes (`0x7FFFFFFF`; the ISA's `.relu` note: "NaN results are
/// converted to canonical NaN"). Compare NaNs as a class, not by payload.
pub const CANONICAL_NAN_F32: u32 = 0x7FFF_FFFF;
/// The canonical bf16 NaN (`0x7FFF`), what `cvt.rn.bf16{x2}.f32` writes for a NaN input (the
/// ISA names the canonical NaN for `.relu`; CUDA's `cuda_bf16.hpp` conversion writes `0x7FFF`
/// for every NaN).
pub const CANONICAL_NAN_BF16: u16 = 0x7FFF;

/// Rounds `(-1)^neg * m * 2^e` to the binary format with `mant` stored fraction bits and `exp`
/// exponent bits (IEEE layout, subnormals kept), once, in mode `r`; returns the bit pattern.
/// Overflow follows IEEE 754: to Inf in the nearest modes and in the direction away from zero,
/// to the largest finite value toward zero.
fn round_bits(neg: bool, m: u128, e: i32, r: Rounding, mant: u32, exp: u32) -> u64 {
    let sign = (neg as u64) << (mant + exp);
    if m == 0 {
        return sign;
    }
    let bias = (1i32 << (exp - 1)) - 1;
    let (emin, emax) = (1 - bias, bias);
    // The value's exponent: its top bit's weight.
    let top = 127 - m.leading_zeros() as i32 + e;
    // The weight of the result's last bit (the quantum): subnormals share emin's.
    let mut q = top.max(emin) - mant as i32;
    let shift = q - e;
    // The kept significand, the discarded remainder, and the remainder against half a quantum.
    let (mut sig, rem, vs_half) = if shift <= 0 {
        (m << (-shift) as u32, 0, Ordering::Less)
    } else if shift > 128 {
        (0, m, Ordering::Less)
    } else if shift == 128 {
        (0, m, m.cmp(&(1u128 << 127)))
    } else {
        let rem = m & ((1u128 << shift) - 1);
        (m >> shift, rem, rem.cmp(&(1u128 << (shift - 1))))
    };
    let inexact = rem != 0;
    let up = inexact
        && match r {
            Rounding::Rn => {
                vs_half == Ordering::Greater || (vs_half == Ordering::Equal && sig & 1 == 1)
            }
            Rounding::Rna => vs_half != Ordering::Less,
            Rounding::Rz => false,
            Rounding::Rm => neg,
            Rounding::Rp => !neg,
        };
    if up {
        sig += 1;
        if sig == 1u128 << (mant + 1) {
            sig >>= 1;
            q += 1;
        }
    }
    // Assemble; a significand below 2^mant is a subnormal (q is emin - mant there).
    if sig < 1u128 << mant {
        return sign | sig as u64;
    }
    let ex = q + mant as i32;
    if ex > emax {
        let inf = ((1u64 << exp) - 1) << mant;
        let to_inf = match r {
            Rounding::Rn | Rounding::Rna => true,
            Rounding::Rz => false,
            Rounding::Rm => neg,
            Rounding::Rp => !neg,
        };
        return sign | if to_inf { inf } else { inf - 1 };
    }
    sign | (((ex + bias) as u64) << mant) | (sig as u64 - (1u64 << mant))
}

/// `(neg, m, e)` with `x = (-1)^neg m 2^e`, for finite `x`.
fn split_f64(x: f64) -> (bool, u128, i32) {
    let b = x.to_bits();
    let neg = b >> 63 == 1;
    let be = ((b >> 52) & 0x7FF) as i32;
    let f = b & ((1u64 << 52) - 1);
    if be == 0 {
        (neg, f as u128, -1074)
    } else {
        (neg, (f | (1u64 << 52)) as u128, be - 1075)
    }
}

/// `cvt.rn.bf16.f32`: round to nearest, ties to even; overflow to Inf (IEEE `.rn`); a NaN
/// becomes the canonical bf16 NaN `0x7FFF` (see `CANONICAL_NAN_BF16`). bf16 has f32's exponent
/// range, so subnormals round the same way (the bit trick is monotone across the boundary).
pub fn f32_to_bf16_rn(x: f32) -> u16 {
    if x.is_nan() {
        return CANONICAL_NAN_BF16;
    }
    let b = x.to_bits();
    // Adding 0x7FFF plus the kept LSB rounds the low 16 bits to nearest, ties to even; a carry
    // into the exponent is the correct rounding up (to Inf past the largest finite value).
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// `cvt.f32.bf16`: exact (bf16 is f32's top half). The ISA: "For cvt.f32.bf16, NaN input yields
/// unspecified NaN"; the payload is kept here.
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `cvt.rn.bf16x2.f32 d, a, b`: the ISA: "the value converted from input a is stored in the
/// upper half of d and the value converted from input b is stored in the lower half of d"
/// (`d[31:16] = convert(a); d[15:0] = convert(b)`). With `mma`'s low-to-high element order, `b`
/// is the even (first) element.
pub fn bf16x2_from_f32(a: f32, b: f32) -> u32 {
    ((f32_to_bf16_rn(a) as u32) << 16) | f32_to_bf16_rn(b) as u32
}

/// `cvt.rna.tf32.f32`: round to 10 fraction bits (tf32), nearest, ties away from zero
/// (`.rna`); the result is the f32 bit pattern with the low 13 bits zero. Past the largest
/// finite tf32 value it rounds to Inf (nearest mode). NaN becomes the canonical NaN
/// `0x7FFFFFFF` (the ISA leaves a NaN's payload unspecified here; compare NaNs as a class).
pub fn f32_to_tf32_rna(x: f32) -> u32 {
    if x.is_nan() {
        return CANONICAL_NAN_F32;
    }
    let b = x.to_bits();
    if x.is_infinite() {
        return b;
    }
    // Sign-magnitude: adding half of the dropped quantum to the magnitude and truncating is
    // ties away from zero; a carry into the exponent is correct (up to Inf).
    (b + 0x1000) & 0xFFFF_E000
}

/// `cvt.{rn,rz,rm,rp}.f32.f64` (and `.rna` for completeness), rounded once, exactly, with
/// subnormal results kept (`.ftz` is the caller's `ftz` on the result). Overflow per IEEE: Inf
/// in the nearest modes and away from zero, the largest finite f32 toward zero. NaN becomes the
/// canonical NaN.
pub fn f64_to_f32(x: f64, r: Rounding) -> f32 {
    if x.is_nan() {
        return f32::from_bits(CANONICAL_NAN_F32);
    }
    if x.is_infinite() {
        return if x > 0.0 {
            f32::INFINITY
        } else {
            f32::NEG_INFINITY
        };
    }
    let (neg, m, e) = split_f64(x);
    f32::from_bits(round_bits(neg, m, e, r, 23, 8) as u32)
}

/// `cvt.{rni,rzi,rmi,rpi}.f32.f32`: round to an integral value kept as f32 ("Integer Notes":
/// `.rni` is "round to nearest integer, choosing even integer if source is equidistant between
/// two integers"). The sign of a zero result follows the input (IEEE roundToIntegral); NaN
/// stays NaN (canonical), Inf stays Inf.
pub fn round_f32_to_integral(x: f32, r: IntRounding) -> f32 {
    if x.is_nan() {
        return f32::from_bits(CANONICAL_NAN_F32);
    }
    match r {
        IntRounding::Rni => x.round_ties_even(),
        IntRounding::Rzi => x.trunc(),
        IntRounding::Rmi => x.floor(),
        IntRounding::Rpi => x.ceil(),
    }
}

fn round_f64_integral(x: f64, r: IntRounding) -> f64 {
    match r {
        IntRounding::Rni => x.round_ties_even(),
        IntRounding::Rzi => x.trunc(),
        IntRounding::Rmi => x.floor(),
        IntRounding::Rpi => x.ceil(),
    }
}

/// Float-to-int `cvt.{rni,rzi,rmi,rpi}.{s,u}{8,16,32,64}.{f32,f16,bf16}` (a source that is NOT
/// `.f64`; widen it to f64 exactly first): rounds, then clamps to the destination's range (the
/// ISA: "For float-to-integer conversions, the result is clamped to the destination range by
/// default"), so a negative value converts to unsigned 0. NaN, per "Integer Notes": "Zero if
/// source is not .f64 and destination is not .s64, .u64. Otherwise 1 << (BitWidth(dst) - 1)".
/// Returns the bit pattern in 64 bits: signed results sign-extended, unsigned zero-extended.
/// `bits` outside 1..=64 is clamped to that range.
pub fn float_to_int(x: f64, r: IntRounding, signed: bool, bits: u32) -> u64 {
    convert_to_int(x, r, signed, bits, false)
}

/// Float-to-int `cvt.{irnd}.{s,u}{8,16,32,64}.f64`: as `float_to_int`, but a NaN converts to
/// `1 << (bits - 1)` for every destination width (the ISA's rule 2: the source is `.f64`), which
/// is MININT (sign-extended) for signed destinations.
pub fn f64_to_int(x: f64, r: IntRounding, signed: bool, bits: u32) -> u64 {
    convert_to_int(x, r, signed, bits, true)
}

fn convert_to_int(x: f64, r: IntRounding, signed: bool, bits: u32, source_f64: bool) -> u64 {
    let bits = bits.clamp(1, 64);
    if x.is_nan() {
        if !source_f64 && bits < 64 {
            return 0;
        }
        let v = 1u64 << (bits - 1);
        return if signed { sign_extend(v, bits) } else { v };
    }
    let v = round_f64_integral(x, r);
    if signed {
        // [-2^(bits-1), 2^(bits-1) - 1]; both 2^(bits-1) bounds are exact in f64.
        let lim = (bits as f64 - 1.0).exp2();
        let i = if v >= lim {
            i64::MAX >> (64 - bits)
        } else if v < -lim {
            i64::MIN >> (64 - bits)
        } else {
            v as i64
        };
        i as u64
    } else {
        let lim = (bits as f64).exp2();
        if v >= lim {
            u64::MAX >> (64 - bits)
        } else if v <= 0.0 {
            0
        } else {
            v as u64
        }
    }
}

fn sign_extend(v: u64, bits: u32) -> u64 {
    (((v << (64 - bits)) as i64) >> (64 - bits)) as u64
}

/// Int-to-float `cvt.{rn,rz,rm,rp}.f32.{s,u}{8..64}` (the caller widens the integer to i128 by
/// its signedness): rounded once, exactly, so the directed modes are right for every u64/s64.
pub fn int_to_f32(x: i128, r: Rounding) -> f32 {
    f32::from_bits(round_bits(x < 0, x.unsigned_abs(), 0, r, 23, 8) as u32)
}

/// Int-to-float `cvt.{rn,rz,rm,rp}.f64.{s,u}{8..64}`: as `int_to_f32`, to f64.
pub fn int_to_f64(x: i128, r: Rounding) -> f64 {
    f64::from_bits(round_bits(x < 0, x.unsigned_abs(), 0, r, 52, 11))
}

/// `.ftz` on an f32 input or result: a subnormal becomes a zero of the same sign ("flushes
/// subnormal inputs and results to sign-preserving zero").
pub fn ftz(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_ties_to_even_and_nan() {
        // 1.0 + 2^-8 is exactly halfway between bf16 1.0 and 1.0 + 2^-7: ties to even (1.0).
        assert_eq!(f32_to_bf16_rn(f32::from_bits(0x3F80_8000)), 0x3F80);
        // 1.0 + 3*2^-8 is halfway between 0x3F81 and 0x3F82: ties to even (0x3F82).
        assert_eq!(f32_to_bf16_rn(f32::from_bits(0x3F81_8000)), 0x3F82);
        // Just above / below the halfway point.
        assert_eq!(f32_to_bf16_rn(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(f32_to_bf16_rn(f32::from_bits(0x3F80_7FFF)), 0x3F80);
        // Negative: magnitude rounding, sign kept.
        assert_eq!(f32_to_bf16_rn(f32::from_bits(0xBF81_8000)), 0xBF82);
        // Largest finite f32 rounds up to Inf in .rn.
        assert_eq!(f32_to_bf16_rn(f32::MAX), 0x7F80);
        assert_eq!(f32_to_bf16_rn(f32::INFINITY), 0x7F80);
        assert_eq!(f32_to_bf16_rn(f32::NEG_INFINITY), 0xFF80);
        // Subnormals: 0x00008000 is halfway between bf16 0x0000 and 0x0001: even is 0.
        assert_eq!(f32_to_bf16_rn(f32::from_bits(0x0000_8000)), 0x0000);
        assert_eq!(f32_to_bf16_rn(f32::from_bits(0x0001_8000)), 0x0002);
        // -0.0 stays -0.0.
        assert_eq!(f32_to_bf16_rn(-0.0), 0x8000);
        // Every NaN, including one whose payload lies only in the low 16 bits (a naive
        // truncation would make it Inf), becomes the canonical NaN.
        for nan in [0x7FC0_0000u32, 0x7F80_0001, 0xFF80_0001, 0xFFFF_FFFF] {
            assert_eq!(f32_to_bf16_rn(f32::from_bits(nan)), 0x7FFF);
        }
        // Round trip of every bf16 value that is not NaN.
        for h in 0..=u16::MAX {
            let x = bf16_to_f32(h);
            if !x.is_nan() {
                assert_eq!(f32_to_bf16_rn(x), h);
            }
        }
    }

    #[test]
    fn bf16x2_packs_a_high_b_low() {
        // cvt.rn.bf16x2.f32 d, a, b: a in d[31:16], b in d[15:0].
        assert_eq!(bf16x2_from_f32(1.0, 2.0), 0x3F80_4000);
        assert_eq!(bf16x2_from_f32(-2.0, 0.5), 0xC000_3F00);
        let d = bf16x2_from_f32(3.0, -1.5);
        assert_eq!(bf16_to_f32((d >> 16) as u16), 3.0);
        assert_eq!(bf16_to_f32(d as u16), -1.5);
    }

    #[test]
    fn tf32_rna() {
        // 1 + 2^-11 is halfway between tf32 1.0 and 1 + 2^-10: ties AWAY from zero.
        assert_eq!(f32_to_tf32_rna(f32::from_bits(0x3F80_1000)), 0x3F80_2000);
        // (Ties to even would give 0x3F80_0000 there.) A tie above an odd kept value: up.
        assert_eq!(f32_to_tf32_rna(f32::from_bits(0x3F80_3000)), 0x3F80_4000);
        // Below half: down.
        assert_eq!(f32_to_tf32_rna(f32::from_bits(0x3F80_0FFF)), 0x3F80_0000);
        // Negative halfway: away from zero (more negative).
        assert_eq!(f32_to_tf32_rna(f32::from_bits(0xBF80_1000)), 0xBF80_2000);
        // Exact values keep their bits.
        assert_eq!(f32_to_tf32_rna(1.5), 1.5f32.to_bits());
        // Past the largest finite tf32: Inf.
        assert_eq!(f32_to_tf32_rna(f32::MAX), 0x7F80_0000);
        assert_eq!(f32_to_tf32_rna(f32::NEG_INFINITY), 0xFF80_0000);
        assert_eq!(f32_to_tf32_rna(f32::NAN), 0x7FFF_FFFF);
        // A NaN with a payload only in the low 13 bits stays NaN (not Inf).
        assert!(f32::from_bits(f32_to_tf32_rna(f32::from_bits(0x7F80_0001))).is_nan());
    }

    #[test]
    fn f64_to_f32_directed_at_boundaries() {
        use Rounding::*;
        let one_up = f32::from_bits(0x3F80_0001);
        // 1 + 2^-30: inexact, below half an ulp.
        let x = 1.0 + 2f64.powi(-30);
        assert_eq!(f64_to_f32(x, Rn), 1.0);
        assert_eq!(f64_to_f32(x, Rz), 1.0);
        assert_eq!(f64_to_f32(x, Rm), 1.0);
        assert_eq!(f64_to_f32(x, Rp), one_up);
        assert_eq!(f64_to_f32(-x, Rm), -one_up);
        assert_eq!(f64_to_f32(-x, Rp), -1.0);
        assert_eq!(f64_to_f32(-x, Rz), -1.0);
        // Exactly half an ulp above 1: Rn ties to even (1.0), Rna away (one_up).
        let h = 1.0 + 2f64.powi(-24);
        assert_eq!(f64_to_f32(h, Rn), 1.0);
        assert_eq!(f64_to_f32(h, Rna), one_up);
        // Half an ulp above one_up (odd): Rn goes up to even.
        let h2 = 1.0 + 3.0 * 2f64.powi(-24);
        assert_eq!(f64_to_f32(h2, Rn).to_bits(), 0x3F80_0002);
        // Overflow: past f32::MAX.
        let big = f32::MAX as f64 * 1.5;
        assert_eq!(f64_to_f32(big, Rn), f32::INFINITY);
        assert_eq!(f64_to_f32(big, Rz), f32::MAX);
        assert_eq!(f64_to_f32(big, Rm), f32::MAX);
        assert_eq!(f64_to_f32(big, Rp), f32::INFINITY);
        assert_eq!(f64_to_f32(-big, Rm), f32::NEG_INFINITY);
        assert_eq!(f64_to_f32(-big, Rp), -f32::MAX);
        // Above f32::MAX by a quarter ulp (2^102), below the tie MAX + 2^103: Rn keeps MAX; the
        // tie itself goes to even, which is up (MAX is odd), to Inf.
        let above = f32::MAX as f64 + 2f64.powi(102);
        assert_eq!(
            f64_to_f32(f32::MAX as f64 + 2f64.powi(103), Rn),
            f32::INFINITY
        );
        assert_eq!(f64_to_f32(above, Rn), f32::MAX);
        assert_eq!(f64_to_f32(above, Rp), f32::INFINITY);
        // Subnormal results, rounded directed: 2^-149 is the smallest subnormal.
        let tiny = 2f64.powi(-151);
        assert_eq!(f64_to_f32(tiny, Rn), 0.0);
        assert_eq!(f64_to_f32(tiny, Rp).to_bits(), 1);
        assert_eq!(f64_to_f32(-tiny, Rm).to_bits(), 0x8000_0001);
        assert_eq!(f64_to_f32(-tiny, Rn).to_bits(), 0x8000_0000);
        // Half the smallest subnormal: ties to even (0); 0.75 of it: up.
        assert_eq!(f64_to_f32(2f64.powi(-150), Rn).to_bits(), 0);
        assert_eq!(f64_to_f32(1.5 * 2f64.powi(-149), Rn).to_bits(), 2);
        // The smallest f64 subnormal.
        assert_eq!(f64_to_f32(f64::from_bits(1), Rp).to_bits(), 1);
        assert_eq!(f64_to_f32(f64::from_bits(1), Rz).to_bits(), 0);
        // Rounding up from the largest subnormal into the normal range.
        let x = (0x007F_FFFF as f64 + 0.75) * 2f64.powi(-149);
        assert_eq!(f64_to_f32(x, Rn).to_bits(), 0x0080_0000);
        // Specials.
        assert!(f64_to_f32(f64::NAN, Rn).is_nan());
        assert_eq!(f64_to_f32(f64::NEG_INFINITY, Rz), f32::NEG_INFINITY);
        assert_eq!(f64_to_f32(-0.0, Rn).to_bits(), 0x8000_0000);
        // Rn agrees with Rust's cast (itself correctly rounded) on a sweep.
        let mut s = 0x1234_5678_9ABC_DEF0u64;
        for _ in 0..20000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = f64::from_bits(s);
            if x.is_nan() {
                continue;
            }
            assert_eq!(f64_to_f32(x, Rn).to_bits(), (x as f32).to_bits(), "{x:e}");
            // Directed modes bracket the value.
            let (lo, hi) = (f64_to_f32(x, Rm) as f64, f64_to_f32(x, Rp) as f64);
            assert!(lo <= x && x <= hi, "{x:e}");
        }
    }

    #[test]
    fn round_to_integral() {
        use IntRounding::*;
        assert_eq!(round_f32_to_integral(2.5, Rni), 2.0);
        assert_eq!(round_f32_to_integral(3.5, Rni), 4.0);
        assert_eq!(round_f32_to_integral(-2.5, Rni), -2.0);
        assert_eq!(round_f32_to_integral(-2.5, Rzi), -2.0);
        assert_eq!(round_f32_to_integral(-2.5, Rmi), -3.0);
        assert_eq!(round_f32_to_integral(-2.5, Rpi), -2.0);
        assert_eq!(round_f32_to_integral(2.5, Rpi), 3.0);
        assert_eq!(round_f32_to_integral(-0.4, Rni).to_bits(), 0x8000_0000);
        assert_eq!(round_f32_to_integral(-0.4, Rpi).to_bits(), 0x8000_0000);
        assert_eq!(round_f32_to_integral(16777217.0, Rni), 16777216.0);
        assert!(round_f32_to_integral(f32::NAN, Rni).is_nan());
        assert_eq!(round_f32_to_integral(f32::INFINITY, Rzi), f32::INFINITY);
    }

    #[test]
    fn float_to_int_saturates() {
        use IntRounding::*;
        assert_eq!(float_to_int(2.5, Rni, true, 32), 2);
        assert_eq!(float_to_int(-2.5, Rni, true, 32), (-2i64) as u64);
        assert_eq!(float_to_int(-2.5, Rmi, true, 32), (-3i64) as u64);
        assert_eq!(float_to_int(2.1, Rpi, false, 32), 3);
        // Saturation at each width, both signs.
        assert_eq!(float_to_int(1e10, Rzi, true, 32), i32::MAX as u64);
        assert_eq!(float_to_int(-1e10, Rzi, true, 32), i32::MIN as i64 as u64);
        assert_eq!(float_to_int(1e10, Rzi, false, 32), u32::MAX as u64);
        assert_eq!(float_to_int(300.0, Rzi, false, 8), 255);
        assert_eq!(float_to_int(-300.0, Rzi, true, 8), (-128i64) as u64);
        assert_eq!(float_to_int(128.0, Rzi, true, 8), 127);
        assert_eq!(float_to_int(127.9, Rzi, true, 8), 127);
        assert_eq!(float_to_int(-128.9, Rzi, true, 8), (-128i64) as u64);
        assert_eq!(float_to_int(-128.9, Rmi, true, 8), (-128i64) as u64);
        assert_eq!(float_to_int(f64::INFINITY, Rni, true, 64), i64::MAX as u64);
        assert_eq!(
            float_to_int(f64::NEG_INFINITY, Rni, true, 64),
            i64::MIN as u64
        );
        assert_eq!(
            float_to_int(1.8446744073709552e19, Rzi, false, 64),
            u64::MAX
        );
        assert_eq!(float_to_int(2f64.powi(63), Rzi, true, 64), i64::MAX as u64);
        // The largest f64 below 2^63 converts exactly.
        let x = f64::from_bits(2f64.powi(63).to_bits() - 1);
        assert_eq!(float_to_int(x, Rzi, true, 64), x as i64 as u64);
        // Negative to unsigned: 0 (also -0.7 rounded toward zero is -0).
        assert_eq!(float_to_int(-5.0, Rni, false, 32), 0);
        assert_eq!(float_to_int(-0.7, Rzi, false, 16), 0);
        assert_eq!(float_to_int(-0.7, Rni, false, 16), 0);
        // NaN: 0 for a non-f64 source and a destination narrower than 64 bits; otherwise
        // 1 << (bits - 1) (MININT for signed).
        assert_eq!(float_to_int(f64::NAN, Rni, true, 32), 0);
        assert_eq!(float_to_int(f64::NAN, Rni, false, 16), 0);
        assert_eq!(float_to_int(f64::NAN, Rni, true, 64), 1u64 << 63);
        assert_eq!(float_to_int(f64::NAN, Rni, false, 64), 1u64 << 63);
        assert_eq!(f64_to_int(f64::NAN, Rni, true, 32), i32::MIN as i64 as u64);
        assert_eq!(f64_to_int(f64::NAN, Rni, false, 32), 1u64 << 31);
        assert_eq!(f64_to_int(f64::NAN, Rni, true, 8), (-128i64) as u64);
        assert_eq!(f64_to_int(7.5, Rni, true, 32), 8);
        // Out-of-range widths do not panic.
        assert_eq!(float_to_int(3.0, Rni, false, 0), 1);
        assert_eq!(float_to_int(3.0, Rni, false, 99), 3);
    }

    #[test]
    fn int_to_float_directed() {
        use Rounding::*;
        let p24 = 1i128 << 24;
        // 2^24 + 1 is halfway between 2^24 and 2^24 + 2.
        assert_eq!(int_to_f32(p24 + 1, Rn), 16777216.0);
        assert_eq!(int_to_f32(p24 + 1, Rz), 16777216.0);
        assert_eq!(int_to_f32(p24 + 1, Rm), 16777216.0);
        assert_eq!(int_to_f32(p24 + 1, Rp), 16777218.0);
        assert_eq!(int_to_f32(p24 + 1, Rna), 16777218.0);
        assert_eq!(int_to_f32(p24 + 3, Rn), 16777220.0);
        assert_eq!(int_to_f32(-(p24 + 1), Rm), -16777218.0);
        assert_eq!(int_to_f32(-(p24 + 1), Rp), -16777216.0);
        assert_eq!(int_to_f32(-(p24 + 1), Rz), -16777216.0);
        // u64::MAX: Rn and Rp give 2^64, Rz and Rm the largest f32 below.
        let m = u64::MAX as i128;
        assert_eq!(int_to_f32(m, Rn), 2f32.powi(64));
        assert_eq!(int_to_f32(m, Rp), 2f32.powi(64));
        assert_eq!(int_to_f32(m, Rz).to_bits(), 2f32.powi(64).to_bits() - 1);
        assert_eq!(int_to_f32(m, Rm).to_bits(), 2f32.powi(64).to_bits() - 1);
        // f64: 2^53 + 1 halfway.
        let p53 = 1i128 << 53;
        assert_eq!(int_to_f64(p53 + 1, Rn), 9007199254740992.0);
        assert_eq!(int_to_f64(p53 + 1, Rp), 9007199254740994.0);
        assert_eq!(int_to_f64(m, Rz).to_bits(), 2f64.powi(64).to_bits() - 1);
        assert_eq!(int_to_f64(m, Rn), 2f64.powi(64));
        assert_eq!(int_to_f64(i64::MIN as i128, Rz), -(2f64.powi(63)));
        assert_eq!(
            int_to_f64(i64::MAX as i128, Rm).to_bits(),
            2f64.powi(63).to_bits() - 1
        );
        // 0 is +0 in every mode.
        assert_eq!(int_to_f32(0, Rm).to_bits(), 0);
        assert_eq!(int_to_f64(-7, Rn), -7.0);
        // i128 extremes do not panic.
        let _ = int_to_f32(i128::MIN, Rn);
        let _ = int_to_f64(i128::MAX, Rp);
        // Rn agrees with Rust's cast (correctly rounded) on a sweep of u64 / i64.
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = s >> (s % 64);
            assert_eq!(int_to_f32(v as i128, Rn), v as f32);
            assert_eq!(int_to_f64(v as i128, Rn), v as f64);
            assert_eq!(int_to_f32(v as i64 as i128, Rn), v as i64 as f32);
        }
    }

    #[test]
    fn ftz_flushes_subnormals_keeping_sign() {
        assert_eq!(ftz(f32::from_bits(1)).to_bits(), 0);
        assert_eq!(ftz(f32::from_bits(0x8000_0001)).to_bits(), 0x8000_0000);
        assert_eq!(ftz(f32::MIN_POSITIVE), f32::MIN_POSITIVE);
        assert_eq!(ftz(-1.5), -1.5);
        assert!(ftz(f32::NAN).is_nan());
    }
}
