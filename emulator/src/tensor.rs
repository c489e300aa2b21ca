//! The warp-wide matrix instructions: `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`
//! with the PTX ISA's fragment layouts, and `ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}`.
//!
//! Layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" (section
//! 9.7.14.5.8 in PTX ISA 8.x/9.x), written once below (`a_index`, `b_index`, `c_index`) and used
//! by `mma` and the tests alike. ldmatrix: PTX ISA, "Warp-level matrix load instruction:
//! ldmatrix".

/// How `mma.sync` adds its 16 products to the accumulator. The PTX ISA leaves the order,
/// rounding and subnormal handling unspecified, so both are modelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MmaModel {
    /// The CPU oracle's order: `d = c`, then `d = fma(a[k], b[k], d)` for k = 0..16, each
    /// rounded to nearest f32 (bf16 products are exact in f32).
    #[default]
    OracleOrder,
    /// What is measured of Hopper: the exact products and `c` aligned to the largest
    /// exponent among them, each truncated to 25 fractional bits, summed exactly, and the
    /// sum truncated (toward zero) to f32.
    Hopper,
}

/// (row, col) in the 16x16 A matrix of element `a_i` (i in 0..8) held by `lane`. ISA:
/// `row = groupID` for a_i with 0 <= i < 2 or 4 <= i < 6, else `groupID + 8`;
/// `col = threadID_in_group * 2 + (i & 0x1)` for i < 4, else that `+ 8`.
pub fn a_index(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane >> 2, lane % 4);
    (g + 8 * ((i >> 1) & 1), t * 2 + (i & 1) + 8 * ((i >> 2) & 1))
}

/// (row, col) in the 16x8 B matrix (k by n) of element `b_i` (i in 0..4) held by `lane`. ISA:
/// `row = threadID_in_group * 2 + (i & 0x1)` for i < 2, else that `+ 8`; `col = groupID`.
pub fn b_index(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane >> 2, lane % 4);
    (t * 2 + (i & 1) + 8 * ((i >> 1) & 1), g)
}

/// (row, col) in the 16x8 C/D matrix of element `c_i` (i in 0..4) held by `lane`. ISA:
/// `row = groupID` for c_i with i < 2, else `groupID + 8`;
/// `col = threadID_in_group * 2 + (i & 0x1)`.
pub fn c_index(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane >> 2, lane % 4);
    (g + 8 * ((i >> 1) & 1), t * 2 + (i & 1))
}

/// Element `i` of a fragment of packed 16-bit registers: the ISA lists a .bf16x2 register's
/// elements "low to high", so element 2j is register j's low half.
fn half(regs: &[u32], i: usize) -> u16 {
    (regs[i / 2] >> (16 * (i % 2))) as u16
}

fn bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// One warp's `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 d, a, b, c`; index = lane.
/// Each A/B register holds two bf16, the lower-numbered element in the low 16 bits.
pub fn mma_m16n8k16_bf16(
    a: &[[u32; 4]; 32],
    b: &[[u32; 2]; 32],
    c: &[[f32; 4]; 32],
    model: MmaModel,
) -> [[f32; 4]; 32] {
    let mut am = [[0u16; 16]; 16];
    let mut bm = [[0u16; 8]; 16];
    let mut cm = [[0f32; 8]; 16];
    for lane in 0..32 {
        for i in 0..8 {
            let (r, k) = a_index(lane, i);
            am[r][k] = half(&a[lane], i);
        }
        for i in 0..4 {
            let (k, n) = b_index(lane, i);
            bm[k][n] = half(&b[lane], i);
        }
        for (i, &v) in c[lane].iter().enumerate() {
            let (r, n) = c_index(lane, i);
            cm[r][n] = v;
        }
    }
    let mut d = [[0f32; 4]; 32];
    for (lane, dl) in d.iter_mut().enumerate() {
        for (i, di) in dl.iter_mut().enumerate() {
            let (r, n) = c_index(lane, i);
            let col: [u16; 16] = std::array::from_fn(|k| bm[k][n]);
            *di = match model {
                MmaModel::OracleOrder => oracle_dot(&am[r], &col, cm[r][n]),
                MmaModel::Hopper => hopper_dot(&am[r], &col, cm[r][n]),
            };
        }
    }
    d
}

/// `d = c; d = fma(a_k, b_k, d)` for k in order: the oracle's sum (products of bf16 are exact
/// in f32, so each step rounds once, to nearest even).
fn oracle_dot(a: &[u16; 16], b: &[u16; 16], c: f32) -> f32 {
    a.iter()
        .zip(b)
        .fold(c, |d, (&x, &y)| bf16(x).mul_add(bf16(y), d))
}

/// Fractional bits each aligned term keeps on Hopper (MMA-Sim `nv_ptx.py`,
/// `arch_accum_fractional_bits["Hopper"] = 25`; Ampere and Ada are 24 with split-k, not
/// modelled).
const HOPPER_FRAC_BITS: i32 = 25;

/// A finite bf16 (`frac_bits` 7) or f32 (23) as (negative, integer significand, exponent) with
/// value `m * 2^(e - frac_bits)`. As MMA-Sim's `extract_significand_exponent` (arithmetic.py):
/// a subnormal keeps its value with the exponent clamped at -126 (bf16 and f32 alike, so no
/// flushing of subnormal inputs), and a zero has exponent -126.
fn split(bits: u32, exp_shift: u32, frac_bits: u32) -> (bool, u64, i32) {
    let neg = (bits >> (exp_shift + 8)) & 1 == 1;
    let be = ((bits >> exp_shift) & 0xFF) as i32;
    let f = (bits & ((1 << frac_bits) - 1)) as u64;
    if be == 0 {
        (neg, f, -126)
    } else {
        (neg, f | (1 << frac_bits), be - 127)
    }
}

