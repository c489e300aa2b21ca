//! Tests of `codegen/norm.rs`: the fused norm kernels of a pre-LN transformer, one launch each,
//! assembled by ptxas for sm_80 and sm_90 without spills.
use super::super::super::testing::assert_no_spills;
use super::super::super::{builder, generate, Arg, Launch, Module};

/// The transformer of `models/`, with its norms replaced by `norm` and width `d` (heads of
/// 64), at its batch size.
fn module(norm: &str, d: u64) -> Module {
    let path =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/transformer.ron");
    let text = std::fs::read_to_string(path)
        .expect("model file")
        .replace("LayerNorm", norm)
        .replace(
            r#""d": 64, "heads": 4"#,
            &format!(r#""d": {d}, "heads": {}"#, d / 64),
        );
    let source = crate::parse(&text).expect("parses");
    let options = crate::Options::default();
    let compiled = crate::compile(&source, &options, &mut |_, _| {}).expect("compiles");
    let plan = compiled.plan(&source, &options);
    generate(&plan, plan.batch_size, "sm_80").expect("generates")
}

/// Per fused kernel of `ops`, its one launch's entry and arguments.
fn launches<'m>(m: &'m Module, ops: &[&str]) -> Vec<(&'m str, &'m [Arg])> {
    m.kernels
        .iter()
        .filter(|k| k.ops == ops)
        .map(|k| match &k.launches[..] {
            [Launch::Kernel { entry, args, .. }] => (entry.as_str(), &args[..]),
            other => panic!("{ops:?}: {other:?}"),
        })
        .collect()
}

#[test]
fn residual_adds_and_norms_are_one_launch_each() {
    // Rows of 64 (a warp each) and of 1536 (a block each).
    for (norm, grad) in [("LayerNorm", "layer_norm"), ("RmsNorm", "rms_norm")] {
        for d in [64, 1536] {
            let m = module(norm, d);
            let grad_name = format!("{grad}_grad");
            let fwd = launches(&m, &["add", grad]);
            let bwd = launches(&m, &[grad_name.as_str(), "add"]);
            // Two norms per layer and the last; each layer's two norm gradients but the last
            // norm's (read by more than its add).
            assert_eq!((fwd.len(), bwd.len()), (5, 4), "{norm} {d}");
            for (_, args) in &fwd {
                // The sum's operands, the sum itself (stored for the next residual add),
                // the norm's output.
                let stored = args.iter().filter(|a| matches!(a, Arg::Value(_))).count();
                assert_eq!((args.len(), stored), (4, 4), "{norm} {d}: {args:?}");
            }
            for (_, args) in &bwd {
                // x, dy, the other addend, the sum.
                assert_eq!(args.len(), 4, "{norm} {d}: {args:?}");
            }
            let mut entries: Vec<&str> = fwd.iter().chain(&bwd).map(|(e, _)| *e).collect();
            entries.sort_unstable();
            entries.dedup();
            let mut text = builder::header("sm_80");
            for e in &entries {
                let (_, body) = m.entries.iter().find(|(n, _)| n == e).expect("an entry");
                text.push_str(body);
                text.push('\n');
            }
            assert_no_spills(&text, entries.len());
        }
    }
}
