//! The embedded 8x8 handwritten digits: 1,797 images of 64 pixels in 0..16 (row-major), each
//! with its label 0..9 (`runtime/data/digits.csv.gz`, the UCI "Optical Recognition of
//! Handwritten Digits" test set as shipped with scikit-learn; see `runtime/data/README.md`).
//!
//! Pixels are scaled to [0, 1] by dividing by 16 (as `f32`); labels are `i32`. Any model input
//! of 64 elements reads them: `[64]`, `[1, 8, 8]`, `[8, 8]`.

use super::{DataError, Labels, Raw, Values};
use std::io::Read;

/// The gzip'd CSV: 65 comma-separated integers a line (64 pixels, then the label), no header.
pub const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");
/// Samples in the embedded set.
pub const SAMPLES: usize = 1797;
/// Pixels per image.
pub const PIXELS: usize = 64;
/// Classes (the digits 0..9).
pub const CLASSES: usize = 10;

const NAME: &str = "the embedded digits (runtime/data/digits.csv.gz)";

/// Decodes the embedded set: scaled pixels (`SAMPLES * PIXELS`) and labels (`SAMPLES`).
pub fn decode() -> Result<(Vec<f32>, Vec<i32>), DataError> {
    let bad = |m: String| DataError::format(NAME, m);
    let mut text = String::new();
    flate2::read::GzDecoder::new(DIGITS_CSV_GZ)
        .read_to_string(&mut text)
        .map_err(|e| bad(format!("cannot decompress: {e}")))?;
    let mut pixels = Vec::with_capacity(SAMPLES * PIXELS);
    let mut labels = Vec::with_capacity(SAMPLES);
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let mut count = 0;
        for (c, cell) in line.split(',').enumerate() {
            let v: u8 = cell
                .trim()
                .parse()
                .map_err(|_| bad(format!("line {}: `{cell}` is not a small integer", i + 1)))?;
            match c {
                0..PIXELS if v <= 16 => pixels.push(v as f32 / 16.0),
                PIXELS if (v as usize) < CLASSES => labels.push(v as i32),
                _ => {
                    return Err(bad(format!(
                        "line {}: value {v} in column {} is out of range",
                        i + 1,
                        c + 1
                    )))
                }
            }
            count += 1;
        }
        if count != PIXELS + 1 {
            return Err(bad(format!(
                "line {}: expected 65 values, found {count}",
                i + 1
            )));
        }
    }
    if labels.len() != SAMPLES {
        return Err(bad(format!(
            "expected {SAMPLES} images, found {}",
            labels.len()
        )));
    }
    Ok((pixels, labels))
}

pub(crate) fn load() -> Result<Raw, DataError> {
    let (pixels, labels) = decode()?;
    Ok(Raw {
        source: NAME.to_string(),
        n: labels.len(),
        inputs: Values::F32(pixels),
        input_shape: vec![PIXELS],
        labels: Labels::Classes(labels),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::{classify, err_text, regress};
    use crate::data::{load as load_data, DType};
    use parallax_compiler::dsl::ast::Data;
    use std::path::Path;

    /// The class counts, read from the CSV independently of `decode`.
    fn class_counts_from_csv() -> [usize; 10] {
        let mut text = String::new();
        flate2::read::GzDecoder::new(DIGITS_CSV_GZ)
            .read_to_string(&mut text)
            .unwrap();
        let mut counts = [0; 10];
        for line in text.lines() {
            let last = line.rsplit(',').next().unwrap();
            counts[last.parse::<usize>().unwrap()] += 1;
        }
        counts
    }

    #[test]
    fn the_embedded_digits_load_with_their_known_class_counts() {
        let expected = class_counts_from_csv();
        assert_eq!(expected, [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]);
        let io = classify(DType::F32, vec![1, 8, 8], 10);
        let data = Data::Digits { validation: 0.0 };
        let s = load_data(&data, &io, 7, Path::new(".")).unwrap();
        assert_eq!(s.train.len, 1797);
        assert_eq!(s.validation.len, 0);
        assert_eq!(s.train.input.shape, vec![1, 8, 8]);
        let Values::I32(y) = &s.train.targets else {
            panic!()
        };
        let mut counts = [0; 10];
        y.iter().for_each(|&l| counts[l as usize] += 1);
        assert_eq!(counts, expected);
        let Values::F32(x) = &s.train.inputs else {
            panic!()
        };
        assert_eq!(x.len(), 1797 * 64);
        assert!(x.iter().all(|&p| (0.0..=1.0).contains(&p)));
        assert_eq!(x.iter().cloned().fold(0.0, f32::max), 1.0);
        // The first image's first row: 0,0,5,13,9,1,0,0 in the file.
        assert_eq!(
            &x[..8],
            &[
                0.0,
                0.0,
                5.0 / 16.0,
                13.0 / 16.0,
                9.0 / 16.0,
                1.0 / 16.0,
                0.0,
                0.0
            ]
        );
    }

    #[test]
    fn split_sizes_follow_the_fraction() {
        let io = classify(DType::F32, vec![64], 10);
        let s = load_data(&Data::Digits { validation: 0.2 }, &io, 42, Path::new(".")).unwrap();
        assert_eq!(s.validation.len, 359); // round(1797 * 0.2) = round(359.4)
        assert_eq!(s.train.len, 1438);
        assert_eq!(s.train.inputs.len(), 1438 * 64);
        assert_eq!(s.validation.targets.len(), 359);
        let again = load_data(&Data::Digits { validation: 0.2 }, &io, 42, Path::new(".")).unwrap();
        assert_eq!(s, again);
        let other = load_data(&Data::Digits { validation: 0.2 }, &io, 43, Path::new(".")).unwrap();
        assert_ne!(s.validation.targets, other.validation.targets);
        let e = load_data(&Data::Digits { validation: 1.0 }, &io, 42, Path::new("."));
        assert!(e.err().unwrap().to_string().contains("[0, 1)"));
    }

    #[test]
    fn a_model_of_the_wrong_size_is_told_what_the_data_gives() {
        let io = classify(DType::F32, vec![28, 28], 10);
        let e = err_text(load_data(
            &Data::Digits { validation: 0.2 },
            &io,
            1,
            Path::new("."),
        ));
        assert!(e.contains("embedded digits"), "{e}");
        assert!(
            e.contains("[64] (64 values)") && e.contains("f32[28, 28] (784 values)"),
            "{e}"
        );
        let few = classify(DType::F32, vec![64], 5);
        let e = err_text(load_data(
            &Data::Digits { validation: 0.2 },
            &few,
            1,
            Path::new("."),
        ));
        assert!(e.contains("out of range: the model has 5 classes"), "{e}");
        // MSE against 10 outputs: one-hot targets.
        let mse = regress(vec![64], vec![10]);
        let s = load_data(&Data::Digits { validation: 0.0 }, &mse, 1, Path::new(".")).unwrap();
        let Values::F32(t) = &s.train.targets else {
            panic!()
        };
        assert_eq!(t.len(), 17970);
        assert_eq!(t[..10].iter().sum::<f32>(), 1.0);
        assert_eq!(t[10 + 1], 1.0); // the second image is a 1
    }
}
