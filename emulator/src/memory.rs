//! The global address space: allocations at 256-byte aligned addresses with unmapped gaps
//! between them (so an access past an allocation's end falls in no allocation, as memcheck
//! sees it), each with a record of which bytes were ever written (initcheck).

use std::collections::BTreeMap;

/// Where the first allocation starts; address 0 and everything below stay unmapped.
const BASE: u64 = 0x7f00_0000_0000;
/// Allocations start at multiples of this (as `cuMemAlloc`'s, which are 256-byte aligned).
const ALIGN: u64 = 256;
/// Unmapped bytes between two allocations.
const GAP: u64 = 4096;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MemError {
    #[error("{len} bytes at {addr:#x} are outside every allocation{}", near(.nearest))]
    OutOfBounds {
        addr: u64,
        len: u64,
        /// The allocation nearest below the address: `(label, base, size)`.
        nearest: Option<(String, u64, u64)>,
    },
    #[error("{addr:#x} is not the start of an allocation")]
    BadFree { addr: u64 },
}

fn near(n: &Option<(String, u64, u64)>) -> String {
    match n {
        Some((label, base, size)) => {
            format!(
                " (nearest below: `{label}`, {size} bytes at {base:#x}, ending at {:#x})",
                base + size
            )
        }
        None => String::new(),
    }
}

#[derive(Debug, Clone)]
struct Allocation {
    label: String,
    data: Vec<u8>,
    /// One bit per byte: written since allocated.
    init: Vec<u64>,
}

impl Allocation {
    fn mark(&mut self, off: usize, len: usize) {
        for i in off..off + len {
            self.init[i / 64] |= 1 << (i % 64);
        }
    }

    fn initialized(&self, off: usize, len: usize) -> bool {
        (off..off + len).all(|i| self.init[i / 64] & (1 << (i % 64)) != 0)
    }
}

/// The device's global memory.
#[derive(Debug, Clone, Default)]
pub struct Memory {
    allocations: BTreeMap<u64, Allocation>,
    next: u64,
}

impl Memory {
    pub fn new() -> Memory {
        Memory::default()
    }

    /// A new allocation of `bytes` bytes, none of them written yet; returns its address.
    pub fn alloc(&mut self, bytes: u64, label: impl Into<String>) -> u64 {
        let base = if self.next == 0 { BASE } else { self.next };
        self.next = (base + bytes.max(1) + GAP).div_ceil(ALIGN) * ALIGN;
        self.allocations.insert(
            base,
            Allocation {
                label: label.into(),
                data: vec![0; bytes as usize],
                init: vec![0; (bytes as usize).div_ceil(64)],
            },
        );
        base
    }

    /// Frees the allocation starting at `addr` (its addresses are never handed out again).
    pub fn free(&mut self, addr: u64) -> Result<(), MemError> {
        self.allocations
            .remove(&addr)
            .map(|_| ())
            .ok_or(MemError::BadFree { addr })
    }

    fn locate(&self, addr: u64, len: u64) -> Result<(u64, usize), MemError> {
        let hit = self.allocations.range(..=addr).next_back();
        match hit {
            Some((&base, a))
                if addr
                    .checked_add(len)
                    .is_some_and(|end| end <= base + a.data.len() as u64) =>
            {
                Ok((base, (addr - base) as usize))
            }
            _ => Err(MemError::OutOfBounds {
                addr,
                len,
                nearest: hit.map(|(&b, a)| (a.label.clone(), b, a.data.len() as u64)),
            }),
        }
    }

    /// Writes `bytes` at `addr` (all inside one allocation), marking them written.
    pub fn write(&mut self, addr: u64, bytes: &[u8]) -> Result<(), MemError> {
        let (base, off) = self.locate(addr, bytes.len() as u64)?;
        let a = self.allocations.get_mut(&base).expect("located");
        a.data[off..off + bytes.len()].copy_from_slice(bytes);
        a.mark(off, bytes.len());
        Ok(())
    }

