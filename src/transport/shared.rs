//! Shared buffers: host memory that every rank of a process group on one host maps, so that
//! the algorithms that read and write peers' buffers in place (`direct`) run between processes,
//! with no copy through the shared-memory slots.
//!
//! A communicator allocates them collectively ([`crate::Communicator::alloc_shared`]): every
//! rank creates a segment of the same size, the ranks all-gather the segments' names, each maps
//! every peer's, and once all have, each unlinks its own (from then on nothing is left under
//! /dev/shm, even when a process is killed; one killed before leaves its names to the next
//! sweep). The first allocation also creates each rank's control page: its progress counter and
//! doorbell for `direct`, and the claim that a call's buffers lie in a shared buffer.
//!
//! A call of a communicator that has allocated shared buffers, of at least [`MIN_BYTES`]
//! ([`MIN_BYTES_SHARING_CORES`] where ranks outnumber cores: [`min_bytes`]), has a check round. Before it, each rank writes its claim into its control page: the call number,
//! and for its input and output the shared buffer holding them (by allocation number), offset
//! and length. After it every rank reads every claim and decides alike: the call runs `direct`
//! through the mappings when every rank's input lies in the same allocation and so does every
//! rank's output, with the same lengths. A rank can claim only an allocation it still holds, so
//! every rank then holds the mappings the call needs.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::shm::{
    buffer_name, futex_wait, futex_wake, pid_namespace, segment_owner, unlink, Segment,
};
use super::CallBuffers;
use crate::error::{Error, Result};

/// Calls moving fewer bytes per rank than this never run through shared buffers: the check
/// round costs about a microsecond, and below it the slots are as fast (2 processes on 2
/// cores: 64 KiB takes 1.4 µs on shared buffers, 4.3 on the slots; 32 KiB 3.3 on the slots).
pub(crate) const MIN_BYTES: usize = 64 << 10;
/// The same where ranks outnumber cores: every rank that waits sleeps, and the round and the
/// final wait cost more than the slots save below this (3 and 4 processes on 2 cores: 256 KiB
/// 40-66 µs on shared buffers against 30-45 on the slots, 512 KiB 56-80 against 57-89, 1 MiB
/// 83-100 against 112-206).
pub(crate) const MIN_BYTES_SHARING_CORES: usize = 512 << 10;
/// Bytes of a rank's record in an allocation's all-gather: its segment's name and length,
/// (first allocation) its control page's name, and its number of cores.
pub(crate) const RECORD: usize = 256;
/// Room for a name in a record.
const NAME: usize = 120;
/// Bytes of a control page.
const CONTROL: usize = 4096;

/// A rank's control page. Only its rank writes `progress`, `inside` and the claim; peers ring
/// `bell` when they publish progress while `sleeping` says the rank sleeps on it. The claim is
/// a sequence lock: `call` is 0 while the words change, so a reader that finds the same
/// `call` before and after reading them read one claim, not two halves.
#[repr(C)]
struct Control {
    progress: AtomicU64,
    _p0: [u8; 56],
    bell: AtomicU32,
    sleeping: AtomicU32,
    /// Call number + 1 from the claim until the rank leaves the call (0: none): peers may
    /// write into its buffers in between.
    inside: AtomicU64,
    _p1: [u8; 48],
    /// Call number + 1 of the claim (0: none yet).
    call: AtomicU64,
    /// Input then output: allocation number + 1 (0: not in a shared buffer), offset, length.
    claim: [AtomicU64; 6],
}

/// The smallest call (bytes per rank) that runs through shared buffers, from the gathered
/// records: the same on every rank, since they read the same records (a rank whose record is
/// empty counts as having no core of its own).
pub(crate) fn min_bytes(records: &[u8]) -> usize {
    let world = records.len() / RECORD;
    let cores = records
        .chunks_exact(RECORD)
        .map(|r| u64::from_le_bytes(r[2 * NAME + 8..2 * NAME + 16].try_into().expect("8 bytes")))
        .min()
        .unwrap_or(0);
    if world as u64 > cores {
        MIN_BYTES_SHARING_CORES
    } else {
        MIN_BYTES
    }
}

/// Where a peer's claim puts its buffers: (offset, length) in its input and output segments.
#[derive(Debug, PartialEq, Eq)]
struct Ranges {
    input: (usize, usize),
    output: (usize, usize),
}

