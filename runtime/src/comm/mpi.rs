//! The communicator over MPI (the `mpi` feature): one process per rank, started by `mpirun`
//! or `srun`. Messages are point-to-point (MPI keeps them in order between two ranks), so the
//! all-reduce is the same gather of partial sums that every member combines along the fixed
//! tree as the in-process communicator's: never `MPI_Allreduce` on floats, whose order
//! depends on the world size. Sends are non-blocking (`MPI_Isend` of a buffer kept until the
//! send completes), so a rank that sends before it receives cannot deadlock. Receives poll
//! (`MPI_Improbe`) until the message comes, a rank reports a failure, or the timeout passes:
//! MPI's own waits have no timeout. A rank that dies outright is `mpirun`'s to handle: it
//! ends every other rank of the job.

use super::protocol::{Message, Transport};
use super::{CommError, Traffic, Wait};
use crate::comm::collective::Partial;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Data messages, in order per pair of ranks.
const DATA: i32 = 1;
/// A rank's failure, sent to every other rank so that their waits end at once.
const FAILED: i32 = 2;
/// How long a receive polls without sleeping.
const SPIN: Duration = Duration::from_millis(20);

/// MPI, started once per process; hand its `MpiComm` to the rank.
pub struct Mpi {
    // Finalises MPI when dropped, after the communicator.
    _universe: mpi::environment::Universe,
}

/// The MPI world as one rank sees it.
pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    timeout: Duration,
    traffic: Traffic,
    /// Sends not yet known to be complete, with their buffers (freed when they are).
    pending: Vec<Request<'static, [u8], StaticScope>>,
    /// The first failure reported to this rank: `(rank, reason)`.
    failure: Option<(usize, String)>,
    /// Whether this rank told the others it failed.
    told: bool,
    /// Messages taken and put back (`Transport::unget`), by sender.
    stash: Vec<VecDeque<Message>>,
}

#[derive(Debug, thiserror::Error)]
pub enum MpiError {
    #[error(
        "MPI could not be started (is this process run by mpirun or srun, and is MPI installed?)"
    )]
    Init,
    #[error("this MPI offers threading level {0:?}; Parallax needs Serialized")]
    Threading(mpi::Threading),
}

// SAFETY: MPI runs at the Serialized level (checked in `Mpi::start`): any thread may call it,
// one at a time, and every call goes through `&mut MpiComm`.
unsafe impl Send for MpiComm {}

impl Mpi {
    /// Starts MPI and returns this process's communicator, whose waits give up after
    /// `timeout`.
    pub fn start(timeout: Duration) -> Result<(Mpi, MpiComm), MpiError> {
        // Serialized: one thread at a time, not always the main one (a rank may run on a
        // thread of its own); every call goes through `&mut MpiComm`.
        keep_large_buffers();
        let (universe, threading) =
            mpi::initialize_with_threading(mpi::Threading::Serialized).ok_or(MpiError::Init)?;
        if !matches!(
            threading,
            mpi::Threading::Serialized | mpi::Threading::Multiple
        ) {
            return Err(MpiError::Threading(threading));
        }
        let world = universe.world();
        let size = world.size() as usize;
        let comm = MpiComm {
            rank: world.rank() as usize,
            size,
            world,
            timeout,
            traffic: Traffic::default(),
            pending: Vec::new(),
            failure: None,
            told: false,
            stash: (0..size).map(|_| VecDeque::new()).collect(),
        };
        Ok((
            Mpi {
                _universe: universe,
            },
            comm,
        ))
    }
}

/// Keeps freed large allocations in the process instead of unmapping them. Every message is
/// a buffer (gradients: megabytes) allocated and freed per collective; glibc maps a fresh one
/// for each, and writing it pays a page fault per 4 KiB, several times the cost of the
/// transfer (`comm-check --bench` on 2 ranks, 8 MiB: 6 times MPI_Allreduce's time without
/// this, 1.9 with it). A training process keeps its peak memory anyway.
fn keep_large_buffers() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets allocator parameters; called before any rank thread runs.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

