//! Decoding of the memory, synchronisation and warp-wide instructions.

use crate::inst::*;
use crate::parse::{err, EntryBuilder, ParseError};

fn bad<T>(no: usize, text: &str) -> Result<T, ParseError> {
    err(no, format!("instruction form not modelled: `{text}`"))
}

fn vector(s: &str) -> Option<Vec<&str>> {
    let inner = s.strip_prefix('{')?.strip_suffix('}')?;
    Some(inner.split(',').map(str::trim).collect())
}

/// Element size in bytes and signedness of a `ld`/`st` type.
fn elem(t: &str) -> Option<(u32, bool)> {
    Some(match t {
        "b8" | "u8" => (1, false),
        "s8" => (1, true),
        "b16" | "u16" => (2, false),
        "s16" => (2, true),
        "b32" | "u32" | "f32" => (4, false),
        "s32" => (4, true),
        "b64" | "u64" | "f64" | "s64" => (8, false),
        _ => return None,
    })
}

pub(crate) fn ld_st(
    b: &mut EntryBuilder,
    no: usize,
    text: &str,
    base: &str,
    m: &[&str],
    ops: &[&str],
) -> Result<Op, ParseError> {
    let mut m = m;
    // `ld.relaxed.{cta,gpu,sys}`: blocks run one after another and warps interleave only at
    // whole instructions, so a relaxed load reads the latest store, as a weak load does.
    if base == "ld" {
        if let ["relaxed", "cta" | "gpu" | "sys", rest @ ..] = m {
            m = rest;
        }
    }
    let (space, rest) = match m {
        ["global", "nc", rest @ ..] if base == "ld" => (Space::Global, rest),
        ["global", rest @ ..] => (Space::Global, rest),
        ["shared" | "shared::cta", rest @ ..] => (Space::Shared, rest),
        ["param", rest @ ..] if base == "ld" => (Space::Param, rest),
        _ => return bad(no, text),
    };
    let (n, t) = match rest {
        [t] => (1u8, *t),
        ["v2", t] => (2, *t),
        ["v4", t] => (4, *t),
        _ => return bad(no, text),
    };
    let Some((size, signed)) = elem(t) else {
        return bad(no, text);
    };
    if ops.len() != 2 || (n == 4 && size == 8) {
        return bad(no, text);
    }
    let vals = |s: &str| -> Option<Vec<String>> {
        if n == 1 {
            (!s.starts_with('{')).then(|| vec![s.to_string()])
        } else {
            vector(s)
                .filter(|v| v.len() == n as usize)
                .map(|v| v.iter().map(|x| x.to_string()).collect())
        }
    };
    if base == "ld" {
        let Some(v) = vals(ops[0]) else {
            return bad(no, text);
        };
        let mut d = [0; 4];
        for (k, r) in v.iter().enumerate() {
            d[k] = b.dst(no, r)?;
        }
        let addr = b.addr(no, ops[1])?;
        Ok(Op::Ld {
            space,
            size,
            signed,
            d,
            n,
            addr,
        })
    } else {
        let Some(v) = vals(ops[1]) else {
            return bad(no, text);
        };
        let mut a = [Src::Imm(0); 4];
        for (k, r) in v.iter().enumerate() {
            a[k] = b.src(no, r)?;
        }
        let addr = b.addr(no, ops[0])?;
        Ok(Op::St {
            space,
            size,
            a,
            n,
            addr,
        })
    }
}

/// `Ok` when the instruction has `k` operands, else an error naming it.
fn operand_count(no: usize, text: &str, ops: &[&str], k: usize) -> Result<(), ParseError> {
    if ops.len() == k {
        Ok(())
    } else {
        err(
            no,
            format!("`{text}` needs {k} operands, has {}", ops.len()),
        )
    }
}

