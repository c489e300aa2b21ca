//! GEMMs through cuBLAS: the plan's row-major matmuls as column-major calls with the operands
//! swapped (`C^T = op(B)^T op(A)^T`), strided-batched, at the executor's precision.

use super::CudaError;
use cudarc::cublas::{result as blas_result, sys as blas_sys};

/// How GEMMs compute: exact fp32, TF32 tensor cores, or bf16 tensor-core products with fp32
/// accumulation and output. Storage, master weights, the optimizer and every other kernel stay fp32
/// (bf16 keeps fp32's exponent range, so no loss scaling is needed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    Fp32,
    Tf32,
    Bf16,
}

impl Precision {
    /// As `--precision` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// One matmul's device addresses and sizes (see `codegen::Launch::Gemm`).
pub(super) struct Gemm {
    pub pa: u64,
    pub pb: u64,
    pub pc: u64,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub count: u64,
    pub trans_a: bool,
    pub trans_b: bool,
    pub stride_a: u64,
    pub stride_b: u64,
    pub stride_c: u64,
    /// Whether A, B and C hold bf16 (A and B alike; see `codegen::Launch::Gemm`).
    pub bf16: [bool; 3],
}

impl Gemm {
    /// Bytes per element of A (B's are alike) and of C.
    pub(super) fn elem_bytes(&self) -> (u64, u64) {
        let bytes = |bf16: bool| if bf16 { 2 } else { 4 };
        (bytes(self.bf16[0]), bytes(self.bf16[2]))
    }
}

pub(super) fn gemm(
    blas: blas_sys::cublasHandle_t,
    precision: Precision,
    g: &Gemm,
) -> Result<(), CudaError> {
    let op = |t: bool| {
        if t {
            blas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas_sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
    let lda = if g.trans_b { g.k } else { g.n };
    let ldb = if g.trans_a { g.m } else { g.k };
    let (alpha, beta) = (1f32, 0f32);
    if g.m == 0 || g.n == 0 || g.count == 0 {
        return Ok(());
    }
    let t = |bf16: bool| {
        if bf16 {
            blas_sys::cudaDataType::CUDA_R_16BF
        } else {
            blas_sys::cudaDataType::CUDA_R_32F
        }
    };
    let ex = |types: [bool; 3], compute| {
        // SAFETY: as below, with each operand's element type.
        unsafe {
            blas_result::gemm_strided_batched_ex(
                blas,
                op(g.trans_b),
                op(g.trans_a),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                &alpha as *const f32 as *const _,
                g.pb as *const _,
                t(types[1]),
                lda as i32,
                g.stride_b as i64,
                g.pa as *const _,
                t(types[0]),
                ldb as i32,
                g.stride_a as i64,
                &beta as *const f32 as *const _,
                g.pc as *mut _,
                t(types[2]),
                g.n as i32,
                g.stride_c as i64,
                g.count as i32,
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| CudaError::Blas(format!("{e:?}")))
    };
    if g.bf16[0] || g.bf16[2] {
        // bf16 storage: bf16 A and B, C bf16 or f32, f32 accumulation, whatever the
        // executor's precision (the operands are bf16 already).
        return ex(g.bf16, blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F);
    }
    if precision == Precision::Bf16 {
        // fp32 storage and accumulation; cuBLAS may use bf16 tensor cores, converting the
        // operands as it loads them (for small problems it picked tf32 kernels on an H200).
        return ex(
            [false; 3],
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
        );
    }
    // SAFETY: pointers address live buffers holding the operands' elements; sizes
    // and strides come from the operands' resolved shapes.
    unsafe {
        blas_result::sgemm_strided_batched(
            blas,
            op(g.trans_b),
            op(g.trans_a),
            g.n as i32,
            g.m as i32,
            g.k as i32,
            &alpha,
            g.pb as *const f32,
            lda as i32,
            g.stride_b as i64,
            g.pa as *const f32,
            ldb as i32,
            g.stride_a as i64,
            &beta,
            g.pc as *mut f32,
            g.n as i32,
            g.stride_c as i64,
            g.count as i32,
        )
    }
    .map_err(|e| CudaError::Blas(format!("{e:?}")))
}
