//! Tests of `codegen/layout.rs`: every op generated and assembled by ptxas.
use super::*;
use crate::codegen::testing::{assemble, value as v};
use crate::ir::Dim;

const F: DType = DType::F32;
const I: DType = DType::I32;

fn dims(s: &[u64]) -> Vec<Dim> {
    s.iter().map(|&n| Dim::known(n)).collect()
}

/// Every case generated into one module, which must assemble.
fn assembles(cases: &[(Op, Vec<Operand>, Operand)]) {
    let mut g = Gen::new();
    for (j, (op, ins, out)) in cases.iter().enumerate() {
        let l = generate(&mut g, OpArgs::new(&format!("k{j}"), op, ins, out))
            .unwrap_or_else(|e| panic!("{op:?} {ins:?} {out:?}: {e}"));
        assert_eq!(l.len(), 1);
        if let (
            Op::Reshape { .. },
            Launch::Copy {
                src, dst, elements, ..
            },
        ) = (op, &l[0])
        {
            assert_eq!((*src, *dst, *elements), (ins[0].arg, out.arg, out.numel()));
            continue;
        }
        let Launch::Kernel { entry, args, .. } = &l[0] else {
            panic!("{l:?}")
        };
        // Its own entry, or an identical one generated before (`Gen` shares those).
        let text = g.text("sm_80");
        assert!(text.contains(&format!(".entry {entry}(")), "{entry}");
        assert_eq!(args.last(), Some(&out.arg));
    }
    assemble(&g.text("sm_80")).unwrap_or_else(|e| panic!("{e}"));
}

/// One unary case per element type.
fn unary(op: Op, x: &[u64], out: &[u64], types: &[DType]) -> Vec<(Op, Vec<Operand>, Operand)> {
    types
        .iter()
        .map(|&t| (op.clone(), vec![v(0, x, t)], v(1, out, t)))
        .collect()
}

#[test]
fn moves_assemble() {
    let mut c = Vec::new();
    let reshape = |s: &[u64]| Op::Reshape { shape: dims(s) };
    c.extend(unary(reshape(&[6, 4]), &[2, 3, 4], &[6, 4], &[F, I]));
    c.extend(unary(reshape(&[5000]), &[50, 100], &[5000], &[F]));
    let permute = |p: &[usize]| Op::Permute { perm: p.to_vec() };
    c.extend(unary(permute(&[1, 0]), &[3, 4], &[4, 3], &[F, I]));
    c.extend(unary(permute(&[2, 0, 1]), &[2, 3, 4], &[4, 2, 3], &[F]));
    c.extend(unary(
        permute(&[0, 2, 1, 3]),
        &[2, 3, 4, 5],
        &[2, 4, 3, 5],
        &[F, I],
    ));
    c.extend(unary(permute(&[0, 1, 2]), &[2, 1, 4], &[2, 1, 4], &[F]));
    let expand = |a: &[usize], s: &[u64], mean| Op::Expand {
        axes: a.to_vec(),
        shape: dims(s),
        mean,
    };
    c.extend(unary(
        expand(&[1], &[3, 4, 5], true),
        &[3, 5],
        &[3, 4, 5],
        &[F],
    ));
    c.extend(unary(
        expand(&[1, 2], &[4, 3, 2], false),
        &[4],
        &[4, 3, 2],
        &[F, I],
    ));
    c.extend(unary(expand(&[0, 1], &[2, 3], true), &[], &[2, 3], &[F]));
    c.extend(unary(
        expand(&[0, 3], &[2, 3, 5, 4], false),
        &[3, 5],
        &[2, 3, 5, 4],
        &[F],
    ));
    let slice = |axis, start, len| Op::Slice {
        axis,
        start,
        len: Dim::known(len),
    };
    c.extend(unary(slice(1, 2, 3), &[4, 6], &[4, 3], &[F, I]));
    c.extend(unary(slice(2, 1, 2), &[2, 3, 4, 5], &[2, 3, 2, 5], &[F, I]));
    c.extend(unary(slice(0, 1, 2), &[3, 4, 5], &[2, 4, 5], &[F]));
    let pad = |axis, start, size| Op::Pad {
        axis,
        start,
        size: Dim::known(size),
    };
    c.extend(unary(pad(1, 2, 6), &[4, 3], &[4, 6], &[F, I]));
    c.extend(unary(pad(2, 1, 4), &[2, 3, 2, 5], &[2, 3, 4, 5], &[F, I]));
    c.extend(unary(pad(0, 0, 5), &[3, 4, 5], &[5, 4, 5], &[F]));
    for (t, axis, a, b, o) in [
        (F, 1, [3, 4, 5], [3, 2, 5], [3, 6, 5]),
        (I, 1, [3, 4, 5], [3, 2, 5], [3, 6, 5]),
        (F, 0, [1, 4, 5], [2, 4, 5], [3, 4, 5]),
        (I, 2, [3, 4, 5], [3, 4, 1], [3, 4, 6]),
    ] {
        let op = Op::Concat { axis };
        c.push((op, vec![v(0, &a, t), v(1, &b, t)], v(2, &o, t)));
    }
    let cat4 = [v(0, &[2, 3, 4, 5], F), v(1, &[2, 3, 4, 2], F)];
    c.push((
        Op::Concat { axis: 3 },
        cat4.to_vec(),
        v(2, &[2, 3, 4, 7], F),
    ));
    let gather =
        |t: &[u64], i: &[u64], o: &[u64]| (Op::Gather, vec![v(0, t, F), v(1, i, I)], v(2, o, F));
    c.push(gather(&[7, 5], &[3, 4], &[3, 4, 5]));
    c.push(gather(&[7, 5], &[6], &[6, 5]));
    c.push(gather(&[100, 64], &[2, 3, 8], &[2, 3, 8, 64]));
    let scatter = |i: &[u64], d: &[u64], o: &[u64]| {
        let op = Op::ScatterAdd { rows: o[0] };
        (op, vec![v(0, i, I), v(1, d, F)], v(2, o, F))
    };
    c.push(scatter(&[3, 4], &[3, 4, 5], &[7, 5]));
    c.push(scatter(&[300], &[300, 3000], &[50, 3000]));
    c.push(scatter(&[2, 3, 4], &[2, 3, 4, 600], &[9, 600]));
    assembles(&c);
}

