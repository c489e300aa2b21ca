//! Work on a stream, as a value: what runs when it is enqueued, or, on a stream being
//! captured, what the capture records for a graph to replay (the driver API's "Graph
//! Management" and stream capture). The documented capture rules are enforced: the legacy
//! stream cannot be captured, nor used while a blocking stream captures; synchronising a
//! capturing stream fails and invalidates the capture; a thread whose capture's mode forbids
//! "potentially unsafe API calls" (`cuStreamBeginCapture`'s modes) cannot allocate, free, or
//! copy or set memory synchronously. A graph launch is stream-ordered work like any other.

use crate::state::{guard, put, state, State};
use cudarc::driver::sys::{CUgraph, CUgraphExec, CUresult, CUstream};
use parallax_emulator::blas::{self, Gemm, Scaled};
use parallax_emulator::{EmuError, Launch, Module, Options, ParamValue};
use std::ffi::{c_int, c_ulonglong};
use std::sync::Arc;

pub enum Op {
    Launch {
        module: Arc<Module>,
        entry: String,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        params: Vec<ParamValue>,
    },
    Copy {
        dst: u64,
        src: u64,
        n: u64,
    },
    Write {
        dst: u64,
        bytes: Vec<u8>,
    },
    /// From host memory, read when the op runs (as a captured copy reads it at each launch).
    HostToDevice {
        dst: u64,
        src: usize,
        n: usize,
    },
    DeviceToHost {
        dst: usize,
        src: u64,
        n: usize,
    },
    Gemm {
        name: &'static str,
        gemm: Gemm,
        scaled: Scaled,
    },
    /// `cuEventRecord`: the event completes when the stream reaches it.
    Record {
        event: usize,
    },
    /// `cuGraphLaunch`: the graph's work, in order, when the stream reaches it.
    Graph(Arc<Vec<Op>>),
}

/// A capture in progress on a stream.
pub struct Capture {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL` (0), `THREAD_LOCAL` (1) or `RELAXED` (2).
    pub mode: c_int,
    /// The thread that began it (the modes restrict that thread's calls, or every thread's).
    pub thread: std::thread::ThreadId,
    pub ops: Vec<Op>,
    /// Why the capture became invalid (it then ends with
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`).
    pub invalid: Option<String>,
}

fn bad(what: &str, e: impl std::fmt::Display) -> CUresult {
    eprintln!("emulated GPU: {what}: {e}");
    CUresult::CUDA_ERROR_INVALID_VALUE
}

impl State {
    /// Whether `stream` is the legacy default stream (null or `CU_STREAM_LEGACY`).
    fn legacy(stream: usize) -> bool {
        stream <= 1
    }

    /// Runs `op` on `stream`, or records it there while the stream captures.
    pub fn submit(&mut self, stream: usize, op: Op) -> Result<(), CUresult> {
        self.stream(stream)?;
        if let Some(c) = self.captures.get_mut(&stream) {
            c.ops.push(op);
            return Ok(());
        }
        if stream <= 2 {
            // The legacy (and per-thread) stream runs now, after the blocking streams' work
            // (the legacy stream waits for it; non-blocking streams are not waited for).
            if Self::legacy(stream) {
                self.no_implicit_sync("work on the legacy stream")?;
                self.flush_blocking()?;
            }
            return self.run(&op);
        }
        self.queues.entry(stream).or_default().push(op);
        self.run_early()
    }

