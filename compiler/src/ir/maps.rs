//! The elementwise family of the op table: for each plain elementwise map (every elementwise
//! row but dropout, whose mask makes it a kernel of its own), its CPU function and the vector
//! loop built from it, its f64 reference, its PTX body, and whether it may end a matmul as
//! its epilogue. The backends look these up (`Op::map`, from the table's `map` column) instead of
//! matching on ops, so an elementwise op is its entry in `op.rs`, its row here and its VJP rule.

use crate::scalar::math;
use crate::scalar::simd::{binary_loop, unary_loop, Operand};

/// An f32 register of a PTX body: what `PtxScalar`'s instructions take and give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reg(pub u32);

/// The f32 instructions the rows' PTX bodies are written in (codegen's kernel builder
/// implements them, with round-to-nearest forms that forbid FMA contraction, as the CPU).
pub trait PtxScalar {
    fn constant(&mut self, v: f32) -> Reg;
    fn add(&mut self, a: Reg, b: Reg) -> Reg;
    fn sub(&mut self, a: Reg, b: Reg) -> Reg;
    fn mul(&mut self, a: Reg, b: Reg) -> Reg;
    fn div(&mut self, a: Reg, b: Reg) -> Reg;
    fn add_const(&mut self, a: Reg, c: f32) -> Reg;
    fn mul_const(&mut self, a: Reg, c: f32) -> Reg;
    /// The number when one operand is NaN, as Rust's `f32::min`.
    fn min(&mut self, a: Reg, b: Reg) -> Reg;
    /// The number when one operand is NaN, as Rust's `f32::max`.
    fn max(&mut self, a: Reg, b: Reg) -> Reg;
    /// `if a > b { then } else { otherwise }` (false for NaN).
    fn select_gt(&mut self, a: Reg, b: Reg, then: Reg, otherwise: Reg) -> Reg;
    fn sqrt(&mut self, a: Reg) -> Reg;
    fn tanh(&mut self, a: Reg) -> Reg;
    fn sigmoid(&mut self, a: Reg) -> Reg;
    fn gelu(&mut self, a: Reg) -> Reg;
    /// `d gelu / dx`.
    fn gelu_grad(&mut self, a: Reg) -> Reg;
    /// The nearest bf16 (ties to even), as an f32.
    fn round_bf16(&mut self, a: Reg) -> Reg;
}

/// A map of one operand and the op's attribute `p` (`Scale`'s factor; 0 for most).
pub struct UnaryMap {
    pub f: fn(f32, f32) -> f32,
    /// `out[i] = f(a[i], p)`, vectorised for the CPU at hand.
    pub run: fn(&mut [f32], &[f32], f32),
    pub reference: fn(f64, f64) -> f64,
    pub ptx: fn(&mut dyn PtxScalar, Reg, f32) -> Reg,
    /// Whether a matmul may apply it to its result as it writes it (an activation).
    pub epilogue: bool,
}

/// A map of two operands.
pub struct BinaryMap {
    pub f: fn(f32, f32) -> f32,
    /// `out[i] = f(a[i], b[i])`, or `f(b[i], a[i])` when swapped, vectorised.
    pub run: fn(&mut [f32], &[f32], Operand, bool),
    pub reference: fn(f64, f64) -> f64,
    pub ptx: fn(&mut dyn PtxScalar, Reg, Reg) -> Reg,
}

/// A row of the elementwise family.
pub enum Map {
    Unary(UnaryMap),
    Binary(BinaryMap),
}

/// A unary map with its op's attribute: what a kernel runs.
#[derive(Clone, Copy)]
pub struct Unary {
    pub map: &'static UnaryMap,
    pub p: f32,
}

impl Unary {
    #[inline(always)]
    pub fn apply(self, x: f32) -> f32 {
        (self.map.f)(x, self.p)
    }
    /// `out[i] = apply(a[i])` over the shorter of the two.
    pub fn run(self, out: &mut [f32], a: &[f32]) {
        (self.map.run)(out, a, self.p)
    }
}

