//! Proving the job's secret: the handshake of every tutti connection (a mutual HMAC-SHA256
//! challenge over the job token, so the token never travels), used by the rendezvous store and
//! by the transports above it.
//!
//! The accepting side is an [`Acceptor`]: one thread (the listener's own, or the caller's) drives
//! every handshake under way without blocking, so a stranger costs a socket and a few bytes, never
//! a thread. Each handshake has one deadline for the whole exchange (a peer that trickles a byte
//! at a time is dropped when it passes), and the handshakes under way are bounded, per source
//! address and in all. When a bound is reached the newcomer takes the place of the oldest
//! handshake of its source (or of the source with the most under way): a rank of the job finishes
//! its handshake within a round trip, so strangers that sit idle are the ones pushed out, and a
//! flood from one address can only push out its own connections or those of the busiest source.
//! A rank whose handshake was pushed out sees the connection close and connects again.
//!
//! The messages (`hello`, `reply`, `proof`) are built and read by pure functions, apart from the
//! sockets, so that the parsing of what a stranger sends can be fuzzed on its own.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

/// First bytes of every tutti connection.
pub(crate) const MAGIC: &[u8; 6] = b"TUTTI\x01";

/// The longest a connection may take to prove the token, from its first byte to its last.
pub(crate) const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// The most handshakes an [`Acceptor`] drives at once from one source (an IPv4 address, or an
/// IPv6 /64): enough for the ranks of a large host joining together.
const MAX_PER_SOURCE: usize = 64;
/// The most handshakes an [`Acceptor`] drives at once in all (each is an open socket).
const MAX_PENDING: usize = 256;
/// Connections taken off the listener per round, between rounds that serve those under way.
const ACCEPT_BATCH: usize = 32;

/// Bytes of the server's hello: magic, purpose, its nonce.
const HELLO: usize = 6 + 1 + 16;
/// Bytes of the client's reply: magic, rank, its nonce, its proof.
const REPLY: usize = 6 + 4 + 16 + 32;
/// Bytes of the server's answer: its proof, or [`REFUSAL`].
const ANSWER: usize = 32;
/// The longest message a server sends.
const OUT: usize = if HELLO > ANSWER { HELLO } else { ANSWER };
/// What a server answers a client whose proof is wrong (instead of closing without a word), so
/// that the client can tell a wrong token, which no retry mends, from a connection that closed.
const REFUSAL: &[u8; ANSWER] = b"TUTTI: the job tokens differ....";

/// What a connection is for; part of what the handshake proves.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Purpose {
    Store = 1,
    Data = 2,
    /// The survivors of a communicator finding each other (`Communicator::shrink`).
    Shrink = 3,
}

/// 16 random bytes from the kernel.
pub(crate) fn nonce() -> Result<[u8; 16]> {
    let mut n = [0u8; 16];
    let mut got = 0;
    while got < n.len() {
        // SAFETY: getrandom writes at most the given length into the buffer.
        let r = unsafe { libc::getrandom(n[got..].as_mut_ptr().cast(), n.len() - got, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("reading random bytes (getrandom)", e));
        }
        got += r as usize;
    }
    Ok(n)
}

/// A random job token (hex), for launchers that make one.
pub fn random_token() -> Result<String> {
    Ok(nonce()?.iter().map(|b| format!("{b:02x}")).collect())
}

fn hmac(token: &str, parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m =
        <Hmac<Sha256> as Mac>::new_from_slice(token.as_bytes()).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m
}

fn mac(token: &str, parts: &[&[u8]]) -> [u8; 32] {
    hmac(token, parts).finalize().into_bytes().into()
}

/// True when `proof` is the MAC of `parts` (compared in constant time).
fn proves(token: &str, parts: &[&[u8]], proof: &[u8]) -> bool {
    hmac(token, parts).verify_slice(proof).is_ok()
}

/// The server's hello: magic, purpose, its nonce.
pub(crate) fn hello(purpose: Purpose, nonce: &[u8; 16]) -> [u8; HELLO] {
    let mut h = [0u8; HELLO];
    h[..6].copy_from_slice(MAGIC);
    h[6] = purpose as u8;
    h[7..].copy_from_slice(nonce);
    h
}

/// The server's nonce from its hello, when the hello is one of a tutti endpoint for `purpose`.
pub(crate) fn parse_hello(h: &[u8], purpose: Purpose) -> std::result::Result<[u8; 16], String> {
    if h.len() != HELLO || &h[..6] != MAGIC {
        return Err("not a tutti endpoint (bad greeting)".into());
    }
    if h[6] != purpose as u8 {
        return Err(format!(
            "not a tutti {purpose:?} endpoint (it serves purpose {})",
            h[6]
        ));
    }
    Ok(h[7..].try_into().expect("16 bytes"))
}

