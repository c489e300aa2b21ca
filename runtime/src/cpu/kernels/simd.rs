//! Elementwise loops compiled for the widest vector unit the CPU has (AVX-512, AVX2 with FMA,
//! or the baseline), chosen once at run time. The loops are generic over the element
//! function, so each op's function (see `math`) is inlined into a vector loop.
//!
//! Determinism: vectorising an elementwise loop does not change its bits (every lane does the
//! scalar's f32 operations; Rust never contracts a multiply and an add into an FMA by itself,
//! and the explicit `mul_add`s of `math` round once at every level, in software on a CPU
//! without FMA), so every level gives the same results.

use super::math;
use parallax_compiler::ir::Op;
use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Baseline = 1,
    Avx2 = 2,
    Avx512 = 3,
}

/// The vector level in use (detected on first use).
pub fn level() -> Level {
    static LEVEL: AtomicU8 = AtomicU8::new(0);
    match LEVEL.load(Ordering::Relaxed) {
        1 => Level::Baseline,
        2 => Level::Avx2,
        3 => Level::Avx512,
        _ => {
            let l = detect();
            LEVEL.store(l as u8, Ordering::Relaxed);
            l
        }
    }
}

fn detect() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        if std::env::var_os("PARALLAX_NO_SIMD").is_some() {
            return Level::Baseline;
        }
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
            return Level::Avx512;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Level::Avx2;
        }
    }
    Level::Baseline
}

/// An elementwise op of one operand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unary {
    Scale(f32),
    AddScalar(f32),
    ClampMax(f32),
    Sqrt,
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
    Silu,
}

/// An elementwise op of two operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    /// `(x, dy)`: `dy` where `x > 0`.
    ReluGrad,
    /// `(x, dy)`: `dy * gelu'(x)`.
    GeluGrad,
    /// `(y, dy)` from `y = tanh(x)`.
    TanhGrad,
    /// `(y, dy)` from `y = sigmoid(x)`.
    SigmoidGrad,
    /// `(x, dy)`: `dy * silu'(x)`.
    SiluGrad,
}

impl Unary {
    #[inline(always)]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Unary::Scale(by) => x * by,
            Unary::AddScalar(v) => x + v,
            Unary::ClampMax(v) => x.min(v),
            Unary::Sqrt => x.sqrt(),
            Unary::Relu => x.max(0.0),
            Unary::Gelu => math::gelu(x),
            Unary::Tanh => math::tanh(x),
            Unary::Sigmoid => math::sigmoid(x),
            Unary::Silu => math::silu(x),
        }
    }
}

impl Binary {
    #[inline(always)]
    pub fn apply(self, x: f32, y: f32) -> f32 {
        match self {
            Binary::Add => x + y,
            Binary::Sub => x - y,
            Binary::Mul => x * y,
            Binary::Div => x / y,
            Binary::ReluGrad => math::relu_grad(x, y),
            Binary::GeluGrad => y * math::gelu_grad(x),
            Binary::TanhGrad => math::tanh_grad(x, y),
            Binary::SigmoidGrad => math::sigmoid_grad(x, y),
            Binary::SiluGrad => math::silu_grad(x, y),
        }
    }
}

/// An elementwise op of the IR as a vector loop's op.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Elementwise {
    Unary(Unary),
    Binary(Binary),
}

impl Elementwise {
    /// `None` for ops that are not plain elementwise maps (dropout among them).
    pub fn of(op: &Op) -> Option<Elementwise> {
        use Elementwise::{Binary as B, Unary as U};
        Some(match *op {
            Op::Add => B(Binary::Add),
            Op::Sub => B(Binary::Sub),
            Op::Mul => B(Binary::Mul),
            Op::Div => B(Binary::Div),
            Op::Scale { by } => U(Unary::Scale(by as f32)),
            Op::AddScalar { value } => U(Unary::AddScalar(value as f32)),
            Op::ClampMax { value } => U(Unary::ClampMax(value as f32)),
            Op::Sqrt => U(Unary::Sqrt),
            Op::Relu => U(Unary::Relu),
            Op::Gelu => U(Unary::Gelu),
            Op::Tanh => U(Unary::Tanh),
            Op::Sigmoid => U(Unary::Sigmoid),
            Op::Silu => U(Unary::Silu),
            Op::ReluGrad => B(Binary::ReluGrad),
            Op::GeluGrad => B(Binary::GeluGrad),
            Op::TanhGrad => B(Binary::TanhGrad),
            Op::SigmoidGrad => B(Binary::SigmoidGrad),
            Op::SiluGrad => B(Binary::SiluGrad),
            _ => return None,
        })
    }
}

