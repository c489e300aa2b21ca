//! What the timing examples share.

#[allow(dead_code)] // only `gemm_speed` compares libraries
pub mod blas;
pub mod peak;

use parallax_runtime::cpu::tensor::Tensor;

/// A tensor of `shape` filled with values in [-0.5, 0.5) from a multiplicative hash of
/// each index and `seed`: the same on every run, no zeros or repeats to flatter a kernel.
#[allow(dead_code)] // `fma_peak` shares `common` without it
pub fn filled(shape: Vec<usize>, seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8;
            x as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect();
    Tensor::from_f32(shape, v)
}

/// Flushes `data`'s cache lines from every level of the cache, so that a timed kernel reads
/// it from memory as a step's kernels read what earlier kernels wrote long before (`COLD`).
#[allow(dead_code)] // not every example flushes
pub fn evict(data: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: every address lies inside `data`; a fence has no preconditions.
    unsafe {
        use std::arch::x86_64::{_mm_clflush, _mm_mfence};
        for i in (0..data.len()).step_by(16) {
            _mm_clflush(data.as_ptr().add(i).cast());
        }
        _mm_mfence();
    }
}
