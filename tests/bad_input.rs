//! Malformed experiments: each test damages a small valid experiment and checks the exact
//! line and column of the first error, its message and its hint, through the library as the
//! CLI calls it (`parse_bytes`, then `compile`). The last tests run the binary itself.
//!
//! The two base experiments are copies of `models/mlp.ron` and `models/transformer.ron`, kept
//! here so that the expected positions do not move when the shipped examples are edited.

use parallax_compiler::{compile, parse_bytes, Diagnostic, Error, Options};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const MLP: &str = r#"// A small MLP classifier for the embedded 8x8 handwritten digits.
Experiment(
    name: "mlp-digits",
    params: { "hidden": 128 },
    model: Sequential(
        input: (shape: [64]),               // one 8x8 image, flattened; the batch is implicit
        layers: [
            Linear(out: "hidden"),
            Relu,
            Dropout(0.1),
            Linear(out: 10),
        ],
    ),
    loss: CrossEntropy,
    data: Digits(validation: 0.2),          // embedded in the repository: no download
    optimizer: AdamW(lr: 1e-3, weight_decay: 0.01, schedule: Cosine(warmup: 50)),
    train: (batch_size: 64, epochs: 30, seed: 42),
    devices: (gpus: 1),
)
"#;

const TRANSFORMER: &str = r#"// A small GPT-style decoder that learns to reverse token sequences.
Experiment(
    name: "transformer-reverse",
    params: { "d": 64, "heads": 4, "layers": 2, "vocab": 16 },
    model: Graph(
        symbols: { "seq": 16 },              // symbolic; 16 is the size used for estimates
        inputs: { "tokens": (shape: ["seq"], dtype: I32) },
        blocks: {
            // "x" is the block's input; the last node is its output.
            "decoder": [
                ("n1",  LayerNorm,                               ["x"]),
                ("att", Attention(heads: "heads", causal: true), ["n1"]),
                ("r1",  Add,                                     ["x", "att"]),
                ("n2",  LayerNorm,                               ["r1"]),
                ("mlp", Mlp(hidden: "d * 4", act: Gelu),         ["n2"]),
                ("out", Add,                                     ["r1", "mlp"]),
            ],
        },
        nodes: [
            ("emb",    Embedding(vocab: "vocab", dim: "d"),       ["tokens"]),
            ("pos",    PositionalEmbedding(max_len: 64),          ["emb"]),
            ("h",      Repeat(block: "decoder", times: "layers"), ["pos"]),
            ("norm",   LayerNorm,                                 ["h"]),
            ("logits", Linear(out: "vocab"),                      ["norm"]),
        ],
    ),
    loss: CrossEntropy,
    data: Sequence(task: Reverse, length: 16, vocab: 16, samples: 8192),
    optimizer: AdamW(lr: 3e-3, weight_decay: 0.01, clip_norm: 1.0, schedule: Cosine(warmup: 100)),
    train: (batch_size: 64, steps: 2000, seed: 1),
)
"#;

// ---- helpers ----

/// Runs the library as the CLI does; the diagnostics of the error, if any.
fn diagnostics(bytes: &[u8]) -> Option<Vec<Diagnostic>> {
    let result = parse_bytes(bytes)
        .and_then(|source| compile(&source, &Options::default(), &mut |_, _| {}).map(|_| ()));
    match result {
        Ok(()) => None,
        Err(e) => {
            assert!(
                !matches!(e, Error::Verify { .. }),
                "an internal error, not a diagnostic: {e}"
            );
            Some(e.diagnostics())
        }
    }
}

/// `base` with `from` (which must occur exactly once) replaced by `to`.
#[track_caller]
fn edit(base: &str, from: &str, to: &str) -> String {
    assert_eq!(base.matches(from).count(), 1, "`{from}` must occur once");
    base.replacen(from, to, 1)
}

