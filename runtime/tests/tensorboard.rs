//! Event files from `EventWriter` read back by TensorBoard's own reader (its Python
//! `EventAccumulator`, which checks every record's CRCs), so the format is checked against
//! TensorBoard rather than against our reading of it. `scripts/test.sh` installs TensorBoard
//! into `.tools/tb`.

use parallax_runtime::run::tensorboard::EventWriter;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Prints `tag step value` for every scalar TensorBoard finds in the directory `argv[1]`, after
/// the line `tags ...` listing the scalar tags. `repr` of a Python float is exact.
const READ_SCALARS: &str = r#"
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1])
ea.Reload()
tags = sorted(ea.Tags()["scalars"])
print("tags", *tags)
for tag in tags:
    for e in ea.Scalars(tag):
        print(tag, e.step, repr(e.value))
"#;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// TensorBoard's reader on `dir`: `(tag, step, value)` sorted.
fn read(dir: &Path) -> Vec<(String, u64, f32)> {
    let tb = workspace().join(".tools/tb");
    let out = Command::new("python3")
        .env("PYTHONPATH", &tb)
        .args(["-c", READ_SCALARS])
        .arg(dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut v: Vec<(String, u64, f32)> = stdout
        .lines()
        .skip(1)
        .map(|line| {
            let f: Vec<&str> = line.split(' ').collect();
            let value: f64 = f[2].parse().unwrap();
            (f[0].to_string(), f[1].parse().unwrap(), value as f32)
        })
        .collect();
    v.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    v
}

/// A resumed run writes a second file starting with a restart marker: TensorBoard keeps the
/// first file's steps before it and the second file's from it on, each step once.
#[test]
fn a_restart_marker_drops_the_interrupted_runs_later_steps() {
    let dir = std::env::temp_dir().join(format!("parallax-tb-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut first = EventWriter::create(&dir).unwrap();
    for step in 1..=10 {
        first.scalar("loss", step, step as f32).unwrap();
    }
    first.flush().unwrap();
    drop(first);
    // Resumed from a checkpoint after step 6: step 7 on again, with other values.
    let mut second = EventWriter::create(&dir).unwrap();
    second.session_start(7).unwrap();
    for step in 7..=10 {
        second.scalar("loss", step, -(step as f32)).unwrap();
    }
    second.flush().unwrap();
    let want: Vec<(String, u64, f32)> = (1..=10)
        .map(|s| {
            (
                "loss".to_string(),
                s,
                if s < 7 { s as f32 } else { -(s as f32) },
            )
        })
        .collect();
    assert_eq!(read(&dir), want);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tensorboard_reads_our_scalars() {
    let tb = workspace().join(".tools/tb");
    let import = Command::new("python3")
        .env("PYTHONPATH", &tb)
        .args([
            "-c",
            "import tensorboard.backend.event_processing.event_accumulator",
        ])
        .output()
        .expect("python3 is needed to run TensorBoard's reader");
    assert!(
        import.status.success(),
        "TensorBoard is not importable from {}: run scripts/test.sh, which installs it \
         there.\n{}",
        tb.display(),
        String::from_utf8_lossy(&import.stderr)
    );

    let dir = std::env::temp_dir().join(format!("parallax-tb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Two tags, steps out of a single sequence, a negative and fractional values, one that
    // needs all of f32's mantissa, and a large step.
    let written: Vec<(&str, u64, f32)> = vec![
        ("loss", 0, 2.5),
        ("accuracy", 0, 0.1),
        ("loss", 1, 1.25),
        ("accuracy", 1, 0.75),
        ("loss", 2, -0.375),
        ("accuracy", 2, 1.0 / 3.0),
        ("loss", 10, 1.0e-7),
        ("loss", 5_000_000_000, 0.0),
    ];
    let mut w = EventWriter::create(&dir).unwrap();
    for &(tag, step, value) in &written {
        w.scalar(tag, step, value).unwrap();
    }
    w.flush().unwrap();

    let out = Command::new("python3")
        .env("PYTHONPATH", &tb)
        .args(["-c", READ_SCALARS])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "TensorBoard's reader failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = stdout.lines();
    assert_eq!(lines.next(), Some("tags accuracy loss"), "{stdout}");
    let mut read: Vec<(String, u64, f32)> = lines
        .map(|line| {
            let f: Vec<&str> = line.split(' ').collect();
            let value: f64 = f[2].parse().unwrap();
            // TensorBoard widens the stored f32 to a double; narrowing back is exact only if it
            // stored exactly our f32.
            assert_eq!(value, value as f32 as f64, "{line}");
            (f[0].to_string(), f[1].parse().unwrap(), value as f32)
        })
        .collect();
    // TensorBoard lists by tag, then step; compare bit for bit, so -0.0 or NaN would count too.
    let mut expected: Vec<(String, u64, f32)> = written
        .iter()
        .map(|&(t, s, v)| (t.to_string(), s, v))
        .collect();
    let key = |e: &(String, u64, f32)| (e.0.clone(), e.1, e.2.to_bits());
    expected.sort_by_key(key);
    read.sort_by_key(key);
    assert_eq!(
        read.iter().map(key).collect::<Vec<_>>(),
        expected.iter().map(key).collect::<Vec<_>>()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