/// What a client answers a hello: magic, its rank, its nonce, and its proof of the token over
/// the server's nonce.
pub(crate) fn reply(
    token: &str,
    purpose: Purpose,
    server_nonce: &[u8; 16],
    rank: u32,
    client_nonce: &[u8; 16],
) -> [u8; REPLY] {
    let r = rank.to_le_bytes();
    let mut m = [0u8; REPLY];
    m[..6].copy_from_slice(MAGIC);
    m[6..10].copy_from_slice(&r);
    m[10..26].copy_from_slice(client_nonce);
    m[26..].copy_from_slice(&mac(
        token,
        &[b"client", &[purpose as u8], server_nonce, &r],
    ));
    m
}

/// A client's reply, read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) rank: u32,
    pub(crate) nonce: [u8; 16],
    proof: [u8; 32],
}

/// Read a client's reply (its magic, rank, nonce and proof); the proof is checked by
/// [`Reply::proves`].
pub(crate) fn parse_reply(m: &[u8]) -> std::result::Result<Reply, String> {
    if m.len() != REPLY || &m[..6] != MAGIC {
        return Err("not a tutti peer (bad greeting)".into());
    }
    Ok(Reply {
        rank: u32::from_le_bytes(m[6..10].try_into().expect("4 bytes")),
        nonce: m[10..26].try_into().expect("16 bytes"),
        proof: m[26..].try_into().expect("32 bytes"),
    })
}

impl Reply {
    /// True when the client proved `token` over this server's nonce.
    pub(crate) fn proves(&self, token: &str, purpose: Purpose, server_nonce: &[u8; 16]) -> bool {
        proves(
            token,
            &[
                b"client",
                &[purpose as u8],
                server_nonce,
                &self.rank.to_le_bytes(),
            ],
            &self.proof,
        )
    }

    /// The server's answer: its own proof over the client's nonce, or [`REFUSAL`].
    pub(crate) fn answer(
        &self,
        token: &str,
        purpose: Purpose,
        server_nonce: &[u8; 16],
    ) -> [u8; ANSWER] {
        if !self.proves(token, purpose, server_nonce) {
            return *REFUSAL;
        }
        mac(
            token,
            &[
                b"server",
                &[purpose as u8],
                &self.nonce,
                &self.rank.to_le_bytes(),
            ],
        )
    }
}

/// Check the server's answer to a client that replied as `rank` with `client_nonce`.
pub(crate) fn check_answer(
    a: &[u8],
    token: &str,
    purpose: Purpose,
    client_nonce: &[u8; 16],
    rank: u32,
) -> std::result::Result<(), String> {
    if a == REFUSAL {
        return Err("refused this rank's proof: the job tokens differ".into());
    }
    if a.len() != ANSWER
        || !proves(
            token,
            &[
                b"server",
                &[purpose as u8],
                client_nonce,
                &rank.to_le_bytes(),
            ],
            a,
        )
    {
        return Err("failed the job-token check".into());
    }
    Ok(())
}

fn io<'a>(what: &'a str, peer: &'a str) -> impl Fn(std::io::Error) -> Error + 'a {
    move |e| Error::System {
        what: format!("{what} with {peer}"),
        message: e.to_string(),
    }
}

/// Read exactly `buf.len()` bytes by `deadline` (one bound for all the reads, however the bytes
/// come).
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                "the handshake did not finish in time",
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "the connection closed during the handshake",
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(std::io::Error::new(
                    ErrorKind::TimedOut,
                    "the handshake did not finish in time",
                ))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Write all of `buf` by `deadline`.
fn write_by(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::Error::new(
            ErrorKind::TimedOut,
            "the handshake did not finish in time",
        ));
    }
    s.set_write_timeout(Some(left))?;
    s.write_all(buf)
}

/// Connecting side: answer the challenge as `rank` and check the server's proof, all within
/// `timeout`. A wrong token or an endpoint that is not a tutti one is an `InvalidArgument`
/// error (no retry mends it); a connection that closes or stalls is a `System` one.
/// A TCP connection to `sa` within `timeout`. One that reached itself is refused, as the port
/// is: TCP's simultaneous open connects a socket to a port nothing listens on when the socket
/// took that very port as its own, and it would then wait for its own peer's hello.
pub(crate) fn connect(sa: &SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(sa, timeout)?;
    if reached_itself(&s) {
        return Err(std::io::Error::new(
            ErrorKind::ConnectionRefused,
            format!("nothing listens on {sa} (the connection reached itself)"),
        ));
    }
    Ok(s)
}

