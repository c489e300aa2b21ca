//! Property test: randomly damaged experiment files never crash the compiler.
//!
//! Every file in `models/` is mutated many times with a seeded PRNG (deleted and duplicated
//! byte ranges, random bytes including invalid UTF-8, numbers swapped for huge, negative,
//! zero or NaN values, identifiers swapped for others from the same file, truncation). Each
//! result goes through `parse_bytes`, `compile` and, if that succeeds, `compile_decode` (the
//! sampler's decode step); none may panic, an error must never be an internal one, and every
//! diagnostic must have a message and a span inside the file.

mod common;

use parallax_compiler::dsl::ast::{DimExpr, Layer, Model, NodeDecl, UniqueMap};
use parallax_compiler::{compile, compile_decode, parse_bytes, Error, Options, Source};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// Mutated inputs per model file, at most.
const ITERATIONS: u64 = 2_000;
/// Fewer for a model whose compiled graph is large: about this many ops compiled per file
/// (the transformer compiles to about 1,100 ops, gpt-large to about 16,500), so that the
/// whole test stays within a few seconds of a debug build.
const OPS_PER_FILE: u64 = 250_000;
const MIN_ITERATIONS: u64 = 10;
/// The number sweep covers the models that compile to at most this many ops.
const SWEEP_OPS: u64 = 500;

/// splitmix64: tiny, deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn new(file: u64, iteration: u64) -> Rng {
        Rng(file
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(iteration.wrapping_mul(0xd1b5_4a32_d192_ed03))
            ^ 0x5eed_f00d)
    }
    fn next(&mut self) -> u64 {
        common::splitmix64(&mut self.0)
    }
    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Values a number in the file may become.
const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "1",
    "-1",
    "-3",
    "0.0",
    "-0.5",
    "1.5",
    "NaN",
    "inf",
    "-inf",
    "1e308",
    "1e-320",
    "4294967296",
    "1099511627777",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551616",
    "99999999999999999999999",
    "-99999999999999999999999",
    "\"0\"",
    "\"-1\"",
    "\"65536 * 65536 * 65536\"",
    "\"9999999999 * 9999999999\"",
    "\"7 / 0\"",
    "\"3 / 2\"",
    "\"-(-9223372036854775807 - 1)\"",
    "1_000_000",
    "0x10",
    "1e",
];

/// Bytes likely to confuse a parser; random bytes (any of 256) are mixed in too.
const INTERESTING: &[&[u8]] = &[
    b"(",
    b")",
    b"[",
    b"]",
    b"{",
    b"}",
    b":",
    b",",
    b"\"",
    b"'",
    b"-",
    b"+",
    b".",
    b"/",
    b"*",
    b"//",
    b"/*",
    b"*/",
    b"#",
    b"\\",
    b"\n",
    b"\t",
    b"\0",
    b"r#\"",
    b"Some(",
    b"\xc3\xa9",         // é
    b"\xef\xbb\xbf",     // a byte-order mark
    b"\xe2\x80\x94",     // an em dash
    b"\xff",             // never valid UTF-8
    b"\xc3",             // a truncated sequence
    b"\xed\xa0\x80",     // a UTF-16 surrogate
    b"\xf4\x90\x80\x80", // beyond U+10FFFF
];

fn is_ident_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}
fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Byte ranges of identifiers (names of layers and fields, and names inside strings).
fn identifiers(src: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < src.len() {
        if is_ident_start(src[i]) && (i == 0 || !is_ident(src[i - 1])) {
            let start = i;
            while i < src.len() && is_ident(src[i]) {
                i += 1;
            }
            out.push((start, i));
        } else {
            i += 1;
        }
    }
    out
}

/// Byte ranges of numbers: a digit run not inside an identifier, with any fraction and
/// exponent.
fn numbers(src: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < src.len() {
        if src[i].is_ascii_digit() && (i == 0 || !is_ident(src[i - 1])) {
            let start = i;
            while i < src.len() && (src[i].is_ascii_alphanumeric() || b"._".contains(&src[i])) {
                i += 1;
            }
            out.push((start, i));
        } else {
            i += 1;
        }
    }
    out
}

/// A random range inside `len`, mostly short.
fn range(rng: &mut Rng, len: usize) -> (usize, usize) {
    let start = rng.below(len + 1);
    let max = if rng.below(8) == 0 { 256 } else { 16 };
    let end = (start + 1 + rng.below(max)).min(len);
    (start, end)
}

