//! Bugs planted on purpose, for tests only: `PARALLAX_PLANT_BUG` names one, and the CUDA
//! path then makes that mistake, so that a test on the emulated GPU can prove it is caught
//! (`tests/emulated_gpu_faults.rs`). Never set outside those tests; unset, or any other
//! value, changes nothing. Read here only.

use std::sync::OnceLock;

/// The variable that plants a bug.
pub const ENV: &str = "PARALLAX_PLANT_BUG";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bug {
    /// `drop-launch-param`: every kernel launch passes one parameter fewer than its
    /// entry declares (the first is left out).
    DropLaunchParam,
    /// `no-sync-before-read`: a replayed CUDA graph's stream is not joined back to the
    /// executor's before the host reads the step's results.
    NoSyncBeforeRead,
    /// `sync-copy-in-capture`: a step's constants are written with a synchronous
    /// host-to-device copy, which a CUDA graph's capture cannot record.
    SyncCopyInCapture,
}

/// Whether `bug` is planted in this process.
pub(super) fn planted(bug: Bug) -> bool {
    static PLANTED: OnceLock<Option<Bug>> = OnceLock::new();
    let which = PLANTED.get_or_init(|| match std::env::var(ENV).ok()?.trim() {
        "drop-launch-param" => Some(Bug::DropLaunchParam),
        "no-sync-before-read" => Some(Bug::NoSyncBeforeRead),
        "sync-copy-in-capture" => Some(Bug::SyncCopyInCapture),
        _ => None,
    });
    *which == Some(bug)
}