/// Whether `s` is connected to itself (its own address is its peer's).
fn reached_itself(s: &TcpStream) -> bool {
    matches!((s.local_addr(), s.peer_addr()), (Ok(a), Ok(b)) if a == b)
}

pub(crate) fn handshake_client(
    s: &mut TcpStream,
    token: &str,
    purpose: Purpose,
    rank: u32,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let peer = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
    let mut h = [0u8; HELLO];
    read_by(s, &mut h, deadline).map_err(io("handshake", &peer))?;
    let server_nonce =
        parse_hello(&h, purpose).map_err(|why| Error::config(format!("{peer} is {why}")))?;
    let nc = nonce()?;
    write_by(
        s,
        &reply(token, purpose, &server_nonce, rank, &nc),
        deadline,
    )
    .map_err(io("handshake", &peer))?;
    let mut a = [0u8; ANSWER];
    read_by(s, &mut a, deadline).map_err(io("handshake", &peer))?;
    check_answer(&a, token, purpose, &nc, rank)
        .map_err(|why| Error::config(format!("{peer} {why}")))?;
    s.set_read_timeout(None)
        .and_then(|_| s.set_write_timeout(None))
        .map_err(io("handshake", &peer))
}

/// Log a rejected connection (a warning): the job goes on.
pub(crate) fn log_rejected(what: &str, e: &Error) {
    log::warn!("rejected a {what} connection: {e}");
}

/// Where a connection comes from, for the bound per source: its IPv4 address, or the /64 of its
/// IPv6 address (one host may hold a whole /64).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
enum Source {
    V4(u32),
    V6(u64),
}

impl Source {
    fn of(addr: &SocketAddr) -> Source {
        match addr.ip() {
            IpAddr::V4(a) => Source::V4(a.into()),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(a) => Source::V4(a.into()),
                None => Source::V6((u128::from(a) >> 64) as u64),
            },
        }
    }
}

/// How far a handshake under way has come.
enum Stage {
    /// Sending the hello, then reading the reply.
    Challenge,
    /// Sending the answer; then done, with what it proved.
    Answer(std::result::Result<u32, String>),
}

/// A handshake under way on the accepting side, driven without blocking.
struct Pending {
    sock: TcpStream,
    peer: SocketAddr,
    source: Source,
    /// When it must be over.
    deadline: Instant,
    /// Arrival order: the oldest is pushed out first.
    seq: u64,
    nonce: [u8; 16],
    out: [u8; OUT],
    out_len: usize,
    out_off: usize,
    got: [u8; REPLY],
    got_len: usize,
    stage: Stage,
}

impl Pending {
    /// Move the handshake forward until it would block: `None` while under way, else its end
    /// (the rank the peer proved, or why it failed).
    fn progress(
        &mut self,
        token: &str,
        purpose: Purpose,
    ) -> Option<std::result::Result<u32, String>> {
        loop {
            while self.out_off < self.out_len {
                match self.sock.write(&self.out[self.out_off..self.out_len]) {
                    Ok(0) => return Some(Err("the connection closed".into())),
                    Ok(n) => self.out_off += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return None,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Some(Err(e.to_string())),
                }
            }
            if let Stage::Answer(r) = &self.stage {
                return Some(r.clone());
            }
            while self.got_len < REPLY {
                match self.sock.read(&mut self.got[self.got_len..]) {
                    Ok(0) => return Some(Err("the connection closed during the handshake".into())),
                    Ok(n) => self.got_len += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return None,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Some(Err(e.to_string())),
                }
            }
            let reply = match parse_reply(&self.got) {
                Ok(r) => r,
                // Nothing to answer a stranger that does not speak the protocol.
                Err(why) => return Some(Err(why)),
            };
            let answer = reply.answer(token, purpose, &self.nonce);
            self.out[..ANSWER].copy_from_slice(&answer);
            (self.out_len, self.out_off) = (ANSWER, 0);
            self.stage = Stage::Answer(if &answer == REFUSAL {
                Err("failed the job-token check".into())
            } else {
                Ok(reply.rank)
            });
        }
    }

    fn wants_write(&self) -> bool {
        self.out_off < self.out_len
    }
}

/// The accepting side of a listener: drives every handshake under way on the caller's thread,
/// each within [`HANDSHAKE_LIMIT`], at most [`MAX_PER_SOURCE`] per source and [`MAX_PENDING`] in
/// all (see the module docs for who makes room for whom). Hands out the connections that proved
/// the token, with the rank they proved, in blocking mode and without timeouts.
pub(crate) struct Acceptor {
    listener: TcpListener,
    token: String,
    purpose: Purpose,
    /// What the listener is, for the log (`rendezvous store`, `peer`...).
    what: &'static str,
    limit: Duration,
    per_source: usize,
    max_pending: usize,
    pending: Vec<Pending>,
    done: VecDeque<(TcpStream, u32)>,
    seq: u64,
    /// Accepting is paused until then (the process ran out of descriptors).
    paused_until: Option<Instant>,
    /// Rejections logged in the current minute, and when it began: a flood is not logged line by
    /// line.
    logged: (usize, Instant),
    fds: Vec<libc::pollfd>,
}

