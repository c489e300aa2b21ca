//! Matrix products: what a matmul multiplies (checks, batches, strided outputs) here; how one
//! product is split across the threads and which engine multiplies it in `parts`; the panels'
//! kernel in `tile`.
//!
//! Determinism: the crates split the output into tiles whose boundaries depend only on the
//! matrix sizes, and each output element is reduced over K in one fixed order by one tile
//! kernel; threads only decide which tile runs where. Batches run independently. So the same
//! inputs give the same bits whatever the number of threads.

use super::layout::{offset_of, strides};
use super::{KernelError, Small};
use crate::cpu::tensor::{numel, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

mod parts;
mod tile;
#[doc(hidden)]
pub use parts::product_by;
use parts::{Job, Ptr};
pub(super) use tile::transpose_into;

thread_local! {
    /// How deep this thread is inside calls of the `gemm` crate, which allocates its packing
    /// buffers on every call: allocation tests count everything else.
    pub static IN_GEMM_CRATE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Products with more multiply-adds than this run on rayon's pool.
pub(super) const PARALLEL_WORK: usize = 64 * 64 * 64;

/// `Rayon` for products above [`PARALLEL_WORK`] multiply-adds, `None` below.
pub(super) fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    if m.saturating_mul(n).saturating_mul(k) > PARALLEL_WORK {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

/// A strided view of a matrix inside a slice: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(super) struct View<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> View<'a> {
    pub fn new(data: &'a [f32], rs: usize, cs: usize) -> View<'a> {
        View { data, rs, cs }
    }
}

/// Whether a `rows x cols` matrix with strides `(rs, cs)` lies inside `len` elements.
fn fits(rows: usize, cols: usize, rs: usize, cs: usize, len: usize) -> bool {
    if rows == 0 || cols == 0 {
        return true;
    }
    let last = (rows - 1)
        .checked_mul(rs)
        .and_then(|r| (cols - 1).checked_mul(cs).and_then(|c| r.checked_add(c)));
    matches!(last, Some(l) if l < len && l <= isize::MAX as usize)
}

/// `dst [m, n] (= or +=) lhs [m, k] x rhs [k, n]`, `dst` row-major with leading dimension
/// `ld` (element `(i, j)` at `i * ld + j`). Accumulating adds the product to `dst`'s values;
/// otherwise `dst` is overwritten (zeros when `k == 0`).
///
/// Panics if a view does not fit its slice: callers size the views from validated shapes,
/// and the check is what makes the unsafe call sound.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_into(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    ld: usize,
    accumulate: bool,
    lhs: View,
    rhs: View,
    par: Parallelism,
) {
    gemm_biased(m, n, k, (dst, ld), accumulate, (lhs, rhs), par, None)
}

/// [`gemm_into`] with `bias` (`n` values) added to each row after the product.
#[allow(clippy::too_many_arguments)]
fn gemm_biased(
    m: usize,
    n: usize,
    k: usize,
    (dst, ld): (&mut [f32], usize),
    accumulate: bool,
    (lhs, rhs): (View, View),
    par: Parallelism,
    bias: Option<&[f32]>,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        fits(m, n, ld, 1, dst.len()),
        "gemm: destination out of bounds"
    );
    assert!(
        bias.is_none_or(|b| b.len() == n),
        "gemm: a bias of {n} values"
    );
    if k == 0 {
        for row in 0..m {
            let row = &mut dst[row * ld..row * ld + n];
            if !accumulate {
                row.fill(0.0);
            }
            for (x, &b) in row.iter_mut().zip(bias.unwrap_or(&[])) {
                *x += b;
            }
        }
        return;
    }
    assert!(
        fits(m, k, lhs.rs, lhs.cs, lhs.data.len()),
        "gemm: lhs out of bounds"
    );
    assert!(
        fits(k, n, rhs.rs, rhs.cs, rhs.data.len()),
        "gemm: rhs out of bounds"
    );
    // SAFETY: the three views fit their slices (checked above, strides fit in isize), `dst`
    // is borrowed mutably so it aliases neither operand, and all strides are nonnegative.
    unsafe {
        Job {
            m,
            n,
            k,
            dst: Ptr(dst.as_mut_ptr()),
            ld,
            accumulate,
            lhs: Ptr(lhs.data.as_ptr() as *mut f32),
            l: (lhs.rs, lhs.cs),
            rhs: Ptr(rhs.data.as_ptr() as *mut f32),
            r: (rhs.rs, rhs.cs),
            bias: bias.map(|b| Ptr(b.as_ptr() as *mut f32)),
        }
        .multiply(par);
    }
}

fn bad(message: String) -> KernelError {
    KernelError::Bad {
        op: "matmul",
        message,
    }
}

/// Checks that `t` holds f32 data matching its shape.
pub(super) fn check_f32(op: &'static str, what: &str, t: &Tensor) -> Result<(), KernelError> {
    if !t.is_f32() {
        return Err(KernelError::Bad {
            op,
            message: format!("{what} must be f32"),
        });
    }
    if t.f32().len() != numel(&t.shape) {
        return Err(KernelError::Bad {
            op,
            message: format!(
                "{what} holds {} elements but is shaped {:?}",
                t.f32().len(),
                t.shape
            ),
        });
    }
    Ok(())
}

/// A checked matrix product: its operands' values and transposes, and its sizes.
struct Product<'a> {
    a: &'a [f32],
    b: &'a [f32],
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    /// Products in the batch (1 for 2-D operands).
    batch: usize,
    /// `b` is 2-D, one matrix for every batch of `a`.
    shared_b: bool,
}

