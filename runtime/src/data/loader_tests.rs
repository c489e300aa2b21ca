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
