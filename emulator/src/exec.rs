//! Runs a launch: blocks one after another in order (so "the last block finishes the
//! reduction" patterns built on atomics work), warps of 32 lanes within a block. Each lane
//! has its own PC; a warp executes the instruction at the lowest PC among its runnable lanes,
//! for the lanes at that PC (min-PC reconvergence). A warp runs until all its lanes have
//! exited or wait at `bar.sync`; when every warp of the block is so, the barrier releases.
//!
//! Findings stop the launch once `Options::max_findings` distinct ones (kind and PTX line)
//! are recorded: `launch` then returns `Ok` with the report (later repeats of one kind at
//! one line are not recorded again, so the report names distinct bugs).

use std::collections::HashSet;

use crate::exec_mem::CpState;
use crate::inst::{Op, Special};
use crate::parse::{Entry, ParamKind, SymKind};
use crate::shared::{Shared, SHARED_BASE};
use crate::{EmuError, Finding, FindingKind, Launch, Memory, Module, Options, ParamValue, Report};

/// Where parameter-space addresses start (so a zero address is outside).
pub(crate) const PARAM_BASE: u64 = 0x100;

/// The most shared memory a block may have (sm_90: 227 KB).
const MAX_SHARED: u64 = 227 * 1024;

pub(crate) struct Run<'a> {
    pub entry: &'a Entry,
    pub launch: &'a Launch<'a>,
    pub mem: &'a mut Memory,
    pub opts: &'a Options,
    pub params: Vec<u8>,
    pub report: Report,
    seen: HashSet<(FindingKind, u32)>,
    pub stop: bool,
    pub block: [u32; 3],
    /// Set by an instruction that cannot go on: (line, message).
    pub abort: Option<(u32, String)>,
}

/// One block's state: every thread's registers (thread-major), shared memory, cp.async
/// groups.
pub(crate) struct Block {
    pub ns: usize,
    pub regs: Vec<u64>,
    pub shared: Shared,
    pub cp: Vec<CpState>,
}

pub(crate) struct Warp {
    /// The block's thread index of lane 0.
    pub base: u32,
    pub pc: [u32; 32],
    /// Lanes that exist and have not exited.
    pub live: u32,
    /// Lanes waiting at a barrier.
    pub waiting: u32,
    /// Lanes that exist.
    pub exists: u32,
}

/// The lanes set in a mask, lowest first.
#[inline]
pub(crate) fn lanes(mut m: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (m != 0).then(|| {
            let l = m.trailing_zeros() as usize;
            m &= m - 1;
            l
        })
    })
}

impl Run<'_> {
    /// Records a finding (the first at each kind and line), by thread `t` of the block.
    pub fn find(
        &mut self,
        kind: FindingKind,
        line: u32,
        t: u32,
        address: Option<u64>,
        detail: impl FnOnce() -> String,
    ) {
        if !self.seen.insert((kind, line)) {
            return;
        }
        let [bx, by, _] = self.launch.block;
        let thread = [t % bx, (t / bx) % by, t / (bx * by)];
        self.report.findings.push(Finding {
            kind,
            entry: self.entry.name.clone(),
            line: line as usize,
            block: self.block,
            thread,
            address,
            detail: detail(),
        });
        if self.report.findings.len() >= self.opts.max_findings {
            self.stop = true;
        }
    }

    fn aborted(&mut self, line: u32, message: String) -> EmuError {
        EmuError::Aborted {
            entry: self.entry.name.clone(),
            line: line as usize,
            message,
            report: Box::new(std::mem::take(&mut self.report)),
        }
    }
}

fn bad_launch(entry: &str, message: String) -> EmuError {
    EmuError::BadLaunch {
        entry: entry.to_string(),
        message,
    }
}

