//! Compiler speed: parse, lower and shape inference of a generated 1000-layer model (target:
//! under 20 ms on a 2-core machine) and of `models/gpt-large.ron`, and the whole pipeline
//! (autodiff, optimizer, simplify, fuse, schedule) of both.

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
    // The front end: parse, lower, shapes (what `check` runs).
    let options = Options {
        verify: false,
        stop_after: Some("shapes"),
        ..Options::default()
    };
    let full = Options {
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
    c.bench_function("lower + shapes 1000 layers", |b| {
        b.iter(|| compile(black_box(&source), &options, &mut |_, _| {}).unwrap())
    });
    c.bench_function("parse + lower + shapes 1000 layers", |b| {
        b.iter(|| {
            let s = parse(black_box(&text)).unwrap();
            compile(&s, &options, &mut |_, _| {}).unwrap()
        })
    });
    c.bench_function("whole pipeline 1000 layers", |b| {
        b.iter(|| compile(black_box(&source), &full, &mut |_, _| {}).unwrap())
    });
    let gpt = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt-large.ron"))
        .unwrap();
    c.bench_function("check gpt-large", |b| {
        b.iter(|| {
            let s = parse(black_box(&gpt)).unwrap();
            compile(&s, &options, &mut |_, _| {}).unwrap()
        })
    });
    c.bench_function("whole pipeline gpt-large", |b| {
        b.iter(|| {
            let s = parse(black_box(&gpt)).unwrap();
            compile(&s, &full, &mut |_, _| {}).unwrap()
        })
    });
}

criterion_group!(benches, frontend);
criterion_main!(benches);
