//! Times each kernel of a training step: `cargo run --release --example profile -- FILE [STEPS]`.

use parallax_compiler::{compile, parse_bytes, Options};
use parallax_runtime::cpu::{Executor, Mode};
use parallax_runtime::data::{self, Loader, Values};
use parallax_runtime::train::model_io;
use std::sync::Arc;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: profile FILE [STEPS]");
    let steps: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20);
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
    let t = std::time::Instant::now();
    for step in 0..steps {
        if step == 2 {
            exec.enable_profile();
        }
        let b = loader.next().unwrap();
        set(&mut exec, &input, b.size, &b.inputs);
        set(&mut exec, &target, b.size, &b.targets);
        for (name, v) in e.optimizer.step_scalars(step, steps) {
            if exec.has_input(name) {
                exec.set_f32(name, 1, &[v]).unwrap();
            }
        }
        exec.run(b.size, Mode::Train, step, 0).unwrap();
    }
    let total = t.elapsed().as_secs_f64();
    let prof = exec.profile();
    let kernels: f64 = prof.iter().map(|p| p.1).sum();
    println!(
        "{steps} steps in {:.1} ms ({:.3} ms/step)",
        total * 1e3,
        total * 1e3 / steps as f64
    );
    for (op, s, n) in prof.iter().take(15) {
        println!(
            "{op:<22} {:>8.3} ms/step {:>5.1}%  ({} calls)",
            s * 1e3 / (steps - 2) as f64,
            100.0 * s / kernels,
            n
        );
    }
}
