//! One lane's ALU instruction over its register file: integer, floating-point, compare,
//! select and conversion forms, with the PTX ISA's semantics.

use crate::inst::*;
use crate::{approx, convert};

#[inline(always)]
fn v(r: &[u64], s: Src) -> u64 {
    match s {
        Src::Reg(i) => r[i as usize],
        Src::Imm(x) => x,
    }
}

#[inline(always)]
fn mask(x: u64, bits: u32) -> u64 {
    if bits >= 64 {
        x
    } else {
        x & ((1u64 << bits) - 1)
    }
}

/// Sign-extends the low `bits` of `x`.
#[inline(always)]
fn sx(x: u64, bits: u32) -> i64 {
    let s = 64 - bits.min(64);
    ((x << s) as i64) >> s
}

#[inline(always)]
fn f32v(r: &[u64], s: Src, ftz: bool) -> f32 {
    let x = f32::from_bits(v(r, s) as u32);
    if ftz {
        convert::ftz(x)
    } else {
        x
    }
}

#[inline(always)]
fn f64v(r: &[u64], s: Src) -> f64 {
    f64::from_bits(v(r, s))
}

/// The canonical NaNs `max.NaN`/`min.NaN` return.
const NAN32: u32 = 0x7fff_ffff;
const NAN64: u64 = 0x7fff_ffff_ffff_ffff;

/// `min`/`max` without `.NaN`: a NaN operand yields the other; -0 is below +0.
fn fminmax<T: PartialOrd + Copy>(
    a: T,
    b: T,
    max: bool,
    nan: impl Fn(T) -> bool,
    neg: impl Fn(T) -> bool,
) -> T {
    if nan(a) {
        return b;
    }
    if nan(b) {
        return a;
    }
    let a_lt_b = a < b || (a == b && neg(a) && !neg(b));
    if a_lt_b == max {
        b
    } else {
        a
    }
}

fn int_op(op: IntOp, ty: IntTy, a: u64, b: u64) -> u64 {
    let bits = ty.bits();
    let s = ty.signed();
    let (ua, ub) = (mask(a, bits), mask(b, bits));
    let (ia, ib) = (sx(a, bits), sx(b, bits));
    let r = match op {
        IntOp::Add => ua.wrapping_add(ub),
        IntOp::Sub => ua.wrapping_sub(ub),
        IntOp::MulLo => ua.wrapping_mul(ub),
        IntOp::MulHi => {
            let p = if s {
                (ia as i128 * ib as i128) as u128
            } else {
                ua as u128 * ub as u128
            };
            (p >> bits) as u64
        }
        IntOp::MulWide => {
            let p = if s {
                ia.wrapping_mul(ib) as u64
            } else {
                ua.wrapping_mul(ub)
            };
            return mask(p, bits * 2);
        }
        // Division by zero is unspecified in the ISA; modelled as all ones (the quotient
        // the hardware's unsigned division returns), and the remainder as the dividend.
        IntOp::Div => match (s, ub == 0) {
            (_, true) => u64::MAX,
            (true, false) => ia.wrapping_div(ib) as u64,
            (false, false) => ua / ub,
        },
        IntOp::Rem => match (s, ub == 0) {
            (_, true) => ua,
            (true, false) => ia.wrapping_rem(ib) as u64,
            (false, false) => ua % ub,
        },
        IntOp::Min | IntOp::Max => {
            let a_lt = if s { ia < ib } else { ua < ub };
            if a_lt == (op == IntOp::Min) {
                ua
            } else {
                ub
            }
        }
        IntOp::And => ua & ub,
        IntOp::Or => ua | ub,
        IntOp::Xor => ua ^ ub,
        // Shift amounts are unsigned 32-bit; those above the width clamp to it.
        IntOp::Shl => {
            let n = b as u32;
            if n >= bits {
                0
            } else {
                ua << n
            }
        }
        IntOp::Shr => {
            let n = (b as u32).min(bits);
            if s {
                (ia >> n.min(63)) as u64
            } else if n >= bits {
                0
            } else {
                ua >> n
            }
        }
    };
    mask(r, bits)
}