/// Rejections logged as warnings per minute; the rest go to the debug log.
const WARNINGS_PER_MINUTE: usize = 20;

impl Acceptor {
    /// Accept on `listener` the connections that prove `token` for `purpose`.
    pub(crate) fn new(
        listener: TcpListener,
        token: &str,
        purpose: Purpose,
        what: &'static str,
    ) -> Result<Acceptor> {
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io(format!("{what}: configuring the listener"), e))?;
        Ok(Acceptor {
            listener,
            token: token.to_string(),
            purpose,
            what,
            limit: HANDSHAKE_LIMIT,
            per_source: MAX_PER_SOURCE,
            max_pending: MAX_PENDING,
            pending: Vec::new(),
            done: VecDeque::new(),
            seq: 0,
            paused_until: None,
            logged: (0, Instant::now()),
            fds: Vec::new(),
        })
    }

    /// Each handshake must be over within `limit` (default [`HANDSHAKE_LIMIT`]).
    pub(crate) fn with_limit(mut self, limit: Duration) -> Acceptor {
        self.limit = limit;
        self
    }

    /// Expect `n` clients of the job joining at once (its ranks, perhaps all from one host):
    /// the bounds on handshakes under way grow to hold them, so that they never push each other
    /// out (at 256 ranks on a host they did, and joining took half a minute of retries);
    /// strangers past them still make room as before.
    pub(crate) fn expecting(mut self, n: usize) -> Acceptor {
        self.per_source = self.per_source.max(n);
        self.max_pending = self.max_pending.max(n.saturating_add(MAX_PER_SOURCE));
        self
    }

    /// The handshakes under way.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }

    fn reject(&mut self, peer: &SocketAddr, why: &str) {
        let now = Instant::now();
        if now.duration_since(self.logged.1) >= Duration::from_secs(60) {
            self.logged = (0, now);
        }
        self.logged.0 += 1;
        let what = self.what;
        match self.logged.0 {
            n if n < WARNINGS_PER_MINUTE => {
                log::warn!("rejected a {what} connection from {peer}: {why}")
            }
            n if n == WARNINGS_PER_MINUTE => log::warn!(
                "rejected a {what} connection from {peer}: {why} (more rejections this minute \
                 are logged at debug level)"
            ),
            _ => log::debug!("rejected a {what} connection from {peer}: {why}"),
        }
    }

    /// The next connection that proves the token, waiting until `until` (`None` then).
    pub(crate) fn next(&mut self, until: Instant) -> Result<Option<(TcpStream, u32)>> {
        loop {
            if let Some(c) = self.done.pop_front() {
                return Ok(Some(c));
            }
            let now = Instant::now();
            self.expire(now);
            if now >= until {
                return Ok(None);
            }
            let accepting = self.paused_until.is_none_or(|t| now >= t);
            if accepting {
                self.paused_until = None;
            }
            let mut wake = until;
            for p in &self.pending {
                wake = wake.min(p.deadline);
            }
            if let Some(t) = self.paused_until {
                wake = wake.min(t);
            }
            self.fds.clear();
            self.fds.push(libc::pollfd {
                fd: self.listener.as_raw_fd(),
                events: if accepting { libc::POLLIN } else { 0 },
                revents: 0,
            });
            for p in &self.pending {
                self.fds.push(libc::pollfd {
                    fd: p.sock.as_raw_fd(),
                    events: if p.wants_write() {
                        libc::POLLOUT
                    } else {
                        libc::POLLIN
                    },
                    revents: 0,
                });
            }
            let wait = wake.saturating_duration_since(now);
            // Rounded up to a whole millisecond: a deadline a few microseconds away is not a
            // busy loop.
            let ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
            // SAFETY: `fds` is a valid array of pollfd of the given length.
            let r =
                unsafe { libc::poll(self.fds.as_mut_ptr(), self.fds.len() as libc::nfds_t, ms) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::io(
                    format!("{}: waiting for connections", self.what),
                    e,
                ));
            }
            // Serve those under way first, then take newcomers.
            let mut i = 0;
            let mut f = 1;
            while i < self.pending.len() {
                let ready = self.fds[f].revents != 0;
                f += 1;
                if !ready {
                    i += 1;
                    continue;
                }
                match self.pending[i].progress(&self.token, self.purpose) {
                    None => i += 1,
                    Some(end) => {
                        let p = self.pending.swap_remove(i);
                        // swap_remove moved the last one here: its descriptor's entry is the
                        // last too; keep the two lists in step.
                        let last = self.fds.len() - 1;
                        self.fds.swap(f - 1, last);
                        self.fds.pop();
                        f -= 1;
                        self.finish(p, end);
                    }
                }
            }
            if accepting && self.fds[0].revents != 0 {
                self.accept_batch();
            }
        }
    }

    /// A handshake that ended: hand out what proved the token, log the rest.
    fn finish(&mut self, p: Pending, end: std::result::Result<u32, String>) {
        match end {
            Ok(rank) => {
                let configured = p
                    .sock
                    .set_nonblocking(false)
                    .and_then(|_| p.sock.set_read_timeout(None))
                    .and_then(|_| p.sock.set_write_timeout(None));
                match configured {
                    Ok(()) => self.done.push_back((p.sock, rank)),
                    Err(e) => self.reject(&p.peer, &e.to_string()),
                }
            }
            Err(why) => self.reject(&p.peer, &why),
        }
    }

    /// Drop the handshakes whose deadline has passed.
    fn expire(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].deadline <= now {
                let p = self.pending.swap_remove(i);
                let why = format!("did not prove the job token within {:?}", self.limit);
                self.reject(&p.peer, &why);
            } else {
                i += 1;
            }
        }
    }

    fn accept_batch(&mut self) {
        for _ in 0..ACCEPT_BATCH {
            match self.listener.accept() {
                Ok((sock, peer)) => self.admit(sock, peer),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted | ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    // Out of descriptors (or memory): the listener stays readable, so wait a
                    // moment before trying again rather than spin; those under way go on.
                    log::warn!("{}: accepting a connection: {e}", self.what);
                    self.paused_until = Some(Instant::now() + Duration::from_millis(50));
                    return;
                }
            }
        }
    }

    /// Start the handshake of a new connection, making room for it if a bound is reached.
    fn admit(&mut self, sock: TcpStream, peer: SocketAddr) {
        let source = Source::of(&peer);
        let oldest_of = |pending: &[Pending], s: Source| {
            pending
                .iter()
                .enumerate()
                .filter(|(_, p)| p.source == s)
                .min_by_key(|(_, p)| p.seq)
                .map(|(i, _)| i)
        };
        // Handshakes under way by source, counted once (a bound as large as a whole job's must
        // not cost a scan of the pending for each of them).
        let mut by_source: std::collections::HashMap<Source, usize> =
            std::collections::HashMap::new();
        for p in &self.pending {
            *by_source.entry(p.source).or_default() += 1;
        }
        let same = by_source.get(&source).copied().unwrap_or(0);
        let evict = if same >= self.per_source {
            oldest_of(&self.pending, source)
        } else if self.pending.len() >= self.max_pending {
            // The source with the most under way makes room.
            let busiest = by_source.iter().max_by_key(|(_, n)| **n).map(|(s, _)| *s);
            busiest.and_then(|s| oldest_of(&self.pending, s))
        } else {
            None
        };
        if let Some(i) = evict {
            let p = self.pending.swap_remove(i);
            self.reject(
                &p.peer,
                "made room for a newer connection (too many handshakes under way)",
            );
        }
        let nonce = match nonce() {
            Ok(n) => n,
            Err(e) => return self.reject(&peer, &e.to_string()),
        };
        if let Err(e) = sock.set_nonblocking(true) {
            return self.reject(&peer, &e.to_string());
        }
        let mut out = [0u8; OUT];
        out[..HELLO].copy_from_slice(&hello(self.purpose, &nonce));
        self.seq += 1;
        let mut p = Pending {
            sock,
            peer,
            source,
            deadline: Instant::now() + self.limit,
            seq: self.seq,
            nonce,
            out,
            out_len: HELLO,
            out_off: 0,
            got: [0; REPLY],
            got_len: 0,
            stage: Stage::Challenge,
        };
        match p.progress(&self.token, self.purpose) {
            None => self.pending.push(p),
            Some(end) => self.finish(p, end),
        }
    }
}

