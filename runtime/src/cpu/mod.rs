//! The CPU executor: runs a compiled plan step by step with the kernels of `kernels`. It is
//! the oracle every other plan is checked against. Every buffer is allocated once, sized for
//! the largest batch; a smaller batch reshapes within that room.

pub mod fused;
pub mod kernels;
mod stepwise;
pub mod tensor;

use crate::rng;
use kernels::{execute, Ctx, KernelError};
use parallax_compiler::ir::{Init, Op, Phase};
use parallax_compiler::passes::fuse::KernelKind;
use parallax_compiler::Plan;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tensor::{Data, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("step {step} (`{op}` in layer `{layer}`): {source}")]
    Kernel {
        step: usize,
        op: &'static str,
        layer: String,
        source: KernelError,
    },
    #[error("the plan has no input named `{0}`")]
    UnknownInput(String),
    #[error("input `{name}`: expected {expected} values of {dtype}, got {got}")]
    InputSize {
        name: String,
        expected: usize,
        got: usize,
        dtype: &'static str,
    },
    #[error("the batch of {batch} is larger than the {max} the executor was sized for")]
    BatchTooLarge { batch: usize, max: usize },
    #[error("parameter `{name}`: {message}")]
    Param { name: String, message: String },
    /// From another backend behind the same interface (`backend::Backend`).
    #[error("{0}")]
    Device(String),
}

/// Training runs every step and applies the updates; `Gradients` runs the forward and
/// backward steps as training does but changes nothing (gradient checks); evaluation runs the
/// forward steps with dropout off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Train,
    Gradients,
    Eval,
}

impl Mode {
    /// Whether kernel `k` of `plan` runs in this mode (by the phase of its last step); every
    /// backend asks this.
    pub fn runs(self, plan: &Plan, k: usize) -> bool {
        let kern = &plan.kernels[k];
        let phase = plan.steps[*kern.steps.last().expect("a kernel has steps")].phase;
        match self {
            Mode::Train => true,
            Mode::Gradients => phase != Phase::Update,
            Mode::Eval => phase == Phase::Forward,
        }
    }
}

static EMPTY: Tensor = Tensor {
    data: Data::F32(Vec::new()),
    shape: Vec::new(),
};

pub struct Executor {
    plan: Arc<Plan>,
    /// Every step's shape at `shapes_batch` (recomputed only when the batch size changes).
    shapes: Vec<Vec<usize>>,
    shapes_batch: usize,
    /// Steps that fill a constant, refilled each step for its batch size.
    fills: Vec<(usize, f32)>,
    /// The fused ops of the kernel being run (kept to reuse its allocation).
    fused_ops: Vec<fused::FusedOp>,
    /// The plan's buffers: dedicated ones (parameters, state, inputs) and reused ones.
    buffers: Vec<Tensor>,
    /// Each step's buffer; `None` for values that stay inside their kernel.
    slot: Vec<Option<usize>>,
    /// Stages a fused reduction's input, or a matmul result its epilogue reads in place.
    scratch: Tensor,
    max_batch: usize,
    seed: u64,
    inputs: HashMap<String, usize>,
    outputs: HashMap<String, usize>,
    params: Vec<(String, usize)>,
    /// Optimizer state by name.
    states: Vec<(String, usize)>,
    /// Seconds and calls per kernel, when profiling.
    profile: Option<HashMap<&'static str, (f64, u64)>>,
    /// The steps whose values this executor holds (all, unless built for some kernels).
    needed: Vec<bool>,
}

impl Executor {
    /// Allocates every buffer of the plan for batches up to `max_batch` and initialises the
    /// parameters from `seed` (keyed by parameter index, so the same on any machine).
    pub fn new(plan: Plan, max_batch: usize, seed: u64) -> Executor {
        Executor::for_kernels(plan, max_batch, seed, None, 0)
    }

