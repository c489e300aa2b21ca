//! The CUDA executor: the plan's buffers in device memory (one allocation per plan buffer,
//! sized for the largest batch), its kernels as one PTX module per batch size, GEMMs through
//! cuBLAS, all on one stream. Parameters are initialised on the host with the CPU executor's
//! keyed generator, so both backends start from the same bits.

use super::{target_for, CudaError};
use crate::exec::Mode;
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use parallax_compiler::codegen::{self, Module};
use parallax_compiler::ir::{DType, Op};
use parallax_compiler::Plan;
use std::collections::HashMap;
use std::sync::Arc;

/// How GEMMs compute: exact fp32, TF32 tensor cores, or bf16 tensor-core products with fp32
/// accumulation and output. Storage, master weights, the optimizer and every other kernel stay fp32
/// (bf16 keeps fp32's exponent range, so no loss scaling is needed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    Fp32,
    Tf32,
    Bf16,
}

impl Precision {
    /// As `--precision` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// Device memory freed on drop. It keeps its context alive and current for the free: an
/// arena lent to another executor (`stepwise`) can outlive the executor that allocated it.
pub(super) struct DeviceBuffer {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) bytes: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: allocated by `malloc_sync`, freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// The address a lent buffer's slot holds (`stepwise`): never a real allocation.
pub(super) const LENT: u64 = 0;

pub(super) struct Loaded {
    pub(super) code: Module,
    _module: Arc<CudaModule>,
    pub(super) functions: HashMap<String, CudaFunction>,
}

pub(super) use crate::exec::launch_args::ArgValue;

pub struct CudaExecutor {
    pub(super) plan: Arc<Plan>,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: blas_sys::cublasHandle_t,
    /// bf16 and tf32 GEMMs with plans cached per shape; `None`: everything on `blas`.
    pub(super) lt: Option<super::lt::Lt>,
    /// One allocation for every buffer of the plan (the memory plan's arena).
    pub(super) _arena: Arc<DeviceBuffer>,
    /// Each plan buffer's device address: inside the arena, inside the arena of the executor
    /// that lent this one its parameters and state, or `LENT` while lent out.
    pub(super) buffers: Vec<u64>,
    /// Each plan buffer's size in elements (at the largest batch).
    pub(super) capacity: Vec<u64>,
    /// The arena of the parameters and state installed here (`stepwise`), kept alive while
    /// this executor addresses it.
    pub(super) persistent_home: Arc<DeviceBuffer>,
    /// The steps whose values a rank may read and write here (all, unless restricted to a
    /// pipeline stage's kernels by `hold_only`).
    pub(super) held: Vec<bool>,
    /// A loan `put_persistent` refused, for the lender to take back.
    pub(super) refused: Option<super::stepwise::Loan>,
    pub(super) slot: Vec<Option<usize>>,
    pub(super) scratch: DeviceBuffer,
    /// Where bf16 GEMMs take their f32 operands rounded to bf16 (`codegen::Arg::Staging`).
    pub(super) staging: DeviceBuffer,
    pub(super) precision: Precision,
    pub(super) max_batch: usize,
    pub(super) seed: u64,
    pub(super) target: &'static str,
    pub(super) modules: HashMap<u64, Loaded>,
    pub(super) inputs: HashMap<String, usize>,
    pub(super) outputs: HashMap<String, usize>,
    pub(super) params: Vec<(String, usize)>,
    /// Optimizer state by name.
    pub(super) states: Vec<(String, usize)>,
    /// Steps that hold one constant, `(step, value)`, filled at the start of every step.
    pub(super) fills: Vec<(usize, f32)>,
    /// Steps holding the `training` flag, filled by `begin` for its mode.
    pub(super) training_flags: Vec<usize>,
    /// The batch of the inputs set last (the batch `run` must be called with).
    pub(super) batch: usize,
    /// The mode of the last step begun (`None` before the first): an output a training
    /// step writes over is read after an eval step only (`Plan::kept_after_training`).
    pub(super) last_mode: Option<Mode>,
    /// The step captured as a CUDA graph (`PARALLAX_CUDA_GRAPH=1`).
    pub(super) graphs: super::graph::Graphs,
}

// SAFETY: an executor is used by one thread at a time (`&mut self`), and a rank's thread
// binds the executor's context before its first call (`RankExecutor::begin_step`). Its raw
// handles may move between threads: cuBLAS and cuBLASLt functions "can be called from
// multiple host threads, even with the same handle" (cuBLAS guide, Thread Safety), and the
// driver's objects (context, stream, module) are cudarc's, which are Send.
unsafe impl Send for CudaExecutor {}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { blas::destroy_handle(self.blas) };
    }
}

