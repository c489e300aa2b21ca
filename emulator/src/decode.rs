//! One PTX instruction's text to its decoded form. Each opcode accepts exactly the modifier
//! and type combinations the executor models; anything else is a `ParseError` naming the
//! instruction.

use crate::convert::{IntRounding, Rounding};
use crate::inst::*;
use crate::parse::{err, EntryBuilder, ParseError};

/// Splits operands at top-level commas (not inside `{}` or `[]`).
fn operands(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if !s[start..].trim().is_empty() {
        out.push(s[start..].trim());
    }
    out
}

/// `{a, b, c}` to its parts.
fn vector(s: &str) -> Option<Vec<&str>> {
    let inner = s.strip_prefix('{')?.strip_suffix('}')?;
    Some(inner.split(',').map(str::trim).collect())
}

fn int_ty(t: &str) -> Option<IntTy> {
    Some(match t {
        "u16" | "b16" => IntTy::U16,
        "u32" | "b32" => IntTy::U32,
        "u64" | "b64" => IntTy::U64,
        "s16" => IntTy::S16,
        "s32" => IntTy::S32,
        "s64" => IntTy::S64,
        _ => return None,
    })
}

fn bits_of(t: &str) -> Option<u32> {
    Some(match t {
        "b16" | "u16" | "s16" => 16,
        "b32" | "u32" | "s32" | "f32" => 32,
        "b64" | "u64" | "s64" | "f64" => 64,
        "pred" => 1,
        _ => return None,
    })
}

fn cvt_ty(t: &str) -> Option<CvtTy> {
    match t {
        "f32" => Some(CvtTy::F32),
        "f64" => Some(CvtTy::F64),
        "u8" | "s8" | "b16" | "b32" | "b64" => None,
        _ => int_ty(t).map(CvtTy::Int),
    }
}

struct D<'a, 'b> {
    b: &'a mut EntryBuilder,
    no: usize,
    text: &'b str,
    ops: Vec<&'b str>,
}

impl D<'_, '_> {
    fn bad<T>(&self) -> Result<T, ParseError> {
        err(
            self.no,
            format!("instruction form not modelled: `{}`", self.text),
        )
    }
    fn n(&self, n: usize) -> Result<(), ParseError> {
        if self.ops.len() == n {
            Ok(())
        } else {
            err(
                self.no,
                format!("`{}` needs {n} operands, has {}", self.text, self.ops.len()),
            )
        }
    }
    fn s(&mut self, i: usize) -> Result<Src, ParseError> {
        let o = self.ops[i];
        self.b.src(self.no, o)
    }
    fn d(&mut self, i: usize) -> Result<Slot, ParseError> {
        let o = self.ops[i];
        self.b.dst(self.no, o)
    }
    fn bin(&mut self) -> Result<(Slot, Src, Src), ParseError> {
        self.n(3)?;
        Ok((self.d(0)?, self.s(1)?, self.s(2)?))
    }
    fn un(&mut self) -> Result<(Slot, Src), ParseError> {
        self.n(2)?;
        Ok((self.d(0)?, self.s(1)?))
    }
    /// A multiply-add's operands: `d, a, b, c`.
    fn tern(&mut self) -> Result<(Slot, Src, Src, Src), ParseError> {
        self.n(4)?;
        Ok((self.d(0)?, self.s(1)?, self.s(2)?, self.s(3)?))
    }
}

pub(crate) fn instruction(b: &mut EntryBuilder, no: usize, text: &str) -> Result<Inst, ParseError> {
    let mut s = text.trim();
    let mut guard = None;
    if let Some(g) = s.strip_prefix('@') {
        let (p, rest) = g.split_once(char::is_whitespace).unwrap_or((g, ""));
        let (neg, p) = match p.strip_prefix('!') {
            Some(p) => (true, p),
            None => (false, p),
        };
        guard = Some((b.reg(no, p)?, neg));
        s = rest.trim();
    }
    let (opcode, rest) = s.split_once(char::is_whitespace).unwrap_or((s, ""));
    let mods: Vec<&str> = opcode.split('.').collect();
    let mut d = D {
        b,
        no,
        text,
        ops: operands(rest),
    };
    let op = decode(&mut d, &mods)?;
    Ok(Inst {
        guard,
        op,
        line: no as u32,
    })
}

