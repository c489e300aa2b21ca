//! The row kernels against f64 references and finite differences, and their bits on any
//! thread count.

use super::super::norms::{
    layer_norm_grad_row, layer_norm_grad_row_at, layer_norm_row, layer_norm_row_at,
};
use super::*;
use crate::cpu::kernels::testutil::{bad_message, in_pool, zeros};
use crate::cpu::tensor::numel;
use crate::rng::{below, normal, stream, Purpose};

const EPS: f32 = 1e-5;

fn randn(n: u64, shape: &[usize], scale: f32) -> Tensor {
    let s = stream(21, Purpose::Synthetic, n);
    let v = (0..numel(shape))
        .map(|i| scale * normal(s, i as u64))
        .collect();
    Tensor::from_f32(shape.to_vec(), v)
}

/// The rows compiled for this CPU's vector level give the baseline's bits.
#[test]
fn row_kernels_match_the_baseline_at_every_length() {
    for c in [1, 7, 8, 64, 257] {
        let (x, g) = (randn(80, &[c], 3.0), randn(81, &[c], 1.0));
        let (x, g) = (x.f32(), g.f32());
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let (mut a, mut b) = (vec![0.0; c], vec![0.0; c]);
        for by in [None, Some(0.37)] {
            softmax_row(x, &mut a, by);
            softmax_row_at(x, &mut b, by);
            assert_eq!(bits(&a), bits(&b), "softmax {c}");
        }
        softmax_grad_row(x, g, &mut a);
        softmax_grad_row_at(x, g, &mut b);
        assert_eq!(bits(&a), bits(&b), "softmax_grad {c}");
        layer_norm_row(x, &mut a, EPS);
        layer_norm_row_at(x, &mut b, EPS);
        assert_eq!(bits(&a), bits(&b), "layer_norm {c}");
        layer_norm_grad_row(x, g, &mut a, EPS);
        layer_norm_grad_row_at(x, g, &mut b, EPS);
        assert_eq!(bits(&a), bits(&b), "layer_norm_grad {c}");
    }
}

fn labels(n: u64, shape: &[usize], classes: usize) -> Tensor {
    let s = stream(22, Purpose::Synthetic, n);
    let v = (0..numel(shape))
        .map(|i| below(s, i as u64, classes as u64) as i32)
        .collect();
    Tensor::from_i32(shape.to_vec(), v)
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.f32().iter().map(|&v| v as f64).collect()
}

/// `|got - want| <= tol * (1 + |want|)` everywhere.
fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

/// Central differences of `f` at `x`, in f64.
fn finite_diff(x: &[f32], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let h = 1e-5;
    let mut p: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    (0..x.len())
        .map(|i| {
            let v = p[i];
            p[i] = v + h;
            let up = f(&p);
            p[i] = v - h;
            let down = f(&p);
            p[i] = v;
            (up - down) / (2.0 * h)
        })
        .collect()
}

fn weighted(y: &[f64], r: &Tensor) -> f64 {
    y.iter().zip(r.f32()).map(|(&a, &b)| a * b as f64).sum()
}

// ---- f64 references ----

fn softmax_ref(x: &[f64], c: usize, causal: bool) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for (i, (row, o)) in x.chunks(c).zip(out.chunks_mut(c)).enumerate() {
        let n = if causal { i % c + 1 } else { c };
        let m = row[..n].iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row[..n].iter().map(|v| (v - m).exp()).sum();
        for j in 0..n {
            o[j] = (row[j] - m).exp() / s;
        }
    }
    out
}

fn layer_norm_ref(x: &[f64], c: usize, eps: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(c) {
        let m = row.iter().sum::<f64>() / c as f64;
        let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / c as f64;
        out.extend(row.iter().map(|v| (v - m) / (var + eps).sqrt()));
    }
    out
}

fn rms_norm_ref(x: &[f64], c: usize, eps: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(c) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / c as f64;
        out.extend(row.iter().map(|v| v / (ms + eps).sqrt()));
    }
    out
}

/// PyTorch's `cross_entropy(x, labels, label_smoothing=s)`, mean reduction.
fn xent_ref(x: &[f64], labels: &[i32], c: usize, s: f64) -> f64 {
    let mut total = 0.0;
    for (row, &l) in x.chunks(c).zip(labels) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        let logp: Vec<f64> = row.iter().map(|v| v - lse).collect();
        let nll = -logp[l as usize];
        let smooth = -logp.iter().sum::<f64>() / c as f64;
        total += (1.0 - s) * nll + s * smooth;
    }
    total / labels.len() as f64
}

// ---- forward values ----

#[test]
fn softmax_matches_reference_and_is_stable() {
    for scale in [1.0, 100.0] {
        let x = randn(0, &[3, 5, 17], scale);
        let mut y = zeros(&[3, 5, 17]);
        softmax(&x, false, &mut y).unwrap();
        assert_close(y.f32(), &softmax_ref(&f64s(&x), 17, false), 1e-6, "softmax");
        assert!(y.f32().iter().all(|v| v.is_finite()));
    }
}

