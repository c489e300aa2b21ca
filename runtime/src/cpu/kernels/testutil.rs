//! Helpers shared by the kernels' tests.

use crate::cpu::kernels::KernelError;
use crate::cpu::tensor::{numel, Tensor};
use crate::rng::{normal, stream, uniform, Purpose};

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

/// The message of `e`, which must be a `KernelError::Bad` from `op`.
pub fn bad_message(e: KernelError, op: &str) -> String {
    let KernelError::Bad { op: from, message } = e else {
        panic!("{e:?}")
    };
    assert_eq!(from, op);
    message
}

/// Runs `f` on a rayon pool of `threads` threads (determinism tests).
pub fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

/// Standard normal values, keyed by `n`.
pub fn randn(n: u64, shape: &[usize]) -> Tensor {
    let s = stream(11, Purpose::Synthetic, n);
    let v = (0..numel(shape)).map(|i| normal(s, i as u64)).collect();
    Tensor::from_f32(shape.to_vec(), v)
}

/// The multi-index of flat index `i` in `shape` (row-major).
pub fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for k in (0..shape.len()).rev() {
        idx[k] = i % shape[k];
        i /= shape[k];
    }
    idx
}

pub fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |a, (&i, &n)| a * n + i)
}

pub fn dot(a: &Tensor, b: &Tensor) -> f64 {
    a.f32()
        .iter()
        .zip(b.f32())
        .map(|(&x, &y)| x as f64 * y as f64)
        .sum()
}

/// `|got - want| <= tol * (1 + |want|)` everywhere.
pub fn assert_close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: got {g}, want {w}"
        );
    }
}

pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.f32().iter().map(|&v| v as f64).collect()
}

/// `|got - want| <= rel * (1 + |want|)` elementwise, naming `what` on a failure.
pub fn assert_near(got: &[f32], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= rel * (1.0 + w.abs()),
            "{what}, element {i}: got {g}, want {w}"
        );
    }
}
