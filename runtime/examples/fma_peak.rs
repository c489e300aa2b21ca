//! The CPU's fp32 FMA peak on THREADS threads (default 2), the limit a training step is
//! measured against (`benches/compare.sh` prints each model's share of it):
//! `cargo run --release -p parallax-runtime --example fma_peak [THREADS] [SECONDS]`.
//!
//! Each thread runs chains of fused multiply-adds on independent vector registers (enough of
//! them to cover the FMA latency on two ports), with AVX-512 where the CPU has it, else AVX2
//! with FMA, else the compiler's own vectors, for about SECONDS (default 0.5). Prints
//! `fma peak: GFLOPS GFLOP/s on THREADS threads (ISA)`: the best of five runs (a multiply-add
//! counts two FLOPs).

mod common;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let seconds: f64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(0.5);
    let (gflops, name) = common::peak::fma_peak(threads, seconds);
    println!("fma peak: {gflops:.1} GFLOP/s on {threads} threads ({name})");
}