/// A peer's claim (the words it wrote into its control page: input allocation + 1, offset,
/// length, then the same for the output), checked against this rank's own claim and the
/// lengths of the peer's segments as mapped here: `None` (the call goes through the slots)
/// unless it names the same allocations and lengths and lies inside the segments. A peer can
/// write anything there; nothing it writes makes a range outside the mappings.
fn claimed_ranges(mine: &[u64; 6], c: &[u64; 6], in_seg: usize, out_seg: usize) -> Option<Ranges> {
    if c[0] != mine[0] || c[3] != mine[3] || c[2] != mine[2] || c[5] != mine[5] {
        return None;
    }
    let fits = |seg: usize, off: u64, len: u64| -> Option<(usize, usize)> {
        let end = off.checked_add(len)?;
        (end <= seg as u64).then_some((usize::try_from(off).ok()?, usize::try_from(len).ok()?))
    };
    Some(Ranges {
        input: fits(in_seg, c[1], c[2])?,
        output: fits(out_seg, c[4], c[5])?,
    })
}

/// One allocation: every rank's segment, mapped here (this rank's own included).
struct Set {
    id: u64,
    maps: Vec<Segment>,
    /// This rank's own names, unlinked once every rank has mapped them.
    names: Vec<String>,
    /// The first allocation's control pages, installed once every rank has mapped them (an
    /// allocation that fails on some rank leaves no rank with them), and the peers' processes.
    controls: Vec<Segment>,
    pids: Vec<Option<u32>>,
}

/// A rank's shared buffers.
pub(crate) struct Buffers {
    rank: usize,
    world: usize,
    /// Allocations made so far (the same count on every rank: allocation is collective).
    made: u64,
    /// Every rank's control page (empty before the first allocation).
    controls: Vec<Segment>,
    /// Every rank's process, where it is in this PID namespace: a peer is alive while it is.
    pids: Vec<Option<u32>>,
    sets: Vec<Set>,
    /// The buffers of the current call's ranks, read from their claims.
    call: Vec<CallBuffers>,
    /// The segments created for an allocation that is not mapped yet.
    pending: Option<Pending>,
}

/// This rank's new segment and its name, and (first allocation) its control page's.
struct Pending {
    seg: Segment,
    name: String,
    ctl: Option<(Segment, String)>,
}

impl Pending {
    fn unlink(&self) {
        unlink(&self.name);
        if let Some((_, n)) = &self.ctl {
            unlink(n);
        }
    }
}

// SAFETY: the mappings are shared memory reached through atomics (control pages) and through
// buffers handed over by the call protocol.
unsafe impl Send for Buffers {}

fn record_name(r: &[u8]) -> Option<&str> {
    let end = r.iter().position(|&b| b == 0).unwrap_or(r.len());
    let name = std::str::from_utf8(&r[..end]).ok()?;
    (name.starts_with("/tutti-") && !name[1..].contains('/') && name.len() > 7).then_some(name)
}

fn put_name(r: &mut [u8], name: &str) -> Result<()> {
    if name.len() >= r.len() {
        return Err(Error::config(format!(
            "shared buffer: segment name {name} is longer than {} bytes",
            r.len() - 1
        )));
    }
    r[..name.len()].copy_from_slice(name.as_bytes());
    Ok(())
}

impl Buffers {
    pub(crate) fn new(rank: usize, world: usize) -> Buffers {
        Buffers {
            rank,
            world,
            made: 0,
            controls: Vec::new(),
            pids: Vec::new(),
            sets: Vec::new(),
            call: vec![CallBuffers::NONE; world],
            pending: None,
        }
    }

    fn control(&self, k: usize) -> &Control {
        // SAFETY: a control page is CONTROL bytes, zeroed by ftruncate, starting with Control.
        unsafe { &*(self.controls[k].ptr() as *const Control) }
    }

    /// Step 1 of an allocation: create this rank's segment of `len` bytes (and its control
    /// page, first time) and return its record for the all-gather. The allocation's number is
    /// taken even when this fails, as on every other rank.
    pub(crate) fn create(&mut self, len: usize) -> Result<[u8; RECORD]> {
        self.made += 1;
        self.abandon();
        let tag = crate::cluster::auth::nonce()?
            .iter()
            .take(6)
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
        let name = buffer_name(self.rank, &self.made.to_string(), &tag);
        let mut rec = [0u8; RECORD];
        put_name(&mut rec[..NAME], &name)?;
        let seg = Segment::map(&name, len.max(64), true)?;
        rec[NAME..NAME + 8].copy_from_slice(&(len as u64).to_le_bytes());
        rec[2 * NAME + 8..2 * NAME + 16]
            .copy_from_slice(&(crate::sync::cores() as u64).to_le_bytes());
        let ctl = if self.controls.is_empty() {
            let cname = buffer_name(self.rank, "ctl", &tag);
            let c = put_name(&mut rec[NAME + 8..2 * NAME + 8], &cname)
                .and_then(|_| Segment::map(&cname, CONTROL, true))
                .inspect_err(|_| unlink(&name))?;
            Some((c, cname))
        } else {
            None
        };
        self.pending = Some(Pending { seg, name, ctl });
        Ok(rec)
    }

