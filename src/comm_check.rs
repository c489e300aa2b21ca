//! `parallax comm-check`: the communicator's self-check on the ranks `mpirun` started.

use crate::Exit;
use parallax_runtime::comm::check::Fault;

pub fn run(timeout: u64, fail_rank: Option<usize>, hang_rank: Option<usize>) -> Result<(), Exit> {
    let fault = match (fail_rank, hang_rank) {
        (Some(r), _) => Some(Fault::Fail(r)),
        // Longer than the others wait, so that they are the ones to give up.
        (None, Some(r)) => Some(Fault::Hang {
            rank: r,
            secs: timeout.saturating_mul(3).max(1),
        }),
        (None, None) => None,
    };
    check(timeout, fault)
}

#[cfg(feature = "mpi")]
fn check(timeout: u64, fault: Option<Fault>) -> Result<(), Exit> {
    use parallax_runtime::comm::mpi::Mpi;
    use parallax_runtime::comm::Communicator;
    use std::io::Write;
    let (mpi, mut comm) = Mpi::start(std::time::Duration::from_secs(timeout)).map_err(|e| {
        eprintln!("error: {e}");
        Exit(1)
    })?;
    let rank = comm.rank();
    match parallax_runtime::comm::check::run(&mut comm, fault) {
        Ok(lines) => {
            if rank == 0 {
                for l in lines {
                    println!("{l}");
                }
            }
            drop(comm);
            drop(mpi);
            Ok(())
        }
        Err(e) => {
            // One write, so that the ranks' lines do not interleave.
            let _ = std::io::stderr().write_all(format!("error: {e}\n").as_bytes());
            // Not through MPI_Finalize, which waits for every rank: a rank that stopped
            // answering would hold this one. mpirun ends the job's other processes.
            std::process::exit(1)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn check(_: u64, _: Option<Fault>) -> Result<(), Exit> {
    eprintln!(
        "error: this parallax was built without MPI; build it with `cargo build --release --features mpi` (Debian: apt-get install openmpi-bin libopenmpi-dev libclang-dev pkgconf)"
    );
    Err(Exit(1))
}
