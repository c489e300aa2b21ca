//! Token files: a stream of token ids, memory-mapped (never read whole), served as windows of
//! `seq + 1` tokens: the model reads the first `seq`, and learns to predict each next token
//! (the targets are the same window shifted by one).
//!
//! Formats, told apart by the header:
//!
//! - llm.c (karpathy/llm.c `dev/data/data_common.py`): 256 little-endian `int32` (1,024 bytes),
//!   magic 20240520 and version 1 for `uint16` ids, or magic 20240801 and version 7 for
//!   `uint32`; header word 2 is the token count, and the file must be exactly
//!   `1024 + count * width` bytes long;
//! - raw (nanoGPT's `train.bin`): little-endian ids of the experiment's `dtype` (`U16` by
//!   default, or `U32`), no header.
//!
//! The stated rules (a batch is a pure function of them, so the order is the same on any
//! device count and a resumed run continues it exactly):
//!
//! - `seq` is the model's token input length; a file of `n` tokens has `n - seq` windows,
//!   starting at `0..n - seq`. Shards (a pattern, `data::shards`) have the sum `W` of theirs,
//!   numbered shard after shard (one file: `W = n - seq`); no window straddles two shards.
//! - Sample `i` of the global batch of step `s` reads window `below(stream(seed, Windows, s),
//!   i, W)` (uniform, with replacement, as nanoGPT draws); with `train.shuffle: false` window
//!   `((s * batch + i) * seq) mod W` (consecutive windows, wrapping).
//! - An "epoch" is `max(1, floor((N - 1) / seq / batch))` steps, `N` the tokens of all
//!   shards: as many tokens as the files hold. It sets when validation runs, and what
//!   `epochs` counts.
//! - Validation: window `k` of a validation file starts at `k * seq`, for `k < (n - 1) / seq`,
//!   shard after shard, up to `validation_windows` windows: every target token up to the cap
//!   counted once.
//! - Every id must be below the model's vocabulary (its embedding's rows and its classes):
//!   every file is checked before training, and hashed for the run's identity.

use super::loader::{read_mask, Batch, Wanted};
use super::shards::{expand, Shards};
use super::{DataError, Dataset, ModelIo, TensorSpec, Values};
use crate::rng::{below, stream, Purpose};
use parallax_compiler::dsl::ast::{Data, TokenDtype};
use parallax_compiler::ir::DType;
use sha2::Digest;
use std::path::Path;

/// llm.c's header: 256 `int32`.
pub const HEADER: usize = 1024;
/// llm.c's magic and version for `uint16` ids (GPT-2).
pub const MAGIC_U16: (i32, i32) = (20240520, 1);
/// llm.c's magic and version for `uint32` ids (LLaMA 3).
pub const MAGIC_U32: (i32, i32) = (20240801, 7);

/// A memory-mapped token file.
pub struct TokenFile {
    pub path: String,
    map: Option<memmap2::Mmap>,
    /// Byte offset of the first id.
    start: usize,
    /// Bytes per id: 2 or 4.
    pub width: usize,
    /// Ids in the file.
    pub len: usize,
    /// `llm.c` or `raw`.
    pub format: &'static str,
}

fn word(b: &[u8], i: usize) -> i32 {
    i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap())
}

impl TokenFile {
    /// Maps `path`: an llm.c file if its header says so (and then its size must agree), else
    /// raw ids of `dtype`.
    pub fn open(path: &Path, dtype: TokenDtype) -> Result<TokenFile, DataError> {
        let name = path.display().to_string();
        let io = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len() as usize;
        // SAFETY: the map is read only and lives as long as this value. Another process that
        // truncates the file while it is mapped makes a read fault (SIGBUS), as with every
        // mmap reader (numpy.memmap, llm.c); nothing here writes token files while training.
        let map = match size {
            0 => None,
            _ => Some(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?),
        };
        let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
        let magic = (bytes.len() >= 8).then(|| word(bytes, 0));
        let llmc = [MAGIC_U16, MAGIC_U32]
            .into_iter()
            .find(|m| Some(m.0) == magic);
        let (start, width, len, format) = if let Some((magic, version)) = llmc {
            let width = if magic == MAGIC_U16.0 { 2 } else { 4 };
            let found = word(bytes, 1);
            if found != version {
                return Err(DataError::format(&name, format!(
                    "an llm.c token file (magic {magic}) must have version {version}, but it has version {found}"
                )));
            }
            if size < HEADER {
                return Err(DataError::format(&name, format!(
                    "an llm.c token file starts with a {HEADER}-byte header, but the file has {size} bytes"
                )));
            }
            let count = word(bytes, 2);
            let expected = usize::try_from(count).map(|c| HEADER + c * width);
            if expected != Ok(size) {
                return Err(DataError::format(&name, format!(
                    "the llm.c header says {count} tokens of {width} bytes, so the file should be {HEADER} + {count} * {width} bytes, but it has {size}: the file is truncated or not an llm.c token file"
                )));
            }
            (HEADER, width, count as usize, "llm.c")
        } else {
            let width = match dtype {
                TokenDtype::U16 => 2,
                TokenDtype::U32 => 4,
            };
            if !size.is_multiple_of(width) {
                return Err(DataError::format(&name, format!(
                    "a raw token file of {dtype:?} ids has a multiple of {width} bytes, but it has {size} (no llm.c header was found: its first word is {})",
                    magic.map_or("missing".to_string(), |m| m.to_string())
                )));
            }
            (0, width, size / width, "raw")
        };
        Ok(TokenFile {
            path: name,
            map,
            start,
            width,
            len,
            format,
        })
    }

