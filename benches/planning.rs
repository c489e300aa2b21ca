//! Planning speed: the partition planner on `models/gpt-large.ron` (per-layer aggregates from
//! the compiled graph, then every candidate costed and the fastest that fits chosen) at 8, 64
//! and 1024 GPUs, and at depths 10 to 160 blocks (target: 1024 GPUs in under 1 s on a 2-core
//! machine). The compile pipeline before it is `benches/frontend.rs`'s.

use criterion::{criterion_group, criterion_main, Criterion};
use parallax_compiler::devices::profile;
use parallax_compiler::partition::{self, model_cost, Target};
use parallax_compiler::{compile, parse, Options};
use std::hint::black_box;
use std::time::Duration;

fn gpt_large(layers: u32) -> parallax_compiler::ir::Graph {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt-large.ron"))
            .unwrap()
            .replace("\"layers\": 40", &format!("\"layers\": {layers}"));
    let source = parse(&text).unwrap();
    let options = Options {
        verify: false,
        ..Options::default()
    };
    compile(&source, &options, &mut |_, _| {}).unwrap().graph
}

fn target(gpus: u32) -> Target {
    let profile = profile("h100").unwrap();
    Target {
        gpus,
        profile,
        capacity: profile.memory,
        nodes: None,
        strategy: None,
    }
}

fn planning(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan gpt-large");
    group
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    let graph = gpt_large(40);
    for gpus in [8, 64, 1024] {
        group.bench_function(format!("{gpus} GPUs"), |b| {
            b.iter(|| {
                let m = model_cost(black_box(&graph), "gpt-large", 1024);
                partition::plan(&m, &target(gpus)).unwrap()
            })
        });
    }
    // The search alone, from the aggregates.
    let m = model_cost(&graph, "gpt-large", 1024);
    group.bench_function("1024 GPUs, candidates only", |b| {
        b.iter(|| partition::plan(black_box(&m), &target(1024)).unwrap())
    });
    for layers in [10, 160] {
        let graph = gpt_large(layers);
        group.bench_function(format!("{layers} blocks, 64 GPUs"), |b| {
            b.iter(|| {
                let m = model_cost(black_box(&graph), "gpt-large", 1024);
                partition::plan(&m, &target(64)).unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, planning);
criterion_main!(benches);
