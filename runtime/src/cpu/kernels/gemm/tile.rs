//! The kernels of the `Panels` engine (see `parts`), with AVX-512 or with AVX2 and FMA: a
//! register-blocked product that reads its operands in place (the right one with contiguous
//! rows, the left one with either stride 1), and the register transposes (16 x 16, 8 x 8)
//! that lay a right operand out for it.
//!
//! Determinism: each output element is the fused multiply-add chain over `p = 0..k` in
//! order, started from the output's value when accumulating (zero otherwise): its bits
//! depend on the operands and `k` alone, so the same with either instruction set.

use super::fits;
use crate::cpu::kernels::simd::{level, Level};

/// The instruction set the panels' kernel runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Isa {
    Avx512,
    Avx2,
}

/// The panels' instruction set on this CPU: the vector level of the elementwise loops
/// (`vectorised!`), so `PARALLAX_NO_SIMD` turns the kernels off and `PARALLAX_NO_AVX512`
/// stops them at AVX2; `None` on other architectures.
pub(super) fn isa() -> Option<Isa> {
    if !cfg!(target_arch = "x86_64") {
        return None;
    }
    match level() {
        Level::Avx512 => Some(Isa::Avx512),
        Level::Avx2 => Some(Isa::Avx2),
        Level::Baseline => None,
    }
}

/// The left operand of [`product`]: element `(i, p)` at `at + i * strides.0 + p *
/// strides.1`. `cold`: too large to stay in a core's caches between the product's sweeps
/// over it, so its columns, when they are contiguous, are asked for ahead (see
/// `Ahead::Columns`); a row-major one's rows always are.
#[derive(Clone, Copy)]
pub(super) struct Left {
    pub at: *const f32,
    pub strides: (usize, usize),
    pub cold: bool,
}

/// `dst [m, n] (= or +=) a [m, k] x b [k, n]` in `isa`'s register blocks: `dst` at leading
/// dimension `ld`, `a` as [`Left`] says, `b` row-major at leading dimension `ldb`. With
/// `bias` (`n` values), `bias[j]` is added to each element of column `j` as it is stored,
/// after its chain: the f32 sum an add after the product makes.
///
/// # Safety
/// The CPU has `isa` (as [`isa`] found it); the three matrices lie inside live allocations;
/// `dst` is valid for writes and aliases neither operand.
pub(super) unsafe fn product(
    isa: Isa,
    mnk: (usize, usize, usize),
    out: (*mut f32, usize),
    accumulate: bool,
    a: Left,
    b: (*const f32, usize),
    bias: Option<*const f32>,
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's contract.
    unsafe {
        match isa {
            Isa::Avx512 => avx512::product(mnk, out, accumulate, a, b, bias),
            Isa::Avx2 => avx2::product(mnk, out, accumulate, a, b, bias),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, mnk, out, accumulate, a, b, bias);
        unreachable!("no instruction set for the panels off x86-64: `isa()` is `None` there");
    }
}

/// `dst[c * ld + r] = src[r * rs + c]` for the `rows x width` matrix at `src` (rows `rs`
/// apart): the right operands `q k^T` and the panels read, in blocks transposed in registers
/// where the CPU has AVX-512 or AVX2.
pub(in crate::cpu::kernels) fn transpose_into(
    src: &[f32],
    rs: usize,
    (rows, width): (usize, usize),
    dst: &mut [f32],
    ld: usize,
) {
    if rows == 0 || width == 0 {
        return;
    }
    assert!(
        fits(rows, width, rs, 1, src.len()),
        "transpose: source out of bounds"
    );
    assert!(
        fits(width, rows, ld, 1, dst.len()),
        "transpose: destination out of bounds"
    );
    #[cfg(target_arch = "x86_64")]
    {
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        // SAFETY: the CPU has the instruction set ([`isa`]); both matrices fit their slices
        // (checked).
        match isa() {
            Some(Isa::Avx512) => return unsafe { avx512::transpose(s, rs, (rows, width), d, ld) },
            Some(Isa::Avx2) => return unsafe { avx2::transpose(s, rs, (rows, width), d, ld) },
            None => {}
        }
    }
    scalar_transpose(src, rs, (rows, width), dst, ld);
}