    /// Like `new`, but when `owned` is given, only for the kernels it marks (a pipeline
    /// stage): buffers that none of them reads or writes stay unallocated. A tensor-parallel
    /// plan's sliced parameters start as slice `tensor_rank` of the whole layer's.
    pub fn for_kernels(
        plan: Plan,
        max_batch: usize,
        seed: u64,
        owned: Option<&[bool]>,
        tensor_rank: usize,
    ) -> Executor {
        let max_batch = max_batch.max(1);
        let needed = plan.steps_touched(owned);
        let capacity: Vec<usize> = plan
            .buffer_elements(&needed, max_batch as u64)
            .into_iter()
            .map(|n| n as usize)
            .collect();
        let slot: Vec<Option<usize>> = plan.steps.iter().map(|s| s.buffer).collect();
        let mut buffers: Vec<Tensor> = plan
            .buffers
            .iter()
            .zip(&capacity)
            .map(|(b, &c)| Tensor::with_capacity(b.dtype, vec![c], c))
            .collect();
        // Sources keep their shapes: parameters and state for good, inputs until set.
        for s in &plan.steps {
            if let (true, Some(b), true) = (s.op.is_source(), s.buffer, needed[s.id]) {
                buffers[b].reshape_in_place(&resolve::<Vec<usize>>(&plan, &s.ty.shape, max_batch));
            }
        }
        let scratch_len = plan.scratch_elements(max_batch as u64) as usize;
        let scratch = Tensor::with_capacity(
            parallax_compiler::ir::DType::F32,
            vec![scratch_len],
            scratch_len,
        );
        let names = plan.names();
        let inputs: HashMap<String, usize> = names.inputs.into_iter().collect();
        let outputs: HashMap<String, usize> = names.outputs.into_iter().collect();
        let (params, states) = (names.params, names.states);
        let shapes = plan
            .steps
            .iter()
            .map(|s| resolve(&plan, &s.ty.shape, max_batch))
            .collect();
        let fills = plan.fills().into_iter().filter(|f| needed[f.0]).collect();
        let mut e = Executor {
            fills,
            plan: Arc::new(plan),
            shapes,
            shapes_batch: max_batch,
            fused_ops: Vec::new(),
            buffers,
            slot,
            scratch,
            max_batch,
            seed,
            inputs,
            outputs,
            params,
            states,
            profile: None,
            needed,
        };
        e.init_params(tensor_rank);
        e
    }

    /// Resolves every step's shape for `batch` (allocates only when the batch size changes).
    fn ensure_shapes(&mut self, batch: usize) {
        if self.shapes_batch != batch {
            for (shape, s) in self.shapes.iter_mut().zip(&self.plan.steps) {
                *shape = resolve(&self.plan, &s.ty.shape, batch);
            }
            self.shapes_batch = batch;
        }
    }

    /// Shapes step `step`'s buffer for the current batch.
    fn shape_buffer(&mut self, step: usize) {
        if let Some(b) = self.slot[step] {
            self.buffers[b].reshape_in_place(&self.shapes[step]);
        }
    }

    fn buf(&self, step: usize) -> &Tensor {
        &self.buffers[self.slot[step].expect("a stored value")]
    }

    fn buf_mut(&mut self, step: usize) -> &mut Tensor {
        &mut self.buffers[self.slot[step].expect("a stored value")]
    }

    fn init_params(&mut self, tensor_rank: usize) {
        for index in 0..self.params.len() {
            let (name, id) = self.params[index].clone();
            let Op::Param { init, .. } = self.plan.steps[id].op.clone() else {
                continue;
            };
            let seed = self.seed;
            let split = self.plan.tensor_parallel.as_ref().and_then(|tp| {
                let axis = tp.axis_of(&name)?;
                Some((axis, tp.degree as usize))
            });
            let buf = self.buf_mut(id);
            match split {
                Some((axis, parts)) if buf.numel() > 0 => {
                    let mut shape = buf.shape.clone();
                    shape[axis] *= parts;
                    let mut full = vec![0.0; tensor::numel(&shape)];
                    init_param(&init, seed, index, &mut full);
                    let part = tensor::slice_part(&full, &shape, axis, parts, tensor_rank);
                    buf.f32_mut().copy_from_slice(&part);
                }
                _ => init_param(&init, seed, index, buf.f32_mut()),
            }
        }
    }