/// Checks that `src` is refused with a first error at `line`:`col` whose message contains
/// `message`; returns that diagnostic for further checks.
#[track_caller]
fn refused(src: impl AsRef<[u8]>, line: usize, col: usize, message: &str) -> Diagnostic {
    let bytes = src.as_ref();
    let text = String::from_utf8_lossy(bytes).into_owned();
    let diags = diagnostics(bytes).expect("the experiment should be refused");
    let rendered: String = diags.iter().map(|d| d.render("f.ron", &text)).collect();
    let d = diags[0].clone();
    let loc = d
        .loc(&text)
        .unwrap_or_else(|| panic!("no location:\n{rendered}"));
    assert_eq!(
        (loc.line, loc.col),
        (line, col),
        "wrong location:\n{rendered}"
    );
    assert!(
        d.message.contains(message),
        "message lacks `{message}`:\n{rendered}"
    );
    d
}

/// The hint of `d`, which must have one containing `part`.
#[track_caller]
fn hint_has(d: &Diagnostic, part: &str) {
    let h = d
        .hint
        .as_deref()
        .unwrap_or_else(|| panic!("no hint: {d:?}"));
    assert!(h.contains(part), "hint lacks `{part}`: {h}");
}

#[test]
fn the_base_experiments_compile() {
    assert!(diagnostics(MLP.as_bytes()).is_none());
    assert!(diagnostics(TRANSFORMER.as_bytes()).is_none());
}

// ---- names ----

#[test]
fn unknown_layer_suggests_the_closest() {
    let d = refused(edit(MLP, "Relu,", "Relux,"), 9, 13, "unknown layer `Relux`");
    assert_eq!(d.hint.as_deref(), Some("did you mean `Relu`?"));
}

#[test]
fn unknown_layer_far_from_any_lists_them() {
    let d = refused(
        edit(MLP, "Relu,", "Frobnicate,"),
        9,
        13,
        "unknown layer `Frobnicate`",
    );
    hint_has(&d, "valid layers: `Linear`, `Conv2d`");
    hint_has(&d, "`Repeat`");
}

#[test]
fn unknown_field_lists_the_valid_fields() {
    let src = edit(MLP, "Linear(out: 10)", "Linear(out: 10, bais: true)");
    let d = refused(src, 11, 29, "unknown field `bais` in `Linear`");
    hint_has(&d, "did you mean `bias`?");
    hint_has(&d, "valid fields: `out`, `bias`");
}

#[test]
fn unknown_top_level_field_lists_the_sections() {
    let src = edit(
        MLP,
        "    loss: CrossEntropy,",
        "    loss: CrossEntropy,\n    epochs: 3,",
    );
    let d = refused(src, 15, 5, "unknown field `epochs` in `Experiment`");
    hint_has(
        &d,
        "`name`, `params`, `model`, `loss`, `data`, `optimizer`, `train`, `devices`",
    );
}

#[test]
fn missing_field_of_a_layer() {
    let d = refused(
        edit(MLP, "Linear(out: 10)", "Linear()"),
        11,
        20,
        "`Linear` is missing the field `out`",
    );
    hint_has(&d, "add `out: ...` inside `Linear(...)`");
}

#[test]
fn missing_section() {
    let d = refused(
        edit(MLP, "    loss: CrossEntropy,\n", ""),
        18,
        1,
        "`Experiment` is missing the field `loss`",
    );
    hint_has(&d, "add `loss: ...`");
}

#[test]
fn unknown_data_set() {
    let src = edit(MLP, "Digits(validation", "Digitz(validation");
    let d = refused(src, 15, 11, "unknown data set `Digitz`");
    assert_eq!(d.hint.as_deref(), Some("did you mean `Digits`?"));
}

#[test]
fn bad_dtype() {
    let src = edit(TRANSFORMER, "dtype: I32", "dtype: Int32");
    let d = refused(src, 7, 53, "unknown dtype `Int32`");
    assert_eq!(d.hint.as_deref(), Some("did you mean `I32`?"));
}

