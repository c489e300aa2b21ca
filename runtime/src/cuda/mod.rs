//! The CUDA backend: GPU detection that never panics, the executor of compiled plans
//! (generated PTX kernels, cuBLAS and cuBLASLt GEMMs, buffers from the plan's memory assignment), and
//! NCCL collectives. Every library is opened at run time (`cudarc`'s dynamic loading), so
//! nothing CUDA is needed to build or test the rest of Parallax.

mod backend;
mod exec;
mod gemm;
pub mod graph;
mod launch;
mod lt;
pub mod nccl;
pub mod nccl_comm;
pub mod nccl_tree;
mod plant;
mod stepwise;
pub mod tree_check;

pub use cudarc;
pub use exec::{codegen_options, CudaExecutor, Precision};
pub use stepwise::{Loan, StepCtx};

use cudarc::driver::{result, sys};

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver: libcuda.so was not found (is the NVIDIA driver installed and on the library path?)")]
    NoDriver,
    #[error("no usable GPU: {0}")]
    NoDevice(String),
    #[error("the CUDA backend needs {needed} GPU(s), but {found} {verb} found", verb = if *found == 1 { "was" } else { "were" })]
    TooFewGpus { needed: usize, found: usize },
    #[error("{library} was not found: {hint}")]
    MissingLibrary {
        library: &'static str,
        hint: &'static str,
    },
    #[error("CUDA: {0}")]
    Driver(String),
    #[error("cuBLAS: {0}")]
    Blas(String),
    #[error("NCCL: {0}")]
    Nccl(String),
    #[error("the GPU rejected kernel `{kernel}` of the generated PTX: {message}")]
    PtxLoad { kernel: String, message: String },
    #[error("out of GPU memory allocating {bytes} bytes for `{tensor}` (the plan predicted a peak of {predicted} bytes; {free} bytes were free)")]
    OutOfMemory {
        tensor: String,
        bytes: u64,
        predicted: u64,
        free: u64,
    },
    #[error("the plan needs {needed} bytes of memory on GPU {gpu} ({what}, the scratch and the bf16 staging), but {free} of its {total} bytes are free: nothing was allocated (a smaller batch or model, or more GPUs, would fit)")]
    PlanTooLarge {
        gpu: usize,
        needed: u64,
        what: String,
        free: u64,
        total: u64,
    },
    #[error("code generation: {0}")]
    Codegen(#[from] parallax_compiler::codegen::CodegenError),
    #[error("{0}")]
    Exec(String),
}

impl From<result::DriverError> for CudaError {
    fn from(e: result::DriverError) -> Self {
        CudaError::Driver(format!("{e:?}"))
    }
}

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
    let nccl_version = nccl::version();
    Ok(Devices {
        gpus,
        driver_cuda_version: version,
        cublas,
        nccl_version,
    })
}

/// The PTX target for a compute capability: `sm_90` on Hopper and later, else `sm_80`.
pub fn target_for(cc: (i32, i32)) -> &'static str {
    if cc.0 >= 9 {
        "sm_90"
    } else {
        "sm_80"
    }
}
