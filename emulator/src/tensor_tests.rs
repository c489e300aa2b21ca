//! Tests of `tensor`: the fragment layouts against the ISA's figures, both mma models,
//! ldmatrix and its composition with mma as the attention kernels use them.
use super::*;

fn bf(x: f32) -> u16 {
    assert_eq!(x.to_bits() & 0xFFFF, 0, "{x} is not a bf16 value");
    (x.to_bits() >> 16) as u16
}

/// Fragments of full matrices, through the layout functions.
fn frags(a: &[[f32; 16]; 16], b: &[[f32; 8]; 16], c: &[[f32; 8]; 16]) -> Frags {
    let mut fa = [[0u32; 4]; 32];
    let mut fb = [[0u32; 2]; 32];
    let mut fc = [[0f32; 4]; 32];
    for lane in 0..32 {
        for i in 0..8 {
            let (r, k) = a_index(lane, i);
            fa[lane][i / 2] |= (bf(a[r][k]) as u32) << (16 * (i % 2));
        }
        for i in 0..4 {
            let (k, n) = b_index(lane, i);
            fb[lane][i / 2] |= (bf(b[k][n]) as u32) << (16 * (i % 2));
            let (r, n) = c_index(lane, i);
            fc[lane][i] = c[r][n];
        }
    }
    (fa, fb, fc)
}

type Frags = ([[u32; 4]; 32], [[u32; 2]; 32], [[f32; 4]; 32]);

fn gather(d: &[[f32; 4]; 32]) -> [[f32; 8]; 16] {
    let mut m = [[f32::NAN; 8]; 16];
    for (lane, dl) in d.iter().enumerate() {
        for (i, &v) in dl.iter().enumerate() {
            let (r, n) = c_index(lane, i);
            m[r][n] = v;
        }
    }
    m
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A random bf16 value in about [-4, 4] with a full 8-bit significand.
    fn bf16(&mut self) -> f32 {
        let r = self.next();
        let e = 125 + (r % 4) as u32;
        let bits = ((r >> 8) as u32 & 1) << 31 | e << 23 | ((r >> 16) as u32 & 0x7F) << 16;
        f32::from_bits(bits)
    }
    fn f32(&mut self) -> f32 {
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }
}

type Mats = ([[f32; 16]; 16], [[f32; 8]; 16], [[f32; 8]; 16]);

fn random(seed: u64) -> Mats {
    let mut g = Rng(seed);
    let a = std::array::from_fn(|_| std::array::from_fn(|_| g.bf16()));
    let b = std::array::from_fn(|_| std::array::from_fn(|_| g.bf16()));
    let c = std::array::from_fn(|_| std::array::from_fn(|_| g.f32()));
    (a, b, c)
}

#[test]
fn layouts_match_the_isa_figures_and_cover_each_element_once() {
    // Lane 0 (groupID 0, threadID_in_group 0) and lane 5 (1, 1), from the ISA's figures.
    let a0: Vec<_> = (0..8).map(|i| a_index(0, i)).collect();
    assert_eq!(
        a0,
        [
            (0, 0),
            (0, 1),
            (8, 0),
            (8, 1),
            (0, 8),
            (0, 9),
            (8, 8),
            (8, 9)
        ]
    );
    let a5: Vec<_> = (0..8).map(|i| a_index(5, i)).collect();
    assert_eq!(
        a5,
        [
            (1, 2),
            (1, 3),
            (9, 2),
            (9, 3),
            (1, 10),
            (1, 11),
            (9, 10),
            (9, 11)
        ]
    );
    let b5: Vec<_> = (0..4).map(|i| b_index(5, i)).collect();
    assert_eq!(b5, [(2, 1), (3, 1), (10, 1), (11, 1)]);
    let c31: Vec<_> = (0..4).map(|i| c_index(31, i)).collect();
    assert_eq!(c31, [(7, 6), (7, 7), (15, 6), (15, 7)]);
    let mut seen_a = [[0; 16]; 16];
    let mut seen_b = [[0; 8]; 16];
    let mut seen_c = [[0; 8]; 16];
    for lane in 0..32 {
        for i in 0..8 {
            let (r, c) = a_index(lane, i);
            seen_a[r][c] += 1;
        }
        for i in 0..4 {
            let (r, c) = b_index(lane, i);
            seen_b[r][c] += 1;
            let (r, c) = c_index(lane, i);
            seen_c[r][c] += 1;
        }
    }
    assert!(seen_a.iter().flatten().all(|&n| n == 1));
    assert!(seen_b.iter().flatten().all(|&n| n == 1));
    assert!(seen_c.iter().flatten().all(|&n| n == 1));
}