/// Where this user's job secret lives: `$XDG_RUNTIME_DIR/tutti/secret` (a directory only the
/// user can enter), else `$HOME/.cache/tutti/secret`, else `/tmp/tutti-UID/secret`.
fn secret_path(vars: &std::collections::HashMap<String, String>) -> std::path::PathBuf {
    use std::path::PathBuf;
    let var = |k: &str| vars.get(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = var("XDG_RUNTIME_DIR").filter(|d| d.is_dir()) {
        return d.join("tutti").join("secret");
    }
    if let Some(h) = var("HOME").filter(|h| h.is_dir()) {
        return h.join(".cache").join("tutti").join("secret");
    }
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    PathBuf::from(format!("/tmp/tutti-{uid}")).join("secret")
}

/// The secret of jobs that set none, on one host: a random token in a file only this user can
/// read (created once, atomically, mode 0600, in a directory of mode 0700 that this user owns).
/// Another user cannot read it, so cannot join; this user's own processes share it.
pub(crate) fn user_secret(vars: &std::collections::HashMap<String, String>) -> Result<String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
    let path = secret_path(vars);
    let dir = path.parent().expect("a file in a directory");
    let fail = |what: &str, e: std::io::Error| {
        Error::io(
            format!(
                "the per-user job secret {} ({what}; set TUTTI_JOB_TOKEN to give the job a \
                 secret yourself)",
                path.display()
            ),
            e,
        )
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| fail("creating its directory", e))?;
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let safe = |p: &std::path::Path| -> Result<()> {
        let m = std::fs::symlink_metadata(p).map_err(|e| fail("reading its permissions", e))?;
        if m.uid() != uid || m.permissions().mode() & 0o077 != 0 || m.file_type().is_symlink() {
            return Err(Error::config(format!(
                "the per-user job secret: {} is not private to this user (owner {}, mode {:o}); \
                 remove it, or set TUTTI_JOB_TOKEN",
                p.display(),
                m.uid(),
                m.permissions().mode() & 0o777
            )));
        }
        Ok(())
    };
    safe(dir)?;
    if !path.exists() {
        // Write a fresh secret under a temporary name, then link it into place: of two
        // processes racing here, one link wins and both read the winner's secret.
        // Unique per attempt: threads of one process may race here too (ranks joining at once).
        let token = random_token()?;
        let tmp = dir.join(format!("secret.{}.{}.tmp", std::process::id(), &token[..8]));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| fail("creating it", e))?;
        f.write_all(token.as_bytes())
            .map_err(|e| fail("writing it", e))?;
        drop(f);
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(fail("creating it", e)),
        }
    }
    safe(&path)?;
    let token = std::fs::read_to_string(&path).map_err(|e| fail("reading it", e))?;
    let token = token.trim().to_string();
    if token.len() < 16 {
        return Err(Error::config(format!(
            "the per-user job secret {} holds fewer than 16 characters; remove it, or set \
             TUTTI_JOB_TOKEN",
            path.display()
        )));
    }
    Ok(token)
}