    /// Starts timing every kernel (a little overhead per step).
    pub fn enable_profile(&mut self) {
        self.profile = Some(HashMap::new());
    }

    /// Seconds and calls per kernel, slowest first.
    pub fn profile(&self) -> Vec<(&'static str, f64, u64)> {
        let mut v: Vec<_> = self
            .profile
            .iter()
            .flatten()
            .map(|(k, (s, n))| (*k, *s, *n))
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Parameters by name, in plan order.
    pub fn params(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.params
            .iter()
            .map(|(n, id)| (n.as_str(), self.buf(*id)))
    }

    /// Optimizer state (momenta, Adam's moments) by name, in plan order.
    pub fn states(&self) -> Vec<(&str, &Tensor)> {
        self.states
            .iter()
            .map(|(n, id)| (n.as_str(), self.buf(*id)))
            .collect()
    }

    /// Replaces an optimizer state's values (resuming from a checkpoint).
    pub fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), ExecError> {
        let id = self
            .states
            .iter()
            .find(|(n, _)| n == name)
            .map(|s| s.1)
            .ok_or_else(|| ExecError::Param {
                name: name.into(),
                message: "the model has no such optimizer state".into(),
            })?;
        let t = self.buf_mut(id);
        if t.numel() != values.len() {
            return Err(ExecError::Param {
                name: name.into(),
                message: format!("{} values given, {} expected", values.len(), t.numel()),
            });
        }
        t.f32_mut().copy_from_slice(values);
        Ok(())
    }

    /// Replaces a parameter's values (for `--init`); the shape must match.
    pub fn set_param(
        &mut self,
        name: &str,
        shape: &[usize],
        values: &[f32],
    ) -> Result<(), ExecError> {
        let Some(&(_, id)) = self.params.iter().find(|(n, _)| n == name) else {
            return Err(ExecError::Param {
                name: name.into(),
                message: "the model has no such parameter".into(),
            });
        };
        let t = self.buf_mut(id);
        if t.shape != shape {
            return Err(ExecError::Param {
                name: name.into(),
                message: format!("shape {shape:?} does not match the model's {:?}", t.shape),
            });
        }
        t.f32_mut().copy_from_slice(values);
        Ok(())
    }

    fn input_slot(&mut self, name: &str, batch: usize) -> Result<&mut Tensor, ExecError> {
        let id = *self
            .inputs
            .get(name)
            .ok_or_else(|| ExecError::UnknownInput(name.into()))?;
        if batch > self.max_batch {
            return Err(ExecError::BatchTooLarge {
                batch,
                max: self.max_batch,
            });
        }
        // Only this input's shape: scalar inputs (the learning rate) are set with batch 1,
        // which must not make the next step recompute every shape.
        let shape: kernels::Small<usize> =
            resolve(&self.plan, &self.plan.steps[id].ty.shape, batch);
        let t = self.buf_mut(id);
        t.reshape_in_place(&shape);
        Ok(t)
    }

    /// Sets an f32 input for a batch of `batch` samples.
    pub fn set_f32(&mut self, name: &str, batch: usize, v: &[f32]) -> Result<(), ExecError> {
        let t = self.input_slot(name, batch)?;
        if !t.is_f32() || t.numel() != v.len() {
            return Err(ExecError::InputSize {
                name: name.into(),
                expected: t.numel(),
                got: v.len(),
                dtype: "f32",
            });
        }
        t.f32_mut().copy_from_slice(v);
        Ok(())
    }

    /// Sets an i32 input for a batch of `batch` samples.
    pub fn set_i32(&mut self, name: &str, batch: usize, v: &[i32]) -> Result<(), ExecError> {
        let t = self.input_slot(name, batch)?;
        if t.is_f32() || t.numel() != v.len() {
            return Err(ExecError::InputSize {
                name: name.into(),
                expected: t.numel(),
                got: v.len(),
                dtype: "i32",
            });
        }
        t.i32_mut().copy_from_slice(v);
        Ok(())
    }

