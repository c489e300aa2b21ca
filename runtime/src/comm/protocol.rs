//! The collectives every communicator runs, written once over a `Transport` (ordered,
//! non-blocking sends and receives with a deadline between two ranks): the all-reduce
//! gathers every member's partial sums and each member combines them along the fixed tree
//! itself, so every member gets the same bits; reduce, broadcast, barrier and the failure
//! flag are messages too. The in-process (`threads`) and MPI (`mpi`) communicators are
//! transports.

use super::{CommError, Communicator, Traffic};
use crate::comm::collective::{total, Partial};

/// What ranks exchange.
pub(super) enum Message {
    Values(Vec<f32>),
    Partials(Vec<Partial>),
    Flag(bool),
    Vote(bool),
    Token,
}

impl Message {
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Message::Values(_) => "send",
            Message::Partials(_) => "partial sum",
            Message::Flag(_) => "failure flag",
            Message::Vote(_) => "vote",
            Message::Token => "barrier token",
        }
    }

    /// The f32 payload's bytes (what `Traffic` counts).
    pub(super) fn bytes(&self) -> u64 {
        4 * match self {
            Message::Values(v) => v.len() as u64,
            Message::Partials(ps) => ps.iter().map(|p| p.values.len() as u64).sum(),
            Message::Flag(_) | Message::Vote(_) | Message::Token => 0,
        }
    }
}

/// The little-endian bytes of `v`: its memory as it is (a copy at memory speed; a value at
/// a time is several times slower, and messages are the gradients).
#[cfg(target_endian = "little")]
fn le_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: an f32 is 4 initialised bytes without padding, u8 has alignment 1, and the
    // length covers exactly the slice's memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// What goes over the wire: one tag byte, then the payload.
impl Message {
    pub(super) fn encode(&self) -> Vec<u8> {
        let floats = |out: &mut Vec<u8>, v: &[f32]| out.extend_from_slice(le_bytes(v));
        let mut out = Vec::new();
        match self {
            Message::Values(v) => {
                out.push(0);
                floats(&mut out, v);
            }
            Message::Partials(ps) => {
                out.push(1);
                out.extend((ps.len() as u64).to_le_bytes());
                for p in ps {
                    for n in [p.range.start, p.range.end, p.values.len()] {
                        out.extend((n as u64).to_le_bytes());
                    }
                    floats(&mut out, &p.values);
                }
            }
            Message::Flag(f) => out.extend([2, u8::from(*f)]),
            Message::Token => out.push(3),
            Message::Vote(v) => out.extend([4, u8::from(*v)]),
        }
        out
    }

    /// `None` for bytes no rank of this build sends.
    pub(super) fn decode(bytes: &[u8]) -> Option<Message> {
        let (&tag, mut rest) = bytes.split_first()?;
        let u64s = |rest: &mut &[u8]| -> Option<usize> {
            let (head, tail) = rest.split_at_checked(8)?;
            *rest = tail;
            Some(u64::from_le_bytes(head.try_into().ok()?) as usize)
        };
        let floats = |b: &[u8]| -> Vec<f32> {
            let mut v = vec![0f32; b.len() / 4];
            v.iter_mut()
                .zip(b.chunks_exact(4))
                .for_each(|(x, c)| *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            v
        };
        Some(match tag {
            0 if rest.len() % 4 == 0 => Message::Values(floats(rest)),
            1 => {
                let n = u64s(&mut rest)?;
                let mut ps = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    let (start, end, len) = (u64s(&mut rest)?, u64s(&mut rest)?, u64s(&mut rest)?);
                    let (vals, tail) = rest.split_at_checked(len.checked_mul(4)?)?;
                    rest = tail;
                    ps.push(Partial {
                        range: start..end,
                        values: floats(vals),
                    });
                }
                Message::Partials(ps)
            }
            2 if rest.len() == 1 => Message::Flag(rest[0] != 0),
            3 if rest.is_empty() => Message::Token,
            4 if rest.len() == 1 => Message::Vote(rest[0] != 0),
            _ => return None,
        })
    }
}

/// Messages between two ranks, in the order sent.
pub(super) trait Transport: Send {
    fn this_rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Queues `m` for rank `to` (`to < size`); never blocks.
    fn post(&mut self, to: usize, m: Message);
    /// The next message from `from`. With `abortable`, a failure reported by any rank ends
    /// the wait (`PeerFailed`); it gives up after the timeout (`Timeout`).
    fn take(
        &mut self,
        from: usize,
        op: &'static str,
        abortable: bool,
    ) -> Result<Message, CommError>;
    /// Puts `m` back, to be `take`n from `from` next.
    fn unget(&mut self, from: usize, m: Message);
    /// The first failure reported so far: `(rank, reason)`.
    fn failure(&mut self) -> Option<(usize, String)>;
    /// Tells every rank at once that this one failed, so that their waits end.
    fn report_failure(&mut self, reason: &str);
    fn traffic(&self) -> Traffic;
    fn traffic_mut(&mut self) -> &mut Traffic;
}

