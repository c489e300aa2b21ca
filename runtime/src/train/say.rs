//! What a run says as it goes, in words: the devices it runs on, each event's line and the
//! summary's. The CLI prints them (and draws its bar).

use super::config::Device;
use super::{Event, Summary};
use crate::comm::world::World;
use parallax_compiler::Plan;

/// The devices `plan` runs on, as the start line names them (`in_job`: this process is one
/// rank of `world`'s launcher).
pub fn devices(device: &Device, plan: &Plan, in_job: bool, world: &World) -> String {
    let shards = plan.sharding.map_or(1, |s| s.shards);
    let ranks = |here: String| match in_job {
        true => format!("rank(s) under {}", world.launcher),
        false => here,
    };
    match device {
        Device::Cuda(_) => "CUDA backend (GPU 0)".to_string(),
        Device::Cpu => "CPU backend".to_string(),
        Device::Simulated(s) => format!(
            "CPU backend, {} {} (dp{}.tp{}.pp{}) over {shards} micro-shards",
            s.grid.devices(),
            ranks("simulated device(s)".to_string()),
            s.grid.dp,
            s.grid.tp,
            s.grid.pp,
        ),
        Device::CudaRanks(g) => format!(
            "CUDA backend, {} GPU {} (dp{}.tp{}.pp{}) over {shards} micro-shards, summed {}",
            g.ranks.grid.devices(),
            ranks(format!("rank(s) in this process on {} GPU(s)", g.gpus)),
            g.ranks.grid.dp,
            g.ranks.grid.tp,
            g.ranks.grid.pp,
            match g.nccl {
                Some(_) => "on the GPUs over NCCL",
                None => "on the host",
            }
        ),
    }
}

impl Event {
    /// The event's line for the run `name` on `devices` (a step's: for a log without a bar).
    pub fn line(&self, name: &str, devices: &str) -> String {
        match self {
            Event::Start {
                total_steps,
                train_samples,
                validation_samples,
                ..
            } => format!("{name}: training {total_steps} steps on {train_samples} samples ({validation_samples} for validation), {devices}"),
            Event::Step {
                step,
                total,
                epoch,
                loss,
                samples_per_sec,
            } => format!("step {step}/{total}  epoch {epoch}  loss {loss:.4}  {samples_per_sec:.0} samples/s"),
            Event::Validation {
                epoch,
                loss,
                accuracy,
            } => {
                let acc = accuracy.map_or(String::new(), |a| format!("  accuracy {:.2}%", a * 100.0));
                format!("epoch {epoch}: validation loss {loss:.4}{acc}")
            }
            Event::Warning(w) => format!("{name}: warning: {w}"),
        }
    }
}

impl Summary {
    /// The run's last line: steps, losses, accuracy, speed and time.
    pub fn line(&self) -> String {
        let acc = self.val_accuracy.map_or(String::new(), |a| {
            format!(", validation accuracy {:.2}%", a * 100.0)
        });
        let val = self
            .val_loss
            .map_or(String::new(), |l| format!(", validation loss {l:.4}"));
        format!(
            "{}: {} steps, train loss {:.4}{val}{acc}, {:.0} samples/s, {:.1} s",
            self.name, self.steps, self.final_train_loss, self.samples_per_sec, self.wall_seconds
        )
    }
}
