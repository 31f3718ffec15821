//! How the survivors of a communicator between processes find each other again
//! (`Communicator::shrink`), without the store they first met through (its server may be the
//! rank that was lost).
//!
//! Every rank keeps listening, for its communicator's life, on the port it published when it
//! joined, and every rank knows every other's. A shrink:
//!
//! 1. **Probe.** Each rank connects to every other rank's port and proves the job's token
//!    (purpose `Shrink`, its rank and the communicator's generation in the proof), all peers at
//!    once, while it accepts the others' connections. A peer whose process is gone refuses at
//!    once (its port is closed); a live one answers when it reaches its own shrink. A peer is
//!    alive when both connections between the two have proved the token by the deadline.
//! 2. **Agree.** Over one connection per pair (the one the higher rank made), each rank sends
//!    the set it found alive to every rank in it, and reads theirs. The new communicator is
//!    made only when every rank of the set sent the same set: a rank that saw another set (a
//!    rank lost during the shrink, or one too late for the others' deadline) fails with an
//!    error naming both views, and closes its connections, so the others fail too rather than
//!    wait. A rank waits for its peers' sets up to two timeouts after its own probing: a peer
//!    may still be probing, until its own deadline, a rank that it finds silent and this rank
//!    found gone at once.
//! 3. The set's ranks, in parent-rank order, are the new ranks; the connections of step 2 are
//!    the new communicator's (shared memory is set up over them as when joining).
//!
//! The failure model is crash-stop: a rank that is alive enters its shrink within the timeout;
//! one that does not is left out by the others. A rank that is not known to be gone (its port
//! refused) but did not answer is silent: stuck, shrunk already without this rank, or out of
//! reach (its host down or cut off). The survivors must outnumber the silent ranks, else the
//! shrink fails, so that a rank that came too late, or two halves cut apart, never go on beside
//! each other. Losing a whole host is therefore survived only when the other hosts hold more
//! ranks than it did. A shrink with silent ranks takes the probing's timeout, then at most as
//! long again to agree and set up the new links; a survivor that stops answering during the
//! agreement is given up after two timeouts.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::cluster::auth::{self as wire, Purpose};
use crate::error::{list, Error, Result};

/// Parent ranks are below this (`MAX_WORLD_SIZE`); a shrink's proof carries
/// `generation * RANKS + rank`.
const RANKS: u32 = crate::cluster::MAX_WORLD_SIZE as u32;

/// The ranks that agreed and the connections to them.
pub(crate) struct Survivors {
    /// Their parent ranks, ascending: a member's index is its new rank.
    pub members: Vec<usize>,
    /// By new rank: the connection to that member (`None` for this rank), blocking, without
    /// timeouts.
    pub socks: Vec<Option<TcpStream>>,
}

/// What one rank of a shrink knows: who it is, whom to reach, and how to prove it.
pub(crate) struct Probe<'a> {
    pub rank: usize,
    /// Every parent rank's listening address (`host:port`).
    pub addrs: &'a [String],
    pub token: &'a str,
    /// Shrinks that made the communicator being shrunk (0 for one made by joining; the same
    /// on every rank): a late rank still shrinking a parent is no rank of its child.
    pub generation: u32,
    /// The end of the probing: a peer silent until then is left out.
    pub deadline: Instant,
    /// The bound of the new links' setup after the probing, and half that of the wait for a
    /// peer's set (a peer may still be probing for up to one of them, see the module docs).
    pub timeout: Duration,
}

