//! cuBLASLt (`libcublasLt.so`): handles, matmul descriptors, matrix layouts, preferences,
//! the algorithm query and `cublasLtMatmul`, with the documented semantics: `D = alpha
//! op(A) op(B) + beta C` (+ the bias epilogue's vector, broadcast over D's columns),
//! column-major layouts with leading dimensions, batch counts and strided batch offsets.
//! Runs through the same GEMM as cuBLAS (`cublas::run`). Only `D == C` in place, the
//! column order, and the `DEFAULT` and `BIAS` epilogues are supported (others are
//! `CUBLAS_STATUS_NOT_SUPPORTED`, as cuBLASLt answers for what it cannot do).

use crate::cublas::{ex_types, guard, run, ColMajor};
use crate::state::state;
// cuBLAS's status and data types: the same C enums (u32) as cuBLASLt's.
use cudarc::cublas::sys::{cublasStatus_t as St, cudaDataType as Dt};
use cudarc::cublaslt::sys::{
    self as lt, cublasLtEpilogue_t as Ep, cublasLtMatmulAlgo_t,
    cublasLtMatmulDescAttributes_t as Da, cublasLtMatmulHeuristicResult_t,
    cublasLtMatrixLayoutAttribute_t as La,
};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, MutexGuard};

#[derive(Clone)]
struct Desc {
    compute: c_int,
    trans_a: c_int,
    trans_b: c_int,
    epilogue: c_int,
    bias: u64,
    /// `-1`: the bias has D's type.
    bias_type: c_int,
}

#[derive(Clone)]
struct Layout {
    dtype: c_int,
    rows: u64,
    cols: u64,
    ld: i64,
    batch: c_int,
    stride: i64,
    order: c_int,
}

enum Obj {
    Handle,
    Desc(Desc),
    Layout(Layout),
    Pref,
}

static OBJECTS: Mutex<Option<HashMap<usize, Obj>>> = Mutex::new(None);

fn objects() -> MutexGuard<'static, Option<HashMap<usize, Obj>>> {
    OBJECTS.lock().unwrap_or_else(|e| e.into_inner())
}

unsafe fn create(out: *mut *mut c_void, obj: Obj) -> Result<(), St> {
    if out.is_null() {
        return Err(St::CUBLAS_STATUS_INVALID_VALUE);
    }
    let h = state().handle();
    objects().get_or_insert_with(HashMap::new).insert(h, obj);
    out.write(h as *mut c_void);
    Ok(())
}

fn destroy(h: *mut c_void) -> Result<(), St> {
    let removed = objects()
        .get_or_insert_with(HashMap::new)
        .remove(&(h as usize));
    removed.map(|_| ()).ok_or(St::CUBLAS_STATUS_INVALID_VALUE)
}