    /// With `PARALLAX_EMULATED_STREAM_SEED`, queued work may also run before anything asks
    /// for it, as a GPU may finish it early: after each enqueue, a stream drawn from the
    /// generator runs a drawn number (possibly none) of its oldest operations. Any prefix of
    /// a queue may run at any time: an event wait ran the awaited work when it was made.
    fn run_early(&mut self) -> Result<(), CUresult> {
        if self.config()?.stream_seed.is_none() {
            return Ok(());
        }
        let mut queued: Vec<usize> = self
            .queues
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(&s, _)| s)
            .collect();
        if queued.is_empty() {
            return Ok(());
        }
        queued.sort_unstable();
        let stream = queued[(self.draw() % queued.len() as u64) as usize];
        let len = self.queues.get(&stream).map_or(0, Vec::len) as u64;
        let k = (self.draw() % (len + 1)) as usize;
        let ops: Vec<Op> = self
            .queues
            .get_mut(&stream)
            .map(|q| q.drain(..k).collect())
            .unwrap_or_default();
        ops.iter().try_for_each(|op| self.run(op))
    }

    /// Runs `stream`'s queued work, in order (the first error is returned, as a
    /// synchronisation reports an asynchronous error).
    pub fn flush(&mut self, stream: usize) -> Result<(), CUresult> {
        let ops = self.queues.remove(&stream).unwrap_or_default();
        ops.iter().try_for_each(|op| self.run(op))
    }

    /// Runs the queued work of every blocking stream.
    pub fn flush_blocking(&mut self) -> Result<(), CUresult> {
        let blocking: Vec<usize> = self
            .queues
            .keys()
            .copied()
            .filter(|s| self.streams.get(s) == Some(&0))
            .collect();
        self.flush_streams(blocking)
    }

    /// Runs every stream's queued work.
    pub fn flush_all(&mut self) -> Result<(), CUresult> {
        let all: Vec<usize> = self.queues.keys().copied().collect();
        self.flush_streams(all)
    }

    /// Runs the queued work of `streams`, which nothing orders between them (an event wait
    /// ran the awaited work when it was made): stream after stream in ascending handle
    /// order, or, with `PARALLAX_EMULATED_STREAM_SEED`, one operation at a time from a
    /// stream drawn from the seeded generator, so a missing event between them shows.
    fn flush_streams(&mut self, mut streams: Vec<usize>) -> Result<(), CUresult> {
        streams.sort_unstable();
        if self.config()?.stream_seed.is_none() {
            return streams.into_iter().try_for_each(|s| self.flush(s));
        }
        let mut queues: Vec<std::collections::VecDeque<Op>> = streams
            .iter()
            .filter_map(|s| self.queues.remove(s))
            .map(Into::into)
            .collect();
        loop {
            queues.retain(|q| !q.is_empty());
            if queues.is_empty() {
                return Ok(());
            }
            let i = (self.draw() % queues.len() as u64) as usize;
            if let Some(op) = queues[i].pop_front() {
                self.run(&op)?;
            }
        }
    }

    /// The next value of the stream-order generator (splitmix64).
    fn draw(&mut self) -> u64 {
        self.order = self.order.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.order;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// "The legacy stream is unusable while a blocking stream is capturing": fails, and
    /// invalidates those captures.
    pub fn no_implicit_sync(&mut self, what: &str) -> Result<(), CUresult> {
        let blocking: Vec<usize> = self
            .captures
            .keys()
            .copied()
            .filter(|s| self.streams.get(s) == Some(&0))
            .collect();
        if blocking.is_empty() {
            return Ok(());
        }
        eprintln!("emulated GPU: {what} while a blocking stream captures");
        for s in blocking {
            if let Some(c) = self.captures.get_mut(&s) {
                c.invalid.get_or_insert_with(|| what.to_string());
            }
        }
        Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    }

    /// A synchronous call (`what`) on `stream`: refused while it captures.
    pub fn no_capture(&mut self, stream: usize, what: &str) -> Result<(), CUresult> {
        if let Some(c) = self.captures.get_mut(&stream) {
            eprintln!("emulated GPU: {what} on a stream being captured");
            c.invalid.get_or_insert_with(|| what.to_string());
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        Ok(())
    }

    /// A potentially unsafe call (`what`: an allocation, a free, a synchronous copy or
    /// memset) by the calling thread: "if the local thread has an ongoing capture sequence
    /// that was not initiated with CU_STREAM_CAPTURE_MODE_RELAXED ..., or if any other
    /// thread has a concurrent capture sequence initiated with CU_STREAM_CAPTURE_MODE_GLOBAL,
    /// this thread is prohibited from potentially unsafe API calls". Refused with
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, invalidating the captures that forbid it.
    pub fn no_unsafe_call(&mut self, what: &str) -> Result<(), CUresult> {
        let me = std::thread::current().id();
        let mut refused = false;
        for c in self.captures.values_mut() {
            let local = c.thread == me && c.mode != 2;
            if local || c.mode == 0 {
                c.invalid.get_or_insert_with(|| what.to_string());
                refused = true;
            }
        }
        if refused {
            eprintln!("emulated GPU: {what} during a stream capture that forbids it");
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        Ok(())
    }

    /// Runs `op` now.
    pub fn run(&mut self, op: &Op) -> Result<(), CUresult> {
        match op {
            Op::Launch {
                module,
                entry,
                grid,
                block,
                shared,
                params,
            } => {
                let launch = Launch {
                    entry,
                    grid: *grid,
                    block: *block,
                    dynamic_shared: *shared,
                    params: params.clone(),
                };
                let r = parallax_emulator::launch(
                    module,
                    &launch,
                    &mut self.memory,
                    &Options::default(),
                );
                self.launched(entry, r)
            }
            Op::Copy { dst, src, n } => self
                .memory
                .copy(*dst, *src, *n)
                .map_err(|e| bad("cuMemcpyDtoD", e)),
            Op::Write { dst, bytes } => self
                .memory
                .write(*dst, bytes)
                .map_err(|e| bad("cuMemset", e)),
            Op::HostToDevice { dst, src, n } => {
                // SAFETY: the caller of the copy promised `n` readable bytes at `src`.
                let bytes = unsafe { std::slice::from_raw_parts(*src as *const u8, *n) };
                self.memory
                    .write(*dst, bytes)
                    .map_err(|e| bad("cuMemcpyHtoD", e))
            }
            Op::DeviceToHost { dst, src, n } => {
                // SAFETY: the caller of the copy promised `n` writable bytes at `dst`.
                let out = unsafe { std::slice::from_raw_parts_mut(*dst as *mut u8, *n) };
                self.memory
                    .read(*src, out)
                    .map_err(|e| bad("cuMemcpyDtoH", e))
            }
            Op::Record { event } => {
                if let Some(e) = self.events.get_mut(event) {
                    e.recorded = Some(std::time::Instant::now());
                    e.pending = None;
                }
                Ok(())
            }
            Op::Graph(ops) => ops.iter().try_for_each(|op| self.run(op)),
            Op::Gemm { name, gemm, scaled } => blas::gemm_scaled(&mut self.memory, gemm, scaled)
                .map_err(|e| {
                    eprintln!("emulated GPU: {name}: {e}");
                    CUresult::CUDA_ERROR_LAUNCH_FAILED
                }),
        }
    }

    /// A launch's outcome: findings (named on stderr) fail it and, as on a GPU, the context.
    fn launched(
        &mut self,
        entry: &str,
        r: Result<parallax_emulator::Report, EmuError>,
    ) -> Result<(), CUresult> {
        match r {
            Ok(report) if report.findings.is_empty() => return Ok(()),
            Ok(report) => {
                for finding in &report.findings {
                    eprintln!("emulated GPU: kernel `{entry}`: sanitizer: {finding}");
                }
            }
            Err(EmuError::BadLaunch { message, .. }) => {
                eprintln!("emulated GPU: cuLaunchKernel(`{entry}`): {message}");
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            Err(e) => {
                eprintln!("emulated GPU: kernel `{entry}`: {e}");
                if let EmuError::Aborted { report, .. } = &e {
                    for finding in &report.findings {
                        eprintln!("emulated GPU: kernel `{entry}`: sanitizer: {finding}");
                    }
                }
            }
        }
        self.sticky = Some(CUresult::CUDA_ERROR_LAUNCH_FAILED);
        Err(CUresult::CUDA_ERROR_LAUNCH_FAILED)
    }
}

#[no_mangle]
pub(crate) extern "C" fn cuStreamBeginCapture_v2(stream: CUstream, mode: c_int) -> CUresult {
    guard("cuStreamBeginCapture_v2", || {
        let mut s = state();
        s.current()?;
        s.stream(stream as usize)?;
        // Modes: GLOBAL 0, THREAD_LOCAL 1, RELAXED 2.
        if !(0..=2).contains(&mode) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // "Capture may not be initiated if stream is CU_STREAM_LEGACY."
        if State::legacy(stream as usize) {
            eprintln!("emulated GPU: cuStreamBeginCapture on the legacy stream");
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        if s.captures.contains_key(&(stream as usize)) {
            return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
        }
        let capture = Capture {
            mode,
            thread: std::thread::current().id(),
            ops: Vec::new(),
            invalid: None,
        };
        s.captures.insert(stream as usize, capture);
        Ok(())
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuStreamEndCapture(
    stream: CUstream,
    graph: *mut CUgraph,
) -> CUresult {
    guard("cuStreamEndCapture", || {
        let mut s = state();
        s.current()?;
        let c = s
            .captures
            .remove(&(stream as usize))
            .ok_or(CUresult::CUDA_ERROR_ILLEGAL_STATE)?;
        if let Some(why) = c.invalid {
            eprintln!("emulated GPU: cuStreamEndCapture: the capture was invalidated by {why}");
            let _ = put(graph, std::ptr::null_mut());
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        let h = s.handle();
        s.graphs.insert(h, Arc::new(c.ops));
        put(graph, h as CUgraph)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuStreamIsCapturing(
    stream: CUstream,
    status: *mut c_int,
) -> CUresult {
    guard("cuStreamIsCapturing", || {
        let s = state();
        s.current()?;
        s.stream(stream as usize)?;
        // NONE 0, ACTIVE 1, INVALIDATED 2.
        let v = match s.captures.get(&(stream as usize)) {
            None => 0,
            Some(c) if c.invalid.is_none() => 1,
            Some(_) => 2,
        };
        put(status, v)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    _flags: c_ulonglong,
) -> CUresult {
    guard("cuGraphInstantiateWithFlags", || {
        let mut s = state();
        s.current()?;
        let ops = s
            .graphs
            .get(&(graph as usize))
            .cloned()
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        let h = s.handle();
        s.execs.insert(h, ops);
        put(exec, h as CUgraphExec)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult {
    guard("cuGraphLaunch", || {
        let mut s = state();
        s.current()?;
        s.stream(stream as usize)?;
        let ops = s
            .execs
            .get(&(exec as usize))
            .cloned()
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        if s.captures.contains_key(&(stream as usize)) {
            eprintln!("emulated GPU: cuGraphLaunch into a capture is not supported");
            return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
        }
        // Queued like any work: a created stream runs it at its next synchronisation.
        s.submit(stream as usize, Op::Graph(ops))
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuGraphUpload(exec: CUgraphExec, stream: CUstream) -> CUresult {
    guard("cuGraphUpload", || {
        let s = state();
        s.current()?;
        s.stream(stream as usize)?;
        s.execs
            .get(&(exec as usize))
            .map(|_| ())
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuGraphExecDestroy(exec: CUgraphExec) -> CUresult {
    guard("cuGraphExecDestroy", || {
        let mut s = state();
        s.execs
            .remove(&(exec as usize))
            .map(|_| ())
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuGraphDestroy(graph: CUgraph) -> CUresult {
    guard("cuGraphDestroy", || {
        let mut s = state();
        s.graphs
            .remove(&(graph as usize))
            .map(|_| ())
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
    })
}
