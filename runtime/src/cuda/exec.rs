//! The CUDA executor: the plan's buffers in device memory (`memory`), its kernels launched by
//! the launcher (`launch`: one PTX module per batch size, GEMMs through cuBLAS, all on one
//! stream), and a step replayed from a CUDA graph where asked (`graph`). Parameters are
//! initialised on the host with the CPU executor's keyed generator, so both backends start
//! from the same bits.

use super::gemm::Precision;
use super::graph::Graphs;
use super::launch::{blas_handle, Launcher};
use super::memory::{numel, Memory};
use super::module::codegen_options;
use super::{target_for, CudaError};
use crate::exec::Mode;
use cudarc::cublas::result as blas;
use cudarc::driver::{CudaContext, CudaStream};
use parallax_compiler::codegen;
use parallax_compiler::ir::{DType, Op};
use parallax_compiler::Plan;
use std::collections::HashMap;
use std::sync::Arc;

pub struct CudaExecutor {
    pub(super) mem: Memory,
    pub(super) launch: Launcher,
    /// The step captured as a CUDA graph (`PARALLAX_CUDA_GRAPH=1`).
    graphs: Graphs,
    inputs: HashMap<String, usize>,
    outputs: HashMap<String, usize>,
    pub(super) params: Vec<(String, usize)>,
    /// Optimizer state by name.
    pub(super) states: Vec<(String, usize)>,
}

// SAFETY: an executor is used by one thread at a time (`&mut self`), and a rank's thread
// binds the executor's context before its first call (`RankExecutor::begin_step`). Its raw
// handles may move between threads: cuBLAS and cuBLASLt functions "can be called from
// multiple host threads, even with the same handle" (cuBLAS guide, Thread Safety), and the
// driver's objects (context, stream, module) are cudarc's, which are Send.
unsafe impl Send for CudaExecutor {}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        let _ = self.mem.stream.synchronize();
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { blas::destroy_handle(self.launch.blas) };
    }
}

impl CudaExecutor {
    /// Allocates every buffer of the plan on GPU `ordinal` for batches up to `max_batch` and
    /// initialises the parameters from `seed`.
    pub fn new(
        plan: Plan,
        max_batch: usize,
        seed: u64,
        ordinal: usize,
        precision: Precision,
    ) -> Result<CudaExecutor, CudaError> {
        let devices = super::probe()?;
        let gpu = devices.gpus.get(ordinal).ok_or(CudaError::TooFewGpus {
            needed: ordinal + 1,
            found: devices.gpus.len(),
        })?;
        if !devices.cublas {
            return Err(CudaError::MissingLibrary {
                library: "libcublas.so.13",
                hint: "install the CUDA 13 cuBLAS libraries (e.g. the nvidia-cublas wheel) and put them on LD_LIBRARY_PATH",
            });
        }
        let target = target_for(gpu.compute_capability);
        let ctx = CudaContext::new(ordinal)?;
        // One stream, synchronised by its order: no per-buffer events needed.
        // SAFETY: set before any allocation through the context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let handle = blas_handle(&stream, precision)?;
        let max_batch = max_batch.max(1);
        // The module at the largest batch sizes the scratch.
        let code =
            codegen::generate_with(&plan, max_batch as u64, target, &codegen_options(precision))?;
        let names = plan.names();
        let launch = Launcher::new(
            &plan,
            stream.clone(),
            handle,
            precision,
            seed,
            target,
            max_batch,
        );
        let mem = Memory::new(plan, max_batch, ctx, stream, ordinal, &code)?;
        let mut e = CudaExecutor {
            mem,
            launch,
            graphs: Graphs::from_env(),
            inputs: names.inputs.into_iter().collect(),
            outputs: names.outputs.into_iter().collect(),
            params: names.params,
            states: names.states,
        };
        e.launch.lt =
            match super::lt::selected(precision, std::env::var(super::lt::ENV).ok().as_deref()) {
                Some(compute) => super::lt::Lt::new(compute, gpu.compute_capability.0)?,
                None => None,
            };
        e.launch.load(&e.mem.ctx, code)?;
        e.init_params()?;
        Ok(e)
    }

    pub fn plan(&self) -> &Plan {
        &self.mem.plan
    }

