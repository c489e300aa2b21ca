//! The flash kernels against the composed definition in f64, and their bits on any thread
//! count.

use super::*;
use crate::cpu::kernels::testutil::in_pool;

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
    let n = dm.problems;
    let mut y = vec![0.0; n * t * e];
    let mut lse = vec![0.0; n * t];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; n * t * d],
        vec![0.0; n * s * d],
        vec![0.0; n * s * e],
    );
    // Element `c` of row `i` of problem `g`, token-major.
    let qa = |g, i, c| dm.at(g, i, t, d) + c;
    let ka = |g, j, c| dm.at(g, j, s, d) + c;
    let va = |g, j, c| dm.at(g, j, s, e) + c;
    let ya = |g, i, c| dm.at(g, i, t, e) + c;
    for g in 0..n {
        for i in 0..t {
            let n = if dm.causal { i + 1 } else { s };
            let x: Vec<f64> = (0..n)
                .map(|j| {
                    (0..d)
                        .map(|c| q[qa(g, i, c)] as f64 * k[ka(g, j, c)] as f64)
                        .sum::<f64>()
                        * dm.scale as f64
                })
                .collect();
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = x.iter().map(|x| (x - m).exp()).sum();
            lse[dm.at(g, i, t, 1)] = m + z.ln();
            let p: Vec<f64> = x.iter().map(|x| (x - m).exp() / z).collect();
            for c in 0..e {
                y[ya(g, i, c)] = (0..n).map(|j| p[j] * v[va(g, j, c)] as f64).sum();
            }
            let gy = |c: usize| dy[ya(g, i, c)] as f64;
            let dp: Vec<f64> = (0..n)
                .map(|j| (0..e).map(|c| gy(c) * v[va(g, j, c)] as f64).sum())
                .collect();
            let delta: f64 = (0..n).map(|j| p[j] * dp[j]).sum();
            for j in 0..n {
                let ds = p[j] * (dp[j] - delta) * dm.scale as f64;
                for c in 0..d {
                    dq[qa(g, i, c)] += ds * k[ka(g, j, c)] as f64;
                    dk[ka(g, j, c)] += ds * q[qa(g, i, c)] as f64;
                }
                for c in 0..e {
                    dv[va(g, j, c)] += p[j] * gy(c);
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

/// `(batch, heads, T, S, D, E)`: token-major operands `[batch, T, heads, D]` and so on.
type Shape = (usize, usize, usize, usize, usize, usize);

/// A zero tensor of `shape`.
fn zeros(shape: &[usize]) -> Tensor {
    Tensor::from_f32(shape.to_vec(), vec![0.0; shape.iter().product()])
}

/// Everything the kernels compute for one attention, as bits.
fn run_all(shape: Shape, causal: bool) -> Vec<Vec<u32>> {
    let (b, h, t, s, d, e) = shape;
    let scale = 1.0 / (d as f64).sqrt();
    let q = tensor(&[b, t, h, d], 1, 1.5);
    let k = tensor(&[b, s, h, d], 2, 1.5);
    let v = tensor(&[b, s, h, e], 3, 1.0);
    let dy = tensor(&[b, t, h, e], 4, 1.0);
    let mut y = zeros(&[b, t, h, e]);
    let mut lse = zeros(&[b, t, h]);
    attention(&q, &k, &v, causal, scale, &mut y, Some(&mut lse)).unwrap();
    let mut alone = zeros(&[b, t, h]);
    attention_lse(&q, &k, causal, scale, &mut alone).unwrap();
    assert_eq!(
        alone.f32(),
        lse.f32(),
        "the statistics alone are those of the forward"
    );
    // Rows of `y` and `dy` are the (b, t, h) triples in order, as `delta`'s are.
    let delta: Vec<f32> = (0..b * t * h)
        .map(|r| {
            (0..e)
                .map(|c| dy.f32()[r * e + c] * y.f32()[r * e + c])
                .sum()
        })
        .collect();
    let delta = Tensor::from_f32(vec![b, t, h], delta);
    let saved = Saved {
        dy: &dy,
        lse: &lse,
        delta: &delta,
    };
    // All three in one kernel, each alone, and the key and value gradients without the
    // query's: the same bits (each element's sums run in the same order).
    let grads = |want: [bool; 3]| {
        let mut out = [
            zeros(&[b, t, h, d]),
            zeros(&[b, s, h, d]),
            zeros(&[b, s, h, e]),
        ];
        let [dq, dk, dv] = out.each_mut().map(Some);
        let grads = Grads {
            dq: dq.filter(|_| want[0]),
            dk: dk.filter(|_| want[1]),
            dv: dv.filter(|_| want[2]),
        };
        attention_grads((&q, &k, &v), &saved, causal, scale, grads).unwrap();
        out
    };
    let [dq, dk, dv] = grads([true, true, true]);
    let bits = |x: &Tensor| x.f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&grads([false, true, false])[1]),
        bits(&dk),
        "the key gradient alone"
    );
    assert_eq!(
        bits(&grads([false, false, true])[2]),
        bits(&dv),
        "the value gradient alone"
    );
    let kv = grads([false, true, true]);
    assert_eq!(
        (bits(&kv[1]), bits(&kv[2])),
        (bits(&dk), bits(&dv)),
        "without the query's"
    );
    // The query gradient alone runs by query tiles, its sum over keys in one chain.
    close(
        &format!("{shape:?} dq alone"),
        grads([true, false, false])[0].f32(),
        &reference(
            &Dims::of("test", &q, &k, &v, causal, scale).unwrap(),
            q.f32(),
            k.f32(),
            v.f32(),
            dy.f32(),
        )
        .2,
    );
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

/// Several heads with one tile of queries and of keys (every operand read in place), one
/// of queries only (the keys and values of the forward in place), one of keys only (the
/// queries of the backward in place, the query gradient written by its one task), and
/// more of both (everything a task shares copied first).
const SHAPES: [Shape; 8] = [
    (1, 1, 1, 1, 4, 4),
    (3, 1, 5, 9, 8, 6),
    (1, 3, 5, 9, 8, 6),
    (2, 1, 33, 33, 16, 16),
    (2, 3, 70, 130, 8, 12),
    (1, 2, 129, 129, 64, 64),
    (2, 2, 40, 100, 16, 8),
    (1, 2, 100, 40, 8, 8),
];

#[test]
fn matches_the_composed_ops_in_f64() {
    for shape in SHAPES {
        run_all(shape, false);
        if shape.2 == shape.3 {
            run_all(shape, true);
        }
    }
}

#[test]
fn the_same_bits_on_any_thread_count() {
    let on = |threads: usize, shape, causal| in_pool(threads, || run_all(shape, causal));
    for (shape, causal) in [(SHAPES[2], false), (SHAPES[4], false), (SHAPES[5], true)] {
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
    let q = tensor(&[2, 4, 1, 8], 1, 1.0);
    let k = tensor(&[2, 5, 1, 8], 2, 1.0);
    let v = tensor(&[2, 5, 1, 3], 3, 1.0);
    let mut y = zeros(&[2, 4, 1, 3]);
    let err = attention(&q, &k, &v, true, 1.0, &mut y, None).unwrap_err();
    assert!(format!("{err}").contains("T = S"), "{err}");
    let bad_v = tensor(&[2, 6, 1, 3], 3, 1.0);
    assert!(attention(&q, &k, &bad_v, false, 1.0, &mut y, None).is_err());
    // Heads that differ.
    let two_heads = tensor(&[2, 5, 2, 8], 2, 1.0);
    let err = attention(&q, &two_heads, &v, false, 1.0, &mut y, None).unwrap_err();
    assert!(format!("{err}").contains("[.., T, H, D]"), "{err}");
    let mut wrong = zeros(&[2, 4, 1, 4]);
    assert!(attention(&q, &k, &v, false, 1.0, &mut wrong, None).is_err());
}
