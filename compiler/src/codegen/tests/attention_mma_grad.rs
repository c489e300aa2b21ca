//! Tests of `codegen/attention_mma_grad.rs`: the tensor-core backward (dq, dk and dv, dk
//! alone, dv alone) generated for every width, length and mask and assembled by ptxas, its
//! launches and static shared memory, the fallback to the f32 kernels, and ptxas's register
//! and spill counts. Numerics are checked outside the tests, by a PTX interpreter against an
//! f64 reference (the commit message has the figures); `PARALLAX_MMA_GRAD_DUMP=file` writes
//! the kernels it ran.
use super::super::super::testing::{
    assemble, assert_no_spills, attention_inputs, bf16_attention as bf16, kernel, shared,
    value_f32 as f,
};
use super::super::super::{Arg, Gen, Launch, OpArgs};
use super::super::single;
use super::key_value_grad;
use crate::ir::{AttentionInput, Op};

/// The sizes of one backward: heads, queries, keys, widths `d` and `e`, causal.
#[derive(Clone, Copy)]
struct Case {
    h: u64,
    t: u64,
    s: u64,
    d: u64,
    e: u64,
    causal: bool,
}

/// The backward's kernels of 2 batch positions, token-major: q, k, v, dy, lse, delta as
/// values 0..6, dq 6, dk 7, dv 8. `{tag}_dq`, `{tag}_dkv` (fused), `{tag}_dk`, `{tag}_dv`.
fn backward(g: &mut Gen, tag: &str, c: Case) -> Vec<Launch> {
    let b = 2;
    let Case { h, t, s, d, e, .. } = c;
    let ins = attention_inputs(b, h, (t, s), (d, e));
    let (dq, dk, dv) = (
        f(6, &[b, t, h, d]),
        f(7, &[b, s, h, d]),
        f(8, &[b, s, h, e]),
    );
    let scale = 1.0 / (d as f64).sqrt();
    let op = |wrt| Op::AttentionGrad {
        wrt,
        causal: c.causal,
        scale,
    };
    let by_key = op(AttentionInput::Key);
    let name = |k: &str| format!("{tag}_{k}");
    let mut l = single(
        g,
        OpArgs::new(&name("dq"), &op(AttentionInput::Query), &ins, &dq),
    )
    .unwrap();
    l.extend(
        key_value_grad(
            g,
            OpArgs::new(&name("dkv"), &by_key, &ins, (Some(&dk), Some(&dv))),
        )
        .unwrap(),
    );
    l.extend(single(g, OpArgs::new(&name("dk"), &by_key, &ins, &dk)).unwrap());
    l.extend(
        single(
            g,
            OpArgs::new(&name("dv"), &op(AttentionInput::Value), &ins, &dv),
        )
        .unwrap(),
    );
    l
}

fn case(h: u64, t: u64, s: u64, w: u64, causal: bool) -> Case {
    Case {
        h,
        t,
        s,
        d: w,
        e: w,
        causal,
    }
}

/// Every case the tensor-core backward takes: widths 64 and 128 (and the two mixed), masks,
/// partial tiles, T != S, one head.
fn all_cases() -> Vec<(String, Case)> {
    let mut cases = Vec::new();
    for causal in [false, true] {
        for w in [64, 128] {
            for t in [1, 33, 70, 1024] {
                cases.push((format!("w{w}t{t}c{causal}"), case(3, t, t, w, causal)));
            }
            cases.push((format!("w{w}h1c{causal}"), case(1, 70, 70, w, causal)));
        }
    }
    for (t, s) in [(70, 130), (130, 17)] {
        for w in [64, 128] {
            cases.push((format!("w{w}t{t}s{s}"), case(3, t, s, w, false)));
        }
    }
    for (d, e) in [(64, 128), (128, 64)] {
        let c = Case {
            d,
            e,
            ..case(3, 70, 70, 0, true)
        };
        cases.push((format!("d{d}e{e}"), c));
    }
    cases
}

#[test]
fn every_variant_assembles() {
    let mut g = bf16();
    for (tag, c) in all_cases() {
        let l = backward(&mut g, &tag, c);
        assert!(l.iter().all(|l| kernel(l).2 == 128), "{tag}");
    }
    let text = g.text("sm_80");
    assert!(text.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"));
    assert!(text.contains("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"));
    assert!(!text.contains("atom."), "deterministic: no atomics");
    assemble(&text).unwrap_or_else(|e| panic!("{e}"));
    if let Some(file) = std::env::var_os("PARALLAX_MMA_GRAD_DUMP") {
        std::fs::write(file, &text).unwrap();
    }
}

#[test]
fn launches_shared_memory_and_fallback() {
    let v = |ids: &[usize]| ids.iter().map(|&i| Arg::Value(i)).collect::<Vec<_>>();
    let mut g = bf16();
    let l = backward(&mut g, "k", case(3, 33, 33, 64, true));
    // 2 x 3 problems of 33 rows: one 64-row tile each, 128 threads (4 warps) per block.
    let ins = [0, 1, 2, 3, 4, 5];
    let with = |o: &[usize]| v(&[&ins[..], o].concat());
    assert_eq!(kernel(&l[0]), ("k_dq".into(), 6, 128, with(&[6])));
    assert_eq!(kernel(&l[1]), ("k_dkv".into(), 6, 128, with(&[7, 8])));
    assert_eq!(kernel(&l[2]), ("k_dk".into(), 6, 128, with(&[7])));
    assert_eq!(kernel(&l[3]), ("k_dv".into(), 6, 128, with(&[8])));
    // dq by query tile, dk and dv by key tile.
    let l = backward(&mut g, "long", case(3, 1024, 130, 128, false));
    assert_eq!(kernel(&l[0]).1, 6 * 16);
    assert_eq!(kernel(&l[1]).1, 6 * 3);
    // Dynamic shared memory, recorded in the launches: the own and streamed bf16 tiles, the
    // streamed ones' f32 staging (and the key side's lse and delta); at width 64 tiles of 64
    // rows, at width 128 streamed tiles of 32, past the 48 KB of static shared memory.
    let sizes = |l: &[Launch]| l.iter().map(shared).collect::<Vec<_>>();
    let l = backward(&mut g, "k64", case(3, 33, 33, 64, true));
    assert_eq!(sizes(&l), [69_632, 70_144, 70_144, 60_928]);
    let l = backward(&mut g, "k128", case(3, 33, 33, 128, true));
    assert_eq!(sizes(&l), [84_992, 85_248, 85_248, 67_840]);
    for (tag, c) in all_cases() {
        let l = backward(&mut g, &tag, c);
        assert!(
            l.iter().all(|l| (1..=96 * 1024).contains(&shared(l))),
            "{tag}"
        );
    }
    let text = g.text("sm_80");
    assert!(!text.contains("\t.shared"), "no static shared memory");
    // Other widths, and the default options, take the f32 kernels (256 threads).
    for (mut g, w) in [
        (bf16(), 32),
        (bf16(), 80),
        (Gen::new(), 64),
        (Gen::new(), 128),
    ] {
        let l = backward(&mut g, "f", case(3, 33, 33, w, false));
        assert!(l.iter().all(|l| kernel(l).2 == 256), "{w}");
        assert!(!g.text("sm_80").contains("mma.sync"));
    }
}

/// `ptxas -v` on sm_80 and sm_90: registers per thread, and no spills.
#[test]
fn registers_and_no_spills() {
    let mut g = bf16();
    for w in [64, 128] {
        backward(&mut g, &format!("w{w}"), case(3, 1024, 1024, w, true));
    }
    assert_no_spills(&g.text("sm_80"), 8);
}