/// Checks `op(a) x op(b)` into an output of `out_shape` (see [`matmul`]).
fn product_of<'a>(
    a: &'a Tensor,
    b: &'a Tensor,
    trans_a: bool,
    trans_b: bool,
    out_shape: &[usize],
) -> Result<Product<'a>, KernelError> {
    check_f32("matmul", "the left operand", a)?;
    check_f32("matmul", "the right operand", b)?;
    let (ra, rb) = (a.shape.len(), b.shape.len());
    if ra < 2 || rb < 2 {
        return Err(bad(format!(
            "operands must have rank 2 or more, got {:?} and {:?}",
            a.shape, b.shape
        )));
    }
    let (m, k) = if trans_a {
        (a.shape[ra - 1], a.shape[ra - 2])
    } else {
        (a.shape[ra - 2], a.shape[ra - 1])
    };
    let (kb, n) = if trans_b {
        (b.shape[rb - 1], b.shape[rb - 2])
    } else {
        (b.shape[rb - 2], b.shape[rb - 1])
    };
    if k != kb {
        return Err(bad(format!(
            "inner dimensions differ: {:?} x {:?} (trans_a {trans_a}, trans_b {trans_b})",
            a.shape, b.shape
        )));
    }
    let batch_a = &a.shape[..ra - 2];
    let shared_b = rb == 2;
    if !shared_b && batch_a != &b.shape[..rb - 2] {
        return Err(bad(format!(
            "batch dimensions differ: {:?} x {:?}",
            a.shape, b.shape
        )));
    }
    if out_shape.len() != ra || out_shape[..ra - 2] != *batch_a || out_shape[ra - 2..] != [m, n] {
        return Err(bad(format!(
            "the output is {out_shape:?}, the product is {:?}",
            [batch_a, &[m, n]].concat()
        )));
    }
    Ok(Product {
        a: a.f32(),
        b: b.f32(),
        trans_a,
        trans_b,
        m,
        n,
        k,
        batch: batch_a.iter().product(),
        shared_b,
    })
}

/// `op(a) x op(b)` with `op` transposing the last two axes when its flag is set. `a` is
/// `[.., M, K]` (or `[.., K, M]`), `b` is 2-D and shared by every batch of `a`, or has `a`'s
/// batch axes. `out` is `[.., M, N]`.
pub fn matmul(
    a: &Tensor,
    b: &Tensor,
    trans_a: bool,
    trans_b: bool,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    check_f32("matmul", "the output", out)?;
    let p = product_of(a, b, trans_a, trans_b, &out.shape)?;
    if out.f32().is_empty() {
        return Ok(());
    }
    let shape: Small<usize> = out.shape.iter().copied().collect();
    let dst = out.f32_mut();
    if p.shared_b && !trans_a {
        one_matrix(&p, dst, None);
        return Ok(());
    }
    // One product per batch, each row-major in its slab of `dst`.
    batched(&p, &shape, dst, &strides(&shape));
    Ok(())
}

/// [`matmul`] with `bias` (`[N]`) added to every row of the product, in the f32 add a pass
/// after it makes, but as the product is stored (no pass over it): the case where `b` is 2-D
/// and shared by `a`'s batches, `a` not transposed (one matrix, as `matmul` runs it); `None`
/// (nothing computed) otherwise.
pub fn matmul_bias(
    a: &Tensor,
    b: &Tensor,
    trans_b: bool,
    bias: &Tensor,
    out: &mut Tensor,
) -> Option<Result<(), KernelError>> {
    let p = match product_of(a, b, false, trans_b, &out.shape) {
        Ok(p) => p,
        Err(e) => return Some(Err(e)),
    };
    if !p.shared_b || !out.is_f32() || !bias.is_f32() {
        return None;
    }
    if bias.f32().len() != p.n || out.f32().len() != p.batch * p.m * p.n {
        return Some(Err(bad(format!(
            "a bias of {:?} for an output {:?}",
            bias.shape, out.shape
        ))));
    }
    one_matrix(&p, out.f32_mut(), Some(bias.f32()));
    Some(Ok(()))
}

