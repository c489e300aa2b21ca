//! The collective library: the interface the partitioned plan's collective ops call, and its
//! in-process implementation for simulated devices. The all-reduce is reproducible: it sums
//! micro-shards along one fixed tree over shard index (`parallax_compiler::shards`), each
//! device contributing the sums of the subtrees it holds whole, so the result does not depend
//! on how many devices there are or which shards each holds.

use parallax_compiler::shards::{owned_subtrees, tree_split};
use std::ops::Range;

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("all-reduce: device {device} sent a partial sum for shards {range:?}, which is not a subtree of the reduction tree over {leaves} shards")]
    NotASubtree {
        device: usize,
        range: Range<usize>,
        leaves: usize,
    },
    #[error("all-reduce: no device holds shards {0:?}")]
    Missing(Range<usize>),
    #[error("all-reduce: partial sums of {0} and {1} elements do not match")]
    Length(usize, usize),
}

/// One device's contribution: the sum over the shards `range` (a subtree of the fixed tree).
#[derive(Debug, Clone)]
pub struct Partial {
    pub range: Range<usize>,
    pub values: Vec<f32>,
}

/// Traffic so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    pub calls: u64,
    /// Bytes every device sent, summed (partials out, the total back to the others).
    pub bytes: u64,
}

/// What the plan's collectives need from a communication library. The NCCL path implements
/// the same calls with one process (or stream) per device.
pub trait Collective {
    fn devices(&self) -> usize;
    /// `partials[d]` are device `d`'s subtree sums over `leaves` shards; every device gets the
    /// returned total.
    fn all_reduce(
        &mut self,
        leaves: usize,
        partials: Vec<Vec<Partial>>,
    ) -> Result<Vec<f32>, CollectiveError>;
    /// The same total as `all_reduce`, delivered to one device only (ZeRO-2's reduce).
    fn reduce(
        &mut self,
        leaves: usize,
        partials: Vec<Vec<Partial>>,
    ) -> Result<Vec<f32>, CollectiveError>;
    /// Point to point: what device `from` sends arrives at device `to` (a pipeline
    /// transfer, or one leg of a broadcast from its root).
    fn send(&mut self, from: usize, to: usize, values: Vec<f32>) -> Vec<f32>;
    fn traffic(&self) -> Traffic;
}

/// The sum of `leaf(lo..hi)` along the fixed tree: what every all-reduce computes.
pub fn tree_sum(lo: usize, hi: usize, leaf: &dyn Fn(usize) -> Vec<f32>) -> Vec<f32> {
    if hi - lo == 1 {
        return leaf(lo);
    }
    let mid = tree_split(lo, hi);
    let mut left = tree_sum(lo, mid, leaf);
    let right = tree_sum(mid, hi, leaf);
    add_into(&mut left, &right);
    left
}