/// `bfind`: the bit position of the most significant non-sign bit (for a signed negative
/// value, the most significant 0), or 0xffffffff if none; `.shiftamt` gives the left shift
/// that moves it to the top instead.
fn bfind(ty: IntTy, shiftamt: bool, a: u64) -> u64 {
    let bits = ty.bits();
    let mut x = mask(a, bits);
    if ty.signed() && sx(a, bits) < 0 {
        x = mask(!x, bits);
    }
    if x == 0 {
        return 0xffff_ffff;
    }
    let pos = 63 - x.leading_zeros() as u64;
    if shiftamt {
        bits as u64 - 1 - pos
    } else {
        pos
    }
}

fn cmp_f(c: Cmp, a: f64, b: f64) -> bool {
    let nan = a.is_nan() || b.is_nan();
    match c {
        Cmp::Eq => a == b,
        Cmp::Ne => !nan && a != b,
        Cmp::Lt => a < b,
        Cmp::Le => a <= b,
        Cmp::Gt => a > b,
        Cmp::Ge => a >= b,
        Cmp::Equ => nan || a == b,
        Cmp::Neu => nan || a != b,
        Cmp::Ltu => nan || a < b,
        Cmp::Leu => nan || a <= b,
        Cmp::Gtu => nan || a > b,
        Cmp::Geu => nan || a >= b,
        Cmp::Num => !nan,
        Cmp::Nan => nan,
    }
}

fn cmp_i(c: Cmp, ty: IntTy, a: u64, b: u64) -> bool {
    let bits = ty.bits();
    let o = if ty.signed() {
        sx(a, bits).cmp(&sx(b, bits))
    } else {
        mask(a, bits).cmp(&mask(b, bits))
    };
    match c {
        Cmp::Eq => o.is_eq(),
        Cmp::Ne => o.is_ne(),
        Cmp::Lt => o.is_lt(),
        Cmp::Le => o.is_le(),
        Cmp::Gt => o.is_gt(),
        Cmp::Ge => o.is_ge(),
        // The decoder admits the unordered forms for floats only.
        _ => false,
    }
}

fn f32_bin(op: FOp, a: f32, b: f32) -> u32 {
    let r = match op {
        FOp::Add => a + b,
        FOp::Sub => a - b,
        FOp::Mul => a * b,
        FOp::Div => a / b,
        FOp::Min | FOp::Max => fminmax(a, b, op == FOp::Max, f32::is_nan, |x| x.is_sign_negative()),
        FOp::MinNaN | FOp::MaxNaN => {
            if a.is_nan() || b.is_nan() {
                return NAN32;
            }
            fminmax(a, b, op == FOp::MaxNaN, f32::is_nan, |x| {
                x.is_sign_negative()
            })
        }
        // copysign d, a, b: b's magnitude with a's sign.
        FOp::Copysign => b.copysign(a),
    };
    r.to_bits()
}

fn f64_bin(op: FOp, a: f64, b: f64) -> u64 {
    let r = match op {
        FOp::Add => a + b,
        FOp::Sub => a - b,
        FOp::Mul => a * b,
        FOp::Div => a / b,
        FOp::Min | FOp::Max => fminmax(a, b, op == FOp::Max, f64::is_nan, |x| x.is_sign_negative()),
        FOp::MinNaN | FOp::MaxNaN => {
            if a.is_nan() || b.is_nan() {
                return NAN64;
            }
            fminmax(a, b, op == FOp::MaxNaN, f64::is_nan, |x| {
                x.is_sign_negative()
            })
        }
        FOp::Copysign => b.copysign(a),
    };
    r.to_bits()
}

fn un32(op: FUn, ftz: bool, a: f32) -> f32 {
    match op {
        FUn::Neg => -a,
        FUn::Abs => a.abs(),
        FUn::Sqrt => a.sqrt(),
        FUn::Rcp => 1.0 / a,
        FUn::Ex2Approx => approx::ex2(a, ftz),
        FUn::Lg2Approx => approx::lg2(a, ftz),
        FUn::RcpApprox => approx::rcp(a, ftz),
        FUn::RsqrtApprox => approx::rsqrt(a, ftz),
        FUn::SqrtApprox => approx::sqrt(a, ftz),
        FUn::SinApprox => approx::sin(a, ftz),
        FUn::CosApprox => approx::cos(a, ftz),
        FUn::TanhApprox => approx::tanh(a),
    }
}