/// Hopper's fused dot-add as MMA-Sim models it (arithmetic.py `nv_fused_dot_add` with
/// `fused_sum`, `n_fractional_bits = 25`, f32 output; nv_ptx.py `mma` runs the k=16 bf16 sum
/// as one fused sum on Hopper):
/// 1. NaN/Inf first: the products and c are summed in f64 (exact for these ranges, so only the
///    NaN/Inf class matters); a NaN sum gives `0x7FFFFFFF`, an infinite one that infinity.
/// 2. Each product's significand `sa * sb` (in [0, 4)) has exponent `ea + eb`; c its own; all
///    17 terms are aligned to the largest exponent, each truncated toward zero to 25 fractional
///    bits there (sign-magnitude, `math.trunc`), and summed exactly.
/// 3. The sum is normalised and truncated toward zero to f32 (subnormal results kept). A zero
///    sum is +0 (Python's int truncation loses the sign); a sum of 2^128 or more is Inf (the
///    f64 -> f32 cast MMA-Sim ends with).
fn hopper_dot(a: &[u16; 16], b: &[u16; 16], c: f32) -> f32 {
    let mut fsum = c as f64;
    for (&x, &y) in a.iter().zip(b) {
        fsum += bf16(x) as f64 * bf16(y) as f64;
    }
    if fsum.is_nan() {
        return f32::from_bits(0x7FFF_FFFF);
    }
    if fsum.is_infinite() {
        return fsum as f32;
    }
    // Terms as (negative, significand with `frac` fractional bits, exponent).
    let mut terms = [(false, 0u64, 0i32, 0i32); 17];
    let (cn, cm, ce) = split(c.to_bits(), 23, 23);
    terms[0] = (cn, cm, ce, 23);
    for (k, (&x, &y)) in a.iter().zip(b).enumerate() {
        let (xn, xm, xe) = split(x as u32, 7, 7);
        let (yn, ym, ye) = split(y as u32, 7, 7);
        terms[k + 1] = (xn != yn, xm * ym, xe + ye, 14);
    }
    let max_e = terms.iter().map(|t| t.2).max().unwrap_or(-126);
    // Sum in units of 2^(max_e - 25): each term is `m * 2^(e - frac)`, so its shift is
    // `e - max_e + 25 - frac` (at most 11 for products, 2 for c: no overflow in i64).
    let mut sum: i64 = 0;
    for &(neg, m, e, frac) in &terms {
        let s = e - max_e + HOPPER_FRAC_BITS - frac;
        let t = if s >= 0 {
            m << s
        } else if -s >= 64 {
            0
        } else {
            m >> -s
        } as i64;
        sum += if neg { -t } else { t };
    }
    if sum == 0 {
        return 0.0;
    }
    // value = |sum| * 2^(max_e - 25); keep 24 bits (fewer if subnormal), truncating.
    let mag = sum.unsigned_abs();
    let unit = max_e - HOPPER_FRAC_BITS;
    let top = 63 - mag.leading_zeros() as i32 + unit;
    if top > 127 {
        return if sum < 0 {
            f32::NEG_INFINITY
        } else {
            f32::INFINITY
        };
    }
    let e_out = top.max(-126);
    let shift = (e_out - 23) - unit;
    let m = if shift >= 64 {
        0
    } else if shift >= 0 {
        mag >> shift
    } else {
        mag << -shift
    };
    if m == 0 {
        return 0.0;
    }
    // A normal m has bit 23 set, which carries into the exponent field: biased exponent
    // e_out + 127 = (e_out + 126) + 1. A subnormal (e_out = -126, m < 2^23) adds nothing.
    let bits = (((e_out + 126) as u32) << 23) + m as u32;
    let sign = if sum < 0 { 0x8000_0000 } else { 0 };
    f32::from_bits(sign | bits)
}

/// `ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16`: `rows[m][r]` is row r of matrix m
/// (the 8 b16 at the address lane 8m + r supplies, element 0 at the lowest address). Returns
/// each lane's registers: register m holds matrix m's fragment; registers past `rows.len()` are
/// 0 (only the first 4 matrices are read).
///
/// ISA ("Each thread in a warp loads fragments of a row, with thread 0 receiving the first
/// fragment in its register r, and so on. A group of four threads loads an entire row of the
/// matrix"): without `.trans` lane t gets row t/4, elements 2(t%4) (low half) and 2(t%4)+1
/// (high half). `.trans` ("the matrix is loaded in column-major format") gives lane t the
/// elements (row 2(t%4), col t/4) and (row 2(t%4)+1, col t/4) of the stored matrix.
pub fn ldmatrix_distribute(rows: &[[[u16; 8]; 8]], trans: bool) -> [[u32; 4]; 32] {
    let mut out = [[0u32; 4]; 32];
    for (m, mat) in rows.iter().take(4).enumerate() {
        for (t, regs) in out.iter_mut().enumerate() {
            let (r, c) = (t / 4, 2 * (t % 4));
            let (lo, hi) = if trans {
                (mat[c][r], mat[c + 1][r])
            } else {
                (mat[r][c], mat[r][c + 1])
            };
            regs[m] = lo as u32 | (hi as u32) << 16;
        }
    }
    out
}

#[cfg(test)]
#[path = "tensor_tests.rs"]
mod tests;
