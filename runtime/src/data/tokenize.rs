//! Text to token files (`parallax tokenize`): a byte tokenizer (vocabulary 256, any file) or a
//! character tokenizer (the sorted set of the text's characters, nanoGPT's `meta.pkl`, saved as
//! JSON beside the tokens). Token files are written in llm.c's format (`data::tokens`):
//! `uint16` ids when every id fits, else `uint32`.

use super::tokens::{HEADER, MAGIC_U16, MAGIC_U32};
use super::DataError;
use std::io::Write;
use std::path::Path;

/// How text becomes ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tokenizer {
    /// Each byte is its id (vocabulary 256).
    Bytes,
    /// Each character's rank among the text's distinct characters (code point order).
    Chars,
}

/// A tokenized text: its ids, and for characters the vocabulary (id `i` is `vocab[i]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Tokenized {
    pub tokens: Vec<u32>,
    pub vocab: Option<Vec<char>>,
}

impl Tokenized {
    /// The vocabulary's size.
    pub fn vocab_size(&self) -> usize {
        self.vocab.as_ref().map_or(256, Vec::len)
    }
}

/// Tokenizes `text` (`file` names it in messages: characters need UTF-8).
pub fn tokenize(text: &[u8], tokenizer: Tokenizer, file: &str) -> Result<Tokenized, DataError> {
    match tokenizer {
        Tokenizer::Bytes => Ok(Tokenized {
            tokens: text.iter().map(|&b| b as u32).collect(),
            vocab: None,
        }),
        Tokenizer::Chars => {
            let s = std::str::from_utf8(text).map_err(|e| {
                DataError::format(file, format!(
                    "the character tokenizer reads UTF-8, but byte {} is not valid UTF-8 (use `--tokenizer bytes` for other text)",
                    e.valid_up_to()
                ))
            })?;
            let mut vocab: Vec<char> = s.chars().collect();
            vocab.sort_unstable();
            vocab.dedup();
            let tokens = s
                .chars()
                .map(|c| vocab.binary_search(&c).unwrap() as u32)
                .collect();
            Ok(Tokenized {
                tokens,
                vocab: Some(vocab),
            })
        }
    }
}

/// Ids back to text (the round trip of [`tokenize`]).
pub fn detokenize(tokens: &[u32], vocab: Option<&[char]>) -> Vec<u8> {
    match vocab {
        None => tokens.iter().map(|&t| t as u8).collect(),
        Some(v) => tokens
            .iter()
            .map(|&t| v[t as usize])
            .collect::<String>()
            .into_bytes(),
    }
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

/// The character vocabulary as JSON: `{"vocab_size": n, "itos": ["\n", " ", ...]}` (id `i` is
/// `itos[i]`), as nanoGPT's `meta.pkl` holds it.
pub fn vocab_json(vocab: &[char]) -> String {
    let itos: Vec<String> = vocab.iter().map(|c| c.to_string()).collect();
    serde_json::to_string_pretty(&serde_json::json!({
        "tokenizer": "chars",
        "vocab_size": vocab.len(),
        "itos": itos,
    }))
    .expect("strings serialize")
}

/// Reads a vocabulary that [`vocab_json`] wrote.
pub fn read_vocab(json: &str, file: &str) -> Result<Vec<char>, DataError> {
    let bad = |m: &str| DataError::format(file, m.to_string());
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| bad(&format!("not JSON: {e}")))?;
    v["itos"]
        .as_array()
        .ok_or_else(|| bad("no `itos` list"))?
        .iter()
        .map(|s| {
            let mut cs = s.as_str().unwrap_or("").chars();
            match (cs.next(), cs.next()) {
                (Some(c), None) => Ok(c),
                _ => Err(bad("every `itos` entry must be one character")),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn characters_round_trip_in_code_point_order() {
        let t = tokenize("hello, wörld\n".as_bytes(), Tokenizer::Chars, "t").unwrap();
        let vocab = t.vocab.clone().unwrap();
        assert_eq!(vocab.iter().collect::<String>(), "\n ,dehlorwö");
        assert_eq!(&t.tokens[..3], &[5, 4, 6]);
        let back = detokenize(&t.tokens, Some(&vocab));
        assert_eq!(back, "hello, wörld\n".as_bytes());
        assert_eq!(read_vocab(&vocab_json(&vocab), "v").unwrap(), vocab);
        assert!(tokenize(&[0xff], Tokenizer::Chars, "t").is_err());
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
