//! How the ranks of a TCP job meet (`super`): rank 0 accepts a connection from every other
//! rank, each saying its rank, the world size and the build, and answers once all have come;
//! the others connect, again and again until the deadline (rank 0 may start later). Every
//! wait has a deadline and sees a signal.

use super::{TcpError, HELLO, RETRY};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Rank 0: a connection from every other rank, each having said its rank, the world size
/// and the token. A wrong one is told why and dropped.
pub(super) fn accept_all(
    listener: &TcpListener,
    size: usize,
    token: &str,
    deadline: Instant,
    timeout: Duration,
    stop: &AtomicUsize,
) -> Result<Vec<Option<TcpStream>>, TcpError> {
    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    let io = |what| {
        move |source| TcpError::Io {
            rank: 0,
            what,
            source,
        }
    };
    listener.set_nonblocking(true).map_err(io("listening"))?;
    while streams.iter().skip(1).any(Option::is_none) {
        if stop.load(Ordering::SeqCst) != 0 {
            return Err(TcpError::Interrupted { rank: 0 });
        }
        if Instant::now() >= deadline {
            let missing = (1..size).filter(|&r| streams[r].is_none()).collect();
            return Err(TcpError::Missing {
                missing,
                size,
                waited: timeout,
            });
        }
        let mut stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(io("accepting")(e)),
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let Some((r, n, t)) = read_hello(&mut stream) else {
            // Not a rank of ours (a port scan, a stray client): ignored.
            continue;
        };
        let why = if n != size {
            Some(format!(
                "it says the world has {n} rank(s), rank 0 says {size}"
            ))
        } else if r == 0 || r >= size {
            Some(format!(
                "rank {r} is not a rank of a world of {size} other than rank 0"
            ))
        } else if streams[r].is_some() {
            Some(format!(
                "rank {r} connected twice (two processes with one RANK?)"
            ))
        } else if t != token {
            Some(format!("its build ({t}) is not rank 0's ({token})"))
        } else {
            None
        };
        match why {
            Some(why) => {
                let _ = write_refusal(&mut stream, &why);
            }
            None => {
                let _ = stream.set_read_timeout(None);
                streams[r] = Some(stream);
            }
        }
    }
    Ok(streams)
}

fn read_hello(s: &mut TcpStream) -> Option<(usize, usize, String)> {
    let mut head = [0u8; 8 + 4 + 4 + 4];
    s.read_exact(&mut head).ok()?;
    if &head[..8] != HELLO {
        return None;
    }
    let word = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().unwrap_or([0; 4]));
    let (r, n, len) = (word(8) as usize, word(12) as usize, word(16) as usize);
    if len > 4096 {
        return None;
    }
    let mut t = vec![0u8; len];
    s.read_exact(&mut t).ok()?;
    Some((r, n, String::from_utf8_lossy(&t).into_owned()))
}

/// A refusal: 0, then the reason's length and text.
fn write_refusal(s: &mut TcpStream, why: &str) -> std::io::Result<()> {
    let mut out = vec![0u8];
    out.extend((why.len() as u32).to_le_bytes());
    out.extend(why.as_bytes());
    s.write_all(&out)
}

/// Another rank: connects to rank 0 (again and again until the deadline: rank 0 may start
/// later), says hello, and waits for every rank to have come.
#[allow(clippy::too_many_arguments)]
pub(super) fn dial(
    rank: usize,
    size: usize,
    host: &str,
    port: u16,
    token: &str,
    deadline: Instant,
    timeout: Duration,
    stop: &AtomicUsize,
) -> Result<TcpStream, TcpError> {
    let addr = format!("{host}:{port}");
    let mut last = String::from("no attempt");
    let unreachable = |last: String| TcpError::Unreachable {
        rank,
        addr: addr.clone(),
        waited: timeout,
        last,
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if stop.load(Ordering::SeqCst) != 0 {
            return Err(TcpError::Interrupted { rank });
        }
        if left.is_zero() {
            return Err(unreachable(last));
        }
        let target = match addr.to_socket_addrs().map(|mut a| a.next()) {
            Ok(Some(a)) => a,
            Ok(None) => return Err(unreachable(format!("{host} has no address"))),
            Err(e) => {
                last = e.to_string();
                std::thread::sleep(RETRY);
                continue;
            }
        };
        let mut stream = match TcpStream::connect_timeout(&target, left.min(Duration::from_secs(2)))
        {
            Ok(s) => s,
            Err(e) => {
                last = e.to_string();
                std::thread::sleep(RETRY);
                continue;
            }
        };
        let mut hello = HELLO.to_vec();
        for n in [rank, size, token.len()] {
            hello.extend((n as u32).to_le_bytes());
        }
        hello.extend(token.as_bytes());
        if let Err(e) = stream.write_all(&hello) {
            last = e.to_string();
            std::thread::sleep(RETRY);
            continue;
        }
        // Rank 0 answers once every rank has come: wait for it until the deadline (in short
        // reads, so that a signal is seen).
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        let mut answer = [0u8; 1];
        let got = loop {
            match stream.read(&mut answer) {
                Ok(0) => break Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(_) => break Ok(()),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    if stop.load(Ordering::SeqCst) != 0 {
                        return Err(TcpError::Interrupted { rank });
                    }
                    if Instant::now() >= deadline {
                        break Err(e);
                    }
                }
                Err(e) => break Err(e),
            }
        };
        match got {
            Ok(()) if answer[0] == 1 => {
                let _ = stream.set_read_timeout(None);
                return Ok(stream);
            }
            Ok(()) if answer[0] != 0 => {
                return Err(TcpError::Refused {
                    rank,
                    why: format!("{addr} answered as no rank 0 of Parallax does (is MASTER_PORT another program's?)"),
                })
            }
            Ok(()) => {
                let mut len = [0u8; 4];
                let mut why = String::from("no reason given");
                if stream.read_exact(&mut len).is_ok() {
                    let mut t = vec![0u8; (u32::from_le_bytes(len) as usize).min(4096)];
                    if stream.read_exact(&mut t).is_ok() {
                        why = String::from_utf8_lossy(&t).into_owned();
                    }
                }
                return Err(TcpError::Refused { rank, why });
            }
            Err(e) => {
                return Err(unreachable(format!(
                    "connected, but rank 0 did not start the job: {e}"
                )))
            }
        }
    }
}
