//! Every layer of the language lowers, with the output shape PyTorch would give and the
//! parameter count PyTorch would report.

mod common;
use common::plan_of;

use parallax_compiler::{compile, parse, Options};

/// Compiles a Sequential model on `input` made of `layers`, with an MSE loss; returns the
/// output type and the parameter count.
fn sequential(input: &str, layers: &str) -> Result<(String, u64), String> {
    let text = format!(
        r#"Experiment(
    name: "t",
    params: {{ "d": 8 }},
    model: Sequential(input: (shape: {input}), layers: [{layers}]),
    loss: Mse,
    data: Synthetic(samples: 16),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 4, steps: 1),
)"#
    );
    run(&text)
}

fn run(text: &str) -> Result<(String, u64), String> {
    let source = parse(text).map_err(|e| e.to_string())?;
    let c = compile(&source, &Options::default(), &mut |_, _| {}).map_err(|e| e.to_string())?;
    let plan = c.plan(&source, &Options::default());
    let out = &plan.outputs[0];
    Ok((
        format!("{}[{}]", out.dtype, out.shape.join(", ")),
        plan.parameters,
    ))
}

#[test]
fn each_layer_has_pytorchs_shapes_and_parameter_counts() {
    let cases: &[(&str, &str, &str, u64)] = &[
        ("[8]", "Linear(out: 4)", "f32[B, 4]", 36),
        (
            "[8]",
            "Linear(out: \"d * 2\", bias: false)",
            "f32[B, 16]",
            128,
        ),
        (
            "[3, 9, 9]",
            "Conv2d(out: 6, kernel: 3)",
            "f32[B, 6, 7, 7]",
            168,
        ),
        (
            "[3, 9, 9]",
            "Conv2d(out: 6, kernel: 3, stride: 2, padding: 1)",
            "f32[B, 6, 5, 5]",
            168,
        ),
        (
            "[4, 9, 9]",
            "Conv2d(out: 4, kernel: 3, groups: 4, bias: false)",
            "f32[B, 4, 7, 7]",
            36,
        ),
        ("[2, 9, 9]", "MaxPool2d(kernel: 2)", "f32[B, 2, 4, 4]", 0),
        (
            "[2, 9, 9]",
            "AvgPool2d(kernel: 3, stride: 2, padding: 1)",
            "f32[B, 2, 5, 5]",
            0,
        ),
        ("[2, 3, 4]", "Flatten", "f32[B, 24]", 0),
        ("[2, 3, 4]", "Reshape([6, -1])", "f32[B, 6, 4]", 0),
        ("[2, 3, 4]", "Transpose(0, 2)", "f32[B, 4, 3, 2]", 0),
        ("[2, 3, 4]", "Permute([1, 2, 0])", "f32[B, 3, 4, 2]", 0),
        ("[8]", "Relu, Gelu, Tanh, Sigmoid", "f32[B, 8]", 0),
        ("[3, 5]", "Softmax", "f32[B, 3, 5]", 0),
        ("[3, 5]", "Softmax(axis: 0)", "f32[B, 3, 5]", 0),
        ("[3, 5]", "LayerNorm", "f32[B, 3, 5]", 10),
        (
            "[3, 5]",
            "LayerNorm(eps: 1e-6, affine: false)",
            "f32[B, 3, 5]",
            0,
        ),
        ("[3, 5]", "RmsNorm", "f32[B, 3, 5]", 5),
        ("[3, 4, 4]", "BatchNorm2d", "f32[B, 3, 4, 4]", 6),
        (
            "[6, 8]",
            "PositionalEmbedding(max_len: 10)",
            "f32[B, 6, 8]",
            80,
        ),
        ("[8]", "Dropout(0.5)", "f32[B, 8]", 0),
        // q, k, v and out projections: 4 * (8 * 8 + 8).
        ("[6, 8]", "Attention(heads: 2)", "f32[B, 6, 8]", 288),
        (
            "[6, 8]",
            "Attention(heads: 2, causal: true, bias: false)",
            "f32[B, 6, 8]",
            256,
        ),
        ("[6, 8]", "Mlp(hidden: 32, act: Relu)", "f32[B, 6, 8]", 552),
    ];
    for &(input, layers, want, params) in cases {
        let got = sequential(input, layers).unwrap_or_else(|e| panic!("{layers}: {e}"));
        assert_eq!(got, (want.to_string(), params), "{layers} on {input}");
    }
}

