//! The fixed-tree all-reduce of partial sums on GPUs, over NCCL point-to-point: the same bits
//! as `collective::total` on the host, for any number of ranks.
//!
//! NCCL's own reductions add in an order that depends on the algorithm and the world size, so
//! floats are never reduced by NCCL here. Instead the vector is cut into one chunk per member;
//! every member sends, to each chunk's owner, its partials' slices of that chunk (grouped
//! `ncclSend`/`ncclRecv`); the owner adds them with its own kernel in exactly the order of the
//! fixed tree over shard index; then the owners' chunks are copied to every member (grouped
//! sends and receives: a copy, so exact).
//!
//! The [`Schedule`] (who receives what, and the straight-line add program of each chunk) is
//! pure host arithmetic, tested here against `collective::total` through a host interpreter
//! that adds chunk by chunk exactly as the device does. [`DeviceTree`] runs a schedule on a
//! GPU; it needs a GPU and libnccl, so none of it runs in the test suite (the PTX of its
//! kernel is assembled with ptxas there; `parallax comm-check --backend cuda` runs the rest
//! on a GPU machine).

use parallax_compiler::shards::{owned_subtrees, tree_split};
use std::ops::Range;

#[path = "tree_device.rs"]
mod device;
pub use device::{add_kernel_ptx, DeviceTree, DeviceTreeError, ADD_KERNEL};

/// Chunks are padded to a multiple of this many floats (256 bytes), so every chunk's device
/// address is as aligned as the buffer's and NCCL's copies stay on their fast paths.
pub const CHUNK_ALIGN: usize = 64;

/// Why a layout of partial sums cannot be reduced.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    #[error("tree all-reduce: the group is empty")]
    EmptyGroup,
    #[error(
        "tree all-reduce: the group has {members} member(s) but {lists} list(s) of partial ranges"
    )]
    Lists { members: usize, lists: usize },
    #[error("tree all-reduce: rank {rank} appears twice in the group {group:?}")]
    DuplicateMember { rank: usize, group: Vec<usize> },
    #[error("tree all-reduce: rank {rank} holds a partial sum for shards {range:?}, which is not a subtree of the reduction tree over {leaves} shards")]
    NotASubtree {
        rank: usize,
        range: Range<usize>,
        leaves: usize,
    },
    #[error("tree all-reduce: no member holds shards {0:?}")]
    Missing(Range<usize>),
    #[error("tree all-reduce: rank {rank}'s partial sum for shards {range:?} overlaps another partial (each shard must be held once)")]
    Overlap { rank: usize, range: Range<usize> },
    #[error("tree all-reduce: rank {rank} passed {got} partial sum(s); its shards make {want}")]
    Count {
        rank: usize,
        got: usize,
        want: usize,
    },
    #[error("tree all-reduce: rank {rank}'s partial sum for shards {range:?} has {got} elements, not {want}")]
    Length {
        rank: usize,
        range: Range<usize>,
        got: usize,
        want: usize,
    },
}

/// Where an operand of the add program lives, on the chunk's owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The owner's own partial number `p` (read in place, never written).
    Mine(usize),
    /// Scratch slot `k` (a chunk's length each): a received partial or an intermediate sum.
    Scratch(usize),
    /// The owner's chunk of the output.
    Out,
}

/// `dst = a + b`, elementwise over the chunk (`a` is the left subtree: its order is kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Add {
    pub dst: Slot,
    pub a: Slot,
    pub b: Slot,
}

/// The owner receives member `from`'s partial `partial` (its slice of the chunk) into
/// scratch slot `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recv {
    /// An index into the group (not a world rank).
    pub from: usize,
    pub partial: usize,
    pub slot: usize,
}

/// What one member does for the chunk it owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlan {
    /// The chunk's elements (empty when the vector is shorter than the chunks before it).
    pub range: Range<usize>,
    /// In the order of the group, then of each member's partials: the order the members
    /// send in (NCCL matches a pair's sends and receives in order).
    pub recvs: Vec<Recv>,
    /// The adds, in order; the last writes `Out` (empty when one partial is the total).
    pub program: Vec<Add>,
    /// Where the chunk's total ends: `Out`, or a partial to copy there.
    pub result: Slot,
    pub scratch_slots: usize,
}

/// The whole exchange, the same on every member: computed from the shard layout alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub leaves: usize,
    /// World ranks, in the group's order.
    pub members: Vec<usize>,
    /// Each member's partial ranges, in the order it passes its partials.
    pub ranges: Vec<Vec<Range<usize>>>,
    pub len: usize,
    /// The padded chunk length (a multiple of `CHUNK_ALIGN`).
    pub chunk: usize,
    /// One per member: the chunk it owns.
    pub chunks: Vec<ChunkPlan>,
}

