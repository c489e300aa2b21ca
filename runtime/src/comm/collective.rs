//! The arithmetic of the plan's reproducible sums, which every communicator (`crate::comm`)
//! shares: micro-shards are summed along one fixed tree over shard index
//! (`parallax_compiler::shards`), each rank contributing the sums of the subtrees it holds
//! whole, so the result does not depend on how many ranks there are or which shards each
//! holds.

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
                let ps = assign(leaves, n)
                    .into_iter()
                    .enumerate()
                    .flat_map(|(d, own)| {
                        partials(leaves, own, &leaf)
                            .into_iter()
                            .map(move |p| (d, p))
                    })
                    .collect();
                let total = total(leaves, ps).unwrap();
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
        let ps = partials(8, 0..4, &leaf)
            .into_iter()
            .map(|p| (0, p))
            .collect();
        assert!(matches!(total(8, ps), Err(CollectiveError::Missing(_))));
        let bad = vec![(
            0,
            Partial {
                range: 1..3,
                values: leaf(0),
            },
        )];
        assert!(matches!(
            total(4, bad),
            Err(CollectiveError::NotASubtree { .. })
        ));
        let short = vec![
            (
                0,
                Partial {
                    range: 0..1,
                    values: leaf(0),
                },
            ),
            (
                1,
                Partial {
                    range: 1..2,
                    values: vec![1.0],
                },
            ),
        ];
        assert!(matches!(
            total(2, short),
            Err(CollectiveError::Length(5, 1))
        ));
    }
}
