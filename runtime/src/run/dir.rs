//! The run directory as one process's own: refused when it is a file, a folder of other files
//! or (unless resumed) another run; held with an advisory lock for as long as the run lasts,
//! so a second `train` in the same folder is refused with the holder's pid; and cleared of the
//! temporary files a crashed or full-disk write left behind.

// The record every run writes first (`run.json`) is what makes a folder a Parallax run.
use crate::run::record::FILE as RECORD;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

const LOCK: &str = ".lock";

#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error("--run-dir {path}: is a file, not a folder; choose a new or empty folder")]
    NotAFolder { path: String },
    #[error("--run-dir {path}: is a link to {target}, which does not exist; choose a new or empty folder, or create the one it names")]
    DanglingLink { path: String, target: String },
    #[error("--run-dir {path}: holds files that are not a Parallax run (`{example}`), which a run would overwrite; choose a new or empty folder")]
    Foreign { path: String, example: String },
    #[error(
        "{path} already holds a run; choose another --run-dir, or continue it with --resume {path}"
    )]
    HoldsARun { path: String },
    #[error("{path} is not a Parallax run (it has no {RECORD} with a run_id); --resume continues a folder that `parallax train` wrote")]
    NotARun { path: String },
    #[error("{path} is in use by another `parallax train` ({holder}); wait for it to finish or choose another --run-dir")]
    Locked { path: String, holder: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> RunDirError + '_ {
    move |source| RunDirError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A run directory this process holds: the lock lasts as long as the value.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    lock: File,
    /// This process made the folder (removed again if the run never starts).
    created: bool,
}

/// Whether `dir` holds a run's record (a `run.json` with a `run_id`).
fn is_run(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join(RECORD))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| v["run_id"].is_string())
}

