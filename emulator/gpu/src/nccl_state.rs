//! The emulated NCCL's communicators and how a group's operations run.
//!
//! At the end of a group (an operation outside one is a group of its own), each operation's
//! stream runs its queued work first (the GPU would have reached the operation), then the
//! data to send is read and posted to the peers (`nccl_wire`): sends are buffered, so they
//! never wait for the receiver. What a rank receives completes in issue order as it arrives,
//! and is then enqueued on the operation's stream as a write: NCCL's documented non-blocking
//! contract, where the operations reach the stream once `ncclCommGetAsyncError` stops
//! reporting `ncclInProgress`. A blocking communicator waits for that inside the call.
//! A peer that aborted, destroyed its communicator or whose process exited fails the wait
//! at once (`ncclRemoteError`); one that never sends fails it after the timeout
//! (`nccl_wire::timeout`, `ncclTimeout`). Either error is sticky, as NCCL's async errors are.

use crate::nccl_reduce as reduce;
use crate::nccl_wire::{self as wire, Every, Header};
use crate::ops::Op;
use crate::state::state;
use cudarc::nccl::sys::ncclResult_t as R;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct Failure {
    pub code: R,
    pub text: String,
}

pub type NResult<T> = Result<T, Failure>;

pub fn failure(code: R, text: impl Into<String>) -> Failure {
    let f = Failure {
        code,
        text: text.into(),
    };
    set_last_error(&f.text);
    f
}

/// `ncclGetLastError`'s text. Each message is leaked so that a pointer handed out stays
/// valid; there is one per failure, and a failure ends a communicator.
static LAST_ERROR: AtomicPtr<c_char> = AtomicPtr::new(std::ptr::null_mut());

