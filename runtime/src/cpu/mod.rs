//! The CPU executor: runs a compiled plan step by step with the kernels of `kernels`. It is
//! the oracle every other plan is checked against. Every buffer is allocated once, sized for
//! the largest batch; a smaller batch reshapes within that room.

pub mod fused;
pub mod kernels;
mod run;
mod run_attention;
mod run_gemm;
mod run_rows;
pub mod spin;
mod stepwise;
mod storage;
mod views;

use crate::exec::finite::{Count, Kind, NonFinite};
pub use crate::exec::{tensor, ExecError, Mode};
use crate::rng;
use parallax_compiler::ir::Op;
use parallax_compiler::Plan;
use std::collections::HashMap;
use std::sync::Arc;
use tensor::{Data, Tensor};

/// Kernel timings (`Executor::enable_profile`).
struct Profile {
    /// Seconds and calls per kind of kernel.
    by_kind: HashMap<&'static str, (f64, u64)>,
    /// Seconds per kernel.
    by_kernel: Vec<f64>,
    /// Seconds of the epilogue pass of the matmul kernel that just ran (a bias added as the
    /// product is stored has none).
    epilogue: Option<f64>,
}

static EMPTY: Tensor = Tensor {
    data: Data::F32(Vec::new()),
    shape: Vec::new(),
    init: tensor::Initialized::NONE,
};

