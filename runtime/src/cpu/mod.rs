//! The CPU executor: runs a compiled plan step by step with the kernels of `kernels`. It is
//! the oracle every other plan is checked against. Every buffer is allocated once, sized for
//! the largest batch; a smaller batch reshapes within that room.

pub mod kernels;
pub mod tensor;

use crate::rng;
use kernels::{execute, Ctx, KernelError};
use parallax_compiler::ir::{Init, Op, Phase};
use parallax_compiler::Plan;
use std::collections::HashMap;
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

pub struct Executor {
    plan: Plan,
    values: Vec<Tensor>,
    max_batch: usize,
    seed: u64,
    inputs: HashMap<String, usize>,
    outputs: HashMap<String, usize>,
    params: Vec<(String, usize)>,
    /// Seconds and calls per op name, when profiling.
    profile: Option<HashMap<&'static str, (f64, u64)>>,
}

static EMPTY: Tensor = Tensor {
    data: Data::F32(Vec::new()),
    shape: Vec::new(),
};

impl Executor {
    /// Allocates every buffer for batches up to `max_batch` and initialises the parameters
    /// from `seed` (keyed by parameter index, so the same on any machine).
    pub fn new(plan: Plan, max_batch: usize, seed: u64) -> Executor {
        let max_batch = max_batch.max(1);
        let values = plan
            .steps
            .iter()
            .map(|s| {
                let shape = resolve(&plan, &s.ty.shape, max_batch);
                let n = tensor::numel(&shape);
                Tensor::with_capacity(s.ty.dtype, shape, n)
            })
            .collect();
        let mut inputs = HashMap::new();
        let mut params = Vec::new();
        for s in &plan.steps {
            match &s.op {
                Op::Input { name, .. } => {
                    inputs.insert(name.clone(), s.id);
                }
                Op::Param { name, .. } => params.push((name.clone(), s.id)),
                _ => {}
            }
        }
        let outputs = plan
            .output_steps
            .iter()
            .map(|o| (o.name.clone(), o.step))
            .collect();
        let mut e = Executor {
            plan,
            values,
            max_batch,
            seed,
            inputs,
            outputs,
            params,
            profile: None,
        };
        e.init_params();
        e
    }

    fn init_params(&mut self) {
        for (index, (_, id)) in self.params.iter().enumerate() {
            let Op::Param { init, .. } = &self.plan.steps[*id].op else {
                continue;
            };
            let key = rng::stream(self.seed, rng::Purpose::Init, index as u64);
            let v = self.values[*id].f32_mut();
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
    }

    /// Starts timing every kernel (a little overhead per step).
    pub fn enable_profile(&mut self) {
        self.profile = Some(HashMap::new());
    }

    /// Seconds and calls per op, slowest first.
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
            .map(|(n, id)| (n.as_str(), &self.values[*id]))
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
        let t = &mut self.values[id];
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
        let shape = resolve(&self.plan, &self.plan.steps[id].ty.shape, batch);
        let t = &mut self.values[id];
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
    pub fn has_input(&self, name: &str) -> bool {
        self.inputs.contains_key(name)
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
        let ctx = Ctx {
            seed: self.seed,
            step,
            training: mode != Mode::Eval,
            first_sample,
        };
        for i in 0..self.plan.steps.len() {
            let s = &self.plan.steps[i];
            if s.op.is_source() && !matches!(s.op, Op::Fill { .. }) {
                continue;
            }
            let wanted = match mode {
                Mode::Train => true,
                Mode::Gradients => s.phase != Phase::Update,
                Mode::Eval => s.phase == Phase::Forward,
            };
            if !wanted {
                continue;
            }
            let shape = resolve(&self.plan, &s.ty.shape, batch);
            let (before, after) = self.values.split_at_mut(i);
            let out = &mut after[0];
            out.reshape_in_place(&shape);
            let get = |k: usize| s.operands.get(k).map_or(&EMPTY, |&o| &before[o]);
            let ins = [get(0), get(1), get(2)];
            let t = self.profile.is_some().then(std::time::Instant::now);
            execute(&s.op, &ins[..s.operands.len()], out, &ctx).map_err(|source| {
                ExecError::Kernel {
                    step: i,
                    op: s.op.name(),
                    layer: s.layer.clone(),
                    source,
                }
            })?;
            if let (Some(t), Some(p)) = (t, self.profile.as_mut()) {
                let e = p.entry(s.op.name()).or_insert((0.0, 0));
                e.0 += t.elapsed().as_secs_f64();
                e.1 += 1;
            }
        }
        if mode == Mode::Train {
            for &(p, u) in &self.plan.updates {
                let (lo, hi) = if p < u {
                    let (a, b) = self.values.split_at_mut(u);
                    (&mut a[p], &b[0])
                } else {
                    let (a, b) = self.values.split_at_mut(p);
                    (&mut b[0], &a[u])
                };
                lo.f32_mut().copy_from_slice(hi.f32());
            }
        }
        Ok(())
    }

    /// A named output (`loss`, the model's outputs) after `run`.
    pub fn output(&self, name: &str) -> Option<&Tensor> {
        self.outputs.get(name).map(|&id| &self.values[id])
    }

    /// Any step's value after `run` (tests read gradients this way).
    pub fn value(&self, step: usize) -> &Tensor {
        &self.values[step]
    }

    /// Each parameter's name, value and gradient (after a `Train` or `Gradients` run).
    pub fn gradients(&self) -> Vec<(&str, &Tensor, &Tensor)> {
        self.plan
            .grads
            .iter()
            .filter_map(|&(p, g)| {
                let name = self.params.iter().find(|(_, id)| *id == p)?.0.as_str();
                Some((name, &self.values[p], &self.values[g]))
            })
            .collect()
    }

    /// A parameter's values, to perturb (gradient checks).
    pub fn param_mut(&mut self, name: &str) -> Option<&mut [f32]> {
        let id = self.params.iter().find(|(n, _)| n == name)?.1;
        Some(self.values[id].f32_mut())
    }
}

/// A type's shape with the batch set to `batch` and other symbols at their nominal sizes.
fn resolve(plan: &Plan, shape: &[parallax_compiler::ir::Dim], batch: usize) -> Vec<usize> {
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