    /// Step 2: map every peer's segment from the gathered records (rank order). Returns the
    /// allocation's number and this rank's buffer.
    pub(crate) fn map(&mut self, records: &[u8], len: usize) -> Result<(u64, *mut u8)> {
        let Pending {
            seg: own,
            name: own_name,
            ctl: own_ctl,
        } = self
            .pending
            .take()
            .ok_or_else(|| Error::config("shared buffer: this rank created no segment"))?;
        let mut names = vec![own_name];
        let mut own_ctl = own_ctl.map(|(c, n)| {
            names.push(n);
            c
        });
        let mut own = Some(own);
        let mut pids = vec![None; self.world];
        let set = (|| {
            let mut maps = Vec::with_capacity(self.world);
            let mut controls = Vec::new();
            for (k, r) in records.chunks_exact(RECORD).enumerate() {
                let theirs = u64::from_le_bytes(r[NAME..NAME + 8].try_into().expect("8 bytes"));
                let name = record_name(&r[..NAME]);
                if k == self.rank {
                    maps.push(own.take().expect("one own segment"));
                    if let Some(c) = own_ctl.take() {
                        controls.push(c);
                    }
                    continue;
                }
                let Some(name) = name else {
                    return Err(Error::config(format!(
                        "shared buffer: rank {k} could not create its segment (its own error says why)"
                    )));
                };
                if theirs != len as u64 {
                    return Err(Error::config(format!(
                        "shared buffer: rank {k} allocated {theirs} bytes, this rank {len}: every rank must allocate the same size"
                    )));
                }
                maps.push(Segment::map(name, len.max(64), false)?);
                if self.controls.is_empty() {
                    let Some(c) = record_name(&r[NAME + 8..2 * NAME + 8]) else {
                        return Err(Error::config(format!(
                            "shared buffer: rank {k} sent no control page"
                        )));
                    };
                    controls.push(Segment::map(c, CONTROL, false)?);
                    pids[k] = segment_owner(&c[1..])
                        .filter(|&(ns, _)| Some(ns) == pid_namespace())
                        .map(|(_, pid)| pid);
                }
            }
            Ok((maps, controls))
        })();
        let (maps, controls) = match set {
            Ok(s) => s,
            Err(e) => {
                names.iter().for_each(|n| unlink(n));
                return Err(e);
            }
        };
        let ptr = maps[self.rank].ptr();
        self.sets.push(Set {
            id: self.made,
            maps,
            names,
            controls,
            pids,
        });
        Ok((self.made, ptr))
    }

    /// Step 3, once every rank has mapped allocation `id`: unlink this rank's names.
    pub(crate) fn mapped(&mut self, id: u64) {
        if let Some(s) = self.sets.iter_mut().find(|s| s.id == id) {
            s.names.drain(..).for_each(|n| unlink(&n));
            if self.controls.is_empty() {
                self.controls = std::mem::take(&mut s.controls);
                self.pids = std::mem::take(&mut s.pids);
            }
        }
    }

    /// Give up the segments of an allocation that did not get as far as [`Buffers::map`].
    pub(crate) fn abandon(&mut self) {
        if let Some(p) = self.pending.take() {
            p.unlink();
        }
    }

    /// Give up allocation `id`: unmap it here.
    pub(crate) fn free(&mut self, id: u64) {
        if let Some(i) = self.sets.iter().position(|s| s.id == id) {
            let s = self.sets.swap_remove(i);
            s.names.iter().for_each(|n| unlink(n));
        }
    }

    /// The allocation and offset holding `len` bytes at `ptr` in this rank's own segments.
    fn locate(&self, ptr: *const u8, len: usize) -> (u64, u64) {
        if ptr.is_null() || len == 0 {
            return (0, 0);
        }
        let p = ptr as usize;
        for s in &self.sets {
            let base = s.maps[self.rank].ptr() as usize;
            if p >= base && p - base + len <= s.maps[self.rank].len() {
                return (s.id + 1, (p - base) as u64);
            }
        }
        (0, 0)
    }

