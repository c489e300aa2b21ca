//! A fault-tolerant NCCL communicator over cudarc's raw layer (one rank per process).
//!
//! cudarc's safe `Comm` blocks in init, panics when an abort fails and cannot query async
//! errors, so a dead peer would hang training. This wrapper uses the non-blocking init and
//! polls `ncclCommGetAsyncError` (and the stream) against a deadline, aborting the
//! communicator on any error or timeout. Floats are never reduced by NCCL here: the project
//! sums partials in a fixed order itself, so only point-to-point and all-gather exist.

use crate::cuda::CudaError;
use cudarc::driver::sys as cu;
use cudarc::nccl::sys;
use std::ffi::{c_int, c_uint, c_void, CStr};
use std::time::{Duration, Instant};

/// Every buffer a communicator moves holds f32.
const F32: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;

/// Sleep between polls: short against collective times, long enough not to spin a core.
const POLL: Duration = Duration::from_micros(50);
/// `ncclCommGetAsyncError`, `ncclCommAbort` and the non-blocking init exist from NCCL 2.14.
const MIN_VERSION: i32 = 21400;

/// `NCCL_VERSION(X,Y,Z)` of nccl.h.
const fn nccl_version(x: u32, y: u32, z: u32) -> u32 {
    if x <= 2 && y <= 8 {
        x * 1000 + y * 100 + z
    } else {
        x * 10000 + y * 100 + z
    }
}

/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`): "let NCCL choose".
const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_API_MAGIC`.
const CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// cudarc's `nccl` feature binds NCCL 2.30's headers (`ncclConfig_v22800` with `maxP2pPeers`),
/// so the struct is announced as 2.30's; the struct is append-only and NCCL reads `size`.
const CONFIG_VERSION: c_uint = nccl_version(2, 30, 0);

/// `ncclConfig_t config = NCCL_CONFIG_INITIALIZER; config.blocking = 0;`
///
/// NVIDIA/nccl src/nccl.h.in (stored copy at 021e804, NCCL 2.31) defines the initializer as
/// `{ sizeof(ncclConfig_t), NCCL_API_MAGIC (0xcafebeef), NCCL_VERSION_CODE, then
/// NCCL_CONFIG_UNDEF_INT (INT_MIN) for every int field and NCCL_CONFIG_UNDEF_PTR (NULL) for
/// netName and commName }`; 2.31 appends fields after `maxP2pPeers` that 2.30's struct lacks.
fn nonblocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        // Non-blocking: init and group end return ncclInProgress instead of waiting forever.
        blocking: 0,
        cgaClusterSize: CONFIG_UNDEF_INT,
        minCTAs: CONFIG_UNDEF_INT,
        maxCTAs: CONFIG_UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: CONFIG_UNDEF_INT,
        trafficClass: CONFIG_UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: CONFIG_UNDEF_INT,
        CTAPolicy: CONFIG_UNDEF_INT,
        shrinkShare: CONFIG_UNDEF_INT,
        nvlsCTAs: CONFIG_UNDEF_INT,
        nChannelsPerNetPeer: CONFIG_UNDEF_INT,
        nvlinkCentricSched: CONFIG_UNDEF_INT,
        graphUsageMode: CONFIG_UNDEF_INT,
        numRmaCtx: CONFIG_UNDEF_INT,
        maxP2pPeers: CONFIG_UNDEF_INT,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NcclCommError {
    #[error("libnccl.so was not found: install NCCL (the nvidia-nccl wheel ships libnccl.so.2: link it as libnccl.so in a folder on LD_LIBRARY_PATH)")]
    MissingLibrary,
    #[error(
        "NCCL {found} is too old: the fault-tolerant communicator needs {MIN_VERSION} or newer"
    )]
    TooOld { found: i32 },
    #[error("NCCL: {0}")]
    Invalid(String),
    #[error("NCCL rank {rank} of {world} ranks: {what} failed: {name} ({code}): {text}; the communicator was aborted")]
    Failed {
        rank: usize,
        world: usize,
        what: String,
        code: u32,
        name: &'static str,
        text: String,
    },
    #[error("NCCL rank {rank} of {world} ranks: {what} did not finish within {timeout:?} (last NCCL state {name} ({code}): {text}); the communicator was aborted")]
    TimedOut {
        rank: usize,
        world: usize,
        what: String,
        timeout: Duration,
        code: u32,
        name: &'static str,
        text: String,
    },
    #[error("NCCL rank {rank} of {world} ranks: {what}: the CUDA stream reported {cuda}; the communicator was aborted")]
    Stream {
        rank: usize,
        world: usize,
        what: String,
        cuda: String,
    },
    #[error("NCCL rank {rank} of {world} ranks: {what} on a communicator aborted after an earlier error (create a new one)")]
    Aborted {
        rank: usize,
        world: usize,
        what: String,
    },
}