#[test]
fn causal_softmax_masks_future_keys_exactly() {
    let s = 7;
    let x = randn(1, &[2, 3, s, s], 3.0);
    let mut y = zeros(&[2, 3, s, s]);
    y.f32_mut().fill(f32::NAN); // every element is overwritten
    softmax(&x, true, &mut y).unwrap();
    assert_close(
        y.f32(),
        &softmax_ref(&f64s(&x), s, true),
        1e-6,
        "causal softmax",
    );
    for (r, row) in y.f32().chunks(s).enumerate() {
        let i = r % s;
        assert!(row[i + 1..].iter().all(|&v| v == 0.0), "row {r}: {row:?}");
        let sum: f64 = row.iter().map(|&v| v as f64).sum();
        assert!((sum - 1.0).abs() < 1e-6);
    }
    assert_eq!(y.f32()[0], 1.0);
    // Not square: an error.
    assert!(softmax(&randn(2, &[2, 3, 4], 1.0), true, &mut zeros(&[2, 3, 4])).is_err());
}

#[test]
fn norms_match_references() {
    let x = randn(3, &[4, 6, 33], 2.0);
    let xd = f64s(&x);
    let mut y = zeros(&[4, 6, 33]);
    layer_norm(&x, EPS, &mut y).unwrap();
    assert_close(
        y.f32(),
        &layer_norm_ref(&xd, 33, EPS as f64),
        1e-6,
        "layer_norm",
    );
    rms_norm(&x, EPS, &mut y).unwrap();
    assert_close(
        y.f32(),
        &rms_norm_ref(&xd, 33, EPS as f64),
        1e-6,
        "rms_norm",
    );
    // A constant row normalises to zeros (variance 0, eps keeps it finite).
    let c = Tensor::from_f32(vec![1, 4], vec![3.0; 4]);
    let mut z = zeros(&[1, 4]);
    layer_norm(&c, EPS, &mut z).unwrap();
    assert_eq!(z.f32(), &[0.0; 4]);
}

#[test]
fn cross_entropy_matches_pytorch_formula_with_and_without_smoothing() {
    let (c, shape) = (11, [3, 4]);
    let x = randn(6, &[3, 4, c], 2.0);
    let l = labels(0, &shape, c);
    for s in [0.0, 0.1] {
        let mut out = zeros(&[]);
        cross_entropy(&x, &l, s, &mut out).unwrap();
        let want = xent_ref(&f64s(&x), l.i32(), c, s as f64);
        assert!(
            (out.f32()[0] as f64 - want).abs() < 1e-6 * (1.0 + want.abs()),
            "s={s}: {} vs {want}",
            out.f32()[0]
        );
    }
    // One position of rank-1 logits.
    let x1 = randn(7, &[c], 1.0);
    let l1 = Tensor::from_i32(vec![], vec![3]);
    let mut out = zeros(&[]);
    cross_entropy(&x1, &l1, 0.0, &mut out).unwrap();
    let want = xent_ref(&f64s(&x1), l1.i32(), c, 0.0);
    assert!((out.f32()[0] as f64 - want).abs() < 1e-6 * (1.0 + want));
}

#[test]
fn labels_out_of_range_are_errors_naming_the_label() {
    let c = 5;
    let x = randn(8, &[3, c], 1.0);
    for bad_label in [5, -1, -99, 77] {
        let l = Tensor::from_i32(vec![3], vec![0, 4, bad_label]);
        let e = cross_entropy(&x, &l, 0.0, &mut zeros(&[])).unwrap_err();
        let message = bad_message(e, "cross_entropy");
        assert!(
            message.contains(&format!("label {bad_label} ")),
            "{message}"
        );
        let d = Tensor::from_f32(vec![], vec![1.0]);
        let e = cross_entropy_grad(&x, &l, &d, 0.1, &mut zeros(&[3, c])).unwrap_err();
        assert!(
            e.to_string().contains(&format!("label {bad_label} ")),
            "{e}"
        );
    }
    // Float labels and mismatched shapes are refused.
    let fl = Tensor::from_f32(vec![3], vec![0.0; 3]);
    assert!(cross_entropy(&x, &fl, 0.0, &mut zeros(&[])).is_err());
    assert!(cross_entropy(&x, &labels(1, &[4], c), 0.0, &mut zeros(&[])).is_err());
}

// ---- gradients: closed forms and finite differences of sum(f(x) * r) ----

/// Checks the analytic gradient `got` against finite differences of `f`.
fn check_grad(got: &Tensor, x: &Tensor, f: impl Fn(&[f64]) -> f64, what: &str) {
    assert_close(got.f32(), &finite_diff(x.f32(), f), 2e-5, what);
}