    /// Write this rank's claim for call `call` (before its check round); from here until
    /// [`Buffers::leave`] the rank counts as inside the call.
    /// Returns whether it claimed (no allocation succeeded yet: none, on any rank).
    pub(crate) fn claim(&self, call: u64, b: &CallBuffers) -> bool {
        if self.controls.is_empty() {
            return false;
        }
        let c = self.control(self.rank);
        let (iid, ioff) = self.locate(b.input, b.input_len);
        let (oid, ooff) = self.locate(b.output, b.output_len);
        let v = [
            iid,
            ioff,
            b.input_len as u64,
            oid,
            ooff,
            b.output_len as u64,
        ];
        c.inside.store(call + 1, Ordering::Release);
        c.call.store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        for (a, x) in c.claim.iter().zip(v) {
            a.store(x, Ordering::Relaxed);
        }
        c.call.store(call + 1, Ordering::Release);
        true
    }

    /// After the check round: whether call `call` runs through shared buffers (every rank
    /// decides alike from the same claims); if so the ranks' buffers are ready for
    /// [`Buffers::buffers`].
    pub(crate) fn decide(&mut self, call: u64) -> bool {
        if self.controls.is_empty() {
            return false;
        }
        let mut call_bufs = std::mem::take(&mut self.call);
        let ok = self.read_claims(call, &mut call_bufs);
        self.call = call_bufs;
        ok
    }

    fn read_claims(&self, call: u64, call_bufs: &mut [CallBuffers]) -> bool {
        // A peer's claim for this call, read whole (or None: it has moved on to its next call,
        // which it does only after deciding against shared buffers for this one).
        let claim = |k: usize| -> Option<[u64; 6]> {
            let c = self.control(k);
            if c.call.load(Ordering::Acquire) != call + 1 {
                return None;
            }
            let words = std::array::from_fn(|i| c.claim[i].load(Ordering::Relaxed));
            fence(Ordering::Acquire);
            (c.call.load(Ordering::Relaxed) == call + 1).then_some(words)
        };
        let Some(mine) = claim(self.rank) else {
            return false;
        };
        let set = |id: u64| self.sets.iter().find(|s| s.id + 1 == id);
        // Both buffers in allocations this rank holds (then so does every rank claiming them).
        let (Some(iset), Some(oset)) = (set(mine[0]), set(mine[3])) else {
            return false;
        };
        for (k, slot) in call_bufs.iter_mut().enumerate() {
            // The same allocations and lengths on every rank (lengths follow from the call,
            // which the round checked; a peer's offsets are checked before they are used).
            let Some(c) = claim(k) else {
                return false;
            };
            let (iseg, oseg) = (&iset.maps[k], &oset.maps[k]);
            let Some(r) = claimed_ranges(&mine, &c, iseg.len(), oseg.len()) else {
                return false;
            };
            // SAFETY: inside the mappings (`claimed_ranges` checked them).
            *slot = unsafe {
                CallBuffers {
                    input: iseg.ptr().add(r.input.0),
                    input_len: r.input.1,
                    output: oseg.ptr().add(r.output.0),
                    output_len: r.output.1,
                    after: 0,
                    end: 0,
                    offsets: std::ptr::null(),
                    offsets_len: 0,
                    held: crate::transport::Held::Bytes,
                }
            };
        }
        true
    }

    /// Rank `k`'s buffers of the current call.
    pub(crate) fn buffers(&self, k: usize) -> CallBuffers {
        self.call[k]
    }

    /// Leave a call that made a claim.
    pub(crate) fn leave(&self) {
        if !self.controls.is_empty() {
            self.control(self.rank).inside.store(0, Ordering::Release);
            self.ring_peers();
        }
    }

