//! Tests of `codegen/conv.rs`: every op generated and assembled by ptxas.
use super::super::testing::{assemble, value_f32 as operand};
use super::super::{Arg, CodegenError, Gen, Launch, OpArgs, Operand};
use super::generate;
use crate::ir::{DType, Op};

fn entry(l: &Launch) -> &str {
    match l {
        Launch::Kernel { entry, .. } => entry,
        other => panic!("not a kernel: {other:?}"),
    }
}

/// `(n, c, h, w, o, k, stride, padding, groups)`.
const CONVS: [[u64; 9]; 5] = [
    [2, 4, 8, 8, 6, 3, 1, 1, 1],
    [2, 4, 9, 7, 6, 3, 2, 1, 2],
    [1, 3, 5, 5, 4, 1, 1, 0, 1],
    [3, 4, 8, 8, 4, 3, 2, 0, 2],
    [2, 2, 6, 6, 4, 5, 1, 2, 2],
];

#[test]
fn every_op_assembles() {
    let mut g = Gen::new();
    let mut names = Vec::new();
    let mut run = |g: &mut Gen, op: Op, ins: &[Operand], out: &Operand| {
        let name = format!("k{}", names.len());
        let launches =
            generate(g, OpArgs::new(&name, &op, ins, out)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(launches.len(), 1);
        let Launch::Kernel { args, grid, .. } = &launches[0] else {
            unreachable!()
        };
        assert!(*grid >= 1);
        // Inputs in order, then the output.
        let want: Vec<Arg> = ins.iter().chain([out]).map(|o| o.arg).collect();
        assert_eq!(*args, want);
        names.push(entry(&launches[0]).to_string());
    };
    for [n, c, h, w, o, k, s, p, groups] in CONVS {
        let ho = (h + 2 * p - k) / s + 1;
        let wo = (w + 2 * p - k) / s + 1;
        let (x, wt, y) = ([n, c, h, w], [o, c / groups, k, k], [n, o, ho, wo]);
        let conv = Op::Conv2d {
            stride: s,
            padding: p,
            groups,
        };
        let gi = Op::Conv2dGradInput {
            stride: s,
            padding: p,
            groups,
            in_h: h,
            in_w: w,
        };
        let gw = Op::Conv2dGradWeight {
            stride: s,
            padding: p,
            groups,
            kernel: k,
        };
        // Each op with its operands and output: the forward, then both gradients.
        for (op, ins, out) in [
            (conv, [&x, &wt], &y),
            (gi, [&y, &wt], &x),
            (gw, [&x, &y], &wt),
        ] {
            run(
                &mut g,
                op,
                &[operand(0, ins[0]), operand(1, ins[1])],
                &operand(2, out),
            );
        }
    }
    for max in [true, false] {
        for (k, s, p) in [(2, 2, 0), (3, 2, 1), (3, 1, 1), (2, 1, 1)] {
            let x = [2, 3, 7, 6];
            let y = [2, 3, (7 + 2 * p - k) / s + 1, (6 + 2 * p - k) / s + 1];
            let pool = Op::Pool2d {
                max,
                kernel: k,
                stride: s,
                padding: p,
            };
            run(&mut g, pool, &[operand(0, &x)], &operand(1, &y));
            let grad = Op::Pool2dGrad {
                max,
                kernel: k,
                stride: s,
                padding: p,
            };
            let ins = [operand(0, &x), operand(1, &y)];
            run(&mut g, grad, &ins, &operand(2, &x));
        }
    }
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), names.len());
    assemble(&g.text("sm_80")).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn other_ops_and_bad_shapes_are_refused() {
    let mut g = Gen::new();
    let x = operand(0, &[1, 2, 4, 4]);
    assert_eq!(
        generate(
            &mut g,
            OpArgs::new("k", &Op::Relu, std::slice::from_ref(&x), &x)
        )
        .unwrap_err(),
        CodegenError::Unsupported { op: "relu" }
    );
    let conv = Op::Conv2d {
        stride: 1,
        padding: 0,
        groups: 1,
    };
    let wt = operand(1, &[3, 2, 3, 3]);
    // The output should be [1, 3, 2, 2].
    let r = generate(
        &mut g,
        OpArgs::new(
            "k",
            &conv,
            &[x.clone(), wt.clone()],
            &operand(2, &[1, 3, 4, 4]),
        ),
    );
    assert!(matches!(r, Err(CodegenError::Bad { .. })));
    let mut half = operand(2, &[1, 3, 2, 2]);
    half.dtype = DType::F16;
    let r = generate(&mut g, OpArgs::new("k", &conv, &[x, wt], &half));
    assert!(matches!(r, Err(CodegenError::Bad { .. })));
}
