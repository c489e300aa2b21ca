//! The process-wide state behind every entry point, and the guard that keeps panics from
//! crossing the C boundary.

use cudarc::driver::sys::CUresult;
use parallax_emulator::{Memory, Module};
use std::cell::Cell;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

/// An H200's memory as its driver reports it (143771 MiB).
pub const H200_MEMORY: u64 = 143_771 * 1024 * 1024;
/// Dynamic shared memory a launch may use without opting in (48 KB).
pub const DEFAULT_SHARED: u32 = 48 * 1024;
/// The most shared memory per block after opting in (227 KB on sm_90).
pub const OPTIN_SHARED: u32 = 227 * 1024;

/// The emulated machine, from the environment: `PARALLAX_EMULATED_GPUS` (default 1),
/// `PARALLAX_EMULATED_GPU_MEMORY` (bytes per device, default an H200's),
/// `PARALLAX_EMULATED_STREAM_SEED` (when set, independent streams' queued work runs
/// interleaved in an order drawn from this seed, rather than stream by stream, and may run
/// before a synchronisation asks for it).
#[derive(Debug, Clone)]
pub struct Config {
    pub gpus: i32,
    pub memory: u64,
    pub stream_seed: Option<u64>,
}

impl Config {
    fn from_env() -> Config {
        fn var<T: std::str::FromStr>(name: &str) -> Option<T> {
            std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
        }
        Config {
            gpus: var::<u32>("PARALLAX_EMULATED_GPUS").unwrap_or(1).min(4096) as i32,
            memory: var("PARALLAX_EMULATED_GPU_MEMORY").unwrap_or(H200_MEMORY),
            stream_seed: var("PARALLAX_EMULATED_STREAM_SEED"),
        }
    }
}

pub struct Function {
    pub module: Arc<Module>,
    pub entry: String,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`.
    pub max_dynamic: u32,
}

#[derive(Default)]
pub struct Event {
    pub flags: u32,
    pub recorded: Option<Instant>,
    /// The stream of the last `cuEventRecord`, while that record has not run yet.
    pub pending: Option<usize>,
}

pub struct BlasHandle {
    pub stream: usize,
    pub math: i32,
}

#[derive(Default)]
pub struct State {
    pub config: Option<Config>,
    pub memory: Memory,
    /// Each live allocation's device and size.
    pub allocs: HashMap<u64, (usize, u64)>,
    /// Bytes allocated per device.
    pub used: Vec<u64>,
    /// Primary context retain counts, per device.
    pub retained: Vec<u32>,
    pub modules: HashMap<usize, (Arc<Module>, Vec<usize>)>,
    pub functions: HashMap<usize, Function>,
    pub streams: HashMap<usize, u32>,
    pub events: HashMap<usize, Event>,
    pub blas: HashMap<usize, BlasHandle>,
    /// Each created stream's work not yet run (it runs at a synchronisation, an event
    /// wait, or work on the legacy stream, which waits for blocking streams).
    pub queues: HashMap<usize, Vec<crate::ops::Op>>,
    /// Streams capturing, with what they captured.
    pub captures: HashMap<usize, crate::ops::Capture>,
    pub graphs: HashMap<usize, Arc<Vec<crate::ops::Op>>>,
    pub execs: HashMap<usize, Arc<Vec<crate::ops::Op>>>,
    /// A launch failed: every later call on the context fails so (as on a GPU).
    pub sticky: Option<CUresult>,
    /// The state of the generator that orders independent streams (from the seed).
    pub order: u64,
    next: usize,
}

impl State {
    /// A fresh handle value (never null, never a special stream value).
    pub fn handle(&mut self) -> usize {
        self.next += 1;
        0x10_0000 + self.next * 16
    }

    pub fn config(&self) -> Result<&Config, CUresult> {
        self.config
            .as_ref()
            .ok_or(CUresult::CUDA_ERROR_NOT_INITIALIZED)
    }

    pub fn device(&self, dev: i32) -> Result<usize, CUresult> {
        let n = self.config()?.gpus;
        if (0..n).contains(&dev) {
            Ok(dev as usize)
        } else {
            Err(CUresult::CUDA_ERROR_INVALID_DEVICE)
        }
    }

    /// The calling thread's current device, with the context usable.
    pub fn current(&self) -> Result<usize, CUresult> {
        self.config()?;
        if let Some(e) = self.sticky {
            return Err(e);
        }
        match CURRENT.with(Cell::get) {
            0 => Err(CUresult::CUDA_ERROR_INVALID_CONTEXT),
            c => {
                let dev = context_device(c).ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
                if self.retained.get(dev).copied().unwrap_or(0) == 0 {
                    return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
                }
                Ok(dev)
            }
        }
    }

    /// Checks a stream handle: null (the legacy default stream), `CU_STREAM_LEGACY`,
    /// `CU_STREAM_PER_THREAD`, or one created and not destroyed.
    pub fn stream(&self, s: usize) -> Result<(), CUresult> {
        if s <= 2 || self.streams.contains_key(&s) {
            Ok(())
        } else {
            Err(CUresult::CUDA_ERROR_INVALID_HANDLE)
        }
    }

    pub fn init(&mut self) {
        if self.config.is_none() {
            let c = Config::from_env();
            self.used = vec![0; c.gpus as usize];
            self.order = c.stream_seed.unwrap_or(0);
            self.retained = vec![0; c.gpus as usize];
            self.config = Some(c);
        }
    }
}

thread_local! {
    /// The calling thread's current context (0: none).
    pub static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// A device's primary context handle.
pub fn context_of(dev: usize) -> usize {
    0x1000 + dev * 16
}

pub fn context_device(ctx: usize) -> Option<usize> {
    (ctx >= 0x1000 && ctx.is_multiple_of(16) && ctx < 0x1000 + 16 * 4096)
        .then(|| (ctx - 0x1000) / 16)
}

static STATE: OnceLock<Mutex<State>> = OnceLock::new();

/// The state, locked (a panic while it was held does not make it unusable).
pub fn state() -> MutexGuard<'static, State> {
    STATE
        .get_or_init(|| Mutex::new(State::default()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Runs an entry point's body: its error, or `CUDA_ERROR_UNKNOWN` (with a line on stderr)
/// if it panicked.
pub fn guard(name: &str, f: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    guarded(name, CUresult::CUDA_ERROR_UNKNOWN, || {
        f().map(|()| CUresult::CUDA_SUCCESS)
    })
}

/// Runs the body of entry point `name` of any library: the status it returns or fails with,
/// or `panicked` (with a line on stderr) if it panicked.
pub fn guarded<S>(name: &str, panicked: S, f: impl FnOnce() -> Result<S, S>) -> S {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(status) | Err(status)) => status,
        Err(_) => {
            eprintln!("emulated GPU: {name} panicked (a bug in the emulated GPU)");
            panicked
        }
    }
}

/// Writes `v` through an out-pointer, or fails with `CUDA_ERROR_INVALID_VALUE` if it is null.
///
/// # Safety
/// `p` is null or valid for a write of `T`.
pub unsafe fn put<T>(p: *mut T, v: T) -> Result<(), CUresult> {
    if p.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    p.write(v);
    Ok(())
}
