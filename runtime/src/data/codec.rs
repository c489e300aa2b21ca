//! The tokenizer recorded beside token files (`PREFIX_tokenizer.json`, written by `parallax
//! tokenize`), loaded as a [`Codec`] that encodes text and decodes ids (what `parallax sample`
//! prints).
//!
//! The file is JSON with a `kind`:
//!
//! - `{"kind": "bytes", "vocab_size": 256}`: each byte is its id;
//! - `{"kind": "chars", "vocab_size": n, "itos": ["\n", " ", ...]}`: id `i` is `itos[i]`
//!   (nanoGPT's `meta.pkl`);
//! - `{"kind": "gpt2", "vocab_size": 50257, "end_of_text": 50256}`: GPT-2's BPE, whose ranks
//!   the `tiktoken-rs` crate embeds (nothing else is needed, offline);
//! - `{"kind": "huggingface", "vocab_size": n, "tokenizer": {...}}`: a Hugging Face
//!   `tokenizer.json`, embedded whole so that the file alone decodes the tokens.

use super::DataError;
use parallax_compiler::dsl::ast::Data;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// GPT-2's vocabulary: 256 bytes, 50,000 merges and `<|endoftext|>`.
pub const GPT2_VOCAB: usize = 50257;
/// GPT-2's `<|endoftext|>`.
pub const GPT2_END_OF_TEXT: u32 = 50256;
/// The special token that ends a document, in the vocabularies that have one.
const END_OF_TEXT: [&str; 3] = ["<|endoftext|>", "</s>", "<|end_of_text|>"];

enum Kind {
    Bytes,
    Chars {
        itos: Vec<char>,
        stoi: HashMap<char, u32>,
    },
    Gpt2(&'static tiktoken_rs::CoreBPE),
    HuggingFace {
        tokenizer: Box<tokenizers::Tokenizer>,
        /// The `tokenizer.json` as given, recorded unchanged.
        json: serde_json::Value,
    },
}

/// A loaded tokenizer: text to ids and back.
pub struct Codec {
    kind: Kind,
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Codec({})", self.describe())
    }
}

/// How an id outside the vocabulary is shown in decoded text: visibly, never a panic.
fn unknown(id: u32) -> String {
    format!("<?{id}>")
}

impl Codec {
    /// Each byte is its id.
    pub fn bytes() -> Codec {
        Codec { kind: Kind::Bytes }
    }

