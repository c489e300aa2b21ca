use super::*;
use crate::comm::check::{self, Fault};
use crate::comm::Communicator;
use std::net::TcpListener;

static GO: AtomicUsize = AtomicUsize::new(0);

/// `f` on each rank of a world of `n` over TCP on this machine, with what each returned.
fn on_ranks<T: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(Result<TcpComm, TcpError>) -> T + Sync,
) -> Vec<T> {
    // Bound here, before any rank dials: no other test can take the port meanwhile.
    let listener = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                let l = if r == 0 { listener.take() } else { None };
                s.spawn(move || {
                    f(match l {
                        Some(l) => TcpComm::connect_listening(l, n, "test", timeout, &GO),
                        None => TcpComm::connect(r, n, "127.0.0.1", port, "test", timeout, &GO),
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The communicators' self-check (the tree all-reduce with one device's bits, reduce,
/// broadcast, a ring of sends, a barrier, the failure flag) on 1 to 4 ranks over TCP.
#[test]
fn the_self_check_passes_over_tcp() {
    for n in 1..=4 {
        let out = on_ranks(n, Duration::from_secs(20), |c| {
            let mut c = c.unwrap();
            check::run(&mut c, None).map_err(|e| e.to_string())
        });
        for (r, o) in out.into_iter().enumerate() {
            let lines = o.unwrap_or_else(|e| panic!("{n} ranks, rank {r}: {e}"));
            assert!(!lines.is_empty());
        }
    }
}

/// A rank whose check fails tells the others, who stop at once naming it.
#[test]
fn a_failing_rank_ends_the_others_waits() {
    let started = Instant::now();
    let out = on_ranks(3, Duration::from_secs(30), |c| {
        let mut c = c.unwrap();
        check::run(&mut c, Some(Fault::Fail(1))).map_err(|e| e.to_string())
    });
    assert!(started.elapsed() < Duration::from_secs(20));
    let e = out[1].as_ref().unwrap_err();
    assert!(e.contains("injected"), "{e}");
    for r in [0, 2] {
        let e = out[r].as_ref().unwrap_err();
        assert!(e.contains("rank 1 failed"), "rank {r}: {e}");
    }
}

/// A rank that goes away (its communicator dropped, as when its process dies) ends every
/// wait on it at once, naming it; a rank relayed by rank 0 too.
#[test]
fn a_closed_connection_ends_waits_on_its_rank() {
    let started = Instant::now();
    let out = on_ranks(3, Duration::from_secs(60), |c| {
        let mut c = c.unwrap();
        match c.rank() {
            2 => {
                drop(c);
                Ok(Vec::new())
            }
            _ => c.recv(2).map_err(|e| e.to_string()),
        }
    });
    assert!(started.elapsed() < Duration::from_secs(20));
    for r in [0, 1] {
        let e = out[r].as_ref().unwrap_err();
        assert!(
            e.contains("rank 2") && e.contains("connection closed"),
            "rank {r}: {e}"
        );
    }
}

/// Sends never wait for the receiver: every rank sends to every other before receiving.
#[test]
fn messages_arrive_in_order_between_any_two_ranks() {
    let out = on_ranks(3, Duration::from_secs(20), |c| {
        let mut c = c.unwrap();
        let me = c.rank();
        for k in 0..20 {
            for to in (0..3).filter(|&t| t != me) {
                c.send(to, [me as f32, k as f32].repeat(1000)).unwrap();
            }
        }
        let mut got = Vec::new();
        for from in (0..3).filter(|&f| f != me) {
            for k in 0..20 {
                let v = c.recv(from).unwrap();
                assert_eq!((v[0], v[1], v.len()), (from as f32, k as f32, 2000));
                got.push(from);
            }
        }
        c.barrier().unwrap();
        got.len()
    });
    assert_eq!(out, vec![40, 40, 40]);
}

/// A listener on a port of its own (bound before anyone dials: no other test can take it).
fn listening() -> (TcpListener, u16) {
    let l = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

#[test]
fn wrong_joiners_are_refused_and_missing_ones_named() {
    // A rank of another build.
    let (l, port) = listening();
    let timeout = Duration::from_secs(3);
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| TcpComm::connect_listening(l, 2, "v1", timeout, &GO));
        let b = s.spawn(|| TcpComm::connect(1, 2, "127.0.0.1", port, "v2", timeout, &GO));
        (a.join().unwrap(), b.join().unwrap())
    });
    let e = b.err().unwrap().to_string();
    assert!(e.contains("refused by rank 0") && e.contains("(v2)"), "{e}");
    let e = a.err().unwrap().to_string();
    assert!(e.contains("rank(s) [1] of 2 never connected"), "{e}");
    // A rank 0 that never answers (its port held by a listener that accepts no one).
    let (_held, port) = listening();
    let wait = Duration::from_millis(500);
    let e = TcpComm::connect(1, 2, "127.0.0.1", port, "v1", wait, &GO)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("rank 1: rank 0 at 127.0.0.1:"), "{e}");
}

/// A signal while the ranks meet (rank 0 waiting for the others, another rank for rank 0)
/// ends the wait at once, not at the timeout.
#[test]
fn a_signal_ends_the_meeting() {
    for rank in [0, 1] {
        let (l, port) = listening();
        let stop = AtomicUsize::new(0);
        let started = Instant::now();
        let wait = Duration::from_secs(60);
        let e = std::thread::scope(|s| {
            let h = s.spawn(|| match rank {
                0 => TcpComm::connect_listening(l, 2, "v1", wait, &stop),
                // `l` stays bound and answers no one: rank 1 waits for rank 0.
                _ => TcpComm::connect(rank, 2, "127.0.0.1", port, "v1", wait, &stop),
            });
            std::thread::sleep(Duration::from_millis(300));
            stop.store(15, std::sync::atomic::Ordering::SeqCst);
            h.join().unwrap()
        });
        let e = e.err().unwrap().to_string();
        assert!(e.contains("stopped by a signal"), "rank {rank}: {e}");
        assert!(started.elapsed() < Duration::from_secs(5), "rank {rank}");
    }
}
