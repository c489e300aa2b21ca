//! A step on the GPU: the plan's modules (`module`, one per batch size), and each kernel's
//! launches (generated PTX entries, device copies, GEMMs through cuBLAS or cuBLASLt) with
//! their arguments resolved to the addresses of the executor's memory (`memory`) and step
//! constants, queued on its stream; the step's constants before them (`begin`) and its
//! parameter copies after (`finish`).

use super::gemm::{self, Precision};
use super::memory::{numel, Memory};
use super::module::{self, codegen_options, Loaded};
use super::CudaError;
use crate::exec::launch_args::{self, ArgValue, LaunchCtx};
use crate::exec::Mode;
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result, sys, CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use parallax_compiler::codegen::{self, Arg, Launch, Module};
use parallax_compiler::Plan;
use std::collections::HashMap;
use std::sync::Arc;

/// What launches the plan's kernels: the loaded modules, the GEMM libraries' handles, and
/// the step under way (its batch and mode).
pub(super) struct Launcher {
    /// Where launches go: the executor's stream, or a graph's while it is captured.
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: blas_sys::cublasHandle_t,
    /// bf16 and tf32 GEMMs with plans cached per shape; `None`: everything on `blas`.
    pub(super) lt: Option<super::lt::Lt>,
    pub(super) precision: Precision,
    pub(super) seed: u64,
    pub(super) target: &'static str,
    modules: HashMap<u64, Loaded>,
    /// Steps that hold one constant, `(step, value)`, filled at the start of every step.
    fills: Vec<(usize, f32)>,
    /// Steps holding the `training` flag, filled by `begin` for its mode.
    training_flags: Vec<usize>,
    /// The batch of the inputs set last (the batch `run` must be called with).
    pub(super) batch: usize,
    /// The mode of the last step begun (`None` before the first): an output a training
    /// step writes over is read after an eval step only (`Plan::kept_after_training`).
    pub(super) last_mode: Option<Mode>,
}

/// A cuBLAS handle on `stream` computing at `precision`.
pub(super) fn blas_handle(
    stream: &CudaStream,
    precision: Precision,
) -> Result<blas_sys::cublasHandle_t, CudaError> {
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
    Ok(handle)
}

/// What a launch did: a GEMM that added its bias (`Launch::Gemm::bias`) makes the launch
/// after it, which would add it again, unneeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ran {
    Done,
    BiasAdded,
}

impl Launcher {
    /// A launcher for `plan` on `stream`, with its cuBLAS handle (cuBLASLt's is set after),
    /// before any module is loaded.
    pub(super) fn new(
        plan: &Plan,
        stream: Arc<CudaStream>,
        blas: blas_sys::cublasHandle_t,
        precision: Precision,
        seed: u64,
        target: &'static str,
        batch: usize,
    ) -> Launcher {
        Launcher {
            stream,
            blas,
            lt: None,
            precision,
            seed,
            target,
            modules: HashMap::new(),
            fills: plan.fills(),
            training_flags: plan.training_flags(),
            batch,
            last_mode: None,
        }
    }

    /// Loads the module of `code`'s batch size.
    pub(super) fn load(&mut self, ctx: &Arc<CudaContext>, code: Module) -> Result<(), CudaError> {
        let loaded = module::load(ctx, code)?;
        self.modules.insert(loaded.code.batch, loaded);
        Ok(())
    }

    fn ensure_module(&mut self, mem: &Memory, batch: usize) -> Result<(), CudaError> {
        if !self.modules.contains_key(&(batch as u64)) {
            let options = codegen_options(self.precision);
            let code = codegen::generate_with(&mem.plan, batch as u64, self.target, &options)?;
            self.load(&mem.ctx, code)?;
        }
        Ok(())
    }

    /// The module of batch `batch`, if loaded.
    pub(super) fn module(&self, batch: usize) -> Option<&Module> {
        self.modules.get(&(batch as u64)).map(|m| &m.code)
    }

    /// The device address of a buffer argument (`launch_args::resolve`'s `address`).
    fn address(mem: &Memory, a: &Arg) -> Result<u64, String> {
        match *a {
            Arg::Value(s) => mem.ptr(s).map_err(|e| e.to_string()),
            Arg::Scratch => Ok(mem.scratch.ptr),
            Arg::Staging { at } => Ok(mem.staging.ptr + 2 * at),
            _ => Err("not a buffer argument".into()),
        }
    }

    fn launch_ctx(&self, mode: Mode, step: u64, first_sample: u64) -> LaunchCtx {
        LaunchCtx {
            seed: self.seed,
            mode,
            step,
            first_sample,
        }
    }