/// Helpers for the tests of the listeners that use an [`Acceptor`].
#[cfg(test)]
pub(crate) mod testing {
    use std::net::{SocketAddr, TcpStream};

    /// Threads of this process.
    pub(crate) fn threads() -> usize {
        std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
    }

    /// Run the test `name` alone in a process of its own (so that counting this process's
    /// threads counts its own only): true in that process, where the test runs; in the
    /// calling one, runs it and fails if it fails, then false.
    pub(crate) fn alone(name: &str) -> bool {
        if std::env::var_os("TUTTI_TEST_ALONE").is_some() {
            return true;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--test-threads=1", "--nocapture"])
            .env("TUTTI_TEST_ALONE", "1")
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
            "{name} alone: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        false
    }

    /// Room for `n` more descriptors, as far as the hard limit allows.
    pub(crate) fn descriptors(n: u64) {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: get/setrlimit on a local struct.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < n + 256 {
                l.rlim_cur = (n + 256).min(l.rlim_max);
                libc::setrlimit(libc::RLIMIT_NOFILE, &l);
            }
        }
    }

    /// `n` strangers connected to `addr` that send nothing.
    pub(crate) fn idle_strangers(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
        descriptors(2 * n as u64);
        (0..n)
            .filter_map(|_| TcpStream::connect(addr).ok())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_to_itself_is_told_apart() {
        // Bound to a free port, then connected to that same port: TCP's simultaneous open.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.set_reuse_address(true).unwrap();
        sock.bind(&port.into()).unwrap();
        sock.connect(&port.into()).unwrap();
        let s: TcpStream = sock.into();
        assert!(reached_itself(&s));
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let other = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert!(!reached_itself(&other));
    }

    fn acceptor(token: &str, limit: Duration) -> (Acceptor, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let a = Acceptor::new(l, token, Purpose::Data, "test")
            .unwrap()
            .with_limit(limit);
        (a, addr)
    }

    #[test]
    fn handshake_proves_the_rank_and_refuses_a_wrong_token() {
        let (mut a, addr) = acceptor("tok", HANDSHAKE_LIMIT);
        let good = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            handshake_client(&mut s, "tok", Purpose::Data, 7, Duration::from_secs(5))
        });
        let (_, rank) = a
            .next(Instant::now() + Duration::from_secs(5))
            .unwrap()
            .unwrap();
        assert_eq!(rank, 7);
        good.join().unwrap().unwrap();
        let bad = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            handshake_client(&mut s, "other", Purpose::Data, 1, Duration::from_secs(5))
        });
        assert!(a
            .next(Instant::now() + Duration::from_millis(500))
            .unwrap()
            .is_none());
        let e = bad.join().unwrap().unwrap_err();
        // A wrong token is said, and not retried (an InvalidArgument).
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("tokens differ"),
            "{e}"
        );
        // A purpose the endpoint does not serve.
        let wrong = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            handshake_client(&mut s, "tok", Purpose::Store, 1, Duration::from_secs(5))
        });
        let _ = a.next(Instant::now() + Duration::from_millis(300));
        let e = wrong.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("not a tutti Store endpoint"), "{e}");
    }

    #[test]
    fn a_trickling_client_cannot_outlive_the_handshake_deadline() {
        let limit = Duration::from_millis(400);
        let (mut a, addr) = acceptor("tok", limit);
        let start = Instant::now();
        let client = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let mut h = [0u8; HELLO];
            s.read_exact(&mut h).unwrap();
            // One byte every 50 ms: each read is quick, the whole would take 2.9 s.
            for b in reply("tok", Purpose::Data, &[0; 16], 0, &[0; 16]) {
                if s.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
                let mut x = [0u8; 1];
                s.set_nonblocking(true).unwrap();
                let closed = matches!(s.read(&mut x), Ok(0));
                s.set_nonblocking(false).unwrap();
                if closed {
                    break;
                }
            }
            start.elapsed()
        });
        assert!(a
            .next(Instant::now() + Duration::from_secs(3))
            .unwrap()
            .is_none());
        let lived = client.join().unwrap();
        assert!(
            lived < limit + Duration::from_millis(400),
            "a trickling client kept its handshake open for {lived:?} (limit {limit:?})"
        );
        assert_eq!(a.pending(), 0);
    }

    #[test]
    fn a_client_handshake_has_one_deadline_for_a_trickling_server() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for b in hello(Purpose::Data, &[0; 16]) {
                if s.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        let mut s = TcpStream::connect(addr).unwrap();
        let start = Instant::now();
        let e = handshake_client(&mut s, "tok", Purpose::Data, 0, Duration::from_millis(300))
            .unwrap_err();
        // The greeting trickles for 4.6 s: a deadline per read would wait for all of it.
        assert!(start.elapsed() < Duration::from_millis(2500), "{e}");
        assert!(matches!(e, Error::System { .. }), "{e}");
        drop(s);
        server.join().unwrap();
    }

    #[test]
    fn idle_strangers_from_the_same_address_do_not_lock_out_a_rank() {
        let (mut a, addr) = acceptor("tok", HANDSHAKE_LIMIT);
        let strangers =
            std::thread::spawn(move || testing::idle_strangers(addr, MAX_PENDING + 100));
        while !strangers.is_finished() {
            assert!(a
                .next(Instant::now() + Duration::from_millis(20))
                .unwrap()
                .is_none());
        }
        let strangers = strangers.join().unwrap();
        assert!(a.pending() <= MAX_PER_SOURCE, "{}", a.pending());
        let rank = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            handshake_client(&mut s, "tok", Purpose::Data, 3, Duration::from_secs(5))
        });
        let (_, r) = a
            .next(Instant::now() + Duration::from_secs(5))
            .unwrap()
            .expect("the rank got through");
        assert_eq!(r, 3);
        rank.join().unwrap().unwrap();
        drop(strangers);
    }

    #[test]
    fn the_busiest_source_makes_room() {
        let (mut a, _) = acceptor("tok", HANDSHAKE_LIMIT);
        a.max_pending = 4;
        a.per_source = 3;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = l.local_addr().unwrap();
        let mut keep = Vec::new();
        let mut admit = |a: &mut Acceptor, ip: [u8; 4]| {
            let c = TcpStream::connect(target).unwrap();
            let (s, _) = l.accept().unwrap();
            keep.push(c);
            a.admit(s, SocketAddr::from((ip, 1)));
        };
        for _ in 0..3 {
            admit(&mut a, [10, 0, 0, 1]);
        }
        admit(&mut a, [10, 0, 0, 2]);
        // Full: a newcomer from a third source pushes out the busiest source's oldest.
        admit(&mut a, [10, 0, 0, 3]);
        let count = |a: &Acceptor, ip: [u8; 4]| {
            let s = Source::of(&SocketAddr::from((ip, 1)));
            a.pending.iter().filter(|p| p.source == s).count()
        };
        assert_eq!(a.pending(), 4);
        assert_eq!(count(&a, [10, 0, 0, 1]), 2);
        assert_eq!(count(&a, [10, 0, 0, 2]), 1);
        assert_eq!(count(&a, [10, 0, 0, 3]), 1);
        // A source at its own bound pushes out its own oldest.
        a.max_pending = 10;
        for _ in 0..3 {
            admit(&mut a, [10, 0, 0, 3]);
        }
        assert_eq!(count(&a, [10, 0, 0, 3]), 3);
        assert_eq!(count(&a, [10, 0, 0, 1]), 2);
        assert_eq!(count(&a, [10, 0, 0, 2]), 1);
    }

    #[test]
    fn an_ipv6_source_is_its_64() {
        let a: SocketAddr = "[2001:db8:1:2:3::1]:5".parse().unwrap();
        let b: SocketAddr = "[2001:db8:1:2:ffff::9]:6".parse().unwrap();
        let c: SocketAddr = "[2001:db8:1:3::1]:5".parse().unwrap();
        let m: SocketAddr = "[::ffff:10.0.0.1]:5".parse().unwrap();
        assert_eq!(Source::of(&a), Source::of(&b));
        assert_ne!(Source::of(&a), Source::of(&c));
        assert_eq!(Source::of(&m), Source::of(&"10.0.0.1:1".parse().unwrap()));
    }

    mod fuzz {
        use super::super::*;
        use proptest::prelude::*;

        fn mutate(mut m: Vec<u8>, edits: &[(usize, u8)], cut: usize) -> Vec<u8> {
            for &(i, b) in edits {
                if !m.is_empty() {
                    let i = i % m.len();
                    m[i] ^= b;
                }
            }
            m.truncate(cut);
            m
        }

        proptest! {
            #[test]
            fn parse_hello_takes_any_bytes(b in proptest::collection::vec(any::<u8>(), 0..64)) {
                let _ = parse_hello(&b, Purpose::Data);
            }

            #[test]
            fn parse_reply_takes_any_bytes(b in proptest::collection::vec(any::<u8>(), 0..96)) {
                if let Ok(r) = parse_reply(&b) {
                    prop_assert_eq!(b.len(), REPLY);
                    // A random proof proves nothing (2^-256).
                    prop_assert!(!r.proves("tok", Purpose::Data, &[0; 16]));
                }
            }

            #[test]
            fn check_answer_takes_any_bytes(b in proptest::collection::vec(any::<u8>(), 0..64)) {
                prop_assert!(check_answer(&b, "tok", Purpose::Data, &[1; 16], 3).is_err());
            }

            #[test]
            fn valid_messages_round_trip_and_mutations_fail_cleanly(
                sn in any::<[u8; 16]>(),
                cn in any::<[u8; 16]>(),
                rank in any::<u32>(),
                edits in proptest::collection::vec((any::<usize>(), 1..=255u8), 0..4),
                cut in 0usize..80,
            ) {
                let h = hello(Purpose::Store, &sn);
                prop_assert_eq!(parse_hello(&h, Purpose::Store), Ok(sn));
                let m = reply("tok", Purpose::Store, &sn, rank, &cn);
                let r = parse_reply(&m).unwrap();
                prop_assert_eq!(r.rank, rank);
                prop_assert!(r.proves("tok", Purpose::Store, &sn));
                prop_assert!(!r.proves("tok2", Purpose::Store, &sn));
                let a = r.answer("tok", Purpose::Store, &sn);
                prop_assert!(check_answer(&a, "tok", Purpose::Store, &cn, rank).is_ok());
                prop_assert!(check_answer(&a, "tok", Purpose::Store, &cn, rank ^ 1).is_err());
                // Mutated (some bytes flipped, perhaps cut short): an error, never a panic,
                // and a proof only where the proved bytes (magic, rank, proof) are intact (the
                // client's nonce is proved by the server's answer, which covers it).
                let bad = mutate(m.to_vec(), &edits, cut);
                if let Ok(r) = parse_reply(&bad) {
                    if r.proves("tok", Purpose::Store, &sn) {
                        prop_assert!(bad[..10] == m[..10] && bad[26..] == m[26..]);
                    }
                }
                let bad = mutate(h.to_vec(), &edits, cut);
                let _ = parse_hello(&bad, Purpose::Store);
                // Two edits of one byte may cancel: only bytes that differ must be refused.
                let bad = mutate(a.to_vec(), &edits, cut);
                if bad[..] != a[..] {
                    prop_assert!(check_answer(&bad, "tok", Purpose::Store, &cn, rank).is_err());
                }
            }
        }
    }
}
