//! Every file Parallax reads or writes holds PyTorch's shapes, whatever the plan uses inside:
//! a Conv2d bias and BatchNorm2d's weight and bias are `[C]` in `--init` files,
//! `final.safetensors` and checkpoints (optimizer state included), `[C, 1, 1]` in the plan.
//! Files written with the plan's shapes (before this was so) are read as well.
//!
//! The CNN is the `cnn` reference fixture (`tests/reference/cnn`, written by PyTorch): two
//! Conv2d layers with biases, a BatchNorm2d with and one without affine parameters.

mod common;
use common::{parallax, stderr, temp, temp_dir};

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

const EXP: &str = "tests/reference/cnn/experiment.ron";
const INIT: &str = "tests/reference/cnn/init.safetensors";

/// The tensors PyTorch's `state_dict` of the fixture holds as `[C]` that the plan holds as
/// `[C, 1, 1]`.
const CHANNEL_VECTORS: &[&str] = &["0.bias", "1.weight", "1.bias", "3.bias"];

fn shapes(path: &Path) -> BTreeMap<String, Vec<usize>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec()))
        .collect()
}

/// Rewrites a safetensors file with `reshape(name, shape)` applied to every tensor (same
/// bytes, same metadata), and with the tensors `drop` names left out.
fn rewrite(
    from: &Path,
    to: &Path,
    reshape: impl Fn(&str, &[usize]) -> Vec<usize>,
    drop: impl Fn(&str) -> bool,
) {
    let bytes = std::fs::read(from).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| !drop(n))
        .map(|(n, v)| {
            let shape = reshape(&n, v.shape());
            let view = TensorView::new(v.dtype(), shape, v.data()).unwrap();
            (n, view)
        })
        .collect();
    let meta: Option<HashMap<String, String>> = header.metadata().clone();
    std::fs::write(to, safetensors::serialize(views, meta).unwrap()).unwrap();
}

