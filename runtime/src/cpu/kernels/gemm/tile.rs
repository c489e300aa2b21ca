//! The AVX-512 kernel of the `Panels` engine (see `parts`): a register-blocked product
//! that reads its operands in place (the right one with contiguous rows, the left one with
//! either stride 1), and the 16 x 16 transposes that lay a right operand out for it.
//!
//! Determinism: each output element is the fused multiply-add chain over `p = 0..k` in
//! order, started from the output's value when accumulating (zero otherwise): its bits
//! depend on the operands and `k` alone.

use super::fits;

/// Whether the AVX-512 kernels run: the vector level the elementwise loops use (so
/// `PARALLAX_NO_SIMD` and `PARALLAX_NO_AVX512` turn them off too).
pub(super) fn has_avx512() -> bool {
    crate::cpu::kernels::simd::level() == crate::cpu::kernels::simd::Level::Avx512
}

/// `dst[c * ld + r] = src[r * rs + c]` for the `rows x width` matrix at `src` (rows `rs`
/// apart): the right operands `q k^T` and the panels read, in 16 x 16 blocks in registers
/// with AVX-512.
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
    if has_avx512() {
        // SAFETY: AVX-512 is present and both matrices fit their slices (checked).
        unsafe { avx512::transpose(src.as_ptr(), rs, (rows, width), dst.as_mut_ptr(), ld) };
        return;
    }
    for r in 0..rows {
        for (c, &x) in src[r * rs..r * rs + width].iter().enumerate() {
            dst[c * ld + r] = x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use std::arch::x86_64::*;

    /// Rows of the output one block keeps in registers: `ROWS x 4` accumulators, 4 vectors
    /// of the right operand's row and a broadcast make 29 of the 32 vector registers.
    const ROWS: usize = 6;
    /// Lanes of a vector.
    const LANES: usize = 16;

    /// `dst [m, n] (= or +=) a [m, k] x b [k, n]` in blocks of up to 64 columns and
    /// [`ROWS`] rows: `dst` at leading dimension `ld`, element `(i, p)` of `a` at
    /// `i * a_rs + p * a_cs`, `b` row-major at leading dimension `ldb`.
    ///
    /// # Safety
    /// AVX-512F is present; the three matrices lie inside live allocations; `dst` is valid
    /// for writes and aliases neither operand.
    #[target_feature(enable = "avx512f")]
    pub(in crate::cpu::kernels::gemm) unsafe fn product(
        (m, n, k): (usize, usize, usize),
        (dst, ld): (*mut f32, usize),
        accumulate: bool,
        (a, (a_rs, a_cs)): (*const f32, (usize, usize)),
        (b, ldb): (*const f32, usize),
    ) {
        for j0 in (0..n).step_by(4 * LANES) {
            let cols = (n - j0).min(4 * LANES);
            // The last vector's lanes inside the product (all of them when it is whole).
            let tail = cols % LANES;
            let mask: __mmask16 = if tail == 0 { 0xffff } else { (1 << tail) - 1 };
            let block = Block {
                k,
                ld,
                accumulate,
                a_rs,
                a_cs,
                ldb,
                mask,
            };
            let mut i0 = 0;
            while i0 < m {
                let rows = (m - i0).min(ROWS);
                // SAFETY: rows [i0, i0 + rows) and columns [j0, j0 + cols) lie inside the
                // product; the caller's contract does the rest.
                unsafe {
                    let c = dst.add(i0 * ld + j0);
                    let (a, b) = (a.add(i0 * a_rs), b.add(j0));
                    let vectors = cols.div_ceil(LANES);
                    match rows {
                        6 => block.rows::<6>(vectors, c, a, b),
                        5 => block.rows::<5>(vectors, c, a, b),
                        4 => block.rows::<4>(vectors, c, a, b),
                        3 => block.rows::<3>(vectors, c, a, b),
                        2 => block.rows::<2>(vectors, c, a, b),
                        _ => block.rows::<1>(vectors, c, a, b),
                    }
                }
                i0 += rows;
            }
        }
    }

    /// [`super::transpose_into`] in blocks of 16 x 16.
    ///
    /// # Safety
    /// AVX-512F; the source (`rows` of `width` at `rs`) and the destination (`width` rows of
    /// `rows` at `ld`) lie inside their allocations and do not overlap.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose(
        src: *const f32,
        rs: usize,
        (rows, width): (usize, usize),
        dst: *mut f32,
        ld: usize,
    ) {
        let lanes = |n: usize| -> __mmask16 {
            if n >= LANES {
                0xffff
            } else {
                (1 << n) - 1
            }
        };
        for r0 in (0..rows).step_by(LANES) {
            let out = lanes(rows - r0);
            for c0 in (0..width).step_by(LANES) {
                let read = lanes(width - c0);
                // SAFETY (all accesses): rows past `rows` are never read, lanes past `width`
                // never touched.
                unsafe {
                    let mut x = [_mm512_setzero_ps(); LANES];
                    for (i, v) in x.iter_mut().enumerate().take(rows - r0) {
                        *v = _mm512_maskz_loadu_ps(read, src.add((r0 + i) * rs + c0));
                    }
                    let t = transpose16(x);
                    for (c, v) in t.iter().enumerate().take((width - c0).min(LANES)) {
                        _mm512_mask_storeu_ps(dst.add((c0 + c) * ld + r0), out, *v);
                    }
                }
            }
        }
    }

    /// The 16 x 16 transpose of the rows `r`: interleaving pairs of rows, then pairs of
    /// pairs, then 128-bit lanes twice (`out[c]` is column `c`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose16(r: [__m512; LANES]) -> [__m512; LANES] {
        let mut t = [_mm512_setzero_ps(); LANES];
        for k in 0..8 {
            // Per 128-bit lane: (a0 b0 a1 b1) and (a2 b2 a3 b3) of rows 2k and 2k + 1.
            t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
            t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
        }
        let mut u = [_mm512_setzero_ps(); LANES];
        let pd = _mm512_castps_pd;
        for k in 0..4 {
            // u[4k + j] holds column 4L + j of rows 4k..4k + 4 in its 128-bit lane L.
            let (a, b, c, d) = (t[4 * k], t[4 * k + 1], t[4 * k + 2], t[4 * k + 3]);
            u[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a), pd(c)));
            u[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a), pd(c)));
            u[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b), pd(d)));
            u[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b), pd(d)));
        }
        let mut out = [_mm512_setzero_ps(); LANES];
        for j in 0..4 {
            // Lanes 0 and 2, then 1 and 3, of the row groups 0, 1 and 2, 3...
            let v0 = _mm512_shuffle_f32x4::<0x88>(u[j], u[4 + j]);
            let v1 = _mm512_shuffle_f32x4::<0xdd>(u[j], u[4 + j]);
            let w0 = _mm512_shuffle_f32x4::<0x88>(u[8 + j], u[12 + j]);
            let w1 = _mm512_shuffle_f32x4::<0xdd>(u[8 + j], u[12 + j]);
            // ... and then lane L of all four groups: column 4L + j.
            out[j] = _mm512_shuffle_f32x4::<0x88>(v0, w0);
            out[8 + j] = _mm512_shuffle_f32x4::<0xdd>(v0, w0);
            out[4 + j] = _mm512_shuffle_f32x4::<0x88>(v1, w1);
            out[12 + j] = _mm512_shuffle_f32x4::<0xdd>(v1, w1);
        }
        out
    }

    /// What every block of one product shares.
    struct Block {
        k: usize,
        ld: usize,
        accumulate: bool,
        a_rs: usize,
        a_cs: usize,
        ldb: usize,
        /// The lanes of the last vector of a row inside the product.
        mask: __mmask16,
    }

    impl Block {
        /// [`Block::run`] for `R` rows and `vectors` (1-4) vectors.
        ///
        /// # Safety
        /// [`Block::run`]'s.
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn rows<const R: usize>(
            &self,
            vectors: usize,
            c: *mut f32,
            a: *const f32,
            b: *const f32,
        ) {
            // SAFETY: the caller's contract.
            unsafe {
                match vectors {
                    4 => self.run::<R, 4>(c, a, b),
                    3 => self.run::<R, 3>(c, a, b),
                    2 => self.run::<R, 2>(c, a, b),
                    _ => self.run::<R, 1>(c, a, b),
                }
            }
        }

        /// `R` rows by `V` vectors of the output (the last one masked), at `c`, from the
        /// left operand's rows at `a` and the right operand's columns at `b`.
        ///
        /// # Safety
        /// AVX-512F; the block lies inside the product (see [`product`]).
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const R: usize, const V: usize>(
            &self,
            c: *mut f32,
            a: *const f32,
            b: *const f32,
        ) {
            let mask = |v: usize| if v + 1 == V { self.mask } else { 0xffff };
            let mut acc = [[_mm512_setzero_ps(); V]; R];
            // SAFETY (all accesses): inside the block, the masked lanes never touched.
            unsafe {
                if self.accumulate {
                    for (i, row) in acc.iter_mut().enumerate() {
                        for (v, x) in row.iter_mut().enumerate() {
                            *x = _mm512_maskz_loadu_ps(mask(v), c.add(i * self.ld + v * LANES));
                        }
                    }
                }
                for p in 0..self.k {
                    let bp = b.add(p * self.ldb);
                    let mut bv = [_mm512_setzero_ps(); V];
                    for (v, x) in bv.iter_mut().enumerate() {
                        *x = _mm512_maskz_loadu_ps(mask(v), bp.add(v * LANES));
                    }
                    let ap = a.add(p * self.a_cs);
                    for (i, row) in acc.iter_mut().enumerate() {
                        let ai = _mm512_set1_ps(*ap.add(i * self.a_rs));
                        for (x, &bx) in row.iter_mut().zip(&bv) {
                            *x = _mm512_fmadd_ps(ai, bx, *x);
                        }
                    }
                }
                for (i, row) in acc.iter().enumerate() {
                    for (v, &x) in row.iter().enumerate() {
                        _mm512_mask_storeu_ps(c.add(i * self.ld + v * LANES), mask(v), x);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::kernels::gemm::tests::{assert_close, random, reference, stored};
    use crate::cpu::kernels::gemm::{gemm_into, View};
    use gemm::Parallelism;

    /// Whole and partial 16 x 16 blocks, rows further apart than they are wide, a
    /// destination wider than the rows: every element in its place, the rest untouched.
    #[test]
    fn transposes_are_exact() {
        for (rows, width, rs, ld) in [
            (64, 64, 256, 64),
            (5, 3, 3, 8),
            (17, 33, 40, 20),
            (1, 1, 1, 1),
        ] {
            let src = random(&[rows * rs], 1);
            let mut dst = vec![f32::NAN; width * ld];
            transpose_into(src.f32(), rs, (rows, width), &mut dst, ld);
            for c in 0..width {
                for r in 0..ld {
                    let got = dst[c * ld + r];
                    if r < rows {
                        assert_eq!(got, src.f32()[r * rs + c], "({c}, {r})");
                    } else {
                        assert!(got.is_nan(), "({c}, {r}) past the rows was written");
                    }
                }
            }
        }
    }

    /// One thread's products of every shape class the kernel's blocks cover (whole and
    /// partial row blocks, 1-4 vectors, a masked last vector, columns past 64, a right
    /// operand read in place and one packed in panels of `PANEL_DEPTH` rows), both left
    /// layouts, overwriting and accumulating into a `dst` wider than the product: the
    /// reference values, the columns past `n` untouched and, with AVX-512 and at least 16
    /// columns, each element the in-order FMA chain (so its bits do not depend on how the
    /// product was blocked).
    #[test]
    fn products_are_the_in_order_chain_in_either_left_layout() {
        let avx = has_avx512();
        eprintln!(
            "one thread's products: {}",
            if avx { "AVX-512 panels" } else { "gemm crate" }
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
