//! The communicator over TCP, for ranks started with torchrun-style variables and no MPI
//! (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), as torch's own store is: rank 0
//! listens at `MASTER_PORT`, every other rank connects to it once, and messages between two
//! other ranks pass through rank 0 (a star). It carries what the job's ranks say to each
//! other (the start-up checks, the votes after each step, values one rank fetches from
//! another, pipeline transfers, and sums over shards when they are summed on the host).
//!
//! A reader thread per connection files incoming messages in the rank's mailbox, one queue
//! per sender, in the order sent, so sends never wait for the receiver. A connection that
//! closes means its rank is gone (it exited or was killed): every wait on it ends at once,
//! naming it, rather than at the timeout.

use super::protocol::{Message, Transport};
use super::{CommError, Traffic, Wait};
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// A frame's first bytes: `from`, `to`, kind, payload length.
const HEADER: usize = 4 + 4 + 1 + 8;
/// `to` of a frame for every rank.
const EVERYONE: u32 = u32::MAX;
/// A message (its encoding follows).
const DATA: u8 = 0;
/// A rank's failure: its reason follows.
const FAILED: u8 = 1;
/// A rank whose connection closed (sent on by rank 0).
const GONE: u8 = 2;
/// What a rank says first: this, its rank, the world size, its token.
const HELLO: &[u8; 8] = b"PRLXTCP1";
/// How long a connection attempt waits before trying again.
const RETRY: Duration = Duration::from_millis(100);
/// Payloads larger than this are refused as garbage (a gradient bucket is far smaller).
const MAX_PAYLOAD: u64 = 1 << 36;

#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    #[error("rank {rank}: cannot listen at port {port}: {source} (another job may hold it: give each job its own MASTER_PORT)")]
    Listen {
        rank: usize,
        port: u16,
        source: std::io::Error,
    },
    #[error("rank {rank}: rank 0 at {addr} did not answer within {waited:?}: {last}")]
    Unreachable {
        rank: usize,
        addr: String,
        waited: Duration,
        last: String,
    },
    #[error("rank 0: rank(s) {missing:?} of {size} never connected within {waited:?}")]
    Missing {
        missing: Vec<usize>,
        size: usize,
        waited: Duration,
    },
    #[error("rank {rank}: refused by rank 0: {why}")]
    Refused { rank: usize, why: String },
    #[error("rank {rank}: stopped by a signal while the ranks were meeting")]
    Interrupted { rank: usize },
    #[error("rank {rank}: {what}: {source}")]
    Io {
        rank: usize,
        what: &'static str,
        source: std::io::Error,
    },
}

/// One rank's view of a job over TCP.
pub struct TcpComm {
    rank: usize,
    size: usize,
    timeout: Duration,
    inbox: Arc<Inbox>,
    /// Rank 0: a connection to each other rank (`None` at 0); the others: to rank 0 only.
    links: Vec<Option<Arc<Link>>>,
    traffic: Traffic,
}

/// Where a rank meets the others.
enum Place<'a> {
    /// Rank 0: listening here.
    Listen(TcpListener),
    /// The others: rank 0's host and port.
    Dial(&'a str, u16),
}

/// A connection's writing end (frames are written whole under its lock).
struct Link {
    stream: Mutex<TcpStream>,
}

struct Inbox {
    state: Mutex<State>,
    ready: Condvar,
}

struct State {
    queues: Vec<VecDeque<Message>>,
    /// The first failure a rank reported: `(rank, reason)`. It ends every wait.
    failure: Option<(usize, String)>,
    /// Ranks whose connection closed: they send nothing more, so waits on them end. (Not a
    /// failure by itself: a rank that finished the job closes its connection too.)
    gone: Vec<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Inbox {
    fn new(size: usize) -> Inbox {
        Inbox {
            state: Mutex::new(State {
                queues: (0..size).map(|_| VecDeque::new()).collect(),
                failure: None,
                gone: vec![false; size],
            }),
            ready: Condvar::new(),
        }
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut lock(&self.state));
        self.ready.notify_all();
    }

    /// Waits at most `left` for news (a message, a failure, a rank gone).
    fn wait<'a>(&self, s: MutexGuard<'a, State>, left: Duration) -> MutexGuard<'a, State> {
        self.ready
            .wait_timeout(s, left)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }

    fn fail(&self, rank: usize, reason: String) {
        self.update(|s| {
            s.failure.get_or_insert((rank, reason));
        });
    }

    fn gone(&self, rank: usize) {
        self.update(|s| {
            if let Some(g) = s.gone.get_mut(rank) {
                *g = true;
            }
        });
    }
}

/// A failure frame's payload: the rank that failed first (4 bytes) and why.
fn failure_of(payload: &[u8]) -> Option<(usize, String)> {
    let (rank, reason) = payload.split_first_chunk::<4>()?;
    let reason = String::from_utf8_lossy(reason).into_owned();
    Some((u32::from_le_bytes(*rank) as usize, reason))
}

