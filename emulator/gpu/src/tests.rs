//! The entry points called as C would call them: device properties, the launch checks the
//! real driver skips, sanitizer findings as sticky launch failures, and cuBLAS's
//! column-major GEMM against a direct evaluation of its definition.

use crate::cublas::*;
use crate::device::*;
use crate::memory::*;
use crate::module::*;
use cudarc::cublas::sys::cublasStatus_t as St;
use cudarc::driver::sys::{CUdevice_attribute as A, CUfunction_attribute as F, CUresult as R};
use std::ffi::{c_int, c_void};
use std::sync::Mutex;

/// The state is process-wide: one test at a time.
pub(crate) static LOCK: Mutex<()> = Mutex::new(());

pub(crate) fn ok(r: R) {
    assert_eq!(r, R::CUDA_SUCCESS);
}

/// Initialises, retains device 0's primary context and makes it current.
pub(crate) fn setup() -> std::sync::MutexGuard<'static, ()> {
    let g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    ok(cuInit(0));
    let mut ctx = std::ptr::null_mut();
    unsafe { ok(cuDevicePrimaryCtxRetain(&mut ctx, 0)) };
    ok(cuCtxSetCurrent(ctx));
    g
}

pub(crate) fn teardown() {
    ok(cuDevicePrimaryCtxRelease_v2(0));
}

const KERNEL: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
.visible .entry add1(\n\t.param .u64 add1_p0,\n\t.param .u32 add1_p1\n)\n{\n\
\t.reg .b32 %r<4>;\n\t.reg .f32 %f<4>;\n\t.reg .b64 %rd<8>;\n\
\tld.param.u64 %rd1, [add1_p0];\n\tcvta.to.global.u64 %rd2, %rd1;\n\
\tmov.u32 %r1, %tid.x;\n\tmul.wide.u32 %rd3, %r1, 4;\n\tadd.s64 %rd4, %rd2, %rd3;\n\
\tld.global.f32 %f1, [%rd4];\n\tadd.f32 %f2, %f1, 0f3F800000;\n\tst.global.f32 [%rd4], %f2;\n\
\tret;\n}\n\0";

pub(crate) fn alloc_f32(v: &[f32]) -> u64 {
    let mut p = 0;
    unsafe {
        ok(cuMemAlloc_v2(&mut p, 4 * v.len()));
        ok(cuMemcpyHtoD_v2(p, v.as_ptr() as *const c_void, 4 * v.len()));
    }
    p
}

pub(crate) fn read_f32(p: u64, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    unsafe { ok(cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut c_void, p, 4 * n)) };
    v
}

#[test]
fn an_h200_by_default() {
    let _g = setup();
    let attr = |a: A| {
        let mut v = 0;
        unsafe { ok(cuDeviceGetAttribute(&mut v, a as c_int, 0)) };
        v
    };
    assert_eq!(attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), 9);
    assert_eq!(attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT), 132);
    assert_eq!(
        attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
        48 * 1024
    );
    assert_eq!(
        attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        227 * 1024
    );
    assert_eq!(attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED), 0);
    let mut bytes = 0;
    unsafe { ok(cuDeviceTotalMem_v2(&mut bytes, 0)) };
    assert_eq!(bytes as u64, crate::state::H200_MEMORY);
    let mut n = 0;
    unsafe { assert_eq!(cuDeviceGet(&mut n, 1), R::CUDA_ERROR_INVALID_DEVICE) };
    teardown();
}

/// Loads the test kernel; returns its function.
pub(crate) fn kernel() -> cudarc::driver::sys::CUfunction {
    let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
    unsafe {
        ok(cuModuleLoadData(&mut m, KERNEL.as_ptr() as *const c_void));
        ok(cuModuleGetFunction(&mut f, m, c"add1".as_ptr()));
    }
    f
}

fn launch(f: cudarc::driver::sys::CUfunction, threads: u32, shared: u32, p: u64) -> R {
    launch_on(f, threads, shared, p, std::ptr::null_mut())
}

