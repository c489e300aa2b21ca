//! Batches of a data set, epoch after epoch, prepared ahead on a worker thread.
//!
//! The stated rules:
//!
//! - Epoch `e` visits the data set in the order `epoch_order(seed, e, len)`, that is
//!   `permutation(stream(seed, Purpose::Shuffle, e), len)`; without shuffling (`train.shuffle:
//!   false`) every epoch visits it in file order, `0..len`.
//! - Batch `b` of an epoch is the samples at positions `b * batch_size ..
//!   min((b + 1) * batch_size, len)` of that order, inputs and targets gathered in that order.
//! - The last partial batch: when `len` is not a multiple of `batch_size`, the epoch's last
//!   batch holds the `len % batch_size` remaining samples (it is smaller) unless `drop_last`,
//!   which drops it (those samples are not seen in that epoch; the next epoch's order differs).
//!   `drop_last` with fewer samples than one batch is an error, as is a batch size of 0 or an
//!   empty data set.
//! - A batch is a pure function of (data set, seed, batch size, drop_last, shuffle, epoch,
//!   index): the worker thread changes only when it is computed, never what it holds.
//! - A process that runs only some devices of a job reads (decodes) only the samples of their
//!   micro-shards ([`Loader::only`]); the batch's other samples are left zero, never read there.
//!   Targets stay whole where they cost nothing to read (an image's class), since each shard's
//!   loss share counts the whole batch's labels.
//! - The worker thread starts at the first [`Loader::next`]: a loader that is never read
//!   (`eval` opening a run's data) reads nothing.

use super::{DataError, Dataset, Values};
use crate::rng::{permutation, stream, Purpose};
use std::ops::Range;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// The samples of a global batch this process reads, given the batch's size: its devices'
/// micro-shards as sample ranges, in order (`Backend::samples_here`).
pub type Wanted = Arc<dyn Fn(usize) -> Vec<Range<usize>> + Send + Sync>;

/// Which of a batch's `size` samples to read: all without `wanted`.
pub fn read_mask(wanted: Option<&Wanted>, size: usize) -> Vec<bool> {
    let Some(w) = wanted else {
        return vec![true; size];
    };
    let mut mask = vec![false; size];
    for r in w(size) {
        for m in &mut mask[r.start.min(size)..r.end.min(size)] {
            *m = true;
        }
    }
    mask
}

/// Makes batch (epoch, index) reading only the wanted samples.
type Make = Box<dyn FnMut(u64, usize, Option<&Wanted>) -> Result<Batch, DataError> + Send>;

/// Batches prepared ahead of the consumer.
pub const PREFETCH: usize = 4;

/// The order in which epoch `epoch` visits a data set of `len` samples.
pub fn epoch_order(seed: u64, epoch: u64, len: usize) -> Vec<usize> {
    permutation(stream(seed, Purpose::Shuffle, epoch), len)
}

/// [`epoch_order`], or file order `0..len` in every epoch when `shuffle` is off.
pub fn order_of(shuffle: bool, seed: u64, epoch: u64, len: usize) -> Vec<usize> {
    if shuffle {
        epoch_order(seed, epoch, len)
    } else {
        (0..len).collect()
    }
}

/// Batches in an epoch: `ceil(len / batch_size)`, or `floor` with `drop_last`.
pub fn batches_per_epoch(len: usize, batch_size: usize, drop_last: bool) -> usize {
    if drop_last {
        len / batch_size
    } else {
        len.div_ceil(batch_size)
    }
}

/// One batch: `size` samples, inputs `[size, ..input shape]` and targets
/// `[size, ..target shape]` in C order; batch `index` of epoch `epoch`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub inputs: Values,
    pub targets: Values,
    pub size: usize,
    pub epoch: u64,
    pub index: usize,
    /// The samples read (decoded) for it here: `size`, or this process's share of them.
    pub read: usize,
}

/// Batch `index` of an epoch whose order is `order`.
pub fn make_batch(
    dataset: &Dataset,
    order: &[usize],
    batch_size: usize,
    epoch: u64,
    index: usize,
) -> Batch {
    let start = (index * batch_size).min(order.len());
    let end = (start + batch_size).min(order.len());
    let picked = dataset.subset(&order[start..end]);
    Batch {
        inputs: picked.inputs,
        targets: picked.targets,
        size: end - start,
        epoch,
        index,
        read: end - start,
    }
}

