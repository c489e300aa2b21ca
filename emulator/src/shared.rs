//! A block's shared memory with the sanitizer's bookkeeping: which bytes were written
//! (initcheck), who wrote and read each 4-byte word since the last barrier (racecheck), and
//! which words a `cp.async` will still write (pending copies).
//!
//! Racecheck is strict: any two different threads touching one word in one barrier
//! interval, one of them writing, is a race, lanes of the same warp included (even in the
//! same instruction, e.g. two lanes storing to one address), as compute-sanitizer's
//! racecheck reports intra-warp hazards. Words are the unit, so two threads writing the two
//! halves of one word also count.

/// Where shared addresses start in the shared window (so a zero address is out of bounds).
pub(crate) const SHARED_BASE: u64 = 0x400;

#[derive(Debug, Clone, Copy, Default)]
struct Word {
    /// Writer thread + 1 in epoch `wepoch` (0: none).
    writer: u32,
    wepoch: u32,
    /// First reader thread + 1 in epoch `repoch`; `multi` when another thread read too.
    reader: u32,
    repoch: u32,
    multi: bool,
    /// cp.async copies still to land here.
    pending: u16,
}

/// What an access ran into.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Hazard {
    /// Another thread (index in the block) that raced with this access.
    pub race: Option<(u32, bool)>,
    /// A pending cp.async destination was touched.
    pub pending: bool,
}

pub(crate) struct Shared {
    data: Vec<u8>,
    written: Vec<bool>,
    words: Vec<Word>,
    /// Barrier intervals so far (starts at 1 so that epoch 0 means "never").
    epoch: u32,
}

impl Shared {
    pub fn new(bytes: u32) -> Shared {
        let n = bytes as usize;
        Shared {
            data: vec![0; n],
            written: vec![false; n],
            words: vec![Word::default(); n.div_ceil(4)],
            epoch: 1,
        }
    }

    pub fn size(&self) -> u64 {
        self.data.len() as u64
    }

    /// The offset of `len` bytes at shared address `addr`, if inside.
    pub fn offset(&self, addr: u64, len: u64) -> Option<usize> {
        let off = addr.checked_sub(SHARED_BASE)?;
        (off.checked_add(len)? <= self.size()).then_some(off as usize)
    }

    /// A barrier: accesses after it are ordered after those before.
    pub fn barrier(&mut self) {
        self.epoch += 1;
    }

    fn words(off: usize, len: usize) -> std::ops::Range<usize> {
        off / 4..(off + len).div_ceil(4)
    }

    /// Reads `out.len()` bytes at offset `off` as thread `t`; returns whether all were
    /// written, and any hazard.
    pub fn read(&mut self, off: usize, out: &mut [u8], t: u32) -> (bool, Hazard) {
        let len = out.len();
        out.copy_from_slice(&self.data[off..off + len]);
        let init = self.written[off..off + len].iter().all(|&w| w);
        let me = t + 1;
        let mut h = Hazard::default();
        for w in &mut self.words[Self::words(off, len)] {
            if w.pending > 0 {
                h.pending = true;
            }
            if w.wepoch == self.epoch && w.writer != me && h.race.is_none() {
                h.race = Some((w.writer - 1, true));
            }
            if w.repoch != self.epoch {
                w.repoch = self.epoch;
                w.reader = me;
                w.multi = false;
            } else if w.reader != me {
                w.multi = true;
            }
        }
        (init, h)
    }

    /// Writes `bytes` at offset `off` as thread `t`; returns any hazard.
    pub fn write(&mut self, off: usize, bytes: &[u8], t: u32) -> Hazard {
        let h = self.write_inner(off, bytes, t);
        Hazard {
            pending: self.words[Self::words(off, bytes.len())]
                .iter()
                .any(|w| w.pending > 0),
            ..h
        }
    }

    fn write_inner(&mut self, off: usize, bytes: &[u8], t: u32) -> Hazard {
        let len = bytes.len();
        self.data[off..off + len].copy_from_slice(bytes);
        self.written[off..off + len].fill(true);
        let me = t + 1;
        let mut h = Hazard::default();
        for w in &mut self.words[Self::words(off, len)] {
            if h.race.is_none() {
                if w.wepoch == self.epoch && w.writer != me {
                    h.race = Some((w.writer - 1, true));
                } else if w.repoch == self.epoch && (w.multi || w.reader != me) {
                    // The other reader is the first one, or another when `multi`.
                    let other = if w.reader != me {
                        w.reader - 1
                    } else {
                        u32::MAX
                    };
                    h.race = Some((other, false));
                }
            }
            w.writer = me;
            w.wepoch = self.epoch;
        }
        h
    }

    /// Whether any of `len` bytes at `off` awaits a cp.async.
    pub fn is_pending(&self, off: usize, len: usize) -> bool {
        self.words[Self::words(off, len)]
            .iter()
            .any(|w| w.pending > 0)
    }

    /// A cp.async issued to `len` bytes at `off` (lands at its wait).
    pub fn add_pending(&mut self, off: usize, len: usize) {
        for w in &mut self.words[Self::words(off, len)] {
            w.pending = w.pending.saturating_add(1);
        }
    }

    /// A cp.async landing: its pending mark goes, then it writes as thread `t`.
    pub fn land(&mut self, off: usize, bytes: &[u8], t: u32) -> Hazard {
        for w in &mut self.words[Self::words(off, bytes.len())] {
            w.pending = w.pending.saturating_sub(1);
        }
        self.write_inner(off, bytes, t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn races_need_two_threads_and_a_write_in_one_interval() {
        let mut s = Shared::new(16);
        assert!(s.write(0, &[1; 4], 0).race.is_none());
        let mut b = [0; 4];
        assert!(s.read(0, &mut b, 0).1.race.is_none());
        assert_eq!(s.read(0, &mut b, 1).1.race, Some((0, true)));
        s.barrier();
        assert!(s.read(0, &mut b, 1).1.race.is_none());
        assert_eq!(s.write(0, &[2; 4], 0).race, Some((1, false)));
        s.barrier();
        let (init, _) = s.read(4, &mut b, 0);
        assert!(!init);
        s.add_pending(8, 8);
        assert!(s.read(8, &mut b, 0).1.pending);
        assert!(s.land(8, &[0; 8], 0).race.is_none());
        assert!(!s.is_pending(8, 8));
        assert_eq!(s.offset(SHARED_BASE + 12, 4), Some(12));
        assert_eq!(s.offset(SHARED_BASE + 13, 4), None);
        assert_eq!(s.offset(0, 4), None);
    }
}
