//! The device grid of a partitioned run: data-parallel ranks, tensor-parallel ranks and
//! pipeline stages (what simulated devices, the memory check and a run's record share).

/// The device grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    /// Data-parallel ranks.
    pub dp: usize,
    /// Tensor-parallel ranks (the plan must be built for this degree).
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
}

impl Grid {
    pub fn devices(&self) -> usize {
        self.dp * self.tp * self.pp
    }
}
