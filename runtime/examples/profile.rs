//! Times each kernel of a training step: `cargo run --release --example profile -- FILE [STEPS]`.
//! With `KERNELS=N` in the environment, also lists the N slowest kernels one by one (their
//! ops and output shapes), as the same steps ran them (folded permutes do nothing).

use parallax_compiler::parse_bytes;
use parallax_runtime::cpu::Mode;
use parallax_runtime::train::{set_scalars, Session};

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
    let t = std::time::Instant::now();
    for step in 0..steps {
        if step == 2 {
            s.exec.enable_profile();
        }
        let b = s.next_batch().unwrap();
        set_scalars(&mut s.exec, &e.optimizer, step, steps).unwrap();
        s.exec.run(b.size, Mode::Train, step, 0).unwrap();
    }
    let total = t.elapsed().as_secs_f64();
    if let Some(top) = std::env::var("KERNELS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        per_kernel(&s, steps, top);
    }
    let prof = s.exec.profile();
    let kernels: f64 = prof.iter().map(|p| p.1).sum();
    println!(
        "{steps} steps in {:.1} ms ({:.3} ms/step)",
        total * 1e3,
        total * 1e3 / steps as f64
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