#[test]
fn unknown_device_kind() {
    let src = edit(
        MLP,
        "devices: (gpus: 1)",
        "devices: (gpus: 1, kind: \"h1000\")",
    );
    let d = refused(src, 18, 24, "unknown device kind `h1000`");
    assert_eq!(d.hint.as_deref(), Some("did you mean `h100`?"));
    let src = edit(
        MLP,
        "devices: (gpus: 1)",
        "devices: (gpus: 1, kind: \"tpu-v5p\")",
    );
    let d = refused(src, 18, 24, "unknown device kind `tpu-v5p`");
    hint_has(&d, "valid device kinds: `h100`, `h200`");
}

#[test]
fn duplicate_params_key() {
    let src = edit(
        MLP,
        "{ \"hidden\": 128 }",
        "{ \"hidden\": 128, \"hidden\": 64 }",
    );
    refused(src, 4, 31, "duplicate key `hidden`");
}

// ---- size expressions and sizes ----

#[test]
fn unknown_parameter_points_inside_the_expression() {
    let src = edit(MLP, "Linear(out: \"hidden\")", "Linear(out: \"2 * hiden\")");
    let d = refused(src, 8, 30, "unknown parameter `hiden`");
    assert_eq!(d.hint.as_deref(), Some("did you mean `hidden`?"));
}

#[test]
fn unknown_parameter_inside_a_repeated_block() {
    let src = edit(
        TRANSFORMER,
        "Mlp(hidden: \"d * 4\"",
        "Mlp(hidden: \"dd * 4\"",
    );
    let d = refused(src, 15, 38, "unknown parameter `dd`");
    assert_eq!(d.hint.as_deref(), Some("did you mean `d`?"));
}

#[test]
fn division_that_is_not_exact() {
    let src = edit(
        MLP,
        "Linear(out: \"hidden\")",
        "Linear(out: \"hidden / 3\")",
    );
    let d = refused(src, 8, 26, "128 / 3 does not divide exactly");
    hint_has(&d, "use `//` to round down");
}

#[test]
fn heads_that_do_not_divide_the_width() {
    let src = edit(
        TRANSFORMER,
        "Attention(heads: \"heads\"",
        "Attention(heads: 3",
    );
    refused(src, 12, 35, "the width 64 does not split into 3 heads");
}

#[test]
fn zero_size() {
    refused(
        edit(MLP, "Linear(out: 10)", "Linear(out: 0)"),
        11,
        20,
        "`out` must be positive, got 0",
    );
    refused(
        edit(
            MLP,
            "Linear(out: \"hidden\")",
            "Linear(out: \"hidden - 128\")",
        ),
        8,
        26,
        "`hidden - 128` is 0; sizes must be positive",
    );
}

#[test]
fn negative_size() {
    refused(
        edit(MLP, "Linear(out: 10)", "Linear(out: -3)"),
        11,
        20,
        "`out` must be positive, got -3",
    );
    refused(
        edit(MLP, "Linear(out: 10)", "Linear(out: \"-3\")"),
        11,
        26,
        "`-3` is -3; sizes must be positive",
    );
}

#[test]
fn absurdly_large_sizes() {
    let src = edit(
        MLP,
        "Linear(out: 10)",
        "Linear(out: \"65536 * 65536 * 65536\")",
    );
    let d = refused(
        src,
        11,
        26,
        "`65536 * 65536 * 65536` is 281474976710656, beyond the largest size",
    );
    hint_has(&d, "2^40");
    let src = edit(
        MLP,
        "Linear(out: 10)",
        "Linear(out: \"9999999999 * 9999999999\")",
    );
    refused(src, 11, 26, "size arithmetic overflows");
    // Beyond 64 bits, RON reads the literal as a float: still called too large.
    let src = edit(
        MLP,
        "Linear(out: 10)",
        "Linear(out: 99999999999999999999999)",
    );
    refused(src, 11, 25, "far too large for a size");
    let src = edit(MLP, "Linear(out: 10)", "Linear(out: 9223372036854775808)");
    refused(
        src,
        11,
        25,
        "9223372036854775808 is far too large for a size",
    );
    let src = edit(
        MLP,
        "Linear(out: 10)",
        "Linear(out: \"-(-9223372036854775807 - 1)\")",
    );
    refused(src, 11, 26, "size arithmetic overflows");
}