    /// The ids' bytes (little-endian, `width` each).
    fn bytes(&self) -> &[u8] {
        let b = self.map.as_deref().unwrap_or(&[]);
        &b[self.start..self.start + self.len * self.width]
    }

    /// Id number `i`.
    pub fn get(&self, i: usize) -> u32 {
        let b = &self.bytes()[i * self.width..(i + 1) * self.width];
        match self.width {
            2 => u16::from_le_bytes([b[0], b[1]]) as u32,
            _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }

    /// Ids `from..from + n`, appended to `out` as model inputs.
    pub fn extend(&self, from: usize, n: usize, out: &mut Vec<i32>) {
        out.extend((from..from + n).map(|i| self.get(i) as i32));
    }

    /// Refuses the first id at or above `vocab`, naming its offset; feeds the ids' bytes to
    /// `hash`. One pass over the map, in pages.
    pub fn check_and_hash(&self, vocab: usize, hash: &mut sha2::Sha256) -> Result<(), DataError> {
        let bytes = self.bytes();
        hash.update(bytes);
        let id = |b: &[u8]| match b.len() {
            2 => u16::from_le_bytes([b[0], b[1]]) as usize,
            _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize,
        };
        let Some(i) = bytes.chunks_exact(self.width).position(|b| id(b) >= vocab) else {
            return Ok(());
        };
        Err(DataError::format(&self.path, format!(
            "token {i} (byte offset {}) is {}, but the model's vocabulary has {vocab} ids (0..{vocab}): the file was tokenized for another vocabulary",
            self.start + i * self.width,
            self.get(i)
        )))
    }
}

/// The training windows of token files, batch by batch (see the module's rules).
pub struct Windows {
    pub shards: Shards,
    pub batch: usize,
    pub seed: u64,
    pub shuffle: bool,
    /// Steps in an "epoch".
    pub per_epoch: usize,
}

impl Windows {
    /// The global window that sample `i` of the global batch of step `step` reads.
    pub fn window(&self, step: u64, i: usize) -> usize {
        let starts = self.shards.windows() as u64;
        let at = if self.shuffle {
            below(stream(self.seed, Purpose::Windows, step), i as u64, starts)
        } else {
            ((step as u128 * self.batch as u128 + i as u128) * self.shards.seq as u128
                % starts as u128) as u64
        };
        at as usize
    }

    /// Where sample `i` of the global batch of step `step` starts: its shard, and its offset
    /// there.
    pub fn offset(&self, step: u64, i: usize) -> (usize, usize) {
        self.shards.locate(self.window(step, i))
    }

    /// Batch `index` of epoch `epoch`.
    pub fn batch(&self, epoch: u64, index: usize) -> Batch {
        self.batch_of(epoch, index, None)
    }