/// Serves the batches of a data set forever, epoch after epoch (see the module's rules),
/// starting at batch `first_batch` of the run. A worker thread prepares up to [`PREFETCH`] batches ahead;
/// dropping the loader stops it.
pub struct Loader {
    rx: Option<Receiver<Batch>>,
    worker: Option<JoinHandle<()>>,
    batches_per_epoch: usize,
    /// Why the worker stopped, if a batch could not be made (an image that does not decode).
    failure: Arc<Mutex<Option<DataError>>>,
    /// The worker's first batch and maker, until the first `next` starts it.
    pending: Option<(u64, Make)>,
    wanted: Option<Wanted>,
    gate: Arc<Gate>,
}

/// When the worker may make a batch. While the consumer computes (a training step, whose
/// threads fill the cores), a worker that has a batch waiting in the channel holds off, so
/// that it does not take a core from the step; one whose consumer would run short goes on.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    computing: bool,
    /// Batches sent and not yet received.
    queued: usize,
    /// The loader was dropped: the worker stops waiting.
    closed: bool,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        // The state is plain flags and a count: a panic elsewhere leaves it usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, change: impl FnOnce(&mut GateState)) {
        change(&mut self.lock());
        self.changed.notify_all();
    }

    /// Waits while the consumer computes and a batch is ready for it.
    fn wait_turn(&self) {
        let mut s = self.lock();
        while s.computing && s.queued > 0 && !s.closed {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// While it lives, the consumer computes: the loader's worker makes no batch unless the
/// consumer would otherwise wait for one ([`Loader::computing`]).
pub struct Computing(Arc<Gate>);

impl Drop for Computing {
    fn drop(&mut self) {
        self.0.set(|s| s.computing = false);
    }
}

impl Loader {
    /// A loader that shuffles every epoch (see [`Loader::with_shuffle`]).
    pub fn new(
        dataset: Arc<Dataset>,
        batch_size: usize,
        seed: u64,
        drop_last: bool,
        first_batch: u64,
    ) -> Result<Loader, DataError> {
        Loader::with_shuffle(dataset, batch_size, seed, drop_last, true, first_batch)
    }

    /// A loader whose epochs visit the data in [`order_of`]`(shuffle, seed, epoch, len)`.
    pub fn with_shuffle(
        dataset: Arc<Dataset>,
        batch_size: usize,
        seed: u64,
        drop_last: bool,
        shuffle: bool,
        first_batch: u64,
    ) -> Result<Loader, DataError> {
        let len = dataset.len;
        if batch_size == 0 {
            return Err(DataError::Config(
                "the batch size must be at least 1".into(),
            ));
        }
        if len == 0 {
            return Err(DataError::Config(
                "the data set to batch has no samples".into(),
            ));
        }
        if drop_last && len < batch_size {
            return Err(DataError::Config(format!(
                "the data set has {len} samples, fewer than one batch of {batch_size}: with drop_last every batch would be dropped (lower batch_size or turn drop_last off)"
            )));
        }
        let per_epoch = batches_per_epoch(len, batch_size, drop_last);
        let mut order = (u64::MAX, Vec::new());
        // Samples in memory are gathered whole: copying them costs less than skipping them.
        Loader::spawn(per_epoch, first_batch, move |epoch, index, _| {
            if order.0 != epoch {
                order = (epoch, order_of(shuffle, seed, epoch, len));
            }
            Ok(make_batch(&dataset, &order.1, batch_size, epoch, index))
        })
    }

    /// Serves the windows of a token file (`data::tokens`), from batch `first_batch` of the run.
    pub fn windows(w: super::tokens::Windows, first_batch: u64) -> Result<Loader, DataError> {
        Loader::spawn(w.per_epoch, first_batch, move |epoch, index, wanted| {
            Ok(w.batch_of(epoch, index, wanted))
        })
    }

    /// Serves the images of a folder (`data::image_folder`), decoded batch by batch, from
    /// batch `first_batch` of the run. A file that does not decode ends the batches: `next`
    /// returns `None` and [`Loader::failure`] says why.
    pub fn images(
        images: super::image_folder::Images,
        first_batch: u64,
    ) -> Result<Loader, DataError> {
        if images.per_epoch == 0 {
            return Err(DataError::Config(
                "the image folder has no training batch".into(),
            ));
        }
        let mut order = (u64::MAX, Vec::new());
        Loader::spawn(
            images.per_epoch,
            first_batch,
            move |epoch, index, wanted| {
                if order.0 != epoch {
                    order = (epoch, images.order(epoch));
                }
                images.batch_in(&order.1, epoch, index, wanted)
            },
        )
    }

    /// Reads only the `wanted` samples of every batch (this process's devices' micro-shards;
    /// see the module's rules). Refused once the first batch was asked for.
    pub fn only(&mut self, wanted: Wanted) -> Result<(), DataError> {
        if self.pending.is_none() {
            return Err(DataError::Config(
                "the loader already started: it cannot be told which samples to read now".into(),
            ));
        }
        self.wanted = Some(wanted);
        Ok(())
    }

    /// Why the batches ended, if making one failed (taken: later calls say nothing).
    pub fn failure(&mut self) -> Option<DataError> {
        self.failure.lock().ok()?.take()
    }

    /// A loader whose worker thread, once started, sends `make(epoch, index, wanted)` for
    /// every batch of the run from batch `first_batch` on, `per_epoch` batches an epoch.
    fn spawn(
        per_epoch: usize,
        first_batch: u64,
        make: impl FnMut(u64, usize, Option<&Wanted>) -> Result<Batch, DataError> + Send + 'static,
    ) -> Result<Loader, DataError> {
        Ok(Loader {
            rx: None,
            worker: None,
            batches_per_epoch: per_epoch,
            failure: Arc::new(Mutex::new(None)),
            pending: Some((first_batch, Box::new(make))),
            wanted: None,
            gate: Arc::default(),
        })
    }

    /// Starts the worker thread (at the first `next`).
    fn start(&mut self, first_batch: u64, mut make: Make) -> Result<(), DataError> {
        let (tx, rx) = sync_channel(PREFETCH);
        let failed = self.failure.clone();
        let (per_epoch, wanted) = (self.batches_per_epoch, self.wanted.clone());
        let gate = self.gate.clone();
        let worker = std::thread::Builder::new()
            .name("parallax-data".into())
            .spawn(move || {
                // Batch `first_batch` of the run (counting across epochs) comes first, so a
                // resumed run reads what an uninterrupted one would have.
                let mut epoch = first_batch / per_epoch as u64;
                let mut start = (first_batch % per_epoch as u64) as usize;
                loop {
                    for index in std::mem::take(&mut start)..per_epoch {
                        gate.wait_turn();
                        let batch = match make(epoch, index, wanted.as_ref()) {
                            Ok(b) => b,
                            Err(e) => {
                                if let Ok(mut f) = failed.lock() {
                                    *f = Some(e);
                                }
                                return; // the receiver then sees the channel closed
                            }
                        };
                        // Counted before it is sent, so that a receive never counts it first.
                        gate.set(|s| s.queued += 1);
                        if tx.send(batch).is_err() {
                            return; // the loader was dropped
                        }
                    }
                    epoch = epoch.wrapping_add(1);
                }
            })
            .map_err(|e| DataError::Config(format!("cannot start the data worker thread: {e}")))?;
        self.rx = Some(rx);
        self.worker = Some(worker);
        Ok(())
    }

    /// Marks the consumer as computing until the guard drops (see [`Computing`]).
    pub fn computing(&self) -> Computing {
        self.gate.set(|s| s.computing = true);
        Computing(self.gate.clone())
    }

    /// Batches in each epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.batches_per_epoch
    }
}

impl Iterator for Loader {
    type Item = Batch;

    /// The next batch; `None` only if the worker thread died (its panic is resumed here).
    fn next(&mut self) -> Option<Batch> {
        if let Some((first_batch, make)) = self.pending.take() {
            if let Err(e) = self.start(first_batch, make) {
                if let Ok(mut f) = self.failure.lock() {
                    *f = Some(e);
                }
                return None;
            }
        }
        match self.rx.as_ref()?.recv() {
            Ok(b) => {
                self.gate.set(|s| s.queued = s.queued.saturating_sub(1));
                Some(b)
            }
            Err(_) => {
                self.rx = None;
                if let Some(Err(panic)) = self.worker.take().map(JoinHandle::join) {
                    std::panic::resume_unwind(panic);
                }
                None
            }
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // Closing the channel makes the worker's next (or pending) send fail, and it returns.
        self.gate.set(|s| s.closed = true);
        drop(self.rx.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::err_text;
    use crate::data::{DType, TensorSpec};

    /// Sample `i` has inputs `[2i, 2i + 1]` and target `i`.
    fn numbered(len: usize) -> Arc<Dataset> {
        Arc::new(Dataset {
            inputs: Values::F32((0..2 * len).map(|v| v as f32).collect()),
            targets: Values::I32((0..len as i32).collect()),
            input: TensorSpec::new(DType::F32, vec![2]),
            target: TensorSpec::new(DType::I32, vec![]),
            len,
        })
    }

    fn ids(b: &Batch) -> Vec<usize> {
        let Values::I32(t) = &b.targets else { panic!() };
        let Values::F32(x) = &b.inputs else { panic!() };
        for (k, &i) in t.iter().enumerate() {
            assert_eq!(
                &x[2 * k..2 * k + 2],
                &[2.0 * i as f32, 2.0 * i as f32 + 1.0]
            );
        }
        t.iter().map(|&i| i as usize).collect()
    }

    #[test]
    fn loaders_with_one_seed_serve_identical_batches() {
        let ds = numbered(37);
        let a: Vec<Batch> = Loader::new(ds.clone(), 8, 5, false, 0)
            .unwrap()
            .take(15)
            .collect();
        let slow: Vec<Batch> = Loader::new(ds.clone(), 8, 5, false, 0)
            .unwrap()
            .take(15)
            .inspect(|_| std::thread::sleep(std::time::Duration::from_millis(1)))
            .collect();
        assert_eq!(a, slow);
        // Each batch is the pure function of (seed, epoch, index).
        for b in &a {
            let order = epoch_order(5, b.epoch, 37);
            assert_eq!(*b, make_batch(&ds, &order, 8, b.epoch, b.index));
        }
        let other: Vec<Batch> = Loader::new(ds.clone(), 8, 6, false, 0)
            .unwrap()
            .take(5)
            .collect();
        assert_ne!(a[..5], other[..]);
        // Starting at batch 10 (epoch 2) or 7 (inside epoch 1) continues exactly there.
        let resumed: Vec<Batch> = Loader::new(ds.clone(), 8, 5, false, 10)
            .unwrap()
            .take(5)
            .collect();
        assert_eq!(resumed[..], a[10..15]);
        let mid: Vec<Batch> = Loader::new(ds, 8, 5, false, 7).unwrap().take(8).collect();
        assert_eq!(mid[..], a[7..15]);
    }

    #[test]
    fn every_epoch_visits_every_sample_once_in_a_new_order() {
        let ds = numbered(10);
        let loader = Loader::new(ds, 4, 1, false, 0).unwrap();
        assert_eq!(loader.batches_per_epoch(), 3);
        let batches: Vec<Batch> = loader.take(9).collect();
        let sizes: Vec<usize> = batches.iter().map(|b| b.size).collect();
        assert_eq!(sizes, [4, 4, 2, 4, 4, 2, 4, 4, 2]);
        let mut orders = Vec::new();
        for (e, chunk) in batches.chunks(3).enumerate() {
            assert!(chunk
                .iter()
                .enumerate()
                .all(|(i, b)| b.epoch == e as u64 && b.index == i));
            let order: Vec<usize> = chunk.iter().flat_map(ids).collect();
            assert_eq!(order, epoch_order(1, e as u64, 10));
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, (0..10).collect::<Vec<_>>());
            orders.push(order);
        }
        assert_ne!(orders[0], orders[1]);
        assert_ne!(orders[1], orders[2]);
    }

    #[test]
    fn without_shuffle_every_epoch_reads_in_file_order() {
        let ds = numbered(10);
        let batches: Vec<Batch> = Loader::with_shuffle(ds.clone(), 4, 1, false, false, 0)
            .unwrap()
            .take(6)
            .collect();
        let seen: Vec<usize> = batches.iter().flat_map(ids).collect();
        let file: Vec<usize> = (0..10).collect();
        assert_eq!(seen[..10], file[..]);
        assert_eq!(seen[10..], file[..]); // 3 batches (4, 4, 2) per epoch
                                          // A resumed loader starts at the same batch of the same order.
        let resumed: Vec<Batch> = Loader::with_shuffle(ds, 4, 1, false, false, 4)
            .unwrap()
            .take(2)
            .collect();
        assert_eq!(resumed[..], batches[4..6]);
    }

    #[test]
    fn drop_last_drops_the_partial_batch() {
        let ds = numbered(10);
        let loader = Loader::new(ds.clone(), 4, 1, true, 0).unwrap();
        assert_eq!(loader.batches_per_epoch(), 2);
        let batches: Vec<Batch> = loader.take(4).collect();
        assert!(batches.iter().all(|b| b.size == 4));
        assert_eq!(
            batches
                .iter()
                .map(|b| (b.epoch, b.index))
                .collect::<Vec<_>>(),
            [(0, 0), (0, 1), (1, 0), (1, 1)]
        );
        let seen: Vec<usize> = batches[..2].iter().flat_map(ids).collect();
        assert_eq!(seen, epoch_order(1, 0, 10)[..8]);
        // An exact multiple loses nothing.
        let exact = Loader::new(numbered(8), 4, 1, true, 0).unwrap();
        assert_eq!(exact.batches_per_epoch(), 2);
        // Fewer samples than a batch: an error, not an endless loop.
        let e = err_text(Loader::new(ds.clone(), 11, 1, true, 0));
        assert!(e.contains("10 samples, fewer than one batch of 11"), "{e}");
        let small: Vec<Batch> = Loader::new(ds.clone(), 11, 1, false, 0)
            .unwrap()
            .take(2)
            .collect();
        assert_eq!((small[0].size, small[1].epoch), (10, 1));
        assert!(Loader::new(ds, 0, 1, false, 0).is_err());
        assert!(Loader::new(numbered(0), 1, 1, false, 0).is_err());
    }

    #[test]
    fn the_worker_starts_at_the_first_batch_and_reads_only_the_wanted_samples() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let made = Arc::new(AtomicUsize::new(0));
        let counter = made.clone();
        let make = move |epoch, index, wanted: Option<&Wanted>| {
            counter.fetch_add(1, Ordering::SeqCst);
            let mask = read_mask(wanted, 6);
            let ids: Vec<i32> = (0..6)
                .map(|i| if mask[i] { i as i32 } else { -1 })
                .collect();
            Ok(Batch {
                inputs: Values::I32(ids.clone()),
                targets: Values::I32(ids),
                size: 6,
                epoch,
                index,
                read: mask.iter().filter(|&&r| r).count(),
            })
        };
        // Never read: no batch is ever made (`eval` opens a run's data and reads none).
        let unread = Loader::spawn(3, 0, make.clone()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(unread);
        assert_eq!(made.load(Ordering::SeqCst), 0);
        let mut l = Loader::spawn(3, 0, make).unwrap();
        l.only(Arc::new(|n: usize| vec![0..1, 4..n])).unwrap();
        let b = l.next().unwrap();
        assert_eq!(b.inputs, Values::I32(vec![0, -1, -1, -1, 4, 5]));
        assert_eq!(b.read, 3);
        assert!(made.load(Ordering::SeqCst) >= 1);
        let e = l
            .only(Arc::new(|n: usize| std::iter::once(0..n).collect()))
            .unwrap_err();
        assert!(e.to_string().contains("already started"), "{e}");
        assert_eq!(read_mask(None, 2), [true, true]);
        let past: Wanted = Arc::new(|_| std::iter::once(1..9).collect());
        assert_eq!(read_mask(Some(&past), 3), [false, true, true]);
    }

    #[test]
    fn dropping_the_loader_stops_its_worker() {
        for _ in 0..20 {
            let mut l = Loader::new(numbered(100), 3, 1, false, 0).unwrap();
            assert_eq!(l.next().unwrap().size, 3);
            drop(l); // joins the worker, blocked on a full channel or not
        }
        drop(Loader::new(numbered(100), 3, 1, false, 0).unwrap()); // never read
    }

    /// While the consumer computes, a worker with a batch waiting makes no other; one whose
    /// consumer has none waiting makes it; when the step ends it fills the channel again.
    #[test]
    fn a_worker_holds_off_while_the_consumer_computes_unless_it_would_run_short() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::time::{Duration, Instant};
        let made = Arc::new(AtomicUsize::new(0));
        let counter = made.clone();
        let make = move |epoch: u64, index: usize, _: Option<&Wanted>| {
            counter.fetch_add(1, Ordering::SeqCst);
            let ids = vec![index as i32];
            Ok(Batch {
                inputs: Values::I32(ids.clone()),
                targets: Values::I32(ids),
                size: 1,
                epoch,
                index,
                read: 1,
            })
        };
        // Waits (up to a minute: a loaded machine is slow, never wrong) for `n` batches made.
        let reaches = |n: usize| {
            let start = Instant::now();
            while made.load(Ordering::SeqCst) < n && start.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(2));
            }
            made.load(Ordering::SeqCst)
        };
        // The worker reaches `n` batches and makes no more while the consumer computes.
        let holds_at = |n: usize| {
            assert_eq!(reaches(n), n);
            std::thread::sleep(Duration::from_millis(100));
            let after = made.load(Ordering::SeqCst);
            assert_eq!(after, n, "a batch made while one was waiting");
        };
        let mut l = Loader::spawn(100, 0, make).unwrap();
        let computing = l.computing();
        assert_eq!(l.next().unwrap().index, 0);
        // Batch 1 is made (none was waiting), then the worker holds off.
        holds_at(2);
        assert_eq!(l.next().unwrap().index, 1);
        holds_at(3);
        drop(computing);
        // Batch 2 waits in the channel; PREFETCH - 1 more fill it, one more waits to be sent.
        assert_eq!(reaches(3 + PREFETCH), 3 + PREFETCH);
        assert_eq!(l.next().unwrap().index, 2);
    }
}
