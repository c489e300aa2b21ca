//! The Parallax runtime: executes compiled plans. The CPU backend is the oracle; the data
//! pipeline feeds it; randomness is keyed by (seed, purpose, index) throughout.

pub mod backend;
pub mod checks;
pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod exec;
pub mod ranks;
pub mod rng;
pub mod run;
pub mod train;
pub mod trained;

pub use parallax_compiler::Plan;