    /// [`Windows::batch`] reading only the `wanted` windows (the loader's rule: the others
    /// stay zero, and zero is a counted label, so every shard's loss share is unchanged).
    pub fn batch_of(&self, epoch: u64, index: usize, wanted: Option<&Wanted>) -> Batch {
        let step = epoch * self.per_epoch as u64 + index as u64;
        let seq = self.shards.seq;
        let n = self.batch * seq;
        let (mut x, mut y) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mask = read_mask(wanted, self.batch);
        for (i, &read) in mask.iter().enumerate() {
            if read {
                self.shards.window(self.window(step, i), &mut x, &mut y);
            } else {
                x.resize(x.len() + seq, 0);
                y.resize(y.len() + seq, 0);
            }
        }
        Batch {
            inputs: Values::I32(x),
            targets: Values::I32(y),
            size: self.batch,
            epoch,
            index,
            read: mask.iter().filter(|&&r| r).count(),
        }
    }
}

/// A token source opened for training: its windows, its validation set, the data's hash.
pub struct Opened {
    pub windows: Windows,
    pub validation: Dataset,
    pub hash: String,
}

/// The model's sequence length and vocabulary, if it reads token windows.
fn contract(io: &ModelIo, what: &str) -> Result<(usize, usize), DataError> {
    let seq = match (&io.input.shape[..], io.integer_input(), io.class_target()) {
        ([seq], true, true) if io.target.shape == [*seq] => *seq,
        _ => {
            return Err(DataError::mismatch(what, format!(
                "token windows feed a model that reads a sequence of token ids and predicts a class (the next token) at each position, but the model reads {} and its target is {}",
                io.input.show(),
                io.target.show()
            )))
        }
    };
    let vocab = match (io.input_range, io.classes) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b).unwrap_or(usize::MAX),
    };
    Ok((seq, vocab))
}

