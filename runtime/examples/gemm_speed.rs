//! Times the matmul kernel on the shapes of the bench models:
//! `cargo run --release -p parallax-runtime --example gemm_speed [REPS]`.
//!
//! Prints GFLOP/s (best and median of REPS runs) for `kernels::gemm::matmul` and for a few
//! alternative ways of calling the `gemm` crate directly, so strategies can be compared.
//! `gemm_speed REPS FILTER engines` instead times the engines (`gemm`, `matrixmultiply` and
//! `matrixmultiply`) on the 2-D products, split as `matmul` splits them, call for call in
//! turn so that a busy spell of a shared machine falls on both.

use gemm::Parallelism;
use parallax_runtime::cpu::kernels::gemm::{matmul, product_by};
use rayon::prelude::*;
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
    (&[16, 4], false, 64, 64, 64, false, true),
    (&[16, 4], false, 64, 64, 64, false, false),
    (&[16, 4], false, 64, 64, 64, true, false),
];

fn stored(batch: &[usize], rows: usize, cols: usize, trans: bool) -> Vec<usize> {
    let mut s = batch.to_vec();
    s.extend(if trans { [cols, rows] } else { [rows, cols] });
    s
}

/// Best and median seconds of `reps` runs of `f` (after one warm-up).
fn time(reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (t[0], t[reps / 2])
}

/// Row-major `dst [m, n] = lhs x rhs` through `gemm::gemm` with the given strides.
#[allow(clippy::too_many_arguments)]
fn raw(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    (b_rs, b_cs): (usize, usize),
    par: Parallelism,
) {
    assert!(dst.len() >= m * n && a.len() >= m * k && b.len() >= k * n);
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// `src [rows, cols]` transposed into `dst [cols, rows]`.
fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    const T: usize = 32;
    for i0 in (0..rows).step_by(T) {
        for j0 in (0..cols).step_by(T) {
            for i in i0..(i0 + T).min(rows) {
                for j in j0..(j0 + T).min(cols) {
                    dst[j * rows + i] = src[i * cols + j];
                }
            }
        }
    }
}

fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let filter = std::env::args().nth(2);
    if std::env::args().nth(3).as_deref() == Some("engines") {
        return engines(reps, filter.as_deref().unwrap_or(""));
    }
    println!(
        "threads {}; GFLOP/s best/median of {reps}",
        rayon::current_num_threads()
    );
    let mut total = [0f64; 8];
    for &(batch, shared_b, m, k, n, ta, tb) in CASES {
        let name = format!("{batch:?}{m}x{k}x{n} ta{} tb{}", ta as u8, tb as u8);
        if let Some(f) = &filter {
            if !name.contains(f.as_str()) {
                continue;
            }
        }
        let a = filled(stored(batch, m, k, ta), 1);
        let b = filled(stored(if shared_b { &[] } else { batch }, k, n, tb), 2);
        let mut out = filled(stored(batch, m, n, false), 0);
        let nb: usize = batch.iter().product();
        let flops = 2.0 * (nb * m * n * k) as f64;
        let mut line = format!("{name:<32}");
        let mut put = |label: &str, i: usize, (best, med): (f64, f64)| {
            total[i] += med;
            line += &format!(
                " {label} {:>5.0}/{:<5.0}",
                flops / best / 1e9,
                flops / med / 1e9
            );
        };
        put(
            "matmul",
            0,
            time(reps, || matmul(&a, &b, ta, tb, &mut out).unwrap()),
        );
        // Alternative strategies on the same data, through gemm directly.
        let (av, bv) = (a.f32(), b.f32());
        let dst = out.f32_mut();
        let a_st = if ta { (1, m) } else { (k, 1) };
        let b_st = if tb { (1, k) } else { (n, 1) };
        let (sa, sb, so) = (m * k, if shared_b { 0 } else { k * n }, m * n);
        if shared_b && !ta {
            let rows = nb * m;
            for (label, i, par) in [
                ("r0", 1, Parallelism::Rayon(0)),
                ("r1", 2, Parallelism::None),
            ] {
                put(
                    label,
                    i,
                    time(reps, || raw(rows, n, k, dst, av, a_st, bv, b_st, par)),
                );
            }
            if tb {
                // Transpose b [n, k] into [k, n] first.
                let mut bt = vec![0f32; k * n];
                put(
                    "tr_b",
                    3,
                    time(reps, || {
                        transpose(bv, n, k, &mut bt);
                        raw(
                            rows,
                            n,
                            k,
                            dst,
                            av,
                            a_st,
                            &bt,
                            (n, 1),
                            Parallelism::Rayon(0),
                        )
                    }),
                );
                // Split rows in two halves, each single-threaded, in parallel.
                put(
                    "split2",
                    4,
                    time(reps, || {
                        let half = rows.div_ceil(2);
                        dst.par_chunks_mut(half * n)
                            .zip(av.par_chunks(half * k))
                            .for_each(|(d, x)| {
                                raw(d.len() / n, n, k, d, x, a_st, bv, b_st, Parallelism::None)
                            })
                    }),
                );
            }
        } else if nb == 1 {
            put(
                "r0",
                1,
                time(reps, || {
                    raw(m, n, k, dst, av, a_st, bv, b_st, Parallelism::Rayon(0))
                }),
            );
            put(
                "none",
                2,
                time(reps, || {
                    raw(m, n, k, dst, av, a_st, bv, b_st, Parallelism::None)
                }),
            );
            if ta {
                // Transpose a [k, m] into [m, k] first.
                let mut at = vec![0f32; k * m];
                put(
                    "tr_a",
                    3,
                    time(reps, || {
                        transpose(av, k, m, &mut at);
                        raw(m, n, k, dst, &at, (k, 1), bv, b_st, Parallelism::Rayon(0))
                    }),
                );
                // Split the output columns in two halves, in parallel.
                put(
                    "splitn",
                    4,
                    time(reps, || {
                        let h = n.div_ceil(2);
                        rayon::join(
                            || unsafe {
                                gemm::gemm(
                                    m,
                                    h,
                                    k,
                                    dst.as_ptr() as *mut f32,
                                    1,
                                    n as isize,
                                    false,
                                    av.as_ptr(),
                                    a_st.1 as isize,
                                    a_st.0 as isize,
                                    bv.as_ptr(),
                                    b_st.1 as isize,
                                    b_st.0 as isize,
                                    1.0,
                                    1.0,
                                    false,
                                    false,
                                    false,
                                    Parallelism::None,
                                )
                            },
                            || unsafe {
                                gemm::gemm(
                                    m,
                                    n - h,
                                    k,
                                    (dst.as_ptr() as *mut f32).add(h),
                                    1,
                                    n as isize,
                                    false,
                                    av.as_ptr(),
                                    a_st.1 as isize,
                                    a_st.0 as isize,
                                    bv.as_ptr().add(h * b_st.1),
                                    b_st.1 as isize,
                                    b_st.0 as isize,
                                    1.0,
                                    1.0,
                                    false,
                                    false,
                                    false,
                                    Parallelism::None,
                                )
                            },
                        );
                    }),
                );
            }
        } else {
            // Product `i` of the batch into `o`.
            let product = |i: usize, o: &mut [f32], par: Parallelism| {
                raw(m, n, k, o, &av[i * sa..], a_st, &bv[i * sb..], b_st, par)
            };
            // Batched products: parallel over the batch, each single-threaded.
            put(
                "parN",
                1,
                time(reps, || {
                    dst.par_chunks_mut(so)
                        .enumerate()
                        .for_each(|(i, o)| product(i, o, Parallelism::None))
                }),
            );
            // Sequential over the batch, each on rayon.
            put(
                "seqR",
                2,
                time(reps, || {
                    dst.chunks_mut(so)
                        .enumerate()
                        .for_each(|(i, o)| product(i, o, Parallelism::Rayon(0)))
                }),
            );
            // Two halves of the batch, one per thread.
            put(
                "halves",
                3,
                time(reps, || {
                    let h = nb.div_ceil(2);
                    dst.par_chunks_mut(h * so).enumerate().for_each(|(c, d)| {
                        for (j, o) in d.chunks_mut(so).enumerate() {
                            let i = c * h + j;
                            product(i, o, Parallelism::None)
                        }
                    })
                }),
            );
            if tb || ta {
                // Transpose the strided operand per product first, parallel over the batch.
                put(
                    "trpar",
                    4,
                    time(reps, || {
                        dst.par_chunks_mut(so).enumerate().for_each_init(
                            || vec![0f32; k * m.max(n)],
                            |buf, (i, o)| {
                                if tb {
                                    transpose(&bv[i * sb..i * sb + k * n], n, k, buf);
                                    raw(
                                        m,
                                        n,
                                        k,
                                        o,
                                        &av[i * sa..],
                                        a_st,
                                        buf,
                                        (n, 1),
                                        Parallelism::None,
                                    )
                                } else {
                                    transpose(&av[i * sa..i * sa + k * m], k, m, buf);
                                    raw(
                                        m,
                                        n,
                                        k,
                                        o,
                                        buf,
                                        (k, 1),
                                        &bv[i * sb..],
                                        b_st,
                                        Parallelism::None,
                                    )
                                }
                            },
                        )
                    }),
                );
            }
        }
        println!("{line}");
    }
    println!("matmul total (median) {:.2} ms", total[0] * 1e3);
}

/// The engines `product_by` knows.
const ENGINES: [&str; 3] = ["gemm", "matrixmultiply", "panels"];

/// The engines on each 2-D case matching `filter`, alternating call by call.
fn engines(reps: usize, filter: &str) {
    println!(
        "threads {}; GFLOP/s best/median of {reps}, alternating",
        rayon::current_num_threads()
    );
    for &(batch, shared_b, m, k, n, ta, tb) in CASES {
        let name = format!("{batch:?}{m}x{k}x{n} ta{} tb{}", ta as u8, tb as u8);
        if !name.contains(filter) || !(shared_b && (batch.is_empty() || !ta)) {
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
                let t = Instant::now();
                product_by(engine, (rows, n, k), &mut out, (a.f32(), l), (b.f32(), r));
                if rep > 0 {
                    secs[side].push(t.elapsed().as_secs_f64());
                }
            }
        }
        let flops = 2.0 * (rows * n * k) as f64 / 1e9;
        let mut line = format!("{name:<32}");
        for (label, s) in ENGINES.iter().zip(&mut secs) {
            s.sort_by(f64::total_cmp);
            line += &format!(
                " {label} {:>5.0}/{:<5.0}",
                flops / s[0],
                flops / s[s.len() / 2]
            );
        }
        println!("{line}");
    }
}
