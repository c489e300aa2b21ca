//! A step on the GPU: each kernel's launches (generated PTX entries, device copies, GEMMs)
//! with their arguments resolved to buffer addresses and step constants, queued on the
//! executor's stream; the step's constants before them (`begin`) and its parameter copies
//! after (`finish`). Split from `exec` (which allocates, loads and moves values to and
//! from the host) along that seam.

use super::exec::{numel, ArgValue, CudaExecutor};
use super::CudaError;
use crate::exec::launch_args::{self, LaunchCtx};
use crate::exec::Mode;
use cudarc::driver::{result, sys, CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use parallax_compiler::codegen::{self, Arg, Launch, Module};
use std::collections::HashMap;

/// What a launch did: a GEMM that added its bias (`Launch::Gemm::bias`) makes the launch
/// after it, which would add it again, unneeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ran {
    Done,
    BiasAdded,
}

/// What a block gets without opting in (and the ceiling of static shared memory).
const SHARED_DEFAULT: u32 = 48 * 1024;

/// Whether a kernel `bytes` of dynamic shared memory per block needs the opt-in attribute;
/// an error naming it when the device's opt-in limit `optin` is below that.
pub(super) fn dynamic_shared_opt_in(
    kernel: &str,
    bytes: u32,
    optin: u32,
) -> Result<bool, CudaError> {
    if bytes > optin {
        return Err(CudaError::PtxLoad {
            kernel: kernel.to_string(),
            message: format!(
                "it needs {bytes} bytes of shared memory per block, this GPU allows {optin}"
            ),
        });
    }
    Ok(bytes > SHARED_DEFAULT)
}

/// Lets each function of a loaded module that launches with more than 48 KB of dynamic shared
/// memory have it (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`), before its first launch;
/// refuses sizes past the device's opt-in limit (read once, if any launch needs dynamic memory).
pub(super) fn prepare_dynamic_shared(
    ctx: &CudaContext,
    code: &Module,
    functions: &HashMap<String, CudaFunction>,
) -> Result<(), CudaError> {
    let mut optin = None;
    for l in code.kernels.iter().flat_map(|k| &k.launches) {
        let Launch::Kernel { entry, shared, .. } = l else {
            continue;
        };
        if *shared == 0 {
            continue;
        }
        let limit = match optin {
            Some(n) => n,
            None => {
                let a =
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
                let n = ctx.attribute(a)?.max(0) as u32;
                *optin.insert(n)
            }
        };
        if dynamic_shared_opt_in(entry, *shared, limit)? {
            let f = functions
                .get(entry)
                .ok_or_else(|| CudaError::Exec(format!("no kernel `{entry}` in the module")))?;
            let a = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(a, *shared as i32)?;
        }
    }
    Ok(())
}

impl CudaExecutor {
    /// The device address of a buffer argument (`launch_args::resolve`'s `address`).
    fn address(&self, a: &Arg) -> Result<u64, String> {
        match *a {
            Arg::Value(s) => self.ptr(s).map_err(|e| e.to_string()),
            Arg::Scratch => Ok(self.scratch.ptr),
            Arg::Staging { at } => Ok(self.staging.ptr + 2 * at),
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
        a: &Arg,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<ArgValue, CudaError> {
        let ctx = self.launch_ctx(mode, step, first_sample);
        launch_args::resolve(a, &ctx, &|x| self.address(x)).map_err(CudaError::Exec)
    }

    /// A kernel's arguments resolved, each table's words gathered into one value.
    fn resolve_all(
        &self,
        args: &[Arg],
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<Vec<ArgValue>, CudaError> {
        let ctx = self.launch_ctx(mode, step, first_sample);
        launch_args::resolve_all(args, &ctx, &|x| self.address(x)).map_err(CudaError::Exec)
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
        batch: usize,
        l: &Launch,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<Ran, CudaError> {
        match l {
            Launch::Kernel {
                entry,
                grid,
                block,
                args,
                shared,
            } => {
                let values = self.resolve_all(args, mode, step, first_sample)?;
                self.launch_entry(batch, entry, *grid, *block, *shared, &values)?;
                Ok(Ran::Done)
            }
            Launch::Copy {
                src,
                dst,
                elements,
                bf16,
            } => {
                let ptr = |x: &Arg| match self.resolve(x, mode, step, first_sample)? {
                    ArgValue::U64(p) => Ok(p),
                    _ => Err(CudaError::Exec("a copy operand is not a buffer".into())),
                };
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
                let ptr = |x: &Arg| match self.resolve(x, mode, step, first_sample)? {
                    ArgValue::U64(p) => Ok(p),
                    _ => Err(CudaError::Exec("a GEMM operand is not a buffer".into())),
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
                    bf16: *bf16,
                };
                if let Some(lt) = &self.lt {
                    if let Some(b) = bias {
                        let [a16, b16, _] = g.bf16;
                        let with_bias = super::gemm::Gemm {
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
                super::gemm::gemm(self.blas, self.precision, &g)?;
                Ok(Ran::Done)
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
        self.last_mode = Some(mode);
        let training = f32::from(u8::from(mode != Mode::Eval));
        let flags = self.training_flags.iter().map(|&s| (s, training));
        for (step, value) in self.fills.iter().copied().chain(flags) {
            let n = numel(&self.shape(step, batch));
            if super::plant::planted(super::plant::Bug::SyncCopyInCapture) {
                let v = vec![value; n as usize];
                // SAFETY: the step's buffer holds `n` f32 values.
                unsafe { result::memcpy_htod_sync(self.ptr(step)?, &v)? };
                continue;
            }
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
                0,
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
        self.run_launches(batch, &code.launches, mode, (step, first_sample), |_, _| {
            Ok(())
        })
    }

    /// Runs `launches` in order, calling `after` with each launch run and what it did; the
    /// launch after a GEMM that added its bias (that bias's own launch) is skipped.
    fn run_launches(
        &self,
        batch: usize,
        launches: &[Launch],
        mode: Mode,
        (step, first_sample): (u64, u64),
        mut after: impl FnMut(&Launch, Ran) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let mut launches = launches.iter();
        while let Some(l) = launches.next() {
            let ran = self.run_launch(batch, l, mode, step, first_sample)?;
            if ran == Ran::BiasAdded {
                launches.next();
            }
            after(l, ran)?;
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
            let code = &self.modules[&(batch as u64)].code.kernels[k];
            self.run_launches(batch, &code.launches, Mode::Train, (step, 0), |l, ran| {
                let e = self.ctx.new_event(flags)?;
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
            })?;
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
                    0,
                    &values,
                )?;
            }
        }
        Ok(())
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
        if self.run_graph(batch, mode, step, first_sample)? {
            return Ok(());
        }
        self.run_direct(batch, mode, step, first_sample)
    }

    /// `run` launch by launch.
    pub(super) fn run_direct(
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_shared_sizes() {
        let h100 = 227 * 1024;
        // Up to 48 KB needs nothing; above, the attribute; past the opt-in, an error.
        assert!(!dynamic_shared_opt_in("k", 0, h100).unwrap());
        assert!(!dynamic_shared_opt_in("k", 48 * 1024, h100).unwrap());
        assert!(dynamic_shared_opt_in("k", 69_632, h100).unwrap());
        assert!(dynamic_shared_opt_in("k", h100, h100).unwrap());
        let e = dynamic_shared_opt_in("attn_fwd", 200 * 1024, 163 * 1024).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("`attn_fwd`") && text.contains("204800"),
            "{text}"
        );
    }
}
