//! Tests of `codegen/attention.rs` and `attention_grad.rs`: every kernel variant generated and
//! assembled by ptxas, the launches' arguments and shapes, and refused operands.
use super::super::testing::{assemble, assert_no_spills, attention_inputs, kernel, value_f32 as f};
use super::super::{Arg, CodegenError, Gen, Launch, OpArgs, Operand};
use super::{forward_checked, grad, single};
use crate::ir::{AttentionInput, DType, Op};

/// Token-major `[B, T, H, D]` operands of one attention, B = 2: q, k, v, dy, lse, delta as
/// values 0..6.
fn operands(h: u64, t: u64, d: u64, e: u64) -> Vec<Operand> {
    attention_inputs(2, h, (t, t), (d, e))
}

/// Every kernel variant of one shape (`h` heads) into `g`; their launches, named `{tag}_*`.
fn variants(g: &mut Gen, tag: &str, h: u64, t: u64, d: u64, e: u64, causal: bool) -> Vec<Launch> {
    let scale = 1.0 / (d as f64).sqrt();
    let x = operands(h, t, d, e);
    let o = f(
        6,
        &x[2].shape[..3]
            .iter()
            .copied()
            .chain([e])
            .collect::<Vec<_>>(),
    );
    let lse = f(7, &x[4].shape);
    let (dk, dv) = (f(8, &x[1].shape), f(9, &x[2].shape));
    let att = Op::Attention { causal, scale };
    let lse_op = Op::AttentionLse { causal, scale };
    let gr = |wrt| Op::AttentionGrad { causal, scale, wrt };
    let mut l = Vec::new();
    let name = |s: &str| format!("{tag}_{s}");
    let mut add = |r: Result<Vec<Launch>, CodegenError>| l.extend(r.unwrap());
    add(forward_checked(
        g,
        OpArgs::new(&name("fwd"), &att, &x[..3], (Some(&o), Some(&lse))),
    ));
    add(single(g, OpArgs::new(&name("o"), &att, &x[..3], &o)));
    add(single(g, OpArgs::new(&name("lse"), &lse_op, &x[..2], &lse)));
    add(single(
        g,
        OpArgs::new(&name("dq"), &gr(AttentionInput::Query), &x, &x[0]),
    ));
    let kv = gr(AttentionInput::Key);
    add(grad::key_value(
        g,
        OpArgs::new(&name("dkv"), &kv, &x, (Some(&dk), Some(&dv))),
    ));
    add(single(g, OpArgs::new(&name("dk"), &kv, &x, &dk)));
    add(single(
        g,
        OpArgs::new(&name("dv"), &gr(AttentionInput::Value), &x, &dv),
    ));
    l
}

