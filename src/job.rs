//! `parallax train` as one rank of a launcher's job (`mpirun`, `srun`, a PMI launcher):
//! where this process stands, and the communicator its device trains over.

use crate::Exit;
use parallax_runtime::launch::{Launcher, World};
use parallax_runtime::ranks::Peers;
use std::path::Path;
use std::time::Duration;

/// Where this process stands, as its launcher's variables say.
pub fn world(file: &Path) -> Result<World, Exit> {
    let world = World::from_env(&|k| std::env::var(k).ok()).map_err(|e| {
        errln!("{}: error: {e}", file.display());
        Exit(1)
    })?;
    if world.launcher == Launcher::Torchrun && world.size > 1 {
        errln!(
            "{}: error: torchrun-style variables set a world of {} rank(s), but ranks meet over MPI only (start them with mpirun or srun)",
            file.display(),
            world.size
        );
        errln!("  = hint: start the ranks with `mpirun -np {}` (or `srun`); on one machine `--gpus {}` runs them in this process", world.size, world.size);
        return Err(Exit(1));
    }
    Ok(world)
}

/// Whether the process is one rank of a launcher's job (a lone torchrun rank is not).
pub fn in_job(world: &World) -> bool {
    matches!(
        world.launcher,
        Launcher::OpenMpi | Launcher::Slurm | Launcher::Pmi
    )
}

/// A running job: MPI started, and this rank's communicator.
pub struct Job {
    pub peers: Peers,
    pub rank: usize,
    // Dropped after `peers` (fields drop in order): MPI ends with the last communicator.
    #[cfg(feature = "mpi")]
    _mpi: parallax_runtime::comm::mpi::Mpi,
}

/// Starts MPI for this rank; its collectives give up on a silent peer after `timeout`.
#[cfg(feature = "mpi")]
pub fn start(file: &Path, timeout: Duration) -> Result<Job, Exit> {
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
        _mpi: mpi,
    })
}

#[cfg(not(feature = "mpi"))]
pub fn start(file: &Path, _: Duration) -> Result<Job, Exit> {
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
