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

/// The lines of a run's log without a progress bar: the start, a step every tenth of the
/// run and the last, each validation and warning.
pub struct Log {
    name: String,
    devices: String,
    every: u64,
}

impl Log {
    /// The log of the run `name` on `devices`.
    pub fn new(name: &str, devices: String) -> Log {
        Log {
            name: name.to_string(),
            devices,
            every: 1,
        }
    }

    /// The line `e` adds to the log, if any.
    pub fn line(&mut self, e: &Event) -> Option<String> {
        match e {
            Event::Start { total_steps, .. } => self.every = (total_steps / 10).max(1),
            Event::Step { step, total, .. } if step % self.every != 0 && step != total => {
                return None
            }
            _ => {}
        }
        Some(e.line(&self.name, &self.devices))
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

#[cfg(test)]
mod tests {
    use super::{Event, Log};

    fn step(step: u64, total: u64) -> Event {
        Event::Step {
            step,
            total,
            epoch: 1,
            loss: 0.5,
            samples_per_sec: 100.0,
        }
    }

    #[test]
    fn a_log_shows_the_start_every_tenth_step_the_last_and_each_warning() {
        let mut log = Log::new("mlp", "CPU backend".into());
        let start = Event::Start {
            total_steps: 25,
            batches_per_epoch: 5,
            train_samples: 80,
            validation_samples: 20,
        };
        assert_eq!(
            log.line(&start).as_deref(),
            Some("mlp: training 25 steps on 80 samples (20 for validation), CPU backend")
        );
        let shown: Vec<u64> = (1..=25)
            .filter(|&s| log.line(&step(s, 25)).is_some())
            .collect();
        assert_eq!(shown, [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 25]);
        let warning = Event::Warning("the loss is NaN".into());
        assert_eq!(
            log.line(&warning).as_deref(),
            Some("mlp: warning: the loss is NaN")
        );
    }
}