impl From<NcclCommError> for CudaError {
    fn from(e: NcclCommError) -> Self {
        match e {
            NcclCommError::MissingLibrary => CudaError::MissingLibrary {
                library: "libnccl.so",
                hint: "install NCCL (the nvidia-nccl wheel ships libnccl.so.2: link it as libnccl.so in a folder on LD_LIBRARY_PATH)",
            },
            e => CudaError::Nccl(e.to_string()),
        }
    }
}

/// The name of an NCCL result code, as in nccl.h.
pub fn code_name(r: sys::ncclResult_t) -> &'static str {
    use sys::ncclResult_t::*;
    match r {
        ncclSuccess => "ncclSuccess",
        ncclUnhandledCudaError => "ncclUnhandledCudaError",
        ncclSystemError => "ncclSystemError",
        ncclInternalError => "ncclInternalError",
        ncclInvalidArgument => "ncclInvalidArgument",
        ncclInvalidUsage => "ncclInvalidUsage",
        ncclRemoteError => "ncclRemoteError",
        ncclInProgress => "ncclInProgress",
        ncclTimeout => "ncclTimeout",
        ncclNumResults => "ncclNumResults",
    }
}

/// `ncclGetErrorString`; only called after a real NCCL call, so the library is loaded.
fn error_text(r: sys::ncclResult_t) -> String {
    // SAFETY: NCCL returns a static string (or null) for any result code.
    let p = unsafe { sys::ncclGetErrorString(r) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated and static.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Checks that libnccl can be opened and is new enough; cudarc panics on a missing library
/// or symbol, so this runs before any other NCCL call.
fn check_library() -> Result<(), NcclCommError> {
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(NcclCommError::MissingLibrary);
    }
    let found = cudarc::nccl::result::get_nccl_version().map_err(|e| NcclCommError::Failed {
        rank: 0,
        world: 0,
        what: "ncclGetVersion".into(),
        code: e.0 as u32,
        name: code_name(e.0),
        text: error_text(e.0),
    })?;
    if found < MIN_VERSION {
        return Err(NcclCommError::TooOld { found });
    }
    Ok(())
}

/// NCCL's 128-byte unique id: made by one rank, sent to all others over any CPU channel.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(sys::ncclUniqueId);

impl NcclId {
    /// `ncclGetUniqueId` (also starts NCCL's bootstrap listener in this process).
    pub fn new() -> Result<Self, NcclCommError> {
        check_library()?;
        cudarc::nccl::result::get_uniqueid()
            .map(NcclId)
            .map_err(|e| NcclCommError::Failed {
                rank: 0,
                world: 0,
                what: "ncclGetUniqueId".into(),
                code: e.0 as u32,
                name: code_name(e.0),
                text: error_text(e.0),
            })
    }

    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        NcclId(sys::ncclUniqueId {
            internal: bytes.map(|b| b as _),
        })
    }
}

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The id holds a socket address; the first bytes are enough to tell ids apart.
        write!(f, "NcclId({:02x?}..)", &self.to_bytes()[..8])
    }
}

