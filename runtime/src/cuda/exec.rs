//! The CUDA executor: the plan's buffers in device memory (one allocation per plan buffer,
//! sized for the largest batch), its kernels as one PTX module per batch size, GEMMs through
//! cuBLAS, all on one stream. Parameters are initialised on the host with the CPU executor's
//! keyed generator, so both backends start from the same bits.

use super::{target_for, CudaError};
use crate::exec::Mode;
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use parallax_compiler::codegen::{self, Arg, Launch, Module};
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

/// Device memory freed on drop.
struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.bytes > 0 {
            // SAFETY: allocated by `malloc_sync`, freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

struct Loaded {
    code: Module,
    _module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

enum ArgValue {
    U64(u64),
    F32(f32),
}

pub struct CudaExecutor {
    plan: Arc<Plan>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: blas_sys::cublasHandle_t,
    /// bf16 and tf32 GEMMs with plans cached per shape; `None`: everything on `blas`.
    lt: Option<super::lt::Lt>,
    /// One allocation for every buffer of the plan (the memory plan's arena).
    _arena: DeviceBuffer,
    /// Each plan buffer's device address inside the arena.
    buffers: Vec<u64>,
    slot: Vec<Option<usize>>,
    scratch: DeviceBuffer,
    precision: Precision,
    max_batch: usize,
    seed: u64,
    target: &'static str,
    modules: HashMap<u64, Loaded>,
    inputs: HashMap<String, usize>,
    outputs: HashMap<String, usize>,
    params: Vec<(String, usize)>,
    /// Optimizer state by name.
    states: Vec<(String, usize)>,
    /// Steps that hold one constant, `(step, value)`, filled at the start of every step.
    fills: Vec<(usize, f32)>,
    /// Steps holding the `training` flag, filled by `begin` for its mode.
    training_flags: Vec<usize>,
    /// The batch of the inputs set last (the batch `run` must be called with).
    batch: usize,
}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { blas::destroy_handle(self.blas) };
    }
}