/// Opens `Data::Tokens` for a model (`io`) trained in global batches of `batch`.
pub fn open(
    data: &Data,
    io: &ModelIo,
    seed: u64,
    base_dir: &Path,
    batch: usize,
    shuffle: bool,
) -> Result<Opened, DataError> {
    let Data::Tokens {
        train,
        validation,
        dtype,
        validation_windows,
        ..
    } = data
    else {
        return Err(DataError::Config("not a token source".into()));
    };
    let (seq, vocab) = contract(io, train)?;
    if batch == 0 {
        return Err(DataError::Config(
            "the batch size must be at least 1".into(),
        ));
    }
    let shards = Shards::open(&base_dir.join(train), *dtype, seq)?;
    let mut hash = sha2::Sha256::new();
    for f in &shards.files {
        f.check_and_hash(vocab, &mut hash)?;
    }
    let mut vx = Vec::new();
    let mut vy = Vec::new();
    let mut n_val = 0;
    if let Some(v) = validation {
        // Shards in name order, each's non-overlapping windows from its start, up to the cap.
        let cap = *validation_windows as usize;
        for path in expand(&base_dir.join(v))? {
            let vf = TokenFile::open(&path, *dtype)?;
            vf.check_and_hash(vocab, &mut hash)?;
            let here = (vf.len.saturating_sub(1) / seq).min(cap - n_val);
            if here == 0 && n_val < cap {
                return Err(DataError::format(&vf.path, format!(
                    "validation needs at least one window of {seq} tokens and the next one, but the file holds {} tokens",
                    vf.len
                )));
            }
            for k in 0..here {
                vf.extend(k * seq, seq, &mut vx);
                vf.extend(k * seq + 1, seq, &mut vy);
            }
            n_val += here;
        }
    }
    let per_epoch = ((shards.tokens() - 1) / seq / batch).max(1);
    let spec = TensorSpec::new(DType::I32, vec![seq]);
    Ok(Opened {
        windows: Windows {
            shards,
            batch,
            seed,
            shuffle,
            per_epoch,
        },
        validation: Dataset {
            inputs: Values::I32(vx),
            targets: Values::I32(vy),
            input: spec.clone(),
            target: spec,
            len: n_val,
        },
        hash: hash.finalize().iter().map(|b| format!("{b:02x}")).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::err_text;
    use crate::data::tokenize::llmc_bytes;

    fn file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("parallax-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn ids(f: &TokenFile) -> Vec<u32> {
        (0..f.len).map(|i| f.get(i)).collect()
    }

    #[test]
    fn raw_and_llmc_files_read_the_same_tokens() {
        let tokens: Vec<u32> = (0..300).map(|i| (i * 7919) % 1000).collect();
        let raw16: Vec<u8> = tokens
            .iter()
            .flat_map(|&t| (t as u16).to_le_bytes())
            .collect();
        let raw32: Vec<u8> = tokens.iter().flat_map(|&t| t.to_le_bytes()).collect();
        let wide: Vec<u32> = tokens.iter().map(|&t| t + 70_000).collect();
        let a = TokenFile::open(&file("a.bin", &raw16), TokenDtype::U16).unwrap();
        let b = TokenFile::open(&file("b.bin", &raw32), TokenDtype::U32).unwrap();
        let c = TokenFile::open(
            &file("c.bin", &llmc_bytes(&tokens, "c").unwrap()),
            TokenDtype::U32,
        )
        .unwrap();
        let d = TokenFile::open(
            &file("d.bin", &llmc_bytes(&wide, "d").unwrap()),
            TokenDtype::U16,
        )
        .unwrap();
        assert_eq!(
            (a.format, c.format, c.width, d.width),
            ("raw", "llm.c", 2, 4)
        );
        for f in [&a, &b, &c] {
            assert_eq!(ids(f), tokens);
        }
        assert_eq!(ids(&d), wide);
    }

    #[test]
    fn bad_headers_and_sizes_are_refused() {
        let good = llmc_bytes(&[1, 2, 3], "g").unwrap();
        let err = |name: &str, b: &[u8], dtype| {
            TokenFile::open(&file(name, b), dtype)
                .err()
                .unwrap()
                .to_string()
        };
        let mut version = good.clone();
        version[4] = 2;
        let e = err("v.bin", &version, TokenDtype::U16);
        assert!(
            e.contains("v.bin") && e.contains("must have version 1, but it has version 2"),
            "{e}"
        );
        let e = err("s.bin", &good[..good.len() - 2], TokenDtype::U16);
        assert!(
            e.contains("should be 1024 + 3 * 2 bytes, but it has 1028"),
            "{e}"
        );
        let e = err("o.bin", &[1, 0, 2], TokenDtype::U16);
        assert!(e.contains("a multiple of 2 bytes, but it has 3"), "{e}");
        let e = TokenFile::open(Path::new("/nonexistent/x.bin"), TokenDtype::U16);
        assert!(matches!(e, Err(DataError::Io { .. })));
    }

    #[test]
    fn windows_are_keyed_by_step_and_index() {
        let tokens: Vec<u32> = (0..1000).collect();
        let shards = Shards::open(
            &file("w.bin", &llmc_bytes(&tokens, "w").unwrap()),
            TokenDtype::U16,
            8,
        )
        .unwrap();
        let w = Windows {
            shards,
            batch: 4,
            seed: 3,
            shuffle: true,
            per_epoch: 31,
        };
        let b = w.batch(1, 2);
        let (Values::I32(x), Values::I32(y)) = (&b.inputs, &b.targets) else {
            panic!()
        };
        for i in 0..4 {
            let (shard, at) = w.offset(33, i);
            assert_eq!(shard, 0);
            let at = at as i32;
            assert!(at + 8 < 1000);
            assert_eq!(x[i * 8..i * 8 + 8], (at..at + 8).collect::<Vec<_>>()[..]);
            assert_eq!(
                y[i * 8..i * 8 + 8],
                (at + 1..at + 9).collect::<Vec<_>>()[..]
            );
        }
        assert_ne!(w.offset(33, 0), w.offset(34, 0));
    }

    #[test]
    fn shards_serve_windows_from_every_shard_and_never_across_two() {
        let dir = std::env::temp_dir().join(format!("parallax-shards-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for k in 0..3u32 {
            let ids: Vec<u32> = (0..40 + 10 * k).map(|i| k * 1000 + i).collect();
            std::fs::write(
                dir.join(format!("s_train_{k}.bin")),
                llmc_bytes(&ids, "s").unwrap(),
            )
            .unwrap();
        }
        std::fs::write(dir.join("s_val_0.bin"), llmc_bytes(&[1; 50], "v").unwrap()).unwrap();
        let shards = Shards::open(&dir.join("s_train_*.bin"), TokenDtype::U16, 8).unwrap();
        assert_eq!((shards.files.len(), shards.windows()), (3, 32 + 42 + 52));
        assert_eq!(shards.locate(31), (0, 31));
        assert_eq!(shards.locate(32), (1, 0));
        assert_eq!(shards.locate(125), (2, 51));
        let w = Windows {
            shards,
            batch: 4,
            seed: 5,
            shuffle: true,
            per_epoch: 8,
        };
        let mut seen = [false; 3];
        for index in 0..8 {
            let b = w.batch(0, index);
            let Values::I32(x) = &b.inputs else { panic!() };
            for win in x.chunks(8) {
                seen[win[0] as usize / 1000] = true;
                // Consecutive ids of one shard: the window does not straddle two.
                assert!(win.windows(2).all(|p| p[1] == p[0] + 1), "{win:?}");
            }
        }
        assert_eq!(seen, [true; 3]);
        let e = err_text(Shards::open(&dir.join("none_*.bin"), TokenDtype::U16, 8));
        assert!(
            e.contains("no file in") && e.contains("matches none_*.bin"),
            "{e}"
        );
        let e = err_text(Shards::open(
            &dir.join("s_train_*.bin"),
            TokenDtype::U16,
            45,
        ));
        assert!(
            e.contains("s_train_0.bin") && e.contains("holds 40 tokens"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
