//! Generated data sets. Every number is a function of `(seed, Purpose::Synthetic, n)` and an
//! index, so a data set is the same on every machine:
//!
//! - `Blobs`: the center of class `c` is `4 * normal(stream(seed, Synthetic, c), j)` in each
//!   dimension `j`; sample `i` is of class `i % classes`, at
//!   `center + std * normal(stream(seed, Synthetic, BLOB_POINTS), i * features + j)`.
//! - `Sequence`: token `t` of sample `i` is `below(stream(seed, Synthetic, i), t, vocab)`
//!   (`i32`, shape `[length]`); the target is the same sequence (`Copy`), reversed
//!   (`Reverse`) or sorted ascending (`Sort`).
//! - `Synthetic`: samples of the model's input spec: element `j` of sample `i` is
//!   `normal(stream(seed, Synthetic, i), j)` for a float input and
//!   `below(stream(seed, Synthetic, i), j, input_range)` for an integer one (which needs a known
//!   range); target element `j` is `below(.., TARGET_INDEX + j, classes)` for cross-entropy and
//!   `normal(.., TARGET_INDEX + j)` for MSE, on the same stream.

use super::{DataError, Labels, ModelIo, Raw, Values};
use crate::rng::{below, normal, stream, Purpose};
use parallax_compiler::dsl::ast::SeqTask;

/// The stream number of the blobs' points (class centers use the streams `0..classes`).
pub(crate) const BLOB_POINTS: u64 = 1 << 63;
/// Where a synthetic sample's target numbers start in its stream.
pub(crate) const TARGET_INDEX: u64 = 1 << 40;

fn count(what: &str, v: u64) -> Result<usize, DataError> {
    match usize::try_from(v) {
        Ok(0) => Err(DataError::Config(format!("{what} must be at least 1"))),
        Ok(n) => Ok(n),
        Err(_) => Err(DataError::Config(format!("{what} ({v}) is too large"))),
    }
}

/// `a * b` elements, refusing sizes that cannot be held in `arrays` arrays of them (inputs,
/// and targets as long).
fn elements(data: &str, a: usize, b: usize, arrays: u64) -> Result<usize, DataError> {
    let n = a
        .checked_mul(b)
        .filter(|&n| n <= isize::MAX as usize / 4)
        .ok_or_else(|| {
            DataError::Config(format!(
                "{data}: {a} samples of {b} values are too many to hold"
            ))
        })?;
    // Checked before generating: the values are 4 bytes each, held at most twice (as
    // generated, and the validation set gathered beside them before the split keeps the
    // training set in place).
    let needed = 8 * arrays * n as u64;
    if let Some(available) = crate::exec::host_memory::available_bytes().filter(|&m| needed > m) {
        return Err(DataError::Config(format!(
            "{data}: {a} samples of {b} values need {} of memory, but this machine has {} available; lower `samples`",
            parallax_compiler::plan::bytes(needed),
            parallax_compiler::plan::bytes(available)
        )));
    }
    Ok(n)
}

/// Seeded Gaussian blobs, one per class.
pub(crate) fn blobs(
    samples: u64,
    classes: u64,
    features: u64,
    std: f64,
    seed: u64,
) -> Result<Raw, DataError> {
    let source = format!("Blobs({features} features)");
    let n = count("Blobs `samples`", samples)?;
    let k = count("Blobs `classes`", classes)?;
    let f = count("Blobs `features`", features)?;
    if !(std.is_finite() && std >= 0.0) {
        return Err(DataError::Config(format!(
            "Blobs `std` must be zero or more, got {std}"
        )));
    }
    if k > i32::MAX as usize {
        return Err(DataError::Config(format!(
            "Blobs `classes` ({k}) is too large"
        )));
    }
    let total = elements(&source, n, f, 1)?;
    let centers: Vec<Vec<f32>> = (0..k.min(n))
        .map(|c| {
            let s = stream(seed, Purpose::Synthetic, c as u64);
            (0..f).map(|j| 4.0 * normal(s, j as u64)).collect()
        })
        .collect();
    let points = stream(seed, Purpose::Synthetic, BLOB_POINTS);
    let mut x = Vec::with_capacity(total);
    let mut y = Vec::with_capacity(n);
    for i in 0..n {
        let c = i % k;
        for (j, &m) in centers[c].iter().enumerate() {
            let z = normal(points, (i * f + j) as u64) as f64;
            x.push((m as f64 + std * z) as f32);
        }
        y.push(c as i32);
    }
    Ok(Raw {
        source,
        n,
        inputs: Values::F32(x),
        input_shape: vec![f],
        labels: Labels::Classes(y),
    })
}