/// The parameter buffer, laid out as declared, after checking the launch's values.
fn params(entry: &Entry, launch: &Launch) -> Result<Vec<u8>, EmuError> {
    if entry.params.len() != launch.params.len() {
        return Err(EmuError::ParamCount {
            entry: entry.name.clone(),
            expected: entry.params.len(),
            got: launch.params.len(),
        });
    }
    let mut buf = vec![0u8; entry.param_bytes as usize];
    for (i, (p, v)) in entry.params.iter().zip(&launch.params).enumerate() {
        let bytes = match (p.kind, v) {
            (ParamKind::U64, ParamValue::U64(x)) => x.to_le_bytes().to_vec(),
            (ParamKind::U32, ParamValue::U32(x)) => x.to_le_bytes().to_vec(),
            (ParamKind::F32, ParamValue::F32(x)) => x.to_le_bytes().to_vec(),
            (ParamKind::Bytes(n), ParamValue::Bytes(b)) if b.len() == n as usize => b.clone(),
            _ => {
                let got = match v {
                    ParamValue::U64(_) => ".u64".to_string(),
                    ParamValue::U32(_) => ".u32".to_string(),
                    ParamValue::F32(_) => ".f32".to_string(),
                    ParamValue::Bytes(b) => format!(".b8[{}]", b.len()),
                };
                return Err(EmuError::ParamType {
                    entry: entry.name.clone(),
                    index: i,
                    name: p.name.clone(),
                    expected: p.kind.describe(),
                    got,
                });
            }
        };
        let o = p.offset as usize;
        buf[o..o + bytes.len()].copy_from_slice(&bytes);
    }
    Ok(buf)
}

pub(crate) fn run(
    module: &Module,
    launch: &Launch,
    memory: &mut Memory,
    options: &Options,
) -> Result<Report, EmuError> {
    let entry = module
        .entry(launch.entry)
        .ok_or_else(|| EmuError::NoEntry(launch.entry.to_string()))?;
    let threads: u64 = launch.block.iter().map(|&x| x as u64).product();
    if threads == 0 || threads > 1024 || launch.grid.contains(&0) {
        return Err(bad_launch(
            &entry.name,
            format!("grid {:?}, block {:?}", launch.grid, launch.block),
        ));
    }
    let dyn_off = (entry.shared_static as u64).next_multiple_of(entry.dyn_align as u64);
    let shared_bytes = dyn_off + launch.dynamic_shared as u64;
    if shared_bytes > MAX_SHARED {
        return Err(bad_launch(
            &entry.name,
            format!("{shared_bytes} bytes of shared memory (at most {MAX_SHARED})"),
        ));
    }
    let params = params(entry, launch)?;
    // Symbol addresses; `.global` variables get a zero-filled allocation named after them,
    // made on first use and kept (PTX: `.global` variables start zero).
    let mut sym_addr = Vec::with_capacity(entry.symbols.len());
    for s in &entry.symbols {
        sym_addr.push(match s.kind {
            SymKind::Param(o) => PARAM_BASE + o as u64,
            SymKind::Shared(o) => SHARED_BASE + o as u64,
            SymKind::Dynamic => SHARED_BASE + dyn_off,
            SymKind::Global { size, align: _ } => {
                let label = format!(".global {}", s.name);
                match memory.find_label(&label) {
                    Some(a) => a,
                    None => {
                        let a = memory.alloc(size as u64, label);
                        let _ = memory.write(a, &vec![0; size as usize]);
                        a
                    }
                }
            }
        });
    }
    let mut run = Run {
        entry,
        launch,
        mem: memory,
        opts: options,
        params,
        report: Report::default(),
        seen: HashSet::new(),
        stop: false,
        block: [0; 3],
        abort: None,
    };
    let [gx, gy, gz] = launch.grid;
    for z in 0..gz {
        for y in 0..gy {
            for x in 0..gx {
                run.block = [x, y, z];
                run_block(&mut run, &sym_addr, threads as u32, shared_bytes as u32)?;
                if run.stop {
                    return Ok(run.report);
                }
            }
        }
    }
    Ok(run.report)
}