#[test]
fn concatenation_beyond_64_bits() {
    let src = r#"Experiment(
    name: "cat",
    model: Graph(
        inputs: { "x": (shape: [1099511627776, 8388608]) },
        nodes: [
            ("f", Flatten, ["x"]),
            ("c", Concat, ["f", "f"]),
        ],
    ),
    loss: Mse,
    data: Synthetic(samples: 10),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 64, steps: 10),
)
"#;
    refused(
        src,
        7,
        19,
        "in layer `c`: the concatenated axis is too large",
    );
}

#[test]
fn parameter_tensor_too_large() {
    let src = edit(MLP, "\"hidden\": 128", "\"hidden\": 1099511627776");
    refused(
        src,
        8,
        13,
        "in layer `0`: the parameter `weight` of shape [1099511627776, 64] is too large",
    );
}

#[test]
fn negative_count_underlines_the_sign() {
    let d = refused(
        edit(MLP, "batch_size: 64", "batch_size: -1"),
        17,
        25,
        "out of range",
    );
    hint_has(&d, "0 or more");
}

// ---- training sections ----

#[test]
fn nan_learning_rate() {
    refused(
        edit(MLP, "lr: 1e-3", "lr: NaN"),
        16,
        22,
        "the learning rate `lr` must be a positive number, got NaN",
    );
}

#[test]
fn negative_learning_rate_is_reported_once() {
    let src = edit(MLP, "lr: 1e-3", "lr: -0.1");
    refused(&src, 16, 22, "must be a positive number, got -0.1");
    // Not also "`min_lr` 0 is above `lr` -0.1" from the cosine schedule.
    assert_eq!(diagnostics(src.as_bytes()).unwrap().len(), 1);
}

#[test]
fn momentum_out_of_range() {
    let adamw = "AdamW(lr: 1e-3, weight_decay: 0.01, schedule: Cosine(warmup: 50))";
    refused(
        edit(MLP, adamw, "Sgd(lr: 0.1, momentum: 1.5)"),
        16,
        29,
        "`momentum` must be in [0, 1), got 1.5",
    );
    refused(
        edit(MLP, adamw, "Sgd(lr: 0.1, momentum: NaN)"),
        16,
        29,
        "`momentum` must be in [0, 1), got NaN",
    );
}

#[test]
fn several_section_errors_are_reported_together() {
    let src = edit(MLP, "lr: 1e-3", "lr: 0");
    let src = edit(&src, "validation: 0.2", "validation: 1.0");
    let diags = diagnostics(src.as_bytes()).unwrap();
    let text: Vec<&str> = diags.iter().map(|d| d.message.as_str()).collect();
    assert_eq!(diags.len(), 2, "{text:?}");
    assert!(text[0].contains("validation fraction must be in [0, 1), got 1"));
    assert!(text[1].contains("the learning rate `lr` must be a positive number, got 0"));
}

#[test]
fn both_steps_and_epochs() {
    refused(
        edit(MLP, "epochs: 30,", "epochs: 30, steps: 100,"),
        17,
        29,
        "give `steps` or `epochs`, not both",
    );
}

#[test]
fn neither_steps_nor_epochs() {
    let d = refused(
        edit(MLP, "epochs: 30, ", ""),
        17,
        5,
        "the training budget is missing",
    );
    hint_has(&d, "add `steps: N` or `epochs: N` to `train`");
}

#[test]
fn dropout_rate_above_one() {
    refused(
        edit(MLP, "Dropout(0.1)", "Dropout(1.5)"),
        10,
        21,
        "the dropout rate must be in [0, 1), got 1.5",
    );
}

// ---- damaged files ----

#[test]
fn attribute_header_keeps_locations_and_bare_layers() {
    // A `#![enable(...)]` line is valid RON: bare `LayerNorm` still works after it, and
    // errors still point at the right line.
    let src = edit(
        TRANSFORMER,
        "Experiment(",
        "#![enable(implicit_some)]\nExperiment(",
    );
    assert!(diagnostics(src.as_bytes()).is_none());
    let src = edit(&src, "[\"norm\"]),", "[\"nrm\"]), ");
    refused(src, 25, 68, "unknown input `nrm` of node `logits`");
}

