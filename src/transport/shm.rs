//! Shared-memory rings between two processes on one host.
//!
//! Each direction of a link has a ring of slots in a segment created by the sender. Every frame
//! to a shared-memory peer goes through its ring, header and payload alike: the sender copies the
//! frame header and the first piece of the payload into a free slot and publishes it, then the
//! rest piece by piece; the receiver checks the header, then copies or reduces straight out of
//! each slot and frees it. No system call is on this path.
//!
//! A slot is published by its stamp (the piece's ring position and length, in one word on the
//! slot's first cache line), then by the ring's head; the receiver looks at the stamp of the
//! slot it waits for, and a frame's first piece of at most [`INLINE`] bytes lies on that line
//! too, so a small message crosses between the cores in the lines the receiver reads anyway.
//! The sender reads the receiver's tail only once its own view of it leaves no slot free. A receiver that finds its ring empty
//! spins briefly when every rank has a core, then sleeps on a futex in the segment, which the
//! sender wakes only when someone sleeps there. The link's TCP connection stays for what shared
//! memory cannot say: a peer that died (its hang-up) and why a peer gave up (`ABORT` frames).
//!
//! Slots are a chunk each (the communicator's `chunk_bytes`), so a chunk just written by one core
//! is read from the shared cache by the other; on a host of many ranks they are smaller, so that
//! the host's rings fit a budget ([`ring_chunk`]).
//!
//! A link's segments are sealed memfds (`memfd_create`, then `F_SEAL_SHRINK | F_SEAL_GROW |
//! F_SEAL_SEAL` once sized and its pages reserved): no process, the creator included, can shrink
//! one under the other's mapping, which would make the next touch of it a SIGBUS. They are handed
//! over through a Unix socket under /dev/shm (`SCM_RIGHTS`), which the ranks of one host reach
//! whatever PID namespaces they run in, as long as they share /dev/shm (as shared
//! memory always required): the lower rank binds it and sends its name and a random key over the
//! link's authenticated TCP connection, the higher rank connects and sends the key with its
//! segment, and gets the lower rank's back. The receiver maps a segment only once it has seen
//! the seals, the size and the reserved pages; a memfd vanishes with its last mapping, so nothing
//! is left behind, even when a process is killed (a socket left by a process killed while setting
//! up goes with the next sweep).
//!
//! Nothing a peer writes into the shared pages is trusted: each side keeps its own position in
//! its ring in private memory, reads only the position the peer publishes (and a slot's stamp),
//! and checks it against its own (a receiver takes only the stamp of the position it waits for,
//! and sees at most every slot filled; a sender sees the receiver free only slots that it
//! filled, never go back); a piece's length is checked against the slot and the receive. A peer that breaks the protocol is an error naming it, not a panic or a stall.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;
use std::time::Instant;

use crate::error::{Error, Result, Site};
use crate::transport::wire::HDR;
use crate::transport::RecvMode;

/// Slots per ring.
const SLOTS: usize = 8;
/// A receiver waiting for a piece checks the sender's head at every this many looks (see
/// `ShmLink::front`).
const LOOK_AT_HEAD: u32 = 64;
/// Bytes before the first slot: the ring's counters, each side's on its own cache line.
const HEAD: usize = 192;
/// Bytes before a slot's payload: its stamp (the piece's position in the ring and length), then
/// (first piece of a frame) the frame header; payloads stay 64-byte aligned.
const SLOT_HEAD: usize = 64 + HDR;
/// The most payload bytes a frame's first piece carries on the stamp's cache line, right after
/// the stamp, instead of past the header: a small message then crosses between the cores in two
/// cache lines (stamp and payload, header), not three.
const INLINE: usize = 56;

/// Bytes of the shared-memory rings of one host, every ordered pair of its ranks together
/// (each rank sends to every other through a ring of its own): past it, rings take smaller
/// slots, down to 4 KiB, so that many ranks on one host do not exhaust its memory (128 ranks
/// with full rings would hold 32 GiB). At the 4 KiB floor the rings pass it from about 180
/// ranks a host (2.2 GB at 256, 8.6 GB at 512).
const HOST_RING_BUDGET: usize = 2 << 30;

/// The slot size to ask of [`ShmLink::open`] where `local` ranks share this host: `chunk_bytes`,
/// or less where the host's rings would pass [`HOST_RING_BUDGET`]. Every rank of the host
/// computes the same.
pub(crate) fn ring_chunk(chunk_bytes: usize, local: usize) -> usize {
    let rings = local.saturating_mul(local.saturating_sub(1)).max(1);
    let fit = (HOST_RING_BUDGET / rings / SLOTS).saturating_sub(SLOT_HEAD);
    chunk_bytes.min(fit.max(4096))
}

/// A ring's counters. The sender writes `head` (slots published), the receiver `tail` (slots
/// freed). `bell` and `sleeping` belong to the process that created the segment: it sleeps on
/// `bell` (a futex) when it waits for its peer, and the peer, after everything the creator may
/// wait for (a slot filled in the creator's receiving ring, a slot freed in its sending ring),
/// bumps `bell` and makes the wake-up system call when `sleeping` says the creator sleeps (see
/// `ShmLink::ring_peer`).
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

/// The seals of a link's segment: neither its creator nor its peer can change its size, or
/// the seals, once it is sized.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// What a segment handed over by a peer must be before it is mapped, from its file's
/// `F_GET_SEALS` (`seals`, -1 where the call failed: not a memfd), `fstatfs` type, `fstat`
/// size and 512-byte blocks, against the `len` bytes the mapping will touch. The reason it is
/// refused, if it is.
pub(super) fn check_segment(
    seals: libc::c_int,
    fs_type: i64,
    size: i64,
    blocks: i64,
    len: usize,
) -> std::result::Result<(), String> {
    let tmpfs: i64 = libc::TMPFS_MAGIC as _;
    if seals < 0 || fs_type != tmpfs {
        return Err("it is not a memfd of ordinary memory (a file, or huge pages)".into());
    }
    if seals & SEALS != SEALS {
        return Err(format!(
            "it is not sealed against shrinking and growing (seals {seals:#x})"
        ));
    }
    if size < 0 || (size as u64) < len as u64 {
        return Err(format!("it holds {size} bytes where {len} are needed"));
    }
    // Pages not reserved would be allocated on first touch, which can fail with SIGBUS.
    if blocks < 0 || (blocks as u64).saturating_mul(512) < len as u64 {
        return Err(format!(
            "its pages are not reserved ({} of {len} bytes)",
            (blocks.max(0) as u64).saturating_mul(512)
        ));
    }
    Ok(())
}

