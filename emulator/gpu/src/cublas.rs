//! cuBLAS (`libcublas.so`): handles and the strided-batched GEMMs, on the host with the
//! documented semantics: column-major `C = alpha op(A) op(B) + beta C` with leading
//! dimensions and strides, run by `parallax_emulator::blas` (row-major) as the transposed
//! product `C^T = op(B)^T op(A)^T`. Scalars are host pointers (the default pointer mode).

use crate::ops::Op;
use crate::state::{guarded, state, BlasHandle};
use cudarc::cublas::sys::{
    cublasComputeType_t as Ct, cublasMath_t, cublasStatus_t as St, cudaDataType as Dt,
};
use parallax_emulator::blas::{Compute, Gemm, Scaled};
use std::ffi::{c_int, c_longlong, c_void};

pub fn guard(name: &str, f: impl FnOnce() -> Result<(), St>) -> St {
    guarded(name, St::CUBLAS_STATUS_INTERNAL_ERROR, || {
        f().map(|()| St::CUBLAS_STATUS_SUCCESS)
    })
}

type Handle = *mut c_void;

#[no_mangle]
pub(crate) unsafe extern "C" fn cublasCreate_v2(handle: *mut Handle) -> St {
    guard("cublasCreate_v2", || {
        let mut s = state();
        if handle.is_null() {
            return Err(St::CUBLAS_STATUS_INVALID_VALUE);
        }
        s.current().map_err(|_| St::CUBLAS_STATUS_NOT_INITIALIZED)?;
        let h = s.handle();
        s.blas.insert(h, BlasHandle { stream: 0, math: 0 });
        handle.write(h as Handle);
        Ok(())
    })
}

#[no_mangle]
pub(crate) extern "C" fn cublasDestroy_v2(handle: Handle) -> St {
    guard("cublasDestroy_v2", || {
        state()
            .blas
            .remove(&(handle as usize))
            .map(|_| ())
            .ok_or(St::CUBLAS_STATUS_NOT_INITIALIZED)
    })
}

fn with_handle<T>(handle: Handle, f: impl FnOnce(&mut BlasHandle) -> T) -> Result<T, St> {
    let mut s = state();
    let h = s
        .blas
        .get_mut(&(handle as usize))
        .ok_or(St::CUBLAS_STATUS_NOT_INITIALIZED)?;
    Ok(f(h))
}

