//! How emulated NCCL ranks meet and move data: through files in a folder named by the
//! 128-byte `ncclUniqueId` (`$TMPDIR/parallax-emulated-nccl/<id>/`), the same way for ranks
//! in one process (threads) and in several (local processes only, as the id names a local
//! folder). One transport for both keeps the in-process tests on the multi-process path.
//!
//! Files: `join-R` (rank R's pid, written at init), `left-R` (R destroyed or aborted its
//! communicator), `gone-R` (R aborted), `p-F-T-N` (the N-th point-to-point message from F
//! to T) and `c-N-F-T` (rank F's part of collective N, for T). Messages are written under a
//! temporary name and renamed, so a reader never sees half of one; a reader deletes what it
//! read. The last rank to leave removes the folder (a rank that died leaves it behind).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What the first 8 bytes of every id made here hold, so that a foreign id is refused.
const MAGIC: &[u8; 8] = b"PXNCCL\x01\x00";

/// How long a rank waits for a peer (to join, or for its data) before the communicator
/// reports `ncclTimeout`: `PARALLAX_EMULATED_NCCL_TIMEOUT` seconds, default 120. Real NCCL
/// waits forever; the runtime has its own, usually shorter, collective timeout.
pub fn timeout() -> Duration {
    let secs = std::env::var("PARALLAX_EMULATED_NCCL_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .unwrap_or(120.0);
    Duration::from_secs_f64(secs)
}

/// A fresh id: the magic, then 16 random bytes (the folder's name), then zeros.
pub fn new_id() -> [u8; 128] {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let mut id = [0u8; 128];
    id[..8].copy_from_slice(MAGIC);
    for half in 0..2 {
        // RandomState's keys are random per process; the pid, clock and a count make
        // two ids of one process, or of two processes, differ.
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u64(COUNT.fetch_add(1, Ordering::Relaxed));
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_usize(half);
        id[8 + 8 * half..16 + 8 * half].copy_from_slice(&h.finish().to_le_bytes());
    }
    id
}

/// The folder of the communicator with this id, or `None` for an id not made here.
pub fn folder(id: &[u8; 128]) -> Option<PathBuf> {
    if &id[..8] != MAGIC {
        return None;
    }
    let name: String = id[8..24].iter().map(|b| format!("{b:02x}")).collect();
    Some(
        std::env::temp_dir()
            .join("parallax-emulated-nccl")
            .join(name),
    )
}

/// Writes `bytes` as `dir/name`, all at once for readers.
pub fn put(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!("tmp-{}-{n}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, dir.join(name))
}

/// Reads and deletes `dir/name`, if it is there.
pub fn take(dir: &Path, name: &str) -> std::io::Result<Option<Vec<u8>>> {
    let path = dir.join(name);
    match std::fs::read(&path) {
        Ok(b) => {
            std::fs::remove_file(&path)?;
            Ok(Some(b))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Why a peer will never send: it aborted, destroyed its communicator, or its process is
/// gone (checked through /proc: the ranks are local).
pub fn peer_lost(dir: &Path, peer: usize) -> Option<String> {
    if dir.join(format!("gone-{peer}")).exists() {
        return Some(format!("rank {peer} aborted its communicator"));
    }
    if dir.join(format!("left-{peer}")).exists() {
        return Some(format!("rank {peer} destroyed its communicator"));
    }
    let pid: u32 = std::fs::read_to_string(dir.join(format!("join-{peer}")))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if pid == std::process::id() {
        return None;
    }
    // `/proc/PID/stat` is "pid (comm) S ...": a zombie (Z) has exited too.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"));
    let alive = stat.is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
    });
    (!alive).then(|| format!("rank {peer} (process {pid}) exited"))
}

/// Joins: writes this rank's pid.
pub fn join(dir: &Path, rank: usize) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    put(
        dir,
        &format!("join-{rank}"),
        std::process::id().to_string().as_bytes(),
    )
}

/// Whether every rank of `n` has joined.
pub fn all_joined(dir: &Path, n: usize) -> bool {
    (0..n).all(|r| dir.join(format!("join-{r}")).exists())
}

/// Leaves (after an abort, marked so): the last rank out removes the folder.
pub fn leave(dir: &Path, rank: usize, n: usize, aborted: bool) {
    if aborted {
        let _ = put(dir, &format!("gone-{rank}"), b"");
    }
    let _ = put(dir, &format!("left-{rank}"), b"");
    if (0..n).all(|r| dir.join(format!("left-{r}")).exists()) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A collective's description, sent ahead of each rank's part so that ranks issuing
/// different collectives (or counts, types, operators, roots) fail instead of mixing data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: u8,
    pub dtype: i32,
    pub op: i32,
    pub root: i32,
    pub count: u64,
}

impl Header {
    const LEN: usize = 21;

    pub fn encode(&self, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::LEN + payload.len());
        v.push(self.kind);
        v.extend_from_slice(&self.dtype.to_le_bytes());
        v.extend_from_slice(&self.op.to_le_bytes());
        v.extend_from_slice(&self.root.to_le_bytes());
        v.extend_from_slice(&self.count.to_le_bytes());
        v.extend_from_slice(payload);
        v
    }

    pub fn decode(b: &[u8]) -> Option<(Header, &[u8])> {
        if b.len() < Self::LEN {
            return None;
        }
        let i32_at = |i: usize| i32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let h = Header {
            kind: b[0],
            dtype: i32_at(1),
            op: i32_at(5),
            root: i32_at(9),
            count: u64::from_le_bytes(b[13..21].try_into().unwrap_or_default()),
        };
        Some((h, &b[Self::LEN..]))
    }
}

/// A rate limit for the slower checks of a wait (a peer's process).
pub struct Every {
    last: Option<Instant>,
    period: Duration,
}

impl Every {
    pub fn new(period: Duration) -> Every {
        Every { last: None, period }
    }

    pub fn due(&mut self) -> bool {
        if self.last.is_some_and(|t| t.elapsed() < self.period) {
            return false;
        }
        self.last = Some(Instant::now());
        true
    }
}
