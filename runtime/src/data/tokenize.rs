//! Text to token files (`parallax tokenize`): bytes (vocabulary 256, any file), characters
//! (the sorted set of the text's characters, nanoGPT's `meta.pkl`), GPT-2's BPE or any Hugging
//! Face `tokenizer.json`; the tokenizer is recorded beside the tokens as a [`Codec`] file
//! (`data::codec`). Token files are written in llm.c's format (`data::tokens`): `uint16` ids
//! when every id fits, else `uint32`.

use super::codec::Codec;
use super::tokens::{HEADER, MAGIC_U16, MAGIC_U32};
use super::DataError;
use std::io::Write;
use std::path::Path;

/// How text becomes ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Tokenizer {
    /// Each byte is its id (vocabulary 256).
    Bytes,
    /// Each character's rank among the text's distinct characters (code point order).
    Chars,
    /// GPT-2's BPE (vocabulary 50,257).
    Gpt2,
    /// A Hugging Face `tokenizer.json`: its text, and its file's name for messages.
    HuggingFace { json: String, file: String },
}

/// A tokenizer's name, as `parallax tokenize --tokenizer` gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    Bytes,
    Chars,
    Gpt2,
    Hf,
}

impl Tokenizer {
    /// The tokenizer `kind` names; `hf` reads its `tokenizer.json` from `file`, which the
    /// built-in ones refuse.
    pub fn named(kind: TokenizerKind, file: Option<&Path>) -> Result<Tokenizer, DataError> {
        let usage = |m: &str| Err(DataError::Config(m.into()));
        Ok(match (kind, file) {
            (TokenizerKind::Hf, Some(f)) => Tokenizer::HuggingFace {
                json: std::fs::read_to_string(f).map_err(|source| DataError::Io {
                    path: f.into(),
                    source,
                })?,
                file: f.display().to_string(),
            },
            (TokenizerKind::Hf, None) => {
                return usage("`--tokenizer hf` needs `--tokenizer-file tokenizer.json`")
            }
            (_, Some(_)) => {
                return usage(
                    "`--tokenizer-file` is for `--tokenizer hf` (the others are built in)",
                )
            }
            (TokenizerKind::Bytes, None) => Tokenizer::Bytes,
            (TokenizerKind::Chars, None) => Tokenizer::Chars,
            (TokenizerKind::Gpt2, None) => Tokenizer::Gpt2,
        })
    }
}

/// A tokenized text: its ids, and the tokenizer that decodes them.
#[derive(Debug)]
pub struct Tokenized {
    pub tokens: Vec<u32>,
    pub codec: Codec,
}

/// Tokenizes `text` (`file` names it in messages: all but bytes need UTF-8).
pub fn tokenize(text: &[u8], tokenizer: &Tokenizer, file: &str) -> Result<Tokenized, DataError> {
    if *tokenizer == Tokenizer::Bytes {
        return Ok(Tokenized {
            tokens: text.iter().map(|&b| b as u32).collect(),
            codec: Codec::bytes(),
        });
    }
    let s = std::str::from_utf8(text).map_err(|e| {
        DataError::format(file, format!(
            "this tokenizer reads UTF-8, but byte {} is not valid UTF-8 (use `--tokenizer bytes` for other text)",
            e.valid_up_to()
        ))
    })?;
    let codec = match tokenizer {
        Tokenizer::Bytes | Tokenizer::Chars => Codec::chars_of(s),
        Tokenizer::Gpt2 => Codec::gpt2(),
        Tokenizer::HuggingFace { json, file } => Codec::huggingface(json, file)?,
    };
    let tokens = codec
        .encode(s)
        .map_err(|e| DataError::format(file, e.to_string()))?;
    Ok(Tokenized { tokens, codec })
}

/// Splits `n` tokens into a train part (the first `floor(n * (1 - validation))`, as
/// nanoGPT's `prepare.py`) and a validation part (the rest).
pub fn split_at(n: usize, validation: f64) -> Result<usize, DataError> {
    if !(0.0..1.0).contains(&validation) {
        return Err(DataError::Config(format!(
            "the validation fraction must be in [0, 1), got {validation}"
        )));
    }
    Ok((n as f64 * (1.0 - validation)) as usize)
}

/// The bytes of an llm.c token file holding `tokens`.
pub fn llmc_bytes(tokens: &[u32], file: &str) -> Result<Vec<u8>, DataError> {
    let count = i32::try_from(tokens.len()).map_err(|_| {
        DataError::format(
            file,
            format!(
                "{} tokens do not fit an llm.c file (at most 2^31 - 1): split the text",
                tokens.len()
            ),
        )
    })?;
    let wide = tokens.iter().any(|&t| t > u16::MAX as u32);
    let ((magic, version), width) = if wide { (MAGIC_U32, 4) } else { (MAGIC_U16, 2) };
    let mut out = Vec::with_capacity(HEADER + tokens.len() * width);
    for w in [magic, version, count] {
        out.extend_from_slice(&w.to_le_bytes());
    }
    out.resize(HEADER, 0);
    for &t in tokens {
        match wide {
            true => out.extend_from_slice(&t.to_le_bytes()),
            false => out.extend_from_slice(&(t as u16).to_le_bytes()),
        }
    }
    Ok(out)
}