impl Segment {
    /// Map `name` (`create`: a new segment of `len` bytes; else an existing one, which must hold
    /// at least `len` bytes: touching a mapping past its file's end would be a SIGBUS).
    ///
    /// A segment opened by name can still be shrunk by whoever else can open it, after it is
    /// mapped: links use [`Segment::create_sealed`] and [`Segment::map_sealed`] instead.
    pub(super) fn map(name: &str, len: usize, create: bool) -> Result<Segment> {
        let cname = std::ffi::CString::new(name).map_err(|_| {
            Error::config(format!(
                "shared memory: the segment name {:?} holds a NUL byte",
                name.escape_debug().to_string()
            ))
        })?;
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

    /// A new anonymous segment of `len` bytes (a memfd), its pages reserved, sealed against
    /// any change of size, and mapped; with its file, to hand to the peer.
    pub(super) fn create_sealed(len: usize) -> Result<(Segment, OwnedFd)> {
        // SAFETY: plain syscalls; the fd is owned at once.
        let fd = unsafe {
            let fd = libc::memfd_create(
                c"tutti-ring".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            );
            if fd < 0 {
                return Err(shm_error("creating a memfd for a ring"));
            }
            OwnedFd::from_raw_fd(fd)
        };
        let raw = fd.as_raw_fd();
        // SAFETY: plain syscalls on our own fd.
        unsafe {
            if libc::ftruncate(raw, len as libc::off_t) != 0 {
                return Err(shm_error(&format!("sizing a ring of {len} bytes")));
            }
            // Reserve the pages now: a page allocated on first touch can fail with SIGBUS.
            let err = libc::posix_fallocate(raw, 0, len as libc::off_t);
            if err != 0 {
                return Err(Error::io(
                    format!("shared memory: reserving {len} bytes for a ring"),
                    std::io::Error::from_raw_os_error(err),
                ));
            }
            if libc::fcntl(raw, libc::F_ADD_SEALS, SEALS) != 0 {
                return Err(shm_error("sealing a ring"));
            }
        }
        let seg =
            Segment::mmap(&fd, len).map_err(|e| Error::io("shared memory: mapping a ring", e))?;
        Ok((seg, fd))
    }

    /// Map the segment `fd` that `whose` (`rank N`) handed over, once it is seen to be a
    /// sealed memfd of at least `len` bytes with its pages reserved: nobody can then shrink it
    /// under the mapping.
    pub(super) fn map_sealed(fd: &OwnedFd, len: usize, whose: &str) -> Result<Segment> {
        let raw = fd.as_raw_fd();
        // SAFETY: plain syscalls on a descriptor we own, into zeroed structs.
        let (seals, fs_type, st) = unsafe {
            let seals = libc::fcntl(raw, libc::F_GET_SEALS);
            let mut fs: libc::statfs = std::mem::zeroed();
            let fs_type = if libc::fstatfs(raw, &mut fs) == 0 {
                fs.f_type as i64
            } else {
                0
            };
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(raw, &mut st) != 0 {
                st.st_size = -1;
            }
            (seals, fs_type, st)
        };
        let (size, blocks): (i64, i64) = (st.st_size as _, st.st_blocks as _);
        check_segment(seals, fs_type, size, blocks, len).map_err(|why| {
            Error::config(format!(
                "shared memory: {whose} handed over a segment that cannot be mapped safely: {why}"
            ))
        })?;
        Segment::mmap(fd, len)
            .map_err(|e| Error::io(format!("shared memory: mapping the segment of {whose}"), e))
    }

    fn mmap(fd: &OwnedFd, len: usize) -> std::io::Result<Segment> {
        // SAFETY: a new shared mapping of a file whose size was checked or set.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Segment { ptr: p.cast(), len })
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
    /// Slot `i`: its stamp, its frame header and its payload (a frame's first piece of at most
    /// [`INLINE`] bytes, `inline`: right after the stamp).
    fn slot_ptr(&self, i: u64, inline: bool) -> (&AtomicU64, *mut u8, *mut u8) {
        let base = HEAD + (i as usize % SLOTS) * (SLOT_HEAD + self.slot);
        // SAFETY: inside the mapping (its length is HEAD + SLOTS * (SLOT_HEAD + slot)); the
        // stamp is 64-byte aligned (the mapping, HEAD and the slot stride are), and lives as
        // long as the ring's segment.
        unsafe {
            (
                &*self.seg.ptr.add(base).cast::<AtomicU64>(),
                self.seg.ptr.add(base + 64),
                self.seg
                    .ptr
                    .add(if inline { base + 8 } else { base + SLOT_HEAD }),
            )
        }
    }
}

/// The bit of a stamp's length word that says the piece lies on the stamp's line
/// ([`INLINE`]).
const INLINED: u64 = 1 << 31;

/// A slot's stamp once it holds the piece at ring position `i` (counting from 0) of `n` bytes
/// (under 2^31), `inline` or not: the position's low 32 bits plus one (0 at the first lap,
/// what a fresh slot holds, never matches) above the length and the inline bit.
fn stamp(i: u64, n: usize, inline: bool) -> u64 {
    (i.wrapping_add(1) & 0xffff_ffff) << 32 | n as u64 | if inline { INLINED } else { 0 }
}

/// The length of the piece a slot's stamp `word` says it holds at position `i`, and whether it
/// lies on the stamp's line, if it says so.
fn stamped(word: u64, i: u64) -> Option<(usize, bool)> {
    (word >> 32 == i.wrapping_add(1) & 0xffff_ffff)
        .then_some(((word & (INLINED - 1)) as usize, word & INLINED != 0))
}

/// The slots of a receiving ring that hold pieces, as far as the head says: the sender's
/// published `head` against this side's own `tail`. None where no sender keeping to the
/// protocol could have published it (more than one behind the tail, or more than the ring ahead
/// of it).
pub(super) fn filled_slots(head: u64, tail: u64) -> Option<u64> {
    // A sender stamps a slot before it publishes the head past it, and a receiver may take the
    // stamped piece meanwhile: the head then trails the tail by one.
    if tail.checked_sub(1) == Some(head) {
        return Some(0);
    }
    head.checked_sub(tail).filter(|&n| n <= SLOTS as u64)
}

/// The free slots of a sending ring: this side's own `head`, the receiver's tail as last seen
/// (`seen`) and as published now (`tail`). None where no receiver keeping to the protocol could
/// have published it (back from what it published before, or past the slots filled).
pub(super) fn free_slots(head: u64, seen: u64, tail: u64) -> Option<u64> {
    (seen <= tail && tail <= head).then(|| (SLOTS as u64).saturating_sub(head - tail))
}

/// Both directions of a link through shared memory. The positions this side owns live here,
/// never read back from the shared pages, which the peer can write.
pub(crate) struct ShmLink {
    tx: Ring,
    rx: Ring,
    /// Slots published into `tx`.
    tx_head: AtomicU64,
    /// The receiver's tail of `tx` as last seen (checked).
    tx_seen: AtomicU64,
    /// Slots freed in `rx`.
    rx_tail: AtomicU64,
    /// Looks at the front of `rx` that found no piece (see [`ShmLink::front`]).
    rx_misses: AtomicU32,
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

/// Unlink the segments and sockets of processes that are gone ([`dead_segments`]): what a
/// process killed in the moment between creating one and its peer taking it leaves behind. Segments
/// of live processes, and of other PID namespaces, are never touched.
pub(crate) fn sweep_dead() {
    for name in dead_segments() {
        unlink(&format!("/{name}"));
    }
}

/// Unlink `name` under /dev/shm (nothing where it cannot be a name).
pub(super) fn unlink(name: &str) {
    let Ok(c) = std::ffi::CString::new(name) else {
        return;
    };
    // SAFETY: plain syscall.
    unsafe { libc::shm_unlink(c.as_ptr()) };
}

/// Where the sockets that hand segments over are bound: /dev/shm, which processes sharing
/// shared memory share.
const SOCKET_DIR: &str = "/dev/shm";
/// The first bytes of a link-setup message (version 2: segments handed over as memfds).
const MAGIC: [u8; 4] = *b"TSM2";
/// Bytes of a setup message before the socket's name: magic, slot size, name length.
const SETUP_HEAD: usize = 16;
/// Bytes of the key that a connection to a link's socket must present.
const KEY: usize = 16;
/// The longest socket name taken from a peer (with /dev/shm in front, it fits a Unix socket
/// address's 108 bytes).
const MAX_NAME: usize = 96;

/// A link-setup message, sent over the link's TCP connection by both sides: the slot size, and
/// from the lower rank, the name of its socket under /dev/shm and the key to present there
/// (the higher rank sends no name and a zero key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Setup {
    pub(super) slot: u64,
    pub(super) socket: Option<String>,
    pub(super) key: [u8; KEY],
}

impl Setup {
    pub(super) fn encode(&self) -> Vec<u8> {
        let name = self.socket.as_deref().unwrap_or("").as_bytes();
        let mut msg = Vec::with_capacity(SETUP_HEAD + name.len() + KEY);
        msg.extend_from_slice(&MAGIC);
        msg.extend_from_slice(&self.slot.to_le_bytes());
        msg.extend_from_slice(&(name.len() as u32).to_le_bytes());
        msg.extend_from_slice(name);
        msg.extend_from_slice(&self.key);
        msg
    }
}

/// The bytes of `peer`'s setup message that follow its first [`SETUP_HEAD`] (`head`): at most
/// [`MAX_NAME`] + [`KEY`].
pub(super) fn setup_rest(peer: usize, head: &[u8]) -> Result<usize> {
    if head.len() < SETUP_HEAD || head[..4] != MAGIC {
        return Err(Error::config(format!(
            "rank {peer} sent a shared-memory setup message this rank cannot read (another tutti version?)"
        )));
    }
    let n = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes")) as usize;
    if n > MAX_NAME {
        return Err(Error::config(format!(
            "rank {peer} sent a shared-memory socket name of {n} bytes (at most {MAX_NAME})"
        )));
    }
    Ok(n + KEY)
}

/// `peer`'s whole setup message, checked: its name (if any) is one of tutti's sockets under
/// /dev/shm ([`check_name`]).
pub(super) fn parse_setup(peer: usize, msg: &[u8]) -> Result<Setup> {
    let rest = setup_rest(peer, msg)?;
    if msg.len() != SETUP_HEAD + rest {
        return Err(Error::config(format!(
            "rank {peer} sent a shared-memory setup message of {} bytes where {} were announced",
            msg.len(),
            SETUP_HEAD + rest
        )));
    }
    let slot = u64::from_le_bytes(msg[4..12].try_into().expect("8 bytes"));
    let name = &msg[SETUP_HEAD..msg.len() - KEY];
    let socket = if name.is_empty() {
        None
    } else {
        Some(check_name(peer, name)?)
    };
    let key = msg[msg.len() - KEY..].try_into().expect("KEY bytes");
    Ok(Setup { slot, socket, key })
}

/// A name `peer` sent for something of its own under /dev/shm: `/tutti-` and then letters,
/// digits, `.`, `_` and `-` only (no NUL, no `/`), at most [`MAX_NAME`] bytes.
pub(super) fn check_name(peer: usize, name: &[u8]) -> Result<String> {
    let ok = name.len() <= MAX_NAME
        && name.len() > 7
        && name.starts_with(b"/tutti-")
        && name[1..]
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !ok {
        let shown: String = String::from_utf8_lossy(&name[..name.len().min(MAX_NAME)])
            .escape_debug()
            .collect();
        return Err(Error::config(format!(
            "rank {peer} named a shared-memory socket \"{shown}\" that is not tutti's"
        )));
    }
    Ok(String::from_utf8(name.to_vec()).expect("ASCII"))
}

/// The time left until `deadline`, never zero (a zero socket timeout means none).
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// Read exactly `buf.len()` bytes by `deadline` (the bound holds however the peer spreads
/// them out).
fn read_by(mut s: &TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        if Instant::now() >= deadline {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left(deadline)))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Send `data` with the descriptor `fd` attached (`SCM_RIGHTS`).
fn send_with_fd(s: &UnixStream, data: &[u8], fd: &OwnedFd) -> std::io::Result<()> {
    let raw = fd.as_raw_fd();
    // SAFETY: a msghdr over our own buffers, one SCM_RIGHTS message of one fd built with the
    // CMSG macros inside a buffer of CMSG_SPACE bytes.
    unsafe {
        let space = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as usize;
        let mut control = vec![0u8; space];
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), raw);
        loop {
            let n = libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            // A Unix stream socket takes a message this small whole or not at all.
            if n as usize != data.len() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    "short write on a Unix socket",
                ));
            }
            return Ok(());
        }
    }
}

