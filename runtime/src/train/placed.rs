//! A training run where `prepare::decide` placed it: in this process, or as one rank of a
//! launcher's job, whose communicator it joins first (`comm::job`).

use super::prepare::Decided;
use super::{train, train_rank, Device, Event, Summary, TrainConfig, TrainError};
use crate::comm::job::{Job, JobError};
use parallax_compiler::Source;
use std::time::Duration;

/// How a placed run ended, beyond its summary.
#[derive(Debug, thiserror::Error)]
pub enum PlacedError {
    /// This rank could not join its job.
    #[error("{0}")]
    Job(#[from] JobError),
    /// A rank of a job failed: the message names the rank once. The process should end at
    /// once, not through `MPI_Finalize`, which waits for every rank (one that stopped
    /// answering would hold this one); the launcher ends the job's other processes.
    #[error("{0}")]
    Rank(String),
    #[error(transparent)]
    Train(#[from] TrainError),
}

/// Trains `source` as `decided` placed it; a rank of a job waits `timeout` for a silent peer;
/// `env` reads the environment (the launcher's variables). A planted fault strikes before
/// its step's event is told.
pub fn train_placed(
    source: &Source,
    decided: Decided,
    cfg: &TrainConfig,
    timeout: Duration,
    env: &dyn Fn(&str) -> Option<String>,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary, PlacedError> {
    let rank = decided.world.rank;
    let on_event = &mut |e: &Event| {
        if let (Some(fault), Event::Step { step, .. }) = (cfg.fault, e) {
            fault.strike(rank, *step);
        }
        on_event(e)
    };
    let joins = matches!(cfg.device, Device::Simulated(_) | Device::CudaRanks(_));
    if !(decided.in_job && joins) {
        return Ok(train(source, decided.plan, cfg, on_event)?);
    }
    let stop = cfg.stop.clone().unwrap_or_default();
    let job = Job::start(&decided.world, timeout, &stop, env)?;
    match train_rank(source, decided.plan, cfg, job.peers.clone(), on_event) {
        Err(e @ (TrainError::Interrupted { .. } | TrainError::Finished { .. })) => Err(e.into()),
        Err(e) => {
            let e = e.to_string();
            let rank = format!("rank {}: ", job.rank);
            // Never finalized: the caller ends the process at once.
            std::mem::forget(job);
            Err(PlacedError::Rank(match e.contains(&rank) {
                true => e,
                false => format!("{rank}{e}"),
            }))
        }
        Ok(s) => Ok(s),
    }
}
