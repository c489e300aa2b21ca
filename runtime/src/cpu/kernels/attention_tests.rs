//! The flash kernels against the composed definition in f64, and their bits on any thread
//! count.

use super::*;

/// A seeded value in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u64 ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn tensor(shape: &[usize], seed: u64, by: f32) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32(
        shape.to_vec(),
        values(n, seed).iter().map(|x| x * by).collect(),
    )
}

/// The composed definition in f64: scores, masked softmax, products; and the gradients
/// of `sum(y * dy)` (dq, dk, dv), with `lse` per query.
#[allow(clippy::type_complexity)]
fn reference(
    dm: &Dims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dy: &[f32],
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (t, s, d, e) = (dm.t, dm.s, dm.d, dm.e);
    let mut y = vec![0.0; dm.heads * t * e];
    let mut lse = vec![0.0; dm.heads * t];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; dm.heads * t * d],
        vec![0.0; dm.heads * s * d],
        vec![0.0; dm.heads * s * e],
    );
    for h in 0..dm.heads {
        for i in 0..t {
            let n = if dm.causal { i + 1 } else { s };
            let x: Vec<f64> = (0..n)
                .map(|j| {
                    (0..d)
                        .map(|c| q[(h * t + i) * d + c] as f64 * k[(h * s + j) * d + c] as f64)
                        .sum::<f64>()
                        * dm.scale as f64
                })
                .collect();
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = x.iter().map(|x| (x - m).exp()).sum();
            lse[h * t + i] = m + z.ln();
            let p: Vec<f64> = x.iter().map(|x| (x - m).exp() / z).collect();
            for c in 0..e {
                y[(h * t + i) * e + c] = (0..n).map(|j| p[j] * v[(h * s + j) * e + c] as f64).sum();
            }
            let g = |c: usize| dy[(h * t + i) * e + c] as f64;
            let dp: Vec<f64> = (0..n)
                .map(|j| (0..e).map(|c| g(c) * v[(h * s + j) * e + c] as f64).sum())
                .collect();
            let delta: f64 = (0..n).map(|j| p[j] * dp[j]).sum();
            for j in 0..n {
                let ds = p[j] * (dp[j] - delta) * dm.scale as f64;
                for c in 0..d {
                    dq[(h * t + i) * d + c] += ds * k[(h * s + j) * d + c] as f64;
                    dk[(h * s + j) * d + c] += ds * q[(h * t + i) * d + c] as f64;
                }
                for c in 0..e {
                    dv[(h * s + j) * e + c] += p[j] * g(c);
                }
            }
        }
    }
    (y, lse, dq, dk, dv)
}

fn close(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= 2e-5 * (1.0 + w.abs()),
            "{what}[{i}]: {g} against {w}"
        );
    }
}

