//! bf16 and tf32 GEMMs through cuBLASLt, with the matmul descriptor, the layouts and the
//! algorithm built once per shape (an `LtPlan`) and only looked up at run time. cudarc's safe
//! `Matmul` rebuilds all of them and reruns the heuristic on every call (and treats f32 as
//! TF32), so this uses its `result`/`sys` layer. Exact fp32 stays on cuBLAS sgemm (cuBLASLt's
//! f32 is not exact), and whatever cuBLASLt cannot run goes back to `gemm::gemm`.

use super::gemm::{Gemm, Precision};
use super::CudaError;
use cudarc::cublaslt::{result, sys};
use cudarc::driver::result as driver;
use std::cell::RefCell;
use std::ffi::c_void;

#[path = "lt_key.rs"]
mod key;
use key::describe;
pub(super) use key::Compute;
use key::{col_major, Cache, Key, Matrix};

/// Set to `0` to run every GEMM through cuBLAS as before (for A/B timing).
pub(super) const ENV: &str = "PARALLAX_CUBLASLT";

/// Set to `0` to add the biases of `gemm+bias` kernels in a launch of their own, as the
/// cuBLAS path does, rather than in the cuBLASLt epilogue (for A/B timing).
pub(super) const BIAS_ENV: &str = "PARALLAX_GEMM_BIAS";

/// The cuBLASLt compute for `precision`, given the value of `PARALLAX_CUBLASLT`; `None` for
/// exact fp32 and when the variable is `0`.
pub(super) fn selected(precision: Precision, env: Option<&str>) -> Option<Compute> {
    if env.map(str::trim) == Some("0") {
        return None;
    }
    match precision {
        Precision::Fp32 => None,
        Precision::Bf16 => Some(Compute::Bf16),
        Precision::Tf32 => Some(Compute::Tf32),
    }
}

/// Whether libcublasLt can be opened. Checked before any cuBLASLt call: cudarc panics when
/// the library is missing.
pub(super) fn present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

fn blas(what: &str, e: result::CublasError) -> CudaError {
    CudaError::Blas(format!("cuBLASLt {what}: {e:?}"))
}

fn not_supported(e: &result::CublasError) -> bool {
    e.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
}

/// Owned cuBLASLt objects, destroyed once on drop (errors there are ignored: nothing can be
/// done about them while tearing down).
struct Handle(sys::cublasLtHandle_t);
struct Desc(sys::cublasLtMatmulDesc_t);
struct Layout(sys::cublasLtMatrixLayout_t);
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle`, destroyed once.
        let _ = unsafe { result::destroy_handle(self.0) };
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_desc`, destroyed once.
        let _ = unsafe { result::destroy_matmul_desc(self.0) };
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by `create_matrix_layout`, destroyed once.
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_pref`, destroyed once.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}

/// Sets a descriptor attribute from a plain value.
///
/// # Safety
/// `T` must be the attribute's C type.
unsafe fn set_desc<T>(
    d: &Desc,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<(), CudaError> {
    result::set_matmul_desc_attribute(d.0, attr, v as *const T as *const c_void, size_of::<T>())
        .map_err(|e| blas("matmul descriptor", e))
}

/// # Safety
/// `T` must be the attribute's C type.
unsafe fn set_pref<T>(
    p: &Pref,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<(), CudaError> {
    result::set_matmul_pref_attribute(p.0, attr, v as *const T as *const c_void, size_of::<T>())
        .map_err(|e| blas("preference", e))
}

/// cuBLASLt's element type: bf16 or f32.
fn data_type(bf16: bool) -> sys::cudaDataType {
    if bf16 {
        sys::cudaDataType::CUDA_R_16BF
    } else {
        sys::cudaDataType::CUDA_R_32F
    }
}

impl Layout {
    fn new(m: &Matrix, batch: i32, bf16: bool) -> Result<Layout, CudaError> {
        let l = result::create_matrix_layout(data_type(bf16), m.rows, m.cols, m.ld as i64)
            .map(Layout)
            .map_err(|e| blas("matrix layout", e))?;
        use sys::cublasLtMatrixLayoutAttribute_t as A;
        let stride = m.stride as i64;
        // SAFETY: a live layout; BATCH_COUNT is an int32, STRIDED_BATCH_OFFSET an int64.
        unsafe {
            result::set_matrix_layout_attribute(
                l.0,
                A::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                &batch as *const i32 as *const c_void,
                size_of::<i32>(),
            )
            .and_then(|()| {
                result::set_matrix_layout_attribute(
                    l.0,
                    A::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    &stride as *const i64 as *const c_void,
                    size_of::<i64>(),
                )
            })
            .map_err(|e| blas("matrix layout", e))?;
        }
        Ok(l)
    }
}

/// Everything `cublasLtMatmul` needs for one key but the pointers. D shares C's layout (D = C).
pub(super) struct LtPlan {
    desc: Desc,
    a: Layout,
    b: Layout,
    d: Layout,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// cuBLASLt's own workspace: cudarc's `Workspace` buffer is crate-private.
struct Workspace {
    ptr: u64,
    bytes: usize,
}

impl Drop for Workspace {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_sync`, freed once.
        let _ = unsafe { driver::free_sync(self.ptr) };
    }
}

