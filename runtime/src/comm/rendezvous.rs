//! How the ranks of a job come to hold the same NCCL id (128 bytes, made by one rank) before
//! `NcclComm::init`: over a communicator the job already has (MPI under `mpirun`), or, for
//! torchrun-style launches without MPI, by a small TCP exchange at `MASTER_ADDR:MASTER_PORT`.
//!
//! The TCP exchange never hangs: rank 0 waits for every other rank until a deadline and then
//! names the ranks that never came; a rank that cannot reach rank 0 by its deadline names the
//! address; every connect, accept, read and write has a timeout. Each rank says its rank,
//! the world size and a job token (the caller's, e.g. the experiment's fingerprint line), so
//! that two jobs started on one port fail, both sides saying why, instead of merging.

use crate::comm::world::World;
use crate::comm::{CommError, Communicator};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// An NCCL unique id's size (`NCCL_UNIQUE_ID_BYTES`).
pub const ID_BYTES: usize = 128;

/// The first bytes of a rank's hello: the protocol and its version.
const MAGIC: &[u8; 5] = b"PXID1";
/// The longest token or refusal accepted (a fingerprint line is far shorter).
const MAX_TEXT: usize = 4096;
/// How long rank 0 gives a connection to say hello (bounded by the deadline too), so that a
/// stray client cannot hold it.
const HELLO_WAIT: Duration = Duration::from_secs(5);
/// Pause between polls of the listener, and between connection attempts.
const POLL: Duration = Duration::from_millis(20);

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rendezvous: rank {rank} is to share the NCCL id but has none")]
    NoId { rank: usize },
    #[error("rendezvous: rank {rank} got {words} words from rank {root}, not an NCCL id of {ID_BYTES} bytes (rank {root} had none to share?)")]
    Garbled {
        rank: usize,
        root: usize,
        words: usize,
    },
    #[error("rendezvous: rank {rank}: the root {root} is not a rank of the world of {size}")]
    NoRoot {
        rank: usize,
        root: usize,
        size: usize,
    },
    #[error("rendezvous: {0}")]
    Comm(#[from] CommError),
    #[error("rendezvous: a world of {size} ranks needs MASTER_ADDR and MASTER_PORT (rank 0's address) to exchange the NCCL id")]
    NoMaster { size: usize },
    #[error("rendezvous: rank 0 could not listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rendezvous: rank 0 waited {waited:?} at {addr} for a world of {world}; rank(s) {missing:?} never came")]
    Missing {
        addr: String,
        world: usize,
        missing: Vec<usize>,
        waited: Duration,
    },
    #[error("rendezvous: rank {rank} could not reach rank 0 at {addr} within {waited:?} (last error: {last})")]
    Unreachable {
        rank: usize,
        addr: String,
        waited: Duration,
        last: String,
    },
    #[error("rendezvous: rank 0 at {addr} refused rank {rank}: {reason}")]
    Refused {
        rank: usize,
        addr: String,
        reason: String,
    },
    #[error("rendezvous at {addr}: {refusal}")]
    Refusing { addr: String, refusal: String },
    #[error("rendezvous: rank {rank} at {addr}: {what}: {source}")]
    Io {
        rank: usize,
        addr: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Root `root`'s id on every rank of `comm`'s world, through `Communicator::broadcast`
/// (its timeout bounds the wait). The root passes `Some(id)`; the others `None`. A root
/// without an id broadcasts nothing, so the others fail at once rather than time out.
pub fn share_id(
    comm: &mut dyn Communicator,
    root: usize,
    id: Option<[u8; ID_BYTES]>,
) -> Result<[u8; ID_BYTES], RendezvousError> {
    let (rank, size) = (comm.rank(), comm.size());
    if root >= size {
        return Err(RendezvousError::NoRoot { rank, root, size });
    }
    // One byte to a word: exact on every transport, whatever it does to a float's bits.
    let mut words: Vec<f32> = match (rank == root, id) {
        (true, Some(id)) => id.iter().map(|&b| f32::from(b)).collect(),
        _ => Vec::new(),
    };
    let world: Vec<usize> = (0..size).collect();
    comm.broadcast(&world, root, &mut words)?;
    if rank == root {
        return id.ok_or(RendezvousError::NoId { rank });
    }
    let garbled = RendezvousError::Garbled {
        rank,
        root,
        words: words.len(),
    };
    if words.len() != ID_BYTES
        || words
            .iter()
            .any(|w| !(0.0..=255.0).contains(w) || w.fract() != 0.0)
    {
        return Err(garbled);
    }
    Ok(std::array::from_fn(|i| words[i] as u8))
}

/// Rank 0's id on every rank of a torchrun-style world (`World::master` is
/// `MASTER_ADDR:MASTER_PORT`): rank 0 listens on that port of every interface (as
/// torchrun's store does) and hands `id` to each rank once all have come; the others connect. Every rank
/// gives up after `timeout`.
pub fn share_id_tcp(
    world: &World,
    token: &str,
    id: Option<[u8; ID_BYTES]>,
    timeout: Duration,
) -> Result<[u8; ID_BYTES], RendezvousError> {
    let rank = world.rank;
    if world.size <= 1 {
        return id.ok_or(RendezvousError::NoId { rank });
    }
    let (host, port) = world
        .master
        .clone()
        .ok_or(RendezvousError::NoMaster { size: world.size })?;
    if rank != 0 {
        return fetch_id(&host, port, rank, world.size, token, timeout);
    }
    let id = id.ok_or(RendezvousError::NoId { rank })?;
    // Both IPv6 and IPv4 where the host has IPv6 (a dual-stack socket), else IPv4.
    let listener = TcpListener::bind(("::", port))
        .or_else(|_| TcpListener::bind(("0.0.0.0", port)))
        .map_err(|source| RendezvousError::Listen {
            addr: format!("port {port} of every interface"),
            source,
        })?;
    serve_id(listener, world.size, token, id, timeout)?;
    Ok(id)
}

/// Rank 0's side: waits on `listener` (bound already, so a test can bind port 0) for ranks
/// `1..world` to say hello with `token`, then sends each `id`. Refuses, and fails, on a
/// wrong token or world size, a rank outside the world, or a rank that comes twice; the
/// ranks already waiting are told why. Fails naming the missing ranks after `timeout`.
pub fn serve_id(
    listener: TcpListener,
    world: usize,
    token: &str,
    id: [u8; ID_BYTES],
    timeout: Duration,
) -> Result<(), RendezvousError> {
    let deadline = Instant::now() + timeout;
    let addr = listener
        .local_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    let io = |what, source| RendezvousError::Io {
        rank: 0,
        addr: addr.clone(),
        what,
        source,
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| io("making the listener non-blocking", e))?;
    let mut arrived: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    while let Some(missing) = missing_ranks(&arrived) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let refusal = format!("rank(s) {missing:?} never came");
            refuse_all(&mut arrived, &refusal, deadline);
            return Err(RendezvousError::Missing {
                addr,
                world,
                missing,
                waited: timeout,
            });
        }
        let (mut stream, peer) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(POLL.min(left));
                continue;
            }
            Err(e) => return Err(io("accepting a rank", e)),
        };
        // A connection that says nothing sensible (not a rank of ours) is dropped.
        let Ok(hello) = read_hello(&mut stream, left.min(HELLO_WAIT)) else {
            continue;
        };
        let refusal = if hello.token != token {
            Some(format!(
                "rank {} from {peer} runs job {:?}, rank 0 runs {token:?} (two jobs on one address?)",
                hello.rank, hello.token
            ))
        } else if hello.world != world {
            Some(format!(
                "rank {} from {peer} says a world of {}, rank 0 a world of {world}",
                hello.rank, hello.world
            ))
        } else if hello.rank == 0 || hello.rank >= world {
            Some(format!(
                "{peer} claims rank {}, not one of ranks 1..{world}",
                hello.rank
            ))
        } else if arrived[hello.rank].is_some() {
            Some(format!(
                "{peer} claims rank {}, which another process already holds (a duplicate rank)",
                hello.rank
            ))
        } else {
            None
        };
        if let Some(refusal) = refusal {
            let _ = write_reply(&mut stream, Err(&refusal), deadline);
            refuse_all(&mut arrived, &refusal, deadline);
            return Err(RendezvousError::Refusing { addr, refusal });
        }
        arrived[hello.rank] = Some(stream);
    }
    for (rank, stream) in arrived.iter_mut().enumerate() {
        if let Some(s) = stream {
            write_reply(s, Ok(&id), deadline).map_err(|source| RendezvousError::Io {
                rank,
                addr: addr.clone(),
                what: "sending the NCCL id",
                source,
            })?;
        }
    }
    Ok(())
}

