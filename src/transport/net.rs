//! The transport between processes and hosts: one TCP connection per peer, with the bytes of
//! peers on the same host moved through shared memory when asked to (`shm.rs`).
//!
//! Setup goes through the rendezvous store: every rank listens on its configured host (a port
//! chosen by the OS), publishes its address, connects to the lower ranks and accepts the higher
//! ones. Every connection proves the job token (a mutual HMAC challenge) before it is used;
//! anything else that connects is logged and dropped, and the job goes on.
//!
//! A call runs on a single thread per rank: an [`Transport::exchange`] drives every send and
//! receive of the step at once over non-blocking sockets (poll(2)), so both directions of a ring
//! stay busy, and a receive that reduces does so chunk by chunk as the bytes arrive.
//!
//! Frames are a 64-byte header (kind, aux, length, and the identity of the call they belong to;
//! see `wire.rs`) and a payload. `DATA` frames carry the bytes of a step, `HEADER` frames
//! the check round of a call that has one (`TUTTI_CHECK=full`, barriers, calls without data, and
//! arguments a rank rejected, whose reason is the payload), `ABORT` frames the reason a rank gave
//! up. Every frame's identity is compared with the receiver's call before its payload is taken:
//! by default that is the whole check, so a small call is one round trip. A rank that fails a
//! call sends `ABORT` to every peer and closes its connections, so a dead or failed rank turns
//! into an error naming it on every survivor.
//!
//! To a peer on the same host every frame goes through a shared-memory ring (`shm.rs`)
//! instead of the socket, which then carries only `ABORT` frames and the peer's hang-up.
//!
//! (Why one long file: connection setup, the step engine and failure propagation share the
//! per-peer link state and its invariants; split, that state would be visible across files.)

use std::io::{ErrorKind, IoSlice, Read};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::shared::{self, Buffers};
use super::shm::ShmLink;
use super::wire::{
    frame, frame_ident, parse_frame, CurrentIdent, Ident, FRAME_ABORT, FRAME_DATA, FRAME_HEADER,
    HDR,
};
use super::{CallBuffers, CallHeader, PeerMemory, RecvMode, RecvOp, SendOp, Transport};
use crate::cluster::auth::{self as wire, Purpose};
use crate::cluster::store::Store;
use crate::cluster::ClusterSpec;
use crate::error::{Error, Result, Site};
use crate::reuse::recycle;
use crate::sync::YIELD_FOR;

/// Which transport carries a multi-process communicator.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// Shared memory for peers on the same host, TCP for the others.
    #[default]
    Auto,
    /// TCP for every peer.
    Tcp,
    /// Shared memory for every peer (all on one host).
    Shm,
    /// MPI point-to-point for every peer (feature `mpi`; ranks and world from the MPI job).
    Mpi,
}

impl FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(TransportKind::Auto),
            "tcp" => Ok(TransportKind::Tcp),
            "shm" => Ok(TransportKind::Shm),
            "mpi" => Ok(TransportKind::Mpi),
            _ => Err(format!(
                "unknown transport '{s}' (expected auto, tcp, shm or mpi)"
            )),
        }
    }
}

impl TransportKind {
    /// Whether this choice means the MPI transport here: `mpi`, or `auto` in a build with the
    /// `mpi` feature under an MPI launcher ([`ClusterSpec::launched_by_mpi`]).
    pub fn is_mpi_here(self) -> bool {
        match self {
            TransportKind::Mpi => true,
            TransportKind::Auto => cfg!(feature = "mpi") && ClusterSpec::launched_by_mpi(),
            TransportKind::Tcp | TransportKind::Shm => false,
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Auto => "auto",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::Mpi => "mpi",
        })
    }
}

/// Socket buffer size asked for on every data connection.
const SOCKET_BUFFER: usize = 4 << 20;
/// Longest rejection message accepted from a peer.
const MAX_HEADER: u64 = 64 << 10;

/// One peer connection.
struct Link {
    peer: usize,
    sock: TcpStream,
    shm: Option<ShmLink>,
    /// A frame was left half written (an exchange failed mid-send): no ABORT frame can follow.
    mid_frame: AtomicBool,
    /// The peer closed its sending side; it is left out of poll's idle watch.
    closed: AtomicBool,
}

/// How one rank meets the others through a store: who it is, the job's secret, where it
/// listens, and when setup gives up.
pub(crate) struct Meeting<'a> {
    pub rank: usize,
    pub world: usize,
    /// The job token every peer connection proves.
    pub token: &'a str,
    /// The host this rank listens on (its port is chosen by the OS).
    pub listen_host: &'a str,
    /// The end of the whole setup: every wait on the store and on peers ends by then.
    pub deadline: Instant,
    /// Who serves the store, for the error when it fails ("... may have stopped").
    pub served_by: &'a str,
}

/// What [`NetTransport::assemble`] builds a transport from.
struct Assembly<'a> {
    rank: usize,
    socks: Vec<Option<TcpStream>>,
    /// The host of every rank (numbered in order of first appearance).
    hosts: Vec<usize>,
    /// Every rank's listening address.
    addrs: Vec<String>,
    listener: TcpListener,
    kind: TransportKind,
    timeout: Duration,
    chunk_bytes: usize,
    token: &'a str,
    listen_host: &'a str,
    deadline: Instant,
    /// Shrinks that made this communicator.
    generation: u32,
}

/// One rank's end of a multi-process communicator.
pub struct NetTransport {
    rank: usize,
    world: usize,
    timeout: Duration,
    chunk_bytes: usize,
    links: Vec<Option<Link>>,
    aborted: AtomicBool,
    reason: Mutex<Option<String>>,
    wake: OwnedFd,
    /// Serializes exchanges with the abort notification to peers, and holds what exchanges
    /// reuse.
    engine: Mutex<Reuse>,
    /// The identity of the current call, which its frames carry ([`CallHeader::ident`]).
    ident: CurrentIdent,
    /// The current call has started moving data (an error now leaves peers mid-step).
    data_started: AtomicBool,
    /// How long a wait on shared-memory slots may spin before it sleeps.
    spin: Duration,
    /// What a split needs to meet again: the job's token, the host to listen on, the kind of
    /// transport asked for.
    regroup: (String, String, TransportKind),
    /// The host of every rank.
    hosts: Vec<usize>,
    /// This rank's listening socket, open for the communicator's life, and every rank's
    /// address: where the survivors of a shrink meet ([`super::shrink`]).
    /// (Handed to the survivors' transport once a shrink succeeds.)
    standby: Mutex<Option<TcpListener>>,
    addrs: Vec<String>,
    /// Shrinks that made this communicator (0: made by joining).
    generation: u32,
    /// A shrink of this communicator runs.
    shrinking: AtomicBool,
    /// The peers have been told why this rank stopped (they are told once).
    notified: AtomicBool,
    /// The rank this rank was waiting for when its call failed, plus one (0: none): every
    /// ABORT frame carries it, so that the rank that gave up can tell who is stuck.
    waiting_for: AtomicU32,
    /// The peer whose ABORT frame was read last, plus one (0: none): the news a failing call
    /// received rather than found.
    aborted_by: AtomicU32,
    /// Shared buffers ([`shared`]), and once any were allocated, the smallest call (bytes per
    /// rank) that has the claim round, the same on every rank (`usize::MAX` before).
    shared: Mutex<Buffers>,
    shared_min: AtomicUsize,
    /// The current call runs through shared buffers: [`PeerMemory`] is offered.
    direct: AtomicBool,
    /// The current call claimed its buffers (peers may write into them until it leaves).
    claimed: AtomicBool,
}

fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is owned below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::io(
            "creating an eventfd",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: fd is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `hostname` plus the kernel's boot id: equal for processes on one host.
/// `TUTTI_HOST_ID` overrides it: processes that share a host but not /dev/shm (containers)
/// can tell tutti they are apart, and tests can act out several hosts on one.
pub(crate) fn host_id() -> String {
    if let Ok(id) = std::env::var("TUTTI_HOST_ID") {
        return id;
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", hostname(), boot.trim())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn set_socket_options(s: &TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let sock = socket2::SockRef::from(s);
    sock.set_send_buffer_size(SOCKET_BUFFER)?;
    sock.set_recv_buffer_size(SOCKET_BUFFER)?;
    Ok(())
}

impl NetTransport {
    /// Join the world described by `spec`: rendezvous, connect to every peer, authenticate.
    pub fn connect(
        spec: &ClusterSpec,
        kind: TransportKind,
        timeout: Duration,
        chunk_bytes: usize,
    ) -> Result<NetTransport> {
        let rank = spec.collective_rank()?;
        // The one rule of every way of joining: the job's secret, or a refusal (before any
        // connection is made or accepted).
        let token = spec.job_key()?;
        // Ranks may start at different times: setup waits for them as long as the configured
        // timeout, and no longer (a short timeout asked for is honoured here too).
        let deadline = Instant::now() + timeout;
        let store = crate::cluster::store::store_for(spec, rank, &token, timeout)?;
        let meet = Meeting {
            rank,
            world: spec.world_size,
            token: &token,
            listen_host: &spec.listen_host,
            deadline,
            served_by: "the process serving the store (rank 0, or the launcher)",
        };
        NetTransport::meet(&store, &meet, kind, timeout, chunk_bytes)
    }

    /// Join a world through `store`, which the caller provides: listen on `meet.listen_host`
    /// (a port chosen by the OS), publish this rank's address, connect to every peer and
    /// authenticate with `meet.token`, all by `meet.deadline`. Only this thread calls `store`.
    pub(crate) fn meet(
        store: &dyn Store,
        meet: &Meeting<'_>,
        kind: TransportKind,
        timeout: Duration,
        chunk_bytes: usize,
    ) -> Result<NetTransport> {
        if kind == TransportKind::Mpi {
            return Err(Error::config(
                "the MPI transport takes its ranks from the MPI job, not from a store \
                 (Communicator::from_mpi, or TUTTI_TRANSPORT=mpi under mpirun)",
            ));
        }
        let call_timeout = timeout;
        let (rank, world, token, deadline) = (meet.rank, meet.world, meet.token, meet.deadline);
        let listen_host = meet.listen_host;
        // Communicators of one job are numbered in creation order (the same on every rank).
        let generation = store.add(&format!("tutti/generation/{rank}"), 1)?;
        let key = |what: &str, r: usize| format!("tutti/{generation}/{what}/{r}");

        let listener = crate::cluster::listen::listen_tcp((listen_host, 0))
            .map_err(|e| Error::io(format!("listening on {listen_host}"), e))?;
        let port = listener
            .local_addr()
            .map_err(|e| Error::io("listening", e))?
            .port();
        let unspecified = listen_host == "0.0.0.0" || listen_host == "::";
        let host = if unspecified {
            hostname()
        } else {
            listen_host.to_string()
        };
        // What this rank publishes: where to reach it, and what every rank must agree on
        // before anyone connects (a rank started with another world size or transport is
        // told so here, not by a timeout or a garbled frame later).
        let me = format!("{host}:{port} {world} {kind} {}", host_id());
        store.set(&key("addr", rank), me.as_bytes())?;

        let mut infos = Vec::with_capacity(world);
        for r in 0..world {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = store.get(&key("addr", r), left).map_err(|e| match e {
                Error::JoinTimeout { .. } => Error::JoinTimeout {
                    message: format!(
                        "rendezvous: rank {r} did not publish its address within {timeout:?} \
                         (is it running, with world size {world}?)"
                    ),
                    timeout,
                },
                // The store's connection failed: the process serving it stopped, most often
                // on an error of its own that it reports.
                Error::System { what, message } => Error::System {
                    what: format!("rendezvous: waiting for rank {r}'s address ({what})"),
                    message: format!(
                        "{message}; {} may have stopped: see its own error",
                        meet.served_by
                    ),
                },
                // What the store refused says why itself.
                e => e,
            })?;
            infos.push(peer_record(&v, r, rank, world, kind)?);
        }
        let my_host = host_id();
        let same_host: Vec<bool> = infos.iter().map(|(_, h)| *h == my_host).collect();
        // Number the hosts in order of their first rank.
        let mut host_names: Vec<&str> = Vec::new();
        let hosts: Vec<usize> = infos
            .iter()
            .map(|(_, h)| {
                host_names.iter().position(|x| x == h).unwrap_or_else(|| {
                    host_names.push(h);
                    host_names.len() - 1
                })
            })
            .collect();
        if kind == TransportKind::Shm {
            if let Some(r) = same_host.iter().position(|s| !s) {
                return Err(Error::config(format!(
                    "transport shm: rank {r} runs on another host ({}); use tcp or auto",
                    infos[r].0
                )));
            }
        }

        let mut socks: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        // Connect to the lower ranks.
        for (r, (addr, _)) in infos.iter().enumerate().take(rank) {
            socks[r] = Some(connect_peer(addr, r, rank, token, deadline)?);
        }
        // Accept the higher ones; strangers and wrong tokens are logged and dropped. The
        // listener stays open for the communicator's life: a shrink's survivors meet on it.
        let accepting = listener
            .try_clone()
            .map_err(|e| Error::io("listening", e))?;
        accept_peers(accepting, rank, world, token, deadline, &mut socks)?;
        NetTransport::assemble(Assembly {
            rank,
            socks,
            hosts,
            addrs: infos.into_iter().map(|(a, _)| a).collect(),
            listener,
            kind,
            timeout: call_timeout,
            chunk_bytes,
            token,
            listen_host,
            deadline,
            generation: 0,
        })
    }

    /// The transport over connections already made to every peer (`socks[r]`, `None` for this
    /// rank): shared-memory rings set up over them with the peers on this host where `kind`
    /// asks for them.
    fn assemble(a: Assembly<'_>) -> Result<NetTransport> {
        let Assembly {
            rank,
            socks,
            hosts,
            addrs,
            listener,
            kind,
            timeout: call_timeout,
            chunk_bytes,
            token,
            listen_host,
            deadline,
            generation,
        } = a;
        let world = socks.len();
        let same_host: Vec<bool> = hosts.iter().map(|&h| h == hosts[rank]).collect();
        // What processes killed mid-setup left under /dev/shm goes, once for every link (a
        // sweep reads the whole directory: once per link would cost O(P^2) a rank).
        if kind != TransportKind::Tcp && same_host.iter().filter(|&&s| s).count() > 1 {
            super::shm::sweep_dead();
        }
        // Many ranks on this host: smaller rings, within the host's budget.
        let ring_chunk =
            super::shm::ring_chunk(chunk_bytes, same_host.iter().filter(|&&s| s).count());
        let mut links = Vec::with_capacity(world);
        for (r, s) in socks.into_iter().enumerate() {
            let Some(sock) = s else {
                links.push(None);
                continue;
            };
            set_socket_options(&sock)
                .map_err(|e| Error::io(format!("configuring the connection to rank {r}"), e))?;
            let use_shm = match kind {
                TransportKind::Tcp => false,
                TransportKind::Shm => true,
                TransportKind::Auto | TransportKind::Mpi => same_host[r],
            };
            let shm = if use_shm {
                Some(ShmLink::open(
                    &sock,
                    rank,
                    r,
                    ring_chunk,
                    deadline.saturating_duration_since(Instant::now()),
                )?)
            } else {
                None
            };
            sock.set_nonblocking(true)
                .map_err(|e| Error::io("configuring a connection", e))?;
            links.push(Some(Link {
                peer: r,
                sock,
                shm,
                mid_frame: AtomicBool::new(false),
                closed: AtomicBool::new(false),
            }));
        }
        Ok(NetTransport {
            rank,
            world,
            timeout: call_timeout,
            chunk_bytes,
            links,
            aborted: AtomicBool::new(false),
            reason: Mutex::new(None),
            wake: eventfd()?,
            // A wait's lists are sized now: the first wait may come at any call.
            engine: Mutex::new(Reuse {
                wait: WaitLists {
                    pending: Vec::with_capacity(2 * world),
                    fds: Vec::with_capacity(world + 1),
                },
                ..Reuse::default()
            }),
            ident: Default::default(),
            data_started: AtomicBool::new(false),
            // Spinning pays while every rank of this host has a core of its own.
            spin: crate::sync::Spin::for_world(hosts.iter().filter(|&&h| h == hosts[rank]).count())
                .0,
            hosts,
            regroup: (token.to_string(), listen_host.to_string(), kind),
            standby: Mutex::new(Some(listener)),
            addrs,
            generation,
            shrinking: AtomicBool::new(false),
            notified: AtomicBool::new(false),
            waiting_for: AtomicU32::new(0),
            aborted_by: AtomicU32::new(0),
            shared: Mutex::new(Buffers::new(rank, world)),
            shared_min: AtomicUsize::new(usize::MAX),
            direct: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
        })
    }

    /// The survivors' transport ([`super::shrink`]): the ranks that are alive and reach their
    /// own shrink by `deadline`, renumbered in this transport's rank order.
    fn survivors(&self, deadline: Instant) -> Result<NetTransport> {
        if self.shrinking.swap(true, Ordering::AcqRel) {
            return Err(Error::config(
                "shrink: another thread is shrinking this communicator already",
            ));
        }
        let r = self.survivors_once(deadline);
        self.shrinking.store(false, Ordering::Release);
        r
    }

    fn survivors_once(&self, deadline: Instant) -> Result<NetTransport> {
        let generation = self.generation;
        // One for the probing, one for the survivors' transport.
        let standby = || {
            self.standby
                .lock()
                .as_ref()
                .ok_or_else(|| {
                    Error::config(
                        "shrink: this communicator was shrunk already; shrink the new one",
                    )
                })?
                .try_clone()
                .map_err(|e| Error::io("shrink: the listening socket", e))
        };
        let (listener, kept) = (standby()?, standby()?);
        let (token, listen_host, kind) = &self.regroup;
        let probe = super::shrink::Probe {
            rank: self.rank,
            addrs: &self.addrs,
            token,
            generation,
            deadline,
            timeout: self.timeout,
        };
        let found = super::shrink::survivors(&probe, listener)?;
        let rank = found
            .members
            .iter()
            .position(|&r| r == self.rank)
            .expect("a rank counts itself alive");
        // Hosts numbered again in order of their first rank.
        let mut seen: Vec<usize> = Vec::new();
        let hosts = found
            .members
            .iter()
            .map(|&r| {
                let h = self.hosts[r];
                seen.iter().position(|&x| x == h).unwrap_or_else(|| {
                    seen.push(h);
                    seen.len() - 1
                })
            })
            .collect();
        let child = NetTransport::assemble(Assembly {
            rank,
            socks: found.socks,
            hosts,
            addrs: found
                .members
                .iter()
                .map(|&r| self.addrs[r].clone())
                .collect(),
            listener: kept,
            kind: *kind,
            timeout: self.timeout,
            chunk_bytes: self.chunk_bytes,
            token,
            listen_host,
            // The probing may have used the whole timeout; the new links get their own.
            deadline: Instant::now() + self.timeout,
            generation: generation.wrapping_add(1),
        })?;
        // Its port is the survivors' now: a later shrink of this one is refused.
        self.standby.lock().take();
        Ok(child)
    }

    fn link(&self, peer: usize) -> &Link {
        self.links[peer].as_ref().expect("a link to every peer")
    }

    fn aborted_error(&self) -> Error {
        Error::Aborted {
            rank: self.rank,
            reason: self
                .reason
                .lock()
                .clone()
                .unwrap_or_else(|| "aborted".into()),
        }
    }

    fn set_aborted(&self, reason: &str) {
        {
            let mut r = self.reason.lock();
            if r.is_none() {
                *r = Some(reason.to_string());
            }
        }
        self.aborted.store(true, Ordering::SeqCst);
        let one = 1u64.to_ne_bytes();
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        // A call asleep on a shared-memory link wakes to see it.
        for s in self.links.iter().flatten().filter_map(|l| l.shm.as_ref()) {
            s.wake_all();
        }
    }

    /// Tell every peer why we stop, and which rank this rank was waiting for, then close our
    /// sending side (once; best effort, never blocks).
    fn notify_peers(&self, reason: &str) {
        if self.notified.swap(true, Ordering::AcqRel) {
            return;
        }
        let waiting_for = self.waiting_for.load(Ordering::Acquire);
        for l in self.links.iter().flatten() {
            if !l.mid_frame.load(Ordering::Acquire) {
                let msg = reason.as_bytes();
                let msg = &msg[..msg.len().min(4000)];
                let hdr = frame(
                    FRAME_ABORT,
                    waiting_for,
                    msg.len() as u64,
                    &self.ident.get(),
                );
                let _ = send_vectored(&l.sock, &[IoSlice::new(&hdr), IoSlice::new(msg)]);
            }
            let _ = l.sock.shutdown(Shutdown::Write);
            if let Some(s) = &l.shm {
                s.abort();
            }
        }
    }
}

/// A peer's rendezvous record, `ADDR WORLD TRANSPORT HOST-ID`: its address and host, once its
/// world size and transport are known to equal this rank's.
fn peer_record(
    v: &[u8],
    peer: usize,
    rank: usize,
    world: usize,
    kind: TransportKind,
) -> Result<(String, String)> {
    let v = String::from_utf8_lossy(v);
    let mut parts = v.splitn(4, ' ');
    let fields = (|| {
        let addr = parts.next()?;
        let their_world: usize = parts.next()?.parse().ok()?;
        let their_kind: TransportKind = parts.next()?.parse().ok()?;
        Some((addr, their_world, their_kind, parts.next()?))
    })();
    let Some((addr, their_world, their_kind, hid)) = fields else {
        return Err(Error::config(format!(
            "rendezvous: rank {peer} published a record this rank cannot read ('{}'): \
             is it another version of tutti?",
            v.chars().take(200).collect::<String>()
        )));
    };
    if their_world != world {
        return Err(Error::config(format!(
            "rendezvous: rank {peer} runs with world size {their_world}, rank {rank} with \
             world size {world}: give every rank the same world size"
        )));
    }
    if their_kind != kind {
        return Err(Error::config(format!(
            "rendezvous: rank {peer} asked for transport {their_kind}, rank {rank} for \
             transport {kind}: give every rank the same transport"
        )));
    }
    Ok((addr.to_string(), hid.to_string()))
}

/// `addr` ("host:port") as a socket address, by `deadline`: an address given as numbers at
/// once; a name is looked up on a thread of its own, which this rank stops waiting for at the
/// deadline (a lookup cannot be cancelled: the thread then ends on its own, holding nothing of
/// the caller's).
pub(super) fn resolve_by(addr: &str, deadline: Instant) -> std::io::Result<std::net::SocketAddr> {
    if let Ok(sa) = addr.parse::<std::net::SocketAddr>() {
        return Ok(sa);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let name = addr.to_string();
    std::thread::Builder::new()
        .name("tutti-resolve".into())
        .spawn(move || {
            let found = name.to_socket_addrs().and_then(|mut a| {
                a.next().ok_or_else(|| {
                    std::io::Error::new(ErrorKind::NotFound, "the name resolves to nothing")
                })
            });
            let _ = tx.send(found);
        })?;
    rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                ErrorKind::TimedOut,
                "looking the name up took past the timeout",
            ))
        })
}