fn numel(shape: &[u64]) -> u64 {
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
                capacity[b] = capacity[b].max(numel(&shape(id)));
                first_step[b] = first_step[b].min(id);
            }
        }
        let predicted = plan.memory.peak_bytes;
        let alloc = |elems: u64, what: &str| -> Result<DeviceBuffer, CudaError> {
            let bytes = (elems.max(1) * 4) as usize;
            ctx.bind_to_thread()?;
            // SAFETY: a plain device allocation, freed by `DeviceBuffer`.
            match unsafe { result::malloc_sync(bytes) } {
                Ok(ptr) => Ok(DeviceBuffer { ptr, bytes }),
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
        let arena = alloc(total / 4, &what)?;
        let lt = match super::lt::selected(precision, std::env::var(super::lt::ENV).ok().as_deref())
        {
            Some(compute) => super::lt::Lt::new(compute, gpu.compute_capability.0)?,
            None => None,
        };
        let buffers: Vec<u64> = offsets.iter().map(|&o| arena.ptr + o).collect();
        // The scratch: the largest any batch size needs (its size is known from the
        // module at the largest batch).
        let code = codegen::generate(&plan, max_batch as u64, target)?;
        let scratch = alloc(code.scratch, "scratch")?;
        let names = plan.names();
        let inputs: HashMap<String, usize> = names.inputs.into_iter().collect();
        let outputs: HashMap<String, usize> = names.outputs.into_iter().collect();
        let (params, states) = (names.params, names.states);
        let fills = plan.fills();
        let training_flags = plan.training_flags();
        let mut e = CudaExecutor {
            plan: Arc::new(plan),
            ctx,
            stream,
            blas: handle,
            lt,
            _arena: arena,
            buffers,
            slot,
            scratch,
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

    fn ensure_module(&mut self, batch: usize) -> Result<(), CudaError> {
        if !self.modules.contains_key(&(batch as u64)) {
            let code = codegen::generate(&self.plan, batch as u64, self.target)?;
            self.load(code)?;
        }
        Ok(())
    }

    fn ptr(&self, step: usize) -> Result<u64, CudaError> {
        self.slot
            .get(step)
            .copied()
            .flatten()
            .map(|b| self.buffers[b])
            .ok_or_else(|| CudaError::Exec(format!("step {step} has no buffer")))
    }

    fn shape(&self, step: usize, batch: usize) -> Vec<u64> {
        self.plan
            .shape_at(&self.plan.steps[step].ty.shape, batch as u64)
    }

    fn upload<T>(&self, step: usize, v: &[T]) -> Result<(), CudaError> {
        let p = self.ptr(step)?;
        // SAFETY: the buffer holds at least the value's elements (checked by the callers),
        // and the copy completes before `v` is released (synchronised).
        unsafe { result::memcpy_htod_async(p, v, self.stream.cu_stream())? };
        self.stream.synchronize()?;
        Ok(())
    }

    fn download_f32(&self, step: usize, n: usize) -> Result<Vec<f32>, CudaError> {
        let p = self.ptr(step)?;
        let mut v = vec![0f32; n];
        self.stream.synchronize()?;
        // SAFETY: reads `n` elements of a buffer that holds at least that many.
        unsafe { result::memcpy_dtoh_async(&mut v, p, self.stream.cu_stream())? };
        self.stream.synchronize()?;
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
            self.upload(id, &v)?;
        }
        // Optimizer state starts at zero, BatchNorm's running variance at one.
        for &(_, id) in &self.states {
            let Op::State { start, .. } = self.plan.steps[id].op else {
                continue;
            };
            let n = numel(&self.shape(id, 1)) as usize;
            self.upload(id, &vec![start as f32; n])?;
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
            self.upload(step, t.f32())
        } else {
            self.upload(step, t.i32())
        }
    }

    /// Device address of a step's buffer (collectives over gradients).
    pub fn device_ptr(&self, step: usize) -> Result<u64, CudaError> {
        self.ptr(step)
    }

    /// Whether a step's value is stored in a buffer.
    pub fn stored(&self, step: usize) -> bool {
        self.slot.get(step).copied().flatten().is_some()
    }

    fn resolve(
        &self,
        a: &Arg,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<ArgValue, CudaError> {
        let training = mode != Mode::Eval;
        Ok(match *a {
            Arg::Value(s) => ArgValue::U64(self.ptr(s)?),
            Arg::Scratch => ArgValue::U64(self.scratch.ptr),
            Arg::DropoutKey { stream } => {
                ArgValue::U64(crate::rng::dropout_key(self.seed, step, stream))
            }
            Arg::DropoutThreshold { p } => ArgValue::F32(if training { p as f32 } else { 0.0 }),
            Arg::DropoutScale { p } => ArgValue::F32(if training {
                (1.0 / (1.0 - p)) as f32
            } else {
                1.0
            }),
            Arg::FirstSample => ArgValue::U64(first_sample),
            Arg::U64(v) => ArgValue::U64(v),
            Arg::F32(v) => ArgValue::F32(v),
        })
    }

    fn launch_entry(
        &self,
        batch: usize,
        entry: &str,
        grid: u32,
        block: u32,
        values: &[ArgValue],
    ) -> Result<(), CudaError> {
        let f = self.modules[&(batch as u64)]
            .functions
            .get(entry)
            .ok_or_else(|| CudaError::Exec(format!("no kernel `{entry}` in the module")))?;
        let mut b = self.stream.launch_builder(f);
        for v in values {
            match v {
                ArgValue::U64(x) => b.arg(x),
                ArgValue::F32(x) => b.arg(x),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the entry's parameters (both come from one `Kernel`
        // of the code generator), and every pointer addresses a live buffer of the size the
        // kernel was generated for.
        unsafe { b.launch(cfg) }.map_err(|e| CudaError::PtxLoad {
            kernel: entry.to_string(),
            message: format!("launch failed: {e:?}"),
        })?;
        Ok(())
    }

    fn run_launch(
        &self,
        batch: usize,
        l: &Launch,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), CudaError> {
        match l {
            Launch::Kernel {
                entry,
                grid,
                block,
                args,
            } => {
                let values = args
                    .iter()
                    .map(|a| self.resolve(a, mode, step, first_sample))
                    .collect::<Result<Vec<_>, _>>()?;
                self.launch_entry(batch, entry, *grid, *block, &values)
            }
            Launch::Copy { src, dst, elements } => {
                let ptr = |x: &Arg| match self.resolve(x, mode, step, first_sample)? {
                    ArgValue::U64(p) => Ok(p),
                    ArgValue::F32(_) => {
                        Err(CudaError::Exec("a copy operand is not a buffer".into()))
                    }
                };
                let (s, d) = (ptr(src)?, ptr(dst)?);
                if s != d && *elements > 0 {
                    // SAFETY: both buffers hold `elements` values of 4 bytes.
                    unsafe {
                        result::memcpy_dtod_async(
                            d,
                            s,
                            *elements as usize * 4,
                            self.stream.cu_stream(),
                        )?
                    };
                }
                Ok(())
            }
            Launch::Gemm {
                a,
                b,
                c,
                m,
                n,
                k,
                batch: count,
                trans_a,
                trans_b,
                stride_a,
                stride_b,
                stride_c,
            } => {
                let ptr = |x: &Arg| match self.resolve(x, mode, step, first_sample)? {
                    ArgValue::U64(p) => Ok(p),
                    ArgValue::F32(_) => {
                        Err(CudaError::Exec("a GEMM operand is not a buffer".into()))
                    }
                };
                let (pa, pb, pc) = (ptr(a)?, ptr(b)?, ptr(c)?);
                let g = super::gemm::Gemm {
                    pa,
                    pb,
                    pc,
                    m: *m,
                    n: *n,
                    k: *k,
                    count: *count,
                    trans_a: *trans_a,
                    trans_b: *trans_b,
                    stride_a: *stride_a,
                    stride_b: *stride_b,
                    stride_c: *stride_c,
                };
                if let Some(lt) = &self.lt {
                    if lt.gemm(&g, self.stream.cu_stream())? {
                        return Ok(());
                    }
                }
                super::gemm::gemm(self.blas, self.precision, &g)
            }
        }
    }

    /// Fills the constants of the plan for `batch`, and its `training` flag for `mode`
    /// (before the kernels).
    pub fn begin(&mut self, batch: usize, mode: Mode) -> Result<(), CudaError> {
        if batch > self.max_batch {
            return Err(CudaError::Exec(format!(
                "the batch of {batch} is larger than the {} the executor was sized for",
                self.max_batch
            )));
        }
        self.ensure_module(batch)?;
        self.batch = batch;
        let training = f32::from(u8::from(mode != Mode::Eval));
        let flags = self.training_flags.iter().map(|&s| (s, training));
        for (step, value) in self.fills.iter().copied().chain(flags) {
            let n = numel(&self.shape(step, batch));
            let values = [
                ArgValue::U64(self.ptr(step)?),
                ArgValue::U64(n),
                ArgValue::F32(value),
            ];
            self.launch_entry(
                batch,
                codegen::FILL,
                codegen::grid_for(n, codegen::BLOCK),
                codegen::BLOCK,
                &values,
            )?;
        }
        Ok(())
    }

    /// Runs kernel `k` of the plan (after `begin`).
    pub fn run_kernel(
        &self,
        k: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), CudaError> {
        let batch = self.batch;
        let code = &self.modules[&(batch as u64)].code.kernels[k];
        for l in &code.launches {
            self.run_launch(batch, l, mode, step, first_sample)?;
        }
        Ok(())
    }

    /// Runs one training step with a CUDA event around every launch and returns the time of
    /// each launch, labelled by what it computes (for `gpu-check --profile`).
    pub fn profile_step(
        &mut self,
        batch: usize,
        step: u64,
    ) -> Result<Vec<(String, f64)>, CudaError> {
        self.begin(batch, Mode::Train)?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut labels = Vec::new();
        let first = self.ctx.new_event(flags)?;
        first.record(&self.stream)?;
        let mut events = vec![first];
        for k in 0..self.plan.kernels.len() {
            let code = self.modules[&(batch as u64)].code.kernels[k].clone();
            for l in &code.launches {
                self.run_launch(batch, l, Mode::Train, step, 0)?;
                let e = self.ctx.new_event(flags)?;
                e.record(&self.stream)?;
                let label = match l {
                    Launch::Gemm { .. } => format!("gemm ({:?})", self.precision),
                    Launch::Kernel { .. } | Launch::Copy { .. } => code.ops.join("+"),
                };
                labels.push(label);
                events.push(e);
            }
        }
        self.finish(Mode::Train)?;
        self.stream.synchronize()?;
        labels
            .into_iter()
            .zip(events.windows(2))
            .map(|(label, w)| Ok((label, w[0].elapsed_ms(&w[1])? as f64)))
            .collect()
    }

    /// Copies the updated parameters and state over the old (the end of a training step).
    pub fn finish(&mut self, mode: Mode) -> Result<(), CudaError> {
        if mode == Mode::Train {
            for &(p, u) in self.plan.updates.iter() {
                // Written in place (see the schedule pass).
                if self.plan.steps[p].buffer == self.plan.steps[u].buffer {
                    continue;
                }
                let n = numel(&self.shape(p, self.batch));
                let values = [
                    ArgValue::U64(self.ptr(p)?),
                    ArgValue::U64(self.ptr(u)?),
                    ArgValue::U64(n),
                ];
                self.launch_entry(
                    self.batch,
                    codegen::COPY,
                    codegen::grid_for(n, codegen::BLOCK),
                    codegen::BLOCK,
                    &values,
                )?;
            }
        }
        Ok(())
    }

    /// Runs one step on a batch of `batch` samples (inputs set before), as the CPU executor.
    pub fn run(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), CudaError> {
        self.begin(batch, mode)?;
        for k in 0..self.plan.kernels.len() {
            if mode.runs(&self.plan, k) {
                self.run_kernel(k, mode, step, first_sample)?;
            }
        }
        self.finish(mode)
    }

    /// cuBLASLt's (plans built, GEMM shapes it sent to cuBLAS), or `None` when every GEMM
    /// runs on cuBLAS (fp32, `PARALLAX_CUBLASLT=0`, or no libcublasLt).
    pub fn cublaslt_plans(&self) -> Option<(usize, usize)> {
        self.lt.as_ref().map(|lt| lt.counts())
    }

    /// Waits for the queued work; reports a kernel fault as an error.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(Into::into)
    }
}

/// `matmul in layer fc1` for messages.
fn describe(op: &Op, layer: &str) -> String {
    match op {
        Op::Param { name, .. } | Op::Input { name, .. } | Op::State { name, .. } => name.clone(),
        _ => format!("{} in layer `{layer}`", op.name()),
    }
}