    /// Id `i` is `itos[i]`.
    pub fn chars(itos: Vec<char>) -> Codec {
        let stoi = itos
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as u32))
            .collect();
        Codec {
            kind: Kind::Chars { itos, stoi },
        }
    }

    /// The distinct characters of `text`, in code point order (nanoGPT's vocabulary).
    pub fn chars_of(text: &str) -> Codec {
        let mut itos: Vec<char> = text.chars().collect();
        itos.sort_unstable();
        itos.dedup();
        Codec::chars(itos)
    }

    /// GPT-2's BPE (`r50k_base`).
    pub fn gpt2() -> Codec {
        Codec {
            kind: Kind::Gpt2(tiktoken_rs::r50k_base_singleton()),
        }
    }

    /// A Hugging Face `tokenizer.json` (its text; `file` names it in messages).
    pub fn huggingface(json: &str, file: &str) -> Result<Codec, DataError> {
        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| DataError::format(file, format!("not JSON: {e}")))?;
        Codec::huggingface_value(value, file)
    }

    fn huggingface_value(json: serde_json::Value, file: &str) -> Result<Codec, DataError> {
        let tokenizer = json
            .to_string()
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| {
                DataError::format(file, format!("not a Hugging Face tokenizer.json: {e}"))
            })?;
        Ok(Codec {
            kind: Kind::HuggingFace {
                tokenizer: Box::new(tokenizer),
                json,
            },
        })
    }

    /// Reads a tokenizer file that [`Codec::to_json`] wrote.
    pub fn open(path: &Path) -> Result<Codec, DataError> {
        let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Codec::from_json(&text, &path.display().to_string())
    }

    /// Parses the text of a tokenizer file (`file` names it in messages).
    pub fn from_json(text: &str, file: &str) -> Result<Codec, DataError> {
        let bad = |m: String| DataError::format(file, m);
        let mut v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let kind = v["kind"].as_str().unwrap_or("").to_string();
        let codec = match kind.as_str() {
            "bytes" => Codec::bytes(),
            "gpt2" => Codec::gpt2(),
            "chars" => {
                let itos = v["itos"]
                    .as_array()
                    .ok_or_else(|| bad("a `chars` tokenizer needs an `itos` list".into()))?
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let mut cs = s.as_str().unwrap_or("").chars();
                        match (cs.next(), cs.next()) {
                            (Some(c), None) => Ok(c),
                            _ => Err(bad(format!("`itos[{i}]` must be one character, not {s}"))),
                        }
                    })
                    .collect::<Result<Vec<char>, DataError>>()?;
                Codec::chars(itos)
            }
            "huggingface" => {
                match v.get_mut("tokenizer").map(serde_json::Value::take) {
                    Some(json) if json.is_object() => Codec::huggingface_value(json, file)?,
                    _ => return Err(bad(
                        "a `huggingface` tokenizer needs a `tokenizer` object (the tokenizer.json)"
                            .into(),
                    )),
                }
            }
            other => {
                return Err(bad(format!(
                    "`kind` must be bytes, chars, gpt2 or huggingface, not {other:?}"
                )))
            }
        };
        Ok(codec)
    }

    /// The tokenizer file's text (see the module's formats).
    pub fn to_json(&self) -> String {
        use serde_json::json;
        let n = self.vocab_size();
        let v = match &self.kind {
            Kind::Bytes => json!({"kind": "bytes", "vocab_size": n}),
            Kind::Chars { itos, .. } => {
                let itos: Vec<String> = itos.iter().map(|c| c.to_string()).collect();
                json!({"kind": "chars", "vocab_size": n, "itos": itos})
            }
            Kind::Gpt2(_) => {
                json!({"kind": "gpt2", "vocab_size": n, "end_of_text": GPT2_END_OF_TEXT})
            }
            Kind::HuggingFace { json, .. } => {
                json!({"kind": "huggingface", "vocab_size": n, "tokenizer": json})
            }
        };
        serde_json::to_string_pretty(&v).expect("JSON values serialize") + "\n"
    }

    /// Ids in the vocabulary (ids are `0..vocab_size()`, a Hugging Face vocabulary's
    /// added tokens included).
    pub fn vocab_size(&self) -> usize {
        match &self.kind {
            Kind::Bytes => 256,
            Kind::Chars { itos, .. } => itos.len(),
            Kind::Gpt2(_) => GPT2_VOCAB,
            Kind::HuggingFace { tokenizer, .. } => tokenizer.get_vocab_size(true),
        }
    }

    /// The id that ends a document, if the vocabulary has one.
    pub fn end_of_text(&self) -> Option<u32> {
        match &self.kind {
            Kind::Bytes | Kind::Chars { .. } => None,
            Kind::Gpt2(_) => Some(GPT2_END_OF_TEXT),
            Kind::HuggingFace { tokenizer, .. } => {
                END_OF_TEXT.iter().find_map(|t| tokenizer.token_to_id(t))
            }
        }
    }

    /// One line for people: "chars (65)", "gpt2 BPE (50257)".
    pub fn describe(&self) -> String {
        let name = match &self.kind {
            Kind::Bytes => "bytes",
            Kind::Chars { .. } => "chars",
            Kind::Gpt2(_) => "gpt2 BPE",
            Kind::HuggingFace { .. } => "huggingface",
        };
        format!("{name} ({})", self.vocab_size())
    }

    /// Text to ids. Special tokens' text (`<|endoftext|>`) is encoded as text for GPT-2, as
    /// llm.c's and nanoGPT's data preparation do; a Hugging Face tokenizer adds no special
    /// tokens of its own (no BOS). A character the `chars` vocabulary lacks is an error that
    /// names it and its position.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match &self.kind {
            Kind::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Kind::Chars { stoi, .. } => text
                .chars()
                .enumerate()
                .map(|(i, c)| {
                    stoi.get(&c).copied().ok_or_else(|| {
                        DataError::Config(format!(
                            "character {i} of the text, {c:?} (U+{:04X}), is not in the tokenizer's vocabulary of {} characters",
                            c as u32,
                            stoi.len()
                        ))
                    })
                })
                .collect(),
            Kind::Gpt2(bpe) => Ok(bpe.encode_ordinary(text)),
            Kind::HuggingFace { tokenizer, .. } => tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| DataError::Config(format!("the tokenizer cannot encode the text: {e}"))),
        }
    }

    /// Ids to bytes: the text's UTF-8, or, for bytes and BPE, the bytes of the ids given
    /// (which may split a character). An id outside the vocabulary is shown as `<?ID>`.
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len());
        match &self.kind {
            Kind::Bytes => {
                for &t in ids {
                    match u8::try_from(t) {
                        Ok(b) => out.push(b),
                        Err(_) => out.extend_from_slice(unknown(t).as_bytes()),
                    }
                }
            }
            Kind::Chars { itos, .. } => {
                let mut s = String::with_capacity(ids.len());
                for &t in ids {
                    match itos.get(t as usize) {
                        Some(&c) => s.push(c),
                        None => s.push_str(&unknown(t)),
                    }
                }
                out = s.into_bytes();
            }
            Kind::Gpt2(bpe) => {
                // Runs of known ids decode together; each unknown id is shown between them.
                for run in ids.split_inclusive(|&t| t as usize >= GPT2_VOCAB) {
                    let (known, bad) = match run.last() {
                        Some(&t) if t as usize >= GPT2_VOCAB => (&run[..run.len() - 1], Some(t)),
                        _ => (run, None),
                    };
                    // Every id below GPT2_VOCAB is in r50k_base, so this cannot fail.
                    out.extend(bpe.decode_bytes(known).unwrap_or_default());
                    if let Some(t) = bad {
                        out.extend_from_slice(unknown(t).as_bytes());
                    }
                }
            }
            Kind::HuggingFace { tokenizer, .. } => {
                let known = |t: &u32| tokenizer.id_to_token(*t).is_some();
                for run in ids.split_inclusive(|t| !known(t)) {
                    let (good, bad) = match run.last() {
                        Some(t) if !known(t) => (&run[..run.len() - 1], Some(*t)),
                        _ => (run, None),
                    };
                    if !good.is_empty() {
                        let text = tokenizer
                            .decode(good, false)
                            .unwrap_or_else(|e| format!("<cannot decode {} ids: {e}>", good.len()));
                        out.extend_from_slice(text.as_bytes());
                    }
                    if let Some(t) = bad {
                        out.extend_from_slice(unknown(t).as_bytes());
                    }
                }
            }
        }
        out
    }

    /// Ids to text; bytes that are not UTF-8 (a character split by the ids' ends) become
    /// U+FFFD, as `String::from_utf8_lossy` does.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }
}