/// Rank `rank`'s side: connects to rank 0 at `host:port` (retrying until it listens), says
/// hello and receives the id, all within `timeout`.
pub fn fetch_id(
    host: &str,
    port: u16,
    rank: usize,
    world: usize,
    token: &str,
    timeout: Duration,
) -> Result<[u8; ID_BYTES], RendezvousError> {
    let start = Instant::now();
    let deadline = start + timeout;
    let addr = match host.contains(':') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    };
    let mut last = "no attempt".to_string();
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(RendezvousError::Unreachable {
                rank,
                addr,
                waited: start.elapsed(),
                last,
            });
        }
        match connect(host, port, left) {
            Ok(s) => break s,
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(POLL.min(deadline.saturating_duration_since(Instant::now())));
    };
    let io = |what, source| RendezvousError::Io {
        rank,
        addr: addr.clone(),
        what,
        source,
    };
    let mut hello = Vec::with_capacity(MAGIC.len() + 12 + token.len());
    hello.extend_from_slice(MAGIC);
    for n in [rank, world, token.len()] {
        hello.extend_from_slice(&(n as u32).to_le_bytes());
    }
    hello.extend_from_slice(token.as_bytes());
    timeouts(&stream, deadline).map_err(|e| io("setting timeouts", e))?;
    stream
        .write_all(&hello)
        .map_err(|e| io("saying hello to rank 0", e))?;
    // Rank 0 answers once every rank has come: up to the deadline.
    let what = "waiting for rank 0 to send the NCCL id (not every rank came, or rank 0 failed)";
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).map_err(|e| io(what, e))?;
    if status[0] != 0 {
        let reason = read_text(&mut stream).map_err(|e| io("reading rank 0's refusal", e))?;
        return Err(RendezvousError::Refused { rank, addr, reason });
    }
    let mut id = [0u8; ID_BYTES];
    stream.read_exact(&mut id).map_err(|e| io(what, e))?;
    Ok(id)
}