fn not_a_member<T: Transport>(t: &T, peer: usize, op: &'static str, group: &[usize]) -> CommError {
    CommError::NotAMember {
        rank: t.this_rank(),
        peer,
        op,
        group: group.to_vec(),
        size: t.world_size(),
    }
}

/// That `group` is ranks of the world holding this rank and `peer`.
fn check<T: Transport>(
    t: &T,
    group: &[usize],
    peer: usize,
    op: &'static str,
) -> Result<(), CommError> {
    if let Some(&p) = group.iter().find(|&&p| p >= t.world_size()) {
        return Err(not_a_member(t, p, op, group));
    }
    for r in [t.this_rank(), peer] {
        if !group.contains(&r) {
            return Err(not_a_member(t, r, op, group));
        }
    }
    Ok(())
}

/// The members other than this rank, in group order.
fn others<T: Transport>(t: &T, group: &[usize]) -> Vec<usize> {
    group
        .iter()
        .copied()
        .filter(|&p| p != t.this_rank())
        .collect()
}

fn send_to<T: Transport>(
    t: &mut T,
    to: usize,
    op: &'static str,
    m: Message,
) -> Result<(), CommError> {
    if to >= t.world_size() {
        return Err(not_a_member(t, to, op, &[]));
    }
    t.traffic_mut().bytes += m.bytes();
    t.post(to, m);
    Ok(())
}

fn out_of_step<T: Transport>(
    t: &T,
    peer: usize,
    op: &'static str,
    expected: &'static str,
    got: &Message,
) -> CommError {
    CommError::OutOfStep {
        rank: t.this_rank(),
        peer,
        op,
        expected,
        got: got.kind(),
    }
}

/// The next data message from `from`. A failure flag there stays queued for the failure
/// check it belongs to: `from` has left the step (failed, or out of step).
fn data<T: Transport>(t: &mut T, from: usize, op: &'static str) -> Result<Message, CommError> {
    let m = t.take(from, op, true)?;
    let Message::Flag(failed) = m else {
        return Ok(m);
    };
    t.unget(from, m);
    if !failed {
        return Err(CommError::OutOfStep {
            rank: t.this_rank(),
            peer: from,
            op,
            expected: "data",
            got: "failure flag",
        });
    }
    // The failure's own message may still be on its way (MPI delivers other tags in any
    // order): the rank that sent the flag failed.
    let (first, reason) = t
        .failure()
        .unwrap_or_else(|| (from, "its step failed".into()));
    Err(CommError::PeerFailed {
        rank: t.this_rank(),
        peer: from,
        op,
        failed: first,
        reason,
    })
}

fn take_values<T: Transport>(
    t: &mut T,
    from: usize,
    op: &'static str,
) -> Result<Vec<f32>, CommError> {
    match data(t, from, op)? {
        Message::Values(v) => Ok(v),
        m => Err(out_of_step(t, from, op, "send", &m)),
    }
}

/// This rank's partial sums and those of the members `from`, with their senders.
fn gather<T: Transport>(
    t: &mut T,
    from: &[usize],
    mine: Vec<Partial>,
    op: &'static str,
) -> Result<Vec<(usize, Partial)>, CommError> {
    let mut all: Vec<(usize, Partial)> = mine.into_iter().map(|p| (t.this_rank(), p)).collect();
    for &peer in from {
        match data(t, peer, op)? {
            Message::Partials(ps) => all.extend(ps.into_iter().map(|p| (peer, p))),
            m => return Err(out_of_step(t, peer, op, "partial sum", &m)),
        }
    }
    Ok(all)
}

fn sum<T: Transport>(
    t: &T,
    leaves: usize,
    all: Vec<(usize, Partial)>,
    op: &'static str,
) -> Result<Vec<f32>, CommError> {
    total(leaves, all).map_err(|source| CommError::Sum {
        rank: t.this_rank(),
        op,
        source,
    })
}

/// Segment `j` of `n` of `len` values (the last ones longest by at most one).
fn segment(len: usize, n: usize, j: usize) -> std::ops::Range<usize> {
    len * j / n..len * (j + 1) / n
}

impl<T: Transport> Communicator for T {
    fn rank(&self) -> usize {
        self.this_rank()
    }

    fn size(&self) -> usize {
        self.world_size()
    }

