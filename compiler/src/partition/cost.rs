//! The cost model: per-device memory and step time of one candidate (degrees, ZeRO stage,
//! pipeline schedule, micro-batches), from the per-layer aggregates. Every assumption is a
//! named constant or stated where it is used.

use super::model::ModelCost;
use crate::devices::{Link, Profile};
use serde::Serialize;
use std::ops::Range;

/// The fraction of the peak matmul rate a large GEMM sustains (cuBLAS on big, aligned shapes
/// reaches 60-80% of the datasheet figure; 0.5 leaves room for smaller shapes).
pub const MATMUL_EFFICIENCY: f64 = 0.5;
/// The fraction of the datasheet memory bandwidth elementwise kernels reach.
pub const MEMORY_EFFICIENCY: f64 = 0.8;
/// GPUs per node when `--nodes` is not given (DGX/HGX nodes).
pub const GPUS_PER_NODE: u32 = 8;
/// The gradient bucket all-reduced while backward runs (PyTorch DDP's default 25 MiB); two are
/// allocated, one filling while the other is reduced.
pub const BUCKET_BYTES: f64 = (25u64 << 20) as f64;
/// What launching one kernel costs the stream: a group's time per micro-batch is at least its
/// kernel count times this (launches overlap with kernels big enough to hide them).
pub const KERNEL_LAUNCH_S: f64 = 4e-6;
/// Backward's share of a layer's forward + backward compute (two GEMMs per forward GEMM).
pub const BACKWARD_SHARE: f64 = 2.0 / 3.0;

pub use crate::plan::PipelineSchedule;

/// The machines planned for.
#[derive(Debug, Clone, Copy)]
pub struct Cluster {
    pub gpus: u32,
    pub gpus_per_node: u32,
    pub profile: &'static Profile,
    /// Usable bytes per device (the profile's, or `--gpu-memory`).
    pub capacity: u64,
}

impl Cluster {
    /// A group of collective peers whose ranks span `span` consecutive GPUs talks over the
    /// node's links when that fits in one node, over the network otherwise.
    fn link(&self, span: u32) -> Link {
        if span <= self.gpus_per_node {
            self.profile.intra_node
        } else {
            self.profile.inter_node
        }
    }
    fn matmul_rate(&self, precision: &str) -> f64 {
        let p = self.profile;
        let peak = match precision {
            "bf16" => p.bf16,
            "fp32" => p.fp32,
            _ => p.tf32,
        };
        peak * MATMUL_EFFICIENCY
    }
    fn memory_rate(&self) -> f64 {
        self.profile.memory_bandwidth * MEMORY_EFFICIENCY
    }
}

/// All-reduce of `bytes` over `n` peers, as NCCL picks per message: the ring,
/// `2(n-1)/n * bytes / bw + 2(n-1) * latency`, for large messages; a (double binary) tree,
/// `2 * bytes / bw + 2 log2(n) * latency`, when latency dominates.
pub fn all_reduce_s(bytes: f64, n: u32, link: Link) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    let ring = 2.0 * (n - 1.0) / n * bytes / link.bandwidth + 2.0 * (n - 1.0) * link.latency;
    let tree = 2.0 * bytes / link.bandwidth + 2.0 * n.log2().ceil() * link.latency;
    ring.min(tree)
}

/// Ring reduce-scatter or all-gather: half an all-reduce.
pub fn gather_s(bytes: f64, n: u32, link: Link) -> f64 {
    all_reduce_s(bytes, n, link) / 2.0
}

/// Bytes one peer sends in a ring all-reduce.
fn all_reduce_sent(bytes: f64, n: u32) -> f64 {
    if n <= 1 {
        0.0
    } else {
        2.0 * (n as f64 - 1.0) / n as f64 * bytes
    }
}

/// One pipeline stage at one tensor-parallel degree: its layer groups and their sums.
#[derive(Debug, Clone)]
pub struct Stage {
    pub groups: Range<usize>,
    /// Per device: compute seconds per sample (forward + backward).
    pub compute_s: f64,
    /// Per group: seconds per sample, and the kernel-launch floor per micro-batch.
    pub group_times: Vec<(f64, f64)>,
    pub param_bytes: f64,
    pub saved_bytes: f64,
    /// The most one micro-batch holds while it runs, per sample: at the forward's end every
    /// saved value and the largest value; while group `g` runs backward, the values saved
    /// by the groups up to `g` (a later group's weight gradients have run beside its input
    /// gradient, the fuse pass's order, so its saved values are gone) and `g`'s largest value
    /// with its gradient.
    pub working_bytes: f64,
    /// The largest group's parameters (ZeRO-3 gathers one group at a time, prefetching the
    /// next).
    pub largest_group_param_bytes: f64,
    /// Sent to the next stage per sample.
    pub boundary_bytes: f64,
    /// Tensor-parallel all-reduces per forward pass, and their total bytes per sample.
    pub tp_allreduces: u32,
    pub tp_allreduce_bytes: f64,
}