    /// Reads `out.len()` bytes at `addr` (written or not).
    pub fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        let (base, off) = self.locate(addr, out.len() as u64)?;
        out.copy_from_slice(&self.allocations[&base].data[off..off + out.len()]);
        Ok(())
    }

    /// Reads `len` bytes at `addr` and whether every one of them was written.
    pub fn load(&self, addr: u64, len: usize) -> Result<(&[u8], bool), MemError> {
        let (base, off) = self.locate(addr, len as u64)?;
        let a = &self.allocations[&base];
        Ok((&a.data[off..off + len], a.initialized(off, len)))
    }

    /// Reads `n` values at `addr`, f32 or bf16 (widened exactly) elements, and whether every
    /// byte of them was written.
    pub fn load_f32(&self, addr: u64, n: usize, bf16: bool) -> Result<(Vec<f32>, bool), MemError> {
        let (data, written) = self.load(addr, n * if bf16 { 2 } else { 4 })?;
        let v = if bf16 {
            data.chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                .collect()
        } else {
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        Ok((v, written))
    }

    /// Copies `bytes` bytes from `src` to `dst` (a device-to-device copy); the destination's
    /// bytes are written where the source's were.
    pub fn copy(&mut self, dst: u64, src: u64, bytes: u64) -> Result<(), MemError> {
        let (sb, so) = self.locate(src, bytes)?;
        let (db, doff) = self.locate(dst, bytes)?;
        let n = bytes as usize;
        let s = &self.allocations[&sb];
        let data = s.data[so..so + n].to_vec();
        let init: Vec<bool> = (so..so + n).map(|i| s.initialized(i, 1)).collect();
        let d = self.allocations.get_mut(&db).expect("located");
        d.data[doff..doff + n].copy_from_slice(&data);
        for (i, w) in init.into_iter().enumerate() {
            if w {
                d.mark(doff + i, 1);
            }
        }
        Ok(())
    }

    /// Writes f32 values at `addr`.
    pub fn write_f32(&mut self, addr: u64, values: &[f32]) -> Result<(), MemError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write(addr, &bytes)
    }

    /// Reads `n` f32 values at `addr`.
    pub fn read_f32(&self, addr: u64, n: usize) -> Result<Vec<f32>, MemError> {
        let mut bytes = vec![0u8; 4 * n];
        self.read(addr, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Whether every one of `len` bytes at `addr` was written (false outside allocations).
    pub fn initialized(&self, addr: u64, len: u64) -> bool {
        self.load(addr, len as usize).is_ok_and(|(_, w)| w)
    }

    /// The label of the allocation holding `addr`, if any.
    pub fn label(&self, addr: u64) -> Option<&str> {
        let (base, _) = self.locate(addr, 1).ok()?;
        Some(&self.allocations[&base].label)
    }

    /// The address of the first allocation labelled `label` (the interpreter's `.global`
    /// variables live in allocations named after them).
    pub fn find_label(&self, label: &str) -> Option<u64> {
        self.allocations
            .iter()
            .find(|(_, a)| a.label == label)
            .map(|(&b, _)| b)
    }

    /// Marks `len` bytes at `addr` as never written (a buffer reused for a new value).
    pub fn forget(&mut self, addr: u64, len: u64) -> Result<(), MemError> {
        let (base, off) = self.locate(addr, len)?;
        let a = self.allocations.get_mut(&base).expect("located");
        for i in off..off + len as usize {
            a.init[i / 64] &= !(1 << (i % 64));
        }
        Ok(())
    }

    /// Writes `bytes` at `addr` from a kernel's store: the same as `write`, for the
    /// interpreter (kept apart so a future write barrier has one place).
    pub(crate) fn store(&mut self, addr: u64, bytes: &[u8]) -> Result<(), MemError> {
        self.write(addr, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_apart_and_bounded() {
        let mut m = Memory::new();
        let a = m.alloc(10, "a");
        let b = m.alloc(300, "b");
        assert_eq!(a % 256, 0);
        assert_eq!(b % 256, 0);
        assert!(b >= a + 10 + GAP);
        m.write(a, &[1; 10]).unwrap();
        assert!(m.write(a + 8, &[1; 4]).is_err());
        let e = m.load(a + 10, 1).unwrap_err();
        assert!(e.to_string().contains("`a`"), "{e}");
        assert!(m.initialized(a, 10));
        assert!(!m.initialized(b, 1));
        m.copy(b, a, 10).unwrap();
        assert!(m.initialized(b, 10) && !m.initialized(b + 10, 1));
        m.forget(b, 4).unwrap();
        assert!(!m.initialized(b, 4) && m.initialized(b + 4, 6));
        m.free(a).unwrap();
        assert!(m.read(a, &mut [0; 1]).is_err());
        assert!(m.free(a).is_err());
    }
}