    /// Whether the plan reads an input of this name (e.g. Adam's bias corrections).
    /// Whether the plan reads input `name` (in the kernels this executor runs).
    pub fn has_input(&self, name: &str) -> bool {
        self.inputs.get(name).is_some_and(|&s| self.needed[s])
    }

    /// Runs one step on a batch of `batch` samples whose first sample has index `first_sample`
    /// in the global batch. Training also replaces parameters and optimizer state.
    pub fn run(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), ExecError> {
        if batch > self.max_batch {
            return Err(ExecError::BatchTooLarge {
                batch,
                max: self.max_batch,
            });
        }
        let ctx = self.begin(batch, mode, step, first_sample);
        // The step runs on a worker of rayon's pool, so that each parallel kernel splits
        // among the workers directly instead of waking the pool from this thread and
        // sleeping until it is done; the other workers spin between kernels (see `Spin`).
        let this = SendPtr(self as *mut Executor);
        let spin = Spin::default();
        rayon::scope(|scope| {
            let this = this;
            // SAFETY: `self` is borrowed mutably for the whole scope, which ends before
            // `run` returns; only this closure touches it.
            let r = unsafe { &mut *this.0 }.run_kernels(mode, &ctx, &|| spin.top_up(scope));
            spin.done.store(true, Ordering::Release);
            r
        })?;
        self.finish(mode);
        Ok(())
    }

    fn run_kernels(
        &mut self,
        mode: Mode,
        ctx: &Ctx,
        before_kernel: &dyn Fn(),
    ) -> Result<(), ExecError> {
        for k in 0..self.plan.kernels.len() {
            if !self.wanted(k, mode) {
                continue;
            }
            before_kernel();
            let t = self.profile.is_some().then(std::time::Instant::now);
            self.run_kernel(k, ctx)?;
            if let (Some(t), Some(p)) = (t, self.profile.as_mut()) {
                let kern = &self.plan.kernels[k];
                let name = match kern.kind {
                    KernelKind::Single => self.plan.steps[kern.steps[0]].op.name(),
                    KernelKind::Elementwise => "fused elementwise",
                    KernelKind::ElementwiseReduce => "fused elementwise+reduce",
                    KernelKind::Gemm {
                        bias: false,
                        activation: None,
                    } => "matmul",
                    KernelKind::Gemm { .. } => "matmul+epilogue",
                };
                let e = p.entry(name).or_insert((0.0, 0));
                e.0 += t.elapsed().as_secs_f64();
                e.1 += 1;
            }
        }
        Ok(())
    }

    /// Sets up a step (shapes, constants) and returns the kernels' context.
    fn begin(&mut self, batch: usize, mode: Mode, step: u64, first_sample: u64) -> Ctx {
        self.ensure_shapes(batch);
        // Constants are sources too: fill them for this batch.
        for k in 0..self.fills.len() {
            let (step, value) = self.fills[k];
            self.shape_buffer(step);
            self.buf_mut(step).f32_mut().fill(value);
        }
        Ctx {
            seed: self.seed,
            step,
            training: mode != Mode::Eval,
            first_sample,
        }
    }

    /// Copies the new parameters and state over the old at the end of a training step (those
    /// not already written in place).
    fn finish(&mut self, mode: Mode) {
        if mode == Mode::Train {
            for i in 0..self.plan.updates.len() {
                let (p, u) = self.plan.updates[i];
                // Another pipeline stage's parameter: not held here.
                if !self.needed[u] {
                    continue;
                }
                let (bp, bu) = (self.slot[p].expect("stored"), self.slot[u].expect("stored"));
                // Written in place (see the schedule pass).
                if bp == bu {
                    continue;
                }
                let src = std::mem::take(&mut self.buffers[bu]);
                self.buffers[bp].f32_mut().copy_from_slice(src.f32());
                self.buffers[bu] = src;
            }
        }
    }

