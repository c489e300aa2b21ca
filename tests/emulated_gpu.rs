//! The CUDA backend, unchanged, on the emulated GPU (`emulator/gpu`, the `cdylib` that
//! `scripts/emulated-gpu` links as libcuda and libcublas): each child runs with a folder of
//! those links first on its library path, under a hard time limit. fp32 GEMMs go through
//! cuBLAS, tf32 and bf16 through cuBLASLt (with its bias epilogue).

mod common;

use common::emulated_gpu::{libs, on_emulated_gpu, on_emulated_gpu_with};
use std::path::PathBuf;
#[cfg(feature = "mpi")]
use std::process::Command;
use std::time::Duration;

#[test]
fn devices_lists_an_emulated_h200() {
    let r = on_emulated_gpu(&["devices"], Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("GPU 0: NVIDIA H200"), "{}", r.stdout);
    assert!(r.stdout.contains("compute capability 9.0"), "{}", r.stdout);
    assert!(r.stdout.contains("cuBLAS found"), "{}", r.stdout);
    // The emulated NCCL's release (the headers cudarc binds).
    assert!(r.stdout.contains("NCCL 2.30.0"), "{}", r.stdout);
}

/// `gpu-check`: the CUDA executor's losses and parameters against the CPU's, within the
/// precision's tolerance. Returns the output.
fn gpu_check(model: &str, precision: &str, limit: Duration) -> String {
    gpu_check_with(model, precision, &[], limit)
}

fn gpu_check_with(model: &str, precision: &str, more: &[&str], limit: Duration) -> String {
    let file = format!("models/{model}.ron");
    let mut args = vec![
        "gpu-check",
        &file,
        "--precision",
        precision,
        "--steps",
        "2",
        "--time-steps",
        "1",
    ];
    args.extend_from_slice(more);
    let r = on_emulated_gpu(&args, limit);
    let all = format!("{}{}", r.stdout, r.stderr);
    assert_eq!(r.code, Some(0), "{all}");
    assert!(
        all.contains(&format!("PTX for sm_90, {precision}")),
        "{all}"
    );
    assert!(
        all.contains("largest relative difference of losses"),
        "{all}"
    );
    // The conformance row: model, precision, differences, verdict.
    let row = format!("|{precision}|");
    assert!(
        r.stdout.contains(&row) && r.stdout.contains("|ok|"),
        "{all}"
    );
    assert!(!r.stderr.contains("emulated GPU:"), "{all}");
    all
}

#[test]
fn gpu_check_mlp_fp32() {
    gpu_check("mlp", "fp32", Duration::from_secs(300));
}

#[test]
fn gpu_check_mlp_tf32_and_bf16_run_every_gemm_on_cublaslt() {
    for precision in ["tf32", "bf16"] {
        let all = gpu_check("mlp", precision, Duration::from_secs(300));
        let lt = "cuBLASLt ran 5 GEMM shape(s); 0 went to cuBLAS";
        assert!(all.contains(lt), "{all}");
    }
}

/// Activations stored in bf16, kernel by kernel against the oracle: the GEMMs' D is bf16,
/// so their f32 biases are added by a launch of their own (cuBLASLt's bias epilogue takes a
/// bias of D's type; an H200 refused the f32 one).
#[test]
fn gpu_check_mlp_with_bf16_activations_in_lockstep() {
    let more = ["--set", "devices.activations=Bf16", "--lockstep"];
    let all = gpu_check_with("mlp", "bf16", &more, Duration::from_secs(300));
    assert!(!all.contains("LOCKSTEP"), "{all}");
    assert!(all.contains("0 went to cuBLAS"), "{all}");
}

/// The small transformer (attention, layer norms, GELU, cross-entropy) at every precision
/// and with bf16-stored activations in lockstep, at batch 4 (about 6 s each here).
#[test]
fn gpu_check_transformer_at_every_precision_and_stored_in_bf16() {
    let small = ["--set", "train.batch_size=4"];
    for precision in ["fp32", "tf32", "bf16"] {
        gpu_check_with("transformer", precision, &small, Duration::from_secs(300));
    }
    let stored = [
        &small[..],
        &["--set", "devices.activations=Bf16", "--lockstep"],
    ]
    .concat();
    let all = gpu_check_with("transformer", "bf16", &stored, Duration::from_secs(300));
    assert!(!all.contains("LOCKSTEP"), "{all}");
}

