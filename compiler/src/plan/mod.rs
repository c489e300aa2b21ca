//! The plan: the compiler's output and the runtime's input, versioned. One plan describes
//! one device's program, or one shard's of a partitioned run (its strategy, micro-shards,
//! pipeline stages, tensor-parallel splits and ZeRO owners say which).

pub mod shards;
pub mod views;

use crate::dsl::Source;
use crate::ir::{Buffer, KernelKind, Memory};
use crate::ir::{Graph, Op, Phase, TensorType};
use serde::Serialize;

/// The plan's output that is the loss (a per-shard plan's is the sum over every shard).
pub const LOSS: &str = "loss";
/// The class labels input of a cross-entropy loss (-100: a position that does not count).
pub const LABELS: &str = "labels";
/// The target input of an MSE loss.
pub const TARGET: &str = "target";
/// The decode step's input: each sample's position, `[B]` (`passes::compile_decode`).
pub const POSITION: &str = "position";

/// The version of `plan.json`; raised whenever a field changes meaning or appears (2: a
/// partitioned plan records its ZeRO stage, pipeline schedule, device memory and experiment).
pub const PLAN_FORMAT: u32 = 2;
/// The oldest format still read: its fields are a subset, the new ones default.
pub const PLAN_FORMAT_OLDEST: u32 = 1;

/// Why a `plan.json` cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("not a Parallax plan: {0}")]
    Json(String),
    #[error("a plan of format {found}, and this Parallax reads formats {PLAN_FORMAT_OLDEST} to {PLAN_FORMAT}; compile the experiment again with this version")]
    Format { found: u64 },
}

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
/// How a pipeline orders its micro-batches (the cost model's choice, which a partitioned plan
/// records).
pub enum PipelineSchedule {
    /// No pipeline: micro-batches (if more than one) accumulate gradients one after another.
    #[serde(rename = "none")]
    Sequential,
    /// All forwards, then all backwards: every micro-batch's activations live at once.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward: stage `s` of `pp` holds at most `pp - s` micro-batches.
    #[serde(rename = "1f1b")]
    OneFOneB,
}

impl PipelineSchedule {
    pub fn name(self) -> &'static str {
        match self {
            PipelineSchedule::Sequential => "-",
            PipelineSchedule::GPipe => "gpipe",
            PipelineSchedule::OneFOneB => "1f1b",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Strategy {
    pub dp: u32,
    pub tp: u32,
    pub pp: u32,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<String>,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ParamInfo {
    pub name: String,
    pub shape: Vec<u64>,
    pub init: String,
}

impl TensorInfo {
    /// Node `n` of `g`, named `name`: its element type and symbolic shape.
    pub(crate) fn of(g: &Graph, name: &str, n: crate::ir::NodeIndex) -> TensorInfo {
        let names = g.sym_names();
        let t = &g.g[n].ty;
        TensorInfo {
            name: name.to_string(),
            dtype: t.dtype.name().to_string(),
            shape: t.shape.iter().map(|d| d.show(&names)).collect(),
        }
    }
}

/// How the plan splits layers over tensor-parallel ranks.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct TensorParallel {
    pub degree: u32,
    /// Each parameter and optimizer state that is one rank's slice (by name), and the axis
    /// the slices are cut along; the rest are whole on every rank.
    pub splits: Vec<(String, usize)>,
}

impl TensorParallel {
    pub fn axis_of(&self, name: &str) -> Option<usize> {
        self.splits.iter().find(|s| s.0 == name).map(|s| s.1)
    }
}

/// One op of the plan, in execution order; operands are earlier steps' ids.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Step {
    pub id: usize,
    pub op: Op,
    pub operands: Vec<usize>,
    #[serde(rename = "type")]
    pub ty: TensorType,
    pub layer: String,
    pub phase: Phase,
    /// Where its value lives (none for values that stay inside their kernel).
    pub buffer: Option<usize>,
    /// The pipeline stage that computes (or, for a source, holds) it.
    pub stage: u32,
    /// The one data-parallel rank that computes (or holds) it under ZeRO-1; none: every rank.
    pub owner: Option<u32>,
}

/// A named step: an output of the model, or the loss.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Named {
    pub name: String,
    pub step: usize,
}

