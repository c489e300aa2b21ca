//! Where attention's operands live: the sizes of a problem set (`Dims`), a problem's rows
//! inside a token-major tensor (`Rows`, packed contiguous on demand), where a task's output
//! rows go (`Out`), and the per-thread scratch the tasks work in.

use super::super::gemm::{check_f32, transpose_into, View};
use super::super::{scratch, KernelError};
use super::KEY_TILE as TILE;
use crate::cpu::tensor::Tensor;
use parallax_compiler::ir::attention::Sizes;
use rayon::prelude::*;

/// The sizes of one attention: `problems` (batch times `heads`) independent problems of `t`
/// queries and `s` keys of width `d`, values of width `e`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    pub problems: usize,
    pub heads: usize,
    pub t: usize,
    pub s: usize,
    pub d: usize,
    pub e: usize,
    pub causal: bool,
    pub scale: f32,
}

pub(super) fn bad(op: &'static str, message: String) -> KernelError {
    KernelError::Bad { op, message }
}

impl Dims {
    /// Checks `q [.., T, H, D]`, `k [.., S, H, D]`, `v [.., S, H, E]` (f32, one batch shape).
    pub fn of(
        op: &'static str,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        causal: bool,
        scale: f64,
    ) -> Result<Dims, KernelError> {
        for (what, t) in [("q", q), ("k", k), ("v", v)] {
            check_f32(op, what, t)?;
        }
        let sz = Sizes::of(&q.shape, &k.shape, Some(&v.shape), causal).map_err(|m| bad(op, m))?;
        let dims = Dims {
            problems: sz.problems as usize,
            heads: sz.heads as usize,
            t: sz.t as usize,
            s: sz.s as usize,
            d: sz.d as usize,
            e: sz.e as usize,
            causal,
            scale: scale as f32,
        };
        Ok(dims)
    }

    /// Where row `i` of problem `g` starts in a tensor of `len` rows per problem, `width`
    /// wide: `[b, i, h, ..]` for `g = b * heads + h`.
    pub(super) fn at(&self, g: usize, i: usize, len: usize, width: usize) -> usize {
        ((g / self.heads * len + i) * self.heads + g % self.heads) * width
    }

