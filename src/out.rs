//! Standard output for every command. A reader that closed the pipe early (`| head -1`) ends
//! the output quietly: nothing more is written, and the command still finishes its work (a
//! training run its run). Any other write error (`> /dev/full`, a full disk) is reported
//! once on stderr and fails the command with exit 1. `println!` would panic on either.

/// `eprintln!` that ignores a closed or failing stderr (`2>&1 | head`) instead of panicking:
/// there is nowhere left to report it.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// `eprint!`, as `errln!`.
macro_rules! err {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr().lock(), $($arg)*);
    }};
}

use crate::Exit;
use std::io::{ErrorKind, Write};
use std::sync::atomic::{AtomicU8, Ordering};

const OPEN: u8 = 0;
const PIPE_CLOSED: u8 = 1;
const FAILED: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(OPEN);

/// Writes `text` to stdout and flushes it.
pub(crate) fn emit(text: &str) -> Result<(), Exit> {
    match STATE.load(Ordering::Relaxed) {
        PIPE_CLOSED => return Ok(()),
        FAILED => return Err(Exit(1)),
        _ => {}
    }
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => {
            STATE.store(PIPE_CLOSED, Ordering::Relaxed);
            Ok(())
        }
        Err(e) => {
            STATE.store(FAILED, Ordering::Relaxed);
            errln!("error: cannot write to standard output: {e}");
            Err(Exit(1))
        }
    }
}

/// Whether an earlier write to stdout failed (other than a closed pipe).
pub(crate) fn failed() -> bool {
    STATE.load(Ordering::Relaxed) == FAILED
}

/// `print!` that returns a write error as `Exit` (use with `?`).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::emit(&format!($($arg)*))
    };
}

/// `println!` that returns a write error as `Exit` (use with `?`).
macro_rules! outln {
    () => {
        $crate::out::emit("\n")
    };
    ($($arg:tt)*) => {
        $crate::out::emit(&format!("{}\n", format_args!($($arg)*)))
    };
}
