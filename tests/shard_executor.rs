//! The devices' code is generic over the executor of a micro-shard (`ShardExecutor`): the
//! CPU executor for simulated devices, the CUDA executor for GPU ranks. Checked here with an
//! executor that wraps the CPU one and copies every value through its own buffers, as a
//! GPU executor does: the same bits as the CPU devices on data and pipeline grids, and a
//! read that fails on one device fails the step on every device, at once, naming it.

mod common;
use common::plan_of;

use parallax_compiler::{parse_bytes, Options, Plan};
use parallax_runtime::backend::{Backend, ParamValues};
use parallax_runtime::comm::collective::{total, Partial};
use parallax_runtime::cpu::kernels::Ctx;
use parallax_runtime::cpu::{Executor, Mode};
use parallax_runtime::data::Values;
use parallax_runtime::exec::finite::{Kind, NonFinite};
use parallax_runtime::exec::tensor::Tensor;
use parallax_runtime::exec::{DeviceSum, ExecError, RankExecutor, SumCall};
use parallax_runtime::ranks::{Grid, Ranks, ShardExecutor};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const TINY: &str = r#"Experiment(
    name: "tiny",
    model: Sequential(input: (shape: [4]), layers: [Linear(out: 8), Relu, Linear(out: 8), Relu, Linear(out: 3)]),
    loss: CrossEntropy,
    data: Synthetic(samples: 8),
    optimizer: Adam(lr: 0.01),
    train: (batch_size: 8, steps: 1, seed: 1),
    devices: (micro_shards: 4),
)"#;

/// The CPU executor behind copies, failing every read from train step `fail_at` on.
struct Copied {
    inner: Executor,
    fail_at: Option<u64>,
    step: u64,
}

impl RankExecutor for Copied {
    type Ctx = Ctx;
    type Persistent = Vec<Tensor>;
    fn begin_step(&mut self, b: usize, m: Mode, step: u64, s: u64) -> Result<Ctx, ExecError> {
        self.step = step;
        self.inner.begin_step(b, m, step, s)
    }
    fn run_kernel(&mut self, k: usize, ctx: &Ctx) -> Result<(), ExecError> {
        self.inner.run_kernel(k, ctx)
    }
    fn read(&self, step: usize) -> Result<Option<Vec<f32>>, ExecError> {
        if self.fail_at.is_some_and(|at| self.step >= at) {
            return Err(ExecError::Device(format!(
                "copying step {step} to the host failed (planted)"
            )));
        }
        RankExecutor::read(&self.inner, step)
    }
    fn write(&mut self, step: usize, values: &[f32]) -> Result<(), ExecError> {
        // Through a buffer of its own, as a copy to a device is.
        let copy = values.to_vec();
        self.inner.write(step, &copy)
    }
    fn finish_step(&mut self, mode: Mode) -> Result<(), ExecError> {
        RankExecutor::finish_step(&mut self.inner, mode)
    }
    fn take_persistent(&mut self) -> Vec<Tensor> {
        self.inner.take_persistent()
    }
    fn put_persistent(&mut self, p: Vec<Tensor>) -> Result<(), ExecError> {
        RankExecutor::put_persistent(&mut self.inner, p)
    }
}

impl Backend for Copied {
    fn backend_name(&self) -> &'static str {
        "copied"
    }
    fn set_input(&mut self, name: &str, batch: usize, v: &Values) -> Result<(), ExecError> {
        Backend::set_input(&mut self.inner, name, batch, v)
    }
    fn has_input(&self, name: &str) -> bool {
        Backend::has_input(&self.inner, name)
    }
    fn run(&mut self, b: usize, m: Mode, step: u64, first: u64) -> Result<(), ExecError> {
        Backend::run(&mut self.inner, b, m, step, first)
    }
    fn loss(&self, batch: usize) -> Result<f32, ExecError> {
        self.inner.loss(batch)
    }
    fn output_values(&self, name: &str, batch: usize) -> Result<Option<Tensor>, ExecError> {
        self.inner.output_values(name, batch)
    }
    fn param_values(&self) -> Result<ParamValues, ExecError> {
        self.inner.param_values()
    }
    fn set_param(&mut self, name: &str, shape: &[usize], v: &[f32]) -> Result<(), ExecError> {
        Backend::set_param(&mut self.inner, name, shape, v)
    }
    fn state_values(&self) -> Result<ParamValues, ExecError> {
        self.inner.state_values()
    }
    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), ExecError> {
        Backend::set_state(&mut self.inner, name, values)
    }
    fn first_non_finite(&self) -> Result<Option<NonFinite>, ExecError> {
        Backend::first_non_finite(&self.inner)
    }
}

type Held = (Vec<usize>, Vec<f32>);

