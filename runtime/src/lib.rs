//! The Parallax runtime: executes compiled plans. The CPU backend is the oracle; the data
//! pipeline feeds it; randomness is keyed by (seed, purpose, index) throughout.

pub mod cpu;
pub mod data;
pub mod rng;
pub mod train;
pub mod weights;

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
