//! TensorBoard event files: scalar summaries written in TensorFlow's TFRecord event format, so
//! `tensorboard --logdir` plots a training run without TensorFlow or a protobuf library.
//!
//! A file is a sequence of records; each record's payload is a serialized `tensorflow.Event`
//! protobuf. The first event carries only the file version; every later one carries one scalar.
//! The handful of protobuf fields needed are encoded by hand below.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// Writes scalars to `DIR/events.out.tfevents.*` as TensorBoard reads them.
///
/// Writes are buffered: call [`EventWriter::flush`] to make them visible to a running
/// TensorBoard (and to see write errors). Dropping the writer flushes too, but ignores errors.
pub struct EventWriter {
    file: BufWriter<File>,
    path: std::path::PathBuf,
}

impl EventWriter {
    /// Creates the event file in `dir` and writes its header event.
    ///
    /// The file is `events.out.tfevents.<unix seconds>.<host>[.<n>]`, as TensorFlow names
    /// them. It is created new, never truncated: a second writer in the same directory within
    /// the same second (a resumed run) takes the next free `.<n>` instead of destroying the
    /// first one's log.
    pub fn create(dir: &Path) -> io::Result<EventWriter> {
        let now = SystemTime::now();
        let seconds = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        let base = format!("events.out.tfevents.{seconds}.{}", host_name());
        let mut n = 0;
        let (file, path) = loop {
            let name = if n == 0 {
                base.clone()
            } else {
                format!("{base}.{n}")
            };
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                other => break (other?, path),
            }
        };
        let mut writer = EventWriter {
            file: BufWriter::new(file),
            path,
        };
        // TensorBoard identifies the format by this first event; "brain.Event:2" is what every
        // TensorFlow writer since 2016 emits.
        let mut event = Proto::default();
        event.double(1, wall_time(now));
        event.bytes(3, b"brain.Event:2");
        write_record(&mut writer.file, &event.0)?;
        Ok(writer)
    }

    /// The event file (for error messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One scalar value of `tag` at `step`.
    pub fn scalar(&mut self, tag: &str, step: u64, value: f32) -> io::Result<()> {
        let event = scalar_event(wall_time(SystemTime::now()), step, tag, value);
        write_record(&mut self.file, &event)
    }

    /// Marks a restart at `step` (a resumed run): TensorBoard then drops the events of earlier
    /// files at this step and after, which the interrupted run logged past its checkpoint.
    pub fn session_start(&mut self, step: u64) -> io::Result<()> {
        let mut log = Proto::default();
        log.varint(1, 1); // SessionLog.status = START
        let mut event = Proto::default();
        event.double(1, wall_time(SystemTime::now())); // Event.wall_time
        event.varint(2, step); // Event.step
        event.bytes(7, &log.0); // Event.session_log (6 is the deprecated log_message)
        write_record(&mut self.file, &event.0)
    }

    /// Writes the buffered events to the file.
    pub fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

/// The host name, as TensorFlow puts it in event file names; "parallax" where unknown.
fn host_name() -> String {
    // std has no gethostname; Linux exposes it here, and the name is cosmetic anyway.
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        // A '/' would make the name a path; an empty one would leave a trailing '.'.
        .filter(|s| !s.is_empty() && !s.contains('/'))
        .unwrap_or_else(|| "parallax".to_string())
}

/// Seconds since the Unix epoch, as `Event.wall_time` holds them.
fn wall_time(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// `Event { wall_time, step, summary: Summary { value: [Value { tag, simple_value }] } }`.
fn scalar_event(wall_time: f64, step: u64, tag: &str, value: f32) -> Vec<u8> {
    let mut v = Proto::default();
    v.bytes(1, tag.as_bytes()); // Summary.Value.tag
    v.float(2, value); // Summary.Value.simple_value
    let mut summary = Proto::default();
    summary.bytes(1, &v.0); // Summary.value (repeated; one here)
    let mut event = Proto::default();
    event.double(1, wall_time); // Event.wall_time
                                // Event.step is an int64; steps past i64::MAX would read back negative, which no training
                                // run reaches.
    event.varint(2, step);
    event.bytes(5, &summary.0); // Event.summary
    event.0
}

/// Appends one TFRecord: length, its masked CRC, the data, the data's masked CRC. The length's
/// own checksum lets a reader tell a torn write from a huge record before reading the data.
fn write_record(w: &mut impl Write, data: &[u8]) -> io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    w.write_all(&len)?;
    w.write_all(&masked_crc32c(&len).to_le_bytes())?;
    w.write_all(data)?;
    w.write_all(&masked_crc32c(data).to_le_bytes())
}

/// CRC-32C (Castagnoli) of `data`, masked as TFRecord stores it. The mask (rotate right by 15,
/// add a constant) is there because a CRC over data that itself holds CRCs is weak.
fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// A protobuf message being encoded: fields are appended in order, as the wire format allows.
#[derive(Default)]
struct Proto(Vec<u8>);

/// Protobuf wire types: how a field's value is laid out after its key.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