/// A kernel of the plan: its steps in order, and those whose values are stored.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct PlanKernel {
    pub kind: KernelKind,
    pub steps: Vec<usize>,
    pub stored: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Plan {
    pub format: u32,
    pub name: String,
    /// GPUs asked for (`--gpus` or the file's `devices`).
    pub gpus_requested: u32,
    pub device_kind: String,
    pub strategy: Strategy,
    /// The batch this plan runs: the file's, or one micro-shard's when `sharding` is set.
    pub batch_size: u64,
    /// Set when the plan is one micro-shard's part of data parallelism.
    pub sharding: Option<crate::shards::Sharding>,
    /// Set when the plan is one tensor-parallel rank's part.
    pub tensor_parallel: Option<TensorParallel>,
    /// Pipeline stages (1: none).
    pub pipeline_stages: u32,
    /// Data-parallel ranks the optimizer state is sharded over (1: none).
    pub optimizer_shards: u32,
    pub parameters: u64,
    pub layers: usize,
    pub flops_per_sample: u64,
    /// Per device, in bytes, at `batch_size`, from the schedule pass.
    pub memory: Memory,
    /// Ops that compute something (sources excluded): the kernel count before fusion.
    pub ops: usize,
    pub kernels: Vec<PlanKernel>,
    pub buffers: Vec<Buffer>,
    pub inputs: Vec<TensorInfo>,
    pub outputs: Vec<TensorInfo>,
    pub params: Vec<ParamInfo>,
    /// The symbols (`B` first) and their nominal sizes.
    pub symbols: Vec<(String, u64)>,
    pub steps: Vec<Step>,
    pub output_steps: Vec<Named>,
    /// `(parameter step, gradient step)`
    pub grads: Vec<(usize, usize)>,
    /// `(persistent step, new value step)`: copied over at the end of a training step.
    pub updates: Vec<(usize, usize)>,
    /// Parameters and optimizer state whose shape in files (`--init`, `final.safetensors`,
    /// checkpoints) is not the plan's, by name, and that shape: PyTorch's layout, the same
    /// elements in the same order (read by the runtime's `weights::FileShapes`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub file_shapes: Vec<(String, Vec<u64>)>,
    /// Rewrites a backend may take, with the same bits (folded permutes, scaled softmax).
    #[serde(default, skip_serializing_if = "views::Views::is_empty")]
    pub views: views::Views,
    /// ZeRO stage over the data-parallel ranks (0: none; 1 shards the optimizer state, 2 the
    /// reduced gradients too, 3 the parameters too).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub zero_stage: u8,
    /// The pipeline schedule chosen with the split (set on a partitioned plan).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<PipelineSchedule>,
    /// Each device's memory, in bytes, that the split was chosen for (a partitioned plan's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_memory_bytes: Option<u64>,
    /// The experiment the plan was compiled from, as RON with every default and override
    /// resolved (set by `compile --emit plan`, so that `train --plan` needs nothing else).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experiment: Option<String>,
}

fn is_zero(z: &u8) -> bool {
    *z == 0
}

/// The named sources of a plan: `(name, step)` in plan order.
#[derive(Debug, Clone, Default)]
pub struct Names {
    pub inputs: Vec<(String, usize)>,
    pub params: Vec<(String, usize)>,
    pub states: Vec<(String, usize)>,
    pub outputs: Vec<(String, usize)>,
}

impl Plan {
    /// Whether the plan stores activations in bf16 (`devices.activations: Bf16`).
    pub fn bf16_activations(&self) -> bool {
        self.buffers
            .iter()
            .any(|b| b.dtype == crate::ir::DType::BF16)
    }

    /// Whether step `step`'s value is stored in a bf16 buffer.
    pub fn stored_in_bf16(&self, step: usize) -> bool {
        self.steps[step]
            .buffer
            .is_some_and(|b| self.buffers[b].dtype == crate::ir::DType::BF16)
    }

    /// Whether output step `step` still holds its value after a training (or gradients)
    /// step: not when a later step of the backward or the update shares its buffer (a
    /// cross-entropy's logits, which their gradient is written over). An eval step runs the
    /// forward kernels only and keeps every output.
    pub fn kept_after_training(&self, step: usize) -> bool {
        let Some(b) = self.steps[step].buffer else {
            return true;
        };
        !self
            .steps
            .iter()
            .any(|s| s.id != step && s.buffer == Some(b) && s.phase != crate::ir::Phase::Forward)
    }

