//! The checks a GPU machine runs against the CPU oracle: `gpu` the CUDA backend's
//! conformance (`gpu-check`), `collectives` the collectives (`collectives-check`), `kernels`
//! each generated kernel on the device or the PTX interpreter (`check-kernels`, `gpu-check
//! --lockstep`), `nccl_tree` the fixed-tree all-reduce over NCCL against the host's sum.

pub mod collectives;
pub mod gpu;
pub mod kernels;
pub mod nccl_tree;