impl ShardExecutor for Copied {
    fn allocated_bytes(&self) -> u64 {
        ShardExecutor::allocated_bytes(&self.inner)
    }
    fn persistent(&self, name: &str, state: bool) -> Result<Option<Held>, ExecError> {
        self.inner.persistent(name, state)
    }
    fn persistent_shape(&self, name: &str, state: bool) -> Option<Vec<usize>> {
        self.inner.persistent_shape(name, state)
    }
    fn value_of(&self, step: usize) -> Result<Option<Held>, ExecError> {
        self.inner.value_of(step)
    }
    fn checked(&self) -> Vec<(Kind, String, usize)> {
        ShardExecutor::checked(&self.inner)
    }
    fn held_f32(&self, step: usize) -> Result<Option<Cow<'_, [f32]>>, ExecError> {
        // Owned, as a copy off a GPU is.
        Ok(ShardExecutor::held_f32(&self.inner, step)?.map(|v| Cow::Owned(v.into_owned())))
    }
}

fn plan(dp: u32, pp: u32) -> Plan {
    let source = parse_bytes(TINY.as_bytes()).unwrap();
    let strategy = parallax_compiler::plan::Strategy { dp, tp: 1, pp };
    let options = Options::partitioned(&source, strategy, 0);
    plan_of(&source, &options)
}

/// Training step `step` on a batch of 8 that depends on it.
fn step(e: &mut dyn Backend, step: u64) -> Result<(), ExecError> {
    let source = parse_bytes(TINY.as_bytes()).unwrap();
    let x: Vec<f32> = (0..32)
        .map(|i| ((i as f32 + step as f32) * 0.37).sin())
        .collect();
    let labels: Vec<i32> = (0..8).map(|i| ((i + step) % 3) as i32).collect();
    let (input, target) = io();
    e.set_input(&input, 8, &Values::F32(x))?;
    e.set_input(&target, 8, &Values::I32(labels))?;
    parallax_runtime::train::set_scalars(e, &source.experiment.optimizer, step, 4)?;
    e.run(8, Mode::Train, step, step * 8)
}

/// The names of the model's input and target.
fn io() -> (String, String) {
    let source = parse_bytes(TINY.as_bytes()).unwrap();
    let (_, input, target) =
        parallax_runtime::train::model_io(&plan(1, 1), &source.experiment.loss).unwrap();
    (input, target)
}

fn copied(plan: Plan, grid: Grid, fail: Option<(usize, u64)>) -> Ranks<Copied> {
    let make = move |p: &Plan, d: usize, owned: Option<&[bool]>, t: usize| {
        Ok(Copied {
            inner: Executor::for_kernels(p.clone(), p.batch_size as usize, 1, owned, t),
            fail_at: fail.filter(|f| f.0 == d).map(|f| f.1),
            step: 0,
        })
    };
    Ranks::in_process_with(plan, grid, u64::MAX, &make).unwrap()
}

/// `a` and `b` hold the same parameters and optimizer state, bit for bit.
fn same_values(a: &impl Backend, b: &impl Backend, at: &str) {
    let (pa, pb) = (a.param_values().unwrap(), b.param_values().unwrap());
    assert_eq!(pa, pb, "{at}: parameters");
    let (sa, sb) = (a.state_values().unwrap(), b.state_values().unwrap());
    assert_eq!(sa, sb, "{at}: optimizer state");
}

#[test]
fn a_wrapped_executor_gives_the_cpu_devices_bits() {
    let whole = plan(1, 1);
    let output = whole
        .output_steps
        .iter()
        .find(|o| o.name != parallax_compiler::plan::LOSS)
        .map(|o| o.name.clone())
        .unwrap();
    for (dp, pp) in [(2, 1), (4, 1), (2, 2), (1, 3)] {
        let grid = Grid {
            dp: dp as usize,
            tp: 1,
            pp: pp as usize,
        };
        let mut cpu = Ranks::in_process(plan(dp, pp), grid, 1, u64::MAX).unwrap();
        let mut wrapped = copied(plan(dp, pp), grid, None);
        assert_eq!(wrapped.backend_name(), "copied");
        for s in 0..3 {
            step(&mut cpu, s).unwrap();
            step(&mut wrapped, s).unwrap();
            let (a, b) = (cpu.loss(8).unwrap(), wrapped.loss(8).unwrap());
            assert_eq!(a.to_bits(), b.to_bits(), "dp{dp}.pp{pp} step {s}: loss");
        }
        same_values(&cpu, &wrapped, &format!("dp{dp}.pp{pp}"));
        // The logits after a training step hold their gradient (refused); an eval step
        // (the same inputs) gives them back.
        let refused = cpu.output_values(&output, 8).unwrap_err().to_string();
        assert!(refused.contains("eval step"), "{refused}");
        for e in [&mut cpu as &mut dyn Backend, &mut wrapped] {
            e.run(8, Mode::Eval, 3, 0).unwrap();
        }
        let (x, y) = (
            cpu.output_values(&output, 8).unwrap(),
            wrapped.output_values(&output, 8).unwrap(),
        );
        assert!(x.is_some(), "dp{dp}.pp{pp}: the plan has `{output}`");
        assert_eq!(x, y, "dp{dp}.pp{pp}: outputs");
        assert_eq!(cpu.memory(), wrapped.memory());
    }
}

