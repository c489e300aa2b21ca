//! The warp-wide matrix instructions: `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`
//! with the PTX ISA's fragment layouts, and `ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}`.
//! (To be written: see the crate's plan.)

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
