//! An emulated GPU: a shared library exporting the CUDA driver's, cuBLAS's, cuBLASLt's and NCCL's C entry
//! points, with NVIDIA's documented semantics, over Parallax's PTX interpreter. Linked as
//! `libcuda.so` (and `libcublas.so`, ...) ahead of the real ones (`scripts/emulated-gpu`),
//! it lets the CUDA backend run, unchanged, with no GPU; every launch runs under the
//! interpreter's sanitizer, and the launch checks the real driver skips are made here
//! (block size, dynamic shared memory against the opt-in attribute).
//!
//! Files: `state` the process-wide state (devices, memory, handles) and the FFI guard;
//! `device` devices, contexts and error strings; `memory` allocations and copies;
//! `module` modules, functions and launches; `stream` streams and events; `ops` work on a
//! stream as a value (run, or recorded by a stream capture) and CUDA graphs; `cublas` the
//! cuBLAS GEMMs (column-major, over `parallax_emulator::blas`); `cublaslt` cuBLASLt's
//! descriptors, layouts, heuristic and matmul (with the bias epilogue), on the same GEMM;
//! `nccl` NCCL's entry points, `nccl_state` its communicators and groups (stream-ordered),
//! `nccl_wire` how ranks meet (files named by the unique id, in one process or several),
//! `nccl_reduce` its element types and reductions (in ascending rank order).
//!
//! Created streams queue their work until a synchronisation, an event wait or legacy-stream
//! work runs it (stale reads show missing synchronisation; `PARALLAX_EMULATED_STREAM_SEED`
//! draws the order of unordered streams' work, and runs some of it early); capture records
//! it instead; the documented capture rules are enforced (no capture of the legacy stream,
//! no legacy-stream work while a blocking stream captures, no synchronising a capture, no
//! allocation or synchronous copy by a thread whose capture's mode forbids it). A sanitizer
//! finding fails the launch with `CUDA_ERROR_LAUNCH_FAILED`, sticky as on a GPU, and names
//! the finding on stderr.

mod cublas;
mod cublaslt;
mod device;
mod memory;
mod module;
mod nccl;
mod nccl_reduce;
mod nccl_state;
mod nccl_wire;
mod ops;
mod state;
mod stream;

#[cfg(test)]
mod fault_tests;
#[cfg(test)]
mod nccl_tests;
#[cfg(test)]
mod tests;
