//! Times each kernel of a training step: `cargo run --release --example profile -- FILE [STEPS]`.

use parallax_compiler::{compile, parse_bytes, Options};
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
    let options = Options::default();
    let plan = compile(&source, &options, &mut |_, _| {})
        .expect("compiles")
        .plan(&source, &options);
    let e = &source.experiment;
    let batch = e.train.batch_size as usize;
    let mut s = Session::new(
        &source,
        plan,
        batch,
        e.train.seed,
        std::path::Path::new("."),
    )
    .expect("data");
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
    let prof = s.exec.profile();
    let kernels: f64 = prof.iter().map(|p| p.1).sum();
    println!(
        "{steps} steps in {:.1} ms ({:.3} ms/step)",
        total * 1e3,
        total * 1e3 / steps as f64
    );
    for (op, secs, n) in prof.iter().take(15) {
        println!(
            "{op:<22} {:>8.3} ms/step {:>5.1}%  ({} calls)",
            secs * 1e3 / (steps - 2) as f64,
            100.0 * secs / kernels,
            n
        );
    }
}
