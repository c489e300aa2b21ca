//! What the sanitizer reports: one finding per bad access or synchronisation, naming the
//! kernel, the PTX line, the block and thread, and the address.

/// The kinds of finding, as compute-sanitizer's tools name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FindingKind {
    /// memcheck: a global access outside every allocation.
    GlobalOutOfBounds,
    /// memcheck: a shared access beyond the block's declared shared memory (static and
    /// dynamic).
    SharedOutOfBounds,
    /// memcheck: an access whose address is not a multiple of its size.
    Misaligned,
    /// initcheck: a read of global or shared memory never written.
    UninitializedRead,
    /// racecheck: two threads of a block touch the same shared address, one writing, with
    /// no barrier between them.
    SharedRace,
    /// synccheck: a barrier reached by part of a warp, or not by every thread of the block.
    BarrierDivergence,
    /// synccheck: a warp-wide instruction (`shfl.sync`, `vote.sync`, `mma.sync`,
    /// `ldmatrix.sync`) whose member mask is not the lanes that reached it together.
    WarpDivergence,
    /// A read of a `cp.async` destination before the `cp.async.wait_group` that completes it.
    AsyncCopyPending,
}

/// One thing the sanitizer found.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub kind: FindingKind,
    /// The entry (kernel) name.
    pub entry: String,
    /// The 1-based line of the instruction in the PTX text given to `Module::parse`.
    pub line: usize,
    pub block: [u32; 3],
    pub thread: [u32; 3],
    pub address: Option<u64>,
    /// What happened, in words (sizes, the other thread of a race, the allocation nearby).
    pub detail: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "{:?} in `{}` at PTX line {}, block {:?}, thread {:?}",
            self.kind, self.entry, self.line, self.block, self.thread
        )?;
        if let Some(a) = self.address {
            write!(f, ", address {a:#x}")?;
        }
        write!(f, ": {}", self.detail)
    }
}
