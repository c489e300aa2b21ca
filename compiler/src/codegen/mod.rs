//! PTX code generation: every kernel of a plan becomes PTX text (or a cuBLAS GEMM call), with
//! its launch shape and arguments, for one batch size. Pure text: nothing here needs a GPU, and
//! the tests in `codegen/tests/` assemble the output with `ptxas` on CI.
//!
//! Files: `builder` writes PTX; `elementwise` the fused elementwise chains; `rows` the
//! reductions along the last axis (softmax, norms, losses); `layout` data movement and general
//! reductions; `conv` convolution and pooling; `attention*` the fused attention kernels; `gemm`
//! the GEMM library calls; `grouped` one launch over many like kernels (each parameter's
//! optimizer step).

mod attention;
pub mod builder;
mod conv;
mod elementwise;
mod gemm;
mod grouped;
mod layout;
mod rows;

use crate::ir::ops::OpClass;
use crate::ir::KernelKind;
use crate::ir::{DType, Op, Phase};
use crate::plan::Plan;
use builder::{Kernel, ParamType};
use gemm::{gemm, gemm_bias, gemm_launch};
use serde::Serialize;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CodegenError {
    #[error("the CUDA backend has no kernel for `{op}` yet")]
    Unsupported { op: &'static str },
    #[error("`{op}`: {message}")]
    Bad { op: &'static str, message: String },
}

/// A value a launch passes to its kernel, resolved by the runtime at each step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Arg {
    /// The device address of a step's stored value.
    Value(usize),
    /// The device address of the scratch buffer (a fused reduction's staged input, or a
    /// matmul result only its epilogue reads).
    Scratch,
    /// The device address `at` bf16 elements into the staging buffer, where a bf16 GEMM's
    /// f32 operand is rounded to bf16 first (`Module::staging` elements in all).
    Staging { at: u64 },
    /// The dropout key of a stream for this step (u64).
    DropoutKey { stream: u64 },
    /// `p` when training, 0 otherwise (f32): elements whose uniform draw is below it drop.
    DropoutThreshold { p: f64 },
    /// `1 / (1 - p)` when training, 1 otherwise (f32).
    DropoutScale { p: f64 },
    /// The index of the batch's first sample in the global batch (u64).
    FirstSample,
    /// A constant u64 (element counts of the built-in kernels).
    U64(u64),
    /// A constant f32 (fill values).
    F32(f32),
    /// One parameter holding the next `words` arguments (each an address or a u64) as a
    /// table of 64-bit words, passed by value (`builder::Kernel::param_table`).
    Table { words: u32 },
}

impl Arg {
    pub fn param_type(&self) -> ParamType {
        match self {
            Arg::DropoutThreshold { .. } | Arg::DropoutScale { .. } | Arg::F32(_) => ParamType::F32,
            Arg::Table { words } => ParamType::Table(*words),
            _ => ParamType::U64,
        }
    }
}

fn none_bf16(b: &[bool; 3]) -> bool {
    !b.iter().any(|&x| x)
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// One thing the runtime does for a kernel of the plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Launch {
    /// A PTX entry of the module, on a 1-D grid.
    Kernel {
        entry: String,
        grid: u32,
        block: u32,
        args: Vec<Arg>,
        /// Bytes of dynamic shared memory it passes (not in the manifest when 0).
        #[serde(default, skip_serializing_if = "is_zero")]
        shared: u32,
    },
    /// A contiguous device-to-device copy of `elements` values (a reshape): 4-byte ones, or
    /// bf16 ones when `bf16` (both stored alike).
    Copy {
        src: Arg,
        dst: Arg,
        elements: u64,
        #[serde(default, skip_serializing_if = "is_false")]
        bf16: bool,
    },
    /// Row-major `c[batch][m, n] = op(a)[batch][m, k] x op(b)[batch][k, n]`, each operand
    /// `stride` elements from one batch to the next (0: shared by every batch).
    Gemm {
        a: Arg,
        b: Arg,
        c: Arg,
        m: u64,
        n: u64,
        k: u64,
        batch: u64,
        trans_a: bool,
        trans_b: bool,
        stride_a: u64,
        stride_b: u64,
        stride_c: u64,
        /// Whether `a`, `b` and `c` are stored in bf16 (`a` and `b` alike: a bf16 GEMM with
        /// f32 accumulation); none in plans with f32 storage.
        #[serde(default, skip_serializing_if = "none_bf16")]
        bf16: [bool; 3],
        /// When the next launch only adds a bias along the last axis (`c + bias` into another
        /// buffer), the GEMM may do it in its epilogue instead and skip that launch.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bias: Option<GemmBias>,
    },
}

/// A bias a GEMM may add in its epilogue: `out[batch][i, j] = c[batch][i, j] + vector[j]`,
/// `out` laid out as `c`. The launch after the GEMM computes the same (for a GEMM library that
/// cannot), and is skipped when the GEMM did it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GemmBias {
    pub vector: Arg,
    pub out: Arg,
    /// `out` is stored in bf16 (the vector stays f32).
    #[serde(default, skip_serializing_if = "is_false")]
    pub out_bf16: bool,
}

