//! What a training run is asked for: the command line's settings, the device that runs the
//! plan, and the experiment as run (the file with those settings applied).

use parallax_compiler::dsl::ast::Experiment;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

#[derive(Debug, Clone, Default)]
pub struct TrainConfig {
    /// Overrides of the file's `train` section.
    pub steps: Option<u64>,
    pub epochs: Option<u64>,
    pub seed: Option<u64>,
    pub run_dir: PathBuf,
    /// Parameters to start from instead of the seeded initialisation.
    pub init: Option<PathBuf>,
    /// Where relative data paths are resolved (the experiment file's folder).
    pub base_dir: PathBuf,
    /// What runs the plan.
    pub device: Device,
    /// Write a checkpoint every this many steps (none when 0; a resumed run's own when
    /// `None`, and none for a new one).
    pub checkpoint_every: Option<u64>,
    /// Keep the newest this many checkpoints (all when 0; the run's own or 3 when `None`).
    pub keep: Option<usize>,
    /// Continue the run in `run_dir` from its newest checkpoint.
    pub resume: bool,
    /// Continue although the run's experiment or data changed (recorded in `run.json`).
    pub accept_changes: bool,
    /// Set to a signal's number to stop after the current step with a checkpoint.
    pub stop: Option<Arc<AtomicUsize>>,
    /// The `--set` overrides applied to the file, recorded in `run.json`.
    pub overrides: Vec<String>,
    /// A failure planted for the tests of failure.
    pub fault: Option<Fault>,
}

/// A failure planted for the tests of failure: a rank dies or stops answering after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `SIGKILL`, as `kill -9` would: no checkpoint, no goodbye.
    Crash { rank: usize, step: u64 },
    /// Stops answering (sleeps an hour).
    Stall { rank: usize, step: u64 },
}

impl Fault {
    /// `RANK:STEP`, as the command line gives it.
    pub fn rank_step(s: &str) -> Result<(usize, u64), String> {
        let (r, t) = s.split_once(':').ok_or("expected RANK:STEP")?;
        Ok((
            r.parse().map_err(|e| format!("rank: {e}"))?,
            t.parse().map_err(|e| format!("step: {e}"))?,
        ))
    }

    /// Strikes when `rank` has finished `step` and the fault is planted there.
    pub(super) fn strike(self, rank: usize, step: u64) {
        match self {
            Fault::Crash { rank: r, step: s } if (r, s) == (rank, step) => {
                let _ = signal_hook::low_level::raise(signal_hook::consts::SIGKILL);
            }
            Fault::Stall { rank: r, step: s } if (r, s) == (rank, step) => {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
            _ => {}
        }
    }
}

/// What runs a plan: one of them, never two.
#[derive(Debug, Clone, Copy, Default)]
pub enum Device {
    /// The CPU executor, the whole batch unsplit.
    #[default]
    Cpu,
    /// GPU 0 with the CUDA executor at this GEMM precision.
    Cuda(crate::cuda::Precision),
    /// A per-shard plan on simulated devices (`crate::ranks`), on the CPU.
    Simulated(Simulated),
    /// A per-shard plan on GPU ranks (`crate::ranks` over CUDA executors): the same device
    /// code as simulated devices, each device on a GPU.
    CudaRanks(CudaRanks),
}

/// GPU ranks: the partition, the GEMM precision, and which GPUs this process's devices use.
#[derive(Debug, Clone, Copy)]
pub struct CudaRanks {
    pub ranks: Simulated,
    pub precision: crate::cuda::Precision,
    /// The GPU of this process's first device; the next take the next GPUs in turn, modulo
    /// `gpus`.
    pub first_gpu: usize,
    /// How many GPUs this process's devices take in turn (fewer than its devices only when
    /// several ranks share a GPU, `PARALLAX_SHARE_GPUS=1`).
    pub gpus: usize,
    /// Sums over shards on the GPUs over NCCL (`PARALLAX_NCCL=1`), each wait bounded by
    /// this; `None`: on the host.
    pub nccl: Option<std::time::Duration>,
}

impl CudaRanks {
    /// The GPU of this process's `i`-th device.
    pub fn gpu(&self, i: usize) -> usize {
        (self.first_gpu + i) % self.gpus.max(1)
    }
}

impl Device {
    /// The simulated devices, if these are.
    pub fn simulated(&self) -> Option<Simulated> {
        match *self {
            Device::Simulated(s) => Some(s),
            _ => None,
        }
    }

