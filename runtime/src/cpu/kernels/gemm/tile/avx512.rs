//! The panels' kernel and transposes with AVX-512F: 16 lanes, blocks of 6 x 64.

use std::arch::x86_64::*;

/// Lanes of a vector.
const LANES: usize = 16;
/// Vectors of a block's row: `ROWS x 4` accumulators, 4 vectors of the right operand's
/// row and a broadcast make 29 of the 32 vector registers.
const VECTORS: usize = 4;
type Mask = __mmask16;

/// The mask of the first `lanes` lanes (`None`: the vector is whole).
fn mask(lanes: usize) -> Option<Mask> {
    (lanes != 0).then(|| (1 << lanes) - 1)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn zero() -> __m512 {
    _mm512_setzero_ps()
}

#[inline]
#[target_feature(enable = "avx512f")]
fn splat(x: f32) -> __m512 {
    _mm512_set1_ps(x)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
    _mm512_fmadd_ps(a, b, c)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn add(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(a, b)
}

/// The vector at `p`, its lanes past `mask` zero (a masked load never touches them).
///
/// # Safety
/// The lanes in `mask` lie inside an allocation.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load(p: *const f32, mask: Option<Mask>) -> __m512 {
    // SAFETY: the caller's contract.
    unsafe { _mm512_maskz_loadu_ps(mask.unwrap_or(0xffff), p) }
}

/// # Safety
/// The lanes in `mask` lie inside an allocation, valid for writes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store(p: *mut f32, mask: Option<Mask>, x: __m512) {
    // SAFETY: the caller's contract.
    unsafe { _mm512_mask_storeu_ps(p, mask.unwrap_or(0xffff), x) }
}

// Blocks of 1 to 4 vectors a row.
register_blocks!("avx512f", [4, 3, 2]);

/// How far ahead along a source row a transpose asks for its lines (four blocks).
const AHEAD: usize = 4 * LANES;

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
                    let row = src.add((r0 + i) * rs);
                    // Each of these rows is a stream of its own, more than the hardware's
                    // prefetchers follow: ask for its line four blocks on.
                    if c0 + AHEAD < width {
                        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(c0 + AHEAD).cast());
                    }
                    *v = _mm512_maskz_loadu_ps(read, row.add(c0));
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