/// The launches of one kernel of the plan.
#[derive(Debug, Clone, Serialize)]
pub struct KernelCode {
    /// Its index in `Plan::kernels`.
    pub index: usize,
    /// The phase of its last step (evaluation runs only forward kernels).
    pub phase: Phase,
    /// The ops it fuses, in order.
    pub ops: Vec<&'static str>,
    pub launches: Vec<Launch>,
}

/// The code of a whole plan at one batch size.
#[derive(Debug, Clone, Serialize)]
pub struct Module {
    pub target: String,
    pub batch: u64,
    /// `(entry name, its .entry text)`, the built-in ones first.
    pub entries: Vec<(String, String)>,
    pub kernels: Vec<KernelCode>,
    /// Elements of the scratch buffer the launches use.
    pub scratch: u64,
    /// bf16 elements of the staging buffer the launches use (`Arg::Staging`).
    pub staging: u64,
}

/// Built-in entries: `px_fill(ptr, n, value)` and `px_copy(dst, src, n)`.
pub const FILL: &str = "px_fill";
pub const COPY: &str = "px_copy";

impl Module {
    /// `manifest.json` of `compile --emit ptx`: each kernel's launches and fused ops, and the
    /// `<entry>.ptx` files.
    pub fn manifest(&self) -> serde_json::Value {
        let mut m = serde_json::json!({
            "target": self.target,
            "batch": self.batch,
            "scratch_elements": self.scratch,
            "entries": self.entries.iter().map(|(n, _)| format!("{n}.ptx")).collect::<Vec<_>>(),
            "kernels": self.kernels,
        });
        if self.staging > 0 {
            m["staging_bf16_elements"] = self.staging.into();
        }
        m
    }

    /// The whole module as one PTX text.
    pub fn text(&self) -> String {
        let mut s = builder::header(&self.target);
        for (_, e) in &self.entries {
            s.push_str(e);
            s.push('\n');
        }
        s
    }

    /// One entry as a PTX module of its own.
    /// Writes `DIR/<entry>.ptx` for each entry and `DIR/manifest.json` (`compile --emit
    /// ptx`); a failure names the file.
    pub fn write_files(
        &self,
        dir: &std::path::Path,
    ) -> Result<(), (std::path::PathBuf, std::io::Error)> {
        let write = |path: std::path::PathBuf, text: String| {
            std::fs::write(&path, text).map_err(|e| (path, e))
        };
        for (name, _) in &self.entries {
            let text = self.entry_text(name).unwrap_or_default();
            write(dir.join(format!("{name}.ptx")), text)?;
        }
        let manifest = serde_json::to_string_pretty(&self.manifest()).expect("serialisable");
        write(dir.join("manifest.json"), manifest + "\n")
    }

    pub fn entry_text(&self, name: &str) -> Option<String> {
        let (_, e) = self.entries.iter().find(|(n, _)| n == name)?;
        Some(builder::header(&self.target) + e)
    }
}

/// A value an op reads or writes: where it is, its shape and type.
#[derive(Debug, Clone)]
pub struct Operand {
    pub arg: Arg,
    pub shape: Vec<u64>,
    pub dtype: DType,
}

