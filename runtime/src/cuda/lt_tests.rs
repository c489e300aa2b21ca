//! Tests of the cuBLASLt plans that need no GPU: plan selection, the cache key, the
//! row-major-to-column-major mapping (run on the CPU with cuBLASLt's column-major, strided
//! batched semantics) and the fallback when libcublasLt is missing.

use super::key::{alignment, ColMajor};
use super::*;
use std::cell::Cell;

fn gemm(m: u64, n: u64, k: u64, count: u64, ta: bool, tb: bool) -> Gemm {
    Gemm {
        pa: 0x7000_0000,
        pb: 0x7100_0000,
        pc: 0x7200_0000,
        m,
        n,
        k,
        count,
        trans_a: ta,
        trans_b: tb,
        stride_a: m * k,
        stride_b: k * n,
        stride_c: m * n,
        bf16: [false; 3],
    }
}

#[test]
fn cublaslt_serves_bf16_and_tf32_unless_the_variable_is_0() {
    assert_eq!(selected(Precision::Bf16, None), Some(Compute::Bf16));
    assert_eq!(selected(Precision::Tf32, Some("1")), Some(Compute::Tf32));
    assert_eq!(selected(Precision::Bf16, Some("0")), None);
    assert_eq!(selected(Precision::Tf32, Some(" 0\n")), None);
    // Exact fp32 stays on sgemm whatever the variable says.
    assert_eq!(selected(Precision::Fp32, None), None);
    assert_eq!(selected(Precision::Fp32, Some("1")), None);
}

#[test]
fn cublaslt_workspace_is_32_mib_from_hopper_on() {
    assert_eq!(workspace_bytes(9), 32 << 20);
    assert_eq!(workspace_bytes(10), 32 << 20);
    assert_eq!(workspace_bytes(8), 4 << 20);
}

#[test]
fn cublaslt_alignment_is_that_of_every_batch_start() {
    assert_eq!(alignment(0x7000_0000, 0, 1), 256);
    assert_eq!(alignment(0x7000_0010, 0, 1), 16);
    // One matrix: the stride is never used.
    assert_eq!(alignment(0x7000_0000, 12, 1), 256);
    // 3 floats apart: the second batch starts 12 bytes in.
    assert_eq!(alignment(0x7000_0000, 12, 2), 4);
    assert_eq!(alignment(0x7000_0000, 64 * 12, 2), 256);
    assert_eq!(alignment(0x7000_0000, 8, 4), 8);
    // A broadcast operand (stride 0) keeps its pointer's alignment.
    assert_eq!(alignment(0x7000_0020, 0, 8), 32);
}

#[test]
fn cublaslt_keys_count_bf16_operands_in_bytes_and_apart() {
    // A is 3 x 4 per batch, B 4 x 5, C 3 x 5: in f32 48, 80 and 60 bytes apart.
    let f32s = gemm(3, 5, 4, 2, false, false);
    let bf16s = Gemm {
        bf16: [true, true, false],
        ..f32s
    };
    let (kf, kb) = (
        Key::of(&f32s, Compute::Bf16),
        Key::of(&bf16s, Compute::Bf16),
    );
    assert_ne!(kf, kb);
    assert_eq!(kf.align, [16, 16, 4]);
    // In bf16 A's starts are 24 bytes apart, B's 40; C stays f32.
    assert_eq!(kb.align, [8, 8, 4]);
    assert_eq!(kb.bf16, [true, true, false]);
}

#[test]
fn cublaslt_launches_of_one_shape_share_a_plan() {
    let cache: Cache<u32> = Cache::new();
    let built = Cell::new(0);
    let build = || {
        built.set(built.get() + 1);
        Ok(Some(built.get()))
    };
    let g = gemm(64, 32, 16, 4, false, true);
    // Other buffers, equally aligned: the same plan.
    let mut h = gemm(64, 32, 16, 4, false, true);
    h.pa += 1 << 20;
    h.pc += 256;
    let key = Key::of(&g, Compute::Bf16);
    assert_eq!(key, Key::of(&h, Compute::Bf16));
    assert_eq!(cache.with(key, build, |p| *p).unwrap(), Some(1));
    assert_eq!(cache.with(key, build, |p| *p).unwrap(), Some(1));
    assert_eq!(
        cache
            .with(Key::of(&h, Compute::Bf16), build, |p| *p)
            .unwrap(),
        Some(1)
    );
    assert_eq!(built.get(), 1);

    // Each difference gets its own plan.
    let mut others = vec![
        Key::of(&g, Compute::Tf32),
        Key::of(&gemm(64, 32, 16, 4, true, true), Compute::Bf16),
        Key::of(&gemm(64, 32, 16, 4, false, false), Compute::Bf16),
        Key::of(&gemm(64, 32, 16, 2, false, true), Compute::Bf16),
        Key::of(&gemm(32, 64, 16, 4, false, true), Compute::Bf16),
    ];
    let mut broadcast = gemm(64, 32, 16, 4, false, true);
    broadcast.stride_b = 0;
    others.push(Key::of(&broadcast, Compute::Bf16));
    let mut padded = gemm(64, 32, 16, 4, false, true);
    padded.stride_c += 64;
    others.push(Key::of(&padded, Compute::Bf16));
    let mut offset = gemm(64, 32, 16, 4, false, true);
    offset.pb += 16;
    others.push(Key::of(&offset, Compute::Bf16));
    for (i, k) in others.iter().enumerate() {
        assert_ne!(*k, key, "key {i}");
        assert_eq!(cache.with(*k, build, |p| *p).unwrap(), Some(i as u32 + 2));
    }
    assert_eq!(built.get(), others.len() as u32 + 1);
    assert_eq!(cache.counts(), (others.len() + 1, 0));
}

