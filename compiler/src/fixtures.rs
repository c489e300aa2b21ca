//! Experiments the tests of several crates share.

/// A tiny GPT as experiment text: 2 decoder layers, 2 heads, width 16, sequence 8,
/// vocabulary 32, with `att` as the attention layer's further settings (`", causal: true"`)
/// and `extra` nodes after the decoder blocks.
pub fn tiny_gpt(att: &str, extra: &str) -> String {
    format!(
        r#"Experiment(
    name: "tiny-gpt",
    params: {{ "d": 16, "heads": 2, "layers": 2, "vocab": 32, "seq": 8 }},
    model: Graph(
        inputs: {{ "tokens": (shape: ["seq"], dtype: I32) }},
        blocks: {{
            "decoder": [
                ("n1",  LayerNorm,                       ["x"]),
                ("att", Attention(heads: "heads"{att}), ["n1"]),
                ("r1",  Add,                             ["x", "att"]),
                ("n2",  LayerNorm,                       ["r1"]),
                ("mlp", Mlp(hidden: "d * 4", act: Gelu), ["n2"]),
                ("out", Add,                             ["r1", "mlp"]),
            ],
        }},
        nodes: [
            ("emb",    Embedding(vocab: "vocab", dim: "d"),       ["tokens"]),
            ("pos",    PositionalEmbedding(max_len: "seq"),       ["emb"]),
            ("h",      Repeat(block: "decoder", times: "layers"), ["pos"]),
            {extra}
            ("norm",   LayerNorm,                                 ["h"]),
            ("logits", Linear(out: "vocab"),                      ["norm"]),
        ],
    ),
    loss: CrossEntropy,
    data: Sequence(task: Reverse, length: 8, vocab: 32, samples: 64),
    optimizer: Adam(lr: 1e-3),
    train: (batch_size: 4, steps: 1, seed: 7),
)"#
    )
}
