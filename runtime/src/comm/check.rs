//! A communicator's self-check, the same on every implementation (`parallax comm-check`
//! runs it on MPI ranks, the unit tests on rank threads): the tree all-reduce over every
//! shard count up to 9 with the bits of one device's sum, reduce, broadcast, a ring of sends,
//! a barrier and the failure flag. A fault can be injected on one rank to see what the
//! others report.

use super::{CommError, Communicator};
use crate::comm::collective::{partials, tree_sum};
use parallax_compiler::shards::assign;

/// A fault injected on one rank, at the all-reduce over 5 shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The rank reports a failure and stops.
    Fail(usize),
    /// The rank stops answering (sleeps for `secs`).
    Hang { rank: usize, secs: u64 },
}

impl Fault {
    /// The fault `comm-check --fail-rank` (first) or `--hang-rank` plants: a hang lasts three
    /// times the collectives' `timeout` (so the others give up first).
    pub fn planted(fail: Option<usize>, hang: Option<usize>, timeout_secs: u64) -> Option<Fault> {
        match (fail, hang) {
            (Some(r), _) => Some(Fault::Fail(r)),
            (None, Some(rank)) => Some(Fault::Hang {
                rank,
                secs: timeout_secs.saturating_mul(3).max(1),
            }),
            (None, None) => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("rank {rank}: the all-reduce over {leaves} shards differs from one device's sum (element {element}: {got} against {want})")]
    Bits {
        rank: usize,
        leaves: usize,
        element: usize,
        got: f32,
        want: f32,
    },
    #[error("rank {rank}: {what}")]
    Wrong { rank: usize, what: String },
    #[error("rank {rank}: the injected failure")]
    Injected { rank: usize },
}

/// Shard `i`'s values: magnitudes far apart, so a sum in another order shows in the bits.
fn leaf(i: usize) -> Vec<f32> {
    (0..7)
        .map(|j| ((i * 7 + j) as f32).sin() * 10f32.powi((i % 7) as i32 - 3))
        .collect()
}

/// What one rank checked, a line per check. A rank whose check fails says so to the others
/// (the failure flag), so that none waits out its timeout for it.
pub fn run(comm: &mut dyn Communicator, fault: Option<Fault>) -> Result<Vec<String>, CheckError> {
    let r = checks(comm, fault);
    if let Err(e) = &r {
        if !matches!(e, CheckError::Injected { .. }) {
            comm.any_failed(true);
        }
    }
    r
}

fn checks(comm: &mut dyn Communicator, fault: Option<Fault>) -> Result<Vec<String>, CheckError> {
    let (rank, size) = (comm.rank(), comm.size());
    let world: Vec<usize> = (0..size).collect();
    let mut lines = Vec::new();
    comm.barrier()?;
    for leaves in 1..=9 {
        if leaves == 5 {
            match fault {
                Some(Fault::Fail(r)) if r == rank => {
                    comm.any_failed(true);
                    return Err(CheckError::Injected { rank });
                }
                Some(Fault::Hang { rank: r, secs }) if r == rank => {
                    std::thread::sleep(std::time::Duration::from_secs(secs));
                    return Err(CheckError::Injected { rank });
                }
                _ => {}
            }
        }
        let own = assign(leaves, size)[rank].clone();
        let total = comm.all_reduce(&world, leaves, partials(leaves, own, &leaf))?;
        let want = tree_sum(0, leaves, &leaf);
        if let Some(element) =
            (0..want.len()).find(|&k| total.get(k).map(|x| x.to_bits()) != Some(want[k].to_bits()))
        {
            return Err(CheckError::Bits {
                rank,
                leaves,
                element,
                got: total.get(element).copied().unwrap_or(f32::NAN),
                want: want[element],
            });
        }
        lines.push(format!(
            "all-reduce over {leaves} shards on {size} rank(s): the bits of one device"
        ));
    }
    let own = assign(6, size)[rank].clone();
    let reduced = comm.reduce(&world, 0, 6, partials(6, own, &leaf))?;
    if (rank == 0) != reduced.is_some() {
        return Err(CheckError::Wrong {
            rank,
            what: "the reduce's total reached the wrong ranks".into(),
        });
    }
    let mut values = if rank == 0 { leaf(11) } else { Vec::new() };
    comm.broadcast(&world, 0, &mut values)?;
    if values != leaf(11) {
        return Err(CheckError::Wrong {
            rank,
            what: "the broadcast delivered other values".into(),
        });
    }
    if size > 1 {
        comm.send((rank + 1) % size, leaf(100 + rank))?;
        let from = (rank + size - 1) % size;
        if comm.recv(from)? != leaf(100 + from) {
            return Err(CheckError::Wrong {
                rank,
                what: format!("the values received from rank {from} are not the ones it sent"),
            });
        }
    }
    lines.push("reduce, broadcast and a ring of sends: as sent".into());
    comm.barrier()?;
    if comm.any_failed(false) {
        return Err(CheckError::Wrong {
            rank,
            what: "the failure flag is set though no rank failed".into(),
        });
    }
    lines.push(format!("barrier and failure flag on {size} rank(s): ok"));
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::threads::Threads;
    use std::time::Duration;

    fn on_threads(n: usize, fault: Option<Fault>) -> Vec<Result<Vec<String>, CheckError>> {
        let world = Threads::new(n, Duration::from_secs(20));
        std::thread::scope(|s| {
            let handles: Vec<_> = world
                .comms()
                .into_iter()
                .map(|mut c| s.spawn(move || run(&mut c, fault)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn the_check_passes_on_rank_threads() {
        for n in 1..=5 {
            for (rank, r) in on_threads(n, None).into_iter().enumerate() {
                let lines = r.unwrap_or_else(|e| panic!("{n} ranks, rank {rank}: {e}"));
                assert_eq!(lines.len(), 11);
            }
        }
    }

    #[test]
    fn an_injected_failure_is_reported_by_every_other_rank() {
        let results = on_threads(3, Some(Fault::Fail(1)));
        assert!(matches!(results[1], Err(CheckError::Injected { rank: 1 })));
        for r in [0, 2] {
            let e = results[r].as_ref().unwrap_err().to_string();
            assert!(e.contains("rank 1 failed"), "rank {r}: {e}");
        }
    }
}
