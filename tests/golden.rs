//! Golden IR text for every experiment in `models/`. `BLESS=1 cargo test --test golden`
//! rewrites the expected files; review the diff before committing it. The small models are
//! compared after the whole pipeline; `gpt-large` after `shapes` (its forward graph), since its
//! training graph is 16,000 ops of the same few blocks.

use parallax_compiler::ir::print::to_text;
use parallax_compiler::{compile, parse_bytes, Options};
use std::path::Path;

fn golden(model: &str, after: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = std::fs::read(root.join("models").join(format!("{model}.ron"))).unwrap();
    let source = parse_bytes(&src).unwrap_or_else(|e| panic!("{model}: {e}"));
    let options = Options {
        verify: true,
        ..Options::default()
    };
    let mut text = String::new();
    compile(&source, &options, &mut |pass, g| {
        if pass == after {
            text = to_text(g, &source.experiment.name);
        }
    })
    .unwrap();
    assert!(!text.is_empty(), "no pass named {after}");
    let expected_path = root.join("tests/golden").join(format!("{model}.ir"));
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&expected_path, &text).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&expected_path)
        .unwrap_or_else(|_| panic!("{} is missing: run with BLESS=1", expected_path.display()));
    if text != expected {
        let first = text
            .lines()
            .zip(expected.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(text.lines().count().min(expected.lines().count()));
        panic!(
            "{model}: the IR differs from {} at line {}:\n  got:      {}\n  expected: {}\n(BLESS=1 rewrites it)",
            expected_path.display(),
            first + 1,
            text.lines().nth(first).unwrap_or("<end>"),
            expected.lines().nth(first).unwrap_or("<end>")
        );
    }
}

#[test]
fn mlp() {
    golden("mlp", "simplify");
}

#[test]
fn cnn() {
    golden("cnn", "simplify");
}

#[test]
fn transformer() {
    golden("transformer", "simplify");
}

#[test]
fn gpt_large() {
    golden("gpt-large", "shapes");
}

/// Every file in `models/` has a golden test above.
#[test]
fn every_model_has_a_golden_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for entry in std::fs::read_dir(root.join("models")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "ron") {
            let stem = path.file_stem().unwrap().to_string_lossy().to_string();
            assert!(
                root.join("tests/golden")
                    .join(format!("{stem}.ir"))
                    .exists(),
                "models/{stem}.ron has no golden IR"
            );
        }
    }
}
