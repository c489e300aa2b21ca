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
    /// How much of `data`'s allocation [`Tensor::reshape_in_place`] left initialized.
    pub(crate) init: Initialized,
}

/// How many elements of one allocation hold values, however far its vector's length has
/// been cut since: an executor's buffer serves tensors of several sizes in a step (the
/// transformer bench's grew by 20 MB a step), and growing it back within them needs no
/// zeros. The allocation is named by its address, so a vector moved to another one (grown
/// past its capacity, cloned, replaced) is known by nothing (see [`Initialized::upto`]).
/// Equal to any other: not part of a tensor's value.
#[derive(Debug, Clone, Copy, Default)]
pub struct Initialized {
    at: usize,
    len: usize,
}

impl PartialEq for Initialized {
    fn eq(&self, _: &Initialized) -> bool {
        true
    }
}

impl Initialized {
    pub const NONE: Initialized = Initialized { at: 0, len: 0 };

    /// Elements of `v`'s allocation known to hold values: its length at least.
    fn upto<T>(self, v: &Vec<T>) -> usize {
        if self.at == v.as_ptr() as usize && self.len <= v.capacity() {
            self.len.max(v.len())
        } else {
            v.len()
        }
    }

    /// `v` at length `n`: cut, grown over values it held before, or grown with `zero`.
    fn resize<T: Copy>(&mut self, v: &mut Vec<T>, n: usize, zero: T) {
        let (known, at) = (self.upto(v), v.as_ptr() as usize);
        if n <= known {
            // SAFETY: within the capacity (`upto` checks it), and every element below
            // `known` was written while this allocation held it; `T: Copy` has no drop, so
            // cutting the length never touched them.
            unsafe { v.set_len(n) };
        } else {
            v.resize(n, zero);
        }
        // A vector grown past its capacity moved: only its new length holds values.
        let moved = at != v.as_ptr() as usize;
        *self = Initialized {
            at: v.as_ptr() as usize,
            len: if moved { n } else { known.max(n) },
        };
    }
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
        Tensor {
            data,
            shape,
            init: Initialized::NONE,
        }
    }

    pub fn from_f32(shape: Vec<usize>, v: Vec<f32>) -> Tensor {
        assert_eq!(numel(&shape), v.len(), "shape and data disagree");
        Tensor {
            data: Data::F32(v),
            shape,
            init: Initialized::NONE,
        }
    }

    pub fn from_i32(shape: Vec<usize>, v: Vec<i32>) -> Tensor {
        assert_eq!(numel(&shape), v.len(), "shape and data disagree");
        Tensor {
            data: Data::I32(v),
            shape,
            init: Initialized::NONE,
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
            Data::F32(v) => self.init.resize(v, n, 0.0),
            Data::I32(v) => self.init.resize(v, n, 0),
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

    /// A buffer cut and grown again within what its allocation held keeps those values (no
    /// pass of zeros); past them, and in a clone or a reallocated vector, it grows with zeros.
    #[test]
    fn growing_back_keeps_what_the_allocation_held_and_zeros_the_rest() {
        let mut t = Tensor::with_capacity(DType::F32, vec![4], 8);
        t.f32_mut().copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        t.reshape_in_place(&[2]);
        assert_eq!(t.f32(), &[1.0, 2.0]);
        t.reshape_in_place(&[2, 2]);
        assert_eq!(t.f32(), &[1.0, 2.0, 3.0, 4.0]);
        t.reshape_in_place(&[6]);
        assert_eq!(t.f32(), &[1.0, 2.0, 3.0, 4.0, 0.0, 0.0]);
        t.f32_mut()[5] = 6.0;
        t.reshape_in_place(&[1]);
        t.reshape_in_place(&[6]);
        assert_eq!(t.f32(), &[1.0, 2.0, 3.0, 4.0, 0.0, 6.0]);
        // A clone is another allocation, holding its length: within it, its values; grown
        // past it from a shorter length, zeros from there.
        let mut c = t.clone();
        c.reshape_in_place(&[1]);
        c.reshape_in_place(&[3]);
        assert_eq!(c.f32(), &[1.0, 2.0, 3.0]);
        c.reshape_in_place(&[1]);
        c.reshape_in_place(&[8]);
        assert_eq!(c.f32(), &[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        // Past the capacity the vector moves: the values up to its length and zeros after.
        t.reshape_in_place(&[2]);
        t.reshape_in_place(&[100]);
        assert_eq!(&t.f32()[..2], &[1.0, 2.0]);
        assert!(t.f32()[2..].iter().all(|&x| x == 0.0));
        // Integers alike, from a vector made elsewhere.
        let mut i = Tensor::from_i32(vec![3], vec![7, 8, 9]);
        i.reshape_in_place(&[1]);
        i.reshape_in_place(&[3]);
        assert_eq!(i.i32(), &[7, 8, 9]);
    }

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
