//! The Parallax runtime: executes compiled plans. The backends (CPU, the oracle; CUDA),
//! the collectives, the data pipeline, training, checkpoints and metrics arrive with the
//! issues that build them; this crate fixes where they live.

pub mod backend {
    //! Executors of a plan.

    /// Where a plan runs.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum BackendKind {
        Cpu,
        Cuda,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the {0:?} backend is not built yet")]
    NotBuilt(backend::BackendKind),
}

pub use parallax_compiler::Plan;
