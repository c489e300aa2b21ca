use super::*;
use crate::comm::collective::{partials, tree_sum, CollectiveError, Partial};
use crate::comm::Communicator;
use parallax_compiler::shards::assign;
use std::time::Instant;

fn leaf(i: usize) -> Vec<f32> {
    // Values of very different magnitudes, so the order of the sum shows in the bits.
    (0..5)
        .map(|j| ((i * 7 + j) as f32).sin() * 10f32.powi((i % 7) as i32 - 3))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Runs `f` on every rank of a world of `n`, one thread each, and returns what each gave.
fn ranks<T: Send>(n: usize, timeout: Duration, f: impl Fn(&mut ThreadComm) -> T + Sync) -> Vec<T> {
    let world = Threads::new(n, timeout);
    let mut comms = world.comms();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter_mut()
            .map(|c| {
                let f = &f;
                s.spawn(move || {
                    let _guard = c.panic_guard();
                    f(c)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

const SECONDS: Duration = Duration::from_secs(5);

#[test]
fn the_total_has_the_same_bits_for_every_rank_count() {
    for leaves in 1..=13 {
        let reference = bits(&tree_sum(0, leaves, &leaf));
        for n in 1..=leaves + 2 {
            let owned = assign(leaves, n);
            let group: Vec<usize> = (0..n).collect();
            let totals = ranks(n, SECONDS, |c| {
                let mine = partials(leaves, owned[c.rank()].clone(), &leaf);
                c.all_reduce(&group, leaves, mine).map(|t| bits(&t))
            });
            for (r, t) in totals.into_iter().enumerate() {
                assert_eq!(t.unwrap(), reference, "{leaves} shards on {n}, rank {r}");
            }
        }
    }
}

#[test]
fn a_reduce_reaches_its_root_only_and_groups_are_separate() {
    // Two groups of two in a world of four: {0, 2} and {1, 3}, each reducing to its second.
    let out = ranks(4, SECONDS, |c| {
        let r = c.rank();
        let group = [r % 2, r % 2 + 2];
        let mine = partials(4, (r / 2) * 2..(r / 2) * 2 + 2, &|i| {
            vec![(i + 10 * (r % 2)) as f32]
        });
        c.reduce(&group, group[1], 4, mine).unwrap()
    });
    assert_eq!(out[0], None);
    assert_eq!(out[1], None);
    assert_eq!(out[2], Some(vec![6.0]));
    assert_eq!(out[3], Some(vec![46.0]));
}

#[test]
fn sends_are_buffered_and_arrive_in_order() {
    let out = ranks(3, SECONDS, |c| match c.rank() {
        0 => {
            // Never blocks: rank 2 receives only after a broadcast rank 0 has no part in.
            for i in 0..3 {
                c.send(2, vec![i as f32]).unwrap();
            }
            c.barrier().unwrap();
            Vec::new()
        }
        1 => {
            let mut v = vec![7.0, 8.0];
            c.broadcast(&[1, 2], 1, &mut v).unwrap();
            c.barrier().unwrap();
            v
        }
        _ => {
            let mut v = Vec::new();
            c.broadcast(&[1, 2], 1, &mut v).unwrap();
            let mut got: Vec<f32> = (0..3).flat_map(|_| c.recv(0).unwrap()).collect();
            got.extend(v);
            c.barrier().unwrap();
            got
        }
    });
    assert_eq!(out[2], [0.0, 1.0, 2.0, 7.0, 8.0]);
    assert_eq!(out[1], [7.0, 8.0]);
}

#[test]
fn every_rank_hears_of_a_failure() {
    for failing in [None, Some(1)] {
        let out = ranks(3, SECONDS, |c| c.any_failed(Some(c.rank()) == failing));
        assert_eq!(out, vec![failing.is_some(); 3]);
    }
}

#[test]
fn a_failed_rank_ends_its_peers_waits_at_once() {
    let start = Instant::now();
    let out = ranks(3, Duration::from_secs(60), |c| {
        if c.rank() == 2 {
            // Fails before its all-reduce and says so.
            return Err(c.any_failed(true));
        }
        let e = c.all_reduce(&[0, 1, 2], 3, partials(3, c.rank()..c.rank() + 1, &leaf));
        let failed = c.any_failed(e.is_err());
        Ok((e.map(drop), failed))
    });
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(matches!(out[2], Err(true)));
    for (r, o) in out.iter().enumerate().take(2) {
        // It gave up on rank 2, or on the other rank (which had given up first).
        let Ok((Err(CommError::PeerFailed { failed, op, .. }), true)) = o else {
            panic!("rank {r}: {o:?}");
        };
        assert_eq!((*failed, *op), (2, "all-reduce"));
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_it() {
    let wait = Duration::from_millis(200);
    let start = Instant::now();
    let out = ranks(2, wait, |c| match c.rank() {
        0 => Some(c.recv(1)),
        _ => None,
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    let Some(Err(CommError::Timeout { rank, peer, op, .. })) = &out[0] else {
        panic!("{:?}", out[0]);
    };
    assert_eq!((*rank, *peer, *op), (0, 1, "recv"));
    let message = out[0].as_ref().unwrap().as_ref().unwrap_err().to_string();
    assert!(
        message.contains("rank 1") && message.contains("recv"),
        "{message}"
    );
}

#[test]
fn a_rank_that_panics_is_not_waited_for() {
    let world = Threads::new(2, Duration::from_secs(60));
    let mut comms = world.comms();
    let start = Instant::now();
    let (waiter, panicked) = std::thread::scope(|s| {
        let mut it = comms.iter_mut();
        let (a, b) = (it.next().unwrap(), it.next().unwrap());
        let waiter = s.spawn(move || {
            let _g = a.panic_guard();
            (a.barrier(), a.any_failed(false))
        });
        let panicked = s.spawn(move || {
            let _g = b.panic_guard();
            panic!("rank 1 breaks");
        });
        (waiter.join(), panicked.join())
    });
    assert!(panicked.is_err());
    let (barrier, any) = waiter.unwrap();
    assert!(matches!(
        barrier,
        Err(CommError::PeerFailed { peer: 1, .. })
    ));
    assert!(any);
    assert!(start.elapsed() < Duration::from_secs(10));
    // Once reset, the same world runs again.
    world.reset();
    let again = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter_mut()
            .map(|c| s.spawn(move || c.any_failed(false)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(again, [false, false]);
}

#[test]
fn missing_or_misaligned_partials_are_refused_by_every_member() {
    // Rank 1 sends nothing: shards 4..8 are missing.
    let out = ranks(2, SECONDS, |c| {
        let mine = if c.rank() == 0 {
            partials(8, 0..4, &leaf)
        } else {
            Vec::new()
        };
        c.all_reduce(&[0, 1], 8, mine)
    });
    for r in &out {
        assert!(matches!(
            r,
            Err(CommError::Sum {
                source: CollectiveError::Missing(_),
                ..
            })
        ));
    }
    // A partial over shards 1..3 is not a subtree of the tree over 4.
    let out = ranks(2, SECONDS, |c| {
        let range = if c.rank() == 0 { 1..3 } else { 0..1 };
        c.all_reduce(
            &[0, 1],
            4,
            vec![Partial {
                range,
                values: leaf(0),
            }],
        )
    });
    for r in &out {
        assert!(matches!(
            r,
            Err(CommError::Sum {
                source: CollectiveError::NotASubtree { device: 0, .. },
                ..
            })
        ));
    }
}

#[test]
fn ranks_out_of_step_are_told_so() {
    let out = ranks(2, SECONDS, |c| match c.rank() {
        0 => c.send(1, vec![1.0]).map(|_| Vec::new()),
        _ => c.all_reduce(&[0, 1], 2, partials(2, 1..2, &leaf)),
    });
    assert!(matches!(
        out[1],
        Err(CommError::OutOfStep {
            peer: 0,
            expected: "partial sum",
            got: "send",
            ..
        })
    ));
    // And a group this rank is not in is refused.
    let out = ranks(1, SECONDS, |c| c.all_reduce(&[1], 1, Vec::new()));
    assert!(matches!(out[0], Err(CommError::NotAMember { .. })));
}
