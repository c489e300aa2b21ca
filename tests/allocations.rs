//! The CPU executor's steady-state training step, and the scan for non-finite values after
//! it, allocate nothing: every value lives in the plan's buffers, shape metadata on the
//! stack, kernel scratch in per-thread vectors kept between steps. The one exception is inside the `gemm` crate, which allocates its packing
//! buffers on every call (no API takes them from the caller); those are not counted here.

use parallax_compiler::parse_bytes;
use parallax_runtime::cpu::kernels::gemm::IN_GEMM_CRATE;
use parallax_runtime::cpu::Mode;
use parallax_runtime::train::{set_scalars, Session};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

struct Counting;
static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
thread_local!(static STEPPING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // `try_with`: the thread-local may be gone while a thread exits.
        let in_gemm = IN_GEMM_CRATE.try_with(|d| d.get() > 0).unwrap_or(false);
        // The step's threads: the test's and the pool's (not the loader's workers).
        let stepping = rayon::current_thread_index().is_some()
            || STEPPING.try_with(|s| s.get()).unwrap_or(false);
        if COUNTING.load(Ordering::Relaxed) && stepping && !in_gemm {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn a_steady_state_training_step_allocates_nothing() {
    // One worker (this binary's only test): every kernel runs on the one thread, which the
    // `gemm` flag above is kept on.
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global()
        .unwrap();
    STEPPING.with(|s| s.set(true));
    for name in ["mlp", "cnn", "transformer"] {
        let path = format!("{}/benches/models/{name}.ron", env!("CARGO_MANIFEST_DIR"));
        let source = parse_bytes(&std::fs::read(path).unwrap()).unwrap();
        let e = &source.experiment;
        let mut s = Session::of_experiment(&source, 0).unwrap();
        let b = s.next_batch().unwrap();
        let mut counted = 0;
        for step in 0..4 {
            set_scalars(&mut s.exec, &e.optimizer, step, 4).unwrap();
            // Warm-up steps size the kept scratch vectors.
            COUNTING.store(step >= 2, Ordering::SeqCst);
            let before = ALLOCATIONS.load(Ordering::SeqCst);
            s.exec.run(b.size, Mode::Train, step, 0).unwrap();
            // Training scans every gradient, parameter and state after each step.
            let non_finite = s.exec.first_non_finite();
            counted += ALLOCATIONS.load(Ordering::SeqCst) - before;
            assert_eq!(non_finite, None, "{name}");
            COUNTING.store(false, Ordering::SeqCst);
        }
        assert_eq!(counted, 0, "{name}: {counted} allocations in two steps");
    }
}