    /// The peers still inside call `call` (for a failing call, which waits for them to leave
    /// before its buffers go back to the caller).
    pub(crate) fn inside(&self, call: u64) -> impl Iterator<Item = usize> + '_ {
        (0..self.world).filter(move |&k| {
            k != self.rank && self.control(k).inside.load(Ordering::Acquire) == call + 1
        })
    }

    /// Whether rank `k`'s process still runs (None: not known from here, another PID
    /// namespace). A process that is gone writes nothing more; one that aborted may still be
    /// finishing its call.
    pub(crate) fn alive(&self, k: usize) -> Option<bool> {
        let pid = (*self.pids.get(k)?)?;
        // SAFETY: signal 0 sends nothing; it only asks whether the process exists.
        let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
        if r != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EPERM) {
            return Some(false);
        }
        // A process that exited but was not yet reaped (a zombie) still answers signal 0.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
        Some(!matches!(state, 'Z' | 'X'))
    }

    pub(crate) fn set_progress(&self, value: u64) {
        self.control(self.rank)
            .progress
            .store(value, Ordering::Release);
        self.ring_peers();
    }

    fn ring_peers(&self) {
        for k in (0..self.world).filter(|&k| k != self.rank) {
            let c = self.control(k);
            c.bell.fetch_add(1, Ordering::SeqCst);
            if c.sleeping.load(Ordering::SeqCst) != 0 {
                futex_wake(&c.bell);
            }
        }
    }

    pub(crate) fn progress(&self, k: usize) -> u64 {
        self.control(k).progress.load(Ordering::Acquire)
    }

    /// Sleep on this rank's doorbell for at most `nap`, unless `ready` already holds.
    pub(crate) fn sleep(&self, nap: Duration, ready: impl Fn(&Buffers) -> bool) {
        let c = self.control(self.rank);
        c.sleeping.store(1, Ordering::SeqCst);
        let bell = c.bell.load(Ordering::SeqCst);
        if !ready(self) {
            futex_wait(&c.bell, bell, nap);
        }
        c.sleeping.store(0, Ordering::Release);
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            p.unlink();
        }
        for s in &self.sets {
            s.names.iter().for_each(|n| unlink(n));
        }
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn words() -> impl Strategy<Value = [u64; 6]> {
        let w = || prop_oneof![0u64..4, 0u64..1 << 20, any::<u64>(), Just(u64::MAX)];
        (w(), w(), w(), w(), w(), w()).prop_map(|(a, b, c, d, e, f)| [a, b, c, d, e, f])
    }

    proptest! {
        /// Arbitrary claim words from a peer: refused, or ranges inside its segments with the
        /// lengths this rank claimed.
        #[test]
        fn claims_give_ranges_inside_the_segments_or_none(
            mine in words(),
            theirs in words(),
            in_seg in 0usize..1 << 21,
            out_seg in 0usize..1 << 21,
        ) {
            if let Some(r) = claimed_ranges(&mine, &theirs, in_seg, out_seg) {
                prop_assert!(r.input.0 + r.input.1 <= in_seg);
                prop_assert!(r.output.0 + r.output.1 <= out_seg);
                prop_assert_eq!(r.input.1 as u64, mine[2]);
                prop_assert_eq!(r.output.1 as u64, mine[5]);
            }
        }

        /// Mutations of a valid claim (the peer's own, which matches) reach the range checks.
        #[test]
        fn mutated_valid_claims_stay_inside(
            off in 0u64..4096, len in 0u64..4096, word in 0usize..6, value in any::<u64>(),
        ) {
            let mine = [2, off, len, 3, off, len];
            let seg = 8192usize;
            prop_assert_eq!(
                claimed_ranges(&mine, &mine, seg, seg),
                Some(Ranges { input: (off as usize, len as usize), output: (off as usize, len as usize) })
            );
            let mut theirs = mine;
            theirs[word] = value;
            if let Some(r) = claimed_ranges(&mine, &theirs, seg, seg) {
                prop_assert!(r.input.0 + r.input.1 <= seg && r.output.0 + r.output.1 <= seg);
            }
        }

        /// A gathered record's names: arbitrary bytes give a segment name of the expected form
        /// or none, never a path outside /dev/shm.
        #[test]
        fn record_names_are_tutti_segments_or_none(r in proptest::collection::vec(any::<u8>(), 0..NAME)) {
            if let Some(n) = record_name(&r) {
                prop_assert!(n.starts_with("/tutti-") && !n[1..].contains('/') && !n.contains('\0'));
            }
        }

        /// Arbitrary gathered records: the threshold is one of the two, whatever a peer wrote.
        #[test]
        fn min_bytes_of_arbitrary_records(r in proptest::collection::vec(any::<u8>(), 0..4 * RECORD)) {
            let m = min_bytes(&r);
            prop_assert!(m == MIN_BYTES || m == MIN_BYTES_SHARING_CORES);
        }
    }
}
