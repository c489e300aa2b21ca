//! Memory instructions for the lanes of one warp: global, shared and parameter loads and
//! stores, `atom.global.add`, and `cp.async` with its per-thread groups. Each access is
//! checked (alignment, bounds, written bytes, shared races, pending copies); a misaligned or
//! out-of-bounds access is not performed (loads yield 0).

use std::collections::VecDeque;

use crate::exec::{lanes, Block, Run, PARAM_BASE};
use crate::inst::*;
use crate::FindingKind as K;

/// A cp.async in flight: its shared destination and the bytes it will write.
#[derive(Debug, Clone)]
pub(crate) struct Copy {
    off: usize,
    data: [u8; 16],
    len: u8,
    line: u32,
}

/// One thread's cp.async groups: copies issued but not committed, then committed groups,
/// oldest first.
#[derive(Debug, Clone, Default)]
pub(crate) struct CpState {
    open: Vec<Copy>,
    groups: VecDeque<Vec<Copy>>,
}

#[inline]
fn v(r: &[u64], s: Src) -> u64 {
    match s {
        Src::Reg(i) => r[i as usize],
        Src::Imm(x) => x,
    }
}

fn space_name(s: Space) -> &'static str {
    match s {
        Space::Global => "global",
        Space::Shared => "shared",
        Space::Param => "param",
    }
}

/// Reads `out.len()` bytes at `addr` of `space` for thread `t` with every check; false if
/// the access was not performed.
pub(crate) fn load(
    run: &mut Run,
    blk: &mut Block,
    space: Space,
    addr: u64,
    out: &mut [u8],
    t: u32,
    line: u32,
) -> bool {
    load_as(run, blk, space, addr, out, t, line, true)
}

/// `load`, with the alignment check or without (a cp.async's partial source).
#[allow(clippy::too_many_arguments)]
fn load_as(
    run: &mut Run,
    blk: &mut Block,
    space: Space,
    addr: u64,
    out: &mut [u8],
    t: u32,
    line: u32,
    align: bool,
) -> bool {
    let len = out.len() as u64;
    if align && !addr.is_multiple_of(len) {
        run.find(K::Misaligned, line, t, Some(addr), || {
            format!(
                "{len}-byte {} load at an address not a multiple of {len}",
                space_name(space)
            )
        });
        return false;
    }
    match space {
        Space::Global => match run.mem.load(addr, out.len()) {
            Ok((data, init)) => {
                out.copy_from_slice(data);
                if !init {
                    run.find(K::UninitializedRead, line, t, Some(addr), || {
                        format!("{len}-byte global load of bytes never written")
                    });
                }
                true
            }
            Err(e) => {
                run.find(K::GlobalOutOfBounds, line, t, Some(addr), || {
                    format!("load: {e}")
                });
                false
            }
        },
        Space::Shared => {
            let Some(off) = blk.shared.offset(addr, len) else {
                let size = blk.shared.size();
                run.find(K::SharedOutOfBounds, line, t, Some(addr), || {
                    format!("{len}-byte shared load outside the block's {size} bytes")
                });
                return false;
            };
            let (init, h) = blk.shared.read(off, out, t);
            if h.pending {
                run.find(K::AsyncCopyPending, line, t, Some(addr), || {
                    "shared load of a cp.async destination before its wait_group".into()
                });
            }
            if let Some((o, wrote)) = h.race {
                run.find(K::SharedRace, line, t, Some(addr), || {
                    let what = if wrote { "written" } else { "read" };
                    format!("shared load of a word {what} by thread {o} with no bar.sync between")
                });
            }
            // A pending destination is unwritten too; the pending finding says why.
            if !init && !h.pending {
                run.find(K::UninitializedRead, line, t, Some(addr), || {
                    format!("{len}-byte shared load of bytes never written")
                });
            }
            true
        }
        Space::Param => {
            let o = addr.wrapping_sub(PARAM_BASE);
            if addr < PARAM_BASE || o + len > run.params.len() as u64 {
                run.abort = Some((
                    line,
                    format!("ld.param at {addr:#x} outside the parameters"),
                ));
                return false;
            }
            out.copy_from_slice(&run.params[o as usize..(o + len) as usize]);
            true
        }
    }
}

