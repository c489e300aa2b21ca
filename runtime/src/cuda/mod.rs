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
mod memory;
mod module;
pub mod nccl;
mod plant;
mod probe;
mod stepwise;

pub use cudarc;
pub use exec::CudaExecutor;
pub use gemm::Precision;
pub use memory::Loan;
pub use module::codegen_options;
pub use probe::{driver_present, probe, Devices, GpuInfo};
pub use stepwise::StepCtx;

use cudarc::driver::result;

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

/// The PTX target for a compute capability: `sm_90` on Hopper and later, else `sm_80`.
pub fn target_for(cc: (i32, i32)) -> &'static str {
    if cc.0 >= 9 {
        "sm_90"
    } else {
        "sm_80"
    }
}
