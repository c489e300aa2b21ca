//! NCCL's C entry points (nccl.h, NCCL 2.30's API as cudarc binds it) over `nccl_state`:
//! the version and unique id, communicators (blocking, or non-blocking through
//! `ncclConfig_t.blocking = 0` with `ncclCommGetAsyncError` reporting progress), groups,
//! point-to-point and the collectives. Enum arguments are taken as C ints, so that a bad
//! value is an error, never an invalid Rust enum.

use crate::nccl_reduce as reduce;
use crate::nccl_state::{self as st, failure, Coll, Issued, Item, NResult};
use crate::nccl_wire as wire;
use crate::state::{guarded, state};
use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclResult_t as R, ncclUniqueId};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void};

/// The NCCL release emulated: 2.30.0 (`NCCL_VERSION(2,30,0)`), the headers cudarc binds.
pub const VERSION: c_int = 23000;

/// Runs an entry point's body: its result, or `ncclInternalError` if it panicked.
fn nguard(name: &str, f: impl FnOnce() -> NResult<R>) -> R {
    guarded(name, R::ncclInternalError, || f().map_err(|e| e.code))
}

fn arg(text: impl Into<String>) -> st::Failure {
    failure(R::ncclInvalidArgument, text)
}

/// # Safety
/// `p` is null or valid for a write of `T`.
unsafe fn out<T>(p: *mut T, v: T) -> NResult<R> {
    if p.is_null() {
        return Err(arg("a null out-pointer"));
    }
    p.write(v);
    Ok(R::ncclSuccess)
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> R {
    nguard("ncclGetVersion", || out(version, VERSION))
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclGetUniqueId(id: *mut ncclUniqueId) -> R {
    nguard("ncclGetUniqueId", || {
        let bytes = wire::new_id();
        out(
            id,
            ncclUniqueId {
                internal: bytes.map(|b| b as c_char),
            },
        )
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclGetErrorString(result: c_int) -> *const c_char {
    // nccl.h's texts, without the NCCL_DEBUG hints.
    let s = match result {
        0 => c"no error",
        1 => c"unhandled cuda error",
        2 => c"unhandled system error",
        3 => c"internal error",
        4 => c"invalid argument",
        5 => c"invalid usage",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        8 => c"NCCL operation timed out",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclGetLastError(_comm: ncclComm_t) -> *const c_char {
    st::last_error()
}

/// The calling thread's current device (NCCL binds a communicator to it); device 0 when no
/// context is current, as the runtime API would pick.
fn current_device() -> i32 {
    let mut s = state();
    s.init();
    s.current().map_or(0, |d| d as i32)
}

fn id_folder(id: &ncclUniqueId) -> NResult<std::path::PathBuf> {
    wire::folder(&id.internal.map(|c| c as u8))
        .ok_or_else(|| arg("the unique id was not made by this library's ncclGetUniqueId"))
}

/// Creates one rank's communicator and waits for the others when `blocking`.
unsafe fn init_rank(
    comm: *mut ncclComm_t,
    n: c_int,
    id: &ncclUniqueId,
    rank: c_int,
    blocking: bool,
) -> NResult<R> {
    if comm.is_null() {
        return Err(arg("a null communicator pointer"));
    }
    if n < 1 || rank < 0 || rank >= n {
        return Err(arg(format!("rank {rank} of {n} ranks")));
    }
    let dir = id_folder(id)?;
    let c = st::Comm::new(dir, rank as usize, n as usize, current_device(), blocking)?;
    let h = st::register(c);
    comm.write(h as ncclComm_t);
    let c = st::get(h)?;
    let r = if blocking {
        st::wait(&c)
    } else {
        st::lock(&c).progress()
    };
    Ok(r)
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
) -> R {
    nguard("ncclCommInitRank", || {
        init_rank(comm, nranks, &id, rank, true)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> R {
    nguard("ncclCommInitRankConfig", || {
        // Only the header fields every version of the struct has are read; `blocking`
        // left at NCCL_CONFIG_UNDEF_INT means NCCL's default, blocking.
        let blocking = if config.is_null() {
            true
        } else {
            let c = &*config;
            if c.magic != 0xcafe_beef {
                return Err(arg(
                    "ncclConfig_t without NCCL_API_MAGIC (use NCCL_CONFIG_INITIALIZER)",
                ));
            }
            c.blocking != 0
        };
        init_rank(comm, nranks, &id, rank, blocking)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclCommInitAll(
    comms: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> R {
    nguard("ncclCommInitAll", || {
        if comms.is_null() || ndev < 1 {
            return Err(arg(format!("{ndev} devices")));
        }
        let dir = id_folder(&ncclUniqueId {
            internal: wire::new_id().map(|b| b as c_char),
        })?;
        for r in 0..ndev as usize {
            // "If devlist is NULL, the first ndev CUDA devices are used."
            let device = if devlist.is_null() {
                r as c_int
            } else {
                *devlist.add(r)
            };
            let c = st::Comm::new(dir.clone(), r, ndev as usize, device, true)?;
            comms.add(r).write(st::register(c) as ncclComm_t);
        }
        // Every rank has joined: this makes each see so.
        for r in 0..ndev as usize {
            let c = st::get(*comms.add(r) as usize)?;
            st::lock(&c).progress();
        }
        Ok(R::ncclSuccess)
    })
}

fn leave(comm: ncclComm_t, aborted: bool) -> NResult<R> {
    let c = st::remove(comm as usize)?;
    let c = st::lock(&c);
    wire::leave(&c.dir, c.rank, c.n, aborted);
    Ok(R::ncclSuccess)
}

#[no_mangle]
pub(crate) extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> R {
    nguard("ncclCommDestroy", || leave(comm, false))
}

#[no_mangle]
pub(crate) extern "C" fn ncclCommAbort(comm: ncclComm_t) -> R {
    nguard("ncclCommAbort", || leave(comm, true))
}

#[no_mangle]
pub(crate) extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> R {
    // Operations complete as they arrive; there is nothing to flush.
    nguard("ncclCommFinalize", || {
        st::get(comm as usize).map(|_| R::ncclSuccess)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclCommGetAsyncError(comm: ncclComm_t, error: *mut R) -> R {
    nguard("ncclCommGetAsyncError", || {
        let c = st::get(comm as usize)?;
        let r = st::lock(&c).progress();
        out(error, r)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> R {
    nguard("ncclCommCount", || {
        let n = st::lock(&st::get(comm as usize)?).n;
        out(count, n as c_int)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> R {
    nguard("ncclCommCuDevice", || {
        let d = st::lock(&st::get(comm as usize)?).device;
        out(device, d)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> R {
    nguard("ncclCommUserRank", || {
        let r = st::lock(&st::get(comm as usize)?).rank;
        out(rank, r as c_int)
    })
}

thread_local! {
    /// The calling thread's group: its nesting depth and the operations issued in it.
    static GROUP: RefCell<(u32, Vec<Issued>)> = const { RefCell::new((0, Vec::new())) };
}

#[no_mangle]
pub(crate) extern "C" fn ncclGroupStart() -> R {
    nguard("ncclGroupStart", || {
        GROUP.with(|g| g.borrow_mut().0 += 1);
        Ok(R::ncclSuccess)
    })
}

#[no_mangle]
pub(crate) extern "C" fn ncclGroupEnd() -> R {
    nguard("ncclGroupEnd", || {
        let items = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            match g.0 {
                0 => None,
                1 => {
                    g.0 = 0;
                    Some(std::mem::take(&mut g.1))
                }
                _ => {
                    g.0 -= 1;
                    Some(Vec::new())
                }
            }
        });
        match items {
            None => Err(failure(
                R::ncclInvalidUsage,
                "ncclGroupEnd without ncclGroupStart",
            )),
            Some(items) if items.is_empty() => Ok(R::ncclSuccess),
            Some(items) => st::launch(items),
        }
    })
}

/// Checks an operation's arguments as NCCL does when it is called, then adds it to the
/// thread's group, or runs it as a group of its own.
fn issue(comm: ncclComm_t, stream: *mut c_void, item: Item) -> NResult<R> {
    let c = st::get(comm as usize)?;
    let n = {
        let g = st::lock(&c);
        if let Some(e) = &g.error {
            return Err(e.clone());
        }
        g.n
    };
    match &item {
        Item::Send { peer, .. } | Item::Recv { peer, .. } if *peer >= n => {
            return Err(arg(format!("peer {peer} of {n} ranks")));
        }
        Item::Coll(c) if matches!(c.kind, st::BROADCAST | st::REDUCE) && c.root as usize >= n => {
            return Err(arg(format!("root {} of {n} ranks", c.root)));
        }
        Item::Coll(c) if matches!(c.kind, st::ALL_REDUCE | st::REDUCE_SCATTER | st::REDUCE) => {
            reduce::check(c.dtype, c.op).map_err(arg)?;
        }
        _ => {}
    }
    let it = Issued {
        comm: comm as usize,
        stream: stream as usize,
        item,
    };
    let alone = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.0 == 0 {
            return Some(it);
        }
        g.1.push(it);
        None
    });
    match alone {
        Some(it) => st::launch(vec![it]),
        None => Ok(R::ncclSuccess),
    }
}

/// Bytes of `count` elements of `dtype`, or the argument error.
fn bytes(count: usize, dtype: c_int, buf: *const c_void) -> NResult<usize> {
    let size = reduce::size_of(dtype).ok_or_else(|| arg(format!("data type {dtype}")))?;
    if buf.is_null() && count > 0 {
        return Err(arg("a null buffer"));
    }
    count
        .checked_mul(size)
        .ok_or_else(|| arg(format!("{count} elements")))
}

fn peer(p: c_int) -> NResult<usize> {
    usize::try_from(p).map_err(|_| arg(format!("peer {p}")))
}

#[no_mangle]
pub(crate) extern "C" fn ncclSend(
    buf: *const c_void,
    count: usize,
    dtype: c_int,
    to: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> R {
    nguard("ncclSend", || {
        let item = Item::Send {
            peer: peer(to)?,
            src: buf as u64,
            bytes: bytes(count, dtype, buf)?,
        };
        issue(comm, stream, item)
    })
}

#[no_mangle]
pub(crate) extern "C" fn ncclRecv(
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    from: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> R {
    nguard("ncclRecv", || {
        let item = Item::Recv {
            peer: peer(from)?,
            dst: buf as u64,
            bytes: bytes(count, dtype, buf)?,
        };
        issue(comm, stream, item)
    })
}

/// A collective's entry: checks the buffers and issues it.
#[allow(clippy::too_many_arguments)]
fn collective(
    kind: u8,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> NResult<R> {
    // A broadcast's send buffer is read on the root only, a reduce's receive buffer is
    // written on the root only: null elsewhere is allowed.
    bytes(
        count,
        dtype,
        std::ptr::NonNull::<c_void>::dangling().as_ptr(),
    )?;
    let null = |p: *const c_void, may: bool| p.is_null() && count > 0 && !may;
    if null(send, kind == st::BROADCAST) || null(recv, kind == st::REDUCE) {
        return Err(arg("a null buffer"));
    }
    if root < 0 {
        return Err(arg(format!("root {root}")));
    }
    let coll = Coll {
        kind,
        send: send as u64,
        recv: recv as u64,
        count,
        dtype,
        op,
        root,
    };
    issue(comm, stream, Item::Coll(coll))
}

#[no_mangle]
pub(crate) extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> R {
    nguard("ncclAllGather", || {
        collective(st::ALL_GATHER, send, recv, count, dtype, 0, 0, comm, stream)
    })
}

#[no_mangle]
pub(crate) extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> R {
    nguard("ncclAllReduce", || {
        collective(
            st::ALL_REDUCE,
            send,
            recv,
            count,
            dtype,
            op,
            0,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub(crate) extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    recvcount: usize,
    dtype: c_int,
    op: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> R {
    nguard("ncclReduceScatter", || {
        collective(
            st::REDUCE_SCATTER,
            send,
            recv,
            recvcount,
            dtype,
            op,
            0,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub(crate) extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> R {
    nguard("ncclBroadcast", || {
        collective(
            st::BROADCAST,
            send,
            recv,
            count,
            dtype,
            0,
            root,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub(crate) extern "C" fn ncclBcast(
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> R {
    ncclBroadcast(buf, buf, count, dtype, root, comm, stream)
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub(crate) extern "C" fn ncclReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: *mut c_void,
) -> R {
    nguard("ncclReduce", || {
        collective(st::REDUCE, send, recv, count, dtype, op, root, comm, stream)
    })
}
