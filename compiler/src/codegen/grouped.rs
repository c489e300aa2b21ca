//! Grouped kernels (the group pass): one launch evaluates the same elementwise chain over
//! every member's tensors, as apex's `multi_tensor_apply`. Each member's addresses and
//! element count travel by value in a table parameter (kept under the 4 KB of parameters
//! every CUDA device takes, so a large group is several launches); shared one-value operands
//! (the learning rate, the clip coefficient) are ordinary parameters.
//!
//! An update group's grid covers the members' elements, `CHUNK` per block; a block finds its
//! member by the table's block offsets. A squared-norm group (a chain ending in a sum of
//! everything) runs one block per member that sums exactly as the lone reduction kernel does
//! (`layout_reduce.rs` over the whole tensor: 256 lanes of strided f64 partial sums added in
//! lane order, or one lane in order below 64 elements), so each member's sum is the same
//! bits as before, and the chain is evaluated in registers instead of staged in the scratch.

use super::builder::{Kernel, Rd, F};
use super::elementwise::apply;
use super::{Arg, CodegenError, Gen, Launch, BLOCK};
use crate::ir::kernels::members_of;
use crate::ir::{KernelKind, Op};
use crate::plan::Plan;

/// The bytes of parameters a launch may pass on every CUDA device and driver.
const PARAM_BYTES: u64 = 4096;
/// Elements of one member each block of an update group takes (four per thread).
const CHUNK: u64 = 4 * BLOCK as u64;
/// Below this many elements the lone whole-tensor sum runs on one lane (`layout_reduce.rs`).
const ONE_LANE_BELOW: u64 = 64;

/// Where an op's operand comes from: a value of the same member, or an outside slot.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Src {
    Inside(usize),
    Slot(usize),
}

/// A member's wiring (the same in every member) and its outside operands by slot.
fn wiring(plan: &Plan, member: &[usize]) -> (Vec<Vec<Src>>, Vec<usize>) {
    let mut slots: Vec<usize> = Vec::new();
    let wires = member
        .iter()
        .map(|&s| {
            plan.steps[s]
                .operands
                .iter()
                .map(|o| match member.iter().position(|x| x == o) {
                    Some(i) => Src::Inside(i),
                    None => Src::Slot(match slots.iter().position(|x| x == o) {
                        Some(j) => j,
                        None => {
                            slots.push(*o);
                            slots.len() - 1
                        }
                    }),
                })
                .collect()
        })
        .collect();
    (wires, slots)
}

fn bad(message: &str) -> CodegenError {
    CodegenError::Bad {
        op: "grouped kernel",
        message: message.into(),
    }
}

/// What every launch of a group shares.
struct Pattern<'a> {
    ops: Vec<&'a Op>,
    wires: Vec<Vec<Src>>,
    /// Each slot: the step every member reads (shared), or none (each its own).
    shared: Vec<Option<usize>>,
    /// Each slot read at element 0 (one value) rather than at the element's index.
    one: Vec<bool>,
    /// Chain positions whose values are stored.
    stored: Vec<usize>,
    /// Each slot, then each stored value (and the sum): whether it is stored in bf16.
    slot_bf16: Vec<bool>,
    store_bf16: Vec<bool>,
    reduce: bool,
}

/// Per member: its element count and its table words (after the count and the block offset
/// or lane count): its own operands' addresses, then its stored values' addresses.
fn member_words(p: &Pattern, member: &[usize], slots: &[usize]) -> Vec<Arg> {
    let own = slots
        .iter()
        .zip(&p.shared)
        .filter(|(_, s)| s.is_none())
        .map(|(&o, _)| Arg::Value(o));
    let stores = p.stored.iter().map(|&i| Arg::Value(member[i]));
    let out = p.reduce.then(|| Arg::Value(*member.last().expect("a sum")));
    own.chain(stores).chain(out).collect()
}

