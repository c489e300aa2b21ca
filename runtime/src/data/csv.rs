//! CSV files of numbers: one sample a line, comma-separated; the label in `label_column`
//! (negative counts from the end: -1 is the last column), the other columns are the features
//! (`f32`, in column order). With `header`, the first non-blank line is skipped. Blank lines are skipped;
//! every other line must have the same number of columns. For cross-entropy the labels must be
//! integers (`3` or `3.0`); for MSE they are numbers. Gzip'd files are read as well.

use super::array::read_file;
use super::{DataError, Labels, ModelIo, Raw, Values};
use std::path::Path;

pub(crate) fn load(
    path: &Path,
    label_column: i64,
    header: bool,
    io: &ModelIo,
) -> Result<Raw, DataError> {
    let bytes = read_file(path)?;
    let file = path.display().to_string();
    let text = std::str::from_utf8(&bytes)
        .map_err(|e| DataError::format(&file, format!("not a text file: {e}")))?;
    // Spreadsheet programs start a UTF-8 export with a byte-order mark: it is not part of the
    // first cell (which would then read as "`0.00` is not a number", the mark being invisible).
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut features: Vec<f32> = Vec::new();
    let mut labels: Vec<f64> = Vec::new();
    let mut columns: Option<(usize, usize)> = None; // (count, label column)
    let mut n = 0;
    let mut skip_header = header;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if std::mem::take(&mut skip_header) {
            continue;
        }
        let lineno = i + 1;
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        let (count, label) = match columns {
            Some(c) => c,
            None => {
                let count = cells.len();
                if count < 2 {
                    return Err(DataError::format(
                        format!("{file}:{lineno}"),
                        format!("expected a label and at least one feature, found {count} column"),
                    ));
                }
                let label = if label_column < 0 {
                    count as i64 + label_column
                } else {
                    label_column
                };
                if !(0..count as i64).contains(&label) {
                    return Err(DataError::format(
                        &file,
                        format!("label_column {label_column} is outside the {count} columns of the file"),
                    ));
                }
                *columns.insert((count, label as usize))
            }
        };
        if cells.len() != count {
            return Err(DataError::format(
                format!("{file}:{lineno}"),
                format!(
                    "expected {count} columns like the first row, found {}",
                    cells.len()
                ),
            ));
        }
        for (c, cell) in cells.iter().enumerate() {
            let v: f64 = cell.parse().map_err(|_| {
                DataError::format(
                    format!("{file}:{lineno}"),
                    format!("column {}: `{cell}` is not a number", c + 1),
                )
            })?;
            if c == label {
                if io.class_target() && (v.fract() != 0.0 || !(0.0..=i32::MAX as f64).contains(&v))
                {
                    return Err(DataError::format(
                        format!("{file}:{lineno}"),
                        format!(
                            "the label `{cell}` (column {}) is not a class number: cross-entropy needs integer labels 0, 1, 2, ...",
                            c + 1
                        ),
                    ));
                }
                labels.push(v);
            } else {
                features.push(v as f32);
            }
        }
        n += 1;
    }
    let Some((count, _)) = columns else {
        return Err(DataError::format(file, "the file holds no data rows"));
    };
    let labels = if io.class_target() {
        Labels::Classes(labels.into_iter().map(|v| v as i32).collect())
    } else {
        Labels::Floats(labels.into_iter().map(|v| v as f32).collect())
    };
    Ok(Raw {
        source: file,
        n,
        inputs: Values::F32(features),
        input_shape: vec![count - 1],
        labels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::{classify, err_text, regress, TempDir};
    use crate::data::{fit, DType};

    #[test]
    fn round_trip_with_header_and_label_columns() {
        let dir = TempDir::new("csv");
        let io = classify(DType::F32, vec![3], 3);
        let p = dir.write("d.csv", b"a,b,c,label\n0.5, 1, -2, 2\n\n3,4,5e-1,0\n");
        let ds = fit(load(&p, -1, true, &io).unwrap(), &io).unwrap();
        assert_eq!(ds.len, 2);
        assert_eq!(ds.inputs, Values::F32(vec![0.5, 1.0, -2.0, 3.0, 4.0, 0.5]));
        assert_eq!(ds.targets, Values::I32(vec![2, 0]));

        let p = dir.write("first.csv", b"1,0.5,0.25,0.125\n0.0,1,2,3\n");
        let ds = fit(load(&p, 0, false, &io).unwrap(), &io).unwrap();
        assert_eq!(
            ds.inputs,
            Values::F32(vec![0.5, 0.25, 0.125, 1.0, 2.0, 3.0])
        );
        assert_eq!(ds.targets, Values::I32(vec![1, 0]));

        // MSE: the label column is a number.
        let rio = regress(vec![3], vec![]);
        let ds = fit(load(&p, -2, false, &rio).unwrap(), &rio).unwrap();
        assert_eq!(ds.targets, Values::F32(vec![0.25, 2.0]));
        assert_eq!(ds.inputs, Values::F32(vec![1.0, 0.5, 0.125, 0.0, 1.0, 3.0]));
    }

    #[test]
    fn a_byte_order_mark_is_not_part_of_the_first_cell() {
        let dir = TempDir::new("csv-bom");
        let io = classify(DType::F32, vec![2], 3);
        let p = dir.write("bom.csv", b"\xef\xbb\xbf0.00,0.5,2\n1,2,0\n");
        let ds = fit(load(&p, -1, false, &io).unwrap(), &io).unwrap();
        assert_eq!(ds.inputs, Values::F32(vec![0.0, 0.5, 1.0, 2.0]));
        assert_eq!(ds.targets, Values::I32(vec![2, 0]));
        // With a header, the marked line is the header.
        let p = dir.write("bomh.csv", b"\xef\xbb\xbfa,b,label\n0.25,1,1\n");
        let ds = fit(load(&p, -1, true, &io).unwrap(), &io).unwrap();
        assert_eq!(ds.inputs, Values::F32(vec![0.25, 1.0]));
    }

    #[test]
    fn errors_name_the_file_line_and_problem() {
        let dir = TempDir::new("csv-errors");
        let io = classify(DType::F32, vec![2], 3);
        let err = |name: &str, text: &str, col: i64| -> String {
            let p = dir.write(name, text.as_bytes());
            match load(&p, col, false, &io).and_then(|r| fit(r, &io)) {
                Ok(_) => panic!("{name} loaded"),
                Err(e) => e.to_string(),
            }
        };
        let e = err_text(load(&dir.path().join("none.csv"), -1, false, &io));
        assert!(e.contains("cannot read") && e.contains("none.csv"), "{e}");
        let e = err("nan.csv", "1,2,0\n1,x,1\n", -1);
        assert!(
            e.contains("nan.csv:2") && e.contains("column 2: `x` is not a number"),
            "{e}"
        );
        let e = err("ragged.csv", "1,2,0\n1,1\n", -1);
        assert!(
            e.contains("ragged.csv:2") && e.contains("expected 3 columns"),
            "{e}"
        );
        let e = err("frac.csv", "1,2,0.5\n", -1);
        assert!(e.contains("frac.csv:1") && e.contains("`0.5`"), "{e}");
        let e = err("range.csv", "1,2,0\n1,2,3\n", -1);
        assert!(
            e.contains("range.csv") && e.contains("label 3 of sample 1"),
            "{e}"
        );
        let e = err("col.csv", "1,2,0\n", 3);
        assert!(
            e.contains("col.csv") && e.contains("label_column 3 is outside the 3 columns"),
            "{e}"
        );
        let e = err("shape.csv", "1,2,3,0\n", -1);
        assert!(
            e.contains("shape.csv") && e.contains("[3] (3 values)"),
            "{e}"
        );
        let e = err("empty.csv", "\n\n", -1);
        assert!(e.contains("empty.csv") && e.contains("no data rows"), "{e}");
    }
}