pub fn set_last_error(text: &str) {
    let c = CString::new(text.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.store(c.into_raw(), Ordering::Release);
}

pub fn last_error() -> *const c_char {
    let p = LAST_ERROR.load(Ordering::Acquire);
    if p.is_null() {
        c"".as_ptr()
    } else {
        p
    }
}

/// The collectives, as tags in the messages' headers.
pub const ALL_GATHER: u8 = 1;
pub const ALL_REDUCE: u8 = 2;
pub const REDUCE_SCATTER: u8 = 3;
pub const BROADCAST: u8 = 4;
pub const REDUCE: u8 = 5;

fn coll_name(kind: u8) -> &'static str {
    match kind {
        ALL_GATHER => "ncclAllGather",
        ALL_REDUCE => "ncclAllReduce",
        REDUCE_SCATTER => "ncclReduceScatter",
        BROADCAST => "ncclBroadcast",
        _ => "ncclReduce",
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Coll {
    pub kind: u8,
    pub send: u64,
    pub recv: u64,
    /// Elements per rank (the receive count of a reduce-scatter, the send count of an
    /// all-gather).
    pub count: usize,
    pub dtype: i32,
    pub op: i32,
    pub root: i32,
}

impl Coll {
    fn header(&self) -> Header {
        Header {
            kind: self.kind,
            dtype: self.dtype,
            op: self.op,
            root: self.root,
            count: self.count as u64,
        }
    }

    fn describe(&self) -> String {
        format!(
            "{} of {} {}",
            coll_name(self.kind),
            self.count,
            reduce::type_name(self.dtype)
        )
    }

    /// Who sends their part to `me`, and whom `me` sends its part to.
    fn senders(&self, me: usize, n: usize) -> Vec<usize> {
        let root = self.root as usize;
        match self.kind {
            BROADCAST if me != root => vec![root],
            BROADCAST => vec![],
            REDUCE if me == root => (0..n).filter(|&r| r != me).collect(),
            REDUCE => vec![],
            _ => (0..n).filter(|&r| r != me).collect(),
        }
    }

    fn receivers(&self, me: usize, n: usize) -> Vec<usize> {
        (0..n)
            .filter(|&r| r != me && self.senders(r, n).contains(&me))
            .collect()
    }

    /// Bytes of this rank's part (`None`: it sends nothing and reads nothing).
    fn own_bytes(&self, me: usize, n: usize) -> Option<usize> {
        let elems = match self.kind {
            BROADCAST if me != self.root as usize => return None,
            REDUCE_SCATTER => self.count * n,
            _ => self.count,
        };
        Some(elems * reduce::size_of(self.dtype).unwrap_or(0))
    }

    /// What lands at `recv` once every part is in (rank order).
    fn result(&self, me: usize, parts: &[Vec<u8>]) -> Option<Vec<u8>> {
        let size = reduce::size_of(self.dtype).unwrap_or(0);
        match self.kind {
            ALL_GATHER => Some(parts.concat()),
            ALL_REDUCE => Some(reduce::reduce(self.dtype, self.op, parts)),
            REDUCE if me == self.root as usize => Some(reduce::reduce(self.dtype, self.op, parts)),
            REDUCE => None,
            REDUCE_SCATTER => {
                let all = reduce::reduce(self.dtype, self.op, parts);
                let b = self.count * size;
                Some(all[me * b..(me + 1) * b].to_vec())
            }
            _ => Some(parts[self.root as usize].clone()),
        }
    }
}

pub enum Item {
    Send { peer: usize, src: u64, bytes: usize },
    Recv { peer: usize, dst: u64, bytes: usize },
    Coll(Coll),
}

/// An operation as issued, before its group ends.
pub struct Issued {
    pub comm: usize,
    pub stream: usize,
    pub item: Item,
}

enum Waiting {
    Recv {
        from: usize,
        seq: u64,
        dst: u64,
        bytes: usize,
    },
    Coll {
        coll: Coll,
        seq: u64,
        parts: Vec<Option<Vec<u8>>>,
    },
}

struct Pending {
    stream: usize,
    since: Instant,
    what: Waiting,
}

pub struct Comm {
    pub dir: PathBuf,
    pub rank: usize,
    pub n: usize,
    pub device: i32,
    pub blocking: bool,
    joined: bool,
    since: Instant,
    /// Point-to-point messages sent to / received from each peer, and collectives issued:
    /// the sequence numbers that match the n-th send with the n-th receive.
    sent: Vec<u64>,
    received: Vec<u64>,
    colls: u64,
    pending: VecDeque<Pending>,
    pub error: Option<Failure>,
    check: Every,
    timeout: Duration,
}

impl Comm {
    pub fn new(dir: PathBuf, rank: usize, n: usize, device: i32, blocking: bool) -> NResult<Comm> {
        wire::join(&dir, rank).map_err(|e| {
            failure(
                R::ncclSystemError,
                format!("joining at {}: {e}", dir.display()),
            )
        })?;
        Ok(Comm {
            dir,
            rank,
            n,
            device,
            blocking,
            joined: false,
            since: Instant::now(),
            sent: vec![0; n],
            received: vec![0; n],
            colls: 0,
            pending: VecDeque::new(),
            error: None,
            check: Every::new(Duration::from_millis(100)),
            timeout: wire::timeout(),
        })
    }

    /// Overrides `nccl_wire::timeout` (for tests).
    #[cfg(test)]
    pub fn set_timeout(&mut self, t: Duration) {
        self.timeout = t;
    }

    /// Makes what progress can be made without waiting; the communicator's async state.
    pub fn progress(&mut self) -> R {
        if let Some(e) = &self.error {
            return e.code;
        }
        match self.advance() {
            Ok(true) => R::ncclSuccess,
            Ok(false) => R::ncclInProgress,
            Err(f) => {
                eprintln!(
                    "emulated GPU: NCCL rank {} of {}: {}",
                    self.rank, self.n, f.text
                );
                let code = f.code;
                self.error = Some(f);
                code
            }
        }
    }

    /// `Ok(true)`: joined and nothing pending.
    fn advance(&mut self) -> NResult<bool> {
        if !self.joined {
            if !wire::all_joined(&self.dir, self.n) {
                let missing: Vec<usize> = (0..self.n)
                    .filter(|r| !self.dir.join(format!("join-{r}")).exists())
                    .collect();
                self.stalled(self.since, &missing, "to join the communicator")?;
                return Ok(false);
            }
            self.joined = true;
        }
        while let Some(p) = self.pending.front_mut() {
            let stream = p.stream;
            let (dir, me, n) = (&self.dir, self.rank, self.n);
            let done = match &mut p.what {
                Waiting::Recv {
                    from,
                    seq,
                    dst,
                    bytes,
                } => match take(dir, &format!("p-{from}-{me}-{seq}"))? {
                    Some(b) if b.len() == *bytes => Some(Some((*dst, b))),
                    Some(b) => {
                        return Err(failure(
                            R::ncclInvalidUsage,
                            format!(
                                "send {seq} from rank {from} carries {} bytes, the matching ncclRecv expects {bytes}",
                                b.len()
                            ),
                        ))
                    }
                    None => None,
                },
                Waiting::Coll { coll, seq, parts } => gather(dir, me, n, coll, *seq, parts)?,
            };
            let Some(write) = done else {
                let (since, missing, what) = self.waiting_for();
                self.stalled(since, &missing, &what)?;
                return Ok(false);
            };
            self.pending.pop_front();
            if let Some((dst, bytes)) = write {
                state()
                    .submit(stream, Op::Write { dst, bytes })
                    .map_err(|e| {
                        failure(
                            R::ncclUnhandledCudaError,
                            format!("enqueuing the received data on the stream: {e:?}"),
                        )
                    })?;
            }
        }
        Ok(true)
    }

    /// The first pending operation's start, the peers it waits for, and what it is.
    fn waiting_for(&self) -> (Instant, Vec<usize>, String) {
        let Some(p) = self.pending.front() else {
            return (Instant::now(), vec![], String::new());
        };
        match &p.what {
            Waiting::Recv { from, seq, .. } => (
                p.since,
                vec![*from],
                format!("to send (message {seq} to this rank's ncclRecv)"),
            ),
            Waiting::Coll { coll, seq, parts } => {
                let missing = coll
                    .senders(self.rank, self.n)
                    .into_iter()
                    .filter(|&r| parts[r].is_none())
                    .collect();
                let what = format!("to join collective {seq} ({})", coll.describe());
                (p.since, missing, what)
            }
        }
    }

    /// Fails a wait on `peers` that cannot end (a peer gone) or ran past the timeout.
    fn stalled(&mut self, since: Instant, peers: &[usize], what: &str) -> NResult<()> {
        if self.check.due() {
            for &p in peers {
                if let Some(why) = wire::peer_lost(&self.dir, p) {
                    return Err(failure(
                        R::ncclRemoteError,
                        format!("waiting for rank {p} {what}: {why}"),
                    ));
                }
            }
        }
        if since.elapsed() > self.timeout {
            let who: Vec<String> = peers.iter().map(|p| format!("rank {p}")).collect();
            return Err(failure(
                R::ncclTimeout,
                format!(
                    "waited {:?} for {} {what} (PARALLAX_EMULATED_NCCL_TIMEOUT)",
                    self.timeout,
                    who.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// Posts one operation at the end of its group.
    fn post(&mut self, stream: usize, item: &Item) -> NResult<()> {
        let (me, n) = (self.rank, self.n);
        let io = |e: std::io::Error| failure(R::ncclSystemError, format!("posting a message: {e}"));
        let what = match *item {
            Item::Send { peer, src, bytes } => {
                let data = read_device(stream, src, bytes)?;
                let seq = next(&mut self.sent[peer]);
                wire::put(&self.dir, &format!("p-{me}-{peer}-{seq}"), &data).map_err(io)?;
                return Ok(());
            }
            Item::Recv { peer, dst, bytes } => Waiting::Recv {
                from: peer,
                seq: next(&mut self.received[peer]),
                dst,
                bytes,
            },
            Item::Coll(coll) => {
                let seq = next(&mut self.colls);
                let mut parts = vec![None; n];
                // Ranks that take no part hold an empty one (a broadcast's non-roots).
                parts[me] = Some(match coll.own_bytes(me, n) {
                    Some(b) => read_device(stream, coll.send, b)?,
                    None => Vec::new(),
                });
                let msg = coll
                    .header()
                    .encode(parts[me].as_deref().unwrap_or_default());
                for to in coll.receivers(me, n) {
                    wire::put(&self.dir, &format!("c-{seq}-{me}-{to}"), &msg).map_err(io)?;
                }
                Waiting::Coll { coll, seq, parts }
            }
        };
        self.pending.push_back(Pending {
            stream,
            since: Instant::now(),
            what,
        });
        Ok(())
    }
}

fn next(counter: &mut u64) -> u64 {
    *counter += 1;
    *counter - 1
}

fn take(dir: &std::path::Path, name: &str) -> NResult<Option<Vec<u8>>> {
    wire::take(dir, name)
        .map_err(|e| failure(R::ncclSystemError, format!("reading message {name}: {e}")))
}

/// Takes the parts of collective `seq` that arrived; the result's write once all are in
/// (`Some(None)`: complete, nothing to write on this rank).
#[allow(clippy::type_complexity)]
fn gather(
    dir: &std::path::Path,
    me: usize,
    n: usize,
    coll: &Coll,
    seq: u64,
    parts: &mut [Option<Vec<u8>>],
) -> NResult<Option<Option<(u64, Vec<u8>)>>> {
    for from in coll.senders(me, n) {
        if parts[from].is_some() {
            continue;
        }
        let Some(msg) = take(dir, &format!("c-{seq}-{from}-{me}"))? else {
            continue;
        };
        let (h, data) = Header::decode(&msg)
            .ok_or_else(|| failure(R::ncclInternalError, "a truncated collective message"))?;
        if h != coll.header() || coll.own_bytes(from, n).is_some_and(|b| b != data.len()) {
            let theirs = Coll {
                kind: h.kind,
                count: h.count as usize,
                dtype: h.dtype,
                ..*coll
            };
            return Err(failure(
                R::ncclInvalidUsage,
                format!(
                    "collective {seq} is {} (op {}, root {}) on rank {from} but {} (op {}, root {}) on rank {me}: every rank must issue the same collectives in the same order",
                    theirs.describe(), h.op, h.root, coll.describe(), coll.op, coll.root
                ),
            ));
        }
        parts[from] = Some(data.to_vec());
    }
    if coll.senders(me, n).iter().any(|&r| parts[r].is_none()) {
        return Ok(None);
    }
    let parts: Vec<Vec<u8>> = parts
        .iter_mut()
        .map(|p| p.take().unwrap_or_default())
        .collect();
    Ok(Some(coll.result(me, &parts).map(|b| (coll.recv, b))))
}

/// `bytes` at device address `addr`, once `stream`'s earlier work has run.
fn read_device(stream: usize, addr: u64, bytes: usize) -> NResult<Vec<u8>> {
    let mut s = state();
    let cuda = |e| failure(R::ncclUnhandledCudaError, format!("the stream: {e:?}"));
    s.stream(stream).map_err(cuda)?;
    if s.captures.contains_key(&stream) {
        return Err(failure(
            R::ncclInvalidUsage,
            "NCCL operations in a stream capture are not emulated",
        ));
    }
    if stream <= 1 {
        s.flush_blocking().map_err(cuda)?;
    } else {
        s.flush(stream).map_err(cuda)?;
    }
    let mut out = vec![0u8; bytes];
    s.memory.read(addr, &mut out).map_err(|e| {
        failure(
            R::ncclInvalidArgument,
            format!("reading {bytes} bytes at {addr:#x}: {e}"),
        )
    })?;
    Ok(out)
}

type Shared = Arc<Mutex<Comm>>;

static COMMS: Mutex<Option<HashMap<usize, Shared>>> = Mutex::new(None);
static NEXT: AtomicUsize = AtomicUsize::new(0);

fn comms() -> MutexGuard<'static, Option<HashMap<usize, Shared>>> {
    COMMS.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn lock(c: &Shared) -> MutexGuard<'_, Comm> {
    c.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers a communicator; its handle (never null).
pub fn register(c: Comm) -> usize {
    let h = 0x4e00_0000 + 16 * NEXT.fetch_add(1, Ordering::Relaxed);
    comms()
        .get_or_insert_with(HashMap::new)
        .insert(h, Arc::new(Mutex::new(c)));
    h
}

pub fn get(h: usize) -> NResult<Shared> {
    comms()
        .as_ref()
        .and_then(|m| m.get(&h).cloned())
        .ok_or_else(|| failure(R::ncclInvalidArgument, "not a live communicator"))
}

pub fn remove(h: usize) -> NResult<Shared> {
    comms()
        .as_mut()
        .and_then(|m| m.remove(&h))
        .ok_or_else(|| failure(R::ncclInvalidArgument, "not a live communicator"))
}

/// A rank whose operations are dropped at the end of every group, as if it never called
/// them: `PARALLAX_EMULATED_NCCL_SKIP_RANK`, a planted fault for the tests of a peer
/// that never arrives.
fn skipped(rank: usize) -> bool {
    std::env::var("PARALLAX_EMULATED_NCCL_SKIP_RANK")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        == Some(rank)
}

/// Waits (without holding any lock between polls) until `c` is no longer in progress.
pub fn wait(c: &Shared) -> R {
    loop {
        let r = lock(c).progress();
        if r != R::ncclInProgress {
            return r;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Ends a group: posts every operation, then makes progress on each communicator (waiting
/// on blocking ones). `ncclInProgress` when a non-blocking one still waits for data.
pub fn launch(items: Vec<Issued>) -> NResult<R> {
    let mut touched: Vec<(usize, Shared)> = Vec::new();
    for it in &items {
        let c = get(it.comm)?;
        let mut g = lock(&c);
        if let Some(e) = &g.error {
            return Err(e.clone());
        }
        if !g.joined {
            return Err(failure(
                R::ncclInvalidUsage,
                "an operation on a communicator whose initialisation has not completed (poll ncclCommGetAsyncError first)",
            ));
        }
        if skipped(g.rank) {
            continue;
        }
        g.post(it.stream, &it.item)?;
        drop(g);
        if !touched.iter().any(|(h, _)| *h == it.comm) {
            touched.push((it.comm, c));
        }
    }
    let mut result = R::ncclSuccess;
    for (_, c) in &touched {
        let blocking = lock(c).blocking;
        let r = if blocking {
            wait(c)
        } else {
            lock(c).progress()
        };
        match r {
            R::ncclSuccess => {}
            R::ncclInProgress => result = R::ncclInProgress,
            e => {
                let text = lock(c).error.as_ref().map(|f| f.text.clone());
                return Err(failure(e, text.unwrap_or_default()));
            }
        }
    }
    Ok(result)
}