fn decode(d: &mut D, m: &[&str]) -> Result<Op, ParseError> {
    let Some((&base, m)) = m.split_first() else {
        return d.bad();
    };
    match (base, m) {
        ("mov", [t]) => mov(d, t),
        ("cvta", ["to", "global", "u64"]) => {
            let (dd, a) = d.un()?;
            Ok(Op::Mov { d: dd, a, bits: 64 })
        }
        ("add" | "sub" | "mul" | "div" | "min" | "max" | "copysign", _) => arith(d, base, m),
        ("rem", [t]) => int_bin(d, IntOp::Rem, t),
        ("and" | "or" | "xor", ["pred"]) => {
            let (dd, a, b) = d.bin()?;
            let op = match base {
                "and" => BoolOp::And,
                "or" => BoolOp::Or,
                _ => BoolOp::Xor,
            };
            Ok(Op::PredBool { op, d: dd, a, b })
        }
        ("and" | "or" | "xor", [t @ ("b16" | "b32" | "b64")]) => {
            let op = match base {
                "and" => IntOp::And,
                "or" => IntOp::Or,
                _ => IntOp::Xor,
            };
            int_bin(d, op, t)
        }
        ("not", ["pred"]) => {
            let (dd, a) = d.un()?;
            Ok(Op::PredNot { d: dd, a })
        }
        ("not", [t @ ("b16" | "b32" | "b64")]) => {
            let (dd, a) = d.un()?;
            let bits = bits_of(t).unwrap_or(64);
            Ok(Op::IntNot { bits, d: dd, a })
        }
        ("shl", [t @ ("b16" | "b32" | "b64")]) => int_bin(d, IntOp::Shl, t),
        // `shr.b` is a logical shift, as `shr.u`.
        ("shr", [t]) => int_bin(d, IntOp::Shr, t),
        ("mad", [half @ ("lo" | "wide"), t]) => {
            let wide = *half == "wide";
            // `.wide` doubles a 16- or 32-bit integer type.
            let doubles = matches!(*t, "u16" | "u32" | "s16" | "s32");
            let Some(ty) = int_ty(t).filter(|_| !wide || doubles) else {
                return d.bad();
            };
            let (d, a, b, c) = d.tern()?;
            Ok(match wide {
                false => Op::MadLo { ty, d, a, b, c },
                true => Op::MadWide { ty, d, a, b, c },
            })
        }
        ("fma", ["rn", rest @ ..]) | ("mad", ["rn", rest @ ..]) => {
            let (dd, a, b, c) = d.tern()?;
            match rest {
                ["f32"] => Ok(Op::Fma32 {
                    ftz: false,
                    d: dd,
                    a,
                    b,
                    c,
                }),
                ["ftz", "f32"] => Ok(Op::Fma32 {
                    ftz: true,
                    d: dd,
                    a,
                    b,
                    c,
                }),
                ["f64"] => Ok(Op::Fma64 { d: dd, a, b, c }),
                _ => d.bad(),
            }
        }
        ("neg" | "abs", [t @ ("s16" | "s32" | "s64")]) => {
            let (dd, a) = d.un()?;
            let ty = int_ty(t).unwrap_or(IntTy::S64);
            Ok(if base == "neg" {
                Op::IntNeg { ty, d: dd, a }
            } else {
                Op::IntAbs { ty, d: dd, a }
            })
        }
        ("bfind", rest) => {
            let (shiftamt, t) = match rest {
                ["shiftamt", t] => (true, *t),
                [t] => (false, *t),
                _ => return d.bad(),
            };
            let Some(ty) = int_ty(t).filter(|t| t.bits() >= 32) else {
                return d.bad();
            };
            let (dd, a) = d.un()?;
            Ok(Op::Bfind {
                ty,
                shiftamt,
                d: dd,
                a,
            })
        }
        ("popc" | "clz", [t @ ("b32" | "b64")]) => {
            let (dd, a) = d.un()?;
            let bits = bits_of(t).unwrap_or(64);
            Ok(if base == "popc" {
                Op::Popc { bits, d: dd, a }
            } else {
                Op::Clz { bits, d: dd, a }
            })
        }
        ("neg" | "abs" | "sqrt" | "rcp" | "rsqrt" | "ex2" | "lg2" | "sin" | "cos" | "tanh", _) => {
            float_unary(d, base, m)
        }
        ("setp", _) => setp(d, m),
        ("selp", [t]) => {
            let Some(bits) = bits_of(t).filter(|&b| b >= 16) else {
                return d.bad();
            };
            d.n(4)?;
            let (dd, a, b) = (d.d(0)?, d.s(1)?, d.s(2)?);
            Ok(Op::Selp {
                d: dd,
                a,
                b,
                p: d.d(3)?,
                bits,
            })
        }
        ("cvt", _) => cvt(d, m),
        ("ld" | "st", _) => crate::decode_mem::ld_st(d.b, d.no, d.text, base, m, &d.ops),
        ("atom" | "bar" | "membar" | "shfl" | "vote" | "mma" | "ldmatrix" | "cp", _) => {
            crate::decode_mem::other(d.b, d.no, d.text, base, m, &d.ops)
        }
        ("bra", [] | ["uni"]) => {
            d.n(1)?;
            Ok(d.b.branch(d.no, d.ops[0]))
        }
        ("ret" | "exit", []) => {
            d.n(0)?;
            Ok(Op::Ret)
        }
        _ => d.bad(),
    }
}

