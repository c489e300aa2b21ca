use super::*;
use crate::cpu::kernels::gemm::tests::{assert_close, random, reference, stored};

/// A transposed left operand whose columns lie 4 KiB apart (`[1024, k]` stored `[k,
/// 1024]`) is transposed a panel deep first (`panels_by_depth`), over two panels down
/// and two across, whole and in halves, overwriting and accumulating: each element the
/// in-order FMA chain, bit for bit.
#[test]
fn a_left_operand_with_columns_4_kib_apart_gives_the_in_order_chain() {
    let Some(_) = tile::isa() else {
        eprintln!("no panels on this CPU: the gemm crate multiplies (tested elsewhere)");
        return;
    };
    let (m, k, n) = (1024, 140, 70);
    let a = random(&[k, m], 1);
    let b = random(&[k, n], 2);
    let start = random(&[m, n], 3);
    for (parts, accumulate) in [(1, false), (2, false), (2, true)] {
        let mut dst = start.f32().to_vec();
        let job = Job {
            m,
            n,
            k,
            dst: Ptr(dst.as_mut_ptr()),
            ld: n,
            accumulate,
            lhs: Ptr(a.f32().as_ptr() as *mut f32),
            l: (1, m),
            rhs: Ptr(b.f32().as_ptr() as *mut f32),
            r: (n, 1),
            bias: None,
        };
        // SAFETY: the matrices fit their vectors; `dst` is its own vector.
        unsafe { job.run(Engine::Panels, parts, Parallelism::Rayon(0)) };
        for i in 0..m {
            for j in 0..n {
                let base = if accumulate {
                    start.f32()[i * n + j]
                } else {
                    0.0
                };
                let chain = (0..k).fold(base, |c, p| {
                    a.f32()[p * m + i].mul_add(b.f32()[p * n + j], c)
                });
                let got = dst[i * n + j];
                assert_eq!(got.to_bits(), chain.to_bits(), "{parts} parts ({i}, {j})");
            }
        }
    }
}

/// Each engine, whole or split in 1-5 parts, in all four transpositions, overwriting
/// and accumulating (with a `dst` row longer than `n`): the reference values, and the
/// same bits whatever the number of parts.
#[test]
fn both_engines_give_the_product_and_parts_do_not_change_the_bits() {
    let (m, k, n, ld) = (130, 300, 150, 160);
    for engine in [Engine::Gemm, Engine::Matrixmultiply, Engine::Panels] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let a = random(&stored(&[], m, k, ta), 5);
            let b = random(&stored(&[], k, n, tb), 6);
            let start = random(&[m, ld], 7);
            let want = reference(&a, &b, ta, tb);
            let mut first: Option<Vec<u32>> = None;
            for (parts, accumulate) in [(1, false), (2, false), (3, false), (5, true)] {
                let mut dst = start.f32().to_vec();
                let job = Job {
                    m,
                    n,
                    k,
                    dst: Ptr(dst.as_mut_ptr()),
                    ld,
                    accumulate,
                    lhs: Ptr(a.f32().as_ptr() as *mut f32),
                    l: if ta { (1, m) } else { (k, 1) },
                    rhs: Ptr(b.f32().as_ptr() as *mut f32),
                    r: if tb { (1, k) } else { (n, 1) },
                    bias: None,
                };
                // SAFETY: the matrices fit their vectors; `dst` is its own vector.
                unsafe { job.run(engine, parts, Parallelism::Rayon(0)) };
                let mut got = Vec::with_capacity(m * n);
                for i in 0..m {
                    for j in 0..n {
                        let was = start.f32()[i * ld + j];
                        got.push(dst[i * ld + j] - if accumulate { was } else { 0.0 });
                    }
                    // Past `n`, the row is left alone.
                    assert_eq!(
                        dst[i * ld + n..(i + 1) * ld],
                        start.f32()[i * ld + n..(i + 1) * ld]
                    );
                }
                assert_close(&got, &want, 1e-5);
                let bits: Vec<u32> = dst.iter().map(|v| v.to_bits()).collect();
                match (&first, accumulate) {
                    (None, _) => first = Some(bits),
                    (Some(f), false) => assert_eq!(f, &bits, "{engine:?} in {parts} parts"),
                    (Some(_), true) => {}
                }
            }
        }
    }
}
