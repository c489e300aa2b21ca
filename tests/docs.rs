//! The documentation stays true: every experiment of `docs/examples/` checks, compiles for
//! the devices it is about and trains a few steps through the built binary, `from-pytorch.md`
//! names each of them, and every relative link of the README, CONTRIBUTING.md and `docs/`
//! points at a file that exists.

mod common;
use common::{binary, run_limited, temp};

use std::path::{Path, PathBuf};
use std::time::Duration;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// `docs/examples/*.ron`, as paths relative to the repository root, sorted.
fn examples() -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(Path::new(ROOT).join("docs/examples"))
        .expect("docs/examples exists")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".ron"))
        .map(|name| format!("docs/examples/{name}"))
        .collect();
    found.sort();
    assert!(!found.is_empty(), "no experiment in docs/examples/");
    found
}

/// Runs the binary from the repository root with a hard time limit; panics with its output
/// unless it exits 0.
fn succeeds(args: &[&str]) {
    let mut c = binary();
    c.args(args);
    let r = run_limited(c, Duration::from_secs(60));
    assert_eq!(
        r.code,
        Some(0),
        "parallax {}\nstdout:\n{}\nstderr:\n{}",
        args.join(" "),
        r.stdout,
        r.stderr
    );
}

/// Whether an example is about several devices (its file asks for more than one).
fn several_devices(file: &str) -> bool {
    let text = std::fs::read_to_string(Path::new(ROOT).join(file)).unwrap();
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .filter_map(|l| l.split_once("gpus:"))
        .any(|(_, after)| {
            let digits: String = after
                .trim_start()
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse::<u32>().is_ok_and(|n| n > 1)
        })
}

#[test]
fn every_example_checks() {
    for file in examples() {
        succeeds(&["check", &file]);
    }
}

#[test]
fn the_examples_about_several_devices_compile_for_two() {
    let several: Vec<String> = examples()
        .into_iter()
        .filter(|f| several_devices(f))
        .collect();
    assert!(several.len() >= 3, "{several:?}");
    for file in &several {
        succeeds(&["compile", file, "--gpus", "2"]);
    }
    // The splits `from-pytorch.md` shows for a model too big for one GPU.
    for strategy in ["pp2", "tp2"] {
        succeeds(&[
            "compile",
            "docs/examples/model-parallel.ron",
            "--gpus",
            "2",
            "--strategy",
            strategy,
        ]);
    }
}

#[test]
fn every_example_trains_a_few_steps() {
    for file in examples() {
        let name = Path::new(&file).file_stem().unwrap().to_string_lossy();
        let run = temp(&format!("docs-{name}"));
        succeeds(&[
            "train",
            &file,
            "--steps",
            "2",
            "--backend",
            "cpu",
            "--run-dir",
            run.to_str().unwrap(),
        ]);
        assert!(run.join("final.safetensors").is_file(), "{file}");
        let _ = std::fs::remove_dir_all(run);
    }
}

#[test]
fn from_pytorch_names_every_example() {
    let text = std::fs::read_to_string(Path::new(ROOT).join("docs/from-pytorch.md")).unwrap();
    for file in examples() {
        let link = file.trim_start_matches("docs/");
        assert!(
            text.contains(&format!("]({link})")),
            "docs/from-pytorch.md does not link {link}"
        );
    }
}

/// The Markdown files whose links are checked: the README, CONTRIBUTING.md and `docs/*.md`.
fn markdown_files() -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    let mut files = vec![root.join("README.md"), root.join("CONTRIBUTING.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    files
}

/// The targets of the inline links `[text](target)` of `text`, outside fenced code blocks.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            targets.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    targets
}

#[test]
fn every_relative_link_points_at_a_file() {
    let mut checked = 0;
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let dir = file.parent().unwrap();
        for target in link_targets(&text) {
            let path = target.split('#').next().unwrap();
            if path.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue; // an anchor in the same file, or a page elsewhere
            }
            checked += 1;
            if !dir.join(path).exists() {
                broken.push(format!("{}: {target}", file.display()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to nothing:\n{}",
        broken.join("\n")
    );
    assert!(checked >= 20, "only {checked} relative links found");
}

#[test]
fn the_link_reader_finds_links_outside_code() {
    let text = "see [a](docs/a.md#x) and [b](b.md)\n```\n[c](not-a-link.md)\n```\n[d](#here)";
    assert_eq!(
        link_targets(text),
        ["docs/a.md#x", "b.md", "#here"].map(String::from)
    );
}
