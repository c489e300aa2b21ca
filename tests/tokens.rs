//! Token files (`Tokens`) and `parallax tokenize`: raw and llm.c files train alike, bad files
//! are refused with their name, the windows are the same on one and two devices and a
//! resumed run continues them exactly; tokenize round-trips and writes the committed
//! Tiny Shakespeare files; `models/shakespeare.ron` trains.

mod common;
use common::{argv, metric, run_args, run_ok, temp, temp_dir, write_experiment, TINY_CAUSAL};

use parallax_compiler::dsl::ast::TokenDtype;
use parallax_runtime::data::codec::Codec;
use parallax_runtime::data::tokenize::llmc_bytes;
use parallax_runtime::data::tokens::TokenFile;
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(300);

/// Runs the binary with `args`; returns (exit code, stdout, stderr).
fn run(args: &[&str]) -> (Option<i32>, String, String) {
    run_args(args, LIMIT)
}

fn ok(args: &[&str]) -> String {
    run_ok(args, LIMIT)
}

/// A tiny causal model on token files of vocabulary 32, sequence 8, batch 4.
fn experiment(dir: &Path, train: &str, validation: &str) -> String {
    let text = format!(
        r#"Experiment(
    name: "tokens",
{TINY_CAUSAL}
    data: Tokens(train: "{train}", validation: "{validation}", validation_windows: 5),
    optimizer: Adam(lr: 1e-2),
    train: (batch_size: 4, steps: 8, seed: 3),
)"#
    );
    write_experiment(&dir.join(format!("{train}.ron")), &text)
}

fn tokens(n: usize) -> Vec<u32> {
    // A learnable stream: mostly counting mod 32, with a little noise.
    (0..n as u32)
        .map(|i| (i + (i * 7919 % 13 == 0) as u32) % 32)
        .collect()
}

/// Trains `file` into `run` with `extra`; the final weights and the losses.
fn train(file: &str, run: &Path, extra: &[&str]) -> (Vec<u8>, Vec<f64>) {
    let mut args = vec!["train", file, "--run-dir", run.to_str().unwrap()];
    args.extend_from_slice(extra);
    ok(&args);
    let w = std::fs::read(run.join("final.safetensors")).unwrap();
    (w, metric(run, "loss"))
}