fn run_block(run: &mut Run, sym_addr: &[u64], n: u32, shared: u32) -> Result<(), EmuError> {
    let entry = run.entry;
    let ns = entry.slots as usize;
    let [bx, by, bz] = run.launch.block;
    let [gx, gy, gz] = run.launch.grid;
    let mut blk = Block {
        ns,
        regs: vec![0; ns * n as usize],
        shared: Shared::new(shared),
        cp: (0..n).map(|_| CpState::default()).collect(),
    };
    for t in 0..n {
        let r = &mut blk.regs[t as usize * ns..(t as usize + 1) * ns];
        let tid = [t % bx, (t / bx) % by, t / (bx * by)];
        for &(slot, sp) in &entry.specials {
            r[slot as usize] = match sp {
                Special::Tid(d) => tid[d] as u64,
                Special::Ntid(d) => [bx, by, bz][d] as u64,
                Special::Ctaid(d) => run.block[d] as u64,
                Special::Nctaid(d) => [gx, gy, gz][d] as u64,
                Special::LaneId => (t % 32) as u64,
                Special::WarpId => (t / 32) as u64,
                Special::Symbol(i) => sym_addr[i],
            };
        }
    }
    let mut warps: Vec<Warp> = (0..n.div_ceil(32))
        .map(|w| {
            let k = (n - w * 32).min(32);
            let m = if k == 32 { u32::MAX } else { (1u32 << k) - 1 };
            Warp {
                base: w * 32,
                pc: [0; 32],
                live: m,
                waiting: 0,
                exists: m,
            }
        })
        .collect();
    loop {
        for w in warps.iter_mut() {
            run_warp(run, &mut blk, w)?;
            if run.stop {
                return Ok(());
            }
        }
        let waiting = warps.iter().any(|w| w.waiting != 0);
        if !waiting {
            return Ok(());
        }
        // Every warp is blocked: the barrier releases. Threads that exited while others wait
        // never arrive (PTX: bar.sync waits for all threads of the block).
        if let Some(w) = warps.iter().find(|w| w.live != w.exists) {
            let t = w.base + (w.exists & !w.live).trailing_zeros();
            let line = warps
                .iter()
                .find(|w| w.waiting != 0)
                .map(|w| {
                    let l = w.waiting.trailing_zeros() as usize;
                    entry.insts[w.pc[l] as usize - 1].line
                })
                .unwrap_or(0);
            run.find(FindingKind::BarrierDivergence, line, t, None, || {
                format!("thread {t} of the block exited while others wait at bar.sync")
            });
        }
        for w in warps.iter_mut() {
            w.waiting = 0;
        }
        blk.shared.barrier();
    }
}

fn run_warp(run: &mut Run, blk: &mut Block, w: &mut Warp) -> Result<(), EmuError> {
    let entry = run.entry;
    let insts = &entry.insts;
    let ns = blk.ns;
    loop {
        let runnable = w.live & !w.waiting;
        if runnable == 0 || run.stop {
            return Ok(());
        }
        let mut p = u32::MAX;
        for l in lanes(runnable) {
            p = p.min(w.pc[l]);
        }
        let mut mask = 0u32;
        for l in lanes(runnable) {
            if w.pc[l] == p {
                mask |= 1 << l;
            }
        }
        let Some(inst) = insts.get(p as usize) else {
            // Running off the end is `ret`.
            w.live &= !mask;
            continue;
        };
        run.report.instructions += mask.count_ones() as u64;
        if run.report.instructions > run.opts.max_instructions {
            let m = format!(
                "more than {} lane-instructions (an endless loop?)",
                run.opts.max_instructions
            );
            return Err(run.aborted(inst.line, m));
        }
        let exec = match inst.guard {
            None => mask,
            Some((s, neg)) => {
                let mut e = 0;
                for l in lanes(mask) {
                    let t = (w.base as usize + l) * ns;
                    if (blk.regs[t + s as usize] != 0) != neg {
                        e |= 1 << l;
                    }
                }
                e
            }
        };
        let next = p + 1;
        match &inst.op {
            Op::Bra { target } => {
                for l in lanes(mask) {
                    w.pc[l] = if exec & (1 << l) != 0 { *target } else { next };
                }
                continue;
            }
            Op::Ret => w.live &= !exec,
            Op::Bar => {
                if exec != 0 && exec != w.live {
                    let t = w.base + (w.live & !exec).trailing_zeros();
                    run.find(FindingKind::BarrierDivergence, inst.line, t, None, || {
                        format!(
                            "bar.sync reached by lanes {exec:#010x} of the warp; live lanes \
                             {:#010x}",
                            w.live
                        )
                    });
                }
                w.waiting |= exec;
            }
            Op::Ld { .. }
            | Op::St { .. }
            | Op::AtomAdd { .. }
            | Op::CpAsync { .. }
            | Op::CpCommit
            | Op::CpWait { .. }
            | Op::Membar => crate::exec_mem::exec(run, blk, inst, w.base, exec),
            Op::Shfl { .. } | Op::Ballot { .. } | Op::Mma { .. } | Op::Ldmatrix { .. } => {
                crate::exec_warp::exec(run, blk, inst, w.base, mask, exec)
            }
            op => {
                for l in lanes(exec) {
                    let t = (w.base as usize + l) * ns;
                    crate::exec_alu::step(op, &mut blk.regs[t..t + ns]);
                }
            }
        }
        if let Some((line, m)) = run.abort.take() {
            return Err(run.aborted(line, m));
        }
        for l in lanes(mask) {
            w.pc[l] = next;
        }
    }
}
