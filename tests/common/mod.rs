//! Helpers shared by the integration tests that run the `parallax` binary.
#![allow(dead_code)] // each test binary uses its own subset

pub mod emulated_gpu;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs the binary from the repository root (so `models/...` paths resolve).
pub fn parallax(args: &[&str]) -> Output {
    binary().args(args).output().expect("the binary runs")
}

/// A command line written as one string: the words of `line` (split at white space, so no
/// word of it may hold a space), each word `{}` replaced by the next of `tail` (paths, which
/// may), then the rest of `tail`.
pub fn argv<'a>(line: &'a str, tail: &[&'a str]) -> Vec<&'a str> {
    let mut tail = tail.iter().copied();
    let mut args: Vec<&str> = line
        .split_whitespace()
        .map(|w| match w {
            "{}" => tail.next().expect("a path for each {} of the line"),
            w => w,
        })
        .collect();
    args.extend(tail);
    args
}

/// Runs the binary with the words of `line`, then `tail` (see [`argv`]).
pub fn cli(line: &str, tail: &[&str]) -> Output {
    parallax(&argv(line, tail))
}

/// [`cli`], which must succeed.
pub fn cli_ok(line: &str, tail: &[&str]) -> Output {
    let o = cli(line, tail);
    assert!(o.status.success(), "{line} {tail:?}\n{}", stderr(&o));
    o
}

/// [`cli`], which must exit with `code`; returns its stderr.
pub fn cli_exits(code: i32, line: &str, tail: &[&str]) -> String {
    let o = cli(line, tail);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(code), "{line} {tail:?}\n{err}");
    err
}

/// Runs the binary with the words of `line`, which must exit 1; returns its stderr.
pub fn exits_1(line: &str) -> String {
    cli_exits(1, line, &[])
}

/// The binary, run from the repository root (so `models/...` paths resolve).
pub fn binary() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_parallax"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

/// `train FILE --run-dir RUN EXTRA...`, which must succeed.
pub fn train_ok(file: &str, run: &std::path::Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", file, "--run-dir", run.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = parallax(&args);
    assert!(
        o.status.success(),
        "{args:?}\n{}\n{}",
        stdout(&o),
        stderr(&o)
    );
    o
}

/// Runs `args` for at most `limit`; returns the exit code (`None` if it was still running,
/// then killed) and stderr.
pub fn run_for(args: &[&str], limit: Duration) -> (Option<i32>, String) {
    let mut c = binary();
    c.args(args);
    let r = run_limited(c, limit);
    (r.code, r.stderr)
}

/// Runs the binary with `args` for at most `limit`; returns (exit code, stdout, stderr).
pub fn run_args(args: &[&str], limit: Duration) -> (Option<i32>, String, String) {
    let mut c = binary();
    c.args(args);
    let r = run_limited(c, limit);
    (r.code, r.stdout, r.stderr)
}

/// Runs the binary with `args` for at most `limit`, which must exit 0; returns stdout.
pub fn run_ok(args: &[&str], limit: Duration) -> String {
    let (code, out, err) = run_args(args, limit);
    assert_eq!(code, Some(0), "{args:?}\n{err}");
    out
}

/// `train MODEL --steps STEPS --gpus 1 --run-dir DIR`: the one-device run that runs over
/// several processes are checked against.
pub fn one_device<'a>(model: &'a str, steps: &'a str, dir: &'a str) -> [&'a str; 8] {
    [
        "train",
        model,
        "--steps",
        steps,
        "--gpus",
        "1",
        "--run-dir",
        dir,
    ]
}

/// What a time-limited run gave.
pub struct Limited {
    /// `None`: still running at the limit, then killed.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

/// Runs `command` for at most `limit` (so a hang fails the test, never the CI run), its
/// output kept in files so that a full pipe cannot stall it.
pub fn run_limited(mut command: Command, limit: Duration) -> Limited {
    // Named by a count, not the arguments: they may be long, and runs may be concurrent.
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (out_file, err_file) = (temp(&format!("stdout-{n}")), temp(&format!("stderr-{n}")));
    let mut child = command
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_file).unwrap())
        .stderr(std::fs::File::create(&err_file).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if start.elapsed() > limit {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = start.elapsed();
    let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();
    let (stdout, stderr) = (read(&out_file), read(&err_file));
    let _ = (
        std::fs::remove_file(out_file),
        std::fs::remove_file(err_file),
    );
    Limited {
        code,
        stdout,
        stderr,
        took,
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh directory path for test `name` in this process (removed if it exists).
pub fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("parallax-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// [`temp`], created.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = temp(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every value of `key` in a run's `metrics.jsonl`, in order (`loss`: one per step;
/// `val_loss`: one per validation).
pub fn metric(run: &std::path::Path, key: &str) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_else(|e| panic!("{}: {e}", run.display()))
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v[key].as_f64())
        .collect()
}

/// The f32 tensors of a safetensors file by name, with their shapes (PyTorch's
/// `num_batches_tracked`, which Parallax does not keep, left out).
pub fn f32_tensors(
    path: &std::path::Path,
) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .filter(|(name, _)| !name.ends_with(".num_batches_tracked"))
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let v = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, (view.shape().to_vec(), v))
        })
        .collect()
}

