//! NumPy `.npy` files: the magic `\x93NUMPY`, a version (1.0: `u16` header length; 2.0 and
//! 3.0: `u32`), a Python dict `{'descr': '<f4', 'fortran_order': False, 'shape': (n, ...)}`,
//! then the elements. Element types: `<f4 <f8 <i1..<i8 |u1..<u8` (little-endian or one byte;
//! big-endian is refused), C order only (`fortran_order: True` is refused). Gzip'd files are
//! read as well.
//!
//! Inputs become `f32`, or stay integers (`i32`) when the model's input is integer; labels
//! become `i32` class labels for cross-entropy, `f32` values for MSE.

use super::array::{Elem, Pair, RawArray, Stream};
use super::{DataError, ModelIo, Raw};
use crate::exec::host_memory::available_bytes;
use parallax_compiler::plan::bytes;
use std::path::Path;

/// The value of `key` in the header dict: the text after its colon.
fn value_after<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header
        .find(&format!("'{key}'"))
        .or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = &header[at + key.len() + 2..];
    Some(rest.trim_start().strip_prefix(':')?.trim_start())
}

/// The element type of a little-endian (or one-byte) `descr`.
fn parse_descr(descr: &str) -> Result<Elem, String> {
    let (order, code) = match descr.chars().next() {
        Some(c @ ('<' | '>' | '|' | '=')) => (c, &descr[1..]),
        _ => ('=', descr),
    };
    let elem = match code {
        "f4" => Elem::F32,
        "f8" => Elem::F64,
        "i1" => Elem::I8,
        "i2" => Elem::I16,
        "i4" => Elem::I32,
        "i8" => Elem::I64,
        "u1" | "b1" => Elem::U8,
        "u2" => Elem::U16,
        "u4" => Elem::U32,
        "u8" => Elem::U64,
        _ => {
            return Err(format!(
                "unsupported element type `{descr}` (expected one of <f4 <f8 <i4 <i8 <i2 |i1 |u1 <u2 <u4 <u8)"
            ))
        }
    };
    if order == '>' && elem.size() > 1 {
        return Err(format!(
            "big-endian element type `{descr}` is not supported; save the array little-endian (e.g. `a.astype('<f4')`)"
        ));
    }
    Ok(elem)
}

/// NumPy writes headers of a few hundred bytes (and reads at most 10000 by default).
const MAX_HEADER: usize = 1 << 20;