impl Link {
    fn send(&self, from: usize, to: u32, kind: u8, payload: &[u8]) -> std::io::Result<()> {
        let mut frame = Vec::with_capacity(HEADER + payload.len());
        frame.extend((from as u32).to_le_bytes());
        frame.extend(to.to_le_bytes());
        frame.push(kind);
        frame.extend((payload.len() as u64).to_le_bytes());
        frame.extend_from_slice(payload);
        lock(&self.stream).write_all(&frame)
    }
}

/// Reads one frame: `(from, to, kind, payload)`; `None` when the connection closed or sent
/// garbage.
fn read_frame(r: &mut impl Read) -> Option<(usize, u32, u8, Vec<u8>)> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h).ok()?;
    let from = u32::from_le_bytes(h[0..4].try_into().ok()?) as usize;
    let to = u32::from_le_bytes(h[4..8].try_into().ok()?);
    let kind = h[8];
    let len = u64::from_le_bytes(h[9..17].try_into().ok()?);
    if len > MAX_PAYLOAD {
        return None;
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).ok()?;
    Some((from, to, kind, payload))
}

impl TcpComm {
    /// Joins the job as `rank` of `size`: rank 0 listens at `port` on every interface and
    /// waits for the others; they connect to `host:port`. Each side gives up after
    /// `timeout`, which also bounds every wait for a message. `token` (the build, say) must
    /// be the same on every rank. A non-zero `stop` (a signal's number) ends the meeting.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        rank: usize,
        size: usize,
        host: &str,
        port: u16,
        token: &str,
        timeout: Duration,
        stop: &AtomicUsize,
    ) -> Result<TcpComm, TcpError> {
        let place = match rank {
            0 => Place::Listen(
                TcpListener::bind(("0.0.0.0", port)).map_err(|source| TcpError::Listen {
                    rank,
                    port,
                    source,
                })?,
            ),
            _ => Place::Dial(host, port),
        };
        TcpComm::join(rank, size, place, token, timeout, stop)
    }

    /// Rank 0 of `size`, on a listener already bound (so that no other program can take
    /// its port between choosing and binding it, as in tests).
    pub fn connect_listening(
        listener: TcpListener,
        size: usize,
        token: &str,
        timeout: Duration,
        stop: &AtomicUsize,
    ) -> Result<TcpComm, TcpError> {
        TcpComm::join(0, size, Place::Listen(listener), token, timeout, stop)
    }

    fn join(
        rank: usize,
        size: usize,
        place: Place,
        token: &str,
        timeout: Duration,
        stop: &AtomicUsize,
    ) -> Result<TcpComm, TcpError> {
        let inbox = Arc::new(Inbox::new(size));
        let mut links: Vec<Option<Arc<Link>>> = (0..size).map(|_| None).collect();
        let deadline = Instant::now() + timeout;
        let io = |what| move |source| TcpError::Io { rank, what, source };
        if let Place::Listen(listener) = place {
            let streams: Vec<TcpStream> =
                accept_all(&listener, size, token, deadline, timeout, stop)?
                    .into_iter()
                    .flatten()
                    .collect();
            for (r, stream) in streams.iter().enumerate() {
                links[r + 1] = Some(Arc::new(Link::new(stream).map_err(io("a connection"))?));
            }
            // Every rank has come: tell them all before reading (and passing on) what any
            // sends, so that no message passed on can reach a rank ahead of its start.
            for mut stream in &streams {
                stream.write_all(&[1]).map_err(io("starting the job"))?;
            }
            for (r, stream) in streams.into_iter().enumerate() {
                reader(stream, r + 1, &inbox, Some(links.clone()));
            }
        } else if let Place::Dial(host, port) = place {
            let stream = dial(rank, size, host, port, token, deadline, timeout, stop)?;
            links[0] = Some(Arc::new(Link::new(&stream).map_err(io("a connection"))?));
            reader(stream, 0, &inbox, None);
        }
        Ok(TcpComm {
            rank,
            size,
            timeout,
            inbox,
            links,
            traffic: Traffic::default(),
        })
    }

    /// The connection a frame for `to` leaves by.
    fn link_to(&self, to: usize) -> Option<&Arc<Link>> {
        match self.rank {
            0 => self.links.get(to)?.as_ref(),
            _ => self.links[0].as_ref(),
        }
    }
}

impl Link {
    fn new(stream: &TcpStream) -> std::io::Result<Link> {
        let w = stream.try_clone()?;
        w.set_nodelay(true)?;
        Ok(Link {
            stream: Mutex::new(w),
        })
    }
}