/// Read exactly `buf.len()` bytes by `deadline`, with the one descriptor the sender attached
/// (none: `None`). Every descriptor received is owned at once; more than one, or a truncated
/// control message, is an error (and they are closed).
fn recv_with_fd(
    s: &UnixStream,
    buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<Option<OwnedFd>> {
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut got = 0;
    // Room for a few descriptors, so that a sender attaching several is seen to.
    let space = unsafe { libc::CMSG_SPACE(4 * std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    while got < buf.len() {
        if Instant::now() >= deadline {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left(deadline)))?;
        let mut iov = libc::iovec {
            iov_base: buf[got..].as_mut_ptr().cast(),
            iov_len: buf.len() - got,
        };
        // SAFETY: a msghdr over our own buffers; the control messages the kernel wrote are
        // walked with the CMSG macros within msg_controllen, and every fd in them is owned.
        let (n, flags) = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            let n = libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
            if n >= 0 {
                let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
                while !cmsg.is_null() {
                    if (*cmsg).cmsg_level == libc::SOL_SOCKET
                        && (*cmsg).cmsg_type == libc::SCM_RIGHTS
                    {
                        let bytes =
                            ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                        let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                        for i in 0..bytes / std::mem::size_of::<RawFd>() {
                            fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                        }
                    }
                    cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
                }
            }
            (n, msg.msg_flags)
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if flags & libc::MSG_CTRUNC != 0 || fds.len() > 1 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "more than one descriptor attached",
            ));
        }
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n as usize;
    }
    Ok(fds.pop())
}

