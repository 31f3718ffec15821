//! Shared-memory rings between two processes on one host.
//!
//! Each direction of a link has a ring of slots in a segment created by the sender under
//! /dev/shm. Every frame to a shared-memory peer goes through its ring, header and payload alike:
//! the sender copies the frame header and the first piece of the payload into a free slot and
//! publishes it, then the rest piece by piece; the receiver checks the header, then copies or
//! reduces straight out of each slot and frees it. No system call is on this path. A receiver
//! that finds its ring empty spins briefly when every rank has a core, then sleeps on a futex in
//! the segment, which the sender wakes only when someone sleeps there. The link's TCP connection
//! stays for what shared memory cannot say: a peer that died (its hang-up) and why a peer gave
//! up (`ABORT` frames).
//!
//! Slots are a chunk each (the communicator's `chunk_bytes`), so a chunk just written by one core
//! is read from the shared cache by the other.
//!
//! Each segment is unlinked as soon as both sides have mapped it: it vanishes when the last of
//! them unmaps it, even when a process is killed, so nothing is left behind in /dev/shm.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;
use std::time::Instant;

use crate::error::{Error, Result, Site};
use crate::transport::wire::HDR;
use crate::transport::RecvMode;

/// Slots per ring.
const SLOTS: usize = 8;
/// Bytes before the first slot: the ring's counters, each side's on its own cache line.
const HEAD: usize = 192;
/// Bytes before a slot's payload: the piece's length, then (first piece of a frame) the frame
/// header; payloads stay 64-byte aligned.
const SLOT_HEAD: usize = 64 + HDR;

/// A ring's counters. The sender writes `head` (slots published), the receiver `tail` (slots
/// freed). `bell` and `sleeping` belong to the process that created the segment: it sleeps on
/// `bell` (a futex) when it waits for its peer, and the peer bumps `bell` after everything the
/// creator may wait for (a slot filled in the creator's receiving ring, a slot freed in its
/// sending ring), making the wake-up system call only when `sleeping` says someone sleeps.
#[repr(C)]
struct Counters {
    head: AtomicU64,
    _p0: [u8; 56],
    tail: AtomicU64,
    _p1: [u8; 56],
    aborted: AtomicU32,
    bell: AtomicU32,
    sleeping: AtomicU32,
}

pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a futex wait on a word of a shared mapping (not FUTEX_PRIVATE: the waker is
    // another process); a spurious or early return is handled by the caller's loop.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        )
    };
}

pub(super) fn futex_wake(word: &AtomicU32) {
    // SAFETY: waking the waiters of a word of a shared mapping.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        )
    };
}

/// A mapped segment.
pub(super) struct Segment {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory accessed through atomics (counters) and through slots
// handed over by the ring protocol.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn shm_error(what: &str) -> Error {
    Error::io(
        format!("shared memory: {what}"),
        std::io::Error::last_os_error(),
    )
}

impl Segment {
    /// Map `name` (`create`: a new segment of `len` bytes; else an existing one, which must hold
    /// at least `len` bytes: touching a mapping past its file's end would be a SIGBUS).
    pub(super) fn map(name: &str, len: usize, create: bool) -> Result<Segment> {
        let cname = std::ffi::CString::new(name).expect("no NUL in segment names");
        let flags = if create {
            libc::O_CREAT | libc::O_EXCL | libc::O_RDWR
        } else {
            libc::O_RDWR
        };
        // SAFETY: plain syscalls on a name we own; the fd is closed before returning.
        unsafe {
            let fd = libc::shm_open(cname.as_ptr(), flags, 0o600);
            if fd < 0 {
                return Err(shm_error(&format!("opening {name}")));
            }
            let mut st: libc::stat = std::mem::zeroed();
            if !create && (libc::fstat(fd, &mut st) != 0 || (st.st_size as u64) < len as u64) {
                libc::close(fd);
                return Err(Error::config(format!(
                    "shared memory: {name} holds {} bytes where {len} were expected",
                    st.st_size
                )));
            }
            if create && libc::ftruncate(fd, len as libc::off_t) != 0 {
                let e = shm_error(&format!("sizing {name}"));
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
                return Err(e);
            }
            // Reserve the pages now: on a full /dev/shm a sparse segment would fail on first
            // touch, with SIGBUS, in whichever process touched it.
            let err = if create {
                libc::posix_fallocate(fd, 0, len as libc::off_t)
            } else {
                0
            };
            if err != 0 {
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
                return Err(Error::io(
                    format!("shared memory: reserving {len} bytes for {name} (is /dev/shm full?)"),
                    std::io::Error::from_raw_os_error(err),
                ));
            }
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            if p == libc::MAP_FAILED {
                if create {
                    libc::shm_unlink(cname.as_ptr());
                }
                return Err(shm_error(&format!("mapping {name}")));
            }
            Ok(Segment { ptr: p.cast(), len })
        }
    }

