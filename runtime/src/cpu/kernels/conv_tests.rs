//! Tests of `conv.rs`.

use super::super::pool::{pool2d, pool2d_grad};
use super::*;
use crate::cpu::kernels::testutil::{in_pool, zeros};

/// Uniform in [-1, 1), keyed by `tag`.
fn random(shape: &[usize], tag: u64) -> Tensor {
    crate::cpu::kernels::testutil::uniform_tensor(11, shape, tag)
}
use crate::cpu::kernels::testutil::{assert_near as assert_close, f64s};
use crate::cpu::tensor::numel;

/// A convolution case: `x [n, c, h, w]`, `w [o, c/groups, k, k]`.
#[derive(Debug, Clone, Copy)]
struct Case {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    k: usize,
    s: usize,
    p: usize,
    g: usize,
}

/// `[n, c, h, w, o, k, stride, padding, groups]`.
const fn case([n, c, h, w, o, k, s, p, g]: [usize; 9]) -> Case {
    Case {
        n,
        c,
        h,
        w,
        o,
        k,
        s,
        p,
        g,
    }
}

impl Case {
    fn x(&self) -> [usize; 4] {
        [self.n, self.c, self.h, self.w]
    }
    fn wt(&self) -> [usize; 4] {
        [self.o, self.c / self.g, self.k, self.k]
    }
    fn ho(&self) -> usize {
        (self.h + 2 * self.p - self.k) / self.s + 1
    }
    fn wo(&self) -> usize {
        (self.w + 2 * self.p - self.k) / self.s + 1
    }
    fn y(&self) -> [usize; 4] {
        [self.n, self.o, self.ho(), self.wo()]
    }