fn int_bin(d: &mut D, op: IntOp, t: &str) -> Result<Op, ParseError> {
    let Some(ty) = int_ty(t) else { return d.bad() };
    let (dd, a, b) = d.bin()?;
    Ok(Op::Int {
        op,
        ty,
        d: dd,
        a,
        b,
    })
}

/// add/sub/mul/div/min/max/copysign over integers and floats.
fn arith(d: &mut D, base: &str, m: &[&str]) -> Result<Op, ParseError> {
    let fop = match base {
        "add" => FOp::Add,
        "sub" => FOp::Sub,
        "mul" => FOp::Mul,
        "div" => FOp::Div,
        "min" => FOp::Min,
        "max" => FOp::Max,
        _ => FOp::Copysign,
    };
    // Integer forms.
    let iop = match (base, m) {
        ("add", [t]) => int_ty(t).map(|t| (IntOp::Add, t)),
        ("sub", [t]) => int_ty(t).map(|t| (IntOp::Sub, t)),
        ("mul", ["lo", t]) => int_ty(t).map(|t| (IntOp::MulLo, t)),
        ("mul", ["hi", t]) => int_ty(t).map(|t| (IntOp::MulHi, t)),
        ("mul", ["wide", t @ ("u16" | "u32" | "s16" | "s32")]) => {
            int_ty(t).map(|t| (IntOp::MulWide, t))
        }
        ("div", [t]) => int_ty(t).map(|t| (IntOp::Div, t)),
        ("min", [t]) => int_ty(t).map(|t| (IntOp::Min, t)),
        ("max", [t]) => int_ty(t).map(|t| (IntOp::Max, t)),
        _ => None,
    };
    if let Some((op, ty)) = iop {
        if m.iter().any(|x| x.starts_with('b')) && !matches!(op, IntOp::Add | IntOp::Sub) {
            return d.bad();
        }
        let (dd, a, b) = d.bin()?;
        return Ok(Op::Int {
            op,
            ty,
            d: dd,
            a,
            b,
        });
    }
    // Float forms: add/sub/mul/div need `.rn` for div, optional for add/sub/mul (the
    // default rounding is `.rn`); min/max take `.NaN`; `.ftz` on f32 only.
    let mut rn = false;
    let mut ftz = false;
    let mut nan = false;
    let mut ty = None;
    for &x in m {
        match x {
            "rn" if !rn => rn = true,
            "ftz" if !ftz => ftz = true,
            "NaN" if !nan => nan = true,
            "f32" | "f64" if ty.is_none() => ty = Some(x),
            _ => return d.bad(),
        }
    }
    let minmax = matches!(fop, FOp::Min | FOp::Max);
    let ok = match fop {
        FOp::Div => rn,
        FOp::Min | FOp::Max => !rn,
        FOp::Copysign => !rn && !nan && !ftz,
        _ => !nan,
    };
    if !ok || (nan && !minmax) || ty.is_none() {
        return d.bad();
    }
    let op = match (fop, nan) {
        (FOp::Min, true) => FOp::MinNaN,
        (FOp::Max, true) => FOp::MaxNaN,
        (f, _) => f,
    };
    let (dd, a, b) = d.bin()?;
    if ty == Some("f64") {
        if ftz {
            return d.bad();
        }
        Ok(Op::F64 { op, d: dd, a, b })
    } else {
        Ok(Op::F32 {
            op,
            ftz,
            d: dd,
            a,
            b,
        })
    }
}