    pub(super) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    fn counters(&self) -> &Counters {
        // SAFETY: the segment starts with the counters (zeroed by ftruncate).
        unsafe { &*(self.ptr as *const Counters) }
    }
}

/// One ring: `slot` bytes of payload per slot.
struct Ring {
    seg: Segment,
    slot: usize,
}

impl Ring {
    /// Slot `i`: its piece length, its frame header and its payload.
    fn slot_ptr(&self, i: u64) -> (*mut u64, *mut u8, *mut u8) {
        let base = HEAD + (i as usize % SLOTS) * (SLOT_HEAD + self.slot);
        // SAFETY: inside the mapping (its length is HEAD + SLOTS * (SLOT_HEAD + slot)).
        unsafe {
            (
                self.seg.ptr.add(base).cast(),
                self.seg.ptr.add(base + 64),
                self.seg.ptr.add(base + SLOT_HEAD),
            )
        }
    }
}

/// Both directions of a link through shared memory.
pub(crate) struct ShmLink {
    tx: Ring,
    rx: Ring,
    /// The peer's segment name: unlinked again when the link goes, in case the peer died
    /// before it could (unlinking a name twice is harmless; names are unique).
    peer_name: String,
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        unlink(&self.peer_name);
    }
}

/// The PID namespace of this process (the inode of `/proc/self/ns/pid`), which every segment
/// name carries: a PID means something only inside its namespace, and ranks in two containers
/// of one pod share `/dev/shm` but not their PIDs. None where it cannot be read.
pub(super) fn pid_namespace() -> Option<u64> {
    static NS: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *NS.get_or_init(|| {
        let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
        let link = link.to_str()?;
        link.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
    })
}

/// The name of this process's segment towards `peer`: `/tutti-N<namespace>-<pid>-<rank>-<peer>-<tag>`.
pub(super) fn segment_name(rank: usize, peer: usize, tag: &str) -> String {
    format!(
        "/tutti-N{}-{}-{rank}-{peer}-{tag}",
        pid_namespace().unwrap_or(0),
        std::process::id()
    )
}

/// The name of this process's segment of shared buffer `id`:
/// `/tutti-N<namespace>-<pid>-<rank>-b<id>-<tag>` (`ctl` for the control page's).
pub(super) fn buffer_name(rank: usize, id: &str, tag: &str) -> String {
    format!(
        "/tutti-N{}-{}-{rank}-b{id}-{tag}",
        pid_namespace().unwrap_or(0),
        std::process::id()
    )
}

/// The creator of a segment, from its name under /dev/shm: (PID namespace, PID).
pub(super) fn segment_owner(name: &str) -> Option<(u64, u32)> {
    let mut parts = name.strip_prefix("tutti-N")?.split('-');
    let ns = parts.next()?.parse().ok()?;
    let pid = parts.next()?.parse().ok()?;
    Some((ns, pid))
}

/// The segments under /dev/shm whose creator is known to be gone: created in this process's
/// PID namespace by a PID that no longer exists. A segment of another namespace (another
/// container sharing /dev/shm) is never counted: its PID cannot be looked up from here.
pub(crate) fn dead_segments() -> Vec<String> {
    let (Some(mine), Ok(dir)) = (pid_namespace(), std::fs::read_dir("/dev/shm")) else {
        return Vec::new();
    };
    dir.flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| {
            segment_owner(name).is_some_and(|(ns, pid)| {
                ns == mine && !std::path::Path::new(&format!("/proc/{pid}")).exists()
            })
        })
        .collect()
}

/// Unlink the segments of processes that are gone ([`dead_segments`]): what a process killed
/// in the moment between creating its segment and its peer mapping it leaves behind. Segments
/// of live processes, and of other PID namespaces, are never touched.
pub(crate) fn sweep_dead() {
    for name in dead_segments() {
        unlink(&format!("/{name}"));
    }
}

pub(super) fn unlink(name: &str) {
    let c = std::ffi::CString::new(name).expect("no NUL in segment names");
    // SAFETY: plain syscall.
    unsafe { libc::shm_unlink(c.as_ptr()) };
}

