//! Shared-memory payload rings between two processes on one host.
//!
//! Each direction of a link has a ring of slots in a segment created by the sender under
//! /dev/shm. The frame headers still travel on the link's TCP connection (ordering, liveness and
//! `ABORT` frames); the payload of a `DATA` frame goes through the ring: the sender copies a
//! chunk into a free slot and publishes it, the receiver copies or reduces straight out of the
//! slot and frees it. Slots are a chunk each (the communicator's `chunk_bytes`), so a chunk just
//! written by one core is read from the shared cache by the other.
//!
//! Each segment is unlinked as soon as both sides have mapped it: it vanishes when the last of
//! them unmaps it, even when a process is killed, so nothing is left behind in /dev/shm.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::dtype::kernels::{self, Init};
use crate::error::{Error, Result, Site};
use crate::transport::RecvMode;

/// Slots per ring.
const SLOTS: usize = 8;
/// Bytes before the first slot: the ring's counters, each on its own cache line.
const HEAD: usize = 192;
/// Bytes before a slot's payload (its length), keeping payloads 64-byte aligned.
const SLOT_HEAD: usize = 64;

#[repr(C)]
struct Counters {
    head: AtomicU64,
    _p0: [u8; 56],
    tail: AtomicU64,
    _p1: [u8; 56],
    aborted: AtomicU32,
}

/// A mapped segment.
struct Segment {
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
    fn map(name: &str, len: usize, create: bool) -> Result<Segment> {
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
            if create && libc::ftruncate(fd, len as libc::off_t) != 0 {
                let e = shm_error(&format!("sizing {name}"));
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
                return Err(e);
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
    fn slot_ptr(&self, i: u64) -> (*mut u64, *mut u8) {
        let base = HEAD + (i as usize % SLOTS) * (SLOT_HEAD + self.slot);
        // SAFETY: inside the mapping (its length is HEAD + SLOTS * (SLOT_HEAD + slot)).
        unsafe {
            (
                self.seg.ptr.add(base).cast(),
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

/// Unlink the segments of processes that are gone (`/dev/shm/tutti-PID-...` whose PID no
/// longer exists): what a process killed in the moment between creating its segment and its
/// peer mapping it leaves behind. Segments of live processes are never touched.
pub(crate) fn sweep_dead() {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix("tutti-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                unlink(&format!("/{name}"));
            }
        }
    }
}

fn unlink(name: &str) {
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
        let name = format!("/tutti-{}-{rank}-{peer}-{tag}", std::process::id());
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

    fn check(&self, site: Site, peer: usize) -> Result<()> {
        if self.rx.seg.counters().aborted.load(Ordering::Acquire) != 0 {
            return Err(Error::Aborted {
                rank: site.rank,
                reason: format!("rank {peer} aborted the shared-memory link"),
            });
        }
        Ok(())
    }

    /// Copy as much of `data[*off..]` into free slots as there is room for. True if any moved.
    pub(crate) fn push(
        &self,
        site: Site,
        peer: usize,
        data: &[u8],
        off: &mut usize,
    ) -> Result<bool> {
        self.check(site, peer)?;
        let c = self.tx.seg.counters();
        let mut head = c.head.load(Ordering::Relaxed);
        let mut moved = false;
        while *off < data.len() && head - c.tail.load(Ordering::Acquire) < SLOTS as u64 {
            let n = (data.len() - *off).min(self.tx.slot);
            let (len, payload) = self.tx.slot_ptr(head);
            // SAFETY: the slot is free (the receiver has moved past it) and ours to fill.
            unsafe {
                std::ptr::copy_nonoverlapping(data[*off..].as_ptr(), payload, n);
                len.write_volatile(n as u64);
            }
            head += 1;
            c.head.store(head, Ordering::Release);
            *off += n;
            moved = true;
        }
        Ok(moved)
    }

    /// Consume the filled slots into `dst[*off..]`, copying or reducing. True if any moved.
    pub(crate) fn pull(
        &self,
        site: Site,
        peer: usize,
        dst: &mut [u8],
        mode: RecvMode,
        off: &mut usize,
    ) -> Result<bool> {
        self.check(site, peer)?;
        let c = self.rx.seg.counters();
        let mut tail = c.tail.load(Ordering::Relaxed);
        let mut moved = false;
        while *off < dst.len() && tail < c.head.load(Ordering::Acquire) {
            let (len, payload) = self.rx.slot_ptr(tail);
            // SAFETY: the sender published this slot (Acquire above) and does not touch it until
            // we advance the tail.
            let n = unsafe { len.read_volatile() } as usize;
            if n > self.rx.slot || *off + n > dst.len() {
                return Err(Error::invalid(
                    site,
                    format!("rank {peer} wrote a malformed shared-memory slot ({n} bytes)"),
                ));
            }
            let src = unsafe { std::slice::from_raw_parts(payload as *const u8, n) };
            let d = &mut dst[*off..*off + n];
            match mode {
                RecvMode::Copy => d.copy_from_slice(src),
                RecvMode::Reduce(dtype, op) => {
                    kernels::reduce(dtype, op, d, &[src], Init::Accumulate, None)
                }
            }
            tail += 1;
            c.tail.store(tail, Ordering::Release);
            *off += n;
            moved = true;
        }
        Ok(moved)
    }

    /// Mark both rings aborted so the peer stops at once.
    pub(crate) fn abort(&self) {
        self.tx.seg.counters().aborted.store(1, Ordering::Release);
        self.rx.seg.counters().aborted.store(1, Ordering::Release);
    }
}
