//! Golden files (`tests/golden/`): the IR text of every experiment in `models/` (the small
//! models after `simplify`; `gpt-large` and `shakespeare` after `shapes`, their training
//! graphs being many copies of the same few blocks); the small models after the last pass,
//! with their kernels, buffers and memory; dp2, ZeRO-2, pp2 and tp2 plans with their stages
//! and owners; the MLP's `plan.json`; `compile --explain`; a few PTX kernels. `BLESS=1 cargo
//! test --test golden` rewrites them; review the diff before committing it.

mod common;
use common::{model, plan_of};

use parallax_compiler::ir::print::to_text;
use parallax_compiler::plan::Strategy;
use parallax_compiler::{compile, Options};
use std::path::Path;

/// The IR text of `source` compiled with `options`, after pass `after`.
fn ir_after(source: &parallax_compiler::Source, options: &Options, after: &str) -> String {
    let options = Options {
        verify: true,
        ..options.clone()
    };
    let mut text = String::new();
    compile(source, &options, &mut |pass, g| {
        if pass == after {
            text = to_text(g, &source.experiment.name);
        }
    })
    .unwrap();
    assert!(!text.is_empty(), "no pass named {after}");
    text
}

fn golden(model_name: &str, after: &str) {
    let text = ir_after(&model(model_name), &Options::default(), after);
    same_as_file(&format!("{model_name}.ir"), &text);
}

/// Compares `text` with `tests/golden/{file}` (rewritten with BLESS=1).
fn same_as_file(file: &str, text: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let expected_path = root.join("tests/golden").join(file);
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&expected_path, text).unwrap();
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
            "{file}: differs from {} at line {}:\n  got:      {}\n  expected: {}\n(BLESS=1 rewrites it)",
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
fn shakespeare() {
    golden("shakespeare", "shapes");
}

#[test]
fn gpt_large() {
    golden("gpt-large", "shapes");
}

/// The scheduled plan of every small model: its kernels, buffers and memory as the IR text
/// shows them after the last pass.
#[test]
fn scheduled() {
    for name in ["mlp", "cnn", "transformer"] {
        let text = ir_after(&model(name), &Options::default(), "schedule");
        same_as_file(&format!("{name}.scheduled.ir"), &text);
    }
}

/// Partitioned plans after the last pass: one shard's program, with its collectives,
/// transfers, stages and owners.
#[test]
fn partitioned() {
    let cases = [
        (
            "mlp",
            "dp2",
            Strategy {
                dp: 2,
                tp: 1,
                pp: 1,
            },
            0,
        ),
        (
            "mlp",
            "dp2.zero2",
            Strategy {
                dp: 2,
                tp: 1,
                pp: 1,
            },
            2,
        ),
        (
            "cnn",
            "pp2",
            Strategy {
                dp: 1,
                tp: 1,
                pp: 2,
            },
            0,
        ),
        (
            "transformer",
            "tp2",
            Strategy {
                dp: 1,
                tp: 2,
                pp: 1,
            },
            0,
        ),
    ];
    for (name, label, strategy, zero) in cases {
        let source = model(name);
        let options = Options::partitioned(&source, strategy, zero);
        let text = ir_after(&source, &options, "schedule");
        same_as_file(&format!("{name}.{label}.ir"), &text);
    }
}

/// `plan.json` of the MLP, whole.
#[test]
fn plan_json() {
    let source = model("mlp");
    let options = Options::default();
    let plan = plan_of(&source, &options);
    same_as_file("mlp.plan.json", &plan.to_json());
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

fn parallax(args: &[&str]) -> String {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_parallax"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// `compile --explain`: the candidates, the choice and each stage's memory.
#[test]
fn explain() {
    let text = parallax(&["compile", "models/mlp.ron", "--gpus", "4", "--explain"]);
    same_as_file("mlp.gpus4.explain.txt", &text);
}

/// A few of the CNN's PTX kernels: a convolution, a pooling and a fused elementwise chain.
#[test]
fn ptx() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("golden-ptx");
    let _ = std::fs::remove_dir_all(&dir);
    parallax(&[
        "compile",
        "models/cnn.ron",
        "--emit",
        "ptx",
        "--out",
        dir.to_str().unwrap(),
    ]);
    for file in ["k0_conv.ptx", "k3_pool.ptx", "k1e.ptx"] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        same_as_file(&format!("cnn.{file}"), &text);
    }
}
