//! `TUTTI_TRACE=PATH`: a Chrome/Perfetto trace of every collective this process runs.
//!
//! Each call records a begin event when it starts and an end event when it finishes. A writer
//! thread writes them to the file as they come (and flushes whenever it has caught up), so that
//! a trace taken from a job that hangs (or was killed) shows the calls still open on each rank.
//! Events are in the Trace Event Format's JSON array form (which Perfetto and
//! `chrome://tracing` read without its closing bracket): `pid` is the rank, `tid` the thread
//! that ran the call, `ts` microseconds of wall-clock time (so the files of the ranks of one job
//! line up). A begin event's args: call number, collective, dtype, bytes, algorithm; an end
//! event's: the error, if any, and the ranks a timeout waited for.
//!
//! Each process writes its own file: `%p` in PATH is replaced by the process id, else the id is
//! put before the extension (`trace.json` becomes `trace.4242.json`).
//!
//! The file is the user's alone and never stands in a collective's way: it is opened without
//! following a symbolic link, created with mode 0600 or appended to (never truncated), and
//! refused unless it is a regular file of this user (a FIFO, a device, someone else's file);
//! the open and every write happen on the writer thread, which a call hands its events to
//! through a bounded queue without waiting: when the queue is full (a stalled disk or mount)
//! events are dropped and counted, and the trace says how many.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};

use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result, Site};

/// Events a call may queue ahead of the writer before new ones are dropped.
const QUEUE: usize = 4096;

/// How long dropping a tracer waits for its writer to write what was queued.
const FLUSH_WAIT: Duration = Duration::from_secs(1);

/// The trace file of this process, when `TUTTI_TRACE` asks for one: the call's side of the
/// queue to the writer thread.
pub(crate) struct Tracer {
    queue: Option<Sender<Line>>,
    /// Events dropped because the queue was full.
    dropped: Arc<AtomicU64>,
    /// Closed by the writer thread when it has written everything and closed the file.
    done: Receiver<()>,
    /// Events handed to the writer, and events it has written and flushed.
    queued: AtomicU64,
    written: Arc<AtomicU64>,
}

/// Wait, at most a second, until the writer of `TUTTI_TRACE` has written and flushed every
/// event this process's calls queued: a program about to exit calls it, so that the trace
/// shows how its last call ended (the writer thread does not outlive the process). Without a
/// trace it returns at once.
pub fn flush() {
    let Some(t) = tracer() else { return };
    let queued = t.queued.load(Ordering::Acquire);
    let deadline = std::time::Instant::now() + FLUSH_WAIT;
    while t.written.load(Ordering::Acquire) < queued && std::time::Instant::now() < deadline {
        // A writer that stopped (it could not open the file) writes nothing more.
        if matches!(
            t.done.try_recv(),
            Err(crossbeam_channel::TryRecvError::Disconnected)
        ) {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// One event, with the rank whose process-name record must precede it.
struct Line {
    rank: usize,
    event: serde_json::Value,
}

/// The process's tracer; `None` unless `TUTTI_TRACE` is set (read once).
pub(crate) fn tracer() -> Option<&'static Tracer> {
    static TRACER: OnceLock<Option<Tracer>> = OnceLock::new();
    TRACER
        .get_or_init(|| {
            let path = std::env::var_os("TUTTI_TRACE")?;
            let path = file_for(&path.to_string_lossy(), std::process::id());
            Tracer::start(path)
        })
        .as_ref()
}

/// Open `path` for the trace: never through a symbolic link, never a FIFO or device (opened
/// without blocking, then checked), never someone else's file; created with mode 0600, or
/// appended to. Returns the file and whether it was empty (a new trace).
fn open(path: &str) -> std::io::Result<(std::fs::File, bool)> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => std::io::Error::other(format!(
                "{e} (the path is a symbolic link, which a trace does not follow)"
            )),
            Some(libc::ENXIO) => {
                std::io::Error::other(format!("{e} (a FIFO without a reader; not a file)"))
            }
            _ => e,
        })?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(std::io::Error::other(
            "not a regular file (a FIFO, socket or device); give a path to a file",
        ));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(std::io::Error::other(format!(
            "the file belongs to user {}, not to this user ({me})",
            meta.uid()
        )));
    }
    // Writes to a regular file block as they always do; the flag only kept the open from
    // waiting for a FIFO's reader.
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a descriptor this function owns.
    unsafe {
        let fd = file.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Ok((file, meta.len() == 0))
}