/// The second operand of a binary op: one value per element, or one value for all.
#[derive(Debug, Clone, Copy)]
pub enum Operand<'a> {
    Each(&'a [f32]),
    All(f32),
}

/// One loop per op, each calling its function directly so that it is inlined and vectorised
/// (a loop over `op.apply` would test the op per element).
#[inline(always)]
fn unary_loop(op: Unary, out: &mut [f32], a: &[f32]) {
    macro_rules! each {
        ($f:expr) => {
            for (o, &x) in out.iter_mut().zip(a) {
                *o = $f(x);
            }
        };
    }
    match op {
        Unary::Scale(by) => each!(|x| x * by),
        Unary::AddScalar(v) => each!(|x| x + v),
        Unary::ClampMax(v) => each!(|x: f32| x.min(v)),
        Unary::Sqrt => each!(f32::sqrt),
        Unary::Relu => each!(|x: f32| x.max(0.0)),
        Unary::Gelu => each!(math::gelu),
        Unary::Tanh => each!(math::tanh),
        Unary::Sigmoid => each!(math::sigmoid),
        Unary::Silu => each!(math::silu),
    }
}

#[inline(always)]
fn binary_loop(op: Binary, out: &mut [f32], a: &[f32], b: Operand, swap: bool) {
    macro_rules! each {
        ($f:expr) => {
            match (b, swap) {
                (Operand::Each(b), false) => {
                    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                        *o = $f(x, y);
                    }
                }
                (Operand::Each(b), true) => {
                    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                        *o = $f(y, x);
                    }
                }
                (Operand::All(y), false) => {
                    for (o, &x) in out.iter_mut().zip(a) {
                        *o = $f(x, y);
                    }
                }
                (Operand::All(y), true) => {
                    for (o, &x) in out.iter_mut().zip(a) {
                        *o = $f(y, x);
                    }
                }
            }
        };
    }
    match op {
        Binary::Add => each!(|x, y| x + y),
        Binary::Sub => each!(|x, y| x - y),
        Binary::Mul => each!(|x, y| x * y),
        Binary::Div => each!(|x, y| x / y),
        Binary::ReluGrad => each!(math::relu_grad),
        Binary::GeluGrad => each!(|x, dy| dy * math::gelu_grad(x)),
        Binary::TanhGrad => each!(math::tanh_grad),
        Binary::SigmoidGrad => each!(math::sigmoid_grad),
        Binary::SiluGrad => each!(math::silu_grad),
    }
}

/// `vectorised! { fn name(args) -> R = body; }` defines `name`, which runs the
/// `#[inline(always)]` function `body` compiled for the detected level, so that a kernel's
/// loops (a row of a softmax, a norm) vectorise as wide as the CPU allows. Every level gives
/// the same bits, for the reasons in the module's comment.
macro_rules! vectorised {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            use $crate::cpu::kernels::simd::{level, Level};
            match level() {
                // SAFETY: the level was detected on this CPU.
                #[cfg(target_arch = "x86_64")]
                Level::Avx512 => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                Level::Avx2 => unsafe { avx2($($arg),*) },
                _ => $body($($arg),*),
            }
        }
    };
}
pub(crate) use vectorised;

vectorised! {
    /// `out[i] = op(a[i])` over the shorter of the two.
    pub fn unary(op: Unary, out: &mut [f32], a: &[f32]) = unary_loop;
}

vectorised! {
    /// `out[i] = op(a[i], b[i])` (or `op(b[i], a[i])` when `swap`) over the shortest operand.
    pub fn binary(op: Binary, out: &mut [f32], a: &[f32], b: Operand, swap: bool) = binary_loop;
}

