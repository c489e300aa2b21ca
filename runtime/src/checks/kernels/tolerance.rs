//! How closely each kernel must follow the oracle on the interpreter: decided once, here,
//! from what the kernel's code does (its instructions and launches), not from its name.
//! The README's table of kernel families states these with their reasons.

use crate::cuda::Precision;
use parallax_compiler::codegen::{Launch, Module};
use parallax_compiler::Plan;

/// What sets a kernel's tolerance; a kernel takes the loosest that applies to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// No launch: the ranks' exchange (a transfer, a sum over ranks), which the collective
    /// library does on GPUs; nothing to compare.
    Collective,
    /// The oracle's IEEE operations in the oracle's order: bit for bit.
    Exact,
    /// Uses approximate functions (`ex2.approx`, `lg2.approx`, ...), which the interpreter
    /// rounds correctly and the oracle computes with libm on the unscaled argument.
    Approximate,
    /// Sums the oracle's products in an order of its own: the direct convolutions (one
    /// thread per output, channels then taps, or a warp's butterfly), where the oracle
    /// multiplies through im2col and a GEMM.
    Reordered,
    /// A GEMM, computed on the host here (by cuBLAS on a GPU) in f64 from the operands at
    /// the precision's rounding; the oracle sums in f32.
    Gemm,
    /// Stores a value in bf16: the two sides' f32 results may round to neighbouring bf16
    /// values (2^-8 apart).
    Bf16Stored,
    /// Multiplies on tensor cores (`mma.sync`, bf16 operands rounded from f32); the oracle
    /// multiplies f32.
    TensorCore,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Collective => "collective",
            Family::Exact => "exact",
            Family::Approximate => "approx",
            Family::Reordered => "reordered",
            Family::Gemm => "gemm",
            Family::Bf16Stored => "bf16-stored",
            Family::TensorCore => "tensor-core",
        }
    }

    /// The tolerance on `max |oracle - interpreter| / max |oracle|`.
    pub fn tolerance(self, precision: Precision) -> f64 {
        match self {
            Family::Collective | Family::Exact => 0.0,
            // ex2.approx.f32's argument `x * log2(e)` is rounded to f32 first: a relative
            // error of up to |x log2 e| 2^-24 ln 2 in the result, 4e-6 at |x| = 100, plus
            // the approximation's own 2 ulp on a GPU; sums of such terms keep the bound.
            Family::Approximate => 1e-5,
            // Either order's error is within k 2^-24 of the sum of |terms| (k terms); for
            // the models' sizes that stays far below 1e-5 of the largest output.
            Family::Reordered => 1e-5,
            // The oracle's f32 sums against exact ones; TF32 and bf16 round each operand
            // (2^-11, 2^-8 relative), as `gpu-check` allows a GPU.
            Family::Gemm => match precision {
                Precision::Fp32 => 1e-5,
                Precision::Tf32 => 1e-3,
                Precision::Bf16 => 2e-2,
            },
            Family::Bf16Stored => 1e-2,
            Family::TensorCore => 2e-2,
        }
    }
}

const APPROXIMATE: [&str; 8] = [
    "ex2.approx",
    "lg2.approx",
    "rcp.approx",
    "rsqrt.approx",
    "sqrt.approx",
    "sin.approx",
    "cos.approx",
    "tanh.approx",
];

/// The ops whose kernels sum in an order of their own (see `Family::Reordered`).
const REORDERED: [&str; 3] = ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"];

/// Kernel `k`'s family and tolerance at `precision`.
pub fn of(plan: &Plan, code: &Module, k: usize, precision: Precision) -> (Family, f64) {
    if code.kernels[k].launches.is_empty() {
        return (Family::Collective, 0.0);
    }
    let mut family = Family::Exact;
    for l in &code.kernels[k].launches {
        let f = match l {
            Launch::Gemm { .. } => Family::Gemm,
            Launch::Copy { .. } => Family::Exact,
            Launch::Kernel { entry, .. } => {
                let text = code
                    .entries
                    .iter()
                    .find(|(n, _)| n == entry)
                    .map_or("", |(_, t)| t.as_str());
                if text.contains("mma.sync") {
                    Family::TensorCore
                } else if APPROXIMATE.iter().any(|a| text.contains(a)) {
                    Family::Approximate
                } else {
                    Family::Exact
                }
            }
        };
        family = looser(family, f, precision);
    }
    let steps = &plan.kernels[k].steps;
    if steps
        .iter()
        .any(|&s| REORDERED.contains(&plan.steps[s].op.name()))
    {
        family = looser(family, Family::Reordered, precision);
    }
    if steps.iter().any(|&s| plan.stored_in_bf16(s)) {
        family = looser(family, Family::Bf16Stored, precision);
    }
    (family, family.tolerance(precision))
}

fn looser(a: Family, b: Family, precision: Precision) -> Family {
    if b.tolerance(precision) > a.tolerance(precision) {
        b
    } else {
        a
    }
}
