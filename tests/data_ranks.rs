//! The data people bring, on any number of processes: a token-file run gives the same
//! `final.safetensors` bytes on 1, 2 and 3 simulated devices and on 2 and 3 `mpirun` ranks,
//! and across a `kill -9` and `--resume`; an image-folder run the same bytes on 1 device, on
//! 2 and 3 `mpirun` ranks and across a `kill -9` of one rank and a resume on 3. Each process reads (decodes) only its own micro-shards' samples
//! (`data_samples_read`). Every run has a hard limit, so a hang fails the test, not CI.
#![cfg(feature = "mpi")]

mod common;
use common::{metric, mpirun, run_args, run_ok, temp, write_experiment, TINY_CAUSAL};

use parallax_runtime::data::tokenize::llmc_bytes;
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(180);

fn ok(args: &[&str]) {
    run_ok(args, LIMIT);
}

/// A tiny causal model on the token files `train.bin` and `val.bin` in `dir`, batches of 6
/// cut into 6 micro-shards (so 1, 2 and 3 devices all take whole shards).
fn experiment(dir: &Path) -> String {
    let text = format!(
        r#"Experiment(
    name: "tokens-ranks",
{TINY_CAUSAL}
    data: Tokens(train: "{d}/train.bin", validation: "{d}/val.bin", validation_windows: 9),
    optimizer: Adam(lr: 1e-2),
    train: (batch_size: 6, steps: 10, seed: 11),
    devices: (micro_shards: 6),
)"#,
        d = dir.display()
    );
    write_experiment(&dir.join("tokens.ron"), &text)
}

fn bytes(run: &Path) -> Vec<u8> {
    std::fs::read(run.join("final.safetensors")).unwrap()
}

/// The samples of the trained batches the process that wrote the run read (rank 0's).
fn samples_read(run: &Path) -> u64 {
    let text = std::fs::read_to_string(run.join("summary.json")).unwrap();
    let s: serde_json::Value = serde_json::from_str(&text).unwrap();
    s["data_samples_read"].as_u64().unwrap()
}

