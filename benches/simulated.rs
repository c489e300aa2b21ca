//! Simulated devices against one device: a training step of `models/transformer.ron` (64
//! sequences of 32 tokens) on the plain executor, and as a partitioned plan on simulated
//! device grids (`dp1` is the micro-sharded plan on one device: the cost of sharding itself;
//! the others add the lockstep coordination, collectives and point-to-point copies). All run
//! on this machine's cores, so more devices never means faster: the figures say what the
//! simulation costs. `cargo bench --bench simulated`.

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use parallax_compiler::shards::Sharding;
use parallax_compiler::{compile, parse_bytes, Options, Source};
use parallax_runtime::backend::Backend;
use parallax_runtime::cpu::{Executor, Mode};
use parallax_runtime::data::{self, loader, Values};
use parallax_runtime::ranks::{Grid, Ranks};
use parallax_runtime::train::model_io;
use std::path::Path;
use std::time::Duration;

fn source() -> Source {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/transformer.ron");
    parse_bytes(&std::fs::read(path).expect("the model")).expect("a valid file")
}

/// A backend for `grid` (the plain executor when `None`) with the first batch and the
/// schedule's scalars set, and the batch size.
fn backend(source: &Source, grid: Option<Grid>) -> (Box<dyn Backend>, usize) {
    let e = &source.experiment;
    let batch = e.train.batch_size as usize;
    let options = Options {
        shards: grid.map(|_| Sharding::new(e.devices.micro_shards, e.train.batch_size)),
        tensor_parallel: grid.map(|g| g.tp as u32).filter(|&t| t > 1),
        pipeline_stages: grid.map(|g| g.pp as u32).filter(|&p| p > 1),
        ..Options::default()
    };
    let plan = compile(source, &options, &mut |_, _| {})
        .expect("compiles")
        .plan(source, &options);
    let (io, input, target) = model_io(&plan, &e.loss).expect("one input");
    let splits = data::load(&e.data, &io, e.train.seed, Path::new(".")).expect("data");
    let order = data::epoch_order(e.train.seed, 0, splits.train.len);
    let b = loader::make_batch(&splits.train, &order, batch, 0, 0);
    let mut exec: Box<dyn Backend> = match grid {
        None => Box::new(Executor::new(plan, batch, e.train.seed)),
        Some(g) => Box::new(Ranks::in_process(plan, g, e.train.seed, u64::MAX).expect("fits")),
    };
    exec.set_input(&input, batch, &b.inputs).unwrap();
    exec.set_input(&target, batch, &b.targets).unwrap();
    for (name, v) in e.optimizer.step_scalars(0, 1) {
        if exec.has_input(name) {
            exec.set_input(name, 1, &Values::F32(vec![v])).unwrap();
        }
    }
    (exec, batch)
}

fn simulated(c: &mut Criterion) {
    let source = source();
    let mut group = c.benchmark_group("transformer_step");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let grid = |dp, tp, pp| Some(Grid { dp, tp, pp });
    let cases = [
        ("one device", None),
        ("dp1", grid(1, 1, 1)),
        ("dp4", grid(4, 1, 1)),
        ("dp8", grid(8, 1, 1)),
        ("tp2", grid(1, 2, 1)),
        ("pp2", grid(1, 1, 2)),
        ("dp2.tp2.pp2", grid(2, 2, 2)),
    ];
    for (name, g) in cases {
        let (mut exec, batch) = backend(&source, g);
        let mut step = 0u64;
        group.bench_function(name, |b| {
            b.iter(|| {
                exec.run(batch, Mode::Train, step, 0).unwrap();
                step += 1;
            })
        });
    }
    group.finish();
}

criterion_group!(benches, simulated);
criterion_main!(benches);