#[no_mangle]
pub(crate) extern "C" fn cublasSetStream_v2(handle: Handle, stream: *mut c_void) -> St {
    guard("cublasSetStream_v2", || {
        state()
            .stream(stream as usize)
            .map_err(|_| St::CUBLAS_STATUS_INVALID_VALUE)?;
        with_handle(handle, |h| h.stream = stream as usize)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cublasSetMathMode(handle: Handle, mode: c_int) -> St {
    guard("cublasSetMathMode", || {
        with_handle(handle, |h| h.math = mode)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cublasGetMathMode(handle: Handle, mode: *mut c_int) -> St {
    guard("cublasGetMathMode", || {
        let m = with_handle(handle, |h| h.math)?;
        if mode.is_null() {
            return Err(St::CUBLAS_STATUS_INVALID_VALUE);
        }
        mode.write(m);
        Ok(())
    })
}

/// One column-major strided-batched GEMM call's arguments.
pub struct ColMajor {
    pub trans_a: c_int,
    pub trans_b: c_int,
    pub m: c_int,
    pub n: c_int,
    pub k: c_int,
    pub alpha: f32,
    pub a: u64,
    pub lda: c_int,
    pub stride_a: c_longlong,
    pub b: u64,
    pub ldb: c_int,
    pub stride_b: c_longlong,
    pub beta: f32,
    pub c: u64,
    pub ldc: c_int,
    pub stride_c: c_longlong,
    pub count: c_int,
    pub ab_bf16: bool,
    pub c_bf16: bool,
    pub compute: Compute,
    /// cuBLASLt's bias epilogue: `m` elements (bf16 when `.1`) added to each column of C.
    pub bias: Option<(u64, bool)>,
}

/// `CUBLAS_OP_N` 0, `CUBLAS_OP_T` 1, `CUBLAS_OP_C` 2 (the transpose, for real types).
fn transposed(op: c_int) -> Result<bool, St> {
    match op {
        0 => Ok(false),
        1 | 2 => Ok(true),
        _ => Err(St::CUBLAS_STATUS_INVALID_VALUE),
    }
}

/// Runs `g` after the documented argument checks.
pub fn run(name: &'static str, g: &ColMajor, stream: usize) -> Result<(), St> {
    let (ta, tb) = (transposed(g.trans_a)?, transposed(g.trans_b)?);
    let invalid = St::CUBLAS_STATUS_INVALID_VALUE;
    if g.m < 0 || g.n < 0 || g.k < 0 || g.count < 0 {
        return Err(invalid);
    }
    // lda >= max(1, m) for op N (A is m x k), else max(1, k); likewise B; ldc >= max(1, m).
    let need_a = if ta { g.k } else { g.m }.max(1);
    let need_b = if tb { g.n } else { g.k }.max(1);
    if g.lda < need_a || g.ldb < need_b || g.ldc < g.m.max(1) {
        eprintln!(
            "emulated GPU: {name}: leading dimensions lda {} ldb {} ldc {} below {need_a}, {need_b}, {}",
            g.lda,
            g.ldb,
            g.ldc,
            g.m.max(1)
        );
        return Err(invalid);
    }
    if g.stride_a < 0 || g.stride_b < 0 || g.stride_c < 0 {
        return Err(invalid);
    }
    // Column-major C (m x n, ldc) is row-major C^T (n x m): C^T = op(B)^T op(A)^T, where the
    // row-major view of the stored B is B^T (so `trans_a` of the row-major call is tb).
    let row = Gemm {
        a: g.b,
        b: g.a,
        c: g.c,
        m: g.n as u64,
        n: g.m as u64,
        k: g.k as u64,
        count: g.count as u64,
        trans_a: tb,
        trans_b: ta,
        stride_a: g.stride_b as u64,
        stride_b: g.stride_a as u64,
        stride_c: g.stride_c as u64,
        ab_bf16: g.ab_bf16,
        c_bf16: g.c_bf16,
        compute: g.compute,
    };
    let scaled = Scaled {
        lda: g.ldb as u64,
        ldb: g.lda as u64,
        ldc: g.ldc as u64,
        alpha: g.alpha,
        beta: g.beta,
        bias: g.bias,
    };
    if g.k == 0 && g.beta == 1.0 && g.bias.is_none() {
        return Ok(());
    }
    let mut s = state();
    s.current().map_err(|e| {
        // cuBLAS runs on the calling thread's current context: name the usual cause.
        eprintln!("emulated GPU: {name}: no usable current context on this thread ({e:?})");
        St::CUBLAS_STATUS_EXECUTION_FAILED
    })?;
    let op = Op::Gemm {
        name,
        gemm: row,
        scaled,
    };
    s.submit(stream, op)
        .map_err(|_| St::CUBLAS_STATUS_EXECUTION_FAILED)
}

fn handle_stream(handle: Handle) -> Result<usize, St> {
    with_handle(handle, |h| h.stream)
}

fn handle_math(handle: Handle) -> Result<c_int, St> {
    with_handle(handle, |h| h.math)
}

/// The compute for f32 operands under the handle's math mode (`CUBLAS_TF32_TENSOR_OP_MATH`
/// lets single-precision routines round their inputs to TF32).
fn f32_compute(math: c_int) -> Compute {
    if math & 0xf == cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH as c_int {
        Compute::Tf32
    } else {
        Compute::F32
    }
}

unsafe fn scalar(p: *const f32) -> Result<f32, St> {
    if p.is_null() {
        Err(St::CUBLAS_STATUS_INVALID_VALUE)
    } else {
        Ok(*p)
    }
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn cublasSgemmStridedBatched(
    handle: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    stride_a: c_longlong,
    b: *const f32,
    ldb: c_int,
    stride_b: c_longlong,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
    stride_c: c_longlong,
    count: c_int,
) -> St {
    guard("cublasSgemmStridedBatched", || {
        let compute = f32_compute(handle_math(handle)?);
        let g = ColMajor {
            trans_a: transa,
            trans_b: transb,
            m,
            n,
            k,
            alpha: scalar(alpha)?,
            a: a as u64,
            lda,
            stride_a,
            b: b as u64,
            ldb,
            stride_b,
            beta: scalar(beta)?,
            c: c as u64,
            ldc,
            stride_c,
            count,
            ab_bf16: false,
            c_bf16: false,
            compute,
            bias: None,
        };
        run("cublasSgemmStridedBatched", &g, handle_stream(handle)?)
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn cublasSgemm_v2(
    handle: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
) -> St {
    cublasSgemmStridedBatched(
        handle, transa, transb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1,
    )
}

/// The operand types and compute of a `cublasGemm*Ex` call, as the supported combinations
/// of the cuBLAS documentation's table (f32 and bf16 only; others are not supported here).
pub fn ex_types(
    math: c_int,
    at: c_int,
    bt: c_int,
    ct: c_int,
    compute: c_int,
) -> Result<(bool, bool, Compute), St> {
    let (f32t, bf16t) = (Dt::CUDA_R_32F as c_int, Dt::CUDA_R_16BF as c_int);
    let is = |x: Ct| compute == x as c_int;
    if at != bt || ![f32t, bf16t].contains(&at) || ![f32t, bf16t].contains(&ct) {
        eprintln!("emulated GPU: cublasGemmEx: types A {at} B {bt} C {ct} are not supported");
        return Err(St::CUBLAS_STATUS_NOT_SUPPORTED);
    }
    let ab_bf16 = at == bf16t;
    if ab_bf16 {
        // bf16 inputs: CUBLAS_COMPUTE_32F (or pedantic), output bf16 or f32.
        if is(Ct::CUBLAS_COMPUTE_32F) || is(Ct::CUBLAS_COMPUTE_32F_PEDANTIC) {
            return Ok((true, ct == bf16t, Compute::F32));
        }
        return Err(St::CUBLAS_STATUS_NOT_SUPPORTED);
    }
    if ct != f32t {
        return Err(St::CUBLAS_STATUS_NOT_SUPPORTED);
    }
    let c = if is(Ct::CUBLAS_COMPUTE_32F) {
        f32_compute(math)
    } else if is(Ct::CUBLAS_COMPUTE_32F_PEDANTIC) {
        Compute::F32
    } else if is(Ct::CUBLAS_COMPUTE_32F_FAST_TF32) {
        Compute::Tf32
    } else if is(Ct::CUBLAS_COMPUTE_32F_FAST_16BF) {
        Compute::Bf16
    } else {
        eprintln!("emulated GPU: cublasGemmEx: compute type {compute} is not supported");
        return Err(St::CUBLAS_STATUS_NOT_SUPPORTED);
    };
    Ok((false, false, c))
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn cublasGemmStridedBatchedEx(
    handle: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_type: c_int,
    lda: c_int,
    stride_a: c_longlong,
    b: *const c_void,
    b_type: c_int,
    ldb: c_int,
    stride_b: c_longlong,
    beta: *const c_void,
    c: *mut c_void,
    c_type: c_int,
    ldc: c_int,
    stride_c: c_longlong,
    count: c_int,
    compute: c_int,
    _algo: c_int,
) -> St {
    guard("cublasGemmStridedBatchedEx", || {
        let math = handle_math(handle)?;
        let (ab_bf16, c_bf16, compute) = ex_types(math, a_type, b_type, c_type, compute)?;
        // With a 32-bit float compute type, alpha and beta are f32.
        let g = ColMajor {
            trans_a: transa,
            trans_b: transb,
            m,
            n,
            k,
            alpha: scalar(alpha as *const f32)?,
            a: a as u64,
            lda,
            stride_a,
            b: b as u64,
            ldb,
            stride_b,
            beta: scalar(beta as *const f32)?,
            c: c as u64,
            ldc,
            stride_c,
            count,
            ab_bf16,
            c_bf16,
            compute,
            bias: None,
        };
        run("cublasGemmStridedBatchedEx", &g, handle_stream(handle)?)
    })
}
