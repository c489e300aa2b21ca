//! Times the matmul kernel on the shapes of the bench models against the CPU's FMA peak:
//! `cargo run --release -p parallax-runtime --example gemm_speed [REPS] [FILTER] [engines]`.
//!
//! Prints GFLOP/s (best and median of REPS calls) of `kernels::gemm::matmul` on each case
//! whose name contains FILTER, and the median's share of the fp32 FMA peak measured first on
//! as many threads. FILTER `MxKxN:ab` (`a`, `b`: `n` or `t`, whether that operand is stored
//! transposed) times that one product instead. With `engines`, the 2-D cases are timed in
//! each engine (`gemm`, `matrixmultiply` and `panels`), split as `matmul` splits them, call
//! for call in turn so that a busy spell of a shared machine falls on all of them. With
//! `blas` (or `openblas`, `blis`: one of them), the 2-D cases are timed in `matmul` and in
//! the system's OpenBLAS and BLIS
//! (`common::blas`, each on as many threads of its own), in blocks of 20 calls in turn.
//! Debian's OpenBLAS 0.3.21 and BLIS 0.9 do not know Zen 5: they pick their AVX2 `Haswell`
//! and their `generic` kernels there; `OPENBLAS_CORETYPE=SkylakeX` and `BLIS_ARCH_TYPE=0`
//! (`skx`) give their AVX-512 ones, `OPENBLAS_CORETYPE=Haswell` and `BLIS_ARCH_TYPE=3`
//! (`haswell`) their AVX2 ones. `BLIS_ARCH_DEBUG=1` prints BLIS's pick.
//!
//! Every call runs as a step's kernels do: on a worker of rayon's pool, the others spinning
//! (`cpu::spin::on_spinning_pool`), so a split product is not timed waking the pool. With
//! `COLD=lhs,rhs,out` (any of the three) in the environment, `matmul`'s calls find those
//! flushed from every cache, as a step's products find what was written long before.

use parallax_runtime::cpu::kernels::gemm::{matmul, product_by};
use parallax_runtime::cpu::spin::on_spinning_pool;
use std::time::Instant;

mod common;
use common::blas::Blas;
use common::{evict, filled};
use parallax_runtime::cpu::tensor::Tensor;