fn un64(op: FUn, a: f64) -> f64 {
    match op {
        FUn::Neg => -a,
        FUn::Abs => a.abs(),
        FUn::Sqrt => a.sqrt(),
        FUn::Rcp => 1.0 / a,
        // The decoder admits the approximate forms for f32 only.
        _ => f64::NAN,
    }
}

fn round64(x: f64, r: convert::IntRounding) -> f64 {
    match r {
        convert::IntRounding::Rni => x.round_ties_even(),
        convert::IntRounding::Rzi => x.trunc(),
        convert::IntRounding::Rmi => x.floor(),
        convert::IntRounding::Rpi => x.ceil(),
    }
}

fn cvt(dt: CvtTy, at: CvtTy, round: CvtRound, ftz: bool, sat: bool, a: u64) -> u64 {
    // `.sat` on float results clamps to [0, 1] (NaN to 0).
    let sat32 = |x: f32| {
        if !sat {
            x
        } else if x.is_nan() {
            0.0
        } else {
            x.clamp(0.0, 1.0)
        }
    };
    let sat64 = |x: f64| {
        if !sat {
            x
        } else if x.is_nan() {
            0.0
        } else {
            x.clamp(0.0, 1.0)
        }
    };
    let fz = |x: f32| if ftz { convert::ftz(x) } else { x };
    match (dt, at) {
        (CvtTy::Int(d), CvtTy::Int(s)) => {
            let x = if s.signed() {
                sx(a, s.bits()) as u64
            } else {
                mask(a, s.bits())
            };
            mask(x, d.bits())
        }
        (CvtTy::Int(d), CvtTy::F32 | CvtTy::F64) => {
            let x = if at == CvtTy::F32 {
                fz(f32::from_bits(a as u32)) as f64
            } else {
                f64::from_bits(a)
            };
            let CvtRound::Int(r) = round else { return 0 };
            // A NaN converts by the source's width (PTX ISA, "Integer Notes").
            let i = if at == CvtTy::F64 {
                convert::f64_to_int(x, r, d.signed(), d.bits())
            } else {
                convert::float_to_int(x, r, d.signed(), d.bits())
            };
            mask(i, d.bits())
        }
        (CvtTy::F32 | CvtTy::F64, CvtTy::Int(s)) => {
            let x: i128 = if s.signed() {
                sx(a, s.bits()) as i128
            } else {
                mask(a, s.bits()) as i128
            };
            let CvtRound::Float(r) = round else { return 0 };
            if dt == CvtTy::F32 {
                sat32(convert::int_to_f32(x, r)).to_bits() as u64
            } else {
                sat64(convert::int_to_f64(x, r)).to_bits()
            }
        }
        (CvtTy::F64, CvtTy::F32) => {
            let x = fz(f32::from_bits(a as u32)) as f64;
            sat64(x).to_bits()
        }
        (CvtTy::F32, CvtTy::F64) => {
            let CvtRound::Float(r) = round else { return 0 };
            fz(sat32(convert::f64_to_f32(f64::from_bits(a), r))).to_bits() as u64
        }
        (CvtTy::F32, CvtTy::F32) => {
            let CvtRound::Int(r) = round else { return 0 };
            let x = fz(f32::from_bits(a as u32));
            fz(sat32(convert::round_f32_to_integral(x, r))).to_bits() as u64
        }
        (CvtTy::F64, CvtTy::F64) => {
            let CvtRound::Int(r) = round else { return 0 };
            sat64(round64(f64::from_bits(a), r)).to_bits()
        }
    }
}

