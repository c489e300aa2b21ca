//! The host-side mistakes the emulated driver must expose, each made here exactly as a
//! caller would make it, beside the correct call: a launch parameter dropped, a host read
//! without the synchronisation a graph's stream needs, a synchronous copy in a capture.

use crate::memory::*;
use crate::module::*;
use crate::ops::*;
use crate::stream::*;
use crate::tests::{alloc_f32, kernel, launch_on, ok, read_f32, setup, teardown};
use cudarc::driver::sys::{CUresult as R, CUstream};
use std::ffi::c_void;

/// `add1(p0 .u64, p1 .u32)` launched with `params` as its `kernelParams` array.
fn launch_with(params: &mut [*mut c_void]) -> R {
    let f = kernel();
    unsafe {
        cuLaunchKernel(
            f,
            1,
            1,
            1,
            32,
            1,
            1,
            0,
            std::ptr::null_mut(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
}

#[test]
fn a_dropped_launch_parameter_fails_the_launch_without_crashing() {
    let _g = setup();
    let n = 32u64;
    let pn = &n as *const u64 as *mut c_void;
    // What lies past a short array is whatever the caller's memory holds: nothing, null,
    // an address that is not mapped.
    for after in [std::ptr::null_mut(), 8 as *mut c_void] {
        assert_eq!(launch_with(&mut [pn, after]), R::CUDA_ERROR_INVALID_VALUE);
    }
    // The first parameter dropped, the array one short: `n` taken for the address faults
    // in the sanitizer (or the read past the array fails); it never runs.
    let mut short = Vec::with_capacity(1);
    short.push(pn);
    let r = launch_with(&mut short);
    assert!(
        matches!(r, R::CUDA_ERROR_INVALID_VALUE | R::CUDA_ERROR_LAUNCH_FAILED),
        "{r:?}"
    );
    teardown();
    drop(_g);
    // The correct launch, on a fresh context (a launch failure is sticky).
    let _g = setup();
    let p = alloc_f32(&[1.0; 32]);
    ok(launch_with(&mut [&p as *const u64 as *mut c_void, pn]));
    assert_eq!(read_f32(p, 32), vec![2.0; 32]);
    ok(cuMemFree_v2(p));
    teardown();
}

/// What `body` enqueues on `stream`, captured (thread-local mode) into an executable graph.
fn graph_of(stream: CUstream, body: impl FnOnce()) -> cudarc::driver::sys::CUgraphExec {
    let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
    ok(cuStreamBeginCapture_v2(stream, 1));
    body();
    unsafe {
        ok(cuStreamEndCapture(stream, &mut graph));
        ok(cuGraphInstantiateWithFlags(&mut exec, graph, 0));
    }
    ok(cuGraphDestroy(graph));
    exec
}

#[test]
fn a_host_read_before_a_graphs_stream_is_joined_sees_stale_data() {
    let _g = setup();
    let p = alloc_f32(&[1.0; 32]);
    let mut s = std::ptr::null_mut();
    unsafe { ok(cuStreamCreate(&mut s, 1)) };
    let exec = graph_of(s, || ok(launch_on(kernel(), 32, 0, p, s)));
    // Launched on a non-blocking stream, the graph is not waited for by the legacy stream:
    // a read there without a join sees the old values.
    ok(cuGraphLaunch(exec, s));
    assert_eq!(read_f32(p, 32), vec![1.0; 32]);
    ok(cuStreamSynchronize(s));
    assert_eq!(read_f32(p, 32), vec![2.0; 32]);
    // The join: the legacy stream waits for an event recorded after the graph.
    let mut e = std::ptr::null_mut();
    unsafe { ok(cuEventCreate(&mut e, 2)) };
    ok(cuGraphLaunch(exec, s));
    ok(cuEventRecord(e, s));
    ok(cuStreamWaitEvent(std::ptr::null_mut(), e, 0));
    assert_eq!(read_f32(p, 32), vec![3.0; 32]);
    ok(cuEventDestroy_v2(e));
    ok(cuGraphExecDestroy(exec));
    ok(cuStreamDestroy_v2(s));
    ok(cuMemFree_v2(p));
    teardown();
}

#[test]
fn a_synchronous_copy_in_a_capture_fails_and_invalidates_it() {
    let _g = setup();
    let p = alloc_f32(&[1.0; 32]);
    let host = [5.0f32; 32];
    let src = host.as_ptr() as *const c_void;
    let mut s = std::ptr::null_mut();
    unsafe { ok(cuStreamCreate(&mut s, 1)) };
    let mut graph = std::ptr::null_mut();
    // Thread-local and global captures forbid the capturing thread's synchronous copies,
    // memsets and allocations, even with a non-blocking capturing stream.
    for mode in [0, 1] {
        ok(cuStreamBeginCapture_v2(s, mode));
        let r = unsafe { cuMemcpyHtoD_v2(p, src, 128) };
        assert_eq!(r, R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "mode {mode}");
        assert_eq!(
            cuMemsetD32_v2(p, 0, 32),
            R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        let mut q = 0;
        let r = unsafe { cuMemAlloc_v2(&mut q, 16) };
        assert_eq!(r, R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        let r = unsafe { cuStreamEndCapture(s, &mut graph) };
        assert_eq!(r, R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    assert_eq!(read_f32(p, 32), vec![1.0; 32]);
    // A relaxed capture allows the synchronous copy (it runs now, not in the graph).
    ok(cuStreamBeginCapture_v2(s, 2));
    unsafe { ok(cuMemcpyHtoD_v2(p, src, 128)) };
    unsafe { ok(cuStreamEndCapture(s, &mut graph)) };
    ok(cuGraphDestroy(graph));
    assert_eq!(read_f32(p, 32), vec![5.0; 32]);
    // The correct capture: the copy on the capturing stream, replayed at each launch.
    let ones = [1.0f32; 32];
    let exec = graph_of(s, || {
        unsafe {
            ok(cuMemcpyHtoDAsync_v2(
                p,
                ones.as_ptr() as *const c_void,
                128,
                s,
            ))
        };
        ok(launch_on(kernel(), 32, 0, p, s));
    });
    for _ in 0..2 {
        ok(cuGraphLaunch(exec, s));
        ok(cuStreamSynchronize(s));
        assert_eq!(read_f32(p, 32), vec![2.0; 32]);
    }
    ok(cuGraphExecDestroy(exec));
    ok(cuStreamDestroy_v2(s));
    ok(cuMemFree_v2(p));
    teardown();
}

/// With `PARALLAX_EMULATED_STREAM_SEED`, two streams' work with no event between them runs
/// in either order (one seed or another), so a missing event shows; with the event, and
/// without a seed, the order is the program's. Queued work may also run early.
#[test]
fn independent_streams_run_in_a_seeded_order() {
    use crate::device::cuCtxSynchronize;
    let _g = setup();
    let p = alloc_f32(&[0.0; 32]);
    let (mut a, mut b, mut e) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    unsafe {
        ok(cuStreamCreate(&mut a, 1));
        ok(cuStreamCreate(&mut b, 1));
        ok(cuEventCreate(&mut e, 2));
    }
    let seed = |v: Option<u64>| {
        let mut s = crate::state::state();
        if let Some(c) = s.config.as_mut() {
            c.stream_seed = v;
        }
        s.order = v.unwrap_or(0);
    };
    // `a` writes 1s, `b` 2s, into the same buffer; `event`: `b` waits for `a` first.
    let race = |event: bool| {
        ok(cuMemsetD32Async(p, 1f32.to_bits(), 32, a));
        if event {
            ok(cuEventRecord(e, a));
            ok(cuStreamWaitEvent(b, e, 0));
        }
        ok(cuMemsetD32Async(p, 2f32.to_bits(), 32, b));
        ok(cuCtxSynchronize());
        read_f32(p, 32)[0]
    };
    assert_eq!(race(false), 2.0);
    let mut seen = Vec::new();
    for s in 0..16 {
        seed(Some(s));
        seen.push(race(false));
        assert_eq!(race(true), 2.0, "seed {s}");
    }
    // Work may also run before a synchronisation asks for it, as a GPU may finish early:
    // a read without one sees the new values under some seeds, the old under others.
    let mut early = Vec::new();
    for s in 0..16 {
        seed(Some(s));
        ok(cuMemsetD32_v2(p, 0, 32));
        ok(cuMemsetD32Async(p, 3f32.to_bits(), 32, a));
        early.push(read_f32(p, 32)[0]);
        ok(cuCtxSynchronize());
    }
    seed(None);
    assert!(seen.contains(&1.0) && seen.contains(&2.0), "{seen:?}");
    assert!(early.contains(&0.0) && early.contains(&3.0), "{early:?}");
    ok(cuEventDestroy_v2(e));
    ok(cuStreamDestroy_v2(a));
    ok(cuStreamDestroy_v2(b));
    ok(cuMemFree_v2(p));
    teardown();
}