pub(crate) fn launch_on(
    f: cudarc::driver::sys::CUfunction,
    threads: u32,
    shared: u32,
    p: u64,
    stream: cudarc::driver::sys::CUstream,
) -> R {
    let n = threads;
    let mut params = [
        &p as *const u64 as *mut c_void,
        &n as *const u32 as *mut c_void,
    ];
    unsafe {
        cuLaunchKernel(
            f,
            1,
            1,
            1,
            threads,
            1,
            1,
            shared,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
}

#[test]
fn launches_are_checked_against_the_documented_limits() {
    let _g = setup();
    let f = kernel();
    let p = alloc_f32(&[1.0; 32]);
    ok(launch(f, 32, 0, p));
    assert_eq!(read_f32(p, 32), vec![2.0; 32]);
    // More than 1024 threads per block.
    assert_eq!(launch(f, 1025, 0, p), R::CUDA_ERROR_INVALID_VALUE);
    // Dynamic shared memory above 48 KB needs the function's opt-in, up to the device's.
    let big = 64 * 1024;
    assert_eq!(launch(f, 32, big, p), R::CUDA_ERROR_INVALID_VALUE);
    let a = F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as c_int;
    assert_eq!(
        cuFuncSetAttribute(f, a, 228 * 1024),
        R::CUDA_ERROR_INVALID_VALUE
    );
    ok(cuFuncSetAttribute(f, a, big as c_int));
    ok(launch(f, 32, big, p));
    assert_eq!(read_f32(p, 32), vec![3.0; 32]);
    ok(cuMemFree_v2(p));
    teardown();
}

#[test]
fn a_sanitizer_finding_fails_the_launch_and_the_context() {
    let _g = setup();
    let f = kernel();
    let p = alloc_f32(&[1.0; 32]);
    // 64 threads over 32 elements: out of bounds.
    assert_eq!(launch(f, 64, 0, p), R::CUDA_ERROR_LAUNCH_FAILED);
    let mut q = 0;
    unsafe { assert_eq!(cuMemAlloc_v2(&mut q, 16), R::CUDA_ERROR_LAUNCH_FAILED) };
    // Destroying the context (the last release) clears it.
    teardown();
    drop(_g);
    let _g = setup();
    unsafe { ok(cuMemAlloc_v2(&mut q, 16)) };
    ok(cuMemFree_v2(q));
    teardown();
}

/// Column-major `C = alpha op(A) op(B) + beta C`, evaluated from the definition.
#[allow(clippy::too_many_arguments)]
fn reference(
    ta: bool,
    tb: bool,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    beta: f32,
    c: &mut [f32],
    ldc: usize,
) {
    for j in 0..n {
        for i in 0..m {
            let mut s = 0f64;
            for l in 0..k {
                let x = if ta { a[l + i * lda] } else { a[i + l * lda] };
                let y = if tb { b[j + l * ldb] } else { b[l + j * ldb] };
                s += f64::from(x) * f64::from(y);
            }
            let v = f64::from(alpha) * s + f64::from(beta) * f64::from(c[i + j * ldc]);
            c[i + j * ldc] = v as f32;
        }
    }
}

#[test]
fn sgemm_is_column_major_with_leading_dimensions_and_transposes() {
    let _g = setup();
    let mut h = std::ptr::null_mut();
    unsafe { assert_eq!(cublasCreate_v2(&mut h), St::CUBLAS_STATUS_SUCCESS) };
    let (m, n, k) = (3usize, 2usize, 4usize);
    let vals = |len: usize, seed: f32| -> Vec<f32> {
        (0..len)
            .map(|i| ((i as f32 * 0.37 + seed).sin() * 4.0).round())
            .collect()
    };
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let lda = if ta { k } else { m } + 1;
        let ldb = if tb { n } else { k } + 2;
        let ldc = m + 1;
        let a = vals(lda * if ta { m } else { k }, 1.0);
        let b = vals(ldb * if tb { k } else { n }, 2.0);
        let mut c = vals(ldc * n, 3.0);
        let (pa, pb, pc) = (alloc_f32(&a), alloc_f32(&b), alloc_f32(&c));
        let (alpha, beta) = (2.0f32, 0.5f32);
        let st = unsafe {
            cublasSgemm_v2(
                h,
                ta as c_int,
                tb as c_int,
                m as c_int,
                n as c_int,
                k as c_int,
                &alpha,
                pa as *const f32,
                lda as c_int,
                pb as *const f32,
                ldb as c_int,
                &beta,
                pc as *mut f32,
                ldc as c_int,
            )
        };
        assert_eq!(st, St::CUBLAS_STATUS_SUCCESS);
        reference(
            ta,
            tb,
            (m, n, k),
            alpha,
            &a,
            lda,
            &b,
            ldb,
            beta,
            &mut c,
            ldc,
        );
        assert_eq!(read_f32(pc, c.len()), c, "transa {ta} transb {tb}");
        for p in [pa, pb, pc] {
            ok(cuMemFree_v2(p));
        }
    }
    // lda below m (op N) is an invalid value.
    let one = 1f32;
    let st = unsafe {
        cublasSgemm_v2(
            h,
            0,
            0,
            4,
            1,
            1,
            &one,
            std::ptr::null(),
            3,
            std::ptr::null(),
            1,
            &one,
            std::ptr::null_mut(),
            4,
        )
    };
    assert_eq!(st, St::CUBLAS_STATUS_INVALID_VALUE);
    assert_eq!(cublasDestroy_v2(h), St::CUBLAS_STATUS_SUCCESS);
    teardown();
}

#[test]
fn stream_capture_follows_the_documented_rules() {
    use crate::ops::*;
    use crate::stream::*;
    let _g = setup();
    let f = kernel();
    let p = alloc_f32(&[1.0; 32]);
    let legacy = std::ptr::null_mut();
    // "Capture may not be initiated if stream is CU_STREAM_LEGACY."
    assert_eq!(
        cuStreamBeginCapture_v2(legacy, 1),
        R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    let (mut blocking, mut graph, mut exec) = (legacy, std::ptr::null_mut(), std::ptr::null_mut());
    unsafe { ok(cuStreamCreate(&mut blocking, 0)) };
    // Captured work does not run until the graph is launched, each launch running it again.
    ok(cuStreamBeginCapture_v2(blocking, 1));
    ok(launch_on(f, 32, 0, p, blocking));
    // The legacy stream is unusable while a blocking stream captures; that ends the capture.
    assert_eq!(
        launch_on(f, 32, 0, p, legacy),
        R::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    );
    unsafe {
        assert_eq!(
            cuStreamEndCapture(blocking, &mut graph),
            R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        );
    }
    assert_eq!(read_f32(p, 32), vec![1.0; 32]);
    ok(cuStreamBeginCapture_v2(blocking, 1));
    ok(launch_on(f, 32, 0, p, blocking));
    unsafe {
        ok(cuStreamEndCapture(blocking, &mut graph));
        ok(cuGraphInstantiateWithFlags(&mut exec, graph, 0));
    }
    assert_eq!(read_f32(p, 32), vec![1.0; 32]);
    ok(cuGraphLaunch(exec, blocking));
    ok(cuGraphLaunch(exec, blocking));
    ok(cuStreamSynchronize(blocking));
    assert_eq!(read_f32(p, 32), vec![3.0; 32]);
    // Synchronising a capturing stream fails and invalidates the capture.
    ok(cuStreamBeginCapture_v2(blocking, 1));
    assert_eq!(
        cuStreamSynchronize(blocking),
        R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    let mut other = std::ptr::null_mut();
    unsafe {
        assert_eq!(
            cuStreamEndCapture(blocking, &mut other),
            R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        );
    }
    ok(cuGraphExecDestroy(exec));
    ok(cuGraphDestroy(graph));
    ok(cuStreamDestroy_v2(blocking));
    ok(cuMemFree_v2(p));
    teardown();
}

#[test]
fn created_streams_defer_their_work_until_a_synchronisation() {
    use crate::stream::*;
    let _g = setup();
    let f = kernel();
    let p = alloc_f32(&[1.0; 32]);
    let (mut non_blocking, mut blocking) = (std::ptr::null_mut(), std::ptr::null_mut());
    unsafe {
        ok(cuStreamCreate(&mut non_blocking, 1));
        ok(cuStreamCreate(&mut blocking, 0));
    }
    // A non-blocking stream is not waited for by the legacy stream: without a
    // synchronisation, the host reads what was there before.
    ok(launch_on(f, 32, 0, p, non_blocking));
    assert_eq!(read_f32(p, 32), vec![1.0; 32]);
    ok(cuStreamSynchronize(non_blocking));
    assert_eq!(read_f32(p, 32), vec![2.0; 32]);
    // An event wait orders a stream after another's work; legacy-stream work waits for a
    // blocking stream's.
    let mut e = std::ptr::null_mut();
    unsafe { ok(cuEventCreate(&mut e, 0)) };
    ok(launch_on(f, 32, 0, p, non_blocking));
    ok(cuEventRecord(e, non_blocking));
    assert_eq!(cuEventQuery(e), R::CUDA_ERROR_NOT_READY);
    ok(cuStreamWaitEvent(blocking, e, 0));
    ok(cuEventQuery(e));
    ok(launch_on(f, 32, 0, p, blocking));
    assert_eq!(read_f32(p, 32), vec![4.0; 32]);
    ok(cuEventDestroy_v2(e));
    ok(cuStreamDestroy_v2(non_blocking));
    ok(cuStreamDestroy_v2(blocking));
    ok(cuMemFree_v2(p));
    teardown();
}
