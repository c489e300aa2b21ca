//! Tests of `codegen/rows.rs`: every op generated and assembled by ptxas.
use super::super::testing::{assemble, kernel, ptxas_log, value as val, value_f32 as f};
use super::super::{Arg, CodegenError, Gen, Launch, OpArgs, Operand};
use super::generate;
use crate::ir::{DType, Op};

/// Every op of the file on `shape` (cross-entropy with `shape` as logits), as
/// `(op, operands, output)`.
fn cases(shape: &[u64]) -> Vec<(Op, Vec<Operand>, Operand)> {
    let eps = 1e-5;
    let one = vec![f(0, shape)];
    let two = vec![f(0, shape), f(1, shape)];
    let labels = val(1, &shape[..shape.len() - 1], DType::I32);
    let mut v = vec![
        (Op::Softmax { causal: false }, one.clone(), f(1, shape)),
        (Op::SoftmaxGrad, two.clone(), f(2, shape)),
        (Op::LayerNorm { eps }, one.clone(), f(1, shape)),
        (Op::LayerNormGrad { eps }, two.clone(), f(2, shape)),
        (Op::RmsNorm { eps }, one.clone(), f(1, shape)),
        (Op::RmsNormGrad { eps }, two.clone(), f(2, shape)),
    ];
    let r = shape.len();
    if r >= 2 && shape[r - 1] == shape[r - 2] {
        v.push((Op::Softmax { causal: true }, one.clone(), f(1, shape)));
    }
    for smoothing in [0.0, 0.1] {
        let xent = vec![f(0, shape), labels.clone()];
        v.push((Op::CrossEntropy { smoothing }, xent.clone(), f(2, &[])));
        let mut grad = xent;
        grad.push(f(2, &[]));
        v.push((Op::CrossEntropyGrad { smoothing }, grad, f(3, shape)));
    }
    v
}

/// Generates the cases into one module, assembles it and returns its launches and text.
fn module(cases: &[(Op, Vec<Operand>, Operand)]) -> (Vec<Launch>, String) {
    let mut g = Gen::new();
    let mut launches = Vec::new();
    for (n, (op, ins, out)) in cases.iter().enumerate() {
        let l = generate(&mut g, OpArgs::new(&format!("k{n}"), op, ins, out))
            .unwrap_or_else(|e| panic!("{op:?}: {e}"));
        launches.extend(l);
    }
    let text = g.text("sm_80");
    assemble(&text).unwrap_or_else(|e| panic!("{e}"));
    (launches, text)
}

#[test]
fn every_op_assembles_on_short_long_and_edge_shapes() {
    for shape in [
        &[4, 7][..],
        &[3, 5, 1500],
        &[1, 2, 1100, 1100],
        &[2, 3, 600],
        &[11],
        &[0, 3, 2],
    ] {
        module(&cases(shape));
    }
}

#[test]
fn launch_shapes_and_arguments() {
    let shape = [2, 3, 8, 8];
    let (l, _) = module(&cases(&shape));
    let v = |ids: &[usize]| ids.iter().map(|&i| Arg::Value(i)).collect::<Vec<_>>();
    // Softmax: a warp per row of 8, 48 rows.
    assert_eq!(kernel(&l[0]), ("k0".into(), 6, 256, v(&[0, 1])));
    assert_eq!(kernel(&l[1]), ("k1".into(), 6, 256, v(&[0, 1, 2])));
    // Cross-entropy: a warp per row.
    assert_eq!(kernel(&l[7]), ("k7".into(), 6, 256, v(&[0, 1, 2])));
    assert_eq!(kernel(&l[8]), ("k8".into(), 6, 256, v(&[0, 1, 2, 3])));
    // Long rows: a block each.
    let (l, _) = module(&cases(&[3, 5, 1500])[..1]);
    assert_eq!(kernel(&l[0]), ("k0".into(), 15, 256, v(&[0, 1])));
}

#[test]
fn wide_blocks_fit_in_64_registers_per_thread() {
    // 1024 threads of a block share 64K registers.
    let (_, text) = module(&cases(&[4, 3, 5, 6]));
    let log = ptxas_log(&text, "sm_80");
    let used: Vec<u32> = log
        .lines()
        .filter_map(|l| l.split("Used ").nth(1))
        .map(|l| l.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(!used.is_empty(), "{log}");
    assert!(used.iter().all(|&r| r <= 64), "{log}");
}

#[test]
fn other_ops_and_bad_shapes_are_refused() {
    let mut g = Gen::new();
    let x = f(0, &[2, 3]);
    let e = generate(
        &mut g,
        OpArgs::new("k", &Op::Add, &[x.clone(), x.clone()], &x),
    );
    assert_eq!(e.unwrap_err(), CodegenError::Unsupported { op: "add" });
    let causal = Op::Softmax { causal: true };
    assert!(generate(
        &mut g,
        OpArgs::new("k", &causal, std::slice::from_ref(&x), &f(1, &[2, 3]))
    )
    .is_err());
    let xent = Op::CrossEntropy { smoothing: 0.0 };
    let bad_labels = [x.clone(), val(1, &[3], DType::I32)];
    assert!(generate(&mut g, OpArgs::new("k", &xent, &bad_labels, &f(2, &[]))).is_err());
    let float_labels = [x.clone(), f(1, &[2])];
    assert!(generate(&mut g, OpArgs::new("k", &xent, &float_labels, &f(2, &[]))).is_err());
}
