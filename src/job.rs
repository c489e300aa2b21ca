//! `parallax train` as one rank of a launcher's job (`mpirun`, `srun`, a PMI launcher, or
//! torchrun-style variables): where this process stands, and the communicator its device
//! trains over (MPI's, or TCP through rank 0 under torchrun-style variables).

use crate::Exit;
use parallax_runtime::comm::world::{Launcher, World};
use parallax_runtime::ranks::Peers;
use std::path::Path;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

/// A running job: MPI started (or the TCP links made), and this rank's communicator.
pub struct Job {
    pub peers: Peers,
    pub rank: usize,
    // Dropped after `peers` (fields drop in order): MPI ends with the last communicator.
    #[cfg(feature = "mpi")]
    _mpi: Option<parallax_runtime::comm::mpi::Mpi>,
}

/// Joins the job's communicator; its collectives give up on a silent peer after `timeout`.
/// A signal (`stop` non-zero) while the ranks meet ends this rank.
pub fn start(
    file: &Path,
    world: &World,
    timeout: Duration,
    stop: &AtomicUsize,
) -> Result<Job, Exit> {
    match (world.launcher, &world.master) {
        (Launcher::Torchrun, Some((host, port))) => {
            let agent = std::env::var("TORCHELASTIC_USE_AGENT_STORE").ok();
            let port = job_port(*port, agent.as_deref()).ok_or_else(|| {
                errln!("{}: error: MASTER_PORT={port} leaves no port above it for the ranks (torchrun's agent holds MASTER_PORT)", file.display());
                Exit(1)
            })?;
            start_tcp(file, world, host, port, timeout, stop)
        }
        _ => start_mpi(file, timeout),
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

/// Under torchrun-style variables: rank 0 listens at `MASTER_PORT`, the others connect.
fn start_tcp(
    file: &Path,
    world: &World,
    host: &str,
    port: u16,
    timeout: Duration,
    stop: &AtomicUsize,
) -> Result<Job, Exit> {
    use parallax_runtime::comm::tcp::TcpComm;
    use parallax_runtime::comm::Communicator;
    let token = concat!("parallax ", env!("CARGO_PKG_VERSION"));
    let comm = TcpComm::connect(world.rank, world.size, host, port, token, timeout, stop).map_err(|e| {
        errln!("{}: error: {e}", file.display());
        errln!("  = hint: every rank needs the same MASTER_ADDR and MASTER_PORT, rank 0 must be able to listen at that port and the others to reach it; --collective-timeout says how long they wait for each other");
        Exit(1)
    })?;
    let comm: Box<dyn Communicator> = Box::new(comm);
    Ok(Job {
        peers: std::sync::Arc::new(std::sync::Mutex::new(comm)),
        rank: world.rank,
        #[cfg(feature = "mpi")]
        _mpi: None,
    })
}

/// Starts MPI for this rank.
#[cfg(feature = "mpi")]
fn start_mpi(file: &Path, timeout: Duration) -> Result<Job, Exit> {
    use parallax_runtime::comm::mpi::Mpi;
    use parallax_runtime::comm::Communicator;
    let (mpi, comm) = Mpi::start(timeout).map_err(|e| {
        errln!("{}: error: {e}", file.display());
        Exit(1)
    })?;
    let rank = comm.rank();
    let comm: Box<dyn Communicator> = Box::new(comm);
    Ok(Job {
        peers: std::sync::Arc::new(std::sync::Mutex::new(comm)),
        rank,
        _mpi: Some(mpi),
    })
}

#[cfg(not(feature = "mpi"))]
fn start_mpi(file: &Path, _: Duration) -> Result<Job, Exit> {
    errln!(
        "{}: error: this process is a rank of a launcher's job, but this parallax was built without MPI",
        file.display()
    );
    errln!("  = hint: build it with `cargo build --release --features mpi` (Debian: apt-get install openmpi-bin libopenmpi-dev libclang-dev pkgconf)");
    Err(Exit(1))
}

/// Ends a rank that failed at once, with `code`: not through `MPI_Finalize`, which waits for
/// every rank (one that stopped answering would hold this one); the launcher ends the job's
/// other processes.
pub fn fail(code: u8) -> ! {
    std::process::exit(code.into())
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