fn connect_peer(
    addr: &str,
    peer: usize,
    rank: usize,
    token: &str,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut pause = Duration::from_millis(2);
    loop {
        let attempt = (|| -> Result<TcpStream> {
            let sa = resolve_by(addr, deadline)
                .map_err(|e| Error::io(format!("resolving rank {peer}'s address {addr}"), e))?;
            // Both bounded by the deadline of the whole setup too.
            let left = deadline.saturating_duration_since(Instant::now());
            let mut s = wire::connect(
                &sa,
                left.clamp(Duration::from_millis(1), Duration::from_secs(5)),
            )
            .map_err(|e| Error::io(format!("connecting to rank {peer} at {addr}"), e))?;
            wire::handshake_client(
                &mut s,
                token,
                Purpose::Data,
                rank as u32,
                left.clamp(Duration::from_millis(1), wire::HANDSHAKE_LIMIT),
            )?;
            Ok(s)
        })();
        match attempt {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(e @ Error::InvalidArgument { .. }) => return Err(e),
            Err(_) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
        }
    }
}

/// Accept the higher ranks on `listener` until every one of them has proved the token, or the
/// deadline. The handshakes run on this thread, without blocking (see `Acceptor`): strangers
/// that connect cost no thread, and those that stall are dropped at their own deadline or pushed
/// out by newer connections, so they delay no rank.
fn accept_peers(
    listener: TcpListener,
    rank: usize,
    world: usize,
    token: &str,
    deadline: Instant,
    socks: &mut [Option<TcpStream>],
) -> Result<()> {
    let mut missing: Vec<usize> = (rank + 1..world).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let mut acceptor =
        wire::Acceptor::new(listener, token, Purpose::Data, "peer")?.expecting(missing.len());
    while !missing.is_empty() {
        let Some((s, peer)) = acceptor.next(deadline)? else {
            return Err(Error::config(format!(
                "rank {rank}: ranks {missing:?} did not connect before the timeout (they did not start, or cannot reach this host)"
            )));
        };
        match usize::try_from(peer) {
            Ok(peer) if missing.contains(&peer) => {
                missing.retain(|&m| m != peer);
                socks[peer] = Some(s);
            }
            _ => wire::log_rejected(
                "peer",
                &Error::config(format!(
                    "a connection claiming rank {peer}, which rank {rank} does not expect"
                )),
            ),
        }
    }
    Ok(())
}

/// `ppoll(2)` on `fds` for at most `timeout`; EINTR is not an error (nothing became ready).
fn poll_for(fds: &mut [libc::pollfd], timeout: Duration) -> std::io::Result<()> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: fds is a valid array of pollfd for its length; ts outlives the call.
    let n = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            &ts,
            std::ptr::null(),
        )
    };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

/// `writev` without SIGPIPE: a peer that died makes the call fail with EPIPE instead of
/// killing a program that does not ignore the signal (C trainers do not).
fn send_vectored(sock: &TcpStream, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
    // SAFETY: a zeroed msghdr is valid; IoSlice has the layout of iovec on Unix, and the
    // slices outlive the call.
    let n = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = bufs.len() as _;
        libc::sendmsg(
            sock.as_raw_fd(),
            &msg,
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// What a receive in the engine is for.
enum Target<'a> {
    Data {
        dst: &'a mut [u8],
        mode: RecvMode<'a>,
    },
    /// A check round's frame: its payload (a rejection message, or nothing).
    Header(Vec<u8>),
}

struct SendState<'a> {
    peer: usize,
    hdr: [u8; HDR],
    hoff: usize,
    data: &'a [u8],
    off: usize,
    /// Waits for an earlier send of its exchange to the same peer (a point-to-point group's
    /// messages to one peer go one after the other on its stream).
    held: bool,
}

struct RecvState<'a> {
    peer: usize,
    target: Target<'a>,
    hdr: [u8; HDR],
    hoff: usize,
    len: usize,
    off: usize,
    /// Holds a partial chunk of a reducing receive (u64s: aligned for every dtype).
    scratch: Vec<u64>,
    fill: usize,
    /// The aux a data frame for this receive carries: 0 for a collective's, [`pair_aux`] of
    /// the dtype for a point-to-point receive's.
    aux: u32,
    /// Waits for an earlier receive of its exchange from the same peer.
    held: bool,
}