#[test]
fn a_token_run_has_the_same_bytes_on_any_device_count_process_count_and_across_a_kill() {
    let dir = temp("data-ranks-tokens");
    std::fs::create_dir_all(&dir).unwrap();
    let ids: Vec<u32> = (0..4000u32).map(|i| (i * 7 + i / 5) % 32).collect();
    std::fs::write(dir.join("train.bin"), llmc_bytes(&ids, "train").unwrap()).unwrap();
    std::fs::write(dir.join("val.bin"), llmc_bytes(&ids[..600], "val").unwrap()).unwrap();
    let exp = experiment(&dir);
    let run = |name: &str| dir.join(name).display().to_string();

    ok(&["train", &exp, "--gpus", "1", "--run-dir", &run("g1")]);
    let want = bytes(&dir.join("g1"));
    // The 9 validation windows, each counted once: the same loss everywhere.
    let val = metric(&dir.join("g1"), "val_loss");
    assert_eq!(val.len(), 1);
    // One process reads every window of the 10 batches of 6, whatever its device count.
    assert_eq!(samples_read(&dir.join("g1")), 60);
    for g in ["2", "3"] {
        let r = run(&format!("g{g}"));
        ok(&["train", &exp, "--gpus", g, "--run-dir", &r]);
        assert!(bytes(Path::new(&r)) == want, "--gpus {g}: other bytes");
        assert_eq!(metric(Path::new(&r), "val_loss"), val, "--gpus {g}");
        assert_eq!(samples_read(Path::new(&r)), 60, "--gpus {g}");
    }
    for n in [2, 3] {
        let r = run(&format!("mpi{n}"));
        let out = mpirun(n, &["train", &exp, "--run-dir", &r], LIMIT);
        assert_eq!(out.code, Some(0), "mpirun -np {n}: {}", out.stderr);
        assert!(bytes(Path::new(&r)) == want, "mpirun -np {n}: other bytes");
        assert_eq!(metric(Path::new(&r), "val_loss"), val, "mpirun -np {n}");
        // Rank 0 reads its 6 / n shards' windows of each batch, not the whole batch.
        assert_eq!(samples_read(Path::new(&r)), 60 / n as u64, "mpirun -np {n}");
    }
    // Killed (SIGKILL, no chance to save) after step 7 of 10, its last checkpoint at step 6;
    // resumed on another device count: the bytes of the uninterrupted run.
    let cut = run("cut");
    let (code, _, err) = run_args(
        &[
            "train",
            &exp,
            "--gpus",
            "2",
            "--run-dir",
            &cut,
            "--checkpoint-every",
            "3",
            "--crash-after",
            "0:7",
        ],
        LIMIT,
    );
    assert_ne!(code, Some(0), "the crash did not happen: {err}");
    assert!(!Path::new(&cut).join("final.safetensors").exists());
    ok(&["train", "--resume", &cut, "--gpus", "3"]);
    assert!(
        bytes(Path::new(&cut)) == want,
        "killed and resumed: other bytes"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes `per_class` 10x12 grey PNGs in each of 3 class folders under `root`.
fn write_pngs(root: &Path, per_class: u32) {
    for c in 0..3u32 {
        let dir = root.join(c.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        for k in 0..per_class {
            let px: Vec<u8> = (0..120u32)
                .map(|i| ((c * 70 + i * (k + 1) + i / 12 * 5) % 256) as u8)
                .collect();
            let path = dir.join(format!("{k:03}.png"));
            image::save_buffer(path, &px, 12, 10, image::ExtendedColorType::L8).unwrap();
        }
    }
}

#[test]
fn an_image_folder_run_has_the_same_bytes_on_one_device_on_mpirun_ranks_and_across_a_kill() {
    let dir = temp("data-ranks-images");
    write_pngs(&dir.join("pngs"), 8);
    let text = r#"Experiment(
    name: "images-ranks",
    model: Sequential(
        input: (shape: [1, 8, 8]),
        layers: [Conv2d(out: 4, kernel: 3, padding: 1), Relu, Flatten, Linear(out: 3)],
    ),
    loss: CrossEntropy,
    data: ImageFolder(train: "pngs", validation_split: 0.25, augment: true, resize: 8),
    optimizer: Adam(lr: 1e-2),
    train: (batch_size: 6, steps: 6, seed: 4),
    devices: (micro_shards: 6),
)"#;
    let exp = dir.join("images.ron");
    std::fs::write(&exp, text).unwrap();
    let exp = exp.display().to_string();
    let run = |name: &str| dir.join(name).display().to_string();
    ok(&["train", &exp, "--gpus", "1", "--run-dir", &run("g1")]);
    let want = bytes(&dir.join("g1"));
    assert_eq!(samples_read(&dir.join("g1")), 36);
    for n in [2, 3] {
        let r = run(&format!("mpi{n}"));
        let out = mpirun(n, &["train", &exp, "--run-dir", &r], LIMIT);
        assert_eq!(out.code, Some(0), "mpirun -np {n}: {}", out.stderr);
        assert!(bytes(Path::new(&r)) == want, "mpirun -np {n}: other bytes");
        // Rank 0 decoded only its micro-shards' images: a sixth of the batch per shard.
        assert_eq!(samples_read(Path::new(&r)), 36 / n as u64, "mpirun -np {n}");
    }
    // Rank 1 of 2 killed (SIGKILL) after step 5, its last checkpoint at step 4; resumed on 3
    // processes: the crops continue from the same keys, each rank decoding its own shards.
    let cut = run("cut");
    let args = [
        "train",
        &exp,
        "--run-dir",
        &cut,
        "--checkpoint-every",
        "2",
        "--collective-timeout",
        "20",
        "--crash-after",
        "1:5",
    ];
    let out = mpirun(2, &args, LIMIT);
    assert_ne!(
        out.code,
        Some(0),
        "the crash did not happen: {}",
        out.stderr
    );
    assert!(!Path::new(&cut).join("final.safetensors").exists());
    let out = mpirun(3, &["train", "--resume", &cut], LIMIT);
    assert_eq!(out.code, Some(0), "resume: {}", out.stderr);
    assert!(
        bytes(Path::new(&cut)) == want,
        "killed and resumed: other bytes"
    );
    // The continuation trained steps 5 and 6: rank 0 read 2 of each batch of 6.
    assert_eq!(samples_read(Path::new(&cut)), 4);
    let _ = std::fs::remove_dir_all(&dir);
}
