//! Device memory on the host (the driver API's "Memory Management" group): one address
//! space for every device, the interpreter's `Memory`, whose addresses are the device
//! pointers. Memory from `cuMemAlloc` is uninitialised (the sanitizer's initcheck sees a
//! read before a write). The async copies run when enqueued; their streams are checked.
//! Allocations, frees and the synchronous copies and memsets are "potentially unsafe" calls,
//! refused while the calling thread's stream capture forbids them (`State::no_unsafe_call`).

use crate::ops::Op;
use crate::state::{guard, put, state, State};
use cudarc::driver::sys::{CUdeviceptr, CUresult, CUstream};
use std::ffi::{c_uchar, c_uint, c_void};

#[no_mangle]
pub(crate) unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    guard("cuMemAlloc_v2", || {
        let mut s = state();
        let dev = s.current()?;
        // "If bytesize is 0, cuMemAlloc() returns CUDA_ERROR_INVALID_VALUE."
        if bytesize == 0 || dptr.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        s.no_unsafe_call("cuMemAlloc")?;
        let total = s.config()?.memory;
        let bytes = bytesize as u64;
        if s.used[dev].saturating_add(bytes) > total {
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        let p = s
            .memory
            .alloc(bytes, format!("cuMemAlloc({bytes}) on device {dev}"));
        s.used[dev] += bytes;
        s.allocs.insert(p, (dev, bytes));
        put(dptr, p)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    guard("cuMemFree_v2", || {
        let mut s = state();
        s.current()?;
        s.no_unsafe_call("cuMemFree")?;
        // cuMemFree waits for the device's work (which may still use the memory).
        s.flush_all()?;
        let Some((dev, bytes)) = s.allocs.remove(&dptr) else {
            eprintln!("emulated GPU: cuMemFree({dptr:#x}): not an allocation's start");
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        };
        s.used[dev] -= bytes;
        s.memory
            .free(dptr)
            .map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guard("cuMemGetInfo_v2", || {
        let s = state();
        let dev = s.current()?;
        let t = s.config()?.memory;
        put(free, (t - s.used[dev]) as usize)?;
        put(total, t as usize)
    })
}

/// How a copy or memset was called: `Sync` (the entry point without `Async`, named) on the
/// legacy stream, or on a stream.
#[derive(Clone, Copy)]
enum On {
    Sync(&'static str),
    Stream(CUstream),
}

impl On {
    fn stream(self) -> CUstream {
        match self {
            On::Sync(_) => std::ptr::null_mut(),
            On::Stream(s) => s,
        }
    }
}

/// The state, with the context current, the stream valid, and a synchronous call allowed.
fn on_stream(on: On) -> Result<std::sync::MutexGuard<'static, State>, CUresult> {
    let mut s = state();
    s.current()?;
    s.stream(on.stream() as usize)?;
    if let On::Sync(what) = on {
        s.no_unsafe_call(what)?;
    }
    Ok(s)
}

/// The body of a copy of `n` bytes between the host buffer `host` and the device: `op` on
/// stream `on`, once `host` is checked (an empty copy does nothing).
fn host_copy(name: &str, host: *const c_void, n: usize, on: On, op: Op) -> CUresult {
    guard(name, || {
        let mut s = on_stream(on)?;
        if n == 0 {
            return Ok(());
        }
        if host.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        s.submit(on.stream() as usize, op)
    })
}

unsafe fn htod(dst: CUdeviceptr, src: *const c_void, n: usize, on: On) -> CUresult {
    let op = Op::HostToDevice {
        dst,
        src: src as usize,
        n,
    };
    host_copy("cuMemcpyHtoD", src, n, on, op)
}

unsafe fn dtoh(dst: *mut c_void, src: CUdeviceptr, n: usize, on: On) -> CUresult {
    let op = Op::DeviceToHost {
        dst: dst as usize,
        src,
        n,
    };
    host_copy("cuMemcpyDtoH", dst, n, on, op)
}

fn dtod(dst: CUdeviceptr, src: CUdeviceptr, n: usize, on: On) -> CUresult {
    guard("cuMemcpyDtoD", || {
        let mut s = on_stream(on)?;
        let op = Op::Copy {
            dst,
            src,
            n: n as u64,
        };
        s.submit(on.stream() as usize, op)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
) -> CUresult {
    htod(dst, src, n, On::Sync("cuMemcpyHtoD"))
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    stream: CUstream,
) -> CUresult {
    htod(dst, src, n, On::Stream(stream))
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
) -> CUresult {
    dtoh(dst, src, n, On::Sync("cuMemcpyDtoH"))
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    dtoh(dst, src, n, On::Stream(stream))
}

#[no_mangle]
pub(crate) extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    dtod(dst, src, n, On::Sync("cuMemcpyDtoD"))
}

#[no_mangle]
pub(crate) extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    dtod(dst, src, n, On::Stream(stream))
}

/// Fills `n` elements of `unit` bytes each at `dst` with `value` (little-endian).
fn memset(dst: CUdeviceptr, value: u32, unit: usize, n: usize, on: On) -> CUresult {
    guard("cuMemset", || {
        let mut s = on_stream(on)?;
        // "The dstDevice pointer must be four byte aligned" (cuMemsetD32).
        if !dst.is_multiple_of(unit as u64) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let one = &value.to_le_bytes()[..unit];
        let bytes: Vec<u8> = one.iter().copied().cycle().take(unit * n).collect();
        s.submit(on.stream() as usize, Op::Write { dst, bytes })
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, uc: c_uchar, n: usize) -> CUresult {
    memset(dst, uc.into(), 1, n, On::Sync("cuMemsetD8"))
}

#[no_mangle]
pub(crate) extern "C" fn cuMemsetD32_v2(dst: CUdeviceptr, ui: c_uint, n: usize) -> CUresult {
    memset(dst, ui, 4, n, On::Sync("cuMemsetD32"))
}

#[no_mangle]
pub(crate) extern "C" fn cuMemsetD8Async(
    dst: CUdeviceptr,
    uc: c_uchar,
    n: usize,
    st: CUstream,
) -> CUresult {
    memset(dst, uc.into(), 1, n, On::Stream(st))
}

#[no_mangle]
pub(crate) extern "C" fn cuMemsetD32Async(
    dst: CUdeviceptr,
    ui: c_uint,
    n: usize,
    st: CUstream,
) -> CUresult {
    memset(dst, ui, 4, n, On::Stream(st))
}
