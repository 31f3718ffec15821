//! Result codes, the thread-local last-error message and the panic boundary that every exported
//! function runs inside.

use std::cell::RefCell;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What a call returned; `TUTTI_SUCCESS` (0) or the kind of failure. The message of the last
/// failure on the calling thread is available from `tutti_last_error`.
///
/// Passed and returned as a `uint32_t`-sized value (`tutti_result`); `tutti_result_string` turns
/// any value, known or not, into a sentence.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiResult {
    /// The call did what it was asked.
    TUTTI_SUCCESS = 0,
    /// This caller's arguments were wrong: a NULL pointer, an unknown enum value, buffers of the
    /// wrong size, a root out of range, a bad config field.
    TUTTI_ERROR_INVALID_ARGUMENT = 1,
    /// The ranks called the same collective step with different arguments (collective, dtype,
    /// count, op, root or algorithm). Nothing was written. The communicator stays usable where
    /// the calls were compared before data moved (threads of one process, calls with a check
    /// round, `TUTTI_CHECK=full`); between processes a difference found in a call's data aborts
    /// it (`tutti_comm_is_aborted`).
    TUTTI_ERROR_MISMATCH = 2,
    /// Another rank rejected its own arguments for this call, so the call failed on every rank.
    /// Usable afterwards as after `TUTTI_ERROR_MISMATCH`.
    TUTTI_ERROR_PEER_REJECTED = 3,
    /// A wait for a peer ran past the communicator's timeout. The group is aborted. Creating a
    /// communicator: a rank did not join, or the rendezvous was out of reach, within the
    /// timeout; nothing was created.
    TUTTI_ERROR_TIMEOUT = 4,
    /// The group was aborted (`tutti_comm_abort`, a timeout, a failed peer, or arguments that a
    /// rank rejected before it could take part). Destroy it and create a new group.
    TUTTI_ERROR_ABORTED = 5,
    /// A device, library or feature is not available in this build or on this machine.
    TUTTI_ERROR_UNAVAILABLE = 6,
    /// An operating-system call failed (starting a thread, for one).
    TUTTI_ERROR_SYSTEM = 7,
    /// A bug inside tutti: the call panicked and the panic was stopped at the C boundary.
    TUTTI_ERROR_INTERNAL = 8,
    /// The connection to a peer process broke during a call: it exited, crashed or was killed.
    /// The group is aborted.
    TUTTI_ERROR_PEER_LOST = 9,
    /// `tutti_work_wait`'s own bound (`timeout_ms`) passed before the call completed. Nothing
    /// failed: the call goes on, the handle stays valid, and waiting again (or
    /// `tutti_work_test`) sees it complete. Not an abort, unlike `TUTTI_ERROR_TIMEOUT`.
    TUTTI_ERROR_WAIT_TIMEOUT = 10,
    /// A task of a parameter-server job (a ps task, a worker) is gone: it exited, crashed or
    /// was killed, or did not answer within the timeout (`tutti_last_error` names it).
    TUTTI_ERROR_TASK_LOST = 11,
    /// A step function failed on a worker of a parameter-server job: the trainer's own error,
    /// with the worker and step that raised it. The job goes on.
    TUTTI_ERROR_STEP_FAILED = 12,
}

/// A `tutti_result` as it crosses the C boundary: one of the `TUTTI_*` codes above.
pub type tutti_result = u32;

use TuttiResult::*;

