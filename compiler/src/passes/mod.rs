//! The pass pipeline: one ordered list, each pass a function from graph to graph that can
//! fail. The driver times each pass, lets the caller dump the IR after any of them, and runs
//! the verifier after each in tests and debug builds.

pub mod autodiff;
mod emit;
pub mod fuse;
pub mod grad_sync;
pub mod group;
pub mod lower;
pub mod optimizer;
pub mod pipeline;
pub mod schedule;
pub mod shapes;
pub mod shard;
pub mod simplify;
pub mod storage;
pub mod weight_copies;
pub mod zero;

use crate::dsl::Source;
use crate::ir::verify::verify;
use crate::ir::Graph;
use crate::plan::{Plan, Summary};
use crate::Error;
use std::time::{Duration, Instant};

/// What a pass sees besides the graph.
pub struct Ctx<'a> {
    pub source: &'a Source,
    pub options: &'a Options,
}

pub struct Pass {
    pub name: &'static str,
    pub about: &'static str,
    pub run: fn(&mut Graph, &Ctx) -> Result<(), Error>,
}

/// The pipeline, in order. Later stages (fuse, partition, schedule, codegen) join this list
/// as they are built.
pub static PIPELINE: &[Pass] = &[
    Pass {
        name: "lower",
        about: "layers and blocks become primitive ops",
        run: lower::run,
    },
    Pass {
        name: "shapes",
        about: "infer and check every shape and dtype",
        run: shapes::run,
    },
    Pass {
        name: "shard",
        about: "per micro-shard plans: synchronised BatchNorm, each shard's share of the loss",
        run: shard::run,
    },
    Pass {
        name: "weight_copies",
        about:
            "devices.activations: Bf16: the weights products multiply, rounded to bf16 once a step",
        run: weight_copies::run,
    },
    Pass {
        name: "autodiff",
        about: "append the backward graph from each op's VJP rule",
        run: autodiff::run,
    },
    Pass {
        name: "grad_sync",
        about: "per micro-shard plans: all-reduce every gradient as soon as it exists",
        run: grad_sync::run,
    },
    Pass {
        name: "optimizer",
        about: "append gradient clipping and the parameter updates",
        run: optimizer::run,
    },
    Pass {
        name: "zero",
        about: "ZeRO-1 plans: each parameter's update on one data-parallel rank, then broadcast",
        run: zero::run,
    },
    Pass {
        name: "simplify",
        about: "dead code and common subexpressions",
        run: simplify::run,
    },
    Pass {
        name: "pipeline",
        about:
            "pipeline plans: each op on its layer's stage, a transfer on every edge between stages",
        run: pipeline::run,
    },
    Pass {
        name: "fuse",
        about: "group elementwise chains, reductions and GEMM epilogues into kernels",
        run: fuse::run,
    },
    Pass {
        name: "group",
        about: "like update kernels (each parameter's step, each squared norm) as one launch",
        run: group::run,
    },
    Pass {
        name: "storage",
        about: "devices.activations: Bf16: the stored activations and their gradients in bf16",
        run: storage::run,
    },
    Pass {
        name: "schedule",
        about: "order kernels, assign buffers with reuse, state the peak memory",
        run: schedule::run,
    },
];

pub fn pass_names() -> Vec<&'static str> {
    PIPELINE.iter().map(|p| p.name).collect()
}

/// The pass `after:PASS` names (`all` for every pass), as `compile --dump-ir` takes it.
pub fn dump_after(s: &str) -> Result<String, String> {
    let names = pass_names().join(", ");
    match s.strip_prefix("after:") {
        None => Err(format!(
            "expected `after:PASS`, where PASS is one of: {names}"
        )),
        Some(p) if p == "all" || PIPELINE.iter().any(|q| q.name == p) => Ok(p.to_string()),
        Some(p) => Err(format!(
            "unknown pass `{p}`; the passes are: {names}, or `all`"
        )),
    }
}

#[derive(Debug, Clone)]
pub struct Options {
    /// GPUs requested (`--gpus`); recorded in the plan.
    pub gpus: Option<u32>,
    /// Build the plan for one micro-shard of data parallelism (`crate::shards`).
    pub shards: Option<crate::shards::Sharding>,
    /// The data-parallel ranks the plan is one of (its strategy records them; the program
    /// depends on them only through `optimizer_shards`).
    pub data_parallel: Option<u32>,
    /// Build it for one rank of this many splitting Attention and Mlp layers.
    pub tensor_parallel: Option<u32>,
    /// Cut it into this many pipeline stages.
    pub pipeline_stages: Option<u32>,
    /// Shard the optimizer state over this many data-parallel ranks (ZeRO-1), with
    /// `zero_stage` 2 the reduced gradients too, with 3 the parameters too.
    pub optimizer_shards: Option<u32>,
    pub zero_stage: u8,
    /// Run the IR verifier after every pass.
    pub verify: bool,
    /// Stop after this pass (`check` needs only the forward graph's shapes).
    pub stop_after: Option<&'static str>,
    /// Lower the decode step for batches of this many samples (one token each, key/value
    /// caches) instead of the training step: `compile_decode` sets it.
    pub decode: Option<u64>,
}

