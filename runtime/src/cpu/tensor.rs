//! Host tensors: a buffer of f32 or i32 and its concrete shape.

use parallax_compiler::ir::DType;

#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tensor {
    pub data: Data,
    pub shape: Vec<usize>,
}

impl Default for Data {
    fn default() -> Self {
        Data::F32(Vec::new())
    }
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl Tensor {
    /// A zero tensor of `dtype` with room for `capacity` elements, shaped `shape`.
    pub fn with_capacity(dtype: DType, shape: Vec<usize>, capacity: usize) -> Tensor {
        let n = numel(&shape);
        let data = if dtype.is_float() {
            let mut v = Vec::with_capacity(capacity.max(n));
            v.resize(n, 0.0);
            Data::F32(v)
        } else {
            let mut v = Vec::with_capacity(capacity.max(n));
            v.resize(n, 0);
            Data::I32(v)
        };
        Tensor { data, shape }
    }

    pub fn from_f32(shape: Vec<usize>, v: Vec<f32>) -> Tensor {
        assert_eq!(numel(&shape), v.len(), "shape and data disagree");
        Tensor {
            data: Data::F32(v),
            shape,
        }
    }

    pub fn from_i32(shape: Vec<usize>, v: Vec<i32>) -> Tensor {
        assert_eq!(numel(&shape), v.len(), "shape and data disagree");
        Tensor {
            data: Data::I32(v),
            shape,
        }
    }

    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// Bytes its allocation holds (capacity, not the current shape).
    pub fn allocated_bytes(&self) -> u64 {
        match &self.data {
            Data::F32(v) => v.capacity() as u64 * 4,
            Data::I32(v) => v.capacity() as u64 * 4,
        }
    }

    /// Reshapes within the allocated capacity (never allocates in steady state).
    pub fn reshape_in_place(&mut self, shape: &[usize]) {
        let n = numel(shape);
        match &mut self.data {
            Data::F32(v) => v.resize(n, 0.0),
            Data::I32(v) => v.resize(n, 0),
        }
        self.shape.clear();
        self.shape.extend_from_slice(shape);
    }

    pub fn f32(&self) -> &[f32] {
        match &self.data {
            Data::F32(v) => v,
            Data::I32(_) => &[],
        }
    }

    pub fn f32_mut(&mut self) -> &mut [f32] {
        match &mut self.data {
            Data::F32(v) => v,
            Data::I32(_) => &mut [],
        }
    }

    pub fn i32(&self) -> &[i32] {
        match &self.data {
            Data::I32(v) => v,
            Data::F32(_) => &[],
        }
    }

    pub fn i32_mut(&mut self) -> &mut [i32] {
        match &mut self.data {
            Data::I32(v) => v,
            Data::F32(_) => &mut [],
        }
    }

    pub fn is_f32(&self) -> bool {
        matches!(self.data, Data::F32(_))
    }
}