#[derive(Clone, Copy)]
pub struct Binary(pub &'static BinaryMap);

impl Binary {
    #[inline(always)]
    pub fn apply(self, x: f32, y: f32) -> f32 {
        (self.0.f)(x, y)
    }
    /// `out[i] = apply(a[i], b[i])` (`apply(b[i], a[i])` when `swap`) over the shortest.
    pub fn run(self, out: &mut [f32], a: &[f32], b: Operand, swap: bool) {
        (self.0.run)(out, a, b, swap)
    }
}

/// An op's map, ready to run.
#[derive(Clone, Copy)]
pub enum Elementwise {
    Unary(Unary),
    Binary(Binary),
}

impl std::fmt::Debug for Elementwise {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Elementwise::Unary(u) => write!(f, "Unary(p={})", u.p),
            Elementwise::Binary(_) => write!(f, "Binary"),
        }
    }
}

/// `unary! { cpu: |x, p| .., f64: |x, p| .., ptx: |k, a, p| .., epilogue: bool }`: a unary
/// row, its CPU function made into a vector loop; `p` is the op's attribute its entry in
/// `op.rs` names (`map maps::SCALE { by }`), 0 without one.
macro_rules! unary {
    (
        cpu: |$x:pat_param, $p:pat_param| $cpu:expr,
        f64: |$rx:pat_param, $rp:pat_param| $reference:expr,
        ptx: |$k:ident, $a:pat_param, $pp:pat_param| $ptx:expr,
        epilogue: $epilogue:expr $(,)?
    ) => {{
        #[inline(always)]
        fn f($x: f32, $p: f32) -> f32 {
            $cpu
        }
        #[inline(always)]
        fn body(out: &mut [f32], a: &[f32], p: f32) {
            unary_loop(f, out, a, p)
        }
        crate::vectorised! { fn run(out: &mut [f32], a: &[f32], p: f32) = body; }
        fn reference($rx: f64, $rp: f64) -> f64 {
            $reference
        }
        fn ptx($k: &mut dyn PtxScalar, $a: Reg, $pp: f32) -> Reg {
            $ptx
        }
        Map::Unary(UnaryMap {
            f,
            run,
            reference,
            ptx,
            epilogue: $epilogue,
        })
    }};
}

/// `binary! { cpu: |x, y| .., f64: |x, y| .., ptx: |k, a, b| .. }`: a binary row.
macro_rules! binary {
    (
        cpu: |$x:pat_param, $y:pat_param| $cpu:expr,
        f64: |$rx:pat_param, $ry:pat_param| $reference:expr,
        ptx: |$k:ident, $a:pat_param, $b:pat_param| $ptx:expr $(,)?
    ) => {{
        #[inline(always)]
        fn f($x: f32, $y: f32) -> f32 {
            $cpu
        }
        #[inline(always)]
        fn body(out: &mut [f32], a: &[f32], b: Operand, swap: bool) {
            binary_loop(f, out, a, b, swap)
        }
        crate::vectorised! { fn run(out: &mut [f32], a: &[f32], b: Operand, swap: bool) = body; }
        fn reference($rx: f64, $ry: f64) -> f64 {
            $reference
        }
        fn ptx($k: &mut dyn PtxScalar, $a: Reg, $b: Reg) -> Reg {
            $ptx
        }
        Map::Binary(BinaryMap {
            f,
            run,
            reference,
            ptx,
        })
    }};
}

fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `Phi(x)`, the standard normal distribution function.
fn phi64(x: f64) -> f64 {
    0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))
}

