//! Front-end speed: parse, lower and shape inference of a generated 1000-layer model, and of
//! `models/gpt-large.ron`. Target: under 20 ms for the 1000-layer model on a 2-core machine.

use criterion::{criterion_group, criterion_main, Criterion};
use parallax_compiler::{compile, parse, Options};
use std::hint::black_box;

/// A Sequential model of `layers` layers cycling through Linear, LayerNorm, Gelu, Dropout.
fn generated(layers: usize) -> String {
    let kinds = ["Linear(out: \"d\")", "LayerNorm", "Gelu", "Dropout(0.1)"];
    let body: Vec<String> = (0..layers)
        .map(|i| format!("        {},", kinds[i % kinds.len()]))
        .collect();
    format!(
        r#"Experiment(
    name: "generated-{layers}",
    params: {{ "d": 256 }},
    model: Sequential(
        input: (shape: ["d"]),
        layers: [
{}
            Linear(out: 10),
        ],
    ),
    loss: CrossEntropy,
    data: Synthetic(samples: 1024),
    optimizer: Sgd(lr: 0.1, momentum: 0.9),
    train: (batch_size: 128, steps: 10),
)
"#,
        body.join("\n")
    )
}

fn frontend(c: &mut Criterion) {
    let options = Options {
        verify: false,
        ..Options::default()
    };
    let text = generated(999);
    let source = parse(&text).expect("the generated model parses");
    assert_eq!(
        compile(&source, &options, &mut |_, _| {})
            .unwrap()
            .graph
            .layers,
        1000
    );
    c.bench_function("parse 1000 layers", |b| {
        b.iter(|| parse(black_box(&text)).unwrap())
    });
    c.bench_function("lower + shapes + simplify 1000 layers", |b| {
        b.iter(|| compile(black_box(&source), &options, &mut |_, _| {}).unwrap())
    });
    c.bench_function("parse + compile 1000 layers", |b| {
        b.iter(|| {
            let s = parse(black_box(&text)).unwrap();
            compile(&s, &options, &mut |_, _| {}).unwrap()
        })
    });
    let gpt = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt-large.ron"))
        .unwrap();
    c.bench_function("parse + compile gpt-large", |b| {
        b.iter(|| {
            let s = parse(black_box(&gpt)).unwrap();
            compile(&s, &options, &mut |_, _| {}).unwrap()
        })
    });
}

criterion_group!(benches, frontend);
criterion_main!(benches);
