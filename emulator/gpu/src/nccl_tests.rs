//! NCCL's entry points called as C would call them, with every rank on the test's thread
//! (operations that wait are issued non-blocking, or all in one group). Calls stay in
//! `unsafe` blocks as a C caller's would, whether or not the Rust signature needs it.
#![allow(unused_unsafe)]

use crate::memory::*;
use crate::nccl::*;
use crate::nccl_state as st;
use crate::stream::*;
use crate::tests::{alloc_f32, ok, read_f32, setup, teardown};
use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclResult_t as N, ncclUniqueId};
use std::ffi::{c_int, c_void, CStr};
use std::time::{Duration, Instant};

const F32: c_int = 7;
const SUM: c_int = 0;

fn id() -> ncclUniqueId {
    let mut id = ncclUniqueId { internal: [0; 128] };
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, N::ncclSuccess);
    id
}

fn config(blocking: c_int) -> ncclConfig_t {
    let mut c: ncclConfig_t = unsafe { std::mem::zeroed() };
    c.size = std::mem::size_of::<ncclConfig_t>();
    c.magic = 0xcafe_beef;
    c.version = 23000;
    c.blocking = blocking;
    c
}

/// `n` non-blocking ranks of one communicator, joined.
fn ranks(n: usize) -> Vec<ncclComm_t> {
    let id = id();
    let comms: Vec<ncclComm_t> = (0..n)
        .map(|r| {
            let mut c = std::ptr::null_mut();
            let mut cfg = config(0);
            let got =
                unsafe { ncclCommInitRankConfig(&mut c, n as c_int, id, r as c_int, &mut cfg) };
            // The last rank completes the rendezvous; the others are still in progress.
            let want = if r + 1 < n {
                N::ncclInProgress
            } else {
                N::ncclSuccess
            };
            assert_eq!(got, want, "rank {r}");
            c
        })
        .collect();
    for &c in &comms {
        assert_eq!(state(c), N::ncclSuccess);
    }
    comms
}

fn state(c: ncclComm_t) -> N {
    let mut s = N::ncclInternalError;
    assert_eq!(unsafe { ncclCommGetAsyncError(c, &mut s) }, N::ncclSuccess);
    s
}

/// Polls until the communicator leaves `ncclInProgress` (at most 10 s).
fn settle(c: ncclComm_t) -> N {
    let start = Instant::now();
    loop {
        match state(c) {
            N::ncclInProgress if start.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(1))
            }
            s => return s,
        }
    }
}