pub(crate) fn other(
    b: &mut EntryBuilder,
    no: usize,
    text: &str,
    base: &str,
    m: &[&str],
    ops: &[&str],
) -> Result<Op, ParseError> {
    let nops = |k: usize| operand_count(no, text, ops, k);
    if base == "cp" {
        return cp(b, no, text, m, ops);
    }
    match (base, m) {
        ("atom", ["global", "add", t @ ("u32" | "u64" | "s32")]) => {
            nops(3)?;
            let size = if *t == "u64" { 8 } else { 4 };
            Ok(Op::AtomAdd {
                size,
                d: b.dst(no, ops[0])?,
                addr: b.addr(no, ops[1])?,
                b: b.src(no, ops[2])?,
            })
        }
        // Barrier 0 with no thread count: every thread of the block.
        ("bar", ["sync"]) => {
            if ops != ["0"] {
                return bad(no, text);
            }
            Ok(Op::Bar)
        }
        ("membar", ["gl" | "cta" | "sys"]) => {
            nops(0)?;
            Ok(Op::Membar)
        }
        ("shfl", ["sync", mode, "b32"]) => {
            let mode = match *mode {
                "up" => ShflMode::Up,
                "down" => ShflMode::Down,
                "bfly" => ShflMode::Bfly,
                "idx" => ShflMode::Idx,
                _ => return bad(no, text),
            };
            nops(5)?;
            let (d, p) = match ops[0].split_once('|') {
                Some((d, p)) => (b.dst(no, d)?, Some(b.dst(no, p)?)),
                None => (b.dst(no, ops[0])?, None),
            };
            Ok(Op::Shfl {
                mode,
                d,
                p,
                a: b.src(no, ops[1])?,
                b: b.src(no, ops[2])?,
                c: b.src(no, ops[3])?,
                mask: b.src(no, ops[4])?,
            })
        }
        ("vote", ["sync", "ballot", "b32"]) => {
            nops(3)?;
            let (neg, p) = match ops[1].strip_prefix('!') {
                Some(p) => (true, p),
                None => (false, ops[1]),
            };
            Ok(Op::Ballot {
                d: b.dst(no, ops[0])?,
                p: b.dst(no, p)?,
                neg,
                mask: b.src(no, ops[2])?,
            })
        }
        ("mma", ["sync", "aligned", "m16n8k16", "row", "col", "f32", "bf16", "bf16", "f32"]) => {
            nops(4)?;
            let v = |i: usize, n: usize| vector(ops[i]).filter(|v| v.len() == n);
            let (Some(dv), Some(av), Some(bv), Some(cv)) = (v(0, 4), v(1, 4), v(2, 2), v(3, 4))
            else {
                return bad(no, text);
            };
            let mut d = [0; 4];
            let mut a = [Src::Imm(0); 4];
            let mut bb = [Src::Imm(0); 2];
            let mut c = [Src::Imm(0); 4];
            for k in 0..4 {
                d[k] = b.dst(no, dv[k])?;
                a[k] = b.src(no, av[k])?;
                c[k] = b.src(no, cv[k])?;
            }
            for k in 0..2 {
                bb[k] = b.src(no, bv[k])?;
            }
            Ok(Op::Mma { d, a, b: bb, c })
        }
        ("ldmatrix", ["sync", "aligned", "m8n8", x, rest @ ..]) => {
            let num: u8 = match *x {
                "x1" => 1,
                "x2" => 2,
                "x4" => 4,
                _ => return bad(no, text),
            };
            let trans = match rest {
                ["shared" | "shared::cta", "b16"] => false,
                ["trans", "shared" | "shared::cta", "b16"] => true,
                _ => return bad(no, text),
            };
            nops(2)?;
            let regs: Vec<&str> = if num == 1 && !ops[0].starts_with('{') {
                vec![ops[0]]
            } else {
                match vector(ops[0]).filter(|v| v.len() == num as usize) {
                    Some(v) => v,
                    None => return bad(no, text),
                }
            };
            let mut d = [0; 4];
            for (k, r) in regs.iter().enumerate() {
                d[k] = b.dst(no, r)?;
            }
            Ok(Op::Ldmatrix {
                num,
                trans,
                d,
                addr: b.addr(no, ops[1])?,
            })
        }
        _ => bad(no, text),
    }
}

/// `cp.async` and its groups.
fn cp(
    b: &mut EntryBuilder,
    no: usize,
    text: &str,
    m: &[&str],
    ops: &[&str],
) -> Result<Op, ParseError> {
    let nops = |k: usize| operand_count(no, text, ops, k);
    match ("cp", m) {
        ("cp", ["async", cache @ ("ca" | "cg"), "shared" | "shared::cta", "global"]) => {
            if ops.len() != 3 && ops.len() != 4 {
                return bad(no, text);
            }
            let size: u32 = match ops[2] {
                "4" => 4,
                "8" => 8,
                "16" => 16,
                _ => return bad(no, text),
            };
            // `.cg` caches at L2 only and takes 16 bytes only.
            if *cache == "cg" && size != 16 {
                return bad(no, text);
            }
            let src_size = match ops.get(3) {
                Some(s) => Some(b.src(no, s)?),
                None => None,
            };
            Ok(Op::CpAsync {
                size,
                dst: b.addr(no, ops[0])?,
                src: b.addr(no, ops[1])?,
                src_size,
            })
        }
        ("cp", ["async", "commit_group"]) => {
            nops(0)?;
            Ok(Op::CpCommit)
        }
        ("cp", ["async", "wait_all"]) => {
            nops(0)?;
            Ok(Op::CpWait { n: 0, all: true })
        }
        ("cp", ["async", "wait_group"]) => {
            nops(1)?;
            match ops[0].parse() {
                Ok(n) => Ok(Op::CpWait { n, all: false }),
                Err(_) => bad(no, text),
            }
        }
        _ => bad(no, text),
    }
}
