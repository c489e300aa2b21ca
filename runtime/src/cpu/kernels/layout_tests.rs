//! Tests of `layout.rs`.

use super::super::reduce::{expand, reduce, sum_to};
use super::*;
use crate::cpu::kernels::testutil::{
    assert_close, bad_message, dot, in_pool, randn, ravel, unravel, zeros,
};
use crate::rng::{stream, uniform, Purpose};

fn randi(n: u64, shape: &[usize]) -> Tensor {
    let s = stream(12, Purpose::Synthetic, n);
    let v = (0..numel(shape))
        .map(|i| (uniform(s, i as u64) * 1000.0) as i32 - 500)
        .collect();
    Tensor::from_i32(shape.to_vec(), v)
}

fn zeros_i(shape: &[usize]) -> Tensor {
    Tensor::from_i32(shape.to_vec(), vec![0; numel(shape)])
}

fn all_perms(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut out = vec![];
    for p in all_perms(n - 1) {
        for k in 0..n {
            let mut q = p.clone();
            q.insert(k, n - 1);
            out.push(q);
        }
    }
    out
}

#[test]
fn copy_keeps_elements_and_checks_types() {
    let x = randn(0, &[3, 4]);
    let mut out = zeros(&[2, 6]);
    copy(&x, &mut out).unwrap();
    assert_eq!(out.f32(), x.f32());
    let xi = randi(0, &[3, 4]);
    let mut oi = zeros_i(&[12]);
    copy(&xi, &mut oi).unwrap();
    assert_eq!(oi.i32(), xi.i32());
    assert!(matches!(
        copy(&xi, &mut zeros(&[12])),
        Err(KernelError::Bad { .. })
    ));
    assert!(matches!(
        copy(&x, &mut zeros(&[13])),
        Err(KernelError::Bad { .. })
    ));
}

#[test]
fn every_rank4_permutation_matches_the_naive_index_map() {
    let shape = [2, 3, 4, 5];
    let x = randn(1, &shape);
    let xi = randi(1, &shape);
    for perm in all_perms(4) {
        let oshape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
        let mut out = zeros(&oshape);
        permute(&x, &perm, &mut out).unwrap();
        let mut oi = zeros_i(&oshape);
        permute(&xi, &perm, &mut oi).unwrap();
        for i in 0..out.numel() {
            let oidx = unravel(i, &oshape);
            let mut xidx = vec![0; 4];
            for k in 0..4 {
                xidx[perm[k]] = oidx[k];
            }
            let j = ravel(&xidx, &shape);
            assert_eq!(out.f32()[i], x.f32()[j], "perm {perm:?} at {oidx:?}");
            assert_eq!(oi.i32()[i], xi.i32()[j], "perm {perm:?} at {oidx:?}");
        }
        // The inverse permutation restores x.
        let mut inv = vec![0; 4];
        for (k, &p) in perm.iter().enumerate() {
            inv[p] = k;
        }
        let mut back = zeros(&shape);
        permute(&out, &inv, &mut back).unwrap();
        assert_eq!(back, x);
    }
    // Size-1 axes and a scalar.
    let y = randn(2, &[1, 5, 1, 3]);
    let mut out = zeros(&[3, 1, 5, 1]);
    permute(&y, &[3, 0, 1, 2], &mut out).unwrap();
    for i in 0..15 {
        let (a, b) = (i / 3, i % 3);
        assert_eq!(out.f32()[b * 5 + a], y.f32()[i]);
    }
    let s = randn(3, &[]);
    let mut o = zeros(&[]);
    permute(&s, &[], &mut o).unwrap();
    assert_eq!(o, s);
    assert!(permute(&x, &[0, 1, 1, 3], &mut zeros(&shape)).is_err());
    assert!(permute(&x, &[1, 0, 2, 3], &mut zeros(&shape)).is_err());
}

#[test]
fn concat_slice_and_pad_match_naive_and_invert_each_other() {
    let shape = [3, 4, 5];
    for axis in 0..3 {
        let (sa, mut sb) = (shape.to_vec(), shape.to_vec());
        sb[axis] = 2;
        let a = randn(4, &sa);
        let b = randn(5, &sb);
        let mut so = shape.to_vec();
        so[axis] += 2;
        let mut out = zeros(&so);
        concat(&a, &b, axis, &mut out).unwrap();
        for i in 0..out.numel() {
            let mut idx = unravel(i, &so);
            let want = if idx[axis] < sa[axis] {
                a.f32()[ravel(&idx, &sa)]
            } else {
                idx[axis] -= sa[axis];
                b.f32()[ravel(&idx, &sb)]
            };
            assert_eq!(out.f32()[i], want);
        }
        // i32 concat.
        let (ai, bi) = (randi(4, &sa), randi(5, &sb));
        let mut oi = zeros_i(&so);
        concat(&ai, &bi, axis, &mut oi).unwrap();
        // Slices give the parts back, for both element types.
        let mut back_a = zeros(&sa);
        slice(&out, axis, 0, &mut back_a).unwrap();
        assert_eq!(back_a, a);
        let mut back_b = zeros_i(&sb);
        slice(&oi, axis, sa[axis], &mut back_b).unwrap();
        assert_eq!(back_b, bi);
        // Pad is the adjoint of slice: <slice(x), r> = <x, pad(r)>.
        let start = 1;
        let mut sl = shape.to_vec();
        sl[axis] -= 2;
        let x = randn(6, &shape);
        let r = randn(7, &sl);
        let mut s = zeros(&sl);
        slice(&x, axis, start, &mut s).unwrap();
        let mut p = zeros(&shape);
        pad(&r, axis, start, &mut p).unwrap();
        assert!((dot(&s, &r) - dot(&x, &p)).abs() < 1e-9);
        for i in 0..p.numel() {
            let mut idx = unravel(i, &shape);
            let want = if idx[axis] >= start && idx[axis] < start + sl[axis] {
                idx[axis] -= start;
                r.f32()[ravel(&idx, &sl)]
            } else {
                0.0
            };
            assert_eq!(p.f32()[i], want);
        }
    }
    let x = randn(8, &[3, 4]);
    assert!(slice(&x, 1, 2, &mut zeros(&[3, 3])).is_err());
    assert!(pad(&x, 1, 2, &mut zeros(&[3, 5])).is_err());
    assert!(concat(&x, &randn(9, &[2, 4]), 1, &mut zeros(&[3, 8])).is_err());
    assert!(concat(&x, &randi(9, &[3, 4]), 1, &mut zeros(&[3, 8])).is_err());
}