impl<'a> SendState<'a> {
    /// A point-to-point send of `data` to `peer` (`aux`: [`pair_aux`] of its dtype).
    fn pair(peer: usize, aux: u32, data: &'a [u8], ident: &Ident, held: bool) -> SendState<'a> {
        SendState {
            peer,
            hdr: frame(FRAME_DATA, aux, data.len() as u64, ident),
            hoff: 0,
            data,
            off: 0,
            held,
        }
    }
}

impl<'a> RecvState<'a> {
    /// A point-to-point receive from `peer` into `dst` (`aux`: [`pair_aux`] of its dtype).
    fn pair(peer: usize, aux: u32, dst: &'a mut [u8], held: bool) -> RecvState<'a> {
        RecvState {
            peer,
            target: Target::Data {
                dst,
                mode: RecvMode::Copy,
            },
            hdr: [0; HDR],
            hoff: 0,
            len: 0,
            off: 0,
            scratch: Vec::new(),
            fill: 0,
            aux,
            held,
        }
    }
}

/// The aux of a point-to-point data frame: a marker and the dtype both sides must state.
pub(crate) fn pair_aux(dtype: crate::dtype::DType) -> u32 {
    PAIR_MARK | dtype as u32
}

/// The high half of [`pair_aux`].
const PAIR_MARK: u32 = 0x5050_0000;

/// The identity every point-to-point frame carries: no call number (point-to-point calls are
/// not numbered with the collectives), so that a collective's frame where a point-to-point one
/// is due, or the reverse, is a `Mismatch` naming the collective.
pub(crate) fn pair_ident() -> Ident {
    CallHeader {
        call: u64::MAX,
        collective: crate::error::Collective::SendRecv,
        dtype: crate::dtype::DType::U8,
        count: 0,
        op: None,
        root: None,
        counts: None,
        algorithm: crate::call::Algorithm::Auto,
        chunk_bytes: 0,
        full_check: false,
        deterministic: false,
        compression: crate::call::Compression::None,
        tuning: 0,
        rejected: None,
    }
    .ident()
}

/// What an exchange reuses from the last (a repeated exchange allocates nothing): its send and
/// receive states (kept empty), the scratch buffers of reducing receives, and a wait's lists.
#[derive(Default)]
struct Reuse {
    sends: Vec<SendState<'static>>,
    recvs: Vec<RecvState<'static>>,
    scratch: Vec<Vec<u64>>,
    wait: WaitLists,
}

/// The lists a wait builds: the transfers still pending, and poll(2)'s descriptors.
#[derive(Default)]
struct WaitLists {
    pending: Vec<(usize, bool)>,
    fds: Vec<libc::pollfd>,
}

/// A peer's stream, read up to its ABORT frame (after a failure, to learn why it gave up and
/// whom it was waiting for).
struct Ask {
    peer: usize,
    /// Bytes of the frame under way still to skip.
    skip: u64,
    hdr: [u8; HDR],
    got: usize,
    /// Still worth reading.
    open: bool,
    /// The ABORT frame's aux (whom the peer waited for, plus one) and message length.
    abort: Option<(u32, u64)>,
}

impl Ask {
    fn new(peer: usize, skip: u64) -> Ask {
        Ask {
            peer,
            skip,
            hdr: [0; HDR],
            got: 0,
            open: true,
            abort: None,
        }
    }
}

/// The peers a step still waits for (to send, or to receive from), each once, in rank order.
fn pending_peers(sends: &[SendState<'_>], recvs: &[RecvState<'_>]) -> Vec<usize> {
    let mut peers: Vec<usize> = sends
        .iter()
        .filter(|s| !s.done())
        .map(|s| s.peer)
        .chain(recvs.iter().filter(|r| !r.done()).map(|r| r.peer))
        .collect();
    peers.sort_unstable();
    peers.dedup();
    peers
}

impl SendState<'_> {
    fn done(&self) -> bool {
        self.hoff == HDR && self.off == self.data.len()
    }

    /// Under way: not done, and not held behind another.
    fn active(&self) -> bool {
        !self.held && !self.done()
    }
}

impl RecvState<'_> {
    fn done(&self) -> bool {
        self.hoff == HDR && self.off == self.len
    }

    fn active(&self) -> bool {
        !self.held && !self.done()
    }
}

/// Release the held transfers whose earlier ones to or from the same peer are done; true if
/// any was released.
fn release_held(sends: &mut [SendState<'_>], recvs: &mut [RecvState<'_>]) -> bool {
    let mut released = false;
    for i in 0..sends.len() {
        if sends[i].held
            && sends[..i]
                .iter()
                .all(|s| s.peer != sends[i].peer || s.done())
        {
            sends[i].held = false;
            released = true;
        }
    }
    for i in 0..recvs.len() {
        if recvs[i].held
            && recvs[..i]
                .iter()
                .all(|r| r.peer != recvs[i].peer || r.done())
        {
            recvs[i].held = false;
            released = true;
        }
    }
    released
}

fn lost(site: Site, peer: usize, e: &std::io::Error) -> Error {
    Error::PeerLost {
        site,
        peer,
        detail: e.to_string(),
    }
}

fn closed(what: &str) -> std::io::Error {
    std::io::Error::new(ErrorKind::UnexpectedEof, what.to_string())
}

