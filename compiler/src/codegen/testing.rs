//! Assembling generated PTX with `ptxas` in tests: `$PTXAS`, or the copy `.ci/run` installs
//! under `.tools/`. A missing `ptxas` fails the test (CI installs it), never skips it.

use std::path::PathBuf;

pub fn ptxas() -> PathBuf {
    if let Ok(p) = std::env::var("PTXAS") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/nvcc/nvidia/cu13/bin/ptxas");
    assert!(
        p.exists(),
        "ptxas not found at {}: run .ci/run once (it installs nvidia-cuda-nvcc) or set PTXAS",
        p.display()
    );
    p
}

/// `ptxas -v`'s log of `text` (written for `sm_80`) assembled for `target`; panics when it
/// does not assemble. `PARALLAX_PTXAS_LOG=1` prints it.
pub fn ptxas_log(text: &str, target: &str) -> String {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let id = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!("parallax-v-{}-{id}.ptx", std::process::id()));
    std::fs::write(
        &file,
        text.replace(".target sm_80", &format!(".target {target}")),
    )
    .unwrap();
    let out = std::process::Command::new(ptxas())
        .args(["--gpu-name", target, "-v", "-o", "/dev/null"])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{log}");
    if std::env::var_os("PARALLAX_PTXAS_LOG").is_some() {
        eprintln!("{target}\n{log}");
    }
    log
}

/// Checks that `text` assembles for sm_80 and sm_90 into `kernels` kernels, none spilling.
pub fn assert_no_spills(text: &str, kernels: usize) {
    for target in ["sm_80", "sm_90"] {
        let log = ptxas_log(text, target);
        let used = log.lines().filter(|l| l.contains("Used ")).count();
        assert_eq!(used, kernels, "{target}: {log}");
        assert!(
            log.lines()
                .filter(|l| l.contains("spill"))
                .all(|l| l.contains("0 bytes spill stores, 0 bytes spill loads")),
            "{target}: {log}"
        );
    }
}

/// Assembles `text` for `sm_80` and `sm_90`; the error names the target and ptxas's output.
pub fn assemble(text: &str) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("parallax-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let id = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = dir.join(format!("k{id}.ptx"));
    for target in ["sm_80", "sm_90"] {
        let text = text.replace(".target sm_80", &format!(".target {target}"));
        std::fs::write(&file, &text).map_err(|e| e.to_string())?;
        let out = std::process::Command::new(ptxas())
            .args(["--gpu-name", target, "-o", "/dev/null"])
            .arg(&file)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "{target}: {}\n{}",
                String::from_utf8_lossy(&out.stderr),
                text.lines()
                    .enumerate()
                    .map(|(i, l)| format!("{:4} {l}", i + 1))
                    .collect::<Vec<_>>()
                    .join("\n")
            ));
        }
    }
    let _ = std::fs::remove_file(&file);
    Ok(())
}

use super::{generate_with, CodegenOptions, Module};

/// The module of a model file of `models/`, at its own batch size.
pub fn model_module(file: &str) -> Module {
    model_module_with(file, &CodegenOptions::default())
}

/// `model_module` with kernel choices.
pub fn model_module_with(file: &str, codegen: &CodegenOptions) -> Module {
    let plan = model_plan(file);
    generate_with(&plan, plan.batch_size, "sm_80", codegen).expect("generates")
}

/// The model files of `models/`, sorted.
pub fn model_files() -> Vec<String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("models/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".ron"))
        .collect();
    files.sort();
    files
}

/// The plan of a model file of `models/`.
pub fn model_plan(file: &str) -> crate::Plan {
    model_plan_stored(file, crate::dsl::ast::Storage::F32)
}

/// The plan of a model file of `models/` with its activations stored as `activations`.
pub fn model_plan_stored(file: &str, activations: crate::dsl::ast::Storage) -> crate::Plan {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models")
        .join(file);
    let text = std::fs::read_to_string(&path).expect("model file");
    let mut source = crate::parse(&text).expect("parses");
    source.experiment.devices.activations = activations;
    let options = crate::Options::default();
    let compiled = crate::compile(&source, &options, &mut |_, _| {}).expect("compiles");
    compiled.plan(&source, &options)
}

use super::{Arg, Gen, Launch, Operand};
use crate::ir::DType;

/// Value `i` of `shape`, stored as `dtype`.
pub fn value(i: usize, shape: &[u64], dtype: DType) -> Operand {
    Operand {
        arg: Arg::Value(i),
        shape: shape.to_vec(),
        dtype,
    }
}

/// Value `i` of `shape`, stored as f32.
pub fn value_f32(i: usize, shape: &[u64]) -> Operand {
    value(i, shape, DType::F32)
}

/// The six inputs of attention's backward, token-major, at `b` batch positions, as values
/// 0..6: q `[b, t, h, d]`, k `[b, s, h, d]`, v `[b, s, h, e]`, dy `[b, t, h, e]`, lse and
/// delta `[b, t, h]` (the forward's tests take the first two or three).
pub fn attention_inputs(b: u64, h: u64, (t, s): (u64, u64), (d, e): (u64, u64)) -> Vec<Operand> {
    let shapes = [[t, d], [s, d], [s, e], [t, e]];
    let mut ins: Vec<Operand> = (0..4)
        .map(|i| value_f32(i, &[b, shapes[i][0], h, shapes[i][1]]))
        .collect();
    ins.extend([value_f32(4, &[b, t, h]), value_f32(5, &[b, t, h])]);
    ins
}

/// A generator that takes the tensor-core (bf16) attention kernels.
pub fn bf16_attention() -> Gen {
    Gen {
        options: CodegenOptions {
            bf16_attention: true,
        },
        ..Gen::default()
    }
}

/// A kernel launch's entry, grid, block and arguments; panics on any other launch.
pub fn kernel(l: &Launch) -> (String, u32, u32, Vec<Arg>) {
    let Launch::Kernel {
        entry,
        grid,
        block,
        args,
        ..
    } = l
    else {
        panic!("{l:?}")
    };
    (entry.clone(), *grid, *block, args.clone())
}

/// The dynamic shared memory a kernel launch passes; panics on any other launch.
pub fn shared(l: &Launch) -> u32 {
    match l {
        Launch::Kernel { shared, .. } => *shared,
        other => panic!("{other:?}"),
    }
}
