//! TEMPORARY stand-ins for `convert`, `approx` and `tensor`'s functions (another helper
//! writes those files); removed once they land. Same signatures as their contract.

#![allow(dead_code)]

pub mod convert {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Rounding {
        Rn,
        Rz,
        Rm,
        Rp,
        Rna,
    }
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum IntRounding {
        Rni,
        Rzi,
        Rmi,
        Rpi,
    }
    pub fn bf16x2_from_f32(a: f32, b: f32) -> u32 {
        ((f32_to_bf16_rn(a) as u32) << 16) | f32_to_bf16_rn(b) as u32
    }
    pub fn f32_to_bf16_rn(x: f32) -> u16 {
        let b = x.to_bits();
        if x.is_nan() {
            return 0x7fc0;
        }
        let r = b.wrapping_add(0x7fff + ((b >> 16) & 1));
        (r >> 16) as u16
    }
    pub fn bf16_to_f32(x: u16) -> f32 {
        f32::from_bits((x as u32) << 16)
    }
    pub fn f64_to_f32(x: f64, _r: Rounding) -> f32 {
        x as f32
    }
    fn round(x: f64, r: IntRounding) -> f64 {
        match r {
            IntRounding::Rni => x.round_ties_even(),
            IntRounding::Rzi => x.trunc(),
            IntRounding::Rmi => x.floor(),
            IntRounding::Rpi => x.ceil(),
        }
    }
    pub fn round_f32_to_integral(x: f32, r: IntRounding) -> f32 {
        round(x as f64, r) as f32
    }
    pub fn float_to_int(x: f64, r: IntRounding, signed: bool, bits: u32) -> u64 {
        if x.is_nan() {
            return 0;
        }
        let v = round(x, r);
        let (lo, hi) = if signed {
            (
                -(2f64.powi(bits as i32 - 1)),
                2f64.powi(bits as i32 - 1) - 1.0,
            )
        } else {
            (0.0, 2f64.powi(bits as i32) - 1.0)
        };
        let v = v.clamp(lo, hi);
        if signed {
            v as i64 as u64
        } else {
            v as u64
        }
    }
    pub fn int_to_f32(x: i128, _r: Rounding) -> f32 {
        x as f32
    }
    pub fn int_to_f64(x: i128, _r: Rounding) -> f64 {
        x as f64
    }
    pub fn ftz(x: f32) -> f32 {
        if x.is_subnormal() {
            0.0f32.copysign(x)
        } else {
            x
        }
    }
}

pub mod approx {
    fn z(x: f32, ftz: bool) -> f32 {
        if ftz {
            super::convert::ftz(x)
        } else {
            x
        }
    }
    pub fn ex2(x: f32, f: bool) -> f32 {
        z((z(x, f) as f64).exp2() as f32, f)
    }
    pub fn lg2(x: f32, f: bool) -> f32 {
        z((z(x, f) as f64).log2() as f32, f)
    }
    pub fn rcp(x: f32, f: bool) -> f32 {
        z((1.0 / z(x, f) as f64) as f32, f)
    }
    pub fn rsqrt(x: f32, f: bool) -> f32 {
        z((1.0 / (z(x, f) as f64).sqrt()) as f32, f)
    }
    pub fn sqrt(x: f32, f: bool) -> f32 {
        z(z(x, f).sqrt(), f)
    }
    pub fn sin(x: f32, f: bool) -> f32 {
        z((z(x, f) as f64).sin() as f32, f)
    }
    pub fn cos(x: f32, f: bool) -> f32 {
        z((z(x, f) as f64).cos() as f32, f)
    }
    pub fn tanh(x: f32) -> f32 {
        (x as f64).tanh() as f32
    }
}

pub mod tensor {
    use crate::MmaModel;
    fn bf(x: u32, hi: bool) -> f32 {
        f32::from_bits(if hi { x & 0xffff_0000 } else { x << 16 })
    }
    pub fn mma_m16n8k16_bf16(
        a: &[[u32; 4]; 32],
        b: &[[u32; 2]; 32],
        c: &[[f32; 4]; 32],
        _model: MmaModel,
    ) -> [[f32; 4]; 32] {
        let mut am = [[0f32; 16]; 16];
        let mut bm = [[0f32; 8]; 16];
        for l in 0..32 {
            let (g, t) = (l / 4, l % 4);
            for i in 0..8 {
                let row = if i < 2 || (4..6).contains(&i) {
                    g
                } else {
                    g + 8
                };
                let col = t * 2 + (i & 1) + if i >= 4 { 8 } else { 0 };
                am[row][col] = bf(a[l][i / 2], i % 2 == 1);
            }
            for i in 0..4 {
                let row = t * 2 + (i & 1) + if i >= 2 { 8 } else { 0 };
                bm[row][g] = bf(b[l][i / 2], i % 2 == 1);
            }
        }
        let mut d = [[0f32; 4]; 32];
        for l in 0..32 {
            let (g, t) = (l / 4, l % 4);
            for i in 0..4 {
                let row = if i < 2 { g } else { g + 8 };
                let col = t * 2 + (i & 1);
                let mut acc = c[l][i];
                for k in 0..16 {
                    acc = am[row][k].mul_add(bm[k][col], acc);
                }
                d[l][i] = acc;
            }
        }
        d
    }
    pub fn ldmatrix_distribute(rows: &[[[u16; 8]; 8]], trans: bool) -> [[u32; 4]; 32] {
        let mut out = [[0u32; 4]; 32];
        for (m, mat) in rows.iter().enumerate().take(4) {
            for (t, o) in out.iter_mut().enumerate() {
                let (r, c) = (t / 4, 2 * (t % 4));
                let (lo, hi) = if trans {
                    (mat[c][r], mat[c + 1][r])
                } else {
                    (mat[r][c], mat[r][c + 1])
                };
                o[m] = lo as u32 | (hi as u32) << 16;
            }
        }
        out
    }
}