#[test]
fn token_files_train_the_same_on_any_device_count_and_resume_exactly() {
    let dir = temp_dir("tokens-train");
    let ids = tokens(3000);
    let raw: Vec<u8> = ids.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect();
    std::fs::write(dir.join("raw.bin"), raw).unwrap();
    std::fs::write(dir.join("llmc.bin"), llmc_bytes(&ids, "llmc").unwrap()).unwrap();
    std::fs::write(dir.join("val.bin"), llmc_bytes(&ids[..500], "val").unwrap()).unwrap();
    let raw_exp = experiment(&dir, "raw.bin", "val.bin");
    let llmc_exp = experiment(&dir, "llmc.bin", "val.bin");

    let (one, losses) = train(&raw_exp, &dir.join("one"), &["--gpus", "1"]);
    assert_eq!(losses.len(), 8);
    assert!(losses.iter().all(|l| l.is_finite()));
    assert!(losses[7] < losses[0], "{losses:?}");
    assert_eq!(metric(&dir.join("one"), "val_loss").len(), 1);
    // The same tokens in llm.c's format: the same bits.
    let (llmc, llmc_losses) = train(&llmc_exp, &dir.join("llmc"), &["--gpus", "1"]);
    assert!(llmc == one && llmc_losses == losses, "raw and llm.c differ");
    // Two devices: the same windows, the same bits.
    let (two, two_losses) = train(&raw_exp, &dir.join("two"), &["--gpus", "2"]);
    assert!(two == one && two_losses == losses, "1 and 2 devices differ");
    // Stopped at step 4 on two devices and resumed on one: the data order continues exactly.
    let cut = dir.join("cut");
    let c = cut.to_str().unwrap();
    let first = "train {} --run-dir {} --steps 4 --checkpoint-every 2 --gpus 2";
    ok(&argv(first, &[&raw_exp, c]));
    ok(&argv("train --resume {} --steps 8 --gpus 1", &[c]));
    let resumed = std::fs::read(cut.join("final.safetensors")).unwrap();
    assert!(resumed == one, "the resumed run's bytes differ");
    assert_eq!(metric(&cut, "loss"), losses);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_token_files_are_refused_with_their_name() {
    let dir = temp_dir("tokens-bad");
    let ids = tokens(500);
    let good = llmc_bytes(&ids, "g").unwrap();
    std::fs::write(dir.join("val.bin"), &good).unwrap();
    let mut version = good.clone();
    version[4] = 9;
    std::fs::write(dir.join("version.bin"), version).unwrap();
    std::fs::write(dir.join("short.bin"), &good[..good.len() - 10]).unwrap();
    let mut big = ids.clone();
    big[321] = 40;
    std::fs::write(dir.join("vocab.bin"), llmc_bytes(&big, "v").unwrap()).unwrap();
    for (file, expect) in [
        ("version.bin", "must have version 1, but it has version 9"),
        (
            "short.bin",
            "should be 1024 + 500 * 2 bytes, but it has 2014",
        ),
        (
            "vocab.bin",
            "token 321 (byte offset 1666) is 40, but the model's vocabulary has 32",
        ),
        ("missing.bin", "cannot read"),
    ] {
        let exp = experiment(&dir, file, "val.bin");
        let (code, _, err) = run(&["train", &exp, "--steps", "1"]);
        assert_eq!(code, Some(1), "{file}: {err}");
        assert!(err.contains(file) && err.contains(expect), "{file}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn tokenize_round_trips_bytes_and_characters() {
    let dir = temp_dir("tokenize");
    let text = "To be, or not to be: that is the question.\nWhether 'tis nobler — in the mind\n"
        .repeat(10);
    std::fs::write(dir.join("a.txt"), &text).unwrap();
    let prefix = dir.join("out");
    let p = prefix.to_str().unwrap();
    let a = dir.join("a.txt");
    let a = a.to_str().unwrap();
    let out = ok(&argv("tokenize {} --out {} --tokenizer chars", &[a, p]));
    assert!(out.contains("MB/s") && out.contains("tokens"), "{out}");
    let n = text.chars().count();
    let read = |suffix: &str| {
        let f = TokenFile::open(&dir.join(format!("out{suffix}")), TokenDtype::U32).unwrap();
        assert_eq!(f.format, "llm.c");
        (0..f.len).map(|i| f.get(i)).collect::<Vec<u32>>()
    };
    let (train, val) = (read("_train.bin"), read("_val.bin"));
    assert_eq!(train.len(), (n as f64 * 0.9) as usize);
    assert_eq!(train.len() + val.len(), n);
    let recorded = dir.join("out_tokenizer.json");
    let json = std::fs::read_to_string(&recorded).unwrap();
    assert!(json.contains(r#""kind": "chars""#), "{json}");
    let codec = Codec::open(&recorded).unwrap();
    let mut distinct: Vec<char> = text.chars().collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(codec.describe(), format!("chars ({})", distinct.len()));
    let all: Vec<u32> = train.into_iter().chain(val).collect();
    assert_eq!(codec.decode(&all), text);
    // Bytes, no validation part: one file, the bytes themselves.
    ok(&argv("tokenize {} --out {} --validation 0", &[a, p]));
    let bytes = read(".bin");
    let codec = Codec::open(&recorded).unwrap();
    assert_eq!(codec.describe(), "bytes (256)");
    assert_eq!(codec.decode_bytes(&bytes), text.as_bytes());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn token_shards_train_and_a_bad_shard_is_refused_with_its_name() {
    let dir = temp_dir("tokens-shards");
    let ids = tokens(3000);
    for (k, part) in ids.chunks(1000).enumerate() {
        let bytes = llmc_bytes(part, "s").unwrap();
        std::fs::write(dir.join(format!("sh_train_{k:06}.bin")), &bytes).unwrap();
        let mut bad = bytes.clone();
        if k == 1 {
            bad[4] = 3; // version 3
        }
        std::fs::write(dir.join(format!("bad_train_{k:06}.bin")), bad).unwrap();
    }
    std::fs::write(dir.join("val.bin"), llmc_bytes(&ids[..500], "val").unwrap()).unwrap();
    let exp = experiment(&dir, "sh_train_*.bin", "val.bin");
    let (_, losses) = train(&exp, &dir.join("run"), &[]);
    assert_eq!(losses.len(), 8);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    for (train, expect) in [
        ("bad_train_*.bin", "bad_train_000001.bin: an llm.c token file (magic 20240520) must have version 1, but it has version 3"),
        ("none_*.bin", "matches none_*.bin"),
    ] {
        let exp = experiment(&dir, train, "val.bin");
        let (code, _, err) = run(&["train", &exp, "--steps", "1"]);
        assert_eq!(code, Some(1), "{train}: {err}");
        assert!(err.contains(expect), "{train}: {err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A tiny Hugging Face tokenizer: a word-level vocabulary, split at whitespace.
const WORDS: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false,
    "rstrip": false, "normalized": false, "special": true}],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "unk_token": "[UNK]",
    "vocab": {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5, ".": 6}}
}"#;

#[test]
fn tokenize_with_gpt2_and_a_hugging_face_tokenizer_records_it() {
    let dir = temp_dir("tokenize-bpe");
    let a = dir.join("a.txt");
    std::fs::write(&a, "Hello world").unwrap();
    let (a, p) = (a.to_str().unwrap(), dir.join("g"));
    let line = "tokenize {} --tokenizer gpt2 --validation 0 --out";
    let out = ok(&argv(line, &[a, p.to_str().unwrap()]));
    assert!(
        out.contains("2 tokens, tokenizer gpt2 BPE (50257)"),
        "{out}"
    );
    let f = TokenFile::open(&dir.join("g.bin"), TokenDtype::U16).unwrap();
    assert_eq!((f.get(0), f.get(1), f.len), (15496, 995, 2));
    let gpt2 = Codec::open(&dir.join("g_tokenizer.json")).unwrap();
    assert_eq!(
        (gpt2.describe(), gpt2.end_of_text()),
        ("gpt2 BPE (50257)".into(), Some(50256))
    );
    assert_eq!(gpt2.decode(&[15496, 995]), "Hello world");

    let words = dir.join("words.json");
    std::fs::write(&words, WORDS).unwrap();
    std::fs::write(dir.join("a.txt"), "the cat sat on the mat.\nthe dog sat.").unwrap();
    let p = dir.join("w");
    let w = words.to_str().unwrap();
    let line = "tokenize {} --tokenizer hf --tokenizer-file {} --validation 0 --out";
    ok(&argv(line, &[a, w, p.to_str().unwrap()]));
    let f = TokenFile::open(&dir.join("w.bin"), TokenDtype::U16).unwrap();
    let ids: Vec<u32> = (0..f.len).map(|i| f.get(i)).collect();
    assert_eq!(ids, [1, 2, 3, 4, 1, 5, 6, 1, 0, 3, 6]);
    let hf = Codec::open(&dir.join("w_tokenizer.json")).unwrap();
    assert_eq!(hf.describe(), "huggingface (7)");
    assert_eq!(hf.encode("the mat sat.").unwrap(), [1, 5, 3, 6]);
    assert_eq!(hf.decode(&[1, 2, 3, 9]), "the cat sat<?9>");
    // A tokenizer file is needed for `hf`, and only for it.
    let (code, _, err) = run(&argv(
        "tokenize {} --tokenizer hf --out",
        &[a, p.to_str().unwrap()],
    ));
    assert!(
        code == Some(1) && err.contains("needs `--tokenizer-file"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The committed Tiny Shakespeare token files are what `tokenize` writes.
#[test]
fn tokenize_writes_the_committed_shakespeare_files() {
    let dir = temp("tokenize-shakespeare");
    let prefix = dir.join("shakespeare");
    let p = prefix.to_str().unwrap();
    let input = "data/tinyshakespeare/input.txt";
    let out = ok(&["tokenize", input, "--tokenizer", "chars", "--out", p]);
    assert!(
        out.contains("1115394 tokens, tokenizer chars (65)"),
        "{out}"
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tinyshakespeare");
    for f in ["_train.bin", "_val.bin", "_tokenizer.json"] {
        let name = format!("shakespeare{f}");
        let made = std::fs::read(dir.join(&name)).unwrap();
        let kept = std::fs::read(root.join(&name)).unwrap();
        assert!(made == kept, "{name} differs from the committed file");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_shakespeare_model_trains() {
    let dir = temp("shakespeare");
    let d = dir.to_str().unwrap();
    let line =
        "train models/shakespeare.ron --steps 5 --run-dir {} --set optimizer.schedule=Constant";
    ok(&argv(line, &[d]));
    let losses = metric(&dir, "loss");
    assert_eq!(losses.len(), 5);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[4] < losses[0], "{losses:?}");
    assert!(metric(&dir, "val_loss")[0].is_finite());
    let _ = std::fs::remove_dir_all(dir);
}