/// The launches of grouped kernel `steps` of `kind`.
pub(super) fn generate(
    g: &mut Gen,
    name: &str,
    plan: &Plan,
    shapes: &[Vec<u64>],
    kind: KernelKind,
    steps: &[usize],
) -> Result<Vec<Launch>, CodegenError> {
    let KernelKind::Grouped { reduce, .. } = kind else {
        return Err(bad("is not grouped"));
    };
    let members: Vec<_> = members_of(kind, steps).collect();
    let first = members.first().ok_or(bad("has no members"))?.1;
    let (wires, first_slots) = wiring(plan, first);
    let mut all_slots = Vec::with_capacity(members.len());
    for (_, m) in &members {
        let (w, slots) = wiring(plan, m);
        let same = m.len() == first.len()
            && w == wires
            && m.iter().zip(first).all(|(a, b)| {
                plan.steps[*a].op == plan.steps[*b].op
                    && plan.steps[*a].buffer.is_some() == plan.steps[*b].buffer.is_some()
                    && plan.stored_in_bf16(*a) == plan.stored_in_bf16(*b)
            })
            && slots.len() == first_slots.len()
            && slots
                .iter()
                .zip(&first_slots)
                .all(|(&a, &b)| plan.stored_in_bf16(a) == plan.stored_in_bf16(b));
        if !same {
            return Err(bad("has members that differ"));
        }
        all_slots.push(slots);
    }
    let chain_len = first.len() - usize::from(reduce);
    let ops: Vec<&Op> = first[..chain_len]
        .iter()
        .map(|&s| &plan.steps[s].op)
        .collect();
    if ops.iter().any(|op| op.map().is_none()) {
        return Err(bad("holds an op that is not a map"));
    }
    if reduce && plan.steps[*first.last().expect("a sum")].buffer.is_none() {
        return Err(bad("has a sum that is not stored"));
    }
    let numel = |s: usize| shapes[s].iter().product::<u64>();
    let stored: Vec<usize> = (0..chain_len)
        .filter(|&i| plan.steps[first[i]].buffer.is_some())
        .collect();
    let pattern = Pattern {
        ops,
        wires,
        shared: (0..first_slots.len())
            .map(|j| {
                let o = first_slots[j];
                let all = all_slots.iter().all(|s| s[j] == o) && members.len() > 1;
                all.then_some(o)
            })
            .collect(),
        one: first_slots.iter().map(|&o| numel(o) == 1).collect(),
        stored: stored.clone(),
        slot_bf16: first_slots
            .iter()
            .map(|&o| plan.stored_in_bf16(o))
            .collect(),
        store_bf16: stored
            .iter()
            .map(|&i| first[i])
            .chain(reduce.then(|| *first.last().expect("a sum")))
            .map(|s| plan.stored_in_bf16(s))
            .collect(),
        reduce,
    };
    let shared_count = pattern.shared.iter().flatten().count() as u64;
    let per_member = 2 + member_words(&pattern, first, &first_slots).len() as u64;
    let fit = (PARAM_BYTES - 8 * shared_count) / (8 * per_member);
    let fit = usize::try_from(fit.max(1)).unwrap_or(usize::MAX);
    let mut launches = Vec::new();
    let indexed: Vec<usize> = (0..members.len()).collect();
    for (c, chunk) in indexed.chunks(fit).enumerate() {
        let mut words = Vec::new();
        let mut blocks = 0u64;
        for &m in chunk {
            let member = members[m].1;
            let n = numel(member[chain_len - 1]);
            if reduce {
                let lanes = if n < ONE_LANE_BELOW { 1 } else { BLOCK as u64 };
                words.extend([Arg::U64(n), Arg::U64(lanes)]);
            } else {
                words.extend([Arg::U64(blocks), Arg::U64(n)]);
                blocks += n.div_ceil(CHUNK);
            }
            words.extend(member_words(&pattern, member, &all_slots[m]));
        }
        let count = chunk.len() as u64;
        let opened = open(g, &format!("{name}g{c}"), &pattern, &words, count);
        let launch = if reduce {
            let grid = u32::try_from(chunk.len()).map_err(|_| bad("has too many members"))?;
            sums(g, &pattern, opened, grid)?
        } else {
            let grid = u32::try_from(blocks.max(1))
                .ok()
                .filter(|&b| b < i32::MAX as u32)
                .ok_or(bad("covers too many elements for one grid"))?;
            updates(g, &pattern, opened, grid)?
        };
        launches.push(launch);
    }
    Ok(launches)
}