    /// Calls `f(x index, w index, y index)` for every product of the convolution.
    fn taps(&self, mut f: impl FnMut(usize, usize, usize)) {
        let (cg, og) = (self.c / self.g, self.o / self.g);
        let (ho, wo) = (self.ho(), self.wo());
        for n in 0..self.n {
            for o in 0..self.o {
                for oh in 0..ho {
                    for ow in 0..wo {
                        let yi = ((n * self.o + o) * ho + oh) * wo + ow;
                        for cl in 0..cg {
                            let c = o / og * cg + cl;
                            for ki in 0..self.k {
                                for kj in 0..self.k {
                                    let ih = (oh * self.s + ki) as isize - self.p as isize;
                                    let iw = (ow * self.s + kj) as isize - self.p as isize;
                                    if ih < 0
                                        || iw < 0
                                        || ih >= self.h as isize
                                        || iw >= self.w as isize
                                    {
                                        continue;
                                    }
                                    let xi = ((n * self.c + c) * self.h + ih as usize) * self.w
                                        + iw as usize;
                                    let wi = ((o * cg + cl) * self.k + ki) * self.k + kj;
                                    f(xi, wi, yi);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    fn conv(&self, x: &[f64], w: &[f64]) -> Vec<f64> {
        let mut y = vec![0f64; numel(&self.y())];
        self.taps(|xi, wi, yi| y[yi] += x[xi] * w[wi]);
        y
    }

    /// `dx = sum over outputs of dy * w` at each tap.
    fn grad_input(&self, dy: &[f64], w: &[f64]) -> Vec<f64> {
        let mut dx = vec![0f64; numel(&self.x())];
        self.taps(|xi, wi, yi| dx[xi] += dy[yi] * w[wi]);
        dx
    }

    /// `dw = sum over outputs of dy * x` at each tap.
    fn grad_weight(&self, x: &[f64], dy: &[f64]) -> Vec<f64> {
        let mut dw = vec![0f64; numel(&self.wt())];
        self.taps(|xi, wi, yi| dw[wi] += dy[yi] * x[xi]);
        dw
    }
}

const CASES: [Case; 9] = [
    case([2, 3, 7, 6, 4, 3, 1, 0, 1]),
    case([2, 3, 7, 6, 4, 3, 1, 1, 1]),
    case([2, 4, 8, 7, 6, 3, 2, 1, 2]),
    case([1, 2, 5, 5, 2, 3, 2, 0, 1]),
    case([3, 4, 6, 6, 4, 1, 1, 0, 2]),
    case([2, 4, 9, 8, 4, 2, 2, 0, 2]),
    case([2, 2, 6, 5, 3, 1, 2, 1, 1]),
    case([2, 6, 5, 4, 6, 3, 1, 1, 3]),
    // Large enough for the per-sample parallel path and parallel GEMMs.
    case([4, 8, 12, 12, 16, 3, 1, 1, 1]),
];

#[test]
fn conv2d_matches_the_definition() {
    for case in &CASES {
        let (x, w) = (random(&case.x(), 1), random(&case.wt(), 2));
        let mut y = zeros(&case.y());
        conv2d(&x, &w, case.s, case.p, case.g, &mut y).unwrap();
        assert_close(
            y.f32(),
            &case.conv(&f64s(&x), &f64s(&w)),
            1e-5,
            &format!("{case:?}"),
        );
    }
}

#[test]
fn conv2d_grad_input_matches_the_definition() {
    for case in CASES {
        let (dy, w) = (random(&case.y(), 3), random(&case.wt(), 2));
        let mut dx = Tensor::from_f32(case.x().to_vec(), vec![7.0; numel(&case.x())]);
        conv2d_grad_input(&dy, &w, case.s, case.p, case.g, &mut dx).unwrap();
        let want = case.grad_input(&f64s(&dy), &f64s(&w));
        assert_close(dx.f32(), &want, 1e-5, &format!("{case:?}"));
    }
}

#[test]
fn conv2d_grad_weight_matches_the_definition() {
    for case in CASES {
        let (x, dy) = (random(&case.x(), 1), random(&case.y(), 3));
        let mut dw = Tensor::from_f32(case.wt().to_vec(), vec![7.0; numel(&case.wt())]);
        conv2d_grad_weight(&x, &dy, case.s, case.p, case.g, &mut dw).unwrap();
        let want = case.grad_weight(&f64s(&x), &f64s(&dy));
        assert_close(dw.f32(), &want, 1e-5, &format!("{case:?}"));
    }
}

#[test]
fn grad_weight_accumulates_chunks_of_samples() {
    let case = case([5, 4, 6, 5, 4, 3, 1, 1, 2]);
    let (x, dy) = (random(&case.x(), 1), random(&case.y(), 3));
    let geom = Geom::new("test", &case.x(), &case.wt(), case.s, case.p, case.g).unwrap();
    let want = case.grad_weight(&f64s(&x), &f64s(&dy));
    let rows_per_sample = case.c * case.k * case.k * case.ho() * case.wo();
    // Chunks of 1, 2 (with a remainder) and all 5 samples.
    for limit in [1, 2 * rows_per_sample, usize::MAX / 2] {
        let mut dw = vec![7f32; numel(&case.wt())];
        grad_weight(x.f32(), dy.f32(), &geom, limit, &mut dw);
        assert_close(&dw, &want, 1e-5, &format!("limit {limit}"));
    }
}

/// `L(x, w) = sum(conv(x, w) * r)` in f64; its central differences must match the
/// gradient kernels run with `dy = r`.
#[test]
fn gradients_match_finite_differences() {
    for case in &CASES[..8] {
        let (x, w, r) = (
            random(&case.x(), 1),
            random(&case.wt(), 2),
            random(&case.y(), 4),
        );
        let (xf, wf, rf) = (f64s(&x), f64s(&w), f64s(&r));
        let loss = |x: &[f64], w: &[f64]| -> f64 {
            case.conv(x, w).iter().zip(&rf).map(|(a, b)| a * b).sum()
        };
        let eps = 1e-3;
        let mut dx = zeros(&case.x());
        conv2d_grad_input(&r, &w, case.s, case.p, case.g, &mut dx).unwrap();
        let mut fd = Vec::new();
        for i in 0..xf.len() {
            let (mut plus, mut minus) = (xf.clone(), xf.clone());
            plus[i] += eps;
            minus[i] -= eps;
            fd.push((loss(&plus, &wf) - loss(&minus, &wf)) / (2.0 * eps));
        }
        assert_close(dx.f32(), &fd, 1e-5, &format!("dx {case:?}"));
        let mut dw = zeros(&case.wt());
        conv2d_grad_weight(&x, &r, case.s, case.p, case.g, &mut dw).unwrap();
        let mut fd = Vec::new();
        for i in 0..wf.len() {
            let (mut plus, mut minus) = (wf.clone(), wf.clone());
            plus[i] += eps;
            minus[i] -= eps;
            fd.push((loss(&xf, &plus) - loss(&xf, &minus)) / (2.0 * eps));
        }
        assert_close(dw.f32(), &fd, 1e-5, &format!("dw {case:?}"));
    }
}

#[test]
fn bad_shapes_are_errors() {
    let x = random(&[2, 4, 6, 6], 1);
    let w = random(&[4, 2, 3, 3], 2);
    let mut y = zeros(&[2, 4, 4, 4]);
    assert!(conv2d(&x, &w, 1, 0, 2, &mut y).is_ok());
    // Channels that do not match the groups, a wrong output, a kernel that does not fit.
    assert!(matches!(
        conv2d(&x, &w, 1, 0, 1, &mut y),
        Err(KernelError::Bad { .. })
    ));
    assert!(matches!(
        conv2d(&x, &w, 1, 1, 2, &mut y),
        Err(KernelError::Bad { .. })
    ));
    assert!(matches!(
        conv2d(&x, &w, 0, 0, 2, &mut y),
        Err(KernelError::Bad { .. })
    ));
    let big = random(&[4, 2, 9, 9], 2);
    assert!(matches!(
        conv2d(&x, &big, 1, 0, 2, &mut y),
        Err(KernelError::Bad { .. })
    ));
    let flat = random(&[2, 4, 36], 1);
    assert!(matches!(
        conv2d(&flat, &w, 1, 0, 2, &mut y),
        Err(KernelError::Bad { .. })
    ));
    let mut dx = zeros(&[2, 4, 6, 6]);
    let dy_wrong = zeros(&[2, 4, 5, 5]);
    assert!(matches!(
        conv2d_grad_input(&dy_wrong, &w, 1, 0, 2, &mut dx),
        Err(KernelError::Bad { .. })
    ));
    let mut dw = zeros(&[4, 2, 3, 3]);
    assert!(matches!(
        conv2d_grad_weight(&x, &dy_wrong, 1, 0, 2, &mut dw),
        Err(KernelError::Bad { .. })
    ));
    let mut p = zeros(&[2, 4, 3, 3]);
    assert!(pool2d(&x, true, 2, 2, 0, &mut p).is_ok());
    assert!(matches!(
        pool2d(&x, true, 3, 2, 0, &mut p),
        Err(KernelError::Bad { .. })
    ));
    assert!(matches!(
        pool2d(&x, true, 2, 0, 0, &mut p),
        Err(KernelError::Bad { .. })
    ));
    let mut dxp = zeros(&[2, 4, 6, 5]);
    assert!(matches!(
        pool2d_grad(&x, &p, true, 2, 2, 0, &mut dxp),
        Err(KernelError::Bad { .. })
    ));
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let case = case([6, 16, 20, 20, 32, 3, 1, 1, 2]);
    let (x, w, dy) = (
        random(&case.x(), 1),
        random(&case.wt(), 2),
        random(&case.y(), 3),
    );
    let pooled = [case.n, case.c, 10, 10];
    let dyp = random(&pooled, 4);
    let run = |threads: usize| {
        in_pool(threads, || {
            let mut outs = vec![zeros(&case.y()), zeros(&case.x()), zeros(&case.wt())];
            conv2d(&x, &w, case.s, case.p, case.g, &mut outs[0]).unwrap();
            conv2d_grad_input(&dy, &w, case.s, case.p, case.g, &mut outs[1]).unwrap();
            conv2d_grad_weight(&x, &dy, case.s, case.p, case.g, &mut outs[2]).unwrap();
            for max in [true, false] {
                let mut y = zeros(&pooled);
                pool2d(&x, max, 2, 2, 0, &mut y).unwrap();
                let mut dx = zeros(&case.x());
                pool2d_grad(&x, &dyp, max, 2, 2, 0, &mut dx).unwrap();
                outs.extend([y, dx]);
            }
            outs.iter()
                .map(|t| t.f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        })
    };
    let one = run(1);
    assert_eq!(one, run(2));
    assert_eq!(one, run(3));
}
