//! The training interface (`Backend`) over the CUDA executor.

use super::{CudaError, CudaExecutor};
use crate::backend::{Backend, ParamValues};
use crate::data::Values;
use crate::exec::finite::NonFinite;
use crate::exec::tensor::Tensor;
use crate::exec::{ExecError, Mode};

fn device(e: CudaError) -> ExecError {
    ExecError::Device(e.to_string())
}

impl Backend for CudaExecutor {
    fn backend_name(&self) -> &'static str {
        "cuda"
    }
    fn set_input(&mut self, name: &str, batch: usize, v: &Values) -> Result<(), ExecError> {
        match v {
            Values::F32(x) => self.set_f32(name, batch, x),
            Values::I32(x) => self.set_i32(name, batch, x),
        }
        .map_err(device)
    }
    fn has_input(&self, name: &str) -> bool {
        CudaExecutor::has_input(self, name)
    }
    fn run(&mut self, batch: usize, mode: Mode, step: u64, first: u64) -> Result<(), ExecError> {
        CudaExecutor::run(self, batch, mode, step, first).map_err(device)
    }
    fn loss(&self, batch: usize) -> Result<f32, ExecError> {
        Ok(self
            .output(parallax_compiler::plan::LOSS, batch)
            .map_err(device)?[0])
    }
    fn output_values(&self, name: &str, batch: usize) -> Result<Option<Tensor>, ExecError> {
        let Some(shape) = self.output_shape(name, batch) else {
            return Ok(None);
        };
        let v = self.output(name, batch).map_err(device)?;
        Ok(Some(Tensor::from_f32(shape, v)))
    }
    fn param_values(&self) -> Result<ParamValues, ExecError> {
        self.params().map_err(device)
    }
    fn set_param(&mut self, name: &str, shape: &[usize], values: &[f32]) -> Result<(), ExecError> {
        let _ = shape;
        CudaExecutor::set_param(self, name, values).map_err(device)
    }
    fn state_values(&self) -> Result<ParamValues, ExecError> {
        self.states().map_err(device)
    }
    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), ExecError> {
        CudaExecutor::set_state(self, name, values).map_err(device)
    }
    /// Nothing, every step: scanning would copy every parameter and state from the GPU
    /// after every step. On CUDA the loop checks the loss every step, and the values
    /// copied anyway are checked where they are copied: every checkpoint and the final
    /// weights refuse a non-finite tensor (`checkpoint::save`, `weights::save`), so a NaN
    /// hidden from the loss stops the run at the next checkpoint or the end, never
    /// written. (A kernel reducing to one flag on the device would make it cheap.)
    fn first_non_finite(&self) -> Result<Option<NonFinite>, ExecError> {
        Ok(None)
    }
}
