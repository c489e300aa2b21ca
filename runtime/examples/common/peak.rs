//! The CPU's fp32 FMA peak (`fma_peak` prints it; `gemm_speed` measures against it).

use std::time::Instant;

/// Independent accumulators per thread: FMA latency 4 cycles times 2 ports, and some spare.
const CHAINS: usize = 12;
/// Fused multiply-adds per accumulator per call.
const ROUNDS: usize = 1 << 14;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_avx512() -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(0.0); CHAINS];
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    for _ in 0..ROUNDS {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2() -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_ps(0.0); CHAINS];
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    for _ in 0..ROUNDS {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut out = [0f32; 8];
    let mut s = 0.0;
    for x in acc {
        _mm256_storeu_ps(out.as_mut_ptr(), x);
        s += out.iter().sum::<f32>();
    }
    s
}

fn run_portable() -> f32 {
    let mut acc = [[0f32; 8]; CHAINS];
    for _ in 0..ROUNDS {
        for x in acc.iter_mut() {
            for l in x.iter_mut() {
                *l = l.mul_add(0.999_999, 1e-7);
            }
        }
    }
    acc.iter().flatten().sum()
}

/// The instruction set used, its vector width in f32 lanes, and one call's function: the
/// kernels' own vector level (`PARALLAX_NO_AVX512` and `PARALLAX_NO_SIMD` lower both).
fn isa() -> (&'static str, usize, fn() -> f32) {
    use parallax_runtime::cpu::kernels::simd::{level, Level};
    #[cfg(target_arch = "x86_64")]
    match level() {
        // SAFETY: the level says the CPU has AVX-512F.
        Level::Avx512 => return ("AVX-512", 16, || unsafe { run_avx512() }),
        // SAFETY: the level says the CPU has AVX2 and FMA.
        Level::Avx2 => return ("AVX2+FMA", 8, || unsafe { run_avx2() }),
        Level::Baseline => {}
    }
    ("portable", 8, run_portable)
}

/// The best of five rates, in GFLOP/s, of `threads` threads each running fused multiply-adds
/// for `seconds / 5`, and the instruction set they ran.
#[allow(dead_code)] // not every example that shares `common` uses it
pub fn fma_peak(threads: usize, seconds: f64) -> (f64, &'static str) {
    let (name, lanes, call) = isa();
    let flops_per_call = (2 * lanes * CHAINS * ROUNDS) as f64;
    let mut best = 0f64;
    for _ in 0..5 {
        let start = std::sync::Barrier::new(threads);
        let rates: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        let t = Instant::now();
                        let (mut calls, mut sink) = (0u64, 0f32);
                        while t.elapsed().as_secs_f64() < seconds / 5.0 {
                            sink += call();
                            calls += 1;
                        }
                        std::hint::black_box(sink);
                        calls as f64 * flops_per_call / t.elapsed().as_secs_f64()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        best = best.max(rates.iter().sum());
    }
    (best / 1e9, name)
}
