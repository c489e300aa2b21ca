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

/// Shard values of the GPU check: every rank computes every rank's partials from it.
#[cfg(feature = "mpi")]
const SEED: u64 = 20_260_801;

/// The GPU check's lengths (one not a multiple of the chunk alignment) and shard counts
/// (fewer than the ranks, so some hold none, up to uneven subtrees).
#[cfg(feature = "mpi")]
const LENGTHS: [usize; 4] = [1, 1000, (1 << 16) + 3, 1 << 20];
#[cfg(feature = "mpi")]
const LEAVES: [usize; 4] = [1, 7, 16, 37];

#[cfg(feature = "mpi")]
fn cuda_ranks(
    devices: parallax_runtime::cuda::Devices,
    timeout: u64,
    fail_rank: Option<usize>,
) -> Result<(), Exit> {
    use parallax_runtime::comm::mpi::Mpi;
    use parallax_runtime::comm::Communicator;
    use parallax_runtime::cuda::cudarc::driver::CudaContext;
    use parallax_runtime::cuda::nccl_comm::{NcclComm, NcclId};
    use parallax_runtime::cuda::nccl_tree::DeviceTree;
    use parallax_runtime::launch::World;
    use parallax_runtime::rendezvous::share_id;
    use std::time::Duration;

    let wait = Duration::from_secs(timeout);
    let world = World::from_env(&|v| std::env::var(v).ok()).map_err(|e| {
        eprintln!("error: comm-check --backend cuda: {e}");
        Exit(1)
    })?;
    let (mpi, mut comm) = Mpi::start(wait).map_err(|e| {
        eprintln!("error: {e}");
        Exit(1)
    })?;
    let (rank, size) = (comm.rank(), comm.size());
    // Before the NCCL communicator exists, a failing rank tells the others over MPI, so that
    // none waits out its timeout for it.
    let ordinal = world.local_rank % devices.gpus.len();
    let gpu = &devices.gpus[ordinal];
    let target = parallax_runtime::cuda::target_for(gpu.compute_capability);
    let setup = (|| {
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("GPU {ordinal}: {e:?}"))?;
        // NCCL's init takes the current device.
        ctx.bind_to_thread()
            .map_err(|e| format!("GPU {ordinal}: binding it: {e:?}"))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("GPU {ordinal}: a stream: {e:?}"))?;
        let tree = DeviceTree::new(&ctx, target).map_err(|e| e.to_string())?;
        Ok::<_, String>((ctx, stream, tree))
    })();
    let made = (rank == 0).then(NcclId::new);
    let id = made
        .as_ref()
        .and_then(|m| m.as_ref().ok())
        .map(|id| id.to_bytes());
    let failed = setup.is_err() || matches!(made, Some(Err(_)));
    if comm.any_failed(failed) {
        let why = match (&setup, made) {
            (Err(e), _) => e.clone(),
            (_, Some(Err(e))) => format!("making the NCCL id: {e}"),
            _ => "another rank failed to set up its GPU or the NCCL id".into(),
        };
        exit_with(rank, &why);
    }
    let (_ctx, stream, mut tree) = setup.unwrap_or_else(|e| exit_with(rank, &e));
    let id = match share_id(&mut comm, 0, id) {
        Ok(id) => NcclId::from_bytes(id),
        Err(e) => exit_with(rank, &e.to_string()),
    };
    // SAFETY: the stream belongs to the current context and outlives `nccl` (declared after).
    let mut nccl = match unsafe { NcclComm::init(&id, rank, size, stream.cu_stream(), wait) } {
        Ok(c) => c,
        Err(e) => exit_with(rank, &e.to_string()),
    };
    if rank == 0 {
        println!(
            "NCCL {} rank(s) on {}; the fixed-tree all-reduce against the host's sum",
            size, gpu.name
        );
        println!("| floats | ranks | shards | time | result's bits (FNV-1a) | same bits |");
        println!("|---|---|---|---|---|---|");
    }
    let mut all_same = true;
    let mut case = 0;
    for &len in &LENGTHS {
        for &leaves in &LEAVES {
            case += 1;
            if fail_rank == Some(rank) && case == 6 {
                // Gone without a word to anyone: the others find out from NCCL.
                let _ = std::io::Write::write_all(
                    &mut std::io::stderr(),
                    format!("rank {rank}: leaving in the middle of the check (--fail-rank)\n")
                        .as_bytes(),
                );
                std::process::exit(3);
            }
            let r = tree_case(&mut tree, &mut nccl, &stream, rank, size, len, leaves, wait);
            let (same, seconds, hash) = r.unwrap_or_else(|e| exit_with(rank, &e));
            let everywhere = match comm.any(!same) {
                Ok(differs) => !differs,
                Err(e) => exit_with(rank, &e.to_string()),
            };
            all_same &= everywhere;
            if rank == 0 {
                println!(
                    "| {len} | {size} | {leaves} | {:.3} ms | {hash:016x} | {} |",
                    seconds * 1e3,
                    if everywhere { "yes" } else { "no" }
                );
            }
        }
    }
    drop(nccl);
    drop(comm);
    drop(mpi);
    match all_same {
        true => Ok(()),
        false => {
            if rank == 0 {
                eprintln!("error: the GPUs' tree all-reduce differs from the host's sum");
            }
            Err(Exit(1))
        }
    }
}