/// [`transpose_into`] element by element (its contract, unchecked bounds aside).
fn scalar_transpose(
    src: &[f32],
    rs: usize,
    (rows, width): (usize, usize),
    dst: &mut [f32],
    ld: usize,
) {
    for r in 0..rows {
        for (c, &x) in src[r * rs..r * rs + width].iter().enumerate() {
            dst[c * ld + r] = x;
        }
    }
}

/// The register-blocked product of one instruction set, from its module's `Mask`, `LANES`,
/// `VECTORS`, `mask`, `load`, `store`, `splat`, `fma` and `zero`: blocks of up to `ROWS` rows
/// by `VECTORS` vectors of the output, the last vector of a row masked to the product's
/// columns. The list names the vector counts a block may have past the first (`VECTORS`
/// down to 2), one compiled block each.
#[cfg(target_arch = "x86_64")]
macro_rules! register_blocks {
    ($feature:literal, [$($vectors:literal),*]) => {
        /// Rows of the output one block keeps in registers.
        const ROWS: usize = 6;
        /// Floats in a cache line: the steps over K between two requests for a row's next
        /// line (see `Block::run`).
        const LINE: usize = 16;

        /// See [`super::product`].
        ///
        /// # Safety
        /// The CPU has this module's instruction set; [`super::product`]'s contract.
        #[target_feature(enable = $feature)]
        pub(super) unsafe fn product(
            (m, n, k): (usize, usize, usize),
            (dst, ld): (*mut f32, usize),
            accumulate: bool,
            super::Left { at: a, strides: (a_rs, a_cs), cold }: super::Left,
            (b, ldb): (*const f32, usize),
            bias: Option<*const f32>,
        ) {
            // Row blocks outside, strips of columns inside: a block's rows of `a` stay in L1
            // across the strips (with AVX2 four of them span a panel: the other order read a
            // transposed `[1024, 1024]` left operand from L2 four times, 180 against 250
            // GFLOP/s). The right operand is at most a panel (32 KiB) whenever `m` is large.
            let strip = VECTORS * LANES;
            let block = |cols: usize| Block {
                k,
                ld,
                accumulate,
                a_rs,
                a_cs,
                ldb,
                last: mask(cols % LANES),
            };
            let (whole, rest) = (block(strip), block(n % strip));
            let mut i0 = 0;
            while i0 < m {
                let rows = (m - i0).min(ROWS);
                for j0 in (0..n).step_by(strip) {
                    let cols = (n - j0).min(strip);
                    let block = if cols == strip { &whole } else { &rest };
                    // SAFETY: rows [i0, i0 + rows) and columns [j0, j0 + cols) lie inside
                    // the product; the caller's contract does the rest.
                    unsafe {
                        let c = dst.add(i0 * ld + j0);
                        let (a, b) = (a.add(i0 * a_rs), b.add(j0));
                        let bias = bias.map(|p| p.add(j0));
                        let vectors = cols.div_ceil(LANES);
                        // What the next blocks read of the left operand, asked for while
                        // the first strip runs (see `Block::run`).
                        let next_rows = (m - i0 - rows).min(ROWS);
                        let ahead = if j0 > 0 {
                            Ahead::Nothing
                        } else if a_cs == 1 && next_rows > 0 {
                            Ahead::Rows(a.wrapping_add(rows * a_rs), next_rows)
                        } else if cold && a_rs == 1 && a_cs > 1 && i0 + LINE < m {
                            Ahead::Columns(a.wrapping_add(LINE))
                        } else {
                            Ahead::Nothing
                        };
                        match rows {
                            6 => block.rows::<6>(vectors, c, a, b, bias, ahead),
                            5 => block.rows::<5>(vectors, c, a, b, bias, ahead),
                            4 => block.rows::<4>(vectors, c, a, b, bias, ahead),
                            3 => block.rows::<3>(vectors, c, a, b, bias, ahead),
                            2 => block.rows::<2>(vectors, c, a, b, bias, ahead),
                            _ => block.rows::<1>(vectors, c, a, b, bias, ahead),
                        }
                    }
                }
                i0 += rows;
            }
        }

        /// The left operand's lines a block asks for while it runs, for the blocks after it.
        #[derive(Clone, Copy)]
        enum Ahead {
            Nothing,
            /// The next block's first element and its row count, the left operand
            /// row-major.
            Rows(*const f32, usize),
            /// The left operand transposed (its columns contiguous): this block's element
            /// `LINE` rows on, whose line in each column the blocks after it read.
            Columns(*const f32),
        }

        /// What every block of one product shares.
        struct Block {
            k: usize,
            ld: usize,
            accumulate: bool,
            a_rs: usize,
            a_cs: usize,
            ldb: usize,
            /// The mask of a row's last vector when the product's columns end inside it.
            last: Option<Mask>,
        }

        impl Block {
            /// [`Block::run`] for `R` rows and `vectors` (1 to `VECTORS`) vectors.
            ///
            /// # Safety
            /// [`Block::run`]'s.
            #[inline]
            #[target_feature(enable = $feature)]
            unsafe fn rows<const R: usize>(
                &self,
                vectors: usize,
                c: *mut f32,
                a: *const f32,
                b: *const f32,
                bias: Option<*const f32>,
                ahead: Ahead,
            ) {
                // SAFETY: the caller's contract.
                unsafe {
                    match vectors {
                        $($vectors => self.run::<R, $vectors>(c, a, b, bias, ahead),)*
                        _ => self.run::<R, 1>(c, a, b, bias, ahead),
                    }
                }
            }

            /// `R` rows by `V` vectors of the output (the last one masked), at `c`, from the
            /// left operand's rows at `a` and the right operand's columns at `b`; `bias`, the
            /// block's columns' values, added as it is stored. With `Ahead::Rows` (the left
            /// operand row-major), each of the next block's rows' next cache line is asked for
            /// every `LINE` steps over K: a block reads its 6 rows' lines at once, 6 short
            /// streams rows apart that the hardware's prefetchers do not follow, and a step's
            /// activations come from L3 or memory (`gemm_speed` with the left operand
            /// flushed, AVX2: `[2048, 256] x [256, 256]^T` 81-85% -> 91-93% of the peak, as
            /// warm). With `Ahead::Columns` (the left operand transposed, and cold), each step
            /// asks for its column's line `LINE` rows on, which the blocks after it read.
            ///
            /// # Safety
            /// The CPU has this module's instruction set; the block lies inside the product
            /// (see [`product`]).
            #[inline]
            #[target_feature(enable = $feature)]
            unsafe fn run<const R: usize, const V: usize>(
                &self,
                c: *mut f32,
                a: *const f32,
                b: *const f32,
                bias: Option<*const f32>,
                ahead: Ahead,
            ) {
                let mask = |v: usize| if v + 1 == V { self.last } else { None };
                let mut acc = [[zero(); V]; R];
                // SAFETY (all accesses): inside the block, the masked lanes never touched.
                unsafe {
                    if self.accumulate {
                        for (i, row) in acc.iter_mut().enumerate() {
                            for (v, x) in row.iter_mut().enumerate() {
                                *x = load(c.add(i * self.ld + v * LANES), mask(v));
                            }
                        }
                    }
                    // One step over K: the accumulators' multiply-adds for row `p` of `b`.
                    let mut step = |p: usize| {
                        let bp = b.add(p * self.ldb);
                        let mut bv = [zero(); V];
                        for (v, x) in bv.iter_mut().enumerate() {
                            *x = load(bp.add(v * LANES), mask(v));
                        }
                        let ap = a.add(p * self.a_cs);
                        for (i, row) in acc.iter_mut().enumerate() {
                            let ai = splat(*ap.add(i * self.a_rs));
                            for (x, &bx) in row.iter_mut().zip(&bv) {
                                *x = fma(ai, bx, *x);
                            }
                        }
                    };
                    match ahead {
                        Ahead::Nothing => (0..self.k).for_each(&mut step),
                        Ahead::Rows(next, rows) => {
                            for p0 in (0..self.k).step_by(LINE) {
                                for i in 0..rows {
                                    let line = next.wrapping_add(i * self.a_rs + p0);
                                    _mm_prefetch::<_MM_HINT_T0>(line.cast());
                                }
                                (p0..(p0 + LINE).min(self.k)).for_each(&mut step);
                            }
                        }
                        Ahead::Columns(next) => {
                            for p in 0..self.k {
                                let line = next.wrapping_add(p * self.a_cs);
                                _mm_prefetch::<_MM_HINT_T0>(line.cast());
                                step(p);
                            }
                        }
                    }
                    if let Some(bias) = bias {
                        let mut by = [zero(); V];
                        for (v, x) in by.iter_mut().enumerate() {
                            *x = load(bias.add(v * LANES), mask(v));
                        }
                        for row in acc.iter_mut() {
                            for (x, &y) in row.iter_mut().zip(&by) {
                                *x = add(*x, y);
                            }
                        }
                    }
                    for (i, row) in acc.iter().enumerate() {
                        for (v, &x) in row.iter().enumerate() {
                            store(c.add(i * self.ld + v * LANES), mask(v), x);
                        }
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::kernels::gemm::tests::{assert_close, random, reference, stored};
    use crate::cpu::kernels::gemm::{gemm_into, View};
    use gemm::Parallelism;

    /// The instruction sets this CPU has, whatever level the kernels run at (so both are
    /// tested on an AVX-512 machine).
    fn cpu_isas() -> Vec<Isa> {
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                isas.push(Isa::Avx2);
            }
        }
        eprintln!("instruction sets tested: {isas:?} and the scalar code");
        isas
    }

    /// Whole and partial 16 x 16 and 8 x 8 blocks, rows further apart than they are wide, a
    /// destination wider than the rows, in each instruction set and element by element:
    /// every element in its place, the rest untouched.
    #[test]
    fn transposes_are_exact() {
        let mut ways: Vec<Option<Isa>> = cpu_isas().into_iter().map(Some).collect();
        ways.push(None);
        for way in ways {
            for (rows, width, rs, ld) in [
                (64, 64, 256, 64),
                (5, 3, 3, 8),
                (17, 33, 40, 20),
                (9, 8, 8, 9),
                (24, 19, 19, 30),
                (1, 1, 1, 1),
            ] {
                let src = random(&[rows * rs], 1);
                let mut dst = vec![f32::NAN; width * ld];
                let (s, d) = (src.f32(), &mut dst[..]);
                match way {
                    // SAFETY: the CPU has the instruction set; both fit their vectors.
                    #[cfg(target_arch = "x86_64")]
                    Some(Isa::Avx512) => unsafe {
                        avx512::transpose(s.as_ptr(), rs, (rows, width), d.as_mut_ptr(), ld)
                    },
                    // SAFETY: as above.
                    #[cfg(target_arch = "x86_64")]
                    Some(Isa::Avx2) => unsafe {
                        avx2::transpose(s.as_ptr(), rs, (rows, width), d.as_mut_ptr(), ld)
                    },
                    _ => scalar_transpose(s, rs, (rows, width), d, ld),
                }
                for c in 0..width {
                    for r in 0..ld {
                        let got = dst[c * ld + r];
                        if r < rows {
                            assert_eq!(got, src.f32()[r * rs + c], "{way:?} ({c}, {r})");
                        } else {
                            assert!(got.is_nan(), "{way:?} ({c}, {r}) past the rows was written");
                        }
                    }
                }
            }
        }
    }

    /// Each instruction set's kernel on its own, the right operand read in place with rows
    /// longer than the product (whole and partial row blocks, whole and masked last vectors,
    /// strips past the first), either left layout, overwriting and accumulating, its lines
    /// asked for ahead or not: each element the in-order FMA chain, bit for bit (the same in
    /// both sets), the rest untouched.
    #[test]
    fn each_instruction_set_gives_the_in_order_chain() {
        for isa in cpu_isas() {
            for (m, k, n) in [
                (13, 37, 70),
                (6, 5, 8),
                (1, 3, 3),
                (7, 64, 16),
                (11, 2, 65),
                (40, 9, 20),
            ] {
                for ta in [false, true] {
                    let a = random(&stored(&[], m, k, ta), 1);
                    let ldb = n + 5;
                    let b = random(&[k, ldb], 2);
                    let ld = n + 3;
                    let start = random(&[m, ld], 3);
                    for (accumulate, cold) in [(false, false), (true, false), (true, true)] {
                        let mut dst = start.f32().to_vec();
                        let l = if ta { (1, m) } else { (k, 1) };
                        // SAFETY: the CPU has `isa`; the matrices fit their vectors.
                        unsafe {
                            product(
                                isa,
                                (m, n, k),
                                (dst.as_mut_ptr(), ld),
                                accumulate,
                                Left {
                                    at: a.f32().as_ptr(),
                                    strides: l,
                                    cold,
                                },
                                (b.f32().as_ptr(), ldb),
                                None,
                            )
                        };
                        for i in 0..m {
                            let (row, was) = (
                                &dst[i * ld..(i + 1) * ld],
                                &start.f32()[i * ld..(i + 1) * ld],
                            );
                            assert_eq!(row[n..], was[n..], "{isa:?}: past the product");
                            for j in 0..n {
                                let base = if accumulate { was[j] } else { 0.0 };
                                let chain = (0..k).fold(base, |c, p| {
                                    a.f32()[i * l.0 + p * l.1].mul_add(b.f32()[p * ldb + j], c)
                                });
                                assert_eq!(
                                    row[j].to_bits(),
                                    chain.to_bits(),
                                    "{isa:?} {m}x{k}x{n} ({i}, {j})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// One thread's products of every shape class the kernel's blocks cover (whole and
    /// partial row blocks, 1-4 vectors, a masked last vector, columns past 64, a right
    /// operand read in place and one packed in panels of `PANEL_DEPTH` rows), both left
    /// layouts, overwriting and accumulating into a `dst` wider than the product: the
    /// reference values, the columns past `n` untouched and, in the panels (AVX-512 or AVX2)
    /// with at least 16 columns, each element the in-order FMA chain (so its bits do not depend on how the
    /// product was blocked).
    #[test]
    fn products_are_the_in_order_chain_in_either_left_layout() {
        let avx = isa().is_some();
        eprintln!(
            "one thread's products: {}",
            if avx { "panels" } else { "gemm crate" }
        );
        for (m, k, n) in [
            (64, 64, 64),
            (7, 13, 5),
            (7, 13, 21),
            (5, 9, 40),
            (4, 64, 33),
            (6, 3, 16),
            (13, 70, 130),
            (1, 1, 1),
            (64, 128, 17),
            (20, 300, 70),
        ] {
            for ta in [false, true] {
                let a = random(&stored(&[], m, k, ta), 1);
                let b = random(&[k, n], 2);
                let want = reference(&a, &b, ta, false);
                let lhs = View::new(a.f32(), if ta { 1 } else { k }, if ta { m } else { 1 });
                let ld = n + 3;
                let start = random(&[m, ld], 3);
                for accumulate in [false, true] {
                    let mut dst = start.f32().to_vec();
                    let rhs = View::new(b.f32(), n, 1);
                    let par = Parallelism::None;
                    gemm_into(m, n, k, &mut dst, ld, accumulate, lhs, rhs, par);
                    let mut got = Vec::new();
                    for i in 0..m {
                        let row = &dst[i * ld..(i + 1) * ld];
                        let was = &start.f32()[i * ld..(i + 1) * ld];
                        assert_eq!(row[n..], was[n..], "past the product, {m}x{k}x{n}");
                        let base = |j: usize| if accumulate { was[j] } else { 0.0 };
                        got.extend((0..n).map(|j| row[j] - base(j)));
                        // Narrower than a vector, a product runs in the `gemm` crate.
                        if avx && n >= 16 {
                            for (j, got) in row[..n].iter().enumerate() {
                                let chain = (0..k).fold(base(j), |c, p| {
                                    let x = if ta {
                                        a.f32()[p * m + i]
                                    } else {
                                        a.f32()[i * k + p]
                                    };
                                    x.mul_add(b.f32()[p * n + j], c)
                                });
                                assert_eq!(got.to_bits(), chain.to_bits(), "({i}, {j})");
                            }
                        }
                    }
                    assert_close(&got, &want, 1e-5);
                }
            }
        }
    }
}