/// A checked product whose `b` is 2-D and shared by `a`'s batches, `a` not transposed, into
/// `dst`: `a`'s batches stacked are one `[batch * M, K]` matrix, multiplied in one call
/// (`bias` added to each row as it is stored).
fn one_matrix(p: &Product, dst: &mut [f32], bias: Option<&[f32]>) {
    let (rows, n, k) = (p.batch * p.m, p.n, p.k);
    let lhs = View::new(p.a, k, 1);
    let rhs = if p.trans_b {
        View::new(p.b, 1, k)
    } else {
        View::new(p.b, n, 1)
    };
    let par = parallelism(rows, n, k);
    gemm_biased(rows, n, k, (dst, n), false, (lhs, rhs), par, bias);
}

/// [`matmul`] writing its `[.., M, N]` result into `dst` at element strides `strides`, one
/// per output axis (the last must be 1, and distinct elements must land on distinct
/// offsets: a permuted layout). A matmul whose only reader is a permute writes the permuted
/// tensor this way, with no pass of its own (see `cpu::views`).
pub fn matmul_strided(
    a: &Tensor,
    b: &Tensor,
    trans_a: bool,
    trans_b: bool,
    out_shape: &[usize],
    dst: &mut [f32],
    strides: &[usize],
) -> Result<(), KernelError> {
    let p = product_of(a, b, trans_a, trans_b, out_shape)?;
    let r = out_shape.len();
    if strides.len() != r || strides[r - 1] != 1 {
        return Err(bad(format!(
            "output strides {strides:?} for {out_shape:?}: one per axis, the last 1"
        )));
    }
    let last = out_shape
        .iter()
        .zip(strides)
        .map(|(&size, &st)| size.saturating_sub(1) * st)
        .sum::<usize>();
    if p.m * p.n * p.batch == 0 {
        return Ok(());
    }
    if last >= dst.len() {
        return Err(bad(format!(
            "{out_shape:?} at strides {strides:?} does not fit {} elements",
            dst.len()
        )));
    }
    batched(&p, out_shape, dst, strides);
    Ok(())
}

/// The products of a checked batched matmul into `dst` at element `strides` (one per axis
/// of `out_shape`, the last 1, the layout inside `dst` and one-to-one): one task per product
/// when there is enough work; large products also split inside (rayon nests).
fn batched(p: &Product, out_shape: &[usize], dst: &mut [f32], strides: &[usize]) {
    let &Product {
        a: av,
        b: bv,
        trans_a,
        trans_b,
        m,
        n,
        k,
        batch,
        shared_b,
    } = p;
    let r = out_shape.len();
    let batch_dims: Small<(usize, usize)> = out_shape[..r - 2]
        .iter()
        .zip(strides)
        .map(|(&size, &st)| (size, st))
        .collect();
    let ld = strides[r - 2];
    let (a_rs, a_cs) = if trans_a { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if trans_b { (1, k) } else { (n, 1) };
    let (sa, sb) = (m * k, if shared_b { 0 } else { k * n });
    let out = Ptr(dst.as_mut_ptr());
    let par = parallelism(m, n, k);
    let one = |i: usize| {
        let at = offset_of(i, &batch_dims);
        // SAFETY: every element of the layout lies inside `dst` (the callers' checks); the
        // layout maps distinct elements to distinct offsets, so products write disjoint
        // elements; the operands are slices of live tensors sized by `product_of`'s checks.
        unsafe {
            Job {
                m,
                n,
                k,
                dst: out.at(at),
                ld,
                accumulate: false,
                lhs: Ptr(av.as_ptr().add(i * sa) as *mut f32),
                l: (a_rs, a_cs),
                rhs: Ptr(bv.as_ptr().add(i * sb) as *mut f32),
                r: (b_rs, b_cs),
                bias: None,
            }
            .multiply(par)
        }
    };
    let work = m.saturating_mul(n).saturating_mul(k);
    if batch > 1 && work.saturating_mul(batch) > PARALLEL_WORK {
        (0..batch).into_par_iter().for_each(one);
    } else {
        (0..batch).for_each(one);
    }
}

#[cfg(test)]
mod tests;
