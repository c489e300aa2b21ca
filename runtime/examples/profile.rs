//! Times each kernel of a training step: `cargo run --release --example profile -- FILE [STEPS]`.
//! With `KERNELS=N` in the environment, also lists the N slowest kernels one by one (their
//! ops and output shapes), as the same steps ran them (folded permutes do nothing). Every
//! step runs on the same batch, as in `step_time`; the kernels' times are means over the
//! steps after the first two, and the steps' median is printed beside them.

use parallax_compiler::parse_bytes;
use parallax_runtime::cpu::Mode;
use parallax_runtime::train::{feed, set_scalars, Session};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: profile FILE [STEPS]");
    let steps: u64 = args
        .get(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20)
        .max(3);
    let source = parse_bytes(&std::fs::read(path).expect("a readable file")).expect("a valid file");
    let e = &source.experiment;
    let mut s = Session::of_experiment(&source, e.train.seed).expect("a plan and its data");
    // One batch fed at every step, as `step_time` does: the loader's worker making the next
    // batch took a core from the kernels (the MLP with AVX2: 2.24-2.47 ms a step so, 2.14-2.24
    // with one batch, `step_time`'s median 2.13-2.21 in the same minutes).
    let b = s.loader.next().expect("the loader runs forever");
    let t = std::time::Instant::now();
    let mut times = Vec::with_capacity(steps as usize);
    for step in 0..steps {
        if step == 2 {
            s.exec.enable_profile();
        }
        let t = std::time::Instant::now();
        feed(&mut s.exec, &s.input, b.size, &b.inputs).unwrap();
        feed(&mut s.exec, &s.target, b.size, &b.targets).unwrap();
        set_scalars(&mut s.exec, &e.optimizer, step, steps).unwrap();
        s.exec.run(b.size, Mode::Train, step, 0).unwrap();
        if step >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let total = t.elapsed().as_secs_f64();
    times.sort_by(f64::total_cmp);
    if let Some(top) = std::env::var("KERNELS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        per_kernel(&s, steps, top);
    }
    let prof = s.exec.profile();
    let kernels: f64 = prof.iter().map(|p| p.1).sum();
    println!(
        "{steps} steps in {:.1} ms ({:.3} ms/step; the profiled steps' median {:.3} ms)",
        total * 1e3,
        total * 1e3 / steps as f64,
        times[times.len() / 2] * 1e3
    );
    for (op, secs, n) in prof.iter().take(20) {
        println!(
            "{op:<26} {:>8.3} ms/step {:>5.1}%  ({} calls)",
            secs * 1e3 / (steps - 2) as f64,
            100.0 * secs / kernels,
            n
        );
    }
}

/// Prints the `top` slowest kernels of the profiled steps.
fn per_kernel(s: &Session, steps: u64, top: usize) {
    let plan = s.exec.plan();
    let secs = s.exec.kernel_seconds();
    let mut order: Vec<usize> = (0..secs.len()).collect();
    order.sort_by(|&a, &b| secs[b].total_cmp(&secs[a]));
    for &k in order.iter().take(top) {
        let kern = &plan.kernels[k];
        let ops: Vec<&str> = kern
            .steps
            .iter()
            .map(|&i| plan.steps[i].op.name())
            .collect();
        let last = &plan.steps[*kern.steps.last().unwrap()];
        let shape: Vec<String> = last.ty.shape.iter().map(|d| d.to_string()).collect();
        println!(
            "kernel {k:>4} {:>8.3} ms  [{}] {}",
            secs[k] * 1e3 / (steps - 2) as f64,
            shape.join(", "),
            ops.join("+")
        );
    }
}
