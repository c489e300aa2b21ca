//! `parallax tokenize`: text files to llm.c token files (the library part is
//! `parallax_runtime::data::tokenize`).

use crate::Exit;
use parallax_runtime::data::tokenize::{self as tk, Tokenizer};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Kind {
    /// Each byte is a token (vocabulary 256).
    Bytes,
    /// Each distinct character is a token (nanoGPT's character-level vocabulary).
    Chars,
    /// GPT-2's BPE (vocabulary 50,257; built in, works offline).
    Gpt2,
    /// A Hugging Face tokenizer.json, given with --tokenizer-file.
    Hf,
}

#[derive(clap::Args)]
pub(crate) struct Args {
    /// Text files, concatenated in this order.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Output prefix: writes PREFIX_train.bin and PREFIX_val.bin (PREFIX.bin with no
    /// validation part) and the tokenizer as PREFIX_tokenizer.json.
    #[arg(long, short)]
    out: PathBuf,
    #[arg(long, value_enum, default_value = "bytes")]
    tokenizer: Kind,
    /// The tokenizer.json of `--tokenizer hf`.
    #[arg(long, value_name = "TOKENIZER_JSON")]
    tokenizer_file: Option<PathBuf>,
    /// The fraction of tokens, from the end, written as the validation file.
    #[arg(long, default_value_t = 0.1)]
    validation: f64,
}

fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

fn fail(e: impl std::fmt::Display) -> Exit {
    errln!("error: {e}");
    Exit(1)
}

pub(crate) fn run(args: Args) -> Result<(), Exit> {
    let started = Instant::now();
    let mut text = Vec::new();
    for p in &args.inputs {
        let bytes =
            std::fs::read(p).map_err(|e| fail(format!("cannot read {}: {e}", p.display())))?;
        text.extend_from_slice(&bytes);
    }
    let names: Vec<String> = args
        .inputs
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let tokenizer = match (args.tokenizer, &args.tokenizer_file) {
        (Kind::Hf, Some(f)) => Tokenizer::HuggingFace {
            json: std::fs::read_to_string(f)
                .map_err(|e| fail(format!("cannot read {}: {e}", f.display())))?,
            file: f.display().to_string(),
        },
        (Kind::Hf, None) => {
            return Err(fail(
                "`--tokenizer hf` needs `--tokenizer-file tokenizer.json`",
            ))
        }
        (_, Some(_)) => {
            return Err(fail(
                "`--tokenizer-file` is for `--tokenizer hf` (the others are built in)",
            ))
        }
        (Kind::Bytes, None) => Tokenizer::Bytes,
        (Kind::Chars, None) => Tokenizer::Chars,
        (Kind::Gpt2, None) => Tokenizer::Gpt2,
    };
    let t = tk::tokenize(&text, &tokenizer, &names.join(" + ")).map_err(fail)?;
    let n = t.tokens.len();
    let cut = tk::split_at(n, args.validation).map_err(fail)?;
    if let Some(parent) = args.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| fail(format!("cannot create {}: {e}", parent.display())))?;
    }
    let mut written = Vec::new();
    let parts: Vec<(&str, &[u32])> = if cut < n {
        vec![
            ("_train.bin", &t.tokens[..cut]),
            ("_val.bin", &t.tokens[cut..]),
        ]
    } else {
        vec![(".bin", &t.tokens[..])]
    };
    for (suffix, tokens) in parts {
        let path = with_suffix(&args.out, suffix);
        tk::write_llmc(&path, tokens).map_err(fail)?;
        written.push(format!("{} ({} tokens)", path.display(), tokens.len()));
    }
    // The tokenizer beside the tokens: what decodes them (`parallax sample`).
    let path = with_suffix(&args.out, "_tokenizer.json");
    std::fs::write(&path, t.codec.to_json())
        .map_err(|e| fail(format!("cannot write {}: {e}", path.display())))?;
    written.push(format!("{} (tokenizer)", path.display()));
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    outln!(
        "{n} tokens, tokenizer {}, from {:.1} MB of text in {secs:.2} s, {:.1} MB/s",
        t.codec.describe(),
        text.len() as f64 / 1e6,
        text.len() as f64 / 1e6 / secs
    )?;
    for w in written {
        outln!("wrote {w}")?;
    }
    Ok(())
}
