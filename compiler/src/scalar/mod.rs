//! f32 arithmetic shared by the op table's CPU column (`ir::maps`) and the CPU executor: the
//! transcendental functions (`math`) and the vector loops they run in (`simd`). The bottom
//! layer of the crate: it names no other module.

pub mod math;
pub mod simd;