/// The socket the lower rank of a link binds under /dev/shm; unlinked when dropped.
struct Rendezvous {
    listener: UnixListener,
    path: String,
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Rendezvous {
    fn bind(name: &str) -> std::io::Result<Rendezvous> {
        let path = format!("{SOCKET_DIR}{name}");
        let listener = UnixListener::bind(&path)?;
        let r = Rendezvous { listener, path };
        // Only this user may connect (the key decides who is the peer).
        std::fs::set_permissions(&r.path, std::fs::Permissions::from_mode(0o600))?;
        r.listener.set_nonblocking(true)?;
        Ok(r)
    }

    /// The first connection by `deadline` that presents `key` with one descriptor attached:
    /// the connection and the descriptor. Connections without the key (someone else who found
    /// the socket) are dropped, and the wait goes on. The peer sends nothing on the link's TCP
    /// connection `sock` meanwhile: anything there is its hang-up, after an error of its own.
    fn accept(
        &self,
        sock: &TcpStream,
        peer: usize,
        key: &[u8; KEY],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(UnixStream, OwnedFd)> {
        let late = || Error::JoinTimeout {
            message: format!(
                "shared memory: rank {peer} did not hand over its segment within {timeout:?}"
            ),
            timeout,
        };
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(late());
            }
            let pfd = |fd: RawFd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            let mut fds = [pfd(self.listener.as_raw_fd()), pfd(sock.as_raw_fd())];
            let ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            // SAFETY: polling two descriptors of ours.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
            if fds[1].revents != 0 && fds[0].revents == 0 {
                return Err(Error::config(format!(
                    "shared memory: rank {peer} gave up setting up the link (its own error says why)"
                )));
            }
            let conn = match self.listener.accept() {
                Ok((c, _)) => c,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) =>
                {
                    continue
                }
                Err(e) => {
                    return Err(Error::io(
                        format!("shared memory: accepting rank {peer}'s connection"),
                        e,
                    ))
                }
            };
            let mut theirs = [0u8; KEY];
            // The peer sends its key and segment at once: a connection that sends nothing for
            // a second is not the peer's, and is dropped rather than waited for.
            let by = deadline.min(Instant::now() + Duration::from_secs(1));
            let got = conn
                .set_nonblocking(false)
                .and_then(|_| recv_with_fd(&conn, &mut theirs, by));
            match got {
                Ok(Some(fd)) if same_key(&theirs, key) => return Ok((conn, fd)),
                Ok(_) => log::warn!(
                    "shared memory: dropped a connection to the socket for rank {peer} that did not present its key"
                ),
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut || e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(late());
                    }
                    log::warn!(
                        "shared memory: dropped a connection to the socket for rank {peer} that sent nothing within a second"
                    )
                }
                Err(e) => log::warn!(
                    "shared memory: dropped a connection to the socket for rank {peer}: {e}"
                ),
            }
        }
    }
}