/// Reads an attribute's value of `size` bytes (4 or 8) as an integer.
unsafe fn value(buf: *const c_void, size: usize) -> Result<i64, St> {
    match size {
        _ if buf.is_null() => Err(St::CUBLAS_STATUS_INVALID_VALUE),
        4 => Ok(i64::from((buf as *const i32).read_unaligned())),
        8 => Ok((buf as *const i64).read_unaligned()),
        _ => Err(St::CUBLAS_STATUS_INVALID_VALUE),
    }
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cublasLtCreate(h: *mut *mut c_void) -> St {
    guard("cublasLtCreate", || create(h, Obj::Handle))
}

#[no_mangle]
pub(crate) extern "C" fn cublasLtDestroy(h: *mut c_void) -> St {
    guard("cublasLtDestroy", || destroy(h))
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cublasLtMatmulDescCreate(
    d: *mut *mut c_void,
    compute: c_int,
    scale: c_int,
) -> St {
    guard("cublasLtMatmulDescCreate", || {
        // Scale type f32 with every compute type modelled (the f32 computes).
        if scale != Dt::CUDA_R_32F as c_int {
            return Err(St::CUBLAS_STATUS_NOT_SUPPORTED);
        }
        let desc = Desc {
            compute,
            trans_a: 0,
            trans_b: 0,
            epilogue: Ep::CUBLASLT_EPILOGUE_DEFAULT as c_int,
            bias: 0,
            bias_type: -1,
        };
        create(d, Obj::Desc(desc))
    })
}

#[no_mangle]
pub(crate) extern "C" fn cublasLtMatmulDescDestroy(d: *mut c_void) -> St {
    guard("cublasLtMatmulDescDestroy", || destroy(d))
}

/// The body of entry point `name`, which sets integer attribute `attr` (read from `buf`) of
/// the object `h`: `set` stores it in the field it names, or fails for an object of another
/// kind or an attribute not modelled (said on stderr, as cuBLASLt only answers a status).
unsafe fn set_attribute(
    name: &'static str,
    h: *mut c_void,
    attr: c_int,
    (buf, size): (*const c_void, usize),
    set: impl FnOnce(&mut Obj, i64) -> Option<Result<(), St>>,
) -> St {
    guard(name, || {
        let mut o = objects();
        let Some(obj) = o.get_or_insert_with(HashMap::new).get_mut(&(h as usize)) else {
            return Err(St::CUBLAS_STATUS_INVALID_VALUE);
        };
        let v = value(buf, size)?;
        set(obj, v).unwrap_or_else(|| {
            eprintln!("emulated GPU: {name}: attribute {attr} is not supported");
            Err(St::CUBLAS_STATUS_NOT_SUPPORTED)
        })
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cublasLtMatmulDescSetAttribute(
    d: *mut c_void,
    attr: c_int,
    buf: *const c_void,
    size: usize,
) -> St {
    let name = "cublasLtMatmulDescSetAttribute";
    set_attribute(name, d, attr, (buf, size), |obj, v| {
        let Obj::Desc(desc) = obj else {
            return Some(Err(St::CUBLAS_STATUS_INVALID_VALUE));
        };
        let is = |a: Da| attr == a as c_int;
        if is(Da::CUBLASLT_MATMUL_DESC_TRANSA) {
            desc.trans_a = v as c_int;
        } else if is(Da::CUBLASLT_MATMUL_DESC_TRANSB) {
            desc.trans_b = v as c_int;
        } else if is(Da::CUBLASLT_MATMUL_DESC_EPILOGUE) {
            desc.epilogue = v as c_int;
        } else if is(Da::CUBLASLT_MATMUL_DESC_BIAS_POINTER) {
            desc.bias = v as u64;
        } else if is(Da::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE) {
            desc.bias_type = v as c_int;
        } else if is(Da::CUBLASLT_MATMUL_DESC_COMPUTE_TYPE) {
            desc.compute = v as c_int;
        } else {
            return None;
        }
        Some(Ok(()))
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cublasLtMatrixLayoutCreate(
    l: *mut *mut c_void,
    dtype: c_int,
    rows: u64,
    cols: u64,
    ld: i64,
) -> St {
    guard("cublasLtMatrixLayoutCreate", || {
        let layout = Layout {
            dtype,
            rows,
            cols,
            ld,
            batch: 1,
            stride: 0,
            order: 0,
        };
        create(l, Obj::Layout(layout))
    })
}

#[no_mangle]
pub(crate) extern "C" fn cublasLtMatrixLayoutDestroy(l: *mut c_void) -> St {
    guard("cublasLtMatrixLayoutDestroy", || destroy(l))
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cublasLtMatrixLayoutSetAttribute(
    l: *mut c_void,
    attr: c_int,
    buf: *const c_void,
    size: usize,
) -> St {
    let name = "cublasLtMatrixLayoutSetAttribute";
    set_attribute(name, l, attr, (buf, size), |obj, v| {
        let Obj::Layout(layout) = obj else {
            return Some(Err(St::CUBLAS_STATUS_INVALID_VALUE));
        };
        let is = |a: La| attr == a as c_int;
        if is(La::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT) {
            layout.batch = v as c_int;
        } else if is(La::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET) {
            layout.stride = v;
        } else if is(La::CUBLASLT_MATRIX_LAYOUT_ORDER) {
            layout.order = v as c_int;
        } else if is(La::CUBLASLT_MATRIX_LAYOUT_LD) {
            layout.ld = v;
        } else {
            return None;
        }
        Some(Ok(()))
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cublasLtMatmulPreferenceCreate(p: *mut *mut c_void) -> St {
    guard("cublasLtMatmulPreferenceCreate", || create(p, Obj::Pref))
}

#[no_mangle]
pub(crate) extern "C" fn cublasLtMatmulPreferenceDestroy(p: *mut c_void) -> St {
    guard("cublasLtMatmulPreferenceDestroy", || destroy(p))
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cublasLtMatmulPreferenceSetAttribute(
    p: *mut c_void,
    _attr: c_int,
    buf: *const c_void,
    size: usize,
) -> St {
    guard("cublasLtMatmulPreferenceSetAttribute", || {
        // Workspace and alignment limits: the host GEMM needs no workspace and any alignment.
        match objects()
            .get_or_insert_with(HashMap::new)
            .get(&(p as usize))
        {
            Some(Obj::Pref) if !buf.is_null() && size > 0 => Ok(()),
            _ => Err(St::CUBLAS_STATUS_INVALID_VALUE),
        }
    })
}

/// The GEMM a descriptor and its layouts describe, checked as cuBLASLt checks them.
fn plan(desc: &Desc, a: &Layout, b: &Layout, c: &Layout, d: &Layout) -> Result<ColMajor, St> {
    let unsupported = St::CUBLAS_STATUS_NOT_SUPPORTED;
    if [a, b, c, d].iter().any(|l| l.order != 0) {
        return Err(unsupported);
    }
    let bias = desc.epilogue == Ep::CUBLASLT_EPILOGUE_BIAS as c_int;
    if !bias && desc.epilogue != Ep::CUBLASLT_EPILOGUE_DEFAULT as c_int {
        return Err(unsupported);
    }
    let (ta, tb) = (desc.trans_a != 0, desc.trans_b != 0);
    // op(A) is m x k, op(B) k x n, C and D m x n.
    let (m, n) = (d.rows, d.cols);
    let (am, ak) = if ta {
        (a.cols, a.rows)
    } else {
        (a.rows, a.cols)
    };
    let (bk, bn) = if tb {
        (b.cols, b.rows)
    } else {
        (b.rows, b.cols)
    };
    let (c_shape, batches) = ((c.rows, c.cols, c.dtype), [a.batch, b.batch, c.batch]);
    if am != m
        || bn != n
        || ak != bk
        || c_shape != (d.rows, d.cols, d.dtype)
        || batches.iter().any(|&x| x != d.batch)
    {
        return Err(St::CUBLAS_STATUS_INVALID_VALUE);
    }
    let (ab_bf16, c_bf16, compute) = ex_types(0, a.dtype, b.dtype, d.dtype, desc.compute)?;
    let int = |x: u64| c_int::try_from(x).map_err(|_| unsupported);
    // CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: "bias vector elements are the same type as the
    // elements of the output matrix (Dtype)", the exceptions being integer (IMMA) and FP8
    // kernels, which this library does not model.
    if desc.bias_type != -1 && desc.bias_type != d.dtype {
        return Err(St::CUBLAS_STATUS_INVALID_VALUE);
    }
    let bias_bf16 = c_bf16;
    Ok(ColMajor {
        trans_a: desc.trans_a,
        trans_b: desc.trans_b,
        m: int(m)?,
        n: int(n)?,
        k: int(ak)?,
        alpha: 1.0,
        a: 0,
        lda: int(a.ld as u64)?,
        stride_a: a.stride,
        b: 0,
        ldb: int(b.ld as u64)?,
        stride_b: b.stride,
        beta: 0.0,
        c: 0,
        ldc: int(d.ld as u64)?,
        stride_c: d.stride,
        count: d.batch,
        ab_bf16,
        c_bf16,
        compute,
        bias: bias.then_some((desc.bias, bias_bf16)),
    })
}

/// The descriptor and four layouts behind handles.
fn lookup(desc: *mut c_void, layouts: [*mut c_void; 4]) -> Result<(Desc, [Layout; 4]), St> {
    let mut o = objects();
    let map = o.get_or_insert_with(HashMap::new);
    let Some(Obj::Desc(d)) = map.get(&(desc as usize)) else {
        return Err(St::CUBLAS_STATUS_INVALID_VALUE);
    };
    let layout = |h: *mut c_void| match map.get(&(h as usize)) {
        Some(Obj::Layout(l)) => Ok(l.clone()),
        _ => Err(St::CUBLAS_STATUS_INVALID_VALUE),
    };
    let ls = [
        layout(layouts[0])?,
        layout(layouts[1])?,
        layout(layouts[2])?,
        layout(layouts[3])?,
    ];
    Ok((d.clone(), ls))
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn cublasLtMatmulAlgoGetHeuristic(
    handle: *mut c_void,
    desc: *mut c_void,
    a: *mut c_void,
    b: *mut c_void,
    c: *mut c_void,
    d: *mut c_void,
    _pref: *mut c_void,
    requested: c_int,
    results: *mut cublasLtMatmulHeuristicResult_t,
    count: *mut c_int,
) -> St {
    guard("cublasLtMatmulAlgoGetHeuristic", || {
        if !matches!(
            objects()
                .get_or_insert_with(HashMap::new)
                .get(&(handle as usize)),
            Some(Obj::Handle)
        ) {
            return Err(St::CUBLAS_STATUS_NOT_INITIALIZED);
        }
        if requested <= 0 || results.is_null() || count.is_null() {
            return Err(St::CUBLAS_STATUS_INVALID_VALUE);
        }
        let (desc, [a, b, c, d]) = lookup(desc, [a, b, c, d])?;
        // "CUBLAS_STATUS_NOT_SUPPORTED: no heuristic function available for current
        // configuration"; otherwise one algorithm, needing no workspace.
        plan(&desc, &a, &b, &c, &d)?;
        results.write(cublasLtMatmulHeuristicResult_t {
            algo: cublasLtMatmulAlgo_t {
                data: [1, 0, 0, 0, 0, 0, 0, 0],
            },
            workspaceSize: 0,
            state: lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
            wavesCount: 1.0,
            reserved: [0; 4],
        });
        count.write(1);
        Ok(())
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn cublasLtMatmul(
    handle: *mut c_void,
    desc: *mut c_void,
    alpha: *const c_void,
    a: *const c_void,
    a_desc: *mut c_void,
    b: *const c_void,
    b_desc: *mut c_void,
    beta: *const c_void,
    c: *const c_void,
    c_desc: *mut c_void,
    d: *mut c_void,
    d_desc: *mut c_void,
    _algo: *const cublasLtMatmulAlgo_t,
    _workspace: *mut c_void,
    _workspace_bytes: usize,
    stream: *mut c_void,
) -> St {
    guard("cublasLtMatmul", || {
        if !matches!(
            objects()
                .get_or_insert_with(HashMap::new)
                .get(&(handle as usize)),
            Some(Obj::Handle)
        ) {
            return Err(St::CUBLAS_STATUS_NOT_INITIALIZED);
        }
        state()
            .stream(stream as usize)
            .map_err(|_| St::CUBLAS_STATUS_INVALID_VALUE)?;
        let (desc, [la, lb, lc, ld]) = lookup(desc, [a_desc, b_desc, c_desc, d_desc])?;
        let mut g = plan(&desc, &la, &lb, &lc, &ld)?;
        if alpha.is_null() || beta.is_null() {
            return Err(St::CUBLAS_STATUS_INVALID_VALUE);
        }
        g.alpha = *(alpha as *const f32);
        g.beta = *(beta as *const f32);
        // Out of place (C != D) needs C copied to D first; only in place is modelled.
        if !std::ptr::eq(c, d) && g.beta != 0.0 {
            eprintln!("emulated GPU: cublasLtMatmul: C != D with beta != 0 is not supported");
            return Err(St::CUBLAS_STATUS_NOT_SUPPORTED);
        }
        if g.bias.is_some_and(|(p, _)| p == 0) {
            return Err(St::CUBLAS_STATUS_INVALID_VALUE);
        }
        (g.a, g.b, g.c) = (a as u64, b as u64, d as u64);
        run("cublasLtMatmul", &g, stream as usize)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::cublas::sys::cublasComputeType_t as Ct;

    fn layout(dtype: Dt, rows: u64, cols: u64) -> Layout {
        Layout {
            dtype: dtype as c_int,
            rows,
            cols,
            ld: rows as i64,
            batch: 1,
            stride: 0,
            order: 0,
        }
    }

    /// The bias epilogue's vector has D's type: an f32 bias with a bf16 D is refused (as an
    /// H200 refused it), one of D's type (or the default, -1) is taken.
    #[test]
    fn the_bias_vector_must_have_the_output_type() {
        let bf16 = Dt::CUDA_R_16BF;
        let (a, b, d) = (layout(bf16, 4, 3), layout(bf16, 3, 5), layout(bf16, 4, 5));
        let desc = |bias_type: c_int| Desc {
            compute: Ct::CUBLAS_COMPUTE_32F as c_int,
            trans_a: 0,
            trans_b: 0,
            epilogue: Ep::CUBLASLT_EPILOGUE_BIAS as c_int,
            bias: 256,
            bias_type,
        };
        let f32_bias = desc(Dt::CUDA_R_32F as c_int);
        assert!(matches!(
            plan(&f32_bias, &a, &b, &d, &d),
            Err(St::CUBLAS_STATUS_INVALID_VALUE)
        ));
        for t in [-1, bf16 as c_int] {
            let g = plan(&desc(t), &a, &b, &d, &d).unwrap_or_else(|_| panic!("bias type {t}"));
            assert_eq!(g.bias, Some((256, true)));
        }
        // With an f32 D, an f32 bias is D's type.
        let d32 = layout(Dt::CUDA_R_32F, 4, 5);
        assert!(plan(&f32_bias, &a, &b, &d32, &d32).is_ok());
    }
}
