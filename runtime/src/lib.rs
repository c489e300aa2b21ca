//! The Parallax runtime: executes compiled plans. The CPU backend is the oracle; the data
//! pipeline feeds it; randomness is keyed by (seed, purpose, index) throughout.

pub mod backend;
pub mod checkpoint;
pub mod collective;
pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod exec;
pub mod files;
pub mod finite;
pub mod gpu_check;
pub mod gpu_placement;
pub mod grid;
pub mod host_memory;
pub mod kernel_check;
pub mod launch;
pub mod loss_share;
pub mod ranks;
pub mod rendezvous;
pub mod report;
pub mod resume;
pub mod rng;
pub mod run_dir;
pub mod run_files;
pub mod run_record;
pub mod tensorboard;
pub mod train;
pub mod trained;
pub mod weights;

pub use parallax_compiler::Plan;