/// Keys compared in time independent of where they differ.
fn same_key(a: &[u8; KEY], b: &[u8; KEY]) -> bool {
    a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

impl ShmLink {
    /// Set up the link over the (still blocking, authenticated) connection to `peer`, within
    /// `timeout`: exchange the slot size, hand the segments over (see the module's doc), check
    /// that both ends are mapped.
    pub(crate) fn open(
        sock: &TcpStream,
        rank: usize,
        peer: usize,
        chunk_bytes: usize,
        timeout: Duration,
    ) -> Result<ShmLink> {
        let deadline = Instant::now() + timeout;
        let slot = (chunk_bytes.clamp(4096, 16 << 20) / 64) * 64;
        let len = HEAD + SLOTS * (SLOT_HEAD + slot);
        let whose = format!("rank {peer}");
        // Errors of the setup's I/O: a peer that stops answering is a timeout naming it.
        let io = |what: &str, e: std::io::Error| match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Error::JoinTimeout {
                message: format!("shared memory: rank {peer} did not {what} within {timeout:?}"),
                timeout,
            },
            std::io::ErrorKind::UnexpectedEof => Error::config(format!(
                "shared memory: rank {peer} gave up setting up the link (its own error says why)"
            )),
            _ => Error::io(format!("setting up shared memory with rank {peer}"), e),
        };
        let (tx, tx_fd) = Segment::create_sealed(len)?;
        // The lower rank binds the socket that hands the segments over.
        let lower = rank < peer;
        let (rendezvous, mine) = if lower {
            let nonce = crate::cluster::auth::nonce()?;
            let tag: String = nonce[..6].iter().map(|b| format!("{b:02x}")).collect();
            let name = format!("{}.sock", segment_name(rank, peer, &tag));
            let r = Rendezvous::bind(&name).map_err(|e| {
                Error::io(
                    format!("shared memory: binding a socket under {SOCKET_DIR} for rank {peer}"),
                    e,
                )
            })?;
            let key = crate::cluster::auth::nonce()?;
            let socket = Some(name);
            (
                Some(r),
                Setup {
                    slot: slot as u64,
                    socket,
                    key,
                },
            )
        } else {
            let key = [0; KEY];
            (
                None,
                Setup {
                    slot: slot as u64,
                    socket: None,
                    key,
                },
            )
        };
        let mut s = sock;
        s.write_all(&mine.encode())
            .map_err(|e| io("take this rank's setup message", e))?;
        let mut msg = vec![0u8; SETUP_HEAD];
        read_by(s, &mut msg, deadline).map_err(|e| io("send its setup message", e))?;
        let rest = setup_rest(peer, &msg)?;
        msg.resize(SETUP_HEAD + rest, 0);
        read_by(s, &mut msg[SETUP_HEAD..], deadline)
            .map_err(|e| io("send its setup message", e))?;
        let theirs = parse_setup(peer, &msg)?;
        if theirs.slot != slot as u64 {
            return Err(Error::config(format!(
                "rank {peer} uses shared-memory slots of {} bytes, this rank {slot}: set the same chunk size everywhere",
                theirs.slot
            )));
        }
        let rx = match (rendezvous, theirs.socket) {
            (Some(r), None) => {
                let (conn, fd) = r.accept(sock, peer, &mine.key, deadline, timeout)?;
                drop(r);
                let rx = Segment::map_sealed(&fd, len, &whose)?;
                send_with_fd(&conn, &[1], &tx_fd).map_err(|e| io("take this rank's segment", e))?;
                rx
            }
            (None, Some(name)) => {
                let addr = socket2::SockAddr::unix(format!("{SOCKET_DIR}{name}"))
                    .map_err(|e| io("name a reachable socket", e))?;
                let conn = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)
                    .and_then(|c| c.connect_timeout(&addr, left(deadline)).map(|_| c))
                    .map_err(|e| {
                        Error::io(
                            format!(
                                "shared memory: connecting to rank {peer}'s socket {SOCKET_DIR}{name} (do both share /dev/shm? if not, set TUTTI_HOST_ID apart or use transport tcp)"
                            ),
                            e,
                        )
                    })?;
                let conn = UnixStream::from(OwnedFd::from(conn));
                conn.set_nonblocking(false)
                    .map_err(|e| io("accept this rank's connection", e))?;
                conn.set_write_timeout(Some(left(deadline)))
                    .map_err(|e| io("accept this rank's connection", e))?;
                send_with_fd(&conn, &theirs.key, &tx_fd)
                    .map_err(|e| io("take this rank's segment", e))?;
                let mut one = [0u8; 1];
                let fd = recv_with_fd(&conn, &mut one, deadline)
                    .map_err(|e| io("hand over its segment", e))?
                    .ok_or_else(|| {
                        Error::config(format!("shared memory: rank {peer} sent no segment"))
                    })?;
                Segment::map_sealed(&fd, len, &whose)?
            }
            (Some(_), Some(_)) | (None, None) => {
                return Err(Error::config(format!(
                    "rank {peer} sent a shared-memory setup message for the other end of the link"
                )))
            }
        };
        drop(tx_fd);
        // Both mapped: each side says so, so that a failure on either is seen by both now.
        s.write_all(&[1])
            .map_err(|e| io("take this rank's confirmation", e))?;
        let mut ack = [0u8; 1];
        read_by(s, &mut ack, deadline).map_err(|e| io("confirm its mapping", e))?;
        s.set_read_timeout(None)
            .map_err(|e| io("take this rank's confirmation", e))?;
        Ok(ShmLink::new(Ring { seg: tx, slot }, Ring { seg: rx, slot }))
    }

    fn new(tx: Ring, rx: Ring) -> ShmLink {
        ShmLink {
            tx,
            rx,
            tx_head: AtomicU64::new(0),
            tx_seen: AtomicU64::new(0),
            rx_tail: AtomicU64::new(0),
            rx_misses: AtomicU32::new(0),
        }
    }

    /// A ring's shared pages broken by `peer`: `sending` (this side's sending ring, whose tail
    /// the peer publishes) or the receiving one (whose head it publishes). Off the fast path.
    #[cold]
    #[inline(never)]
    fn corrupt(&self, site: Site, peer: usize, sending: bool) -> Error {
        let (head, tail, what) = if sending {
            let tail = self.tx.seg.counters().tail.load(Ordering::Acquire);
            let what = if tail < self.tx_seen.load(Ordering::Relaxed) {
                "its receiving position went back"
            } else {
                "it freed slots that were never filled"
            };
            (self.tx_head.load(Ordering::Relaxed), tail, what)
        } else {
            let head = self.rx.seg.counters().head.load(Ordering::Acquire);
            let tail = self.rx_tail.load(Ordering::Relaxed);
            let what = if head.saturating_add(1) < tail {
                "its sending position went back"
            } else if head > tail.saturating_add(SLOTS as u64) {
                "it filled more slots than the ring has"
            } else {
                "it published a slot it never stamped"
            };
            (head, tail, what)
        };
        Error::invalid(
            site,
            format!(
                "rank {peer} broke the shared-memory ring protocol: {what} (head {head}, tail {tail})"
            ),
        )
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

    /// The free slots of the sending ring, from the tail the receiver published (checked:
    /// None where it broke the protocol).
    #[inline]
    fn free(&self, head: u64) -> Option<u64> {
        // While the receiver's tail as last seen leaves a slot free, that slot is free: the
        // tail only moves on. Not reading it leaves its cache line with the receiver.
        let seen = self.tx_seen.load(Ordering::Relaxed);
        if head.wrapping_sub(seen) < SLOTS as u64 {
            return Some(SLOTS as u64 - (head - seen));
        }
        let tail = self.tx.seg.counters().tail.load(Ordering::Acquire);
        let free = free_slots(head, self.tx_seen.load(Ordering::Relaxed), tail)?;
        self.tx_seen.store(tail, Ordering::Relaxed);
        Some(free)
    }

    /// The piece at the front of the receiving ring (position `tail`): its length, from the
    /// slot's stamp; `Some(None)` where none is there yet; None where the sender broke the
    /// protocol. A receiver waits on the stamp, on the line the piece's first bytes share; it
    /// checks the head the sender publishes only every [`LOOK_AT_HEAD`]th look that finds no
    /// stamp: a receiver that read it at every look would pull its line from the sender at
    /// every message, and the sender would wait for it back to publish the next.
    #[inline]
    fn front(&self, tail: u64) -> Option<Option<(usize, bool)>> {
        let (word, ..) = self.rx.slot_ptr(tail, false);
        if let Some(n) = stamped(word.load(Ordering::Acquire), tail) {
            return Some(Some(n));
        }
        // Counted by this side's receiving thread (it holds the transport's engine): a plain
        // load and store, no locked instruction on the waiting path.
        let misses = self.rx_misses.load(Ordering::Relaxed);
        self.rx_misses
            .store(misses.wrapping_add(1), Ordering::Relaxed);
        if misses % LOOK_AT_HEAD != 0 {
            return Some(None);
        }
        // The sender stamps a slot before it publishes the head past it: a head past `tail`
        // with no stamp there is a broken protocol.
        match filled_slots(self.rx.seg.counters().head.load(Ordering::Acquire), tail)? {
            0 => Some(None),
            _ => stamped(word.load(Ordering::Acquire), tail).map(Some),
        }
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
        let mut head = self.tx_head.load(Ordering::Relaxed);
        let mut moved = false;
        while *hoff < HDR || *off < data.len() {
            match self.free(head) {
                Some(0) => break,
                Some(_) => {}
                None => return Err(self.corrupt(site, peer, true)),
            }
            let n = (data.len() - *off)
                .min(self.tx.slot)
                .min(INLINED as usize - 1);
            let first = *hoff < HDR;
            let inline = first && n <= INLINE;
            let (word, frame, payload) = self.tx.slot_ptr(head, inline);
            // SAFETY: the slot is free (the receiver has moved past it) and ours to fill.
            unsafe {
                if first {
                    std::ptr::copy_nonoverlapping(hdr.as_ptr(), frame, HDR);
                }
                std::ptr::copy_nonoverlapping(data[*off..].as_ptr(), payload, n);
            }
            word.store(stamp(head, n, inline), Ordering::Release);
            head += 1;
            self.tx_head.store(head, Ordering::Relaxed);
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

    /// Free slot `tail` of the receiving ring.
    fn advance(&self, tail: u64) {
        self.rx_tail.store(tail + 1, Ordering::Relaxed);
        self.rx
            .seg
            .counters()
            .tail
            .store(tail + 1, Ordering::SeqCst);
    }

    /// Copy the header of the frame at the front of the ring into `hdr`; a frame without a
    /// payload is taken off the ring with it. True when a frame was there.
    pub(crate) fn peek_header(&self, site: Site, peer: usize, hdr: &mut [u8; HDR]) -> Result<bool> {
        let tail = self.rx_tail.load(Ordering::Relaxed);
        let n = match self.front(tail) {
            Some(None) => return self.aborted_error(site, peer),
            Some(Some((n, _))) => n,
            None => return Err(self.corrupt(site, peer, false)),
        };
        let (_, frame, _) = self.rx.slot_ptr(tail, false);
        // SAFETY: the sender published this slot (Acquire above) and does not touch it until we
        // advance the tail.
        unsafe { std::ptr::copy_nonoverlapping(frame as *const u8, hdr.as_mut_ptr(), HDR) };
        if n == 0 {
            self.advance(tail);
            self.ring_peer();
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
        let mut tail = self.rx_tail.load(Ordering::Relaxed);
        let mut moved = false;
        while *off < dst.len() {
            let (n, inline) = match self.front(tail) {
                Some(None) => break,
                Some(Some(piece)) => piece,
                None => return Err(self.corrupt(site, peer, false)),
            };
            // A frame's first piece of at most INLINE bytes lies on the stamp's line.
            let (_, _, payload) = self.rx.slot_ptr(tail, inline);
            // A reducing receive combines whole elements: every piece holds some (slots are
            // multiples of 64 bytes, and a frame a whole number of elements).
            let fits =
                n != 0 && n <= if inline { INLINE } else { self.rx.slot } && n <= dst.len() - *off;
            if !fits || mode.combined().is_some_and(|d| n % d.size() != 0) {
                return Err(Error::invalid(
                    site,
                    format!("rank {peer} wrote a malformed shared-memory slot ({n} bytes)"),
                ));
            }
            // SAFETY: n ≤ the slot's payload bytes, inside the mapping.
            let src = unsafe { std::slice::from_raw_parts(payload as *const u8, n) };
            let d = &mut dst[*off..*off + n];
            mode.deliver(d, *off, src);
            self.advance(tail);
            tail += 1;
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
    ///
    /// Every caller has just published a position with a SeqCst store (the head past a slot it
    /// filled, the tail past one it freed), and a sleeper stores `sleeping` (SeqCst) before it
    /// reads the positions (SeqCst, [`ShmLink::ready`]): either the sleeper sees the new
    /// position, or this load sees it asleep and rings. A peer that does not sleep costs no
    /// locked instruction here.
    #[inline]
    fn ring_peer(&self) {
        let c = self.rx.seg.counters();
        if c.sleeping.load(Ordering::SeqCst) != 0 {
            c.bell.fetch_add(1, Ordering::SeqCst);
            futex_wake(&c.bell);
        }
    }

    /// Whether a frame or piece waits to be received (`filled`), a slot is free to send into
    /// (`free`), or the link was aborted. A position the peer broke counts as ready: the
    /// receive or send that follows reports it.
    pub(crate) fn ready(&self, filled: bool, free: bool) -> bool {
        let rx = self.rx.seg.counters();
        let tx = self.tx.seg.counters();
        let tail = self.rx_tail.load(Ordering::Relaxed);
        rx.aborted.load(Ordering::SeqCst) != 0
            || (filled
                && (filled_slots(rx.head.load(Ordering::SeqCst), tail) != Some(0)
                    || stamped(
                        self.rx.slot_ptr(tail, false).0.load(Ordering::Acquire),
                        tail,
                    )
                    .is_some()))
            || (free
                && free_slots(
                    self.tx_head.load(Ordering::Relaxed),
                    self.tx_seen.load(Ordering::Relaxed),
                    tx.tail.load(Ordering::SeqCst),
                ) != Some(0))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_of_many_ranks_keeps_its_rings_within_the_budget() {
        // Up to 32 ranks a host, rings have the chunk size asked for.
        assert_eq!(ring_chunk(256 << 10, 2), 256 << 10);
        assert_eq!(ring_chunk(256 << 10, 32), 256 << 10);
        for local in [64usize, 128] {
            let slot = ring_chunk(256 << 10, local);
            assert!(slot < 256 << 10, "{local}: {slot}");
            let rings = local * (local - 1) * (HEAD + SLOTS * (SLOT_HEAD + slot));
            assert!(
                rings <= HOST_RING_BUDGET + local * local * HEAD,
                "{local}: {rings}"
            );
        }
        // Never below one page (256 ranks: 2.2 GB of rings in all).
        assert_eq!(ring_chunk(256 << 10, 256), 4096);
        assert_eq!(ring_chunk(256 << 10, 4096), 4096);
        assert_eq!(ring_chunk(1024, 2), 1024);
    }
    use crate::error::Collective;
    use std::net::TcpListener;

    pub(super) fn site() -> Site {
        Site {
            collective: Collective::AllReduce,
            rank: 0,
            call: 0,
        }
    }

    /// A crafted peer: given its end of the link's TCP connection, it does what it does.
    type Peer = Box<dyn FnOnce(TcpStream) + Send>;
    /// What a crafted peer hands over as its segment.
    type MakeFd = Box<dyn Fn() -> OwnedFd + Send>;

    /// Two ends of a link over shared memory, without the setup: ends 0 and 1.
    pub(super) fn ring_pair(slot: usize) -> (ShmLink, ShmLink) {
        let len = HEAD + SLOTS * (SLOT_HEAD + slot);
        let (sa, fa) = Segment::create_sealed(len).unwrap();
        let (sb, fb) = Segment::create_sealed(len).unwrap();
        let ra = Segment::map_sealed(&fb, len, "rank 1").unwrap();
        let rb = Segment::map_sealed(&fa, len, "rank 0").unwrap();
        (
            ShmLink::new(Ring { seg: sa, slot }, Ring { seg: ra, slot }),
            ShmLink::new(Ring { seg: sb, slot }, Ring { seg: rb, slot }),
        )
    }

    /// Ranks 0 and 1 of a link set up over a loopback TCP connection, with `peer` (given the
    /// connection and its rank) in place of rank `crafted` where it is given.
    fn setup(crafted: Option<(usize, Peer)>, timeout: Duration) -> [Option<Result<ShmLink>>; 2] {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (mut p0, mut p1) = (None, None);
        match crafted {
            Some((0, p)) => p0 = Some(p),
            Some((_, p)) => p1 = Some(p),
            None => {}
        }
        let t = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            match p1 {
                Some(p) => {
                    p(s);
                    None
                }
                None => Some(ShmLink::open(&s, 1, 0, 4096, timeout)),
            }
        });
        let (s, _) = l.accept().unwrap();
        let zero = match p0 {
            Some(p) => {
                p(s);
                None
            }
            None => {
                let link = ShmLink::open(&s, 0, 1, 4096, timeout);
                // A crafted rank 1 waits for this end's hang-up.
                drop(s);
                Some(link)
            }
        };
        [zero, t.join().unwrap()]
    }

    /// Read a whole setup message off `s`.
    fn read_setup(s: &TcpStream, peer: usize) -> Setup {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut msg = vec![0u8; SETUP_HEAD];
        read_by(s, &mut msg, deadline).unwrap();
        let rest = setup_rest(peer, &msg).unwrap();
        msg.resize(SETUP_HEAD + rest, 0);
        read_by(s, &mut msg[SETUP_HEAD..], deadline).unwrap();
        parse_setup(peer, &msg).unwrap()
    }

    fn frame_through(a: &ShmLink, b: &ShmLink, data: &[u8]) -> Vec<u8> {
        let hdr = [7u8; HDR];
        let (mut hoff, mut off) = (0, 0);
        let mut out = vec![0u8; data.len()];
        let mut got = [0u8; HDR];
        let mut roff = 0;
        let mut header = false;
        while roff < out.len() || !header {
            a.push(site(), 1, &hdr, &mut hoff, data, &mut off).unwrap();
            if !header {
                header = b.peek_header(site(), 0, &mut got).unwrap();
            }
            if header {
                b.pull(site(), 0, &mut out, RecvMode::Copy, &mut roff)
                    .unwrap();
            }
        }
        assert_eq!(got, hdr);
        out
    }

    #[test]
    fn a_link_hands_sealed_segments_over_and_moves_frames() {
        // Ranks 2 and 3, whose names no other test uses.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            ShmLink::open(&s, 3, 2, 4096, Duration::from_secs(10))
        });
        let (s, _) = l.accept().unwrap();
        let a = ShmLink::open(&s, 2, 3, 4096, Duration::from_secs(10)).unwrap();
        let b = t.join().unwrap().unwrap();
        let data: Vec<u8> = (0..50_000u32).map(|i| i as u8).collect();
        assert_eq!(frame_through(&a, &b, &data), data);
        assert_eq!(frame_through(&b, &a, &data[..100]), &data[..100]);
        // Nothing of the link is left under /dev/shm.
        let left: Vec<String> = std::fs::read_dir(SOCKET_DIR)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&segment_name(2, 3, "")[1..]))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn a_receiving_position_past_the_sending_one_is_an_error_naming_the_peer() {
        let (a, b) = ring_pair(4096);
        // Rank 1 claims to have freed 20 slots of rank 0's sending ring that nothing filled.
        b.rx.seg.counters().tail.store(20, Ordering::SeqCst);
        assert!(a.ready(false, true));
        // The sender reads the tail once its own view of it leaves no slot free: after a
        // ring's worth of frames.
        for _ in 0..SLOTS {
            let (mut hoff, mut off) = (0, 0);
            assert!(a
                .push(site(), 1, &[0; HDR], &mut hoff, &[1; 100], &mut off)
                .unwrap());
        }
        let (mut hoff, mut off) = (0, 0);
        let e = a
            .push(site(), 1, &[0; HDR], &mut hoff, &[1; 100], &mut off)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1") && e.contains("tail 20"), "{e}");
    }

    #[test]
    fn a_sending_position_out_of_the_ring_is_an_error_naming_the_peer() {
        for head in [SLOTS as u64 + 1, u64::MAX] {
            let (a, b) = ring_pair(4096);
            b.tx.seg.counters().head.store(head, Ordering::SeqCst);
            assert!(a.ready(true, false));
            // Seen within the looks between two at the head.
            let e = (0..=LOOK_AT_HEAD)
                .find_map(|_| a.peek_header(site(), 1, &mut [0; HDR]).err())
                .unwrap();
            assert!(e.to_string().contains("rank 1"), "{e}");
            let e = (0..=LOOK_AT_HEAD)
                .find_map(|_| {
                    a.pull(site(), 1, &mut [0; 64], RecvMode::Copy, &mut 0)
                        .err()
                })
                .unwrap();
            assert!(e.to_string().contains("rank 1"), "{e}");
        }
        // A head that goes back once slots were taken (more than the one a stamped piece may
        // be taken ahead of it).
        let (a, b) = ring_pair(4096);
        for _ in 0..2 {
            assert_eq!(frame_through(&b, &a, &[3; 64]), [3; 64]);
        }
        b.tx.seg.counters().head.store(0, Ordering::SeqCst);
        let e = (0..=LOOK_AT_HEAD)
            .find_map(|_| a.peek_header(site(), 1, &mut [0; HDR]).err())
            .unwrap();
        assert!(e.to_string().contains("rank 1 broke"), "{e}");
    }

    #[test]
    fn a_segment_cannot_be_shrunk_under_its_mapping() {
        let len = 3 * 4096;
        let (mine, fd) = Segment::create_sealed(len).unwrap();
        let theirs = Segment::map_sealed(&fd, len, "rank 1").unwrap();
        // Whoever holds the file (the peer that received it, or its creator) cannot shrink it.
        // SAFETY: plain syscalls on our fd; reads inside both mappings.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), 0), -1);
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EPERM)
            );
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), 2 * len as libc::off_t), -1);
            assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, 0), -1);
            mine.ptr().add(len - 1).write_volatile(9);
            assert_eq!(theirs.ptr().add(len - 1).read_volatile(), 9);
        }
    }

    /// A memfd of `len` bytes with `seals` (and its pages reserved where `reserve`).
    fn memfd(len: usize, seals: libc::c_int, reserve: bool) -> OwnedFd {
        // SAFETY: plain syscalls on a new fd we own.
        unsafe {
            let fd = libc::memfd_create(
                c"test".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            );
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
            if reserve {
                assert_eq!(libc::posix_fallocate(fd, 0, len as libc::off_t), 0);
            }
            assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, seals), 0);
            OwnedFd::from_raw_fd(fd)
        }
    }

    #[test]
    fn a_segment_that_could_shrink_or_is_short_is_refused_naming_the_peer() {
        let len = HEAD + SLOTS * (SLOT_HEAD + 4096);
        let tmpfs = move || {
            let path = format!("/dev/shm/tutti-test-{}-file", std::process::id());
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .unwrap();
            f.set_len(len as u64).unwrap();
            std::fs::remove_file(&path).unwrap();
            OwnedFd::from(f)
        };
        let cases: [(MakeFd, &str); 5] = [
            (Box::new(move || memfd(len, 0, true)), "not sealed"),
            (
                Box::new(move || memfd(len, libc::F_SEAL_GROW | libc::F_SEAL_SEAL, true)),
                "not sealed",
            ),
            (
                Box::new(move || memfd(len - 4096, SEALS, true)),
                "bytes where",
            ),
            (Box::new(move || memfd(len, SEALS, false)), "not reserved"),
            (Box::new(tmpfs), "not sealed"),
        ];
        for (make, why) in cases {
            // The peer (rank 1) speaks the protocol but hands over `make()`.
            let peer = move |s: TcpStream| {
                let theirs = read_setup(&s, 0);
                let mine = Setup {
                    slot: theirs.slot,
                    socket: None,
                    key: [0; KEY],
                };
                (&s).write_all(&mine.encode()).unwrap();
                let path = format!("{SOCKET_DIR}{}", theirs.socket.unwrap());
                let conn = UnixStream::connect(path).unwrap();
                send_with_fd(&conn, &theirs.key, &make()).unwrap();
                let _ = (&s).read(&mut [0; 1]);
            };
            let t = Instant::now();
            let [zero, _] = setup(Some((1, Box::new(peer))), Duration::from_secs(10));
            let e = zero.unwrap().err().unwrap().to_string();
            assert!(e.contains("rank 1") && e.contains(why), "{why}: {e}");
            // Reported when the peer hung up, not at the 10 s deadline.
            assert!(t.elapsed() < Duration::from_secs(9));
        }
    }

    #[test]
    fn a_socket_name_that_is_not_tutti_s_is_an_error_naming_the_peer() {
        for name in [
            "/tutti-a\0b",
            "/tutti-../../etc/x",
            "/tmp/x",
            &format!("/tutti-{}", "a".repeat(200)),
        ] {
            let name = name.to_string();
            // The peer (rank 0, which names the socket) names `name`.
            let peer = move |s: TcpStream| {
                let mine = Setup {
                    slot: 4096,
                    socket: Some(name),
                    key: [1; KEY],
                };
                (&s).write_all(&mine.encode()).unwrap();
                let _ = (&s).read(&mut [0; 64]);
            };
            let [_, one] = setup(Some((0, Box::new(peer))), Duration::from_secs(10));
            let e = one.unwrap().err().unwrap().to_string();
            assert!(
                e.contains("rank 0") && (e.contains("not tutti's") || e.contains("at most")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_peer_that_never_hands_its_segment_over_is_a_timeout_naming_it() {
        // Rank 1 sends its setup message, then neither connects nor hangs up.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            let theirs = read_setup(&s, 0);
            let mine = Setup {
                slot: theirs.slot,
                socket: None,
                key: [0; KEY],
            };
            (&s).write_all(&mine.encode()).unwrap();
            std::thread::sleep(Duration::from_secs(2));
        });
        let (s, _) = l.accept().unwrap();
        let t = Instant::now();
        let e = ShmLink::open(&s, 0, 1, 4096, Duration::from_millis(500))
            .err()
            .unwrap();
        let took = t.elapsed();
        assert!(
            matches!(e, Error::JoinTimeout { .. }) && e.to_string().contains("rank 1"),
            "{e}"
        );
        assert!(took < Duration::from_millis(1400), "{took:?}");
        peer.join().unwrap();
    }

    #[test]
    fn a_stranger_without_the_key_is_dropped_and_the_peer_still_connects() {
        // Ranks 5 and 7 set up a link; a stranger (the same user) connects to rank 5's socket
        // with a wrong key as soon as it appears, and rank 7 starts only after it has.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (knocked, wait) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            wait.recv_timeout(Duration::from_secs(10)).unwrap();
            ShmLink::open(&s, 7, 5, 4096, Duration::from_secs(10))
        });
        let (s, _) = l.accept().unwrap();
        let knock = std::thread::spawn(move || {
            let prefix = segment_name(5, 7, "")[1..].to_string();
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until {
                let found = std::fs::read_dir(SOCKET_DIR)
                    .unwrap()
                    .flatten()
                    .find_map(|e| {
                        let n = e.file_name().to_string_lossy().into_owned();
                        n.starts_with(&prefix).then_some(n)
                    });
                if let Some(n) = found {
                    let c = UnixStream::connect(format!("{SOCKET_DIR}/{n}")).unwrap();
                    send_with_fd(&c, &[9; KEY], &memfd(4096, SEALS, true)).unwrap();
                    knocked.send(()).unwrap();
                    return c;
                }
                std::thread::yield_now();
            }
            panic!("no socket of rank 5 appeared");
        });
        let zero = ShmLink::open(&s, 5, 7, 4096, Duration::from_secs(10));
        let (zero, one) = (zero.unwrap(), t.join().unwrap().unwrap());
        drop(knock.join().unwrap());
        assert_eq!(frame_through(&zero, &one, &[5; 300]), [5; 300]);
    }
}