/// Device 1's copies fail from step 1 on: that step fails on every device, with device 1's
/// error (not the others' echo of it), long before the timeout.
#[test]
fn a_failed_copy_fails_the_step_on_every_device() {
    let grid = Grid {
        dp: 2,
        tp: 1,
        pp: 2,
    };
    let mut ranks = copied(plan(2, 2), grid, Some((1, 1)));
    ranks.set_timeout(Duration::from_secs(60));
    step(&mut ranks, 0).unwrap();
    let started = Instant::now();
    let e = step(&mut ranks, 1).unwrap_err().to_string();
    assert!(e.contains("(planted)"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(30), "{e}");
}

/// What the devices of one process deposit for their sums: each shard's values by
/// (group, call), and a wake-up when some arrive.
type Table = Arc<(
    Mutex<HashMap<(Vec<usize>, u64), BTreeMap<usize, Vec<f32>>>>,
    Condvar,
)>;

/// A sum over shards outside the communicator, as a GPU rank's over NCCL is: every shard's
/// values go to every member as a single-leaf partial, and each member combines them along
/// the fixed tree (`collective::total`).
struct Deposited {
    table: Table,
    calls: u64,
}

impl DeviceSum<Copied> for Deposited {
    fn sum(&mut self, shards: &mut [Copied], call: &SumCall) -> Result<(), ExecError> {
        let key = (call.group.to_vec(), self.calls);
        self.calls += 1;
        let own = call.held[call.member].clone();
        let (lock, wake) = &*self.table;
        {
            let mut table = lock.lock().unwrap();
            let entry = table.entry(key.clone()).or_default();
            for i in own.clone() {
                let v = RankExecutor::read(&shards[i - own.start], call.operand)?.unwrap();
                entry.insert(i, v);
            }
            wake.notify_all();
        }
        let mut table = lock.lock().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while table.get(&key).map_or(0, |e| e.len()) < call.leaves {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ExecError::Device("a member never deposited".into()));
            }
            table = wake.wait_timeout(table, left).unwrap().0;
        }
        let partials = table[&key]
            .iter()
            .map(|(&i, v)| {
                let p = Partial {
                    range: i..i + 1,
                    values: v.clone(),
                };
                (i, p)
            })
            .collect();
        drop(table);
        if call.root.is_some_and(|r| r != call.member) {
            return Ok(());
        }
        let sum = total(call.leaves, partials).map_err(|e| ExecError::Device(e.to_string()))?;
        for e in shards.iter_mut().take(own.len().max(1)) {
            RankExecutor::write(e, call.out, &sum)?;
        }
        Ok(())
    }
}

/// Sums done by the devices' own `DeviceSum` (here single-leaf partials combined by each
/// member, the shape of the NCCL path) give the bits of the communicator's sums, on data
/// and pipeline grids, with ZeRO's reduce to one rank and ranks holding no shard.
#[test]
fn device_sums_give_the_communicators_bits() {
    for (dp, pp, zero) in [
        (2, 1, 0),
        (3, 1, 0),
        (2, 2, 0),
        (8, 1, 0),
        (2, 1, 2),
        (4, 1, 1),
    ] {
        let grid = Grid {
            dp: dp as usize,
            tp: 1,
            pp: pp as usize,
        };
        let source = parse_bytes(TINY.as_bytes()).unwrap();
        let strategy = parallax_compiler::plan::Strategy { dp, tp: 1, pp };
        let options = Options::partitioned(&source, strategy, zero);
        let plan = plan_of(&source, &options);
        let mut host = copied(plan.clone(), grid, None);
        let mut device = copied(plan, grid, None);
        let table: Table = Arc::default();
        let sums = (0..grid.devices())
            .map(|_| {
                Box::new(Deposited {
                    table: table.clone(),
                    calls: 0,
                }) as Box<dyn DeviceSum<Copied>>
            })
            .collect();
        device.set_device_sums(sums).unwrap();
        for s in 0..3 {
            step(&mut host, s).unwrap();
            step(&mut device, s).unwrap();
        }
        let at = format!("dp{dp}.pp{pp} zero {zero}");
        assert!(
            !table.0.lock().unwrap().is_empty(),
            "{at}: no device sum ran"
        );
        same_values(&host, &device, &at);
        assert_eq!(
            host.loss(8).unwrap().to_bits(),
            device.loss(8).unwrap().to_bits(),
            "{at}"
        );
    }
    let mut one = copied(
        plan(1, 1),
        Grid {
            dp: 1,
            tp: 1,
            pp: 1,
        },
        None,
    );
    let e = one.set_device_sums(Vec::new()).unwrap_err().to_string();
    assert!(e.contains("0 device sum(s) for the 1 device(s)"), "{e}");
}