/// Everything the kernels compute for one problem, as bits.
fn run_all(shape: (usize, usize, usize, usize, usize), causal: bool) -> Vec<Vec<u32>> {
    let (heads, t, s, d, e) = shape;
    let scale = 1.0 / (d as f64).sqrt();
    let q = tensor(&[heads, t, d], 1, 1.5);
    let k = tensor(&[heads, s, d], 2, 1.5);
    let v = tensor(&[heads, s, e], 3, 1.0);
    let dy = tensor(&[heads, t, e], 4, 1.0);
    let mut y = Tensor::from_f32(vec![heads, t, e], vec![0.0; heads * t * e]);
    let mut lse = Tensor::from_f32(vec![heads, t], vec![0.0; heads * t]);
    attention(&q, &k, &v, causal, scale, &mut y, Some(&mut lse)).unwrap();
    let mut alone = Tensor::from_f32(vec![heads, t], vec![0.0; heads * t]);
    attention_lse(&q, &k, causal, scale, &mut alone).unwrap();
    assert_eq!(
        alone.f32(),
        lse.f32(),
        "the statistics alone are those of the forward"
    );
    let delta: Vec<f32> = (0..heads * t)
        .map(|r| {
            (0..e)
                .map(|c| dy.f32()[r * e + c] * y.f32()[r * e + c])
                .sum()
        })
        .collect();
    let delta = Tensor::from_f32(vec![heads, t], delta);
    let saved = Saved {
        dy: &dy,
        lse: &lse,
        delta: &delta,
    };
    let mut dq = Tensor::from_f32(vec![heads, t, d], vec![0.0; heads * t * d]);
    let mut dk = Tensor::from_f32(vec![heads, s, d], vec![0.0; heads * s * d]);
    let mut dv = Tensor::from_f32(vec![heads, s, e], vec![0.0; heads * s * e]);
    attention_grad_query(&q, &k, &v, &saved, causal, scale, &mut dq).unwrap();
    attention_grad_key_value(
        &q,
        &k,
        &v,
        &saved,
        causal,
        scale,
        Some(&mut dk),
        Some(&mut dv),
    )
    .unwrap();
    let mut dk_alone = Tensor::from_f32(vec![heads, s, d], vec![0.0; heads * s * d]);
    attention_grad_key_value(&q, &k, &v, &saved, causal, scale, Some(&mut dk_alone), None).unwrap();
    assert_eq!(dk_alone.f32(), dk.f32(), "the key gradient alone");
    let dm = Dims::of("test", &q, &k, &v, causal, scale).unwrap();
    let (ry, rlse, rdq, rdk, rdv) = reference(&dm, q.f32(), k.f32(), v.f32(), dy.f32());
    let what = format!("{shape:?} causal {causal}");
    close(&format!("{what} y"), y.f32(), &ry);
    close(&format!("{what} lse"), lse.f32(), &rlse);
    close(&format!("{what} dq"), dq.f32(), &rdq);
    close(&format!("{what} dk"), dk.f32(), &rdk);
    close(&format!("{what} dv"), dv.f32(), &rdv);
    [y, lse, dq, dk, dv]
        .iter()
        .map(|t| t.f32().iter().map(|x| x.to_bits()).collect())
        .collect()
}

const SHAPES: [(usize, usize, usize, usize, usize); 5] = [
    (1, 1, 1, 4, 4),
    (3, 5, 9, 8, 6),
    (2, 33, 33, 16, 16),
    (2, 70, 130, 8, 12),
    (1, 129, 129, 64, 64),
];

#[test]
fn matches_the_composed_ops_in_f64() {
    for shape in SHAPES {
        run_all(shape, false);
        if shape.1 == shape.2 {
            run_all(shape, true);
        }
    }
}

#[test]
fn the_same_bits_on_any_thread_count() {
    let on = |threads: usize, shape, causal| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| run_all(shape, causal))
    };
    for (shape, causal) in [(SHAPES[3], false), (SHAPES[4], true)] {
        let one = on(1, shape, causal);
        for threads in [2, 3, 5] {
            assert!(
                one == on(threads, shape, causal),
                "{shape:?} on {threads} threads"
            );
        }
    }
}

#[test]
fn refuses_mismatched_operands() {
    let q = tensor(&[2, 4, 8], 1, 1.0);
    let k = tensor(&[2, 5, 8], 2, 1.0);
    let v = tensor(&[2, 5, 3], 3, 1.0);
    let mut y = Tensor::from_f32(vec![2, 4, 3], vec![0.0; 24]);
    let err = attention(&q, &k, &v, true, 1.0, &mut y, None).unwrap_err();
    assert!(format!("{err}").contains("T = S"), "{err}");
    let bad_v = tensor(&[2, 6, 3], 3, 1.0);
    assert!(attention(&q, &k, &bad_v, false, 1.0, &mut y, None).is_err());
    let mut wrong = Tensor::from_f32(vec![2, 4, 4], vec![0.0; 32]);
    assert!(attention(&q, &k, &v, false, 1.0, &mut wrong, None).is_err());
}
