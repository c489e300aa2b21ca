//! The sampler's cached path: the decode-step plan (`parallax_compiler::compile_decode`)
//! on the CPU executor or a GPU's, one token per run at its position, each attention reading and
//! updating its key and value caches (buffers of the plan that persist between runs).
//!
//! The cache holds the keys and values of the tokens it was last fed (`held`, at positions
//! `0..held.len()`). A context that extends them feeds only its new tokens; one that does
//! not (another prompt) is fed again from its first token that differs. So each token's
//! logits are those of the full-window forward over the same context. (A context past
//! `seq` tokens would need its whole window fed again for each draw, its positions having
//! moved: the sampler runs the full window's forward there instead.)

use super::{model_output, UseError, Weights};
use crate::backend::Backend;
use crate::data::Values;
use crate::exec::Mode;
use crate::run::weights::FileShapes;
use crate::train::{backend, Device};
use parallax_compiler::plan::POSITION;
use parallax_compiler::{Plan, Source};

pub struct Cached {
    exec: Box<dyn Backend>,
    /// The decode step's token input (the model's input).
    input: String,
    output: String,
    /// The tokens whose keys and values the caches hold, position by position.
    held: Vec<u32>,
    /// Bytes of the key and value caches (the decode plan's `memory.cache_bytes`).
    pub cache_bytes: u64,
}

impl Cached {
    /// The decode step of `source`'s model with `weights` on the CPU executor or GPU 0's;
    /// `Err` with the reason when the model cannot be cached (the sampler then runs the full
    /// window).
    pub fn new(
        source: &Source,
        input: &str,
        device: &Device,
        weights: &Weights,
    ) -> Result<Cached, String> {
        if !matches!(device, Device::Cpu | Device::Cuda(_)) {
            return Err("the key/value cache runs on one CPU or one GPU".into());
        }
        let plan = parallax_compiler::compile_decode(source, 1, cfg!(debug_assertions))
            .map_err(|e| e.to_string())?;
        Cached::of_plan(plan, source, input, *device, weights).map_err(|e| e.to_string())
    }

    fn of_plan(
        plan: Plan,
        source: &Source,
        input: &str,
        device: Device,
        weights: &Weights,
    ) -> Result<Cached, UseError> {
        let output = model_output(&plan)?;
        let files = FileShapes::of(&plan);
        let cache_bytes = plan.memory.cache_bytes;
        let seed = source.experiment.train.seed;
        let (mut exec, _) = backend(plan, device, &None, 1, seed)?;
        weights.load(exec.as_mut(), &files)?;
        Ok(Cached {
            exec,
            input: input.to_string(),
            output,
            held: Vec::new(),
            cache_bytes,
        })
    }

    /// The logits after `window` (at most the model's `seq` tokens, at least one).
    pub fn next_logits(&mut self, window: &[u32]) -> Result<Vec<f32>, UseError> {
        // The tokens already held at the same positions, keeping at least one to run.
        let same = self
            .held
            .iter()
            .zip(window)
            .take_while(|(a, b)| a == b)
            .count()
            .min(window.len() - 1);
        self.held.truncate(same);
        for (at, &t) in window.iter().enumerate().skip(same) {
            self.step(t, at)?;
            self.held.push(t);
        }
        let out = self.exec.output_values(&self.output, 1)?.ok_or_else(|| {
            UseError::Model(format!("the model's output `{}` was not kept", self.output))
        })?;
        Ok(out.f32().to_vec())
    }

    /// One decode step: token `t` at position `at`.
    fn step(&mut self, t: u32, at: usize) -> Result<(), UseError> {
        let e = self.exec.as_mut();
        e.set_input(&self.input, 1, &Values::I32(vec![t as i32]))?;
        e.set_input(POSITION, 1, &Values::I32(vec![at as i32]))?;
        e.run(1, Mode::Eval, 0, 0)?;
        Ok(())
    }
}
