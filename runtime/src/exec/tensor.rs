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

/// Part `index` of `parts` equal slices of `full` (shaped `shape`) along `axis`.
pub fn slice_part(
    full: &[f32],
    shape: &[usize],
    axis: usize,
    parts: usize,
    index: usize,
) -> Vec<f32> {
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let chunk = shape[axis] / parts.max(1) * inner;
    let row = shape[axis] * inner;
    let mut out = Vec::with_capacity(outer * chunk);
    for o in 0..outer {
        let at = o * row + index * chunk;
        out.extend_from_slice(&full[at..at + chunk]);
    }
    out
}

/// The inverse of `slice_part`: the whole tensor from its slices (each shaped `part_shape`)
/// along `axis`.
pub fn join_parts(parts: &[Vec<f32>], part_shape: &[usize], axis: usize) -> Vec<f32> {
    let outer: usize = part_shape[..axis].iter().product();
    let chunk: usize = part_shape[axis..].iter().product();
    let mut out = Vec::with_capacity(chunk * outer * parts.len());
    for o in 0..outer {
        for p in parts {
            out.extend_from_slice(&p[o * chunk..(o + 1) * chunk]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_join_back_to_the_whole() {
        let full: Vec<f32> = (0..24).map(|i| i as f32).collect();
        for (shape, axis) in [(vec![4, 6], 0), (vec![4, 6], 1), (vec![2, 6, 2], 1)] {
            let parts: Vec<Vec<f32>> = (0..2)
                .map(|i| slice_part(&full, &shape, axis, 2, i))
                .collect();
            let mut part_shape = shape.clone();
            part_shape[axis] /= 2;
            assert_eq!(
                join_parts(&parts, &part_shape, axis),
                full,
                "{shape:?} {axis}"
            );
        }
        assert_eq!(slice_part(&full, &[4, 6], 1, 2, 1)[..3], [3.0, 4.0, 5.0]);
    }
}