impl RunDir {
    /// Takes `path` for a new run (`resume` false) or for continuing the run in it: checks
    /// what the folder holds, creates it when new, locks it, and removes stale temporaries.
    pub fn open(path: &Path, resume: bool) -> Result<RunDir, RunDirError> {
        let shown = || path.display().to_string();
        if path.exists() && !path.is_dir() {
            return Err(RunDirError::NotAFolder { path: shown() });
        }
        // A link to nowhere: `exists` says no, and creating the folder fails with EEXIST.
        if let (false, Ok(target)) = (path.exists(), std::fs::read_link(path)) {
            return Err(RunDirError::DanglingLink {
                path: shown(),
                target: target.display().to_string(),
            });
        }
        if resume && !is_run(path) {
            return Err(RunDirError::NotARun { path: shown() });
        }
        let created = !path.exists();
        std::fs::create_dir_all(path).map_err(io(path))?;
        let lock_path = path.join(LOCK);
        let mut lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = lock.read_to_string(&mut pid);
                let holder = match pid.trim() {
                    "" => "a process that has not yet written its pid".to_string(),
                    p => format!("pid {p}"),
                };
                return Err(RunDirError::Locked {
                    path: shown(),
                    holder,
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(&lock_path)(e)),
        }
        // Checked under the lock: no other run can be writing the folder now.
        if !resume {
            if is_run(path) {
                return Err(RunDirError::HoldsARun { path: shown() });
            }
            if let Some(example) = foreign_entry(path).map_err(io(path))? {
                return Err(RunDirError::Foreign {
                    path: shown(),
                    example,
                });
            }
        }
        lock.set_len(0).map_err(io(&lock_path))?;
        lock.rewind().map_err(io(&lock_path))?;
        writeln!(lock, "{}", std::process::id()).map_err(io(&lock_path))?;
        remove_temporaries(path).map_err(io(path))?;
        Ok(RunDir {
            path: path.to_path_buf(),
            lock,
            created,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Lets go of a run that never started: a folder this process made and wrote nothing
    /// else into is removed, so a failed start leaves no empty run behind.
    pub fn abandon(self) {
        let only_the_lock = std::fs::read_dir(&self.path)
            .map(|entries| entries.flatten().all(|e| e.file_name() == LOCK))
            .unwrap_or(false);
        if self.created && only_the_lock {
            drop(self.lock);
            let _ = std::fs::remove_file(self.path.join(LOCK));
            let _ = std::fs::remove_dir(&self.path);
        }
    }
}

/// The first entry of a folder without a run that a new run would not have made itself.
fn foreign_entry(dir: &Path) -> std::io::Result<Option<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    names.sort();
    // The lock is this process's own; a temporary is a crashed run's, removed next.
    Ok(names.into_iter().find(|n| n != LOCK && !is_temporary(n)))
}

/// `crate::run::atomic::write_atomic`'s temporaries: `.{name}.tmp`.
fn is_temporary(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp")
}

/// Removes the temporaries an interrupted write left in the run folder and its checkpoints
/// (under the lock, so none is another process's write in progress).
fn remove_temporaries(dir: &Path) -> std::io::Result<()> {
    for folder in [dir.to_path_buf(), dir.join("checkpoints")] {
        let Ok(entries) = std::fs::read_dir(&folder) else {
            continue;
        };
        for e in entries {
            let e = e?;
            if is_temporary(&e.file_name().to_string_lossy()) {
                std::fs::remove_file(e.path())?;
            }
        }
    }
    Ok(())
}

/// `YYYYMMDD-HHMMSS` in UTC, from the system clock (names the run directory only).
fn timestamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// `runs/<name>-<timestamp>` (a suffix `-2`, `-3`, ... when taken), for a run given no
/// `--run-dir`.
pub fn default_path(name: &str) -> PathBuf {
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let base = PathBuf::from("runs").join(format!("{safe}-{}", timestamp()));
    let mut dir = base.clone();
    let mut k = 2;
    while dir.exists() {
        dir = PathBuf::from(format!("{}-{k}", base.display()));
        k += 1;
    }
    dir
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("parallax-rundir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid() {
        let d = temp("lock");
        let first = RunDir::open(&d, false).unwrap();
        let err = RunDir::open(&d, false).unwrap_err().to_string();
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(first);
        RunDir::open(&d, false).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
        // A run that never started leaves nothing behind.
        RunDir::open(&d, false).unwrap().abandon();
        assert!(!d.exists());
    }

    #[test]
    fn files_runs_and_foreign_folders_are_refused() {
        let d = temp("kinds");
        std::fs::create_dir_all(&d).unwrap();
        let file = d.join("a-file");
        std::fs::write(&file, "x").unwrap();
        let err = RunDir::open(&file, false).unwrap_err().to_string();
        assert!(err.contains("is a file, not a folder"), "{err}");
        let err = RunDir::open(&d, false).unwrap_err().to_string();
        assert!(err.contains("not a Parallax run (`a-file`)"), "{err}");
        let err = RunDir::open(&d, true).unwrap_err().to_string();
        assert!(err.contains("has no run.json"), "{err}");
        let dangling = d.join("dangling");
        std::os::unix::fs::symlink(d.join("nowhere"), &dangling).unwrap();
        let err = RunDir::open(&dangling, false).unwrap_err().to_string();
        assert!(err.contains("is a link to"), "{err}");
        std::fs::remove_file(&dangling).unwrap();
        std::fs::remove_file(&file).unwrap();
        std::fs::write(d.join(RECORD), r#"{"run_id": "abc"}"#).unwrap();
        let err = RunDir::open(&d, false).unwrap_err().to_string();
        assert!(err.contains("already holds a run"), "{err}");
        // A user's own run.json is not a run: refused as foreign, not overwritten.
        std::fs::write(d.join(RECORD), "{}").unwrap();
        let err = RunDir::open(&d, false).unwrap_err().to_string();
        assert!(err.contains("(`run.json`)"), "{err}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn stale_temporaries_are_removed() {
        let d = temp("tmp");
        std::fs::create_dir_all(d.join("checkpoints")).unwrap();
        std::fs::write(d.join(RECORD), r#"{"run_id": "abc"}"#).unwrap();
        std::fs::write(d.join(".metrics.jsonl.tmp"), "x").unwrap();
        std::fs::write(d.join("checkpoints/.step-00000010.safetensors.tmp"), "x").unwrap();
        let _held = RunDir::open(&d, true).unwrap();
        assert!(!d.join(".metrics.jsonl.tmp").exists());
        assert!(!d
            .join("checkpoints/.step-00000010.safetensors.tmp")
            .exists());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