/// Applies one random mutation to `src`. Swaps of numbers and names, which usually keep
/// the file well-formed, are the most frequent, so that many mutants reach the later passes.
fn mutate(rng: &mut Rng, src: &mut Vec<u8>, idents: &[Vec<u8>]) {
    match rng.below(16) {
        // Delete a range.
        0 | 1 => {
            let (s, e) = range(rng, src.len());
            src.drain(s..e);
        }
        // Duplicate a range, in place or somewhere else.
        2 | 3 => {
            let (s, e) = range(rng, src.len());
            let copy = src[s..e].to_vec();
            let at = if rng.below(2) == 0 {
                e
            } else {
                rng.below(src.len() + 1)
            };
            src.splice(at..at, copy);
        }
        // Insert random or structural bytes.
        4 | 5 => {
            let at = rng.below(src.len() + 1);
            let mut bytes = Vec::new();
            for _ in 0..1 + rng.below(6) {
                if rng.below(3) == 0 {
                    bytes.push(rng.next() as u8);
                } else {
                    let piece: &&[u8] = rng.pick(INTERESTING);
                    bytes.extend_from_slice(piece);
                }
            }
            src.splice(at..at, bytes);
        }
        // Swap a number for an extreme one.
        6..=9 => {
            let nums = numbers(src);
            if nums.is_empty() {
                return;
            }
            let (s, e) = *rng.pick(&nums);
            let with = rng.pick(NUMBERS).as_bytes().to_vec();
            src.splice(s..e, with);
        }
        // Swap an identifier for another from the file: anywhere (layer and field names), or
        // only inside strings (node, block and parameter names, size expressions).
        10..=14 => {
            let quoted = rng.below(5) >= 2;
            let ids: Vec<(usize, usize)> = identifiers(src)
                .into_iter()
                .filter(|&(s, _)| !quoted || (s > 0 && src[s - 1] == b'"'))
                .collect();
            if ids.is_empty() || idents.is_empty() {
                return;
            }
            let (s, e) = *rng.pick(&ids);
            let with = rng.pick(idents).clone();
            src.splice(s..e, with);
        }
        // Truncate.
        _ => {
            let at = rng.below(src.len() + 1);
            src.truncate(at);
        }
    }
}

/// The layers a Graph model expands to, where `times` is written as a number or a single
/// parameter name; `None` when it cannot tell cheaply (the compiler then decides).
fn expanded_layers(source: &Source) -> u64 {
    let e = &source.experiment;
    let Model::Graph {
        params,
        blocks,
        nodes,
        ..
    } = &e.model
    else {
        return 1;
    };
    let value = |d: &DimExpr| -> u64 {
        let lookup = |name: &str| match e.params.get(name).or_else(|| params.get(name)) {
            Some(DimExpr::Int(n)) => Some(*n),
            Some(DimExpr::Expr(s)) => s.trim().parse().ok(),
            None => None,
        };
        let n = match d {
            DimExpr::Int(n) => Some(*n),
            DimExpr::Expr(s) => s.trim().parse().ok().or_else(|| lookup(s.trim())),
        };
        n.map_or(1, |n| n.clamp(1, i64::MAX) as u64)
    };
    fn count(
        decls: &[NodeDecl],
        blocks: &UniqueMap<Vec<NodeDecl>>,
        value: &dyn Fn(&DimExpr) -> u64,
        depth: usize,
    ) -> u64 {
        decls.iter().fold(0u64, |acc, (_, layer, _)| {
            let n = match layer {
                Layer::Repeat { block, times, .. } if depth < 8 => {
                    let inner = blocks
                        .get(block)
                        .map_or(1, |d| count(d, blocks, value, depth + 1));
                    value(times).saturating_mul(inner)
                }
                _ => 1,
            };
            acc.saturating_add(n)
        })
    }
    count(nodes, blocks, &value, 0)
}

/// Parses and compiles `bytes`; `Err` describes a broken property. A mutant that expands
/// to more than `max_layers` layers (`times: "layers"` become `times: "d_model"`) but no more
/// than the compiler accepts is parsed, not compiled: it is legal, only slow.
fn check(bytes: &[u8], max_layers: u64) -> Result<(), String> {
    let text = String::from_utf8_lossy(bytes).into_owned();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let source = parse_bytes(bytes)?;
        let layers = expanded_layers(&source);
        if layers > max_layers && layers <= 100_000 {
            return Ok(());
        }
        compile(&source, &Options::default(), &mut |_, _| {})?;
        // The decode step (`parallax sample`'s key/value cache) of what compiles: built or
        // refused with a diagnostic, never a panic.
        compile_decode(&source, 1, true).map(|_| ())
    }));
    let result = match outcome {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            return Err(format!("the compiler panicked: {msg}"));
        }
    };
    let Err(error) = result else {
        return Ok(());
    };
    if let Error::Verify { .. } = error {
        return Err(format!("an internal error: {error}"));
    }
    let diags = error.diagnostics();
    if diags.is_empty() {
        return Err(format!("an error without diagnostics: {error:?}"));
    }
    for d in &diags {
        if d.message.trim().is_empty() {
            return Err(format!("a diagnostic without a message: {d:?}"));
        }
        if d.hint.as_deref().is_some_and(|h| h.trim().is_empty()) {
            return Err(format!("an empty hint: {d:?}"));
        }
        if let Some(s) = d.span {
            if s.start > s.end || s.end > text.len() {
                return Err(format!(
                    "a span outside the file ({} bytes): {d:?}",
                    text.len()
                ));
            }
        }
        let rendered = catch_unwind(AssertUnwindSafe(|| d.render("f.ron", &text)))
            .map_err(|_| format!("rendering panicked: {d:?}"))?;
        if !rendered.starts_with("f.ron:") || !rendered.contains(" error: ") {
            return Err(format!("a badly rendered diagnostic: {rendered}"));
        }
        if d.span.is_some() && !rendered.contains('^') {
            return Err(format!("a located diagnostic without a caret: {rendered}"));
        }
    }
    Ok(())
}

