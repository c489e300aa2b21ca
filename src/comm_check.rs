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

/// `parallax comm-check --bench`: the cost of the same bits on any count, measured.
#[cfg(feature = "mpi")]
pub fn bench(timeout: u64) -> Result<(), Exit> {
    use parallax_runtime::comm::mpi::Mpi;
    use parallax_runtime::comm::Communicator;
    let (mpi, mut comm) = Mpi::start(std::time::Duration::from_secs(timeout)).map_err(|e| {
        eprintln!("error: {e}");
        Exit(1)
    })?;
    let (rank, size) = (comm.rank(), comm.size());
    if rank == 0 {
        println!("| floats per rank | fixed tree | MPI_Allreduce | tree / MPI | tree bytes sent per rank | MPI's buffer | same bits here |");
        println!("|---|---|---|---|---|---|---|");
    }
    for floats in [1 << 10, 1 << 14, 1 << 18, 1 << 21] {
        let t = match comm.time_reductions(floats, 20) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1)
            }
        };
        if rank == 0 {
            println!(
                "| {} | {:.3} ms | {:.3} ms | {:.2} | {} | {} | {} |",
                t.floats,
                t.tree_seconds * 1e3,
                t.allreduce_seconds * 1e3,
                t.tree_seconds / t.allreduce_seconds.max(1e-12),
                parallax_compiler::plan::bytes(t.tree_bytes),
                parallax_compiler::plan::bytes(4 * t.floats as u64),
                if t.same_bits { "yes" } else { "no" }
            );
        }
    }
    if rank == 0 {
        println!("({size} rank(s); medians of 20)");
    }
    drop(comm);
    drop(mpi);
    Ok(())
}

#[cfg(not(feature = "mpi"))]
pub fn bench(timeout: u64) -> Result<(), Exit> {
    check(timeout, None)
}

/// Which communicator `comm-check` checks.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CommBackend {
    /// The MPI communicator of CPU ranks.
    Cpu,
    /// The fixed-tree all-reduce on GPUs over NCCL.
    Cuda,
}

/// `parallax comm-check --backend cuda`: the tree all-reduce on the GPUs of the ranks
/// `mpirun` started, against the host's `collective::total`, bit for bit. Without a GPU (or
/// without MPI in this build) it fails before any rank waits on another.
pub fn cuda(timeout: u64, fail_rank: Option<usize>) -> Result<(), Exit> {
    let devices = parallax_runtime::cuda::probe().map_err(|e| {
        // One write, so that the ranks' lines do not interleave.
        let line = format!("error: comm-check --backend cuda: {e}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        Exit(1)
    })?;
    cuda_ranks(devices, timeout, fail_rank)
}

#[cfg(not(feature = "mpi"))]
fn cuda_ranks(
    _: parallax_runtime::cuda::Devices,
    timeout: u64,
    _: Option<usize>,
) -> Result<(), Exit> {
    check(timeout, None)
}

#[cfg(feature = "mpi")]
fn cuda_ranks(
    devices: parallax_runtime::cuda::Devices,
    timeout: u64,
    fail_rank: Option<usize>,
) -> Result<(), Exit> {
    use parallax_runtime::checks::nccl_tree::{self, Event, TreeCheckError};
    use parallax_runtime::comm::mpi::Mpi;
    use parallax_runtime::comm::world::World;
    use parallax_runtime::comm::Communicator;

    let wait = std::time::Duration::from_secs(timeout);
    let world = World::from_env(&|v| std::env::var(v).ok()).map_err(|e| {
        eprintln!("error: comm-check --backend cuda: {e}");
        Exit(1)
    })?;
    let (mpi, mut comm) = Mpi::start(wait).map_err(|e| {
        eprintln!("error: {e}");
        Exit(1)
    })?;
    let rank = comm.rank();
    let mut report = |e: Event| match e {
        _ if rank != 0 => {}
        Event::Started { ranks, gpu } => {
            println!(
                "NCCL {ranks} rank(s) on {gpu}; the fixed-tree all-reduce against the host's sum"
            );
            println!("| floats | ranks | shards | time | result's bits (FNV-1a) | same bits |");
            println!("|---|---|---|---|---|---|");
        }
        Event::Case(c) => println!(
            "| {} | {} | {} | {:.3} ms | {:016x} | {} |",
            c.floats,
            c.ranks,
            c.shards,
            c.seconds * 1e3,
            c.hash,
            if c.same_everywhere { "yes" } else { "no" }
        ),
    };
    let all_same = match nccl_tree::run(
        &mut comm,
        &devices,
        world.local_rank,
        wait,
        fail_rank,
        &mut report,
    ) {
        Ok(all_same) => all_same,
        Err(TreeCheckError::Leave) => {
            // Gone without a word to anyone: the others find out from NCCL.
            let line = format!("rank {rank}: leaving in the middle of the check (--fail-rank)\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            std::process::exit(3)
        }
        Err(TreeCheckError::Failed(why)) => exit_with(rank, &why),
    };
    drop(comm);
    drop(mpi);
    if all_same {
        return Ok(());
    }
    if rank == 0 {
        eprintln!("error: the GPUs' tree all-reduce differs from the host's sum");
    }
    Err(Exit(1))
}

/// Ends this rank at once, naming it (not through MPI_Finalize, which would wait for the
/// others; mpirun ends the job's other processes).
#[cfg(feature = "mpi")]
fn exit_with(rank: usize, why: &str) -> ! {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("error: rank {rank}: {why}\n").as_bytes());
    std::process::exit(1)
}
