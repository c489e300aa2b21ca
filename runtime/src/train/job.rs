//! What a rank of a job of processes does beyond a lone process: agree with every other rank
//! on what they run before anything is written.

use super::TrainError;
use crate::comm::world::Fingerprint;
use crate::ranks::{lock, Peers};
use parallax_compiler::Plan;

/// The signal a rank stops for when another rank of its job got one (launchers forward
/// SIGTERM).
pub(super) const SIGNALLED_ELSEWHERE: usize = 15;

/// Every rank's fingerprint (the experiment as run, the binary, the plan), compared on every
/// rank: a mismatch is refused by all of them with the same message, rank 0's against the
/// first rank that differs.
pub(super) fn agree(peers: &Peers, plan: &Plan, experiment: &[u8]) -> Result<(), TrainError> {
    let plan_json = serde_json::to_string(plan).map_err(|e| TrainError::Model(e.to_string()))?;
    let lines = exchange(peers, &Fingerprint::new(experiment, &plan_json).line())?;
    let read = |r: usize| {
        Fingerprint::from_line(&lines[r]).ok_or_else(|| {
            TrainError::Ranks(format!(
                "the ranks disagree: rank {r} sent a fingerprint this build cannot read ({:?})",
                lines[r]
            ))
        })
    };
    let first = read(0)?;
    for r in 1..lines.len() {
        if let Some(m) = first.mismatch(0, &read(r)?, r) {
            return Err(TrainError::Ranks(m));
        }
    }
    Ok(())
}

/// That every rank loaded the same data (the SHA-256 of every sample): files that differ
/// between hosts under the same path would train each rank on other samples.
pub(super) fn agree_on_data(peers: &Peers, data_hash: &str) -> Result<(), TrainError> {
    let hashes = exchange(peers, data_hash)?;
    match hashes.iter().position(|h| *h != hashes[0]) {
        None => Ok(()),
        Some(r) => Err(TrainError::Ranks(format!(
            "the ranks disagree: rank 0 loaded data with hash {} and rank {r} data with {} (the files differ between their machines)",
            short(&hashes[0]),
            short(&hashes[r])
        ))),
    }
}

fn short(hash: &str) -> String {
    hash.chars().take(12).collect()
}

/// Every rank's `line`, in rank order, on every rank (each broadcasts its own in turn).
fn exchange(peers: &Peers, line: &str) -> Result<Vec<String>, TrainError> {
    let comm_err = |e: crate::comm::CommError| TrainError::Exec(e.into());
    let mut comm = lock(peers);
    let world: Vec<usize> = (0..comm.size()).collect();
    let mut lines = Vec::with_capacity(world.len());
    for r in 0..comm.size() {
        // The line's bytes, one to a word.
        let mut words: Vec<f32> = match r == comm.rank() {
            true => line.bytes().map(f32::from).collect(),
            false => Vec::new(),
        };
        comm.broadcast(&world, r, &mut words).map_err(comm_err)?;
        let bytes: Vec<u8> = words.iter().map(|&w| w as u8).collect();
        lines.push(String::from_utf8_lossy(&bytes).into_owned());
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::threads::Threads;
    use crate::comm::Communicator;
    use std::sync::{Arc, Mutex};

    /// `f` on each rank of a world of `n` threads, with what each returned.
    fn on_ranks<T: Send>(n: usize, f: impl Fn(&Peers) -> T + Sync) -> Vec<T> {
        let world = Threads::new(n, std::time::Duration::from_secs(5));
        let peers: Vec<Peers> = world
            .comms()
            .into_iter()
            .map(|c| Arc::new(Mutex::new(Box::new(c) as Box<dyn Communicator>)))
            .collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = peers.iter().map(|p| s.spawn(|| f(p))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn ranks_with_other_data_all_refuse_naming_it() {
        let same = on_ranks(3, |p| agree_on_data(p, "ab12"));
        assert!(same.iter().all(Result::is_ok));
        let out = on_ranks(3, |p| {
            let hash = if lock(p).rank() == 2 { "cd34" } else { "ab12" };
            agree_on_data(p, hash).map_err(|e| e.to_string())
        });
        for r in out {
            let e = r.unwrap_err();
            assert!(
                e.contains("rank 0 loaded data with hash ab12 and rank 2 data with cd34"),
                "{e}"
            );
        }
    }

    #[test]
    fn lines_are_exchanged_in_rank_order() {
        let out = on_ranks(4, |p| {
            let r = lock(p).rank();
            exchange(p, &format!("rank {r} é")).unwrap()
        });
        let want: Vec<String> = (0..4).map(|r| format!("rank {r} é")).collect();
        for lines in out {
            assert_eq!(lines, want);
        }
    }
}
