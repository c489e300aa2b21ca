//! A plan's generated kernels on the PTX interpreter, laid out as the CUDA executor lays
//! them out on a GPU (`cuda::exec`, `cuda::launch`): the same buffers, the same arguments, the
//! same launches, so what runs here is what a GPU would be given. Two differences, both
//! for the checks: each plan buffer is an allocation of its own (so memcheck bounds every
//! buffer, where a GPU's arena would hide an overrun into the next), and GEMMs run on the
//! host (`parallax_emulator::blas`, which cuBLAS runs on a GPU).

use crate::cuda::Precision;
use crate::exec::launch_args::{self, ArgValue, LaunchCtx};
use crate::exec::Mode;
use parallax_compiler::codegen::{self, Arg, Launch, Module};
use parallax_compiler::Plan;
use parallax_emulator::blas::{self, Compute};
use parallax_emulator::{EmuError, Finding, Memory, ParamValue};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("the code generator: {0}")]
    Codegen(#[from] codegen::CodegenError),
    #[error("`{file}`: {source}")]
    Parse {
        file: String,
        source: parallax_emulator::ParseError,
    },
    #[error("cannot read `{}`: {message}", .path.display())]
    Read { path: PathBuf, message: String },
    #[error("kernel {kernel}: {source}")]
    Launch { kernel: usize, source: EmuError },
    #[error("kernel {kernel}: {source}")]
    Gemm {
        kernel: usize,
        source: blas::BlasError,
    },
    #[error("kernel {kernel}: {message}")]
    Memory { kernel: usize, message: String },
    #[error("{0}")]
    Plan(String),
}

/// Where an entry's PTX came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Generated,
    File(PathBuf),
}

struct Entry {
    module: parallax_emulator::Module,
    origin: Origin,
}

/// The plan's buffers in emulated memory and its kernels, parsed.
pub struct Device<'p> {
    plan: &'p Plan,
    pub memory: Memory,
    /// Each plan buffer's address.
    buffers: Vec<u64>,
    slot: Vec<Option<usize>>,
    scratch: u64,
    staging: u64,
    pub code: Module,
    entries: HashMap<String, Entry>,
    seed: u64,
    precision: Precision,
    pub options: parallax_emulator::Options,
    batch: u64,
    /// Every finding so far, with the kernel it came from (`None`: the step's own fills
    /// and copies).
    pub findings: Vec<(Option<usize>, Finding)>,
    /// Lane-instructions interpreted so far.
    pub instructions: u64,
}

impl<'p> Device<'p> {
    /// The plan's kernels for batches of `batch` at `precision`, each entry's PTX from
    /// `ptx_dir/<entry>.ptx` where that file exists (a kernel changed by hand), else as
    /// generated.
    pub fn new(
        plan: &'p Plan,
        batch: usize,
        seed: u64,
        precision: Precision,
        ptx_dir: Option<&Path>,
    ) -> Result<Device<'p>, DeviceError> {
        let options = crate::cuda::codegen_options(precision);
        // sm_80, as `compile --emit ptx` writes the files `--ptx` may replace.
        let code = codegen::generate_with(plan, batch as u64, "sm_80", &options)?;
        let mut entries = HashMap::new();
        for (name, _) in &code.entries {
            let file = ptx_dir.map(|d| d.join(format!("{name}.ptx")));
            let (text, origin) = match file.filter(|f| f.exists()) {
                Some(f) => {
                    let text = std::fs::read_to_string(&f).map_err(|e| DeviceError::Read {
                        path: f.clone(),
                        message: e.to_string(),
                    })?;
                    (text, Origin::File(f))
                }
                None => (code.entry_text(name).unwrap_or_default(), Origin::Generated),
            };
            let module =
                parallax_emulator::Module::parse(&text).map_err(|source| DeviceError::Parse {
                    file: match &origin {
                        Origin::File(f) => f.display().to_string(),
                        Origin::Generated => format!("{name}.ptx (generated)"),
                    },
                    source,
                })?;
            entries.insert(name.clone(), Entry { module, origin });
        }
        let mut memory = Memory::new();
        let shape = |id: usize| plan.shape_at(&plan.steps[id].ty.shape, batch as u64);
        let slot: Vec<Option<usize>> = plan.steps.iter().map(|s| s.buffer).collect();
        let mut bytes = vec![0u64; plan.buffers.len()];
        let mut first = vec![usize::MAX; plan.buffers.len()];
        for (id, b) in slot.iter().enumerate() {
            if let Some(b) = *b {
                let n = shape(id).iter().product::<u64>() * plan.buffers[b].dtype.bytes();
                bytes[b] = bytes[b].max(n);
                first[b] = first[b].min(id);
            }
        }
        let buffers = (0..bytes.len())
            .map(|b| {
                let label = plan.steps.get(first[b]).map_or_else(
                    || format!("buffer {b}"),
                    |s| format!("buffer {b} ({} `{}`)", s.op.name(), s.layer),
                );
                memory.alloc(bytes[b], label)
            })
            .collect();
        let scratch = memory.alloc(4 * code.scratch, "scratch");
        let staging = memory.alloc(2 * code.staging, "the bf16 GEMM operands' staging");
        Ok(Device {
            plan,
            memory,
            buffers,
            slot,
            scratch,
            staging,
            code,
            entries,
            seed,
            precision,
            options: parallax_emulator::Options::default(),
            batch: batch as u64,
            findings: Vec::new(),
            instructions: 0,
        })
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The entries read from files (`--ptx`).
    pub fn replaced(&self) -> Vec<(String, PathBuf)> {
        let mut v: Vec<_> = self
            .entries
            .iter()
            .filter_map(|(n, e)| match &e.origin {
                Origin::File(f) => Some((n.clone(), f.clone())),
                Origin::Generated => None,
            })
            .collect();
        v.sort();
        v
    }