/// Every code with its sentence, in code order.
const RESULT_STRINGS: [(TuttiResult, &CStr); 13] = [
    (TUTTI_SUCCESS, c"success"),
    (
        TUTTI_ERROR_INVALID_ARGUMENT,
        c"invalid argument: fix this call's arguments (tutti_last_error names the one that was wrong)",
    ),
    (
        TUTTI_ERROR_MISMATCH,
        c"ranks made different calls: every rank must call the same collectives in the same order with the same dtype, count, op, root and algorithm (tutti_last_error names the field and the rank)",
    ),
    (
        TUTTI_ERROR_PEER_REJECTED,
        c"another rank rejected its arguments for this call: fix that rank's call (tutti_last_error names it); the communicator is still usable unless tutti_comm_is_aborted says otherwise",
    ),
    (
        TUTTI_ERROR_TIMEOUT,
        c"timed out waiting for a peer: the group is aborted; create a new one (raise timeout_ms if the peer is only slow)",
    ),
    (
        TUTTI_ERROR_ABORTED,
        c"the group was aborted: destroy its communicators and create a new group",
    ),
    (
        TUTTI_ERROR_UNAVAILABLE,
        c"not available in this build or on this machine (tutti_last_error says what is missing)",
    ),
    (
        TUTTI_ERROR_SYSTEM,
        c"an operating-system call failed (tutti_last_error says which)",
    ),
    (
        TUTTI_ERROR_INTERNAL,
        c"internal error in tutti: please report it with the text of tutti_last_error",
    ),
    (
        TUTTI_ERROR_PEER_LOST,
        c"lost a peer process (it exited, crashed or was killed): the group is aborted; find out why that rank died (tutti_last_error names it) and start a new group",
    ),
    (
        TUTTI_ERROR_WAIT_TIMEOUT,
        c"the wait's own bound passed before the call completed: nothing failed, the call goes on and the work handle stays valid; wait for it again or test it later",
    ),
    (
        TUTTI_ERROR_TASK_LOST,
        c"a task of the parameter-server job was lost (it exited, crashed or was killed; tutti_last_error names it)",
    ),
    (
        TUTTI_ERROR_STEP_FAILED,
        c"a step function failed on a worker: its own error (tutti_last_error has its message, the worker and the step); the job goes on",
    ),
];

/// A failure on its way to the C caller: the code and what went wrong.
#[derive(Debug)]
pub(crate) struct Failure {
    pub code: TuttiResult,
    pub message: String,
}

impl Failure {
    /// A failure caused by the caller's arguments.
    pub fn invalid(message: impl Into<String>) -> Failure {
        Failure {
            code: TUTTI_ERROR_INVALID_ARGUMENT,
            message: message.into(),
        }
    }
}

impl From<tutti::Error> for Failure {
    fn from(e: tutti::Error) -> Failure {
        use tutti::Error as E;
        let code = match &e {
            E::InvalidArgument { .. } => TUTTI_ERROR_INVALID_ARGUMENT,
            E::Mismatch { .. } => TUTTI_ERROR_MISMATCH,
            E::PeerRejected { .. } => TUTTI_ERROR_PEER_REJECTED,
            E::Timeout { .. } | E::JoinTimeout { .. } => TUTTI_ERROR_TIMEOUT,
            E::Aborted { .. } => TUTTI_ERROR_ABORTED,
            E::Unavailable { .. } => TUTTI_ERROR_UNAVAILABLE,
            E::System { .. } => TUTTI_ERROR_SYSTEM,
            E::PeerLost { .. } => TUTTI_ERROR_PEER_LOST,
            E::TaskLost { .. } => TUTTI_ERROR_TASK_LOST,
            E::StepFailed { .. } => TUTTI_ERROR_STEP_FAILED,
            // A kind of error this C ABI has no code for yet: still a failure, with its message.
            _ => TUTTI_ERROR_INTERNAL,
        };
        Failure {
            code,
            message: e.to_string(),
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Record `message` as this thread's last error. Never panics (a thread that is exiting has no
/// thread-locals left; the message is then dropped).
pub(crate) fn set_last_error(message: String) {
    let _ = LAST_ERROR.try_with(|m| {
        if let Ok(mut m) = m.try_borrow_mut() {
            *m = message;
        }
    });
}

pub(crate) fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|m| {
        if let Ok(mut m) = m.try_borrow_mut() {
            m.clear();
        }
    });
}

/// The text of a panic payload.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The panic boundary of every exported function that returns a `tutti_result`: runs `body`,
/// clears the thread's last error on success, records `function: message` on failure, and turns
/// a panic into `TUTTI_ERROR_INTERNAL` carrying the panic's message.
pub(crate) fn boundary(
    function: &'static str,
    body: impl FnOnce() -> Result<(), Failure>,
) -> tutti_result {
    crate::log::init();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => {
            clear_last_error();
            TUTTI_SUCCESS as u32
        }
        Ok(Err(f)) => {
            set_last_error(format!("{function}: {}", f.message));
            f.code as u32
        }
        Err(payload) => {
            let message = panic_message(&*payload);
            // Dropping a payload runs foreign code only for exotic payloads; keep it inside.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            set_last_error(format!(
                "{function}: internal error: tutti panicked ({message}); please report this"
            ));
            TUTTI_ERROR_INTERNAL as u32
        }
    }
}

