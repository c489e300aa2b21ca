//! `parallax train` as one rank of a launcher's job (`mpirun`, `srun`, a PMI launcher, or
//! torchrun-style variables): where this process stands, and the communicator its device
//! trains over (MPI's, or TCP through rank 0 under torchrun-style variables).

use crate::Exit;
use parallax_runtime::launch::{Launcher, World};
use parallax_runtime::ranks::Peers;
use std::path::Path;
use std::time::Duration;

/// Where this process stands, as its launcher's variables say.
pub fn world(file: &Path) -> Result<World, Exit> {
    World::from_env(&|k| std::env::var(k).ok()).map_err(|e| {
        errln!("{}: error: {e}", file.display());
        Exit(1)
    })
}

/// Whether the process is one rank of a launcher's job (a lone torchrun rank is not).
pub fn in_job(world: &World) -> bool {
    match world.launcher {
        Launcher::OpenMpi | Launcher::Slurm | Launcher::Pmi => true,
        Launcher::Torchrun => world.size > 1,
        Launcher::None => false,
    }
}

/// A running job: MPI started (or the TCP links made), and this rank's communicator.
pub struct Job {
    pub peers: Peers,
    pub rank: usize,
    // Dropped after `peers` (fields drop in order): MPI ends with the last communicator.
    #[cfg(feature = "mpi")]
    _mpi: Option<parallax_runtime::comm::mpi::Mpi>,
}

/// Joins the job's communicator; its collectives give up on a silent peer after `timeout`.
pub fn start(file: &Path, world: &World, timeout: Duration) -> Result<Job, Exit> {
    match (world.launcher, &world.master) {
        (Launcher::Torchrun, Some((host, port))) => start_tcp(file, world, host, *port, timeout),
        _ => start_mpi(file, timeout),
    }
}

/// Under torchrun-style variables: rank 0 listens at `MASTER_PORT`, the others connect.
fn start_tcp(
    file: &Path,
    world: &World,
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<Job, Exit> {
    use parallax_runtime::comm::tcp::TcpComm;
    use parallax_runtime::comm::Communicator;
    let token = concat!("parallax ", env!("CARGO_PKG_VERSION"));
    let comm = TcpComm::connect(world.rank, world.size, host, port, token, timeout).map_err(|e| {
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