/// (batch, shared b, M, K, N, trans_a, trans_b)
type Case = (&'static [usize], bool, usize, usize, usize, bool, bool);

const CASES: &[Case] = &[
    // mlp.ron
    (&[], true, 128, 784, 512, false, true),
    (&[], true, 128, 512, 512, false, true),
    (&[], true, 128, 512, 512, false, false),
    (&[], true, 512, 128, 784, true, false),
    (&[], true, 512, 128, 512, true, false),
    // transformer.ron: linear layers (batch folded), weight gradients, attention
    (&[16], true, 64, 256, 256, false, true),
    (&[16], true, 64, 256, 256, false, false),
    (&[16], true, 64, 256, 1024, false, true),
    (&[16], true, 64, 1024, 256, false, true),
    (&[], true, 256, 1024, 256, true, false),
    (&[], true, 256, 1024, 1024, true, false),
    (&[], true, 1024, 1024, 256, true, false),
];

fn stored(batch: &[usize], rows: usize, cols: usize, trans: bool) -> Vec<usize> {
    let mut s = batch.to_vec();
    s.extend(if trans { [cols, rows] } else { [rows, cols] });
    s
}

/// The cases `filter` asks for: the one `MxKxN:ab` product, or the bench's whose name
/// contains it.
fn cases(filter: &str) -> Vec<Case> {
    let asked = filter.split_once(':').and_then(|(dims, t)| {
        let d: Vec<usize> = dims.split('x').filter_map(|v| v.parse().ok()).collect();
        let t = t.as_bytes();
        (d.len() == 3 && t.len() == 2)
            .then(|| (&[][..], true, d[0], d[1], d[2], t[0] == b't', t[1] == b't'))
    });
    match asked {
        Some(case) => vec![case],
        None => CASES
            .iter()
            .filter(|c| name(c).contains(filter))
            .copied()
            .collect(),
    }
}

fn name(&(batch, _, m, k, n, ta, tb): &Case) -> String {
    format!("{batch:?}{m}x{k}x{n} ta{} tb{}", ta as u8, tb as u8)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let reps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(15);
    let filter = args.get(2).map_or("", String::as_str);
    let threads = rayon::current_num_threads();
    let (peak, isa) = common::peak::fma_peak(threads, 0.5);
    let mode = args.get(3).map(String::as_str);
    // The libraries' comparison prints medians of whole blocks of calls.
    let timed = match mode {
        Some("blas" | "openblas" | "blis") => format!("median of {}", reps.div_ceil(BLOCK) * BLOCK),
        _ => format!("best/median of {reps}"),
    };
    println!("threads {threads}; fma peak {peak:.0} GFLOP/s ({isa}); GFLOP/s {timed}");
    match mode {
        Some("engines") => on_spinning_pool(|top_up| engines(reps, filter, top_up)),
        Some(m @ ("blas" | "openblas" | "blis")) => libraries(reps, filter, threads, peak, m),
        _ => on_spinning_pool(|top_up| products(reps, filter, peak, top_up)),
    }
}

/// `matmul` on each case.
fn products(reps: usize, filter: &str, peak: f64, top_up: &dyn Fn()) {
    let mut total = 0.0;
    for case in cases(filter) {
        let (batch, shared_b, m, k, n, ta, tb) = case;
        let a = filled(stored(batch, m, k, ta), 1);
        let b = filled(stored(if shared_b { &[] } else { batch }, k, n, tb), 2);
        let mut out = filled(stored(batch, m, n, false), 0);
        let gflop = 2.0 * (batch.iter().product::<usize>() * m * n * k) as f64 / 1e9;
        let mut secs = Vec::with_capacity(reps);
        let cold = std::env::var("COLD").unwrap_or_default();
        for rep in 0..=reps {
            for (name, t) in [("lhs", &a), ("rhs", &b), ("out", &out)] {
                if cold.contains(name) {
                    evict(t.f32());
                }
            }
            top_up();
            let t = Instant::now();
            matmul(&a, &b, ta, tb, &mut out).unwrap();
            if rep > 0 {
                secs.push(t.elapsed().as_secs_f64());
            }
        }
        secs.sort_by(f64::total_cmp);
        let median = secs[secs.len() / 2];
        total += median;
        println!(
            "{:<32} matmul {:>5.0}/{:<5.0} {:>3.0}% of the peak",
            name(&case),
            gflop / secs[0],
            gflop / median,
            100.0 * gflop / median / peak
        );
    }
    println!("matmul total (median) {:.2} ms", total * 1e3);
}

/// The engines `product_by` knows.
const ENGINES: [&str; 3] = ["gemm", "matrixmultiply", "panels"];

/// `(rows, k, n, ta, tb)` of a product as one 2-D matrix product.
type TwoD = (usize, usize, usize, bool, bool);

/// The 2-D cases `engines` and `libraries` time: a row-major left operand's batches stacked
/// into one matrix, as `matmul` multiplies them, as [`TwoD`].
fn two_d(filter: &str) -> Vec<(Case, TwoD)> {
    cases(filter)
        .into_iter()
        .filter(|&(batch, shared_b, _, _, _, ta, _)| shared_b && (batch.is_empty() || !ta))
        .map(|case| {
            let (batch, _, m, k, n, ta, tb) = case;
            (case, (m * batch.iter().product::<usize>(), k, n, ta, tb))
        })
        .collect()
}

/// `matmul` against the system's BLAS libraries on each 2-D case: blocks of 20 timed calls
/// per side in turn, 100 ms apart so that one side's idle threads have stopped spinning
/// before the other's block (OpenBLAS's spin up to 2^28 cycles by default). Each block
/// first runs its product untimed for [`WARM`]. Each library's output is checked against
/// `matmul`'s.
fn libraries(reps: usize, filter: &str, threads: usize, peak: f64, which: &str) {
    let pause = std::time::Duration::from_millis(100);
    let blas: Vec<Blas> = Blas::available(threads)
        .into_iter()
        .filter(|b| which == "blas" || b.name.to_lowercase().starts_with(which))
        .collect();
    let names: Vec<&str> = blas.iter().map(|b| b.name.as_str()).collect();
    println!("matmul against {}", names.join(", "));
    for (case, (rows, k, n, ta, tb)) in two_d(filter) {
        let a = filled(stored(&[], rows, k, ta), 1);
        let b = filled(stored(&[], k, n, tb), 2);
        let mut out = Tensor::from_f32(vec![rows, n], vec![0.0; rows * n]);
        let mut theirs = vec![0f32; rows * n];
        let mut secs = vec![Vec::new(); blas.len() + 1];
        let mut worst = vec![0f32; blas.len()];
        for _ in 0..reps.div_ceil(BLOCK) {
            on_spinning_pool(|top_up| {
                block(BLOCK, &mut secs[0], &mut || {
                    top_up();
                    matmul(&a, &b, ta, tb, &mut out).unwrap();
                })
            });
            for (side, library) in blas.iter().enumerate() {
                std::thread::sleep(pause);
                block(BLOCK, &mut secs[side + 1], &mut || {
                    library.product((rows, k, n), a.f32(), ta, b.f32(), tb, &mut theirs)
                });
                let diff = out.f32().iter().zip(&theirs).map(|(x, y)| (x - y).abs());
                worst[side] = diff.fold(worst[side], f32::max);
            }
            std::thread::sleep(pause);
        }
        let gflop = 2.0 * (rows * n * k) as f64 / 1e9;
        let mut line = format!("{:<32}", name(&case));
        let labels = std::iter::once("matmul").chain(names.iter().copied());
        for (label, s) in labels.zip(&mut secs) {
            s.sort_by(f64::total_cmp);
            let median = gflop / s[s.len() / 2];
            line += &format!(" {label} {median:>4.0} ({:.0}%)", 100.0 * median / peak);
        }
        let worst: Vec<String> = worst.iter().map(|w| format!("{w:.1e}")).collect();
        println!("{line}; largest difference {}", worst.join(", "));
    }
}

/// Timed calls per side in a block of `libraries`.
const BLOCK: usize = 20;

/// How long a block of calls runs untimed first. After a pause the threads of either side
/// sleep, and waking the machine's other vCPU took milliseconds: with only the block's
/// first call untimed, `matmul`'s 0.2 ms products ran at 43-80% of the peak after 1-100 ms
/// pauses and 85% with none.
const WARM: std::time::Duration = std::time::Duration::from_millis(20);

/// Runs `call` for [`WARM`], then times it `count` times into `secs`.
fn block(count: usize, secs: &mut Vec<f64>, call: &mut dyn FnMut()) {
    let warm = Instant::now();
    while warm.elapsed() < WARM {
        call();
    }
    for _ in 0..count {
        let t = Instant::now();
        call();
        secs.push(t.elapsed().as_secs_f64());
    }
}

/// The engines on each 2-D case, alternating call by call.
fn engines(reps: usize, filter: &str, top_up: &dyn Fn()) {
    for (case, (rows, k, n, ta, tb)) in two_d(filter) {
        let a = filled(stored(&[], rows, k, ta), 1);
        let b = filled(stored(&[], k, n, tb), 2);
        let mut out = vec![0f32; rows * n];
        let l = if ta { (1, rows) } else { (k, 1) };
        let r = if tb { (1, k) } else { (n, 1) };
        let mut secs = ENGINES.map(|_| Vec::new());
        for rep in 0..=reps {
            for (side, engine) in ENGINES.into_iter().enumerate() {
                top_up();
                let t = Instant::now();
                product_by(engine, (rows, n, k), &mut out, (a.f32(), l), (b.f32(), r));
                if rep > 0 {
                    secs[side].push(t.elapsed().as_secs_f64());
                }
            }
        }
        let gflop = 2.0 * (rows * n * k) as f64 / 1e9;
        let mut line = format!("{:<32}", name(&case));
        for (label, s) in ENGINES.iter().zip(&mut secs) {
            s.sort_by(f64::total_cmp);
            line += &format!(
                " {label} {:>5.0}/{:<5.0}",
                gflop / s[0],
                gflop / s[s.len() / 2]
            );
        }
        println!("{line}");
    }
}
