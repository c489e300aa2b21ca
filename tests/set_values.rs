//! `--set PATH=VALUE`: a value that does not fit its field is refused in terms of the
//! override (its path, its value, what the field takes), never as an error in the RON text
//! the overrides are spliced into; and no value, however odd, panics.

mod common;
use common::{cli, cli_exits, cli_ok, exits_1, metric, parallax, run_for, stderr, stdout, temp};

use std::time::Duration;

#[test]
fn a_fraction_for_a_whole_number_says_so() {
    let run = temp("set-fraction");
    let err = cli_exits(
        1,
        "train models/mlp.ron --set train.batch_size=3.5 --run-dir",
        &[run.to_str().unwrap()],
    );
    assert!(
        err.contains(
            "--set train.batch_size=3.5: `3.5` is not a whole number; batch_size takes an integer like 64"
        ) && !err.contains("expected comma"),
        "{err}"
    );
    assert!(!run.exists());

    // Other kinds of field say what they take.
    for (set, says) in [
        ("optimizer.lr=fast", "`fast` is not a number like 0.005"),
        ("train.drop_last=1", "`1` is not `true` or `false`"),
        (
            "train.steps=2.5",
            "`2.5` is not a whole number; steps takes an integer",
        ),
        (
            "train.seed=-1",
            "`-1` is out of range for seed, which takes a whole number like 42",
        ),
        (
            "params.hidden=wide",
            "`wide` is not a whole number or a size expression in quotes",
        ),
        (
            "train.batch_size=64, steps: 3",
            "`64, steps: 3` is not one value",
        ),
    ] {
        let o = parallax(&["check", "models/mlp.ron", "--set", set]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{set}: {err}");
        assert!(
            err.contains(&format!("--set {set}: {says}")),
            "{set}: {err}"
        );
        assert!(!err.contains("expected"), "{set}: {err}");
    }
}

#[test]
fn a_parameter_of_the_params_map_is_set() {
    // 64 inputs, `hidden` units, 10 classes: 64h + h + 10h + 10 parameters.
    let o = parallax(&["check", "models/mlp.ron", "--set", "params.hidden=64"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("4,810 parameters"), "{}", stdout(&o));
    let o = parallax(&["check", "models/mlp.ron"]);
    assert!(stdout(&o).contains("9,610 parameters"), "{}", stdout(&o));
}

#[test]
fn setting_steps_replaces_the_files_epochs_as_the_flag_does() {
    let (a, b) = (temp("set-steps"), temp("flag-steps"));
    for (dir, how) in [(&a, "--set train.steps=3"), (&b, "--steps 3")] {
        cli_ok(
            &format!("train models/mlp.ron {how} --run-dir"),
            &[dir.to_str().unwrap()],
        );
    }
    let losses = metric(&a, "loss");
    assert_eq!(losses.len(), 3);
    assert_eq!(losses, metric(&b, "loss"));
    for d in [a, b] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn an_error_the_override_causes_elsewhere_points_into_the_file() {
    // 64 wide does not split into 3 heads: the error is at the attention layer of the
    // user's file (not a line of the written-out text) and says which override was applied.
    let err = exits_1("check models/transformer.ron --set params.heads=3");
    assert!(
        err.contains("models/transformer.ron:13:35: error:")
            && err.contains("does not split into 3 heads")
            && err.contains(r#"("att", Attention(heads: "heads", causal: true), ["n1"]),"#)
            && err.contains("with --set params.heads=3"),
        "{err}"
    );
    // Inside the override's own value, the override is named instead.
    let err = stderr(&cli("check models/mlp.ron --set model.layers.0.out=0", &[]));
    assert!(
        err.contains("--set model.layers.0.out=0: ") && err.contains("sizes must be positive"),
        "{err}"
    );
}

/// Fields of models/mlp.ron and values at the edges of every type: `check` (every field)
/// and `compile` (those the partition reads) exit 0, 1 or 2, never panic, abort or hang;
/// `check` names the override whenever it fails. (`compile`'s own refusals, such as a GPU
/// count no split can use, speak of what was asked, not of the flag that asked it.)
#[test]
fn no_set_value_panics_and_every_refusal_names_the_path() {
    let fields = [
        "name",
        "params.hidden",
        "model.input.shape.0",
        "model.layers.0.out",
        "model.layers.0.bias",
        "model.layers.2.0",
        "model.layers.1",
        "loss.label_smoothing",
        "data.validation",
        "optimizer.lr",
        "optimizer.betas.0",
        "optimizer.clip_norm",
        "optimizer.schedule",
        "optimizer.schedule.warmup",
        "train.batch_size",
        "train.steps",
        "train.epochs",
        "train.seed",
        "train.shuffle",
        "devices.gpus",
        "devices.kind",
        "devices.nodes",
        "devices.micro_shards",
        "devices.gradient_bucket_mb",
    ];
    let partition = [
        "train.batch_size",
        "params.hidden",
        "devices.gpus",
        "devices.nodes",
    ];
    let nested = format!("{}{}", "[".repeat(300), "]".repeat(300));
    let deeper = format!("{}{}", "(".repeat(600), ")".repeat(600));
    let digits = "9".repeat(100_000);
    let letters = "a".repeat(100_000);
    let values = [
        "0",
        "1",
        "-1",
        "-0.0",
        "3.5",
        "1e308",
        "-1e308",
        "1e400",
        "inf",
        "-inf",
        "NaN",
        "4294967296",
        "9223372036854775807",
        "9223372036854775808",
        "18446744073709551615",
        "18446744073709551616",
        "0x10",
        "1_000",
        "true",
        "None",
        "Some(",
        "Some(1)",
        "()",
        "(",
        ")",
        "[",
        "{",
        "\"",
        "\"\"",
        "'",
        "\"open",
        "a b",
        "a,b",
        "x: 1",
        "1, steps: 3",
        "/* 1",
        "// 1",
        "Relu",
        "Linear(out: 0)",
        "é",
        "日本語",
        "🦀",
        "tab\there",
        "line\nbreak",
        " ",
        "",
        &nested,
        &deeper,
        &digits,
        &letters,
    ];
    let limit = Duration::from_secs(20);
    let try_field = |field: &str| {
        for value in values {
            let set = format!("{field}={value}");
            let short: String = set.chars().take(60).collect();
            let mut commands = vec!["check"];
            if partition.contains(&field) {
                commands.push("compile");
            }
            for command in commands {
                let (code, err) = run_for(&[command, "models/mlp.ron", "--set", &set], limit);
                assert!(
                    matches!(code, Some(0..=2)) && !err.contains("panicked"),
                    "{command} --set {short}: exit {code:?}\n{err}"
                );
                if code != Some(0) {
                    assert!(err.contains("error"), "{command} --set {short}: {err}");
                }
                if code != Some(0) && command == "check" {
                    assert!(err.contains(field), "{command} --set {short}: {err}");
                }
            }
        }
    };
    // Two at a time: each run is a few milliseconds, mostly starting the process.
    std::thread::scope(|s| {
        let (a, b) = fields.split_at(fields.len() / 2);
        let other = s.spawn(|| a.iter().for_each(|f| try_field(f)));
        b.iter().for_each(|f| try_field(f));
        other.join().unwrap();
    });
}