impl ShmLink {
    /// Set up the link over the (still blocking) connection to `peer`.
    pub(crate) fn open(
        sock: &TcpStream,
        rank: usize,
        peer: usize,
        chunk_bytes: usize,
        timeout: Duration,
    ) -> Result<ShmLink> {
        let io =
            |e: std::io::Error| Error::io(format!("setting up shared memory with rank {peer}"), e);
        let slot = (chunk_bytes.clamp(4096, 16 << 20) / 64) * 64;
        let len = HEAD + SLOTS * (SLOT_HEAD + slot);
        let tag = crate::cluster::auth::nonce()?
            .iter()
            .take(6)
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
        let name = segment_name(rank, peer, &tag);
        sweep_dead();
        let tx = Segment::map(&name, len, true)?;
        let mut peer_name = String::new();
        let result = (|| {
            let mut s = sock;
            s.set_read_timeout(Some(timeout)).map_err(io)?;
            let mut msg = (slot as u64).to_le_bytes().to_vec();
            msg.extend_from_slice(&(name.len() as u32).to_le_bytes());
            msg.extend_from_slice(name.as_bytes());
            s.write_all(&msg).map_err(io)?;
            let mut h = [0u8; 12];
            s.read_exact(&mut h).map_err(io)?;
            let their_slot = u64::from_le_bytes(h[..8].try_into().expect("8 bytes")) as usize;
            let n = u32::from_le_bytes(h[8..].try_into().expect("4 bytes")) as usize;
            if n > 255 || their_slot != slot {
                return Err(Error::config(format!(
                    "rank {peer} uses shared-memory slots of {their_slot} bytes, this rank {slot}: set the same chunk size everywhere"
                )));
            }
            let mut theirs = vec![0u8; n];
            s.read_exact(&mut theirs).map_err(io)?;
            peer_name = String::from_utf8_lossy(&theirs).into_owned();
            if !peer_name.starts_with("/tutti-") || peer_name[1..].contains('/') {
                return Err(Error::config(format!(
                    "rank {peer} named a shared-memory segment '{peer_name}' that is not tutti's"
                )));
            }
            let rx = Segment::map(&peer_name, len, false)?;
            // Both mapped: the names can go.
            s.write_all(&[1]).map_err(io)?;
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack).map_err(io)?;
            s.set_read_timeout(None).map_err(io)?;
            Ok(rx)
        })();
        unlink(&name);
        let rx = result.inspect_err(|_| {
            if !peer_name.is_empty() {
                unlink(&peer_name);
            }
        })?;
        Ok(ShmLink {
            tx: Ring { seg: tx, slot },
            rx: Ring { seg: rx, slot },
            peer_name,
        })
    }

    fn aborted_error(&self, site: Site, peer: usize) -> Result<bool> {
        if self.rx.seg.counters().aborted.load(Ordering::Acquire) != 0 {
            return Err(Error::Aborted {
                rank: site.rank,
                reason: format!("rank {peer} aborted the shared-memory link"),
            });
        }
        Ok(false)
    }

    /// Put as much of a frame into free slots as there is room for: its header `hdr` with the
    /// first piece (while `*hoff < HDR`), then `data[*off..]`. True if any moved.
    pub(crate) fn push(
        &self,
        site: Site,
        peer: usize,
        hdr: &[u8; HDR],
        hoff: &mut usize,
        data: &[u8],
        off: &mut usize,
    ) -> Result<bool> {
        self.aborted_error(site, peer)?;
        let c = self.tx.seg.counters();
        let mut head = c.head.load(Ordering::Relaxed);
        let mut moved = false;
        while (*hoff < HDR || *off < data.len())
            && head - c.tail.load(Ordering::Acquire) < SLOTS as u64
        {
            let n = (data.len() - *off).min(self.tx.slot);
            let (len, frame, payload) = self.tx.slot_ptr(head);
            // SAFETY: the slot is free (the receiver has moved past it) and ours to fill.
            unsafe {
                if *hoff < HDR {
                    std::ptr::copy_nonoverlapping(hdr.as_ptr(), frame, HDR);
                }
                std::ptr::copy_nonoverlapping(data[*off..].as_ptr(), payload, n);
                len.write_volatile(n as u64);
            }
            head += 1;
            c.head.store(head, Ordering::SeqCst);
            *hoff = HDR;
            *off += n;
            moved = true;
        }
        if moved {
            self.ring_peer();
        }
        Ok(moved)
    }

    /// Copy the header of the frame at the front of the ring into `hdr`; a frame without a
    /// payload is taken off the ring with it. True when a frame was there.
    pub(crate) fn peek_header(&self, site: Site, peer: usize, hdr: &mut [u8; HDR]) -> Result<bool> {
        let c = self.rx.seg.counters();
        let tail = c.tail.load(Ordering::Relaxed);
        if tail == c.head.load(Ordering::Acquire) {
            return self.aborted_error(site, peer);
        }
        let (len, frame, _) = self.rx.slot_ptr(tail);
        // SAFETY: the sender published this slot (Acquire above) and does not touch it until we
        // advance the tail.
        unsafe {
            std::ptr::copy_nonoverlapping(frame as *const u8, hdr.as_mut_ptr(), HDR);
            if len.read_volatile() == 0 {
                c.tail.store(tail + 1, Ordering::SeqCst);
                self.ring_peer();
            }
        }
        Ok(true)
    }

    /// Consume filled slots into `dst[*off..]`, copying or reducing. True if any moved.
    pub(crate) fn pull(
        &self,
        site: Site,
        peer: usize,
        dst: &mut [u8],
        mode: RecvMode<'_>,
        off: &mut usize,
    ) -> Result<bool> {
        let c = self.rx.seg.counters();
        let mut tail = c.tail.load(Ordering::Relaxed);
        let mut moved = false;
        while *off < dst.len() && tail < c.head.load(Ordering::Acquire) {
            let (len, _, payload) = self.rx.slot_ptr(tail);
            // SAFETY: the sender published this slot (Acquire above) and does not touch it until
            // we advance the tail.
            let n = unsafe { len.read_volatile() } as usize;
            // A reducing receive combines whole elements: every piece holds some (slots are
            // multiples of 64 bytes, and a frame a whole number of elements).
            let partial = mode.combined().is_some_and(|d| n % d.size() != 0);
            if n == 0 || n > self.rx.slot || *off + n > dst.len() || partial {
                return Err(Error::invalid(
                    site,
                    format!("rank {peer} wrote a malformed shared-memory slot ({n} bytes)"),
                ));
            }
            let src = unsafe { std::slice::from_raw_parts(payload as *const u8, n) };
            let d = &mut dst[*off..*off + n];
            mode.deliver(d, *off, src);
            tail += 1;
            c.tail.store(tail, Ordering::SeqCst);
            *off += n;
            moved = true;
        }
        if moved {
            self.ring_peer();
        } else if *off < dst.len() {
            self.aborted_error(site, peer)?;
        }
        Ok(moved)
    }

    /// Wake the peer if it sleeps on this link (its bell is in the segment it created: the one
    /// this side receives from).
    #[inline]
    fn ring_peer(&self) {
        let c = self.rx.seg.counters();
        c.bell.fetch_add(1, Ordering::SeqCst);
        if c.sleeping.load(Ordering::SeqCst) != 0 {
            futex_wake(&c.bell);
        }
    }

    /// Whether a frame or piece waits to be received (`filled`), a slot is free to send into
    /// (`free`), or the link was aborted.
    pub(crate) fn ready(&self, filled: bool, free: bool) -> bool {
        let rx = self.rx.seg.counters();
        let tx = self.tx.seg.counters();
        rx.aborted.load(Ordering::SeqCst) != 0
            || (filled && rx.head.load(Ordering::SeqCst) > rx.tail.load(Ordering::SeqCst))
            || (free
                && tx.head.load(Ordering::SeqCst) - tx.tail.load(Ordering::SeqCst) < SLOTS as u64)
    }

    /// Sleep until [`ShmLink::ready`] would say so, the peer or [`ShmLink::wake_all`] rings, or
    /// `until` passes.
    pub(crate) fn sleep(&self, filled: bool, free: bool, until: Instant) {
        let c = self.tx.seg.counters();
        c.sleeping.store(1, Ordering::SeqCst);
        let seen = c.bell.load(Ordering::SeqCst);
        let left = until.saturating_duration_since(Instant::now());
        if !self.ready(filled, free) && !left.is_zero() {
            futex_wait(&c.bell, seen, left);
        }
        c.sleeping.store(0, Ordering::SeqCst);
    }

    /// Wake whoever sleeps on this link, on either side.
    pub(crate) fn wake_all(&self) {
        for c in [self.tx.seg.counters(), self.rx.seg.counters()] {
            c.bell.fetch_add(1, Ordering::SeqCst);
            futex_wake(&c.bell);
        }
    }

    /// Mark both rings aborted so the peer stops at once.
    pub(crate) fn abort(&self) {
        self.tx.seg.counters().aborted.store(1, Ordering::SeqCst);
        self.rx.seg.counters().aborted.store(1, Ordering::SeqCst);
        self.wake_all();
    }
}
