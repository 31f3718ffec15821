//! Diagnostics of the C ABI. tutti writes nothing on its own: its log records go to stderr as
//! `tutti: ...` at the level `TUTTI_LOG` names (`error`, `warn`, `info`, `debug`, `trace`,
//! `off`; default `warn`), or to the caller's function (`tutti_set_log_callback`). A panic
//! stopped at the boundary is a log record and an error code, never a printed backtrace.

use std::ffi::{c_char, c_void, CString};
use std::sync::{Once, RwLock};

use crate::error::{boundary, tutti_result, Failure};

/// How much a log record matters.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiLogLevel {
    /// Something failed.
    TUTTI_LOG_ERROR = 1,
    /// Something is wrong but tutti goes on (a stranger's connection refused, a slow peer).
    TUTTI_LOG_WARN = 2,
    /// What tutti chose (an algorithm's fallback and why).
    TUTTI_LOG_INFO = 3,
    /// Details for debugging.
    TUTTI_LOG_DEBUG = 4,
    /// Everything.
    TUTTI_LOG_TRACE = 5,
}

/// A `TuttiLogLevel` value as it crosses the ABI.
pub type tutti_log_level = u32;

/// A function that receives tutti's log records: the level, the message (NUL-terminated, valid
/// only during the call) and the `user` pointer given to `tutti_set_log_callback`. It may be
/// called from any thread, several at once.
pub type tutti_log_fn =
    Option<unsafe extern "C" fn(level: tutti_log_level, message: *const c_char, user: *mut c_void)>;

struct Sink {
    callback: tutti_log_fn,
    user: usize,
}

static SINK: RwLock<Sink> = RwLock::new(Sink {
    callback: None,
    user: 0,
});

struct Logger;

impl log::Log for Logger {
    fn enabled(&self, meta: &log::Metadata<'_>) -> bool {
        meta.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let sink = SINK.read().unwrap_or_else(|e| e.into_inner());
        match sink.callback {
            Some(cb) => {
                let text = record.args().to_string().replace('\0', " ");
                let msg = CString::new(text).unwrap_or_default();
                let level = match record.level() {
                    log::Level::Error => TuttiLogLevel::TUTTI_LOG_ERROR,
                    log::Level::Warn => TuttiLogLevel::TUTTI_LOG_WARN,
                    log::Level::Info => TuttiLogLevel::TUTTI_LOG_INFO,
                    log::Level::Debug => TuttiLogLevel::TUTTI_LOG_DEBUG,
                    log::Level::Trace => TuttiLogLevel::TUTTI_LOG_TRACE,
                };
                // SAFETY: the caller registered a function of this signature and promised it
                // may be called from any thread with its `user` pointer.
                unsafe { cb(level as u32, msg.as_ptr(), sink.user as *mut c_void) };
            }
            None => eprintln!("tutti: {}", record.args()),
        }
    }

    fn flush(&self) {}
}

static LOGGER: Logger = Logger;

fn filter(level: u32) -> Option<log::LevelFilter> {
    Some(match level {
        0 => log::LevelFilter::Off,
        1 => log::LevelFilter::Error,
        2 => log::LevelFilter::Warn,
        3 => log::LevelFilter::Info,
        4 => log::LevelFilter::Debug,
        5 => log::LevelFilter::Trace,
        _ => return None,
    })
}

/// Install the logger and the panic hook once, before the first call does anything.
pub(crate) fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if log::set_logger(&LOGGER).is_ok() {
            let level = std::env::var("TUTTI_LOG")
                .ok()
                .and_then(|v| v.trim().parse::<log::LevelFilter>().ok())
                .unwrap_or(log::LevelFilter::Warn);
            log::set_max_level(level);
        }
        // A panic is turned into TUTTI_ERROR_INTERNAL with its message at the boundary; the
        // default hook would also print it with a backtrace into the caller's stderr.
        std::panic::set_hook(Box::new(|info| log::debug!("panic: {info}")));
    });
}

/// Send tutti's log records to `callback` (with `user`) instead of stderr; NULL restores
/// stderr. The level is `TUTTI_LOG`'s until `tutti_set_log_level` changes it.
///
/// Thread-safety: callable from any thread; records being written when it is called go to
/// the old or the new destination.
///
/// # Safety
///
/// `callback` is NULL or a function of this signature that may be called from any thread for
/// as long as it stays registered, with `user`.
#[no_mangle]
pub unsafe extern "C" fn tutti_set_log_callback(
    callback: tutti_log_fn,
    user: *mut c_void,
) -> tutti_result {
    boundary("tutti_set_log_callback", || {
        *SINK.write().unwrap_or_else(|e| e.into_inner()) = Sink {
            callback,
            user: user as usize,
        };
        Ok(())
    })
}

/// Let through log records up to `level` (a `TUTTI_LOG_*` value; 0 turns logging off).
///
/// Thread-safety: callable from any thread.
#[no_mangle]
pub extern "C" fn tutti_set_log_level(level: tutti_log_level) -> tutti_result {
    boundary("tutti_set_log_level", || {
        let f = filter(level).ok_or_else(|| {
            Failure::invalid(format!("level {level} is not a tutti_log_level (0 to 5)"))
        })?;
        log::set_max_level(f);
        Ok(())
    })
}
