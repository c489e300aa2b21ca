use super::*;
use crate::cpu::kernels::testutil::{in_pool, zeros};

/// Uniform in [-1, 1), keyed by `tag`.
pub(super) fn random(shape: &[usize], tag: u64) -> Tensor {
    crate::cpu::kernels::testutil::uniform_tensor(7, shape, tag)
}

/// The product by definition in f64.
pub(super) fn reference(a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Vec<f64> {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let (m, k) = if ta {
        (a.shape[ra - 1], a.shape[ra - 2])
    } else {
        (a.shape[ra - 2], a.shape[ra - 1])
    };
    let n = if tb { b.shape[rb - 2] } else { b.shape[rb - 1] };
    let batch: usize = a.shape[..ra - 2].iter().product();
    let shared = rb == 2;
    let mut out = vec![0f64; batch * m * n];
    for bi in 0..batch {
        let ao = bi * m * k;
        let bo = if shared { 0 } else { bi * k * n };
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..k {
                    let x = if ta {
                        a.f32()[ao + p * m + i]
                    } else {
                        a.f32()[ao + i * k + p]
                    };
                    let y = if tb {
                        b.f32()[bo + j * k + p]
                    } else {
                        b.f32()[bo + p * n + j]
                    };
                    s += x as f64 * y as f64;
                }
                out[bi * m * n + i * n + j] = s;
            }
        }
    }
    out
}

pub(super) fn assert_close(got: &[f32], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= rel * (1.0 + w.abs()),
            "element {i}: got {g}, want {w}"
        );
    }
}

/// `a`'s shape from `op(a)`'s `[.., M, K]`.
pub(super) fn stored(batch: &[usize], rows: usize, cols: usize, trans: bool) -> Vec<usize> {
    let mut s = batch.to_vec();
    s.extend(if trans { [cols, rows] } else { [rows, cols] });
    s
}

fn check(batch: &[usize], shared_b: bool, m: usize, k: usize, n: usize, ta: bool, tb: bool) {
    let a = random(&stored(batch, m, k, ta), 1);
    let b = random(&stored(if shared_b { &[] } else { batch }, k, n, tb), 2);
    let mut out = zeros(&stored(batch, m, n, false));
    matmul(&a, &b, ta, tb, &mut out).unwrap();
    assert_close(out.f32(), &reference(&a, &b, ta, tb), 1e-5);
}

#[test]
fn strided_output_is_the_permuted_product() {
    // Attention's `[B, H, S, D] -> [B, S, H, D]`, batched and shared-b operands, both
    // transpositions, with products large enough to run in parallel and to split.
    for &(batch, m, k, n, shared_b, ta, tb) in &[
        ([2usize, 3usize], 5usize, 4usize, 6usize, false, false, true),
        ([2, 3], 5, 4, 6, false, true, false),
        ([2, 4], 64, 64, 64, false, false, false),
        ([3, 2], 96, 80, 128, true, false, true),
    ] {
        let a = random(&stored(&batch, m, k, ta), 3);
        let b = random(
            &stored(if shared_b { &[] } else { &batch[..] }, k, n, tb),
            4,
        );
        let mut want = zeros(&stored(&batch, m, n, false));
        matmul(&a, &b, ta, tb, &mut want).unwrap();
        let mut permuted = zeros(&[batch[0], m, batch[1], n]);
        crate::cpu::kernels::layout::permute(&want, &[0, 2, 1, 3], &mut permuted).unwrap();
        // Element (b, h, i, j) of the product at b*M*H*N + i*H*N + h*N + j.
        let strides = [m * batch[1] * n, n, batch[1] * n, 1];
        let mut got = vec![f32::NAN; permuted.numel()];
        let shape = [batch[0], batch[1], m, n];
        matmul_strided(&a, &b, ta, tb, &shape, &mut got, &strides).unwrap();
        // The same kernels on the same values: the same bits.
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            permuted
                .f32()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        );
    }
    let (a, b) = (random(&[2, 3, 4], 5), random(&[4, 5], 6));
    let mut small = vec![0f32; 29];
    let err = matmul_strided(&a, &b, false, false, &[2, 3, 5], &mut small, &[15, 5, 1]);
    assert!(err.unwrap_err().to_string().contains("does not fit"));
    let err = matmul_strided(&a, &b, false, false, &[2, 3, 5], &mut small, &[1, 2, 6]);
    assert!(err.unwrap_err().to_string().contains("the last 1"));
}

#[test]
fn two_d_in_all_four_transpositions() {
    for ta in [false, true] {
        for tb in [false, true] {
            check(&[], true, 7, 13, 5, ta, tb);
            check(&[], true, 1, 1, 1, ta, tb);
            // Large enough to run in parallel.
            check(&[], true, 70, 90, 80, ta, tb);
        }
    }
}

#[test]
fn batched_with_shared_b() {
    for ta in [false, true] {
        for tb in [false, true] {
            check(&[2, 3], true, 5, 4, 6, ta, tb);
        }
    }
}

#[test]
fn batched_with_batched_b() {
    // The attention shape [2, 3, 5, 4] x [2, 3, 4, 6].
    for ta in [false, true] {
        for tb in [false, true] {
            check(&[2, 3], false, 5, 4, 6, ta, tb);
        }
    }
    // Many small products (one task each) and a few large ones.
    check(&[4, 8], false, 40, 32, 40, false, true);
    check(&[2], false, 70, 70, 70, true, false);
}

