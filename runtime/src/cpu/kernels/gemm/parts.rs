//! One product on raw parts, split across rayon's threads and multiplied by one of three
//! engines: `tile`'s panels, or the `gemm` or `matrixmultiply` crate (see [`Engine`]).

use super::tile::{self, Isa};
use super::{fits, parallelism, IN_GEMM_CRATE, PARALLEL_WORK};
use gemm::Parallelism;

/// Products with more multiply-adds than this, when allowed to run in parallel, are split
/// into parts run by `rayon::join` (see [`Job::run`]). Measured on 2 cores, two independent
/// halves beat `gemm`'s own threading by 5-15% on the bench models' shapes
/// (`examples/gemm_speed.rs`), and a stolen half balances better on a busy machine.
const SPLIT_WORK: usize = 16 * PARALLEL_WORK;

/// A raw pointer that may cross threads: a split product's parts touch disjoint parts of
/// `dst` and only read the operands.
#[derive(Clone, Copy)]
pub(super) struct Ptr(pub(super) *mut f32);

// SAFETY: see `Ptr`; the pointees outlive the `rayon::join` that shares them.
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}

impl Ptr {
    /// The pointer `count` elements further (`wrapping_add`: never dereferenced out of range).
    pub(super) fn at(self, count: usize) -> Ptr {
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

/// Which kernel multiplies a product's tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// The `gemm` crate, threaded by rayon inside for products it is given whole.
    Gemm,
    /// The `matrixmultiply` crate, one thread per part of a split product.
    Matrixmultiply,
    /// With AVX-512, or AVX2 and FMA: the right operand packed in panels of 64 columns by [`PANEL_DEPTH`]
    /// rows, each multiplied by `tile`'s register-blocked kernel reading the left operand
    /// in place (see [`Job::panels`]). Split like `gemm`.
    Panels,
}

/// Rows of the right operand in one packed panel: 64 columns of 128 rows is 32 KiB, which
/// stays in L1 while the kernel sweeps the output's rows (against 256 and 512, paired in
/// `gemm_speed 20 '' engines`: the weight gradients `[256, 1024] x [1024, 256]` 463 against
/// 416-426 GFLOP/s median, the rest within the noise).
const PANEL_DEPTH: usize = 128;

/// The most rows of a left operand transposed a panel deep (`Job::panels_by_depth`): its
/// scratch, `LEFT_ROWS x PANEL_DEPTH` floats (4 MiB), stays with each thread.
const LEFT_ROWS: usize = 8192;

/// Floats of a part's left operand (1 MiB, a core's L2 on Zen 5) from which the panels'
/// kernel asks for a transposed one's lines ahead (`tile::Left::cold`): read in place, a
/// transposed operand's blocks take each column's line in turn, a stream the hardware's
/// prefetchers do not follow. `gemm_speed` with the operands flushed, AVX-512, 2 cores:
/// `[2048, 256]^T x [2048, 1024]` 73-76% -> 78-80% of the peak, `[2048, 256]^T x [2048,
/// 256]` 70-71% -> 78-80%, `[1024, 256]^T x [1024, 256]` 62-65% -> 81% (warm, 84-89%);
/// with AVX2, at half the rate, no change. A left operand that stays in L2 (the MLP's
/// weight gradients, `[128, 512]^T`) is left alone: asking for lines already there only
/// takes load slots.
const COLD_LEFT: usize = 1 << 18;

/// A row of a packed panel, aligned to a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct PanelRow([f32; 64]);

impl Engine {
    /// The engine for a whole product, from its shape and this CPU alone (so never from the
    /// number of threads). Without the panels (a CPU without AVX2 and FMA, or a product
    /// narrower than 16 columns), the choice made before they had an AVX2 form: on an AVX2
    /// machine (Zen 3, 2 cores), paired runs of the halves
    /// of the bench models' large products (`[1024, 256] x [256, 1024]` and the like) gave
    /// `matrixmultiply`'s 8x8 FMA kernel medians 0-15% above `gemm`'s (`examples/gemm_speed`)
    /// and the transformer's step 0.93x-0.95x (MLP 0.91x-0.95x; `benches/ab.py`). With a
    /// side under 64 it lost (`[32, 43264] x [43264, 9]`, a convolution's weight gradient:
    /// 24 against 43 GFLOP/s), as do products too small to split. With AVX-512, `gemm`'s
    /// `x86-v4` kernels measured about 90% of a core's peak, so they stay.
    ///
    /// With AVX-512 a product at least one vector wide runs in [`Engine::Panels`]: on 2 cores
    /// of an AMD EPYC (Zen 5) it was ahead of `gemm` on each of the bench models' products,
    /// paired call by call (`gemm_speed 20 '' engines`: 413-492 GFLOP/s median against
    /// 274-482, the peak 545), most on the thin-K products the `gemm` crate packs both
    /// operands for. Narrower, its kernel keeps a part of one vector per row (a convolution's
    /// weight gradient `[32, 43264] x [43264, 9]`: 0.69 ms against `gemm`'s 0.50). With AVX2
    /// and FMA alone (the same machine, AVX-512 off everywhere: `compare.sh`'s `ISA=avx2`
    /// build) the panels ran the same products at 237-256 GFLOP/s median against `gemm`'s
    /// 200-258 and `matrixmultiply`'s 173-217 (peak 268-283), so they take the same
    /// products there.
    fn of(m: usize, n: usize, k: usize) -> Engine {
        if tile::isa().is_some() && n >= 16 {
            Engine::Panels
        } else if m.saturating_mul(n).saturating_mul(k) > SPLIT_WORK && m.min(n) >= 64 {
            Engine::Matrixmultiply
        } else {
            Engine::Gemm
        }
    }
}

/// One product on raw parts: `dst [m, n] (= or +=) lhs [m, k] x rhs [k, n]`, `dst` with
/// leading dimension `ld`, the operands at element strides `(rows, columns)`.
#[derive(Clone, Copy)]
pub(super) struct Job {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dst: Ptr,
    pub ld: usize,
    pub accumulate: bool,
    pub lhs: Ptr,
    pub l: (usize, usize),
    pub rhs: Ptr,
    pub r: (usize, usize),
    /// `n` values added to `dst`'s columns after the product (a bias), in the same f32 add
    /// as a pass after it: by the panels' kernel as it stores each block, by the crates'
    /// engines after their call.
    pub bias: Option<Ptr>,
}

impl Job {
    /// Multiplies with the engine [`Engine::of`] picks for the product.
    ///
    /// # Safety
    /// [`Job::run`]'s contract.
    pub(super) unsafe fn multiply(self, par: Parallelism) {
        // SAFETY: the caller's contract.
        unsafe { self.multiply_by(Engine::of(self.m, self.n, self.k), par) }
    }

