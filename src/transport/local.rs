//! The in-process transport: ranks are threads of one process sharing memory.
//!
//! Nothing is staged. A send publishes a pointer to the sender's bytes; the receiver copies or
//! reduces straight from them into its own buffer, then marks the message consumed, which is
//! when the send completes. [`PeerMemory`] hands the algorithms the peers' buffers of the call,
//! published in [`Transport::begin`].
//!
//! Every wait sleeps on the waiting rank's bell after a short spin, checks the group's abort
//! flag, and is bounded by the group's timeout.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use super::{CallBuffers, CallHeader, PairData, PairOp, PeerMemory, RecvOp, SendOp, Transport};
use crate::dtype::DType;
use crate::error::{Error, Result, Site};
use crate::sync::{Bell, Spin};

/// One published call: header and buffers.
type Entry = Option<(CallHeader, CallBuffers)>;

/// A rank's arrival slot, double-buffered by call number: a rank can be at most one call ahead of
/// a peer that still reads its entry (see `begin`).
#[derive(Default)]
struct Slot {
    /// Call number + 1 of the latest published entry.
    arrived: AtomicU64,
    entries: [Mutex<Entry>; 2],
    /// True while the rank is inside a call and may touch peers' memory.
    inside: AtomicBool,
    /// Progress counter for `PeerMemory`.
    progress: AtomicU64,
}

/// The point-to-point messages sent to one rank: each one's sender, dtype and bytes, in send
/// order, and the buffers of messages already taken, for the next sends to reuse (a fresh
/// buffer costs a page fault per page it fills).
#[derive(Default)]
struct Inbox {
    messages: VecDeque<(usize, DType, Vec<u8>)>,
    /// The bytes of `messages`.
    bytes: usize,
    /// A sender waits for room (the receiver rings every rank when it takes a message).
    full: bool,
    spare: Vec<Vec<u8>>,
}

/// The spare buffers an inbox keeps at most, and the largest it keeps.
const SPARE_BUFFERS: usize = 4;
const SPARE_MAX_BYTES: usize = 16 << 20;

/// The bytes an inbox holds at most: past them a send waits (bounded by the timeout) for the
/// receiver to take some, so a sender that runs ahead cannot take all the memory there is.
const INBOX_MAX_BYTES: usize = 1 << 30;

/// A one-way mailbox from one rank to another, one message in flight.
#[derive(Default)]
struct Channel {
    posted: AtomicU64,
    consumed: AtomicU64,
    ptr: AtomicUsize,
    len: AtomicUsize,
    /// Length the receiver expected, when it differed from the message's (0 = fine).
    refused_len: AtomicUsize,
}

/// State shared by the ranks of one in-process group.
pub(crate) struct Shared {
    world: usize,
    timeout: Duration,
    spin: Spin,
    bells: Vec<CachePadded<Bell>>,
    slots: Vec<CachePadded<Slot>>,
    channels: Vec<CachePadded<Channel>>,
    /// Each rank's point-to-point messages: copies, so that a send does not wait for its
    /// receive.
    inboxes: Vec<CachePadded<Mutex<Inbox>>>,
    aborted: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl Shared {
    pub(crate) fn new(world: usize, timeout: Duration) -> Arc<Shared> {
        Arc::new(Shared {
            world,
            timeout,
            spin: Spin::for_world(world),
            bells: (0..world).map(|_| Default::default()).collect(),
            slots: (0..world).map(|_| Default::default()).collect(),
            channels: (0..world * world).map(|_| Default::default()).collect(),
            inboxes: (0..world).map(|_| Default::default()).collect(),
            aborted: AtomicBool::new(false),
            reason: Mutex::new(None),
        })
    }

    fn channel(&self, from: usize, to: usize) -> &Channel {
        &self.channels[from * self.world + to]
    }

    fn ring_all(&self) {
        self.bells.iter().for_each(|b| b.ring());
    }

    fn abort(&self, reason: &str) {
        {
            let mut r = self.reason.lock();
            if r.is_none() {
                *r = Some(reason.to_string());
            }
        }
        self.aborted.store(true, Ordering::SeqCst);
        self.ring_all();
    }
}

/// One rank's end of an in-process group.
pub struct LocalTransport {
    shared: Arc<Shared>,
    rank: usize,
    /// The peers' buffers of the current call, read in `begin`.
    peers: Mutex<Vec<CallBuffers>>,
}

impl LocalTransport {
    /// The transports of a fresh group of `world` ranks whose waits are bounded by `timeout`.
    pub fn group(world: usize, timeout: Duration) -> Vec<LocalTransport> {
        let shared = Shared::new(world, timeout);
        (0..world)
            .map(|rank| LocalTransport {
                shared: shared.clone(),
                rank,
                peers: Mutex::new(vec![CallBuffers::NONE; world]),
            })
            .collect()
    }

