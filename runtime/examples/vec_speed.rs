//! Nanoseconds per element of the op table's vectorised elementwise loops, at the level this
//! CPU supports (`PARALLAX_NO_SIMD=1` forces the baseline):
//! `cargo run --release --example vec_speed`.

use parallax_compiler::ir::maps::Elementwise;
use parallax_compiler::ir::ops::elementwise_examples;
use parallax_runtime::cpu::kernels::simd::{self, Operand};
use std::time::Instant;

fn time(name: &str, n: usize, mut f: impl FnMut()) {
    f();
    let t = Instant::now();
    for _ in 0..10 {
        f();
    }
    println!(
        "{name:<12} {:.3} ns/element",
        t.elapsed().as_secs_f64() * 1e9 / (10 * n) as f64
    );
}

fn main() {
    let n = 1 << 20;
    let xs: Vec<f32> = (0..n)
        .map(|i| ((i % 2000) as f32 - 1000.0) * 0.004)
        .collect();
    let mut out = vec![0f32; n];
    println!("vector level {:?}", simd::level());
    for op in elementwise_examples() {
        match op.map() {
            Some(Elementwise::Unary(u)) => time(op.name(), n, || u.run(&mut out, &xs)),
            Some(Elementwise::Binary(b)) => time(op.name(), n, || {
                b.run(&mut out, &xs, Operand::Each(&xs), false)
            }),
            None => {}
        }
    }
    std::hint::black_box(&out);
}