fn indices(n: u64, shape: &[usize], rows: usize) -> Tensor {
    let s = stream(13, Purpose::Synthetic, n);
    let v = (0..numel(shape))
        .map(|i| crate::rng::below(s, i as u64, rows as u64) as i32)
        .collect();
    Tensor::from_i32(shape.to_vec(), v)
}

#[test]
fn gather_and_scatter_add_match_naive_and_are_adjoint() {
    let (v, d) = (7, 5);
    let table = randn(10, &[v, d]);
    let idx = indices(0, &[3, 4], v);
    let mut out = zeros(&[3, 4, d]);
    gather(&table, &idx, &mut out).unwrap();
    for p in 0..12 {
        let row = idx.i32()[p] as usize;
        assert_eq!(&out.f32()[p * d..][..d], &table.f32()[row * d..][..d]);
    }
    // Scatter-add sums the rows of dy at each index, repeated indices included.
    let dy = randn(11, &[3, 4, d]);
    let mut acc = zeros(&[v, d]);
    acc.f32_mut().fill(9.0); // overwritten, not accumulated into
    scatter_add(&idx, &dy, &mut acc).unwrap();
    let mut want = vec![0f64; v * d];
    for p in 0..12 {
        let row = idx.i32()[p] as usize;
        for k in 0..d {
            want[row * d + k] += dy.f32()[p * d + k] as f64;
        }
    }
    assert_close(acc.f32(), &want, 1e-6);
    // Adjoint: <gather(T), dy> = <T, scatter_add(dy)>.
    assert!((dot(&out, &dy) - dot(&table, &acc)).abs() < 1e-5);
}

#[test]
fn out_of_range_indices_are_errors_naming_the_index() {
    let table = randn(12, &[4, 3]);
    for bad_index in [4, -1, 1000] {
        let idx = Tensor::from_i32(vec![3], vec![0, bad_index, 2]);
        let e = gather(&table, &idx, &mut zeros(&[3, 3])).unwrap_err();
        let message = bad_message(e, "gather");
        assert!(
            message.contains(&format!("index {bad_index} ")),
            "{message}"
        );
        let dy = randn(13, &[3, 3]);
        let e = scatter_add(&idx, &dy, &mut zeros(&[4, 3])).unwrap_err();
        assert!(
            e.to_string().contains(&format!("index {bad_index} ")),
            "{e}"
        );
    }
    // Float indices are refused.
    let fidx = Tensor::from_f32(vec![2], vec![0.0, 1.0]);
    assert!(gather(&table, &fidx, &mut zeros(&[2, 3])).is_err());
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let x = randn(50, &[8, 64, 300]);
    let idx = indices(1, &[40, 50], 64);
    let table = randn(51, &[64, 300]);
    let dy = randn(52, &[40, 50, 300]);
    let run = || {
        let mut p = zeros(&[300, 8, 64]);
        permute(&x, &[2, 0, 1], &mut p).unwrap();
        let mut r1 = zeros(&[8, 300]);
        reduce(&x, &[1], true, &mut r1).unwrap();
        let mut r2 = zeros(&[64]);
        reduce(&x, &[0, 2], false, &mut r2).unwrap();
        let mut st = zeros(&[300]);
        sum_to(&x, &mut st).unwrap();
        let mut g = zeros(&[40, 50, 300]);
        gather(&table, &idx, &mut g).unwrap();
        let mut sa = zeros(&[64, 300]);
        scatter_add(&idx, &dy, &mut sa).unwrap();
        let mut e = zeros(&[8, 64, 3, 300]);
        expand(&r1, &[1, 2], true, &mut e).unwrap();
        let mut e2 = zeros(&[8, 64, 300]);
        expand(&r1, &[1], true, &mut e2).unwrap();
        [p, r1, r2, st, g, sa, e, e2]
    };
    let one = in_pool(1, run);
    let two = in_pool(2, run);
    for (a, b) in one.iter().zip(&two) {
        let (a, b): (Vec<u32>, Vec<u32>) = (
            a.f32().iter().map(|v| v.to_bits()).collect(),
            b.f32().iter().map(|v| v.to_bits()).collect(),
        );
        assert!(a == b);
    }
}
