//! Tests of `pool.rs`.

use super::*;
use crate::cpu::kernels::testutil::{assert_near as assert_close, f64s, in_pool, zeros};
use crate::cpu::tensor::numel;

/// Uniform in [-1, 1), keyed by `tag`.
fn random(shape: &[usize], tag: u64) -> Tensor {
    crate::cpu::kernels::testutil::uniform_tensor(11, shape, tag)
}

/// Pooling by definition in f64: outputs, and the gradient for `dy`.
fn pool_ref(
    x: &Tensor,
    dy: &[f64],
    max: bool,
    k: usize,
    s: usize,
    p: usize,
) -> (Vec<f64>, Vec<f64>) {
    let [n, c, h, w] = x.shape[..] else {
        unreachable!()
    };
    let (ho, wo) = ((h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1);
    let xf = f64s(x);
    let mut y = vec![0f64; n * c * ho * wo];
    let mut dx = vec![0f64; xf.len()];
    for plane in 0..n * c {
        for oh in 0..ho {
            for ow in 0..wo {
                let yi = (plane * ho + oh) * wo + ow;
                let (mut best, mut at, mut sum) = (f64::NEG_INFINITY, None, 0f64);
                let mut inside = Vec::new();
                for ki in 0..k {
                    for kj in 0..k {
                        let ih = (oh * s + ki) as isize - p as isize;
                        let iw = (ow * s + kj) as isize - p as isize;
                        if ih < 0 || iw < 0 || ih >= h as isize || iw >= w as isize {
                            continue; // padding: -inf for max, 0 for the average
                        }
                        let xi = (plane * h + ih as usize) * w + iw as usize;
                        inside.push(xi);
                        sum += xf[xi];
                        if at.is_none() || xf[xi] > best {
                            best = xf[xi];
                            at = Some(xi);
                        }
                    }
                }
                if max {
                    y[yi] = best;
                    dx[at.unwrap()] += dy[yi];
                } else {
                    y[yi] = sum / (k * k) as f64;
                    for xi in inside {
                        dx[xi] += dy[yi] / (k * k) as f64;
                    }
                }
            }
        }
    }
    (y, dx)
}

#[test]
fn pooling_and_its_gradient_match_the_definition() {
    // (kernel, stride, padding)
    let windows = [
        (2, 2, 0),
        (3, 1, 1),
        (3, 2, 1),
        (2, 1, 1),
        (3, 3, 0),
        (4, 2, 2),
    ];
    for shape in [[2, 3, 6, 7], [1, 2, 5, 5], [4, 16, 20, 20]] {
        for (k, s, p) in windows {
            let x = random(&shape, 5);
            let (ho, wo) = (
                (shape[2] + 2 * p - k) / s + 1,
                (shape[3] + 2 * p - k) / s + 1,
            );
            let yshape = [shape[0], shape[1], ho, wo];
            let dy = random(&yshape, 6);
            for max in [true, false] {
                let what = format!("{shape:?} k{k} s{s} p{p} max {max}");
                let (want_y, want_dx) = pool_ref(&x, &f64s(&dy), max, k, s, p);
                let mut y = zeros(&yshape);
                pool2d(&x, max, k, s, p, &mut y).unwrap();
                assert_close(y.f32(), &want_y, 1e-6, &what);
                let mut dx = Tensor::from_f32(shape.to_vec(), vec![7.0; numel(&shape)]);
                pool2d_grad(&x, &dy, max, k, s, p, &mut dx).unwrap();
                assert_close(dx.f32(), &want_dx, 1e-6, &what);
            }
        }
    }
}

/// The first kernels' pooling, kept as the bit-exact reference for the fast loops:
/// `(y, dx)`, each window scanned by its own loops.
fn pool_first(
    x: &Tensor,
    dy: &Tensor,
    max: bool,
    kernel: usize,
    stride: usize,
    padding: usize,
) -> (Vec<f32>, Vec<f32>) {
    fn window_max(
        plane: &[f32],
        w: usize,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Option<(f32, usize)> {
        let mut best: Option<(f32, usize)> = None;
        for r in rows {
            for c in cols.clone() {
                let v = plane[r * w + c];
                if v.is_nan() {
                    return Some((v, r * w + c));
                }
                if best.is_none_or(|(b, _)| v > b) {
                    best = Some((v, r * w + c));
                }
            }
        }
        best
    }
    let [planes, h, w, ho, wo] = pool_geom("test", x, kernel, stride, padding).unwrap();
    let area = kernel as f32 * kernel as f32;
    let (xv, dyv) = (x.f32(), dy.f32());
    let mut y = vec![0f32; planes * ho * wo];
    let mut dx = vec![0f32; planes * h * w];
    for i in 0..planes {
        let plane = &xv[i * h * w..(i + 1) * h * w];
        let dx = &mut dx[i * h * w..(i + 1) * h * w];
        for oh in 0..ho {
            for ow in 0..wo {
                let o = (i * ho + oh) * wo + ow;
                let (rows, cols) = window(oh, ow, kernel, stride, padding, h, w);
                let d = dyv[o];
                if max {
                    let best = window_max(plane, w, rows, cols);
                    y[o] = best.map_or(f32::NEG_INFINITY, |(v, _)| v);
                    if let Some((_, at)) = best {
                        dx[at] += d;
                    }
                } else {
                    let mut sum = 0f32;
                    for r in rows.clone() {
                        for &v in &plane[r * w + cols.start..r * w + cols.end] {
                            sum += v;
                        }
                    }
                    y[o] = sum / area;
                    let share = d / area;
                    for r in rows {
                        for v in &mut dx[r * w + cols.start..r * w + cols.end] {
                            *v += share;
                        }
                    }
                }
            }
        }
    }
    (y, dx)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

/// The row-at-a-time loops (and the 2x2 tiles' own loops) give the very bits of the
/// per-window loops, on odd sizes, with ties, signed zeros, infinities and NaNs, serial
/// and parallel, whatever the thread count.
#[test]
fn pooling_is_bit_identical_to_per_window_loops() {
    // (kernel, stride, padding)
    let windows = [
        (2, 2, 0),
        (2, 2, 1),
        (3, 2, 1),
        (2, 1, 0),
        (3, 3, 0),
        (3, 1, 1),
        (1, 1, 0),
        (4, 2, 2),
    ];
    let specials = [
        0.0,
        -0.0,
        1.0,
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    let shapes = [
        [1, 1, 2, 2],
        [2, 3, 7, 5],
        [1, 2, 6, 9],
        [3, 2, 5, 4],
        [1, 1, 3, 1],
        // Parallel: whole planes per job, with a remainder batch.
        [5, 37, 13, 11],
        [4, 48, 26, 26],
    ];
    for (si, shape) in shapes.into_iter().enumerate() {
        for (k, s, p) in windows {
            let (Some(ho), Some(wo)) =
                (window_out(shape[2], k, s, p), window_out(shape[3], k, s, p))
            else {
                continue;
            };
            let yshape = [shape[0], shape[1], ho, wo];
            for special in [false, true] {
                let mut x = random(&shape, 20 + si as u64);
                if special {
                    // Coarse values tie often; some are special.
                    for (i, v) in x.f32_mut().iter_mut().enumerate() {
                        *v = match i * 7919 % 23 {
                            j @ 0..=6 => specials[j],
                            _ => (*v * 2.0).round(),
                        };
                    }
                }
                let mut dy = random(&yshape, 30 + si as u64);
                dy.f32_mut()[0] = -0.0;
                for max in [true, false] {
                    let what = format!("{shape:?} k{k} s{s} p{p} max {max} special {special}");
                    let (want_y, want_dx) = pool_first(&x, &dy, max, k, s, p);
                    for threads in [1, 2, 3] {
                        let (y, dx) = in_pool(threads, || {
                            let mut y =
                                Tensor::from_f32(yshape.to_vec(), vec![7.0; numel(&yshape)]);
                            pool2d(&x, max, k, s, p, &mut y).unwrap();
                            let mut dx = Tensor::from_f32(shape.to_vec(), vec![7.0; numel(&shape)]);
                            pool2d_grad(&x, &dy, max, k, s, p, &mut dx).unwrap();
                            (y, dx)
                        });
                        assert_eq!(bits(y.f32()), bits(&want_y), "y {what}");
                        assert_eq!(bits(dx.f32()), bits(&want_dx), "dx {what}");
                    }
                }
            }
        }
    }
}

#[test]
fn max_pooling_routes_ties_to_the_first_maximum() {
    // All equal: each 2x2 window's gradient goes to its top-left element.
    let x = Tensor::from_f32(vec![1, 1, 4, 4], vec![1.0; 16]);
    let dy = Tensor::from_f32(vec![1, 1, 2, 2], vec![1.0, 2.0, 3.0, 4.0]);
    let mut dx = zeros(&[1, 1, 4, 4]);
    pool2d_grad(&x, &dy, true, 2, 2, 0, &mut dx).unwrap();
    #[rustfmt::skip]
    let want = [
        1.0, 0.0, 2.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
        3.0, 0.0, 4.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
    ];
    assert_eq!(dx.f32(), want);
    // Negative inputs with padding: padding never wins (it is -inf), so the maximum is
    // the window's largest input.
    let x = Tensor::from_f32(vec![1, 1, 2, 2], vec![-3.0, -1.0, -2.0, -4.0]);
    let mut y = zeros(&[1, 1, 3, 3]);
    pool2d(&x, true, 2, 1, 1, &mut y).unwrap();
    assert_eq!(
        y.f32(),
        [-3.0, -1.0, -1.0, -2.0, -1.0, -1.0, -2.0, -2.0, -4.0]
    );
    // The average divides by the whole window, padding included.
    let mut avg = zeros(&[1, 1, 3, 3]);
    pool2d(&x, false, 2, 1, 1, &mut avg).unwrap();
    assert_eq!(
        avg.f32(),
        [-0.75, -1.0, -0.25, -1.25, -2.5, -1.25, -0.5, -1.5, -1.0]
    );
}