    /// Rows `[i0, i1)` of problem `g` as a strided matrix (rows `heads * width` apart).
    pub(super) fn rows<'a>(
        &self,
        x: &'a [f32],
        g: usize,
        (i0, i1): (usize, usize),
        len: usize,
        width: usize,
    ) -> Rows<'a> {
        let stride = self.heads * width;
        let data = if i1 > i0 {
            let first = self.at(g, i0, len, width);
            &x[first..first + (i1 - i0 - 1) * stride + width]
        } else {
            &[]
        };
        Rows {
            data,
            stride,
            width,
        }
    }

    /// Runs `f` with tensors every task reads whole (`(x, len, width, layout)`: `len` rows
    /// per problem, `width` wide) copied once per kernel, rather than once per task, into
    /// this thread's kept scratch, in the layout given (see [`Layout`]), and for each the
    /// sizes that address it (one head when copied). With one head a head-major tensor is
    /// so already, and is lent as it is; so is one that a single task reads (`once`: one
    /// tile per problem), whose copy would be a pass over it for nothing.
    pub(super) fn packed<R, const N: usize>(
        &self,
        xs: [(&[f32], usize, usize, Layout); N],
        once: bool,
        f: impl FnOnce([Dims; N], [&[f32]; N]) -> R,
    ) -> R {
        let flat = Dims { heads: 1, ..*self };
        let lent = |i: usize| (self.heads == 1 || once) && xs[i].3 == Layout::HeadMajor;
        let dims = std::array::from_fn(|i| if lent(i) { *self } else { flat });
        let sizes: [usize; N] = std::array::from_fn(|i| {
            let (_, len, width, layout) = xs[i];
            match layout {
                _ if lent(i) => 0,
                Layout::HeadMajor => self.problems * len * width,
                Layout::TilesTransposed => self.problems * len.div_ceil(TILE) * width * TILE,
            }
        });
        // Its own element type, so the tasks' scratch (`with_scratch`) on this thread is
        // another vector.
        scratch::with_vec(|v: &mut Vec<[f32; 1]>| {
            let total = sizes.iter().sum();
            if v.len() < total {
                v.resize(total, [0.0]);
            }
            let all = &mut v.as_flattened_mut()[..total];
            let mut rest = &mut *all;
            for (i, &(x, len, width, layout)) in xs.iter().enumerate() {
                let (out, tail) = rest.split_at_mut(sizes[i]);
                rest = tail;
                match layout {
                    _ if lent(i) => {}
                    Layout::HeadMajor => self.pack_head_major((x, len, width), out),
                    Layout::TilesTransposed => self.pack_transposed((x, len, width), out),
                }
            }
            let all = &*all;
            let mut at = 0;
            let packed = std::array::from_fn(|i| {
                at += sizes[i];
                if lent(i) {
                    xs[i].0
                } else {
                    &all[at - sizes[i]..at]
                }
            });
            f(dims, packed)
        })
    }

    fn pack_head_major(&self, (x, len, width): (&[f32], usize, usize), out: &mut [f32]) {
        if len * width == 0 {
            return;
        }
        out.par_chunks_mut(len * width)
            .enumerate()
            .for_each(|(g, rows)| {
                for (i, row) in rows.chunks_exact_mut(width).enumerate() {
                    let at = self.at(g, i, len, width);
                    row.copy_from_slice(&x[at..at + width]);
                }
            });
    }

    /// Each tile of [`TILE`] rows of each problem as a `[width, TILE]` block, its rows
    /// padded with zeros past `len`.
    fn pack_transposed(&self, (x, len, width): (&[f32], usize, usize), out: &mut [f32]) {
        if len * width == 0 {
            return;
        }
        let tiles = len.div_ceil(TILE);
        out.par_chunks_mut(width * TILE)
            .enumerate()
            .for_each(|(task, block)| {
                let (g, j0) = (task / tiles, task % tiles * TILE);
                let rows = (len - j0).min(TILE);
                let at = self.at(g, j0, len, width);
                let stride = self.heads * width;
                let src = &x[at..at + (rows - 1) * stride + width];
                transpose_into(src, stride, (rows, width), block, TILE);
                for c in 0..width {
                    block[c * TILE + rows..(c + 1) * TILE].fill(0.0);
                }
            });
    }

    /// Rows `[j0, j0 + TILE)` of problem `g` (a tile's first row `j0`) of a tensor packed
    /// [`Layout::TilesTransposed`], `len` rows per problem: the right operand `[width, TILE]`
    /// of a product.
    pub(super) fn tile_t<'a>(
        &self,
        x: &'a [f32],
        g: usize,
        j0: usize,
        len: usize,
        width: usize,
    ) -> View<'a> {
        let block = (g * len.div_ceil(TILE) + j0 / TILE) * width * TILE;
        View::new(&x[block..block + width * TILE], TILE, 1)
    }

    /// The keys query `i` sees among `[j0, j0 + cols)`: a prefix of that tile.
    pub(super) fn visible(&self, i: usize, j0: usize, cols: usize) -> usize {
        if self.causal {
            (i + 1).saturating_sub(j0).min(cols)
        } else {
            cols
        }
    }

    /// The keys any of the queries `[i0, i1)` sees: `[0, end)`.
    pub(super) fn keys_end(&self, i1: usize) -> usize {
        if self.causal {
            i1.min(self.s)
        } else {
            self.s
        }
    }

    /// The first query that sees key `j`.
    pub(super) fn first_query(&self, j: usize) -> usize {
        if self.causal {
            j
        } else {
            0
        }
    }
}

/// How [`Dims::packed`] lays out a tensor every task reads whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Layout {
    /// `[problems, len, width]`: a problem's rows contiguous, the left operand of a product
    /// or a right one whose rows are its rows.
    HeadMajor,
    /// `[problems, tiles, width, TILE]`: each tile of rows transposed, the right operand of
    /// a product with the tile's rows as columns (`q k^T`), 64 contiguous floats a row.
    TilesTransposed,
}

/// Rows of one problem inside a token-major tensor: row `r` starts at `r * stride`.
#[derive(Clone, Copy)]
pub(super) struct Rows<'a> {
    data: &'a [f32],
    stride: usize,
    width: usize,
}