    /// A step's shape with the batch set to `batch` and other symbols at their nominal sizes.
    pub fn shape_at(&self, shape: &[crate::ir::Dim], batch: u64) -> Vec<u64> {
        shape
            .iter()
            .map(|d| {
                d.eval(&|s| {
                    if s.0 == 0 {
                        batch
                    } else {
                        self.symbols.get(s.0 as usize).map_or(1, |x| x.1)
                    }
                })
            })
            .collect()
    }

    /// Whether input `name` holds one row per sample (its first axis is the batch's symbol).
    pub fn is_batched(&self, name: &str) -> bool {
        let batch = crate::ir::Dim::sym(crate::ir::dim::BATCH);
        self.steps.iter().any(|s| {
            matches!(&s.op, Op::Input { name: n, .. } if n == name)
                && s.ty.shape.first() == Some(&batch)
        })
    }

    /// The plan as `plan.json` holds it.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a plan serialises") + "\n"
    }

    /// A plan from `plan.json` text, of this version's format only: what another process
    /// (a rank, a tool) runs without compiling the experiment again.
    pub fn from_json(text: &str) -> Result<Plan, PlanError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| PlanError::Json(e.to_string()))?;
        match value["format"].as_u64() {
            Some(f) if (u64::from(PLAN_FORMAT_OLDEST)..=u64::from(PLAN_FORMAT)).contains(&f) => {}
            Some(found) => return Err(PlanError::Format { found }),
            None => return Err(PlanError::Json("no `format` field".into())),
        }
        serde_json::from_value(value).map_err(|e| PlanError::Json(e.to_string()))
    }

    /// The steps that hold one constant value, `(step, value)`: refilled for each batch size.
    pub fn fills(&self) -> Vec<(usize, f32)> {
        self.steps
            .iter()
            .filter_map(|s| match s.op {
                Op::Fill { value, .. } => Some((s.id, value as f32)),
                _ => None,
            })
            .collect()
    }

    /// The steps holding the `training` flag: 1 in a step that trains or computes gradients,
    /// 0 in an evaluation (set by the executor before each step).
    pub fn training_flags(&self) -> Vec<usize> {
        self.steps
            .iter()
            .filter(|s| s.op == Op::Training)
            .map(|s| s.id)
            .collect()
    }

    /// The pipeline stage of each kernel (every step of a kernel is on one stage).
    pub fn kernel_stages(&self) -> Vec<u32> {
        self.kernels
            .iter()
            .map(|k| self.steps[k.steps[0]].stage)
            .collect()
    }

    /// The kernels the device of data-parallel `rank` on pipeline `stage` runs; `None` when
    /// every device runs every kernel (no pipeline, no sharded optimizer).
    pub fn kernel_mask(&self, stage: u32, rank: u32) -> Option<Vec<bool>> {
        if self.pipeline_stages <= 1 && self.optimizer_shards <= 1 {
            return None;
        }
        Some(
            self.kernels
                .iter()
                .map(|k| {
                    let last = &self.steps[*k.steps.last().expect("a kernel has steps")];
                    let here = self.pipeline_stages <= 1 || last.stage == stage;
                    here && last.owner.is_none_or(|o| o == rank)
                })
                .collect(),
        )
    }

    /// The steps whose values the kernels marked in `owned` read or write (every step when
    /// `None`): what a device running only those kernels (a pipeline stage) holds.
    pub fn steps_touched(&self, owned: Option<&[bool]>) -> Vec<bool> {
        let Some(owned) = owned else {
            return vec![true; self.steps.len()];
        };
        let mut touched = vec![false; self.steps.len()];
        for (k, kern) in self.kernels.iter().enumerate() {
            if owned.get(k).copied().unwrap_or(false) {
                for &s in &kern.steps {
                    touched[s] = true;
                    // A transfer's or broadcast's operand lives on the sender.
                    if matches!(self.steps[s].op, Op::Transfer { .. } | Op::Broadcast { .. }) {
                        continue;
                    }
                    for &o in &self.steps[s].operands {
                        touched[o] = true;
                    }
                }
            }
        }
        touched
    }

    /// Elements each buffer needs at `batch` to hold the `touched` steps assigned to it.
    pub fn buffer_elements(&self, touched: &[bool], batch: u64) -> Vec<u64> {
        let mut elements = vec![0u64; self.buffers.len()];
        for s in &self.steps {
            if let (Some(b), true) = (s.buffer, touched[s.id]) {
                // Saturating, so an absurd batch gives an absurd size to refuse, not a panic.
                let n = self
                    .shape_at(&s.ty.shape, batch)
                    .iter()
                    .fold(1u64, |a, &d| a.saturating_mul(d));
                elements[b] = elements[b].max(n);
            }
        }
        elements
    }

    /// Elements of the host executor's staging buffer at `batch`: the input of a fused
    /// reduction, or a matmul result that only its epilogue reads.
    pub fn scratch_elements(&self, batch: u64) -> u64 {
        let numel = |id: usize| {
            self.shape_at(&self.steps[id].ty.shape, batch)
                .iter()
                .fold(1u64, |a, &d| a.saturating_mul(d))
        };
        self.kernels
            .iter()
            .flat_map(|k| crate::ir::kernels::members_of(k.kind, &k.steps))
            .filter_map(|(kind, steps)| match kind {
                KernelKind::ElementwiseReduce => steps.iter().rev().nth(1).map(|&s| numel(s)),
                KernelKind::Gemm { .. } if self.steps[steps[0]].buffer.is_none() => {
                    Some(numel(steps[0]))
                }
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Its inputs, parameters, optimizer state and outputs by name.
    pub fn names(&self) -> Names {
        let mut n = Names::default();
        for s in &self.steps {
            match &s.op {
                Op::Input { name, .. } => n.inputs.push((name.clone(), s.id)),
                Op::Param { name, .. } => n.params.push((name.clone(), s.id)),
                Op::State { name, .. } => n.states.push((name.clone(), s.id)),
                _ => {}
            }
        }
        n.outputs = self
            .output_steps
            .iter()
            .map(|o| (o.name.clone(), o.step))
            .collect();
        n
    }
}

pub(crate) fn sat(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// What `parallax check` reports.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Summary {
    pub name: String,
    pub parameters: u64,
    pub layers: usize,
    /// Forward FLOPs for one sample (symbols at their nominal sizes).
    pub flops_per_sample: u64,
    pub ops: usize,
    pub inputs: Vec<TensorInfo>,
    pub outputs: Vec<TensorInfo>,
}

/// `1,234,567`
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `1.23 GFLOP`, `512 KiB`-style scaling with SI units.
pub fn si(n: u64, unit: &str) -> String {
    let units = ["", "K", "M", "G", "T", "P", "E"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1000.0 && i + 1 < units.len() {
        v /= 1000.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} {unit}")
    } else {
        format!("{v:.2} {}{unit}", units[i])
    }
}

/// Bytes in binary units: `1.50 GiB`.
pub fn bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", units[i])
    }
}

impl Summary {
    pub fn of(g: &Graph, source: &Source) -> Summary {
        Summary {
            name: source.experiment.name.clone(),
            parameters: sat(g.parameter_count()),
            layers: g.layers,
            flops_per_sample: sat(g.flops(1, crate::ir::Phase::Forward)),
            ops: g.g.node_count(),
            inputs: g
                .inputs
                .iter()
                .filter_map(|&n| match &g.g[n].op {
                    crate::ir::Op::Input { name, .. } => Some(TensorInfo::of(g, name, n)),
                    _ => None,
                })
                .collect(),
            outputs: g
                .outputs
                .iter()
                .map(|(k, n)| TensorInfo::of(g, k, *n))
                .collect(),
        }
    }

    /// What `parallax check --format json` prints: the summary, with `"ok": true`.
    pub fn json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("a summary serialises");
        v["ok"] = serde_json::Value::Bool(true);
        v
    }

    pub fn line(&self) -> String {
        format!(
            "{}: ok: {} parameters, {} layers, {} per sample (forward), {} ops",
            self.name,
            thousands(self.parameters),
            self.layers,
            si(self.flops_per_sample, "FLOP"),
            self.ops
        )
    }
}
