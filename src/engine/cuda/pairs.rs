//! Point-to-point between the ranks of an in-process CUDA group: where the pairs meet.
//!
//! A send leaves a letter (its device address, length, dtype, and the event of the sender's
//! stream it must wait for) in the receiver's box and returns to its group's receives; a
//! receive takes the first letter from its peer (a pair's messages in issue order), checks it
//! against itself, copies the bytes GPU to GPU on the receiver's stream, waits for the copy and
//! settles the letter. A send's call ends once each of its letters is settled (or withdrawn
//! untaken), so no copy of the sender's buffer starts after its call returns; a copy that
//! outlives its receiver's deadline fails the call and aborts the group, as a collective's
//! does. Every rank posts all its sends before it receives, so a ring of grouped sends and
//! receives cannot wait on itself. Every wait sleeps, ends at the call's deadline (a sender
//! whose message is being copied waits for the copy, saying so) and wakes on an abort of the
//! group or of the communicator.
//!
//! The calls complete on the host: with a CUDA stream set, the copy waits for the work queued
//! on the sender's and the receiver's streams before the call, and the call (or its handle)
//! completes once the bytes are in place; work queued on the stream after issuing a
//! non-blocking call is not ordered after it, so wait for its handle first.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::dtype::DType;
use crate::error::{Error, Result, Site};

/// A send waiting in its receiver's box.
pub(super) struct Letter {
    id: u64,
    pub from: usize,
    pub dtype: DType,
    pub ptr: u64,
    pub bytes: usize,
    /// An event of the sender's stream that the copy waits for (0: none).
    pub after: u64,
}

#[derive(Default)]
struct State {
    /// Each rank's box: the letters sent to it, in the order they were sent.
    boxes: Vec<VecDeque<Letter>>,
    /// Letters taken and dealt with: `Err` carries the receiver's reason.
    settled: HashMap<u64, std::result::Result<(), String>>,
    next: u64,
}

/// The boxes of a group's ranks.
#[derive(Default)]
pub(super) struct Post {
    state: Mutex<State>,
    bell: Condvar,
}

/// How long a wait sleeps between looks at the group's abort flag (an abort also rings).
const LOOK: Duration = Duration::from_millis(20);

/// A taken letter, to be settled with [`Taken::settle`]; dropped unsettled (a panic between
/// taking and settling), it settles as failed, so that its sender never waits for it forever.
pub(super) struct Taken<'a> {
    post: &'a Post,
    id: u64,
    settled: bool,
}

impl Taken<'_> {
    /// Tell the sender how its message ended.
    pub fn settle(mut self, outcome: std::result::Result<(), String>) {
        self.settled = true;
        self.post.settle(self.id, outcome);
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.post.settle(
                self.id,
                Err("the receiving rank failed before it had copied the message".into()),
            );
        }
    }
}