/// Parses a `.npy` file's header; the result holds its elements. The header is read first (from
/// a gzip'd file's decoder), so a size it claims is refused before the elements are inflated.
pub(crate) fn parse(path: &Path) -> Result<RawArray, DataError> {
    let mut stream = Stream::open(path)?;
    let file = path.display().to_string();
    let err = |m: String| DataError::format(&file, m);
    let mut lead = stream.read_up_to(10)?;
    if !lead.starts_with(b"\x93NUMPY") || lead.len() < 10 {
        return Err(err(
            "not a .npy file: it does not start with the magic `\\x93NUMPY`".into(),
        ));
    }
    let (major, minor) = (lead[6], lead[7]);
    let len = match major {
        1 => u16::from_le_bytes([lead[8], lead[9]]) as usize,
        2 | 3 => {
            lead.extend(stream.read_up_to(2)?);
            match lead[8..] {
                [a, b, c, d] => u32::from_le_bytes([a, b, c, d]) as usize,
                _ => return Err(err("truncated: the file ends inside its header".into())),
            }
        }
        _ => {
            return Err(err(format!(
                "unsupported .npy version {major}.{minor} (expected 1.0, 2.0 or 3.0)"
            )))
        }
    };
    if len > MAX_HEADER {
        return Err(err(format!(
            "the header claims to be {len} bytes long; a .npy header is a few hundred"
        )));
    }
    let header = stream.read_up_to(len as u64)?;
    if header.len() < len {
        return Err(err("truncated: the file ends inside its header".into()));
    }
    let header = std::str::from_utf8(&header).map_err(|_| err("the header is not text".into()))?;

    let descr = value_after(header, "descr")
        .and_then(|v| {
            let q = v.chars().next().filter(|c| *c == '\'' || *c == '"')?;
            v[1..].split(q).next()
        })
        .ok_or_else(|| {
            err(format!(
                "the header has no 'descr' string: {}",
                header.trim()
            ))
        })?;
    let elem = parse_descr(descr).map_err(err)?;

    let fortran = value_after(header, "fortran_order")
        .ok_or_else(|| err("the header has no 'fortran_order'".into()))?;
    if fortran.starts_with("True") {
        return Err(err(
            "the array is stored in Fortran order (fortran_order: True); save it in C order (e.g. `np.ascontiguousarray(a)`)".into(),
        ));
    }
    let shape_text = value_after(header, "shape")
        .and_then(|v| v.strip_prefix('('))
        .and_then(|v| v.split(')').next())
        .ok_or_else(|| {
            err(format!(
                "the header has no 'shape' tuple: {}",
                header.trim()
            ))
        })?;
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('L').parse::<usize>())
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| err(format!("bad shape ({shape_text}) in the header")))?;
    if shape.is_empty() {
        return Err(err(
            "the array is a scalar; a data set needs a first axis of samples".into(),
        ));
    }
    // What the header claims, refused before reading when the machine could not hold it.
    let claimed = shape
        .iter()
        .fold(elem.size() as u64, |a, &d| a.saturating_mul(d as u64));
    if let Some(available) = available_bytes().filter(|&m| claimed > m) {
        return Err(err(format!(
            "the header says shape {shape:?} of {} ({}), more than the {} of memory this machine has available",
            elem.name(),
            bytes(claimed),
            bytes(available)
        )));
    }
    let data = stream.read_up_to(claimed)?;
    if data.len() as u64 == claimed && stream.has_more()? {
        return Err(err(format!(
            "the file holds more data than the {claimed} bytes the header's shape {shape:?} of {} says",
            elem.name()
        )));
    }
    // Short data is refused here, with the sizes.
    RawArray::new(file, elem, false, shape, data, 0)
}