/// The f64 sum of `f(v[i])` in a fixed order that vectorises: eight running sums, over the
/// indices equal to 0..8 mod 8, then added pairwise. The order depends only on the length,
/// never on threads or the vector level. Iterating over whole chunks of the slice (not
/// indexing it) leaves no bounds checks in the loop, which kept it from vectorising (a layer
/// norm's row 2.5x slower).
#[inline(always)]
pub fn sum8(v: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    sum8_pair(v, v, |x, _| f(x))
}

/// [`sum8`] of `f(a[i], b[i])` over the shorter slice.
#[inline(always)]
pub fn sum8_pair(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f64) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f64; 8];
    let (mut ac, mut bc) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in (&mut ac).zip(&mut bc) {
        for l in 0..8 {
            acc[l] += f(x[l], y[l]);
        }
    }
    for ((s, &x), &y) in acc.iter_mut().zip(ac.remainder()).zip(bc.remainder()) {
        *s += f(x, y);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eight_lane_sums_are_exact_where_f64_is() {
        for n in [0, 1, 7, 8, 9, 63, 64, 1000] {
            let v: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
            let want: f64 = v.iter().map(|&x| x as f64).sum();
            assert_eq!(sum8(&v, |x| x as f64), want, "{n}");
            // The pair form, by lanes: lane l holds the elements l, l + 8, ...
            let w: Vec<f32> = v.iter().map(|x| x * 0.5).collect();
            let mut lanes = [0f64; 8];
            for (i, (&x, &y)) in v.iter().zip(&w).enumerate() {
                lanes[i % 8] += x as f64 * y as f64;
            }
            let by_lanes = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
                + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
            assert_eq!(
                sum8_pair(&v, &w, |x, y| x as f64 * y as f64),
                by_lanes,
                "{n}"
            );
        }
    }

    /// The vector loops give the scalar function's bits, at every length (tails included).
    #[test]
    fn vector_loops_match_the_scalar_function() {
        let xs: Vec<f32> = (0..1037).map(|i| (i as f32 - 500.0) * 0.0173).collect();
        let ys: Vec<f32> = xs.iter().map(|x| 1.0 - x * 0.5).collect();
        // Every elementwise row of the op table but dropout (its own kernel) has a map here.
        for op in parallax_compiler::ir::ops::elementwise_examples() {
            let mapped = Elementwise::of(&op);
            assert_eq!(
                mapped.is_some(),
                !matches!(op, Op::Dropout { .. }),
                "{op:?} has no CPU elementwise map"
            );
        }
        let unaries = [
            Unary::Scale(0.3),
            Unary::AddScalar(-1.5),
            Unary::ClampMax(2.0),
            Unary::Sqrt,
            Unary::Relu,
            Unary::Gelu,
            Unary::Tanh,
            Unary::Sigmoid,
            Unary::Silu,
        ];
        let binaries = [
            Binary::Add,
            Binary::Sub,
            Binary::Mul,
            Binary::Div,
            Binary::ReluGrad,
            Binary::GeluGrad,
            Binary::TanhGrad,
            Binary::SigmoidGrad,
            Binary::SiluGrad,
        ];
        for n in [0, 1, 7, 8, 15, 16, 17, 1037] {
            let mut out = vec![0f32; n];
            for op in unaries {
                unary(op, &mut out, &xs[..n]);
                for i in 0..n {
                    let want = op.apply(xs[i]);
                    assert_eq!(out[i].to_bits(), want.to_bits(), "{op:?} at {i}");
                }
            }
            for op in binaries {
                binary(op, &mut out, &xs[..n], Operand::Each(&ys[..n]), false);
                for i in 0..n {
                    let want = op.apply(xs[i], ys[i]);
                    assert_eq!(out[i].to_bits(), want.to_bits(), "{op:?} at {i}");
                }
                binary(op, &mut out, &xs[..n], Operand::All(0.7), true);
                for i in 0..n {
                    let want = op.apply(0.7, xs[i]);
                    assert_eq!(out[i].to_bits(), want.to_bits(), "{op:?} swapped at {i}");
                }
            }
        }
    }
}
