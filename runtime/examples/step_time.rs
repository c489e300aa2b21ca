//! The median time of one training step of an experiment file:
//! `cargo run --release --example step_time -- FILE [WARMUP] [STEPS]` (defaults 10 and 30).
//!
//! Builds the executor as `profile.rs` does, runs `WARMUP` untimed steps, then times `STEPS`
//! steps (setting the batch's inputs and the schedule's scalars, then `Executor::run` in
//! training mode; the loader's next batch is fetched outside the timed part) and prints
//! `NAME median MS ms/step (min MS, max MS; STEPS steps after WARMUP warm-up)`.

use parallax_compiler::{compile, parse_bytes, Options};
use parallax_runtime::cpu::{Executor, Mode};
use parallax_runtime::data::{self, Loader, Values};
use parallax_runtime::train::model_io;
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: step_time FILE [WARMUP] [STEPS]");
    let warmup: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let steps: u64 = args
        .get(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or(30)
        .max(1);
    let source = parse_bytes(&std::fs::read(path).expect("a readable file")).expect("a valid file");
    let options = Options::default();
    let plan = compile(&source, &options, &mut |_, _| {})
        .expect("compiles")
        .plan(&source, &options);
    let e = &source.experiment;
    let (io, input, target) = model_io(&plan, &e.loss).expect("one input");
    let splits = data::load(&e.data, &io, e.train.seed, std::path::Path::new(".")).expect("data");
    let batch = e.train.batch_size as usize;
    let mut exec = Executor::new(plan, batch, e.train.seed);
    let mut loader = Loader::new(Arc::new(splits.train), batch, 0, false, 0).expect("a loader");
    let set = |x: &mut Executor, name: &str, n: usize, v: &Values| match v {
        Values::F32(v) => x.set_f32(name, n, v).unwrap(),
        Values::I32(v) => x.set_i32(name, n, v).unwrap(),
    };
    let total = warmup + steps;
    let mut times = Vec::with_capacity(steps as usize);
    for step in 0..total {
        let b = loader.next().expect("the loader runs forever");
        let t = Instant::now();
        set(&mut exec, &input, b.size, &b.inputs);
        set(&mut exec, &target, b.size, &b.targets);
        for (name, v) in e.optimizer.step_scalars(step, total) {
            if exec.has_input(name) {
                exec.set_f32(name, 1, &[v]).unwrap();
            }
        }
        exec.run(b.size, Mode::Train, step, 0).unwrap();
        let elapsed = t.elapsed().as_secs_f64() * 1e3;
        if step >= warmup {
            times.push(elapsed);
        }
        let loss = exec.output("loss").map_or(f32::NAN, |t| t.f32()[0]);
        assert!(loss.is_finite(), "the loss became {loss} at step {step}");
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let n = times.len();
    let median = if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2.0
    };
    println!(
        "{} median {median:.3} ms/step (min {:.3}, max {:.3}; {steps} steps after {warmup} warm-up)",
        e.name,
        times[0],
        times[n - 1]
    );
}