impl Stage {
    /// Seconds of compute for one micro-batch of `mb` samples: each group's work, or its
    /// kernel launches when those take longer.
    pub fn compute(&self, mb: f64) -> f64 {
        self.group_times
            .iter()
            .map(|&(t, floor)| (mb * t).max(floor))
            .sum()
    }
}

/// Per-sample compute seconds of each group at tensor-parallel degree `tp`.
pub fn group_times(m: &ModelCost, c: &Cluster, tp: u32) -> Vec<f64> {
    let (mm, mem) = (c.matmul_rate(m.precision), c.memory_rate());
    (0..m.groups.len())
        .map(|g| {
            let k = m.cost(g);
            k.matmul_flops.at(tp) / mm + k.traffic_bytes.at(tp) / mem
        })
        .collect()
}

/// Splits the groups into `pp` contiguous, non-empty stages minimising the slowest stage's
/// compute: a binary search on the bottleneck with greedy packing (O(groups) per probe).
pub fn balance(times: &[f64], pp: usize) -> Vec<Range<usize>> {
    let n = times.len();
    let pp = pp.clamp(1, n.max(1));
    let pack = |limit: f64| -> Option<Vec<Range<usize>>> {
        let mut stages = Vec::with_capacity(pp);
        let (mut start, mut sum) = (0, 0.0);
        for (i, &t) in times.iter().enumerate() {
            let left_groups = n - i;
            let left_stages = pp.saturating_sub(stages.len());
            // Close the stage when this group would overflow it, or when every later stage
            // needs one of the remaining groups.
            if i > start && (sum + t > limit || left_groups < left_stages) {
                stages.push(start..i);
                start = i;
                sum = 0.0;
            }
            sum += t;
        }
        stages.push(start..n);
        let fits = stages.len() <= pp
            && stages
                .iter()
                .all(|r| times[r.clone()].iter().sum::<f64>() <= limit * (1.0 + 1e-12));
        fits.then_some(stages)
    };
    let mut hi = times.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    let mut lo = times.iter().cloned().fold(0.0, f64::max);
    let mut best = pack(hi).unwrap_or_else(|| std::iter::once(0..n).collect());
    if let Some(s) = pack(lo) {
        best = s;
    } else {
        for _ in 0..60 {
            let mid = (lo + hi) / 2.0;
            match pack(mid) {
                Some(s) => {
                    best = s;
                    hi = mid;
                }
                None => lo = mid,
            }
            if hi - lo <= hi * 1e-9 {
                break;
            }
        }
    }
    // Fewer stages than asked (few groups, or a cheap tail): split the largest ranges.
    while best.len() < pp {
        let Some((i, _)) = best
            .iter()
            .enumerate()
            .filter(|(_, r)| r.len() > 1)
            .max_by_key(|(_, r)| r.len())
        else {
            break;
        };
        let r = best[i].clone();
        let mid = r.start + r.len() / 2;
        best[i] = r.start..mid;
        best.insert(i + 1, mid..r.end);
    }
    best
}

/// The stages of `(tp, pp)`, with their per-device sums.
pub fn stages(m: &ModelCost, c: &Cluster, tp: u32, pp: u32) -> Vec<Stage> {
    let times = group_times(m, c, tp);
    balance(&times, pp as usize)
        .into_iter()
        .map(|r| {
            let mut s = Stage {
                groups: r.clone(),
                compute_s: 0.0,
                group_times: Vec::with_capacity(r.len()),
                param_bytes: 0.0,
                saved_bytes: 0.0,
                working_bytes: 0.0,
                largest_group_param_bytes: 0.0,
                boundary_bytes: 0.0,
                tp_allreduces: 0,
                tp_allreduce_bytes: 0.0,
            };
            let mut largest = 0.0f64;
            for g in r {
                let k = m.cost(g);
                s.compute_s += times[g];
                s.group_times
                    .push((times[g], k.kernels as f64 * KERNEL_LAUNCH_S));
                let p = k.param_bytes.at(tp);
                s.param_bytes += p;
                s.largest_group_param_bytes = s.largest_group_param_bytes.max(p);
                s.saved_bytes += k.saved_bytes.at(tp);
                largest = largest.max(k.largest_value_bytes.at(tp));
                let backward = s.saved_bytes + 2.0 * k.largest_value_bytes.at(tp);
                s.working_bytes = s.working_bytes.max(backward);
                s.boundary_bytes = k.output_bytes;
                s.tp_allreduces += k.tp_allreduces;
                s.tp_allreduce_bytes += k.tp_allreduces as f64 * k.tp_allreduce_bytes;
            }
            s.working_bytes = s.working_bytes.max(s.saved_bytes + largest);
            s
        })
        .collect()
}

