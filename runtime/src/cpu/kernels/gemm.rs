//! Matrix products through the `gemm` crate.
//!
//! Determinism: `gemm` splits the output into tiles whose boundaries depend only on the
//! matrix sizes, and each output element is reduced over K in one fixed order by one tile
//! kernel; threads only decide which tile runs where. Batches run independently. So the same
//! inputs give the same bits whatever the number of threads.

use super::layout::{offset_of, strides};
use super::{KernelError, Small};
use crate::cpu::tensor::{numel, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

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
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        fits(m, n, ld, 1, dst.len()),
        "gemm: destination out of bounds"
    );
    if k == 0 {
        if !accumulate {
            for row in 0..m {
                dst[row * ld..row * ld + n].fill(0.0);
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
        product(
            m,
            n,
            k,
            Ptr(dst.as_mut_ptr()),
            ld,
            accumulate,
            Ptr(lhs.data.as_ptr() as *mut f32),
            (lhs.rs, lhs.cs),
            Ptr(rhs.data.as_ptr() as *mut f32),
            (rhs.rs, rhs.cs),
            par,
        );
    }
}

/// Products with more multiply-adds than this, when allowed to run in parallel, are split
/// into parts run by `rayon::join` (see [`Job::run`]). Measured on 2 cores, two independent
/// halves beat `gemm`'s own threading by 5-15% on the bench models' shapes
/// (`examples/gemm_speed.rs`), and a stolen half balances better on a busy machine.
const SPLIT_WORK: usize = 16 * PARALLEL_WORK;

/// A raw pointer that may cross threads: a split product's parts touch disjoint parts of
/// `dst` and only read the operands.
#[derive(Clone, Copy)]
struct Ptr(*mut f32);

// SAFETY: see `Ptr`; the pointees outlive the `rayon::join` that shares them.
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}

impl Ptr {
    /// The pointer `count` elements further (`wrapping_add`: never dereferenced out of range).
    fn at(self, count: usize) -> Ptr {
        Ptr(self.0.wrapping_add(count))
    }
}

/// `rayon::join`, except that the calling thread, once its half is done, spins until the
/// other half is done (running it, or any other work it finds, meanwhile) instead of falling
/// asleep: rayon puts a waiting worker to sleep after a few dozen idle rounds, and on this
/// shared 2-vCPU machine waking it again cost more than the wait (workers idle 3.9% -> 2.1%
/// of a transformer step; paired A/B of the step 0.95x-1.01x, mean 0.98x, five runs). No
/// allocation: the other half is `join`'s job on the stack.
fn spin_join(a: impl FnOnce() + Send, b: impl FnOnce() + Send) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let done = AtomicBool::new(false);
    rayon::join(
        || {
            a();
            while !done.load(Ordering::Acquire) {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::hint::spin_loop();
                }
            }
        },
        || {
            b();
            done.store(true, Ordering::Release);
        },
    );
}

/// Which library multiplies a product's tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// The `gemm` crate, threaded by rayon inside for products it is given whole.
    Gemm,
    /// The `matrixmultiply` crate, one thread per part of a split product.
    Matrixmultiply,
}