impl NetTransport {
    /// Move a send forward until it would block. True if anything moved.
    fn progress_send(&self, site: Site, s: &mut SendState<'_>) -> Result<bool> {
        let link = self.link(s.peer);
        if let Some(shm) = &link.shm {
            return shm
                .push(site, s.peer, &s.hdr, &mut s.hoff, s.data, &mut s.off)
                .map_err(|e| self.ring_error(site, s.peer, e));
        }
        let mut moved = false;
        while !s.done() {
            let bufs = [
                IoSlice::new(&s.hdr[s.hoff..]),
                IoSlice::new(&s.data[s.off..]),
            ];
            match send_vectored(&link.sock, &bufs) {
                Ok(0) => {
                    return Err(lost(
                        site,
                        s.peer,
                        &std::io::Error::from(ErrorKind::WriteZero),
                    ))
                }
                Ok(mut n) => {
                    moved = true;
                    let h = n.min(HDR - s.hoff);
                    s.hoff += h;
                    n -= h;
                    s.off += n;
                    link.mid_frame.store(!s.done(), Ordering::Release);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // A peer that gave up may have said why before it closed.
                Err(e) => {
                    return Err(self
                        .drain_abort(site, s.peer)
                        .unwrap_or_else(|| lost(site, s.peer, &e)))
                }
            }
        }
        Ok(moved)
    }

    fn read_abort(&self, site: Site, peer: usize, len: u64) -> Error {
        self.aborted_by
            .store(u32::try_from(peer + 1).unwrap_or(0), Ordering::Release);
        let link = self.link(peer);
        let mut msg = vec![0u8; len.min(4000) as usize];
        let _ = link.sock.set_nonblocking(false);
        let _ = link.sock.set_read_timeout(Some(Duration::from_secs(1)));
        let _ = (&link.sock).read_exact(&mut msg);
        let _ = link.sock.set_nonblocking(true);
        Error::Aborted {
            rank: site.rank,
            reason: format!("rank {peer} gave up: {}", String::from_utf8_lossy(&msg)),
        }
    }

    /// The peer's ABORT frame, when one is at the head of its stream (taken off the stream).
    fn peek_abort(&self, site: Site, peer: usize) -> Option<Error> {
        let l = self.link(peer);
        let mut h = [0u8; HDR];
        // SAFETY: peeking into a local buffer.
        let got = unsafe {
            libc::recv(
                l.sock.as_raw_fd(),
                h.as_mut_ptr().cast(),
                HDR,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if got != HDR as isize || parse_frame(&h).0 != FRAME_ABORT {
            return None;
        }
        let _ = (&l.sock).read_exact(&mut h);
        Some(self.read_abort(site, peer, parse_frame(&h).2))
    }

    /// The peer's ABORT frame, reading past the frames it sent before it (a peer can be a step
    /// ahead), for up to half a second. Only for a call that is failing anyway: what it reads is
    /// lost.
    fn drain_abort(&self, site: Site, peer: usize) -> Option<Error> {
        let mut ask = [Ask::new(peer, 0)];
        self.read_to_aborts(&mut ask, Instant::now() + Duration::from_millis(500));
        let (_, len) = ask[0].abort?;
        Some(self.read_abort(site, peer, len))
    }

    /// A shared-memory ring reported the peer aborted: its ABORT frame says why.
    fn ring_error(&self, site: Site, peer: usize, e: Error) -> Error {
        match e {
            Error::Aborted { .. } => self.drain_abort(site, peer).unwrap_or(e),
            e => e,
        }
    }

    /// A frame whose call identity differs from this rank's call: a `Mismatch` naming the
    /// first field that differs.
    fn mismatch(&self, site: Site, peer: usize, theirs: &Ident, mine: &Ident) -> Error {
        super::wire::mismatch(site, peer, theirs, mine)
    }

    /// Check the header of an arriving frame against this rank's call and the receive it
    /// arrives for; set the length to receive.
    fn accept_frame(&self, site: Site, r: &mut RecvState<'_>, mine: &Ident) -> Result<()> {
        let (kind, aux, len) = parse_frame(&r.hdr);
        if kind == FRAME_ABORT {
            return Err(self.read_abort(site, r.peer, len));
        }
        let theirs = frame_ident(&r.hdr);
        match (&mut r.target, kind) {
            // A check round: identities are compared once every peer's frame is in, so that
            // every rank reports the same first difference and the communicator stays usable.
            (Target::Header(buf), FRAME_HEADER) => {
                if len > MAX_HEADER {
                    return Err(Error::invalid(
                        site,
                        format!("rank {} sent a call header of {len} bytes", r.peer),
                    ));
                }
                buf.resize(len as usize, 0);
                r.len = len as usize;
                Ok(())
            }
            // A rank that rejected its arguments says so instead of sending data; its header
            // states the call as it could (no elements, the op it refused), so only the call
            // number must match.
            (Target::Data { .. }, FRAME_HEADER)
                if len > 0 && len <= MAX_HEADER && super::wire::same_call(theirs, mine) =>
            {
                self.data_started.store(true, Ordering::Release);
                let message = self.read_payload(site, r.peer, len as usize);
                Err(Error::PeerRejected {
                    site,
                    peer: r.peer,
                    message,
                })
            }
            (Target::Data { dst, mode }, FRAME_DATA) if theirs == mine => {
                if r.aux != 0 && (aux != r.aux || len != dst.len() as u64) {
                    let sent = crate::dtype::DType::from_u32(aux & 0xffff)
                        .filter(|_| aux & !0xffff == PAIR_MARK);
                    return Err(match sent {
                        Some(d) => super::pair_mismatch(
                            site,
                            r.peer,
                            (d, len as usize),
                            (
                                crate::dtype::DType::from_u32(r.aux & 0xffff).unwrap_or(d),
                                dst.len(),
                            ),
                        ),
                        None => Error::invalid(
                            site,
                            format!("rank {} sent a frame this rank cannot read", r.peer),
                        ),
                    });
                }
                if len != dst.len() as u64 {
                    return Err(Error::invalid(
                        site,
                        format!(
                            "rank {} sent {len} bytes where {} were expected",
                            r.peer,
                            dst.len()
                        ),
                    ));
                }
                r.len = dst.len();
                if mode.combined().is_some() && self.link(r.peer).shm.is_none() {
                    r.scratch
                        .resize(self.chunk_bytes.min(r.len).max(8).div_ceil(8), 0);
                }
                Ok(())
            }
            _ if theirs != mine => {
                self.data_started.store(true, Ordering::Release);
                let e = self.mismatch(site, r.peer, theirs, mine);
                // A frame of an earlier call is left over from a call that failed: the peer's
                // ABORT frame behind it says why, which is the news.
                // (Point-to-point frames carry no call number: u64::MAX.)
                let call = |i: &Ident| u64::from_le_bytes(i[..8].try_into().expect("8 bytes"));
                if call(theirs) < call(mine) && call(mine) != u64::MAX {
                    return Err(self.drain_abort(site, r.peer).unwrap_or(e));
                }
                Err(e)
            }
            (target, _) => {
                self.data_started.store(true, Ordering::Release);
                let want = match target {
                    Target::Data { .. } => FRAME_DATA,
                    Target::Header(_) => FRAME_HEADER,
                };
                Err(Error::invalid(
                    site,
                    format!("rank {} is out of step with this rank (sent frame kind {kind} where {want} was due)", r.peer),
                ))
            }
        }
    }

    /// Read a short payload (a rejection message) of a frame whose header was just taken,
    /// waiting at most a second for it.
    fn read_payload(&self, site: Site, peer: usize, len: usize) -> String {
        let link = self.link(peer);
        let mut msg = vec![0u8; len];
        match &link.shm {
            Some(shm) => {
                let (mut off, until) = (0, Instant::now() + Duration::from_secs(1));
                while off < len && Instant::now() < until {
                    if !matches!(
                        shm.pull(site, peer, &mut msg, RecvMode::Copy, &mut off),
                        Ok(true)
                    ) {
                        shm.sleep(
                            true,
                            false,
                            (Instant::now() + Duration::from_millis(10)).min(until),
                        );
                    }
                }
            }
            None => {
                let _ = link.sock.set_nonblocking(false);
                let _ = link.sock.set_read_timeout(Some(Duration::from_secs(1)));
                let _ = (&link.sock).read_exact(&mut msg);
                let _ = link.sock.set_nonblocking(true);
            }
        }
        String::from_utf8_lossy(&msg).into_owned()
    }

    /// Move a receive forward until it would block. True if anything moved.
    fn progress_recv(&self, site: Site, r: &mut RecvState<'_>, mine: &Ident) -> Result<bool> {
        let link = self.link(r.peer);
        if let Some(shm) = &link.shm {
            let mut moved = false;
            if r.hoff < HDR {
                if !shm
                    .peek_header(site, r.peer, &mut r.hdr)
                    .map_err(|e| self.ring_error(site, r.peer, e))?
                {
                    return self.dry_ring(site, r.peer).map(|_| false);
                }
                r.hoff = HDR;
                moved = true;
                self.accept_frame(site, r, mine)?;
            }
            if r.done() {
                return Ok(moved);
            }
            let (dst, mode) = match &mut r.target {
                Target::Data { dst, mode } => (&mut **dst, *mode),
                Target::Header(b) => (&mut b[..], RecvMode::Copy),
            };
            let pulled = shm
                .pull(site, r.peer, dst, mode, &mut r.off)
                .map_err(|e| self.ring_error(site, r.peer, e))?;
            if !pulled && !r.done() {
                self.dry_ring(site, r.peer)?;
            }
            return Ok(pulled || moved);
        }
        let mut moved = false;
        loop {
            if r.hoff < HDR {
                match (&link.sock).read(&mut r.hdr[r.hoff..]) {
                    Ok(0) => return Err(lost(site, r.peer, &closed("connection closed"))),
                    Ok(n) => {
                        moved = true;
                        r.hoff += n;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => return Err(lost(site, r.peer, &e)),
                }
                if r.hoff < HDR {
                    continue;
                }
                self.accept_frame(site, r, mine)?;
            }
            if r.done() {
                return Ok(moved);
            }
            let n = {
                let buf: &mut [u8] = match &mut r.target {
                    Target::Header(b) => &mut b[r.off..],
                    Target::Data {
                        dst,
                        mode: RecvMode::Copy,
                    } => &mut dst[r.off..],
                    Target::Data { .. } => {
                        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut r.scratch);
                        let want = (scratch.len() - r.fill).min(r.len - r.off - r.fill);
                        &mut scratch[r.fill..r.fill + want]
                    }
                };
                match (&link.sock).read(buf) {
                    Ok(0) => return Err(lost(site, r.peer, &closed("connection closed"))),
                    Ok(n) => n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => return Err(lost(site, r.peer, &e)),
                }
            };
            moved = true;
            let combined = match &r.target {
                Target::Data { mode, .. } => mode.combined(),
                Target::Header(_) => None,
            };
            let (Some(dtype), Target::Data { dst, mode }) = (combined, &mut r.target) else {
                r.off += n;
                continue;
            };
            // A reducing receive combines whole elements only: a partial one waits in scratch.
            r.fill += n;
            let whole = r.fill - r.fill % dtype.size();
            let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut r.scratch);
            if r.fill == scratch.len() || r.off + r.fill == r.len {
                mode.deliver(&mut dst[r.off..r.off + whole], r.off, &scratch[..whole]);
                scratch.copy_within(whole..r.fill, 0);
                r.off += whole;
                r.fill -= whole;
            }
        }
    }

    /// A shared-memory peer's ring is empty where this rank waits for more: fine while the peer
    /// lives; once it has hung up, the rest will never come.
    fn dry_ring(&self, site: Site, peer: usize) -> Result<()> {
        let link = self.link(peer);
        if !link.closed.load(Ordering::Relaxed) {
            return Ok(());
        }
        if let Some(e) = self.drain_abort(site, peer) {
            return Err(e);
        }
        Err(lost(site, peer, &closed("connection closed mid-message")))
    }

    /// The engine: drive `sends` and `recvs` to completion (the caller holds `self.engine`,
    /// whose lists `wait` are).
    fn run(
        &self,
        site: Site,
        phase: &'static str,
        sends: &mut [SendState<'_>],
        recvs: &mut [RecvState<'_>],
        wait: &mut WaitLists,
    ) -> Result<()> {
        self.aborted_by.store(0, Ordering::Release);
        self.run_steps(site, phase, sends, recvs, wait)
            .map_err(|e| self.blame(phase, e, sends, recvs))
    }

    /// A failed step: its error says what this rank was waiting for, and a timeout asks the
    /// ranks it waited for what they were waiting for. The rank that stopped is the one at the
    /// end of that chain; the first rank to time out may only be waiting for a rank that waits.
    fn blame(
        &self,
        phase: &'static str,
        e: Error,
        sends: &[SendState<'_>],
        recvs: &[RecvState<'_>],
    ) -> Error {
        let by = (self.aborted_by.swap(0, Ordering::AcqRel) as usize).checked_sub(1);
        let pending = pending_peers(sends, recvs);
        // Whom this rank tells its peers it waited for: a peer it still receives from (it has
        // not sent: that is the news), else one it still sends to; never the rank that gave up.
        let awaited = recvs
            .iter()
            .filter(|r| !r.done() && Some(r.peer) != by)
            .map(|r| r.peer)
            .min()
            .or_else(|| pending.iter().copied().find(|&p| Some(p) != by));
        self.waiting_for.store(
            awaited.map_or(0, |p| u32::try_from(p + 1).unwrap_or(0)),
            Ordering::Release,
        );
        match e {
            Error::Timeout {
                ref waiting_for, ..
            } if !waiting_for.is_empty() => {
                // Give up now, telling every peer, and hear what the others answer: whom each
                // was waiting for, as far as this rank can learn (a flight recorder's view).
                let reason = e.to_string();
                self.set_aborted(&reason);
                self.notify_peers(&reason);
                let answers = self.ask_waits(recvs);
                let mut e = e;
                if let Error::Timeout { stalled_on, .. } = &mut e {
                    *stalled_on = answers;
                }
                e
            }
            // A peer gave up while this rank still waited for others: say so, so that its
            // guess is not repeated as fact.
            Error::Aborted { rank, reason } if by.is_some() => {
                let others: Vec<usize> = pending.into_iter().filter(|&p| Some(p) != by).collect();
                if others.is_empty() {
                    return Error::Aborted { rank, reason };
                }
                Error::Aborted {
                    rank,
                    reason: format!(
                        "rank {rank} was waiting for {} to {phase} when {reason}",
                        crate::error::list(&others)
                    ),
                }
            }
            e => e,
        }
    }

    /// After a timeout: the answers of the other ranks, read from their ABORT frames as they
    /// come (all at once, for a tenth of the timeout and at most a second): (rank, the rank it
    /// was itself waiting for). Answers naming this rank say nothing new and are left out. A
    /// TCP stream that stopped mid-header cannot be read on and is not asked; the streams of
    /// peers this step no longer receives from are between frames.
    fn ask_waits(&self, recvs: &[RecvState<'_>]) -> Vec<(usize, usize)> {
        let until = Instant::now() + (self.timeout / 10).min(Duration::from_secs(1));
        let mut asks: Vec<Ask> = (0..self.world)
            .filter(|&peer| peer != self.rank)
            .filter_map(|peer| {
                // What is left of the frame being received, on a stream that carries data.
                let skip = match recvs.iter().find(|r| r.peer == peer && !r.done()) {
                    _ if self.link(peer).shm.is_some() => 0,
                    None => 0,
                    Some(r) if r.hoff == 0 => 0,
                    Some(r) if r.hoff == HDR => (r.len - r.off - r.fill) as u64,
                    Some(_) => return None,
                };
                Some(Ask::new(peer, skip))
            })
            .collect();
        self.read_to_aborts(&mut asks, until);
        asks.iter()
            .filter_map(|a| {
                let (aux, _) = a.abort?;
                let w = (aux as usize).checked_sub(1)?;
                (w != self.rank).then_some((a.peer, w))
            })
            .collect()
    }

    /// Read the peers' streams of `asks` together (non-blocking, polled), past their frames,
    /// until each reaches its ABORT frame's header (kept in `abort`), ends, or `until` passes.
    fn read_to_aborts(&self, asks: &mut [Ask], until: Instant) {
        let mut scratch = vec![0u8; 64 << 10];
        loop {
            for a in asks.iter_mut().filter(|a| a.open) {
                a.open = self.read_to_abort(a, &mut scratch);
            }
            let mut fds: Vec<libc::pollfd> = asks
                .iter()
                .filter(|a| a.open)
                .map(|a| libc::pollfd {
                    fd: self.link(a.peer).sock.as_raw_fd(),
                    events: libc::POLLIN | libc::POLLRDHUP,
                    revents: 0,
                })
                .collect();
            let left = until.saturating_duration_since(Instant::now());
            if fds.is_empty() || left.is_zero() || poll_for(&mut fds, left).is_err() {
                return;
            }
        }
    }

    /// Read what `a.peer`'s stream holds, up to its ABORT frame's header; false once there is
    /// nothing more to wait for (the header was read, or the stream ended or failed).
    fn read_to_abort(&self, a: &mut Ask, scratch: &mut [u8]) -> bool {
        let l = self.link(a.peer);
        let mut s = &l.sock;
        loop {
            let buf = if a.skip > 0 {
                let n = a.skip.min(scratch.len() as u64) as usize;
                &mut scratch[..n]
            } else {
                &mut a.hdr[a.got..]
            };
            let n = match s.read(buf) {
                Ok(0) => return false,
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return false,
            };
            if a.skip > 0 {
                a.skip -= n as u64;
                continue;
            }
            a.got += n;
            if a.got < HDR {
                continue;
            }
            a.got = 0;
            let (kind, aux, len) = parse_frame(&a.hdr);
            if kind == FRAME_ABORT {
                a.abort = Some((aux, len));
                return false;
            }
            // To a shared-memory peer only ABORT frames travel on the socket.
            a.skip = if l.shm.is_some() { 0 } else { len };
        }
    }

    /// The engine's loop: move every send and receive until all are done.
    fn run_steps(
        &self,
        site: Site,
        phase: &'static str,
        sends: &mut [SendState<'_>],
        recvs: &mut [RecvState<'_>],
        lists: &mut WaitLists,
    ) -> Result<()> {
        let mine = self.ident.get();
        let mut held = sends.iter().any(|s| s.held) || recvs.iter().any(|r| r.held);
        // The deadline is the timeout from the last move, read from the clock once a wait
        // begins (`None`: moved since), not at every move.
        let mut deadline: Option<Instant> = None;
        let mut pause = Duration::from_micros(20);
        let mut spin_until: Option<Instant> = None;
        // Spinning without yielding, as of the last clock read (see below).
        let mut spinning = false;
        let mut looks = 0u32;
        loop {
            if self.aborted.load(Ordering::Acquire) {
                return Err(self.aborted_error());
            }
            let mut moved = false;
            for s in sends.iter_mut().filter(|s| s.active()) {
                moved |= self.progress_send(site, s)?;
            }
            for r in recvs.iter_mut().filter(|r| r.active()) {
                moved |= self.progress_recv(site, r, &mine)?;
            }
            if sends.iter().all(|s| s.done()) && recvs.iter().all(|r| r.done()) {
                return Ok(());
            }
            if held {
                moved |= release_held(sends, recvs);
                held = sends.iter().any(|s| s.held) || recvs.iter().any(|r| r.held);
            }
            if moved {
                deadline = None;
                pause = Duration::from_micros(20);
                spin_until = None;
                spinning = false;
                looks = 0;
                continue;
            }
            // While spinning with a core of its own (the first microseconds of a wait, before
            // it yields between looks), a rank looks again at once, reading the clock (for the
            // deadline and the end of the spin) every 16th look only: a reply is then noticed
            // within a look, not a look plus a clock read. No pause instruction between looks
            // either: on recent x86 cores one takes over a hundred cycles, which a reply would
            // wait out (8-byte ping-pong over shared memory: 0.26 against 0.28-0.30 µs).
            looks = looks.wrapping_add(1);
            if spinning && looks % 16 != 0 {
                continue;
            }
            let now = Instant::now();
            let deadline = *deadline.get_or_insert(now + self.timeout);
            if now >= deadline {
                return Err(Error::Timeout {
                    site,
                    waiting_for: pending_peers(sends, recvs),
                    phase,
                    timeout: self.timeout,
                    stalled_on: Vec::new(),
                });
            }
            // Spin briefly while every rank has a core: a reply in a shared-memory slot or on
            // loopback is then caught without a sleep and a wake-up. Past the first few
            // microseconds the spin yields the core between looks: the peer may have been woken
            // onto this core (the scheduler likes to put a woken process next to its waker), and
            // would otherwise wait for this rank's spin to end before it could answer. Where
            // ranks outnumber cores a rank only yields, for as long: the ranks it waits for get
            // the core at once, and none of them pays a sleep and a wake-up per message.
            let spin_until = *spin_until.get_or_insert(now + self.spin.max(YIELD_FOR));
            spinning = false;
            if now < spin_until {
                if self.spin.is_zero()
                    || spin_until - now < self.spin.saturating_sub(Duration::from_micros(3))
                {
                    if !self.spin.is_zero() {
                        for _ in 0..4 {
                            std::hint::spin_loop();
                        }
                    }
                    std::thread::yield_now();
                } else {
                    // Looking again at once: a pause here would delay the reply's notice.
                    spinning = true;
                }
                continue;
            }
            let on_ring = |peer: usize| self.link(peer).shm.is_some();
            let ring_only = sends.iter().all(|s| !s.active() || on_ring(s.peer))
                && recvs.iter().all(|r| !r.active() || on_ring(r.peer));
            self.wait(sends, recvs, ring_only, &mut pause, deadline, lists)?;
            if let Some(e) = self.hang_ups(site, sends)? {
                return Err(e);
            }
        }
    }

    /// Sleep until something may have moved: on a shared-memory link's futex when every wait is
    /// on a ring, else in poll(2) on the sockets and the abort eventfd (shared-memory rings, not
    /// pollable, are then looked at again after `pause`, which doubles up to 1 ms).
    fn wait(
        &self,
        sends: &[SendState<'_>],
        recvs: &[RecvState<'_>],
        ring_only: bool,
        pause: &mut Duration,
        deadline: Instant,
        lists: &mut WaitLists,
    ) -> Result<()> {
        let WaitLists { pending, fds } = lists;
        pending.clear();
        pending.extend(
            sends
                .iter()
                .filter(|s| s.active())
                .map(|s| (s.peer, false))
                .chain(recvs.iter().filter(|r| r.active()).map(|r| (r.peer, true))),
        );
        if ring_only {
            let (peer, _) = pending[0];
            let filled = pending.iter().any(|&(p, recv)| p == peer && recv);
            let free = pending.iter().any(|&(p, recv)| p == peer && !recv);
            let one_link = pending.iter().all(|&(p, _)| p == peer);
            // Sleep up to 20 ms on the only link waited for (a hang-up does not ring the
            // futex: it is looked for after every sleep), 1 ms when others are waited for too.
            let nap = if one_link {
                Duration::from_millis(20)
            } else {
                Duration::from_millis(1)
            };
            let shm = self.link(peer).shm.as_ref().expect("a ring");
            shm.sleep(filled, free, (Instant::now() + nap).min(deadline));
        }
        fds.clear();
        let pfd = |fd: RawFd, events: i16| libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        fds.push(pfd(self.wake.as_raw_fd(), libc::POLLIN));
        for l in self.links.iter().flatten() {
            let mut ev = 0;
            if l.shm.is_none() {
                if pending.iter().any(|&(p, recv)| p == l.peer && !recv) {
                    ev |= libc::POLLOUT;
                }
                if pending.iter().any(|&(p, recv)| p == l.peer && recv) {
                    ev |= libc::POLLIN;
                }
            }
            // Every link is watched for hang-ups, except a closed one with nothing to do
            // (poll ignores a negative fd): its hang-up would otherwise wake every wait.
            if !l.closed.load(Ordering::Relaxed) {
                ev |= libc::POLLRDHUP;
            }
            fds.push(pfd(if ev == 0 { -1 } else { l.sock.as_raw_fd() }, ev));
        }
        let wait = if ring_only {
            Duration::ZERO
        } else if pending.iter().any(|&(p, _)| self.link(p).shm.is_some()) {
            let p = *pause;
            *pause = (*pause * 2).min(Duration::from_millis(1));
            p
        } else {
            deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(1))
        };
        poll_for(fds, wait).map_err(|e| Error::io("poll", e))?;
        for (l, f) in self.links.iter().flatten().zip(&fds[1..]) {
            if f.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                l.closed.store(true, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Hang-ups seen by `wait`. A peer that gave up leaves an ABORT frame at the head of its
    /// stream (its reason names the root cause). A peer that hangs up while we push into its
    /// ring is lost: it cannot have finished without taking our data. A peer we receive from may
    /// have sent everything and left; `progress_recv` calls it lost only when its ring runs dry.
    /// An idle peer that left is no concern until we need it.
    fn hang_ups(&self, site: Site, sends: &[SendState<'_>]) -> Result<Option<Error>> {
        for l in self.links.iter().flatten() {
            if !l.closed.load(Ordering::Relaxed) {
                continue;
            }
            if let Some(e) = self.peek_abort(site, l.peer) {
                return Ok(Some(e));
            }
            let pushing = l.shm.is_some() && sends.iter().any(|s| s.peer == l.peer && !s.done());
            if pushing {
                if let Some(e) = self.drain_abort(site, l.peer) {
                    return Ok(Some(e));
                }
                return Ok(Some(lost(site, l.peer, &closed("connection closed"))));
            }
        }
        Ok(None)
    }

    /// What a check round's frames say: a peer's rejection, or the first peer whose call differs.
    fn check_round(&self, site: Site, recvs: &[RecvState<'_>], ident: &Ident) -> Result<()> {
        for r in recvs {
            let Target::Header(message) = &r.target else {
                unreachable!("header receives")
            };
            if !message.is_empty() {
                return Err(Error::PeerRejected {
                    site,
                    peer: r.peer,
                    message: String::from_utf8_lossy(message).into_owned(),
                });
            }
            let theirs = frame_ident(&r.hdr);
            if theirs != ident {
                return Err(self.mismatch(site, r.peer, theirs, ident));
            }
        }
        Ok(())
    }
}

impl Transport for NetTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn begin(&self, site: Site, header: &CallHeader, buffers: CallBuffers) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        self.data_started.store(false, Ordering::Release);
        self.direct.store(false, Ordering::Release);
        self.claimed.store(false, Ordering::Release);
        if self.world == 1 {
            return Ok(());
        }
        let ident = header.ident();
        self.ident.set(&ident);
        // By default a call's check travels with its data. A call that moves none (a barrier,
        // no elements), one whose arguments this rank rejected, rooted calls, and every call under
        // `TUTTI_CHECK=full` have a check round first: every rank sends its identity (and any
        // rejection) to every other and compares what it gets, so a difference found there
        // leaves the communicator usable.
        // Every rooted call has one too (broadcast, reduce, gather, scatter): a rank that only
        // sends in a call (the root of a broadcast or scatter, the others in a reduce or
        // gather) would otherwise check nothing, and two ranks that both take themselves for
        // the root would neither receive. So do the calls with counts: ranks whose counts
        // differ may move data that matches in length, or none between some pairs.
        // A communicator that allocated shared buffers also rounds every call large enough to
        // run through them: each rank claims its buffers before, and all decide alike after.
        use crate::error::Collective::{Barrier, Broadcast, Reduce};
        let share = header.collective != Barrier
            && header.count.saturating_mul(header.dtype.size())
                >= self.shared_min.load(Ordering::Acquire);
        let round = header.full_check
            || header.count == 0
            || matches!(header.collective, Barrier | Broadcast | Reduce)
            || header.root.is_some()
            || header.counts.is_some()
            || header.rejected.is_some()
            || share;
        if !round {
            return Ok(());
        }
        if share {
            let b = if header.rejected.is_some() {
                CallBuffers::NONE
            } else {
                buffers
            };
            let claimed = self.shared.lock().claim(site.call, &b);
            self.claimed.store(claimed, Ordering::Release);
        }
        let message = header
            .rejected
            .as_deref()
            .map(|m| if m.is_empty() { "rejected" } else { m })
            .unwrap_or("")
            .as_bytes();
        let message = &message[..message.len().min(MAX_HEADER as usize)];
        let hdr = frame(FRAME_HEADER, 0, message.len() as u64, &ident);
        let peers = (0..self.world).filter(|&r| r != self.rank);
        let mut engine = self.engine.lock();
        let reuse = &mut *engine;
        let mut sends: Vec<SendState<'_>> = recycle(std::mem::take(&mut reuse.sends));
        sends.extend(peers.clone().map(|peer| SendState {
            peer,
            hdr,
            hoff: 0,
            data: message,
            off: 0,
            held: false,
        }));
        let mut recvs: Vec<RecvState<'_>> = recycle(std::mem::take(&mut reuse.recvs));
        recvs.extend(peers.map(|peer| RecvState {
            peer,
            target: Target::Header(Vec::new()),
            hdr: [0; HDR],
            hoff: 0,
            len: 0,
            off: 0,
            scratch: Vec::new(),
            fill: 0,
            aux: 0,
            held: false,
        }));
        let result = self.run(site, "arrive", &mut sends, &mut recvs, &mut reuse.wait);
        reuse.sends = recycle(sends);
        result?;
        let checked = self.check_round(site, &recvs, &ident);
        reuse.recvs = recycle(recvs);
        checked?;
        if share && self.shared.lock().decide(site.call) {
            // Peers now write into this rank's buffers: a failure from here aborts.
            self.data_started.store(true, Ordering::Release);
            self.direct.store(true, Ordering::Release);
        }
        Ok(())
    }

    fn exchange(&self, site: Site, sends: &[SendOp<'_>], recvs: &mut [RecvOp<'_>]) -> Result<()> {
        super::check_peers(site, self.rank, self.world, sends, recvs)?;
        // From here a failure leaves peers mid-step: `end` must abort the communicator.
        self.data_started.store(true, Ordering::Release);
        let ident = self.ident.get();
        let mut engine = self.engine.lock();
        let reuse = &mut *engine;
        let mut ss: Vec<SendState<'_>> = recycle(std::mem::take(&mut reuse.sends));
        ss.extend(sends.iter().map(|s| SendState {
            peer: s.peer,
            hdr: frame(FRAME_DATA, 0, s.data.len() as u64, &ident),
            hoff: 0,
            data: s.data,
            off: 0,
            held: false,
        }));
        // Reducing receives over TCP stage chunks in scratch buffers kept between exchanges:
        // each takes the smallest that holds its chunk (else the largest, grown once), so that
        // a buffer resized to a length it had is not allocated or zeroed again, whichever
        // receives of an exchange reduce.
        let pool = &mut reuse.scratch;
        let chunk = self.chunk_bytes;
        let mut take = |r: &RecvOp<'_>| {
            if r.mode.combined().is_none() || self.link(r.peer).shm.is_some() {
                return Vec::new();
            }
            let words = chunk.min(r.dst.len()).max(8).div_ceil(8);
            let fit = (0..pool.len())
                .filter(|&i| pool[i].capacity() >= words)
                .min_by_key(|&i| pool[i].capacity())
                .or_else(|| (0..pool.len()).max_by_key(|&i| pool[i].capacity()));
            fit.map(|i| pool.swap_remove(i)).unwrap_or_default()
        };
        let mut rs: Vec<RecvState<'_>> = recycle(std::mem::take(&mut reuse.recvs));
        rs.extend(recvs.iter_mut().map(|r| RecvState {
            scratch: take(r),
            peer: r.peer,
            target: Target::Data {
                dst: &mut *r.dst,
                mode: r.mode,
            },
            hdr: [0; HDR],
            hoff: 0,
            len: 0,
            off: 0,
            fill: 0,
            aux: 0,
            held: false,
        }));
        let result = self.run(site, "exchange data", &mut ss, &mut rs, &mut reuse.wait);
        for r in rs.iter_mut() {
            let v = std::mem::take(&mut r.scratch);
            if v.capacity() > 0 {
                reuse.scratch.push(v);
            }
        }
        reuse.sends = recycle(ss);
        reuse.recvs = recycle(rs);
        result
    }

    /// Every operation of the group is under way at once, but for the messages to (or from) one
    /// peer, which follow each other on its stream: each starts when the one before it is done.
    fn pair_exchange(&self, site: Site, ops: &mut [super::PairOp<'_>]) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        static IDENT: std::sync::OnceLock<Ident> = std::sync::OnceLock::new();
        let ident = IDENT.get_or_init(pair_ident);
        self.ident.set(ident);
        self.data_started.store(true, Ordering::Release);
        let mut engine = self.engine.lock();
        let reuse = &mut *engine;
        const PHASE: &str = "point-to-point";
        // One operation (a blocking send or recv): its state on the stack, no list to fill.
        if let [op] = ops {
            let (peer, aux) = (op.peer, pair_aux(op.dtype));
            return match &mut op.data {
                super::PairData::Send(data) => {
                    let mut s = [SendState::pair(peer, aux, data, ident, false)];
                    self.run(site, PHASE, &mut s, &mut [], &mut reuse.wait)
                }
                super::PairData::Recv(dst) => {
                    let mut r = [RecvState::pair(peer, aux, dst, false)];
                    self.run(site, PHASE, &mut [], &mut r, &mut reuse.wait)
                }
            };
        }
        let mut ss: Vec<SendState<'_>> = recycle(std::mem::take(&mut reuse.sends));
        let mut rs: Vec<RecvState<'_>> = recycle(std::mem::take(&mut reuse.recvs));
        for op in ops.iter_mut() {
            let (peer, aux) = (op.peer, pair_aux(op.dtype));
            match &mut op.data {
                super::PairData::Send(data) => {
                    let held = ss.iter().any(|s| s.peer == peer);
                    ss.push(SendState::pair(peer, aux, data, ident, held))
                }
                super::PairData::Recv(dst) => {
                    let held = rs.iter().any(|r| r.peer == peer);
                    rs.push(RecvState::pair(peer, aux, dst, held))
                }
            }
        }
        let result = self.run(site, PHASE, &mut ss, &mut rs, &mut reuse.wait);
        reuse.sends = recycle(ss);
        reuse.recvs = recycle(rs);
        result
    }

    fn hosts(&self) -> Option<&[usize]> {
        Some(&self.hosts)
    }

    fn shrink(&self, deadline: Instant) -> Option<Result<Arc<dyn Transport>>> {
        Some(
            self.survivors(deadline)
                .map(|t| Arc::new(t) as Arc<dyn Transport>),
        )
    }

    fn regroup(&self) -> Option<super::Regroup> {
        let (token, listen_host, kind) = self.regroup.clone();
        Some(super::Regroup::Network {
            token,
            listen_host,
            kind,
        })
    }

    fn all_shared_memory(&self) -> bool {
        self.links.iter().flatten().all(|l| l.shm.is_some())
    }

    fn over_network(&self) -> bool {
        self.links.iter().flatten().any(|l| l.shm.is_none())
    }

    fn shm_within_hosts(&self) -> bool {
        // From the kind, which every rank shares (a rank alone on its host has no such link
        // to look at).
        self.regroup.2 != TransportKind::Tcp
    }

    fn peer_memory(&self) -> Option<&dyn PeerMemory> {
        self.direct
            .load(Ordering::Acquire)
            .then_some(self as &dyn PeerMemory)
    }

    fn end(&self, failed: Option<&Error>) {
        self.direct.store(false, Ordering::Release);
        let claimed = self.claimed.swap(false, Ordering::AcqRel);
        let Some(e) = failed else {
            if claimed {
                self.shared.lock().leave();
            }
            return;
        };
        if matches!(
            e,
            Error::Mismatch { .. }
                | Error::PeerRejected { .. }
                | Error::InvalidArgument { site: Some(_), .. }
        ) && !self.aborted.load(Ordering::Acquire)
            && !self.data_started.load(Ordering::Acquire)
            && self
                .links
                .iter()
                .flatten()
                .all(|l| !l.mid_frame.load(Ordering::Acquire))
        {
            // Found in a check round by every rank alike, before any data moved: still usable.
            if claimed {
                self.shared.lock().leave();
            }
            return;
        }
        // An abort's own reason, not its "communicator aborted on rank N:" wrapping, which
        // every later call adds again.
        let reason = match e {
            Error::Aborted { reason, .. } => reason.clone(),
            e => e.to_string(),
        };
        self.set_aborted(&reason);
        let _engine = self.engine.lock();
        self.notify_peers(&reason);
        if claimed {
            // A peer that got this rank's claim may write into its buffers until it leaves.
            self.shared.lock().leave();
            self.wait_peers_out();
        }
    }

    fn share_create(&self, len: usize) -> Result<[u8; shared::RECORD]> {
        if !self.all_shared_memory() {
            return Err(Error::config(
                "shared buffers need every peer on shared memory of this host (transport shm or auto, one host)",
            ));
        }
        self.shared.lock().create(len)
    }

    fn share_map(&self, records: &[u8], len: usize) -> Result<(u64, *mut u8)> {
        // From here on calls have the claim round. Every rank gets here once the records'
        // all-gather has completed, before any later call of its own begins (and after every
        // earlier one ended): the calls that have it are the same on every rank.
        let min = shared::min_bytes(records);
        self.shared_min.fetch_min(min, Ordering::AcqRel);
        self.shared.lock().map(records, len)
    }

    fn share_mapped(&self, id: u64) {
        self.shared.lock().mapped(id)
    }

    fn share_abandon(&self) {
        self.shared.lock().abandon()
    }

    fn shared_min_bytes(&self) -> usize {
        self.shared_min.load(Ordering::Acquire)
    }

    fn share_free(&self, id: u64) {
        self.shared.lock().free(id)
    }

    fn abort(&self, reason: &str) {
        self.set_aborted(reason);
        // Tell the peers now if no call is running; a running call does it as it fails (one
        // that runs through shared buffers holds no lock while it writes into them, and its
        // peers, told now, would take it for gone and hand their buffers back too early).
        if self.direct.load(Ordering::Acquire) {
            return;
        }
        if let Some(_engine) = self.engine.try_lock() {
            self.notify_peers(reason);
        }
    }

    fn aborted(&self) -> Option<String> {
        if self.aborted.load(Ordering::Acquire) {
            self.reason.lock().clone()
        } else {
            None
        }
    }
}

impl NetTransport {
    /// After a failed call through shared buffers: wait (bounded by the timeout) until no live
    /// peer still runs it, so that none writes into this rank's buffers once they are the
    /// caller's again. A peer leaves at its next wait, which reads the ABORT frame sent to it.
    fn wait_peers_out(&self) {
        let call = self.ident_call();
        let deadline = Instant::now() + self.timeout;
        loop {
            // A peer counts while its process runs (or, where that cannot be known, while its
            // connection is open): a gone one writes nothing more.
            let inside: Vec<usize> = {
                let b = self.shared.lock();
                b.inside(call)
                    .filter(|&k| {
                        b.alive(k)
                            .unwrap_or_else(|| !self.link(k).closed.load(Ordering::Acquire))
                    })
                    .collect()
            };
            if inside.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                log::warn!(
                    "rank {} returns its buffers while {} still run the failed call",
                    self.rank,
                    crate::error::list(&inside)
                );
                return;
            }
            self.shared
                .lock()
                .sleep(Duration::from_millis(1), |_| false);
            self.watch_links();
        }
    }

    /// The call number of the current call (from its identity).
    fn ident_call(&self) -> u64 {
        u64::from_le_bytes(self.ident.get()[..8].try_into().expect("8 bytes"))
    }

    /// Mark the links whose peer hung up; return the first peer with bytes waiting (an ABORT
    /// frame, in a call that moves nothing else over the sockets).
    fn watch_links(&self) -> Option<usize> {
        let links: Vec<&Link> = self.links.iter().flatten().collect();
        let mut fds: Vec<libc::pollfd> = links
            .iter()
            .map(|l| libc::pollfd {
                fd: l.sock.as_raw_fd(),
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            })
            .collect();
        if poll_for(&mut fds, Duration::ZERO).is_err() {
            return None;
        }
        let mut readable = None;
        for (f, l) in fds.iter().zip(&links) {
            if f.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                l.closed.store(true, Ordering::Release);
            }
            if f.revents & libc::POLLIN != 0 && readable.is_none() {
                readable = Some(l.peer);
            }
        }
        readable
    }
}

/// Peer memory through shared buffers, for calls whose every buffer lies in one
/// ([`shared`]).
impl PeerMemory for NetTransport {
    fn buffers(&self, peer: usize) -> CallBuffers {
        self.shared.lock().buffers(peer)
    }

    fn set_progress(&self, value: u64) {
        self.shared.lock().set_progress(value)
    }

    fn wait_progress(
        &self,
        site: Site,
        peer: usize,
        value: u64,
        phase: &'static str,
    ) -> Result<()> {
        let start = Instant::now();
        let deadline = start + self.timeout;
        let reached = || self.shared.lock().progress(peer) >= value;
        let mut nap = Duration::from_micros(50);
        loop {
            if reached() {
                return Ok(());
            }
            if self.aborted.load(Ordering::Acquire) {
                return Err(self.aborted_error());
            }
            if start.elapsed() < self.spin {
                std::hint::spin_loop();
                continue;
            }
            self.shared.lock().sleep(nap, |b| b.progress(peer) >= value);
            nap = (nap * 2).min(Duration::from_millis(1));
            if reached() {
                return Ok(());
            }
            // A peer that gave up says why on its socket; one that died hangs it up.
            if let Some(k) = self.watch_links() {
                if let Some(e) = self.peek_abort(site, k) {
                    return Err(e);
                }
            }
            if self.link(peer).closed.load(Ordering::Acquire) {
                return Err(lost(site, peer, &closed("connection closed")));
            }
            if Instant::now() >= deadline {
                let e = Error::Timeout {
                    site,
                    waiting_for: vec![peer],
                    phase,
                    timeout: self.timeout,
                    stalled_on: Vec::new(),
                };
                let reason = e.to_string();
                self.waiting_for
                    .store(u32::try_from(peer + 1).unwrap_or(0), Ordering::Release);
                self.set_aborted(&reason);
                self.notify_peers(&reason);
                return Err(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::auth::testing::{alone, idle_strangers, threads};

    /// Addresses in numbers need no lookup; a name is looked up by the deadline, and one that
    /// names nothing is an error, not a hang.
    #[test]
    fn addresses_resolve_by_the_deadline() {
        let soon = Instant::now() + Duration::from_secs(5);
        assert_eq!(
            resolve_by("127.0.0.1:7", soon).unwrap(),
            "127.0.0.1:7".parse().unwrap()
        );
        assert_eq!(resolve_by("[::1]:7", soon).unwrap().port(), 7);
        assert!(resolve_by("localhost:7", soon).unwrap().ip().is_loopback());
        let t = Instant::now();
        assert!(resolve_by("no-such-host.invalid:7", soon).is_err());
        assert!(t.elapsed() < Duration::from_secs(6));
        // A deadline already past: no wait for the lookup, whatever it gives.
        let t = Instant::now();
        let _ = resolve_by("localhost:7", Instant::now());
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    /// Rank 1 connects to rank 0 while `strangers` idle connections sit on rank 0's listener;
    /// rank 0 accepts it. The threads of this process before and after.
    fn accept_among_strangers(strangers: usize) -> (usize, usize) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let before = threads();
        // Below the strangers' own handshake deadline (10 s): a listener that served them
        // first, as one thread per connection or a bounded queue of them did, misses it.
        let deadline = Instant::now() + Duration::from_secs(9);
        // The strangers connect first, then the rank.
        let rank1 = std::thread::spawn(move || {
            let idle = idle_strangers(addr, strangers);
            assert!(idle.len() >= strangers, "{}", idle.len());
            connect_peer(&addr.to_string(), 0, 1, "tok", deadline).map(|_| idle)
        });
        let mut socks: Vec<Option<TcpStream>> = vec![None, None];
        accept_peers(listener, 0, 2, "tok", deadline, &mut socks).unwrap();
        assert!(socks[1].is_some());
        let idle = rank1.join().unwrap().unwrap();
        let after = threads();
        drop(idle);
        (before, after)
    }

    #[test]
    fn idle_strangers_do_not_stop_a_rank_from_joining() {
        // Joining within the deadline is the assertion (accept_peers and connect_peer fail
        // past it); how long it takes on a loaded machine is not.
        accept_among_strangers(1100);
    }

    #[test]
    fn accepting_peers_starts_no_thread_per_stranger() {
        if !alone("transport::net::tests::accepting_peers_starts_no_thread_per_stranger") {
            return;
        }
        let (before, after) = accept_among_strangers(300);
        assert!(
            after <= before,
            "300 strangers took {before} threads to {after}"
        );
    }
}
