//! What picks a cuBLASLt plan and how it is laid out, apart from the library's calls: the
//! tensor-core compute, the key (sizes, transposes, strides, alignment, compute), the
//! row-major GEMM read as cuBLASLt's column-major problem, and the plans by key.

use super::super::gemm::Gemm;
use super::super::CudaError;
use cudarc::cublaslt::sys;
use std::cell::RefCell;
use std::collections::HashMap;

/// The tensor-core compute of a plan; storage, accumulation and output stay fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(in crate::cuda) enum Compute {
    Bf16,
    Tf32,
}

impl Compute {
    pub(super) fn cublas(self) -> sys::cublasComputeType_t {
        match self {
            Compute::Bf16 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
            Compute::Tf32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        }
    }
}

/// What picks a plan: the GEMM's sizes, transposes and batch strides, the compute, and the
/// alignment of its operands (the heuristic may choose kernels that assume it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(in crate::cuda) struct Key {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub batch: u64,
    pub trans_a: bool,
    pub trans_b: bool,
    pub stride_a: u64,
    pub stride_b: u64,
    pub stride_c: u64,
    pub compute: Compute,
    /// Bytes (a power of two, at most 256) that every batch's A, B and C start is aligned to.
    pub align: [u32; 3],
    /// Whether the epilogue adds a bias vector along C's rows (`CUBLASLT_EPILOGUE_BIAS`).
    pub bias: bool,
    /// Whether A, B and C hold bf16 (`Gemm::bf16`).
    pub bf16: [bool; 3],
}

impl Key {
    pub(in crate::cuda) fn of(g: &Gemm, compute: Compute) -> Key {
        let (ab, cb) = g.elem_bytes();
        Key {
            m: g.m,
            n: g.n,
            k: g.k,
            batch: g.count,
            trans_a: g.trans_a,
            trans_b: g.trans_b,
            stride_a: g.stride_a,
            stride_b: g.stride_b,
            stride_c: g.stride_c,
            compute,
            align: [
                alignment(g.pa, g.stride_a * ab, g.count),
                alignment(g.pb, g.stride_b * ab, g.count),
                alignment(g.pc, g.stride_c * cb, g.count),
            ],
            bias: false,
            bf16: g.bf16,
        }
    }
}

/// The largest power of two, at most 256 (cuBLASLt's default assumption), dividing the byte
/// address of every batch's matrix (`stride_bytes` apart).
pub(in crate::cuda) fn alignment(ptr: u64, stride_bytes: u64, batch: u64) -> u32 {
    let mut bits = ptr | 256;
    if batch > 1 {
        bits |= stride_bytes;
    }
    1 << bits.trailing_zeros()
}

/// One operand as cuBLASLt stores it: column-major `rows × cols` with leading dimension `ld`,
/// each batch's matrix `stride` elements after the previous one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::cuda) struct Matrix {
    pub rows: u64,
    pub cols: u64,
    pub ld: u64,
    pub stride: u64,
}

/// The column-major problem `D = op(A') op(B')` run for a row-major GEMM. Row-major
/// `C = op(A) op(B)` is column-major `C^T = op(B)^T op(A)^T` over the same memory, so A' is B,
/// B' is A, and D (`n × m`, ld `n`) is C; each keeps its own transpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::cuda) struct ColMajor {
    pub trans_a: bool,
    pub trans_b: bool,
    pub a: Matrix,
    pub b: Matrix,
    pub d: Matrix,
    pub batch: u64,
}

pub(in crate::cuda) fn col_major(key: &Key) -> ColMajor {
    let (m, n, k) = (key.m, key.n, key.k);
    // Stored row-major B is `k × n` (`n × k` transposed): column-major, the same memory
    // read as `n × k` (`k × n`).
    let a = if key.trans_b {
        Matrix {
            rows: k,
            cols: n,
            ld: k,
            stride: key.stride_b,
        }
    } else {
        Matrix {
            rows: n,
            cols: k,
            ld: n,
            stride: key.stride_b,
        }
    };
    let b = if key.trans_a {
        Matrix {
            rows: m,
            cols: k,
            ld: m,
            stride: key.stride_a,
        }
    } else {
        Matrix {
            rows: k,
            cols: m,
            ld: k,
            stride: key.stride_a,
        }
    };
    ColMajor {
        trans_a: key.trans_b,
        trans_b: key.trans_a,
        a,
        b,
        d: Matrix {
            rows: n,
            cols: m,
            ld: n,
            stride: key.stride_c,
        },
        batch: key.batch,
    }
}

/// Plans by key. `None` remembers a shape cuBLASLt has no algorithm for, so it goes straight
/// to cuBLAS instead of rerunning the heuristic. One stream drives the executor, so a
/// `RefCell` is enough.
pub(in crate::cuda) struct Cache<P> {
    map: RefCell<HashMap<Key, Option<P>>>,
}

impl<P> Cache<P> {
    pub(in crate::cuda) fn new() -> Self {
        Cache {
            map: RefCell::new(HashMap::new()),
        }
    }

    /// Runs `run` on the plan for `key`, building it first if there is none yet; `None`
    /// when the key has no plan.
    pub(in crate::cuda) fn with<R>(
        &self,
        key: Key,
        build: impl FnOnce() -> Result<Option<P>, CudaError>,
        run: impl FnOnce(&P) -> R,
    ) -> Result<Option<R>, CudaError> {
        if !self.map.borrow().contains_key(&key) {
            // Built outside any borrow; a failed build is not remembered, so it is retried.
            let plan = build()?;
            self.map.borrow_mut().insert(key, plan);
        }
        Ok(self
            .map
            .borrow()
            .get(&key)
            .and_then(Option::as_ref)
            .map(run))
    }

    /// Sends the key to cuBLAS from now on (cuBLASLt refused to run its plan).
    pub(in crate::cuda) fn disable(&self, key: Key) {
        self.map.borrow_mut().insert(key, None);
    }

    /// (plans, keys without one).
    pub(in crate::cuda) fn counts(&self) -> (usize, usize) {
        let map = self.map.borrow();
        let plans = map.values().filter(|p| p.is_some()).count();
        (plans, map.len() - plans)
    }
}

/// A key for a person: `m×n×k`, the batch, transposes, bf16 operands and the epilogue.
pub(super) fn describe(key: &Key) -> String {
    let t = |b: bool| if b { "bf16" } else { "f32" };
    format!(
        "{}x{}x{} batch {} trans {}{} A {} B {} C {}{} {:?}",
        key.m,
        key.n,
        key.k,
        key.batch,
        u8::from(key.trans_a),
        u8::from(key.trans_b),
        t(key.bf16[0]),
        t(key.bf16[1]),
        t(key.bf16[2]),
        if key.bias { " +bias" } else { "" },
        key.compute,
    )
}
