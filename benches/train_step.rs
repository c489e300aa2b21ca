//! Training-step speed of the CPU executor: one full step (forward, backward, SGD update) of
//! each model in `benches/models/` on one fixed synthetic batch. `cargo bench --bench
//! train_step`; `benches/compare.sh` sets the same models against PyTorch.

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use parallax_compiler::{compile, parse_bytes, Options};
use parallax_runtime::cpu::{Executor, Mode};
use parallax_runtime::data::{self, loader, Values};
use parallax_runtime::train::model_io;
use std::path::Path;
use std::time::Duration;

const MODELS: [&str; 3] = ["mlp", "cnn", "transformer"];

/// The executor of `benches/models/NAME.ron` with its first batch and the schedule's scalars
/// set, and the batch size.
fn executor(name: &str) -> (Executor, usize) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("benches/models/{name}.ron"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let source = parse_bytes(&bytes).expect("a valid file");
    let options = Options::default();
    let plan = compile(&source, &options, &mut |_, _| {})
        .expect("compiles")
        .plan(&source, &options);
    let e = &source.experiment;
    let (io, input, target) = model_io(&plan, &e.loss).expect("one input");
    let splits = data::load(&e.data, &io, e.train.seed, Path::new(".")).expect("data");
    let batch_size = e.train.batch_size as usize;
    let order = data::epoch_order(e.train.seed, 0, splits.train.len);
    let batch = loader::make_batch(&splits.train, &order, batch_size, 0, 0);
    assert_eq!(batch.size, batch_size, "a full first batch");
    let mut exec = Executor::new(plan, batch_size, e.train.seed);
    let set = |x: &mut Executor, name: &str, v: &Values| match v {
        Values::F32(v) => x.set_f32(name, batch_size, v).unwrap(),
        Values::I32(v) => x.set_i32(name, batch_size, v).unwrap(),
    };
    set(&mut exec, &input, &batch.inputs);
    set(&mut exec, &target, &batch.targets);
    // The schedules are constant: step 0's scalars hold for every step.
    for (name, v) in e.optimizer.step_scalars(0, 1) {
        if exec.has_input(name) {
            exec.set_f32(name, 1, &[v]).unwrap();
        }
    }
    (exec, batch_size)
}

fn train_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("train_step");
    group
        .sample_size(20)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(5));
    for name in MODELS {
        let (mut exec, batch) = executor(name);
        let mut step = 0u64;
        group.bench_function(name, |b| {
            b.iter(|| {
                exec.run(batch, Mode::Train, step, 0).unwrap();
                step += 1;
            })
        });
        let loss = exec.output("loss").map_or(f32::NAN, |t| t.f32()[0]);
        assert!(loss.is_finite(), "{name}: the loss became {loss}");
    }
    group.finish();
}

criterion_group!(benches, train_step);
criterion_main!(benches);
