//! Inputs without labels, for `parallax predict`: a `.npy` array (of many inputs, the first
//! axis, or of one), a CSV file of one input a line (a first line that is not all numbers is
//! a header), image files and folders of them (for a model trained on an image folder: its
//! evaluation transform); and the `.npy` file `predict` writes its probabilities to.

use super::image_folder::{eval_image, EXTENSIONS};
use super::npy;
use super::{DataError, ImageSpec, TensorSpec, Values};
use std::path::{Path, PathBuf};

/// Inputs read, each named (its file, and its index in a file of several).
#[derive(Debug, Clone, PartialEq)]
pub struct Inputs {
    pub names: Vec<String>,
    pub values: Values,
}

/// Whether `path` names an image file (by its extension, as an image folder's scan does).
pub fn is_image(path: &Path) -> bool {
    let name = path.to_string_lossy().to_ascii_lowercase();
    EXTENSIONS.iter().any(|e| name.ends_with(e))
}

/// The inputs of every path in order (`read_any`), named: the file, and its index in a file
/// of several.
pub fn read_all(
    paths: &[std::path::PathBuf],
    spec: &TensorSpec,
    images: Option<&ImageSpec>,
) -> Result<Inputs, DataError> {
    let mut all: Option<Inputs> = None;
    for path in paths {
        let read = read_any(path, spec, images)?;
        all = Some(match all {
            None => read,
            Some(mut a) => {
                a.names.extend(read.names);
                a.values = a.values.concat(read.values)?;
                a
            }
        });
    }
    all.ok_or_else(|| DataError::Config("no inputs given".into()))
}

/// The inputs in `path` for a model reading `spec`: an array or CSV file, an image file, or a
/// folder whose image files (under it, in name order) are the inputs. Images need `images`,
/// the transform of the image folder the model was trained on.
pub fn read_any(
    path: &Path,
    spec: &TensorSpec,
    images: Option<&ImageSpec>,
) -> Result<Inputs, DataError> {
    let file = path.display().to_string();
    let image_files = match (path.is_dir(), is_image(path)) {
        (true, _) => images_under(path)?,
        (false, true) => vec![path.to_path_buf()],
        (false, false) => {
            let (values, n) = read(path, spec)?;
            let names = match n {
                1 => vec![file],
                _ => (0..n).map(|i| format!("{file}[{i}]")).collect(),
            };
            return Ok(Inputs { names, values });
        }
    };
    let Some(images) = images else {
        return Err(DataError::format(&file, "images are read for a model trained on an image folder (with its evaluation transform); give this model .npy or .csv inputs".to_string()));
    };
    if image_files.is_empty() {
        return Err(DataError::format(&file, "holds no image file".to_string()));
    }
    let mut values = Vec::with_capacity(image_files.len() * spec.numel());
    for f in &image_files {
        values.extend(eval_image(f, images)?);
    }
    Ok(Inputs {
        names: image_files
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        values: Values::F32(values),
    })
}

/// The image files under `dir`, in name order, hidden files and folders left out.
fn images_under(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|source| DataError::Io {
            path: d.clone(),
            source,
        })?;
        for e in entries.flatten() {
            let p = e.path();
            let hidden = e.file_name().to_string_lossy().starts_with('.');
            match (hidden, p.is_dir()) {
                (true, _) => {}
                (false, true) => stack.push(p),
                (false, false) if is_image(&p) => found.push(p),
                _ => {}
            }
        }
    }
    found.sort();
    Ok(found)
}

/// The inputs in `path` (`.npy` or `.csv`) for a model reading `spec`: their values (C
/// order) and their count.
pub fn read(path: &Path, spec: &TensorSpec) -> Result<(Values, usize), DataError> {
    let file = path.display().to_string();
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    let per = spec.numel();
    let (values, count) = match ext.as_deref() {
        Some("npy") => {
            let a = npy::parse(path)?;
            // One input of the model's shape, or many along the first axis.
            let n = match a.shape == spec.shape {
                true => 1,
                false if a.sample_shape() == spec.shape => a.samples(),
                false => {
                    return Err(DataError::format(&file, format!(
                        "the model reads {} per input; the array's shape {:?} is neither that nor a list of it",
                        spec.show(),
                        a.shape
                    )))
                }
            };
            let v = match spec.dtype.is_float() {
                true => Values::F32(a.to_f32(1.0)),
                false => Values::I32(a.to_i32("input")?),
            };
            (v, n)
        }
        Some("csv") => csv_rows(path, spec)?,
        _ => {
            return Err(DataError::format(
                &file,
                "inputs are read from .npy, .csv or image files, or folders of images".to_string(),
            ))
        }
    };
    debug_assert_eq!(values.len(), count * per);
    Ok((values, count))
}

