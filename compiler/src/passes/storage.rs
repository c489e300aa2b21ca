//! Storage: in an experiment with `devices.activations: Bf16`, the activations a step stores
//! between kernels (and their gradients) are kept in bf16, as mixed-precision training keeps
//! them; every kernel still computes in f32, rounding to nearest even where it stores such a
//! value. Parameters, their gradients and updates, optimizer state, inputs, losses and the
//! row statistics a backward reads (attention's log-sum-exp, sums and means) stay f32: they
//! are small, and they are where bf16's 8-bit mantissa would cost accuracy.

use super::fuse::stored;
use super::Ctx;
use crate::dsl::ast::Storage;
use crate::ir::storage::stored_in_bf16;
use crate::ir::Graph;
use crate::Error;

pub fn run(g: &mut Graph, ctx: &Ctx) -> Result<(), Error> {
    g.bf16_stored = match ctx.source.experiment.devices.activations {
        Storage::F32 => Default::default(),
        Storage::Bf16 => stored(g)
            .into_iter()
            .flatten()
            .filter(|&n| stored_in_bf16(g, n))
            .collect(),
    };
    Ok(())
}