    pub fn target(&self) -> &'static str {
        self.launch.target
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.mem.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.mem.ctx
    }

    /// Fills the constants of the plan for `batch`, and its `training` flag for `mode`
    /// (before the kernels).
    pub fn begin(&mut self, batch: usize, mode: Mode) -> Result<(), CudaError> {
        self.launch.begin(&self.mem, batch, mode)
    }

    /// Runs kernel `k` of the plan (after `begin`).
    pub fn run_kernel(
        &self,
        k: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), CudaError> {
        self.launch
            .run_kernel(&self.mem, k, mode, step, first_sample)
    }

    /// Copies the updated parameters and state over the old (the end of a training step).
    pub fn finish(&mut self, mode: Mode) -> Result<(), CudaError> {
        self.launch.finish(&self.mem, mode)
    }

    /// Runs one training step with a CUDA event around every launch and returns the time of
    /// each launch, labelled by what it computes (for `gpu-check --profile`).
    pub fn profile_step(
        &mut self,
        batch: usize,
        step: u64,
    ) -> Result<Vec<(String, f64)>, CudaError> {
        self.launch.profile_step(&self.mem, batch, step)
    }

    /// Runs one step on a batch of `batch` samples (inputs set before), as the CPU executor:
    /// replayed from its CUDA graph where it has one (`graph`).
    pub fn run(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), CudaError> {
        let at = (step, first_sample);
        if self
            .graphs
            .run_graph(&mut self.launch, &self.mem, batch, mode, at)?
        {
            return Ok(());
        }
        self.launch
            .run_direct(&self.mem, batch, mode, step, first_sample)
    }

    /// What graphs did, for reports: `None` when they are off.
    pub fn cuda_graphs(&self) -> Option<String> {
        self.graphs.report()
    }

    fn init_params(&mut self) -> Result<(), CudaError> {
        for index in 0..self.params.len() {
            let id = self.params[index].1;
            let Op::Param { init, .. } = &self.mem.plan.steps[id].op else {
                continue;
            };
            let mut v = vec![0f32; numel(&self.mem.shape(id, 1)) as usize];
            crate::rng::init_param(init, self.launch.seed, index, &mut v);
            self.mem.upload_f32(id, &v)?;
        }
        // Optimizer state starts at zero, BatchNorm's running variance at one.
        for &(_, id) in &self.states {
            let Op::State { start, .. } = self.mem.plan.steps[id].op else {
                continue;
            };
            let n = numel(&self.mem.shape(id, 1)) as usize;
            self.mem.upload_f32(id, &vec![start as f32; n])?;
        }
        Ok(())
    }

    /// Parameters by name with their shapes and values (copied from the device).
    pub fn params(&self) -> Result<crate::backend::ParamValues, CudaError> {
        self.params
            .iter()
            .map(|(n, id)| {
                let shape: Vec<usize> =
                    self.mem.shape(*id, 1).iter().map(|&d| d as usize).collect();
                let v = self.mem.download_f32(*id, shape.iter().product())?;
                Ok((n.clone(), shape, v))
            })
            .collect()
    }

    /// Optimizer state by name with shapes and values (copied from the device).
    pub fn states(&self) -> Result<crate::backend::ParamValues, CudaError> {
        self.states
            .iter()
            .map(|(n, id)| {
                let (n, id) = (n.clone(), *id);
                let shape: Vec<usize> = self.mem.shape(id, 1).iter().map(|&d| d as usize).collect();
                let v = self.mem.download_f32(id, shape.iter().product())?;
                Ok((n, shape, v))
            })
            .collect()
    }

    /// Replaces a state's values (resuming from a checkpoint, loading running statistics).
    pub fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), CudaError> {
        let id = self.sized(&self.states, "state", name, values.len())?;
        self.mem.upload(id, values)
    }

    /// Replaces a parameter's values (for `--init` and comparisons).
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<(), CudaError> {
        let id = self.sized(&self.params, "parameter", name, values.len())?;
        self.mem.upload(id, values)
    }

    /// The buffer of `name` in `named` (the model's parameters or states: `kind`), checked
    /// to hold `len` values.
    fn sized(
        &self,
        named: &[(String, usize)],
        kind: &str,
        name: &str,
        len: usize,
    ) -> Result<usize, CudaError> {
        let id = named
            .iter()
            .find(|(n, _)| n == name)
            .map(|p| p.1)
            .ok_or_else(|| CudaError::Exec(format!("the model has no {kind} `{name}`")))?;
        let n = numel(&self.mem.shape(id, 1)) as usize;
        if n != len {
            return Err(CudaError::Exec(format!(
                "{kind} `{name}`: {len} values given, {n} expected"
            )));
        }
        Ok(id)
    }

    fn input_step(
        &self,
        name: &str,
        batch: usize,
        len: usize,
        dtype: DType,
    ) -> Result<usize, CudaError> {
        let id = *self
            .inputs
            .get(name)
            .ok_or_else(|| CudaError::Exec(format!("the plan has no input named `{name}`")))?;
        if batch > self.mem.max_batch {
            return Err(CudaError::Exec(format!(
                "the batch of {batch} is larger than the {} the executor was sized for",
                self.mem.max_batch
            )));
        }
        let st = &self.mem.plan.steps[id];
        let n = numel(&self.mem.shape(id, batch)) as usize;
        if st.ty.dtype != dtype || n != len {
            return Err(CudaError::Exec(format!(
                "input `{name}`: expected {n} values of {}, got {len} of {}",
                st.ty.dtype.name(),
                dtype.name()
            )));
        }
        Ok(id)
    }

    pub fn set_f32(&mut self, name: &str, batch: usize, v: &[f32]) -> Result<(), CudaError> {
        let id = self.input_step(name, batch, v.len(), DType::F32)?;
        self.mem.upload(id, v)
    }

    pub fn set_i32(&mut self, name: &str, batch: usize, v: &[i32]) -> Result<(), CudaError> {
        let id = self.input_step(name, batch, v.len(), DType::I32)?;
        self.mem.upload(id, v)
    }

    pub fn has_input(&self, name: &str) -> bool {
        self.inputs.contains_key(name)
    }

    /// A named output (`loss`, the model's outputs) after `run`, copied to the host.
    pub fn output(&self, name: &str, batch: usize) -> Result<Vec<f32>, CudaError> {
        let id = *self
            .outputs
            .get(name)
            .ok_or_else(|| CudaError::Exec(format!("no output named `{name}`")))?;
        if self.launch.last_mode != Some(Mode::Eval) && !self.mem.plan.kept_after_training(id) {
            return Err(CudaError::Exec(
                crate::exec::ExecError::OutputNotKept(name.to_string()).to_string(),
            ));
        }
        self.value(id, batch)
    }

    /// The shape of a named output at batch `batch`.
    pub fn output_shape(&self, name: &str, batch: usize) -> Option<Vec<usize>> {
        let id = *self.outputs.get(name)?;
        Some(
            self.mem
                .shape(id, batch)
                .iter()
                .map(|&d| d as usize)
                .collect(),
        )
    }

    /// A step's stored value at batch `batch`, copied to the host.
    pub fn value(&self, step: usize, batch: usize) -> Result<Vec<f32>, CudaError> {
        let n = numel(&self.mem.shape(step, batch)) as usize;
        self.mem.download_f32(step, n)
    }

    /// Overwrites a step's stored value (lockstep comparisons resynchronise from the oracle).
    pub fn overwrite(&self, step: usize, t: &crate::exec::tensor::Tensor) -> Result<(), CudaError> {
        if t.is_f32() {
            self.mem.upload_f32(step, t.f32())
        } else {
            self.mem.upload(step, t.i32())
        }
    }

    /// Whether a step's value is stored in bf16 (two bytes an element on the device).
    pub fn stored_in_bf16(&self, step: usize) -> bool {
        self.mem.plan.stored_in_bf16(step)
    }

    /// Device address of a step's buffer (collectives over gradients).
    pub fn device_ptr(&self, step: usize) -> Result<u64, CudaError> {
        self.mem.ptr(step)
    }

    /// Whether a step's value is stored in a buffer.
    pub fn stored(&self, step: usize) -> bool {
        self.mem.slot.get(step).copied().flatten().is_some()
    }

    /// cuBLASLt's (plans built, GEMM shapes it sent to cuBLAS, the heuristic's refusals),
    /// or `None` when every GEMM runs on cuBLAS (fp32, `PARALLAX_CUBLASLT=0`, or no
    /// libcublasLt).
    pub fn cublaslt_plans(&self) -> Option<(usize, usize, Vec<String>)> {
        self.launch.lt.as_ref().map(|lt| lt.counts())
    }

    /// Waits for the queued work; reports a kernel fault as an error.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.mem.stream.synchronize().map_err(Into::into)
    }
}
