//! A whole step captured as a CUDA graph and replayed (`PARALLAX_CUDA_GRAPH=1`): one launch
//! per step instead of one per kernel, for when the host cannot stay ahead of the GPU.
//!
//! A graph keeps the addresses and arguments it was captured with, so a step is replayed
//! only while they still hold: per batch size and mode, for the buffer addresses it saw (a
//! loan between executors changes them, and a new capture follows), and only for plans none
//! of whose launches takes an argument that changes from step to step (dropout's key, the
//! first sample's index). The first step of each kind runs directly: it loads the module and
//! builds the GEMM plans, which a capture could not. The second is captured, then launched;
//! later ones replay. A plan that cannot be replayed, or a capture that fails, turns graphs
//! off for the executor, and the step runs directly (nothing ran during the capture). The kernels are the same, so the bits are
//! the same; `scripts/gpu-check.sh` compares both with the CPU oracle.
//!
//! The executor works on the legacy default stream, which cannot be captured: a graph is
//! captured on a stream of its own (the executor's launches, cuBLAS and cuBLASLt pointed at
//! it meanwhile) and launched there between two event waits, after what the default stream
//! has queued (the inputs) and before what it queues next (the loss read back).

use super::launch::Launcher;
use super::memory::Memory;
use super::CudaError;
use crate::exec::Mode;
use cudarc::driver::{sys, CudaGraph, CudaStream};
use parallax_compiler::codegen::{Arg, Launch, Module};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The variable that turns graphs on (`1`); off by default until a GPU has measured them.
pub const ENV: &str = "PARALLAX_CUDA_GRAPH";

/// Whether `value` (the variable's) turns graphs on.
pub fn wanted(value: Option<&str>) -> bool {
    matches!(value.map(str::trim), Some("1" | "true" | "on"))
}

/// Whether every launch of `code` takes the same arguments at every step of one batch size
/// and mode, so that a captured step can be replayed.
pub fn replayable(code: &Module) -> bool {
    code.kernels
        .iter()
        .flat_map(|k| &k.launches)
        .all(|l| match l {
            Launch::Kernel { args, .. } => args
                .iter()
                .all(|a| !matches!(a, Arg::DropoutKey { .. } | Arg::FirstSample)),
            Launch::Copy { .. } | Launch::Gemm { .. } => true,
        })
}

/// An executor's graphs and what it has learned about capturing.
#[derive(Default)]
pub(super) struct Graphs {
    enabled: bool,
    /// The (batch, mode) steps that have run once directly.
    seen: HashSet<(usize, Mode)>,
    /// Each captured step with the buffer addresses it was captured with.
    captured: HashMap<(usize, Mode), (CudaGraph, Vec<u64>)>,
    replayed: u64,
    /// Why graphs were turned off: a plan that cannot be replayed, or a failed capture.
    given_up: Option<String>,
    /// The stream graphs are captured and launched on (made at the first capture).
    stream: Option<Arc<CudaStream>>,
}

impl Graphs {
    pub(super) fn from_env() -> Graphs {
        Graphs {
            enabled: wanted(std::env::var(ENV).ok().as_deref()),
            ..Graphs::default()
        }
    }
}

impl Graphs {
    /// What graphs did, for reports: `None` when they are off.
    pub(super) fn report(&self) -> Option<String> {
        if let Some(why) = &self.given_up {
            return Some(format!("off: {why}"));
        }
        self.enabled.then(|| {
            format!(
                "{} step(s) captured, {} replayed",
                self.captured.len(),
                self.replayed
            )
        })
    }

    /// Runs the step from its graph when there is one for this batch, mode and these buffer
    /// addresses, capturing it on the second such step; `false`: run it directly.
    pub(super) fn run_graph(
        &mut self,
        launcher: &mut Launcher,
        mem: &Memory,
        batch: usize,
        mode: Mode,
        (step, first_sample): (u64, u64),
    ) -> Result<bool, CudaError> {
        if !self.enabled || batch > mem.max_batch {
            return Ok(false);
        }
        let key = (batch, mode);
        if let Some((graph, addresses)) = self.captured.get(&key) {
            if *addresses == mem.buffers {
                self.launch_graph(launcher, graph)?;
                self.replayed += 1;
                launcher.batch = batch;
                launcher.last_mode = Some(mode);
                return Ok(true);
            }
            self.captured.remove(&key);
        }
        // The first step of each kind runs directly (module, GEMM plans).
        if self.seen.insert(key) {
            return Ok(false);
        }
        // Per-step arguments are the plan's (dropout), whatever the batch: asked once.
        if !launcher.module(batch).is_some_and(replayable) {
            self.give_up("the plan's launches take per-step arguments (dropout)".into());
            return Ok(false);
        }
        let graph = match self.capture(launcher, mem, batch, mode, (step, first_sample)) {
            Ok(graph) => graph,
            Err(why) => {
                // Nothing ran: the step runs launch by launch.
                self.give_up(format!("a capture failed ({why})"));
                return Ok(false);
            }
        };
        self.launch_graph(launcher, &graph)?;
        let addresses = mem.buffers.clone();
        self.captured.insert(key, (graph, addresses));
        Ok(true)
    }

