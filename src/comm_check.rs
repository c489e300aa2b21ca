//! `parallax comm-check`: the communicator's self-check on the ranks `mpirun` started.

use crate::Exit;

/// `parallax comm-check`'s arguments.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Seconds a rank waits for another before it gives up.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
    /// Make this rank fail (at the 5-shard all-reduce), to see what the others report.
    #[arg(long, value_name = "RANK")]
    pub fail_rank: Option<usize>,
    /// Make this rank stop answering (at the same point) for as long.
    #[arg(long, value_name = "RANK")]
    pub hang_rank: Option<usize>,
    /// Instead of the check, time the fixed-tree all-reduce against MPI_Allreduce on the
    /// same buffers (a table on rank 0).
    #[arg(long)]
    pub bench: bool,
    /// `cuda`: instead, the fixed-tree all-reduce on GPUs over NCCL (each rank binds GPU
    /// local rank % GPU count; the NCCL id goes out over MPI), compared bit for bit with
    /// the host's sum for several lengths and shard layouts (a table on rank 0).
    /// `--fail-rank` then makes that rank exit in the middle.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: CommBackend,
}

/// The communicator under the check.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CommBackend {
    Cpu,
    Cuda,
}

pub(crate) fn run(args: Args) -> Result<(), Exit> {
    // NCCL needs a GPU: said before any rank waits for another.
    let devices = match args.backend {
        CommBackend::Cuda => Some(
            parallax_runtime::cuda::probe()
                .map_err(|e| crate::error(format!("comm-check --backend cuda: {e}")))?,
        ),
        CommBackend::Cpu => None,
    };
    ranks(args, devices)
}

#[cfg(not(feature = "mpi"))]
fn ranks(_: Args, _: Option<parallax_runtime::cuda::Devices>) -> Result<(), Exit> {
    errln!("error: this parallax was built without MPI; build it with `cargo build --release --features mpi` (Debian: apt-get install openmpi-bin libopenmpi-dev libclang-dev pkgconf)");
    Err(Exit(1))
}

/// Runs the check (or the benchmark) on this rank; rank 0 prints the table. A rank that
/// fails exits at once, not through `MPI_Finalize`, which would wait for every rank.
#[cfg(feature = "mpi")]
fn ranks(args: Args, devices: Option<parallax_runtime::cuda::Devices>) -> Result<(), Exit> {
    use parallax_runtime::checks::nccl_tree::{self, TreeCheckError};
    use parallax_runtime::comm::check::{self, Fault};
    use parallax_runtime::comm::mpi::Mpi;
    use parallax_runtime::comm::Communicator;
    let wait = std::time::Duration::from_secs(args.timeout);
    // The GPU each rank binds: its local rank's.
    let local_rank = match devices {
        Some(_) => {
            parallax_runtime::comm::world::World::from_env(&|v| std::env::var(v).ok())
                .map_err(|e| crate::error(format!("comm-check --backend cuda: {e}")))?
                .local_rank
        }
        None => 0,
    };
    let (mpi, mut comm) = Mpi::start(wait).map_err(crate::error)?;
    let rank = comm.rank();
    let say = |lines: Vec<String>| {
        for l in lines.iter().filter(|_| rank == 0) {
            let _ = outln!("{l}");
        }
    };
    let exit = |code: i32, why: String| -> ! {
        errln!("{why}");
        std::process::exit(code)
    };
    let same = match (devices, args.bench) {
        (Some(devices), _) => {
            let mut report = |e: nccl_tree::Event| say(e.lines());
            let at = local_rank;
            match nccl_tree::run(&mut comm, &devices, at, wait, args.fail_rank, &mut report) {
                Ok(same) => same,
                Err(TreeCheckError::Leave) => {
                    exit(3, format!("rank {rank}: {}", TreeCheckError::Leave))
                }
                Err(e) => exit(1, format!("error: rank {rank}: {e}")),
            }
        }
        (None, true) => {
            let lines = comm.reduction_table();
            say(lines.unwrap_or_else(|e| exit(1, format!("error: {e}"))));
            true
        }
        (None, false) => {
            let fault = Fault::planted(args.fail_rank, args.hang_rank, args.timeout);
            let lines = check::run(&mut comm, fault);
            say(lines.unwrap_or_else(|e| exit(1, format!("error: {e}"))));
            true
        }
    };
    drop(comm);
    drop(mpi);
    if same {
        return Ok(());
    }
    if rank == 0 {
        errln!("error: the GPUs' tree all-reduce differs from the host's sum");
    }
    Err(Exit(1))
}
