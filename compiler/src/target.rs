//! Compiling for a device count: the split (the one asked for, or the cost model's choice among
//! those the run can use), and the per-device plan built for it. What `train` runs, what
//! `compile` measures, and what every rank of a job computes alike from the same file.

use crate::partition;
use crate::plan::{PipelineSchedule, Plan, Strategy};
use crate::shards::Sharding;
use crate::{compile, Compiled, Error, Options, Source};

/// What the command line asks for.
#[derive(Debug, Clone, Copy, Default)]
pub struct Request<'a> {
    pub gpus: u32,
    /// Degrees like `dp2.pp2` (the cost model's choice, or all data parallel without a
    /// profile for the device kind, when absent).
    pub strategy: Option<&'a str>,
    /// ZeRO stage; the cost model's choice, or 0 with a strategy, when absent.
    pub zero: Option<u8>,
    /// Each device's memory (the device kind's when absent).
    pub memory: Option<u64>,
    /// The device kind (the file's when absent; `compile --device`).
    pub kind: Option<&'a str>,
    /// Nodes the devices are spread over (`compile --nodes`; 8 devices a node when absent).
    pub nodes: Option<u32>,
    /// The split a resumed run trained with: kept unless `strategy` asks for another.
    pub resumed: Option<Recorded>,
}

/// A split as a run records it (`run.json`) and a partitioned plan carries it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Recorded {
    pub strategy: Strategy,
    pub zero: u8,
    pub schedule: PipelineSchedule,
}

/// The split a run uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Split {
    pub strategy: Strategy,
    /// ZeRO stage over the data-parallel ranks (0 with one rank: nothing to shard).
    pub zero: u8,
    /// The pipeline schedule (`Sequential` without stages).
    pub schedule: PipelineSchedule,
    /// Each device's memory, in bytes.
    pub capacity: u64,
    /// Whether the cost model chose it (neither `--strategy` nor a resumed run's split).
    pub chosen: bool,
}

impl Split {
    /// The degrees, ZeRO stage and schedule, as a run records them.
    pub fn recorded(&self) -> Recorded {
        Recorded {
            strategy: self.strategy,
            zero: self.zero,
            schedule: self.schedule,
        }
    }
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

/// The split for `request`: what `train` runs and `compile` reports. Without `--strategy`
/// (or a resumed run's split) the cost model chooses the fastest candidate that fits and that
/// the batch's micro-shards can feed, preferring one without tensor parallelism (whose bits do
/// not depend on the device count); with no profile for the device kind, all data parallel.
pub fn split(source: &Source, request: &Request) -> Result<Split, TargetError> {
    let partitioned = match profile_of(source, request) {
        Some(_) => {
            let options = Options {
                gpus: Some(request.gpus),
                ..Options::default()
            };
            let unsplit = compile(source, &options, &mut |_, _| {})?;
            partition_for(source, &unsplit, request)?
        }
        None => None,
    };
    split_from(source, request, partitioned.as_ref())
}

fn profile_of(source: &Source, request: &Request) -> Option<&'static crate::devices::Profile> {
    crate::devices::profile(request.kind.unwrap_or(&source.experiment.devices.kind))
}

/// The micro-shards each batch is cut into: the most data-parallel ranks a run can feed.
fn micro_shards(source: &Source) -> u32 {
    let e = &source.experiment;
    Sharding::new(e.devices.micro_shards, e.train.batch_size).shards
}

/// The strategy `request` forces (`--strategy`, or the resumed run's), if any.
fn forced(request: &Request) -> Result<Option<Strategy>, TargetError> {
    match (request.strategy, request.resumed) {
        (Some(s), _) => partition::parse_strategy(s, request.gpus)
            .map(Some)
            .map_err(|e| TargetError::Strategy(e.to_string())),
        (None, Some(r)) => Ok(Some(r.strategy)),
        (None, None) => Ok(None),
    }
}

/// The ZeRO stage `request` asks for: `--zero`, the resumed run's, or 0 with a forced
/// strategy (`None`: the cost model's choice).
fn zero_asked(request: &Request) -> Option<u8> {
    match (request.zero, request.resumed, request.strategy) {
        (Some(z), _, _) => Some(z),
        (None, Some(r), None) => Some(r.zero),
        (None, _, Some(_)) => Some(0),
        (None, _, None) => None,
    }
}

