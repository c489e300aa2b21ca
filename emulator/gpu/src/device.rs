//! Devices, primary contexts and error strings (the CUDA driver API's "Initialization",
//! "Version Management", "Device Management", "Primary Context Management", "Context
//! Management" and "Error Handling" groups).

use crate::state::{self, context_device, context_of, guard, put, state, OPTIN_SHARED};
use cudarc::driver::sys::{CUcontext, CUdevice, CUdevice_attribute as A, CUresult};
use std::ffi::{c_char, c_int, c_uint};

/// The CUDA version this driver implements (13.0).
const VERSION: c_int = 13000;
const NAME: &str = "NVIDIA H200 (emulated by Parallax)";

#[no_mangle]
pub(crate) extern "C" fn cuInit(flags: c_uint) -> CUresult {
    guard("cuInit", || {
        // "Flags: Initialization flag for CUDA" -- must be 0.
        if flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let mut s = state();
        s.init();
        if s.config()?.gpus == 0 {
            return Err(CUresult::CUDA_ERROR_NO_DEVICE);
        }
        Ok(())
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    // Documented to work before cuInit.
    guard("cuDriverGetVersion", || put(version, VERSION))
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    guard("cuDeviceGetCount", || {
        let n = state().config()?.gpus;
        put(count, n)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    guard("cuDeviceGet", || {
        let d = state().device(ordinal)?;
        put(device, d as CUdevice)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuDeviceGetName(
    name: *mut c_char,
    len: c_int,
    dev: CUdevice,
) -> CUresult {
    guard("cuDeviceGetName", || {
        state().device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // "len: Maximum length of string to store in name": truncated, NUL-terminated.
        let bytes = NAME.as_bytes();
        let n = bytes.len().min(len as usize - 1);
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), name as *mut u8, n);
        *name.add(n) = 0;
        Ok(())
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    guard("cuDeviceTotalMem_v2", || {
        let s = state();
        s.device(dev)?;
        put(bytes, s.config()?.memory as usize)
    })
}

/// An H200's value of a device attribute (0 for those not listed).
pub fn attribute(a: c_int, sms: c_int) -> c_int {
    let is = |x: A| a == x as c_int;
    let table: [(A, c_int); 40] = [
        (A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024),
        (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, 1024),
        (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, 1024),
        (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, 64),
        (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, i32::MAX),
        (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, 65535),
        (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, 65535),
        (A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, 49152),
        (A::CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY, 65536),
        (A::CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32),
        (A::CU_DEVICE_ATTRIBUTE_MAX_PITCH, i32::MAX),
        (A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, 65536),
        (A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 1_980_000),
        (A::CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, 512),
        (A::CU_DEVICE_ATTRIBUTE_GPU_OVERLAP, 1),
        (A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, sms),
        (A::CU_DEVICE_ATTRIBUTE_INTEGRATED, 0),
        (A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, 1),
        (A::CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS, 1),
        (A::CU_DEVICE_ATTRIBUTE_ECC_ENABLED, 1),
        (A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, 2_619_000),
        (A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, 6144),
        (A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, 60 * 1024 * 1024),
        (A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 2048),
        (A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, 3),
        (A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1),
        (A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 9),
        (A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0),
        (A::CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED, 1),
        (A::CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED, 1),
        (
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            233_472,
        ),
        (
            A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR,
            65536,
        ),
        (A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 1),
        (A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH, 1),
        (
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            OPTIN_SHARED as c_int,
        ),
        (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, 32),
        (
            A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
            1024,
        ),
        (
            A::CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
            47_185_920,
        ),
        // Stream-ordered allocation is not emulated: callers fall back to cuMemAlloc.
        (A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 0),
        (A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, 0),
    ];
    table.iter().find(|(k, _)| is(*k)).map_or(0, |&(_, v)| v)
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: c_int,
    dev: CUdevice,
) -> CUresult {
    guard("cuDeviceGetAttribute", || {
        let d = state().device(dev)?;
        if !(1..=A::CU_DEVICE_ATTRIBUTE_MAX as c_int + 64).contains(&attrib) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let v = if attrib == A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID as c_int {
            d as c_int + 1
        } else {
            attribute(attrib, 132)
        };
        put(pi, v)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    pctx: *mut CUcontext,
    dev: CUdevice,
) -> CUresult {
    guard("cuDevicePrimaryCtxRetain", || {
        let mut s = state();
        let d = s.device(dev)?;
        put(pctx, context_of(d) as CUcontext)?;
        s.retained[d] += 1;
        Ok(())
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    guard("cuDevicePrimaryCtxRelease_v2", || {
        let mut s = state();
        let d = s.device(dev)?;
        if s.retained[d] == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        s.retained[d] -= 1;
        if s.retained.iter().all(|&r| r == 0) {
            // The last release destroys the context, and its sticky error with it.
            s.sticky = None;
        }
        Ok(())
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    guard("cuCtxSetCurrent", || {
        let s = state();
        s.config()?;
        let c = ctx as usize;
        // "If ctx is NULL then this is equivalent to popping the current context."
        if c != 0 {
            let d = context_device(c).ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            s.device(d as c_int)?;
        }
        state::CURRENT.with(|x| x.set(c));
        Ok(())
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    guard("cuCtxGetCurrent", || {
        state().config()?;
        put(pctx, state::CURRENT.with(|x| x.get()) as CUcontext)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    guard("cuCtxGetDevice", || {
        let d = state().current()?;
        put(device, d as CUdevice)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuCtxSynchronize() -> CUresult {
    // Work runs when it is enqueued: nothing is outstanding.
    guard("cuCtxSynchronize", || {
        let mut s = state();
        s.current()?;
        // Not permitted while any stream captures.
        let capturing: Vec<usize> = s.captures.keys().copied().collect();
        for c in capturing {
            s.no_capture(c, "cuCtxSynchronize")?;
        }
        s.flush_all()
    })
}

/// Each code this library returns: its name and documented description.
const ERRORS: [(CUresult, &str, &str); 19] = [
    (CUresult::CUDA_SUCCESS, "CUDA_SUCCESS\0", "no error\0"),
    (
        CUresult::CUDA_ERROR_INVALID_VALUE,
        "CUDA_ERROR_INVALID_VALUE\0",
        "invalid argument\0",
    ),
    (
        CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        "CUDA_ERROR_OUT_OF_MEMORY\0",
        "out of memory\0",
    ),
    (
        CUresult::CUDA_ERROR_NOT_INITIALIZED,
        "CUDA_ERROR_NOT_INITIALIZED\0",
        "initialization error\0",
    ),
    (
        CUresult::CUDA_ERROR_NO_DEVICE,
        "CUDA_ERROR_NO_DEVICE\0",
        "no CUDA-capable device is detected\0",
    ),
    (
        CUresult::CUDA_ERROR_INVALID_DEVICE,
        "CUDA_ERROR_INVALID_DEVICE\0",
        "invalid device ordinal\0",
    ),
    (
        CUresult::CUDA_ERROR_INVALID_IMAGE,
        "CUDA_ERROR_INVALID_IMAGE\0",
        "device kernel image is invalid\0",
    ),
    (
        CUresult::CUDA_ERROR_INVALID_CONTEXT,
        "CUDA_ERROR_INVALID_CONTEXT\0",
        "invalid device context\0",
    ),
    (
        CUresult::CUDA_ERROR_INVALID_PTX,
        "CUDA_ERROR_INVALID_PTX\0",
        "a PTX JIT compilation failed\0",
    ),
    (
        CUresult::CUDA_ERROR_INVALID_HANDLE,
        "CUDA_ERROR_INVALID_HANDLE\0",
        "invalid resource handle\0",
    ),
    (
        CUresult::CUDA_ERROR_NOT_FOUND,
        "CUDA_ERROR_NOT_FOUND\0",
        "named symbol not found\0",
    ),
    (
        CUresult::CUDA_ERROR_NOT_READY,
        "CUDA_ERROR_NOT_READY\0",
        "device not ready\0",
    ),
    (
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
        "CUDA_ERROR_ILLEGAL_ADDRESS\0",
        "an illegal memory access was encountered\0",
    ),
    (
        CUresult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
        "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES\0",
        "too many resources requested for launch\0",
    ),
    (
        CUresult::CUDA_ERROR_LAUNCH_FAILED,
        "CUDA_ERROR_LAUNCH_FAILED\0",
        "unspecified launch failure\0",
    ),
    (
        CUresult::CUDA_ERROR_NOT_SUPPORTED,
        "CUDA_ERROR_NOT_SUPPORTED\0",
        "operation not supported\0",
    ),
    (
        CUresult::CUDA_ERROR_INVALID_SOURCE,
        "CUDA_ERROR_INVALID_SOURCE\0",
        "device kernel image is invalid\0",
    ),
    (
        CUresult::CUDA_ERROR_DEINITIALIZED,
        "CUDA_ERROR_DEINITIALIZED\0",
        "driver shutting down\0",
    ),
    (
        CUresult::CUDA_ERROR_UNKNOWN,
        "CUDA_ERROR_UNKNOWN\0",
        "unknown error\0",
    ),
];

unsafe fn error_text(error: u32, out: *mut *const c_char, name: bool) -> CUresult {
    guard("cuGetErrorString", || {
        let hit = ERRORS.iter().find(|e| e.0 as u32 == error);
        match hit {
            Some(&(_, n, d)) => put(out, if name { n } else { d }.as_ptr() as *const c_char),
            None => {
                // "If the error code is not recognized, CUDA_ERROR_INVALID_VALUE will be
                // returned and *pStr will be set to the NULL address."
                let _ = put(out, std::ptr::null());
                Err(CUresult::CUDA_ERROR_INVALID_VALUE)
            }
        }
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuGetErrorString(error: u32, p: *mut *const c_char) -> CUresult {
    error_text(error, p, false)
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuGetErrorName(error: u32, p: *mut *const c_char) -> CUresult {
    error_text(error, p, true)
}
