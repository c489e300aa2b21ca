//! The median time of one training step of an experiment file:
//! `cargo run --release --example step_time -- FILE [WARMUP] [STEPS]` (defaults 10 and 30).
//!
//! Builds the executor as `profile.rs` does, runs `WARMUP` untimed steps, then times `STEPS`
//! steps (setting the batch's inputs and the schedule's scalars, then `Executor::run` in
//! training mode) and prints
//! `NAME median MS ms/step (min MS, max MS; STEPS steps after WARMUP warm-up)`.
//!
//! `step_time FILE --flops` prints the FLOPs of one training step (forward, backward and
//! update at the file's batch size, by the op table's cost rules) and exits.
//!
//! `step_time FILE --serve` instead reads a count `N` per line from standard input and answers
//! each with one line of `N` step times in milliseconds, until the input ends: a driver
//! (`benches/pytorch_compare.py --paired`) alternates short runs of it with PyTorch's steps so
//! that both see the same spells of a shared machine.

use parallax_compiler::parse_bytes;
use parallax_runtime::cpu::Mode;
use parallax_runtime::train::{feed, set_scalars, Session};
use std::io::BufRead;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .expect("usage: step_time FILE [WARMUP] [STEPS] | step_time FILE --serve");
    let serve = args.get(2).is_some_and(|a| a == "--serve");
    if args.get(2).is_some_and(|a| a == "--flops") {
        let source =
            parse_bytes(&std::fs::read(path).expect("a readable file")).expect("a valid file");
        let options = parallax_compiler::Options::default();
        let g = parallax_compiler::compile(&source, &options, &mut |_, _| {})
            .expect("the experiment compiles")
            .graph;
        let batch = source.experiment.train.batch_size;
        use parallax_compiler::ir::Phase;
        let flops: u128 = [Phase::Forward, Phase::Backward, Phase::Update]
            .into_iter()
            .map(|p| g.flops(batch, p))
            .sum();
        println!("{flops}");
        return;
    }
    let warmup: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let steps: u64 = args
        .get(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or(30)
        .max(1);
    let source = parse_bytes(&std::fs::read(path).expect("a readable file")).expect("a valid file");
    let e = &source.experiment;
    let mut s = Session::of_experiment(&source, 0).expect("a plan and its data");
    let total = warmup + steps;
    let mut times = Vec::with_capacity(steps as usize);
    // One batch fed at every step, as PyTorch's side (benches/pytorch_compare.py) reuses one:
    // the loader's threads are idle while the steps are timed.
    let b = s.loader.next().expect("the loader runs forever");
    // One step's milliseconds; the schedule's total is nominal when serving.
    let mut timed_step = |step: u64, total: u64| {
        let t = Instant::now();
        feed(&mut s.exec, &s.input, b.size, &b.inputs).unwrap();
        feed(&mut s.exec, &s.target, b.size, &b.targets).unwrap();
        set_scalars(&mut s.exec, &e.optimizer, step, total).unwrap();
        s.exec.run(b.size, Mode::Train, step, 0).unwrap();
        let elapsed = t.elapsed().as_secs_f64() * 1e3;
        let loss = s.exec.output("loss").map_or(f32::NAN, |t| t.f32()[0]);
        assert!(loss.is_finite(), "the loss became {loss} at step {step}");
        elapsed
    };
    if serve {
        let mut step = 0;
        for line in std::io::stdin().lock().lines() {
            let n: u64 = line.unwrap().trim().parse().expect("a step count per line");
            let ms: Vec<String> = (0..n)
                .map(|_| {
                    step += 1;
                    format!("{:.4}", timed_step(step - 1, 1_000_000))
                })
                .collect();
            println!("{}", ms.join(" "));
        }
        return;
    }
    for step in 0..total {
        let elapsed = timed_step(step, total);
        if step >= warmup {
            times.push(elapsed);
        }
    }
    if std::env::var_os("STEP_TIMES").is_some() {
        let all: Vec<String> = times.iter().map(|t| format!("{t:.1}")).collect();
        eprintln!("ms per step, in order: {}", all.join(" "));
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