#[test]
fn cublaslt_shapes_without_a_plan_go_to_cublas_without_rebuilding() {
    let cache: Cache<u32> = Cache::new();
    let built = Cell::new(0);
    let none = || {
        built.set(built.get() + 1);
        Ok(None)
    };
    let key = Key::of(&gemm(8, 8, 8, 1, false, false), Compute::Bf16);
    assert_eq!(cache.with(key, none, |p| *p).unwrap(), None);
    assert_eq!(cache.with(key, none, |p| *p).unwrap(), None);
    assert_eq!(built.get(), 1);

    // A plan cuBLASLt refused at run time is not tried again.
    let other = Key::of(&gemm(8, 8, 8, 2, false, false), Compute::Bf16);
    assert_eq!(cache.with(other, || Ok(Some(7)), |p| *p).unwrap(), Some(7));
    cache.disable(other);
    assert_eq!(cache.with(other, none, |p| *p).unwrap(), None);
    assert_eq!(built.get(), 1);
    assert_eq!(cache.counts(), (0, 2));

    // A failed build is an error and is not remembered.
    let third = Key::of(&gemm(8, 8, 8, 3, false, false), Compute::Bf16);
    let failed = cache.with(third, || Err(CudaError::Blas("x".into())), |p| *p);
    assert!(failed.is_err());
    assert_eq!(cache.with(third, || Ok(Some(3)), |p| *p).unwrap(), Some(3));
}

#[test]
fn cublaslt_column_major_sizes_and_leading_dimensions() {
    let cm = col_major(&Key::of(&gemm(5, 3, 7, 2, false, false), Compute::Bf16));
    let m = |rows, cols, ld, stride| Matrix {
        rows,
        cols,
        ld,
        stride,
    };
    assert_eq!(cm.a, m(3, 7, 3, 21)); // B (k × n row-major) read as n × k
    assert_eq!(cm.b, m(7, 5, 7, 35)); // A (m × k row-major) read as k × m
    assert_eq!(cm.d, m(3, 5, 3, 15));
    assert_eq!((cm.trans_a, cm.trans_b, cm.batch), (false, false, 2));
    let cm = col_major(&Key::of(&gemm(5, 3, 7, 2, true, true), Compute::Bf16));
    assert_eq!(cm.a, m(7, 3, 7, 21)); // B stored n × k
    assert_eq!(cm.b, m(5, 7, 5, 35)); // A stored k × m
    assert_eq!((cm.trans_a, cm.trans_b), (true, true));
    // The leading dimensions cuBLAS gets in gemm.rs.
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let cm = col_major(&Key::of(&gemm(5, 3, 7, 1, ta, tb), Compute::Tf32));
        assert_eq!(cm.a.ld, if tb { 7 } else { 3 });
        assert_eq!(cm.b.ld, if ta { 5 } else { 7 });
        assert_eq!(cm.d.ld, 3);
    }
}