#[test]
fn gpu_check_cnn_fp32_and_bf16() {
    for precision in ["fp32", "bf16"] {
        gpu_check("cnn", precision, Duration::from_secs(300));
    }
}

#[test]
fn train_mlp_on_cuda_gives_finite_losses() {
    let dir = common::temp("emulated-gpu-train-mlp");
    let _ = std::fs::remove_dir_all(&dir);
    let run_dir = dir.to_str().unwrap();
    let args = [
        "train",
        "models/mlp.ron",
        "--backend",
        "cuda",
        "--steps",
        "5",
        "--run-dir",
        run_dir,
    ];
    let r = on_emulated_gpu(&args, Duration::from_secs(300));
    assert_eq!(r.code, Some(0), "{}\n{}", r.stdout, r.stderr);
    let all = format!("{}{}", r.stdout, r.stderr);
    assert!(all.contains("CUDA backend (GPU 0)"), "{all}");
    let losses: Vec<f64> = all
        .lines()
        .filter(|l| l.starts_with("step "))
        .filter_map(|l| l.split("loss ").nth(1))
        .filter_map(|x| x.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(losses.len(), 5, "{all}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
}

#[test]
fn train_on_cuda_resumes_from_a_checkpoint_bit_for_bit() {
    let (cut, whole) = (
        common::temp("emulated-gpu-resume-cut"),
        common::temp("emulated-gpu-resume-whole"),
    );
    for d in [&cut, &whole] {
        let _ = std::fs::remove_dir_all(d);
    }
    let limit = Duration::from_secs(300);
    // The file comes with `--run-dir`; a resumed run reads its own copy.
    let train = |args: &[&str]| {
        let mut all = vec!["train", "--backend", "cuda"];
        all.extend_from_slice(args);
        let r = on_emulated_gpu(&all, limit);
        assert_eq!(r.code, Some(0), "{}\n{}", r.stdout, r.stderr);
    };
    let cut_dir = cut.to_str().unwrap();
    let mlp = "models/mlp.ron";
    train(&[
        mlp,
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--run-dir",
        cut_dir,
    ]);
    train(&["--steps", "6", "--resume", cut_dir]);
    train(&[mlp, "--steps", "6", "--run-dir", whole.to_str().unwrap()]);
    let read = |d: &PathBuf| std::fs::read(d.join("final.safetensors")).unwrap();
    assert!(
        read(&cut) == read(&whole),
        "the resumed run's parameters differ"
    );
}

/// A CUDA run killed with SIGKILL after a checkpoint, then resumed, writes the bytes of the
/// run never killed.
#[test]
fn a_cuda_run_killed_after_a_checkpoint_resumes_to_the_same_bytes() {
    let (cut, whole) = (
        common::temp("emulated-gpu-kill-cut"),
        common::temp("emulated-gpu-kill-whole"),
    );
    for d in [&cut, &whole] {
        let _ = std::fs::remove_dir_all(d);
    }
    let (cut_dir, whole_dir) = (cut.to_str().unwrap(), whole.to_str().unwrap());
    fn train(dir: &str) -> Vec<&str> {
        let a = [
            "train",
            "models/mlp.ron",
            "--backend",
            "cuda",
            "--steps",
            "120",
        ];
        [&a[..], &["--checkpoint-every", "20", "--run-dir", dir]].concat()
    }
    let limit = Duration::from_secs(300);
    let r = on_emulated_gpu(&train(whole_dir), limit);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let command = common::emulated_gpu::emulated_gpu_command(&train(cut_dir), &[]);
    let mut run = common::Running::spawn(command);
    let checkpoint = cut.join("checkpoints").join("step-00000040.safetensors");
    run.wait_until(limit, || checkpoint.exists());
    run.signal(libc::SIGKILL);
    let _ = run.exit_code(limit);
    assert!(!cut.join("final.safetensors").exists(), "it finished first");
    let r = on_emulated_gpu(&["train", "--resume", cut_dir, "--backend", "cuda"], limit);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let read = |d: &PathBuf| std::fs::read(d.join("final.safetensors")).unwrap();
    assert!(
        read(&cut) == read(&whole),
        "the resumed run's parameters differ"
    );
    for d in [&cut, &whole] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn gpu_check_cnn_with_cuda_graphs_captures_and_replays() {
    let args = [
        "gpu-check",
        "models/cnn.ron",
        "--precision",
        "fp32",
        "--steps",
        "4",
        "--time-steps",
        "2",
    ];
    let env = [("PARALLAX_CUDA_GRAPH", "1")];
    let r = on_emulated_gpu_with(&args, &env, Duration::from_secs(300));
    let all = format!("{}{}", r.stdout, r.stderr);
    assert_eq!(r.code, Some(0), "{all}");
    assert!(
        all.contains("CUDA graphs: 1 step(s) captured, 7 replayed"),
        "{all}"
    );
    assert!(
        r.stdout.contains("|fp32|") && r.stdout.contains("|ok|"),
        "{all}"
    );
    assert!(!r.stderr.contains("emulated GPU:"), "{all}");
}

/// `gpu-check --interpreter` on the emulated GPU compares the interpreter with itself
/// through the whole CUDA path (driver, cuBLAS, the executor's launches): every kernel must
/// be bit-equal, which checks the comparison that a real GPU's lease will run.
#[test]
fn gpu_check_against_the_interpreter_is_bit_equal_here() {
    for (model, precision) in [("mlp", "fp32"), ("cnn", "bf16")] {
        let file = format!("models/{model}.ron");
        let args = [
            "gpu-check",
            &file,
            "--precision",
            precision,
            "--steps",
            "1",
            "--time-steps",
            "1",
            "--interpreter",
            "--mma",
            "oracle-order",
        ];
        let r = on_emulated_gpu(&args, Duration::from_secs(300));
        let all = format!("{}{}", r.stdout, r.stderr);
        assert_eq!(r.code, Some(0), "{all}");
        let families: Vec<&str> = r
            .stdout
            .lines()
            .filter(|l| l.starts_with("INTERP ") && l.contains("kernels bit-equal"))
            .collect();
        assert!(families.len() >= 2, "{all}");
        for line in families {
            // `INTERP family: N of N kernels bit-equal ...; largest 0 ulp apart, 0.0e0 of ...`
            let counts: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(counts[2], counts[4], "{line}");
            assert!(line.contains("largest 0 ulp apart, 0.0e0 of"), "{line}");
        }
        assert!(!r.stdout.contains("INTERP kernel"), "{all}");
    }
}

/// `train models/mlp.ron --backend cuda` on GPU ranks for 3 steps with `args` and `env`;
/// the run's `final.safetensors` and its output.
fn train_gpu_ranks(tag: &str, args: &[&str], env: &[(&str, &str)]) -> (Vec<u8>, String) {
    let dir = common::temp(&format!("emulated-gpu-{tag}"));
    let d = dir.to_str().unwrap();
    let mut all = vec![
        "train",
        "models/mlp.ron",
        "--backend",
        "cuda",
        "--steps",
        "3",
    ];
    all.extend_from_slice(&["--run-dir", d]);
    all.extend_from_slice(args);
    let r = on_emulated_gpu_with(&all, env, Duration::from_secs(300));
    let out = format!("{}{}", r.stdout, r.stderr);
    assert_eq!(r.code, Some(0), "{tag}: {out}");
    (std::fs::read(dir.join("final.safetensors")).unwrap(), out)
}

/// `n` processes of `parallax ARGS` on the emulated GPU with torchrun-style variables (each
/// its own emulated machine), under one hard limit: each one's exit code (`None`: killed at
/// the limit) and output.
fn process_ranks(n: usize, args: &[&str], env: &[(&str, &str)]) -> Vec<(Option<i32>, String)> {
    let port = common::job_port().to_string();
    let runs: Vec<_> = (0..n)
        .map(|r| {
            let mut c = common::binary();
            c.args(args)
                .env("LD_LIBRARY_PATH", libs())
                .env_remove("PARALLAX_CUDA_GRAPH")
                .env_remove("CUDA_VISIBLE_DEVICES")
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", "0")
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("PARALLAX_EMULATED_GPUS", "1")
                .envs(env.iter().copied());
            std::thread::spawn(move || common::run_limited(c, Duration::from_secs(300)))
        })
        .collect();
    runs.into_iter()
        .map(|h| {
            let r = h.join().unwrap();
            (r.code, format!("{}{}", r.stdout, r.stderr))
        })
        .collect()
}

/// GPU ranks summing over NCCL (`PARALLAX_NCCL=1`), as threads of one process (two GPUs;
/// four as dp2.pp2 with ZeRO 1) and as three processes (uneven shards), give the bytes of
/// the host path's sums (the fixed tree makes them the same for every layout).
#[test]
fn nccl_gpu_ranks_in_one_process_and_in_three_give_the_host_paths_bytes() {
    let two = [("PARALLAX_EMULATED_GPUS", "2")];
    let (host, _) = train_gpu_ranks("nccl-host", &["--gpus", "2"], &two);
    let dp_pp = ["--gpus", "4", "--strategy", "dp2.pp2", "--zero", "1"];
    for (tag, gpus, args) in [
        ("nccl-threads-2", "2", &["--gpus", "2"][..]),
        ("nccl-threads-4", "4", &dp_pp[..]),
    ] {
        let nccl = [("PARALLAX_EMULATED_GPUS", gpus), ("PARALLAX_NCCL", "1")];
        let (threads, out) = train_gpu_ranks(tag, args, &nccl);
        assert!(out.contains("over NCCL"), "{out}");
        assert!(!out.contains("emulated GPU:"), "{out}");
        assert!(threads == host, "{tag}: NCCL sums differ from the host's");
    }

    let dir = common::temp("emulated-gpu-nccl-processes");
    let d = dir.to_str().unwrap();
    let args = [
        "train",
        "models/mlp.ron",
        "--backend",
        "cuda",
        "--steps",
        "3",
        "--run-dir",
        d,
        "--collective-timeout",
        "120",
    ];
    let out = process_ranks(3, &args, &[("PARALLAX_NCCL", "1")]);
    for (r, (code, text)) in out.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {r}: {text}");
        assert!(!text.contains("emulated GPU:"), "rank {r}: {text}");
    }
    assert!(out[0].1.contains("over NCCL"), "{}", out[0].1);
    let processes = std::fs::read(dir.join("final.safetensors")).unwrap();
    assert!(
        processes == host,
        "NCCL sums over three processes differ from the host's"
    );
}

/// A planted fault: rank 1's NCCL operations are dropped, as if it never called them
/// (`PARALLAX_EMULATED_NCCL_SKIP_RANK`). Rank 0 must fail within the emulated NCCL's
/// timeout, naming the rank it waited for, not hang.
#[test]
fn a_rank_that_never_calls_the_collective_fails_its_peer_in_time() {
    let dir = common::temp("emulated-gpu-nccl-skip");
    let d = dir.to_str().unwrap();
    let args = [
        "train",
        "models/mlp.ron",
        "--backend",
        "cuda",
        "--steps",
        "3",
        "--run-dir",
        d,
        "--collective-timeout",
        "120",
    ];
    let env = [
        ("PARALLAX_NCCL", "1"),
        ("PARALLAX_EMULATED_NCCL_SKIP_RANK", "1"),
        ("PARALLAX_EMULATED_NCCL_TIMEOUT", "3"),
    ];
    let start = std::time::Instant::now();
    let out = process_ranks(2, &args, &env);
    let took = start.elapsed();
    let (code, text) = &out[0];
    assert!(
        code.is_some_and(|c| c != 0),
        "rank 0 exited {code:?}: {text}"
    );
    assert!(text.contains("ncclTimeout"), "{text}");
    // The runtime's error carries the emulated NCCL's detail (ncclGetLastError).
    assert!(text.contains("waited 3s for rank 1"), "{text}");
    assert!(text.contains("the communicator was aborted"), "{text}");
    assert!(out[1].0.is_some(), "rank 1 hung: {}", out[1].1);
    assert!(took < Duration::from_secs(120), "{took:?}");
}

/// `mpirun -np 2 parallax comm-check --backend cuda` on the emulated GPU (the `mpi`
/// feature): the fixed-tree all-reduce over NCCL against the host's sum, bit for bit, every
/// process its own emulated GPU; with `--fail-rank 1` (rank 1 exits mid-check) rank 0 fails
/// at once, naming the lost rank, instead of waiting out its timeout.
#[cfg(feature = "mpi")]
#[test]
fn comm_check_on_cuda_runs_over_the_emulated_nccl() {
    let mpirun = |args: &[&str]| {
        let mut c = Command::new("mpirun");
        c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
            .env("LD_LIBRARY_PATH", libs())
            .env_remove("PARALLAX_EMULATED_GPUS")
            .args([
                "--oversubscribe",
                "-np",
                "2",
                env!("CARGO_BIN_EXE_parallax"),
            ])
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        common::run_limited(c, Duration::from_secs(600))
    };
    let r = mpirun(&["comm-check", "--backend", "cuda", "--timeout", "120"]);
    let all = format!("{}{}", r.stdout, r.stderr);
    assert_eq!(r.code, Some(0), "{all}");
    assert!(all.contains("NCCL 2 rank(s) on NVIDIA H200"), "{all}");
    let rows = r.stdout.lines().filter(|l| l.ends_with("| yes |")).count();
    assert_eq!(rows, 16, "{all}");
    assert!(!all.contains("| no |"), "{all}");

    let r = mpirun(&[
        "comm-check",
        "--backend",
        "cuda",
        "--timeout",
        "120",
        "--fail-rank",
        "1",
    ]);
    let all = format!("{}{}", r.stdout, r.stderr);
    assert!(r.code.is_some_and(|c| c != 0), "{all}");
    // Rank 0 is waiting on rank 1 when it exits: the emulated NCCL sees its process gone.
    let named = "rank 1 (process ";
    assert!(
        all.lines()
            .any(|l| l.starts_with("error: rank 0") && l.contains(named) && l.contains("exited")),
        "{all}"
    );
    assert!(r.took < Duration::from_secs(110), "{:?}: {all}", r.took);
}

/// `scripts/gpu-check.sh`, the run prepared for a lent GPU, rehearsed whole on the emulated
/// GPU with the small models: every section but speed and the bench models (the conformance
/// rows, CUDA graphs, the interpreter beside the "GPU", bf16 storage in lockstep, training,
/// resume, collectives, NCCL ranks under mpirun, GPU ranks in train), its table and its
/// `$OUT` files; every row must pass, none be skipped. (On an H200, a first run of its
/// ranks section reported the GPU-rank trainings as skipped: the launcher put `--gpus`
/// before the subcommand, the command line's usage error exited 2, and 2 meant "no time".)
#[cfg(feature = "mpi")]
#[test]
fn the_gpu_check_script_runs_whole_on_the_emulated_gpu() {
    let dir = common::temp("emulated-gpu-script");
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.join("out");
    let bin = env!("CARGO_BIN_EXE_parallax");
    let mut c = Command::new("bash");
    c.arg("scripts/gpu-check.sh")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("PARALLAX", bin)
        .env("PARALLAX_MPI", bin)
        .env("WHEEL_LIBS", "0")
        .env("BASE_MODELS", "models/mlp.ron")
        .env("RANK_MODELS", "models/mlp.ron")
        .env("SECTIONS", "base interp stored ranks")
        .env("BUDGET", "900")
        .env("OUT", &out)
        .env("TMPDIR", &dir)
        .env("LD_LIBRARY_PATH", libs())
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .env_remove("PARALLAX_EMULATED_GPUS")
        .env_remove("NCCL_WHEEL")
        .env_remove("LOCKSTEP");
    std::fs::create_dir_all(&dir).unwrap();
    let r = common::run_limited(c, Duration::from_secs(900));
    let all = format!("{}{}", r.stdout, r.stderr);
    assert_eq!(r.code, Some(0), "{all}");
    let rows: Vec<&str> = r
        .stdout
        .lines()
        .skip_while(|l| !l.starts_with("check "))
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .collect();
    for want in [
        "models/mlp.ron ",
        "models/mlp.ron, CUDA graph",
        "interp models/mlp.ron",
        "models/mlp.ron (bf16-stored, lockstep)",
        "train mlp --backend cuda",
        "resume from step 200 on CUDA: final.safetensors identical",
        "collectives",
        "comm-check cuda (a) 1 rank, NCCL id over MPI: same bits",
        "comm-check cuda (b) 2 ranks on one GPU: same bits as 1 rank",
        "comm-check cuda (c) --fail-rank 1: rank 0 failed",
        "train mlp --gpus 1 --backend cuda",
        "train mlp --gpus 2, host sums: the bits of --gpus 1",
        "train mlp --gpus 2, pp2: the bits of --gpus 1",
        "train mlp --gpus 2, NCCL sums: the bits of --gpus 1",
        "train mlp --gpus 2, mpirun -np 2: the bits of --gpus 1",
        "train mlp --gpus 2, mpirun -np 2, NCCL sums: the bits of --gpus 1",
    ] {
        assert!(
            rows.iter().any(|r| r.starts_with(want)),
            "no row `{want}`: {all}"
        );
    }
    assert!(rows.len() >= 18, "{all}");
    for row in &rows {
        assert!(row.contains(" ok "), "{row}: {all}");
    }
    for f in [
        "gpu-check-rows.txt",
        "gpu-check.log",
        "gpu-check-interp.txt",
    ] {
        assert!(out.join(f).is_file(), "no $OUT/{f}: {all}");
    }
    let log = std::fs::read_to_string(out.join("gpu-check.log")).unwrap();
    assert!(log.contains("took "), "{log}");
}

/// `sample` on the CUDA backend draws through the decode step's key/value cache (its cache
/// write and cached attention as PTX kernels, run here on the interpreter with its
/// sanitizer): a tiny character model trained on the CPU gives the CPU's text, greedy and
/// drawn with a seed.
#[test]
fn sample_draws_through_the_key_value_cache_on_cuda() {
    let dir = common::temp("emulated-gpu-sample");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("input.txt");
    std::fs::write(&input, "abcdefghijklmnopqrstuvwxyz\n".repeat(300)).unwrap();
    let prefix = dir.join("letters");
    let p = prefix.to_str().unwrap();
    let cpu = |args: &[&str]| {
        let r = common::run_args(args, Duration::from_secs(120));
        assert_eq!(r.0, Some(0), "{}", r.2);
        (r.1, r.2)
    };
    cpu(&[
        "tokenize",
        input.to_str().unwrap(),
        "--tokenizer",
        "chars",
        "--out",
        p,
    ]);
    let exp = common::char_model(&dir, p, 27);
    let run = dir.join("run");
    let r = run.to_str().unwrap();
    cpu(&["train", &exp, "--run-dir", r, "--backend", "cpu"]);
    for draw in [
        common::GREEDY_ABC,
        &[
            "--prompt",
            "k",
            "--max-new-tokens",
            "40",
            "--seed",
            "1",
            "--temperature",
            "1.5",
        ],
    ] {
        let mut on_cpu = vec!["sample", r, "--backend", "cpu"];
        on_cpu.extend_from_slice(draw);
        let (want, said) = cpu(&on_cpu);
        assert!(said.contains("a key/value cache of 4096 bytes"), "{said}");
        let mut on_gpu = vec!["sample", r, "--backend", "cuda", "--precision", "fp32"];
        on_gpu.extend_from_slice(draw);
        let g = on_emulated_gpu(&on_gpu, Duration::from_secs(300));
        assert_eq!(g.code, Some(0), "{}", g.stderr);
        assert!(
            g.stderr.contains("a key/value cache of 4096 bytes"),
            "{}",
            g.stderr
        );
        assert!(!g.stderr.contains("emulated GPU:"), "{}", g.stderr);
        assert_eq!(g.stdout, want, "{}", g.stderr);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