/// One length and shard layout: upload this rank's partials, all-reduce them on the GPUs,
/// and compare with `collective::total` of every rank's partials on the host. Returns
/// (same bits here, seconds of the fastest of three all-reduces, a hash of the result's
/// bits: the same on any rank count, so runs can be compared by their tables).
#[cfg(feature = "mpi")]
#[allow(clippy::too_many_arguments)]
fn tree_case(
    tree: &mut parallax_runtime::cuda::nccl_tree::DeviceTree,
    nccl: &mut parallax_runtime::cuda::nccl_comm::NcclComm,
    stream: &std::sync::Arc<parallax_runtime::cuda::cudarc::driver::CudaStream>,
    rank: usize,
    size: usize,
    len: usize,
    leaves: usize,
    wait: std::time::Duration,
) -> Result<(bool, f64, u64), String> {
    use parallax_compiler::shards::assign;
    use parallax_runtime::collective::{partials, total};
    use parallax_runtime::cuda::cudarc::driver::{DevicePtr, DevicePtrMut};
    use parallax_runtime::cuda::nccl_tree::{check_value, Schedule};

    let leaf = |i: usize| {
        (0..len)
            .map(|j| check_value(SEED, i, j))
            .collect::<Vec<f32>>()
    };
    let every: Vec<_> = assign(leaves, size)
        .into_iter()
        .map(|own| partials(leaves, own, &leaf))
        .collect();
    let members: Vec<usize> = (0..size).collect();
    let ranges: Vec<_> = every
        .iter()
        .map(|ps| ps.iter().map(|p| p.range.clone()).collect())
        .collect();
    let schedule = Schedule::new(leaves, &members, &ranges, len).map_err(|e| e.to_string())?;
    let cuda = |e: parallax_runtime::cuda::cudarc::driver::DriverError| format!("CUDA: {e:?}");
    let bufs = every[rank]
        .iter()
        .map(|p| stream.clone_htod(&p.values).map_err(cuda))
        .collect::<Result<Vec<_>, _>>()?;
    let mine: Vec<u64> = bufs.iter().map(|b| b.device_ptr(stream).0).collect();
    let mut out = stream.alloc_zeros::<f32>(len).map_err(cuda)?;
    let out_ptr = out.device_ptr_mut(stream).0;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        // SAFETY: each buffer holds `len` f32 on this rank's device, alive until the end.
        unsafe { tree.all_reduce(nccl, stream, &schedule, &mine, out_ptr, wait) }
            .map_err(|e| e.to_string())?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let got = stream.clone_dtoh(&out).map_err(cuda)?;
    stream.synchronize().map_err(cuda)?;
    let all = every
        .into_iter()
        .enumerate()
        .flat_map(|(r, ps)| ps.into_iter().map(move |p| (r, p)))
        .collect();
    let want = total(leaves, all).map_err(|e| e.to_string())?;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // FNV-1a over the bits.
    let hash = bits(&got).iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        b.to_le_bytes()
            .iter()
            .fold(h, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3))
    });
    Ok((bits(&got) == bits(&want), best, hash))
}

/// Ends this rank at once, naming it (not through MPI_Finalize, which would wait for the
/// others; mpirun ends the job's other processes).
#[cfg(feature = "mpi")]
fn exit_with(rank: usize, why: &str) -> ! {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("error: rank {rank}: {why}\n").as_bytes());
    std::process::exit(1)
}