/// Find the live ranks of `probe`'s world and agree with them on who they are (see the module
/// docs). `listener` is this rank's own, on `probe.addrs[probe.rank]`.
pub(crate) fn survivors(probe: &Probe<'_>, listener: TcpListener) -> Result<Survivors> {
    let (rank, world) = (probe.rank, probe.addrs.len());
    let id = |r: usize| probe.generation.wrapping_mul(RANKS).wrapping_add(r as u32);
    // Outgoing connections, one thread per peer: a peer that is alive but slow must not hold
    // up the probes of the others.
    type Probed = Option<std::result::Result<TcpStream, (Fate, String)>>;
    let outgoing: Vec<Mutex<Probed>> = (0..world).map(|_| Mutex::new(None)).collect();
    let mut incoming: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    std::thread::scope(|s| -> Result<()> {
        for (r, slot) in outgoing.iter().enumerate().filter(|(r, _)| *r != rank) {
            let addr = &probe.addrs[r];
            std::thread::Builder::new()
                .name("tutti-shrink".into())
                .stack_size(64 << 10)
                .spawn_scoped(s, move || {
                    *slot.lock() = Some(probe_peer(addr, probe.token, id(rank), probe.deadline));
                })
                .map_err(|e| Error::io("starting a thread for the shrink", e))?;
        }
        let mut acceptor =
            wire::Acceptor::new(listener, probe.token, Purpose::Shrink, "shrink")?.expecting(world);
        // Accept until every peer either connected or is known to be gone.
        loop {
            let waiting = (0..world).any(|r| {
                r != rank
                    && incoming[r].is_none()
                    && !matches!(*outgoing[r].lock(), Some(Err((Fate::Gone, _))))
            });
            if !waiting || Instant::now() >= probe.deadline {
                break;
            }
            let slice = (Instant::now() + Duration::from_millis(20)).min(probe.deadline);
            let Some((sock, who)) = acceptor.next(slice)? else {
                continue;
            };
            let (generation, r) = (who / RANKS, (who % RANKS) as usize);
            if generation != probe.generation || r >= world || r == rank || incoming[r].is_some() {
                wire::log_rejected(
                    "shrink",
                    &Error::config(format!(
                        "a connection claiming rank {r} of a communicator of generation \
                         {generation}, where rank {rank} shrinks one of generation {} of {world} \
                         ranks (or a second connection of that rank)",
                        probe.generation
                    )),
                );
                continue;
            }
            incoming[r] = Some(sock);
        }
        Ok(())
    })?;
    let mut outgoing: Vec<Probed> = outgoing.into_iter().map(Mutex::into_inner).collect();
    let alive: Vec<bool> = (0..world)
        .map(|r| r == rank || (incoming[r].is_some() && matches!(outgoing[r], Some(Ok(_)))))
        .collect();
    let members: Vec<usize> = (0..world).filter(|&r| alive[r]).collect();
    // Ranks whose process runs but that did not take part: stuck, or already shrunk without
    // this rank. The survivors must outnumber them, so that two sets of ranks that could not
    // reach each other in time never both go on.
    let silent: Vec<usize> = (0..world)
        .filter(|&r| {
            !alive[r]
                && (incoming[r].is_some() || !matches!(outgoing[r], Some(Err((Fate::Gone, _)))))
        })
        .collect();
    if members.len() <= silent.len() {
        return Err(Error::config(format!(
            "shrink: rank {rank} found {} running but silent within the timeout and only \
             {} taking part: the silent ranks are stuck or shrank already without this \
             rank, and too few answered to go on without them",
            list(&silent),
            list(&members)
        )));
    }
    // One connection per pair: the one the higher rank made.
    let mut links: Vec<Option<TcpStream>> = (0..world)
        .map(|r| match r {
            _ if !alive[r] || r == rank => None,
            _ if r < rank => outgoing[r].take().and_then(|o| o.ok()),
            _ => incoming[r].take(),
        })
        .collect();
    let mine = bitmap(&alive);
    let gone: Vec<usize> = (0..world)
        .filter(|&r| !alive[r] && !silent.contains(&r))
        .collect();
    let none_or = |v: &[usize]| {
        if v.is_empty() {
            "no rank".into()
        } else {
            list(v)
        }
    };
    log::info!(
        "shrink: rank {rank} finds {} alive, {} gone and {} silent; agreeing with them",
        list(&members),
        none_or(&gone),
        none_or(&silent)
    );
    for &r in &silent {
        let why = match &outgoing[r] {
            Some(Err((_, why))) => why.as_str(),
            _ => "it did not connect to this rank",
        };
        log::warn!("shrink: rank {rank} leaves out rank {r}, silent within the timeout: {why}");
    }
    drop((outgoing, incoming));
    // A peer found alive here connected before this rank's probing ended, so its own probing
    // ends at most a timeout later (it may be waiting for a rank it finds silent that this
    // rank found gone); then it has a timeout of its own to send its set.
    let wait = probe.timeout * 2;
    let io = |r: usize, reading: bool| {
        move |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut if reading => {
                Error::JoinTimeout {
                    message: format!(
                        "shrink: rank {r} did not send rank {rank} its set of live ranks \
                         within {wait:?} (it is stuck, or its process was stopped)"
                    ),
                    timeout: wait,
                }
            }
            std::io::ErrorKind::UnexpectedEof => Error::config(format!(
                "shrink: rank {r} closed its connection to rank {rank} before agreeing (its \
                 own error says why)"
            )),
            _ => Error::io(
                format!("shrink: rank {rank} exchanging the set of live ranks with rank {r}"),
                e,
            ),
        }
    };
    let agree_by = Instant::now() + wait;
    let agreed = (|| -> Result<()> {
        for (r, l) in links.iter_mut().enumerate() {
            if let Some(s) = l {
                s.set_write_timeout(Some(left_of(agree_by)))
                    .and_then(|_| s.write_all(&mine))
                    .map_err(io(r, false))?;
            }
        }
        for (r, l) in links.iter_mut().enumerate() {
            if let Some(s) = l {
                let mut theirs = vec![0u8; mine.len()];
                s.set_read_timeout(Some(left_of(agree_by)))
                    .and_then(|_| s.read_exact(&mut theirs))
                    .map_err(io(r, true))?;
                if theirs != mine {
                    let seen: Vec<usize> = (0..world)
                        .filter(|&k| theirs[k / 8] & (1 << (k % 8)) != 0)
                        .collect();
                    return Err(Error::config(format!(
                        "shrink: the survivors do not agree: rank {rank} finds {} alive, \
                         rank {r} finds {} (a rank was lost during the shrink, or came \
                         after the others' timeout); shrink again",
                        list(&members),
                        list(&seen)
                    )));
                }
            }
        }
        Ok(())
    })();
    // On failure `links` drops here: its peers, reading, fail too instead of waiting.
    agreed?;
    let socks = members
        .iter()
        .map(|&r| {
            let s = links[r].take();
            if let Some(s) = &s {
                let _ = s.set_read_timeout(None);
                let _ = s.set_write_timeout(None);
            }
            s
        })
        .collect();
    Ok(Survivors { members, socks })
}

