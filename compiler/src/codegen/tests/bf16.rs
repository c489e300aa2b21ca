//! Plans storing activations in bf16 (`devices.activations: Bf16`): their values move as two
//! bytes (widened on load, rounded on store), their GEMMs multiply bf16, and every module
//! assembles.

use super::testing::{assemble, model_plan_stored};
use super::{generate_with, Arg, CodegenOptions, Launch, Module};
use crate::dsl::ast::Storage;

fn module(file: &str, storage: Storage, options: &CodegenOptions) -> (crate::Plan, Module) {
    let plan = model_plan_stored(file, storage);
    let m = generate_with(&plan, plan.batch_size, "sm_80", options).expect("generates");
    (plan, m)
}

fn gemms(m: &Module) -> impl Iterator<Item = &Launch> {
    m.kernels
        .iter()
        .flat_map(|k| &k.launches)
        .filter(|l| matches!(l, Launch::Gemm { .. }))
}

/// Every model's bf16 module assembles for sm_80 and sm_90, with the f32 attention kernels
/// and with the tensor-core ones (gpt-large's heads, width 128, staged from bf16).
#[test]
fn every_model_module_assembles_with_bf16_activations() {
    let files = super::testing::model_files();
    for f in &files {
        let (_, m) = module(f, Storage::Bf16, &CodegenOptions::default());
        assemble(&m.text()).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    let mma = CodegenOptions {
        bf16_attention: true,
    };
    // Heads of width 128 (gpt-large) and 64 (the bench transformer).
    for file in ["gpt-large.ron", "../benches/models/transformer.ron"] {
        let (_, m) = module(file, Storage::Bf16, &mma);
        let staged = m
            .entries
            .iter()
            .filter(|(_, e)| e.contains("mma.sync") && e.contains("ld.global.nc.v2.b32"))
            .count();
        // The forward and both backward kernels stage bf16 tiles as they are stored.
        assert_eq!(staged, 3, "{file}");
        assemble(&m.text()).unwrap_or_else(|e| panic!("{file}: {e}"));
    }
}

/// A bf16-stored value is loaded as 16 bits and widened, stored rounded to the nearest bf16;
/// nothing of an f32 plan changes.
#[test]
fn bf16_values_load_and_store_two_bytes() {
    let (_, m16) = module("transformer.ron", Storage::Bf16, &CodegenOptions::default());
    let text = m16.text();
    for needle in [
        "ld.global.u16",
        "st.global.u16",
        "cvt.rn.bf16x2.f32",
        "shl.b32",
    ] {
        assert!(text.contains(needle), "no {needle}");
    }
    let (_, m32) = module("transformer.ron", Storage::F32, &CodegenOptions::default());
    let text = m32.text();
    assert!(!text.contains("ld.global.u16") && !text.contains("st.global.u16"));
    assert_eq!(m32.staging, 0);
    for l in gemms(&m32) {
        let Launch::Gemm { bf16, .. } = l else {
            unreachable!()
        };
        assert_eq!(*bf16, [false; 3]);
    }
}

/// Every GEMM of a bf16 plan multiplies bf16 operands as they are stored (the
/// `weight_copies` pass gives each f32 operand of a product a bf16 copy: the input's, a
/// mean's), and its product is bf16 exactly when its value is stored so.
#[test]
fn bf16_plans_multiply_bf16_operands_as_stored() {
    for file in ["transformer.ron", "mlp.ron", "cnn.ron"] {
        let (plan, m) = module(file, Storage::Bf16, &CodegenOptions::default());
        let is_bf16 = |a: &Arg| matches!(*a, Arg::Value(s) if plan.stored_in_bf16(s));
        assert!(gemms(&m).count() > 0, "{file}");
        for k in &m.kernels {
            for l in &k.launches {
                let Launch::Gemm { a, b, c, bf16, .. } = l else {
                    continue;
                };
                assert!(is_bf16(a) && is_bf16(b), "{file}: kernel {}", k.index);
                assert_eq!(
                    *bf16,
                    [true, true, is_bf16(c)],
                    "{file}: kernel {}",
                    k.index
                );
            }
        }
        assert_eq!(m.staging, 0, "{file}");
    }
}

/// A product of a bf16 value and an f32 one (which no model has left after `weight_copies`)
/// first rounds the f32 operand into the staging buffer, then multiplies bf16.
#[test]
fn a_mixed_product_stages_its_f32_operand_in_bf16() {
    let mut g = super::Gen {
        bf16_values: std::sync::Arc::new([1usize, 2].into_iter().collect()),
        ..super::Gen::default()
    };
    let operand = |id: usize, shape: &[u64]| super::Operand {
        arg: Arg::Value(id),
        shape: shape.to_vec(),
        dtype: crate::ir::DType::F32,
    };
    let op = crate::ir::Op::MatMul {
        trans_a: false,
        trans_b: false,
    };
    let (x, w, y) = (
        operand(0, &[5, 3]),
        operand(1, &[3, 4]),
        operand(2, &[5, 4]),
    );
    let mut staging = 0;
    let l = super::gemm(&mut g, "k0", &op, &[x, w], &y, &mut staging).expect("a GEMM");
    let [Launch::Kernel { args, .. }, Launch::Gemm { a, b, c, bf16, .. }] = &l[..] else {
        panic!("{l:?}")
    };
    assert_eq!(args[..], [Arg::Value(0), Arg::Staging { at: 0 }]);
    assert_eq!(
        (*a, *b, *c),
        (Arg::Staging { at: 0 }, Arg::Value(1), Arg::Value(2))
    );
    assert_eq!(*bf16, [true, true, true]);
    // Each staged operand is 256-byte aligned: 128 bf16.
    assert_eq!(staging, 128);
    let text = g.text("sm_80");
    assert!(text.contains("st.global.u16") && text.contains("ld.global.f32"));
    assemble(&text).unwrap_or_else(|e| panic!("{e}"));
}

/// A reshape between values stored alike is a copy of their bytes; between an f32 value and
/// a bf16 one, a kernel that converts.
#[test]
fn reshapes_copy_bf16_as_two_byte_elements() {
    let (plan, m) = module("transformer.ron", Storage::Bf16, &CodegenOptions::default());
    let mut bf16_copies = 0;
    for l in m.kernels.iter().flat_map(|k| &k.launches) {
        if let Launch::Copy { src, dst, bf16, .. } = l {
            let of = |a: &Arg| matches!(*a, Arg::Value(s) if plan.stored_in_bf16(s));
            assert_eq!(of(src), *bf16);
            assert_eq!(of(dst), *bf16);
            bf16_copies += usize::from(*bf16);
        }
    }
    assert!(bf16_copies > 0);
}
