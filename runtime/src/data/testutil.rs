//! Helpers for the data tests: temporary directories and model descriptions.

use super::{DType, ModelIo, TensorSpec};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A directory under the system's temp dir, removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("parallax-data-{}-{name}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
    /// Writes `bytes` to `name` in the directory and returns the file's path.
    pub fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A classifier: input `dtype[shape]`, one integer label per sample below `classes`.
pub fn classify(dtype: DType, shape: Vec<usize>, classes: usize) -> ModelIo {
    ModelIo {
        input: TensorSpec::new(dtype, shape),
        target: TensorSpec::new(DType::I32, vec![]),
        classes: Some(classes),
        input_range: None,
    }
}

/// A regression model: `f32[input]` in, `f32[target]` out (MSE).
pub fn regress(input: Vec<usize>, target: Vec<usize>) -> ModelIo {
    ModelIo {
        input: TensorSpec::new(DType::F32, input),
        target: TensorSpec::new(DType::F32, target),
        classes: None,
        input_range: None,
    }
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// The message of the error `r` must be (the tests check what it names).
pub fn err_text<T, E: std::fmt::Display>(r: Result<T, E>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}