#[test]
fn truncated_file() {
    let cut = MLP.find("    loss:").unwrap();
    let d = refused(&MLP[..cut], 13, 7, "the file ends in the middle of a value");
    hint_has(&d, "truncated");
    // Cut inside a string.
    let cut = MLP.find("mlp-digits").unwrap() + 3;
    refused(&MLP[..cut], 3, 11, "string");
}

#[test]
fn junk_bytes() {
    let src = edit(
        MLP,
        "    loss: CrossEntropy,",
        "    @@@ ### ;;\n    loss: CrossEntropy,",
    );
    refused(src, 14, 5, "expected");
    let src = format!("{MLP}trailing junk\n");
    refused(
        src,
        20,
        1,
        "unexpected text after the end of the experiment",
    );
    let src = format!("{MLP}\n// a comment\n/* another */ junk\n");
    refused(
        src,
        22,
        15,
        "unexpected text after the end of the experiment",
    );
}

#[test]
fn bytes_that_are_not_utf8() {
    let at = MLP.find("mlp-digits").unwrap() + 3;
    let mut bytes = MLP.as_bytes().to_vec();
    bytes[at] = 0xff;
    let d = refused(
        &bytes,
        3,
        15,
        &format!("the file is not valid UTF-8 (byte 0xff at offset {at})"),
    );
    hint_has(&d, "save the file as UTF-8");
    // A multi-byte sequence cut short.
    let mut bytes = MLP.as_bytes().to_vec();
    bytes.splice(at..at, [0xe2, 0x82]);
    refused(&bytes, 3, 15, "byte 0xe2");
}

#[test]
fn empty_file() {
    let d = refused("", 1, 1, "the file is empty");
    hint_has(&d, "Experiment(");
    refused("\n  \n\t\n", 1, 1, "the file is empty");
}