    fn resolve(
        &self,
        mem: &Memory,
        a: &Arg,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<ArgValue, CudaError> {
        let ctx = self.launch_ctx(mode, step, first_sample);
        launch_args::resolve(a, &ctx, &|x| Self::address(mem, x)).map_err(CudaError::Exec)
    }

    /// A kernel's arguments resolved, each table's words gathered into one value.
    fn resolve_all(
        &self,
        mem: &Memory,
        args: &[Arg],
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<Vec<ArgValue>, CudaError> {
        let ctx = self.launch_ctx(mode, step, first_sample);
        launch_args::resolve_all(args, &ctx, &|x| Self::address(mem, x)).map_err(CudaError::Exec)
    }

    fn launch_entry(
        &self,
        batch: usize,
        entry: &str,
        grid: u32,
        block: u32,
        shared: u32,
        values: &[ArgValue],
    ) -> Result<(), CudaError> {
        let f = self.modules[&(batch as u64)]
            .functions
            .get(entry)
            .ok_or_else(|| CudaError::Exec(format!("no kernel `{entry}` in the module")))?;
        let mut b = self.stream.launch_builder(f);
        let values = match values.split_first() {
            Some((_, rest)) if super::plant::planted(super::plant::Bug::DropLaunchParam) => rest,
            _ => values,
        };
        for v in values {
            match v {
                ArgValue::U64(x) => b.arg(x),
                ArgValue::F32(x) => b.arg(x),
                // The driver copies the parameter's size (the whole table) from the address
                // of its first word; `values` outlives the launch.
                ArgValue::Table(t) => b.arg(&t[0]),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared,
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
        mem: &Memory,
        batch: usize,
        l: &Launch,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<Ran, CudaError> {
        // A copy's or a GEMM's operand: the device address of its buffer.
        let buffer = |x: &Arg, what: &str| match self.resolve(mem, x, mode, step, first_sample)? {
            ArgValue::U64(p) => Ok(p),
            _ => Err(CudaError::Exec(format!("a {what} operand is not a buffer"))),
        };
        match l {
            Launch::Kernel {
                entry,
                grid,
                block,
                args,
                shared,
            } => {
                let values = self.resolve_all(mem, args, mode, step, first_sample)?;
                self.launch_entry(batch, entry, *grid, *block, *shared, &values)?;
                Ok(Ran::Done)
            }
            Launch::Copy {
                src,
                dst,
                elements,
                bf16,
            } => {
                let ptr = |x: &Arg| buffer(x, "copy");
                let (s, d) = (ptr(src)?, ptr(dst)?);
                if s != d && *elements > 0 {
                    let bytes = if *bf16 { 2 } else { 4 };
                    // SAFETY: both buffers hold `elements` values of `bytes` bytes.
                    unsafe {
                        result::memcpy_dtod_async(
                            d,
                            s,
                            *elements as usize * bytes,
                            self.stream.cu_stream(),
                        )?
                    };
                }
                Ok(Ran::Done)
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
                bf16,
                bias,
            } => {
                let ptr = |x: &Arg| buffer(x, "GEMM");
                let (pa, pb, pc) = (ptr(a)?, ptr(b)?, ptr(c)?);
                let g = gemm::Gemm {
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
                    bf16: *bf16,
                };
                if let Some(lt) = &self.lt {
                    if let Some(b) = bias {
                        let [a16, b16, _] = g.bf16;
                        let with_bias = gemm::Gemm {
                            pc: ptr(&b.out)?,
                            bf16: [a16, b16, b.out_bf16],
                            ..g
                        };
                        if lt.gemm_bias(&with_bias, ptr(&b.vector)?, self.stream.cu_stream())? {
                            return Ok(Ran::BiasAdded);
                        }
                    }
                    if lt.gemm(&g, self.stream.cu_stream())? {
                        return Ok(Ran::Done);
                    }
                }
                gemm::gemm(self.blas, self.precision, &g)?;
                Ok(Ran::Done)
            }
        }
    }

    /// Fills the constants of the plan for `batch`, and its `training` flag for `mode`
    /// (before the kernels).
    pub(super) fn begin(
        &mut self,
        mem: &Memory,
        batch: usize,
        mode: Mode,
    ) -> Result<(), CudaError> {
        if batch > mem.max_batch {
            return Err(CudaError::Exec(format!(
                "the batch of {batch} is larger than the {} the executor was sized for",
                mem.max_batch
            )));
        }
        self.ensure_module(mem, batch)?;
        self.batch = batch;
        self.last_mode = Some(mode);
        let training = f32::from(u8::from(mode != Mode::Eval));
        let flags = self.training_flags.iter().map(|&s| (s, training));
        for (step, value) in self.fills.iter().copied().chain(flags) {
            let n = numel(&mem.shape(step, batch));
            if super::plant::planted(super::plant::Bug::SyncCopyInCapture) {
                let v = vec![value; n as usize];
                // SAFETY: the step's buffer holds `n` f32 values.
                unsafe { result::memcpy_htod_sync(mem.ptr(step)?, &v)? };
                continue;
            }
            let values = [
                ArgValue::U64(mem.ptr(step)?),
                ArgValue::U64(n),
                ArgValue::F32(value),
            ];
            self.launch_entry(
                batch,
                codegen::FILL,
                codegen::grid_for(n, codegen::BLOCK),
                codegen::BLOCK,
                0,
                &values,
            )?;
        }
        Ok(())
    }

    /// Runs kernel `k` of the plan (after `begin`).
    pub(super) fn run_kernel(
        &self,
        mem: &Memory,
        k: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), CudaError> {
        let batch = self.batch;
        let code = &self.modules[&(batch as u64)].code.kernels[k];
        self.run_launches(
            mem,
            batch,
            &code.launches,
            mode,
            (step, first_sample),
            |_, _| Ok(()),
        )
    }

    /// Runs `launches` in order, calling `after` with each launch run and what it did; the
    /// launch after a GEMM that added its bias (that bias's own launch) is skipped.
    fn run_launches(
        &self,
        mem: &Memory,
        batch: usize,
        launches: &[Launch],
        mode: Mode,
        (step, first_sample): (u64, u64),
        mut after: impl FnMut(&Launch, Ran) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let mut launches = launches.iter();
        while let Some(l) = launches.next() {
            let ran = self.run_launch(mem, batch, l, mode, step, first_sample)?;
            if ran == Ran::BiasAdded {
                launches.next();
            }
            after(l, ran)?;
        }
        Ok(())
    }

    /// Runs one training step with a CUDA event around every launch and returns the time of
    /// each launch, labelled by what it computes (for `gpu-check --profile`).
    pub(super) fn profile_step(
        &mut self,
        mem: &Memory,
        batch: usize,
        step: u64,
    ) -> Result<Vec<(String, f64)>, CudaError> {
        self.begin(mem, batch, Mode::Train)?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut labels = Vec::new();
        let first = mem.ctx.new_event(flags)?;
        first.record(&self.stream)?;
        let mut events = vec![first];
        for k in 0..mem.plan.kernels.len() {
            let code = &self.modules[&(batch as u64)].code.kernels[k];
            self.run_launches(
                mem,
                batch,
                &code.launches,
                Mode::Train,
                (step, 0),
                |l, ran| {
                    let e = mem.ctx.new_event(flags)?;
                    e.record(&self.stream)?;
                    let label = match (l, ran) {
                        (Launch::Gemm { .. }, Ran::BiasAdded) => {
                            format!("gemm+bias ({:?})", self.precision)
                        }
                        (Launch::Gemm { .. }, _) => format!("gemm ({:?})", self.precision),
                        (Launch::Kernel { .. } | Launch::Copy { .. }, _) => code.ops.join("+"),
                    };
                    labels.push(label);
                    events.push(e);
                    Ok(())
                },
            )?;
        }
        self.finish(mem, Mode::Train)?;
        self.stream.synchronize()?;
        labels
            .into_iter()
            .zip(events.windows(2))
            .map(|(label, w)| Ok((label, w[0].elapsed_ms(&w[1])? as f64)))
            .collect()
    }

    /// Copies the updated parameters and state over the old (the end of a training step).
    pub(super) fn finish(&mut self, mem: &Memory, mode: Mode) -> Result<(), CudaError> {
        if mode == Mode::Train {
            for &(p, u) in mem.plan.updates.iter() {
                // Written in place (see the schedule pass).
                if mem.plan.steps[p].buffer == mem.plan.steps[u].buffer {
                    continue;
                }
                let n = numel(&mem.shape(p, self.batch));
                let values = [
                    ArgValue::U64(mem.ptr(p)?),
                    ArgValue::U64(mem.ptr(u)?),
                    ArgValue::U64(n),
                ];
                self.launch_entry(
                    self.batch,
                    codegen::COPY,
                    codegen::grid_for(n, codegen::BLOCK),
                    codegen::BLOCK,
                    0,
                    &values,
                )?;
            }
        }
        Ok(())
    }

    /// `run` launch by launch.
    pub(super) fn run_direct(
        &mut self,
        mem: &Memory,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), CudaError> {
        self.begin(mem, batch, mode)?;
        for k in 0..mem.plan.kernels.len() {
            if mode.runs(&mem.plan, k) {
                self.run_kernel(mem, k, mode, step, first_sample)?;
            }
        }
        self.finish(mem, mode)
    }

    /// cuBLAS's launches go to `stream` (cuBLASLt is given its stream at each call).
    pub(super) fn point_blas_at(&self, stream: &CudaStream) -> Result<(), CudaError> {
        // SAFETY: the executor's handle, and a stream of its context.
        unsafe { blas::set_stream(self.blas, stream.cu_stream() as _) }
            .map_err(|e| CudaError::Blas(format!("{e:?}")))
    }
}
