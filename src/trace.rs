//! `TUTTI_TRACE=PATH`: a Chrome/Perfetto trace of every collective this process runs.
//!
//! Each call writes a begin event when it starts and an end event when it finishes, flushed at
//! once, so that a trace taken from a job that hangs (or was killed) shows the calls still open
//! on each rank. Events are in the Trace Event Format's JSON array form (which Perfetto and
//! `chrome://tracing` read without its closing bracket): `pid` is the rank, `tid` the thread
//! that ran the call, `ts` microseconds of wall-clock time (so the files of the ranks of one job
//! line up). A begin event's args: call number, collective, dtype, bytes, algorithm; an end
//! event's: the error, if any, and the ranks a timeout waited for.
//!
//! Each process writes its own file: `%p` in PATH is replaced by the process id, else the id is
//! put before the extension (`trace.json` becomes `trace.4242.json`).

use std::io::Write;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result, Site};

/// The trace file of this process, when `TUTTI_TRACE` asks for one.
pub(crate) struct Tracer {
    out: Mutex<Writer>,
}

struct Writer {
    file: std::fs::File,
    /// The ranks already named in the trace (a `process_name` event each).
    named: Vec<usize>,
}

/// The process's tracer; `None` unless `TUTTI_TRACE` is set (read once).
pub(crate) fn tracer() -> Option<&'static Tracer> {
    static TRACER: OnceLock<Option<Tracer>> = OnceLock::new();
    TRACER
        .get_or_init(|| {
            let path = std::env::var_os("TUTTI_TRACE")?;
            let path = file_for(&path.to_string_lossy(), std::process::id());
            match std::fs::File::create(&path).and_then(|mut f| f.write_all(b"[\n").map(|_| f)) {
                Ok(file) => Some(Tracer {
                    out: Mutex::new(Writer {
                        file,
                        named: Vec::new(),
                    }),
                }),
                Err(e) => {
                    log::warn!("TUTTI_TRACE: cannot write {path}: {e}; no trace is written");
                    None
                }
            }
        })
        .as_ref()
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
    fn write(&self, rank: usize, event: serde_json::Value) {
        let mut w = self.out.lock();
        let mut line = String::new();
        if !w.named.contains(&rank) {
            w.named.push(rank);
            let name = serde_json::json!({
                "name": "process_name", "ph": "M", "pid": rank,
                "args": { "name": format!("rank {rank}") },
            });
            line.push_str(&format!("{name},\n"));
        }
        line.push_str(&format!("{event},\n"));
        // A trace that cannot be written is not worth failing a collective over.
        let _ = w.file.write_all(line.as_bytes());
    }

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
    use super::file_for;

    #[test]
    fn each_process_gets_its_own_file() {
        assert_eq!(file_for("/t/trace.json", 42), "/t/trace.42.json");
        assert_eq!(file_for("/t/trace-%p.json", 42), "/t/trace-42.json");
        assert_eq!(file_for("trace", 42), "trace.42");
    }
}
