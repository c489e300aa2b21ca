//! Compiling for a device count: the split (the one asked for, or the cost model's choice among
//! those the run can use), and the per-device plan built for it. What `train` runs, what
//! `compile` measures, and what every rank of a job computes alike from the same file.

use crate::partition::{self, Candidate};
use crate::plan::{Plan, Strategy};
use crate::shards::Sharding;
use crate::{compile, Compiled, Error, Options, Source};

/// What the command line asks for.
#[derive(Debug, Clone, Copy, Default)]
pub struct Request<'a> {
    pub gpus: u32,
    /// Degrees like `dp2.pp2` (all data parallel, or the cost model's choice, when absent).
    pub strategy: Option<&'a str>,
    /// ZeRO stage; the cost model's choice, or 0 with a strategy, when absent.
    pub zero: Option<u8>,
    /// Each device's memory (the file's device kind's when absent).
    pub memory: Option<u64>,
}

/// The split a run uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Split {
    pub strategy: Strategy,
    /// ZeRO stage over the data-parallel ranks (0 with one rank: nothing to shard).
    pub zero: u8,
    /// Each device's memory, in bytes.
    pub capacity: u64,
    /// Whether the cost model chose it (`--strategy` absent).
    pub chosen: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("--strategy: {0}")]
    Strategy(String),
    #[error("--gpus {gpus}: {source}")]
    Partition { gpus: u32, source: partition::Error },
    #[error("--gpus {gpus}: each batch is cut into {shards} micro-shards, so {dp} data-parallel ranks cannot all get work")]
    TooFewShards { gpus: u32, shards: u32, dp: u32 },
    #[error(
        "--strategy: tensor parallelism splits Attention and Mlp layers, and this model has none"
    )]
    NothingToSplit { devices: u32 },
    #[error(transparent)]
    Compile(#[from] Error),
}

impl TargetError {
    /// What to do about it.
    pub fn hint(&self) -> Option<String> {
        match self {
            TargetError::Strategy(_) => Some(
                "write degrees like `dp4`, `dp2.pp2` or `pp2.dp2`; they multiply to --gpus".into(),
            ),
            TargetError::Partition { gpus, .. } => Some(format!(
                "`parallax compile FILE --gpus {gpus} --explain` shows every candidate and its memory"
            )),
            TargetError::TooFewShards { dp, .. } => Some(format!(
                "raise it with `--set devices.micro_shards={dp}` (every GPU count up to it then gives the same bits; the batch size bounds it)"
            )),
            TargetError::NothingToSplit { devices } => Some(format!(
                "use data or pipeline parallelism (`dp{devices}`, `pp2`)"
            )),
            TargetError::Compile(_) => None,
        }
    }
}

/// The split for `request`. Without `--strategy` the cost model chooses: the fastest
/// candidate that fits and that the batch's micro-shards can feed, preferring one without
/// tensor parallelism (whose bits do not depend on the device count); with no profile for
/// the device kind, all data parallel.
pub fn split(source: &Source, request: &Request) -> Result<Split, TargetError> {
    let e = &source.experiment;
    let n = request.gpus;
    let shards = Sharding::new(e.devices.micro_shards, e.train.batch_size).shards;
    let profile = crate::devices::profile(&e.devices.kind);
    let capacity = request
        .memory
        .unwrap_or_else(|| profile.map_or(u64::MAX, |p| p.memory));
    let all_data = Strategy {
        dp: n,
        tp: 1,
        pp: 1,
    };
    let (strategy, chosen_zero, chosen) = match (request.strategy, profile) {
        (Some(s), _) => (
            partition::parse_strategy(s, n).map_err(|e| TargetError::Strategy(e.to_string()))?,
            0,
            false,
        ),
        (None, None) => (all_data, 0, false),
        (None, Some(profile)) => {
            let options = Options {
                gpus: Some(n),
                ..Options::default()
            };
            let unsplit = compile(source, &options, &mut |_, _| {})?;
            let model = partition::model_cost(&unsplit.graph, &e.name, e.train.batch_size);
            let target = partition::Target {
                gpus: n,
                profile,
                capacity,
                nodes: None,
                strategy: None,
            };
            let planned = partition::plan(&model, &target)
                .map_err(|source| TargetError::Partition { gpus: n, source })?;
            let runnable = |c: &&Candidate| c.fits && c.strategy.dp <= shards;
            let fastest = |tp_free: bool| {
                planned
                    .candidates
                    .iter()
                    .filter(runnable)
                    .filter(|c| !tp_free || c.strategy.tp == 1)
                    .min_by(|a, b| a.step_time_s.total_cmp(&b.step_time_s))
                    .map(|c| (c.strategy, c.zero))
            };
            let (s, z) = fastest(true)
                .or_else(|| fastest(false))
                .unwrap_or((all_data, 0));
            (s, z, true)
        }
    };
    if strategy.dp > shards {
        return Err(TargetError::TooFewShards {
            gpus: n,
            shards,
            dp: strategy.dp,
        });
    }
    let zero = if strategy.dp > 1 {
        request.zero.unwrap_or(chosen_zero)
    } else {
        0
    };
    Ok(Split {
        strategy,
        zero,
        capacity,
        chosen,
    })
}