/// Where a token source's tokenizer is by convention: `PREFIX_tokenizer.json` beside a train
/// file `PREFIX_train.bin` or `PREFIX.bin` (a shard pattern `PREFIX_train_*.bin` too).
pub fn conventional_tokenizer(train: &Path) -> Option<PathBuf> {
    let name = train.file_name()?.to_str()?;
    let stem = name.strip_suffix(".bin")?;
    let prefix = stem
        .strip_suffix("_train")
        .or_else(|| stem.strip_suffix("_train_*"))
        .unwrap_or(stem);
    Some(train.with_file_name(format!("{prefix}_tokenizer.json")))
}

/// The tokenizer file of a `Tokens` source: its `tokenizer` field (which must exist), else
/// the convention's file if it exists; `None` for other sources, or when neither is there.
pub fn tokenizer_of(data: &Data, base_dir: &Path) -> Result<Option<PathBuf>, DataError> {
    let Data::Tokens {
        train, tokenizer, ..
    } = data
    else {
        return Ok(None);
    };
    if let Some(t) = tokenizer {
        let path = base_dir.join(t);
        return match path.is_file() {
            true => Ok(Some(path)),
            false => Err(DataError::Io {
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "the data's `tokenizer` file does not exist",
                ),
                path,
            }),
        };
    }
    Ok(conventional_tokenizer(&base_dir.join(train)).filter(|p| p.is_file()))
}

/// Text as ids arrive one at a time: a character split across tokens waits for its rest.
#[derive(Default)]
pub struct TextStream {
    pending: Vec<u32>,
}

impl TextStream {
    /// The text `id` completes, if any.
    pub fn push(&mut self, codec: &Codec, id: u32) -> Option<String> {
        self.pending.push(id);
        let text = codec.decode(&self.pending);
        if text.ends_with('\u{fffd}') {
            return None;
        }
        self.pending.clear();
        Some(text)
    }

