//! Helpers shared by the kernels' tests.

use crate::cpu::tensor::{numel, Tensor};
use crate::rng::{stream, uniform, Purpose};

/// Uniform in [-1, 1), keyed by `(seed, tag)`.
pub fn uniform_tensor(seed: u64, shape: &[usize], tag: u64) -> Tensor {
    let s = stream(seed, Purpose::Synthetic, tag);
    let v = (0..numel(shape) as u64)
        .map(|i| uniform(s, i) * 2.0 - 1.0)
        .collect();
    Tensor::from_f32(shape.to_vec(), v)
}

pub fn zeros(shape: &[usize]) -> Tensor {
    Tensor::from_f32(shape.to_vec(), vec![0.0; numel(shape)])
}

/// Runs `f` on a rayon pool of `threads` threads (determinism tests).
pub fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}