/// Executes `op` (an ALU form) for one lane.
#[inline]
pub(crate) fn step(op: &Op, r: &mut [u64]) {
    let (d, x) = match *op {
        Op::Mov { d, a, bits } => (
            d,
            if bits == 1 {
                (v(r, a) != 0) as u64
            } else {
                mask(v(r, a), bits)
            },
        ),
        Op::Pack { d, lo, hi } => (d, mask(v(r, lo), 32) | (v(r, hi) << 32)),
        Op::Unpack { lo, hi, a } => {
            let x = v(r, a);
            r[lo as usize] = mask(x, 32);
            (hi, x >> 32)
        }
        Op::Int { op, ty, d, a, b } => (d, int_op(op, ty, v(r, a), v(r, b))),
        Op::MadLo { ty, d, a, b, c } => {
            let p = int_op(IntOp::MulLo, ty, v(r, a), v(r, b));
            (d, int_op(IntOp::Add, ty, p, v(r, c)))
        }
        Op::MadWide { ty, d, a, b, c } => {
            let p = int_op(IntOp::MulWide, ty, v(r, a), v(r, b));
            (d, mask(p.wrapping_add(v(r, c)), ty.bits() * 2))
        }
        Op::IntNeg { ty, d, a } => (d, mask(v(r, a).wrapping_neg(), ty.bits())),
        Op::IntNot { bits, d, a } => (d, mask(!v(r, a), bits)),
        Op::IntAbs { ty, d, a } => (
            d,
            mask(sx(v(r, a), ty.bits()).wrapping_abs() as u64, ty.bits()),
        ),
        Op::Bfind { ty, shiftamt, d, a } => (d, bfind(ty, shiftamt, v(r, a))),
        Op::Popc { bits, d, a } => (d, mask(v(r, a), bits).count_ones() as u64),
        Op::Clz { bits, d, a } => (
            d,
            (mask(v(r, a), bits).leading_zeros() - (64 - bits)) as u64,
        ),
        Op::F32 { op, ftz, d, a, b } => {
            let x = f32_bin(op, f32v(r, a, ftz), f32v(r, b, ftz));
            (
                d,
                if ftz {
                    convert::ftz(f32::from_bits(x)).to_bits()
                } else {
                    x
                } as u64,
            )
        }
        Op::F64 { op, d, a, b } => (d, f64_bin(op, f64v(r, a), f64v(r, b))),
        Op::Fma32 { ftz, d, a, b, c } => {
            let x = f32v(r, a, ftz).mul_add(f32v(r, b, ftz), f32v(r, c, ftz));
            (d, if ftz { convert::ftz(x) } else { x }.to_bits() as u64)
        }
        Op::Fma64 { d, a, b, c } => (d, f64v(r, a).mul_add(f64v(r, b), f64v(r, c)).to_bits()),
        Op::Un32 { op, ftz, d, a } => {
            let x = un32(op, ftz, f32v(r, a, ftz));
            (d, if ftz { convert::ftz(x) } else { x }.to_bits() as u64)
        }
        Op::Un64 { op, d, a } => (d, un64(op, f64v(r, a)).to_bits()),
        Op::Setp {
            cmp,
            ty,
            d,
            a,
            b,
            combine,
        } => {
            let (a, b) = (v(r, a), v(r, b));
            let mut t = match ty {
                CmpTy::Int(ty) => cmp_i(cmp, ty, a, b),
                CmpTy::F32 => cmp_f(
                    cmp,
                    f32::from_bits(a as u32) as f64,
                    f32::from_bits(b as u32) as f64,
                ),
                CmpTy::F64 => cmp_f(cmp, f64::from_bits(a), f64::from_bits(b)),
            };
            if let Some((op, p, neg)) = combine {
                let q = (r[p as usize] != 0) != neg;
                t = match op {
                    BoolOp::And => t && q,
                    BoolOp::Or => t || q,
                    BoolOp::Xor => t ^ q,
                };
            }
            (d, t as u64)
        }
        Op::Selp { d, a, b, p, bits } => {
            let x = if r[p as usize] != 0 { v(r, a) } else { v(r, b) };
            (d, mask(x, bits))
        }
        Op::PredBool { op, d, a, b } => {
            let (a, b) = (v(r, a) != 0, v(r, b) != 0);
            let t = match op {
                BoolOp::And => a && b,
                BoolOp::Or => a || b,
                BoolOp::Xor => a ^ b,
            };
            (d, t as u64)
        }
        Op::PredNot { d, a } => (d, (v(r, a) == 0) as u64),
        Op::Cvt {
            dt,
            at,
            round,
            ftz,
            sat,
            d,
            a,
        } => (d, cvt(dt, at, round, ftz, sat, v(r, a))),
        Op::CvtBf16x2 { d, a, b } => {
            let (a, b) = (
                f32::from_bits(v(r, a) as u32),
                f32::from_bits(v(r, b) as u32),
            );
            (d, convert::bf16x2_from_f32(a, b) as u64)
        }
        // Memory, control and warp-wide forms are executed elsewhere.
        _ => return,
    };
    r[d as usize] = x;
}