#[test]
fn softmax_grad_matches_formula_and_finite_differences() {
    for (shape, causal) in [(&[2, 3, 8][..], false), (&[2, 5, 5][..], true)] {
        let c = shape[shape.len() - 1];
        let x = randn(9, shape, 1.5);
        let r = randn(10, shape, 1.0);
        let mut y = zeros(shape);
        softmax(&x, causal, &mut y).unwrap();
        let mut dx = zeros(shape);
        softmax_grad(&y, &r, &mut dx).unwrap();
        // Closed form on the kernel's y.
        let mut want = vec![0.0; dx.numel()];
        for ((yr, rr), w) in y
            .f32()
            .chunks(c)
            .zip(r.f32().chunks(c))
            .zip(want.chunks_mut(c))
        {
            let s: f64 = yr.iter().zip(rr).map(|(&a, &b)| a as f64 * b as f64).sum();
            for j in 0..c {
                w[j] = yr[j] as f64 * (rr[j] as f64 - s);
            }
        }
        assert_close(dx.f32(), &want, 1e-6, "softmax_grad formula");
        check_grad(
            &dx,
            &x,
            |p| weighted(&softmax_ref(p, c, causal), &r),
            "softmax_grad",
        );
    }
}

#[test]
fn norm_grads_match_finite_differences() {
    let shape = [3, 4, 8];
    type NormGrad = fn(&Tensor, &Tensor, f32, &mut Tensor) -> Result<(), KernelError>;
    type Reference = fn(&[f64], usize, f64) -> Vec<f64>;
    let norms: [(NormGrad, Reference, u64, &str); 2] = [
        (layer_norm_grad, layer_norm_ref, 11, "layer_norm_grad"),
        (rms_norm_grad, rms_norm_ref, 13, "rms_norm_grad"),
    ];
    for (grad, reference, seed, name) in norms {
        let x = randn(seed, &shape, 1.5);
        let r = randn(seed + 1, &shape, 1.0);
        let mut dx = zeros(&shape);
        grad(&x, &r, EPS, &mut dx).unwrap();
        check_grad(
            &dx,
            &x,
            |p| weighted(&reference(p, 8, EPS as f64), &r),
            name,
        );
    }
}

#[test]
fn cross_entropy_grad_matches_finite_differences() {
    let (c, shape) = (7, [2, 3]);
    let x = randn(17, &[2, 3, c], 2.0);
    let l = labels(2, &shape, c);
    let dloss = 1.7;
    let d = Tensor::from_f32(vec![], vec![dloss]);
    for s in [0.0f32, 0.1] {
        let mut dx = zeros(&[2, 3, c]);
        dx.f32_mut().fill(f32::NAN);
        cross_entropy_grad(&x, &l, &d, s, &mut dx).unwrap();
        check_grad(
            &dx,
            &x,
            |p| dloss as f64 * xent_ref(p, l.i32(), c, s as f64),
            &format!("cross_entropy_grad s={s}"),
        );
        // Each position's gradient sums to zero (softmax and target both sum to one).
        for row in dx.f32().chunks(c) {
            assert!(row.iter().map(|&v| v as f64).sum::<f64>().abs() < 1e-7);
        }
        // Written over the logits (the schedule's choice), with an ignored position: the
        // same bits as into a buffer of its own.
        let mut l = l.clone();
        l.i32_mut()[4] = IGNORE;
        let mut own = zeros(&[2, 3, c]);
        cross_entropy_grad(&x, &l, &d, s, &mut own).unwrap();
        let mut over = x.clone();
        cross_entropy_grad_in_place(&mut over, &l, &d, s).unwrap();
        let bits = |t: &Tensor| t.f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&over), bits(&own), "in place, s={s}");
        assert!(own.f32()[4 * c..5 * c].iter().all(|&v| v == 0.0));
    }
}

// ---- determinism ----

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let att = randn(20, &[4, 128, 128], 3.0);
    let dy = randn(21, &[4, 128, 128], 1.0);
    let x = randn(22, &[256, 200], 2.0);
    let dx = randn(23, &[256, 200], 1.0);
    let logits = randn(26, &[512, 100], 3.0);
    let l = labels(3, &[512], 100);
    let d = Tensor::from_f32(vec![], vec![0.75]);
    let run = || {
        let mut outs = Vec::new();
        let mut go = |shape: &[usize], f: &dyn Fn(&mut Tensor) -> Result<(), KernelError>| {
            let mut o = zeros(shape);
            f(&mut o).unwrap();
            outs.push(o);
        };
        let mut y = zeros(&att.shape);
        softmax(&att, true, &mut y).unwrap();
        go(&att.shape, &|o| softmax(&att, false, o));
        go(&att.shape, &|o| softmax_grad(&y, &dy, o));
        go(&x.shape, &|o| layer_norm(&x, EPS, o));
        go(&x.shape, &|o| layer_norm_grad(&x, &dx, EPS, o));
        go(&x.shape, &|o| rms_norm(&x, EPS, o));
        go(&x.shape, &|o| rms_norm_grad(&x, &dx, EPS, o));
        go(&[], &|o| cross_entropy(&logits, &l, 0.1, o));
        go(&logits.shape, &|o| {
            cross_entropy_grad(&logits, &l, &d, 0.1, o)
        });
        outs.push(y);
        outs
    };
    let one = in_pool(1, run);
    let two = in_pool(2, run);
    assert_eq!(one.len(), two.len());
    for (k, (a, b)) in one.iter().zip(&two).enumerate() {
        let bits = |t: &Tensor| t.f32().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert!(
            bits(a) == bits(b),
            "output {k} differs between 1 and 2 threads"
        );
    }
}
