//! Token shards: a `Tokens` path whose file name holds `*` or `?` (`data/fw_train_*.bin`, as
//! llm.c globs its shards) names every file of its folder that matches, in name order; a plain
//! path names one file. The shards read as one list of windows: shard `k` of `n_k` tokens has
//! `n_k - seq` window starts, and global window `g` is start `g - (starts before k)` of the
//! shard whose starts hold `g`, so a window never straddles two shards, and one file reads
//! exactly as before.

use super::tokens::TokenFile;
use super::DataError;
use parallax_compiler::dsl::ast::TokenDtype;
use std::path::{Path, PathBuf};

/// Whether `name` matches `pattern` (`*`: any run of characters, `?`: one character).
fn matches(pattern: &[char], name: &[char]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some(('*', rest)) => (0..=name.len()).any(|k| matches(rest, &name[k..])),
        Some((&p, rest)) => match name.split_first() {
            Some((&c, tail)) => (p == '?' || p == c) && matches(rest, tail),
            None => false,
        },
    }
}

/// The files `path` names: itself, or the sorted matches of a pattern in its file name.
pub fn expand(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if !name.contains(['*', '?']) {
        return Ok(vec![path.to_path_buf()]);
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    let io = |source| DataError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let pattern: Vec<char> = name.chars().collect();
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let file = entry.file_name();
        let Some(file) = file.to_str() else { continue };
        let is_file = entry.file_type().map_err(io)?.is_file() || entry.path().is_file();
        if is_file && matches(&pattern, &file.chars().collect::<Vec<_>>()) {
            found.push(entry.path());
        }
    }
    if found.is_empty() {
        return Err(DataError::format(
            path.display(),
            format!("no file in {} matches {name}", dir.display()),
        ));
    }
    found.sort();
    Ok(found)
}

/// Token files read as one list of windows of `seq + 1` tokens (see the module's rules).
pub struct Shards {
    pub files: Vec<TokenFile>,
    /// `starts[k]`: window starts in shards before `k` (`files.len() + 1` entries).
    starts: Vec<usize>,
    pub seq: usize,
}

impl Shards {
    /// Opens every file `path` names; each must hold at least one window of `seq` tokens and
    /// the next one.
    pub fn open(path: &Path, dtype: TokenDtype, seq: usize) -> Result<Shards, DataError> {
        let files = expand(path)?
            .iter()
            .map(|p| TokenFile::open(p, dtype))
            .collect::<Result<Vec<_>, _>>()?;
        let mut starts = vec![0];
        for f in &files {
            if f.len <= seq {
                return Err(DataError::format(&f.path, format!(
                    "the model reads windows of {seq} tokens (and the next one), but the file holds {} tokens",
                    f.len
                )));
            }
            starts.push(starts.last().unwrap_or(&0) + f.len - seq);
        }
        Ok(Shards { files, starts, seq })
    }

    /// Window starts in all shards.
    pub fn windows(&self) -> usize {
        *self.starts.last().unwrap_or(&0)
    }

    /// Tokens in all shards.
    pub fn tokens(&self) -> usize {
        self.files.iter().map(|f| f.len).sum()
    }

    /// Global window `g` (below [`Shards::windows`]): its shard and its start there.
    pub fn locate(&self, g: usize) -> (usize, usize) {
        let k = self.starts.partition_point(|&s| s <= g) - 1;
        (k, g - self.starts[k])
    }

    /// Window `g`'s inputs and targets, appended to `x` and `y`.
    pub fn window(&self, g: usize, x: &mut Vec<i32>, y: &mut Vec<i32>) {
        let (k, at) = self.locate(g);
        self.files[k].extend(at, self.seq, x);
        self.files[k].extend(at + 1, self.seq, y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_names() {
        let m = |p: &str, n: &str| {
            matches(
                &p.chars().collect::<Vec<_>>(),
                &n.chars().collect::<Vec<_>>(),
            )
        };
        assert!(m("fw_train_*.bin", "fw_train_000001.bin"));
        assert!(m("fw_train_*.bin", "fw_train_.bin"));
        assert!(!m("fw_train_*.bin", "fw_val_000000.bin"));
        assert!(!m("fw_train_*.bin", "fw_train_1.bin.tmp"));
        assert!(m("s?.bin", "s1.bin") && !m("s?.bin", "s12.bin"));
    }
}