    /// What is left at the end, decoded as it is.
    pub fn rest(&mut self, codec: &Codec) -> String {
        codec.decode(&std::mem::take(&mut self.pending))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_encodes_hello_world_and_round_trips() {
        let c = Codec::gpt2();
        assert_eq!(c.encode("Hello world").unwrap(), vec![15496, 995]);
        assert_eq!(c.decode(&[15496, 995]), "Hello world");
        assert_eq!((c.vocab_size(), c.end_of_text()), (50257, Some(50256)));
        assert_eq!(c.describe(), "gpt2 BPE (50257)");
        let text = "Wörds, ünïcode — and <|endoftext|> as text.\n";
        let ids = c.encode(text).unwrap();
        assert!(!ids.contains(&50256));
        assert_eq!(c.decode(&ids), text);
        assert_eq!(c.decode(&[15496, 60000, 995]), "Hello<?60000> world");
        let back = Codec::from_json(&c.to_json(), "t").unwrap();
        assert_eq!(back.encode("Hello world").unwrap(), vec![15496, 995]);
    }

    #[test]
    fn chars_refuse_an_unknown_character_with_its_position() {
        let c = Codec::chars_of("hello, wörld\n");
        assert_eq!(c.describe(), "chars (11)");
        assert_eq!(c.encode("hello").unwrap(), vec![5, 4, 6, 6, 7]);
        let e = c.encode("held up").unwrap_err().to_string();
        assert!(e.contains("character 5 of the text, 'u' (U+0075)"), "{e}");
        assert_eq!(c.decode(&[5, 4, 99]), "he<?99>");
        let back = Codec::from_json(&c.to_json(), "t").unwrap();
        assert_eq!(back.encode("wörld").unwrap(), c.encode("wörld").unwrap());
        assert_eq!(back.end_of_text(), None);
    }

    #[test]
    fn bytes_decode_lossily_and_show_unknown_ids() {
        let c = Codec::bytes();
        let ids = c.encode("é!").unwrap();
        assert_eq!(ids, vec![0xc3, 0xa9, 0x21]);
        assert_eq!(c.decode(&ids[1..]), "\u{fffd}!");
        assert_eq!(c.decode(&[104, 300, 105]), "h<?300>i");
        assert_eq!(
            Codec::from_json(&c.to_json(), "t").unwrap().vocab_size(),
            256
        );
    }

    #[test]
    fn bad_tokenizer_files_are_refused() {
        let e = Codec::from_json(r#"{"kind":"morse"}"#, "t.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.json") && e.contains("\"morse\""), "{e}");
        let e = Codec::from_json(r#"{"kind":"chars","itos":["ab"]}"#, "t.json").unwrap_err();
        assert!(
            e.to_string().contains("`itos[0]` must be one character"),
            "{e}"
        );
        assert!(Codec::from_json(r#"{"kind":"huggingface"}"#, "t").is_err());
        assert!(matches!(
            Codec::open(Path::new("/nonexistent/t.json")),
            Err(DataError::Io { .. })
        ));
    }

    #[test]
    fn the_tokenizer_file_is_found_by_convention() {
        let c = |s: &str| conventional_tokenizer(Path::new(s)).unwrap();
        assert_eq!(
            c("d/shakespeare_train.bin"),
            Path::new("d/shakespeare_tokenizer.json")
        );
        assert_eq!(c("d/all.bin"), Path::new("d/all_tokenizer.json"));
        assert_eq!(c("d/fw_train_*.bin"), Path::new("d/fw_tokenizer.json"));
    }

    #[test]
    fn a_token_source_finds_its_tokenizer() {
        let dir = std::env::temp_dir().join(format!("parallax-codec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tokens = |tokenizer: Option<&str>| Data::Tokens {
            train: "s_train.bin".into(),
            validation: None,
            dtype: Default::default(),
            validation_windows: 1,
            tokenizer: tokenizer.map(String::from),
        };
        assert_eq!(tokenizer_of(&tokens(None), &dir).unwrap(), None);
        std::fs::write(dir.join("s_tokenizer.json"), Codec::gpt2().to_json()).unwrap();
        let found = tokenizer_of(&tokens(None), &dir).unwrap().unwrap();
        assert_eq!(found, dir.join("s_tokenizer.json"));
        assert_eq!(Codec::open(&found).unwrap().describe(), "gpt2 BPE (50257)");
        let e = tokenizer_of(&tokens(Some("t.json")), &dir)
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.json") && e.contains("does not exist"), "{e}");
        let digits = Data::Digits { validation: 0.1 };
        assert_eq!(tokenizer_of(&digits, &dir).unwrap(), None);
        let _ = std::fs::remove_dir_all(dir);
    }
}
