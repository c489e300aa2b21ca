//! Fitting samples as read to the compiled model: element counts, element types, token-id
//! ranges, class-label ranges and the target's shape (see the rules in the parent module).

use super::{DataError, Dataset, Labels, ModelIo, Raw, Values};

/// Fits samples as read to the model: checks element counts, converts element types, checks
/// token ids and class labels, and shapes the targets.
pub(crate) fn fit(raw: Raw, io: &ModelIo) -> Result<Dataset, DataError> {
    let Raw {
        source,
        n,
        inputs,
        input_shape,
        labels,
    } = raw;
    if n == 0 {
        return Err(DataError::mismatch(&source, "the data set has no samples"));
    }
    let per_in: usize = input_shape.iter().product();
    debug_assert_eq!(inputs.len(), n * per_in);
    if per_in != io.input.numel() {
        return Err(DataError::mismatch(
            &source,
            format!(
                "each sample has shape {input_shape:?} ({per_in} values), but the model's input is {} ({} values)",
                io.input.show(),
                io.input.numel()
            ),
        ));
    }
    let inputs = fit_inputs(inputs, io, &source)?;
    let targets = fit_targets(labels, n, io, &source)?;
    Ok(Dataset {
        inputs,
        targets,
        input: io.input.clone(),
        target: io.target.clone(),
        len: n,
    })
}

fn fit_inputs(inputs: Values, io: &ModelIo, source: &str) -> Result<Values, DataError> {
    if !io.integer_input() {
        return Ok(match inputs {
            Values::I32(v) => Values::F32(v.into_iter().map(|x| x as f32).collect()),
            f => f,
        });
    }
    let ints = match inputs {
        Values::I32(v) => v,
        Values::F32(v) => {
            let mut out = Vec::with_capacity(v.len());
            for (i, &x) in v.iter().enumerate() {
                if x.fract() != 0.0 || !(x >= i32::MIN as f32 && x <= i32::MAX as f32) {
                    return Err(DataError::mismatch(
                        source,
                        format!(
                            "the model's input is {} (integer ids), but value {i} of the data is {x}, not an integer",
                            io.input.show()
                        ),
                    ));
                }
                out.push(x as i32);
            }
            out
        }
    };
    let per = io.input.numel().max(1);
    for (i, &t) in ints.iter().enumerate() {
        let out_of_range = t < 0 || io.input_range.is_some_and(|r| t as usize >= r);
        if out_of_range {
            let bound = io
                .input_range
                .map_or("a non-negative id".to_string(), |r| format!("in 0..{r}"));
            return Err(DataError::mismatch(
                source,
                format!(
                    "input id {t} of sample {} is out of range: the model's input ids must be {bound}",
                    i / per
                ),
            ));
        }
    }
    Ok(Values::I32(ints))
}

fn fit_targets(labels: Labels, n: usize, io: &ModelIo, source: &str) -> Result<Values, DataError> {
    let want = io.target.numel();
    let have = match &labels {
        Labels::Classes(v) => v.len(),
        Labels::Floats(v) => v.len(),
    } / n;
    if io.class_target() {
        let Labels::Classes(v) = labels else {
            return Err(DataError::mismatch(
                source,
                "the labels are not integers, but the loss (cross-entropy) needs integer class labels",
            ));
        };
        if have != want {
            return Err(DataError::mismatch(
                source,
                format!(
                    "each sample has {have} label(s), but the loss expects class labels of shape {:?} ({want} per sample)",
                    io.target.shape
                ),
            ));
        }
        // -100 marks a position that does not count (PyTorch's `ignore_index`).
        for (i, &l) in v
            .iter()
            .enumerate()
            .filter(|(_, &l)| l != crate::exec::IGNORE)
        {
            let sample = i / want.max(1);
            match io.classes {
                Some(classes) if l < 0 || l as usize >= classes => {
                    return Err(DataError::Label {
                        data: source.to_string(),
                        sample,
                        label: l as i64,
                        classes,
                    })
                }
                None if l < 0 => {
                    return Err(DataError::mismatch(
                        source,
                        format!(
                            "label {l} of sample {sample} is negative: class labels are 0 or more"
                        ),
                    ))
                }
                _ => {}
            }
        }
        return Ok(Values::I32(v));
    }
    match labels {
        Labels::Floats(v) if have == want => Ok(Values::F32(v)),
        Labels::Classes(v) if have == want => {
            Ok(Values::F32(v.into_iter().map(|x| x as f32).collect()))
        }
        Labels::Classes(v) if have == 1 && v.iter().all(|&l| l >= 0 && (l as usize) < want) => {
            let mut out = vec![0f32; n * want];
            for (i, &l) in v.iter().enumerate() {
                out[i * want + l as usize] = 1.0;
            }
            Ok(Values::F32(out))
        }
        _ => Err(DataError::mismatch(
            source,
            format!(
                "each sample has {have} label value(s), which do not fit the loss's target {} ({want} values; one class label per sample may also be one-hot encoded over it)",
                io.target.show()
            ),
        )),
    }
}