/// The per-device plan of `split`, its strategy recorded; refused when tensor parallelism
/// has nothing to split.
pub fn compile_split(
    source: &Source,
    split: &Split,
    after_pass: &mut dyn FnMut(&str, &crate::ir::Graph),
) -> Result<(Compiled, Plan), TargetError> {
    let options = Options::partitioned(source, split.strategy, split.zero);
    let compiled = compile(source, &options, after_pass)?;
    let plan = compiled.plan(source, &options);
    if plan
        .tensor_parallel
        .as_ref()
        .is_some_and(|t| t.splits.is_empty())
    {
        let s = split.strategy;
        return Err(TargetError::NothingToSplit {
            devices: s.dp * s.tp * s.pp,
        });
    }
    Ok((compiled, plan))
}

/// What each simulated device allocates (exact, in grid order: data rank, tensor rank,
/// stage) when `train --backend cpu` runs `strategy`; `None` where the simulation cannot run
/// it (more data-parallel ranks than micro-shards, nothing to split for tensor parallelism).
pub fn simulated_device_bytes(source: &Source, strategy: Strategy, zero: u8) -> Option<Vec<u64>> {
    let e = &source.experiment;
    let sharding = Sharding::new(e.devices.micro_shards, e.train.batch_size);
    if strategy.dp > sharding.shards {
        return None;
    }
    let split = Split {
        strategy,
        zero,
        capacity: u64::MAX,
        chosen: false,
    };
    let (_, plan) = compile_split(source, &split, &mut |_, _| {}).ok()?;
    Some(crate::shards::grid_bytes(&plan, strategy.dp, strategy.tp))
}

/// A compiled experiment partitioned for its GPUs (`parallax compile`).
pub struct Partitioned {
    pub model: partition::ModelCost,
    pub target: partition::Target,
    /// The partition, or why nothing fits (the candidates and their memory, to show).
    pub partition: Result<partition::Partition, partition::Error>,
}

impl Partitioned {
    /// The smallest GPU count above the target's that fits.
    pub fn smallest_fitting(&self) -> Option<partition::Smallest> {
        partition::smallest_fitting(&self.model, &self.target)
    }
}

/// Partitions `compiled` for `gpus` devices of `profile` with `capacity` bytes each, over
/// `nodes`, with `strategy` forced when given. Errors are those that leave nothing to show
/// (a bad strategy, no strategy for the count); a partition that does not fit is returned.
pub fn partition(
    compiled: &Compiled,
    source: &Source,
    target: partition::Target,
    strategy: Option<&str>,
) -> Result<Partitioned, partition::Error> {
    let e = &source.experiment;
    let model = partition::model_cost(&compiled.graph, &e.name, e.train.batch_size);
    let forced = strategy.map(|s| partition::parse_strategy(s, target.gpus));
    let target = partition::Target {
        strategy: forced.transpose()?,
        ..target
    };
    let partition = partition::plan(&model, &target);
    match partition {
        Err(partition::Error::NoFit { .. } | partition::Error::ForcedNoFit { .. }) | Ok(_) => {
            Ok(Partitioned {
                model,
                target,
                partition,
            })
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(text: &str) -> Source {
        crate::parse_bytes(text.as_bytes()).unwrap()
    }

    #[test]
    fn splits_are_chosen_checked_and_refused_with_their_reasons() {
        let mlp = model(include_str!("../../models/mlp.ron"));
        let ask = |gpus, strategy| Request {
            gpus,
            strategy,
            ..Request::default()
        };
        // The cost model's choice feeds every rank from the micro-shards.
        let chosen = split(&mlp, &ask(2, None)).unwrap();
        assert!(chosen.chosen && chosen.strategy.dp <= mlp.experiment.devices.micro_shards);
        let forced = split(&mlp, &ask(2, Some("pp2"))).unwrap();
        assert_eq!(
            (forced.strategy.pp, forced.zero, forced.chosen),
            (2, 0, false)
        );
        let zero = Request {
            zero: Some(2),
            ..ask(2, Some("dp2"))
        };
        assert_eq!(split(&mlp, &zero).unwrap().zero, 2);
        assert_eq!(
            split(
                &mlp,
                &Request {
                    zero: Some(2),
                    ..ask(2, Some("pp2"))
                }
            )
            .unwrap()
            .zero,
            0,
            "one data-parallel rank has nothing to shard"
        );

        let err = split(&mlp, &ask(4, Some("dp3"))).unwrap_err();
        assert!(matches!(err, TargetError::Strategy(_)), "{err}");
        let mut few = mlp.clone();
        few.experiment.devices.micro_shards = 2;
        let err = split(&few, &ask(4, Some("dp4"))).unwrap_err();
        assert!(
            matches!(
                err,
                TargetError::TooFewShards {
                    shards: 2,
                    dp: 4,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.hint().unwrap().contains("devices.micro_shards=4"));
        let err = split(&mlp, &ask(256, None)).unwrap_err();
        assert!(
            matches!(err, TargetError::Partition { gpus: 256, .. }),
            "{err}"
        );

        let tp = split(&mlp, &ask(2, Some("tp2"))).unwrap();
        let Err(err) = compile_split(&mlp, &tp, &mut |_, _| {}) else {
            panic!("tp2 of an MLP compiled");
        };
        assert!(
            matches!(err, TargetError::NothingToSplit { devices: 2 }),
            "{err}"
        );
        let (_, plan) = compile_split(&mlp, &forced, &mut |_, _| {}).unwrap();
        assert_eq!(plan.strategy, forced.strategy);
        assert_eq!(plan.pipeline_stages, 2);
    }
}