/// Seeded token sequences and their transformation.
pub(crate) fn sequence(
    task: SeqTask,
    length: u64,
    vocab: u64,
    samples: u64,
    seed: u64,
    io: &ModelIo,
) -> Result<Raw, DataError> {
    let source = format!("Sequence({task:?}, length {length}, vocab {vocab})");
    let n = count("Sequence `samples`", samples)?;
    let len = count("Sequence `length`", length)?;
    let v = count("Sequence `vocab`", vocab)?;
    if v > i32::MAX as usize {
        return Err(DataError::Config(format!(
            "Sequence `vocab` ({v}) is too large"
        )));
    }
    if let Some(r) = io.input_range.filter(|&r| v > r) {
        return Err(DataError::mismatch(
            source,
            format!(
                "tokens go up to {}, but the model's embedding holds {r} ids",
                v - 1
            ),
        ));
    }
    if let Some(c) = io.classes.filter(|&c| io.class_target() && v > c) {
        return Err(DataError::mismatch(
            source,
            format!(
                "target tokens go up to {}, but the model predicts {c} classes",
                v - 1
            ),
        ));
    }
    // A model reading twice the length is a causal language model: it reads the tokens, then
    // the answer, and predicts each answer token from everything before it. Positions with
    // nothing to predict are labelled -100 (ignored by the loss).
    let prompted = io.input.numel() == 2 * len;
    let width = if prompted { 2 * len } else { len };
    let total = elements(&source, n, width, 2)?;
    let mut x = Vec::with_capacity(total);
    let mut y = Vec::with_capacity(total);
    let ignore = crate::exec::IGNORE;
    for i in 0..n {
        let s = stream(seed, Purpose::Synthetic, i as u64);
        let tokens: Vec<i32> = (0..len as u64)
            .map(|t| below(s, t, v as u64) as i32)
            .collect();
        let answer: Vec<i32> = match task {
            SeqTask::Copy => tokens.clone(),
            SeqTask::Reverse => tokens.iter().rev().copied().collect(),
            SeqTask::Sort => {
                let mut t = tokens.clone();
                t.sort_unstable();
                t
            }
        };
        x.extend_from_slice(&tokens);
        if prompted {
            x.extend_from_slice(&answer);
            y.extend(std::iter::repeat_n(ignore, len - 1));
            y.extend_from_slice(&answer);
            y.push(ignore);
        } else {
            y.extend_from_slice(&answer);
        }
    }
    Ok(Raw {
        source,
        n,
        inputs: Values::I32(x),
        input_shape: vec![width],
        labels: Labels::Classes(y),
    })
}

/// `n` samples of `per` normal values, value `j` of sample `i` being
/// `normal(stream(seed, Synthetic, i), first + j)`, generated in parallel (each value is a
/// function of its indices alone, so the threads change nothing).
fn normals(n: usize, per: usize, seed: u64, first: u64) -> Vec<f32> {
    use rayon::prelude::*;
    let mut x = vec![0.0; n * per];
    x.par_chunks_mut(per.max(1))
        .enumerate()
        .for_each(|(i, sample)| {
            let s = stream(seed, Purpose::Synthetic, i as u64);
            for (j, v) in sample.iter_mut().enumerate() {
                *v = normal(s, first + j as u64);
            }
        });
    x
}