/// The workspace NVIDIA recommends: 32 MiB on Hopper and later, else 4 MiB.
pub(super) fn workspace_bytes(cc_major: i32) -> usize {
    if cc_major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

/// The executor's cuBLASLt: a handle, a workspace and the plans. Fields drop in order: the
/// plans before the handle they were made for.
pub(super) struct Lt {
    plans: Cache<LtPlan>,
    handle: Handle,
    workspace: Workspace,
    compute: Compute,
    /// Whether `gemm_bias` adds biases in the epilogue (`PARALLAX_GEMM_BIAS` is not `0`).
    bias_epilogue: bool,
    /// The keys whose heuristic query failed, with cuBLASLt's status: sent to cuBLAS, and
    /// named by `gpu-check` so a refused configuration is seen rather than only slower.
    refused: RefCell<Vec<String>>,
}

impl Lt {
    /// cuBLASLt at `compute`, or `None` when libcublasLt is not found (the caller keeps
    /// cuBLAS). Call with the executor's context current (the workspace is allocated in it).
    pub(super) fn new(compute: Compute, cc_major: i32) -> Result<Option<Lt>, CudaError> {
        if !present() {
            return Ok(None);
        }
        let handle = Handle(result::create_handle().map_err(|e| blas("create", e))?);
        let bytes = workspace_bytes(cc_major);
        // SAFETY: a plain device allocation, freed by `Workspace`.
        let ptr = unsafe { driver::malloc_sync(bytes) }.map_err(|e| {
            CudaError::Driver(format!(
                "allocating the cuBLASLt workspace ({bytes} bytes): {e:?}"
            ))
        })?;
        Ok(Some(Lt {
            plans: Cache::new(),
            handle,
            workspace: Workspace { ptr, bytes },
            compute,
            bias_epilogue: std::env::var(BIAS_ENV).map_or(true, |v| v.trim() != "0"),
            refused: RefCell::new(Vec::new()),
        }))
    }

    /// (plans built, shapes sent to cuBLAS, why the heuristic refused some), for checks
    /// that cuBLASLt really ran.
    pub(super) fn counts(&self) -> (usize, usize, Vec<String>) {
        let (plans, fallbacks) = self.plans.counts();
        (plans, fallbacks, self.refused.borrow().clone())
    }

    /// Queues `g` on `stream` through its plan. `Ok(false)`: cuBLASLt cannot run it (no
    /// algorithm, or the call was refused as not supported) and the caller must use cuBLAS.
    pub(super) fn gemm(
        &self,
        g: &Gemm,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<bool, CudaError> {
        if g.m == 0 || g.n == 0 || g.count == 0 {
            return Ok(true);
        }
        // cuBLAS zero-fills C for k = 0; a cuBLASLt layout with no columns may be refused.
        if g.k == 0 {
            return Ok(false);
        }
        self.queue(Key::of(g, self.compute), g, None, stream)
    }

    /// Queues `g` with `bias` (`n` values) added along each row of C in the epilogue (see
    /// `codegen::GemmBias`). `Ok(false)`: the caller must run the GEMM and the bias launch.
    pub(super) fn gemm_bias(
        &self,
        g: &Gemm,
        bias: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<bool, CudaError> {
        // The heuristic is not told the bias's address: take vectors as aligned as any
        // kernel loads them (16 bytes; the arena aligns every buffer to more).
        let aligned = bias.is_multiple_of(16);
        // The epilogue's bias has D's type (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: other types
        // only for integer and FP8 kernels), and a bias is an f32 parameter: a bf16 D adds
        // it in a launch of its own.
        let bf16_d = g.bf16[2];
        if !self.bias_epilogue
            || !aligned
            || bf16_d
            || g.m == 0
            || g.n == 0
            || g.count == 0
            || g.k == 0
        {
            return Ok(false);
        }
        let key = Key {
            bias: true,
            ..Key::of(g, self.compute)
        };
        self.queue(key, g, Some(bias), stream)
    }

    fn queue(
        &self,
        key: Key,
        g: &Gemm,
        bias: Option<u64>,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<bool, CudaError> {
        let ran = self.plans.with(
            key,
            || self.build(&key),
            // SAFETY: the plan was built for these sizes, strides, alignments and epilogue;
            // the pointers address live buffers holding the operands (and the bias).
            |p| unsafe { self.run(p, g, bias, stream) },
        )?;
        match ran {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) if not_supported(&e) => {
                self.plans.disable(key);
                Ok(false)
            }
            Some(Err(e)) => Err(blas("matmul", e)),
        }
    }

    /// The descriptor, layouts and the heuristic's first algorithm for `key`; `None` when
    /// there is no algorithm.
    fn build(&self, key: &Key) -> Result<Option<LtPlan>, CudaError> {
        let Ok(batch) = i32::try_from(key.batch) else {
            return Ok(None);
        };
        let cm = col_major(key);
        let f32t = sys::cudaDataType::CUDA_R_32F;
        // bf16 operands are multiplied as they are (f32 accumulation); f32 ones at the
        // plan's tensor-core compute.
        let compute = if key.bf16[0] {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        } else {
            key.compute.cublas()
        };
        let desc = result::create_matmul_desc(compute, f32t)
            .map(Desc)
            .map_err(|e| blas("matmul descriptor", e))?;
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        // cublasOperation_t is an int32: 0 = N, 1 = T.
        let (ta, tb) = (i32::from(cm.trans_a), i32::from(cm.trans_b));
        // SAFETY: a live descriptor; TRANSA/TRANSB are int32.
        unsafe {
            set_desc(&desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &ta)?;
            set_desc(&desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &tb)?;
        }
        if key.bias {
            // Row-major C's bias along its last axis is one value per row of column-major D
            // (`n` of them), broadcast over D's columns and the batch; fp32 like D.
            let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
            // SAFETY: a live descriptor; EPILOGUE is a cublasLtEpilogue_t.
            unsafe { set_desc(&desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)? };
        }
        // A' is B's memory, B' is A's.
        let a = Layout::new(&cm.a, batch, key.bf16[1])?;
        let b = Layout::new(&cm.b, batch, key.bf16[0])?;
        let d = Layout::new(&cm.d, batch, key.bf16[2])?;
        let pref = result::create_matmul_pref()
            .map(Pref)
            .map_err(|e| blas("preference", e))?;
        // A' is B's memory, B' is A's.
        let [align_a, align_b, align_c] = key.align;
        // SAFETY: a live preference; MAX_WORKSPACE_BYTES is a uint64, the alignments uint32.
        unsafe {
            set_pref(
                &pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &(self.workspace.bytes as u64),
            )?;
            set_pref(
                &pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                &align_b,
            )?;
            set_pref(
                &pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                &align_a,
            )?;
            set_pref(
                &pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                &align_c,
            )?;
            set_pref(
                &pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                &align_c,
            )?;
        }
        // SAFETY: every object is live; C and D share one layout. cudarc reports an empty
        // result as NOT_SUPPORTED.
        let heuristic = unsafe {
            result::get_matmul_algo_heuristic(self.handle.0, desc.0, a.0, b.0, d.0, d.0, pref.0)
        };
        match heuristic {
            Ok(h) => Ok(Some(LtPlan {
                desc,
                a,
                b,
                d,
                algo: h.algo,
            })),
            Err(e) if not_supported(&e) => Ok(None),
            // Any other refusal of the configuration (INVALID_VALUE for a combination of
            // types it does not run, say): cuBLAS runs the GEMM, and the refusal is kept.
            Err(e) => {
                self.refused
                    .borrow_mut()
                    .push(format!("{}: {e:?}", describe(key)));
                Ok(None)
            }
        }
    }

    /// # Safety
    /// `p` must be the plan for `g`'s key, and `g`'s pointers live buffers of its operands.
    unsafe fn run(
        &self,
        p: &LtPlan,
        g: &Gemm,
        bias: Option<u64>,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), result::CublasError> {
        if let Some(bias) = bias {
            // The pointer is read when the call is queued, so one descriptor serves every
            // bias of the shape. BIAS_POINTER is a `void *`.
            let ptr = bias as *const c_void;
            result::set_matmul_desc_attribute(
                p.desc.0,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &ptr as *const *const c_void as *const c_void,
                size_of::<*const c_void>(),
            )?;
        }
        let (alpha, beta) = (1f32, 0f32);
        result::matmul(
            self.handle.0,
            p.desc.0,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            g.pb as *const c_void,
            p.a.0,
            g.pa as *const c_void,
            p.b.0,
            g.pc as *const c_void,
            p.d.0,
            g.pc as *mut c_void,
            p.d.0,
            &p.algo,
            self.workspace.ptr as *mut c_void,
            self.workspace.bytes,
            stream as sys::cudaStream_t,
        )
    }
}

#[cfg(test)]
#[path = "lt_tests.rs"]
mod tests;