fn train(args: &[&str]) -> std::process::Output {
    let o = parallax(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    o
}

/// Trains `EXP` from PyTorch's `INIT` for 2 steps into `dir`, checkpointing every `every`.
fn two_steps_from_init(every: &str, dir: &str) {
    train(&[
        "train",
        EXP,
        "--init",
        INIT,
        "--steps",
        "2",
        "--checkpoint-every",
        every,
        "--run-dir",
        dir,
    ]);
}

#[test]
fn a_pytorch_state_dict_goes_in_and_comes_out_with_its_names_and_shapes() {
    // PyTorch's own file: `[C]` biases and BatchNorm weights, `num_batches_tracked` (int64).
    let init = shapes(Path::new(INIT));
    for n in CHANNEL_VECTORS {
        assert_eq!(init[*n], [8], "{n}");
    }
    assert!(init.contains_key("1.num_batches_tracked"));
    let dir = temp("layouts-roundtrip");
    let d = dir.to_str().unwrap();
    two_steps_from_init("1", d);
    // final.safetensors: PyTorch's state_dict, but for the counter Parallax does not keep.
    let mut want = init.clone();
    want.retain(|n, _| !n.ends_with(".num_batches_tracked"));
    assert_eq!(shapes(&dir.join("final.safetensors")), want);
    // A checkpoint: the parameters and the optimizer state in PyTorch's shapes too.
    let ck = shapes(&dir.join("checkpoints/step-00000002.safetensors"));
    for n in CHANNEL_VECTORS {
        assert_eq!(ck[&format!("param/{n}")], [8], "{n}");
        assert_eq!(ck[&format!("state/{n}.momentum")], [8], "{n}");
    }
    assert_eq!(ck["state/1.running_mean"], [8]);
    assert_eq!(ck["param/0.weight"], [8, 2, 3, 3]);
    // What came out goes back in.
    let again = temp("layouts-again");
    let f = dir.join("final.safetensors");
    train(&[
        "train",
        EXP,
        "--init",
        f.to_str().unwrap(),
        "--steps",
        "1",
        "--run-dir",
        again.to_str().unwrap(),
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&again);
}

/// `[C]` -> `[C, 1, 1]` for the channel vectors (what files held before).
fn plan_shape(name: &str, shape: &[usize]) -> Vec<usize> {
    let bare = name
        .strip_prefix("param/")
        .or_else(|| name.strip_prefix("state/"))
        .unwrap_or(name);
    let bare = bare.strip_suffix(".momentum").unwrap_or(bare);
    if CHANNEL_VECTORS.contains(&bare) {
        vec![shape[0], 1, 1]
    } else {
        shape.to_vec()
    }
}

#[test]
fn files_with_the_plans_shapes_are_still_read() {
    let base = temp_dir("layouts-old");
    // --init: the same values as `[C, 1, 1]` give the same run, to the byte.
    let old_init = base.join("old-init.safetensors");
    rewrite(Path::new(INIT), &old_init, plan_shape, |_| false);
    let (a, b) = (base.join("a"), base.join("b"));
    train(&[
        "train",
        EXP,
        "--init",
        INIT,
        "--run-dir",
        a.to_str().unwrap(),
    ]);
    train(&[
        "train",
        EXP,
        "--init",
        old_init.to_str().unwrap(),
        "--run-dir",
        b.to_str().unwrap(),
    ]);
    let whole = std::fs::read(a.join("final.safetensors")).unwrap();
    assert!(whole == std::fs::read(b.join("final.safetensors")).unwrap());

    // A checkpoint with `[C, 1, 1]` tensors (its checksum covers names and bytes, not shapes)
    // resumes to the same bytes as the uninterrupted run; so does one with `[C]`.
    for (i, old) in [false, true].into_iter().enumerate() {
        let dir = base.join(format!("resumed{i}"));
        let d = dir.to_str().unwrap();
        two_steps_from_init("2", d);
        let ck = dir.join("checkpoints/step-00000002.safetensors");
        if old {
            rewrite(&ck.clone(), &ck, plan_shape, |_| false);
            assert_eq!(shapes(&ck)["param/1.weight"], [8, 1, 1]);
        }
        // `--resume` reads the run's copy of the experiment, whose data paths are relative:
        // they resolve against the run directory, so the data goes there too.
        for f in ["x.npy", "y.npy"] {
            let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/cnn");
            std::fs::copy(data.join(f), dir.join(f)).unwrap();
        }
        train(&["train", "--resume", d, "--steps", "5"]);
        let got = std::fs::read(dir.join("final.safetensors")).unwrap();
        assert!(got == whole, "case {i}: resuming changed the weights");
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_tensor_of_another_shape_is_refused_with_pytorchs_shape() {
    let base = temp_dir("layouts-bad");
    // Training from `init` fails with exit code 1; its stderr.
    let refused = |init: &Path, run: &str| {
        let o = parallax(&[
            "train",
            EXP,
            "--init",
            init.to_str().unwrap(),
            "--run-dir",
            base.join(run).to_str().unwrap(),
        ]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        err
    };
    let bad = base.join("bad.safetensors");
    rewrite(
        Path::new(INIT),
        &bad,
        |n, s| {
            if n == "1.bias" {
                vec![2, 4]
            } else {
                s.to_vec()
            }
        },
        |_| false,
    );
    let err = refused(&bad, "run");
    assert!(
        err.contains("`1.bias`") && err.contains("has shape [2, 4], the model expects [8]"),
        "{err}"
    );
    // A missing running statistic is named too.
    let missing = base.join("missing.safetensors");
    rewrite(
        Path::new(INIT),
        &missing,
        |_, s| s.to_vec(),
        |n| n == "4.running_var",
    );
    let err = refused(&missing, "run2");
    assert!(
        err.contains("`4.running_var`: missing from the file"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&base);
}