    /// The address of step `step`'s buffer.
    pub fn ptr(&self, step: usize) -> Option<u64> {
        self.slot
            .get(step)
            .copied()
            .flatten()
            .map(|b| self.buffers[b])
    }

    pub fn elements(&self, step: usize) -> u64 {
        self.plan
            .shape_at(&self.plan.steps[step].ty.shape, self.batch)
            .iter()
            .product()
    }

    /// Writes a step's values (f32, rounded to bf16 where the plan stores the step so; or
    /// i32 bits), as the CUDA executor uploads them.
    pub fn write(&mut self, step: usize, values: &[f32]) -> Result<(), String> {
        let p = self.ptr(step).ok_or("no buffer")?;
        let bytes: Vec<u8> = if self.plan.stored_in_bf16(step) {
            values
                .iter()
                .flat_map(|&x| {
                    let r = parallax_compiler::scalar::math::round_bf16(x);
                    ((r.to_bits() >> 16) as u16).to_le_bytes()
                })
                .collect()
        } else {
            values.iter().flat_map(|x| x.to_le_bytes()).collect()
        };
        self.memory.write(p, &bytes).map_err(|e| e.to_string())
    }

    /// Writes a step's i32 values.
    pub fn write_i32(&mut self, step: usize, values: &[i32]) -> Result<(), String> {
        let p = self.ptr(step).ok_or("no buffer")?;
        let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.memory.write(p, &bytes).map_err(|e| e.to_string())
    }

    /// A step's values as f32 (bf16 widened exactly), and whether all were written.
    pub fn read(&self, step: usize) -> Result<(Vec<f32>, bool), String> {
        let p = self.ptr(step).ok_or("no buffer")?;
        let n = self.elements(step) as usize;
        self.memory
            .load_f32(p, n, self.plan.stored_in_bf16(step))
            .map_err(|e| e.to_string())
    }

    /// The address of a buffer argument (`launch_args::resolve`'s `address`).
    fn address(&self, a: &Arg) -> Result<u64, String> {
        match *a {
            Arg::Value(s) => self.ptr(s).ok_or_else(|| format!("step {s} has no buffer")),
            Arg::Scratch => Ok(self.scratch),
            Arg::Staging { at } => Ok(self.staging + 2 * at),
            _ => Err("not a buffer argument".into()),
        }
    }

    fn ctx(&self, mode: Mode, step: u64, first_sample: u64) -> LaunchCtx {
        LaunchCtx {
            seed: self.seed,
            mode,
            step,
            first_sample,
        }
    }

    /// Interprets one entry launch; findings are kept with `kernel`.
    pub fn launch_entry(
        &mut self,
        kernel: Option<usize>,
        entry: &str,
        (grid, block, shared): (u32, u32, u32),
        params: Vec<ParamValue>,
    ) -> Result<(), DeviceError> {
        let at = kernel.unwrap_or(usize::MAX);
        let e = self.entries.get(entry).ok_or_else(|| DeviceError::Launch {
            kernel: at,
            source: EmuError::NoEntry(entry.to_string()),
        })?;
        let launch = parallax_emulator::Launch {
            entry,
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            dynamic_shared: shared,
            params,
        };
        let report =
            match parallax_emulator::launch(&e.module, &launch, &mut self.memory, &self.options) {
                Ok(r) => r,
                // A launch that stopped keeps what it found: report those, then the error.
                Err(EmuError::Aborted {
                    entry,
                    line,
                    message,
                    report,
                }) => {
                    self.instructions += report.instructions;
                    self.findings
                        .extend(report.findings.iter().cloned().map(|f| (kernel, f)));
                    return Err(DeviceError::Launch {
                        kernel: at,
                        source: EmuError::Aborted {
                            entry,
                            line,
                            message,
                            report,
                        },
                    });
                }
                Err(source) => return Err(DeviceError::Launch { kernel: at, source }),
            };
        self.instructions += report.instructions;
        self.findings
            .extend(report.findings.into_iter().map(|f| (kernel, f)));
        Ok(())
    }