/// The panic boundary of an exported function that returns nothing (the destructors): a panic
/// is stopped here and recorded as the thread's last error.
pub(crate) fn boundary_void(function: &'static str, body: impl FnOnce()) {
    crate::log::init();
    if let Err(payload) = catch_unwind(AssertUnwindSafe(body)) {
        let message = panic_message(&*payload);
        let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
        set_last_error(format!(
            "{function}: internal error: tutti panicked ({message}); please report this"
        ));
    }
}

/// A static sentence for a result code: what it means and what to do next. Unknown codes get
/// a sentence that says so; never returns NULL. The string lives as long as the program.
///
/// Thread-safety: callable from any thread at any time. Does not touch the last error.
#[no_mangle]
pub extern "C" fn tutti_result_string(code: tutti_result) -> *const c_char {
    let found = catch_unwind(|| {
        RESULT_STRINGS
            .iter()
            .find(|(c, _)| *c as u32 == code)
            .map(|(_, s)| *s)
    });
    match found {
        Ok(Some(s)) => s.as_ptr(),
        _ => c"unknown tutti_result code (from a newer libtutti than this program knows?)".as_ptr(),
    }
}

/// Copy the calling thread's last error message into `buf` (at most `len` bytes, always
/// NUL-terminated when `len > 0`, cut short when it does not fit) and return the message's full
/// length in bytes, without the NUL, as `snprintf` does: call with `buf = NULL, len = 0` to size
/// a buffer. Returns 0 when the thread's last call succeeded.
///
/// Every function that returns a `tutti_result` sets the message when it fails and clears it
/// when it succeeds; the message says which function failed, on which rank, and why.
///
/// Thread-safety: callable from any thread; each thread has its own message.
///
/// # Safety
///
/// `buf` is NULL or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tutti_last_error(buf: *mut c_char, len: usize) -> usize {
    let copy = AssertUnwindSafe(|| {
        LAST_ERROR
            .try_with(|m| {
                let m = m.try_borrow().map(|m| m.clone()).unwrap_or_default();
                if !buf.is_null() && len > 0 {
                    let n = floor_char_boundary(&m, len - 1);
                    // SAFETY: the caller gave `len` writable bytes at `buf`; n + 1 <= len.
                    unsafe {
                        std::ptr::copy_nonoverlapping(m.as_ptr(), buf.cast::<u8>(), n);
                        *buf.add(n) = 0;
                    }
                }
                m.len()
            })
            .unwrap_or(0)
    });
    catch_unwind(copy).unwrap_or(0)
}

/// This thread's last error message ("" when the last call succeeded).
/// What a trainer's callback that returned `code` failed with: the code's meaning, and the
/// last error it left on this thread (through a tutti call), if any.
pub(crate) fn callback_failure(code: tutti_result) -> String {
    let last = last_error_text();
    format!(
        "returned {code} ({}){}",
        result_text(code),
        if last.is_empty() {
            String::new()
        } else {
            format!(": {last}")
        }
    )
}

pub(crate) fn last_error_text() -> String {
    LAST_ERROR
        .try_with(|m| m.try_borrow().map(|m| m.clone()).unwrap_or_default())
        .unwrap_or_default()
}