impl MpiComm {
    /// Frees the buffers of the sends that completed.
    fn reap(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        for req in pending {
            match req.test_with_data() {
                // SAFETY: the buffer was leaked from a `Box<[u8]>` by `isend`, and the send
                // that read it is complete.
                Ok((_, buf)) => drop(unsafe { Box::from_raw(buf as *const [u8] as *mut [u8]) }),
                Err(req) => self.pending.push(req),
            }
        }
    }

    fn isend(&mut self, to: usize, tag: i32, bytes: Vec<u8>) {
        self.reap();
        // Leaked for the send's lifetime: MPI reads it until the request completes.
        let buf: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        let req = self
            .world
            .process_at_rank(to as i32)
            .immediate_send_with_tag(StaticScope, buf, tag);
        self.pending.push(req);
    }

    /// A failure another rank reported, if one came.
    fn poll_failure(&mut self) -> Option<(usize, String)> {
        if self.failure.is_none() {
            let any = self.world.any_process();
            if let Some(probed) = any.immediate_matched_probe_with_tag(FAILED) {
                let (bytes, status) = probed.matched_receive_vec::<u8>();
                let reason = String::from_utf8_lossy(&bytes).into_owned();
                self.failure = Some((status.source_rank() as usize, reason));
            }
        }
        self.failure.clone()
    }

    /// Tells every other rank that this one failed (once).
    fn tell_failed(&mut self, reason: &str) {
        if std::mem::replace(&mut self.told, true) {
            return;
        }
        let me = self.rank;
        for peer in (0..self.size).filter(|&p| p != me) {
            self.isend(peer, FAILED, reason.as_bytes().to_vec());
        }
    }

    /// The next message from `from`. With `abortable`, a failure reported by any rank ends
    /// the wait (the step is lost anyway).
    fn wait_for(
        &mut self,
        from: usize,
        op: &'static str,
        abortable: bool,
    ) -> Result<Message, CommError> {
        if let Some(m) = self.stash[from].pop_front() {
            return Ok(m);
        }
        let wait = Wait::new(self.rank, from, op, self.timeout);
        let start = Instant::now();
        let mut nap = Duration::from_micros(5);
        loop {
            let source = self.world.process_at_rank(from as i32);
            if let Some(probed) = source.immediate_matched_probe_with_tag(DATA) {
                let (bytes, _) = probed.matched_receive_vec::<u8>();
                return Message::decode(&bytes).ok_or(CommError::OutOfStep {
                    rank: self.rank,
                    peer: from,
                    op,
                    expected: "message of this build",
                    got: "malformed message",
                });
            }
            if abortable {
                if let Some(failure) = self.poll_failure() {
                    return Err(wait.failed(failure));
                }
            }
            let left = wait.left()?;
            self.reap();
            // MPI moves a large message only while both sides call into it: poll hot for a
            // while (yielding the core), then back off for a peer that is far behind.
            if start.elapsed() < SPIN {
                std::thread::yield_now();
                continue;
            }
            std::thread::sleep(nap.min(left));
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // A send no rank will receive (a peer failed) must not hold the process: the requests
        // are released to MPI, and their buffers leaked, as the process ends anyway.
        for req in std::mem::take(&mut self.pending) {
            // SAFETY: the request is live and owned here; MPI_Request_free lets the send
            // finish (or be dropped at finalisation) without our waiting for it, and its
            // buffer is never freed.
            unsafe {
                let (mut raw, _, _) = req.into_raw();
                mpi::ffi::MPI_Request_free(&mut raw);
            }
        }
    }
}

impl Transport for MpiComm {
    fn this_rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn post(&mut self, to: usize, m: Message) {
        self.isend(to, DATA, m.encode());
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
        self.stash[from].push_front(m);
    }

    fn failure(&mut self) -> Option<(usize, String)> {
        self.poll_failure()
    }

    fn report_failure(&mut self, reason: &str) {
        self.tell_failed(reason);
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }

    fn traffic_mut(&mut self) -> &mut Traffic {
        &mut self.traffic
    }
}

/// One size of the reduction benchmark: the fixed tree (partials gathered, summed in order by
/// every member) against `MPI_Allreduce(SUM)` on the same buffers, one shard per rank.
#[derive(Debug, Clone, Copy)]
pub struct ReductionTiming {
    pub floats: usize,
    /// Median seconds per all-reduce.
    pub tree_seconds: f64,
    pub allreduce_seconds: f64,
    /// Bytes this rank sent per tree all-reduce (MPI's own traffic is its algorithm's).
    pub tree_bytes: u64,
    /// Whether `MPI_Allreduce` gave the tree's bits here (it need not on other counts).
    pub same_bits: bool,
}

impl MpiComm {
    /// `comm-check --bench`: the fixed tree against `MPI_Allreduce` at four sizes, 20 times
    /// each, as a Markdown table (rank 0 prints it; every rank calls this).
    pub fn reduction_table(&mut self) -> Result<Vec<String>, CommError> {
        use crate::comm::Communicator;
        let mut lines = vec![
            "| floats per rank | fixed tree | MPI_Allreduce | tree / MPI | tree bytes sent per rank | MPI's buffer | same bits here |".to_string(),
            "|---|---|---|---|---|---|---|".to_string(),
        ];
        for floats in [1 << 10, 1 << 14, 1 << 18, 1 << 21] {
            let t = self.time_reductions(floats, 20)?;
            lines.push(format!(
                "| {} | {:.3} ms | {:.3} ms | {:.2} | {} | {} | {} |",
                t.floats,
                t.tree_seconds * 1e3,
                t.allreduce_seconds * 1e3,
                t.tree_seconds / t.allreduce_seconds.max(1e-12),
                parallax_compiler::plan::bytes(t.tree_bytes),
                parallax_compiler::plan::bytes(4 * t.floats as u64),
                if t.same_bits { "yes" } else { "no" }
            ));
        }
        lines.push(format!("({} rank(s); medians of 20)", self.size()));
        Ok(lines)
    }
}

impl MpiComm {
    /// Times both reductions over `floats` values per rank, `repeats` times each (every rank
    /// calls it with the same arguments). For the benchmark only: training never sums
    /// floats with `MPI_Allreduce`.
    pub fn time_reductions(
        &mut self,
        floats: usize,
        repeats: usize,
    ) -> Result<ReductionTiming, CommError> {
        use crate::comm::Communicator;
        use mpi::collective::{CommunicatorCollectives, SystemOperation};
        let rank = self.rank;
        let mine: Vec<f32> = (0..floats)
            .map(|i| ((i * 7 + rank * 13) % 101) as f32 * 0.013 - 0.6)
            .collect();
        let group: Vec<usize> = (0..self.size).collect();
        let median = |mut t: Vec<f64>| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        };
        let (mut tree, mut native) = (Vec::new(), Vec::new());
        let before = Communicator::traffic(self).bytes;
        let mut total = Vec::new();
        for _ in 0..repeats.max(1) {
            self.barrier()?;
            let t = Instant::now();
            let part = vec![Partial {
                range: rank..rank + 1,
                values: mine.clone(),
            }];
            total = self.all_reduce(&group, self.size, part)?;
            tree.push(t.elapsed().as_secs_f64());
        }
        let tree_bytes = (Communicator::traffic(self).bytes - before) / repeats.max(1) as u64;
        let mut sum = vec![0f32; floats];
        for _ in 0..repeats.max(1) {
            self.barrier()?;
            let t = Instant::now();
            self.world
                .all_reduce_into(&mine[..], &mut sum[..], SystemOperation::sum());
            native.push(t.elapsed().as_secs_f64());
        }
        let same_bits = total
            .iter()
            .zip(&sum)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        Ok(ReductionTiming {
            floats,
            tree_seconds: median(tree),
            allreduce_seconds: median(native),
            tree_bytes,
            same_bits,
        })
    }
}
