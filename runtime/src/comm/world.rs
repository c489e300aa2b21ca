//! Where this process stands in a job: its rank, the world size and its node-local rank, as
//! the launcher that started it says (Open MPI's `mpirun`, Slurm's `srun`, a PMI launcher, or
//! torchrun-style variables), or alone. Read once at start; the rest of the runtime is handed
//! the `World`, never the environment.

use std::fmt;

/// What started the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher: one process, which may run several local ranks itself.
    None,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`).
    Slurm,
    /// A PMI launcher (MPICH's hydra and others: `PMI_RANK`, `PMI_SIZE`).
    Pmi,
    /// torchrun-style variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    /// `MASTER_PORT`).
    Torchrun,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(match self {
            Launcher::None => "no launcher",
            Launcher::OpenMpi => "mpirun",
            Launcher::Slurm => "srun",
            Launcher::Pmi => "a PMI launcher",
            Launcher::Torchrun => "torchrun-style variables",
        })
    }
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    pub launcher: Launcher,
    pub rank: usize,
    pub size: usize,
    /// The rank among this node's processes: which local device it binds.
    pub local_rank: usize,
    /// torchrun's rendezvous address (`MASTER_ADDR:MASTER_PORT`), when given.
    pub master: Option<(String, u16)>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LaunchError {
    #[error("{var}={value:?} is not a number ({launcher})")]
    NotANumber {
        launcher: Launcher,
        var: &'static str,
        value: String,
    },
    #[error("{launcher} says rank {rank} of a world of {size}; ranks run from 0 to {}", size.saturating_sub(1))]
    RankOutOfRange {
        launcher: Launcher,
        rank: usize,
        size: usize,
    },
    #[error("{launcher} sets {set} but not {missing}")]
    Incomplete {
        launcher: Launcher,
        set: &'static str,
        missing: &'static str,
    },
    #[error("--gpus {asked} differs from the {size} rank(s) {launcher} started; drop --gpus (under a launcher the world size is the device count) or start {asked} rank(s)")]
    GpusDiffer {
        launcher: Launcher,
        asked: u32,
        size: usize,
    },
}

impl World {
    /// One process, alone.
    pub fn alone() -> World {
        World {
            launcher: Launcher::None,
            rank: 0,
            size: 1,
            local_rank: 0,
            master: None,
        }
    }

    /// The world the environment describes (`var` reads a variable): the first launcher
    /// whose variables are set, in the order MPI, Slurm, PMI, torchrun.
    pub fn from_env(var: &dyn Fn(&str) -> Option<String>) -> Result<World, LaunchError> {
        type Names = (&'static str, &'static str, Option<&'static str>);
        let launchers: [(Launcher, Names); 3] = [
            (
                Launcher::OpenMpi,
                (
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    Some("OMPI_COMM_WORLD_LOCAL_RANK"),
                ),
            ),
            (
                Launcher::Slurm,
                ("SLURM_PROCID", "SLURM_NTASKS", Some("SLURM_LOCALID")),
            ),
            (Launcher::Pmi, ("PMI_RANK", "PMI_SIZE", None)),
        ];
        for (launcher, (rank, size, local)) in launchers {
            if var(rank).is_some() || var(size).is_some() {
                let mut w = read(var, launcher, rank, size)?;
                w.local_rank = match local {
                    Some(l) if var(l).is_some() => number(var, launcher, l)?,
                    // Without a local rank, ranks are taken to be one per node.
                    _ => 0,
                };
                return Ok(w);
            }
        }
        if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
            let launcher = Launcher::Torchrun;
            let mut w = read(var, launcher, "RANK", "WORLD_SIZE")?;
            w.local_rank = match var("LOCAL_RANK") {
                Some(_) => number(var, launcher, "LOCAL_RANK")?,
                None => w.rank,
            };
            if w.size > 1 {
                let addr = var("MASTER_ADDR").ok_or(LaunchError::Incomplete {
                    launcher,
                    set: "WORLD_SIZE",
                    missing: "MASTER_ADDR",
                })?;
                if var("MASTER_PORT").is_none() {
                    return Err(LaunchError::Incomplete {
                        launcher,
                        set: "MASTER_ADDR",
                        missing: "MASTER_PORT (no default port: pick one per job)",
                    });
                }
                let port = number(var, launcher, "MASTER_PORT")?;
                let port = u16::try_from(port).map_err(|_| LaunchError::NotANumber {
                    launcher,
                    var: "MASTER_PORT",
                    value: port.to_string(),
                })?;
                w.master = Some((addr, port));
            }
            return Ok(w);
        }
        Ok(World::alone())
    }

    /// The device count of the run: the world's size under a launcher (an explicit `--gpus`
    /// must agree), else `--gpus` or the file's default.
    pub fn devices(&self, gpus_flag: Option<u32>, file_default: u32) -> Result<u32, LaunchError> {
        if self.launcher == Launcher::None {
            return Ok(gpus_flag.unwrap_or(file_default));
        }
        match gpus_flag {
            Some(asked) if asked as usize != self.size => Err(LaunchError::GpusDiffer {
                launcher: self.launcher,
                asked,
                size: self.size,
            }),
            _ => Ok(self.size as u32),
        }
    }

    /// Whether this process writes the run directory (rank 0 alone does).
    pub fn writes_run_dir(&self) -> bool {
        self.rank == 0
    }
}

fn number(
    var: &dyn Fn(&str) -> Option<String>,
    launcher: Launcher,
    name: &'static str,
) -> Result<usize, LaunchError> {
    let value = var(name).unwrap_or_default();
    value.trim().parse().map_err(|_| LaunchError::NotANumber {
        launcher,
        var: name,
        value,
    })
}

fn read(
    var: &dyn Fn(&str) -> Option<String>,
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
) -> Result<World, LaunchError> {
    for (set, missing) in [(rank, size), (size, rank)] {
        if var(set).is_some() && var(missing).is_none() {
            return Err(LaunchError::Incomplete {
                launcher,
                set,
                missing,
            });
        }
    }
    let (r, n) = (number(var, launcher, rank)?, number(var, launcher, size)?);
    if n == 0 || r >= n {
        return Err(LaunchError::RankOutOfRange {
            launcher,
            rank: r,
            size: n,
        });
    }
    Ok(World {
        launcher,
        rank: r,
        size: n,
        local_rank: 0,
        master: None,
    })
}

/// What every rank must agree on before the first step: the experiment, the binary and the
/// plan. Ranks compare these at start and all refuse on a mismatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// SHA-256 of the experiment's text (with `--set` applied).
    pub experiment: String,
    pub version: String,
    /// SHA-256 of the plan as `plan.json` holds it.
    pub plan: String,
}

impl Fingerprint {
    pub fn new(experiment: &[u8], plan_json: &str) -> Fingerprint {
        Fingerprint {
            experiment: sha256(experiment),
            version: env!("CARGO_PKG_VERSION").to_string(),
            plan: sha256(plan_json.as_bytes()),
        }
    }

    /// One line, the same on every rank that agrees: what ranks exchange.
    pub fn line(&self) -> String {
        format!(
            "experiment {} parallax {} plan {}",
            self.experiment, self.version, self.plan
        )
    }

    /// A fingerprint back from its `line` (`None` if it is not one).
    pub fn from_line(line: &str) -> Option<Fingerprint> {
        let words: Vec<&str> = line.split(' ').collect();
        match words[..] {
            ["experiment", experiment, "parallax", version, "plan", plan] => Some(Fingerprint {
                experiment: experiment.to_string(),
                version: version.to_string(),
                plan: plan.to_string(),
            }),
            _ => None,
        }
    }

    /// What differs between this rank's fingerprint and `other`'s (rank `other_rank`), as one
    /// message naming both; `None` when they agree.
    pub fn mismatch(&self, rank: usize, other: &Fingerprint, other_rank: usize) -> Option<String> {
        let short = |h: &str| h.chars().take(12).collect::<String>();
        let what = if self.version != other.version {
            format!(
                "rank {rank} runs parallax {} and rank {other_rank} parallax {}",
                self.version, other.version
            )
        } else if self.experiment != other.experiment {
            format!(
                "rank {rank} read an experiment with hash {} and rank {other_rank} one with {} (a different file, or different --set values)",
                short(&self.experiment),
                short(&other.experiment)
            )
        } else if self.plan != other.plan {
            format!(
                "rank {rank} compiled plan {} and rank {other_rank} plan {} from the same experiment",
                short(&self.plan),
                short(&other.plan)
            )
        } else {
            return None;
        };
        Some(format!("the ranks disagree: {what}"))
    }
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn world(vars: &[(&str, &str)]) -> Result<World, LaunchError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_env(&|k| map.get(k).cloned())
    }

    #[test]
    fn launchers_are_read_from_their_variables() {
        assert_eq!(world(&[]).unwrap(), World::alone());
        // Rank, size and local rank, as each launcher names them.
        let launchers = [
            (
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                ],
                ["2", "4", "0"],
                (Launcher::OpenMpi, 2, 4, 0),
            ),
            (
                ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"],
                ["5", "8", "1"],
                (Launcher::Slurm, 5, 8, 1),
            ),
        ];
        for (names, values, want) in launchers {
            let vars: Vec<_> = names.into_iter().zip(values).collect();
            let w = world(&vars).unwrap();
            assert_eq!((w.launcher, w.rank, w.size, w.local_rank), want);
        }
        let w = world(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29611"),
        ])
        .unwrap();
        assert_eq!(w.launcher, Launcher::Torchrun);
        assert_eq!(w.master, Some(("10.0.0.1".to_string(), 29611)));
        // mpirun wins over variables a user left set.
        let w = world(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "1"),
            ("RANK", "3"),
        ])
        .unwrap();
        assert_eq!((w.launcher, w.rank), (Launcher::OpenMpi, 0));
    }

    #[test]
    fn bad_launch_variables_are_clear_errors() {
        let e = world(&[("RANK", "2"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "torchrun-style variables says rank 2 of a world of 2; ranks run from 0 to 1"
        );
        let e = world(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]).unwrap_err();
        assert!(e.to_string().contains("no default port"), "{e}");
        let e = world(&[("OMPI_COMM_WORLD_RANK", "x"), ("OMPI_COMM_WORLD_SIZE", "2")]).unwrap_err();
        assert!(matches!(
            e,
            LaunchError::NotANumber {
                var: "OMPI_COMM_WORLD_RANK",
                ..
            }
        ));
        let e = world(&[("WORLD_SIZE", "2")]).unwrap_err();
        assert!(
            matches!(
                e,
                LaunchError::Incomplete {
                    missing: "RANK",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn under_a_launcher_the_world_size_is_the_device_count() {
        let w = world(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "3")]).unwrap();
        assert_eq!(w.devices(None, 1), Ok(3));
        assert_eq!(w.devices(Some(3), 1), Ok(3));
        let e = w.devices(Some(4), 1).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("--gpus 4 differs from the 3 rank(s) mpirun started"),
            "{e}"
        );
        assert_eq!(World::alone().devices(None, 2), Ok(2));
        assert_eq!(World::alone().devices(Some(4), 2), Ok(4));
    }

    #[test]
    fn fingerprints_name_what_differs() {
        let a = Fingerprint::new(b"(name: \"a\")", "{}");
        assert_eq!(a.mismatch(0, &a.clone(), 1), None);
        let b = Fingerprint::new(b"(name: \"b\")", "{}");
        let m = a.mismatch(0, &b, 3).unwrap();
        assert!(
            m.starts_with("the ranks disagree: rank 0 read an experiment with hash"),
            "{m}"
        );
        assert!(m.contains("rank 3"), "{m}");
        let c = Fingerprint::new(b"(name: \"a\")", "{\"x\": 1}");
        assert!(a.mismatch(0, &c, 1).unwrap().contains("compiled plan"));
        let mut d = a.clone();
        d.version = "9.9.9".into();
        assert!(a
            .mismatch(0, &d, 1)
            .unwrap()
            .contains("rank 1 parallax 9.9.9"));
        // What ranks exchange reads back as the fingerprint it came from.
        assert_eq!(Fingerprint::from_line(&d.line()), Some(d));
        assert_eq!(Fingerprint::from_line("experiment x parallax"), None);
    }
}
