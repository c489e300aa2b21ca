//! IDX files, the MNIST format: a big-endian magic `00 00 TT NN` (element type `TT`, `NN`
//! dimensions), `NN` big-endian `u32` sizes, then the elements in C order, big-endian.
//! Element types: `08` u8, `09` i8, `0B` i16, `0C` i32, `0D` f32, `0E` f64. MNIST's images are
//! `0x0803` (u8, [n, 28, 28]) and its labels `0x0801` (u8, [n]). Gzip'd files (`.gz`) are read
//! as well.
//!
//! Images become `f32`: `u8` pixels are divided by 255 (to [0, 1]), other types are taken as
//! they are; for an integer model input (token ids) integer images are kept as integers.
//! Labels must be one value per sample (`[n]`, or `[n, ...]` for targets with more values).

use super::array::{read_file, Elem, Pair, RawArray};
use super::{DataError, ModelIo, Raw};
use std::path::Path;

/// Parses an IDX file's header; the result holds its elements.
pub(crate) fn parse(path: &Path) -> Result<RawArray, DataError> {
    let bytes = read_file(path)?;
    let file = path.display().to_string();
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        let found: Vec<String> = bytes.iter().take(4).map(|b| format!("{b:02x}")).collect();
        return Err(DataError::format(
            file,
            format!(
                "not an IDX file: expected the magic `00 00 TT NN` (e.g. 00 00 08 03 for MNIST images, 00 00 08 01 for labels), found `{}`",
                found.join(" ")
            ),
        ));
    }
    let elem = match bytes[2] {
        0x08 => Elem::U8,
        0x09 => Elem::I8,
        0x0B => Elem::I16,
        0x0C => Elem::I32,
        0x0D => Elem::F32,
        0x0E => Elem::F64,
        t => {
            return Err(DataError::format(
                file,
                format!(
                    "unknown IDX element type 0x{t:02x} (expected 08 u8, 09 i8, 0B i16, 0C i32, 0D f32 or 0E f64)"
                ),
            ))
        }
    };
    let ndim = bytes[3] as usize;
    if ndim == 0 {
        return Err(DataError::format(
            file,
            "the IDX header declares 0 dimensions; a data set needs at least the sample axis",
        ));
    }
    let header = 4 + 4 * ndim;
    if bytes.len() < header {
        return Err(DataError::format(
            file,
            format!("truncated: the header declares {ndim} dimensions but the file ends inside it"),
        ));
    }
    let shape = (0..ndim)
        .map(|k| {
            let b = &bytes[4 + 4 * k..8 + 4 * k];
            u32::from_be_bytes(b.try_into().unwrap()) as usize
        })
        .collect();
    RawArray::new(file, elem, true, shape, bytes, header)
}

/// Reads an images file and a labels file.
pub(crate) fn load(images: &Path, labels: &Path, io: &ModelIo) -> Result<Raw, DataError> {
    let im = parse(images)?;
    // Bytes of pixels scale to [0, 1] for a model of float inputs.
    let divisor = if im.elem == Elem::U8 && !io.integer_input() {
        255.0
    } else {
        1.0
    };
    let pair = Pair {
        inputs: "images",
        divisor,
        int_labels_are_classes: true,
    };
    pair.raw(im, parse(labels)?, io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::{classify, err_text, TempDir};
    use crate::data::{fit, DType, Values};

    /// An IDX file of u8 elements.
    fn idx_u8(dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut b = vec![0, 0, 0x08, dims.len() as u8];
        for d in dims {
            b.extend_from_slice(&d.to_be_bytes());
        }
        b.extend_from_slice(data);
        b
    }

    #[test]
    fn round_trip_of_mnist_style_files() {
        let dir = TempDir::new("idx");
        let pixels: Vec<u8> = (0..3 * 2 * 2).map(|i| (i * 20) as u8).collect();
        let im = dir.write("images.idx", &idx_u8(&[3, 2, 2], &pixels));
        let lb = dir.write("labels.idx", &idx_u8(&[3], &[2, 0, 1]));
        let io = classify(DType::F32, vec![4], 3);
        let ds = fit(load(&im, &lb, &io).unwrap(), &io).unwrap();
        assert_eq!(ds.len, 3);
        assert_eq!(ds.targets, Values::I32(vec![2, 0, 1]));
        let Values::F32(x) = &ds.inputs else { panic!() };
        assert_eq!(x[1], 20.0 / 255.0);
        assert_eq!(x[11], 220.0 / 255.0);

        // An f32 IDX file (type 0D) is taken as it is, and a gzip'd file is read too.
        let mut f = vec![0, 0, 0x0D, 2, 0, 0, 0, 3, 0, 0, 0, 4];
        for i in 0..12 {
            f.extend_from_slice(&(i as f32 * 0.5).to_be_bytes());
        }
        let fpath = dir.write("images-f32.idx", &f);
        let gz = dir.write(
            "labels.idx.gz",
            &crate::data::testutil::gzip(&idx_u8(&[3], &[1, 1, 0])),
        );
        let ds = fit(load(&fpath, &gz, &io).unwrap(), &io).unwrap();
        assert_eq!(
            ds.inputs,
            Values::F32((0..12).map(|i| i as f32 * 0.5).collect())
        );
        assert_eq!(ds.targets, Values::I32(vec![1, 1, 0]));
    }

    #[test]
    fn errors_name_the_file_and_the_problem() {
        let dir = TempDir::new("idx-errors");
        let io = classify(DType::F32, vec![4], 3);
        let im = dir.write("images.idx", &idx_u8(&[2, 2, 2], &[0; 8]));
        let lb = dir.write("labels.idx", &idx_u8(&[2], &[0, 1]));

        let missing = dir.path().join("nope.idx");
        let e = load(&missing, &lb, &io).err().unwrap().to_string();
        assert!(e.contains("cannot read") && e.contains("nope.idx"), "{e}");

        let bad = dir.write("bad.idx", b"PK\x03\x04rest");
        let e = load(&bad, &lb, &io).err().unwrap().to_string();
        assert!(
            e.contains("bad.idx") && e.contains("not an IDX file"),
            "{e}"
        );

        let truncated = dir.write("short.idx", &idx_u8(&[2, 2, 2], &[0; 7]));
        let e = load(&truncated, &lb, &io).err().unwrap().to_string();
        assert!(e.contains("short.idx") && e.contains("7 bytes"), "{e}");

        let three = dir.write("three.idx", &idx_u8(&[3], &[0, 1, 2]));
        let e = load(&im, &three, &io).err().unwrap().to_string();
        assert!(
            e.contains("three.idx") && e.contains("holds 2 samples"),
            "{e}"
        );

        let big = dir.write("big.idx", &idx_u8(&[2], &[0, 7]));
        let e = err_text(fit(load(&im, &big, &io).unwrap(), &io));
        assert!(
            e.contains("big.idx") && e.contains("label 7 of sample 1"),
            "{e}"
        );

        let wide = classify(DType::F32, vec![1, 28, 28], 3);
        let e = err_text(fit(load(&im, &lb, &wide).unwrap(), &wide));
        assert!(
            e.contains("images.idx") && e.contains("[2, 2] (4 values)"),
            "{e}"
        );
        assert!(e.contains("f32[1, 28, 28] (784 values)"), "{e}");
    }
}