    /// Runs a step kernel by kernel, calling `after(k, self)` after each kernel that runs
    /// (lockstep comparisons with another backend).
    pub fn run_observed(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
        after: &mut dyn FnMut(usize, &mut Executor),
    ) -> Result<(), ExecError> {
        if batch > self.max_batch {
            return Err(ExecError::BatchTooLarge {
                batch,
                max: self.max_batch,
            });
        }
        let ctx = self.begin(batch, mode, step, first_sample);
        for k in 0..self.plan.kernels.len() {
            if self.wanted(k, mode) {
                self.run_kernel(k, &ctx)?;
                after(k, self);
            }
        }
        self.finish(mode);
        Ok(())
    }

    /// Whether kernel `k` runs in `mode`.
    pub fn wanted(&self, k: usize, mode: Mode) -> bool {
        mode.runs(&self.plan, k)
    }

    fn kernel_err(&self, step: usize, source: KernelError) -> ExecError {
        let s = &self.plan.steps[step];
        ExecError::Kernel {
            step,
            op: s.op.name(),
            layer: s.layer.clone(),
            source,
        }
    }

    /// Runs one op from its operands' buffers into `out` (its own buffer, or the scratch).
    fn run_single(&mut self, step: usize, ctx: &Ctx, into_scratch: bool) -> Result<(), ExecError> {
        self.shape_operands(step);
        // A reshape sharing its operand's buffer (see the schedule pass) is only a new shape.
        if !into_scratch && self.writes_over_operand(step) {
            if let Op::Reshape { .. } = self.plan.steps[step].op {
                self.shape_buffer(step);
                return Ok(());
            }
        }
        let mut out = if into_scratch {
            std::mem::take(&mut self.scratch)
        } else {
            std::mem::take(self.buf_mut(step))
        };
        out.reshape_in_place(&self.shapes[step]);
        let s = &self.plan.steps[step];
        let get = |k: usize| s.operands.get(k).map_or(&EMPTY, |&o| self.buf(o));
        let ins = [get(0), get(1), get(2)];
        let r = execute(&s.op, &ins[..s.operands.len()], &mut out, ctx);
        if into_scratch {
            self.scratch = out;
        } else {
            *self.buf_mut(step) = out;
        }
        r.map_err(|e| self.kernel_err(step, e))
    }

    fn run_kernel(&mut self, k: usize, ctx: &Ctx) -> Result<(), ExecError> {
        let plan = self.plan.clone();
        let kind = plan.kernels[k].kind;
        let steps = &plan.kernels[k].steps;
        match kind {
            // An update written over its operand (see the schedule pass) runs as a fused
            // kernel, which reads each element before writing it.
            KernelKind::Single
                if self.writes_over_operand(steps[0])
                    && fused::Kind::of(&plan.steps[steps[0]].op).is_some() =>
            {
                self.run_fused(steps, None, ctx, None)
            }
            KernelKind::Single => self.run_single(steps[0], ctx, false),
            KernelKind::Elementwise => self.run_fused(steps, None, ctx, None),
            KernelKind::Gemm { .. } => {
                let mm = steps[0];
                let staged = self.slot[mm].is_none();
                self.run_single(mm, ctx, staged)?;
                if steps.len() > 1 {
                    let source = if staged {
                        (self.scratch.f32().as_ptr(), self.scratch.numel())
                    } else {
                        let t = self.buf(mm);
                        (t.f32().as_ptr(), t.numel())
                    };
                    self.run_fused(&steps[1..], Some((mm, source)), ctx, None)?;
                }
                Ok(())
            }
            KernelKind::ElementwiseReduce => {
                let (&red, chain) = steps.split_last().expect("a reduction and its chain");
                let last = *chain.last().expect("a chain before the reduction");
                self.scratch.reshape_in_place(&self.shapes[last]);
                let stage = self.scratch.f32_mut().as_mut_ptr();
                self.run_fused(chain, None, ctx, Some((last, stage)))?;
                let mut out = std::mem::take(self.buf_mut(red));
                out.reshape_in_place(&self.shapes[red]);
                let r = execute(&self.plan.steps[red].op, &[&self.scratch], &mut out, ctx);
                *self.buf_mut(red) = out;
                r.map_err(|e| self.kernel_err(red, e))
            }
        }
    }