fn last_error() -> String {
    let p = unsafe { ncclGetLastError(std::ptr::null_mut()) };
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn stream() -> usize {
    let mut s = std::ptr::null_mut();
    unsafe { ok(cuStreamCreate(&mut s, 0)) };
    s as usize
}

fn sync(s: usize) {
    ok(cuStreamSynchronize(s as _));
}

#[test]
fn version_and_init_rank_config_report_progress_until_every_rank_joins() {
    let _g = setup();
    let mut v = 0;
    assert_eq!(unsafe { ncclGetVersion(&mut v) }, N::ncclSuccess);
    assert_eq!(v, 23000);
    let id = id();
    let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut cfg = config(0);
    assert_eq!(
        unsafe { ncclCommInitRankConfig(&mut a, 2, id, 1, &mut cfg) },
        N::ncclInProgress
    );
    assert_eq!(state(a), N::ncclInProgress);
    assert_eq!(
        unsafe { ncclCommInitRankConfig(&mut b, 2, id, 0, &mut cfg) },
        N::ncclSuccess
    );
    assert_eq!(state(a), N::ncclSuccess);
    let (mut n, mut r, mut d) = (0, 0, -1);
    unsafe {
        assert_eq!(ncclCommCount(a, &mut n), N::ncclSuccess);
        assert_eq!(ncclCommUserRank(a, &mut r), N::ncclSuccess);
        assert_eq!(ncclCommCuDevice(a, &mut d), N::ncclSuccess);
    }
    assert_eq!((n, r, d), (2, 1, 0));
    let dir = crate::nccl_wire::folder(&id.internal.map(|c| c as u8)).unwrap();
    assert!(dir.exists());
    assert_eq!(ncclCommDestroy(a), N::ncclSuccess);
    assert_eq!(ncclCommDestroy(b), N::ncclSuccess);
    assert!(!dir.exists(), "the last rank out removes the folder");
    // A destroyed communicator is no longer one.
    assert_eq!(ncclCommDestroy(a), N::ncclInvalidArgument);
    // A rank outside the world, and an id not made here.
    let mut c = std::ptr::null_mut();
    assert_eq!(
        unsafe { ncclCommInitRank(&mut c, 2, id, 2) },
        N::ncclInvalidArgument
    );
    let foreign = ncclUniqueId { internal: [7; 128] };
    assert_eq!(
        unsafe { ncclCommInitRank(&mut c, 1, foreign, 0) },
        N::ncclInvalidArgument
    );
    teardown();
}

/// The n-th send from a peer matches the n-th receive from it, whatever the order the
/// sends and receives were issued in; what a send reads is its stream's earlier work.
#[test]
fn send_and_recv_match_by_peer_and_order_on_the_stream() {
    let _g = setup();
    let c = ranks(3);
    let s = stream();
    let (a, b, z) = (
        alloc_f32(&[1.0, 2.0]),
        alloc_f32(&[3.0, 4.0]),
        alloc_f32(&[9.0; 2]),
    );
    let (x, y, w) = (
        alloc_f32(&[0.0; 2]),
        alloc_f32(&[0.0; 2]),
        alloc_f32(&[0.0; 2]),
    );
    // Queued on the stream before the send: the send must carry 5, 6.
    let later = [5.0f32, 6.0];
    unsafe {
        ok(cuMemcpyHtoDAsync_v2(
            b,
            later.as_ptr() as *const c_void,
            8,
            s as _,
        ));
    }
    let p = |v: u64| v as *mut c_void;
    assert_eq!(ncclGroupStart(), N::ncclSuccess);
    unsafe {
        // Receives first, and rank 2's send interleaved: matching is per peer, in order.
        assert_eq!(ncclRecv(p(x), 2, F32, 0, c[1], s as _), N::ncclSuccess);
        assert_eq!(ncclRecv(p(w), 2, F32, 2, c[1], s as _), N::ncclSuccess);
        assert_eq!(ncclRecv(p(y), 2, F32, 0, c[1], s as _), N::ncclSuccess);
        assert_eq!(ncclSend(p(a), 2, F32, 1, c[0], s as _), N::ncclSuccess);
        assert_eq!(ncclSend(p(z), 2, F32, 1, c[2], s as _), N::ncclSuccess);
        assert_eq!(ncclSend(p(b), 2, F32, 1, c[0], s as _), N::ncclSuccess);
    }
    let r = ncclGroupEnd();
    assert!(matches!(r, N::ncclSuccess | N::ncclInProgress), "{r:?}");
    for &k in &c {
        assert_eq!(settle(k), N::ncclSuccess);
    }
    sync(s);
    assert_eq!(read_f32(x, 2), [1.0, 2.0]);
    assert_eq!(read_f32(y, 2), [5.0, 6.0]);
    assert_eq!(read_f32(w, 2), [9.0, 9.0]);
    // A receive of a different size than the matching send is an error of that rank.
    unsafe {
        assert_eq!(ncclSend(p(a), 2, F32, 1, c[0], s as _), N::ncclSuccess);
        ncclRecv(p(x), 1, F32, 0, c[1], s as _);
    }
    assert_eq!(settle(c[1]), N::ncclInvalidUsage);
    assert!(last_error().contains("8 bytes"), "{}", last_error());
    // Arguments are checked when called.
    unsafe {
        assert_eq!(
            ncclSend(p(a), 2, F32, 3, c[0], s as _),
            N::ncclInvalidArgument
        );
        assert_eq!(
            ncclSend(p(a), 2, 99, 1, c[0], s as _),
            N::ncclInvalidArgument
        );
    }
    assert_eq!(ncclGroupEnd(), N::ncclInvalidUsage);
    for k in c {
        ncclCommDestroy(k);
    }
    teardown();
}

#[test]
fn collectives_give_rank_ordered_values() {
    let _g = setup();
    let c = ranks(3);
    let s = stream();
    let p = |v: u64| v as *mut c_void;
    // Ascending rank order: (1e8 + 1) - 1e8 rounds to 0 in f32 (any other order gives 1).
    let parts = [[1e8f32, 1.0], [1.0, 2.0], [-1e8, 3.0]];
    let send: Vec<u64> = parts.iter().map(|v| alloc_f32(v)).collect();
    let gathered: Vec<u64> = (0..3).map(|_| alloc_f32(&[0.0; 6])).collect();
    let summed: Vec<u64> = (0..3).map(|_| alloc_f32(&[0.0; 2])).collect();
    let bcast: Vec<u64> = (0..3).map(|r| alloc_f32(&[r as f32; 2])).collect();
    let scattered: Vec<u64> = (0..3).map(|_| alloc_f32(&[0.0; 2])).collect();
    let six: Vec<u64> = (0..3)
        .map(|r| alloc_f32(&[r as f32, 1.0, 2.0, 3.0, 4.0, 5.0]))
        .collect();
    assert_eq!(ncclGroupStart(), N::ncclSuccess);
    for r in 0..3 {
        unsafe {
            ncclAllGather(p(send[r]), p(gathered[r]), 2, F32, c[r], s as _);
            ncclAllReduce(p(send[r]), p(summed[r]), 2, F32, SUM, c[r], s as _);
            assert_eq!(
                ncclBcast(p(bcast[r]), 2, F32, 2, c[r], s as _),
                N::ncclSuccess,
                "{}",
                last_error()
            );
            ncclReduceScatter(p(six[r]), p(scattered[r]), 2, F32, SUM, c[r], s as _);
        }
    }
    ncclGroupEnd();
    for &k in &c {
        assert_eq!(settle(k), N::ncclSuccess);
    }
    sync(s);
    for r in 0..3 {
        assert_eq!(read_f32(gathered[r], 6), [1e8, 1.0, 1.0, 2.0, -1e8, 3.0]);
        assert_eq!(read_f32(summed[r], 2), [0.0, 6.0]);
        assert_eq!(
            read_f32(bcast[r], 2),
            [2.0, 2.0],
            "rank {r}: {:?}",
            (0..3).map(|q| read_f32(bcast[q], 2)).collect::<Vec<_>>()
        );
        let want = [[3.0, 3.0], [6.0, 9.0], [12.0, 15.0]][r];
        assert_eq!(read_f32(scattered[r], 2), want);
    }
    // Different collectives on two ranks: an error, not mixed data.
    unsafe {
        ncclAllGather(p(send[0]), p(gathered[0]), 2, F32, c[0], s as _);
        ncclAllReduce(p(send[1]), p(summed[1]), 2, F32, SUM, c[1], s as _);
    }
    assert_eq!(settle(c[1]), N::ncclInvalidUsage);
    assert!(
        last_error().contains("same collectives"),
        "{}",
        last_error()
    );
    for k in c {
        ncclCommAbort(k);
    }
    teardown();
}

/// A peer that never sends fails the wait after the timeout; one that aborts fails it at
/// once; either error sticks, and the error is named.
#[test]
fn a_missing_peer_times_out_and_an_aborted_one_fails_at_once() {
    let _g = setup();
    let c = ranks(2);
    let s = stream();
    let x = alloc_f32(&[0.0; 2]) as *mut c_void;
    st::lock(&st::get(c[0] as usize).unwrap()).set_timeout(Duration::from_millis(300));
    let start = Instant::now();
    assert_eq!(
        unsafe { ncclRecv(x, 2, F32, 1, c[0], s as _) },
        N::ncclInProgress
    );
    assert_eq!(settle(c[0]), N::ncclTimeout);
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
    assert!(last_error().contains("rank 1"), "{}", last_error());
    // Sticky: later calls report it.
    assert_eq!(
        unsafe { ncclSend(x, 2, F32, 1, c[0], s as _) },
        N::ncclTimeout
    );
    assert_eq!(ncclCommAbort(c[0]), N::ncclSuccess);
    assert_eq!(ncclCommDestroy(c[1]), N::ncclSuccess);

    let c = ranks(2);
    let start = Instant::now();
    assert_eq!(
        unsafe { ncclRecv(x, 2, F32, 0, c[1], s as _) },
        N::ncclInProgress
    );
    assert_eq!(ncclCommAbort(c[0]), N::ncclSuccess);
    assert_eq!(settle(c[1]), N::ncclRemoteError);
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(last_error().contains("rank 0 aborted"), "{}", last_error());
    ncclCommDestroy(c[1]);
    teardown();
}

/// cudarc's `Comm::from_devices`: ncclCommInitAll, blocking collectives on one thread in a
/// group.
#[test]
fn init_all_gives_blocking_ranks() {
    let _g = setup();
    let mut comms = [std::ptr::null_mut(); 2];
    assert_eq!(
        unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) },
        N::ncclSuccess
    );
    let mut d = -1;
    unsafe { ncclCommCuDevice(comms[1], &mut d) };
    assert_eq!(d, 1);
    let v: Vec<u64> = (0..2).map(|r| alloc_f32(&[r as f32 + 1.0; 3])).collect();
    ncclGroupStart();
    for r in 0..2 {
        let p = v[r] as *mut c_void;
        unsafe { ncclAllReduce(p, p, 3, F32, SUM, comms[r], std::ptr::null_mut()) };
    }
    assert_eq!(ncclGroupEnd(), N::ncclSuccess);
    for &p in &v {
        assert_eq!(read_f32(p, 3), [3.0; 3]);
    }
    for c in comms {
        assert_eq!(ncclCommDestroy(c), N::ncclSuccess);
    }
    teardown();
}
