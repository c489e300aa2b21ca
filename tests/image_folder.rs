//! Image folders (`ImageFolder`): the embedded digits written as PNG files in class folders
//! train (the loss falls), write `classes.json`, and give the same bytes on 1, 2 and 3
//! devices (every random crop and flip is keyed by seed, epoch and sample, not by device);
//! a file that is not an image stops `train` with its name.

mod common;
use common::{metric, run_args, temp, write_experiment};

use parallax_runtime::data::digits;
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(300);

fn run(args: &[&str]) -> (Option<i32>, String, String) {
    run_args(args, LIMIT)
}

/// Writes the first `per_class` digits of each class as 8x8 grey PNGs in `root/<class>/`.
fn write_digits(root: &Path, per_class: usize) {
    let (pixels, labels) = digits::decode().unwrap();
    let mut counts = [0usize; digits::CLASSES];
    for (i, &label) in labels.iter().enumerate() {
        let c = label as usize;
        if counts[c] == per_class {
            continue;
        }
        counts[c] += 1;
        let dir = root.join(c.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let px: Vec<u8> = pixels[i * 64..(i + 1) * 64]
            .iter()
            .map(|v| (v * 255.0).round() as u8)
            .collect();
        image::save_buffer(
            dir.join(format!("{i:04}.png")),
            &px,
            8,
            8,
            image::ExtendedColorType::L8,
        )
        .unwrap();
    }
}

fn experiment(dir: &Path, folder: &str, augment: bool, steps: u64) -> String {
    let text = format!(
        r#"Experiment(
    name: "images",
    model: Sequential(
        input: (shape: [1, 8, 8]),
        layers: [
            Conv2d(out: 8, kernel: 3, padding: 1),
            Relu,
            MaxPool2d(kernel: 2),
            Flatten,
            Linear(out: 10),
        ],
    ),
    loss: CrossEntropy,
    data: ImageFolder(train: "{folder}", validation_split: 0.2, augment: {augment}, resize: 8),
    optimizer: Adam(lr: 1e-2),
    train: (batch_size: 24, steps: {steps}, seed: 5),
)"#
    );
    write_experiment(&dir.join(format!("{folder}-{augment}.ron")), &text)
}

fn train(exp: &str, run_dir: &Path, gpus: &str) -> Vec<u8> {
    let (code, _, err) = run(&[
        "train",
        exp,
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--gpus",
        gpus,
    ]);
    assert_eq!(code, Some(0), "{err}");
    std::fs::read(run_dir.join("final.safetensors")).unwrap()
}

#[test]
fn digit_pngs_train_and_give_the_same_bytes_on_one_two_and_three_devices() {
    let dir = temp("image-folder");
    write_digits(&dir.join("digits"), 30);
    // Without augmentation the digits are learnt quickly: the loss falls well below chance's.
    let plain = experiment(&dir, "digits", false, 40);
    train(&plain, &dir.join("plain"), "1");
    let losses = metric(&dir.join("plain"), "loss");
    assert_eq!(losses.len(), 40);
    let (first, last) = (losses[0], losses[35..].iter().sum::<f64>() / 5.0);
    assert!(last < 0.5 * first && last < 1.0, "{losses:?}");
    let acc = metric(&dir.join("plain"), "val_accuracy");
    assert!(acc.last().is_some_and(|&a| a > 0.5), "{acc:?}");
    let classes = std::fs::read_to_string(dir.join("plain/classes.json")).unwrap();
    assert_eq!(
        classes.trim(),
        r#"["0","1","2","3","4","5","6","7","8","9"]"#
    );
    // eval gives the validation figures training gave; predict reads image files and
    // folders with the evaluation transform and names the classes.
    let run_dir = dir.join("plain").display().to_string();
    let (code, out, err) = run(&["eval", &run_dir, "--format", "json"]);
    assert_eq!(code, Some(0), "{err}");
    let e: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(e["accuracy"].as_f64(), acc.last().copied(), "{e}");
    let threes = dir.join("digits/3").display().to_string();
    let (code, out, err) = run(&[
        "predict", &run_dir, &threes, "--top-k", "2", "--format", "json",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let p: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = p.as_array().unwrap();
    assert_eq!(rows.len(), 30);
    assert!(rows[0]["input"].as_str().unwrap().ends_with(".png"), "{p}");
    let right = rows.iter().filter(|r| r["top"][0]["label"] == "3").count();
    assert!(right >= 20, "{right} of 30 threes");
    let one_file = rows[0]["input"].as_str().unwrap().to_string();
    let (code, out, err) = run(&["predict", &run_dir, &one_file]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
    // With random crops and flips: the same bytes on any device count.
    let augmented = experiment(&dir, "digits", true, 6);
    let one = train(&augmented, &dir.join("one"), "1");
    assert!(metric(&dir.join("one"), "loss")
        .iter()
        .all(|l| l.is_finite()));
    for n in ["2", "3"] {
        let other = train(&augmented, &dir.join(format!("n{n}")), n);
        assert!(other == one, "1 and {n} devices differ");
        assert_eq!(
            metric(&dir.join(format!("n{n}")), "loss"),
            metric(&dir.join("one"), "loss")
        );
    }
    // Killed (SIGKILL) after step 4, its last checkpoint at step 2, and resumed on three
    // devices: the uninterrupted run's bytes (the crops continue from the same keys).
    let cut = dir.join("cut").display().to_string();
    let (code, _, err) = run(&[
        "train",
        &augmented,
        "--run-dir",
        &cut,
        "--gpus",
        "2",
        "--checkpoint-every",
        "2",
        "--crash-after",
        "0:4",
    ]);
    assert_ne!(code, Some(0), "the crash did not happen: {err}");
    let (code, _, err) = run(&["train", "--resume", &cut, "--gpus", "3"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(std::fs::read(dir.join("cut/final.safetensors")).unwrap() == one);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_file_that_is_not_an_image_stops_train_with_its_name() {
    let dir = temp("image-folder-bad");
    write_digits(&dir.join("digits"), 3);
    std::fs::write(dir.join("digits/4/broken.png"), b"\x89PNG\r\n\x1a\nno more").unwrap();
    let exp = experiment(&dir, "digits", true, 2);
    let (code, _, err) = run(&["train", &exp, "--run-dir", dir.join("r").to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("digits/4/broken.png") && err.contains("not a readable image"),
        "{err}"
    );
    // Too few class folders for the model's 10 classes.
    std::fs::remove_dir_all(dir.join("digits/9")).unwrap();
    std::fs::remove_file(dir.join("digits/4/broken.png")).unwrap();
    let (code, _, err) = run(&["train", &exp, "--run-dir", dir.join("r2").to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("9 class folders") && err.contains("the model's output has 10 classes"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
