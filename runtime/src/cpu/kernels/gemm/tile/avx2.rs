//! The panels' kernel and transposes with AVX2 and FMA: 8 lanes, blocks of 6 x 16.

use std::arch::x86_64::*;

/// Lanes of a vector.
const LANES: usize = 8;
/// Vectors of a block's row: `ROWS x 2` accumulators, 2 vectors of the right operand's
/// row and a broadcast make 15 of the 16 vector registers.
const VECTORS: usize = 2;
/// Lanes set (all bits) or clear, for `maskload` and `maskstore`.
type Mask = __m256i;

/// The mask of the first `lanes` lanes (`None`: the vector is whole).
fn mask(lanes: usize) -> Option<Mask> {
    let lane = |l: usize| if l < lanes { -1 } else { 0 };
    // SAFETY: AVX is present wherever this module's kernels run.
    (lanes != 0).then(|| unsafe {
        _mm256_setr_epi32(
            lane(0),
            lane(1),
            lane(2),
            lane(3),
            lane(4),
            lane(5),
            lane(6),
            lane(7),
        )
    })
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn zero() -> __m256 {
    _mm256_setzero_ps()
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn splat(x: f32) -> __m256 {
    _mm256_set1_ps(x)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
    _mm256_fmadd_ps(a, b, c)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn add(a: __m256, b: __m256) -> __m256 {
    _mm256_add_ps(a, b)
}

/// The vector at `p`, its lanes past `mask` zero (a masked load never touches them).
///
/// # Safety
/// The lanes in `mask` lie inside an allocation.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load(p: *const f32, mask: Option<Mask>) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        match mask {
            None => _mm256_loadu_ps(p),
            Some(m) => _mm256_maskload_ps(p, m),
        }
    }
}

/// # Safety
/// The lanes in `mask` lie inside an allocation, valid for writes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store(p: *mut f32, mask: Option<Mask>, x: __m256) {
    // SAFETY: the caller's contract.
    unsafe {
        match mask {
            None => _mm256_storeu_ps(p, x),
            Some(m) => _mm256_maskstore_ps(p, m, x),
        }
    }
}

// Blocks of 1 to 2 vectors a row.
register_blocks!("avx2,fma", [2]);

/// [`super::transpose_into`] in blocks of 8 x 8 in registers, the edges element by
/// element.
///
/// # Safety
/// AVX2; the source (`rows` of `width` at `rs`) and the destination (`width` rows of
/// `rows` at `ld`) lie inside their allocations and do not overlap.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn transpose(
    src: *const f32,
    rs: usize,
    (rows, width): (usize, usize),
    dst: *mut f32,
    ld: usize,
) {
    let (whole_rows, whole_cols) = (rows - rows % LANES, width - width % LANES);
    // SAFETY (all accesses): inside the `rows x width` source and its transpose.
    unsafe {
        for r0 in (0..whole_rows).step_by(LANES) {
            for c0 in (0..whole_cols).step_by(LANES) {
                let mut x = [_mm256_setzero_ps(); LANES];
                for (i, v) in x.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(src.add((r0 + i) * rs + c0));
                }
                for (c, v) in transpose8(x).iter().enumerate() {
                    _mm256_storeu_ps(dst.add((c0 + c) * ld + r0), *v);
                }
            }
        }
        // The edges: the columns past the whole blocks, then the rows past them.
        for r in 0..rows {
            let from = if r < whole_rows { whole_cols } else { 0 };
            for c in from..width {
                *dst.add(c * ld + r) = *src.add(r * rs + c);
            }
        }
    }
}

/// The 8 x 8 transpose of the rows `r`: interleaving pairs of rows, then pairs of pairs,
/// then swapping 128-bit halves (`out[c]` is column `c`).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn transpose8(r: [__m256; LANES]) -> [__m256; LANES] {
    let mut t = [_mm256_setzero_ps(); LANES];
    for k in 0..4 {
        // Per 128-bit half: (a0 b0 a1 b1) and (a2 b2 a3 b3) of rows 2k and 2k + 1.
        t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    let mut u = [_mm256_setzero_ps(); LANES];
    for k in 0..2 {
        // u[4k + j] holds column 4h + j of rows 4k..4k + 4 in its half h.
        let (a, b, c, d) = (t[4 * k], t[4 * k + 1], t[4 * k + 2], t[4 * k + 3]);
        u[4 * k] = _mm256_shuffle_ps::<0x44>(a, c);
        u[4 * k + 1] = _mm256_shuffle_ps::<0xee>(a, c);
        u[4 * k + 2] = _mm256_shuffle_ps::<0x44>(b, d);
        u[4 * k + 3] = _mm256_shuffle_ps::<0xee>(b, d);
    }
    let mut out = [_mm256_setzero_ps(); LANES];
    for j in 0..4 {
        // Half 0 of rows 0-3 and of rows 4-7: column j; halves 1: column 4 + j.
        out[j] = _mm256_permute2f128_ps::<0x20>(u[j], u[4 + j]);
        out[4 + j] = _mm256_permute2f128_ps::<0x31>(u[j], u[4 + j]);
    }
    out
}
