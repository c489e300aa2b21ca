//! What a rank of a job of processes does beyond a lone process: agree with every other rank
//! on what they run before anything is written.

use super::TrainError;
use crate::launch::Fingerprint;
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
    let mine = Fingerprint::new(experiment, &plan_json).line();
    let comm_err = |e: crate::comm::CommError| TrainError::Exec(e.into());
    let mut comm = lock(peers);
    let world: Vec<usize> = (0..comm.size()).collect();
    let mut lines = Vec::with_capacity(world.len());
    for r in 0..comm.size() {
        // The line's bytes, one to a word.
        let mut words: Vec<f32> = match r == comm.rank() {
            true => mine.bytes().map(f32::from).collect(),
            false => Vec::new(),
        };
        comm.broadcast(&world, r, &mut words).map_err(comm_err)?;
        lines.push(words.iter().map(|&w| w as u8 as char).collect::<String>());
    }
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
