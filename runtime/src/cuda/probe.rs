//! What this machine has: its GPUs (never panicking where there is no driver or no GPU), the
//! driver's CUDA version, and whether cuBLAS and NCCL can be opened.

use super::CudaError;
use cudarc::driver::{result, sys};

/// What `parallax devices` shows of one GPU.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub memory_bytes: u64,
    pub compute_capability: (i32, i32),
}

/// The GPUs and the versions of the libraries found.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Devices {
    pub gpus: Vec<GpuInfo>,
    /// `13000` for CUDA 13.0.
    pub driver_cuda_version: i32,
    pub cublas: bool,
    /// `22703` for NCCL 2.27.3, when libnccl is found.
    pub nccl_version: Option<i32>,
}

/// What `parallax devices` prints: the versions, then a line per GPU.
impl std::fmt::Display for Devices {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let v = |x: i32| format!("{}.{}", x / 1000, x % 1000 / 10);
        let nccl = self.nccl_version.map_or("not found".to_string(), |n| {
            format!("{}.{}.{}", n / 10000, n / 100 % 100, n % 100)
        });
        let cublas = if self.cublas { "found" } else { "not found" };
        let cuda = v(self.driver_cuda_version);
        writeln!(
            f,
            "CUDA driver supports CUDA {cuda}; cuBLAS {cublas}; NCCL {nccl}"
        )?;
        for g in &self.gpus {
            let (major, minor) = g.compute_capability;
            let gib = g.memory_bytes as f64 / (1u64 << 30) as f64;
            let name = &g.name;
            writeln!(
                f,
                "GPU {}: {name}, {gib:.1} GiB, compute capability {major}.{minor}",
                g.ordinal
            )?;
        }
        Ok(())
    }
}

/// Whether libcuda can be opened (checked first: every cudarc call panics without it).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// Finds the GPUs, or says why none is usable. Never panics.
pub fn probe() -> Result<Devices, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    result::init().map_err(|e| CudaError::NoDevice(format!("cuInit failed: {e:?}")))?;
    let n = result::device::get_count()
        .map_err(|e| CudaError::NoDevice(format!("cuDeviceGetCount failed: {e:?}")))?;
    if n <= 0 {
        return Err(CudaError::NoDevice("the driver reports no device".into()));
    }
    let mut gpus = Vec::new();
    for ordinal in 0..n {
        let dev = result::device::get(ordinal)?;
        let name = result::device::get_name(dev)?;
        // SAFETY: `dev` is a device handle the driver just returned.
        let memory_bytes = unsafe { result::device::total_mem(dev)? } as u64;
        let attr = |a| unsafe { result::device::get_attribute(dev, a) };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        gpus.push(GpuInfo {
            ordinal: ordinal as usize,
            name,
            memory_bytes,
            compute_capability: (major, minor),
        });
    }
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
    // SAFETY: only tries to open the libraries.
    let cublas = unsafe { cudarc::cublas::sys::is_culib_present() };
    let nccl_version = nccl_version();
    Ok(Devices {
        gpus,
        driver_cuda_version: version,
        cublas,
        nccl_version,
    })
}

/// NCCL's version (`22703` for 2.27.3), when libnccl can be opened.
pub fn nccl_version() -> Option<i32> {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return None;
    }
    cudarc::nccl::result::get_nccl_version().ok()
}
