//! The in-process communicator: ranks are threads of one process, each with a mailbox that
//! holds one queue per sender (so messages between two ranks arrive in the order sent, as
//! MPI's do). Sends only append, so they never block; a receive waits on its mailbox's
//! condition variable until the message comes, the sender is known to have failed, or the
//! timeout passes. All-reduces gather every member's partial sums and each member combines
//! them along the fixed tree itself, so every member gets the same bits.

use super::protocol::{Message, Transport};
use super::{CommError, Traffic, Wait};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

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

    /// The next message from `from`. With `abortable`, a failure reported by any rank ends
    /// the wait; a rank that is gone (its thread panicked) ends it always.
    fn wait_for(
        &mut self,
        from: usize,
        op: &'static str,
        abortable: bool,
    ) -> Result<Message, CommError> {
        let shared = &*self.shared;
        let wait = Wait::new(self.rank, from, op, shared.timeout);
        let b = &shared.boxes[self.rank];
        let mut queues = lock(&b.queues);
        loop {
            if let Some(m) = queues[from].pop_front() {
                return Ok(m);
            }
            let gone = shared.gone[from].load(Ordering::SeqCst);
            if gone || (abortable && shared.aborted.load(Ordering::SeqCst)) {
                drop(queues);
                return Err(wait.failed(shared.failure()));
            }
            let left = wait.left()?;
            queues = b
                .ready
                .wait_timeout(queues, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Transport for ThreadComm {
    fn this_rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size_()
    }

    fn post(&mut self, to: usize, m: Message) {
        let b = &self.shared.boxes[to];
        lock(&b.queues)[self.rank].push_back(m);
        b.ready.notify_all();
    }

    fn take(
        &mut self,
        from: usize,
        op: &'static str,
        abortable: bool,
    ) -> Result<Message, CommError> {
        self.wait_for(from, op, abortable)
    }

    fn unget(&mut self, from: usize, m: Message) {
        lock(&self.shared.boxes[self.rank].queues)[from].push_front(m);
    }

    fn failure(&mut self) -> Option<(usize, String)> {
        Some(self.shared.failure())
    }

    fn report_failure(&mut self, reason: &str) {
        self.shared.fail(self.rank, reason, false);
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }

    fn traffic_mut(&mut self) -> &mut Traffic {
        &mut self.traffic
    }
}

#[cfg(test)]
#[path = "threads_tests.rs"]
mod tests;
