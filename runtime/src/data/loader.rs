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
#[path = "loader_tests.rs"]
mod tests;