/// Seeded random inputs and targets of the model's shapes.
pub(crate) fn synthetic(samples: u64, seed: u64, io: &ModelIo) -> Result<Raw, DataError> {
    let source = "Synthetic".to_string();
    let n = count("Synthetic `samples`", samples)?;
    let per_in = io.input.numel();
    let per_t = io.target.numel();
    elements(&source, n, per_in.max(per_t), 2)?;
    let inputs = if io.integer_input() {
        let r = io.input_range.ok_or_else(|| {
            DataError::mismatch(
                &source,
                format!(
                    "the model's input is {} (integer ids) with no known range to draw them from",
                    io.input.show()
                ),
            )
        })?;
        let mut x = Vec::with_capacity(n * per_in);
        for i in 0..n {
            let s = stream(seed, Purpose::Synthetic, i as u64);
            x.extend((0..per_in as u64).map(|j| below(s, j, r as u64) as i32));
        }
        Values::I32(x)
    } else {
        Values::F32(normals(n, per_in, seed, 0))
    };
    let labels = if io.class_target() {
        let c = io.classes.ok_or_else(|| {
            DataError::mismatch(
                &source,
                "the loss needs class labels but the number of classes is unknown",
            )
        })?;
        let mut y = Vec::with_capacity(n * per_t);
        for i in 0..n {
            let s = stream(seed, Purpose::Synthetic, i as u64);
            y.extend((0..per_t as u64).map(|j| below(s, TARGET_INDEX + j, c as u64) as i32));
        }
        Labels::Classes(y)
    } else {
        Labels::Floats(normals(n, per_t, seed, TARGET_INDEX))
    };
    Ok(Raw {
        source,
        n,
        inputs,
        input_shape: io.input.shape.clone(),
        labels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::{classify, err_text, regress};
    use crate::data::{fit, load, DType, TensorSpec};
    use parallax_compiler::dsl::ast::Data;
    use std::path::Path;

    fn seq_io(length: usize, vocab: usize) -> ModelIo {
        ModelIo {
            input: TensorSpec::new(DType::I32, vec![length]),
            target: TensorSpec::new(DType::I32, vec![length]),
            classes: Some(vocab),
            input_range: Some(vocab),
        }
    }

    fn ints(v: &Values) -> &[i32] {
        match v {
            Values::I32(v) => v,
            Values::F32(_) => panic!("expected i32"),
        }
    }

    #[test]
    fn sequence_tasks_transform_the_tokens() {
        let io = seq_io(12, 9);
        for task in [SeqTask::Copy, SeqTask::Reverse, SeqTask::Sort] {
            let ds = fit(sequence(task, 12, 9, 50, 3, &io).unwrap(), &io).unwrap();
            assert_eq!(ds.len, 50);
            let (x, y) = (ints(&ds.inputs), ints(&ds.targets));
            assert!(x.iter().all(|&t| (0..9).contains(&t)));
            for (a, b) in x.chunks(12).zip(y.chunks(12)) {
                let mut want = a.to_vec();
                match task {
                    SeqTask::Copy => {}
                    SeqTask::Reverse => want.reverse(),
                    SeqTask::Sort => want.sort(),
                }
                assert_eq!(b, &want[..], "{task:?}");
            }
            assert!(x.chunks(12).any(|a| a.windows(2).any(|w| w[0] > w[1])));
        }
        // The same seed gives the same tokens; another seed others.
        let a = sequence(SeqTask::Copy, 12, 9, 5, 3, &io).unwrap().inputs;
        assert_eq!(a, sequence(SeqTask::Copy, 12, 9, 5, 3, &io).unwrap().inputs);
        assert_ne!(a, sequence(SeqTask::Copy, 12, 9, 5, 4, &io).unwrap().inputs);
        // A vocabulary larger than the model's embedding is refused.
        let e = err_text(sequence(SeqTask::Copy, 12, 10, 5, 3, &io));
        assert!(
            e.contains("tokens go up to 9") && e.contains("holds 9 ids"),
            "{e}"
        );
        let d = Data::Sequence {
            task: SeqTask::Sort,
            length: 12,
            vocab: 9,
            samples: 40,
            validation: 0.25,
        };
        let s = load(&d, &io, 1, Path::new(".")).unwrap();
        assert_eq!((s.train.len, s.validation.len), (30, 10));
    }

    #[test]
    fn blobs_are_separable_by_their_centers() {
        let (n, k, f) = (600usize, 4usize, 8usize);
        let io = classify(DType::F32, vec![f], k);
        let d = Data::Blobs {
            samples: n as u64,
            classes: k as u64,
            features: f as u64,
            std: 1.0,
            validation: 0.0,
        };
        let ds = load(&d, &io, 11, Path::new(".")).unwrap().train;
        let Values::F32(x) = &ds.inputs else { panic!() };
        let y = ints(&ds.targets);
        let centers: Vec<Vec<f32>> = (0..k)
            .map(|c| {
                (0..f)
                    .map(|j| 4.0 * normal(stream(11, Purpose::Synthetic, c as u64), j as u64))
                    .collect()
            })
            .collect();
        let mut right = 0;
        for (i, p) in x.chunks(f).enumerate() {
            assert_eq!(y[i] as usize, i % k);
            let d2 = |c: &Vec<f32>| c.iter().zip(p).map(|(a, b)| (a - b) * (a - b)).sum::<f32>();
            let best = (0..k)
                .min_by(|&a, &b| d2(&centers[a]).total_cmp(&d2(&centers[b])))
                .unwrap();
            right += (best == y[i] as usize) as usize;
        }
        assert!(right as f64 / n as f64 > 0.9, "{right}/{n}");
        // The noise has the stated spread.
        let var: f32 = x
            .chunks(f)
            .enumerate()
            .flat_map(|(i, p)| {
                p.iter()
                    .zip(&centers[i % k])
                    .map(|(a, b)| (a - b) * (a - b))
            })
            .sum::<f32>()
            / (n * f) as f32;
        assert!((var - 1.0).abs() < 0.15, "{var}");
        // The model's input must have `features` elements.
        let wrong = classify(DType::F32, vec![7], k);
        let e = err_text(load(&d, &wrong, 11, Path::new(".")));
        assert!(
            e.contains("Blobs(8 features)") && e.contains("f32[7]"),
            "{e}"
        );
    }

    #[test]
    fn synthetic_follows_the_model_spec() {
        let io = ModelIo {
            input: TensorSpec::new(DType::I32, vec![2, 3]),
            target: TensorSpec::new(DType::I32, vec![3]),
            classes: Some(5),
            input_range: Some(7),
        };
        let ds = fit(synthetic(20, 9, &io).unwrap(), &io).unwrap();
        assert_eq!((ds.len, ds.inputs.len(), ds.targets.len()), (20, 120, 60));
        assert!(ints(&ds.inputs).iter().all(|&t| (0..7).contains(&t)));
        assert!(ints(&ds.targets).iter().all(|&t| (0..5).contains(&t)));
        let no_range = ModelIo {
            input_range: None,
            ..io.clone()
        };
        let e = synthetic(20, 9, &no_range).err().unwrap().to_string();
        assert!(e.contains("no known range"), "{e}");
        let mse = regress(vec![4], vec![2]);
        let ds = fit(synthetic(10, 9, &mse).unwrap(), &mse).unwrap();
        assert_eq!(
            (ds.inputs.dtype(), ds.targets.dtype()),
            (DType::F32, DType::F32)
        );
        assert_eq!(ds.targets.len(), 20);
        let d = Data::Synthetic {
            samples: 10,
            validation: 0.0,
        };
        let s = load(&d, &mse, 9, Path::new(".")).unwrap();
        assert_eq!((s.train.len, s.validation.len), (10, 0));
        assert_eq!(s.train, ds);
    }
}