/// Writes `bytes` at `addr` of `space` for thread `t` with every check.
pub(crate) fn store(
    run: &mut Run,
    blk: &mut Block,
    space: Space,
    addr: u64,
    bytes: &[u8],
    t: u32,
    line: u32,
) {
    let len = bytes.len() as u64;
    if !addr.is_multiple_of(len) {
        run.find(K::Misaligned, line, t, Some(addr), || {
            format!(
                "{len}-byte {} store at an address not a multiple of {len}",
                space_name(space)
            )
        });
        return;
    }
    match space {
        Space::Global => {
            if let Err(e) = run.mem.store(addr, bytes) {
                run.find(K::GlobalOutOfBounds, line, t, Some(addr), || {
                    format!("store: {e}")
                });
            }
        }
        Space::Shared => {
            let Some(off) = blk.shared.offset(addr, len) else {
                let size = blk.shared.size();
                run.find(K::SharedOutOfBounds, line, t, Some(addr), || {
                    format!("{len}-byte shared store outside the block's {size} bytes")
                });
                return;
            };
            let h = blk.shared.write(off, bytes, t);
            if h.pending {
                run.find(K::AsyncCopyPending, line, t, Some(addr), || {
                    "shared store to a cp.async destination before its wait_group".into()
                });
            }
            if let Some((o, wrote)) = h.race {
                run.find(K::SharedRace, line, t, Some(addr), || {
                    let what = if wrote { "written" } else { "read" };
                    format!("shared store to a word {what} by thread {o} with no bar.sync between")
                });
            }
        }
        Space::Param => run.abort = Some((line, "st.param is not modelled".into())),
    }
}

pub(crate) fn exec(run: &mut Run, blk: &mut Block, inst: &Inst, base: u32, exec: u32) {
    let ns = blk.ns;
    let line = inst.line;
    match inst.op {
        Op::Ld {
            space,
            size,
            signed,
            d,
            n,
            addr,
        } => {
            let mut buf = [0u8; 32];
            for l in lanes(exec) {
                let t = base + l as u32;
                let ri = t as usize * ns;
                let a = blk.regs[ri + addr.base as usize].wrapping_add(addr.offset as u64);
                let bytes = &mut buf[..(size * n as u32) as usize];
                if !load(run, blk, space, a, bytes, t, line) {
                    bytes.fill(0);
                }
                for k in 0..n as usize {
                    let mut e = [0u8; 8];
                    e[..size as usize]
                        .copy_from_slice(&bytes[k * size as usize..(k + 1) * size as usize]);
                    let mut x = u64::from_le_bytes(e);
                    if signed {
                        let s = 64 - 8 * size;
                        x = (((x << s) as i64) >> s) as u64;
                    }
                    blk.regs[ri + d[k] as usize] = x;
                }
            }
        }
        Op::St {
            space,
            size,
            a,
            n,
            addr,
        } => {
            let mut buf = [0u8; 32];
            for l in lanes(exec) {
                let t = base + l as u32;
                let ri = t as usize * ns;
                let r = &blk.regs[ri..ri + ns];
                let at = r[addr.base as usize].wrapping_add(addr.offset as u64);
                let s = size as usize;
                for k in 0..n as usize {
                    buf[k * s..(k + 1) * s].copy_from_slice(&v(r, a[k]).to_le_bytes()[..s]);
                }
                store(run, blk, space, at, &buf[..s * n as usize], t, line);
            }
        }
        Op::AtomAdd { size, d, addr, b } => {
            for l in lanes(exec) {
                let t = base + l as u32;
                let ri = t as usize * ns;
                let at = blk.regs[ri + addr.base as usize].wrapping_add(addr.offset as u64);
                let mut old = [0u8; 8];
                let s = size as usize;
                if !load(run, blk, Space::Global, at, &mut old[..s], t, line) {
                    continue;
                }
                let o = u64::from_le_bytes(old);
                let new = o.wrapping_add(v(&blk.regs[ri..ri + ns], b));
                store(
                    run,
                    blk,
                    Space::Global,
                    at,
                    &new.to_le_bytes()[..s],
                    t,
                    line,
                );
                blk.regs[ri + d as usize] = o;
            }
        }
        // Blocks run one after another and warps interleave only at whole instructions:
        // every store is already visible to every later load.
        Op::Membar => {}
        Op::CpAsync {
            size,
            dst,
            src,
            src_size,
        } => {
            for l in lanes(exec) {
                cp_async(run, blk, base + l as u32, line, size, dst, src, src_size);
            }
        }
        Op::CpCommit => {
            for l in lanes(exec) {
                let c = &mut blk.cp[(base + l as u32) as usize];
                let g = std::mem::take(&mut c.open);
                c.groups.push_back(g);
            }
        }
        Op::CpWait { n, all } => {
            for l in lanes(exec) {
                let t = base + l as u32;
                let c = &mut blk.cp[t as usize];
                if all {
                    let g = std::mem::take(&mut c.open);
                    c.groups.push_back(g);
                }
                while c.groups.len() > n as usize {
                    let Some(g) = c.groups.pop_front() else { break };
                    for cp in g {
                        let h = blk.shared.land(cp.off, &cp.data[..cp.len as usize], t);
                        if let Some((o, wrote)) = h.race {
                            let addr = crate::shared::SHARED_BASE + cp.off as u64;
                            run.find(K::SharedRace, cp.line, t, Some(addr), || {
                                let what = if wrote { "written" } else { "read" };
                                format!("cp.async lands on a word {what} by thread {o} with no bar.sync between")
                            });
                        }
                    }
                }
            }
        }
        _ => {}
    }
}

