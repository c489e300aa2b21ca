//! `comm-check --backend cuda`: the fixed-tree all-reduce on the GPUs of a job's ranks, over
//! NCCL, against the host's `collective::total` of the same partials, bit for bit, at several
//! lengths and shard layouts. Every rank computes every rank's partials from one seed, so no
//! data is sent but the all-reduce's own. The command line starts the ranks' communicator
//! and prints; this runs the check.

use crate::comm::collective::{partials, total};
use crate::comm::rendezvous::share_id;
use crate::comm::Communicator;
use crate::cuda::cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DriverError};
use crate::cuda::nccl::comm::{NcclComm, NcclId};
use crate::cuda::nccl::tree::{check_value, DeviceTree, Schedule};
use crate::cuda::{target_for, Devices};
use parallax_compiler::shards::assign;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Shard values: every rank computes every rank's partials from it.
const SEED: u64 = 20_260_801;

/// The lengths (one not a multiple of the chunk alignment) and shard counts (fewer than the
/// ranks, so some hold none, up to uneven subtrees).
const LENGTHS: [usize; 4] = [1, 1000, (1 << 16) + 3, 1 << 20];
const LEAVES: [usize; 4] = [1, 7, 16, 37];

/// The case at which `--fail-rank` leaves.
const LEAVE_AT: usize = 6;

/// Why the check ended early on this rank.
#[derive(Debug, thiserror::Error)]
pub enum TreeCheckError {
    /// This rank failed; the reason.
    #[error("{0}")]
    Failed(String),
    /// `--fail-rank` named this rank: it leaves in the middle of the check, telling no one;
    /// its NCCL communicator is left as it is, for the caller to exit at once.
    #[error("leaving in the middle of the check (--fail-rank)")]
    Leave,
}

/// What the check reports as it goes.
pub enum Event<'a> {
    /// NCCL is up: the ranks and this rank's GPU.
    Started { ranks: usize, gpu: &'a str },
    /// One case, after every rank compared its result.
    Case(Case),
}

/// One length and shard layout.
pub struct Case {
    pub floats: usize,
    pub ranks: usize,
    pub shards: usize,
    /// The fastest of three all-reduces.
    pub seconds: f64,
    /// FNV-1a over the result's bits: the same on any rank count, so runs compare by it.
    pub hash: u64,
    /// Whether every rank got the host's bits.
    pub same_everywhere: bool,
}

impl Event<'_> {
    /// The event's lines of rank 0's table.
    pub fn lines(&self) -> Vec<String> {
        match self {
            Event::Started { ranks, gpu } => vec![
                format!("NCCL {ranks} rank(s) on {gpu}; the fixed-tree all-reduce against the host's sum"),
                "| floats | ranks | shards | time | result's bits (FNV-1a) | same bits |".into(),
                "|---|---|---|---|---|---|".into(),
            ],
            Event::Case(c) => vec![format!(
                "| {} | {} | {} | {:.3} ms | {:016x} | {} |",
                c.floats,
                c.ranks,
                c.shards,
                c.seconds * 1e3,
                c.hash,
                if c.same_everywhere { "yes" } else { "no" }
            )],
        }
    }
}