impl Operand {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// What every op's generator takes: the entry's name, the op, the operands it reads and what
/// it writes (one output, or a fused kernel's optional outputs).
#[derive(Debug, Clone, Copy)]
pub struct OpArgs<'a, O = &'a Operand> {
    pub name: &'a str,
    pub op: &'a Op,
    pub ins: &'a [Operand],
    pub out: O,
}

impl<'a, O> OpArgs<'a, O> {
    pub fn new(name: &'a str, op: &'a Op, ins: &'a [Operand], out: O) -> Self {
        OpArgs { name, op, ins, out }
    }

    /// The same op writing `out` instead (a fused kernel's outputs).
    pub fn with<P>(self, out: P) -> OpArgs<'a, P> {
        OpArgs::new(self.name, self.op, self.ins, out)
    }
}

/// A generator's result: the launches of its op, or why it has none.
pub type Launches = Result<Vec<Launch>, CodegenError>;

/// Choices of kernel beyond what the plan says. `Default` is what `generate` uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CodegenOptions {
    /// Attention (forward and backward) of head width 64 or 128 on tensor cores (`mma.sync`,
    /// bf16 operands rounded from the stored f32, f32 accumulation; sm_80 and later) instead
    /// of the plain f32 kernels. For plans whose matmuls run in bf16 anyway.
    pub bf16_attention: bool,
}

/// Collects the entries of a module as kernels are generated.
#[derive(Default)]
pub struct Gen {
    pub options: CodegenOptions,
    entries: Vec<(String, String)>,
    /// Each entry's text with its name blanked out, to reuse identical kernels (a repeated
    /// block generates the same kernels in every layer).
    seen: std::collections::HashMap<String, String>,
    /// The plan's values stored in bf16 (`devices.activations: Bf16`).
    bf16_values: std::sync::Arc<std::collections::BTreeSet<usize>>,
}

/// Threads per block of the grid-stride kernels.
pub const BLOCK: u32 = 256;

/// A 1-D grid covering `n` elements with `block` threads each, capped (the kernels loop).
pub fn grid_for(n: u64, block: u32) -> u32 {
    n.div_ceil(block as u64).clamp(1, 65_535) as u32
}

impl Gen {
    pub fn new() -> Gen {
        Gen::default()
    }

    /// Every entry so far as one PTX module (for tests).
    pub fn text(&self, target: &str) -> String {
        let mut s = builder::header(target);
        for (_, e) in &self.entries {
            s.push_str(e);
            s.push('\n');
        }
        s
    }

    /// A new kernel whose pointers to bf16-stored values address bf16 elements.
    pub fn kernel(&self, name: &str) -> Kernel {
        Kernel::with_bf16(name, self.bf16_values.clone())
    }

    /// Whether `arg` addresses a value stored in bf16.
    pub fn arg_is_bf16(&self, arg: Arg) -> bool {
        matches!(arg, Arg::Value(id) if self.bf16_values.contains(&id))
    }

    /// Adds a finished kernel and returns its launch.
    pub fn launch(&mut self, k: Kernel, grid: u32, block: u32) -> Launch {
        let args = k.args().to_vec();
        let name = k.name().to_string();
        let shared = u32::try_from(k.dynamic_bytes()).expect("dynamic shared bytes fit a u32");
        let text = k.finish();
        let key = text.replace(&name, "@");
        let entry = match self.seen.get(&key) {
            Some(existing) => existing.clone(),
            None => {
                self.seen.insert(key, name.clone());
                self.entries.push((name.clone(), text));
                name
            }
        };
        Launch::Kernel {
            entry,
            grid,
            block,
            args,
            shared,
        }
    }
}

fn builtins(g: &mut Gen) {
    let mut k = Kernel::new(FILL);
    let p = k.param_ptr(Arg::Scratch);
    let n = k.param_u64(Arg::U64(0));
    let v = k.param_f32(Arg::F32(0.0));
    let (i, s) = k.global_index();
    k.for_range(i, n, s, |k, i| k.store(p, i, v));
    g.launch(k, 1, BLOCK);
    let mut k = Kernel::new(COPY);
    let d = k.param_ptr(Arg::Scratch);
    let src = k.param_ptr(Arg::Scratch);
    let n = k.param_u64(Arg::U64(0));
    let (i, s) = k.global_index();
    k.for_range(i, n, s, |k, i| {
        let v = k.load(src, i);
        k.store(d, i, v)
    });
    g.launch(k, 1, BLOCK);
}

