//! GEMMs on the host over the emulated memory: what cuBLAS and cuBLASLt compute for the
//! plan's `Launch::Gemm`, with defined semantics (cuBLAS's own order of sums is not
//! documented, so no emulation can be bit-exact with it; this one is exact in f64 and
//! rounds once). Every operand element is read through the memory's checks: an operand
//! outside its allocation, or never written, is an error naming the operand.

use crate::memory::{MemError, Memory};

/// How the products are formed (cuBLAS's compute types for our three precisions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compute {
    /// `CUBLAS_COMPUTE_32F` with pedantic math: f32 operands as they are.
    F32,
    /// `CUBLAS_COMPUTE_32F_FAST_TF32`: each f32 operand rounded to TF32 (10 fraction bits,
    /// to nearest even: cuBLAS does not document its conversion) before multiplying.
    Tf32,
    /// `CUBLAS_COMPUTE_32F_FAST_16BF`, or bf16 operands: each operand rounded to bf16.
    Bf16,
}

/// Row-major `c[batch][m, n] = op(a)[batch][m, k] x op(b)[batch][k, n]`; `a` is stored
/// `[k, m]` when `trans_a`, `b` is stored `[n, k]` when `trans_b`; each operand is `stride`
/// elements from one batch to the next (0: shared by every batch).
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub count: u64,
    pub trans_a: bool,
    pub trans_b: bool,
    pub stride_a: u64,
    pub stride_b: u64,
    pub stride_c: u64,
    /// `a` and `b` hold bf16 elements (else f32).
    pub ab_bf16: bool,
    /// `c` holds bf16 elements, rounded to nearest even (else f32).
    pub c_bf16: bool,
    pub compute: Compute,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BlasError {
    #[error("GEMM operand {operand}: {source}")]
    Memory {
        operand: &'static str,
        source: MemError,
    },
    #[error("GEMM operand {operand} reads {bytes} bytes at {addr:#x} that were never written")]
    Uninitialized {
        operand: &'static str,
        addr: u64,
        bytes: u64,
    },
}

/// The nearest bf16 (ties to even), as f32; NaN stays NaN.
fn round_bf16(x: f32) -> f32 {
    round_mantissa(x, 16)
}

/// `x` with its lowest `drop` fraction bits rounded away, to nearest even.
fn round_mantissa(x: f32, drop: u32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let b = x.to_bits();
    let half = 1u32 << (drop - 1);
    let odd = (b >> drop) & 1;
    let r = b.wrapping_add(half - 1 + odd) & !((1u32 << drop) - 1);
    f32::from_bits(r)
}

fn read(
    memory: &Memory,
    operand: &'static str,
    addr: u64,
    elements: u64,
    bf16: bool,
) -> Result<Vec<f32>, BlasError> {
    let (v, written) = memory
        .load_f32(addr, elements as usize, bf16)
        .map_err(|source| BlasError::Memory { operand, source })?;
    if !written {
        return Err(BlasError::Uninitialized {
            operand,
            addr,
            bytes: elements * if bf16 { 2 } else { 4 },
        });
    }
    Ok(v)
}

/// Leading dimensions (elements from one stored row to the next) and scales: `c = alpha
/// op(a) op(b) + beta c`, as BLAS defines it. With `beta == 0`, `c` is not read (so it need
/// not hold valid values).
#[derive(Debug, Clone, Copy)]
pub struct Scaled {
    pub lda: u64,
    pub ldb: u64,
    pub ldc: u64,
    pub alpha: f32,
    pub beta: f32,
    /// A vector of `n` elements (bf16 when `.1`, else f32) at `.0`, added to every row of
    /// `c` after the scaling (cuBLASLt's bias epilogue, in row-major terms).
    pub bias: Option<(u64, bool)>,
}

impl Scaled {
    /// Densely stored operands, `c = op(a) op(b)`.
    pub fn packed(g: &Gemm) -> Scaled {
        Scaled {
            lda: if g.trans_a { g.m } else { g.k },
            ldb: if g.trans_b { g.k } else { g.n },
            ldc: g.n,
            alpha: 1.0,
            beta: 0.0,
            bias: None,
        }
    }
}

