//! One rank of a launcher's job (`mpirun`, `srun`, a PMI launcher, or torchrun-style
//! variables): the communicator its device trains over, chosen by the launcher (MPI's, or
//! TCP through rank 0 under torchrun-style variables).

use crate::comm::world::{Launcher, World};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Why this rank could not join its job.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("MASTER_PORT={0} leaves no port above it for the ranks (torchrun's agent holds MASTER_PORT)")]
    NoPort(u16),
    #[error("{0}")]
    Tcp(#[from] super::tcp::TcpError),
    #[cfg(feature = "mpi")]
    #[error("{0}")]
    Mpi(#[from] super::mpi::MpiError),
    #[error("this process is a rank of a launcher's job, but this parallax was built without MPI")]
    NoMpi,
}

impl JobError {
    /// What to do about it.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            JobError::Tcp(_) => Some("every rank needs the same MASTER_ADDR and MASTER_PORT, rank 0 must be able to listen at that port and the others to reach it; --collective-timeout says how long they wait for each other"),
            JobError::NoMpi => Some("build it with `cargo build --release --features mpi` (Debian: apt-get install openmpi-bin libopenmpi-dev libclang-dev pkgconf)"),
            _ => None,
        }
    }
}

/// What keeps MPI up while a job of MPI ranks runs (nothing can be one without `mpi`).
#[cfg(feature = "mpi")]
type MpiUp = super::mpi::Mpi;
#[cfg(not(feature = "mpi"))]
type MpiUp = std::convert::Infallible;

/// A running job: MPI started (or the TCP links made), and this rank's communicator.
pub struct Job {
    /// `ranks::Peers`: what a rank's device trains over.
    pub peers: Arc<Mutex<Box<dyn super::Communicator>>>,
    pub rank: usize,
    // Dropped after `peers` (fields drop in order): MPI ends with the last communicator.
    _mpi: Option<MpiUp>,
}

impl Job {
    /// Joins the job's communicator; its collectives give up on a silent peer after
    /// `timeout`. A signal (`stop` non-zero) while the ranks meet ends the wait. `var` reads
    /// the environment.
    pub fn start(
        world: &World,
        timeout: Duration,
        stop: &AtomicUsize,
        var: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Job, JobError> {
        match (world.launcher, &world.master) {
            (Launcher::Torchrun, Some((host, port))) => {
                let agent = var("TORCHELASTIC_USE_AGENT_STORE");
                let port = job_port(*port, agent.as_deref()).ok_or(JobError::NoPort(*port))?;
                let token = concat!("parallax ", env!("CARGO_PKG_VERSION"));
                let comm = super::tcp::TcpComm::connect(
                    world.rank, world.size, host, port, token, timeout, stop,
                )?;
                Ok(Job::of(Box::new(comm), world.rank, None))
            }
            _ => Job::start_mpi(timeout),
        }
    }

    #[cfg(feature = "mpi")]
    fn start_mpi(timeout: Duration) -> Result<Job, JobError> {
        use super::Communicator;
        let (mpi, comm) = super::mpi::Mpi::start(timeout)?;
        let rank = comm.rank();
        Ok(Job::of(Box::new(comm), rank, Some(mpi)))
    }

    #[cfg(not(feature = "mpi"))]
    fn start_mpi(_: Duration) -> Result<Job, JobError> {
        Err(JobError::NoMpi)
    }

    fn of(comm: Box<dyn super::Communicator>, rank: usize, mpi: Option<MpiUp>) -> Job {
        Job {
            peers: Arc::new(Mutex::new(comm)),
            rank,
            _mpi: mpi,
        }
    }
}

/// The port rank 0 listens at: `MASTER_PORT`, or the next one when torchrun's agent holds
/// `MASTER_PORT` for its own store (`TORCHELASTIC_USE_AGENT_STORE=True`, as torchrun sets
/// for its workers).
fn job_port(master_port: u16, agent_store: Option<&str>) -> Option<u16> {
    match agent_store {
        Some(v) if v.eq_ignore_ascii_case("true") || v == "1" => master_port.checked_add(1),
        _ => Some(master_port),
    }
}

#[cfg(test)]
mod tests {
    use super::job_port;

    #[test]
    fn under_torchrun_the_ranks_meet_above_the_agents_port() {
        assert_eq!(job_port(29500, None), Some(29500));
        assert_eq!(job_port(29500, Some("False")), Some(29500));
        assert_eq!(job_port(29500, Some("True")), Some(29501));
        assert_eq!(job_port(u16::MAX, Some("True")), None);
    }
}
