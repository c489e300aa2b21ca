//! The decode step's key/value cache against the full-window forward, on a tiny GPT with
//! random weights: the same logits at every position and past the window, the same greedy
//! tokens, the caches' bytes; a model that cannot be cached falls back to the full window.

use super::*;
use parallax_compiler::{compile, parse, Options as CompileOptions};
use std::path::PathBuf;

/// 2 decoder layers, 2 heads, width 16, sequence 8, vocabulary 32; `extra` nodes after the
/// decoder blocks.
fn gpt(extra: &str) -> Source {
    let text = parallax_compiler::fixtures::tiny_gpt(", causal: true", extra);
    parse(&text).expect("the tiny GPT parses")
}

fn train_plan(source: &Source) -> Plan {
    let o = CompileOptions::default();
    compile(source, &o, &mut |_, _| {})
        .unwrap()
        .plan(source, &o)
}

/// Random weights by `seed` (the executor's initialisation), or after `steps` training
/// steps on windows of a counting stream, as `final.safetensors`.
fn weights(source: &Source, seed: u64, steps: u64, tag: &str) -> Weights {
    let plan = train_plan(source);
    let files = FileShapes::of(&plan);
    let batch = plan.batch_size as usize;
    let (mut exec, _) = backend(plan, Device::Cpu, &None, batch, seed).unwrap();
    let optimizer = &source.experiment.optimizer;
    for step in 0..steps {
        // Windows of `i + 1 mod 32`, each starting elsewhere: the next token is learnable.
        let start = |b: usize| (step as usize * 5 + b * 11) % 32;
        let ids = |shift: usize| -> Vec<i32> {
            (0..batch)
                .flat_map(|b| (0..8).map(move |i| ((start(b) + i + shift) % 32) as i32))
                .collect()
        };
        exec.set_input("tokens", batch, &Values::I32(ids(0)))
            .unwrap();
        exec.set_input("labels", batch, &Values::I32(ids(1)))
            .unwrap();
        crate::train::set_scalars(exec.as_mut(), optimizer, step, steps).unwrap();
        exec.run(batch, Mode::Train, step, 0).unwrap();
    }
    let path: PathBuf = std::env::temp_dir().join(format!(
        "px-kv-{tag}-{seed}-{}.safetensors",
        std::process::id()
    ));
    crate::run::weights::save(exec.as_ref(), &files, &path).unwrap();
    Weights::Final(path)
}

fn random_weights(source: &Source, seed: u64, tag: &str) -> Weights {
    weights(source, seed, 0, tag)
}

/// Both generators of `source` with the same weights: the cached one first.
fn both(source: &Source, weights: &Weights) -> (Generator, Generator) {
    let cached = Generator::new(source, train_plan(source), Device::Cpu, weights).unwrap();
    let full = Generator::full_window(source, train_plan(source), Device::Cpu, weights).unwrap();
    (cached, full)
}

/// The largest difference between two rows of logits, relative to the larger's scale.
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let scale = a
        .iter()
        .chain(b)
        .fold(1e-12f64, |m, &x| m.max(x.abs() as f64));
    let diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
    diff / scale
}