/// The writer thread: open the file, then write each event as it comes, flushing whenever the
/// queue is empty, until every sender is gone.
fn write_events(path: &str, queue: Receiver<Line>, dropped: &AtomicU64, written: &AtomicU64) {
    let (file, new) = match open(path) {
        Ok(f) => f,
        Err(e) => {
            log::warn!("TUTTI_TRACE: cannot write {path}: {e}; no trace is written");
            return;
        }
    };
    let mut out = std::io::BufWriter::new(file);
    if new {
        let _ = out.write_all(b"[\n");
    }
    // The ranks already named in the trace (a `process_name` event each).
    let mut named: Vec<usize> = Vec::new();
    let mut reported = 0;
    let mut warned = false;
    while let Ok(first) = queue.recv() {
        let mut next = Some(first);
        let mut lines = 0;
        while let Some(Line { rank, event }) = next {
            lines += 1;
            if !named.contains(&rank) {
                named.push(rank);
                let name = serde_json::json!({
                    "name": "process_name", "ph": "M", "pid": rank,
                    "args": { "name": format!("rank {rank}") },
                });
                let _ = writeln!(out, "{name},");
            }
            // A trace that cannot be written is not worth failing a collective over.
            let _ = writeln!(out, "{event},");
            let lost = dropped.load(Ordering::Relaxed);
            if lost > reported {
                reported = lost;
                let note = serde_json::json!({
                    "name": "trace events dropped", "ph": "i", "s": "g", "pid": rank,
                    "ts": now_us() as u64, "args": { "dropped": lost },
                });
                let _ = writeln!(out, "{note},");
                if !warned {
                    warned = true;
                    log::warn!(
                        "TUTTI_TRACE: {path} cannot keep up with the calls; events are dropped \
                         (counted in the trace)"
                    );
                }
            }
            next = queue.try_recv().ok();
        }
        let _ = out.flush();
        written.fetch_add(lines, Ordering::Release);
    }
    let _ = out.flush();
}

impl Tracer {
    /// A tracer writing to `path` (the file is opened on the writer thread); `None`, with the
    /// reason logged, when no thread can be started.
    fn start(path: String) -> Option<Tracer> {
        let (queue, rx) = bounded(QUEUE);
        let (done_tx, done) = bounded::<()>(0);
        let dropped = Arc::new(AtomicU64::new(0));
        let lost = dropped.clone();
        let written = Arc::new(AtomicU64::new(0));
        let flushed = written.clone();
        let spawned = std::thread::Builder::new()
            .name("tutti-trace".into())
            .spawn(move || {
                write_events(&path, rx, &lost, &flushed);
                drop(done_tx);
            });
        match spawned {
            Ok(_) => Some(Tracer {
                queue: Some(queue),
                dropped,
                done,
                queued: AtomicU64::new(0),
                written,
            }),
            Err(e) => {
                log::warn!("TUTTI_TRACE: cannot start the trace writer: {e}; no trace is written");
                None
            }
        }
    }