#[test]
fn exact_arithmetic_both_models_equal_f64() {
    // Small integers scaled by powers of two: every product and partial sum is a multiple
    // of 2^-6 below 2^17, exact in f32, so order, alignment and truncation cannot matter.
    let mut g = Rng(7);
    for round in 0..20 {
        let sa = [1.0, 0.25, 8.0][round % 3];
        let sb = [1.0, 0.125, 4.0][round % 3];
        let a: [[f32; 16]; 16] =
            std::array::from_fn(|_| std::array::from_fn(|_| ((g.next() % 33) as f32 - 16.0) * sa));
        let b: [[f32; 8]; 16] =
            std::array::from_fn(|_| std::array::from_fn(|_| ((g.next() % 33) as f32 - 16.0) * sb));
        let c: [[f32; 8]; 16] =
            std::array::from_fn(|_| std::array::from_fn(|_| (g.next() % 201) as f32 - 100.0));
        let (fa, fb, fc) = frags(&a, &b, &c);
        for model in [MmaModel::OracleOrder, MmaModel::Hopper] {
            let d = gather(&mma_m16n8k16_bf16(&fa, &fb, &fc, model));
            for r in 0..16 {
                for n in 0..8 {
                    let want =
                        (0..16).fold(c[r][n] as f64, |s, k| s + a[r][k] as f64 * b[k][n] as f64);
                    assert_eq!(d[r][n].to_bits(), (want as f32).to_bits(), "{model:?}");
                    assert_eq!(d[r][n] as f64, want);
                }
            }
        }
    }
}

/// The independent reference: full matrices, k in order, `mul_add`.
fn reference(a: &[[f32; 16]; 16], b: &[[f32; 8]; 16], c: &[[f32; 8]; 16]) -> [[f32; 8]; 16] {
    let mut d = *c;
    for (r, row) in d.iter_mut().enumerate() {
        for (n, v) in row.iter_mut().enumerate() {
            for k in 0..16 {
                *v = a[r][k].mul_add(b[k][n], *v);
            }
        }
    }
    d
}

#[test]
fn oracle_order_matches_the_reference_on_random_data() {
    for seed in 1..40 {
        let (a, b, c) = random(seed * 0x9E37_79B9);
        let (fa, fb, fc) = frags(&a, &b, &c);
        let d = gather(&mma_m16n8k16_bf16(&fa, &fb, &fc, MmaModel::OracleOrder));
        let want = reference(&a, &b, &c);
        for r in 0..16 {
            for n in 0..8 {
                assert_eq!(d[r][n].to_bits(), want[r][n].to_bits());
            }
        }
        // Hopper stays within a few ulp of it (truncation, not a different layout).
        let h = gather(&mma_m16n8k16_bf16(&fa, &fb, &fc, MmaModel::Hopper));
        for r in 0..16 {
            for n in 0..8 {
                let ulp = want[r][n].abs().max(1.0) * f32::EPSILON;
                assert!((h[r][n] - want[r][n]).abs() <= 8.0 * ulp, "{r} {n}");
            }
        }
    }
}

#[test]
fn swapping_any_fragment_registers_or_halves_changes_the_result() {
    let (a, b, c) = random(12345);
    let (fa, fb, fc) = frags(&a, &b, &c);
    let base = mma_m16n8k16_bf16(&fa, &fb, &fc, MmaModel::OracleOrder);
    let changed = |fa: &[[u32; 4]; 32], fb: &[[u32; 2]; 32], fc: &[[f32; 4]; 32]| {
        mma_m16n8k16_bf16(fa, fb, fc, MmaModel::OracleOrder) != base
    };
    for i in 0..4 {
        for j in i + 1..4 {
            let mut x = fa;
            x.iter_mut().for_each(|r| r.swap(i, j));
            assert!(changed(&x, &fb, &fc), "A registers {i} {j}");
            let mut x = fc;
            x.iter_mut().for_each(|r| r.swap(i, j));
            assert!(changed(&fa, &fb, &x), "C registers {i} {j}");
        }
        let mut x = fa;
        x.iter_mut().for_each(|r| r[i] = r[i].rotate_left(16));
        assert!(changed(&x, &fb, &fc), "A register {i} halves");
    }
    let mut x = fb;
    x.iter_mut().for_each(|r| r.swap(0, 1));
    assert!(changed(&fa, &x, &fc), "B registers");
    for i in 0..2 {
        let mut x = fb;
        x.iter_mut().for_each(|r| r[i] = r[i].rotate_left(16));
        assert!(changed(&fa, &x, &fc), "B register {i} halves");
    }
}