/// Reads an inputs file and a labels file.
pub(crate) fn load(inputs: &Path, labels: &Path, io: &ModelIo) -> Result<Raw, DataError> {
    let pair = Pair {
        inputs: "inputs",
        divisor: 1.0,
        int_labels_are_classes: false,
    };
    pair.raw(parse(inputs)?, parse(labels)?, io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::{classify, err_text, gzip, regress, TempDir};
    use crate::data::{fit, DType, Values};

    /// A version-1.0 .npy file, as NumPy writes it (header padded to 64 bytes).
    fn npy(descr: &str, fortran: bool, shape: &[usize], data: &[u8]) -> Vec<u8> {
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        let tuple = if shape.len() == 1 {
            format!("({},)", dims[0])
        } else {
            format!("({})", dims.join(", "))
        };
        let f = if fortran { "True" } else { "False" };
        let mut h = format!("{{'descr': '{descr}', 'fortran_order': {f}, 'shape': {tuple}, }}");
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(' ');
        }
        h.push('\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(h.len() as u16).to_le_bytes());
        b.extend_from_slice(h.as_bytes());
        b.extend_from_slice(data);
        b
    }

    fn le<T: Copy, const N: usize>(v: &[T], f: fn(T) -> [u8; N]) -> Vec<u8> {
        v.iter().flat_map(|&x| f(x)).collect()
    }

    #[test]
    fn round_trip_of_every_common_dtype() {
        let dir = TempDir::new("npy");
        let io = classify(DType::F32, vec![2, 2], 4);
        let xs: Vec<f32> = (0..12).map(|i| i as f32 - 3.5).collect();
        let x = dir.write(
            "x.npy",
            &npy("<f4", false, &[3, 2, 2], &le(&xs, f32::to_le_bytes)),
        );
        for (name, bytes) in [
            (
                "i8.npy",
                npy("<i8", false, &[3], &le(&[3i64, 0, 2], i64::to_le_bytes)),
            ),
            (
                "i4.npy",
                npy("<i4", false, &[3], &le(&[3i32, 0, 2], i32::to_le_bytes)),
            ),
            ("u1.npy", npy("|u1", false, &[3], &[3, 0, 2])),
            (
                "f8.npy",
                npy(
                    "<f8",
                    false,
                    &[3],
                    &le(&[3.0f64, 0.0, 2.0], f64::to_le_bytes),
                ),
            ),
            ("gz.npy.gz", gzip(&npy("|i1", false, &[3], &[3, 0, 2]))),
        ] {
            let y = dir.write(name, &bytes);
            let ds = fit(load(&x, &y, &io).unwrap(), &io).unwrap();
            assert_eq!(ds.inputs, Values::F32(xs.clone()), "{name}");
            assert_eq!(ds.targets, Values::I32(vec![3, 0, 2]), "{name}");
        }

        // Integer inputs stay integers for an integer model input; f8 inputs become f32.
        let tok = dir.write(
            "tok.npy",
            &npy(
                "<i8",
                false,
                &[2, 3],
                &le(&[1i64, 2, 3, 4, 5, 6], i64::to_le_bytes),
            ),
        );
        let lab = dir.write(
            "lab.npy",
            &npy("<i4", false, &[2], &le(&[1i32, 0], i32::to_le_bytes)),
        );
        let mut tio = classify(DType::I32, vec![3], 2);
        tio.input_range = Some(7);
        let ds = fit(load(&tok, &lab, &tio).unwrap(), &tio).unwrap();
        assert_eq!(ds.inputs, Values::I32(vec![1, 2, 3, 4, 5, 6]));
        tio.input_range = Some(6);
        let e = err_text(fit(load(&tok, &lab, &tio).unwrap(), &tio));
        assert!(
            e.contains("input id 6 of sample 1") && e.contains("0..6"),
            "{e}"
        );

        // MSE: f32 targets of the output's shape.
        let t = dir.write(
            "t.npy",
            &npy(
                "<f8",
                false,
                &[3, 2],
                &le(&[0.5f64, 1.0, 1.5, 2.0, 2.5, 3.0], f64::to_le_bytes),
            ),
        );
        let rio = regress(vec![4], vec![2]);
        let ds = fit(load(&x, &t, &rio).unwrap(), &rio).unwrap();
        assert_eq!(ds.targets, Values::F32(vec![0.5, 1.0, 1.5, 2.0, 2.5, 3.0]));
    }

    #[test]
    fn errors_name_the_file_and_the_problem() {
        let dir = TempDir::new("npy-errors");
        let io = classify(DType::F32, vec![2], 3);
        let x = dir.write("x.npy", &npy("<f4", false, &[2, 2], &[0; 16]));
        let y = dir.write("y.npy", &npy("|u1", false, &[2], &[0, 1]));
        let load_err = |a: &Path, b: &Path| -> String {
            match load(a, b, &io).and_then(|r| fit(r, &io)) {
                Ok(_) => panic!("loaded"),
                Err(e) => e.to_string(),
            }
        };

        let e = load_err(&dir.path().join("missing.npy"), &y);
        assert!(
            e.contains("cannot read") && e.contains("missing.npy"),
            "{e}"
        );
        let e = load_err(&dir.write("bad.npy", b"\x93NUMPZ\x01\x00\x00\x00"), &y);
        assert!(
            e.contains("bad.npy") && e.contains("not a .npy file"),
            "{e}"
        );
        let e = load_err(
            &dir.write("f.npy", &npy("<f4", true, &[2, 2], &[0; 16])),
            &y,
        );
        assert!(e.contains("f.npy") && e.contains("Fortran order"), "{e}");
        let e = load_err(
            &dir.write("be.npy", &npy(">f4", false, &[2, 2], &[0; 16])),
            &y,
        );
        assert!(e.contains("be.npy") && e.contains("big-endian"), "{e}");
        let e = load_err(
            &dir.write("c.npy", &npy("<c8", false, &[2, 2], &[0; 32])),
            &y,
        );
        assert!(e.contains("unsupported element type `<c8`"), "{e}");
        let e = load_err(
            &dir.write("short.npy", &npy("<f4", false, &[2, 2], &[0; 15])),
            &y,
        );
        assert!(e.contains("short.npy") && e.contains("15 bytes"), "{e}");
        let e = load_err(
            &x,
            &dir.write("y3.npy", &npy("|u1", false, &[3], &[0, 1, 2])),
        );
        assert!(e.contains("y3.npy") && e.contains("holds 2 samples"), "{e}");
        let e = load_err(&x, &dir.write("big.npy", &npy("|u1", false, &[2], &[0, 3])));
        assert!(
            e.contains("big.npy") && e.contains("label 3 of sample 1"),
            "{e}"
        );
        let e = load_err(
            &x,
            &dir.write(
                "frac.npy",
                &npy("<f4", false, &[2], &le(&[0.0f32, 1.5], f32::to_le_bytes)),
            ),
        );
        assert!(
            e.contains("frac.npy") && e.contains("label 1.5 (sample 1)"),
            "{e}"
        );
        let wide = dir.write("wide.npy", &npy("<f4", false, &[2, 3], &[0; 24]));
        let e = load_err(&wide, &y);
        assert!(
            e.contains("wide.npy") && e.contains("[3] (3 values)") && e.contains("f32[2]"),
            "{e}"
        );
    }

    #[test]
    fn a_gzipped_header_is_checked_before_the_data_is_inflated() {
        let dir = TempDir::new("npy-gz");
        // 2^60 f32 elements claimed; the compressed stream is cut off half-way, so inflating
        // it whole (rather than reading the header first) fails as a broken gzip file instead.
        let mut big = gzip(&npy("<f4", false, &[1 << 60], &vec![0; 1 << 20]));
        big.truncate(big.len() / 2);
        let p = dir.write("bomb.npy.gz", &big);
        let e = parse(&p).err().unwrap().to_string();
        assert!(
            e.contains("bomb.npy.gz")
                && e.contains("shape [1152921504606846976] of f32")
                && e.contains("memory this machine has available"),
            "{e}"
        );

        // Exactly the claimed bytes are read: more, or fewer, is refused naming the file.
        let p = dir.write("long.npy.gz", &gzip(&npy("|u1", false, &[2], &[0, 1, 2])));
        let e = parse(&p).err().unwrap().to_string();
        assert!(
            e.contains("long.npy.gz") && e.contains("more data than the 2 bytes"),
            "{e}"
        );
        let p = dir.write("short.npy.gz", &gzip(&npy("<f4", false, &[2], &[0; 7])));
        let e = parse(&p).err().unwrap().to_string();
        assert!(
            e.contains("short.npy.gz") && e.contains("holds 7 bytes of data"),
            "{e}"
        );
        let p = dir.write("ok.npy.gz", &gzip(&npy("|u1", false, &[3], &[3, 0, 2])));
        let a = parse(&p).unwrap();
        assert_eq!(
            (a.shape.clone(), a.to_i32("label").unwrap()),
            (vec![3], vec![3, 0, 2])
        );
        // A plain file's trailing bytes are refused alike.
        let p = dir.write("long.npy", &npy("|u1", false, &[2], &[0, 1, 2]));
        let e = parse(&p).err().unwrap().to_string();
        assert!(e.contains("long.npy") && e.contains("more data"), "{e}");
    }
}
