//! What training needs from an executor, so the same loop drives the CPU executor, the
//! simulated devices and the CUDA executor. The trait speaks the CPU executor's types, so its
//! implementation is here; `crate::ranks` and `crate::cuda` implement it beside their own.

use crate::cpu::Executor;
use crate::data::Values;
use crate::exec::finite::{Count, Kind, NonFinite};
use crate::exec::tensor::Tensor;
use crate::exec::{ExecError, Mode};

/// Each parameter's name, shape and values.
pub type ParamValues = Vec<(String, Vec<usize>, Vec<f32>)>;

pub trait Backend {
    /// `cpu` or `cuda`, for summaries.
    fn backend_name(&self) -> &'static str;
    fn set_input(&mut self, name: &str, batch: usize, v: &Values) -> Result<(), ExecError>;
    fn has_input(&self, name: &str) -> bool;
    /// One step on a batch of `batch` samples, the first of index `first_sample`.
    fn run(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), ExecError>;
    /// The loss after `run`.
    fn loss(&self, batch: usize) -> Result<f32, ExecError>;
    /// A named output after `run` (a copy), if the plan has it.
    fn output_values(&self, name: &str, batch: usize) -> Result<Option<Tensor>, ExecError>;
    /// Every parameter's name, shape and values (a copy), in plan order.
    fn param_values(&self) -> Result<ParamValues, ExecError>;
    fn set_param(&mut self, name: &str, shape: &[usize], values: &[f32]) -> Result<(), ExecError>;
    /// Every state's (the optimizer's, BatchNorm's running statistics) name, shape and values
    /// (a copy), in plan order.
    fn state_values(&self) -> Result<ParamValues, ExecError>;
    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), ExecError>;
    /// The samples of a global batch this process's devices read (see
    /// `data::loader::Wanted`), when that is not all of them: a process of a job of several.
    fn samples_here(&self) -> Option<crate::data::loader::Wanted> {
        None
    }
    /// After a training step: the first tensor holding a NaN or an infinity, gradients
    /// first, then parameters, then states (each in plan order). Training calls it after
    /// every step, so a backend should scan in place; this default copies the parameters and
    /// states (and sees no gradients).
    fn first_non_finite(&self) -> Result<Option<NonFinite>, ExecError> {
        let params = self
            .param_values()?
            .into_iter()
            .map(|p| (Kind::Parameter, p));
        let states = self.state_values()?.into_iter().map(|s| (Kind::State, s));
        Ok(params.chain(states).find_map(|(kind, (name, _, v))| {
            let count = Count::of(&v)?;
            Some(NonFinite { kind, name, count })
        }))
    }
}

impl Backend for Executor {
    fn backend_name(&self) -> &'static str {
        "cpu"
    }
    fn set_input(&mut self, name: &str, batch: usize, v: &Values) -> Result<(), ExecError> {
        match v {
            Values::F32(x) => self.set_f32(name, batch, x),
            Values::I32(x) => self.set_i32(name, batch, x),
        }
    }
    fn has_input(&self, name: &str) -> bool {
        Executor::has_input(self, name)
    }
    fn run(&mut self, batch: usize, mode: Mode, step: u64, first: u64) -> Result<(), ExecError> {
        Executor::run(self, batch, mode, step, first)
    }
    fn loss(&self, _batch: usize) -> Result<f32, ExecError> {
        Ok(self
            .output(parallax_compiler::plan::LOSS)
            .map_or(f32::NAN, |t| t.f32()[0]))
    }
    fn output_values(&self, name: &str, _batch: usize) -> Result<Option<Tensor>, ExecError> {
        Ok(self.output_kept(name)?.cloned())
    }
    fn param_values(&self) -> Result<ParamValues, ExecError> {
        Ok(self
            .params()
            .map(|(n, t)| (n.to_string(), t.shape.clone(), t.f32().to_vec()))
            .collect())
    }
    fn set_param(&mut self, name: &str, shape: &[usize], values: &[f32]) -> Result<(), ExecError> {
        Executor::set_param(self, name, shape, values)
    }
    fn state_values(&self) -> Result<ParamValues, ExecError> {
        Ok(self
            .states()
            .into_iter()
            .map(|(n, t)| (n.to_string(), t.shape.clone(), t.f32().to_vec()))
            .collect())
    }
    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), ExecError> {
        Executor::set_state(self, name, values)
    }
    fn first_non_finite(&self) -> Result<Option<NonFinite>, ExecError> {
        Ok(Executor::first_non_finite(self))
    }
}