    fn all_reduce(
        &mut self,
        group: &[usize],
        leaves: usize,
        mine: Vec<Partial>,
    ) -> Result<Vec<f32>, CommError> {
        const OP: &str = "all-reduce";
        check(self, group, self.this_rank(), OP)?;
        self.traffic_mut().calls += 1;
        let others = others(self, group);
        if others.len() < 2 {
            // Two members: each sends its partials whole, as many bytes as segments would.
            for &peer in &others {
                send_to(self, peer, OP, Message::Partials(mine.clone()))?;
            }
            let all = gather(self, &others, mine, OP)?;
            return sum(self, leaves, all, OP);
        }
        // More: member `j` sums segment `j` of the values from every member's partials (each
        // element's sum is the same fixed tree, so the bits do not change), then passes its
        // segment's total to all: each member sends about twice its values, not once per peer.
        let me = self.this_rank();
        let n = group.len();
        let mut own = Vec::new();
        for (j, &peer) in group.iter().enumerate() {
            let slices = mine.iter().map(|p| Partial {
                range: p.range.clone(),
                values: p.values[segment(p.values.len(), n, j)].to_vec(),
            });
            if peer == me {
                own = slices.collect();
            } else {
                send_to(self, peer, OP, Message::Partials(slices.collect()))?;
            }
        }
        let all = gather(self, &others, own, OP)?;
        let part = sum(self, leaves, all, OP)?;
        for &peer in &others {
            send_to(self, peer, OP, Message::Values(part.clone()))?;
        }
        let mut whole = Vec::new();
        for &peer in group {
            match peer == me {
                true => whole.extend_from_slice(&part),
                false => whole.extend(take_values(self, peer, OP)?),
            }
        }
        Ok(whole)
    }

    fn reduce(
        &mut self,
        group: &[usize],
        root: usize,
        leaves: usize,
        mine: Vec<Partial>,
    ) -> Result<Option<Vec<f32>>, CommError> {
        const OP: &str = "reduce";
        check(self, group, root, OP)?;
        self.traffic_mut().calls += 1;
        if self.this_rank() != root {
            send_to(self, root, OP, Message::Partials(mine))?;
            return Ok(None);
        }
        let others = others(self, group);
        let all = gather(self, &others, mine, OP)?;
        sum(self, leaves, all, OP).map(Some)
    }

    fn broadcast(
        &mut self,
        group: &[usize],
        root: usize,
        values: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        const OP: &str = "broadcast";
        check(self, group, root, OP)?;
        self.traffic_mut().calls += 1;
        if self.this_rank() == root {
            for peer in others(self, group) {
                send_to(self, peer, OP, Message::Values(values.clone()))?;
            }
        } else {
            *values = take_values(self, root, OP)?;
        }
        Ok(())
    }

    fn send(&mut self, to: usize, values: Vec<f32>) -> Result<(), CommError> {
        self.traffic_mut().calls += 1;
        send_to(self, to, "send", Message::Values(values))
    }

    fn recv(&mut self, from: usize) -> Result<Vec<f32>, CommError> {
        if from >= self.world_size() {
            return Err(not_a_member(self, from, "recv", &[]));
        }
        take_values(self, from, "recv")
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        const OP: &str = "barrier";
        let me = self.this_rank();
        let world: Vec<usize> = (0..self.world_size()).filter(|&r| r != me).collect();
        for &peer in &world {
            send_to(self, peer, OP, Message::Token)?;
        }
        for &peer in &world {
            match data(self, peer, OP)? {
                Message::Token => {}
                m => return Err(out_of_step(self, peer, OP, "barrier token", &m)),
            }
        }
        Ok(())
    }

    fn any(&mut self, mine: bool) -> Result<bool, CommError> {
        const OP: &str = "vote";
        let me = self.this_rank();
        let world: Vec<usize> = (0..self.world_size()).filter(|&r| r != me).collect();
        for &peer in &world {
            send_to(self, peer, OP, Message::Vote(mine))?;
        }
        let mut any = mine;
        for &peer in &world {
            match data(self, peer, OP)? {
                Message::Vote(v) => any |= v,
                m => return Err(out_of_step(self, peer, OP, "vote", &m)),
            }
        }
        Ok(any)
    }

    fn any_failed(&mut self, failed: bool) -> bool {
        const OP: &str = "failure check";
        if failed {
            self.report_failure("its step failed");
        }
        let me = self.this_rank();
        let world: Vec<usize> = (0..self.world_size()).filter(|&r| r != me).collect();
        let mut any = failed;
        for &peer in &world {
            // A send fails only to a rank outside the world, which `world` has none of.
            any |= send_to(self, peer, OP, Message::Flag(failed)).is_err();
        }
        for &peer in &world {
            // Not abortable: this is where a failed rank comes to say so. Data ahead of the
            // flag was meant for a call a failure cut short (or the ranks are out of step):
            // either way the step failed.
            loop {
                match self.take(peer, OP, false) {
                    Ok(Message::Flag(f)) => {
                        any |= f;
                        break;
                    }
                    Ok(_) => any = true,
                    Err(_) => {
                        any = true;
                        break;
                    }
                }
            }
        }
        any
    }

    fn traffic(&self) -> Traffic {
        Transport::traffic(self)
    }
}