/// One output element, d[0][0], from `a` row 0, `b` column 0 and `c`; the rest zero.
fn one(a: &[f32], b: &[f32], c: f32, model: MmaModel) -> f32 {
    let mut am = [[0f32; 16]; 16];
    let mut bm = [[0f32; 8]; 16];
    let mut cm = [[0f32; 8]; 16];
    am[0][..a.len()].copy_from_slice(a);
    for (k, &v) in b.iter().enumerate() {
        bm[k][0] = v;
    }
    cm[0][0] = c;
    let (fa, fb, fc) = frags(&am, &bm, &cm);
    gather(&mma_m16n8k16_bf16(&fa, &fb, &fc, model))[0][0]
}

#[test]
fn hopper_truncates_where_round_to_nearest_differs() {
    use MmaModel::*;
    // 2^e exactly (powi may go through 2^-e, which overflows for subnormal results).
    let p = |e: i32| {
        if e >= -126 {
            f32::from_bits(((e + 127) as u32) << 23)
        } else {
            f32::from_bits(1 << (e + 149))
        }
    };
    // (1) c = 1, one product 1.5 * 2^-12 * 2^-12 = 3 * 2^-25 (0.75 ulp of 1). Hopper: max
    // exponent 0; c is 2^25 units of 2^-25, the product 3 units, sum 2^25 + 3; to f32 keep
    // 24 bits: (2^25 + 3) >> 2 = 2^23 -> 1.0 (0x3F800000). Round to nearest: 1 + 2^-23.
    assert_eq!(
        one(&[1.5 * p(-12)], &[p(-12)], 1.0, Hopper).to_bits(),
        0x3F80_0000
    );
    assert_eq!(
        one(&[1.5 * p(-12)], &[p(-12)], 1.0, OracleOrder).to_bits(),
        0x3F80_0001
    );
    // Negative: truncation is toward zero: -(1 + 3 * 2^-25) -> -1.0 (0xBF800000).
    assert_eq!(
        one(&[-1.5 * p(-12)], &[p(-12)], -1.0, Hopper).to_bits(),
        0xBF80_0000
    );
    assert_eq!(
        one(&[-1.5 * p(-12)], &[p(-12)], -1.0, OracleOrder).to_bits(),
        0xBF80_0001
    );
    // (2) c = 1, sixteen products 2^-13 * 2^-12 = 2^-25 (a quarter ulp each). Hopper keeps
    // each as exactly 1 unit of 2^-25: sum 2^25 + 16, >> 2 = 2^23 + 4 -> 1 + 2^-21
    // (0x3F800004, the exact sum). The oracle's fma chain rounds each away: 1.0.
    let a16 = [p(-13); 16];
    let b16 = [p(-12); 16];
    assert_eq!(one(&a16, &b16, 1.0, Hopper).to_bits(), 0x3F80_0004);
    assert_eq!(one(&a16, &b16, 1.0, OracleOrder).to_bits(), 0x3F80_0000);
    // Sixteen products of 2^-26 are each below one unit: truncated to 0 -> 1.0 in both.
    assert_eq!(one(&[p(-13); 16], &[p(-13); 16], 1.0, Hopper), 1.0);
    // (3) Cancellation: c = 1, products -1 * 1 and 2^-15 * 2^-15 = 2^-30. Aligned to
    // exponent 0, 2^-30 is 2^14 >> 19 = 0 units: the sum is exactly 0 -> +0.0. The oracle
    // cancels first (fma(-1, 1, 1) = 0) and then adds 2^-30 exactly.
    let (a3, b3) = ([-1.0, p(-15)], [1.0, p(-15)]);
    assert_eq!(one(&a3, &b3, 1.0, Hopper).to_bits(), 0);
    assert_eq!(one(&a3, &b3, 1.0, OracleOrder), p(-30));
    // A negative term smaller than one unit truncates toward zero (to 0), not down: c = 1,
    // product -2^-26: 1.0 (floor would give 2^25 - 1 units -> 0x3F7FFFFF).
    assert_eq!(
        one(&[-p(-13)], &[p(-13)], 1.0, Hopper).to_bits(),
        0x3F80_0000
    );
    // A zero sum is +0 even from negative zeros.
    assert_eq!(one(&[-0.0], &[1.0], -0.0, Hopper).to_bits(), 0);
    // Subnormal inputs are kept: 2^-130 (a bf16 subnormal) * 2^10 = 2^-120, c = 0.
    assert_eq!(one(&[p(-130)], &[p(10)], 0.0, Hopper), p(-120));
    // A subnormal result: 2^-70 * 2^-70 = 2^-140 with c = 0 is an f32 subnormal, kept.
    assert_eq!(one(&[p(-70)], &[p(-70)], 0.0, Hopper), p(-140));
    // Overflow: 2^127 * 4 = 2^129 is Inf (MMA-Sim's final cast); round toward zero would
    // otherwise stop at f32::MAX.
    assert_eq!(one(&[p(127)], &[4.0], 0.0, Hopper), f32::INFINITY);
}