impl<'a> Rows<'a> {
    /// Asks for these rows to be brought into L2 ahead of their use (a task's operands,
    /// read by the task after this one): each row's cache lines. A prefetch never faults.
    pub(super) fn prefetch(self) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            if self.data.is_empty() || self.width == 0 {
                return;
            }
            let rows = (self.data.len() - self.width) / self.stride.max(1) + 1;
            for r in 0..rows {
                let row = &self.data[r * self.stride..r * self.stride + self.width];
                for x in row.iter().step_by(16).chain(row.last()) {
                    // SAFETY: a prefetch of an element of a live slice reads nothing.
                    unsafe { _mm_prefetch::<_MM_HINT_T1>((x as *const f32).cast()) };
                }
            }
        }
    }

    /// Rows `[r0, r1)` of these.
    pub(super) fn sub(self, r0: usize, r1: usize) -> Rows<'a> {
        let data = if r1 > r0 {
            &self.data[r0 * self.stride..(r1 - 1) * self.stride + self.width]
        } else {
            &[]
        };
        Rows { data, ..self }
    }

    /// As the left operand `[rows, width]` of a product.
    pub(super) fn view(self) -> View<'a> {
        View::new(self.data, self.stride, 1)
    }

    /// These rows copied contiguous into `buf` when they are strided (several heads):
    /// products of a tile with rows `H * D` apart run slower in the GEMM crates than the
    /// copy costs, which each task makes once per tile it reuses.
    pub(super) fn packed<'b>(self, buf: &'b mut [f32]) -> Rows<'b>
    where
        'a: 'b,
    {
        if self.stride == self.width || self.data.is_empty() {
            return self;
        }
        let n = (self.data.len() - self.width) / self.stride + 1;
        let buf = &mut buf[..n * self.width];
        for (r, row) in buf.chunks_exact_mut(self.width).enumerate() {
            row.copy_from_slice(&self.data[r * self.stride..][..self.width]);
        }
        Rows {
            data: buf,
            stride: self.width,
            width: self.width,
        }
    }

    /// These rows' transpose `[width, rows]` read in place (a right operand the panels'
    /// kernel packs).
    pub(super) fn transposed(self) -> View<'a> {
        View::new(self.data, 1, self.stride)
    }

    /// These rows transposed into `buf`: column `c` at `buf[c * ld..]`, `[width, ld]`.
    pub(super) fn transposed_into(self, buf: &mut [f32], ld: usize) {
        if self.data.is_empty() {
            return;
        }
        let n = (self.data.len() - self.width) / self.stride + 1;
        transpose_into(self.data, self.stride, (n, self.width), buf, ld);
    }

    /// Elements `packed` needs for `n` rows (none when they are contiguous).
    pub(super) fn packing(self, n: usize) -> usize {
        if self.stride == self.width {
            0
        } else {
            n * self.width
        }
    }

    /// Element `r` of a one-wide column (the per-row statistics).
    pub(super) fn get(self, r: usize) -> f32 {
        self.data[r * self.stride]
    }
}

/// Where a task's output rows go: a token-major output tensor shared by every task, each
/// task writing rows no other task writes.
#[derive(Clone, Copy)]
pub(super) struct Out {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: see `Out::put`: every task writes its own rows only.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    pub(super) fn of(t: &mut [f32]) -> Out {
        Out {
            ptr: t.as_mut_ptr(),
            len: t.len(),
        }
    }

    /// The `len` floats from `start`, to write.
    ///
    /// # Safety
    /// No other live slice or thread touches them while the result lives.
    pub(super) unsafe fn slice<'a>(self, start: usize, len: usize) -> &'a mut [f32] {
        assert!(start + len <= self.len, "attention: slice out of bounds");
        // SAFETY: in bounds (checked); exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }

    /// Copies the rows of `tile` (`width` wide) to rows `[i0, ..)` of problem `g`.
    pub(super) fn put(
        self,
        dm: &Dims,
        g: usize,
        i0: usize,
        len: usize,
        width: usize,
        tile: &[f32],
    ) {
        if width == 0 {
            return;
        }
        for (r, row) in tile.chunks_exact(width).enumerate() {
            let at = dm.at(g, i0 + r, len, width);
            assert!(
                at + width <= self.len,
                "attention: output row out of bounds"
            );
            // SAFETY: in bounds (checked); tasks own disjoint (problem, row) pairs, so no
            // other thread reads or writes these elements while this one copies them.
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), self.ptr.add(at), width) };
        }
    }
}

/// Runs `f` on `len` floats of this thread's kept scratch, as they were left: a task
/// zeroes what it accumulates into and overwrites the rest (zeroing a packed head of keys
/// and values on every task would cost more than the task's copies).
pub(super) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    scratch::with_stale(len, f)
}
