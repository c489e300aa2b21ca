//! The id exchange over rank threads (`comm::threads`) and over TCP on 127.0.0.1, with
//! missing, mismatched and duplicate ranks: errors within the test's short deadlines, never
//! a hang.

use super::*;
use crate::comm::threads::Threads;
use crate::comm::world::Launcher;

fn id(seed: u8) -> [u8; ID_BYTES] {
    std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(seed))
}

/// `f(rank, comm)` on each rank thread of a world of `n`.
fn on_ranks<T: Send>(n: usize, f: impl Fn(usize, &mut dyn Communicator) -> T + Sync) -> Vec<T> {
    let world = Threads::new(n, Duration::from_secs(5));
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = world
            .comms()
            .into_iter()
            .enumerate()
            .map(|(r, mut c)| s.spawn(move || f(r, &mut c)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn every_rank_gets_the_roots_id_over_a_communicator() {
    for n in 1..=4 {
        for root in [0, n - 1] {
            // Every byte value, so nothing is lost on the way.
            let want: [u8; ID_BYTES] = std::array::from_fn(|i| (255 - 2 * i) as u8);
            let got = on_ranks(n, |r, c| share_id(c, root, (r == root).then_some(want)));
            for (r, g) in got.into_iter().enumerate() {
                assert_eq!(g.unwrap(), want, "{n} ranks, root {root}, rank {r}");
            }
        }
    }
}

#[test]
fn a_root_without_an_id_fails_every_rank_at_once() {
    let t = Instant::now();
    let got = on_ranks(3, |_, c| share_id(c, 1, None));
    assert!(matches!(got[1], Err(RendezvousError::NoId { rank: 1 })));
    for r in [0, 2] {
        let e = got[r].as_ref().unwrap_err().to_string();
        assert!(e.contains("0 words from rank 1"), "{e}");
    }
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "they waited out the timeout"
    );
    let got = on_ranks(2, |_, c| share_id(c, 2, Some(id(0))));
    assert!(got
        .iter()
        .all(|r| matches!(r, Err(RendezvousError::NoRoot { .. }))));
}

fn listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

/// Rank 0 serving `world` with `token`, and a client per `(rank, token)`: every side's result.
#[allow(clippy::type_complexity)]
fn tcp_world(
    world: usize,
    clients: &[(usize, &str)],
    server_wait: Duration,
) -> (
    Result<(), RendezvousError>,
    Vec<Result<[u8; ID_BYTES], RendezvousError>>,
) {
    let (l, port) = listener();
    std::thread::scope(|s| {
        let server = s.spawn(|| serve_id(l, world, "job-a", id(9), server_wait));
        let clients: Vec<_> = clients
            .iter()
            .map(|&(rank, token)| {
                // The clients outwait rank 0, so its answer (or refusal) is what they report.
                s.spawn(move || fetch_id("127.0.0.1", port, rank, world, token, server_wait * 3))
            })
            .collect();
        (
            server.join().unwrap(),
            clients.into_iter().map(|c| c.join().unwrap()).collect(),
        )
    })
}

#[test]
fn every_rank_gets_rank_0s_bytes_over_tcp() {
    let clients: Vec<(usize, &str)> = (1..5).map(|r| (r, "job-a")).collect();
    let (server, got) = tcp_world(5, &clients, Duration::from_secs(10));
    server.unwrap();
    for (r, g) in got.into_iter().enumerate() {
        assert_eq!(g.unwrap(), id(9), "rank {}", r + 1);
    }
}

#[test]
fn rank_0_names_the_ranks_that_never_came() {
    let t = Instant::now();
    let (server, got) = tcp_world(4, &[(2, "job-a")], Duration::from_millis(600));
    let e = server.unwrap_err();
    assert!(
        matches!(&e, RendezvousError::Missing { missing, .. } if *missing == [1, 3]),
        "{e}"
    );
    let s = e.to_string();
    assert!(
        s.contains("rank(s) [1, 3] never came") && s.contains("127.0.0.1"),
        "{s}"
    );
    // The rank that came is told why, rather than waiting out its own deadline.
    let c = got[0].as_ref().unwrap_err().to_string();
    assert!(
        c.contains("refused rank 2") && c.contains("[1, 3] never came"),
        "{c}"
    );
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

#[test]
fn a_wrong_job_token_is_refused_on_both_sides() {
    let (server, got) = tcp_world(3, &[(1, "job-a"), (2, "job-b")], Duration::from_secs(1));
    let e = server.unwrap_err().to_string();
    assert!(e.contains("\"job-b\"") && e.contains("\"job-a\""), "{e}");
    let c = got[1].as_ref().unwrap_err().to_string();
    assert!(
        c.contains("refused rank 2") && c.contains("two jobs"),
        "{c}"
    );
    // The rank of the right job that was waiting hears of the failure too.
    assert!(got[0].is_err());
}

#[test]
fn a_duplicate_rank_is_refused() {
    let (server, got) = tcp_world(3, &[(1, "job-a"), (1, "job-a")], Duration::from_secs(1));
    let e = server.unwrap_err().to_string();
    assert!(
        e.contains("claims rank 1") && e.contains("duplicate"),
        "{e}"
    );
    for g in got {
        let c = g.unwrap_err().to_string();
        assert!(c.contains("duplicate"), "{c}");
    }
}

#[test]
fn a_rank_outside_the_world_or_of_another_size_is_refused() {
    let (server, _) = tcp_world(3, &[(3, "job-a")], Duration::from_secs(5));
    assert!(server
        .unwrap_err()
        .to_string()
        .contains("not one of ranks 1..3"));
    let (l, port) = listener();
    let r = std::thread::scope(|s| {
        let server = s.spawn(|| serve_id(l, 3, "job-a", id(1), Duration::from_secs(5)));
        let c = fetch_id("127.0.0.1", port, 1, 4, "job-a", Duration::from_secs(5));
        (server.join().unwrap(), c)
    });
    assert!(r
        .0
        .unwrap_err()
        .to_string()
        .contains("a world of 4, rank 0 a world of 3"));
    assert!(matches!(r.1, Err(RendezvousError::Refused { rank: 1, .. })));
}

#[test]
fn a_rank_that_cannot_reach_rank_0_names_the_address() {
    // A port nobody listens on: bound, then released.
    let port = listener().1;
    let t = Instant::now();
    let e = fetch_id("127.0.0.1", port, 1, 2, "job-a", Duration::from_millis(300)).unwrap_err();
    assert!(matches!(e, RendezvousError::Unreachable { rank: 1, .. }));
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[test]
fn a_stray_connection_does_not_stop_the_rendezvous() {
    let (l, port) = listener();
    let got = std::thread::scope(|s| {
        let server = s.spawn(|| serve_id(l, 2, "job-a", id(4), Duration::from_secs(10)));
        // Says nothing sensible and goes away.
        let mut stray = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stray.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        drop(stray);
        let c = fetch_id("127.0.0.1", port, 1, 2, "job-a", Duration::from_secs(10));
        server.join().unwrap().unwrap();
        c
    });
    assert_eq!(got.unwrap(), id(4));
}

#[test]
fn the_torchrun_path_reads_the_world() {
    let mut w = World {
        launcher: Launcher::Torchrun,
        rank: 0,
        size: 1,
        local_rank: 0,
        master: None,
    };
    assert_eq!(
        share_id_tcp(&w, "t", Some(id(2)), Duration::ZERO).unwrap(),
        id(2)
    );
    w.size = 2;
    assert!(matches!(
        share_id_tcp(&w, "t", Some(id(2)), Duration::ZERO),
        Err(RendezvousError::NoMaster { size: 2 })
    ));
    // Rank 0 on a port it can bind, rank 1 reaching it by name.
    let port = listener().1;
    w.master = Some(("localhost".into(), port));
    let rank1 = World {
        rank: 1,
        ..w.clone()
    };
    let (a, b) = std::thread::scope(|s| {
        let zero = s.spawn(|| share_id_tcp(&w, "t", Some(id(5)), Duration::from_secs(10)));
        let one = share_id_tcp(&rank1, "t", None, Duration::from_secs(10));
        (zero.join().unwrap(), one)
    });
    assert_eq!(a.unwrap(), id(5));
    assert_eq!(b.unwrap(), id(5));
}