/// MMA-Sim's `nv_fused_dot_add` (arithmetic.py) transcribed literally in f64 arithmetic,
/// as a check of the integer implementation above: significands in [1, 2) (subnormals
/// scaled, exponent clamped at -126; zero has exponent -126), products' significands
/// multiplied, terms truncated at 25 fractional bits below the largest exponent, the sum
/// normalised and truncated to 23 fractional bits, then cast to f32.
fn mma_sim_literal(a: &[f32; 16], b: &[f32; 16], c: f32) -> f32 {
    fn extract(x: f64) -> (f64, i32) {
        if x == 0.0 {
            return (0.0, -126);
        }
        let e = ((x.to_bits() >> 52) & 0x7FF) as i32 - 1023;
        let (sig, e) = (x * 2f64.powi(-e), e);
        if e < -126 {
            (sig * 2f64.powi(e + 126), -126)
        } else {
            (sig, e)
        }
    }
    let mut sigs = vec![extract(c as f64)];
    for k in 0..16 {
        let (sa, ea) = extract(a[k] as f64);
        let (sb, eb) = extract(b[k] as f64);
        sigs.push((sa * sb, ea + eb));
    }
    let max_e = sigs.iter().map(|s| s.1).max().unwrap();
    let sum: f64 = sigs
        .iter()
        .map(|&(s, e)| (s * 2f64.powi(25 + e - max_e)).trunc() * 2f64.powi(-25))
        .sum();
    let (s, e) = extract(sum * 2f64.powi(max_e));
    ((s * 2f64.powi(23)).trunc() * 2f64.powi(-23) * 2f64.powi(e)) as f32
}

#[test]
fn hopper_matches_a_literal_transcription_of_mma_sim() {
    let mut g = Rng(0xDEAD_BEEF);
    // bf16 values over a wide exponent range, with zeros and subnormals.
    let val = |g: &mut Rng| -> f32 {
        let r = g.next();
        let e = match r & 15 {
            0 => 0,
            1 => (r >> 4) as u32 % 3,
            _ => 60 + (r >> 4) as u32 % 140,
        };
        let frac = if e == 0 && r.is_multiple_of(3) {
            0
        } else {
            (r >> 20) as u32 & 0x7F
        };
        f32::from_bits(((r >> 40) as u32 & 1) << 31 | e << 23 | frac << 16)
    };
    for _ in 0..3000 {
        let a: [f32; 16] = std::array::from_fn(|_| val(&mut g));
        let b: [f32; 16] = std::array::from_fn(|_| val(&mut g));
        let c = f32::from_bits(val(&mut g).to_bits() | (g.next() as u32 & 0xFFFF));
        let got = one(&a, &b, c, MmaModel::Hopper);
        let want = mma_sim_literal(&a, &b, c);
        assert_eq!(got.to_bits(), want.to_bits(), "{a:?} {b:?} {c:e}");
    }
}