/// One rank's communicator, bound to one CUDA stream. Every failure or timeout aborts it.
pub struct NcclComm {
    /// Null once aborted or destroyed.
    comm: sys::ncclComm_t,
    stream: cu::CUstream,
    rank: usize,
    world: usize,
    /// Operations issued since the last `wait`, for error messages.
    pending: Vec<String>,
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `world`, waiting at most `timeout` for every rank.
    /// The device must be current on this thread (`CudaContext::bind_to_thread`).
    ///
    /// # Safety
    /// `stream` must be a stream of the current device's context that outlives the
    /// communicator (null is the legacy default stream).
    pub unsafe fn init(
        id: &NcclId,
        rank: usize,
        world: usize,
        stream: cu::CUstream,
        timeout: Duration,
    ) -> Result<Self, NcclCommError> {
        if world == 0 || rank >= world || world > c_int::MAX as usize {
            return Err(NcclCommError::Invalid(format!(
                "rank {rank} does not fit a world of {world} ranks"
            )));
        }
        check_library()?;
        let mut config = nonblocking_config();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer and config; the id is passed by value.
        let r = unsafe {
            sys::ncclCommInitRankConfig(&mut comm, world as c_int, id.0, rank as c_int, &mut config)
        };
        let mut me = NcclComm {
            comm,
            stream,
            rank,
            world,
            pending: Vec::new(),
        };
        let what = "communicator init (waiting for every rank to join)";
        if !matches!(
            r,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        ) {
            return Err(me.fail(what, r));
        }
        if me.comm.is_null() {
            return Err(NcclCommError::Invalid(format!(
                "ncclCommInitRankConfig returned {} but no communicator",
                code_name(r)
            )));
        }
        me.poll(what, timeout, false)?;
        Ok(me)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// The stream the communicator's operations run on (work that must follow them, such as
    /// a kernel reading what was received, goes on the same one).
    pub fn stream(&self) -> cu::CUstream {
        self.stream
    }

    /// Whether an error or timeout aborted the communicator.
    pub fn is_aborted(&self) -> bool {
        self.comm.is_null()
    }

    /// `ncclGroupStart`: sends and receives up to `group_end` are issued together (a ring
    /// exchange of sends and receives deadlocks without it).
    pub fn group_start(&mut self) -> Result<(), NcclCommError> {
        self.live("group start")?;
        // SAFETY: no arguments.
        let r = unsafe { sys::ncclGroupStart() };
        self.issued("group start", r, false)
    }

    /// `ncclGroupEnd`; may return before the operations are on the stream (`wait` covers that).
    pub fn group_end(&mut self) -> Result<(), NcclCommError> {
        self.live("group end")?;
        // SAFETY: no arguments.
        let r = unsafe { sys::ncclGroupEnd() };
        self.issued("group end", r, false)
    }

    /// Sends `n` f32 at device address `ptr` to rank `peer`.
    ///
    /// # Safety
    /// `ptr` holds `n` f32 on this communicator's device until `wait` returns.
    pub unsafe fn send(&mut self, ptr: u64, n: usize, peer: usize) -> Result<(), NcclCommError> {
        let what = format!("send of {n} f32 to rank {peer}");
        // SAFETY: the caller vouches for the buffer; `point_to_point` passes a live comm
        // and stream.
        self.point_to_point(&what, peer, |peer, comm, stream| unsafe {
            sys::ncclSend(ptr as *const c_void, n, F32, peer, comm, stream)
        })
    }

    /// Receives `n` f32 from rank `peer` into device address `ptr`.
    ///
    /// # Safety
    /// `ptr` has room for `n` f32 on this communicator's device until `wait` returns.
    pub unsafe fn recv(&mut self, ptr: u64, n: usize, peer: usize) -> Result<(), NcclCommError> {
        let what = format!("recv of {n} f32 from rank {peer}");
        // SAFETY: as for `send`.
        self.point_to_point(&what, peer, |peer, comm, stream| unsafe {
            sys::ncclRecv(ptr as *mut c_void, n, F32, peer, comm, stream)
        })
    }

    /// Issues a send or receive (`call`, given the peer, the comm and the stream) after
    /// checking the peer.
    fn point_to_point(
        &mut self,
        what: &str,
        peer: usize,
        call: impl FnOnce(c_int, sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<(), NcclCommError> {
        self.check_peer(what, peer)?;
        let r = call(peer as c_int, self.comm, self.nccl_stream());
        self.issued(what, r, true)
    }

    /// All-gather: `n` f32 from every rank at `send` land in rank order at `recv`
    /// (`world * n` values). A copy, so bitwise the same on every rank.
    ///
    /// # Safety
    /// `send` holds `n` f32 and `recv` has room for `world * n` f32 until `wait` returns.
    pub unsafe fn all_gather(
        &mut self,
        send: u64,
        recv: u64,
        n: usize,
    ) -> Result<(), NcclCommError> {
        let what = format!("all_gather of {n} f32 per rank");
        self.live(&what)?;
        // SAFETY: as for `send`.
        let r = unsafe {
            sys::ncclAllGather(
                send as *const c_void,
                recv as *mut c_void,
                n,
                F32,
                self.comm,
                self.nccl_stream(),
            )
        };
        self.issued(&what, r, true)
    }

    /// Waits at most `timeout` for everything issued since the last wait: polls NCCL's async
    /// error and the stream together; aborts the communicator on an error or the deadline.
    pub fn wait(&mut self, timeout: Duration) -> Result<(), NcclCommError> {
        let what = if self.pending.is_empty() {
            "wait with nothing issued".to_string()
        } else {
            self.pending.join(", ")
        };
        self.live(&what)?;
        self.poll(&what, timeout, true)?;
        self.pending.clear();
        Ok(())
    }

    fn nccl_stream(&self) -> sys::cudaStream_t {
        self.stream as sys::cudaStream_t
    }

    fn live(&self, what: &str) -> Result<(), NcclCommError> {
        if self.comm.is_null() {
            return Err(NcclCommError::Aborted {
                rank: self.rank,
                world: self.world,
                what: what.to_string(),
            });
        }
        Ok(())
    }

    fn check_peer(&self, what: &str, peer: usize) -> Result<(), NcclCommError> {
        self.live(what)?;
        if peer >= self.world {
            return Err(NcclCommError::Invalid(format!(
                "rank {} of {}: {what}: no such peer",
                self.rank, self.world
            )));
        }
        Ok(())
    }

    /// After issuing: ncclInProgress is normal for a non-blocking communicator.
    fn issued(
        &mut self,
        what: &str,
        r: sys::ncclResult_t,
        record: bool,
    ) -> Result<(), NcclCommError> {
        match r {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => {
                if record {
                    self.pending.push(what.to_string());
                }
                Ok(())
            }
            r => Err(self.fail(what, r)),
        }
    }

    /// Polls until NCCL reports success (and, with `stream`, the stream is idle), an error,
    /// or the deadline.
    fn poll(&mut self, what: &str, timeout: Duration, stream: bool) -> Result<(), NcclCommError> {
        let start = Instant::now();
        loop {
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: live communicator (checked by the callers), valid out-pointer.
            let r = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            if r != sys::ncclResult_t::ncclSuccess {
                return Err(self.fail(what, r));
            }
            match state {
                // Only once NCCL says success are the operations on the stream: querying it
                // earlier could report an idle stream before the work was enqueued.
                sys::ncclResult_t::ncclSuccess if !stream => return Ok(()),
                sys::ncclResult_t::ncclSuccess => {
                    // SAFETY: the stream outlives the communicator (contract of `init`).
                    match unsafe { cu::cuStreamQuery(self.stream) } {
                        cu::CUresult::CUDA_SUCCESS => return Ok(()),
                        cu::CUresult::CUDA_ERROR_NOT_READY => {}
                        e => {
                            self.abort();
                            return Err(NcclCommError::Stream {
                                rank: self.rank,
                                world: self.world,
                                what: what.to_string(),
                                cuda: format!("{e:?}"),
                            });
                        }
                    }
                }
                sys::ncclResult_t::ncclInProgress => {}
                e => return Err(self.fail(what, e)),
            }
            if start.elapsed() >= timeout {
                let text = error_text(state);
                self.abort();
                return Err(NcclCommError::TimedOut {
                    rank: self.rank,
                    world: self.world,
                    what: what.to_string(),
                    timeout,
                    code: state as u32,
                    name: code_name(state),
                    text,
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// NCCL's text for `r`, with `ncclGetLastError`'s detail (which peer, which operation)
    /// when it has one; read before an abort can replace it.
    fn detailed_text(&self, r: sys::ncclResult_t) -> String {
        let text = error_text(r);
        // SAFETY: NCCL returns a NUL-terminated string it owns (or null); the comm is live or
        // null, which ncclGetLastError accepts.
        let last = unsafe { sys::ncclGetLastError(self.comm) };
        if last.is_null() {
            return text;
        }
        // SAFETY: non-null and NUL-terminated.
        let last = unsafe { CStr::from_ptr(last) }.to_string_lossy();
        match last.trim() {
            "" => text,
            detail => format!("{text} ({detail})"),
        }
    }

    /// Aborts and describes a failure.
    fn fail(&mut self, what: &str, r: sys::ncclResult_t) -> NcclCommError {
        let text = self.detailed_text(r);
        self.abort();
        NcclCommError::Failed {
            rank: self.rank,
            world: self.world,
            what: what.to_string(),
            code: r as u32,
            name: code_name(r),
            text,
        }
    }

    /// `ncclCommAbort` once; its own failure is ignored (nothing better can be done).
    fn abort(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: live communicator, nulled right after so it is never used again.
            let _ = unsafe { sys::ncclCommAbort(self.comm) };
            self.comm = std::ptr::null_mut();
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return;
        }
        if self.pending.is_empty() {
            // SAFETY: live communicator, no work outstanding.
            let _ = unsafe { sys::ncclCommDestroy(self.comm) };
            self.comm = std::ptr::null_mut();
        } else {
            // Work was issued but never waited for: destroying could block on a dead peer.
            self.abort();
        }
    }
}

#[cfg(test)]
#[path = "comm_tests.rs"]
mod tests;
