//! `parallax tokenize`: text files to llm.c token files (the library part is
//! `parallax_runtime::data::tokenize`).

use crate::Exit;
use parallax_runtime::data::tokenize::{self as tk, Tokenizer, TokenizerKind};
use std::path::PathBuf;
use std::time::Instant;

arg_enum!(Kind => TokenizerKind {
    /// Each byte is a token (vocabulary 256).
    Bytes,
    /// Each distinct character is a token (nanoGPT's character-level vocabulary).
    Chars,
    /// GPT-2's BPE (vocabulary 50,257; built in, works offline).
    Gpt2,
    /// A Hugging Face tokenizer.json, given with --tokenizer-file.
    Hf
});

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

pub(crate) fn run(args: Args) -> Result<(), Exit> {
    let started = Instant::now();
    let tokenizer = Tokenizer::named(args.tokenizer.value(), args.tokenizer_file.as_deref())
        .map_err(crate::error)?;
    let w = tk::tokenize_files(&args.inputs, &tokenizer, args.validation, &args.out)
        .map_err(crate::error)?;
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let mb = w.text_bytes as f64 / 1e6;
    outln!(
        "{} tokens, tokenizer {}, from {mb:.1} MB of text in {secs:.2} s, {:.1} MB/s",
        w.tokens,
        w.codec,
        mb / secs
    )?;
    for f in w.files {
        outln!("wrote {f}")?;
    }
    Ok(())
}