    /// Fills the plan's constants and its `training` flag for `mode` with the built-in
    /// fill kernel, as `CudaExecutor::begin` does.
    pub fn begin(&mut self, mode: Mode) -> Result<(), DeviceError> {
        let training = f32::from(u8::from(mode != Mode::Eval));
        let flags = self
            .plan
            .training_flags()
            .into_iter()
            .map(|s| (s, training));
        let fills: Vec<(usize, f32)> = self.plan.fills().into_iter().chain(flags).collect();
        for (step, value) in fills {
            let n = self.elements(step);
            let p = self
                .ptr(step)
                .ok_or_else(|| DeviceError::Plan(format!("step {step} has no buffer")))?;
            let params = vec![
                ParamValue::U64(p),
                ParamValue::U64(n),
                ParamValue::F32(value),
            ];
            let shape = (codegen::grid_for(n, codegen::BLOCK), codegen::BLOCK, 0);
            self.launch_entry(None, codegen::FILL, shape, params)?;
        }
        Ok(())
    }

    /// Runs kernel `k`'s launches; the launch after a GEMM is its bias's (the GPU's cuBLASLt
    /// may fold it; here it always runs, so the kernel is checked).
    pub fn run_kernel(
        &mut self,
        k: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), DeviceError> {
        let launches = self.code.kernels[k].launches.clone();
        let fail = |message: String| DeviceError::Memory { kernel: k, message };
        for l in &launches {
            match l {
                Launch::Kernel {
                    entry,
                    grid,
                    block,
                    args,
                    shared,
                } => {
                    let ctx = self.ctx(mode, step, first_sample);
                    let params = launch_args::resolve_all(args, &ctx, &|x| self.address(x))
                        .map_err(fail)?
                        .into_iter()
                        .map(|v| match v {
                            ArgValue::U64(x) => ParamValue::U64(x),
                            ArgValue::F32(x) => ParamValue::F32(x),
                            ArgValue::Table(t) => {
                                ParamValue::Bytes(t.iter().flat_map(|w| w.to_le_bytes()).collect())
                            }
                        })
                        .collect();
                    self.launch_entry(Some(k), entry, (*grid, *block, *shared), params)?;
                }
                Launch::Copy {
                    src,
                    dst,
                    elements,
                    bf16,
                } => {
                    let ctx = self.ctx(mode, step, first_sample);
                    let ptr = |x: &Arg| launch_args::resolve_ptr(x, &ctx, &|y| self.address(y));
                    let (s, d) = (ptr(src).map_err(fail)?, ptr(dst).map_err(fail)?);
                    if s != d && *elements > 0 {
                        let bytes = elements * if *bf16 { 2 } else { 4 };
                        self.memory
                            .copy(d, s, bytes)
                            .map_err(|e| fail(e.to_string()))?;
                    }
                }
                Launch::Gemm {
                    a,
                    b,
                    c,
                    m,
                    n,
                    k: kk,
                    batch,
                    trans_a,
                    trans_b,
                    stride_a,
                    stride_b,
                    stride_c,
                    bf16,
                    bias: _,
                } => {
                    let ctx = self.ctx(mode, step, first_sample);
                    let ptr = |x: &Arg| launch_args::resolve_ptr(x, &ctx, &|y| self.address(y));
                    let g = blas::Gemm {
                        a: ptr(a).map_err(fail)?,
                        b: ptr(b).map_err(fail)?,
                        c: ptr(c).map_err(fail)?,
                        m: *m,
                        n: *n,
                        k: *kk,
                        count: *batch,
                        trans_a: *trans_a,
                        trans_b: *trans_b,
                        stride_a: *stride_a,
                        stride_b: *stride_b,
                        stride_c: *stride_c,
                        ab_bf16: bf16[0],
                        c_bf16: bf16[2],
                        compute: match self.precision {
                            Precision::Fp32 => Compute::F32,
                            Precision::Tf32 => Compute::Tf32,
                            Precision::Bf16 => Compute::Bf16,
                        },
                    };
                    blas::gemm(&mut self.memory, &g)
                        .map_err(|source| DeviceError::Gemm { kernel: k, source })?;
                }
            }
        }
        Ok(())
    }

    /// Copies the updated parameters and state over the old, as `CudaExecutor::finish`.
    pub fn finish(&mut self, mode: Mode) -> Result<(), DeviceError> {
        if mode != Mode::Train {
            return Ok(());
        }
        for &(p, u) in self.plan.updates.iter() {
            if self.plan.steps[p].buffer == self.plan.steps[u].buffer {
                continue;
            }
            let n = self.elements(p);
            let missing = |s: usize| DeviceError::Plan(format!("step {s} has no buffer"));
            let params = vec![
                ParamValue::U64(self.ptr(p).ok_or_else(|| missing(p))?),
                ParamValue::U64(self.ptr(u).ok_or_else(|| missing(u))?),
                ParamValue::U64(n),
            ];
            let shape = (codegen::grid_for(n, codegen::BLOCK), codegen::BLOCK, 0);
            self.launch_entry(None, codegen::COPY, shape, params)?;
        }
        Ok(())
    }
}
