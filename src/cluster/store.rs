//! Rendezvous stores: a key-value store with `set`, `get` (waiting) and `add`, every wait bounded.
//!
//! [`TcpStoreServer`] is served by the chief; [`TcpStore`] is a client (every connection proves
//! the job token first); [`FileStore`] keeps keys as files in a directory on a shared filesystem.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::auth::{handshake_client, Acceptor, Purpose, HANDSHAKE_LIMIT};
use crate::error::{Error, Result};

/// A rendezvous key-value store.
pub trait Store: Send + Sync {
    /// Set `key` to `value` (overwrites).
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The value of `key`, waiting up to `timeout` for it to be set.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Add `delta` to the integer at `key` (0 when unset); the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Wait until every key is set.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for k in keys {
            self.get(k, deadline.saturating_duration_since(Instant::now()))?;
        }
        Ok(())
    }
}

fn timeout_err(key: &str, timeout: Duration) -> Error {
    Error::JoinTimeout {
        message: format!(
            "rendezvous: key '{key}' was not set within {timeout:?} (a rank has not started, \
             or cannot reach the store)"
        ),
        timeout,
    }
}

/// What the store holds: the entries, and their bytes (keys and values) counted against its
/// bound.
#[derive(Default)]
struct Entries {
    map: HashMap<String, Vec<u8>>,
    bytes: usize,
}

struct Table {
    entries: Mutex<Entries>,
    changed: Condvar,
    /// The most bytes (keys and values) the store holds: a client that proved the token may
    /// still not fill the chief's memory.
    limit: usize,
}