fn float_unary(d: &mut D, base: &str, m: &[&str]) -> Result<Op, ParseError> {
    let (mode, ftz, ty) = match m {
        [t] => ("", false, *t),
        ["ftz", t] => ("", true, *t),
        [mode, t] => (*mode, false, *t),
        [mode, "ftz", t] => (*mode, true, *t),
        _ => return d.bad(),
    };
    let op = match (base, mode) {
        ("neg", "") => FUn::Neg,
        ("abs", "") => FUn::Abs,
        ("sqrt", "rn") => FUn::Sqrt,
        ("rcp", "rn") => FUn::Rcp,
        ("sqrt", "approx") if ty == "f32" => FUn::SqrtApprox,
        ("rcp", "approx") if ty == "f32" => FUn::RcpApprox,
        ("rsqrt", "approx") if ty == "f32" => FUn::RsqrtApprox,
        ("ex2", "approx") if ty == "f32" => FUn::Ex2Approx,
        ("lg2", "approx") if ty == "f32" => FUn::Lg2Approx,
        ("sin", "approx") if ty == "f32" => FUn::SinApprox,
        ("cos", "approx") if ty == "f32" => FUn::CosApprox,
        ("tanh", "approx") if ty == "f32" && !ftz => FUn::TanhApprox,
        _ => return d.bad(),
    };
    let (dd, a) = d.un()?;
    match ty {
        "f32" => Ok(Op::Un32 { op, ftz, d: dd, a }),
        "f64" if !ftz => Ok(Op::Un64 { op, d: dd, a }),
        _ => d.bad(),
    }
}

fn setp(d: &mut D, m: &[&str]) -> Result<Op, ParseError> {
    let (cmp, rest) = match m.split_first() {
        Some((c, r)) => (*c, r),
        None => return d.bad(),
    };
    let cmp = match cmp {
        "eq" => Cmp::Eq,
        "ne" => Cmp::Ne,
        "lt" => Cmp::Lt,
        "le" => Cmp::Le,
        "gt" => Cmp::Gt,
        "ge" => Cmp::Ge,
        "equ" => Cmp::Equ,
        "neu" => Cmp::Neu,
        "ltu" => Cmp::Ltu,
        "leu" => Cmp::Leu,
        "gtu" => Cmp::Gtu,
        "geu" => Cmp::Geu,
        "num" => Cmp::Num,
        "nan" => Cmp::Nan,
        // `lo/ls/hi/hs` are the unsigned spellings.
        "lo" => Cmp::Lt,
        "ls" => Cmp::Le,
        "hi" => Cmp::Gt,
        "hs" => Cmp::Ge,
        _ => return d.bad(),
    };
    let (bop, t) = match rest {
        [t] => (None, *t),
        ["and", t] => (Some(BoolOp::And), *t),
        ["or", t] => (Some(BoolOp::Or), *t),
        ["xor", t] => (Some(BoolOp::Xor), *t),
        _ => return d.bad(),
    };
    let float_only = matches!(
        cmp,
        Cmp::Equ | Cmp::Neu | Cmp::Ltu | Cmp::Leu | Cmp::Gtu | Cmp::Geu | Cmp::Num | Cmp::Nan
    );
    let ty = match t {
        "f32" => CmpTy::F32,
        "f64" => CmpTy::F64,
        _ if float_only => return d.bad(),
        "b16" | "b32" | "b64" if !matches!(cmp, Cmp::Eq | Cmp::Ne) => return d.bad(),
        _ => match int_ty(t) {
            Some(t) => CmpTy::Int(t),
            None => return d.bad(),
        },
    };
    d.n(if bop.is_some() { 4 } else { 3 })?;
    if d.ops[0].contains('|') {
        return d.bad();
    }
    let (dd, a, b) = (d.d(0)?, d.s(1)?, d.s(2)?);
    let combine = match bop {
        Some(op) => {
            let o = d.ops[3];
            let (neg, p) = match o.strip_prefix('!') {
                Some(p) => (true, p),
                None => (false, o),
            };
            Some((op, d.b.dst(d.no, p)?, neg))
        }
        None => None,
    };
    Ok(Op::Setp {
        cmp,
        ty,
        d: dd,
        a,
        b,
        combine,
    })
}