/// A group kernel's parameters (`open`): the shared operands' pointers, declared first, then
/// the members' table, `record` bytes for each of its `members`; and the block's index.
struct Opened {
    shared: Vec<Option<Rd>>,
    table: Rd,
    record: u64,
    members: u64,
    block: Rd,
}

/// A group's kernel and its parameters.
type Group = (Kernel, Opened);

/// The kernel `name` of a group of `members`, with its parameters.
fn open(g: &Gen, name: &str, p: &Pattern, words: &[Arg], members: u64) -> Group {
    let mut k = g.kernel(name);
    let shared = p
        .shared
        .iter()
        .map(|s| s.map(|o| k.param_ptr(Arg::Value(o))))
        .collect();
    let table = k.param_table(words);
    let block = k.special("%ctaid.x");
    let block = k.wide(block);
    let record = 8 * (words.len() as u64 / members);
    let o = Opened {
        shared,
        table,
        record,
        members,
        block,
    };
    (k, o)
}

impl Opened {
    /// The address of member `m`'s record in the table.
    fn member(&self, k: &mut Kernel, m: Rd) -> Rd {
        let off = k.op64("mul.lo", m, self.record);
        k.op64("add", self.table, off)
    }
}

/// A member's addresses from its table record at `base`, from byte 16: its own operands by
/// slot (shared slots from `shared`), then its stores.
fn addresses(k: &mut Kernel, p: &Pattern, shared: &[Option<Rd>], base: Rd) -> (Vec<Rd>, Vec<Rd>) {
    let mut at = 16u64;
    let mut next = |k: &mut Kernel| {
        let r = k.table_ptr(base, at);
        at += 8;
        r
    };
    let slots = shared
        .iter()
        .zip(&p.slot_bf16)
        .map(|(s, &bf16)| match s {
            Some(r) => *r,
            None => {
                let r = next(k);
                k.mark_bf16(r, bf16)
            }
        })
        .collect();
    let stores = p
        .store_bf16
        .iter()
        .map(|&bf16| {
            let r = next(k);
            k.mark_bf16(r, bf16)
        })
        .collect();
    (slots, stores)
}

/// The chain's value at element `i` of a member whose slots are at `slots`; stores the
/// stored values (`stores`, in `p.stored` order) at `i`.
fn chain_at(
    k: &mut Kernel,
    p: &Pattern,
    slots: &[Rd],
    stores: &[Rd],
    i: Rd,
) -> Result<F, CodegenError> {
    let zero = k.u64c(0);
    let mut regs: Vec<F> = Vec::new();
    for (r, op) in p.ops.iter().enumerate() {
        let mut vals = [None, None];
        for (j, src) in p.wires[r].iter().enumerate().take(2) {
            vals[j] = Some(match *src {
                Src::Inside(x) => regs[x],
                Src::Slot(s) => {
                    let idx = if p.one[s] { zero } else { i };
                    k.load(slots[s], idx)
                }
            });
        }
        let a = vals[0].ok_or(bad("has an op without operands"))?;
        // Maps only (checked above): no dropout asks for random bits.
        let mut no_dropout = |k: &mut Kernel, _: f64, _: u64| (k.fc(0.0), k.fc(1.0), zero);
        let mut v = apply(k, op, a, vals[1], &mut no_dropout)?;
        if let Some(at) = p.stored.iter().position(|&x| x == r) {
            if k.is_bf16(stores[at]) {
                // Later ops read it as stored (`elementwise::Chain::eval`).
                v = k.round_bf16(v);
            }
            k.store(stores[at], i, v);
        }
        regs.push(v);
    }
    regs.last().copied().ok_or(bad("has an empty chain"))
}