    /// Gives the operands' buffers their values' shapes: a buffer shared by a value and its
    /// reshapes holds the shape of the one last written.
    fn shape_operands(&mut self, step: usize) {
        for i in 0..self.plan.steps[step].operands.len() {
            self.shape_buffer(self.plan.steps[step].operands[i]);
        }
    }

    /// Whether step `step` is stored in the buffer of one of its operands.
    fn writes_over_operand(&self, step: usize) -> bool {
        let out = self.slot[step];
        out.is_some()
            && self.plan.steps[step]
                .operands
                .iter()
                .any(|&o| self.slot[o] == out)
    }

    /// Evaluates elementwise `steps` chunk by chunk. `given` are values already in memory
    /// (a matmul's result); `stage` also writes one value to a scratch buffer.
    fn run_fused(
        &mut self,
        steps: &[usize],
        given: Option<(usize, (*const f32, usize))>,
        ctx: &Ctx,
        stage: Option<(usize, *mut f32)>,
    ) -> Result<(), ExecError> {
        let last = *steps.last().expect("a kernel has steps");
        let shape = &self.shapes[last];
        let n = tensor::numel(shape);
        let per_sample = if shape.is_empty() {
            1
        } else {
            (n / shape[0].max(1)).max(1)
        };
        // Shape every stored output for this batch, and every operand read from memory,
        // before taking pointers into them.
        for &s in steps {
            self.shape_buffer(s);
            self.shape_operands(s);
        }
        let mut ops = std::mem::take(&mut self.fused_ops);
        ops.clear();
        for &s in steps {
            let st = &self.plan.steps[s];
            let mut operands = [fused::Source::Register(0); 2];
            for (j, &o) in st.operands.iter().enumerate().take(2) {
                operands[j] = if let Some(r) = steps.iter().position(|&x| x == o) {
                    fused::Source::Register(r)
                } else if let Some((_, (p, len))) = given.filter(|(g, _)| *g == o) {
                    fused::Source::Memory(p, len)
                } else {
                    let t = self.buf(o);
                    if !t.is_f32() {
                        return Err(self.kernel_err(
                            s,
                            KernelError::Bad {
                                op: st.op.name(),
                                message: "expects f32 operands".into(),
                            },
                        ));
                    }
                    fused::Source::Memory(t.f32().as_ptr(), t.numel().max(1))
                };
            }
            let store = match (self.slot[s], stage) {
                (Some(b), _) => Some(self.buffers[b].f32_mut().as_mut_ptr()),
                (None, Some((x, p))) if x == s => Some(p),
                _ => None,
            };
            let Some(kind) = fused::Kind::of(&st.op) else {
                return Err(self.kernel_err(
                    s,
                    KernelError::Bad {
                        op: st.op.name(),
                        message: "is not elementwise".into(),
                    },
                ));
            };
            ops.push(fused::FusedOp {
                kind,
                operands,
                store,
            });
        }
        // A staged value that is also stored is copied to the scratch after the pass.
        let copy_stage = stage.filter(|(x, _)| self.slot[*x].is_some());
        let r = fused::run(&ops, n, per_sample, ctx);
        self.fused_ops = ops;
        r.map_err(|e| self.kernel_err(last, e))?;
        if let Some((x, p)) = copy_stage {
            let src = self.buf(x).f32();
            // SAFETY: the scratch was shaped to this value's size; it is not the source buffer.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) };
        }
        Ok(())
    }

    /// A named output (`loss`, the model's outputs) after `run`.
    pub fn output(&self, name: &str) -> Option<&Tensor> {
        self.outputs.get(name).map(|&id| self.buf(id))
    }

    /// Replaces a step's stored value (lockstep comparisons resynchronise from the oracle).
    pub fn value_mut(&mut self, step: usize) -> Option<&mut Tensor> {
        let b = self.slot.get(step).copied().flatten()?;
        Some(&mut self.buffers[b])
    }