#[test]
fn deeply_nested_brackets_are_refused_without_recursing() {
    let t = Instant::now();
    let deep = "[".repeat(10_000);
    let src = edit(
        MLP,
        "input: (shape: [64])",
        &format!("input: (shape: {deep})"),
    );
    refused(src, 6, 25, "found a sequence");
    refused("(".repeat(10_000), 1, 2, "expected");
    let src = edit(
        MLP,
        "\"hidden\": 128",
        &format!("\"hidden\": {}", "{".repeat(10_000)),
    );
    refused(src, 4, 25, "found a map");
    // In a size expression: refused at the 66th parenthesis.
    let expr = format!("{}1{}", "(".repeat(10_000), ")".repeat(10_000));
    let src = edit(
        MLP,
        "Linear(out: \"hidden\")",
        &format!("Linear(out: \"{expr}\")"),
    );
    refused(src, 8, 26 + 65, "expression nested too deeply");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

// ---- graphs and blocks ----

#[test]
fn duplicate_node_names() {
    let src = edit(
        TRANSFORMER,
        "(\"norm\",   LayerNorm",
        "(\"pos\",    LayerNorm",
    );
    let d = refused(src, 23, 14, "two nodes are named `pos`");
    hint_has(&d, "rename one");
}

#[test]
fn unknown_node_input() {
    let src = edit(TRANSFORMER, "[\"norm\"]),", "[\"nrm\"]), ");
    let d = refused(src, 24, 68, "unknown input `nrm` of node `logits`");
    assert_eq!(d.hint.as_deref(), Some("did you mean `norm`?"));
}

#[test]
fn cycle_between_nodes() {
    let src = edit(TRANSFORMER, "[\"emb\"]),", "[\"logits\"]),");
    let d = refused(
        src,
        22,
        13,
        "the nodes form a cycle: h -> norm -> logits -> pos -> h",
    );
    hint_has(&d, "do not depend on it");
}

#[test]
fn repeat_of_an_unknown_block() {
    let src = edit(TRANSFORMER, "block: \"decoder\"", "block: \"decodr\"");
    let d = refused(src, 22, 31, "unknown block `decodr`");
    assert_eq!(d.hint.as_deref(), Some("did you mean `decoder`?"));
}

#[test]
fn block_that_repeats_itself() {
    let src = edit(
        TRANSFORMER,
        "(\"mlp\", Mlp(hidden: \"d * 4\", act: Gelu),",
        "(\"mlp\", Repeat(block: \"decoder\"),",
    );
    refused(
        src,
        15,
        32,
        "the block `decoder` repeats itself: decoder -> decoder",
    );
}

#[test]
fn block_that_repeats_itself_through_another() {
    let src = edit(
        TRANSFORMER,
        "            \"decoder\": [",
        "            \"enc\": [ (\"a\", Repeat(block: \"decoder\"), [\"x\"]) ],\n            \"decoder\": [",
    );
    let src = edit(
        &src,
        "(\"mlp\", Mlp(hidden: \"d * 4\", act: Gelu),",
        "(\"mlp\", Repeat(block: \"enc\"),",
    );
    refused(
        src,
        10,
        35,
        "the block `decoder` repeats itself: decoder -> enc -> decoder",
    );
}

#[test]
fn repeat_outside_a_graph() {
    refused(
        edit(MLP, "Relu,", "Repeat(block: \"b\"),"),
        9,
        13,
        "Repeat `1` needs a Graph model with `blocks`",
    );
}

#[test]
fn million_layer_repeat_is_refused_before_building() {
    let t = Instant::now();
    let src = edit(TRANSFORMER, "times: \"layers\"", "times: 1000000");
    refused(
        src,
        22,
        49,
        "Repeat `h` would make 6000000 layers; Parallax builds at most 100000",
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[test]
fn nested_repeats_are_counted_before_building() {
    // 1000 copies of a block that repeats the decoder 1000 times: refused at the outer Repeat,
    // before any copy is built.
    let t = Instant::now();
    let src = edit(
        TRANSFORMER,
        "            \"decoder\": [",
        "            \"stack\": [ (\"s\", Repeat(block: \"decoder\", times: 1000), [\"x\"]) ],\n            \"decoder\": [",
    );
    let src = edit(
        &src,
        "Repeat(block: \"decoder\", times: \"layers\")",
        "Repeat(block: \"stack\", times: 1000)",
    );
    refused(src, 23, 47, "Repeat `h` would make 6000000 layers");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

// ---- shapes and types ----

#[test]
fn residual_add_of_different_widths() {
    let src = edit(
        TRANSFORMER,
        "(\"mlp\", Mlp(hidden: \"d * 4\", act: Gelu),        ",
        "(\"mlp\", Linear(out: 32),                         ",
    );
    refused(
        src,
        16,
        25,
        "in layer `h.0.out`: shapes f32[B, seq, 64] and f32[B, seq, 32] do not broadcast",
    );
}

#[test]
fn conv2d_on_a_flat_input() {
    refused(
        edit(MLP, "Relu,", "Conv2d(out: 8, kernel: 3),"),
        9,
        13,
        "Conv2d `1` expects an image [C, H, W] per sample, got f32[B, 128]",
    );
}

#[test]
fn embedding_of_floats() {
    let d = refused(
        edit(MLP, "Relu,", "Embedding(vocab: 10, dim: 4),"),
        9,
        13,
        "Embedding `1` needs integer token ids, got f32[B, 128]",
    );
    hint_has(&d, "dtype: I32");
    let d = refused(
        edit(TRANSFORMER, "dtype: I32", "dtype: F32"),
        20,
        24,
        "Embedding `emb` needs integer token ids, got f32[B, seq]",
    );
    hint_has(&d, "dtype: I32");
}

#[test]
fn sequence_longer_than_the_positional_table() {
    refused(
        edit(TRANSFORMER, "max_len: 64", "max_len: 8"),
        21,
        44,
        "the sequence (seq = 16) is longer than `max_len` 8",
    );
}

#[test]
fn wrong_class_count_for_digits() {
    let d = refused(
        edit(MLP, "Linear(out: 10)", "Linear(out: 5)"),
        15,
        5,
        "the digits data set (8x8 images) has 10 classes, but the model's output has 5",
    );
    hint_has(&d, "Linear(out: 10)");
}

#[test]
fn wrong_input_size_for_digits() {
    refused(
        edit(MLP, "shape: [64]", "shape: [65]"),
        15,
        5,
        "gives 64 values per sample, but the model's input is f32[B, 65]",
    );
}

// ---- the command line ----

fn parallax(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_parallax"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bad_input");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn cli_prints_location_source_line_caret_and_hint() {
    let path = temp_file("unknown-layer.ron", edit(MLP, "Relu,", "Relux,").as_bytes());
    let file = path.to_str().unwrap();
    for cmd in ["check", "compile"] {
        let o = parallax(&[cmd, file]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {err}");
        assert!(o.stdout.is_empty(), "{cmd}");
        assert!(
            err.starts_with(&format!("{file}:9:13: error: unknown layer `Relux`\n")),
            "{cmd}: {err}"
        );
        assert!(err.contains("9 |             Relux,\n"), "{err}");
        assert!(err.contains("  |             ^^^^^\n"), "{err}");
        assert!(err.contains("= hint: did you mean `Relu`?"), "{err}");
    }
}

#[test]
fn cli_reports_model_and_encoding_errors_with_a_caret() {
    let src = edit(MLP, "Linear(out: 10)", "Linear(out: 5)");
    let path = temp_file("classes.ron", src.as_bytes());
    let file = path.to_str().unwrap();
    let o = parallax(&["compile", file]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with(&format!("{file}:15:5: error: the digits data set")),
        "{err}"
    );
    assert!(err.contains("\n   |     ^^^^\n"), "{err}");

    let mut bytes = MLP.as_bytes().to_vec();
    let at = MLP.find("mlp-digits").unwrap();
    bytes[at] = 0xc0;
    let path = temp_file("latin1.ron", &bytes);
    let file = path.to_str().unwrap();
    let o = parallax(&["check", file]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with(&format!("{file}:3:12: error: the file is not valid UTF-8")),
        "{err}"
    );
    assert!(err.contains("\n  |            ^\n"), "{err}");
}

#[test]
fn cli_missing_file_exits_1() {
    let missing = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bad_input/no-such-file.ron");
    let file = missing.to_str().unwrap();
    for cmd in ["check", "compile"] {
        let o = parallax(&[cmd, file]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {err}");
        assert!(
            err.starts_with(&format!("{file}: error: cannot read the file")),
            "{err}"
        );
    }
}

#[test]
fn cli_bad_flags_exit_2() {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/models/mlp.ron");
    for (args, mentions) in [
        (vec!["compile", model, "--gpus", "0"], "--gpus"),
        (vec!["compile", model, "--gpus", "lots"], "--gpus"),
        (
            vec!["compile", model, "--dump-ir", "after:nope"],
            "unknown pass `nope`",
        ),
        (vec!["compile", model, "--dump-ir", "lower"], "after:PASS"),
        (vec!["check", model, "--format", "yaml"], "--format"),
        (vec!["check"], "FILE"),
        (vec!["frobnicate", model], "frobnicate"),
    ] {
        let o = parallax(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(mentions), "{args:?}: {err}");
        assert!(o.stdout.is_empty(), "{args:?}");
    }
}

/// A UTF-8 byte-order mark at the start is accepted, and positions after it stay right.
#[test]
fn a_byte_order_mark_is_accepted() {
    let text = format!("\u{feff}{}", MLP.replace("Relu,", "Relux,"));
    let e = parallax_compiler::parse_bytes(text.as_bytes()).unwrap_err();
    let d = &e.diagnostics()[0];
    assert_eq!(d.message, "unknown layer `Relux`");
    let loc = d.loc(&text).unwrap();
    let line = text.lines().nth(loc.line - 1).unwrap();
    assert_eq!(&line[loc.col - 1..loc.col + 4], "Relux");
    let ok = format!("\u{feff}{MLP}");
    assert!(parallax_compiler::parse_bytes(ok.as_bytes()).is_ok());
}
