//! Times the matmul kernel on the shapes of the bench models against the CPU's FMA peak:
//! `cargo run --release -p parallax-runtime --example gemm_speed [REPS] [FILTER] [engines]`.
//!
//! Prints GFLOP/s (best and median of REPS calls) of `kernels::gemm::matmul` on each case
//! whose name contains FILTER, and the median's share of the fp32 FMA peak measured first on
//! as many threads. FILTER `MxKxN:ab` (`a`, `b`: `n` or `t`, whether that operand is stored
//! transposed) times that one product instead. With `engines`, the 2-D cases are timed in
//! each engine (`gemm`, `matrixmultiply` and `panels`), split as `matmul` splits them, call
//! for call in turn so that a busy spell of a shared machine falls on all of them.
//!
//! Every call runs as a step's kernels do: on a worker of rayon's pool, the others spinning
//! (`cpu::spin::on_spinning_pool`), so a split product is not timed waking the pool.

use parallax_runtime::cpu::kernels::gemm::{matmul, product_by};
use parallax_runtime::cpu::spin::on_spinning_pool;
use std::time::Instant;

mod common;
use common::filled;

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
    println!(
        "threads {threads}; fma peak {peak:.0} GFLOP/s ({isa}); GFLOP/s best/median of {reps}"
    );
    on_spinning_pool(|top_up| {
        if args.get(3).map(String::as_str) == Some("engines") {
            engines(reps, filter, top_up);
        } else {
            products(reps, filter, peak, top_up);
        }
    });
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
        for rep in 0..=reps {
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

/// The engines on each 2-D case, alternating call by call.
fn engines(reps: usize, filter: &str, top_up: &dyn Fn()) {
    for case in cases(filter) {
        let (batch, shared_b, m, k, n, ta, tb) = case;
        if !(shared_b && (batch.is_empty() || !ta)) {
            continue;
        }
        // Stacked batches of a row-major `a` are one matrix, as `matmul` multiplies them.
        let rows = m * batch.iter().product::<usize>();
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