pub struct Executor {
    plan: Arc<Plan>,
    /// Every step's shape at `shapes_batch` (recomputed only when the batch size changes).
    shapes: Vec<Vec<usize>>,
    shapes_batch: usize,
    /// Steps that fill a constant, refilled each step for its batch size.
    fills: Vec<(usize, f32)>,
    /// Steps holding the `training` flag, set before each step by its mode.
    training_flags: Vec<usize>,
    /// The fused ops of the kernel being run (kept to reuse its allocation).
    fused_ops: fused::OpsCache,
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
    /// State by name: the optimizer's, BatchNorm's running statistics.
    states: Vec<(String, usize)>,
    /// Seconds and calls per kernel, when profiling.
    profile: Option<Profile>,
    /// The steps whose values this executor holds (all, unless built for some kernels).
    needed: Vec<bool>,
    /// Permutes written by the kernel of their operand (see `views`).
    folds: views::Folds,
    /// What `first_non_finite` scans, in its order: each gradient (named by its parameter),
    /// each parameter, each state, with the step holding it (listed once, so a scan
    /// allocates nothing).
    checked: Vec<(Kind, String, usize)>,
    /// The mode of the last step begun (`None` before the first).
    last_mode: Option<Mode>,
    /// Steps of the running kernel already rounded to bf16 as they were stored (a fused
    /// chain's, a product its epilogue reads), so the kernel's end leaves them alone.
    rounded: Vec<bool>,
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
        let checked = checked(&plan, &params, &states);
        let shapes = plan
            .steps
            .iter()
            .map(|s| resolve(&plan, &s.ty.shape, max_batch))
            .collect();
        let fills = plan.fills().into_iter().filter(|f| needed[f.0]).collect();
        let training_flags = plan
            .training_flags()
            .into_iter()
            .filter(|&s| needed[s])
            .collect();
        // A pipeline stage's kernels are a part of the plan: fold nothing.
        let folds = match owned {
            None => views::Folds::of(&plan),
            Some(_) => views::Folds::none(&plan),
        };
        let plan_steps = plan.steps.len();
        let mut e = Executor {
            folds,
            fills,
            training_flags,
            plan: Arc::new(plan),
            shapes,
            shapes_batch: max_batch,
            fused_ops: fused::OpsCache::default(),
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
            checked,
            last_mode: None,
            rounded: vec![false; plan_steps],
        };
        e.init_params(tensor_rank);
        e
    }

    /// How many permutes are written by the kernel of their operand (see `views`): their
    /// own kernels do nothing, except in `run_observed`.
    pub fn folded_permutes(&self) -> usize {
        self.folds.skipped.iter().filter(|&&s| s).count()
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
                    rng::init_param(&init, seed, index, &mut full);
                    let part = tensor::slice_part(&full, &shape, axis, parts, tensor_rank);
                    buf.f32_mut().copy_from_slice(&part);
                }
                _ => rng::init_param(&init, seed, index, buf.f32_mut()),
            }
        }
        for index in 0..self.states.len() {
            let id = self.states[index].1;
            if let Op::State { start, .. } = self.plan.steps[id].op {
                self.buf_mut(id).f32_mut().fill(start as f32);
            }
        }
    }

    /// Starts timing every kernel (a little overhead per step).
    pub fn enable_profile(&mut self) {
        self.profile = Some(Profile {
            by_kind: HashMap::new(),
            by_kernel: vec![0.0; self.plan.kernels.len()],
            epilogue: None,
        });
    }

    /// Seconds and calls per kind of kernel, slowest first. A matmul's epilogue pass (an
    /// activation, or a bias the product could not add) counts apart from the product
    /// (`epilogue of a matmul`).
    pub fn profile(&self) -> Vec<(&'static str, f64, u64)> {
        let mut v: Vec<_> = self
            .profile
            .iter()
            .flat_map(|p| &p.by_kind)
            .map(|(k, (s, n))| (*k, *s, *n))
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    /// Seconds spent in each kernel of the plan since profiling started, as `run` runs it
    /// (folded permutes included); empty when not profiling.
    pub fn kernel_seconds(&self) -> &[f64] {
        self.profile.as_ref().map_or(&[], |p| &p.by_kernel)
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

    /// Replaces a state's values (resuming from a checkpoint, loading running statistics).
    pub fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), ExecError> {
        let t = self.buf_mut(id_of(&self.states, "state", name)?);
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
        let t = self.buf_mut(id_of(&self.params, "parameter", name)?);
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
        let expected = t.numel();
        copy_in(name, expected, t.is_f32().then(|| t.f32_mut()), v, "f32")
    }

    /// Sets an i32 input for a batch of `batch` samples.
    pub fn set_i32(&mut self, name: &str, batch: usize, v: &[i32]) -> Result<(), ExecError> {
        let t = self.input_slot(name, batch)?;
        let expected = t.numel();
        copy_in(name, expected, (!t.is_f32()).then(|| t.i32_mut()), v, "i32")
    }

    /// Whether the plan reads an input of this name (e.g. Adam's bias corrections).
    /// Whether the plan reads input `name` (in the kernels this executor runs).
    pub fn has_input(&self, name: &str) -> bool {
        self.inputs.get(name).is_some_and(|&s| self.needed[s])
    }

    /// A named output (`loss`, the model's outputs) after `run`; `None` also for an output
    /// the last step did not keep (see `output_kept`).
    pub fn output(&self, name: &str) -> Option<&Tensor> {
        self.output_kept(name).ok().flatten()
    }

    /// A named output after `run`, refused when the last step was a training step that
    /// wrote over it (`Plan::kept_after_training`: a cross-entropy's logits).
    pub fn output_kept(&self, name: &str) -> Result<Option<&Tensor>, ExecError> {
        let Some(&id) = self.outputs.get(name) else {
            return Ok(None);
        };
        if self.last_mode != Some(Mode::Eval) && !self.plan.kept_after_training(id) {
            return Err(ExecError::OutputNotKept(name.to_string()));
        }
        Ok(Some(self.buf(id)))
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

    /// What [`Executor::first_non_finite`] scans, in its order: each gradient (named by its
    /// parameter), each parameter, each state, with the step holding it.
    pub fn checked(&self) -> &[(Kind, String, usize)] {
        &self.checked
    }

    /// Step `step`'s f32 value, if this executor holds it (a pipeline stage holds only what
    /// its kernels touch).
    pub fn held_f32(&self, step: usize) -> Option<&[f32]> {
        let t = self.value(step)?;
        (self.needed[step] && t.is_f32()).then(|| t.f32())
    }

    /// The first gradient, parameter or state (in that order, each in plan order) holding a
    /// NaN or an infinity, scanned in place. Gradients are read as the last `Train` or
    /// `Gradients` run left them: an `Eval` run may have reused their buffers since.
    pub fn first_non_finite(&self) -> Option<NonFinite> {
        self.checked.iter().find_map(|(kind, name, step)| {
            let count = Count::of(self.held_f32(*step)?)?;
            Some(NonFinite {
                kind: *kind,
                name: name.clone(),
                count,
            })
        })
    }

    /// A parameter's values, to perturb (gradient checks).
    pub fn param_mut(&mut self, name: &str) -> Option<&mut [f32]> {
        let id = self.params.iter().find(|(n, _)| n == name)?.1;
        Some(self.buf_mut(id).f32_mut())
    }
}

/// What `first_non_finite` scans (see `Executor::checked`).
fn checked(
    plan: &Plan,
    params: &[(String, usize)],
    states: &[(String, usize)],
) -> Vec<(Kind, String, usize)> {
    let grads = plan.grads.iter().filter_map(|&(p, g)| {
        let name = &params.iter().find(|(_, id)| *id == p)?.0;
        Some((Kind::Gradient, name.clone(), g))
    });
    let params = params
        .iter()
        .map(|(n, id)| (Kind::Parameter, n.clone(), *id));
    let states = states.iter().map(|(n, id)| (Kind::State, n.clone(), *id));
    grads.chain(params).chain(states).collect()
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

/// The buffer of `name` among the model's parameters or states (`named`, `what`).
fn id_of(named: &[(String, usize)], what: &str, name: &str) -> Result<usize, ExecError> {
    match named.iter().find(|(n, _)| n == name) {
        Some(&(_, id)) => Ok(id),
        None => Err(ExecError::Param {
            name: name.into(),
            message: format!("the model has no such {what}"),
        }),
    }
}

/// Copies an input's values `v` into its buffer (`None`: the input holds the other type),
/// which holds `expected` values.
fn copy_in<T: Copy>(
    name: &str,
    expected: usize,
    dst: Option<&mut [T]>,
    v: &[T],
    dtype: &'static str,
) -> Result<(), ExecError> {
    match dst {
        Some(dst) if expected == v.len() => {
            dst.copy_from_slice(v);
            Ok(())
        }
        _ => Err(ExecError::InputSize {
            name: name.into(),
            expected,
            got: v.len(),
            dtype,
        }),
    }
}