struct Hello {
    rank: usize,
    world: usize,
    token: String,
}

fn missing_ranks(arrived: &[Option<TcpStream>]) -> Option<Vec<usize>> {
    let missing: Vec<usize> = (1..arrived.len())
        .filter(|&r| arrived[r].is_none())
        .collect();
    (!missing.is_empty()).then_some(missing)
}

/// Tells every waiting rank why the rendezvous failed (best effort: it is failing anyway).
fn refuse_all(arrived: &mut [Option<TcpStream>], refusal: &str, deadline: Instant) {
    for s in arrived.iter_mut().flatten() {
        let _ = write_reply(s, Err(refusal), deadline);
    }
}

fn connect(host: &str, port: u16, left: Duration) -> std::io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs()?.collect();
    let mut last = std::io::Error::new(ErrorKind::NotFound, "the name resolved to no address");
    for a in addrs {
        // At most a second per attempt, so a dropped SYN is retried before the deadline.
        match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(1))) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Read and write timeouts up to `deadline` (a zero timeout would mean none: at least 1 ms).
fn timeouts(s: &TcpStream, deadline: Instant) -> std::io::Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))
}

fn read_hello(s: &mut TcpStream, wait: Duration) -> std::io::Result<Hello> {
    s.set_nonblocking(false)?;
    timeouts(s, Instant::now() + wait)?;
    let mut magic = [0u8; MAGIC.len()];
    s.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "not a rank's hello",
        ));
    }
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    let rank = u32::from_le_bytes(n) as usize;
    s.read_exact(&mut n)?;
    let world = u32::from_le_bytes(n) as usize;
    let token = read_text(s)?;
    Ok(Hello { rank, world, token })
}

/// A u32 length, then that many bytes of UTF-8 (lossy), at most `MAX_TEXT`.
fn read_text(s: &mut TcpStream) -> std::io::Result<String> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    let len = u32::from_le_bytes(n) as usize;
    if len > MAX_TEXT {
        return Err(std::io::Error::new(ErrorKind::InvalidData, "text too long"));
    }
    let mut text = vec![0u8; len];
    s.read_exact(&mut text)?;
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// Status 0 and the id, or status 1 and the refusal.
fn write_reply(
    s: &mut TcpStream,
    reply: Result<&[u8; ID_BYTES], &str>,
    deadline: Instant,
) -> std::io::Result<()> {
    timeouts(s, deadline.max(Instant::now() + Duration::from_millis(200)))?;
    let mut out = Vec::new();
    match reply {
        Ok(id) => {
            out.push(0);
            out.extend_from_slice(id);
        }
        Err(refusal) => {
            let text = &refusal.as_bytes()[..refusal.len().min(MAX_TEXT)];
            out.push(1);
            out.extend_from_slice(&(text.len() as u32).to_le_bytes());
            out.extend_from_slice(text);
        }
    }
    s.write_all(&out)?;
    s.flush()
}

#[cfg(test)]
#[path = "rendezvous_tests.rs"]
mod tests;