impl Table {
    fn new(limit: usize) -> Table {
        Table {
            entries: Mutex::default(),
            changed: Condvar::new(),
            limit,
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Option<Vec<u8>> {
        // A wait a client asks for may be any number of milliseconds: a year is forever here.
        let deadline = Instant::now() + timeout.min(Duration::from_secs(365 * 24 * 3600));
        let mut e = self.entries.lock();
        loop {
            if let Some(v) = e.map.get(key) {
                return Some(v.clone());
            }
            if self.changed.wait_until(&mut e, deadline).timed_out() {
                return e.map.get(key).cloned();
            }
        }
    }

    /// Store `value` under `key`, unless the store would then hold more than its bound.
    fn set(&self, key: &str, value: Vec<u8>) -> std::result::Result<(), String> {
        let mut e = self.entries.lock();
        self.insert(&mut e, key, value)?;
        drop(e);
        self.changed.notify_all();
        Ok(())
    }

    /// Add `delta` to the number stored under `key` (0 if none), atomically.
    fn add(&self, key: &str, delta: i64) -> std::result::Result<i64, String> {
        let mut e = self.entries.lock();
        let cur = e
            .map
            .get(key)
            .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
            .unwrap_or(0);
        let new = cur.wrapping_add(delta);
        self.insert(&mut e, key, new.to_string().into_bytes())?;
        drop(e);
        self.changed.notify_all();
        Ok(new)
    }

    /// Insert under the entries' lock, counting each entry's key, value and bookkeeping.
    fn insert(
        &self,
        e: &mut Entries,
        key: &str,
        value: Vec<u8>,
    ) -> std::result::Result<(), String> {
        let cost = |v: &[u8]| ENTRY_OVERHEAD + key.len() + v.len();
        let old = e.map.get(key).map_or(0, |v| cost(v));
        let bytes = e.bytes - old + cost(&value);
        if bytes > self.limit {
            return Err(format!(
                "the store is full: '{key}' ({} bytes) would make it hold {bytes} bytes, more \
                 than its bound of {}",
                value.len(),
                self.limit
            ));
        }
        e.bytes = bytes;
        e.map.insert(key.to_string(), value);
        Ok(())
    }
}

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
/// Status of an answer that carries a value.
const FOUND: u8 = 0;
/// Status of a `get` whose key was not set in time (no field follows).
const MISSING: u8 = 1;
/// Status of a request the store refused; a message follows.
const REFUSED: u8 = 2;
const MAX_FIELD: usize = 1 << 20;
/// The most bytes a store holds (keys, values and bookkeeping): this, or 64 KiB per rank of a
/// larger world, which leaves room for hundreds of communicators per job.
const MAX_STORE_BYTES: usize = 64 << 20;
/// Bytes counted per entry besides its key and value: the map's own bookkeeping.
const ENTRY_OVERHEAD: usize = 96;

/// What a decoder makes of the bytes of a message received so far.
#[derive(Debug, PartialEq)]
enum Decoded<T> {
    /// The message, which took every byte given.
    Done(T),
    /// Incomplete: the message has at least this many bytes in all (never more than the
    /// message's bound).
    More(usize),
}

/// A field (a `u32` length, then that many bytes, at most [`MAX_FIELD`]) at `at` of `b`: its
/// range, or how many bytes of `b` it needs.
fn field(b: &[u8], at: usize) -> std::result::Result<Decoded<std::ops::Range<usize>>, String> {
    let Some(n) = b.get(at..at + 4) else {
        return Ok(Decoded::More(at + 4));
    };
    let n = u32::from_le_bytes(n.try_into().expect("4 bytes")) as usize;
    if n > MAX_FIELD {
        return Err(format!(
            "a field of {n} bytes (more than the bound of {MAX_FIELD})"
        ));
    }
    let r = at + 4..at + 4 + n;
    Ok(if b.len() < r.end {
        Decoded::More(r.end)
    } else {
        Decoded::Done(r)
    })
}

/// A request to the store.
#[derive(Clone, Debug, PartialEq)]
enum Request {
    Set(String, Vec<u8>),
    /// The key, and how long to wait for it.
    Get(String, Duration),
    Add(String, i64),
}

impl Request {
    /// The request's bytes: op, key, argument.
    fn encode(&self) -> Vec<u8> {
        match self {
            Request::Set(k, v) => fields(OP_SET, &[k.as_bytes(), v]),
            Request::Get(k, wait) => fields(
                OP_GET,
                &[
                    k.as_bytes(),
                    &u64::try_from(wait.as_millis())
                        .unwrap_or(u64::MAX)
                        .to_le_bytes(),
                ],
            ),
            Request::Add(k, d) => fields(OP_ADD, &[k.as_bytes(), &d.to_le_bytes()]),
        }
    }

    /// Read a request from the bytes received so far.
    fn decode(b: &[u8]) -> std::result::Result<Decoded<Request>, String> {
        let Some(&op) = b.first() else {
            return Ok(Decoded::More(1));
        };
        if !matches!(op, OP_SET | OP_GET | OP_ADD) {
            return Err(format!("unknown request {op}"));
        }
        let key = match field(b, 1)? {
            Decoded::Done(r) => r,
            Decoded::More(n) => return Ok(Decoded::More(n)),
        };
        let arg = match field(b, key.end)? {
            Decoded::Done(r) => r,
            Decoded::More(n) => return Ok(Decoded::More(n)),
        };
        if arg.end != b.len() {
            return Err("bytes after the request".into());
        }
        let key = std::str::from_utf8(&b[key])
            .map_err(|_| "a key that is not UTF-8".to_string())?
            .to_string();
        let word = |what: &str| -> std::result::Result<[u8; 8], String> {
            b[arg.clone()]
                .try_into()
                .map_err(|_| format!("{what} of {} bytes, not 8", arg.len()))
        };
        Ok(Decoded::Done(match op {
            OP_SET => Request::Set(key, b[arg.clone()].to_vec()),
            OP_GET => Request::Get(
                key,
                Duration::from_millis(u64::from_le_bytes(word("a wait")?)),
            ),
            _ => Request::Add(key, i64::from_le_bytes(word("an increment")?)),
        }))
    }
}

/// The store's answer to a request.
#[derive(Clone, Debug, PartialEq)]
enum Reply {
    /// The value (of a `get`; the new number of an `add`, 8 bytes; empty for a `set`).
    Found(Vec<u8>),
    /// A `get` whose key was not set in time.
    Missing,
    /// The store refused the request, for this reason.
    Refused(String),
}

impl Reply {
    fn encode(&self) -> Vec<u8> {
        match self {
            Reply::Found(v) => fields(FOUND, &[v]),
            Reply::Missing => vec![MISSING],
            Reply::Refused(why) => fields(REFUSED, &[why.as_bytes()]),
        }
    }

    /// Read an answer from the bytes received so far.
    fn decode(b: &[u8]) -> std::result::Result<Decoded<Reply>, String> {
        let Some(&status) = b.first() else {
            return Ok(Decoded::More(1));
        };
        if status == MISSING {
            return match b.len() {
                1 => Ok(Decoded::Done(Reply::Missing)),
                _ => Err("bytes after the answer".into()),
            };
        }
        if status != FOUND && status != REFUSED {
            return Err(format!("an answer of unknown status {status}"));
        }
        let r = match field(b, 1)? {
            Decoded::Done(r) => r,
            Decoded::More(n) => return Ok(Decoded::More(n)),
        };
        if r.end != b.len() {
            return Err("bytes after the answer".into());
        }
        Ok(Decoded::Done(match status {
            FOUND => Reply::Found(b[r].to_vec()),
            _ => Reply::Refused(String::from_utf8_lossy(&b[r]).into_owned()),
        }))
    }
}

fn fields(head: u8, fields: &[&[u8]]) -> Vec<u8> {
    let mut out = vec![head];
    for f in fields {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}

/// Read one message from `s`, by `deadline` when one is given: the bytes it needs, as the
/// decoder says, and no more (what is allocated grows with what arrives, up to the message's
/// bound). A message the decoder refuses is an `InvalidData` error saying why.
fn read_message<T>(
    s: &mut TcpStream,
    decode: fn(&[u8]) -> std::result::Result<Decoded<T>, String>,
    deadline: Option<Instant>,
) -> std::io::Result<T> {
    let mut b = Vec::new();
    loop {
        let need = match decode(&b) {
            Ok(Decoded::Done(m)) => return Ok(m),
            Ok(Decoded::More(n)) => n,
            Err(why) => return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why)),
        };
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            s.set_read_timeout(Some(left))?;
        }
        let want = (need - b.len()) as u64;
        let got = (&mut *s).take(want).read_to_end(&mut b)?;
        if (got as u64) < want {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// The store server, run by the chief. Stops when dropped.
pub struct TcpStoreServer {
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Listen on `addr` (`host:port`; port 0 picks one) for clients that prove `token`; it holds
    /// at most 64 MiB.
    pub fn start(addr: &str, token: &str) -> Result<TcpStoreServer> {
        Self::start_bounded(addr, token, MAX_STORE_BYTES, HANDSHAKE_LIMIT, 0)
    }

    /// [`TcpStoreServer::start`], holding at most `limit` bytes of keys and values, each
    /// client proving the token within `handshake`, `clients` of them (the job's ranks) expected
    /// to connect at once.
    fn start_bounded(
        addr: &str,
        token: &str,
        limit: usize,
        handshake: Duration,
        clients: usize,
    ) -> Result<TcpStoreServer> {
        let listener = super::listen::bind(addr)
            .map_err(|e| Error::io(format!("rendezvous store: listening on {addr}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("rendezvous store", e))?;
        // One thread drives every handshake under way; a client that proved the token (a rank
        // of the job) gets a thread of its own.
        let mut acceptor = Acceptor::new(listener, token, Purpose::Store, "rendezvous store")?
            .with_limit(handshake)
            .expecting(clients);
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::new(limit));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tutti-store".into())
            .spawn(move || {
                while !stop2.load(Ordering::Acquire) {
                    let (mut s, peer) =
                        match acceptor.next(Instant::now() + Duration::from_millis(50)) {
                            Ok(Some((s, _))) => match s.peer_addr() {
                                Ok(a) => (s, a),
                                Err(_) => continue,
                            },
                            Ok(None) => continue,
                            Err(e) => {
                                log::warn!("{e}");
                                std::thread::sleep(Duration::from_millis(50));
                                continue;
                            }
                        };
                    let (table, stop) = (table.clone(), stop2.clone());
                    let _ = s.set_nodelay(true);
                    let spawned = std::thread::Builder::new()
                        .name("tutti-store-conn".into())
                        .spawn(move || serve(&mut s, peer, &table, &stop));
                    if let Err(e) = spawned {
                        log::warn!(
                            "rendezvous store: no thread to serve {peer} ({e}); closing its \
                             connection"
                        );
                    }
                }
            })
            .map_err(|e| Error::io("starting the rendezvous store", e))?;
        Ok(TcpStoreServer {
            addr: local,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

fn serve(s: &mut TcpStream, peer: std::net::SocketAddr, table: &Table, stop: &AtomicBool) {
    loop {
        let req = match read_message(s, Request::decode, None) {
            Ok(r) => r,
            Err(e) => {
                if e.kind() == std::io::ErrorKind::InvalidData {
                    // A client that proved the token but speaks garbage: say why, then close.
                    log::warn!("rendezvous store: a malformed request from {peer}: {e}");
                    let _ =
                        s.write_all(&Reply::Refused(format!("malformed request: {e}")).encode());
                }
                return;
            }
        };
        if stop.load(Ordering::Acquire) {
            return;
        }
        let reply = match req {
            Request::Set(key, value) => match table.set(&key, value) {
                Ok(()) => Reply::Found(Vec::new()),
                Err(why) => Reply::Refused(why),
            },
            Request::Get(key, wait) => match table.get(&key, wait) {
                Some(v) => Reply::Found(v),
                None => Reply::Missing,
            },
            Request::Add(key, d) => match table.add(&key, d) {
                Ok(v) => Reply::Found(v.to_le_bytes().to_vec()),
                Err(why) => Reply::Refused(why),
            },
        };
        if s.write_all(&reply.encode()).is_err() {
            return;
        }
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        // The accepting thread sees it within 50 ms.
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A client of a [`TcpStoreServer`].
pub struct TcpStore {
    conn: Mutex<TcpStream>,
    addr: String,
}

impl TcpStore {
    /// Connect to `addr`, retrying until `timeout` (the server may not be up yet, or busy).
    pub fn connect(addr: &str, token: &str, timeout: Duration) -> Result<TcpStore> {
        let deadline = Instant::now() + timeout;
        let mut last = String::new();
        let mut pause = Duration::from_millis(5);
        while Instant::now() < deadline {
            let attempt = (|| -> Result<TcpStream> {
                let sa = addr
                    .to_socket_addrs()
                    .map_err(|e| Error::io(format!("rendezvous store: resolving {addr}"), e))?
                    .next()
                    .ok_or_else(|| {
                        Error::config(format!("rendezvous store: {addr} resolves to nothing"))
                    })?;
                let left = deadline.saturating_duration_since(Instant::now());
                let mut s = super::auth::connect(
                    &sa,
                    left.clamp(Duration::from_millis(1), Duration::from_secs(2)),
                )
                .map_err(|e| Error::io(format!("rendezvous store: connecting to {addr}"), e))?;
                handshake_client(
                    &mut s,
                    token,
                    Purpose::Store,
                    u32::MAX,
                    left.clamp(Duration::from_millis(1), HANDSHAKE_LIMIT),
                )?;
                let _ = s.set_nodelay(true);
                Ok(s)
            })();
            match attempt {
                Ok(s) => {
                    return Ok(TcpStore {
                        conn: Mutex::new(s),
                        addr: addr.to_string(),
                    })
                }
                Err(e @ Error::InvalidArgument { .. }) => return Err(e),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(Duration::from_millis(200));
        }
        Err(Error::JoinTimeout {
            message: format!("rendezvous store at {addr} not reachable within {timeout:?}: {last}"),
            timeout,
        })
    }

    fn request(&self, req: &Request, wait: Duration) -> Result<Reply> {
        let mut s = self.conn.lock();
        let io = |e: std::io::Error| Error::io(format!("rendezvous store at {}", self.addr), e);
        s.set_write_timeout(Some(Duration::from_secs(10)))
            .map_err(io)?;
        s.write_all(&req.encode()).map_err(io)?;
        let deadline = Instant::now().checked_add(wait.saturating_add(Duration::from_secs(10)));
        let reply = read_message(&mut s, Reply::decode, deadline).map_err(io)?;
        if let Reply::Refused(why) = &reply {
            let key = match req {
                Request::Set(k, _) | Request::Get(k, _) | Request::Add(k, _) => k,
            };
            return Err(Error::config(format!(
                "rendezvous store at {} refused '{key}': {why}",
                self.addr
            )));
        }
        Ok(reply)
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.request(&Request::Set(key.into(), value.to_vec()), Duration::ZERO)
            .map(drop)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        match self.request(&Request::Get(key.into(), timeout), timeout)? {
            Reply::Found(v) => Ok(v),
            _ => Err(timeout_err(key, timeout)),
        }
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        match self.request(&Request::Add(key.into(), delta), Duration::ZERO)? {
            Reply::Found(v) if v.len() == 8 => {
                Ok(i64::from_le_bytes(v.try_into().expect("8 bytes")))
            }
            r => Err(Error::System {
                what: format!("rendezvous store at {}", self.addr),
                message: format!("answered an add to '{key}' with {r:?}, not a number"),
            }),
        }
    }
}

/// Keys as files in a directory (a filesystem every rank shares).
pub struct FileStore {
    dir: PathBuf,
    lock: Mutex<()>,
}

impl FileStore {
    /// A store in `dir` (created if missing).
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("file store {}", dir.display()), e))?;
        Ok(FileStore {
            dir,
            lock: Mutex::new(()),
        })
    }
    fn path(&self, key: &str) -> PathBuf {
        let name: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        self.dir.join(name)
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let p = self.path(key);
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, value)
            .and_then(|_| std::fs::rename(&tmp, &p))
            .map_err(|e| Error::io(format!("file store: writing {}", p.display()), e))
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(1);
        loop {
            if let Ok(v) = std::fs::read(self.path(key)) {
                return Ok(v);
            }
            if Instant::now() >= deadline {
                return Err(timeout_err(key, timeout));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        // Atomic across processes through an exclusive lock file.
        let _g = self.lock.lock();
        let lock = self.path(&format!("{key}.lock"));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&lock)
            {
                Ok(_) => break,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => {
                    return Err(Error::io(
                        format!("file store: locking {}", lock.display()),
                        e,
                    ))
                }
            }
        }
        let cur = std::fs::read(self.path(key))
            .ok()
            .and_then(|v| String::from_utf8(v).ok()?.parse::<i64>().ok())
            .unwrap_or(0);
        let r = self.set(key, (cur + delta).to_string().as_bytes());
        let _ = std::fs::remove_file(&lock);
        r.map(|_| cur + delta)
    }
}

/// The rendezvous store of this communicator. Rank 0 serves it; the server is kept for the life
/// of the process, so that the later communicators of a job find it. Every communicator has its
/// own client connection (a waiting `get` holds it).
pub(crate) fn store_for(
    spec: &super::ClusterSpec,
    rank: usize,
    token: &str,
    timeout: Duration,
) -> Result<TcpStore> {
    static SERVERS: Mutex<Vec<(String, TcpStoreServer)>> = Mutex::new(Vec::new());
    if rank == 0 {
        let mut servers = SERVERS.lock();
        if !servers.iter().any(|(a, _)| a == &spec.rendezvous) {
            let limit = MAX_STORE_BYTES.max(spec.world_size.saturating_mul(64 << 10));
            let s = TcpStoreServer::start_bounded(
                &spec.rendezvous,
                token,
                limit,
                HANDSHAKE_LIMIT,
                spec.world_size,
            )?;
            servers.push((spec.rendezvous.clone(), s));
        }
    }
    TcpStore::connect(&spec.rendezvous, token, timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_store_set_get_add_and_wrong_token() {
        let server = TcpStoreServer::start("127.0.0.1:0", "tok").unwrap();
        let addr = server.addr().to_string();
        let a = TcpStore::connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        let b = TcpStore::connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        let t = std::thread::spawn(move || b.get("k", Duration::from_secs(5)).unwrap());
        std::thread::sleep(Duration::from_millis(20));
        a.set("k", b"v").unwrap();
        assert_eq!(t.join().unwrap(), b"v");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(a.add("n", 3).unwrap(), 5);
        let e = a.get("missing", Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("'missing' was not set"), "{e}");
        let e = TcpStore::connect(&addr, "wrong", Duration::from_secs(5))
            .err()
            .unwrap();
        assert!(e.to_string().contains("job token"), "{e}");
        // Garbage does not disturb the store.
        let mut g = TcpStream::connect(server.addr()).unwrap();
        let _ = g.write_all(b"GET / HTTP/1.1\r\n\r\n");
        a.set("k2", b"still fine").unwrap();
        assert_eq!(a.get("k2", Duration::from_secs(1)).unwrap(), b"still fine");
    }

    #[test]
    fn the_store_holds_no_more_than_its_bound() {
        let server =
            TcpStoreServer::start_bounded("127.0.0.1:0", "tok", 4096 + 192, HANDSHAKE_LIMIT, 0)
                .unwrap();
        let addr = server.addr().to_string();
        let a = TcpStore::connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        a.set("big", &[7; 3000]).unwrap();
        let e = a.set("more", &[7; 3000]).unwrap_err();
        assert!(e.to_string().contains("the store is full"), "{e}");
        // Replacing a value counts its new size only, and the store still serves.
        a.set("big", &[8; 3500]).unwrap();
        assert_eq!(a.get("big", Duration::from_secs(1)).unwrap(), vec![8; 3500]);
        assert!(a.add("n", 1).is_ok());
        assert!(a.get("more", Duration::from_millis(20)).is_err());
    }

    #[test]
    fn concurrent_adds_count_every_one() {
        let server = TcpStoreServer::start("127.0.0.1:0", "tok").unwrap();
        let addr = server.addr().to_string();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let c = TcpStore::connect(&addr, "tok", Duration::from_secs(5)).unwrap();
                    for _ in 0..200 {
                        c.add("n", 1).unwrap();
                    }
                });
            }
        });
        let c = TcpStore::connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        assert_eq!(c.add("n", 0).unwrap(), 800);
    }

    #[test]
    fn file_store() {
        let dir = std::env::temp_dir().join(format!("tutti-fs-{}", std::process::id()));
        let s = FileStore::new(&dir).unwrap();
        s.set("a/b", b"1").unwrap();
        assert_eq!(s.get("a/b", Duration::from_millis(10)).unwrap(), b"1");
        assert_eq!(s.add("c", 4).unwrap(), 4);
        assert_eq!(s.add("c", -1).unwrap(), 3);
        assert!(s.get("nope", Duration::from_millis(20)).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A stranger that sends a byte every `every` until the store closes its connection: how
    /// long it was kept.
    fn trickle_until_closed(addr: std::net::SocketAddr, every: Duration) -> Duration {
        let start = Instant::now();
        let mut s = TcpStream::connect(addr).unwrap();
        let mut h = [0u8; 23];
        s.read_exact(&mut h).unwrap();
        for _ in 0..58 {
            if s.write_all(b"T").is_err() {
                break;
            }
            std::thread::sleep(every);
            let mut x = [0u8; 1];
            s.set_nonblocking(true).unwrap();
            let closed = matches!(s.read(&mut x), Ok(0));
            s.set_nonblocking(false).unwrap();
            if closed {
                break;
            }
        }
        start.elapsed()
    }

    #[test]
    fn a_trickling_stranger_cannot_outlive_the_store_handshake_deadline() {
        let limit = Duration::from_millis(400);
        let server =
            TcpStoreServer::start_bounded("127.0.0.1:0", "tok", 1 << 20, limit, 0).unwrap();
        // A byte every 100 ms: each read is quick, the whole would take 5.8 s.
        let lived = trickle_until_closed(server.addr(), Duration::from_millis(100));
        assert!(
            lived < limit + Duration::from_millis(500),
            "a trickling stranger kept its handshake open for {lived:?} (limit {limit:?})"
        );
    }

    #[test]
    fn idle_strangers_do_not_stop_the_ranks_from_joining_the_store() {
        let server = TcpStoreServer::start("127.0.0.1:0", "tok").unwrap();
        // More than any bound on the handshakes under way, all from this host (as the ranks).
        let strangers = crate::cluster::auth::testing::idle_strangers(server.addr(), 1100);
        assert!(strangers.len() > 1024, "{}", strangers.len());
        let addr = server.addr().to_string();
        std::thread::scope(|sc| {
            for r in 0..8 {
                let addr = &addr;
                sc.spawn(move || {
                    let c = TcpStore::connect(addr, "tok", Duration::from_secs(8)).unwrap();
                    c.set(&format!("r{r}"), b"here").unwrap();
                    assert_eq!(c.get("r0", Duration::from_secs(8)).unwrap(), b"here");
                });
            }
        });
        // Every rank joined within its 8 s, below the strangers' own 10 s handshake deadline:
        // that is the assertion, not how long it took on a loaded machine.
        drop(strangers);
    }

    #[test]
    fn the_store_starts_no_thread_per_stranger() {
        use crate::cluster::auth::testing::{alone, idle_strangers, threads};
        if !alone("cluster::store::tests::the_store_starts_no_thread_per_stranger") {
            return;
        }
        let server = TcpStoreServer::start("127.0.0.1:0", "tok").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let before = threads();
        let strangers = idle_strangers(server.addr(), 300);
        std::thread::sleep(Duration::from_millis(300));
        let during = threads();
        assert!(
            during <= before,
            "{} strangers took {before} threads to {during}",
            strangers.len()
        );
        // A rank that proves the token is served on a thread of its own.
        let c =
            TcpStore::connect(&server.addr().to_string(), "tok", Duration::from_secs(5)).unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(threads(), before + 1);
    }

    #[test]
    fn a_wait_of_any_length_is_served() {
        let server = TcpStoreServer::start("127.0.0.1:0", "tok").unwrap();
        let c =
            TcpStore::connect(&server.addr().to_string(), "tok", Duration::from_secs(5)).unwrap();
        c.set("k", b"v").unwrap();
        // u64::MAX milliseconds on the wire: the server's wait must not overflow.
        assert_eq!(c.get("k", Duration::MAX).unwrap(), b"v");
        assert_eq!(c.get("k", Duration::from_millis(u64::MAX)).unwrap(), b"v");
    }

    #[test]
    fn a_malformed_request_is_refused_with_its_reason() {
        let server = TcpStoreServer::start("127.0.0.1:0", "tok").unwrap();
        let addr = server.addr().to_string();
        let c = TcpStore::connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        // An add whose increment is 3 bytes.
        let mut s = c.conn.lock();
        s.write_all(&fields(OP_ADD, &[b"n", &[1, 2, 3]])).unwrap();
        let r = read_message(
            &mut s,
            Reply::decode,
            Some(Instant::now() + Duration::from_secs(5)),
        )
        .unwrap();
        assert!(
            matches!(&r, Reply::Refused(why) if why.contains("an increment of 3 bytes")),
            "{r:?}"
        );
        drop(s);
        // A field longer than the bound is refused before anything is allocated.
        let c = TcpStore::connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        let mut s = c.conn.lock();
        s.write_all(&[OP_SET, 0xff, 0xff, 0xff, 0xff]).unwrap();
        let r = read_message(
            &mut s,
            Reply::decode,
            Some(Instant::now() + Duration::from_secs(5)),
        )
        .unwrap();
        assert!(
            matches!(&r, Reply::Refused(why) if why.contains("field of")),
            "{r:?}"
        );
    }

    mod fuzz {
        use super::super::*;
        use proptest::prelude::*;

        /// The most bytes one message may take.
        const BOUND: usize = 1 + 2 * (4 + MAX_FIELD);

        fn request() -> impl Strategy<Value = Request> {
            let key = "[a-z/0-9]{0,12}";
            prop_oneof![
                (key, proptest::collection::vec(any::<u8>(), 0..40))
                    .prop_map(|(k, v)| Request::Set(k, v)),
                (key, 0u64..1 << 40).prop_map(|(k, ms)| Request::Get(k, Duration::from_millis(ms))),
                (key, any::<i64>()).prop_map(|(k, d)| Request::Add(k, d)),
            ]
        }

        fn reply() -> impl Strategy<Value = Reply> {
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..40).prop_map(Reply::Found),
                Just(Reply::Missing),
                "[ -~]{0,40}".prop_map(Reply::Refused),
            ]
        }

        /// What a decoder says of `b` is an error, a message, or a need for more bytes that
        /// is within the bound and past what it has.
        fn sane<T>(
            b: &[u8],
            d: std::result::Result<Decoded<T>, String>,
        ) -> std::result::Result<(), TestCaseError> {
            if let Ok(Decoded::More(n)) = d {
                prop_assert!(n > b.len() && n <= BOUND, "needs {n} of {}", b.len());
            }
            Ok(())
        }

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
            fn decoders_take_any_bytes(b in proptest::collection::vec(any::<u8>(), 0..64)) {
                sane(&b, Request::decode(&b))?;
                sane(&b, Reply::decode(&b))?;
            }

            #[test]
            fn requests_round_trip_and_mutations_fail_cleanly(
                r in request(),
                edits in proptest::collection::vec((any::<usize>(), 1..=255u8), 0..4),
                cut in 0usize..80,
            ) {
                let m = r.encode();
                prop_assert_eq!(Request::decode(&m), Ok(Decoded::Done(r)));
                // Every prefix asks for more, up to the whole.
                for k in 0..m.len() {
                    match Request::decode(&m[..k]) {
                        Ok(Decoded::More(n)) => prop_assert!(n > k && n <= m.len()),
                        other => prop_assert!(false, "prefix {k}: {other:?}"),
                    }
                }
                let bad = mutate(m, &edits, cut);
                sane(&bad, Request::decode(&bad))?;
            }

            #[test]
            fn replies_round_trip_and_mutations_fail_cleanly(
                r in reply(),
                edits in proptest::collection::vec((any::<usize>(), 1..=255u8), 0..4),
                cut in 0usize..80,
            ) {
                let m = r.encode();
                prop_assert_eq!(Reply::decode(&m), Ok(Decoded::Done(r)));
                for k in 0..m.len() {
                    match Reply::decode(&m[..k]) {
                        Ok(Decoded::More(n)) => prop_assert!(n > k && n <= m.len()),
                        other => prop_assert!(false, "prefix {k}: {other:?}"),
                    }
                }
                let bad = mutate(m, &edits, cut);
                sane(&bad, Reply::decode(&bad))?;
            }
        }
    }
}