/// Element `element` of shard `shard`'s values in checks of the tree all-reduce: a pure
/// function of the seed, so every rank can compute every other's partials. Magnitudes from
/// 2^-10 to 2^10 with both signs, so that a sum in another order shows in the bits.
pub fn check_value(seed: u64, shard: usize, element: usize) -> f32 {
    let h = crate::rng::bits(
        crate::rng::mix(seed ^ ((shard as u64) << 20)),
        element as u64,
    );
    let mantissa = 1.0 + (h & 0xff_ffff) as f32 / (1u32 << 24) as f32;
    let exponent = ((h >> 24) % 21) as i32 - 10;
    let sign = if (h >> 40) & 1 == 1 { -1.0 } else { 1.0 };
    sign * mantissa * 2f32.powi(exponent)
}

/// The fixed tree over the partials: what `collective::combine` walks.
enum Expr {
    Leaf { member: usize, partial: usize },
    Add(Box<Expr>, Box<Expr>),
}

impl Schedule {
    /// The schedule for `members` (world ranks) whose partials cover `ranges[m]`, summing
    /// vectors of `len` floats over `0..leaves` shards. Refuses what `collective::total`
    /// refuses (a partial that is not a subtree, a shard no one holds) and, unlike it, a
    /// partial that overlaps another (`total` ignores the extra; here it would be sent for
    /// nothing, and it means the layout is wrong).
    pub fn new(
        leaves: usize,
        members: &[usize],
        ranges: &[Vec<Range<usize>>],
        len: usize,
    ) -> Result<Schedule, TreeError> {
        if members.is_empty() {
            return Err(TreeError::EmptyGroup);
        }
        if members.len() != ranges.len() {
            return Err(TreeError::Lists {
                members: members.len(),
                lists: ranges.len(),
            });
        }
        for (i, r) in members.iter().enumerate() {
            if members[..i].contains(r) {
                return Err(TreeError::DuplicateMember {
                    rank: *r,
                    group: members.to_vec(),
                });
            }
        }
        // (range, member, partial) of every partial, checked as `total` checks them.
        let mut held = Vec::new();
        for (m, list) in ranges.iter().enumerate() {
            for (p, r) in list.iter().enumerate() {
                if owned_subtrees(leaves, r.clone()) != [r.clone()] {
                    return Err(TreeError::NotASubtree {
                        rank: members[m],
                        range: r.clone(),
                        leaves,
                    });
                }
                held.push((r.clone(), m, p, false));
            }
        }
        let tree = combine(0, leaves, &mut held)?;
        if let Some((r, m, _, _)) = held.iter().find(|h| !h.3) {
            return Err(TreeError::Overlap {
                rank: members[*m],
                range: r.clone(),
            });
        }
        let n = members.len();
        let chunk = len.div_ceil(n).div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN;
        let chunks = (0..n)
            .map(|owner| {
                let range = (owner * chunk).min(len)..((owner + 1) * chunk).min(len);
                lower(owner, range, ranges, &tree)
            })
            .collect();
        Ok(Schedule {
            leaves,
            members: members.to_vec(),
            ranges: ranges.to_vec(),
            len,
            chunk,
            chunks,
        })
    }

    /// The group index of world rank `rank`.
    pub fn member(&self, rank: usize) -> Option<usize> {
        self.members.iter().position(|&r| r == rank)
    }

    /// Floats of scratch the owner of chunk `m` needs.
    pub fn scratch_floats(&self, m: usize) -> usize {
        self.chunks[m].scratch_slots * self.chunk
    }

