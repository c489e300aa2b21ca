//! A typed n-dimensional array as stored in a file (IDX, NPY), decoded on demand, and the file
//! reader shared by the file formats (gzip'd files are decompressed transparently).

use super::{DataError, Labels, ModelIo, Raw, Values};
use std::io::Read;
use std::path::Path;

/// Reads a whole file; a gzip'd file (starting with `1f 8b`) is decompressed.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>, DataError> {
    let bytes = crate::exec::host_memory::read_whole(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .map_err(|e| {
                DataError::format(path.display(), format!("not a valid gzip file: {e}"))
            })?;
        return Ok(out);
    }
    Ok(bytes)
}

/// A file opened for reading in order: a gzip'd file (starting with `1f 8b`) through its
/// decoder, so that a header can be read before the rest is inflated.
pub(crate) struct Stream {
    pub reader: Box<dyn Read>,
    pub gzip: bool,
    path: std::path::PathBuf,
}

impl Stream {
    pub fn open(path: &Path) -> Result<Stream, DataError> {
        let io = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = std::io::BufReader::new(std::fs::File::open(path).map_err(io)?);
        let gzip = std::io::BufRead::fill_buf(&mut file)
            .map_err(io)?
            .starts_with(&[0x1f, 0x8b]);
        let reader: Box<dyn Read> = if gzip {
            Box::new(flate2::read::GzDecoder::new(file))
        } else {
            Box::new(file)
        };
        Ok(Stream {
            reader,
            gzip,
            path: path.to_path_buf(),
        })
    }

    /// Up to `n` bytes: fewer only where the data ends.
    pub fn read_up_to(&mut self, n: u64) -> Result<Vec<u8>, DataError> {
        let mut out = Vec::new();
        (&mut self.reader)
            .take(n)
            .read_to_end(&mut out)
            .map_err(|e| self.broken(e))?;
        Ok(out)
    }

    /// Whether anything follows what was read (reading to the end also checks a gzip'd
    /// file's checksum).
    pub fn has_more(&mut self) -> Result<bool, DataError> {
        let mut byte = [0u8; 1];
        loop {
            match self.reader.read(&mut byte) {
                Ok(n) => return Ok(n > 0),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.broken(e)),
            }
        }
    }

    fn broken(&self, e: std::io::Error) -> DataError {
        if self.gzip {
            DataError::format(self.path.display(), format!("not a valid gzip file: {e}"))
        } else {
            DataError::Io {
                path: self.path.clone(),
                source: e,
            }
        }
    }
}

/// Element types of stored arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F32,
    F64,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::U8 | Elem::I8 => 1,
            Elem::U16 | Elem::I16 => 2,
            Elem::U32 | Elem::I32 | Elem::F32 => 4,
            Elem::U64 | Elem::I64 | Elem::F64 => 8,
        }
    }
    pub fn is_int(self) -> bool {
        !matches!(self, Elem::F32 | Elem::F64)
    }
    pub fn name(self) -> &'static str {
        match self {
            Elem::U8 => "u8",
            Elem::I8 => "i8",
            Elem::U16 => "u16",
            Elem::I16 => "i16",
            Elem::U32 => "u32",
            Elem::I32 => "i32",
            Elem::U64 => "u64",
            Elem::I64 => "i64",
            Elem::F32 => "f32",
            Elem::F64 => "f64",
        }
    }
}

/// How an inputs array and a labels array (IDX, NPY) become a data set.
pub(crate) struct Pair<'a> {
    /// What the inputs file holds, in messages ("images", "inputs").
    pub inputs: &'a str,
    /// What float inputs are divided by (255 for IDX's bytes of pixels).
    pub divisor: f64,
    /// Whether integer labels are class indices even for a model that does not classify.
    pub int_labels_are_classes: bool,
}

impl Pair<'_> {
    /// The data set of `x` (inputs) and `y` (labels) for a model of `io`, checked to hold as
    /// many samples.
    pub fn raw(&self, x: RawArray, y: RawArray, io: &ModelIo) -> Result<Raw, DataError> {
        if x.samples() != y.samples() {
            return Err(DataError::format(
                format!("{} and {}", x.file, y.file),
                format!(
                    "the {} file holds {} samples (shape {:?}) but the labels file holds {} (shape {:?})",
                    self.inputs,
                    x.samples(),
                    x.shape,
                    y.samples(),
                    y.shape
                ),
            ));
        }
        let inputs = if io.integer_input() && x.elem.is_int() {
            Values::I32(x.to_i32("input")?)
        } else {
            Values::F32(x.to_f32(self.divisor))
        };
        let labels = if io.class_target() || (self.int_labels_are_classes && y.elem.is_int()) {
            Labels::Classes(y.to_i32("label")?)
        } else {
            Labels::Floats(y.to_f32(1.0))
        };
        Ok(Raw {
            source: format!("{} (labels: {})", x.file, y.file),
            n: x.samples(),
            input_shape: x.sample_shape(),
            inputs,
            labels,
        })
    }
}

/// An array read from `file`: `shape` (the first axis is the sample axis), elements of type
/// `elem` in C order from `bytes[offset..]`.
pub(crate) struct RawArray {
    pub file: String,
    pub elem: Elem,
    pub big_endian: bool,
    pub shape: Vec<usize>,
    bytes: Vec<u8>,
    offset: usize,
}