#[test]
fn nan_and_inf_propagate() {
    use MmaModel::*;
    for model in [OracleOrder, Hopper] {
        let nan = one(&[f32::NAN], &[1.0], 0.0, model);
        assert!(nan.is_nan());
        assert!(one(&[f32::INFINITY], &[0.0], 0.0, model).is_nan());
        assert!(one(&[f32::INFINITY, 1.0], &[1.0, f32::NEG_INFINITY], 0.0, model).is_nan());
        assert!(one(&[1.0], &[1.0], f32::NAN, model).is_nan());
        assert!(one(&[f32::INFINITY], &[1.0], f32::NEG_INFINITY, model).is_nan());
        assert_eq!(
            one(&[f32::INFINITY], &[-2.0], 5.0, model),
            f32::NEG_INFINITY
        );
        assert_eq!(one(&[1.0], &[1.0], f32::INFINITY, model), f32::INFINITY);
    }
    // Hopper's NaN is 0x7FFFFFFF (MMA-Sim).
    assert_eq!(one(&[f32::NAN], &[1.0], 0.0, Hopper).to_bits(), 0x7FFF_FFFF);
    // A NaN in A[3][5] poisons row 3 of D only.
    let (mut a, b, c) = random(99);
    a[3][5] = f32::NAN;
    let (fa, fb, fc) = frags(&a, &b, &c);
    for model in [OracleOrder, Hopper] {
        let d = gather(&mma_m16n8k16_bf16(&fa, &fb, &fc, model));
        for (r, row) in d.iter().enumerate() {
            assert!(row.iter().all(|v| v.is_nan() == (r == 3)));
        }
    }
}

/// An 8x8 matrix of the known pattern: value = matrix * 64 + row * 8 + col.
fn pattern(count: usize) -> Vec<[[u16; 8]; 8]> {
    (0..count)
        .map(|m| std::array::from_fn(|r| std::array::from_fn(|c| (m * 64 + r * 8 + c) as u16)))
        .collect()
}

#[test]
fn ldmatrix_known_pattern() {
    for count in [1, 2, 4] {
        let rows = pattern(count);
        for trans in [false, true] {
            let out = ldmatrix_distribute(&rows, trans);
            for (t, regs) in out.iter().enumerate() {
                for (m, &reg) in regs.iter().enumerate() {
                    if m >= count {
                        assert_eq!(reg, 0);
                        continue;
                    }
                    let (row, col) = (t / 4, 2 * (t % 4));
                    // Without .trans: row t/4, columns 2(t%4), 2(t%4)+1 (low, high).
                    // With .trans: column t/4, rows 2(t%4), 2(t%4)+1.
                    let (lo, hi) = if trans {
                        (m * 64 + col * 8 + row, m * 64 + (col + 1) * 8 + row)
                    } else {
                        (m * 64 + row * 8 + col, m * 64 + row * 8 + col + 1)
                    };
                    assert_eq!(reg, (lo | hi << 16) as u32, "x{count} {trans} {t} {m}");
                }
            }
        }
    }
    // Lane 0 and lane 5 spelled out: x1 non-trans lane 5 = row 1, cols 2,3: 10, 11.
    let out = ldmatrix_distribute(&pattern(1), false);
    assert_eq!(out[5][0], 10 | 11 << 16);
    let out = ldmatrix_distribute(&pattern(1), true);
    // .trans lane 5: column 1, rows 2 and 3: 17, 25.
    assert_eq!(out[5][0], 17 | 25 << 16);
    // More than 4 matrices or none: no panic.
    assert_eq!(ldmatrix_distribute(&[], false), [[0; 4]; 32]);
    let _ = ldmatrix_distribute(&pattern(5), true);
}

/// A row-major tile in "shared memory": `rows` of `width` b16 with distinct values.
fn tile(rows: usize, width: usize) -> Vec<Vec<u16>> {
    (0..rows)
        .map(|r| (0..width).map(|c| (r * 256 + c + 1) as u16).collect())
        .collect()
}

/// The ldmatrix x4 matrices as the executor assembles them: lane 8m + i supplies the
/// address of row i of matrix m; here an address is (tile row, first column).
fn load_x4(t: &[Vec<u16>], addr: impl Fn(usize) -> (usize, usize)) -> Vec<[[u16; 8]; 8]> {
    (0..4)
        .map(|m| {
            std::array::from_fn(|i| {
                let (r, c) = addr(8 * m + i);
                std::array::from_fn(|j| t[r][c + j])
            })
        })
        .collect()
}

/// `lane_row` of compiler/src/codegen/attention_mma.rs: matrix m = lane / 8, its row
/// lane % 8; `split_rows`: matrices are (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), then
/// the same of cols 8-15; otherwise rows 0-7 of cols 0-7, 8-15, 16-23, 24-31.
fn lane_row(lane: usize, split_rows: bool) -> (usize, usize) {
    let (r, m) = (lane % 8, lane / 8);
    if split_rows {
        (r + 8 * (m & 1), 8 * (m >> 1))
    } else {
        (r, 8 * m)
    }
}

