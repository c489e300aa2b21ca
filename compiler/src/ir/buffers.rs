//! Buffers: the schedule pass's assignment of stored values to memory, and the memory a step
//! takes. An annotation of the graph that the plan carries.

use super::{DType, NodeIndex};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Buffer {
    pub dtype: DType,
    /// Its size in elements at the plan's batch size.
    pub elements: u64,
    /// Holds a parameter, optimizer state or input for the whole run.
    pub dedicated: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Memory {
    pub parameter_bytes: u64,
    pub optimizer_state_bytes: u64,
    /// BatchNorm's running means and variances: state, but not the optimizer's.
    pub statistics_bytes: u64,
    /// A decode step's key and value caches (`passes::compile_decode`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_bytes: u64,
    pub input_bytes: u64,
    /// The reused buffers of intermediate values.
    pub activation_bytes: u64,
    /// Live bytes at the fullest moment of a step (dedicated buffers included).
    pub peak_bytes: u64,
    /// What the intermediates would take with no reuse.
    pub activation_bytes_without_reuse: u64,
}

impl Memory {
    /// Parameters, optimizer state, running statistics, caches and inputs: held for the whole
    /// run.
    pub fn dedicated_bytes(&self) -> u64 {
        self.parameter_bytes
            .saturating_add(self.optimizer_state_bytes)
            .saturating_add(self.statistics_bytes)
            .saturating_add(self.cache_bytes)
            .saturating_add(self.input_bytes)
    }

    /// What the peak holds beyond the dedicated bytes: activations and workspace.
    pub fn activation_bytes_at_peak(&self) -> u64 {
        self.peak_bytes.saturating_sub(self.dedicated_bytes())
    }
}

#[derive(Debug, Clone, Default)]
/// Where every stored value lives, and the memory that takes.
pub struct BufferSchedule {
    pub buffer_of: HashMap<NodeIndex, usize>,
    pub buffers: Vec<Buffer>,
    pub memory: Memory,
    /// The batch size the sizes are stated at.
    pub batch: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