    /// The partition of a per-shard plan (simulated devices or GPU ranks).
    pub fn partition(&self) -> Option<Simulated> {
        match *self {
            Device::Simulated(s) => Some(s),
            Device::CudaRanks(g) => Some(g.ranks),
            _ => None,
        }
    }

    /// As `run.json` names it; `in_processes`: a device per process of a job.
    pub(super) fn describe(&self, in_processes: bool) -> String {
        match self {
            Device::Cpu => "cpu".to_string(),
            Device::Cuda(p) => format!("cuda:0 ({p:?})"),
            Device::Simulated(s) => format!(
                "{} {} on the cpu (dp{}.tp{}.pp{})",
                s.grid.devices(),
                if in_processes {
                    "rank(s) in separate processes"
                } else {
                    "simulated device(s)"
                },
                s.grid.dp,
                s.grid.tp,
                s.grid.pp
            ),
            Device::CudaRanks(g) => format!(
                "{} GPU rank(s) {} (dp{}.tp{}.pp{}, {:?}, sums {})",
                g.ranks.grid.devices(),
                if in_processes {
                    "in separate processes"
                } else {
                    "in one process"
                },
                g.ranks.grid.dp,
                g.ranks.grid.tp,
                g.ranks.grid.pp,
                g.precision,
                if g.nccl.is_some() {
                    "over NCCL"
                } else {
                    "on the host"
                }
            ),
        }
    }
}

/// Simulated devices for a partitioned plan.
#[derive(Debug, Clone, Copy)]
pub struct Simulated {
    pub grid: crate::ranks::Grid,
    /// ZeRO stage: 1 shards the optimizer state over the data-parallel ranks, 2 the reduced
    /// gradients too, 3 the parameters too (0: none).
    pub zero: u8,
    /// Each device's memory, in bytes.
    pub capacity: u64,
}

impl Simulated {
    /// The devices of a partitioned `plan` (`None` for a whole plan): its strategy's grid and
    /// ZeRO stage, each device with `capacity` bytes.
    pub fn of_plan(plan: &parallax_compiler::Plan, capacity: u64) -> Option<Simulated> {
        plan.sharding?;
        let s = plan.strategy;
        Some(Simulated {
            grid: crate::ranks::Grid {
                dp: s.dp as usize,
                tp: s.tp as usize,
                pp: s.pp as usize,
            },
            zero: plan.zero_stage,
            capacity,
        })
    }
}

/// How many devices a run trains on (`None`: one device, batches unsplit): as `--gpus` asks,
/// or several when the file wants them. A run resumed from `resumed` continues as it was
/// split (on any device count: the bits do not depend on it), its degrees, ZeRO stage and
/// schedule as recorded (returned), or on `--gpus` devices. The third value says whether that
/// continuation splits a run that trained unsplit (its bits then differ from an uninterrupted
/// run's).
pub fn parallel_devices(
    resumed: Option<&Path>,
    gpus: Option<u32>,
    file_gpus: u32,
) -> (
    Option<u32>,
    Option<parallax_compiler::target::Recorded>,
    bool,
) {
    let Some(dir) = resumed else {
        return (gpus.or((file_gpus > 1).then_some(file_gpus)), None, false);
    };
    match (crate::run::record::RunRecord::split_of(dir), gpus) {
        (Some(r), None) => {
            let s = r.strategy;
            (Some(s.dp * s.tp * s.pp), Some(r), false)
        }
        (Some(_), Some(m)) => (Some(m), None, false),
        (None, None) => (None, None, false),
        (None, Some(m)) => (Some(m), None, true),
    }
}

/// The experiment as run: the file with the command line's overrides.
pub fn resolved(e: &Experiment, cfg: &TrainConfig) -> Experiment {
    let mut e = e.clone();
    if let Some(s) = cfg.steps {
        e.train.steps = Some(s);
        e.train.epochs = None;
    }
    if let Some(ep) = cfg.epochs {
        e.train.epochs = Some(ep);
        e.train.steps = None;
    }
    if let Some(seed) = cfg.seed {
        e.train.seed = seed;
    }
    // Data files are recorded absolute, so the run's `experiment.ron` (read again by
    // `--resume`, from the run folder) names the same files.
    let absolute = |p: &mut String| {
        if Path::new(p.as_str()).is_relative() {
            let joined = cfg.base_dir.join(p.as_str());
            *p = std::path::absolute(&joined)
                .unwrap_or(joined)
                .display()
                .to_string();
        }
    };
    for p in e.data.files_mut() {
        absolute(p);
    }
    e
}