fn pack(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

#[test]
fn ldmatrix_x4_gives_the_a_fragment_as_our_kernels_load_it() {
    // `fragments`/`fragment_row` (attention_mma.rs): lane_row with split rows, no .trans,
    // on a row-major 16x16 tile: lanes 0-15 give rows 0-15 at column 0, lanes 16-31 rows
    // 0-15 at column 8. The four registers must be exactly mma's A fragment.
    let t = tile(16, 16);
    let regs = ldmatrix_distribute(&load_x4(&t, |l| lane_row(l, true)), false);
    for (lane, r) in regs.iter().enumerate() {
        for (j, &reg) in r.iter().enumerate() {
            let (r0, c0) = a_index(lane, 2 * j);
            let (r1, c1) = a_index(lane, 2 * j + 1);
            assert_eq!(reg, pack(t[r0][c0], t[r1][c1]), "lane {lane} a{j}");
        }
    }
}

#[test]
fn ldmatrix_x4_gives_b_fragments_as_our_kernels_load_them() {
    // `mma_abt`: B = K^T with K staged row-major (8 keys by 32 columns), lane_row without
    // split, no .trans: registers (0, 1) are B of k-step 0 (columns 0-15), (2, 3) of
    // k-step 1 (columns 16-31); B[k][n] = K[n][16 step + k].
    let kt = tile(8, 32);
    let regs = ldmatrix_distribute(&load_x4(&kt, |l| lane_row(l, false)), false);
    for (lane, r) in regs.iter().enumerate() {
        for step in 0..2 {
            for j in 0..2 {
                let (k0, n0) = b_index(lane, 2 * j);
                let (k1, n1) = b_index(lane, 2 * j + 1);
                let want = pack(kt[n0][16 * step + k0], kt[n1][16 * step + k1]);
                assert_eq!(r[2 * step + j], want, "K lane {lane} step {step} b{j}");
            }
        }
    }
    // `mma_ab`: B = V staged row-major (16 keys by 16 columns), lane_row with split,
    // .trans: registers (0, 1) are B of n-tile 0 (columns 0-7), (2, 3) of n-tile 1
    // (columns 8-15); B[k][n] = V[k][8 tile + n].
    let v = tile(16, 16);
    let regs = ldmatrix_distribute(&load_x4(&v, |l| lane_row(l, true)), true);
    for (lane, r) in regs.iter().enumerate() {
        for nt in 0..2 {
            for j in 0..2 {
                let (k0, n0) = b_index(lane, 2 * j);
                let (k1, n1) = b_index(lane, 2 * j + 1);
                let want = pack(v[k0][8 * nt + n0], v[k1][8 * nt + n1]);
                assert_eq!(r[2 * nt + j], want, "V lane {lane} tile {nt} b{j}");
            }
        }
    }
}

#[test]
fn ldmatrix_then_mma_equals_the_matrix_product() {
    // Composition: A by ldmatrix (split, no trans) from a row-major 16x16 tile, B by
    // ldmatrix.trans from a row-major 16x8 tile (matrices: rows 0-7 and 8-15, x2), then
    // mma: D = A B exactly on small integers.
    let mut g = Rng(3);
    let av: Vec<Vec<f32>> = (0..16)
        .map(|_| (0..16).map(|_| (g.next() % 9) as f32 - 4.0).collect())
        .collect();
    let bv: Vec<Vec<f32>> = (0..16)
        .map(|_| (0..8).map(|_| (g.next() % 9) as f32 - 4.0).collect())
        .collect();
    let to_bits = |m: &Vec<Vec<f32>>| -> Vec<Vec<u16>> {
        m.iter()
            .map(|r| r.iter().map(|&x| bf(x)).collect())
            .collect()
    };
    let (at, bt) = (to_bits(&av), to_bits(&bv));
    let fa = ldmatrix_distribute(&load_x4(&at, |l| lane_row(l, true)), false);
    let bmats: Vec<[[u16; 8]; 8]> = (0..2)
        .map(|m| std::array::from_fn(|i| std::array::from_fn(|j| bt[8 * m + i][j])))
        .collect();
    let fb2 = ldmatrix_distribute(&bmats, true);
    let fb: [[u32; 2]; 32] = std::array::from_fn(|l| [fb2[l][0], fb2[l][1]]);
    for model in [MmaModel::OracleOrder, MmaModel::Hopper] {
        let d = gather(&mma_m16n8k16_bf16(&fa, &fb, &[[0.0; 4]; 32], model));
        for r in 0..16 {
            for n in 0..8 {
                let want: f32 = (0..16).map(|k| av[r][k] * bv[k][n]).sum();
                assert_eq!(d[r][n], want);
            }
        }
    }
}
