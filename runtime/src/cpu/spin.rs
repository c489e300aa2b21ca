//! Running on rayon's pool with its other workers busy-waiting: how a step runs its kernels
//! (`Executor::run`), and how the timing examples run theirs so that they time the same.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Runs `f` on a worker of rayon's pool while the other workers spin, running any work they
/// find, instead of falling asleep between parallel kernels: a sleeping worker wakes too
/// late to take its half of a product that lasts a millisecond (on 2 cores the MLP bench
/// step took 6.1 ms without spinners, 5.4 with, the mean of 5 interleaved runs each), and
/// called from outside the pool each split product also wakes the pool and puts the caller
/// to sleep. OpenMP's threads, PyTorch's, spin the same way. `f` gets `top_up`, to call
/// before each kernel: a spinner gives up after [`IDLE`] without work, so one picked up by a
/// worker that is itself waiting inside a kernel only delays that kernel.
pub fn on_spinning_pool<R: Send>(f: impl FnOnce(&dyn Fn()) -> R + Send) -> R {
    let spin = Spin::default();
    rayon::scope(|scope| {
        let r = f(&|| spin.top_up(scope));
        spin.done.store(true, Ordering::Release);
        r
    })
}

#[derive(Default)]
struct Spin {
    done: AtomicBool,
    active: AtomicUsize,
}

/// How long a spinner waits for work before it gives up.
const IDLE: std::time::Duration = std::time::Duration::from_micros(500);

impl Spin {
    fn top_up<'s>(&'s self, scope: &rayon::Scope<'s>) {
        let others = rayon::current_num_threads().saturating_sub(1);
        while self.active.load(Ordering::Acquire) < others {
            self.active.fetch_add(1, Ordering::AcqRel);
            scope.spawn(move |_| self.spin());
        }
    }

    fn spin(&self) {
        let mut since = std::time::Instant::now();
        while !self.done.load(Ordering::Acquire) {
            if rayon::yield_now() == Some(rayon::Yield::Executed) {
                since = std::time::Instant::now();
            } else if since.elapsed() > IDLE {
                break;
            } else {
                std::hint::spin_loop();
            }
        }
        self.active.fetch_sub(1, Ordering::AcqRel);
    }
}