impl Options {
    /// The options that build one shard's plan of `strategy` (what every device of a
    /// partitioned run executes): the batch cut into the file's micro-shards, the tensor and
    /// pipeline degrees, and ZeRO stage `zero` over the data-parallel ranks (with one rank
    /// there is nothing to shard).
    pub fn partitioned(source: &Source, strategy: crate::plan::Strategy, zero: u8) -> Options {
        let e = &source.experiment;
        let crate::plan::Strategy { dp, tp, pp } = strategy;
        Options {
            gpus: Some(dp * tp * pp),
            shards: Some(crate::shards::Sharding::new(
                e.devices.micro_shards,
                e.train.batch_size,
            )),
            data_parallel: Some(dp),
            tensor_parallel: (tp > 1).then_some(tp),
            pipeline_stages: (pp > 1).then_some(pp),
            optimizer_shards: (zero >= 1 && dp > 1).then_some(dp),
            zero_stage: zero.max(1),
            ..Options::default()
        }
    }

    /// The strategy the plan is built for.
    pub fn strategy(&self) -> crate::plan::Strategy {
        crate::plan::Strategy {
            dp: self.data_parallel.or(self.optimizer_shards).unwrap_or(1),
            tp: self.tensor_parallel.unwrap_or(1).max(1),
            pp: self.pipeline_stages.unwrap_or(1).max(1),
        }
    }

    /// The batch the plan is built for: the file's, or one micro-shard's.
    pub fn plan_batch(&self, source: &Source) -> u64 {
        if let Some(batch) = self.decode {
            return batch;
        }
        let batch = source.experiment.train.batch_size;
        self.shards.map_or(batch, |s| s.shard_batch())
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            gpus: None,
            shards: None,
            data_parallel: None,
            tensor_parallel: None,
            pipeline_stages: None,
            optimizer_shards: None,
            zero_stage: 1,
            verify: cfg!(debug_assertions),
            stop_after: None,
            decode: None,
        }
    }
}

pub struct Compiled {
    pub graph: Graph,
    /// Each pass's name and wall time, in pipeline order.
    pub timings: Vec<(&'static str, Duration)>,
}

impl Compiled {
    /// The plan the runtime executes.
    pub fn plan(&self, source: &Source, options: &Options) -> Plan {
        Plan::single_device(&self.graph, source, options)
    }

    /// What `parallax check` reports, without building the plan.
    pub fn summary(&self, source: &Source) -> Summary {
        Summary::of(&self.graph, source)
    }
}

/// Runs the pipeline on a parsed source. `after_pass` sees the graph after each pass (for
/// `--dump-ir`).
pub fn compile(
    source: &Source,
    options: &Options,
    after_pass: &mut dyn FnMut(&str, &Graph),
) -> Result<Compiled, Error> {
    run_passes(source, options, PIPELINE.iter(), after_pass)
}

/// The passes of the decode step: forward only (no gradients, no optimizer), on one device.
pub const DECODE_PASSES: [&str; 5] = ["lower", "shapes", "simplify", "fuse", "schedule"];

/// The decode-step plan of a causal language model (`lower::decode`): one new token per
/// sample (`batch` samples) and its position in, the logits at that position out, each
/// attention reading and updating key and value caches that persist between runs. Refuses
/// a model that cannot be run a token at a time (`Error::Model`).
pub fn compile_decode(source: &Source, batch: u64, verify: bool) -> Result<Plan, Error> {
    let options = Options {
        decode: Some(batch.max(1)),
        verify,
        ..Options::default()
    };
    let passes = PIPELINE.iter().filter(|p| DECODE_PASSES.contains(&p.name));
    let compiled = run_passes(source, &options, passes, &mut |_, _| {})?;
    let plan = compiled.plan(source, &options);
    // A cache persists only if written where its state lives (an eval step copies nothing).
    for &(old, new) in &plan.updates {
        if plan.steps[old].buffer != plan.steps[new].buffer {
            return Err(Error::Verify {
                pass: "schedule".into(),
                message: format!(
                    "the decode step's `{}` is not written in place",
                    plan.steps[old].layer
                ),
            });
        }
    }
    Ok(plan)
}

fn run_passes<'p>(
    source: &Source,
    options: &Options,
    passes: impl Iterator<Item = &'p Pass>,
    after_pass: &mut dyn FnMut(&str, &Graph),
) -> Result<Compiled, Error> {
    let ctx = Ctx { source, options };
    let mut graph = Graph::new();
    let mut timings = Vec::with_capacity(PIPELINE.len());
    for pass in passes {
        let t = Instant::now();
        (pass.run)(&mut graph, &ctx)?;
        timings.push((pass.name, t.elapsed()));
        if options.verify {
            verify(&graph).map_err(|message| Error::Verify {
                pass: pass.name.to_string(),
                message,
            })?;
        }
        after_pass(pass.name, &graph);
        if options.stop_after == Some(pass.name) {
            break;
        }
    }
    Ok(Compiled { graph, timings })
}

#[cfg(test)]
#[path = "decode_tests.rs"]
pub(crate) mod decode_tests;