impl Post {
    /// Leave a letter for rank `to`; its id, for [`Post::wait_sent`].
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &self,
        to: usize,
        from: usize,
        dtype: DType,
        ptr: u64,
        bytes: usize,
        after: u64,
    ) -> u64 {
        let mut s = self.state.lock();
        if s.boxes.len() <= to {
            s.boxes.resize_with(to + 1, VecDeque::new);
        }
        let id = s.next;
        s.next += 1;
        s.boxes[to].push_back(Letter {
            id,
            from,
            dtype,
            ptr,
            bytes,
            after,
        });
        drop(s);
        self.bell.notify_all();
        id
    }

    /// Take rank `rank`'s first letter from `peer`, waiting for it until `deadline`;
    /// `aborted` says whether (and why) the group was aborted meanwhile.
    pub fn take(
        &self,
        site: Site,
        rank: usize,
        peer: usize,
        deadline: Instant,
        timeout: Duration,
        aborted: &dyn Fn() -> Option<String>,
    ) -> Result<(Letter, Taken<'_>)> {
        let mut s = self.state.lock();
        loop {
            if let Some(reason) = aborted() {
                return Err(Error::Aborted { rank, reason });
            }
            let found = s
                .boxes
                .get(rank)
                .and_then(|b| b.iter().position(|l| l.from == peer));
            if let Some(k) = found {
                let Some(letter) = s.boxes[rank].remove(k) else {
                    continue;
                };
                let taken = Taken {
                    post: self,
                    id: letter.id,
                    settled: false,
                };
                return Ok((letter, taken));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    site,
                    waiting_for: vec![peer],
                    phase: "send the message this rank receives",
                    timeout,
                    stalled_on: Vec::new(),
                });
            }
            self.bell.wait_for(&mut s, LOOK.min(deadline - now));
        }
    }

    fn settle(&self, id: u64, outcome: std::result::Result<(), String>) {
        self.state.lock().settled.insert(id, outcome);
        self.bell.notify_all();
    }

    /// Wait until every letter of `sent` (id, receiver) is settled. When `failing` (this
    /// rank's call has already failed), or past `deadline`, or once aborted, letters not yet
    /// taken are withdrawn; a letter being copied is waited for (its receiver settles it by its
    /// own deadline, or as it fails), so no receiver starts reading the buffer after this
    /// returns. The first receiver's error, or a timeout naming the receivers that did not take
    /// theirs.
    #[allow(clippy::too_many_arguments)]
    pub fn wait_sent(
        &self,
        site: Site,
        rank: usize,
        sent: &[(u64, usize)],
        failing: bool,
        deadline: Instant,
        timeout: Duration,
        aborted: &dyn Fn() -> Option<String>,
    ) -> Result<()> {
        let mut s = self.state.lock();
        let mut withdrawn = Vec::new();
        let mut first_err: Option<Error> = None;
        let mut pending: Vec<(u64, usize)> = sent.to_vec();
        let mut warned = deadline;
        loop {
            let stop = failing || Instant::now() >= deadline || aborted().is_some();
            pending.retain(|&(id, to)| {
                if let Some(outcome) = s.settled.remove(&id) {
                    if let Err(why) = outcome {
                        first_err.get_or_insert_with(|| {
                            Error::invalid(
                                site,
                                format!("rank {to} could not receive rank {rank}'s send: {why}"),
                            )
                        });
                    }
                    return false;
                }
                if stop {
                    let b = &mut s.boxes[to];
                    if let Some(k) = b.iter().position(|l| l.id == id) {
                        b.remove(k);
                        withdrawn.push(to);
                        return false;
                    }
                }
                true
            });
            if pending.is_empty() {
                break;
            }
            // Taken and being copied: its receiver settles it by its own deadline. Past ours,
            // say who is still copying, once per timeout, as a failing collective does.
            let now = Instant::now();
            if stop && now >= warned + timeout {
                warned = now;
                log::warn!(
                    "rank {rank} waits for ranks {:?} to finish copying its message before \
                     returning its buffers",
                    pending.iter().map(|p| p.1).collect::<Vec<_>>()
                );
            }
            let wait = if stop { LOOK } else { LOOK.min(deadline - now) };
            self.bell.wait_for(&mut s, wait);
        }
        drop(s);
        self.bell.notify_all();
        if let Some(e) = first_err {
            return Err(e);
        }
        if let Some(reason) = aborted() {
            if !withdrawn.is_empty() {
                return Err(Error::Aborted { rank, reason });
            }
        }
        if !withdrawn.is_empty() && !failing {
            withdrawn.sort_unstable();
            withdrawn.dedup();
            return Err(Error::Timeout {
                site,
                waiting_for: withdrawn,
                phase: "receive the message this rank sends",
                timeout,
                stalled_on: Vec::new(),
            });
        }
        Ok(())
    }

    /// Wake every wait (the group was aborted).
    pub fn ring(&self) {
        self.bell.notify_all();
    }
}