fn model_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("models/ is readable")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "ron"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no models in {}", dir.display());
    files
}

/// A model file, with what the unmutated file compiles to.
struct ModelFile {
    name: String,
    bytes: Vec<u8>,
    ops: u64,
    /// Mutants expanding to more layers than this are not compiled (see [`check`]).
    max_layers: u64,
}

fn load(path: &Path) -> ModelFile {
    let bytes = std::fs::read(path).expect("a model file");
    let source = parse_bytes(&bytes).expect("the model parses");
    let ops = compile(&source, &Options::default(), &mut |_, _| {})
        .expect("the model compiles")
        .graph
        .g
        .node_count() as u64;
    ModelFile {
        name: path.file_stem().unwrap().to_string_lossy().into_owned(),
        max_layers: 2 * expanded_layers(&source) + 16,
        bytes,
        ops,
    }
}

/// `PARALLAX_MUTATIONS=K` runs K times as many mutations, and the number sweep on every
/// model, for a longer local search.
fn scale() -> Option<u64> {
    std::env::var("PARALLAX_MUTATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
}

/// Runs every mutation of one file; returns the failures, each saved for reproduction.
fn fuzz_file(index: u64, path: &Path) -> Vec<String> {
    let model = load(path);
    let iterations = (OPS_PER_FILE / model.ops.max(1)).clamp(MIN_ITERATIONS, ITERATIONS);
    let iterations = iterations.saturating_mul(scale().unwrap_or(1).max(1));
    let original = &model.bytes;
    let mut idents: Vec<Vec<u8>> = identifiers(original)
        .into_iter()
        .map(|(s, e)| original[s..e].to_vec())
        .collect();
    idents.sort();
    idents.dedup();
    let mut failures = Vec::new();
    for i in 0..iterations {
        let mut rng = Rng::new(index, i);
        let mut bytes = original.clone();
        // One mutation half the time, else two or three.
        let count = [1, 1, 2, 3][rng.below(4)];
        for _ in 0..count {
            mutate(&mut rng, &mut bytes, &idents);
        }
        if let Err(why) = check(&bytes, model.max_layers) {
            let saved = Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("mutant-{}-{i}.ron", model.name));
            let _ = std::fs::write(&saved, &bytes);
            failures.push(format!(
                "{} mutation {i} ({}): {why}",
                model.name,
                saved.display()
            ));
        }
    }
    failures
}

#[test]
fn mutated_models_never_crash_the_compiler() {
    let files = model_files();
    let failures: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(i, f)| scope.spawn(move || fuzz_file(i as u64, f)))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a fuzzing thread"))
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} mutated files broke the compiler:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Every number of every small model, swapped in turn for every extreme value: an
/// exhaustive complement to the random search.
#[test]
fn every_number_swapped_for_every_extreme_value() {
    let mut failures = Vec::new();
    for path in model_files() {
        let model = load(&path);
        if model.ops > SWEEP_OPS && scale().is_none() {
            continue;
        }
        let original = &model.bytes;
        for (s, e) in numbers(original) {
            for with in NUMBERS {
                let mut bytes = original.clone();
                bytes.splice(s..e, with.bytes());
                if let Err(why) = check(&bytes, model.max_layers) {
                    failures.push(format!(
                        "{} with `{}` at byte {s} replaced by `{with}`: {why}",
                        model.name,
                        String::from_utf8_lossy(&original[s..e])
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_prng_is_deterministic_and_spread() {
    let a: Vec<u64> = (0..4).map(|_| Rng::new(1, 2).next()).collect();
    assert!(a.windows(2).all(|w| w[0] == w[1]));
    assert_ne!(Rng::new(1, 2).next(), Rng::new(2, 1).next());
    let mut r = Rng::new(0, 0);
    let mut seen = [false; 16];
    for _ in 0..1_000 {
        seen[r.below(16)] = true;
    }
    assert!(seen.iter().all(|&s| s), "every mutation kind is reachable");
}