    /// Multiplies with `engine`: a product allowed to run in parallel (`par`) and above
    /// [`SPLIT_WORK`] is split in two (`gemm`) or in one part per thread (`matrixmultiply`,
    /// whose parts are single-threaded).
    ///
    /// # Safety
    /// [`Job::run`]'s contract.
    unsafe fn multiply_by(self, engine: Engine, par: Parallelism) {
        // Panels run on one thread each, so any product allowed to run in parallel is split.
        let least = if engine == Engine::Panels {
            0
        } else {
            SPLIT_WORK
        };
        let split = matches!(par, Parallelism::Rayon(_))
            && self.m.saturating_mul(self.n).saturating_mul(self.k) > least;
        let parts = match (split, engine) {
            (false, _) => 1,
            (true, Engine::Gemm | Engine::Panels) => 2,
            (true, Engine::Matrixmultiply) => rayon::current_num_threads().max(2),
        };
        // SAFETY: the caller's contract.
        unsafe { self.run(engine, parts, par) }
    }

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
                bias: self.bias.map(|b| b.at(h)),
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
                Engine::Panels => self.panels(par),
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
            self.add_bias();
        }
    }

    /// Adds the bias to every row of `dst` after a crate's product (which has no hook for
    /// it); [`Job::run`]'s contract.
    unsafe fn add_bias(self) {
        if let Some(bias) = self.bias {
            // SAFETY: `n` bias values, `m` rows of `n` in `dst` (the caller's contract).
            let bias = unsafe { std::slice::from_raw_parts(bias.0.cast_const(), self.n) };
            for i in 0..self.m {
                // SAFETY: as above; row `i` aliases neither operand nor the bias.
                let row =
                    unsafe { std::slice::from_raw_parts_mut(self.dst.0.add(i * self.ld), self.n) };
                for (x, &b) in row.iter_mut().zip(bias) {
                    *x += b;
                }
            }
        }
    }

    /// The product panel by panel on this thread: `PANEL_DEPTH` rows of 64 columns of the
    /// right operand copied contiguous (transposed when its columns are contiguous), then
    /// multiplied into `dst`'s columns by `tile`'s kernel, accumulating from the second
    /// panel down on. Each element's chain of multiply-adds runs over K in order whatever the
    /// panels (an accumulator stored and loaded again is the same float), so the bits are
    /// `tile`'s. Without AVX2 and FMA, or with a left operand strided both ways, `gemm`.
    /// [`Job::run`]'s contract.
    unsafe fn panels(self, par: Parallelism) {
        if let Some(isa) = tile::isa().filter(|_| self.l.0 == 1 || self.l.1 == 1) {
            // SAFETY: the CPU has `isa`; the caller's contract.
            unsafe { self.panels_in(isa) };
            return;
        }
        // SAFETY: the caller's contract.
        unsafe { self.gemm(par) }
    }

    /// [`Job::panels`] in `isa`, which the CPU has, the left operand's rows or columns
    /// contiguous; [`Job::run`]'s contract.
    unsafe fn panels_in(self, isa: Isa) {
        let Job { m, n, k, l, r, .. } = self;
        if r.1 == 1 && r.0.saturating_mul(k) <= 64 * PANEL_DEPTH {
            // The whole right operand spans no more than a panel: read in place.
            // SAFETY: the CPU has `isa`; the caller's contract.
            unsafe {
                tile::product(
                    isa,
                    (m, n, k),
                    (self.dst.0, self.ld),
                    self.accumulate,
                    self.left(self.lhs.0, l),
                    (self.rhs.0, r.0),
                    self.bias.map(|b| b.0.cast_const()),
                );
            }
            return;
        }
        super::super::scratch::with_vec(|buf: &mut Vec<PanelRow>| {
            if buf.len() < PANEL_DEPTH {
                buf.resize(PANEL_DEPTH, PanelRow([0.0; 64]));
            }
            // SAFETY: a `PanelRow` is 64 floats and nothing else (`repr(C)`, size 256).
            let panel = unsafe {
                std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<f32>(), buf.len() * 64)
            };
            // Columns a multiple of 4 KiB apart: see `panels_by_depth`.
            if l.0 == 1 && l.1 % 1024 == 0 && m > 1 && m <= LEFT_ROWS {
                // SAFETY: the caller's contract.
                unsafe { self.panels_by_depth(isa, panel) };
                return;
            }
            for j0 in (0..n).step_by(64) {
                let cols = (n - j0).min(64);
                for p0 in (0..k).step_by(PANEL_DEPTH) {
                    let depth = (k - p0).min(PANEL_DEPTH);
                    let lhs = self.lhs.0.wrapping_add(p0 * l.1).cast_const();
                    // SAFETY: the panel lies inside the product (the caller's contract).
                    unsafe { self.panel(isa, (p0, depth), (j0, cols), (lhs, l), panel) };
                }
            }
        });
    }

    /// [`Job::panels_in`] for a left operand whose columns are contiguous and a multiple of
    /// 4 KiB apart: its `PANEL_DEPTH` columns at a time transposed into rows first, then
    /// multiplied by each panel. Read in place, a block's rows of one column share a cache
    /// line and the next column's line lies 4 KiB on, in the same set of L1, so a block's
    /// columns evict each other: `[1024, 1024]^T x [1024, 256]` ran at 184 GFLOP/s with AVX2
    /// (peak 268), 242 transposed, and the same with AVX-512. Columns 1 KiB apart (`[1024,
    /// 256]^T x [1024, 256]`) lost by it (AVX-512: 380 against 483; the transpose, done by
    /// both halves of a split product, costs more than it saves there).
    /// [`Job::run`]'s contract; `panel` holds a panel.
    unsafe fn panels_by_depth(self, isa: Isa, panel: &mut [f32]) {
        use super::transpose_into;
        /// The transposed columns, a type of their own among the kept scratch vectors.
        #[derive(Clone, Copy, Default)]
        #[repr(transparent)]
        struct LeftRow(f32);
        let Job { m, n, k, l, .. } = self;
        super::super::scratch::with_stale(m * PANEL_DEPTH, |rows: &mut [LeftRow]| {
            // SAFETY: a `LeftRow` is an `f32` (`repr(transparent)`).
            let rows = unsafe {
                std::slice::from_raw_parts_mut(rows.as_mut_ptr().cast::<f32>(), rows.len())
            };
            for p0 in (0..k).step_by(PANEL_DEPTH) {
                let depth = (k - p0).min(PANEL_DEPTH);
                // SAFETY: columns [p0, p0 + depth) of the left operand, each `m` long and
                // contiguous, lie inside it; the panels lie inside the product (the
                // caller's contract).
                unsafe {
                    let len = (depth - 1) * l.1 + m;
                    let src = std::slice::from_raw_parts(self.lhs.0.add(p0 * l.1), len);
                    transpose_into(src, l.1, (depth, m), rows, depth);
                    for j0 in (0..n).step_by(64) {
                        let cols = (n - j0).min(64);
                        let lhs = (rows.as_ptr(), (depth, 1));
                        self.panel(isa, (p0, depth), (j0, cols), lhs, panel);
                    }
                }
            }
        });
    }

    /// The left operand for `tile::product`: at `at`, strides `l`, cold when this part's
    /// left operand holds at least [`COLD_LEFT`] floats.
    fn left(self, at: *const f32, l: (usize, usize)) -> tile::Left {
        tile::Left {
            at,
            strides: l,
            cold: self.m.saturating_mul(self.k) >= COLD_LEFT,
        }
    }

    /// Packs rows `[p0, p0 + depth)` by columns `[j0, j0 + cols)` of the right operand into
    /// `panel` and adds their product with `lhs` (the left operand's columns `[p0, p0 +
    /// depth)`, at strides `l`) to `dst`'s columns `[j0, j0 + cols)`: overwriting them when
    /// the product does and this is the first panel down.
    ///
    /// # Safety
    /// The panel and `lhs`'s `m x depth` lie inside the product; `panel` holds `depth` rows.
    unsafe fn panel(
        self,
        isa: Isa,
        (p0, depth): (usize, usize),
        (j0, cols): (usize, usize),
        (lhs, l): (*const f32, (usize, usize)),
        panel: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            self.pack((p0, depth), (j0, cols), panel);
            tile::product(
                isa,
                (self.m, cols, depth),
                (self.dst.0.add(j0), self.ld),
                self.accumulate || p0 > 0,
                self.left(lhs, l),
                (panel.as_ptr(), 64),
                // The bias after each element's last multiply-add.
                self.bias
                    .filter(|_| p0 + depth == self.k)
                    .map(|b| b.0.add(j0).cast_const()),
            );
        }
    }

    /// Copies rows `[p0, p0 + depth)` by columns `[j0, j0 + cols)` of the right operand
    /// into `panel` (rows 64 apart), transposed when its columns are contiguous.
    ///
    /// # Safety
    /// Those rows and columns lie inside the right operand; `panel` holds `depth` rows.
    unsafe fn pack(
        self,
        (p0, depth): (usize, usize),
        (j0, cols): (usize, usize),
        panel: &mut [f32],
    ) {
        use super::transpose_into;
        let r = self.r;
        // SAFETY: the caller's contract.
        unsafe {
            let at = self.rhs.0.add(p0 * r.0 + j0 * r.1);
            if r.1 == 1 {
                for p in 0..depth {
                    let row = std::slice::from_raw_parts(at.add(p * r.0), cols);
                    panel[p * 64..p * 64 + cols].copy_from_slice(row);
                }
            } else if r.0 == 1 {
                // Its transpose's rows: columns [j0, j0 + cols), `depth` long.
                let len = (cols - 1) * r.1 + depth;
                let src = std::slice::from_raw_parts(at, len);
                transpose_into(src, r.1, (cols, depth), panel, 64);
            } else {
                for p in 0..depth {
                    for c in 0..cols {
                        panel[p * 64 + c] = *at.add(p * r.0 + c * r.1);
                    }
                }
            }
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
            self.add_bias();
        }
    }
}