fn add_into(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// A device's partial sums: one per subtree it holds whole, from its shards' values
/// (`value(i)` for global shard `i` in `own`).
pub fn partials(
    leaves: usize,
    own: Range<usize>,
    value: &dyn Fn(usize) -> Vec<f32>,
) -> Vec<Partial> {
    owned_subtrees(leaves, own)
        .into_iter()
        .map(|r| Partial {
            values: tree_sum(r.start, r.end, value),
            range: r,
        })
        .collect()
}

/// Devices in one process, exchanging through memory.
#[derive(Debug, Default)]
pub struct InProcess {
    devices: usize,
    traffic: Traffic,
}

impl InProcess {
    pub fn new(devices: usize) -> InProcess {
        InProcess {
            devices,
            traffic: Traffic::default(),
        }
    }
}

impl Collective for InProcess {
    fn devices(&self) -> usize {
        self.devices
    }

    fn all_reduce(
        &mut self,
        leaves: usize,
        partials: Vec<Vec<Partial>>,
    ) -> Result<Vec<f32>, CollectiveError> {
        let total = self.reduce(leaves, partials)?;
        // The total goes back to every other device.
        self.traffic.bytes += 4 * total.len() as u64 * (self.devices.max(1) as u64 - 1);
        Ok(total)
    }

    fn reduce(
        &mut self,
        leaves: usize,
        partials: Vec<Vec<Partial>>,
    ) -> Result<Vec<f32>, CollectiveError> {
        let mut held: Vec<(Range<usize>, Vec<f32>)> = Vec::new();
        let mut len = None;
        for (device, ps) in partials.into_iter().enumerate() {
            for p in ps {
                if owned_subtrees(leaves, p.range.clone()) != [p.range.clone()] {
                    return Err(CollectiveError::NotASubtree {
                        device,
                        range: p.range,
                        leaves,
                    });
                }
                match len {
                    None => len = Some(p.values.len()),
                    Some(l) if l != p.values.len() => {
                        return Err(CollectiveError::Length(l, p.values.len()))
                    }
                    _ => {}
                }
                self.traffic.bytes += 4 * p.values.len() as u64;
                held.push((p.range, p.values));
            }
        }
        let total = combine(0, leaves, &mut held)?;
        self.traffic.calls += 1;
        Ok(total)
    }

    fn send(&mut self, from: usize, to: usize, values: Vec<f32>) -> Vec<f32> {
        if from != to {
            self.traffic.calls += 1;
            self.traffic.bytes += 4 * values.len() as u64;
        }
        values
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }
}

/// The total over `0..leaves` from every rank's partial sums, `(rank, partial)`, combined
/// along the fixed tree: each partial must be one subtree, all of one length, and together
/// they must cover every leaf. What each communicator computes after gathering the partials.
pub fn total(leaves: usize, partials: Vec<(usize, Partial)>) -> Result<Vec<f32>, CollectiveError> {
    let mut held: Vec<(Range<usize>, Vec<f32>)> = Vec::with_capacity(partials.len());
    let mut len = None;
    for (device, p) in partials {
        if owned_subtrees(leaves, p.range.clone()) != [p.range.clone()] {
            return Err(CollectiveError::NotASubtree {
                device,
                range: p.range,
                leaves,
            });
        }
        match len {
            None => len = Some(p.values.len()),
            Some(l) if l != p.values.len() => {
                return Err(CollectiveError::Length(l, p.values.len()))
            }
            _ => {}
        }
        held.push((p.range, p.values));
    }
    combine(0, leaves, &mut held)
}

/// Completes the tree from the partial sums that cover it.
fn combine(
    lo: usize,
    hi: usize,
    held: &mut Vec<(Range<usize>, Vec<f32>)>,
) -> Result<Vec<f32>, CollectiveError> {
    if let Some(i) = held.iter().position(|(r, _)| *r == (lo..hi)) {
        return Ok(held.swap_remove(i).1);
    }
    if hi - lo <= 1 {
        return Err(CollectiveError::Missing(lo..hi));
    }
    let mid = tree_split(lo, hi);
    let mut left = combine(lo, mid, held)?;
    let right = combine(mid, hi, held)?;
    add_into(&mut left, &right);
    Ok(left)
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_compiler::shards::assign;

    fn leaf(i: usize) -> Vec<f32> {
        // Values of very different magnitudes, so the order of the sum shows in the bits.
        (0..5)
            .map(|j| ((i * 7 + j) as f32).sin() * 10f32.powi((i % 7) as i32 - 3))
            .collect()
    }

    #[test]
    fn the_total_has_the_same_bits_for_every_device_count() {
        for leaves in 1..=13 {
            let reference = tree_sum(0, leaves, &leaf);
            for n in 1..=leaves + 2 {
                let mut c = InProcess::new(n);
                let ps = assign(leaves, n)
                    .into_iter()
                    .map(|own| partials(leaves, own, &leaf))
                    .collect();
                let total = c.all_reduce(leaves, ps).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&total), bits(&reference), "{leaves} shards on {n}");
            }
        }
        // And the order matters at all (else the test proves nothing).
        let serial = (1..8).fold(leaf(0), |mut a, i| {
            add_into(&mut a, &leaf(i));
            a
        });
        assert_ne!(serial, tree_sum(0, 8, &leaf));
    }

    #[test]
    fn missing_or_misaligned_partials_are_refused() {
        let mut c = InProcess::new(2);
        let ps = vec![partials(8, 0..4, &leaf), vec![]];
        assert!(matches!(
            c.all_reduce(8, ps),
            Err(CollectiveError::Missing(_))
        ));
        let bad = vec![vec![Partial {
            range: 1..3,
            values: leaf(0),
        }]];
        assert!(matches!(
            c.all_reduce(4, bad),
            Err(CollectiveError::NotASubtree { .. })
        ));
    }
}