/// A tensor's difference against its scale: `max |a - b| / max(max |b|, tiny)`.
pub fn scaled_difference(a: &[f32], b: &[f32]) -> f64 {
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs())
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| f64::from(y.abs())).fold(0.0, f64::max);
    diff / scale.max(f64::from(f32::MIN_POSITIVE))
}

/// A `.npy` file (version 1.0, C order, little-endian) of `descr` (`<f4`, `<i4`) values.
pub fn write_npy(path: &std::path::Path, descr: &str, shape: &[usize], data: &[u8]) {
    std::fs::write(
        path,
        parallax_runtime::data::inputs::npy(descr, shape, data),
    )
    .unwrap();
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One step of splitmix64: advances `state` and returns the next value of the stream (tiny,
/// deterministic, good enough for test data and mutations).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A `parallax` process running in the background, its stderr in a file, killed when
/// dropped (so a hang fails the test instead of outliving it).
pub struct Running {
    pub child: std::process::Child,
    err: PathBuf,
}

impl Running {
    /// Starts `args` from the repository root.
    pub fn start(args: &[&str]) -> Running {
        let mut c = Command::new(env!("CARGO_BIN_EXE_parallax"));
        c.args(args).current_dir(env!("CARGO_MANIFEST_DIR"));
        Running::spawn(c)
    }

    /// Starts `command` (a launcher of `parallax`, say).
    pub fn spawn(mut command: Command) -> Running {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let err = temp(&format!("running-{n}.stderr"));
        let child = command
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("the binary starts");
        Running { child, err }
    }

    /// Sends signal `sig` (`libc::SIGINT`, ...).
    pub fn signal(&self, sig: i32) {
        let pid = self.child.id() as i32;
        // SAFETY: kill(2) on our own child's pid has no memory effects.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid}");
    }

    /// Waits at most `limit` for `until` to hold, polling; panics past it.
    pub fn wait_until(&mut self, limit: std::time::Duration, until: impl Fn() -> bool) {
        let start = std::time::Instant::now();
        while !until() {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("exited ({status}) before expected: {}", self.stderr());
            }
            assert!(start.elapsed() < limit, "timed out: {}", self.stderr());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// The exit code, waiting at most `limit` (panics past it, the process killed).
    pub fn exit_code(&mut self, limit: std::time::Duration) -> Option<i32> {
        let start = std::time::Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(start.elapsed() < limit, "still running: {}", self.stderr());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.err);
    }
}

/// Writes `tensors` (by name: shape and values) as an f32 safetensors file, the inverse of
/// [`f32_tensors`].
pub fn write_f32_tensors(
    path: &std::path::Path,
    tensors: &std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) {
    let bytes: Vec<(&String, &Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, (s, v))| (n, s, f32_bytes(v)))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.to_vec(), b);
            (n.to_string(), view.unwrap())
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// A port for a job's rank 0 to listen at, free now and outside the kernel's ephemeral range
/// (32768 and up on Linux), so that no connection another test makes takes it meanwhile.
pub fn job_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20000 + ((std::process::id().wrapping_mul(7919) + n * 104729) % 12000) as u16;
        let both = std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
            && std::net::TcpListener::bind(("0.0.0.0", port + 1)).is_ok();
        if both {
            return port;
        }
    }
}

/// `models/NAME.ron`, parsed.
pub fn model(name: &str) -> parallax_compiler::Source {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("models/{name}.ron"));
    parallax_compiler::parse_bytes(&std::fs::read(path).unwrap())
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The plan of `source` compiled with `options`.
pub fn plan_of(
    source: &parallax_compiler::Source,
    options: &parallax_compiler::Options,
) -> parallax_compiler::plan::Plan {
    parallax_compiler::compile(source, options, &mut |_, _| {})
        .unwrap()
        .plan(source, options)
}

