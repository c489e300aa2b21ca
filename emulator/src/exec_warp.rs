//! The warp-wide instructions: `shfl.sync`, `vote.sync.ballot`, `mma.sync.aligned` and
//! `ldmatrix.sync.aligned`. Each checks that the lanes executing it together are its member
//! mask (all 32 for the `.aligned` forms), else a WarpDivergence finding.

#![allow(clippy::needless_range_loop)]

use crate::exec::{lanes, Block, Run};
use crate::exec_mem::load;
use crate::inst::*;
use crate::tensor;
use crate::FindingKind as K;

#[inline]
fn v(r: &[u64], s: Src) -> u64 {
    match s {
        Src::Reg(i) => r[i as usize],
        Src::Imm(x) => x,
    }
}

fn diverged(run: &mut Run, line: u32, base: u32, what: &str, want: u32, got: u32) {
    let t = base + (want ^ got).trailing_zeros().min(31);
    run.find(K::WarpDivergence, line, t, None, || {
        format!("{what} with member mask {want:#010x} executed by lanes {got:#010x}")
    });
}

pub(crate) fn exec(run: &mut Run, blk: &mut Block, inst: &Inst, base: u32, mask: u32, exec: u32) {
    let ns = blk.ns;
    let n = blk.cp.len() as u32;
    let k = n.saturating_sub(base).min(32);
    let exists = if k >= 32 { u32::MAX } else { (1u32 << k) - 1 };
    let reg = |blk: &Block, l: usize, s: Src| v(&blk.regs[(base as usize + l) * ns..][..ns], s);
    let line = inst.line;
    let _ = mask;
    match inst.op {
        Op::Shfl {
            mode,
            d,
            p,
            a,
            b,
            c,
            mask: mm,
        } => {
            let mut src = [0u64; 32];
            for l in lanes(exec) {
                src[l] = reg(blk, l, a) & 0xffff_ffff;
            }
            for l in lanes(exec) {
                let member = reg(blk, l, mm) as u32 & exists;
                if member != exec {
                    diverged(run, line, base, "shfl.sync", member, exec);
                }
                // PTX ISA, shfl.sync: c packs the clamp value (bits 0-4) and the segment
                // mask (bits 8-12); an out-of-range source lane reads its own value.
                let bval = reg(blk, l, b) as u32 & 31;
                let cv = reg(blk, l, c) as u32;
                let (cval, seg) = (cv & 31, (cv >> 8) & 31);
                let lane = l as u32;
                let max_lane = (lane & seg) | (cval & !seg);
                let min_lane = lane & seg;
                let (j, ok) = match mode {
                    ShflMode::Up => {
                        let j = lane as i32 - bval as i32;
                        (j, j >= max_lane as i32)
                    }
                    ShflMode::Down => {
                        let j = (lane + bval) as i32;
                        (j, j <= max_lane as i32)
                    }
                    ShflMode::Bfly => {
                        let j = (lane ^ bval) as i32;
                        (j, j <= max_lane as i32)
                    }
                    ShflMode::Idx => {
                        let j = (min_lane | (bval & !seg)) as i32;
                        (j, j <= max_lane as i32)
                    }
                };
                let j = if ok { j as usize } else { l };
                if exec & (1 << j) == 0 {
                    diverged(
                        run,
                        line,
                        base,
                        "shfl.sync reading an inactive lane",
                        1 << j,
                        exec,
                    );
                }
                let ri = (base as usize + l) * ns;
                blk.regs[ri + d as usize] = src[j];
                if let Some(p) = p {
                    blk.regs[ri + p as usize] = ok as u64;
                }
            }
        }
        Op::Ballot {
            d,
            p,
            neg,
            mask: mm,
        } => {
            let mut bits = 0u32;
            for l in lanes(exec) {
                if (reg(blk, l, Src::Reg(p)) != 0) != neg {
                    bits |= 1 << l;
                }
            }
            for l in lanes(exec) {
                let member = reg(blk, l, mm) as u32 & exists;
                if member != exec {
                    diverged(run, line, base, "vote.sync.ballot", member, exec);
                }
                blk.regs[(base as usize + l) * ns + d as usize] = (bits & member) as u64;
            }
        }
        Op::Mma { d, a, b, c } => {
            if exec != u32::MAX {
                return diverged(run, line, base, "mma.sync.aligned", u32::MAX, exec);
            }
            let mut fa = [[0u32; 4]; 32];
            let mut fb = [[0u32; 2]; 32];
            let mut fc = [[0f32; 4]; 32];
            for l in 0..32 {
                for i in 0..4 {
                    fa[l][i] = reg(blk, l, a[i]) as u32;
                    fc[l][i] = f32::from_bits(reg(blk, l, c[i]) as u32);
                }
                for i in 0..2 {
                    fb[l][i] = reg(blk, l, b[i]) as u32;
                }
            }
            let out = tensor::mma_m16n8k16_bf16(&fa, &fb, &fc, run.opts.mma);
            for (l, o) in out.iter().enumerate() {
                let ri = (base as usize + l) * ns;
                for i in 0..4 {
                    blk.regs[ri + d[i] as usize] = o[i].to_bits() as u64;
                }
            }
        }
        Op::Ldmatrix {
            num,
            trans,
            d,
            addr,
        } => {
            if exec != u32::MAX {
                return diverged(run, line, base, "ldmatrix.sync.aligned", u32::MAX, exec);
            }
            // Lane 8*m + r gives the address of matrix m's row r: 16 bytes, 16-aligned.
            let mut rows = [[[0u16; 8]; 8]; 4];
            for m in 0..num as usize {
                for r in 0..8 {
                    let l = 8 * m + r;
                    let at = reg(blk, l, Src::Reg(addr.base)).wrapping_add(addr.offset as u64);
                    let mut buf = [0u8; 16];
                    if load(run, blk, Space::Shared, at, &mut buf, base + l as u32, line) {
                        for (e, x) in rows[m][r].iter_mut().enumerate() {
                            *x = u16::from_le_bytes([buf[2 * e], buf[2 * e + 1]]);
                        }
                    }
                }
            }
            let out = tensor::ldmatrix_distribute(&rows[..num as usize], trans);
            for (l, o) in out.iter().enumerate() {
                let ri = (base as usize + l) * ns;
                for j in 0..num as usize {
                    blk.regs[ri + d[j] as usize] = o[j] as u64;
                }
            }
        }
        _ => {}
    }
}