/// What one device holds at its peak, in bytes. `total` is the sum of the items.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DeviceMemory {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    pub activations: u64,
    pub communication_buffers: u64,
    pub inputs: u64,
    pub total: u64,
}

/// Where a step's time goes on the slowest path, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepTime {
    pub compute_s: f64,
    /// Idle stages while the pipeline fills and drains: `(pp-1)/(M+pp-1)` of the pipeline.
    pub bubble_s: f64,
    pub tensor_parallel_s: f64,
    pub pipeline_p2p_s: f64,
    /// The part of the data-parallel collectives backward does not hide.
    pub data_parallel_exposed_s: f64,
    pub optimizer_s: f64,
    pub total_s: f64,
}

/// One candidate's options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Options {
    pub dp: u32,
    pub tp: u32,
    pub pp: u32,
    /// 0: replicated; 1: optimizer state sharded over dp; 2: and gradients; 3: and parameters.
    pub zero: u8,
    pub schedule: PipelineSchedule,
    /// Micro-batches per replica per step (pipeline micro-batches, or gradient accumulation).
    pub micro_batches: u64,
}

/// A candidate's estimate.
#[derive(Debug, Clone)]
pub struct Estimate {
    pub micro_batch_size: u64,
    /// Per pipeline stage (one device of each stage; tp and dp peers hold the same).
    pub memory: Vec<DeviceMemory>,
    pub time: StepTime,
    /// Bytes one device sends per step (the busiest device).
    pub bytes_sent: u64,
}

impl Estimate {
    /// The fullest device.
    pub fn peak(&self) -> DeviceMemory {
        self.memory
            .iter()
            .copied()
            .max_by_key(|m| m.total)
            .unwrap_or_default()
    }
}

