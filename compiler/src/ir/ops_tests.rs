//! The op table's tests: its order, the elementwise pattern and examples against it, shape
//! rules and costs.

use super::*;
use crate::ir::dim::Dim;

const B: [String; 0] = [];

fn f(shape: &[u64]) -> TensorType {
    TensorType::f32(shape.iter().map(|&d| Dim::known(d)).collect())
}

#[test]
fn table_is_in_kind_order() {
    for (i, d) in OPS.iter().enumerate() {
        assert_eq!(d.kind as usize, i, "row {} is out of order", d.name);
    }
}

#[test]
fn the_map_pattern_is_the_ops_with_a_map() {
    for op in elementwise_examples() {
        assert_eq!(
            matches!(op, crate::map_ops!()),
            op.map().is_some(),
            "{op:?}: `map_ops!` and the table disagree"
        );
    }
}

/// Every elementwise row of the table has a map, but dropout.
#[test]
fn every_elementwise_row_but_dropout_has_a_map() {
    for d in OPS.iter().filter(|d| d.class == OpClass::Elementwise) {
        assert_eq!(d.map.is_some(), d.name != "dropout", "{}", d.name);
    }
    for d in OPS.iter().filter(|d| d.class != OpClass::Elementwise) {
        assert!(d.map.is_none(), "{} is not elementwise", d.name);
    }
}

#[test]
fn the_elementwise_examples_cover_the_table() {
    let rows: Vec<OpKind> = OPS
        .iter()
        .filter(|d| d.class == OpClass::Elementwise)
        .map(|d| d.kind)
        .collect();
    let examples: Vec<OpKind> = elementwise_examples().iter().map(Op::kind).collect();
    assert_eq!(
        examples, rows,
        "add the new elementwise op to `elementwise_examples`"
    );
}

#[test]
fn shape_rules() {
    let mm = Op::MatMul {
        trans_a: false,
        trans_b: false,
    };
    assert_eq!(
        mm.infer(&[&f(&[8, 3]), &f(&[3, 5])], &B).unwrap(),
        f(&[8, 5])
    );
    assert!(mm.infer(&[&f(&[8, 3]), &f(&[4, 5])], &B).is_err());
    let mmt = Op::MatMul {
        trans_a: false,
        trans_b: true,
    };
    assert_eq!(
        mmt.infer(&[&f(&[2, 4, 8, 16]), &f(&[2, 4, 8, 16])], &B)
            .unwrap(),
        f(&[2, 4, 8, 8])
    );
    let mta = Op::MatMul {
        trans_a: true,
        trans_b: false,
    };
    assert_eq!(
        mta.infer(&[&f(&[8, 3]), &f(&[8, 5])], &B).unwrap(),
        f(&[3, 5])
    );
    let conv = Op::Conv2d {
        stride: 2,
        padding: 1,
        groups: 1,
    };
    assert_eq!(
        conv.infer(&[&f(&[1, 3, 32, 32]), &f(&[16, 3, 3, 3])], &B)
            .unwrap(),
        f(&[1, 16, 16, 16])
    );
    let gi = Op::Conv2dGradInput {
        stride: 2,
        padding: 1,
        groups: 1,
        in_h: 32,
        in_w: 32,
    };
    assert_eq!(
        gi.infer(&[&f(&[1, 16, 16, 16]), &f(&[16, 3, 3, 3])], &B)
            .unwrap(),
        f(&[1, 3, 32, 32])
    );
    let gw = Op::Conv2dGradWeight {
        stride: 2,
        padding: 1,
        groups: 1,
        kernel: 3,
    };
    assert_eq!(
        gw.infer(&[&f(&[1, 3, 32, 32]), &f(&[1, 16, 16, 16])], &B)
            .unwrap(),
        f(&[16, 3, 3, 3])
    );
    assert_eq!(
        Op::Add.infer(&[&f(&[4, 1, 5]), &f(&[3, 1])], &B).unwrap(),
        f(&[4, 3, 5])
    );
    assert!(Op::Add.infer(&[&f(&[4, 2]), &f(&[3])], &B).is_err());
    assert!(Op::Relu.infer(&[&f(&[1]), &f(&[1])], &B).is_err());
    let pool = Op::Pool2d {
        max: true,
        kernel: 2,
        stride: 2,
        padding: 0,
    };
    assert_eq!(
        pool.infer(&[&f(&[1, 8, 7, 7])], &B).unwrap(),
        f(&[1, 8, 3, 3])
    );
    let r = Op::ReduceMean { axes: vec![0, 1] };
    assert_eq!(r.infer(&[&f(&[2, 3])], &B).unwrap(), f(&[]));
    let st = Op::SumTo {
        shape: vec![Dim::known(5)],
    };
    assert_eq!(st.infer(&[&f(&[4, 3, 5])], &B).unwrap(), f(&[5]));
    assert!(st.infer(&[&f(&[4, 3, 6])], &B).is_err());
    let ex = Op::Expand {
        axes: vec![1],
        shape: vec![Dim::known(4), Dim::known(3)],
        mean: true,
    };
    assert_eq!(ex.infer(&[&f(&[4])], &B).unwrap(), f(&[4, 3]));
    let pad = Op::Pad {
        axis: 0,
        start: 2,
        size: Dim::known(10),
    };
    assert_eq!(pad.infer(&[&f(&[6, 4])], &B).unwrap(), f(&[10, 4]));
}

#[test]
fn costs() {
    let mm = Op::MatMul {
        trans_a: false,
        trans_b: false,
    };
    assert_eq!(
        (mm.def().flops)(&mm, &[vec![8, 3], vec![3, 5]], &[8, 5]),
        240
    );
}

#[test]
fn cache_shape_rules() {
    let i32s = |shape: &[u64]| {
        TensorType::new(
            super::super::types::DType::I32,
            shape.iter().map(|&d| Dim::known(d)).collect(),
        )
    };
    let (cache, row, pos) = (f(&[2, 8, 4, 16]), f(&[2, 1, 4, 16]), i32s(&[2]));
    assert_eq!(
        Op::CacheWrite.infer(&[&cache, &row, &pos], &B).unwrap(),
        cache
    );
    // More rows than the cache holds, another head count, float or misshapen positions.
    for (c, r, p) in [
        (&f(&[2, 1, 4, 16]), &f(&[2, 2, 4, 16]), &pos),
        (&cache, &f(&[2, 1, 2, 16]), &pos),
        (&cache, &row, &f(&[2])),
        (&cache, &row, &i32s(&[2, 1])),
    ] {
        assert!(
            Op::CacheWrite.infer(&[c, r, p], &B).is_err(),
            "{c:?} {r:?} {p:?}"
        );
    }
    let att = Op::CachedAttention { scale: 0.25 };
    let v = f(&[2, 8, 4, 8]);
    assert_eq!(
        att.infer(&[&row, &cache, &v, &pos], &B).unwrap(),
        f(&[2, 1, 4, 8])
    );
    assert!(att.infer(&[&row, &cache, &v, &i32s(&[3])], &B).is_err());
    assert!(att
        .infer(&[&row, &cache, &f(&[2, 7, 4, 8]), &pos], &B)
        .is_err());
    // Its cost: over the whole cache, 2 (D + E) + 5 per score.
    let flops = (att.def().flops)(&att, &[vec![2, 1, 4, 16], vec![2, 8, 4, 16]], &[]);
    assert_eq!(flops, 2 * 4 * 8 * (2 * (16 + 16) + 5));
}
