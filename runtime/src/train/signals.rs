//! SIGINT and SIGTERM ask a run to stop after its current step, with a checkpoint
//! (`TrainConfig::stop`); a second one ends the process at once (exit 130 or 143).

use signal_hook::consts::{SIGINT, SIGTERM};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;

/// Installs the handlers; the returned number is the signal received (0 before any).
pub fn stop_on_signals() -> Result<Arc<AtomicUsize>, String> {
    let which = Arc::new(AtomicUsize::new(0));
    let asked = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        // Registered first, so it sees the flag as it was before this signal set it.
        signal_hook::flag::register_conditional_shutdown(signal, 128 + signal, Arc::clone(&asked))
            .and_then(|_| signal_hook::flag::register(signal, Arc::clone(&asked)))
            .and_then(|_| {
                signal_hook::flag::register_usize(signal, Arc::clone(&which), signal as usize)
            })
            .map_err(|e| format!("cannot handle signal {signal}: {e}"))?;
    }
    Ok(which)
}