/// Memory and time of `o` with the stages of `(o.tp, o.pp)`.
pub fn estimate(m: &ModelCost, c: &Cluster, stages: &[Stage], o: &Options) -> Estimate {
    let dp = o.dp.max(1);
    let replica_batch = m.batch.div_ceil(dp as u64).max(1);
    let mb = replica_batch.div_ceil(o.micro_batches.max(1)).max(1);
    let micro = replica_batch.div_ceil(mb) as f64;
    let mbf = mb as f64;
    let pp = stages.len() as u32;
    let ratio = m.state_ratio();
    let tp_link = c.link(o.tp);
    let dp_link = c.link(o.tp * dp);
    let p2p_link = c.link(o.tp * dp * pp);
    let shard = |b: f64, on: bool| if on { b / dp as f64 } else { b };
    let inputs =
        replica_batch as f64 * m.input_bytes_per_sample as f64 + m.input_bytes_fixed as f64;

    let mut memory = Vec::with_capacity(stages.len());
    let (mut slowest_mb, mut slowest_compute, mut slowest_tp, mut slowest_p2p) =
        (0.0f64, 0.0, 0.0, 0.0);
    let (mut dp_exposed, mut optimizer, mut sent) = (0.0f64, 0.0f64, 0.0f64);
    for (i, s) in stages.iter().enumerate() {
        let in_flight = match o.schedule {
            PipelineSchedule::Sequential => 1.0,
            PipelineSchedule::GPipe => micro,
            PipelineSchedule::OneFOneB => (pp as f64 - i as f64).min(micro),
        };
        let params = shard(s.param_bytes, o.zero >= 3);
        let grads = shard(s.param_bytes, o.zero >= 2);
        let state = shard(s.param_bytes * ratio, o.zero >= 1);
        let mut comm = 0.0;
        if dp > 1 {
            comm += if o.zero >= 3 {
                2.0 * s.largest_group_param_bytes
            } else {
                2.0 * BUCKET_BYTES.min(s.param_bytes)
            };
        }
        if pp > 1 {
            // Send and receive buffers for the activation going forward and its gradient back.
            comm += 4.0 * mbf * s.boundary_bytes;
        }
        let items = [
            params,
            grads,
            state,
            (in_flight - 1.0) * mbf * s.saved_bytes + mbf * s.working_bytes,
            comm,
            inputs,
        ]
        .map(|b| b.ceil() as u64);
        memory.push(DeviceMemory {
            parameters: items[0],
            gradients: items[1],
            optimizer_state: items[2],
            activations: items[3],
            communication_buffers: items[4],
            inputs: items[5],
            // Items past u64 (a batch near 2^64) saturate: so does their sum.
            total: items.iter().fold(0u64, |a, &b| a.saturating_add(b)),
        });

        // Time of one micro-batch on this stage: compute, the Megatron all-reduces (two in
        // forward and two in backward per transformer block), the p2p sends.
        let compute = s.compute(mbf);
        let tp_ar = if o.tp > 1 {
            let latency = all_reduce_s(0.0, o.tp, tp_link);
            2.0 * (all_reduce_s(mbf * s.tp_allreduce_bytes, o.tp, tp_link) - latency
                + s.tp_allreduces as f64 * latency)
        } else {
            0.0
        };
        let p2p = if pp > 1 {
            2.0 * (p2p_link.latency + mbf * s.boundary_bytes / p2p_link.bandwidth)
        } else {
            0.0
        };
        let stage_mb = compute + tp_ar + p2p;
        if stage_mb > slowest_mb {
            (slowest_mb, slowest_compute, slowest_tp, slowest_p2p) =
                (stage_mb, compute, tp_ar, p2p);
        }
        let mut stage_sent = micro
            * (2.0 * all_reduce_sent(mbf * s.tp_allreduce_bytes, o.tp)
                + if pp > 1 {
                    2.0 * mbf * s.boundary_bytes
                } else {
                    0.0
                });

        // Data parallel: gradients reduced in buckets while backward still runs, so only what
        // outlasts the last micro-batch's backward (and at least the last bucket) is exposed.
        let g = s.param_bytes;
        let bucket = gather_s(BUCKET_BYTES.min(g), dp, dp_link) * 2.0;
        let backward = BACKWARD_SHARE * compute;
        let exposed = match o.zero {
            _ if dp <= 1 => 0.0,
            // One all-reduce of the accumulated gradients.
            0 => (all_reduce_s(g, dp, dp_link) - backward).max(bucket),
            // Reduce-scatter behind backward (per micro-batch once gradients are sharded),
            // then the updated parameter shards all-gathered, exposed.
            1 | 2 => {
                let rs_per = if o.zero == 2 { micro } else { 1.0 };
                (rs_per * gather_s(g, dp, dp_link) - backward).max(bucket / 2.0)
                    + gather_s(g, dp, dp_link)
            }
            // Parameters gathered for each micro-batch's forward and backward and gradients
            // reduce-scattered, prefetched one group ahead of the compute; each group waits
            // for its gather, so every collective's latency is exposed.
            _ => {
                let per_mb = 3.0 * gather_s(g, dp, dp_link);
                let collectives = 3.0 * micro * s.group_times.len() as f64;
                micro * (per_mb - compute).max(0.0)
                    + gather_s(s.largest_group_param_bytes, dp, dp_link)
                    + collectives * gather_s(0.0, dp, dp_link)
            }
        };
        stage_sent += match o.zero {
            _ if dp <= 1 => 0.0,
            0 => all_reduce_sent(g, dp),
            1 => all_reduce_sent(g, dp),
            2 => (micro + 1.0) * all_reduce_sent(g, dp) / 2.0,
            _ => 3.0 * micro * all_reduce_sent(g, dp) / 2.0,
        };
        // The update reads parameters, gradients and state and writes parameters and state:
        // memory-bound, on this device's shard.
        let touched = shard(g, o.zero >= 1) * (3.0 + 2.0 * ratio);
        dp_exposed = f64::max(dp_exposed, exposed);
        // The stage's share of the update kernels, by its share of the groups.
        let share = s.group_times.len() as f64 / m.groups.len().max(1) as f64;
        let update =
            (touched / c.memory_rate()).max(share * m.update_kernels as f64 * KERNEL_LAUNCH_S);
        optimizer = f64::max(optimizer, update);
        sent = sent.max(stage_sent);
    }
    // Every micro-batch passes the slowest stage; the other pp-1 slots are the bubble.
    let time = StepTime {
        compute_s: micro * slowest_compute,
        bubble_s: (pp as f64 - 1.0) * slowest_mb,
        tensor_parallel_s: micro * slowest_tp,
        pipeline_p2p_s: micro * slowest_p2p,
        data_parallel_exposed_s: dp_exposed,
        optimizer_s: optimizer,
        total_s: (micro + pp as f64 - 1.0) * slowest_mb + dp_exposed + optimizer,
    };
    Estimate {
        micro_batch_size: mb,
        memory,
        time,
        bytes_sent: sent.ceil() as u64,
    }
}