fn cvt(d: &mut D, m: &[&str]) -> Result<Op, ParseError> {
    if m == ["rn", "bf16x2", "f32"] {
        let (dd, a, b) = d.bin()?;
        return Ok(Op::CvtBf16x2 { d: dd, a, b });
    }
    let mut round = CvtRound::None;
    let (mut ftz, mut sat) = (false, false);
    let mut tys = Vec::new();
    for &x in m {
        let r = match x {
            "rn" => CvtRound::Float(Rounding::Rn),
            "rz" => CvtRound::Float(Rounding::Rz),
            "rm" => CvtRound::Float(Rounding::Rm),
            "rp" => CvtRound::Float(Rounding::Rp),
            "rni" => CvtRound::Int(IntRounding::Rni),
            "rzi" => CvtRound::Int(IntRounding::Rzi),
            "rmi" => CvtRound::Int(IntRounding::Rmi),
            "rpi" => CvtRound::Int(IntRounding::Rpi),
            "ftz" if !ftz => {
                ftz = true;
                continue;
            }
            "sat" if !sat => {
                sat = true;
                continue;
            }
            t => match cvt_ty(t) {
                Some(t) if tys.len() < 2 => {
                    tys.push(t);
                    continue;
                }
                _ => return d.bad(),
            },
        };
        if round != CvtRound::None {
            return d.bad();
        }
        round = r;
    }
    let [dt, at] = tys[..] else { return d.bad() };
    let float = |t: CvtTy| !matches!(t, CvtTy::Int(_));
    // The ISA's required roundings: integer rounding for float-to-int and float-to-float of
    // the same size; float rounding for int-to-float and narrowing float; none otherwise.
    let ok = match (float(dt), float(at), round) {
        (false, false, CvtRound::None) => !sat && !ftz,
        (true, false, CvtRound::Float(_)) => !ftz && !sat,
        (false, true, CvtRound::Int(_)) => !sat,
        (true, true, r) => match (dt, at, r) {
            (CvtTy::F64, CvtTy::F32, CvtRound::None) => !sat,
            (CvtTy::F32, CvtTy::F64, CvtRound::Float(_)) => !sat,
            (CvtTy::F32, CvtTy::F32, CvtRound::Int(_))
            | (CvtTy::F64, CvtTy::F64, CvtRound::Int(_)) => !sat,
            _ => false,
        },
        _ => false,
    };
    if !ok {
        return d.bad();
    }
    let (dd, a) = d.un()?;
    Ok(Op::Cvt {
        dt,
        at,
        round,
        ftz,
        sat,
        d: dd,
        a,
    })
}

/// `mov`, including `mov.b64` packing `{lo, hi}` and unpacking.
fn mov(d: &mut D, t: &str) -> Result<Op, ParseError> {
    let Some(bits) = bits_of(t) else {
        return d.bad();
    };
    d.n(2)?;
    if let Some(v) = vector(d.ops[1]) {
        if bits != 64 || v.len() != 2 {
            return d.bad();
        }
        let (lo, hi) = (d.b.src(d.no, v[0])?, d.b.src(d.no, v[1])?);
        return Ok(Op::Pack { d: d.d(0)?, lo, hi });
    }
    if let Some(v) = vector(d.ops[0]) {
        if bits != 64 || v.len() != 2 {
            return d.bad();
        }
        let (lo, hi) = (d.b.dst(d.no, v[0])?, d.b.dst(d.no, v[1])?);
        return Ok(Op::Unpack { lo, hi, a: d.s(1)? });
    }
    let (dd, a) = d.un()?;
    Ok(Op::Mov { d: dd, a, bits })
}