impl Engine {
    /// The engine for a whole product, from its shape and this CPU alone (so never from the
    /// number of threads). On this AVX2 machine (Zen 3, 2 cores), paired runs of the halves
    /// of the bench models' large products (`[1024, 256] x [256, 1024]` and the like) gave
    /// `matrixmultiply`'s 8x8 FMA kernel medians 5-15% above `gemm`'s (`examples/gemm_speed`)
    /// and the transformer's step 0.93x-0.95x (MLP 0.91x-0.95x; `benches/ab.py`). With a
    /// side under 64 it lost (`[32, 43264] x [43264, 9]`, a convolution's weight gradient:
    /// 24 against 43 GFLOP/s), as do products too small to split. With AVX-512, `gemm`'s
    /// `x86-v4` kernels measured about 90% of a core's peak, so they stay.
    fn of(m: usize, n: usize, k: usize) -> Engine {
        if m.saturating_mul(n).saturating_mul(k) > SPLIT_WORK && m.min(n) >= 64 && !avx512() {
            Engine::Matrixmultiply
        } else {
            Engine::Gemm
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512() -> bool {
    false
}

/// One product on raw parts: `dst [m, n] (= or +=) lhs [m, k] x rhs [k, n]`, `dst` with
/// leading dimension `ld`, the operands at element strides `(rows, columns)`.
#[derive(Clone, Copy)]
struct Job {
    m: usize,
    n: usize,
    k: usize,
    dst: Ptr,
    ld: usize,
    accumulate: bool,
    lhs: Ptr,
    l: (usize, usize),
    rhs: Ptr,
    r: (usize, usize),
}

impl Job {
    /// The product as two halves, or `None` when it is too narrow to halve. The longer side
    /// of `dst` is split: each half packs the whole of the operand along the other side, so
    /// the operand packed twice is the smaller one (`[1024, 256] x [256, 256]`: the weight,
    /// not the activations). Paired step A/B against splitting the columns whenever `lhs` is
    /// row-major: transformer 0.984x and 0.988x, MLP 0.99x and 0.98x, CNN 0.98x and 0.96x.
    /// Halves start on a multiple of 16 (whole cache lines of `dst` rows).
    fn halves(self) -> Option<(Job, Job)> {
        let (m, n) = (self.m, self.n);
        let split_n = (n >= m && n >= 32) || m < 32;
        if split_n && n >= 32 {
            let h = n.div_ceil(32) * 16;
            let right = Job {
                n: n - h,
                dst: self.dst.at(h),
                rhs: self.rhs.at(h * self.r.1),
                ..self
            };
            Some((Job { n: h, ..self }, right))
        } else if !split_n {
            let h = m.div_ceil(32) * 16;
            let lower = Job {
                m: m - h,
                dst: self.dst.at(h * self.ld),
                lhs: self.lhs.at(h * self.l.0),
                ..self
            };
            Some((Job { m: h, ..self }, lower))
        } else {
            None
        }
    }

    /// Runs the product: split in `parts` (halving, each half on its own side of a
    /// [`spin_join`]) while there is more than one part and the product halves, each part
    /// multiplied by `engine`. Every element of `dst` is reduced over K by one part in an
    /// order fixed by K, so the split does not change the bits.
    ///
    /// # Safety
    /// The three matrices lie inside live allocations, `dst` aliases neither operand, and no
    /// other thread accesses `dst`'s elements during the call.
    unsafe fn run(self, engine: Engine, parts: usize, par: Parallelism) {
        if parts > 1 {
            if let Some((a, b)) = self.halves() {
                let first = parts.div_ceil(2);
                // SAFETY: the halves write disjoint parts of `dst`; the caller's contract.
                spin_join(
                    || unsafe { a.run(engine, first, par) },
                    || unsafe { b.run(engine, parts - first, par) },
                );
                return;
            }
        }
        IN_GEMM_CRATE.with(|d| d.set(d.get() + 1));
        // SAFETY: the caller's contract.
        unsafe {
            match engine {
                Engine::Gemm => self.gemm(par),
                Engine::Matrixmultiply => self.matrixmultiply(),
            }
        }
        IN_GEMM_CRATE.with(|d| d.set(d.get() - 1));
    }

    /// One call of `gemm::gemm`; [`Job::run`]'s contract.
    unsafe fn gemm(self, par: Parallelism) {
        // SAFETY: the caller's contract.
        unsafe {
            gemm::gemm(
                self.m,
                self.n,
                self.k,
                self.dst.0,
                1,
                self.ld as isize,
                self.accumulate,
                self.lhs.0,
                self.l.1 as isize,
                self.l.0 as isize,
                self.rhs.0,
                self.r.1 as isize,
                self.r.0 as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            );
        }
    }

    /// One call of `matrixmultiply::sgemm` (one thread); [`Job::run`]'s contract.
    unsafe fn matrixmultiply(self) {
        // SAFETY: the caller's contract; with beta 0 `dst` is only written.
        unsafe {
            matrixmultiply::sgemm(
                self.m,
                self.k,
                self.n,
                1.0,
                self.lhs.0,
                self.l.0 as isize,
                self.l.1 as isize,
                self.rhs.0,
                self.r.0 as isize,
                self.r.1 as isize,
                if self.accumulate { 1.0 } else { 0.0 },
                self.dst.0,
                self.ld as isize,
                1,
            );
        }
    }
}

/// `gemm_into` on raw parts: a product allowed to run in parallel (`par`) and above
/// [`SPLIT_WORK`] is split in two (`gemm`) or in one part per thread (`matrixmultiply`,
/// whose parts are single-threaded); see [`Engine::of`].
///
/// # Safety
/// [`Job::run`]'s contract.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    m: usize,
    n: usize,
    k: usize,
    dst: Ptr,
    ld: usize,
    accumulate: bool,
    lhs: Ptr,
    l: (usize, usize),
    rhs: Ptr,
    r: (usize, usize),
    par: Parallelism,
) {
    let job = Job {
        m,
        n,
        k,
        dst,
        ld,
        accumulate,
        lhs,
        l,
        rhs,
        r,
    };
    let split =
        matches!(par, Parallelism::Rayon(_)) && m.saturating_mul(n).saturating_mul(k) > SPLIT_WORK;
    let engine = Engine::of(m, n, k);
    let parts = match (split, engine) {
        (false, _) => 1,
        (true, Engine::Gemm) => 2,
        (true, Engine::Matrixmultiply) => rayon::current_num_threads().max(2),
    };
    // SAFETY: the caller's contract.
    unsafe { job.run(engine, parts, par) }
}

/// `dst [m, n] = lhs [m, k] x rhs [k, n]` (operands at element strides `(rows, columns)`,
/// `dst` row-major) split as [`matmul`] splits it but with the given engine, `gemm` or
/// `matrixmultiply`: for `examples/gemm_speed`, which times the two against each other.
///
/// Panics if a matrix does not fit its slice.
#[doc(hidden)]
pub fn product_by(
    matrixmultiply: bool,
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    (lhs, l): (&[f32], (usize, usize)),
    (rhs, r): (&[f32], (usize, usize)),
) {
    assert!(fits(m, n, n, 1, dst.len()) && fits(m, k, l.0, l.1, lhs.len()));
    assert!(fits(k, n, r.0, r.1, rhs.len()) && m * n * k > 0);
    let (engine, parts) = match matrixmultiply {
        false => (Engine::Gemm, 2),
        true => (Engine::Matrixmultiply, rayon::current_num_threads().max(2)),
    };
    let split = m.saturating_mul(n).saturating_mul(k) > SPLIT_WORK;
    let job = Job {
        m,
        n,
        k,
        dst: Ptr(dst.as_mut_ptr()),
        ld: n,
        accumulate: false,
        lhs: Ptr(lhs.as_ptr() as *mut f32),
        l,
        rhs: Ptr(rhs.as_ptr() as *mut f32),
        r,
    };
    // SAFETY: the matrices fit their slices (checked above), and `dst` is borrowed mutably.
    unsafe { job.run(engine, if split { parts } else { 1 }, parallelism(m, n, k)) }
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

/// The sizes of a checked matrix product.
struct Product {
    m: usize,
    n: usize,
    k: usize,
    /// Products in the batch (1 for 2-D operands).
    batch: usize,
    /// `b` is 2-D, one matrix for every batch of `a`.
    shared_b: bool,
}

/// Checks `op(a) x op(b)` into an output of `out_shape` (see [`matmul`]).
fn product_of(
    a: &Tensor,
    b: &Tensor,
    trans_a: bool,
    trans_b: bool,
    out_shape: &[usize],
) -> Result<Product, KernelError> {
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
        // `a`'s batches stacked are one `[batch * M, K]` matrix.
        let (rows, n, k) = (p.batch * p.m, p.n, p.k);
        let lhs = View::new(a.f32(), k, 1);
        let rhs = if trans_b {
            View::new(b.f32(), 1, k)
        } else {
            View::new(b.f32(), n, 1)
        };
        gemm_into(rows, n, k, dst, n, false, lhs, rhs, parallelism(rows, n, k));
        return Ok(());
    }
    // One product per batch, each row-major in its slab of `dst`.
    batched(&p, a, b, trans_a, trans_b, &shape, dst, &strides(&shape));
    Ok(())
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
    batched(&p, a, b, trans_a, trans_b, out_shape, dst, strides);
    Ok(())
}

/// The products of a checked batched matmul into `dst` at element `strides` (one per axis
/// of `out_shape`, the last 1, the layout inside `dst` and one-to-one): one task per product
/// when there is enough work; large products also split inside (rayon nests).
#[allow(clippy::too_many_arguments)]
fn batched(
    p: &Product,
    a: &Tensor,
    b: &Tensor,
    trans_a: bool,
    trans_b: bool,
    out_shape: &[usize],
    dst: &mut [f32],
    strides: &[usize],
) {
    let &Product {
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
    let (av, bv) = (a.f32(), b.f32());
    let (sa, sb) = (m * k, if shared_b { 0 } else { k * n });
    let out = Ptr(dst.as_mut_ptr());
    let par = parallelism(m, n, k);
    let one = |i: usize| {
        let at = offset_of(i, &batch_dims);
        // SAFETY: every element of the layout lies inside `dst` (the callers' checks); the
        // layout maps distinct elements to distinct offsets, so products write disjoint
        // elements; the operands are slices of live tensors sized by `product_of`'s checks.
        unsafe {
            product(
                m,
                n,
                k,
                out.at(at),
                ld,
                false,
                Ptr(av.as_ptr().add(i * sa) as *mut f32),
                (a_rs, a_cs),
                Ptr(bv.as_ptr().add(i * sb) as *mut f32),
                (b_rs, b_cs),
                par,
            )
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
mod tests {
    use super::*;
    use crate::cpu::kernels::testutil::zeros;

    /// Uniform in [-1, 1), keyed by `tag`.
    fn random(shape: &[usize], tag: u64) -> Tensor {
        crate::cpu::kernels::testutil::uniform_tensor(7, shape, tag)
    }

    /// The product by definition in f64.
    fn reference(a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Vec<f64> {
        let (ra, rb) = (a.shape.len(), b.shape.len());
        let (m, k) = if ta {
            (a.shape[ra - 1], a.shape[ra - 2])
        } else {
            (a.shape[ra - 2], a.shape[ra - 1])
        };
        let n = if tb { b.shape[rb - 2] } else { b.shape[rb - 1] };
        let batch: usize = a.shape[..ra - 2].iter().product();
        let shared = rb == 2;
        let mut out = vec![0f64; batch * m * n];
        for bi in 0..batch {
            let ao = bi * m * k;
            let bo = if shared { 0 } else { bi * k * n };
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0f64;
                    for p in 0..k {
                        let x = if ta {
                            a.f32()[ao + p * m + i]
                        } else {
                            a.f32()[ao + i * k + p]
                        };
                        let y = if tb {
                            b.f32()[bo + j * k + p]
                        } else {
                            b.f32()[bo + p * n + j]
                        };
                        s += x as f64 * y as f64;
                    }
                    out[bi * m * n + i * n + j] = s;
                }
            }
        }
        out
    }

    fn assert_close(got: &[f32], want: &[f64], rel: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= rel * (1.0 + w.abs()),
                "element {i}: got {g}, want {w}"
            );
        }
    }

    /// `a`'s shape from `op(a)`'s `[.., M, K]`.
    fn stored(batch: &[usize], rows: usize, cols: usize, trans: bool) -> Vec<usize> {
        let mut s = batch.to_vec();
        s.extend(if trans { [cols, rows] } else { [rows, cols] });
        s
    }

    fn check(batch: &[usize], shared_b: bool, m: usize, k: usize, n: usize, ta: bool, tb: bool) {
        let a = random(&stored(batch, m, k, ta), 1);
        let b = random(&stored(if shared_b { &[] } else { batch }, k, n, tb), 2);
        let mut out = zeros(&stored(batch, m, n, false));
        matmul(&a, &b, ta, tb, &mut out).unwrap();
        assert_close(out.f32(), &reference(&a, &b, ta, tb), 1e-5);
    }

    #[test]
    fn strided_output_is_the_permuted_product() {
        // Attention's `[B, H, S, D] -> [B, S, H, D]`, batched and shared-b operands, both
        // transpositions, with products large enough to run in parallel and to split.
        for &(batch, m, k, n, shared_b, ta, tb) in &[
            ([2usize, 3usize], 5usize, 4usize, 6usize, false, false, true),
            ([2, 3], 5, 4, 6, false, true, false),
            ([2, 4], 64, 64, 64, false, false, false),
            ([3, 2], 96, 80, 128, true, false, true),
        ] {
            let a = random(&stored(&batch, m, k, ta), 3);
            let b = random(
                &stored(if shared_b { &[] } else { &batch[..] }, k, n, tb),
                4,
            );
            let mut want = zeros(&stored(&batch, m, n, false));
            matmul(&a, &b, ta, tb, &mut want).unwrap();
            let mut permuted = zeros(&[batch[0], m, batch[1], n]);
            crate::cpu::kernels::layout::permute(&want, &[0, 2, 1, 3], &mut permuted).unwrap();
            // Element (b, h, i, j) of the product at b*M*H*N + i*H*N + h*N + j.
            let strides = [m * batch[1] * n, n, batch[1] * n, 1];
            let mut got = vec![f32::NAN; permuted.numel()];
            let shape = [batch[0], batch[1], m, n];
            matmul_strided(&a, &b, ta, tb, &shape, &mut got, &strides).unwrap();
            // The same kernels on the same values: the same bits.
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                permuted
                    .f32()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            );
        }
        let (a, b) = (random(&[2, 3, 4], 5), random(&[4, 5], 6));
        let mut small = vec![0f32; 29];
        let err = matmul_strided(&a, &b, false, false, &[2, 3, 5], &mut small, &[15, 5, 1]);
        assert!(err.unwrap_err().to_string().contains("does not fit"));
        let err = matmul_strided(&a, &b, false, false, &[2, 3, 5], &mut small, &[1, 2, 6]);
        assert!(err.unwrap_err().to_string().contains("the last 1"));
    }

    #[test]
    fn two_d_in_all_four_transpositions() {
        for ta in [false, true] {
            for tb in [false, true] {
                check(&[], true, 7, 13, 5, ta, tb);
                check(&[], true, 1, 1, 1, ta, tb);
                // Large enough to run in parallel.
                check(&[], true, 70, 90, 80, ta, tb);
            }
        }
    }

    #[test]
    fn batched_with_shared_b() {
        for ta in [false, true] {
            for tb in [false, true] {
                check(&[2, 3], true, 5, 4, 6, ta, tb);
            }
        }
    }

    #[test]
    fn batched_with_batched_b() {
        // The attention shape [2, 3, 5, 4] x [2, 3, 4, 6].
        for ta in [false, true] {
            for tb in [false, true] {
                check(&[2, 3], false, 5, 4, 6, ta, tb);
            }
        }
        // Many small products (one task each) and a few large ones.
        check(&[4, 8], false, 40, 32, 40, false, true);
        check(&[2], false, 70, 70, 70, true, false);
    }

    #[test]
    fn empty_inner_dimension_gives_zeros() {
        let a = zeros(&[3, 0]);
        let b = zeros(&[0, 4]);
        let mut out = Tensor::from_f32(vec![3, 4], vec![5.0; 12]);
        matmul(&a, &b, false, false, &mut out).unwrap();
        assert!(out.f32().iter().all(|&v| v == 0.0));
        // Batched, one product at a time.
        let (a, b) = (zeros(&[2, 0, 3]), zeros(&[2, 0, 4]));
        let mut out = Tensor::from_f32(vec![2, 3, 4], vec![5.0; 24]);
        matmul(&a, &b, true, false, &mut out).unwrap();
        assert!(out.f32().iter().all(|&v| v == 0.0));
    }

    #[test]
    fn mismatched_shapes_are_errors() {
        let a = random(&[2, 3], 1);
        let b = random(&[4, 5], 2);
        let mut out = zeros(&[2, 5]);
        assert!(matches!(
            matmul(&a, &b, false, false, &mut out),
            Err(KernelError::Bad { .. })
        ));
        let b = random(&[3, 5], 2);
        let mut wrong = zeros(&[2, 4]);
        assert!(matches!(
            matmul(&a, &b, false, false, &mut wrong),
            Err(KernelError::Bad { .. })
        ));
        let a3 = random(&[2, 2, 3], 1);
        let b3 = random(&[3, 3, 5], 2);
        let mut out3 = zeros(&[2, 2, 5]);
        assert!(matches!(
            matmul(&a3, &b3, false, false, &mut out3),
            Err(KernelError::Bad { .. })
        ));
        let v = random(&[3], 1);
        assert!(matches!(
            matmul(&v, &b, false, false, &mut out),
            Err(KernelError::Bad { .. })
        ));
        let ints = Tensor::from_i32(vec![2, 3], vec![0; 6]);
        assert!(matches!(
            matmul(&ints, &b, false, false, &mut out),
            Err(KernelError::Bad { .. })
        ));
    }

    /// Each engine, whole or split in 1-5 parts, in all four transpositions, overwriting
    /// and accumulating (with a `dst` row longer than `n`): the reference values, and the
    /// same bits whatever the number of parts.
    #[test]
    fn both_engines_give_the_product_and_parts_do_not_change_the_bits() {
        let (m, k, n, ld) = (130, 300, 150, 160);
        for engine in [Engine::Gemm, Engine::Matrixmultiply] {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                let a = random(&stored(&[], m, k, ta), 5);
                let b = random(&stored(&[], k, n, tb), 6);
                let start = random(&[m, ld], 7);
                let want = reference(&a, &b, ta, tb);
                let mut first: Option<Vec<u32>> = None;
                for (parts, accumulate) in [(1, false), (2, false), (3, false), (5, true)] {
                    let mut dst = start.f32().to_vec();
                    let job = Job {
                        m,
                        n,
                        k,
                        dst: Ptr(dst.as_mut_ptr()),
                        ld,
                        accumulate,
                        lhs: Ptr(a.f32().as_ptr() as *mut f32),
                        l: if ta { (1, m) } else { (k, 1) },
                        rhs: Ptr(b.f32().as_ptr() as *mut f32),
                        r: if tb { (1, k) } else { (n, 1) },
                    };
                    // SAFETY: the matrices fit their vectors; `dst` is its own vector.
                    unsafe { job.run(engine, parts, Parallelism::Rayon(0)) };
                    let mut got = Vec::with_capacity(m * n);
                    for i in 0..m {
                        for j in 0..n {
                            let was = start.f32()[i * ld + j];
                            got.push(dst[i * ld + j] - if accumulate { was } else { 0.0 });
                        }
                        // Past `n`, the row is left alone.
                        assert_eq!(
                            dst[i * ld + n..(i + 1) * ld],
                            start.f32()[i * ld + n..(i + 1) * ld]
                        );
                    }
                    assert_close(&got, &want, 1e-5);
                    let bits: Vec<u32> = dst.iter().map(|v| v.to_bits()).collect();
                    match (&first, accumulate) {
                        (None, _) => first = Some(bits),
                        (Some(f), false) => assert_eq!(f, &bits, "{engine:?} in {parts} parts"),
                        (Some(_), true) => {}
                    }
                }
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        // (batch, shared b, M, K, N, trans_a, trans_b)
        type Case<'a> = (&'a [usize], bool, usize, usize, usize, bool, bool);
        let cases: [Case; 4] = [
            (&[], true, 200, 300, 250, false, false),
            (&[3], true, 100, 150, 120, false, true),
            (&[4, 8], false, 64, 64, 64, false, true),
            (&[2], false, 150, 130, 170, true, false),
        ];
        for (batch, shared_b, m, k, n, ta, tb) in cases {
            let a = random(&stored(batch, m, k, ta), 3);
            let b = random(&stored(if shared_b { &[] } else { batch }, k, n, tb), 4);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    let mut out = zeros(&stored(batch, m, n, false));
                    matmul(&a, &b, ta, tb, &mut out).unwrap();
                    out.f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                })
            };
            let one = run(1);
            assert_eq!(one, run(2));
            assert_eq!(one, run(3));
        }
    }
}
