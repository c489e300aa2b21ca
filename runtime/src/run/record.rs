//! `run.json`, typed: the run's identity (a hash of its resolved experiment and of every
//! data sample), what it ran on and with which plan, and each continuation. Written by the
//! trainer, read back by `--resume` and the command line; fields added later default, so
//! records of older runs still read.

use parallax_compiler::plan::{PipelineSchedule, Strategy};
use parallax_compiler::target::Recorded;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The file name, in the run folder.
pub const FILE: &str = "run.json";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    pub run_id: String,
    pub data_sha256: String,
    pub parallax_version: String,
    pub backend: String,
    /// `cpu`, `cuda:0 (Tf32)`, `4 simulated device(s) on the cpu (dp2.tp1.pp2)`.
    pub devices: String,
    pub plan: PlanRecord,
    /// Each simulated device's memory, when the plan ran on simulated devices.
    pub device_memory_bytes: Option<Vec<u64>>,
    /// The `--set` overrides, as given.
    pub overrides: Vec<String>,
    pub checkpoint_every: u64,
    /// Checkpoints kept (0: all); absent in records written before it was kept.
    #[serde(default)]
    pub keep: Option<usize>,
    #[serde(default)]
    pub resumes: Vec<Continuation>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRecord {
    pub strategy: Strategy,
    /// Micro-shards per batch, when the plan was partitioned.
    pub micro_shards: Option<u32>,
    pub optimizer_shards: u32,
    pub kernels: usize,
    pub ops: usize,
    pub peak_memory_bytes: u64,
    pub batch_size: u64,
    /// The ZeRO stage (absent in records written before it was kept: read from
    /// `optimizer_shards`, stage 1 where they are sharded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero_stage: Option<u8>,
    /// The pipeline schedule (absent in records written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<PipelineSchedule>,
}

impl PlanRecord {
    /// The record of `plan`.
    pub fn of(plan: &parallax_compiler::Plan) -> PlanRecord {
        PlanRecord {
            strategy: plan.strategy,
            micro_shards: plan.sharding.map(|s| s.shards),
            optimizer_shards: plan.optimizer_shards,
            kernels: plan.kernels.len(),
            ops: plan.ops,
            peak_memory_bytes: plan.memory.peak_bytes,
            batch_size: plan.batch_size,
            zero_stage: plan.sharding.map(|_| plan.zero_stage),
            schedule: plan.sharding.and(plan.schedule),
        }
    }
}

/// One `--resume`: where it started, and the identity and settings it continued with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Continuation {
    pub from_step: u64,
    pub run_id: String,
    #[serde(default)]
    pub data_sha256: Option<String>,
    pub devices: String,
    #[serde(default)]
    pub checkpoint_every: Option<u64>,
    #[serde(default)]
    pub keep: Option<usize>,
    /// What changed since the run was written, continued with `--accept-changes`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accepted_changes: Vec<String>,
    /// The plan it continued with (absent in records written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlanRecord>,
}

impl RunRecord {
    /// The record of the run in `dir`.
    pub fn read(dir: &Path) -> Result<RunRecord, String> {
        let path = dir.join(FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
        serde_json::from_str(&text).map_err(|e| format!("not the record a run writes ({e})"))
    }

    /// The record as written, pretty and newline-terminated.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a record serialises") + "\n"
    }

    /// Every identity the run has had: its first, and each continuation's (a longer step
    /// budget, or a change accepted with `--accept-changes`, gives a new one).
    pub fn run_ids(&self) -> Vec<&str> {
        std::iter::once(self.run_id.as_str())
            .chain(self.resumes.iter().map(|r| r.run_id.as_str()))
            .collect()
    }

    /// Every data hash the run has trained on.
    pub fn data_hashes(&self) -> Vec<&str> {
        std::iter::once(self.data_sha256.as_str())
            .chain(self.resumes.iter().filter_map(|r| r.data_sha256.as_deref()))
            .collect()
    }

    /// The checkpoint cadence and how many are kept, as the run last trained.
    pub fn cadence(&self) -> (u64, Option<usize>) {
        match self
            .resumes
            .iter()
            .rev()
            .find(|r| r.checkpoint_every.is_some())
        {
            Some(r) => (r.checkpoint_every.unwrap_or(0), r.keep),
            None => (self.checkpoint_every, self.keep),
        }
    }

    /// The split the run in `dir` trained with, when it was partitioned.
    pub fn split_of(dir: &Path) -> Option<Recorded> {
        RunRecord::read(dir).ok()?.split()
    }

    /// The split the run last trained with, when its plan was partitioned: its degrees, ZeRO
    /// stage and pipeline schedule, as recorded.
    pub fn split(&self) -> Option<Recorded> {
        let plan = self.resumes.iter().rev().find_map(|r| r.plan.as_ref());
        let plan = plan.unwrap_or(&self.plan);
        plan.micro_shards?;
        let s = plan.strategy;
        Some(Recorded {
            strategy: s,
            zero: plan
                .zero_stage
                .unwrap_or(u8::from(plan.optimizer_shards > 1)),
            schedule: plan.schedule.unwrap_or(match s.pp {
                1 => PipelineSchedule::Sequential,
                _ => PipelineSchedule::OneFOneB,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record as runs wrote it before `keep` and the continuations' own settings existed.
    const OLD: &str = r#"{
  "backend": "cpu",
  "checkpoint_every": 25,
  "data_sha256": "ab",
  "device_memory_bytes": null,
  "devices": "cpu",
  "overrides": [],
  "parallax_version": "0.1.0",
  "plan": {"batch_size": 64, "kernels": 20, "micro_shards": null, "ops": 40,
           "optimizer_shards": 1, "peak_memory_bytes": 1000,
           "strategy": {"dp": 1, "pp": 1, "tp": 1}},
  "resumes": [{"devices": "cpu", "from_step": 50, "run_id": "r2"}],
  "run_id": "r1"
}"#;

    #[test]
    fn older_records_read_and_records_round_trip() {
        let r: RunRecord = serde_json::from_str(OLD).unwrap();
        assert_eq!(r.run_ids(), ["r1", "r2"]);
        assert_eq!(r.data_hashes(), ["ab"]);
        assert_eq!(r.cadence(), (25, None));
        assert!(r.split().is_none());
        let again: RunRecord = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(again, r);
        // A partitioned run from before the ZeRO stage and schedule were kept: sharded
        // optimizer state is read as stage 1.
        let old_split = OLD
            .replace("\"micro_shards\": null", "\"micro_shards\": 8")
            .replace("\"optimizer_shards\": 1", "\"optimizer_shards\": 2")
            .replace("\"dp\": 1", "\"dp\": 2");
        let r: RunRecord = serde_json::from_str(&old_split).unwrap();
        let s = r.split().unwrap();
        assert_eq!((s.strategy.dp, s.zero), (2, 1));
        assert_eq!(s.schedule, PipelineSchedule::Sequential);
    }
}
