//! Per-rank communicators: what one rank of a partitioned run calls to exchange values with
//! the others, with its own buffers only. Simulated devices use the in-process
//! implementation (`threads`: one thread per rank); an MPI or NCCL implementation offers the
//! same calls to one process per rank.
//!
//! Ranks are numbered `0..size` (the world). A collective names its group as the world ranks
//! taking part, in the same order on every member; every member of a group must make the same
//! calls in the same order (the SPMD rule), and every blocking wait gives up after the
//! communicator's timeout with an error naming the peer and the collective, never a hang.

pub mod check;
pub mod collective;
pub mod job;
#[cfg(feature = "mpi")]
pub mod mpi;
mod protocol;
pub mod rendezvous;
pub mod tcp;
pub mod threads;
pub mod world;

use crate::comm::collective::{CollectiveError, Partial};
use std::time::{Duration, Instant};

/// What a communicator call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("rank {rank}: {op} waited {waited:?} for rank {peer}, which never arrived")]
    Timeout {
        rank: usize,
        peer: usize,
        op: &'static str,
        waited: Duration,
    },
    #[error("rank {rank}: {op} stopped waiting for rank {peer}: rank {failed} failed ({reason})")]
    PeerFailed {
        rank: usize,
        peer: usize,
        op: &'static str,
        failed: usize,
        reason: String,
    },
    #[error("rank {rank}: another rank failed this step")]
    OthersFailed { rank: usize },
    #[error("rank {rank}: {op}: rank {peer} sent a {got} where a {expected} was due (the ranks are out of step)")]
    OutOfStep {
        rank: usize,
        peer: usize,
        op: &'static str,
        expected: &'static str,
        got: &'static str,
    },
    #[error(
        "rank {rank}: {op}: rank {peer} is not a member (group {group:?} of a world of {size})"
    )]
    NotAMember {
        rank: usize,
        peer: usize,
        op: &'static str,
        group: Vec<usize>,
        size: usize,
    },
    #[error("rank {rank}: {op}: {source}")]
    Sum {
        rank: usize,
        op: &'static str,
        source: CollectiveError,
    },
}

/// One receive's wait on `peer`: every transport gives up at the same deadline with the same
/// errors, whatever it polls or sleeps on in between.
pub(crate) struct Wait {
    rank: usize,
    peer: usize,
    op: &'static str,
    timeout: Duration,
    deadline: Instant,
}

impl Wait {
    /// `rank` starts waiting (in `op`) on `peer` now, for at most `timeout`.
    pub(crate) fn new(rank: usize, peer: usize, op: &'static str, timeout: Duration) -> Wait {
        let deadline = Instant::now() + timeout;
        Wait {
            rank,
            peer,
            op,
            timeout,
            deadline,
        }
    }

    /// The time left to wait, or `Timeout` once the deadline has passed.
    pub(crate) fn left(&self) -> Result<Duration, CommError> {
        let now = Instant::now();
        if now >= self.deadline {
            return Err(CommError::Timeout {
                rank: self.rank,
                peer: self.peer,
                op: self.op,
                waited: self.timeout,
            });
        }
        Ok(self.deadline - now)
    }

    /// The wait ended because rank `failed` failed.
    pub(crate) fn failed(&self, (failed, reason): (usize, String)) -> CommError {
        CommError::PeerFailed {
            rank: self.rank,
            peer: self.peer,
            op: self.op,
            failed,
            reason,
        }
    }
}

impl CommError {
    /// Whether the error only reports another rank's failure (so the job's error is that
    /// rank's, not this one).
    pub fn is_echo(&self) -> bool {
        matches!(
            self,
            CommError::PeerFailed { .. } | CommError::OthersFailed { .. }
        )
    }
}

/// What one rank has sent so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Collectives and sends this rank took part in.
    pub calls: u64,
    /// Bytes this rank sent.
    pub bytes: u64,
}

/// One rank's view of the job's communication.
pub trait Communicator: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// The sum over `0..leaves` shards: this rank passes the subtree sums of the shards it
    /// holds (`collective::partials`) and every member of `group` gets the same total, summed
    /// along the fixed tree (the same bits for any group size).
    fn all_reduce(
        &mut self,
        group: &[usize],
        leaves: usize,
        mine: Vec<Partial>,
    ) -> Result<Vec<f32>, CommError>;

    /// `all_reduce`'s total, delivered to `root` only (`Some` there, `None` elsewhere; a
    /// member other than the root does not wait).
    fn reduce(
        &mut self,
        group: &[usize],
        root: usize,
        leaves: usize,
        mine: Vec<Partial>,
    ) -> Result<Option<Vec<f32>>, CommError>;

    /// `root`'s `values` become every member's: the root passes its values, the others get
    /// theirs replaced.
    fn broadcast(
        &mut self,
        group: &[usize],
        root: usize,
        values: &mut Vec<f32>,
    ) -> Result<(), CommError>;

    /// Sends `values` to rank `to`. It never blocks (the message is buffered until `to`
    /// receives it), so a rank sending before it receives cannot deadlock.
    fn send(&mut self, to: usize, values: Vec<f32>) -> Result<(), CommError>;

    /// The next values rank `from` sent to this rank.
    fn recv(&mut self, from: usize) -> Result<Vec<f32>, CommError>;

    /// Waits until every rank of the world has arrived.
    fn barrier(&mut self) -> Result<(), CommError>;

    /// Whether any rank of the world failed: each passes whether it did. A rank that failed
    /// says so at once (peers blocked waiting for it give up with `PeerFailed`); a rank that
    /// never arrives within the timeout, or that is out of step, counts as failed. Cheap
    /// (one flag from each rank), so a job can ask it after every step.
    fn any_failed(&mut self, failed: bool) -> bool;

    /// Whether any rank of the world passes `true` (a vote every rank makes, such as "stop
    /// here"; unlike `any_failed`, a rank that does not answer is an error, not a yes).
    fn any(&mut self, mine: bool) -> Result<bool, CommError>;

    fn traffic(&self) -> Traffic;
}