/// Elements an operand of `rows` stored rows of `cols` spans with leading dimension `ld`.
fn span(rows: u64, cols: u64, ld: u64) -> u64 {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

/// Runs `g` over `memory`.
pub fn gemm(memory: &mut Memory, g: &Gemm) -> Result<(), BlasError> {
    gemm_scaled(memory, g, &Scaled::packed(g))
}

/// Runs `g` over `memory` with leading dimensions and scales `s` (row-major, as `Gemm`).
pub fn gemm_scaled(memory: &mut Memory, g: &Gemm, s: &Scaled) -> Result<(), BlasError> {
    if g.m == 0 || g.n == 0 || g.count == 0 {
        return Ok(());
    }
    let (ea, eb) = if g.ab_bf16 { (2, 2) } else { (4, 4) };
    let ec = if g.c_bf16 { 2 } else { 4 };
    let operand = |x: f32| match (g.compute, g.ab_bf16) {
        (_, true) | (Compute::F32, false) => x,
        (Compute::Tf32, false) => round_mantissa(x, 13),
        (Compute::Bf16, false) => round_bf16(x),
    };
    let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let (lda, ldb, ldc) = (s.lda as usize, s.ldb as usize, s.ldc as usize);
    let a_span = if g.trans_a {
        span(g.k, g.m, s.lda)
    } else {
        span(g.m, g.k, s.lda)
    };
    let b_span = if g.trans_b {
        span(g.n, g.k, s.ldb)
    } else {
        span(g.k, g.n, s.ldb)
    };
    let c_span = span(g.m, g.n, s.ldc);
    let bias = match s.bias {
        Some((addr, bf16)) => read(memory, "bias", addr, g.n, bf16)?,
        None => Vec::new(),
    };
    for i in 0..g.count {
        let a = read(memory, "A", g.a + i * g.stride_a * ea, a_span, g.ab_bf16)?;
        let b = read(memory, "B", g.b + i * g.stride_b * eb, b_span, g.ab_bf16)?;
        let c_addr = g.c + i * g.stride_c * ec;
        let mut c = if s.beta == 0.0 {
            vec![0f32; c_span as usize]
        } else {
            read(memory, "C", c_addr, c_span, g.c_bf16)?
        };
        let at = |r: usize, j: usize| {
            if g.trans_a {
                a[j * lda + r]
            } else {
                a[r * lda + j]
            }
        };
        let bt = |j: usize, c: usize| {
            if g.trans_b {
                b[c * ldb + j]
            } else {
                b[j * ldb + c]
            }
        };
        for r in 0..m {
            for col in 0..n {
                // Products of f32 (or narrower) values are exact in f64; the sum rounds
                // far below f32's last bit, then once to the output's type.
                let sum: f64 = (0..k)
                    .map(|j| f64::from(operand(at(r, j))) * f64::from(operand(bt(j, col))))
                    .sum();
                let old = &mut c[r * ldc + col];
                let mut v = f64::from(s.alpha) * sum;
                if s.beta != 0.0 {
                    v += f64::from(s.beta) * f64::from(*old);
                }
                // The epilogue works in the compute type (32F): the bias is added to the
                // f32 result, as a separate bias launch adds it.
                let mut v = v as f32;
                if let Some(&x) = bias.get(col) {
                    v += x;
                }
                *old = v;
            }
        }
        // Only the m x n elements are written (the gaps of a leading dimension stay).
        for r in 0..m {
            let row = &c[r * ldc..r * ldc + n];
            let bytes: Vec<u8> = if g.c_bf16 {
                row.iter()
                    .flat_map(|&v| ((round_bf16(v).to_bits() >> 16) as u16).to_le_bytes())
                    .collect()
            } else {
                row.iter().flat_map(|v| v.to_le_bytes()).collect()
            };
            memory
                .write(c_addr + (r * ldc) as u64 * ec, &bytes)
                .map_err(|source| BlasError::Memory {
                    operand: "C",
                    source,
                })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(mem: &mut Memory, v: &[f32]) -> u64 {
        let p = mem.alloc(4 * v.len() as u64, "x");
        mem.write_f32(p, v).unwrap();
        p
    }

    fn base(a: u64, b: u64, c: u64) -> Gemm {
        Gemm {
            a,
            b,
            c,
            m: 2,
            n: 2,
            k: 3,
            count: 1,
            trans_a: false,
            trans_b: false,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            ab_bf16: false,
            c_bf16: false,
            compute: Compute::F32,
        }
    }

    #[test]
    fn row_major_products_and_transposes() {
        let mut mem = Memory::new();
        // a = [[1,2,3],[4,5,6]], b = [[1,0],[0,1],[1,1]]: c = [[4,5],[10,11]].
        let a = setup(&mut mem, &[1., 2., 3., 4., 5., 6.]);
        let b = setup(&mut mem, &[1., 0., 0., 1., 1., 1.]);
        let c = mem.alloc(16, "c");
        gemm(&mut mem, &base(a, b, c)).unwrap();
        assert_eq!(mem.read_f32(c, 4).unwrap(), vec![4., 5., 10., 11.]);
        // The same with a stored transposed ([3, 2]) and b stored transposed ([2, 3]).
        let at = setup(&mut mem, &[1., 4., 2., 5., 3., 6.]);
        let bt = setup(&mut mem, &[1., 0., 1., 0., 1., 1.]);
        let g = Gemm {
            trans_a: true,
            trans_b: true,
            ..base(at, bt, c)
        };
        gemm(&mut mem, &g).unwrap();
        assert_eq!(mem.read_f32(c, 4).unwrap(), vec![4., 5., 10., 11.]);
    }

    #[test]
    fn operands_are_checked() {
        let mut mem = Memory::new();
        let a = setup(&mut mem, &[1.; 5]); // one element short
        let b = setup(&mut mem, &[1.; 6]);
        let c = mem.alloc(16, "c");
        let e = gemm(&mut mem, &base(a, b, c)).unwrap_err();
        assert!(matches!(e, BlasError::Memory { operand: "A", .. }), "{e}");
        let a = mem.alloc(24, "a");
        let e = gemm(&mut mem, &base(a, b, c)).unwrap_err();
        assert!(
            matches!(e, BlasError::Uninitialized { operand: "A", .. }),
            "{e}"
        );
    }

    #[test]
    fn reduced_precision_rounds_operands() {
        assert_eq!(round_bf16(1.0 + 2f32.powi(-8)), 1.0); // a tie, to even
        assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert_eq!(round_mantissa(1.0 + 2f32.powi(-11), 13), 1.0);
        assert_eq!(
            round_mantissa(1.0 + 3.0 * 2f32.powi(-11), 13),
            1.0 + 2f32.powi(-9)
        );
        let mut mem = Memory::new();
        let x = 1.0 + 2f32.powi(-12);
        let a = setup(&mut mem, &[x; 6]);
        let b = setup(&mut mem, &[1.; 6]);
        let c = mem.alloc(16, "c");
        let g = Gemm {
            compute: Compute::Tf32,
            ..base(a, b, c)
        };
        gemm(&mut mem, &g).unwrap();
        assert_eq!(mem.read_f32(c, 4).unwrap(), vec![3.0; 4]);
    }

    #[test]
    fn leading_dimensions_and_scales() {
        let mut mem = Memory::new();
        // a = [[1,2,3],[4,5,6]] with lda 4 (a gap column), b = [[1,0],[0,1],[1,1]].
        let a = setup(&mut mem, &[1., 2., 3., 9., 4., 5., 6., 9.]);
        let b = setup(&mut mem, &[1., 0., 0., 1., 1., 1.]);
        let c = setup(&mut mem, &[1., 1., 7., 1., 1., 7.]);
        let s = Scaled {
            lda: 4,
            ldb: 2,
            ldc: 3,
            alpha: 2.0,
            beta: 0.5,
            bias: None,
        };
        gemm_scaled(&mut mem, &base(a, b, c), &s).unwrap();
        // 2 [[4,5],[10,11]] + 0.5: the gap element (7) is untouched.
        assert_eq!(
            mem.read_f32(c, 6).unwrap(),
            vec![8.5, 10.5, 7., 20.5, 22.5, 7.]
        );
    }
}