#[cfg(test)]
mod fuzz {
    use super::tests::{ring_pair, site};
    use super::*;
    use proptest::prelude::*;

    fn names_peer(e: &Error, peer: usize) -> bool {
        e.to_string().contains(&format!("rank {peer}"))
    }

    fn valid_setup() -> impl Strategy<Value = Setup> {
        (
            any::<u64>(),
            proptest::option::of("[A-Za-z0-9._-]{1,89}"),
            any::<[u8; KEY]>(),
        )
            .prop_map(|(slot, name, key)| Setup {
                slot,
                socket: name.map(|n| format!("/tutti-{n}")),
                key,
            })
    }

    proptest! {
        /// Any bytes as a setup message: read, or refused naming the peer; the length read
        /// after the head is bounded.
        #[test]
        fn setup_messages_of_any_bytes(msg in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(rest) = setup_rest(3, &msg) {
                prop_assert!(rest <= MAX_NAME + KEY);
            }
            match parse_setup(3, &msg) {
                Ok(s) => prop_assert_eq!(s.encode(), msg),
                Err(e) => prop_assert!(names_peer(&e, 3), "{}", e),
            }
        }

        /// Valid setup messages round-trip; mutated ones (a byte changed, cut short, grown)
        /// are read or refused naming the peer.
        #[test]
        fn setup_messages_mutated(
            s in valid_setup(),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
            cut in any::<prop::sample::Index>(),
            extra in proptest::collection::vec(any::<u8>(), 0..8),
        ) {
            let msg = s.encode();
            prop_assert_eq!(parse_setup(3, &msg).unwrap(), s);
            let mut changed = msg.clone();
            changed[at.index(msg.len())] = byte;
            let mut grown = msg.clone();
            grown.extend_from_slice(&extra);
            for m in [changed, msg[..cut.index(msg.len())].to_vec(), grown] {
                match parse_setup(3, &m) {
                    Ok(p) => {
                        prop_assert_eq!(p.encode(), m);
                        if let Some(n) = p.socket {
                            prop_assert!(std::ffi::CString::new(n).is_ok());
                        }
                    }
                    Err(e) => prop_assert!(names_peer(&e, 3), "{}", e),
                }
            }
        }

        /// Names from a peer, any bytes (NUL, '/', long ones): taken only when they are one of
        /// tutti's names under /dev/shm, else refused naming the peer.
        #[test]
        fn names_from_a_peer(
            name in prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..300),
                "/tutti-[A-Za-z0-9._/\\x00-]{0,120}".prop_map(String::into_bytes),
            ]
        ) {
            match check_name(4, &name) {
                Ok(n) => {
                    prop_assert!(n.len() <= MAX_NAME && n.starts_with("/tutti-"));
                    prop_assert!(!n[1..].contains('/') && !n.contains('\0'));
                    prop_assert!(std::ffi::CString::new(n).is_ok());
                }
                Err(e) => prop_assert!(names_peer(&e, 4), "{}", e),
            }
        }

        /// The position checks: never a panic, never more than the ring.
        #[test]
        fn ring_positions(head in any::<u64>(), seen in any::<u64>(), tail in any::<u64>()) {
            if let Some(n) = filled_slots(head, tail) {
                prop_assert!(
                    n <= SLOTS as u64 && (head >= tail || (tail.checked_sub(1) == Some(head) && n == 0))
                );
            }
            if let Some(n) = free_slots(head, seen, tail) {
                prop_assert!(n <= SLOTS as u64 && seen <= tail && tail <= head);
            }
        }

        /// The checks of a segment handed over: taken only sealed, large enough and reserved.
        #[test]
        fn segments_handed_over(
            seals in any::<i32>(), fs in prop_oneof![Just(libc::TMPFS_MAGIC as _), any::<i64>()],
            size in any::<i64>(), blocks in any::<i64>(), len in 0usize..1 << 40,
        ) {
            if check_segment(seals, fs, size, blocks, len).is_ok() {
                prop_assert!(seals & SEALS == SEALS && size as u64 >= len as u64);
                prop_assert!((blocks as u64).saturating_mul(512) >= len as u64);
            }
        }

        /// A peer that writes anything into the shared pages (both rings' positions, the abort
        /// flag, the bell, the pieces' lengths) between this end's sends and receives: every
        /// call returns at once, with data or an error naming the peer; never a panic or a
        /// wait.
        #[test]
        fn a_peer_writing_anything_into_the_rings(
            steps in proptest::collection::vec(
                (0u8..7, any::<u64>(), 0usize..SLOTS, 1usize..9000), 1..24)
        ) {
            let (a, b) = ring_pair(4096);
            let data = vec![1u8; 9000];
            let mut dst = vec![0u8; 9000];
            let t = Instant::now();
            for (what, v, slot, n) in steps {
                // The peer's writes: into the segment it created (rank 0's receiving ring) and
                // into the one it maps (rank 0's sending ring).
                let mine = b.tx.seg.counters();
                let theirs = b.rx.seg.counters();
                match what {
                    0 => mine.head.store(v, Ordering::SeqCst),
                    1 => theirs.tail.store(v, Ordering::SeqCst),
                    2 => b.tx.slot_ptr(slot as u64, false).0.store(v, Ordering::SeqCst),
                    3 => mine.bell.store(v as u32, Ordering::SeqCst),
                    4 => theirs.head.store(v, Ordering::SeqCst),
                    // A stamp of the position the receiver waits for, of any length.
                    5 => {
                        let at = a.rx_tail.load(Ordering::Relaxed) + slot as u64;
                        let forged = stamp(at, (v & 0x7fff_ffff) as usize, v & (1 << 40) != 0);
                        b.tx.slot_ptr(at, false).0.store(forged, Ordering::SeqCst)
                    }
                    _ => {
                        let (mut hoff, mut off) = (0, 0);
                        let _ = b.push(site(), 0, &[2; HDR], &mut hoff, &data[..n], &mut off);
                    }
                }
                let _ = a.ready(true, true);
                a.sleep(true, true, Instant::now());
                let (mut hoff, mut off) = (0, 0);
                let checks = [
                    a.push(site(), 1, &[0; HDR], &mut hoff, &data[..n], &mut off),
                    a.peek_header(site(), 1, &mut [0; HDR]),
                    a.pull(site(), 1, &mut dst[..n], RecvMode::Copy, &mut 0),
                    a.pull(
                        site(),
                        1,
                        &mut dst[..n / 4 * 4],
                        RecvMode::Reduce(crate::dtype::DType::F32, crate::dtype::ReduceOp::Sum),
                        &mut 0,
                    ),
                ];
                for r in checks {
                    if let Err(e) = r {
                        prop_assert!(names_peer(&e, 1), "{}", e);
                    }
                }
            }
            prop_assert!(t.elapsed() < Duration::from_secs(10));
        }
    }
}