/// One lane's `cp.async`: the global source is read (and checked) now, the shared
/// destination written when a wait completes its group; `src-size` below `cp-size`
/// zero-fills the rest (PTX ISA, cp.async).
#[allow(clippy::too_many_arguments)]
fn cp_async(
    run: &mut Run,
    blk: &mut Block,
    t: u32,
    line: u32,
    size: u32,
    dst: Addr,
    src: Addr,
    src_size: Option<Src>,
) {
    let ri = t as usize * blk.ns;
    let r = &blk.regs[ri..ri + blk.ns];
    let da = r[dst.base as usize].wrapping_add(dst.offset as u64);
    let sa = r[src.base as usize].wrapping_add(src.offset as u64);
    let n = src_size.map(|s| v(r, s) as u32).unwrap_or(size);
    if n > size {
        run.abort = Some((
            line,
            format!("cp.async src-size {n} above cp-size {size} is undefined"),
        ));
        return;
    }
    let len = size as u64;
    if !da.is_multiple_of(len) || !sa.is_multiple_of(len) {
        run.find(K::Misaligned, line, t, Some(if !da.is_multiple_of(len) { da } else { sa }), || {
            format!("cp.async of {size} bytes from {sa:#x} to shared {da:#x}: both must be {size}-byte aligned")
        });
        return;
    }
    let Some(off) = blk.shared.offset(da, len) else {
        let s = blk.shared.size();
        run.find(K::SharedOutOfBounds, line, t, Some(da), || {
            format!("cp.async destination of {size} bytes outside the block's {s} bytes")
        });
        return;
    };
    let mut data = [0u8; 16];
    if n > 0
        && !load_as(
            run,
            blk,
            Space::Global,
            sa,
            &mut data[..n as usize],
            t,
            line,
            false,
        )
    {
        data = [0; 16];
    }
    if blk.shared.is_pending(off, size as usize) {
        run.find(K::AsyncCopyPending, line, t, Some(da), || {
            "cp.async to a destination another cp.async has yet to write".into()
        });
    }
    blk.shared.add_pending(off, size as usize);
    blk.cp[t as usize].open.push(Copy {
        off,
        data,
        len: size as u8,
        line,
    });
}
