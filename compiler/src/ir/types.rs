//! Tensor types: an element type and a shape of [`Dim`]s.

use super::dim::{product, Dim};
use serde::Serialize;

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
pub enum DType {
    F32,
    BF16,
    F16,
    I32,
    I64,
}

impl DType {
    pub fn bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<Dim>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: Vec<Dim>) -> Self {
        TensorType { dtype, shape }
    }
    pub fn f32(shape: Vec<Dim>) -> Self {
        TensorType::new(DType::F32, shape)
    }
    pub fn scalar(dtype: DType) -> Self {
        TensorType::new(dtype, Vec::new())
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    /// The number of elements, `None` on overflow.
    pub fn numel(&self) -> Option<Dim> {
        product(&self.shape)
    }
    /// `f32[B, 64]`, with symbol names from `names`.
    pub fn show(&self, names: &[String]) -> String {
        let dims: Vec<String> = self.shape.iter().map(|d| d.show(names)).collect();
        format!("{}[{}]", self.dtype.name(), dims.join(", "))
    }
    /// Concrete sizes with every symbol valued by `value`.
    pub fn concrete(&self, value: &dyn Fn(super::dim::Sym) -> u64) -> Vec<u64> {
        self.shape.iter().map(|d| d.eval(value)).collect()
    }
}
