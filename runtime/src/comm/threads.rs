//! The in-process communicator: ranks are threads of one process, each with a mailbox that
//! holds one queue per sender (so messages between two ranks arrive in the order sent, as
//! MPI's do). Sends only append, so they never block; a receive waits on its mailbox's
//! condition variable until the message comes, the sender is known to have failed, or the
//! timeout passes. All-reduces gather every member's partial sums and each member combines
//! them along the fixed tree itself, so every member gets the same bits.

use super::{CommError, Communicator, Traffic};
use crate::collective::{total, Partial};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// A world of ranks in one process: make it once, hand each rank thread its `ThreadComm`.
pub struct Threads {
    shared: Arc<Shared>,
}

/// One rank's handle.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    traffic: Traffic,
}

struct Shared {
    timeout: Duration,
    /// Rank `r`'s incoming messages, by sender.
    boxes: Vec<Mailbox>,
    /// Set when a rank reports a failure: waits for data give up instead of timing out.
    aborted: AtomicBool,
    /// The first rank that failed, and why.
    failure: Mutex<Option<(usize, String)>>,
    /// Ranks that will send nothing more (their thread panicked): every wait on them ends.
    gone: Vec<AtomicBool>,
}

struct Mailbox {
    queues: Mutex<Vec<VecDeque<Message>>>,
    ready: Condvar,
}

enum Message {
    Values(Vec<f32>),
    Partials(Vec<Partial>),
    Flag(bool),
    Token,
}

impl Message {
    fn kind(&self) -> &'static str {
        match self {
            Message::Values(_) => "send",
            Message::Partials(_) => "partial sum",
            Message::Flag(_) => "failure flag",
            Message::Token => "barrier token",
        }
    }
}

/// A queue is only ever pushed or popped whole, so a panic elsewhere while a lock was held
/// (there is none: nothing in these sections panics) could not leave it half-written.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Threads {
    /// A world of `size` ranks whose waits give up after `timeout`.
    pub fn new(size: usize, timeout: Duration) -> Threads {
        let boxes = (0..size)
            .map(|_| Mailbox {
                queues: Mutex::new((0..size).map(|_| VecDeque::new()).collect()),
                ready: Condvar::new(),
            })
            .collect();
        Threads {
            shared: Arc::new(Shared {
                timeout,
                boxes,
                aborted: AtomicBool::new(false),
                failure: Mutex::new(None),
                gone: (0..size).map(|_| AtomicBool::new(false)).collect(),
            }),
        }
    }

    /// Each rank's communicator, rank `r` at index `r`.
    pub fn comms(&self) -> Vec<ThreadComm> {
        (0..self.shared.boxes.len())
            .map(|rank| ThreadComm {
                rank,
                shared: self.shared.clone(),
                traffic: Traffic::default(),
            })
            .collect()
    }

    /// Forgets a failed step: failures, and messages a failure left unread. Call it only
    /// while no rank is inside a call (between steps).
    pub fn reset(&self) {
        for b in &self.shared.boxes {
            lock(&b.queues).iter_mut().for_each(VecDeque::clear);
        }
        for g in &self.shared.gone {
            g.store(false, Ordering::SeqCst);
        }
        *lock(&self.shared.failure) = None;
        self.shared.aborted.store(false, Ordering::SeqCst);
    }
}

impl Shared {
    /// Records that `rank` failed and wakes every waiting rank to see it.
    fn fail(&self, rank: usize, reason: &str, gone: bool) {
        lock(&self.failure).get_or_insert_with(|| (rank, reason.to_string()));
        self.aborted.store(true, Ordering::SeqCst);
        if gone {
            self.gone[rank].store(true, Ordering::SeqCst);
        }
        // Taking each lock before notifying means no waiter is between its check and its wait.
        for b in &self.boxes {
            let _held = lock(&b.queues);
            b.ready.notify_all();
        }
    }

    fn failure(&self) -> (usize, String) {
        lock(&self.failure)
            .clone()
            .unwrap_or((usize::MAX, "unknown".into()))
    }
}

/// Marks its rank as gone if its thread panics, so peers stop waiting for it at once.
pub struct PanicGuard {
    rank: usize,
    shared: Arc<Shared>,
}

impl Drop for PanicGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared.fail(self.rank, "its thread panicked", true);
        }
    }
}

