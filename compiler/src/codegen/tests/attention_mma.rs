//! Tests of `codegen/attention_mma.rs`: the tensor-core forward generated for every width,
//! length and mask and assembled by ptxas, its launches, the fallback to the f32 kernels for
//! other widths, and ptxas's register and spill counts.
use super::super::super::testing::{
    assemble, assert_no_spills, bf16_attention as bf16, kernel, shared, value_f32 as f,
};
use super::super::super::{Arg, Gen, Launch, OpArgs};
use super::super::{forward_checked, single};
use crate::ir::Op;

/// The forward with its log-sum-exp, the output alone and the log-sum-exp alone, of 2 batch
/// positions and `h` heads, token-major: q, k, v as values 0..3, o 3, lse 4.
fn forwards(g: &mut Gen, tag: &str, h: u64, t: u64, d: u64, causal: bool) -> Vec<Launch> {
    let b = 2;
    let x = [
        f(0, &[b, t, h, d]),
        f(1, &[b, t, h, d]),
        f(2, &[b, t, h, d]),
    ];
    let (o, lse) = (f(3, &[b, t, h, d]), f(4, &[b, t, h]));
    let scale = 1.0 / (d as f64).sqrt();
    let att = Op::Attention { causal, scale };
    let lse_op = Op::AttentionLse { causal, scale };
    let mut l = forward_checked(
        g,
        OpArgs::new(&format!("{tag}_fwd"), &att, &x, (Some(&o), Some(&lse))),
    )
    .unwrap();
    l.extend(single(g, OpArgs::new(&format!("{tag}_o"), &att, &x, &o)).unwrap());
    l.extend(
        single(
            g,
            OpArgs::new(&format!("{tag}_lse"), &lse_op, &x[..2], &lse),
        )
        .unwrap(),
    );
    l
}

#[test]
fn every_shape_assembles() {
    for causal in [false, true] {
        let mut g = bf16();
        for d in [64, 128] {
            for t in [1, 33, 128, 1024] {
                forwards(&mut g, &format!("d{d}t{t}"), 3, t, d, causal);
            }
            // One head: the head-major layout's addressing.
            forwards(&mut g, &format!("d{d}h1"), 1, 33, d, causal);
        }
        let text = g.text("sm_80");
        assert!(text.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"));
        assert!(text.contains("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"));
        assert!(text.contains("ex2.approx.f32"));
        assert!(!text.contains("atom."), "deterministic: no atomics");
        assemble(&text).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn launches_and_fallback() {
    let v = |ids: &[usize]| ids.iter().map(|&i| Arg::Value(i)).collect::<Vec<_>>();
    let mut g = bf16();
    let l = forwards(&mut g, "k", 3, 33, 64, true);
    // 2 x 3 problems of 33 queries: one 64-query tile each, 128 threads (4 warps) per block.
    assert_eq!(kernel(&l[0]), ("k_fwd".into(), 6, 128, v(&[0, 1, 2, 3, 4])));
    assert_eq!(kernel(&l[1]), ("k_o".into(), 6, 128, v(&[0, 1, 2, 3])));
    assert_eq!(kernel(&l[2]), ("k_lse".into(), 6, 128, v(&[0, 1, 4])));
    let l = forwards(&mut g, "long", 3, 1024, 128, false);
    assert_eq!(kernel(&l[0]).1, 6 * 16);
    // Dynamic shared memory, recorded in the launch: the bf16 K (and V) tile of 64 rows padded
    // by 8 columns, and its f32 staging tile; 98 KB at width 128, past the 48 KB of static
    // shared memory.
    assert_eq!(
        l.iter().map(shared).collect::<Vec<_>>(),
        [100_352, 100_352, 50_176]
    );
    // The manifest names the size where there is one, and only there.
    let json = serde_json::to_value(&l[0]).unwrap();
    assert_eq!(json["Kernel"]["shared"], 100_352);
    let l = forwards(&mut g, "narrow", 3, 33, 64, false);
    assert_eq!(
        l.iter().map(shared).collect::<Vec<_>>(),
        [51_200, 51_200, 25_600]
    );
    let text = g.text("sm_80");
    assert!(!text.contains("\t.shared"), "no static shared memory");
    assert_eq!(text.matches(".extern .shared .align 16 .b8").count(), 9);
    // Other widths, and the default options, take the f32 kernels (256 threads).
    for (mut g, d) in [(bf16(), 32), (bf16(), 80), (Gen::new(), 64)] {
        let l = forwards(&mut g, "f", 3, 33, d, false);
        assert!(l.iter().all(|l| kernel(l).2 == 256), "{d}");
        assert!(l.iter().all(|l| shared(l) == 0), "{d}");
        let json = serde_json::to_value(&l[0]).unwrap();
        assert!(json["Kernel"].get("shared").is_none(), "{json}");
        assert!(!g.text("sm_80").contains("mma.sync"));
    }
}

/// `ptxas -v` on sm_80 and sm_90: registers per thread, and no spills.
#[test]
fn registers_and_no_spills() {
    let mut g = bf16();
    for d in [64, 128] {
        forwards(&mut g, &format!("d{d}"), 3, 1024, d, true);
    }
    assert_no_spills(&g.text("sm_80"), 6);
}

/// `PARALLAX_MMA_FWD_DUMP=file`: the kernels the PTX interpreter checks.
#[test]
fn dump_for_interpreter() {
    let Some(file) = std::env::var_os("PARALLAX_MMA_FWD_DUMP") else {
        return;
    };
    let mut g = bf16();
    for causal in [false, true] {
        for d in [64, 128] {
            for (h, t) in [(3, 70), (1, 70), (3, 1), (3, 130)] {
                forwards(&mut g, &format!("f{d}h{h}t{t}c{causal}"), h, t, d, causal);
            }
        }
    }
    std::fs::write(file, g.text("sm_80")).unwrap();
}
