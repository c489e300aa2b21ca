//! What every executor and the code around them share: host tensors, the mode of a step, and
//! the errors of running one (the CPU executor's, a rank's exchanges, another backend's). The
//! CPU executor, the CUDA executor, the ranks and training all speak these types.

pub mod finite;
pub mod grid;
pub mod host_memory;
pub mod launch_args;
mod rank;
pub mod tensor;

pub use rank::{DeviceSum, RankExecutor, SumCall};

use parallax_compiler::ir::Phase;
use parallax_compiler::Plan;

/// The label of a position that does not count (PyTorch's default `ignore_index`).
pub const IGNORE: i32 = -100;

/// Why a kernel could not run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KernelError {
    #[error("the CPU backend has no kernel for `{0}` yet")]
    Unsupported(&'static str),
    #[error("`{op}`: {message}")]
    Bad { op: &'static str, message: String },
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("step {step} (`{op}` in layer `{layer}`): {source}")]
    Kernel {
        step: usize,
        op: &'static str,
        layer: String,
        source: KernelError,
    },
    #[error("the plan has no input named `{0}`")]
    UnknownInput(String),
    #[error("input `{name}`: expected {expected} values of {dtype}, got {got}")]
    InputSize {
        name: String,
        expected: usize,
        got: usize,
        dtype: &'static str,
    },
    #[error("the batch of {batch} is larger than the {max} the executor was sized for")]
    BatchTooLarge { batch: usize, max: usize },
    #[error(
        "output `{0}` is kept by an eval step only: a training step writes the loss's gradient over it (read it after an eval step)"
    )]
    OutputNotKept(String),
    #[error("parameter `{name}`: {message}")]
    Param { name: String, message: String },
    /// From another backend behind the same interface (`backend::Backend`).
    #[error("{0}")]
    Device(String),
    /// The CUDA executor, driven step by step by a rank (`cuda::stepwise`): the plan step it
    /// was at and what CUDA reported (boxed: `exec` sits below `cuda` in the crate's layers).
    #[error("step {step} ({what}) on the GPU: {source}")]
    Cuda {
        step: usize,
        what: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A rank's exchange with the others (rank threads, or processes).
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),
}

/// Training runs every step and applies the updates; `Gradients` runs the forward and
/// backward steps as training does but changes nothing (gradient checks); evaluation runs the
/// forward steps with dropout off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    Train,
    Gradients,
    Eval,
}

impl Mode {
    /// Whether kernel `k` of `plan` runs in this mode (by the phase of its last step); every
    /// backend asks this.
    pub fn runs(self, plan: &Plan, k: usize) -> bool {
        let kern = &plan.kernels[k];
        let phase = plan.steps[*kern.steps.last().expect("a kernel has steps")].phase;
        match self {
            Mode::Train => true,
            Mode::Gradients => phase != Phase::Update,
            Mode::Eval => phase == Phase::Forward,
        }
    }
}
