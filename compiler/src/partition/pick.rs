//! Which of the planner's candidates a run can use beyond fitting: what `train` can feed
//! (data-parallel ranks up to the micro-shards), a ZeRO stage or schedule it must keep, and
//! its preference for splits whose bits do not depend on the device count.

use super::{Candidate, PipelineSchedule};

/// Which candidates a run can use, beyond fitting: what `train` can run (see
/// `target::split`). The default takes any.
#[derive(Debug, Clone, Copy)]
pub struct Pick {
    /// The most data-parallel ranks (one micro-shard each at least).
    pub max_dp: u32,
    /// Only this ZeRO stage (a candidate with one data-parallel rank has nothing to shard,
    /// and matches any).
    pub zero: Option<u8>,
    /// Only this pipeline schedule.
    pub schedule: Option<PipelineSchedule>,
    /// The fastest without tensor parallelism, when one fits (its bits do not depend on the
    /// device count).
    pub prefer_tp_free: bool,
}

impl Default for Pick {
    fn default() -> Pick {
        Pick {
            max_dp: u32::MAX,
            zero: None,
            schedule: None,
            prefer_tp_free: false,
        }
    }
}

impl Pick {
    pub(super) fn allows(&self, c: &Candidate) -> bool {
        c.strategy.dp <= self.max_dp
            && self.zero.is_none_or(|z| c.zero == z || c.strategy.dp == 1)
            && self.schedule.is_none_or(|s| c.schedule == s)
    }
}