/// The cost model's candidates for `request` over the `unsplit` graph and its pick among those
/// `train` can run (`None` where the device kind has no profile). A forced strategy the
/// planner refuses or finds too big is returned as the partition's error, to show.
pub fn partition_for(
    source: &Source,
    unsplit: &Compiled,
    request: &Request,
) -> Result<Option<Partitioned>, TargetError> {
    let Some(profile) = profile_of(source, request) else {
        return Ok(None);
    };
    let e = &source.experiment;
    let model = partition::model_cost(&unsplit.graph, &e.name, e.train.batch_size);
    let target = partition::Target {
        gpus: request.gpus,
        profile,
        capacity: request.memory.unwrap_or(profile.memory),
        nodes: request.nodes,
        strategy: forced(request)?,
    };
    let pick = partition::Pick {
        max_dp: micro_shards(source),
        zero: zero_asked(request),
        schedule: request
            .resumed
            .filter(|_| request.strategy.is_none())
            .map(|r| r.schedule),
        prefer_tp_free: true,
    };
    let partition = partition::plan_picking(&model, &target, &pick);
    Ok(Some(Partitioned {
        model,
        target,
        partition,
    }))
}

/// The split of `request` given its partition (`None`: no profile for the device kind).
pub fn split_from(
    source: &Source,
    request: &Request,
    partitioned: Option<&Partitioned>,
) -> Result<Split, TargetError> {
    let n = request.gpus;
    let shards = micro_shards(source);
    let capacity = request
        .memory
        .unwrap_or_else(|| profile_of(source, request).map_or(u64::MAX, |p| p.memory));
    let forced = forced(request)?;
    let zero = zero_asked(request);
    let all_data = Strategy {
        dp: n,
        tp: 1,
        pp: 1,
    };
    let plain = |s: Strategy| Recorded {
        strategy: s,
        zero: zero.unwrap_or(0),
        schedule: match s.pp {
            1 => PipelineSchedule::Sequential,
            _ => PipelineSchedule::OneFOneB,
        },
    };
    let partition = partitioned.map(|p| &p.partition);
    let chosen = match (forced, partition) {
        (_, Some(Ok(p))) => Recorded {
            strategy: p.strategy,
            zero: p.zero,
            schedule: p.schedule,
        },
        // A forced split the planner refuses or finds too big runs anyway: the devices'
        // exact memory and the per-device plan decide (and say why).
        (Some(s), _) => plain(s),
        (None, None) => plain(all_data),
        (None, Some(Err(partition::Error::Unrunnable { fastest, .. }))) => {
            return Err(TargetError::TooFewShards {
                gpus: n,
                shards,
                dp: fastest.strategy.dp,
            })
        }
        (None, Some(Err(e))) => {
            return Err(TargetError::Partition {
                gpus: n,
                source: e.clone(),
            })
        }
    };
    let strategy = chosen.strategy;
    if strategy.dp > shards {
        return Err(TargetError::TooFewShards {
            gpus: n,
            shards,
            dp: strategy.dp,
        });
    }
    Ok(Split {
        strategy,
        zero: if strategy.dp > 1 { chosen.zero } else { 0 },
        schedule: chosen.schedule,
        capacity,
        chosen: forced.is_none() && partitioned.is_some(),
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
    let mut plan = compiled.plan(source, &options);
    plan.schedule = Some(split.schedule);
    plan.device_memory_bytes = Some(split.capacity);
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
        schedule: PipelineSchedule::Sequential,
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

    /// What to do instead when the plan does not fit one device, from the planner's verdict.
    pub fn one_device_hint(&self) -> String {
        use partition::explain::{micro_batches, smallest_hint};
        match &self.partition {
            Err(partition::Error::NoFit { smallest, .. }) => smallest_hint(smallest.as_ref()),
            Ok(p) => format!(
                "the planner fits it on one GPU with gradient accumulation ({}, peak {}), which single-device plans do not do yet; {}",
                micro_batches(p.micro_batches, p.micro_batch_size),
                crate::plan::bytes(p.per_device_peak_bytes),
                smallest_hint(self.smallest_fitting().as_ref())
            ),
            Err(_) => smallest_hint(self.smallest_fitting().as_ref()),
        }
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
