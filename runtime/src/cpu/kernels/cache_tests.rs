use super::*;
use crate::cpu::kernels::testutil::{uniform_tensor, zeros};

/// f64 reference: query `t` of sample `b` over rows `0..=pos[b] + t`.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, pos: &[i32], scale: f64) -> Vec<f64> {
    let (b, t, h, d) = dims(q).unwrap();
    let (_, s, _, _) = dims(k).unwrap();
    let e = v.shape[3];
    let (q, k, v) = (q.f32(), k.f32(), v.f32());
    let mut out = vec![0.0; b * t * h * e];
    for bi in 0..b {
        for ti in 0..t {
            for hi in 0..h {
                let seen = pos[bi] as usize + ti + 1;
                let scores: Vec<f64> = (0..seen)
                    .map(|j| {
                        let dot: f64 = (0..d)
                            .map(|x| {
                                q[((bi * t + ti) * h + hi) * d + x] as f64
                                    * k[((bi * s + j) * h + hi) * d + x] as f64
                            })
                            .sum();
                        dot * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let total: f64 = w.iter().sum();
                for x in 0..e {
                    out[((bi * t + ti) * h + hi) * e + x] = (0..seen)
                        .map(|j| w[j] / total * v[((bi * s + j) * h + hi) * e + x] as f64)
                        .sum();
                }
            }
        }
    }
    out
}

#[test]
fn cached_attention_matches_an_f64_reference_at_every_position() {
    let (b, s, h, d, e) = (2, 7, 3, 5, 4);
    let k = uniform_tensor(1, &[b, s, h, d], 1);
    let v = uniform_tensor(1, &[b, s, h, e], 2);
    for t in [1, 2] {
        let q = uniform_tensor(2, &[b, t, h, d], 3);
        for p0 in 0..=(s - t) as i32 {
            let pos = [p0, (s - t) as i32 - p0];
            let mut out = zeros(&[b, t, h, e]);
            let pt = Tensor::from_i32(vec![b], pos.to_vec());
            cached_attention(&q, &k, &v, &pt, 0.4, &mut out).unwrap();
            let want = reference(&q, &k, &v, &pos, 0.4);
            for (i, (&got, &w)) in out.f32().iter().zip(&want).enumerate() {
                assert!(
                    (got as f64 - w).abs() < 1e-6,
                    "t {t} pos {pos:?} [{i}]: {got} vs {w}"
                );
            }
        }
    }
}

#[test]
fn cache_writes_replace_the_rows_at_each_position_only() {
    let (b, s, h, d) = (2, 5, 2, 3);
    let cache = uniform_tensor(3, &[b, s, h, d], 1);
    let rows = uniform_tensor(3, &[b, 2, h, d], 2);
    let pos = Tensor::from_i32(vec![b], vec![3, 0]);
    let mut out = zeros(&[b, s, h, d]);
    cache_write(&cache, &rows, &pos, &mut out).unwrap();
    let row = h * d;
    for bi in 0..b {
        let at = [3, 0][bi];
        for j in 0..s {
            let got = &out.f32()[(bi * s + j) * row..][..row];
            let want = if (at..at + 2).contains(&j) {
                &rows.f32()[(bi * 2 + j - at) * row..][..row]
            } else {
                &cache.f32()[(bi * s + j) * row..][..row]
            };
            assert_eq!(got, want, "sample {bi} row {j}");
        }
    }
    // In place: the same values.
    let mut c = cache.clone();
    write_rows(&mut c, &rows, &pos).unwrap();
    assert_eq!(c.f32(), out.f32());
}

#[test]
fn positions_outside_the_cache_are_refused() {
    let cache = zeros(&[1, 4, 1, 2]);
    let rows = zeros(&[1, 1, 1, 2]);
    for p in [-1, 4] {
        let pos = Tensor::from_i32(vec![1], vec![p]);
        let mut c = cache.clone();
        let err = write_rows(&mut c, &rows, &pos).unwrap_err().to_string();
        assert!(err.contains("outside the cache of 4 rows"), "{err}");
        let mut out = zeros(&[1, 1, 1, 2]);
        let err = cached_attention(&rows, &cache, &cache, &pos, 1.0, &mut out).unwrap_err();
        assert!(err.to_string().contains("outside the cache"), "{err}");
    }
}