    fn aborted_error(&self) -> Error {
        Error::Aborted {
            rank: self.rank,
            reason: self
                .shared
                .reason
                .lock()
                .clone()
                .unwrap_or_else(|| "aborted".into()),
        }
    }

    /// Wait on this rank's bell for `ready`, failing with `Aborted` or with `Timeout` naming
    /// `peers()` (evaluated on timeout). A timeout aborts the whole group.
    fn wait(
        &self,
        site: Site,
        phase: &'static str,
        mut ready: impl FnMut() -> bool,
        peers: impl FnOnce() -> Vec<usize>,
    ) -> Result<()> {
        let s = &self.shared;
        let deadline = Instant::now() + s.timeout;
        let ok = s.bells[self.rank].wait(deadline, s.spin, || {
            s.aborted.load(Ordering::Acquire) || ready()
        });
        if s.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        if ok {
            return Ok(());
        }
        let e = Error::Timeout {
            site,
            waiting_for: peers(),
            phase,
            timeout: s.timeout,
            stalled_on: Vec::new(),
        };
        s.abort(&e.to_string());
        Err(e)
    }
}

impl Transport for LocalTransport {
    fn regroup(&self) -> Option<super::Regroup> {
        Some(super::Regroup::Threads(Arc::as_ptr(&self.shared) as usize))
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn begin(&self, site: Site, header: &CallHeader, buffers: CallBuffers) -> Result<()> {
        let s = &self.shared;
        if s.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        let me = &s.slots[self.rank];
        me.inside.store(true, Ordering::SeqCst);
        let idx = (header.call % 2) as usize;
        *me.entries[idx].lock() = Some((header.clone(), buffers));
        me.arrived.store(header.call + 1, Ordering::SeqCst);
        s.ring_all();

        let target = header.call + 1;
        self.wait(
            site,
            "arrive",
            || {
                s.slots
                    .iter()
                    .all(|p| p.arrived.load(Ordering::Acquire) >= target)
            },
            || {
                (0..s.world)
                    .filter(|&r| s.slots[r].arrived.load(Ordering::Acquire) < target)
                    .collect()
            },
        )?;
        // Every rank has published this call; none can overwrite this entry before we finish
        // (it would first have to pass `begin` of the next call, which waits for us).
        let mut peers = self.peers.lock();
        let mut first_error = None;
        for (r, slot) in s.slots.iter().enumerate() {
            let entry = slot.entries[idx].lock();
            let (theirs, bufs) = entry
                .as_ref()
                .expect("an arrived rank has published its entry");
            peers[r] = *bufs;
            if r == self.rank || first_error.is_some() {
                continue;
            }
            if let Some(message) = &theirs.rejected {
                first_error = Some(Error::PeerRejected {
                    site,
                    peer: r,
                    message: message.clone(),
                });
            } else if let Some((field, mine, theirs)) = header.first_difference(theirs) {
                first_error = Some(Error::Mismatch {
                    site,
                    peer: r,
                    field,
                    mine,
                    theirs,
                });
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn exchange(&self, site: Site, sends: &[SendOp<'_>], recvs: &mut [RecvOp<'_>]) -> Result<()> {
        let s = &self.shared;
        let world = s.world;
        super::check_peers(site, self.rank, world, sends, recvs)?;
        // Post every send first so that no pair of ranks waits on each other.
        let mut posted = [0u64; 8];
        let mut posted_vec = Vec::new();
        let posted: &mut [u64] = if sends.len() <= posted.len() {
            &mut posted[..sends.len()]
        } else {
            posted_vec.resize(sends.len(), 0);
            &mut posted_vec
        };
        for (snd, n) in sends.iter().zip(posted.iter_mut()) {
            let ch = s.channel(self.rank, snd.peer);
            *n = ch.posted.load(Ordering::Relaxed) + 1;
            ch.ptr.store(snd.data.as_ptr() as usize, Ordering::Relaxed);
            ch.len.store(snd.data.len(), Ordering::Relaxed);
            ch.posted.store(*n, Ordering::Release);
            s.bells[snd.peer].ring();
        }
        // Receive in order, reading straight from the sender's memory.
        let mut result = Ok(());
        for rcv in recvs.iter_mut() {
            let ch = s.channel(rcv.peer, self.rank);
            let expect = ch.consumed.load(Ordering::Relaxed) + 1;
            let peer = rcv.peer;
            let w = self.wait(
                site,
                "send data",
                || ch.posted.load(Ordering::Acquire) >= expect,
                || vec![peer],
            );
            if let Err(e) = w {
                result = Err(e);
                break;
            }
            let len = ch.len.load(Ordering::Relaxed);
            if len != rcv.dst.len() {
                // Plus one: an expected length of 0 is a refusal too.
                ch.refused_len.store(rcv.dst.len() + 1, Ordering::Relaxed);
            } else if len > 0 {
                let ptr = ch.ptr.load(Ordering::Relaxed) as *const u8;
                // SAFETY: the sender keeps `len` bytes at `ptr` unchanged until we mark the
                // message consumed below; they do not overlap our destination (different
                // buffers, or disjoint ranges of one buffer chosen by the algorithm).
                let src = unsafe { std::slice::from_raw_parts(ptr, len) };
                rcv.mode.deliver(rcv.dst, 0, src);
            }
            ch.consumed.store(expect, Ordering::Release);
            s.bells[peer].ring();
            if len != rcv.dst.len() {
                let e = Error::invalid(
                    site,
                    format!(
                        "rank {peer} sent {len} bytes where {} were expected",
                        rcv.dst.len()
                    ),
                );
                s.abort(&e.to_string());
                result = Err(e);
                break;
            }
        }
        // A send completes when its receiver has consumed it.
        for (snd, n) in sends.iter().zip(posted.iter()) {
            let ch = s.channel(self.rank, snd.peer);
            let peer = snd.peer;
            // Wait even after an error: the receiver may be reading our bytes right now. Once the
            // group is aborted a receiver that has not started never will.
            let done = || ch.consumed.load(Ordering::Acquire) >= *n;
            let w = self.wait(site, "receive data", done, || vec![peer]);
            if w.is_err() && result.is_ok() {
                result = w;
            }
            let refused = ch.refused_len.swap(0, Ordering::Relaxed);
            if refused != 0 && result.is_ok() {
                result = Err(Error::invalid(
                    site,
                    format!(
                        "rank {peer} expected {} bytes where {} were sent",
                        refused - 1,
                        snd.data.len()
                    ),
                ));
            }
        }
        result
    }

    /// Sends are copied into the peer's inbox at once, so a send does not wait for its receive
    /// (unless the inbox holds [`INBOX_MAX_BYTES`]); receives take their peer's messages in
    /// order.
    fn pair_exchange(&self, site: Site, ops: &mut [PairOp<'_>]) -> Result<()> {
        let s = &self.shared;
        if s.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        for op in ops.iter() {
            let PairData::Send(data) = &op.data else {
                continue;
            };
            let inbox = &s.inboxes[op.peer];
            let peer = op.peer;
            let room = || {
                let mut i = inbox.lock();
                let room = i.messages.is_empty() || i.bytes + data.len() <= INBOX_MAX_BYTES;
                i.full |= !room;
                room
            };
            self.wait(site, "receive data", room, || vec![peer])?;
            let spare = {
                let mut i = inbox.lock();
                let fits = i.spare.iter().position(|b| b.capacity() >= data.len());
                fits.map(|k| i.spare.swap_remove(k))
            };
            let mut copy = spare.unwrap_or_default();
            copy.clear();
            copy.extend_from_slice(data);
            let mut i = inbox.lock();
            i.bytes += copy.len();
            i.messages.push_back((self.rank, op.dtype, copy));
            drop(i);
            s.bells[peer].ring();
        }
        let inbox = &s.inboxes[self.rank];
        for op in ops.iter_mut() {
            let PairData::Recv(dst) = &mut op.data else {
                continue;
            };
            let peer = op.peer;
            let first_from = |i: &Inbox| i.messages.iter().position(|m| m.0 == peer);
            let ready = || first_from(&inbox.lock()).is_some();
            self.wait(site, "send data", ready, || vec![peer])?;
            // Only this rank takes from its inbox: the message it waited for is there.
            let (taken, full) = {
                let mut i = inbox.lock();
                let m = first_from(&i).and_then(|k| i.messages.remove(k));
                if let Some(m) = &m {
                    i.bytes -= m.2.len();
                }
                (m, std::mem::take(&mut i.full))
            };
            if full {
                s.ring_all();
            }
            let Some((_, dtype, bytes)) = taken else {
                return Err(Error::invalid(
                    site,
                    format!("rank {peer}'s message vanished"),
                ));
            };
            if dtype != op.dtype || bytes.len() != dst.len() {
                return Err(super::pair_mismatch(
                    site,
                    peer,
                    (dtype, bytes.len()),
                    (op.dtype, dst.len()),
                ));
            }
            dst.copy_from_slice(&bytes);
            let mut i = inbox.lock();
            if i.spare.len() < SPARE_BUFFERS && bytes.capacity() <= SPARE_MAX_BYTES {
                i.spare.push(bytes);
            }
        }
        Ok(())
    }

    fn end(&self, failed: Option<&Error>) {
        let s = &self.shared;
        s.slots[self.rank].inside.store(false, Ordering::SeqCst);
        s.ring_all();
        let Some(e) = failed else { return };
        if matches!(
            e,
            Error::Mismatch { .. } | Error::PeerRejected { .. } | Error::InvalidArgument { .. }
        ) && !s.aborted.load(Ordering::Acquire)
        {
            // Found in `begin`, by every rank alike, before any byte moved: the group stays usable.
            return;
        }
        s.abort(&e.to_string());
        // A peer still inside may be reading this rank's buffers; it leaves at its next wait,
        // which sees the abort. Returning before would hand the caller buffers still in use,
        // so wait as long as it takes, saying so at every timeout.
        let all_out = || s.slots.iter().all(|p| !p.inside.load(Ordering::SeqCst));
        while !s.bells[self.rank].wait(Instant::now() + s.timeout, Spin(Duration::ZERO), all_out) {
            let inside: Vec<usize> = (0..s.world)
                .filter(|&r| s.slots[r].inside.load(Ordering::SeqCst))
                .collect();
            log::warn!(
                "rank {} waits for ranks {inside:?} to leave the aborted call before returning its buffers",
                self.rank
            );
        }
    }

    fn peer_memory(&self) -> Option<&dyn PeerMemory> {
        Some(self)
    }

    fn one_process(&self) -> bool {
        true
    }

    fn abort(&self, reason: &str) {
        self.shared.abort(reason);
    }

    fn aborted(&self) -> Option<String> {
        if self.shared.aborted.load(Ordering::Acquire) {
            self.shared.reason.lock().clone()
        } else {
            None
        }
    }
}

impl PeerMemory for LocalTransport {
    fn buffers(&self, peer: usize) -> CallBuffers {
        self.peers.lock()[peer]
    }

    fn set_progress(&self, value: u64) {
        self.shared.slots[self.rank]
            .progress
            .store(value, Ordering::Release);
        self.shared.ring_all();
    }

    fn wait_progress(
        &self,
        site: Site,
        peer: usize,
        value: u64,
        phase: &'static str,
    ) -> Result<()> {
        let p = &self.shared.slots[peer].progress;
        self.wait(
            site,
            phase,
            || p.load(Ordering::Acquire) >= value,
            || vec![peer],
        )
    }
}