/// Writes `tokens` as an llm.c token file.
pub fn write_llmc(path: &Path, tokens: &[u32]) -> Result<(), DataError> {
    let bytes = llmc_bytes(tokens, &path.display().to_string())?;
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::create(path).map_err(io)?;
    f.write_all(&bytes).map_err(io)
}

/// What `tokenize_files` wrote.
pub struct Written {
    pub tokens: usize,
    pub text_bytes: usize,
    pub codec: String,
    /// Each file and what it holds.
    pub files: Vec<String>,
}

/// Tokenizes the text files `inputs` (concatenated in order) and writes `PREFIX_train.bin`
/// and `PREFIX_val.bin` (the last `validation` share), or `PREFIX.bin` when that share holds
/// no token, and the tokenizer that decodes them, `PREFIX_tokenizer.json`.
pub fn tokenize_files(
    inputs: &[std::path::PathBuf],
    tokenizer: &Tokenizer,
    validation: f64,
    prefix: &Path,
) -> Result<Written, DataError> {
    let mut text = Vec::new();
    for path in inputs {
        let bytes = std::fs::read(path).map_err(|source| DataError::Io {
            path: path.clone(),
            source,
        })?;
        text.extend_from_slice(&bytes);
    }
    let names: Vec<String> = inputs.iter().map(|p| p.display().to_string()).collect();
    let t = tokenize(&text, tokenizer, &names.join(" + "))?;
    let n = t.tokens.len();
    let cut = split_at(n, validation)?;
    let at = |suffix: &str| {
        let mut s = prefix.as_os_str().to_os_string();
        s.push(suffix);
        std::path::PathBuf::from(s)
    };
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |e| DataError::Config(format!("cannot write {path}: {e}"))
    };
    if let Some(parent) = prefix.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io(parent))?;
    }
    let parts: Vec<(&str, &[u32])> = match cut < n {
        true => vec![
            ("_train.bin", &t.tokens[..cut]),
            ("_val.bin", &t.tokens[cut..]),
        ],
        false => vec![(".bin", &t.tokens[..])],
    };
    let mut files = Vec::new();
    for (suffix, tokens) in parts {
        let path = at(suffix);
        write_llmc(&path, tokens)?;
        files.push(format!("{} ({} tokens)", path.display(), tokens.len()));
    }
    // The tokenizer beside the tokens: what decodes them (`parallax sample`).
    let path = at("_tokenizer.json");
    std::fs::write(&path, t.codec.to_json()).map_err(io(&path))?;
    files.push(format!("{} (tokenizer)", path.display()));
    Ok(Written {
        tokens: n,
        text_bytes: text.len(),
        codec: t.codec.describe(),
        files,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn characters_round_trip_in_code_point_order() {
        let t = tokenize("hello, wörld\n".as_bytes(), &Tokenizer::Chars, "t").unwrap();
        assert_eq!(
            t.codec.decode(&(0..11).collect::<Vec<u32>>()),
            "\n ,dehlorwö"
        );
        assert_eq!(&t.tokens[..3], &[5, 4, 6]);
        assert_eq!(t.codec.decode_bytes(&t.tokens), "hello, wörld\n".as_bytes());
        let e = tokenize(&[0xff], &Tokenizer::Gpt2, "t")
            .unwrap_err()
            .to_string();
        assert!(e.contains("byte 0 is not valid UTF-8"), "{e}");
        let b = tokenize(&[0xff, 1], &Tokenizer::Bytes, "t").unwrap();
        assert_eq!((b.tokens, b.codec.vocab_size()), (vec![255, 1], 256));
    }

    #[test]
    fn the_split_is_nanogpts() {
        assert_eq!(split_at(1_115_394, 0.1).unwrap(), 1_003_854);
        assert_eq!(split_at(10, 0.0).unwrap(), 10);
        assert!(split_at(10, 1.0).is_err());
    }

    #[test]
    fn wide_ids_get_the_uint32_header() {
        let b = llmc_bytes(&[1, 70_000], "f").unwrap();
        assert_eq!(b.len(), HEADER + 8);
        assert_eq!(&b[..4], &20240801i32.to_le_bytes());
        assert_eq!(llmc_bytes(&[1, 2], "f").unwrap().len(), HEADER + 4);
    }
}