/// An update group: blocks of `CHUNK` elements of one member each, over `members` members.
fn updates(g: &mut Gen, p: &Pattern, (mut k, o): Group, grid: u32) -> Result<Launch, CodegenError> {
    // The member: the last whose first block is at or before this one, by bisection over
    // the members' first blocks (in order; member 0's is 0). `lo`'s is at or before the
    // block, `hi`'s after it (or `hi` is past the end). The same for the whole block, so no
    // thread diverges.
    let (m, hi) = (k.u64c(0), k.u64c(o.members));
    let (top, found) = (k.label(), k.label());
    k.place(&top);
    let width = k.op64("sub", hi, m);
    let one = k.cmp64("le", width, 1);
    k.bra_if(one, &found);
    let mid = k.op64("add", m, hi);
    let mid = k.op64("shr", mid, 1);
    let off = k.op64("mul.lo", mid, o.record);
    let start = k.table_u64(o.table, off);
    let before = k.cmp64("lt", o.block, start);
    k.ins(format!("selp.u64 {hi}, {mid}, {hi}, {before}"));
    k.ins(format!("selp.u64 {m}, {m}, {mid}, {before}"));
    k.bra(&top);
    k.place(&found);
    let base = o.member(&mut k, m);
    let start = k.table_u64(base, 0);
    let n = k.table_u64(base, 8);
    let (slots, stores) = addresses(&mut k, p, &o.shared, base);
    let rel = k.op64("sub", o.block, start);
    let tid = k.special("%tid.x");
    let tid = k.wide(tid);
    let first = k.rd();
    k.ins(format!("mad.lo.u64 {first}, {rel}, {CHUNK}, {tid}"));
    let end = k.rd();
    k.ins(format!("mad.lo.u64 {end}, {rel}, {CHUNK}, {CHUNK}"));
    let end = k.op64("min", end, n);
    let mut result = Ok(());
    k.for_range(first, end, BLOCK, |k, i| {
        if let Err(e) = chain_at(k, p, &slots, &stores, i) {
            result = Err(e);
        }
    });
    result?;
    Ok(g.launch(k, grid, BLOCK))
}

/// A squared-norm group: block `b` sums member `b`'s chain over all its elements.
fn sums(g: &mut Gen, p: &Pattern, (mut k, o): Group, grid: u32) -> Result<Launch, CodegenError> {
    let base = o.member(&mut k, o.block);
    let n = k.table_u64(base, 0);
    let lanes = k.table_u64(base, 8);
    let (slots, stores) = addresses(&mut k, p, &o.shared, base);
    let (stores, out) = stores.split_at(p.stored.len());
    let tid = k.special("%tid.x");
    let tid = k.wide(tid);
    let acc = k.rd();
    k.ins(format!("mov.b64 {acc}, 0d0000000000000000"));
    let idle = k.cmp64("ge", tid, lanes);
    let skip = k.label();
    k.bra_if(idle, &skip);
    let mut result = Ok(());
    k.for_range(tid, n, lanes, |k, e| {
        match chain_at(k, p, &slots, stores, e) {
            Ok(v) => {
                let w = k.rd();
                k.ins(format!("cvt.f64.f32 {w}, {v}"));
                k.ins(format!("add.rn.f64 {acc}, {acc}, {w}"));
            }
            Err(e) => result = Err(e),
        }
    });
    result?;
    k.place(&skip);
    // Partials to shared memory as two words each; lane 0 adds them in lane order.
    let s = k.shared_f32(2 * BLOCK);
    let sb = k.share_f64(&s, tid, acc);
    let lead = k.cmp64("eq", tid, 0);
    let done = k.label();
    k.bra_unless(lead, &done);
    let stop = k.rd();
    k.ins(format!("mad.lo.u64 {stop}, {lanes}, 8, {sb}"));
    let sum = k.sum_shared_f64(sb, stop, 8);
    let f = k.f();
    k.ins(format!("cvt.rn.f32.f64 {f}, {sum}"));
    let zero = k.u64c(0);
    k.store(out[0], zero, f);
    k.place(&done);
    Ok(g.launch(k, grid, BLOCK))
}

#[cfg(test)]
#[path = "tests/grouped.rs"]
mod tests;