#[test]
fn cached_logits_equal_the_full_windows_at_every_position_and_past_it() {
    let source = gpt("");
    // Two random initialisations, and a run trained for 60 steps.
    for (seed, steps) in [(1, 0), (2, 0), (3, 60)] {
        let weights = weights(&source, seed, steps, "logits");
        let (mut cached, mut full) = both(&source, &weights);
        assert!(cached.cached(), "{:?}", cached.uncached);
        assert!(!full.cached());
        // layers * (keys + values) * seq * width * 4 bytes.
        assert_eq!(cached.cache_bytes(), 2 * 2 * 8 * 16 * 4);
        let rng = stream(seed, Purpose::Sample, 9);
        // 13 tokens: positions 0..8 through the cache, then a window sliding past `seq` (the
        // full forward, built on first need).
        let prompt: Vec<u32> = (0..13).map(|i| (bits(rng, i) % 32) as u32).collect();
        let mut worst = 0f64;
        for n in 1..=prompt.len() {
            let a = cached.next_logits(&prompt[..n]).unwrap();
            let b = full.next_logits(&prompt[..n]).unwrap();
            assert_eq!(a.len(), 32);
            assert_eq!(a.len(), b.len());
            let d = rel_diff(&a, &b);
            assert!(d < 1e-5, "seed {seed}, {n} tokens: {d:e}");
            worst = worst.max(d);
        }
        // Another prompt on the same cache: only what differs is fed again.
        let other = [prompt[0], 5, 6];
        let d = rel_diff(
            &cached.next_logits(&other).unwrap(),
            &full.next_logits(&other).unwrap(),
        );
        assert!(d < 1e-5, "another prompt: {d:e}");
        eprintln!("seed {seed}, {steps} steps trained: largest relative difference cached vs full {worst:e}");
        if let Weights::Final(p) = weights {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[test]
fn greedy_tokens_are_the_same_with_and_without_the_cache() {
    let source = gpt("");
    // Trained, so that greedy decoding follows the stream rather than ties of noise.
    let weights = weights(&source, 3, 60, "greedy");
    let (mut cached, mut full) = both(&source, &weights);
    let o = Options {
        max_new_tokens: 14,
        temperature: 0.0,
        top_k: None,
        top_p: None,
        seed: 0,
    };
    let prompt = [3, 1, 4];
    let t = std::time::Instant::now();
    let a = cached.generate(&prompt, &o, &mut |_| true).unwrap();
    let with_cache = t.elapsed();
    let t = std::time::Instant::now();
    let b = full.generate(&prompt, &o, &mut |_| true).unwrap();
    let without = t.elapsed();
    eprintln!("14 greedy tokens: {with_cache:?} cached, {without:?} full window");
    assert_eq!(a.len(), 14);
    assert_eq!(a, b);
    // The model learnt to count: most of what it draws follows the token before.
    let context: Vec<u32> = prompt.iter().chain(&a).copied().collect();
    let counted = context
        .windows(2)
        .filter(|w| w[1] == (w[0] + 1) % 32)
        .count();
    eprintln!("greedy after [3, 1, 4]: {a:?} ({counted} of 16 steps count)");
    assert!(counted >= 8, "{a:?}");
    // Drawn at temperature 1 with one seed: the same tokens too.
    let o = Options {
        temperature: 1.0,
        seed: 5,
        ..o
    };
    let a = cached.generate(&prompt, &o, &mut |_| true).unwrap();
    let b = full.generate(&prompt, &o, &mut |_| true).unwrap();
    assert_eq!(a, b);
    if let Weights::Final(p) = weights {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn a_model_that_mixes_positions_runs_the_full_window() {
    // A softmax across positions: the decode step is refused, the sampler still works.
    let source = gpt(r#"("mix", Softmax(axis: 0), ["h"]), ("h2", Add, ["h", "mix"]),"#);
    let weights = random_weights(&source, 4, "mixed");
    let mut g = Generator::new(&source, train_plan(&source), Device::Cpu, &weights).unwrap();
    assert!(!g.cached());
    let why = g.uncached.clone().unwrap();
    assert!(
        why.contains("Softmax `mix` works across positions"),
        "{why}"
    );
    assert_eq!(g.cache_bytes(), 0);
    assert_eq!(g.next_logits(&[1, 2]).unwrap().len(), 32);
    if let Weights::Final(p) = weights {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn a_decode_step_of_two_samples_keeps_each_samples_cache() {
    let source = gpt("");
    let weights = random_weights(&source, 6, "batch");
    let plan = parallax_compiler::compile_decode(&source, 2, true).unwrap();
    assert_eq!(plan.memory.cache_bytes, 2 * 2 * 2 * 8 * 16 * 4);
    let output = model_output(&plan).unwrap();
    let files = FileShapes::of(&plan);
    let (mut exec, _) = backend(plan, Device::Cpu, &None, 2, 1).unwrap();
    weights.load(exec.as_mut(), &files).unwrap();
    let mut full =
        Generator::full_window(&source, train_plan(&source), Device::Cpu, &weights).unwrap();
    // Sample 0 reads a prompt a token at a time; sample 1 rewrites position 0 each step.
    let prompt = [7u32, 3, 9, 30, 1, 12, 5, 0];
    for (at, &t) in prompt.iter().enumerate() {
        let other = (at as i32 * 3) % 32;
        let tokens = Values::I32(vec![t as i32, other]);
        exec.set_input("tokens", 2, &tokens).unwrap();
        let pos = Values::I32(vec![at as i32, 0]);
        exec.set_input(parallax_compiler::plan::POSITION, 2, &pos)
            .unwrap();
        exec.run(2, Mode::Eval, 0, 0).unwrap();
        let out = exec.output_values(&output, 2).unwrap().unwrap();
        let rows = out.f32();
        let first = full.next_logits(&prompt[..=at]).unwrap();
        let second = full.next_logits(&[other as u32]).unwrap();
        assert!(rel_diff(&rows[..32], &first) < 1e-5, "sample 0 at {at}");
        assert!(rel_diff(&rows[32..], &second) < 1e-5, "sample 1 at {at}");
    }
    if let Weights::Final(p) = weights {
        let _ = std::fs::remove_file(p);
    }
}