pub(super) fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
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
        let handle = blas::create_handle().map_err(|e| CudaError::Blas(format!("{e:?}")))?;
        // SAFETY: a fresh handle and the context's stream.
        unsafe {
            blas::set_stream(handle, stream.cu_stream() as _)
                .map_err(|e| CudaError::Blas(format!("{e:?}")))?;
            let mode = match precision {
                Precision::Fp32 => blas_sys::cublasMath_t::CUBLAS_PEDANTIC_MATH,
                // Tensor cores for the bf16 operands (accumulation stays fp32).
                Precision::Bf16 => blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
                Precision::Tf32 => blas_sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
            };
            blas_sys::cublasSetMathMode(handle, mode)
                .result()
                .map_err(|e| CudaError::Blas(format!("{e:?}")))?;
        }
        let max_batch = max_batch.max(1);
        let shape = |id: usize| plan.shape_at(&plan.steps[id].ty.shape, max_batch as u64);
        let mut capacity = vec![0u64; plan.buffers.len()];
        let slot: Vec<Option<usize>> = plan.steps.iter().map(|s| s.buffer).collect();
        let mut first_step = vec![usize::MAX; plan.buffers.len()];
        for (id, b) in slot.iter().enumerate() {
            if let Some(b) = *b {
                // In 4-byte units: a bf16 buffer takes half its elements' (rounded up).
                let n = numel(&shape(id)) * plan.buffers[b].dtype.bytes();
                capacity[b] = capacity[b].max(n.div_ceil(4));
                first_step[b] = first_step[b].min(id);
            }
        }
        let predicted = plan.memory.peak_bytes;
        let alloc = |elems: u64, what: &str| -> Result<DeviceBuffer, CudaError> {
            let bytes = (elems.max(1) * 4) as usize;
            ctx.bind_to_thread()?;
            // SAFETY: a plain device allocation, freed by `DeviceBuffer`.
            match unsafe { result::malloc_sync(bytes) } {
                Ok(ptr) => Ok(DeviceBuffer {
                    ptr,
                    bytes,
                    ctx: ctx.clone(),
                }),
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                    let free = result::mem_get_info().map(|m| m.0 as u64).unwrap_or(0);
                    Err(CudaError::OutOfMemory {
                        tensor: what.to_string(),
                        bytes: bytes as u64,
                        predicted,
                        free,
                    })
                }
                Err(e) => Err(e.into()),
            }
        };
        // The arena: every buffer at a 256-byte aligned offset.
        let mut offsets = Vec::with_capacity(capacity.len());
        let mut total = 0u64;
        for &c in &capacity {
            offsets.push(total);
            total += (c.max(1) * 4).div_ceil(256) * 256;
        }
        let largest = (0..capacity.len()).max_by_key(|&b| capacity[b]);
        let what = largest.map_or_else(
            || "the plan's buffers".to_string(),
            |b| {
                let name = plan
                    .steps
                    .get(first_step[b])
                    .map_or_else(|| format!("buffer {b}"), |s| describe(&s.op, &s.layer));
                format!(
                    "the plan's {} buffers (largest: `{name}`, {} bytes)",
                    capacity.len(),
                    capacity[b] * 4
                )
            },
        );
        // The scratch: the largest any batch size needs (its size is known from the
        // module at the largest batch).
        let code =
            codegen::generate_with(&plan, max_batch as u64, target, &codegen_options(precision))?;
        // Refused before allocating anything: a plan past the device's free memory fails
        // here, naming both, rather than at whichever allocation runs out.
        let needed = total + (code.scratch.max(1) + code.staging.div_ceil(2).max(1)) * 4;
        ctx.bind_to_thread()?;
        let (free, device) = result::mem_get_info()?;
        if needed > free as u64 {
            return Err(CudaError::PlanTooLarge {
                gpu: ordinal,
                needed,
                what,
                free: free as u64,
                total: device as u64,
            });
        }
        let arena = Arc::new(alloc(total / 4, &what)?);
        let lt = match super::lt::selected(precision, std::env::var(super::lt::ENV).ok().as_deref())
        {
            Some(compute) => super::lt::Lt::new(compute, gpu.compute_capability.0)?,
            None => None,
        };
        let buffers: Vec<u64> = offsets.iter().map(|&o| arena.ptr + o).collect();
        let scratch = alloc(code.scratch, "scratch")?;
        let staging = alloc(code.staging.div_ceil(2), "the bf16 GEMM operands' staging")?;
        let names = plan.names();
        let inputs: HashMap<String, usize> = names.inputs.into_iter().collect();
        let outputs: HashMap<String, usize> = names.outputs.into_iter().collect();
        let (params, states) = (names.params, names.states);
        let fills = plan.fills();
        let training_flags = plan.training_flags();
        let held = plan.steps_touched(None);
        let mut e = CudaExecutor {
            plan: Arc::new(plan),
            ctx,
            stream,
            blas: handle,
            lt,
            persistent_home: arena.clone(),
            _arena: arena,
            buffers,
            capacity,
            held,
            refused: None,
            slot,
            scratch,
            staging,
            precision,
            max_batch,
            seed,
            target,
            modules: HashMap::new(),
            inputs,
            outputs,
            fills,
            training_flags,
            params,
            states,
            batch: max_batch,
            last_mode: None,
            graphs: super::graph::Graphs::from_env(),
        };
        e.load(code)?;
        e.init_params()?;
        Ok(e)
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn target(&self) -> &'static str {
        self.target
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Loads a module; on failure, finds the kernel the driver rejects.
    fn load(&mut self, code: Module) -> Result<(), CudaError> {
        let text = code.text();
        let module = match self.ctx.load_module(cudarc::nvrtc::Ptx::from_src(text)) {
            Ok(m) => m,
            Err(e) => {
                for (name, _) in &code.entries {
                    let one = code.entry_text(name).unwrap_or_default();
                    if let Err(e) = self.ctx.load_module(cudarc::nvrtc::Ptx::from_src(one)) {
                        return Err(CudaError::PtxLoad {
                            kernel: name.clone(),
                            message: format!("{e:?}"),
                        });
                    }
                }
                return Err(CudaError::PtxLoad {
                    kernel: "(the whole module)".into(),
                    message: format!("{e:?}"),
                });
            }
        };
        let mut functions = HashMap::new();
        for (name, _) in &code.entries {
            let f = module.load_function(name).map_err(|e| CudaError::PtxLoad {
                kernel: name.clone(),
                message: format!("{e:?}"),
            })?;
            functions.insert(name.clone(), f);
        }
        super::launch::prepare_dynamic_shared(&self.ctx, &code, &functions)?;
        self.modules.insert(
            code.batch,
            Loaded {
                code,
                _module: module,
                functions,
            },
        );
        Ok(())
    }

    pub(super) fn ensure_module(&mut self, batch: usize) -> Result<(), CudaError> {
        if !self.modules.contains_key(&(batch as u64)) {
            let options = codegen_options(self.precision);
            let code = codegen::generate_with(&self.plan, batch as u64, self.target, &options)?;
            self.load(code)?;
        }
        Ok(())
    }

    pub(super) fn ptr(&self, step: usize) -> Result<u64, CudaError> {
        let b = self.slot.get(step).copied().flatten();
        match b.map(|b| self.buffers[b]) {
            None => Err(CudaError::Exec(format!("step {step} has no buffer"))),
            // Never hand a kernel a null address: it would fault, not fail.
            Some(LENT) => Err(CudaError::Exec(format!(
                "step {step}'s buffer (a parameter or optimizer state) is lent to another executor of this rank"
            ))),
            Some(p) => Ok(p),
        }
    }

    pub(super) fn shape(&self, step: usize, batch: usize) -> Vec<u64> {
        self.plan
            .shape_at(&self.plan.steps[step].ty.shape, batch as u64)
    }

    pub(super) fn upload<T>(&self, step: usize, v: &[T]) -> Result<(), CudaError> {
        let p = self.ptr(step)?;
        // SAFETY: the buffer holds at least the value's elements (checked by the callers),
        // and the copy completes before `v` is released (synchronised).
        unsafe { result::memcpy_htod_async(p, v, self.stream.cu_stream())? };
        self.stream.synchronize()?;
        Ok(())
    }

    /// Uploads f32 values, rounded to bf16 when the step is stored so.
    pub(super) fn upload_f32(&self, step: usize, v: &[f32]) -> Result<(), CudaError> {
        if self.plan.stored_in_bf16(step) {
            let bits: Vec<u16> = v.iter().map(|&x| bf16_bits(x)).collect();
            return self.upload(step, &bits);
        }
        self.upload(step, v)
    }

    /// A step's first `n` values as f32 (widened exactly from bf16 when stored so).
    pub(super) fn download_f32(&self, step: usize, n: usize) -> Result<Vec<f32>, CudaError> {
        let p = self.ptr(step)?;
        self.stream.synchronize()?;
        let v = if self.plan.stored_in_bf16(step) {
            let mut bits = vec![0u16; n];
            // SAFETY: reads `n` bf16 elements of a buffer that holds at least that many.
            unsafe { result::memcpy_dtoh_async(&mut bits, p, self.stream.cu_stream())? };
            self.stream.synchronize()?;
            bits.iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16))
                .collect()
        } else {
            let mut v = vec![0f32; n];
            // SAFETY: reads `n` elements of a buffer that holds at least that many.
            unsafe { result::memcpy_dtoh_async(&mut v, p, self.stream.cu_stream())? };
            self.stream.synchronize()?;
            v
        };
        Ok(v)
    }

    fn init_params(&mut self) -> Result<(), CudaError> {
        for index in 0..self.params.len() {
            let id = self.params[index].1;
            let Op::Param { init, .. } = &self.plan.steps[id].op else {
                continue;
            };
            let mut v = vec![0f32; numel(&self.shape(id, 1)) as usize];
            crate::rng::init_param(init, self.seed, index, &mut v);
            self.upload_f32(id, &v)?;
        }
        // Optimizer state starts at zero, BatchNorm's running variance at one.
        for &(_, id) in &self.states {
            let Op::State { start, .. } = self.plan.steps[id].op else {
                continue;
            };
            let n = numel(&self.shape(id, 1)) as usize;
            self.upload_f32(id, &vec![start as f32; n])?;
        }
        Ok(())
    }

    /// Parameters by name with their shapes and values (copied from the device).
    pub fn params(&self) -> Result<crate::backend::ParamValues, CudaError> {
        self.params
            .iter()
            .map(|(n, id)| {
                let shape: Vec<usize> = self.shape(*id, 1).iter().map(|&d| d as usize).collect();
                let v = self.download_f32(*id, shape.iter().product())?;
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
                let shape: Vec<usize> = self.shape(id, 1).iter().map(|&d| d as usize).collect();
                let v = self.download_f32(id, shape.iter().product())?;
                Ok((n, shape, v))
            })
            .collect()
    }

    /// Replaces a state's values (resuming from a checkpoint, loading running statistics).
    pub fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), CudaError> {
        let id = self
            .states
            .iter()
            .find(|(n, _)| n == name)
            .map(|s| s.1)
            .ok_or_else(|| CudaError::Exec(format!("the model has no state `{name}`")))?;
        if numel(&self.shape(id, 1)) as usize != values.len() {
            return Err(CudaError::Exec(format!(
                "state `{name}`: {} values given",
                values.len()
            )));
        }
        self.upload(id, values)
    }

    /// Replaces a parameter's values (for `--init` and comparisons).
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<(), CudaError> {
        let id = self
            .params
            .iter()
            .find(|(n, _)| n == name)
            .map(|p| p.1)
            .ok_or_else(|| CudaError::Exec(format!("the model has no parameter `{name}`")))?;
        let n = numel(&self.shape(id, 1)) as usize;
        if n != values.len() {
            return Err(CudaError::Exec(format!(
                "parameter `{name}`: {} values given, {n} expected",
                values.len()
            )));
        }
        self.upload(id, values)
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
        if batch > self.max_batch {
            return Err(CudaError::Exec(format!(
                "the batch of {batch} is larger than the {} the executor was sized for",
                self.max_batch
            )));
        }
        let st = &self.plan.steps[id];
        let n = numel(&self.shape(id, batch)) as usize;
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
        self.upload(id, v)
    }

    pub fn set_i32(&mut self, name: &str, batch: usize, v: &[i32]) -> Result<(), CudaError> {
        let id = self.input_step(name, batch, v.len(), DType::I32)?;
        self.upload(id, v)
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
        if self.last_mode != Some(Mode::Eval) && !self.plan.kept_after_training(id) {
            return Err(CudaError::Exec(
                crate::exec::ExecError::OutputNotKept(name.to_string()).to_string(),
            ));
        }
        self.value(id, batch)
    }

    /// The shape of a named output at batch `batch`.
    pub fn output_shape(&self, name: &str, batch: usize) -> Option<Vec<usize>> {
        let id = *self.outputs.get(name)?;
        Some(self.shape(id, batch).iter().map(|&d| d as usize).collect())
    }

    /// A step's stored value at batch `batch`, copied to the host.
    pub fn value(&self, step: usize, batch: usize) -> Result<Vec<f32>, CudaError> {
        let n = numel(&self.shape(step, batch)) as usize;
        self.download_f32(step, n)
    }

    /// Overwrites a step's stored value (lockstep comparisons resynchronise from the oracle).
    pub fn overwrite(&self, step: usize, t: &crate::exec::tensor::Tensor) -> Result<(), CudaError> {
        if t.is_f32() {
            self.upload_f32(step, t.f32())
        } else {
            self.upload(step, t.i32())
        }
    }

    /// Whether a step's value is stored in bf16 (two bytes an element on the device).
    pub fn stored_in_bf16(&self, step: usize) -> bool {
        self.plan.stored_in_bf16(step)
    }

    /// Device address of a step's buffer (collectives over gradients).
    pub fn device_ptr(&self, step: usize) -> Result<u64, CudaError> {
        self.ptr(step)
    }

    /// Whether a step's value is stored in a buffer.
    pub fn stored(&self, step: usize) -> bool {
        self.slot.get(step).copied().flatten().is_some()
    }

    /// cuBLASLt's (plans built, GEMM shapes it sent to cuBLAS, the heuristic's refusals),
    /// or `None` when every GEMM runs on cuBLAS (fp32, `PARALLAX_CUBLASLT=0`, or no
    /// libcublasLt).
    pub fn cublaslt_plans(&self) -> Option<(usize, usize, Vec<String>)> {
        self.lt.as_ref().map(|lt| lt.counts())
    }

    /// Waits for the queued work; reports a kernel fault as an error.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(Into::into)
    }
}

/// `matmul in layer fc1` for messages.
pub(super) fn describe(op: &Op, layer: &str) -> String {
    match op {
        Op::Param { name, .. } | Op::Input { name, .. } | Op::State { name, .. } => name.clone(),
        _ => format!("{} in layer `{layer}`", op.name()),
    }
}

/// What codegen is asked for at a precision: bf16 plans take the tensor-core attention
/// forward (its operands rounded to bf16, as their matmuls' are). `compile --emit ptx` asks
/// the same, so it writes the kernels `train` runs.
pub fn codegen_options(precision: Precision) -> codegen::CodegenOptions {
    codegen::CodegenOptions {
        bf16_attention: precision == Precision::Bf16,
    }
}

/// The bits of `x` rounded to the nearest bf16 (ties to even), as the kernels store it.
pub(super) fn bf16_bits(x: f32) -> u16 {
    (parallax_compiler::scalar::math::round_bf16(x).to_bits() >> 16) as u16
}
