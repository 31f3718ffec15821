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

use super::auth::{handshake_client, handshake_server, log_rejected, Purpose};
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
        let deadline = Instant::now() + timeout;
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
/// Status of a request the store refused; a message follows.
const REFUSED: u8 = 2;
const MAX_FIELD: usize = 1 << 20;
/// The most bytes a store holds (keys, values and bookkeeping): this, or 64 KiB per rank of a
/// larger world, which leaves room for hundreds of communicators per job.
const MAX_STORE_BYTES: usize = 64 << 20;
/// Bytes counted per entry besides its key and value: the map's own bookkeeping.
const ENTRY_OVERHEAD: usize = 96;
/// The most connections that may be proving the token at once: each has a thread. Connections
/// that proved it are the job's own ranks (as many as the world has).
const MAX_HANDSHAKES: usize = 1024;

fn read_field(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    let n = u32::from_le_bytes(n) as usize;
    if n > MAX_FIELD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "field too large",
        ));
    }
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn write_fields(s: &mut TcpStream, head: u8, fields: &[&[u8]]) -> std::io::Result<()> {
    let mut out = vec![head];
    for f in fields {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    s.write_all(&out)
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
        Self::start_bounded(addr, token, MAX_STORE_BYTES)
    }

    /// [`TcpStoreServer::start`], holding at most `limit` bytes of keys and values.
    fn start_bounded(addr: &str, token: &str, limit: usize) -> Result<TcpStoreServer> {
        let listener = super::listen::bind(addr)
            .map_err(|e| Error::io(format!("rendezvous store: listening on {addr}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("rendezvous store", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::new(limit));
        let proving = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let token = token.to_string();
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tutti-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(mut s) = conn else { continue };
                    // A flood of strangers gets no more threads than the bound.
                    if proving.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
                        proving.fetch_sub(1, Ordering::AcqRel);
                        continue;
                    }
                    let (table, token, stop) = (table.clone(), token.clone(), stop2.clone());
                    let conn_proving = proving.clone();
                    let spawned = std::thread::Builder::new()
                        .name("tutti-store-conn".into())
                        .spawn(move || {
                            let proved = handshake_server(
                                &mut s,
                                &token,
                                Purpose::Store,
                                Duration::from_secs(10),
                            );
                            conn_proving.fetch_sub(1, Ordering::AcqRel);
                            if let Err(e) = proved {
                                log_rejected("rendezvous store", &e);
                                return;
                            }
                            let _ = s.set_read_timeout(None);
                            let _ = s.set_nodelay(true);
                            serve(&mut s, &table, &stop);
                        });
                    if spawned.is_err() {
                        proving.fetch_sub(1, Ordering::AcqRel);
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

fn serve(s: &mut TcpStream, table: &Table, stop: &AtomicBool) {
    loop {
        let mut op = [0u8; 1];
        if s.read_exact(&mut op).is_err() || stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(key) = read_field(s).map(|k| String::from_utf8_lossy(&k).into_owned()) else {
            return;
        };
        let Ok(arg) = read_field(s) else { return };
        let ok = match op[0] {
            OP_SET => match table.set(&key, arg) {
                Ok(()) => write_fields(s, 0, &[&[]]),
                Err(why) => write_fields(s, REFUSED, &[why.as_bytes()]),
            },
            OP_GET => {
                let ms = arg
                    .get(..8)
                    .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
                match table.get(&key, Duration::from_millis(ms)) {
                    Some(v) => write_fields(s, 0, &[&v]),
                    None => write_fields(s, 1, &[]),
                }
            }
            OP_ADD => {
                let d = arg
                    .get(..8)
                    .map_or(0, |b| i64::from_le_bytes(b.try_into().expect("8 bytes")));
                match table.add(&key, d) {
                    Ok(v) => write_fields(s, 0, &[&v.to_le_bytes()]),
                    Err(why) => write_fields(s, REFUSED, &[why.as_bytes()]),
                }
            }
            _ => return,
        };
        if ok.is_err() {
            return;
        }
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
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
    /// Connect to `addr`, retrying until `timeout` (the server may not be up yet).
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
                let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(2))
                    .map_err(|e| Error::io(format!("rendezvous store: connecting to {addr}"), e))?;
                handshake_client(
                    &mut s,
                    token,
                    Purpose::Store,
                    u32::MAX,
                    Duration::from_secs(10),
                )?;
                s.set_read_timeout(None)
                    .map_err(|e| Error::io("rendezvous store", e))?;
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
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(200));
        }
        Err(Error::JoinTimeout {
            message: format!("rendezvous store at {addr} not reachable within {timeout:?}: {last}"),
            timeout,
        })
    }

    fn request(&self, op: u8, key: &str, arg: &[u8], wait: Duration) -> Result<(u8, Vec<u8>)> {
        let mut s = self.conn.lock();
        let io = |e: std::io::Error| Error::io(format!("rendezvous store at {}", self.addr), e);
        s.set_read_timeout(Some(wait + Duration::from_secs(10)))
            .map_err(io)?;
        write_fields(&mut s, op, &[key.as_bytes(), arg]).map_err(io)?;
        let mut status = [0u8; 1];
        s.read_exact(&mut status).map_err(io)?;
        let v = match status[0] {
            0 => read_field(&mut s).map_err(io)?,
            REFUSED => {
                let why = read_field(&mut s).map_err(io)?;
                return Err(Error::config(format!(
                    "rendezvous store at {} refused '{key}': {}",
                    self.addr,
                    String::from_utf8_lossy(&why)
                )));
            }
            _ => Vec::new(),
        };
        Ok((status[0], v))
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.request(OP_SET, key, value, Duration::ZERO).map(drop)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let ms = (timeout.as_millis() as u64).to_le_bytes();
        match self.request(OP_GET, key, &ms, timeout)? {
            (0, v) => Ok(v),
            _ => Err(timeout_err(key, timeout)),
        }
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let (_, v) = self.request(OP_ADD, key, &delta.to_le_bytes(), Duration::ZERO)?;
        Ok(i64::from_le_bytes(
            v.get(..8).and_then(|b| b.try_into().ok()).unwrap_or([0; 8]),
        ))
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
            let s = TcpStoreServer::start_bounded(&spec.rendezvous, token, limit)?;
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
        let server = TcpStoreServer::start_bounded("127.0.0.1:0", "tok", 4096 + 192).unwrap();
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
}