#[test]
fn embeddings_take_integer_tokens() {
    let text = r#"Experiment(
    name: "emb",
    model: Sequential(input: (shape: [5], dtype: I32), layers: [Embedding(vocab: 100, dim: 8), Linear(out: 100)]),
    loss: CrossEntropy,
    data: Synthetic(samples: 16),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 4, steps: 1),
)"#;
    assert_eq!(run(text).unwrap(), ("f32[B, 5, 100]".into(), 800 + 900));
}

const TWO_TOWER: &str = r#"Experiment(
    name: "two-tower",
    params: { "w": 16 },
    model: Graph(
        symbols: { "seq": 12 },
        inputs: {
            "image": (shape: [1, 8, 8]),
            "text": (shape: ["seq", 4]),
        },
        nodes: [
            // Out of order on purpose: nodes are sorted by their inputs.
            ("both",  Concat(axis: 0),        ["img_f", "txt_f"]),
            ("img_f", Linear(out: "w"),        ["img"]),
            ("img",   Flatten,                 ["image"]),
            ("txt_f", Linear(out: "w"),        ["pool"]),
            ("pool",  Reshape([-1]),           ["txt_w"]),
            ("txt_w", Linear(out: 1),          ["text_t"]),
            ("text_t", Transpose(0, 1),        ["text"]),
            ("gate",  Sigmoid,                 ["both"]),
            ("mixed", Mul,                     ["both", "gate"]),
            ("score", Linear(out: 3),          ["mixed"]),
            ("aux",   Linear(out: 1),          ["both"]),
        ],
        outputs: ["aux", "score"],
    ),
    loss: CrossEntropy(output: "score"),
    data: Synthetic(samples: 16),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 4, steps: 1),
)"#;

#[test]
fn graphs_take_several_inputs_and_give_several_outputs() {
    // The text tower needs a known length: with a symbolic `seq` the Linear over the
    // transposed text cannot size its weights, and says so.
    let e = run(TWO_TOWER).unwrap_err();
    assert!(
        e.contains("`txt_w`") && e.contains("known last dimension"),
        "{e}"
    );
    let fixed = TWO_TOWER.replace("symbols: { \"seq\": 12 }", "params: { \"seq\": 12 }");
    let c = plan_of(&parse(&fixed).unwrap(), &Options::default());
    let outs: Vec<(String, String)> = c
        .outputs
        .iter()
        .map(|o| (o.name.clone(), o.shape.join(", ")))
        .collect();
    assert_eq!(
        outs,
        vec![
            ("aux".into(), "B, 1".into()),
            ("score".into(), "B, 3".into()),
            ("loss".into(), "".into()),
        ]
    );
    let inputs: Vec<&str> = c.inputs.iter().map(|i| i.name.as_str()).collect();
    // The learning rate is an input too, so schedules never recompile.
    assert_eq!(inputs, ["image", "text", "labels", "lr"]);
    // image 64*16+16; text (transposed to [4, 12]) 12+1, then 4*16+16; aux 32+1; score 32*3+3.
    assert_eq!(c.parameters, 1040 + 13 + 80 + 33 + 99);
}

#[test]
fn repeated_blocks_take_arguments_and_nest() {
    let text = r#"Experiment(
    name: "nested",
    params: { "d": 8 },
    model: Graph(
        inputs: { "x": (shape: [8]) },
        blocks: {
            "inner": [ ("fc", Linear(out: "d"), ["x"]), ("act", Tanh, ["fc"]) ],
            "outer": [ ("a", Repeat(block: "inner", times: "k"), ["x"]), ("n", LayerNorm, ["a"]) ],
        },
        nodes: [
            ("body", Repeat(block: "outer", times: 3, args: { "k": 2 }), ["x"]),
            ("head", Linear(out: 2), ["body"]),
        ],
    ),
    loss: CrossEntropy,
    data: Synthetic(samples: 16),
    optimizer: Sgd(lr: 0.1),
    train: (batch_size: 4, steps: 1),
)"#;
    let c = plan_of(&parse(text).unwrap(), &Options::default());
    // 3 outer copies of (2 inner copies of (Linear, Tanh), LayerNorm), then the head.
    assert_eq!(c.layers, 3 * (2 * 2 + 1) + 1);
    assert_eq!(c.parameters, 3 * (2 * 72 + 16) + 18);
    assert!(c.params.iter().any(|p| p.name == "body.2.a.1.fc.weight"));
}