impl ThreadComm {
    /// A guard to hold in the rank's thread for as long as it runs.
    pub fn panic_guard(&self) -> PanicGuard {
        PanicGuard {
            rank: self.rank,
            shared: self.shared.clone(),
        }
    }

    fn size_(&self) -> usize {
        self.shared.boxes.len()
    }

    fn check(&self, group: &[usize], peer: usize, op: &'static str) -> Result<(), CommError> {
        let bad = |peer| CommError::NotAMember {
            rank: self.rank,
            peer,
            op,
            group: group.to_vec(),
            size: self.size_(),
        };
        if let Some(&p) = group.iter().find(|&&p| p >= self.size_()) {
            return Err(bad(p));
        }
        for r in [self.rank, peer] {
            if !group.contains(&r) {
                return Err(bad(r));
            }
        }
        Ok(())
    }

    /// The members other than this rank, in group order.
    fn others<'g>(&self, group: &'g [usize]) -> impl Iterator<Item = usize> + 'g {
        let me = self.rank;
        group.iter().copied().filter(move |&p| p != me)
    }

    fn post(&mut self, to: usize, op: &'static str, m: Message) -> Result<(), CommError> {
        if to >= self.size_() {
            return Err(CommError::NotAMember {
                rank: self.rank,
                peer: to,
                op,
                group: Vec::new(),
                size: self.size_(),
            });
        }
        self.traffic.bytes += 4 * match &m {
            Message::Values(v) => v.len() as u64,
            Message::Partials(ps) => ps.iter().map(|p| p.values.len() as u64).sum(),
            Message::Flag(_) | Message::Token => 0,
        };
        let b = &self.shared.boxes[to];
        lock(&b.queues)[self.rank].push_back(m);
        b.ready.notify_all();
        Ok(())
    }

    /// The next message from `from`. Waiting for data (`flag` false), a failure reported by
    /// any rank ends the wait (the step is lost anyway), and a failure flag `from` sent stays
    /// queued for the failure check it belongs to: `from` has left the step. The failure
    /// check itself (`flag`) waits until the flag comes or `from` is gone.
    fn take(&mut self, from: usize, op: &'static str, flag: bool) -> Result<Message, CommError> {
        let shared = &*self.shared;
        let deadline = Instant::now() + shared.timeout;
        let b = &shared.boxes[self.rank];
        let mut queues = lock(&b.queues);
        loop {
            match queues[from].front() {
                Some(Message::Flag(failed)) if !flag => {
                    let failed = *failed;
                    drop(queues);
                    if !failed {
                        return Err(self.out_of_step(from, op, "data", "failure flag"));
                    }
                    let (first, reason) = shared.failure();
                    return Err(CommError::PeerFailed {
                        rank: self.rank,
                        peer: from,
                        op,
                        failed: first,
                        reason,
                    });
                }
                Some(_) => return Ok(queues[from].pop_front().expect("a front message")),
                None => {}
            }
            let gone = shared.gone[from].load(Ordering::SeqCst);
            if gone || (!flag && shared.aborted.load(Ordering::SeqCst)) {
                drop(queues);
                let (failed, reason) = shared.failure();
                return Err(CommError::PeerFailed {
                    rank: self.rank,
                    peer: from,
                    op,
                    failed,
                    reason,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    rank: self.rank,
                    peer: from,
                    op,
                    waited: shared.timeout,
                });
            }
            queues = b
                .ready
                .wait_timeout(queues, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn out_of_step(
        &self,
        peer: usize,
        op: &'static str,
        expected: &'static str,
        got: &'static str,
    ) -> CommError {
        CommError::OutOfStep {
            rank: self.rank,
            peer,
            op,
            expected,
            got,
        }
    }

    fn take_values(&mut self, from: usize, op: &'static str) -> Result<Vec<f32>, CommError> {
        match self.take(from, op, false)? {
            Message::Values(v) => Ok(v),
            m => Err(self.out_of_step(from, op, "send", m.kind())),
        }
    }

    /// This rank's partial sums and those of the members `from`, with their senders.
    fn gather(
        &mut self,
        from: &[usize],
        mine: Vec<Partial>,
        op: &'static str,
    ) -> Result<Vec<(usize, Partial)>, CommError> {
        let mut all: Vec<(usize, Partial)> = mine.into_iter().map(|p| (self.rank, p)).collect();
        for &peer in from {
            match self.take(peer, op, false)? {
                Message::Partials(ps) => all.extend(ps.into_iter().map(|p| (peer, p))),
                m => return Err(self.out_of_step(peer, op, "partial sum", m.kind())),
            }
        }
        Ok(all)
    }

    fn sum(
        &self,
        leaves: usize,
        all: Vec<(usize, Partial)>,
        op: &'static str,
    ) -> Result<Vec<f32>, CommError> {
        total(leaves, all).map_err(|source| CommError::Sum {
            rank: self.rank,
            op,
            source,
        })
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size_()
    }

    fn all_reduce(
        &mut self,
        group: &[usize],
        leaves: usize,
        mine: Vec<Partial>,
    ) -> Result<Vec<f32>, CommError> {
        const OP: &str = "all-reduce";
        self.check(group, self.rank, OP)?;
        self.traffic.calls += 1;
        let others: Vec<usize> = self.others(group).collect();
        for &peer in &others {
            self.post(peer, OP, Message::Partials(mine.clone()))?;
        }
        let all = self.gather(&others, mine, OP)?;
        self.sum(leaves, all, OP)
    }

    fn reduce(
        &mut self,
        group: &[usize],
        root: usize,
        leaves: usize,
        mine: Vec<Partial>,
    ) -> Result<Option<Vec<f32>>, CommError> {
        const OP: &str = "reduce";
        self.check(group, root, OP)?;
        self.traffic.calls += 1;
        if self.rank != root {
            self.post(root, OP, Message::Partials(mine))?;
            return Ok(None);
        }
        let others: Vec<usize> = self.others(group).collect();
        let all = self.gather(&others, mine, OP)?;
        self.sum(leaves, all, OP).map(Some)
    }

    fn broadcast(
        &mut self,
        group: &[usize],
        root: usize,
        values: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        const OP: &str = "broadcast";
        self.check(group, root, OP)?;
        self.traffic.calls += 1;
        if self.rank == root {
            for peer in self.others(group).collect::<Vec<_>>() {
                self.post(peer, OP, Message::Values(values.clone()))?;
            }
        } else {
            *values = self.take_values(root, OP)?;
        }
        Ok(())
    }

    fn send(&mut self, to: usize, values: Vec<f32>) -> Result<(), CommError> {
        self.traffic.calls += 1;
        self.post(to, "send", Message::Values(values))
    }

    fn recv(&mut self, from: usize) -> Result<Vec<f32>, CommError> {
        if from >= self.size_() {
            return Err(CommError::NotAMember {
                rank: self.rank,
                peer: from,
                op: "recv",
                group: Vec::new(),
                size: self.size_(),
            });
        }
        self.take_values(from, "recv")
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        const OP: &str = "barrier";
        let world: Vec<usize> = (0..self.size_()).filter(|&r| r != self.rank).collect();
        for &peer in &world {
            self.post(peer, OP, Message::Token)?;
        }
        for &peer in &world {
            match self.take(peer, OP, false)? {
                Message::Token => {}
                m => return Err(self.out_of_step(peer, OP, "barrier token", m.kind())),
            }
        }
        Ok(())
    }

    fn any_failed(&mut self, failed: bool) -> bool {
        const OP: &str = "failure check";
        if failed {
            self.shared.fail(self.rank, "its step failed", false);
        }
        let world: Vec<usize> = (0..self.size_()).filter(|&r| r != self.rank).collect();
        let mut any = failed;
        for &peer in &world {
            // A post fails only for a rank outside the world, which `world` has none of.
            any |= self.post(peer, OP, Message::Flag(failed)).is_err();
        }
        for &peer in &world {
            // Not abortable: this is where a failed rank comes to say so. Data ahead of the
            // flag was meant for a call a failure cut short (or the ranks are out of step):
            // either way the step failed.
            loop {
                match self.take(peer, OP, true) {
                    Ok(Message::Flag(f)) => {
                        any |= f;
                        break;
                    }
                    Ok(_) => any = true,
                    Err(_) => {
                        any = true;
                        break;
                    }
                }
            }
        }
        any
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }
}

#[cfg(test)]
#[path = "threads_tests.rs"]
mod tests;