/// Generates the code of every kernel of `plan` for batches of `batch` samples.
pub fn generate(plan: &Plan, batch: u64, target: &str) -> Result<Module, CodegenError> {
    generate_with(plan, batch, target, &CodegenOptions::default())
}

/// `generate` with kernel choices (`CodegenOptions`).
pub fn generate_with(
    plan: &Plan,
    batch: u64,
    target: &str,
    options: &CodegenOptions,
) -> Result<Module, CodegenError> {
    let mut g = Gen {
        options: *options,
        bf16_values: std::sync::Arc::new(
            (0..plan.steps.len())
                .filter(|&s| plan.stored_in_bf16(s))
                .collect(),
        ),
        ..Gen::default()
    };
    builtins(&mut g);
    let shapes: Vec<Vec<u64>> = plan
        .steps
        .iter()
        .map(|s| plan.shape_at(&s.ty.shape, batch))
        .collect();
    let operand = |id: usize, arg: Arg| Operand {
        arg,
        shape: shapes[id].clone(),
        dtype: plan.steps[id].ty.dtype,
    };
    let stored = |id: usize| Arg::Value(id);
    let mut kernels = Vec::new();
    let mut scratch = 0u64;
    let mut staging = 0u64;
    for (index, kern) in plan.kernels.iter().enumerate() {
        let steps = &kern.steps;
        let last = *steps.last().expect("a kernel has steps");
        let name = format!("k{index}");
        let ins_of = |s: usize| -> Vec<Operand> {
            plan.steps[s]
                .operands
                .iter()
                .map(|&o| operand(o, stored(o)))
                .collect()
        };
        let norm_fused = |g: &mut Gen, scratch: &mut u64| -> Result<Vec<Launch>, CodegenError> {
            let of = |s: usize| operand(s, stored(s));
            let (l, staged) = rows::norm::fused(g, &name, plan, &shapes, steps, &of)?;
            *scratch = (*scratch).max(staged);
            Ok(vec![l])
        };
        let launches = match kern.kind {
            KernelKind::Single => {
                let s = steps[0];
                let step = &plan.steps[s];
                if step.op.def().class == OpClass::Collective {
                    // The ranks' exchange (a transfer between stages, a sum over ranks): the
                    // collective library's, run by the ranks layer, never launched here.
                    Vec::new()
                } else if step.op.def().class == OpClass::Elementwise {
                    vec![elementwise::chain(
                        &mut g, &name, plan, &shapes, steps, None, None,
                    )?]
                } else if matches!(step.op, Op::MatMul { .. }) {
                    let out = operand(s, stored(s));
                    gemm(&mut g, &name, &step.op, &ins_of(s), &out, &mut staging)?
                } else {
                    let (ins, out) = (ins_of(s), operand(s, stored(s)));
                    single(&mut g, OpArgs::new(&name, &step.op, &ins, &out))?
                }
            }
            KernelKind::Elementwise => vec![elementwise::chain(
                &mut g, &name, plan, &shapes, steps, None, None,
            )?],
            // A norm of a chain, or a norm's gradient and an add: one launch (`rows::norm`).
            KernelKind::NormGradAdd => norm_fused(&mut g, &mut scratch)?,
            KernelKind::ElementwiseReduce
                if matches!(
                    plan.steps[last].op,
                    Op::LayerNorm { .. } | Op::RmsNorm { .. }
                ) =>
            {
                norm_fused(&mut g, &mut scratch)?
            }
            KernelKind::ElementwiseReduce => {
                let (&red, chain) = steps.split_last().expect("a reduction and its chain");
                let staged = *chain.last().expect("a chain");
                scratch = scratch.max(shapes[staged].iter().product());
                let mut l = vec![elementwise::chain(
                    &mut g,
                    &name,
                    plan,
                    &shapes,
                    chain,
                    None,
                    Some(staged),
                )?];
                let ins = [operand(staged, Arg::Scratch)];
                let (name, out) = (format!("{name}r"), operand(red, stored(red)));
                l.extend(single(
                    &mut g,
                    OpArgs::new(&name, &plan.steps[red].op, &ins, &out),
                )?);
                l
            }
            KernelKind::Grouped { .. } => {
                grouped::generate(&mut g, &name, plan, &shapes, kern.kind, steps)?
            }
            KernelKind::Attention | KernelKind::AttentionGrads => {
                let of = |s: usize| operand(s, stored(s));
                attention::kernel(&mut g, &name, plan, steps, &of)?
            }
            KernelKind::Gemm { .. } => {
                let mm = steps[0];
                let at = if plan.steps[mm].buffer.is_some() {
                    stored(mm)
                } else {
                    scratch = scratch.max(shapes[mm].iter().product());
                    Arg::Scratch
                };
                let op = &plan.steps[mm].op;
                let mut l = gemm(
                    &mut g,
                    &name,
                    op,
                    &ins_of(mm),
                    &operand(mm, at),
                    &mut staging,
                )?;
                if let Some(Launch::Gemm { bias, .. }) = l.last_mut() {
                    *bias = gemm_bias(plan, kern.kind, steps, at);
                }
                if steps.len() > 1 {
                    l.push(elementwise::chain(
                        &mut g,
                        &name,
                        plan,
                        &shapes,
                        &steps[1..],
                        Some((mm, at)),
                        None,
                    )?);
                }
                l
            }
        };
        kernels.push(KernelCode {
            index,
            phase: plan.steps[last].phase,
            // A grouped kernel's members all fuse the first one's ops.
            ops: crate::ir::kernels::members_of(kern.kind, steps)
                .next()
                .map_or(&steps[..], |m| m.1)
                .iter()
                .map(|&s| plan.steps[s].op.name())
                .collect(),
            launches,
        });
    }
    Ok(Module {
        target: target.to_string(),
        batch,
        entries: g.entries,
        kernels,
        scratch,
        staging,
    })
}