/// `D = op(A') op(B') (+ bias)` per batch, as cuBLASLt computes it from column-major layouts:
/// its `CUBLASLT_EPILOGUE_BIAS` adds `bias[i]` to row `i` of D, in every column and batch.
fn run_col_major(
    cm: &ColMajor,
    k: u64,
    (a, b): (&[f32], &[f32]),
    bias: Option<&[f32]>,
    d: &mut [f32],
) {
    let at = |x: &Matrix, mem: &[f32], t: bool, batch: u64, i: u64, j: u64| {
        let (r, c) = if t { (j, i) } else { (i, j) };
        assert!(r < x.rows && c < x.cols && x.ld >= x.rows);
        mem[(batch * x.stride + r + c * x.ld) as usize]
    };
    // op(A') is d.rows × k, op(B') is k × d.cols.
    let (ar, ac) = if cm.trans_a {
        (cm.a.cols, cm.a.rows)
    } else {
        (cm.a.rows, cm.a.cols)
    };
    let (br, bc) = if cm.trans_b {
        (cm.b.cols, cm.b.rows)
    } else {
        (cm.b.rows, cm.b.cols)
    };
    assert_eq!((ar, ac, br, bc), (cm.d.rows, k, k, cm.d.cols));
    for batch in 0..cm.batch {
        for i in 0..cm.d.rows {
            for j in 0..cm.d.cols {
                let mut s = 0f32;
                for p in 0..k {
                    s += at(&cm.a, a, cm.trans_a, batch, i, p)
                        * at(&cm.b, b, cm.trans_b, batch, p, j);
                }
                if let Some(bias) = bias {
                    assert_eq!(bias.len() as u64, cm.d.rows, "one bias per row of D");
                    s += bias[i as usize];
                }
                d[(batch * cm.d.stride + i + j * cm.d.ld) as usize] = s;
            }
        }
    }
}

/// Row-major `C = op(A) op(B)` per batch, directly.
fn run_row_major(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, n, k) = (g.m, g.n, g.k);
    for batch in 0..g.count {
        let (oa, ob, oc) = (batch * g.stride_a, batch * g.stride_b, batch * g.stride_c);
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f32;
                for p in 0..k {
                    let x = if g.trans_a {
                        a[(oa + p * m + i) as usize]
                    } else {
                        a[(oa + i * k + p) as usize]
                    };
                    let y = if g.trans_b {
                        b[(ob + j * k + p) as usize]
                    } else {
                        b[(ob + p * n + j) as usize]
                    };
                    s += x * y;
                }
                c[(oc + i * n + j) as usize] = s;
            }
        }
    }
}

#[test]
fn cublaslt_column_major_problem_computes_the_row_major_product() {
    // Small integers: every sum is exact, so the two orders agree bit for bit.
    let mut seed = 7u32;
    let mut values = |n: u64| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                ((seed >> 16) % 9) as f32 - 4.0
            })
            .collect()
    };
    let (m, n, k) = (5, 3, 7);
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        for (count, broadcast_a, broadcast_b) in [
            (1, false, false),
            (3, false, false),
            (3, true, false),
            (3, false, true),
        ] {
            let mut g = gemm(m, n, k, count, ta, tb);
            if broadcast_a {
                g.stride_a = 0;
            }
            if broadcast_b {
                g.stride_b = 0;
            }
            let a = values(m * k * count);
            let b = values(k * n * count);
            let mut want = vec![f32::NAN; (m * n * count) as usize];
            let mut got = want.clone();
            run_row_major(&g, &a, &b, &mut want);
            let cm = col_major(&Key::of(&g, Compute::Bf16));
            run_col_major(&cm, k, (&b, &a), None, &mut got);
            assert_eq!(
                got, want,
                "trans {ta}/{tb}, batch {count}, broadcast {broadcast_a}/{broadcast_b}"
            );
        }
    }
}

/// A `gemm+bias` kernel's bias (one value per column of row-major C, `codegen::GemmBias`) is
/// cuBLASLt's bias of column-major D's rows, the same in every batch; such a GEMM has a
/// plan of its own.
#[test]
fn cublaslt_bias_epilogue_adds_the_bias_along_the_last_axis() {
    let (m, n, k) = (4, 3, 5);
    let values = |n: u64, at: f32| -> Vec<f32> { (0..n).map(|i| (i % 7) as f32 - at).collect() };
    for count in [1, 2] {
        let g = gemm(m, n, k, count, false, true);
        let (a, b) = (values(m * k * count, 3.0), values(k * n * count, 2.0));
        let bias = [0.5f32, -1.25, 8.0];
        let mut want = vec![f32::NAN; (m * n * count) as usize];
        run_row_major(&g, &a, &b, &mut want);
        for (i, x) in want.iter_mut().enumerate() {
            *x += bias[i % n as usize];
        }
        let key = Key {
            bias: true,
            ..Key::of(&g, Compute::Bf16)
        };
        assert_ne!(key, Key::of(&g, Compute::Bf16));
        let mut got = vec![f32::NAN; want.len()];
        run_col_major(&col_major(&key), k, (&b, &a), Some(&bias), &mut got);
        assert_eq!(got, want, "batch {count}");
    }
}

#[test]
fn cublaslt_missing_library_means_the_cublas_path() {
    // Must not panic on a machine without libcublasLt (cudarc panics on any call then).
    if !present() {
        assert!(matches!(Lt::new(Compute::Bf16, 9), Ok(None)));
        assert!(matches!(Lt::new(Compute::Tf32, 8), Ok(None)));
    }
}
