//! Running the binary on the emulated GPU (`emulator/gpu`, the `cdylib` that
//! `scripts/emulated-gpu` links as libcuda, libcublas, libcublasLt and libnccl): a folder of
//! those links first on the child's library path, under a hard time limit.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

/// The target folder this test was built in (`.../target/<profile>`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // .../target/<profile>/deps/emulated_gpu-<hash>
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// The emulated GPU library: built with the workspace (this package dev-depends on it),
/// else built now into the same target folder. Fails, never skips, when it cannot be.
pub fn library() -> PathBuf {
    let dir = profile_dir();
    let name = "libparallax_emulated_gpu.so";
    // The newest of the uplifted library and the dependency's own (a `cargo test` of this
    // package alone refreshes only the latter).
    let found = || {
        [dir.join(name), dir.join("deps").join(name)]
            .into_iter()
            .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
            .max()
            .map(|(_, p)| p)
    };
    if let Some(p) = found() {
        return p;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = dir.parent().unwrap();
    let mut c = Command::new(cargo);
    c.args(["build", "-p", "parallax-emulated-gpu", "--target-dir"])
        .arg(target)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if dir.file_name().is_some_and(|n| n == "release") {
        c.arg("--release");
    }
    let r = super::run_limited(c, Duration::from_secs(900));
    assert_eq!(r.code, Some(0), "building the emulated GPU: {}", r.stderr);
    found().unwrap_or_else(|| panic!("no {name} in {} after building it", dir.display()))
}

/// A folder with the library under the driver's and cuBLAS's names (as the script makes).
pub fn libs() -> &'static Path {
    static LIBS: OnceLock<PathBuf> = OnceLock::new();
    LIBS.get_or_init(|| {
        let lib = library();
        let dir = super::temp("emulated-gpu-libs");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for name in [
            "libcuda.so",
            "libcuda.so.1",
            "libcublas.so",
            "libcublas.so.13",
            "libcublasLt.so",
            "libcublasLt.so.13",
            "libnccl.so",
            "libnccl.so.2",
        ] {
            std::os::unix::fs::symlink(&lib, dir.join(name)).unwrap();
        }
        dir
    })
}

/// Runs the binary on the emulated GPU for at most `limit`.
pub fn on_emulated_gpu(args: &[&str], limit: Duration) -> super::Limited {
    on_emulated_gpu_with(args, &[], limit)
}

/// The same with more environment variables.
pub fn on_emulated_gpu_with(
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> super::Limited {
    let r = super::run_limited(emulated_gpu_command(args, env), limit);
    assert!(r.code.is_some(), "`{}` ran past {limit:?}", args.join(" "));
    r
}

/// The binary with `args` and `env`, set to run on the emulated GPU (and nothing of the
/// caller's environment that changes it).
pub fn emulated_gpu_command(args: &[&str], env: &[(&str, &str)]) -> std::process::Command {
    let mut c = super::binary();
    c.args(args)
        .env("LD_LIBRARY_PATH", libs())
        .env_remove("PARALLAX_CUBLASLT")
        .env_remove("PARALLAX_GEMM_BIAS")
        .env_remove("PARALLAX_CUDA_GRAPH")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("PARALLAX_EMULATED_GPUS")
        .env_remove("PARALLAX_EMULATED_GPU_MEMORY")
        .env_remove("PARALLAX_EMULATED_STREAM_SEED")
        .env_remove("PARALLAX_PLANT_BUG")
        .envs(env.iter().copied());
    c
}
