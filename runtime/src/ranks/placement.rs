//! Which GPU each GPU rank of this process binds, and the memory each may plan for: a rank
//! per GPU, in order (the N ranks of `--gpus N` in one process take GPUs 0..N; a rank of a
//! launcher's job takes the GPU of its local rank). Several ranks share a GPU only when
//! asked (`PARALLAX_SHARE_GPUS=1`: a test of the ranks on a machine with fewer GPUs, never
//! faster), and then split its memory.

/// The variable that lets several ranks share a GPU.
pub const SHARE_ENV: &str = "PARALLAX_SHARE_GPUS";

/// Where this process's ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The GPU of this process's first rank; the next take the next GPUs in turn.
    pub first_gpu: usize,
    /// How many GPUs the ranks take in turn.
    pub gpus: usize,
    /// The memory each rank may plan for, in bytes.
    pub capacity: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlacementError {
    #[error("no GPU was found")]
    NoGpu,
    #[error("--gpus {asked} runs a rank per GPU, but this machine has {found} GPU(s)")]
    TooFew { asked: usize, found: usize },
    #[error("rank {rank} is local rank {local_rank} on its machine, which has {found} GPU(s): a rank per GPU binds GPU {local_rank}")]
    LocalRankTooHigh {
        rank: usize,
        local_rank: usize,
        found: usize,
    },
}

impl PlacementError {
    /// What to do about it.
    pub fn hint(&self) -> String {
        match self {
            PlacementError::NoGpu => "`parallax devices` says what was found; `--backend cpu` trains on the CPU".into(),
            PlacementError::TooFew { asked, .. } => format!(
                "`--backend cpu --gpus {asked}` runs the same plan on simulated devices with the same bits; {SHARE_ENV}=1 runs several ranks on one GPU (to test them; not faster)"
            ),
            PlacementError::LocalRankTooHigh { found, .. } => format!(
                "start at most {found} rank(s) per machine (mpirun --map-by ppr:{found}:node), or set {SHARE_ENV}=1 to run several ranks on one GPU"
            ),
        }
    }
}

/// `devices` ranks in this process over GPUs of `memory` bytes each (in ordinal order).
pub fn in_process(
    devices: usize,
    memory: &[u64],
    share: bool,
) -> Result<Placement, PlacementError> {
    let found = memory.len();
    if found == 0 {
        return Err(PlacementError::NoGpu);
    }
    if devices > found && !share {
        return Err(PlacementError::TooFew {
            asked: devices,
            found,
        });
    }
    let gpus = devices.clamp(1, found);
    let least = memory[..gpus].iter().copied().min().unwrap_or(0);
    // Ranks sharing a GPU split it (the GPU with the most ranks bounds them all).
    let per_gpu = devices.div_ceil(gpus).max(1) as u64;
    Ok(Placement {
        first_gpu: 0,
        gpus,
        capacity: least / per_gpu,
    })
}

/// Rank `rank` of a launcher's job, local rank `local_rank` on a machine with GPUs of
/// `memory` bytes. Sharing ranks each plan for the whole GPU: a process does not know how
/// many others share it (an allocation that does not fit then fails, naming the tensor).
pub fn in_job(
    rank: usize,
    local_rank: usize,
    memory: &[u64],
    share: bool,
) -> Result<Placement, PlacementError> {
    let found = memory.len();
    if found == 0 {
        return Err(PlacementError::NoGpu);
    }
    if local_rank >= found && !share {
        return Err(PlacementError::LocalRankTooHigh {
            rank,
            local_rank,
            found,
        });
    }
    let gpu = local_rank % found;
    Ok(Placement {
        first_gpu: gpu,
        gpus: found,
        capacity: memory[gpu],
    })
}

/// Whether `PARALLAX_SHARE_GPUS` asks for sharing (as `var` reads it).
pub fn share_asked(var: &dyn Fn(&str) -> Option<String>) -> bool {
    var(SHARE_ENV).is_some_and(|v| v.trim() == "1")
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_rank_per_gpu_in_order_planning_for_the_smallest() {
        let p = in_process(2, &[80 * GIB, 40 * GIB, 80 * GIB], false).unwrap();
        assert_eq!(
            p,
            Placement {
                first_gpu: 0,
                gpus: 2,
                capacity: 40 * GIB
            }
        );
        let p = in_process(1, &[80 * GIB, 40 * GIB], false).unwrap();
        assert_eq!((p.gpus, p.capacity), (1, 80 * GIB));
    }

    #[test]
    fn more_ranks_than_gpus_are_refused_unless_shared() {
        let e = in_process(4, &[141 * GIB], false).unwrap_err();
        assert_eq!(e, PlacementError::TooFew { asked: 4, found: 1 });
        assert!(e.to_string().contains("--gpus 4") && e.to_string().contains("1 GPU"));
        assert!(e.hint().contains("PARALLAX_SHARE_GPUS=1"), "{}", e.hint());
        // Shared: 3 ranks over 2 GPUs, 2 on the first: each plans for half a GPU.
        let p = in_process(3, &[80 * GIB, 80 * GIB], true).unwrap();
        assert_eq!((p.gpus, p.capacity), (2, 40 * GIB));
        assert_eq!(in_process(1, &[], true), Err(PlacementError::NoGpu));
    }

    #[test]
    fn a_job_rank_binds_its_local_rank() {
        let p = in_job(5, 1, &[80 * GIB, 40 * GIB], false).unwrap();
        assert_eq!((p.first_gpu, p.capacity), (1, 40 * GIB));
        let e = in_job(5, 2, &[80 * GIB, 40 * GIB], false).unwrap_err();
        assert!(
            e.to_string()
                .contains("rank 5 is local rank 2 on its machine, which has 2 GPU(s)"),
            "{e}"
        );
        assert!(e.hint().contains("ppr:2:node"));
        let p = in_job(5, 2, &[80 * GIB, 40 * GIB], true).unwrap();
        assert_eq!((p.first_gpu, p.capacity), (0, 80 * GIB));
    }

    #[test]
    fn sharing_is_asked_with_exactly_1() {
        let env = |v: &'static str| move |k: &str| (k == SHARE_ENV).then(|| v.to_string());
        assert!(share_asked(&env("1")));
        assert!(!share_asked(&env("0")));
        assert!(!share_asked(&env("yes")));
        assert!(!share_asked(&|_| None));
    }
}