fn left_of(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// One bit per rank (1: alive).
fn bitmap(alive: &[bool]) -> Vec<u8> {
    let mut b = vec![0u8; alive.len().div_ceil(8)];
    for (r, _) in alive.iter().enumerate().filter(|(_, a)| **a) {
        b[r / 8] |= 1 << (r % 8);
    }
    b
}

/// Why a peer is not among the survivors.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Fate {
    /// Its port refuses, or answers as no peer of this job: the process is gone.
    Gone,
    /// It did not answer by the deadline, though it may run: stuck, shrunk already without
    /// this rank, or out of reach (its host down, or cut off from this one).
    Silent,
}

/// Connect to a peer's listening port and prove the token as `id`, by `deadline`; the error
/// says why the peer is not a survivor. A refused connection is final (the port was open for
/// the communicator's whole life: the process is gone); others are retried until the
/// deadline.
fn probe_peer(
    addr: &str,
    token: &str,
    id: u32,
    deadline: Instant,
) -> std::result::Result<TcpStream, (Fate, String)> {
    // Only a refusal, or an answer that is no peer of this job's, says the process is gone; a
    // peer that cannot be reached (its host down, or cut off from this one) may still run.
    let sa = super::net::resolve_by(addr, deadline)
        .map_err(|e| (Fate::Silent, format!("resolving {addr}: {e}")))?;
    let mut pause = Duration::from_millis(5);
    loop {
        let attempt = match wire::connect(&sa, left_of(deadline).min(Duration::from_secs(5))) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err((Fate::Gone, format!("{addr} refused the connection")))
            }
            Err(e) => Err((Fate::Silent, format!("connecting to {addr}: {e}"))),
            Ok(mut s) => {
                match wire::handshake_client(&mut s, token, Purpose::Shrink, id, left_of(deadline))
                {
                    Ok(()) => return Ok(s),
                    Err(e @ Error::InvalidArgument { .. }) => {
                        return Err((Fate::Gone, e.to_string()))
                    }
                    Err(e) => Err((Fate::Silent, e.to_string())),
                }
            }
        };
        if Instant::now() >= deadline {
            return attempt;
        }
        std::thread::sleep(pause.min(left_of(deadline)));
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bitmap_has_a_bit_per_live_rank() {
        assert_eq!(bitmap(&[true, false, true]), [0b101]);
        assert_eq!(bitmap(&[false; 9]), [0, 0]);
        let mut v = vec![false; 10];
        v[9] = true;
        assert_eq!(bitmap(&v), [0, 0b10]);
    }

    #[test]
    fn a_rank_that_found_a_peer_gone_waits_for_one_still_probing_it() {
        // Rank 2's port refuses rank 0 (gone) but takes rank 1's connection and never answers
        // (silent): rank 0's probing ends as soon as rank 1 comes, rank 1's at its deadline.
        let timeout = Duration::from_millis(800);
        let bind = || TcpListener::bind("127.0.0.1:0").unwrap();
        let at = |l: &TcpListener| l.local_addr().unwrap().to_string();
        let (l0, l1, mute) = (bind(), bind(), bind());
        let closed = at(&bind());
        let addrs0 = [at(&l0), at(&l1), closed];
        let addrs1 = [at(&l0), at(&l1), at(&mute)];
        let token = "a job's token";
        let probe = |rank, addrs, deadline| Probe {
            rank,
            addrs,
            token,
            generation: 0,
            deadline,
            timeout,
        };
        let (r0, r1) = std::thread::scope(|s| {
            let h0 = s.spawn(|| survivors(&probe(0, &addrs0, Instant::now() + timeout), l0));
            std::thread::sleep(timeout / 4);
            // Rank 1 sends its set a little after its deadline, as a loaded host's may: with
            // one timeout for the agreement rank 0 had given up on it by then.
            let deadline = Instant::now() + timeout + timeout / 4;
            let addrs1 = &addrs1;
            let h1 = s.spawn(move || {
                let r = survivors(&probe(1, addrs1, deadline), l1);
                (r, Instant::now() >= deadline)
            });
            (h0.join().unwrap(), h1.join().unwrap())
        });
        let (r1, probed_to_deadline) = r1;
        // Rank 1 waited for rank 2 to the end of its probing.
        assert!(probed_to_deadline);
        for r in [r0, r1] {
            let found = r.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(found.members, [0, 1]);
        }
        drop(mute);
    }
}