/// The launches of one non-elementwise op reading `ins` into `out`.
fn single(g: &mut Gen, a: OpArgs) -> Launches {
    match a.op {
        Op::MatMul { .. } => Ok(vec![gemm_launch(a.op, a.ins, a.out)?]),
        Op::Conv2d { .. }
        | Op::Conv2dGradInput { .. }
        | Op::Conv2dGradWeight { .. }
        | Op::Pool2d { .. }
        | Op::Pool2dGrad { .. } => conv::generate(g, a),
        Op::Softmax { .. }
        | Op::SoftmaxGrad
        | Op::LayerNorm { .. }
        | Op::LayerNormGrad { .. }
        | Op::RmsNorm { .. }
        | Op::RmsNormGrad { .. }
        | Op::CrossEntropy { .. }
        | Op::CrossEntropyGrad { .. } => rows::generate(g, a),
        Op::Attention { .. }
        | Op::AttentionLse { .. }
        | Op::AttentionGrad { .. }
        | Op::CachedAttention { .. } => attention::single(g, a),
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::Pad { .. }
        | Op::Gather
        | Op::ScatterAdd { .. }
        | Op::ReduceSum { .. }
        | Op::ReduceMean { .. }
        | Op::SumTo { .. }
        | Op::Expand { .. }
        | Op::TensorParallelCopy
        | Op::CacheWrite => layout::generate(g, a),
        // Elementwise ops are chains (`elementwise::chain`); sources hold values the executor
        // sets; collectives are the collective library's; none is a kernel of its own here.
        crate::map_ops!()
        | Op::Dropout { .. }
        | Op::Input { .. }
        | Op::Param { .. }
        | Op::State { .. }
        | Op::Training
        | Op::Fill { .. }
        | Op::AllReduce { .. }
        | Op::Transfer { .. }
        | Op::Broadcast { .. }
        | Op::Reduce { .. } => Err(CodegenError::Unsupported { op: a.op.name() }),
    }
}

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
#[path = "tests/module.rs"]
mod tests;

#[cfg(test)]
#[path = "tests/bf16.rs"]
mod bf16_tests;