pub static ADD: Map = binary! {
    cpu: |x, y| x + y,
    f64: |x, y| x + y,
    ptx: |k, a, b| k.add(a, b),
};
pub static SUB: Map = binary! {
    cpu: |x, y| x - y,
    f64: |x, y| x - y,
    ptx: |k, a, b| k.sub(a, b),
};
pub static MUL: Map = binary! {
    cpu: |x, y| x * y,
    f64: |x, y| x * y,
    ptx: |k, a, b| k.mul(a, b),
};
pub static DIV: Map = binary! {
    cpu: |x, y| x / y,
    f64: |x, y| x / y,
    ptx: |k, a, b| k.div(a, b),
};
pub static SCALE: Map = unary! {
    cpu: |x, by| x * by,
    f64: |x, by| x * by,
    ptx: |k, a, by| k.mul_const(a, by),
    epilogue: false,
};
pub static ADD_SCALAR: Map = unary! {
    cpu: |x, v| x + v,
    f64: |x, v| x + v,
    ptx: |k, a, v| k.add_const(a, v),
    epilogue: false,
};
pub static CLAMP_MAX: Map = unary! {
    cpu: |x, v| x.min(v),
    f64: |x, v| x.min(v),
    ptx: |k, a, v| {
        let v = k.constant(v);
        k.min(a, v)
    },
    epilogue: false,
};
pub static SQRT: Map = unary! {
    cpu: |x, _| x.sqrt(),
    f64: |x, _| x.sqrt(),
    ptx: |k, a, _| k.sqrt(a),
    epilogue: false,
};
pub static RELU: Map = unary! {
    // NaN becomes 0, as `f32::max` (the PTX `max` too).
    cpu: |x, _| x.max(0.0),
    f64: |x, _| x.max(0.0),
    ptx: |k, a, _| {
        let z = k.constant(0.0);
        k.max(a, z)
    },
    epilogue: true,
};
pub static GELU: Map = unary! {
    cpu: |x, _| math::gelu(x),
    f64: |x, _| x * phi64(x),
    ptx: |k, a, _| k.gelu(a),
    epilogue: true,
};
pub static TANH: Map = unary! {
    cpu: |x, _| math::tanh(x),
    f64: |x, _| x.tanh(),
    ptx: |k, a, _| k.tanh(a),
    epilogue: true,
};
pub static SIGMOID: Map = unary! {
    cpu: |x, _| math::sigmoid(x),
    f64: |x, _| sigmoid64(x),
    ptx: |k, a, _| k.sigmoid(a),
    epilogue: true,
};
pub static SILU: Map = unary! {
    cpu: |x, _| x * math::sigmoid(x),
    f64: |x, _| x * sigmoid64(x),
    ptx: |k, a, _| {
        let s = k.sigmoid(a);
        k.mul(a, s)
    },
    epilogue: true,
};
pub static RELU6: Map = unary! {
    // NaN becomes 0, as `Relu` and the PTX `max` (where `clamp` would keep it).
    cpu: |x, _| {
        let r = x.max(0.0);
        r.min(6.0)
    },
    f64: |x, _| {
        let r = x.max(0.0);
        r.min(6.0)
    },
    ptx: |k, a, _| {
        let z = k.constant(0.0);
        let r = k.max(a, z);
        let six = k.constant(6.0);
        k.min(r, six)
    },
    epilogue: true,
};
/// `(x, dy)`: `dy` where `x > 0`.
pub static RELU_GRAD: Map = binary! {
    cpu: |x, dy| if x > 0.0 { dy } else { 0.0 },
    f64: |x, dy| if x > 0.0 { dy } else { 0.0 },
    ptx: |k, a, dy| {
        let z = k.constant(0.0);
        k.select_gt(a, z, dy, z)
    },
};
/// `(x, dy)`: `dy` where `0 < x < 6` (PyTorch's `hardtanh_backward`: 0 at both ends).
pub static RELU6_GRAD: Map = binary! {
    cpu: |x, dy| {
        let below = if 6.0 > x { dy } else { 0.0 };
        if x > 0.0 { below } else { 0.0 }
    },
    f64: |x, dy| if x > 0.0 && x < 6.0 { dy } else { 0.0 },
    ptx: |k, a, dy| {
        let z = k.constant(0.0);
        let six = k.constant(6.0);
        let below = k.select_gt(six, a, dy, z);
        k.select_gt(a, z, below, z)
    },
};
/// `(x, dy)`: `dy * gelu'(x)`.
pub static GELU_GRAD: Map = binary! {
    cpu: |x, dy| dy * math::gelu_grad(x),
    f64: |x, dy| dy * (phi64(x) + x * (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()),
    ptx: |k, a, dy| {
        let g = k.gelu_grad(a);
        k.mul(dy, g)
    },
};
/// `(y, dy)` from `y = tanh(x)`: `dy * (1 - y^2)`.
pub static TANH_GRAD: Map = binary! {
    cpu: |y, dy| dy * (1.0 - y * y),
    f64: |y, dy| dy * (1.0 - y * y),
    ptx: |k, y, dy| {
        let y2 = k.mul(y, y);
        let one = k.constant(1.0);
        let t = k.sub(one, y2);
        k.mul(dy, t)
    },
};
/// `(y, dy)` from `y = sigmoid(x)`: `dy * y * (1 - y)`.
pub static SIGMOID_GRAD: Map = binary! {
    cpu: |y, dy| dy * y * (1.0 - y),
    f64: |y, dy| dy * y * (1.0 - y),
    ptx: |k, y, dy| {
        let t = k.mul(dy, y);
        let one = k.constant(1.0);
        let c = k.sub(one, y);
        k.mul(t, c)
    },
};
/// `(x, dy)`: `dy * s * (1 + x * (1 - s))` with `s = sigmoid(x)`.
pub static ROUND_BF16: Map = unary! {
    cpu: |x, _| math::round_bf16(x),
    // Exact: a bf16 is an f32 whose low 16 bits are zero.
    f64: |x, _| f64::from(math::round_bf16(x as f32)),
    ptx: |k, a, _| k.round_bf16(a),
    epilogue: false,
};
pub static SILU_GRAD: Map = binary! {
    cpu: |x, dy| {
        let s = math::sigmoid(x);
        dy * (s * (1.0 + x * (1.0 - s)))
    },
    f64: |x, dy| {
        let s = sigmoid64(x);
        dy * (s * (1.0 + x * (1.0 - s)))
    },
    ptx: |k, x, dy| {
        let s = k.sigmoid(x);
        let one = k.constant(1.0);
        let c = k.sub(one, s);
        let xc = k.mul(x, c);
        let t = k.add_const(xc, 1.0);
        let g = k.mul(s, t);
        k.mul(dy, g)
    },
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::op::{elementwise_examples, Op};

    /// Operands where every map is defined: `x` across [-6, 6] (its absolute value for a
    /// square root), `y` away from zero (a divisor).
    fn operands(op: &Op, n: usize) -> (Vec<f32>, Vec<f32>) {
        let xs = (0..n)
            .map(|i| {
                let x = (i as f32 - n as f32 / 2.0) * (12.0 / n.max(1) as f32);
                if matches!(op, Op::Sqrt) {
                    x.abs()
                } else {
                    x
                }
            })
            .collect();
        let ys = (0..n).map(|i| 0.5 + (i % 17) as f32 * 0.125).collect();
        (xs, ys)
    }

    /// Each map's CPU function against its f64 reference, and its vector loop against the
    /// function bit for bit at every length (tails included), swapped operands too.
    #[test]
    fn cpu_maps_match_their_reference_and_their_vector_loops() {
        for op in elementwise_examples() {
            let Some(m) = op.map() else { continue };
            for n in [0, 1, 7, 8, 15, 16, 17, 1037] {
                let (xs, ys) = operands(&op, n);
                let mut out = vec![0f32; n];
                match m {
                    Elementwise::Unary(u) => {
                        u.run(&mut out, &xs);
                        for i in 0..n {
                            let got = u.apply(xs[i]);
                            assert_eq!(out[i].to_bits(), got.to_bits(), "{op:?} at {i}");
                            let want = (u.map.reference)(xs[i] as f64, u.p as f64);
                            let err = (got as f64 - want).abs();
                            assert!(
                                err <= 2e-6 * want.abs().max(1.0),
                                "{op:?}({}) = {got}, want {want}",
                                xs[i]
                            );
                        }
                    }
                    Elementwise::Binary(b) => {
                        b.run(&mut out, &xs, Operand::Each(&ys), false);
                        for i in 0..n {
                            let got = b.apply(xs[i], ys[i]);
                            assert_eq!(out[i].to_bits(), got.to_bits(), "{op:?} at {i}");
                            let want = (b.0.reference)(xs[i] as f64, ys[i] as f64);
                            let err = (got as f64 - want).abs();
                            assert!(
                                err <= 2e-6 * want.abs().max(1.0),
                                "{op:?}({}, {}) = {got}, want {want}",
                                xs[i],
                                ys[i]
                            );
                        }
                        b.run(&mut out, &ys, Operand::All(0.7), true);
                        for i in 0..n {
                            let want = b.apply(0.7, ys[i]);
                            assert_eq!(out[i].to_bits(), want.to_bits(), "{op:?} swapped at {i}");
                        }
                    }
                }
            }
        }
    }
}