/// `dst [m, n] = lhs [m, k] x rhs [k, n]` (operands at element strides `(rows, columns)`,
/// `dst` row-major) split as [`super::matmul`] splits it but with the given engine, `gemm`,
/// `matrixmultiply` or `panels`: for `examples/gemm_speed`, which times them against each
/// other.
///
/// Panics if a matrix does not fit its slice.
#[doc(hidden)]
pub fn product_by(
    engine: &str,
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    (lhs, l): (&[f32], (usize, usize)),
    (rhs, r): (&[f32], (usize, usize)),
) {
    assert!(fits(m, n, n, 1, dst.len()) && fits(m, k, l.0, l.1, lhs.len()));
    assert!(fits(k, n, r.0, r.1, rhs.len()) && m * n * k > 0);
    let engine = match engine {
        "gemm" => Engine::Gemm,
        "matrixmultiply" => Engine::Matrixmultiply,
        "panels" => Engine::Panels,
        _ => panic!("no engine {engine:?}: gemm, matrixmultiply or panels"),
    };
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
        bias: None,
    };
    // SAFETY: the matrices fit their slices (checked above), and `dst` is borrowed mutably.
    unsafe { job.multiply_by(engine, parallelism(m, n, k)) }
}

#[cfg(test)]
#[path = "parts_tests.rs"]
mod tests;