impl Proto {
    /// A field's key: its number and wire type, itself a varint.
    fn key(&mut self, field: u32, wire_type: u32) {
        put_varint(&mut self.0, u64::from((field << 3) | wire_type));
    }

    /// An int64/uint64 field.
    fn varint(&mut self, field: u32, value: u64) {
        self.key(field, VARINT);
        put_varint(&mut self.0, value);
    }

    /// A double field: 8 little-endian bytes.
    fn double(&mut self, field: u32, value: f64) {
        self.key(field, FIXED64);
        self.0.extend_from_slice(&value.to_le_bytes());
    }

    /// A float field: 4 little-endian bytes.
    fn float(&mut self, field: u32, value: f32) {
        self.key(field, FIXED32);
        self.0.extend_from_slice(&value.to_le_bytes());
    }

    /// A string, bytes or embedded-message field: a varint length, then the bytes.
    fn bytes(&mut self, field: u32, value: &[u8]) {
        self.key(field, LEN);
        put_varint(&mut self.0, value.len() as u64);
        self.0.extend_from_slice(value);
    }
}

/// Base-128 varint: 7 bits a byte, least significant first, the high bit set on all but the last.
fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_mask_matches_tensorflow() {
        // The standard CRC-32C check value, then its masked form as TensorBoard's own Python
        // implementation computes it.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
        // Every TensorFlow event file starts with these 12 bytes: the 24-byte header event's
        // length and its masked CRC.
        let len = 24u64.to_le_bytes();
        assert_eq!(masked_crc32c(&len).to_le_bytes(), [0xa3, 0x7f, 0x4b, 0x22]);
    }

    #[test]
    fn varints() {
        let enc = |v: u64| {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            out
        };
        assert_eq!(enc(0), [0x00]);
        assert_eq!(enc(1), [0x01]);
        assert_eq!(enc(127), [0x7f]);
        assert_eq!(enc(128), [0x80, 0x01]);
        assert_eq!(enc(300), [0xac, 0x02]);
        assert_eq!(enc(16_384), [0x80, 0x80, 0x01]);
        let max = enc(u64::MAX);
        assert_eq!(max.len(), 10);
        assert_eq!(max[9], 0x01);
        assert!(max[..9].iter().all(|&b| b == 0xff));
    }

    #[test]
    fn events_encode_as_tensorflow_does() {
        // Reference bytes from TensorBoard's generated event_pb2: Event(wall_time=1.5, step=3,
        // summary=Summary(value=[Value(tag="loss", simple_value=-0.25)])).SerializeToString().
        let expected = [
            0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, // wall_time 1.5
            0x10, 0x03, // step 3
            0x2a, 0x0d, 0x0a, 0x0b, // summary { value {
            0x0a, 0x04, b'l', b'o', b's', b's', // tag "loss"
            0x15, 0, 0, 0x80, 0xbe, // simple_value -0.25
        ];
        assert_eq!(scalar_event(1.5, 3, "loss", -0.25), expected);
    }

    /// Splits TFRecord bytes back into payloads, checking both checksums of every record.
    fn read_records(mut bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut records = Vec::new();
        while !bytes.is_empty() {
            let (len, rest) = bytes.split_at(8);
            let (len_crc, rest) = rest.split_at(4);
            assert_eq!(masked_crc32c(len).to_le_bytes(), len_crc, "length crc");
            let n = u64::from_le_bytes(len.try_into().unwrap()) as usize;
            let (data, rest) = rest.split_at(n);
            let (data_crc, rest) = rest.split_at(4);
            assert_eq!(masked_crc32c(data).to_le_bytes(), data_crc, "data crc");
            records.push(data.to_vec());
            bytes = rest;
        }
        records
    }

    #[test]
    fn record_framing_round_trips() {
        let payloads: [&[u8]; 3] = [b"", b"brain.Event:2", &[0xab; 300]];
        let mut file = Vec::new();
        for p in payloads {
            write_record(&mut file, p).unwrap();
        }
        assert_eq!(
            file.len(),
            payloads.iter().map(|p| 16 + p.len()).sum::<usize>()
        );
        assert_eq!(read_records(&file), payloads);
    }

    #[test]
    fn writer_writes_header_then_scalars() {
        let dir = std::env::temp_dir().join(format!("parallax-tb-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut w = EventWriter::create(&dir).unwrap();
        w.scalar("loss", 7, 0.5).unwrap();
        w.flush().unwrap();

        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1);
        let name = files[0].file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let records = read_records(&std::fs::read(&files[0]).unwrap());
        assert_eq!(records.len(), 2);
        // Header: wall_time, then file_version.
        assert_eq!(records[0].len(), 24);
        assert_eq!(&records[0][9..], b"\x1a\x0dbrain.Event:2");
        // Scalar: all but the wall time is fixed.
        let wall = f64::from_le_bytes(records[1][1..9].try_into().unwrap());
        assert!(wall > 1.6e9, "wall_time {wall}");
        assert_eq!(records[1], scalar_event(wall, 7, "loss", 0.5));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