    /// Graphs off for this executor, for `why`.
    fn give_up(&mut self, why: String) {
        self.enabled = false;
        self.captured.clear();
        self.given_up = Some(why);
    }

    /// The step run launch by launch into a graph on the graphs' stream; `Err`: why not.
    fn capture(
        &mut self,
        launcher: &mut Launcher,
        mem: &Memory,
        batch: usize,
        mode: Mode,
        at: (u64, u64),
    ) -> Result<CudaGraph, String> {
        let stream = match &self.stream {
            Some(s) => s.clone(),
            None => {
                let s = mem.ctx.new_stream().map_err(|e| format!("{e:?}"))?;
                self.stream = Some(s.clone());
                s
            }
        };
        let home = std::mem::replace(&mut launcher.stream, stream.clone());
        let captured = capture_on(launcher, mem, &stream, batch, mode, at);
        launcher.stream = home;
        let restored = launcher.point_blas_at(&launcher.stream);
        let graph = captured?;
        restored.map_err(|e| e.to_string())?;
        Ok(graph)
    }

    /// Launches `graph` on the graphs' stream, ordered after the work queued on the
    /// executor's stream and before what it queues next.
    fn launch_graph(&self, launcher: &Launcher, graph: &CudaGraph) -> Result<(), CudaError> {
        let Some(own) = &self.stream else {
            return Err(CudaError::Exec("a graph without its stream".into()));
        };
        own.join(&launcher.stream)?;
        graph.launch()?;
        if !super::plant::planted(super::plant::Bug::NoSyncBeforeRead) {
            launcher.stream.join(own)?;
        }
        Ok(())
    }
}

/// The step run launch by launch on `stream`, captured into a graph.
fn capture_on(
    launcher: &mut Launcher,
    mem: &Memory,
    stream: &Arc<CudaStream>,
    batch: usize,
    mode: Mode,
    (step, first_sample): (u64, u64),
) -> Result<CudaGraph, String> {
    launcher.point_blas_at(stream).map_err(|e| e.to_string())?;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| format!("{e:?}"))?;
    let ran = launcher.run_direct(mem, batch, mode, step, first_sample);
    // Always ended, so that the stream leaves capture whatever happened.
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    ran.map_err(|e| e.to_string())?;
    ended
        .map_err(|e| format!("{e:?}"))?
        .ok_or_else(|| "the capture was empty".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_compiler::codegen;

    fn module(file: &str) -> Module {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let source = parallax_compiler::parse(&text).unwrap();
        let options = parallax_compiler::Options::default();
        let plan = parallax_compiler::compile(&source, &options, &mut |_, _| {})
            .unwrap()
            .plan(&source, &options);
        codegen::generate(&plan, 8, "sm_80").unwrap()
    }

    #[test]
    fn only_plans_without_per_step_arguments_are_replayed() {
        // No dropout: every argument is an address or a constant.
        assert!(replayable(&module("models/transformer.ron")));
        assert!(replayable(&module("benches/models/gpt-gpu.ron")));
        // The mlp's dropout takes a key that changes every step.
        let dropout = module("models/mlp.ron");
        assert!(dropout.kernels.iter().flat_map(|k| &k.launches).any(|l| matches!(
            l,
            Launch::Kernel { args, .. } if args.iter().any(|a| matches!(a, Arg::DropoutKey { .. }))
        )));
        assert!(!replayable(&dropout));
    }

    #[test]
    fn graphs_are_off_unless_asked_for() {
        assert!(!wanted(None));
        assert!(!wanted(Some("0")));
        assert!(!wanted(Some("")));
        assert!(wanted(Some("1")));
        assert!(wanted(Some(" on")));
    }
}
