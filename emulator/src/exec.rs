//! Runs a launch. (To be written.)

use crate::{EmuError, Launch, Memory, Module, Options, Report};

pub(crate) fn run(
    _module: &Module,
    launch: &Launch,
    _memory: &mut Memory,
    _options: &Options,
) -> Result<Report, EmuError> {
    Err(EmuError::NoEntry(launch.entry.to_string()))
}