impl RawArray {
    /// Checks that the data after `offset` holds exactly the elements `shape` says.
    pub fn new(
        file: String,
        elem: Elem,
        big_endian: bool,
        shape: Vec<usize>,
        bytes: Vec<u8>,
        offset: usize,
    ) -> Result<Self, DataError> {
        let count = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(elem.size()));
        let have = bytes.len().saturating_sub(offset);
        match count {
            Some(want) if want == have => Ok(RawArray {
                file,
                elem,
                big_endian,
                shape,
                bytes,
                offset,
            }),
            Some(want) => Err(DataError::format(
                file,
                format!(
                    "the header says shape {shape:?} of {} ({want} bytes of data), but the file holds {have} bytes of data",
                    elem.name()
                ),
            )),
            None => Err(DataError::format(
                file,
                format!("the shape {shape:?} in the header is impossibly large"),
            )),
        }
    }

    /// The number of samples (the first axis).
    pub fn samples(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    /// The shape of one sample.
    pub fn sample_shape(&self) -> Vec<usize> {
        self.shape.get(1..).unwrap_or(&[]).to_vec()
    }

    fn chunks(&self) -> std::slice::ChunksExact<'_, u8> {
        self.bytes[self.offset..].chunks_exact(self.elem.size())
    }

    fn word<const N: usize>(&self, c: &[u8]) -> [u8; N] {
        let mut w: [u8; N] = c.try_into().expect("chunk of the element size");
        if self.big_endian {
            w.reverse();
        }
        w
    }

    /// An integer element, exactly (`u64` above `i64::MAX` saturates).
    fn int(&self, c: &[u8]) -> i64 {
        match self.elem {
            Elem::U8 => c[0] as i64,
            Elem::I8 => c[0] as i8 as i64,
            Elem::U16 => u16::from_le_bytes(self.word(c)) as i64,
            Elem::I16 => i16::from_le_bytes(self.word(c)) as i64,
            Elem::U32 => u32::from_le_bytes(self.word(c)) as i64,
            Elem::I32 => i32::from_le_bytes(self.word(c)) as i64,
            Elem::U64 => u64::from_le_bytes(self.word(c)).min(i64::MAX as u64) as i64,
            Elem::I64 => i64::from_le_bytes(self.word(c)),
            Elem::F32 | Elem::F64 => unreachable!("not an integer element"),
        }
    }

    fn float(&self, c: &[u8]) -> f64 {
        match self.elem {
            Elem::F32 => f32::from_le_bytes(self.word(c)) as f64,
            Elem::F64 => f64::from_le_bytes(self.word(c)),
            Elem::U64 => u64::from_le_bytes(self.word(c)) as f64,
            _ => self.int(c) as f64,
        }
    }

    /// Every element as `f32`, divided by `divisor`.
    pub fn to_f32(&self, divisor: f64) -> Vec<f32> {
        if divisor == 1.0 && self.elem == Elem::F32 && !self.big_endian {
            return self
                .chunks()
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
        }
        self.chunks()
            .map(|c| (self.float(c) / divisor) as f32)
            .collect()
    }

    /// Every element as `i32`; an element that is not an integer in `i32`'s range is an error
    /// naming `what` ("label", "input") and the element's position.
    pub fn to_i32(&self, what: &str) -> Result<Vec<i32>, DataError> {
        let per = self.sample_shape().iter().product::<usize>().max(1);
        let mut out =
            Vec::with_capacity(self.bytes.len().saturating_sub(self.offset) / self.elem.size());
        for (i, c) in self.chunks().enumerate() {
            let ok = if self.elem.is_int() {
                i32::try_from(self.int(c)).map_err(|_| self.int(c).to_string())
            } else {
                let x = self.float(c);
                if x.fract() == 0.0 && x >= i32::MIN as f64 && x <= i32::MAX as f64 {
                    Ok(x as i32)
                } else {
                    Err(x.to_string())
                }
            };
            match ok {
                Ok(v) => out.push(v),
                Err(text) => {
                    return Err(DataError::format(
                        &self.file,
                        format!(
                            "{what} {text} (sample {}) is not an integer that fits in i32",
                            i / per
                        ),
                    ))
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_every_element_type_in_both_byte_orders() {
        let le = RawArray::new(
            "t".into(),
            Elem::I16,
            false,
            vec![2],
            vec![0xff, 0xff, 2, 1],
            0,
        )
        .unwrap();
        assert_eq!(le.to_i32("x").unwrap(), vec![-1, 0x0102]);
        let be = RawArray::new(
            "t".into(),
            Elem::U16,
            true,
            vec![2],
            vec![0xff, 0xff, 1, 2],
            0,
        )
        .unwrap();
        assert_eq!(be.to_i32("x").unwrap(), vec![65535, 0x0102]);
        let f: Vec<u8> = [1.5f64, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let f = RawArray::new("t".into(), Elem::F64, false, vec![2], f, 0).unwrap();
        assert_eq!(f.to_f32(1.0), vec![1.5, -2.0]);
        let err = f.to_i32("label").unwrap_err().to_string();
        assert!(err.contains("label 1.5 (sample 0)"), "{err}");
        let short = RawArray::new("f.idx".into(), Elem::I32, false, vec![3], vec![0; 8], 0);
        let err = short.err().unwrap().to_string();
        assert!(
            err.starts_with("f.idx:") && err.contains("12 bytes"),
            "{err}"
        );
    }
}