/// Runs the check on the ranks of `comm` (this rank drives GPU `local_rank` modulo the
/// count); `Ok(true)` when every case gave the host's bits on every rank. Before NCCL is up
/// a failing rank tells the others over `comm`, so none waits out `wait` for it.
pub fn run(
    comm: &mut dyn Communicator,
    devices: &Devices,
    local_rank: usize,
    wait: Duration,
    fail_rank: Option<usize>,
    report: &mut dyn FnMut(Event),
) -> Result<bool, TreeCheckError> {
    use TreeCheckError::Failed;
    let (rank, size) = (comm.rank(), comm.size());
    let ordinal = local_rank % devices.gpus.len().max(1);
    let gpu = devices
        .gpus
        .get(ordinal)
        .ok_or_else(|| Failed("no GPU".into()))?;
    let setup = (|| {
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("GPU {ordinal}: {e:?}"))?;
        // NCCL's init takes the current device.
        ctx.bind_to_thread()
            .map_err(|e| format!("GPU {ordinal}: binding it: {e:?}"))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("GPU {ordinal}: a stream: {e:?}"))?;
        let tree =
            DeviceTree::new(&ctx, target_for(gpu.compute_capability)).map_err(|e| e.to_string())?;
        Ok::<_, String>((ctx, stream, tree))
    })();
    let made = (rank == 0).then(NcclId::new);
    let id = made
        .as_ref()
        .and_then(|m| m.as_ref().ok())
        .map(|id| id.to_bytes());
    if comm.any_failed(setup.is_err() || matches!(made, Some(Err(_)))) {
        return Err(Failed(match (&setup, made) {
            (Err(e), _) => e.clone(),
            (_, Some(Err(e))) => format!("making the NCCL id: {e}"),
            _ => "another rank failed to set up its GPU or the NCCL id".into(),
        }));
    }
    let (_ctx, stream, mut tree) = setup.map_err(Failed)?;
    let id = NcclId::from_bytes(share_id(comm, 0, id).map_err(|e| Failed(e.to_string()))?);
    // SAFETY: the stream belongs to the current context and outlives `nccl` (declared after).
    let mut nccl = unsafe { NcclComm::init(&id, rank, size, stream.cu_stream(), wait) }
        .map_err(|e| Failed(e.to_string()))?;
    report(Event::Started {
        ranks: size,
        gpu: &gpu.name,
    });
    let mut all_same = true;
    let cases = LENGTHS
        .iter()
        .flat_map(|&len| LEAVES.iter().map(move |&leaves| (len, leaves)));
    for (i, (len, leaves)) in cases.enumerate() {
        if fail_rank == Some(rank) && i + 1 == LEAVE_AT {
            // As a rank that dies: its communicator is never destroyed (the caller exits).
            std::mem::forget(nccl);
            return Err(TreeCheckError::Leave);
        }
        let at = (rank, size);
        let (same, seconds, hash) =
            case(&mut tree, &mut nccl, &stream, at, (len, leaves), wait).map_err(Failed)?;
        let everywhere = !comm.any(!same).map_err(|e| Failed(e.to_string()))?;
        all_same &= everywhere;
        report(Event::Case(Case {
            floats: len,
            ranks: size,
            shards: leaves,
            seconds,
            hash,
            same_everywhere: everywhere,
        }));
    }
    Ok(all_same)
}

/// One case: upload this rank's partials, all-reduce them on the GPUs, and compare with
/// `collective::total` of every rank's partials on the host. Returns (same bits here,
/// seconds of the fastest of three all-reduces, the hash of the result's bits).
fn case(
    tree: &mut DeviceTree,
    nccl: &mut NcclComm,
    stream: &Arc<CudaStream>,
    (rank, size): (usize, usize),
    (len, leaves): (usize, usize),
    wait: Duration,
) -> Result<(bool, f64, u64), String> {
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
    let cuda = |e: DriverError| format!("CUDA: {e:?}");
    let bufs = every[rank]
        .iter()
        .map(|p| stream.clone_htod(&p.values).map_err(cuda))
        .collect::<Result<Vec<_>, _>>()?;
    let mine: Vec<u64> = bufs.iter().map(|b| b.device_ptr(stream).0).collect();
    let mut out = stream.alloc_zeros::<f32>(len).map_err(cuda)?;
    let out_ptr = out.device_ptr_mut(stream).0;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        // SAFETY: each buffer holds `len` f32 on this rank's device, alive until the end.
        unsafe { tree.sum(nccl, stream, &schedule, &mine, out_ptr, None, wait) }
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
    let hash = bits(&got).iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        b.to_le_bytes()
            .iter()
            .fold(h, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3))
    });
    Ok((bits(&got) == bits(&want), best, hash))
}