/// The plan of `source` as compiled (default options) and one op a kernel (its kernels and
/// schedule dropped).
pub fn fused_and_plain(
    source: &parallax_compiler::Source,
) -> (parallax_compiler::plan::Plan, parallax_compiler::plan::Plan) {
    let options = parallax_compiler::Options::default();
    let c = parallax_compiler::compile(source, &options, &mut |_, _| {}).unwrap();
    let fused = c.plan(source, &options);
    let mut g = c.graph;
    g.kernels.clear();
    g.schedule = None;
    let plain = parallax_compiler::plan::Plan::single_device(&g, source, &options);
    (fused, plain)
}

/// `steps` training steps of `plan` on the data's first batch of 8, on the CPU executor.
pub fn train_steps(
    s: &parallax_compiler::Source,
    plan: parallax_compiler::plan::Plan,
    steps: u64,
) -> parallax_runtime::cpu::Executor {
    use parallax_runtime::train::{set_scalars, Session};
    let mut session = Session::new(s, plan, 8, 1, std::path::Path::new(".")).unwrap();
    let batch = session.next_batch().unwrap().size;
    let mut e = session.exec;
    for step in 0..steps {
        set_scalars(&mut e, &s.experiment.optimizer, step, steps).unwrap();
        e.run(batch, parallax_runtime::cpu::Mode::Train, step, 0)
            .unwrap();
    }
    e
}

/// `mpirun` as the tests run it: root in CI, more ranks than cores, no CMA single-copy
/// inside containers.
pub fn mpirun_command() -> Command {
    let mut c = Command::new("mpirun");
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .arg("--oversubscribe")
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

/// `mpirun -np N parallax ARGS` for at most `limit`.
pub fn mpirun(n: usize, args: &[&str], limit: Duration) -> Limited {
    let mut c = mpirun_command();
    c.args(["-np", &n.to_string(), env!("CARGO_BIN_EXE_parallax")])
        .args(args);
    run_limited(c, limit)
}

/// A tiny causal character model of `vocab` symbols on token files `PREFIX_train.bin` and
/// `PREFIX_val.bin`.
pub fn char_model(dir: &std::path::Path, prefix: &str, vocab: usize) -> String {
    let text = format!(
        r#"Experiment(
    name: "letters",
    params: {{ "d": 32, "vocab": {vocab}, "seq": 16 }},
    model: Graph(
        inputs: {{ "tokens": (shape: ["seq"], dtype: I32) }},
        nodes: [
            ("emb", Embedding(vocab: "vocab", dim: "d"), ["tokens"]),
            ("pos", PositionalEmbedding(max_len: "seq"), ["emb"]),
            ("n1", LayerNorm, ["pos"]),
            ("att", Attention(heads: 2, causal: true), ["n1"]),
            ("r1", Add, ["pos", "att"]),
            ("n2", LayerNorm, ["r1"]),
            ("logits", Linear(out: "vocab"), ["n2"]),
        ],
    ),
    loss: CrossEntropy,
    data: Tokens(train: "{prefix}_train.bin", validation: "{prefix}_val.bin", validation_windows: 20),
    optimizer: Adam(lr: 1e-2),
    train: (batch_size: 8, steps: 150, seed: 5),
)"#
    );
    write_experiment(&dir.join("letters.ron"), &text)
}

/// `sample`'s arguments for a greedy continuation of "abc" (30 new tokens, temperature 0), the
/// alphabet once `char_model` has learnt it.
pub const GREEDY_ABC: &[&str] = &[
    "--prompt",
    "abc",
    "--max-new-tokens",
    "30",
    "--temperature",
    "0",
];

/// Writes the experiment `text` to `path`; returns the path, for the command line.
pub fn write_experiment(path: &std::path::Path, text: &str) -> String {
    std::fs::write(path, text).unwrap();
    path.display().to_string()
}

/// The params, model and loss of a tiny causal model on tokens of vocabulary 32, sequence 8:
/// an embedding, a positional embedding, one attention and the logits.
pub const TINY_CAUSAL: &str = r#"    params: { "d": 16, "vocab": 32, "seq": 8 },
    model: Graph(
        inputs: { "tokens": (shape: ["seq"], dtype: I32) },
        nodes: [
            ("emb", Embedding(vocab: "vocab", dim: "d"), ["tokens"]),
            ("pos", PositionalEmbedding(max_len: "seq"), ["emb"]),
            ("att", Attention(heads: 2, causal: true), ["pos"]),
            ("logits", Linear(out: "vocab"), ["att"]),
        ],
    ),
    loss: CrossEntropy,"#;