    /// A step's stored value after `run` (`None` for values kept inside a fused kernel).
    pub fn value(&self, step: usize) -> Option<&Tensor> {
        self.slot
            .get(step)
            .copied()
            .flatten()
            .map(|b| &self.buffers[b])
    }

    /// Each parameter's name, value and gradient (after a `Train` or `Gradients` run).
    pub fn gradients(&self) -> Vec<(&str, &Tensor, &Tensor)> {
        self.plan
            .grads
            .iter()
            .filter_map(|&(p, g)| {
                let name = self.params.iter().find(|(_, id)| *id == p)?.0.as_str();
                Some((name, self.buf(p), self.buf(g)))
            })
            .collect()
    }

    /// A parameter's values, to perturb (gradient checks).
    pub fn param_mut(&mut self, name: &str) -> Option<&mut [f32]> {
        let id = self.params.iter().find(|(n, _)| n == name)?.1;
        Some(self.buf_mut(id).f32_mut())
    }
}

/// The initial values of parameter number `index` (in plan order), keyed by (seed, index):
/// the same on every backend and machine.
pub fn init_param(init: &Init, seed: u64, index: usize, v: &mut [f32]) {
    let key = rng::stream(seed, rng::Purpose::Init, index as u64);
    match *init {
        Init::Uniform { bound } => {
            let b = bound as f32;
            for (i, x) in v.iter_mut().enumerate() {
                *x = (2.0 * rng::uniform(key, i as u64) - 1.0) * b;
            }
        }
        Init::Normal { std } => {
            let s = std as f32;
            for (i, x) in v.iter_mut().enumerate() {
                *x = rng::normal(key, i as u64) * s;
            }
        }
        Init::Zeros => v.fill(0.0),
        Init::Ones => v.fill(1.0),
    }
}

/// A type's shape with the batch set to `batch` and other symbols at their nominal sizes.
fn resolve<C: FromIterator<usize>>(
    plan: &Plan,
    shape: &[parallax_compiler::ir::Dim],
    batch: usize,
) -> C {
    shape
        .iter()
        .map(|d| {
            d.eval(&|s| {
                if s.0 == 0 {
                    batch as u64
                } else {
                    plan.symbols.get(s.0 as usize).map_or(1, |x| x.1)
                }
            }) as usize
        })
        .collect()
}

/// The executor, handed to the pool's worker that runs a step.
struct SendPtr(*mut Executor);
// SAFETY: see `Executor::run`: the pointee is exclusively borrowed while the worker uses it.
unsafe impl Send for SendPtr {}

/// Keeps the pool's other workers busy-waiting through a step, running any work they find,
/// instead of falling asleep between kernels: a sleeping worker wakes too late to take its
/// half of a product that lasts a millisecond (on 2 cores the MLP bench step took 6.1 ms
/// without spinners, 5.4 with, the mean of 5 interleaved runs each). OpenMP's threads,
/// PyTorch's, spin the same way. A spinner gives up after `IDLE` without work, so one picked
/// up by a worker that is itself waiting inside a kernel only delays that kernel; the step
/// tops them up before each kernel.
#[derive(Default)]
struct Spin {
    done: AtomicBool,
    active: AtomicUsize,
}

const IDLE: std::time::Duration = std::time::Duration::from_micros(500);

impl Spin {
    fn top_up<'s>(&'s self, scope: &rayon::Scope<'s>) {
        let others = rayon::current_num_threads().saturating_sub(1);
        while self.active.load(Ordering::Acquire) < others {
            self.active.fetch_add(1, Ordering::AcqRel);
            scope.spawn(move |_| self.spin());
        }
    }

    fn spin(&self) {
        let mut since = std::time::Instant::now();
        while !self.done.load(Ordering::Acquire) {
            if rayon::yield_now() == Some(rayon::Yield::Executed) {
                since = std::time::Instant::now();
            } else if since.elapsed() > IDLE {
                break;
            } else {
                std::hint::spin_loop();
            }
        }
        self.active.fetch_sub(1, Ordering::AcqRel);
    }
}
