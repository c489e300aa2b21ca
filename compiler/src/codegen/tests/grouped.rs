//! Tests of `codegen/grouped.rs`: the grouped kernels of real plans, their tables, and ptxas.
use super::super::testing::{assert_no_spills, model_module};
use super::super::{builder, Arg, KernelCode, Launch, Module, BLOCK};
use super::{CHUNK, PARAM_BYTES};

/// The kernels with a table parameter (grouped), with their launches.
fn grouped(m: &Module) -> Vec<&KernelCode> {
    m.kernels
        .iter()
        .filter(|k| {
            k.launches.iter().any(|l| {
                matches!(l, Launch::Kernel { args, .. } if args.iter().any(|a| matches!(a, Arg::Table { .. })))
            })
        })
        .collect()
}

/// A launch's table words (after `Arg::Table`) and the parameters before it.
fn table(l: &Launch) -> (&[Arg], usize) {
    let Launch::Kernel { args, .. } = l else {
        panic!("a kernel launch");
    };
    let at = args
        .iter()
        .position(|a| matches!(a, Arg::Table { .. }))
        .unwrap();
    let Arg::Table { words } = args[at] else {
        unreachable!()
    };
    assert_eq!(
        args.len(),
        at + 1 + words as usize,
        "the table is the last parameter"
    );
    (&args[at + 1..], at)
}

/// The entries of `m` the grouped kernels launch, as one module text.
fn grouped_text(m: &Module) -> (String, usize) {
    let mut names: Vec<&str> = grouped(m)
        .iter()
        .flat_map(|k| &k.launches)
        .filter_map(|l| match l {
            Launch::Kernel { entry, .. } => Some(entry.as_str()),
            _ => None,
        })
        .collect();
    names.sort_unstable();
    names.dedup();
    let mut text = builder::header(&m.target);
    for (n, e) in &m.entries {
        if names.contains(&n.as_str()) {
            text.push_str(e);
        }
    }
    (text, names.len())
}

#[test]
fn transformer_steps_and_norms_in_three_launches_that_assemble() {
    let m = model_module("transformer.ron");
    let g = grouped(&m);
    // The AdamW steps (one launch) and the squared norms (one per gradient rank).
    assert_eq!(g.len(), 3);
    assert!(g.iter().all(|k| k.launches.len() == 1));
    let (text, entries) = grouped_text(&m);
    assert!(text.contains(".param .align 8 .b8"), "{text}");
    assert_no_spills(&text, entries);
    for k in g {
        let l = &k.launches[0];
        let (words, before) = table(l);
        let Launch::Kernel { grid, block, .. } = l else {
            unreachable!()
        };
        assert_eq!(*block, BLOCK);
        if k.ops.contains(&"reduce_sum") {
            // One block per member: [count, lanes, gradient, sum] each.
            assert_eq!(words.len() % 4, 0);
            assert_eq!(*grid as usize, words.len() / 4);
            for w in words.chunks(4) {
                let (Arg::U64(n), Arg::U64(lanes)) = (w[0], w[1]) else {
                    panic!("{w:?}");
                };
                assert_eq!(lanes, if n < 64 { 1 } else { 256 }, "{w:?}");
                assert!(matches!((w[2], w[3]), (Arg::Value(_), Arg::Value(_))));
            }
            assert_eq!(before, 0);
        } else {
            // [first block, count, gradient, parameter, m, v, new m, new v, new parameter];
            // the clip coefficient, the learning rate and Adam's two scalars are shared.
            assert_eq!(before, 4, "{:?}", k.ops);
            let record = 9;
            assert_eq!(words.len() % record, 0);
            let mut blocks = 0;
            for w in words.chunks(record) {
                let (Arg::U64(first), Arg::U64(n)) = (w[0], w[1]) else {
                    panic!("{w:?}");
                };
                assert_eq!(first, blocks);
                blocks += n.div_ceil(CHUNK);
            }
            assert_eq!(*grid as u64, blocks);
        }
    }
}

#[test]
fn large_groups_split_into_launches_under_the_parameter_limit() {
    let m = model_module("../benches/models/gpt-gpu.ron");
    let g = grouped(&m);
    let steps = g
        .iter()
        .find(|k| !k.ops.contains(&"reduce_sum"))
        .expect("a grouped step");
    assert!(steps.launches.len() >= 2, "{}", steps.launches.len());
    let mut members = 0;
    for l in &steps.launches {
        let (words, before) = table(l);
        assert!(8 * (words.len() + before) as u64 <= PARAM_BYTES);
        // Adam without clipping: the same nine words per member as above.
        assert_eq!(words.len() % 9, 0);
        members += words.len() / 9;
    }
    // gpt-gpu's 148 parameters but its embeddings' (no decay there either way).
    assert!(members >= 100, "{members}");
    let (text, entries) = grouped_text(&m);
    assert_no_spills(&text, entries);
}