fn csv_rows(path: &Path, spec: &TensorSpec) -> Result<(Values, usize), DataError> {
    let file = path.display().to_string();
    let bytes = super::array::read_file(path)?;
    let text = std::str::from_utf8(&bytes)
        .map_err(|e| DataError::format(&file, format!("not a text file: {e}")))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let per = spec.numel();
    let mut out: Vec<f64> = Vec::new();
    let mut n = 0;
    let mut first = true;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        let numbers: Result<Vec<f64>, &str> = cells
            .iter()
            .map(|c| c.parse::<f64>().map_err(|_| *c))
            .collect();
        let header = std::mem::take(&mut first);
        let row = match numbers {
            Ok(r) => r,
            Err(_) if header => continue,
            Err(c) => {
                return Err(DataError::format(
                    &file,
                    format!("line {}: `{c}` is not a number", i + 1),
                ))
            }
        };
        if row.len() != per {
            return Err(DataError::format(
                &file,
                format!(
                    "line {}: {} values, but the model reads {} per input ({} values)",
                    i + 1,
                    row.len(),
                    spec.show(),
                    per
                ),
            ));
        }
        out.extend(row);
        n += 1;
    }
    if n == 0 {
        return Err(DataError::format(&file, "holds no input".to_string()));
    }
    let values = match spec.dtype.is_float() {
        true => Values::F32(out.iter().map(|&x| x as f32).collect()),
        false => Values::I32(
            out.iter()
                .enumerate()
                .map(
                    |(k, &x)| match x.fract() == 0.0 && x.abs() <= i32::MAX as f64 {
                        true => Ok(x as i32),
                        false => Err(DataError::format(
                            &file,
                            format!(
                                "input {} value {}: {x} is not an integer id",
                                k / per + 1,
                                k % per + 1
                            ),
                        )),
                    },
                )
                .collect::<Result<_, _>>()?,
        ),
    };
    Ok((values, n))
}

/// `values` of `shape` as a `.npy` file (version 1.0, little-endian `f32`, C order).
pub fn npy_f32(values: &[f32], shape: &[usize]) -> Vec<u8> {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    npy("<f4", shape, &data)
}

/// A `.npy` file (version 1.0, C order) of `data`, elements of type `descr` (`<f4`, `<i4`).
pub fn npy(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Magic, version and length take 10 bytes; the header ends in a newline at a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::TempDir;
    use parallax_compiler::ir::types::DType;

    #[test]
    fn npy_written_is_read_back_as_inputs() {
        let t = TempDir::new("inputs-npy");
        let v: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
        let p = t.write("x.npy", &npy_f32(&v, &[3, 2, 2]));
        let spec = TensorSpec::new(DType::F32, vec![2, 2]);
        let (got, n) = read(&p, &spec).unwrap();
        assert_eq!((got, n), (Values::F32(v.clone()), 3));
        // One input of the model's own shape.
        let one = t.write("one.npy", &npy_f32(&v[..4], &[2, 2]));
        assert_eq!(read(&one, &spec).unwrap().1, 1);
        let e = read(&p, &TensorSpec::new(DType::F32, vec![3])).unwrap_err();
        assert!(
            e.to_string().contains("neither that nor a list of it"),
            "{e}"
        );
    }

    #[test]
    fn csv_rows_with_a_header_are_inputs_and_bad_cells_are_named() {
        let t = TempDir::new("inputs-csv");
        let spec = TensorSpec::new(DType::F32, vec![3]);
        let p = t.write("x.csv", b"a,b,c\n1,2,3\n\n4,5,6.5\n");
        let (v, n) = read(&p, &spec).unwrap();
        assert_eq!((v, n), (Values::F32(vec![1., 2., 3., 4., 5., 6.5]), 2));
        let bad = t.write("bad.csv", b"1,2,3\n4,x,6\n");
        let e = read(&bad, &spec).unwrap_err().to_string();
        assert!(e.contains("line 2: `x` is not a number"), "{e}");
        let short = t.write("short.csv", b"1,2\n");
        let e = read(&short, &spec).unwrap_err().to_string();
        assert!(e.contains("line 1: 2 values"), "{e}");
    }
}
