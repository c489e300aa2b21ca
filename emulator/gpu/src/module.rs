//! Modules from PTX text, their functions, and launches on the interpreter (the driver
//! API's "Module Management", "Execution Control" groups). Checks the real driver does not
//! make: each parameter is read with the size of the entry's `.param` list; besides the
//! documented limits (block size, grid size, dynamic shared memory against
//! `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`), every launch runs under the
//! sanitizer, and a finding fails it (`CUDA_ERROR_LAUNCH_FAILED`, sticky, named on stderr).

use crate::device::attribute;
use crate::ops::Op;
use crate::state::{guard, put, state, Function, DEFAULT_SHARED, OPTIN_SHARED};
use cudarc::driver::sys::{
    CUdevice_attribute as D, CUfunction, CUfunction_attribute as F, CUmodule, CUresult, CUstream,
};
use parallax_emulator::parse::ParamKind;
use parallax_emulator::{Module, ParamValue};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Arc, OnceLock};

#[no_mangle]
pub(crate) unsafe extern "C" fn cuModuleLoadData(
    module: *mut CUmodule,
    image: *const c_void,
) -> CUresult {
    guard("cuModuleLoadData", || {
        let mut s = state();
        s.current()?;
        if image.is_null() || module.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // Only PTX text (NUL-terminated) is understood: no cubin or fatbin.
        let text = CStr::from_ptr(image as *const c_char)
            .to_str()
            .map_err(|_| {
                eprintln!("emulated GPU: cuModuleLoadData: the image is not PTX text");
                CUresult::CUDA_ERROR_INVALID_IMAGE
            })?;
        let m = Module::parse(text).map_err(|e| {
            eprintln!("emulated GPU: cuModuleLoadData: the PTX does not parse: {e}");
            CUresult::CUDA_ERROR_INVALID_PTX
        })?;
        let h = s.handle();
        s.modules.insert(h, (Arc::new(m), Vec::new()));
        put(module, h as CUmodule)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuModuleUnload(hmod: CUmodule) -> CUresult {
    guard("cuModuleUnload", || {
        let mut s = state();
        s.current()?;
        let (_, functions) = s
            .modules
            .remove(&(hmod as usize))
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        for f in functions {
            s.functions.remove(&f);
        }
        Ok(())
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuModuleGetFunction(
    hfunc: *mut CUfunction,
    hmod: CUmodule,
    name: *const c_char,
) -> CUresult {
    guard("cuModuleGetFunction", || {
        let mut s = state();
        s.current()?;
        if name.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let name = CStr::from_ptr(name).to_string_lossy().into_owned();
        let module = s
            .modules
            .get(&(hmod as usize))
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?
            .0
            .clone();
        let shared = module
            .static_shared(&name)
            .ok_or(CUresult::CUDA_ERROR_NOT_FOUND)?;
        let h = s.handle();
        let f = Function {
            module,
            entry: name,
            max_dynamic: DEFAULT_SHARED.saturating_sub(shared),
        };
        s.functions.insert(h, f);
        if let Some(m) = s.modules.get_mut(&(hmod as usize)) {
            m.1.push(h);
        }
        put(hfunc, h as CUfunction)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuFuncSetAttribute(
    hfunc: CUfunction,
    attrib: c_int,
    value: c_int,
) -> CUresult {
    guard("cuFuncSetAttribute", || {
        let mut s = state();
        s.current()?;
        let f = s
            .functions
            .get_mut(&(hfunc as usize))
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        let shared = f.module.static_shared(&f.entry).unwrap_or(0);
        if attrib == F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as c_int {
            // "The sum of this value and the function attribute
            // CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES cannot exceed the device attribute
            // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN."
            if value < 0 || value as u64 + u64::from(shared) > u64::from(OPTIN_SHARED) {
                eprintln!(
                    "emulated GPU: cuFuncSetAttribute(`{}`, MAX_DYNAMIC_SHARED_SIZE_BYTES, {value}): \
                     with {shared} bytes of static shared memory this exceeds the device's {OPTIN_SHARED}",
                    f.entry
                );
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            f.max_dynamic = value as u32;
            Ok(())
        } else if attrib == F::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT as c_int {
            if (-1..=100).contains(&value) {
                Ok(())
            } else {
                Err(CUresult::CUDA_ERROR_INVALID_VALUE)
            }
        } else {
            Err(CUresult::CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuFuncGetAttribute(
    pi: *mut c_int,
    attrib: c_int,
    hfunc: CUfunction,
) -> CUresult {
    guard("cuFuncGetAttribute", || {
        let s = state();
        s.current()?;
        let f = s
            .functions
            .get(&(hfunc as usize))
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        let is = |x: F| attrib == x as c_int;
        let v = if is(F::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK) {
            1024
        } else if is(F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) {
            f.module.static_shared(&f.entry).unwrap_or(0) as c_int
        } else if is(F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
            f.max_dynamic as c_int
        } else if is(F::CU_FUNC_ATTRIBUTE_PTX_VERSION) || is(F::CU_FUNC_ATTRIBUTE_BINARY_VERSION) {
            90
        } else if is(F::CU_FUNC_ATTRIBUTE_NUM_REGS) {
            32
        } else {
            0
        };
        put(pi, v)
    })
}

/// `len` bytes of this process's memory at `p`, or `None` where they are not mapped. A
/// `kernelParams` array shorter than the entry's `.param` list (a launch parameter dropped)
/// is read past its end, as the real driver would read it: that must fail the launch, not
/// crash the process, so the reads go through `/proc/self/mem`, which reports unmapped
/// addresses as errors.
fn host_bytes(p: usize, len: usize) -> Option<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    static MEM: OnceLock<Option<std::fs::File>> = OnceLock::new();
    let mut buf = vec![0u8; len];
    match MEM.get_or_init(|| std::fs::File::open("/proc/self/mem").ok()) {
        Some(mem) => mem.read_exact_at(&mut buf, p as u64).ok().map(|_| buf),
        // SAFETY: without /proc, the caller's promise that `p` holds `len` bytes is taken.
        None => Some(unsafe { std::slice::from_raw_parts(p as *const u8, len) }.to_vec()),
    }
}

/// The launch's parameter values, each read with its declared size from `params[i]`.
fn read_params(
    entry: &str,
    kinds: &[ParamKind],
    params: *mut *mut c_void,
) -> Result<Vec<ParamValue>, CUresult> {
    if kinds.is_empty() {
        return Ok(Vec::new());
    }
    let unreadable = |i: usize, what: &str| {
        eprintln!(
            "emulated GPU: cuLaunchKernel(`{entry}`): parameter {i} of the {} its `.param` list \
             declares: {what} (fewer parameters passed than declared?)",
            kinds.len()
        );
        CUresult::CUDA_ERROR_INVALID_VALUE
    };
    if params.is_null() {
        return Err(unreadable(0, "kernelParams is null"));
    }
    let mut out = Vec::with_capacity(kinds.len());
    for (i, k) in kinds.iter().enumerate() {
        let slot = params as usize + i * std::mem::size_of::<*mut c_void>();
        let p = host_bytes(slot, 8)
            .map(|b| usize::from_le_bytes(b.try_into().unwrap_or_default()))
            .ok_or_else(|| unreadable(i, "its pointer cannot be read"))?;
        if p == 0 {
            return Err(unreadable(i, "its pointer is null"));
        }
        let bytes = host_bytes(p, k.size() as usize)
            .ok_or_else(|| unreadable(i, &format!("its value at {p:#x} cannot be read")))?;
        let word = |n: usize| {
            let mut b = [0u8; 8];
            b[..n].copy_from_slice(&bytes[..n]);
            u64::from_le_bytes(b)
        };
        out.push(match k {
            ParamKind::U64 => ParamValue::U64(word(8)),
            ParamKind::U32 => ParamValue::U32(word(4) as u32),
            ParamKind::F32 => ParamValue::F32(f32::from_bits(word(4) as u32)),
            ParamKind::Bytes(_) => ParamValue::Bytes(bytes),
        });
    }
    Ok(out)
}

/// The documented launch limits (`CUDA_ERROR_INVALID_VALUE` past any).
fn check_limits(f: &Function, grid: [u32; 3], block: [u32; 3], shared: u32) -> Result<(), String> {
    let dev = |a: D| attribute(a as c_int, 132) as u64;
    let threads: u64 = block.iter().map(|&b| u64::from(b)).product();
    let block_max = [
        D::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X,
        D::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y,
        D::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z,
    ];
    let grid_max = [
        D::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X,
        D::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y,
        D::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z,
    ];
    if threads == 0 || grid.contains(&0) {
        return Err(format!(
            "grid {grid:?} x block {block:?} has a zero dimension"
        ));
    }
    if threads > dev(D::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK) {
        return Err(format!(
            "block {block:?} has {threads} threads; the limit is 1024"
        ));
    }
    for i in 0..3 {
        if u64::from(block[i]) > dev(block_max[i]) || u64::from(grid[i]) > dev(grid_max[i]) {
            return Err(format!(
                "grid {grid:?} x block {block:?} exceeds the device's dimension limits"
            ));
        }
    }
    if shared > f.max_dynamic {
        return Err(format!(
            "{shared} bytes of dynamic shared memory exceed the function's \
             MAX_DYNAMIC_SHARED_SIZE_BYTES ({}; raise it with cuFuncSetAttribute)",
            f.max_dynamic
        ));
    }
    Ok(())
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn cuLaunchKernel(
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guard("cuLaunchKernel", || {
        let mut s = state();
        s.current()?;
        s.stream(stream as usize)?;
        let func = s
            .functions
            .get(&(f as usize))
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        let (module, entry) = (func.module.clone(), func.entry.clone());
        if !extra.is_null() {
            eprintln!("emulated GPU: cuLaunchKernel(`{entry}`): `extra` is not supported");
            return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
        }
        let (grid, block) = ([grid_x, grid_y, grid_z], [block_x, block_y, block_z]);
        if let Err(m) = check_limits(func, grid, block, shared) {
            eprintln!("emulated GPU: cuLaunchKernel(`{entry}`): {m}");
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let kinds = module.params(&entry).unwrap_or_default();
        let op = Op::Launch {
            params: read_params(&entry, &kinds, params)?,
            module,
            entry,
            grid,
            block,
            shared,
        };
        s.submit(stream as usize, op)
    })
}
