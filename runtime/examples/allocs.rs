//! Counts heap allocations per training step: `cargo run --release --example allocs -- FILE`.

use parallax_compiler::parse_bytes;
use parallax_runtime::cpu::Mode;
use parallax_runtime::train::Session;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local!(static IN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
static TRACE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        if TRACE.load(Ordering::Relaxed) && !IN.with(|c| c.replace(true)) {
            let bt = std::backtrace::Backtrace::force_capture().to_string();
            let frames: Vec<&str> = bt
                .lines()
                .filter(|l| l.contains("parallax") || l.contains("gemm") || l.contains("rayon"))
                .take(4)
                .collect();
            eprintln!("ALLOC {} {:?}", l.size(), frames);
            IN.with(|c| c.set(false));
        }
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn main() {
    let path = std::env::args().nth(1).expect("usage: allocs FILE");
    let source = parse_bytes(&std::fs::read(path).unwrap()).unwrap();
    let e = &source.experiment;
    let mut s = Session::of_experiment(&source, 1).unwrap();
    let batch = e.train.batch_size as usize;
    s.next_batch().unwrap();
    let x = &mut s.exec;
    for step in 0..6 {
        if step == 5 && std::env::var_os("TRACE").is_some() {
            TRACE.store(true, Ordering::Relaxed);
        }
        let before = ALLOCS.load(Ordering::Relaxed);
        x.run(batch, Mode::Train, step, 0).unwrap();
        println!(
            "step {step}: {} allocations",
            ALLOCS.load(Ordering::Relaxed) - before
        );
    }
}