/// Files what `peer`'s connection brings in this rank's mailbox; on rank 0 (`forward`
/// given), passes on what is meant for other ranks. When the connection closes, `peer` is
/// gone (rank 0 tells the others).
fn reader(
    stream: TcpStream,
    peer: usize,
    inbox: &Arc<Inbox>,
    forward: Option<Vec<Option<Arc<Link>>>>,
) {
    let inbox = inbox.clone();
    std::thread::spawn(move || {
        let mut r = std::io::BufReader::with_capacity(1 << 20, stream);
        while let Some((from, to, kind, payload)) = read_frame(&mut r) {
            // Rank 0 knows who sent what it reads: never trust a frame's `from` there.
            let from = if forward.is_some() { peer } else { from };
            if let Some(links) = &forward {
                let onward: Vec<usize> = match to {
                    EVERYONE => (1..links.len()).filter(|&q| q != from).collect(),
                    0 => Vec::new(),
                    q => vec![q as usize],
                };
                for q in onward {
                    if let Some(Some(l)) = links.get(q) {
                        let _ = l.send(from, to, kind, &payload);
                    }
                }
                if to != 0 && to != EVERYONE {
                    continue;
                }
            }
            match kind {
                DATA => match Message::decode(&payload) {
                    Some(m) => inbox.update(|s| {
                        if let Some(q) = s.queues.get_mut(from) {
                            q.push_back(m)
                        }
                    }),
                    None => inbox.fail(from, "it sent a malformed message".into()),
                },
                FAILED => {
                    let (failed, reason) = failure_of(&payload).unwrap_or((from, String::new()));
                    inbox.fail(failed, reason)
                }
                GONE => inbox.gone(from),
                _ => inbox.fail(from, "it sent a frame of an unknown kind".into()),
            }
        }
        inbox.gone(peer);
        if let Some(links) = &forward {
            for l in links.iter().skip(1).flatten() {
                let _ = l.send(peer, EVERYONE, GONE, &[]);
            }
        }
    });
}

fn gone_reason() -> String {
    "its connection closed: the process exited or was killed".into()
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        // Rank 0 relays the others' messages: it leaves only once each of them has left
        // (closed its connection), so none is left waiting for a message still to pass,
        // and waits at most the timeout for that.
        if self.rank == 0 {
            let deadline = Instant::now() + self.timeout;
            let mut s = lock(&self.inbox.state);
            while !s.gone.iter().skip(1).all(|&g| g) {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                s = self.inbox.wait(s, deadline - now);
            }
        }
        for l in self.links.iter().flatten() {
            let _ = lock(&l.stream).shutdown(Shutdown::Both);
        }
    }
}

impl Transport for TcpComm {
    fn this_rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn post(&mut self, to: usize, m: Message) {
        if to == self.rank {
            self.inbox.update(|s| s.queues[to].push_back(m));
            return;
        }
        let sent = match self.link_to(to) {
            Some(l) => l.send(self.rank, to as u32, DATA, &m.encode()),
            None => Ok(()),
        };
        if sent.is_err() {
            // Its connection is broken: it is gone (its reader sees the same soon).
            self.inbox.gone(if self.rank == 0 { to } else { 0 });
        }
    }

    fn take(
        &mut self,
        from: usize,
        op: &'static str,
        abortable: bool,
    ) -> Result<Message, CommError> {
        let wait = Wait::new(self.rank, from, op, self.timeout);
        let mut s = lock(&self.inbox.state);
        loop {
            if let Some(m) = s.queues[from].pop_front() {
                return Ok(m);
            }
            // Rank 0 relays every other rank: without it no message comes.
            let relay_gone = self.rank != 0 && from != 0 && s.gone[0];
            if s.gone[from] || relay_gone || (abortable && s.failure.is_some()) {
                let silent = if s.gone[from] { from } else { 0 };
                let failure = s.failure.clone().unwrap_or((silent, gone_reason()));
                return Err(wait.failed(failure));
            }
            s = self.inbox.wait(s, wait.left()?);
        }
    }

    fn unget(&mut self, from: usize, m: Message) {
        self.inbox.update(|s| s.queues[from].push_front(m));
    }

    fn failure(&mut self) -> Option<(usize, String)> {
        let s = lock(&self.inbox.state);
        let gone = s.gone.iter().position(|&g| g).map(|r| (r, gone_reason()));
        s.failure.clone().or(gone)
    }

    fn report_failure(&mut self, reason: &str) {
        // A rank that fails because another did passes the first failure on: told through
        // it, a third rank could hear of it before the first failure's own word (rank 0
        // relays both), and would name this rank.
        let (failed, reason) = self.failure().unwrap_or((self.rank, reason.to_string()));
        self.inbox.fail(failed, reason.clone());
        let mut payload = (failed as u32).to_le_bytes().to_vec();
        payload.extend(reason.as_bytes());
        for l in self.links.iter().flatten() {
            let _ = l.send(self.rank, EVERYONE, FAILED, &payload);
        }
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }

    fn traffic_mut(&mut self) -> &mut Traffic {
        &mut self.traffic
    }
}

#[path = "tcp_meet.rs"]
mod meet;
use meet::{accept_all, dial};

#[cfg(test)]
#[path = "tcp_tests.rs"]
mod tests;