#[test]
fn empty_inner_dimension_gives_zeros() {
    let a = zeros(&[3, 0]);
    let b = zeros(&[0, 4]);
    let mut out = Tensor::from_f32(vec![3, 4], vec![5.0; 12]);
    matmul(&a, &b, false, false, &mut out).unwrap();
    assert!(out.f32().iter().all(|&v| v == 0.0));
    // Batched, one product at a time.
    let (a, b) = (zeros(&[2, 0, 3]), zeros(&[2, 0, 4]));
    let mut out = Tensor::from_f32(vec![2, 3, 4], vec![5.0; 24]);
    matmul(&a, &b, true, false, &mut out).unwrap();
    assert!(out.f32().iter().all(|&v| v == 0.0));
}

#[test]
fn mismatched_shapes_are_errors() {
    let a = random(&[2, 3], 1);
    let b = random(&[4, 5], 2);
    let mut out = zeros(&[2, 5]);
    assert!(matches!(
        matmul(&a, &b, false, false, &mut out),
        Err(KernelError::Bad { .. })
    ));
    let b = random(&[3, 5], 2);
    let mut wrong = zeros(&[2, 4]);
    assert!(matches!(
        matmul(&a, &b, false, false, &mut wrong),
        Err(KernelError::Bad { .. })
    ));
    let a3 = random(&[2, 2, 3], 1);
    let b3 = random(&[3, 3, 5], 2);
    let mut out3 = zeros(&[2, 2, 5]);
    assert!(matches!(
        matmul(&a3, &b3, false, false, &mut out3),
        Err(KernelError::Bad { .. })
    ));
    let v = random(&[3], 1);
    assert!(matches!(
        matmul(&v, &b, false, false, &mut out),
        Err(KernelError::Bad { .. })
    ));
    let ints = Tensor::from_i32(vec![2, 3], vec![0; 6]);
    assert!(matches!(
        matmul(&ints, &b, false, false, &mut out),
        Err(KernelError::Bad { .. })
    ));
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    // (batch, shared b, M, K, N, trans_a, trans_b)
    type Case<'a> = (&'a [usize], bool, usize, usize, usize, bool, bool);
    let cases: [Case; 4] = [
        (&[], true, 200, 300, 250, false, false),
        (&[3], true, 100, 150, 120, false, true),
        (&[4, 8], false, 64, 64, 64, false, true),
        (&[2], false, 150, 130, 170, true, false),
    ];
    for (batch, shared_b, m, k, n, ta, tb) in cases {
        let a = random(&stored(batch, m, k, ta), 3);
        let b = random(&stored(if shared_b { &[] } else { batch }, k, n, tb), 4);
        let run = |threads: usize| {
            in_pool(threads, || {
                let mut out = zeros(&stored(batch, m, n, false));
                matmul(&a, &b, ta, tb, &mut out).unwrap();
                out.f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            })
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }
}

/// A bias added as the product is stored: bit for bit the product, then the add, for
/// products split by columns (the right part's bias starts where its columns do) and by
/// rows, on 1 to 3 threads, a masked last vector, columns too few for the panels (the
/// `gemm` crate, then the add), batches of `a` over one `b`, either layout of `b`, and
/// no depth; `None` where `b` has batches of its own; a bias of another length refused.
#[test]
fn a_bias_added_as_the_product_is_stored_is_the_add_after_it() {
    type Case<'a> = (&'a [usize], usize, usize, usize, bool);
    let cases: [Case; 7] = [
        (&[], 130, 300, 150, false),
        (&[], 300, 140, 130, true),
        (&[2], 65, 64, 33, false),
        (&[], 7, 13, 5, true),
        (&[16], 64, 256, 256, true),
        (&[], 9, 0, 20, false),
        (&[], 1, 1, 1, false),
    ];
    for (batch, m, k, n, tb) in cases {
        let a = random(&stored(batch, m, k, false), 5);
        let b = random(&stored(&[], k, n, tb), 6);
        let bias = random(&[n], 7);
        let mut want = zeros(&stored(batch, m, n, false));
        matmul(&a, &b, false, tb, &mut want).unwrap();
        for (i, x) in want.f32_mut().iter_mut().enumerate() {
            *x += bias.f32()[i % n];
        }
        let want: Vec<u32> = want.f32().iter().map(|v| v.to_bits()).collect();
        for threads in [1, 2, 3] {
            let got = in_pool(threads, || {
                let mut out = zeros(&stored(batch, m, n, false));
                matmul_bias(&a, &b, tb, &bias, &mut out).unwrap().unwrap();
                out.f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            });
            assert!(
                got == want,
                "{batch:?} {m}x{k}x{n} tb {tb}, {threads} threads"
            );
        }
    }
    let (a, b) = (random(&[2, 4, 3], 1), random(&[2, 3, 5], 2));
    let mut out = zeros(&[2, 4, 5]);
    assert!(matmul_bias(&a, &b, false, &random(&[5], 3), &mut out).is_none());
    let b = random(&[3, 5], 2);
    let r = matmul_bias(&a, &b, false, &random(&[4], 3), &mut out);
    assert!(matches!(r, Some(Err(KernelError::Bad { .. }))));
}