#[test]
fn every_variant_assembles_on_every_shape() {
    for causal in [false, true] {
        let mut g = Gen::new();
        for d in [16, 64, 80] {
            for t in [1, 33, 128] {
                variants(&mut g, &format!("d{d}t{t}"), 3, t, d, d, causal);
            }
        }
        // One head (the head-major layout's addressing), a value width unlike the keys', and
        // heads wider than one staged chunk.
        variants(&mut g, "h1", 1, 33, 64, 64, causal);
        variants(&mut g, "e24", 3, 33, 64, 24, causal);
        variants(&mut g, "wide", 3, 40, 200, 300, causal);
        assemble(&g.text("sm_80")).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn launch_shapes_and_arguments() {
    let mut g = Gen::new();
    let l = variants(&mut g, "k", 3, 33, 64, 64, true);
    let v = |ids: &[usize]| ids.iter().map(|&i| Arg::Value(i)).collect::<Vec<_>>();
    // 2 x 3 problems of 33 queries (or keys): 5 tiles of 8 rows each, a block per tile.
    let grid = 6 * 5;
    assert_eq!(
        kernel(&l[0]),
        ("k_fwd".into(), grid, 256, v(&[0, 1, 2, 6, 7]))
    );
    assert_eq!(kernel(&l[1]), ("k_o".into(), grid, 256, v(&[0, 1, 2, 6])));
    assert_eq!(kernel(&l[2]), ("k_lse".into(), grid, 256, v(&[0, 1, 7])));
    assert_eq!(
        kernel(&l[3]),
        ("k_dq".into(), grid, 256, v(&[0, 1, 2, 3, 4, 5, 0]))
    );
    let kv = kernel(&l[4]);
    assert_eq!(
        kv,
        ("k_dkv".into(), grid, 256, v(&[0, 1, 2, 3, 4, 5, 8, 9]))
    );
    assert_eq!(kernel(&l[5]).3, v(&[0, 1, 2, 3, 4, 5, 8]));
    assert_eq!(kernel(&l[6]).3, v(&[0, 1, 2, 3, 4, 5, 9]));
    assert_eq!(l.len(), 7);
    // Grids stay within limits (the kernels loop over their tasks).
    let mut g = Gen::new();
    let x = [f(0, &[256, 64, 16, 64]), f(1, &[256, 64, 16, 64])];
    let lse_op = Op::AttentionLse {
        causal: false,
        scale: 0.125,
    };
    let big = single(
        &mut g,
        OpArgs::new("big", &lse_op, &x, &f(2, &[256, 64, 16])),
    )
    .unwrap();
    assert_eq!(kernel(&big[0]).1, 32_768);
    let x = [f(0, &[65536, 64, 1, 64]), f(1, &[65536, 64, 1, 64])];
    let big = single(
        &mut g,
        OpArgs::new("big", &lse_op, &x, &f(2, &[65536, 64, 1])),
    )
    .unwrap();
    assert_eq!(kernel(&big[0]).1, 65_535);
}

#[test]
fn bad_operands_are_refused() {
    let mut g = Gen::new();
    let x = operands(3, 16, 32, 32);
    let att = Op::Attention {
        causal: true,
        scale: 0.5,
    };
    let o = f(6, &[2, 16, 3, 32]);
    let refused = |g: &mut Gen, q: &[u64], k: &[u64], v: &[u64]| {
        let ins = [f(0, q), f(1, k), f(2, v)];
        matches!(
            single(g, OpArgs::new("k", &att, &ins, &o)),
            Err(CodegenError::Bad { .. })
        )
    };
    let q = [2, 16, 3, 32];
    // The shapes pass.
    assert!(single(&mut g, OpArgs::new("k", &att, &x[..3], &o)).is_ok());
    // Causal needs T = S.
    assert!(refused(&mut g, &q, &[2, 8, 3, 32], &[2, 8, 3, 32]));
    // Widths of q and k differ; keys and values differ in count.
    assert!(refused(&mut g, &q, &[2, 16, 3, 16], &q));
    assert!(refused(&mut g, &q, &q, &[2, 8, 3, 32]));
    // Heads, or batch axes, differ; a rank below 3 (no heads axis).
    assert!(refused(&mut g, &q, &[2, 16, 1, 32], &q));
    assert!(refused(&mut g, &q, &q, &[2, 16, 1, 32]));
    assert!(refused(&mut g, &q, &[1, 16, 3, 32], &[1, 16, 3, 32]));
    assert!(refused(&mut g, &q, &[2, 1, 16, 3, 32], &q));
    assert!(refused(&mut g, &[16, 32], &[16, 32], &[16, 32]));
    // An output of the wrong size, a non-f32 operand, too few operands.
    assert!(single(
        &mut g,
        OpArgs::new("k", &att, &x[..3], &f(6, &[2, 16, 3, 31]))
    )
    .is_err());
    let mut h = x[..3].to_vec();
    h[2].dtype = DType::BF16;
    assert!(single(&mut g, OpArgs::new("k", &att, &h, &o)).is_err());
    let dq = Op::AttentionGrad {
        causal: false,
        scale: 0.5,
        wrt: AttentionInput::Query,
    };
    assert!(single(&mut g, OpArgs::new("k", &dq, &x[..5], &x[0])).is_err());
    assert_eq!(
        single(&mut g, OpArgs::new("k", &Op::Add, &x[..2], &x[0])).unwrap_err(),
        CodegenError::Unsupported { op: "add" }
    );
}

/// `ptxas -v` of the main kernels at head width 64: registers, and no spills (a spill would
/// mean the accumulators or the unrolled loops outgrew the register file).
#[test]
fn head_width_64_kernels_do_not_spill() {
    let mut g = Gen::new();
    variants(&mut g, "k", 3, 128, 64, 64, true);
    assert_no_spills(&g.text("sm_80"), 7);
}