    /// The all-reduce on the host, chunk by chunk with the device's program (what the device
    /// computes, for tests and for checking a GPU's result): `partials[m][p]` is member `m`'s
    /// partial `p`, each `len` long.
    pub fn run_host(&self, partials: &[Vec<Vec<f32>>]) -> Result<Vec<f32>, TreeError> {
        self.check_counts(&partials.iter().map(Vec::len).collect::<Vec<_>>())?;
        for (m, list) in partials.iter().enumerate() {
            for (p, v) in list.iter().enumerate() {
                if v.len() != self.len {
                    return Err(TreeError::Length {
                        rank: self.members[m],
                        range: self.ranges[m][p].clone(),
                        got: v.len(),
                        want: self.len,
                    });
                }
            }
        }
        let mut out = vec![0f32; self.len];
        for (owner, plan) in self.chunks.iter().enumerate() {
            let r = plan.range.clone();
            let mut scratch = vec![Vec::new(); plan.scratch_slots];
            // What the grouped receives deliver: the senders' slices of this chunk.
            for rv in &plan.recvs {
                scratch[rv.slot] = partials[rv.from][rv.partial][r.clone()].to_vec();
            }
            let mine = &partials[owner];
            let mut chunk_out = vec![0f32; r.len()];
            let read = |s: Slot, scratch: &[Vec<f32>], chunk_out: &[f32]| -> Vec<f32> {
                match s {
                    Slot::Mine(p) => mine[p][r.clone()].to_vec(),
                    Slot::Scratch(k) => scratch[k].clone(),
                    Slot::Out => chunk_out.to_vec(),
                }
            };
            for op in &plan.program {
                let a = read(op.a, &scratch, &chunk_out);
                let b = read(op.b, &scratch, &chunk_out);
                // The kernel's `add.rn.f32`, element by element.
                let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
                match op.dst {
                    Slot::Scratch(k) => scratch[k] = sum,
                    Slot::Out => chunk_out = sum,
                    Slot::Mine(_) => unreachable!("the program never writes a member's input"),
                }
            }
            out[r.clone()].copy_from_slice(&read(plan.result, &scratch, &chunk_out));
        }
        Ok(out)
    }

    /// Each member passes one value per partial range the schedule was made with.
    fn check_counts(&self, counts: &[usize]) -> Result<(), TreeError> {
        if counts.len() != self.members.len() {
            return Err(TreeError::Lists {
                members: self.members.len(),
                lists: counts.len(),
            });
        }
        for (m, &got) in counts.iter().enumerate() {
            let want = self.ranges[m].len();
            if got != want {
                return Err(TreeError::Count {
                    rank: self.members[m],
                    got,
                    want,
                });
            }
        }
        Ok(())
    }
}

/// `collective::combine`'s walk: the partial that covers `lo..hi` exactly, else the split's
/// left then right.
fn combine(
    lo: usize,
    hi: usize,
    held: &mut [(Range<usize>, usize, usize, bool)],
) -> Result<Expr, TreeError> {
    if let Some(h) = held.iter_mut().find(|h| h.0 == (lo..hi) && !h.3) {
        h.3 = true;
        return Ok(Expr::Leaf {
            member: h.1,
            partial: h.2,
        });
    }
    if hi - lo <= 1 {
        return Err(TreeError::Missing(lo..hi));
    }
    let mid = tree_split(lo, hi);
    let left = combine(lo, mid, held)?;
    let right = combine(mid, hi, held)?;
    Ok(Expr::Add(Box::new(left), Box::new(right)))
}

/// The owner's receives and straight-line program for the tree.
fn lower(
    owner: usize,
    range: Range<usize>,
    ranges: &[Vec<Range<usize>>],
    tree: &Expr,
) -> ChunkPlan {
    let mut recvs = Vec::new();
    for (from, list) in ranges.iter().enumerate() {
        if from != owner {
            for partial in 0..list.len() {
                let slot = recvs.len();
                recvs.push(Recv {
                    from,
                    partial,
                    slot,
                });
            }
        }
    }
    let mut plan = ChunkPlan {
        range,
        scratch_slots: recvs.len(),
        recvs,
        program: Vec::new(),
        result: Slot::Out,
    };
    plan.result = emit(owner, tree, true, &mut plan);
    plan
}

fn emit(owner: usize, e: &Expr, top: bool, plan: &mut ChunkPlan) -> Slot {
    match e {
        Expr::Leaf { member, partial } if *member == owner => Slot::Mine(*partial),
        Expr::Leaf { member, partial } => {
            // Every other member's partials are received (`lower`), so the search finds one.
            let r = plan
                .recvs
                .iter()
                .find(|r| r.from == *member && r.partial == *partial);
            Slot::Scratch(r.map_or(0, |r| r.slot))
        }
        Expr::Add(l, r) => {
            let a = emit(owner, l, false, plan);
            let b = emit(owner, r, false, plan);
            // The root writes the output; otherwise the left operand's scratch is reused in
            // place (as `total` adds into its left buffer), else a fresh slot.
            let dst = match (top, a) {
                (true, _) => Slot::Out,
                (false, Slot::Scratch(_)) => a,
                (false, _) => {
                    plan.scratch_slots += 1;
                    Slot::Scratch(plan.scratch_slots - 1)
                }
            };
            plan.program.push(Add { dst, a, b });
            dst
        }
    }
}

#[cfg(test)]
#[path = "tree_tests.rs"]
mod tests;