#[test]
fn reductions_assemble() {
    let mut c = Vec::new();
    let shape = [3u64, 4, 5, 6];
    for axes in [
        &[][..],
        &[0],
        &[3],
        &[1, 2],
        &[0, 2],
        &[1, 3],
        &[0, 1, 2, 3],
    ] {
        let kept: Vec<u64> = (0..4)
            .filter(|i| !axes.contains(i))
            .map(|i| shape[i])
            .collect();
        let a = axes.to_vec();
        c.extend(unary(
            Op::ReduceSum { axes: a.clone() },
            &shape,
            &kept,
            &[F],
        ));
        c.extend(unary(Op::ReduceMean { axes: a }, &shape, &kept, &[F]));
    }
    // The lane-parallel forms: a bias gradient, a conv bias gradient, row means, a total.
    c.extend(unary(
        Op::ReduceSum { axes: vec![0] },
        &[8192, 768],
        &[768],
        &[F],
    ));
    let nchw = [64, 32, 26, 26];
    c.extend(unary(
        Op::ReduceSum {
            axes: vec![0, 2, 3],
        },
        &nchw,
        &[32],
        &[F],
    ));
    c.extend(unary(
        Op::ReduceMean { axes: vec![1] },
        &[4, 1000],
        &[4],
        &[F],
    ));
    c.extend(unary(Op::ReduceMean { axes: vec![0] }, &[5000], &[], &[F]));
    c.extend(unary(
        Op::ReduceMean { axes: vec![1, 2] },
        &[16, 50, 60, 3],
        &[16, 3],
        &[F],
    ));
    let sum_to = |s: &[u64]| Op::SumTo { shape: dims(s) };
    for to in [
        &[5][..],
        &[4, 1],
        &[1, 3, 4, 1],
        &[2, 1, 1, 5],
        &[],
        &[2, 3, 4, 5],
    ] {
        c.extend(unary(sum_to(to), &[2, 3, 4, 5], to, &[F]));
    }
    c.extend(unary(sum_to(&[768]), &[16, 512, 768], &[768], &[F]));
    c.extend(unary(
        sum_to(&[1, 512, 64]),
        &[16, 512, 64],
        &[1, 512, 64],
        &[F],
    ));
    assembles(&c);
}

#[test]
fn bad_operands_are_errors() {
    let mut g = Gen::new();
    // Op `op` of `ins` into `out`, as kernel `k`.
    let mut run =
        |op: &Op, ins: &[Operand], out: &Operand| generate(&mut g, OpArgs::new("k", op, ins, out));
    let e = run(&Op::Add, &[v(0, &[2], F)], &v(1, &[2], F));
    assert_eq!(e.unwrap_err(), CodegenError::Unsupported { op: "add" });
    let reshape = Op::Reshape { shape: dims(&[5]) };
    assert!(run(&reshape, &[v(0, &[2, 3], F)], &v(1, &[5], F)).is_err());
    assert!(run(&reshape, &[v(0, &[5], I)], &v(1, &[5], F)).is_err());
    let perm = Op::Permute { perm: vec![0, 0] };
    assert!(run(&perm, &[v(0, &[2, 2], F)], &v(1, &[2, 2], F)).is_err());
    let red = Op::ReduceSum { axes: vec![1] };
    assert!(run(&red, &[v(0, &[2, 3], I)], &v(1, &[2], I)).is_err());
    assert!(run(&red, &[v(0, &[2, 3], F)], &v(1, &[3], F)).is_err());
    let st = Op::SumTo { shape: dims(&[2]) };
    assert!(run(&st, &[v(0, &[2, 3], F)], &v(1, &[2], F)).is_err());
    let ins = [v(0, &[3], F), v(1, &[7, 4], F)];
    assert!(run(&Op::Gather, &ins, &v(2, &[3, 4], F)).is_err());
    assert!(run(&Op::Gather, &ins[..1], &v(2, &[3, 4], F)).is_err());
}

#[test]
fn merging_follows_contiguous_runs() {
    assert_eq!(merge(&[(2, 12), (3, 4), (4, 1)]), vec![(24, 1)]);
    assert_eq!(merge(&[(4, 1), (2, 12), (3, 4)]), vec![(4, 1), (6, 4)]);
    assert_eq!(merge(&[(3, 0), (1, 7), (5, 0)]), vec![(15, 0)]);
    assert_eq!(
        merge(&[(3, 5), (4, 0), (5, 1)]),
        vec![(3, 5), (4, 0), (5, 1)]
    );
}