/// The sentence for a result code, as Rust text.
pub(crate) fn result_text(code: tutti_result) -> String {
    RESULT_STRINGS
        .iter()
        .find(|(c, _)| *c as u32 == code)
        .map_or_else(
            || "unknown tutti_result code".to_string(),
            |(_, s)| s.to_string_lossy().into_owned(),
        )
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub(crate) fn floor_char_boundary(s: &str, max: usize) -> usize {
    if max >= s.len() {
        return s.len();
    }
    (0..=max)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        let n = unsafe { tutti_last_error(std::ptr::null_mut(), 0) };
        let mut buf = vec![0 as c_char; n + 1];
        let m = unsafe { tutti_last_error(buf.as_mut_ptr(), buf.len()) };
        assert_eq!(m, n);
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let code = boundary("tutti_test", || panic!("boom at step {}", 3));
        assert_eq!(code, TUTTI_ERROR_INTERNAL as u32);
        let m = last_error();
        assert!(
            m.contains("tutti_test") && m.contains("boom at step 3"),
            "{m}"
        );
        boundary_void("tutti_test_destroy", || panic!("in a destructor"));
        assert!(last_error().contains("in a destructor"));
    }

    #[test]
    fn success_clears_and_failure_sets_the_message() {
        let code = boundary("tutti_test", || Err(Failure::invalid("count is wrong")));
        assert_eq!(code, TUTTI_ERROR_INVALID_ARGUMENT as u32);
        assert_eq!(last_error(), "tutti_test: count is wrong");
        assert_eq!(boundary("tutti_test", || Ok(())), 0);
        assert_eq!(last_error(), "");
    }

    #[test]
    fn messages_are_cut_at_character_boundaries() {
        set_last_error("ab\u{e9}cd".into()); // é is two bytes
        let mut buf = [1 as c_char; 4];
        let n = unsafe { tutti_last_error(buf.as_mut_ptr(), buf.len()) };
        assert_eq!(n, 6);
        assert_eq!(buf[2], 0, "the cut must not split é");
        assert_eq!(unsafe { tutti_last_error(std::ptr::null_mut(), 8) }, 6);
    }

    #[test]
    fn every_code_has_a_sentence() {
        for (i, (code, _)) in RESULT_STRINGS.iter().enumerate() {
            assert_eq!(*code as usize, i);
        }
        let s = unsafe { CStr::from_ptr(tutti_result_string(4)) };
        assert!(s.to_str().unwrap().contains("timed out"));
        let s = unsafe { CStr::from_ptr(tutti_result_string(1000)) };
        assert!(s.to_str().unwrap().contains("unknown"));
    }

    #[test]
    fn core_errors_map_to_distinct_codes() {
        let site = tutti::Site {
            collective: tutti::Collective::AllReduce,
            rank: 1,
            call: 0,
        };
        let errors = [
            tutti::Error::invalid(site, "x"),
            tutti::Error::Mismatch {
                site,
                peer: 0,
                field: "count",
                mine: "1".into(),
                theirs: "2".into(),
            },
            tutti::Error::PeerRejected {
                site,
                peer: 0,
                message: "x".into(),
            },
            tutti::Error::Timeout {
                site,
                waiting_for: vec![0],
                phase: "arrive",
                timeout: std::time::Duration::from_secs(1),
                stalled_on: Vec::new(),
            },
            tutti::Error::Aborted {
                rank: 1,
                reason: "x".into(),
            },
            tutti::Error::Unavailable {
                what: "x".into(),
                why: "y".into(),
            },
            tutti::Error::System {
                what: "x".into(),
                message: "y".into(),
            },
            tutti::Error::PeerLost {
                site,
                peer: 2,
                detail: "x".into(),
            },
            tutti::Error::TaskLost {
                task: "ps task 0".into(),
                detail: "x".into(),
            },
            tutti::Error::StepFailed {
                worker: 1,
                step: 3,
                message: "x".into(),
            },
        ];
        let codes: Vec<u32> = errors
            .into_iter()
            .map(|e| Failure::from(e).code as u32)
            .collect();
        assert_eq!(codes, [1, 2, 3, 4, 5, 6, 7, 9, 11, 12]);
        let setup = tutti::Error::JoinTimeout {
            message: "x".into(),
            timeout: std::time::Duration::from_secs(1),
        };
        assert_eq!(Failure::from(setup).code, TUTTI_ERROR_TIMEOUT);
    }
}