    /// Hand an event to the writer; never waits (a full queue drops it, counted).
    fn write(&self, rank: usize, event: serde_json::Value) {
        let Some(queue) = &self.queue else { return };
        match queue.try_send(Line { rank, event }) {
            Ok(()) => {
                self.queued.fetch_add(1, Ordering::Release);
            }
            Err(TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
            // The writer could not open the file (it said why): nothing is traced.
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

impl Drop for Tracer {
    /// Let the writer write what is queued and close the file, waiting a moment at most (a
    /// writer stuck on a stalled file is left behind).
    fn drop(&mut self) {
        drop(self.queue.take());
        let _ = self.done.recv_timeout(FLUSH_WAIT);
    }
}

/// This process's file for the trace path the user gave.
fn file_for(path: &str, pid: u32) -> String {
    if path.contains("%p") {
        return path.replace("%p", &pid.to_string());
    }
    let p = std::path::Path::new(path);
    match (p.file_stem(), p.extension()) {
        (Some(stem), Some(ext)) => p
            .with_file_name(format!(
                "{}.{pid}.{}",
                stem.to_string_lossy(),
                ext.to_string_lossy()
            ))
            .to_string_lossy()
            .into_owned(),
        _ => format!("{path}.{pid}"),
    }
}

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

fn thread_id() -> i64 {
    // SAFETY: plain syscall without arguments.
    unsafe { libc::syscall(libc::SYS_gettid) }
}

impl Tracer {
    /// A call starts.
    pub(crate) fn begin(&self, site: Site, dtype: DType, bytes: usize, algorithm: Algorithm) {
        let name = site.collective.to_string();
        self.write(
            site.rank,
            serde_json::json!({
                "name": name, "cat": "collective", "ph": "B", "ts": now_us() as u64,
                "pid": site.rank, "tid": thread_id(),
                "args": {
                    "call": site.call, "dtype": dtype.name(), "bytes": bytes,
                    "algorithm": algorithm.to_string(),
                },
            }),
        );
    }

    /// The call of `site` ends with `result`.
    pub(crate) fn end(&self, site: Site, result: &Result<()>) {
        let mut args = serde_json::json!({ "call": site.call });
        if let Err(e) = result {
            args["error"] = e.to_string().into();
            if let Error::Timeout {
                waiting_for,
                stalled_on,
                ..
            } = e
            {
                args["waiting_for"] = serde_json::json!(waiting_for);
                args["stalled_on"] = serde_json::json!(stalled_on);
            }
        }
        self.write(
            site.rank,
            serde_json::json!({
                "name": site.collective.to_string(), "cat": "collective", "ph": "E",
                "ts": now_us() as u64, "pid": site.rank, "tid": thread_id(), "args": args,
            }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Collective;
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;
    use std::time::Instant;

    #[test]
    fn each_process_gets_its_own_file() {
        assert_eq!(file_for("/t/trace.json", 42), "/t/trace.42.json");
        assert_eq!(file_for("/t/trace-%p.json", 42), "/t/trace-42.json");
        assert_eq!(file_for("trace", 42), "trace.42");
    }

    /// A fresh directory for one test.
    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tutti-trace-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Trace `calls` calls (a begin and an end each) with a tracer on `path`, then drop it.
    fn trace(path: &std::path::Path, calls: u64) {
        let t = Tracer::start(path.to_string_lossy().into_owned()).unwrap();
        for call in 0..calls {
            let site = Site {
                collective: Collective::AllReduce,
                rank: 1,
                call,
            };
            t.begin(site, DType::F32, 16, Algorithm::Ring);
            t.end(site, &Ok(()));
        }
    }

    #[test]
    fn a_new_trace_is_private_and_holds_every_event() {
        let d = dir("new");
        let path = d.join("t.json");
        trace(&path, 3);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        let text = std::fs::read_to_string(&path).unwrap();
        let closed = format!("{}]", text.trim_end().trim_end_matches(','));
        let events: serde_json::Value = serde_json::from_str(&closed).unwrap();
        let events = events.as_array().unwrap();
        assert_eq!(events.len(), 7, "{text}");
        assert_eq!(events[0]["name"], "process_name");
        assert_eq!(events.iter().filter(|e| e["ph"] == "B").count(), 3);
        assert_eq!(events.iter().filter(|e| e["ph"] == "E").count(), 3);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_symbolic_link_is_refused_and_its_target_left_alone() {
        let d = dir("link");
        let victim = d.join("victim");
        std::fs::write(&victim, "someone's data\n").unwrap();
        let link = d.join("t.json");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = open(link.to_str().unwrap()).err().unwrap().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        // The calls still run (and trace nothing).
        trace(&link, 3);
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "someone's data\n"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_existing_file_is_appended_to_not_truncated() {
        let d = dir("append");
        let path = d.join("t.json");
        std::fs::write(&path, "[\n{\"earlier\": 1},\n").unwrap();
        trace(&path, 2);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("[\n{\"earlier\": 1},\n"), "{text}");
        assert_eq!(text.matches('[').count(), 1, "one array: {text}");
        assert_eq!(text.matches("\"ph\":\"E\"").count(), 2, "{text}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_fifo_never_stalls_the_calls() {
        let d = dir("fifo");
        let path = d.join("t.json");
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open(path.to_str().unwrap()).err().unwrap().to_string();
        assert!(e.contains("FIFO"), "{e}");
        let t = Instant::now();
        trace(&path, 10_000);
        // With a reader that never reads, the FIFO opens, and is refused as no file.
        let reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .unwrap();
        let e = open(path.to_str().unwrap()).err().unwrap().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        trace(&path, 10_000);
        // A stalled write would block the calls for good; this bound only catches that.
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
        drop(reader);
        std::fs::remove_dir_all(&d).unwrap();
    }

    use std::os::unix::fs::OpenOptionsExt;

    /// A writer that cannot keep up (here: one that never reads its queue) costs the calls
    /// nothing: events past the queue's bound are dropped and counted, and the trace says so
    /// once the writer catches up.
    #[test]
    fn a_stalled_writer_drops_and_counts_events() {
        let (queue, stalled) = bounded(QUEUE);
        let (_done_tx, done) = bounded::<()>(0);
        let dropped = Arc::new(AtomicU64::new(0));
        let written = Arc::new(AtomicU64::new(0));
        let t = Tracer {
            queue: Some(queue),
            dropped: dropped.clone(),
            done,
            queued: AtomicU64::new(0),
            written: written.clone(),
        };
        let start = Instant::now();
        let site = Site {
            collective: Collective::Broadcast,
            rank: 0,
            call: 0,
        };
        for _ in 0..QUEUE {
            t.begin(site, DType::U8, 1, Algorithm::Auto);
            t.end(site, &Ok(()));
        }
        assert!(start.elapsed() < Duration::from_secs(30));
        assert_eq!(dropped.load(Ordering::Relaxed), QUEUE as u64);
        // The writer catches up: the queued events, then how many were lost.
        let d = dir("stalled");
        let path = d.join("t.json");
        let lost = dropped.clone();
        let path2 = path.to_string_lossy().into_owned();
        let flushed = written.clone();
        let writer = std::thread::spawn(move || write_events(&path2, stalled, &lost, &flushed));
        let queued = t.queued.load(Ordering::Relaxed);
        drop(t);
        writer.join().unwrap();
        // What `flush` waits for: every queued event written.
        assert_eq!(queued, QUEUE as u64);
        assert_eq!(written.load(Ordering::Relaxed), queued);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("\"dropped\":4096"),
            "{}",
            &text[text.len() - 300..]
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}

/// `TUTTI_TRACE` is the environment's: any path gives this process its own file name, without
/// a panic.
#[cfg(test)]
mod fuzz {
    use super::file_for;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_trace_path_gives_a_file_of_this_process(path in any::<String>(), pid in any::<u32>()) {
            let f = file_for(&path, pid);
            prop_assert!(f.contains(&pid.to_string()), "{f}");
        }

        #[test]
        fn a_trace_path_with_placeholders(stem in "[a-z/%.]{0,20}", ext in "[a-z%]{0,5}", pid in any::<u32>()) {
            let f = file_for(&format!("{stem}%p.{ext}"), pid);
            prop_assert!(!f.contains("%p") || stem.contains('%') || ext.contains('%'), "{f}");
            prop_assert!(f.contains(&pid.to_string()), "{f}");
        }
    }
}
