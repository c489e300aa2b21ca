//! The builder's f32 special functions (exponential, logarithm, tanh, sigmoid, erf, GELU
//! and its gradient), written from `ex2`/`lg2` and rounding-mode arithmetic so that they
//! track the CPU's functions.

use super::{imm, Kernel, F};

impl Kernel {
    /// `e^x`: `2^(x log2 e)` with the product split in two, so large arguments keep their
    /// precision (softmax and cross-entropy compare against the CPU's `exp`).
    pub fn exp(&mut self, x: F) -> F {
        let hi = self.f();
        let lo = self.f();
        let t = self.f();
        let d = self.f();
        let e = self.f();
        let r = self.f();
        // hi = round(x * log2e), lo = the rest (with log2e in two parts), so 2^hi is exact
        // and 2^lo is close to 1.
        self.ins(format!(
            "mul.rn.f32 {t}, {x}, {}",
            imm(std::f32::consts::LOG2_E)
        ));
        self.ins(format!("cvt.rni.f32.f32 {hi}, {t}"));
        self.ins(format!("neg.f32 {t}, {hi}"));
        self.ins(format!(
            "fma.rn.f32 {lo}, {x}, {}, {t}",
            imm(std::f32::consts::LOG2_E)
        ));
        self.ins(format!(
            "fma.rn.f32 {lo}, {x}, {}, {lo}",
            imm((std::f64::consts::LOG2_E - std::f32::consts::LOG2_E as f64) as f32)
        ));
        self.ins(format!("ex2.approx.f32 {d}, {lo}"));
        self.ins(format!("ex2.approx.f32 {e}, {hi}"));
        self.ins(format!("mul.rn.f32 {r}, {d}, {e}"));
        r
    }
    /// Natural logarithm.
    pub fn ln(&mut self, x: F) -> F {
        let d = self.f();
        self.ins(format!("lg2.approx.f32 {d}, {x}"));
        self.mulc(d, std::f32::consts::LN_2)
    }
    /// `tanh(x) = sign(x) (1 - 2 / (e^(2|x|) + 1))`, exact at the tails.
    pub fn tanh(&mut self, x: F) -> F {
        let a = self.abs(x);
        let a2 = self.mulc(a, 2.0);
        let e = self.exp(a2);
        let e1 = self.addc(e, 1.0);
        let two = self.fc(2.0);
        let q = self.div(two, e1);
        let one = self.fc(1.0);
        let t = self.sub(one, q);
        // Small |x|: tanh x = x (1 - x^2/3 + 2x^4/15), where the form above cancels.
        let x2 = self.mul(x, x);
        let c = self.mulc(x2, 2.0 / 15.0);
        let c = self.addc(c, -1.0 / 3.0);
        let c = self.mul(c, x2);
        let c = self.addc(c, 1.0);
        let small = self.mul(c, a);
        let lim = self.fc(0.004);
        let p = self.cmpf("lt", a, lim);
        let m = self.sel(small, t, p);
        let d = self.f();
        // copysign.f32 d, a, b copies the sign of a onto b.
        self.ins(format!("copysign.f32 {d}, {x}, {m}"));
        d
    }
    /// `1 / (1 + e^-x)`.
    pub fn sigmoid(&mut self, x: F) -> F {
        let n = self.neg(x);
        let e = self.exp(n);
        let d = self.addc(e, 1.0);
        let one = self.fc(1.0);
        self.div(one, d)
    }
    /// `erf(x)` given `e^(-x^2)`: the CPU kernel's formula, operation for operation.
    pub fn erf_given(&mut self, x: F, exp_neg_x2: F) -> F {
        let a = self.abs(x);
        let x2 = self.mul(x, x);
        // Series for |x| < 0.5.
        let s = self.fc(1.0 / 1320.0);
        let s = self.mul(x2, s);
        let c = self.fc(1.0 / 216.0);
        let s = self.sub(c, s);
        let s = self.mul(x2, s);
        let s = self.addc(s, -1.0 / 42.0);
        let s = self.mul(x2, s);
        let s = self.addc(s, 0.1);
        let s = self.mul(x2, s);
        let s = self.addc(s, -1.0 / 3.0);
        let s = self.mul(x2, s);
        let s = self.addc(s, 1.0);
        let series = self.mulc(x, std::f32::consts::FRAC_2_SQRT_PI);
        let series = self.mul(series, s);
        // Abramowitz-Stegun 7.1.26 otherwise.
        let t = self.mulc(a, 0.327_591_1);
        let t = self.addc(t, 1.0);
        let one = self.fc(1.0);
        let t = self.div(one, t);
        let p = self.mulc(t, 1.061_405_4);
        let p = self.addc(p, -1.453_152_1);
        let p = self.mul(t, p);
        let p = self.addc(p, 1.421_413_8);
        let p = self.mul(t, p);
        let p = self.addc(p, -0.284_496_74);
        let p = self.mul(t, p);
        let p = self.addc(p, 0.254_829_6);
        let p = self.mul(t, p);
        let pe = self.mul(p, exp_neg_x2);
        let one = self.fc(1.0);
        let v = self.sub(one, pe);
        let tail = self.f();
        self.ins(format!("copysign.f32 {tail}, {x}, {v}"));
        let half = self.fc(0.5);
        let small = self.cmpf("lt", a, half);
        self.sel(series, tail, small)
    }
    /// `(erf(x / sqrt 2), exp(-x^2 / 2))`, what GELU and its gradient share.
    fn gelu_terms(&mut self, x: F) -> (F, F) {
        let a = self.mulc(x, std::f32::consts::FRAC_1_SQRT_2);
        let na = self.neg(a);
        let a2 = self.mul(na, a);
        let e = self.exp(a2);
        (self.erf_given(a, e), e)
    }
    pub fn gelu(&mut self, x: F) -> F {
        let (erf, _) = self.gelu_terms(x);
        let h = self.mulc(x, 0.5);
        let one = self.addc(erf, 1.0);
        self.mul(h, one)
    }
    pub fn gelu_grad(&mut self, x: F) -> F {
        let (erf, e) = self.gelu_terms(x);
        let cdf = self.addc(erf, 1.0);
        let cdf = self.mulc(cdf, 0.5);
        let xe = self.mul(x, e);
        let xe = self.mulc(xe, 0.398_942_3);
        self.add(cdf, xe)
    }
}
