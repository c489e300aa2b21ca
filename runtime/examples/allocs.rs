//! Counts heap allocations per training step: `cargo run --release --example allocs -- FILE`.

use parallax_compiler::{compile, parse_bytes, Options};
use parallax_runtime::cpu::{Executor, Mode};
use parallax_runtime::data::{self, Loader, Values};
use parallax_runtime::train::model_io;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
    let options = Options::default();
    let plan = compile(&source, &options, &mut |_, _| {})
        .unwrap()
        .plan(&source, &options);
    let e = &source.experiment;
    let (io, input, target) = model_io(&plan, &e.loss).unwrap();
    let splits = data::load(&e.data, &io, 1, std::path::Path::new(".")).unwrap();
    let batch = e.train.batch_size as usize;
    let b = Loader::new(Arc::new(splits.train), batch, 1, false, 0)
        .unwrap()
        .next()
        .unwrap();
    let mut x = Executor::new(plan, batch, 3);
    match &b.inputs {
        Values::F32(v) => x.set_f32(&input, batch, v).unwrap(),
        Values::I32(v) => x.set_i32(&input, batch, v).unwrap(),
    }
    match &b.targets {
        Values::F32(v) => x.set_f32(&target, batch, v).unwrap(),
        Values::I32(v) => x.set_i32(&target, batch, v).unwrap(),
    }
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
