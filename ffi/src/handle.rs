//! The lifetime of the handles C holds (`tutti_comm`, `tutti_replicas`, `tutti_work`).
//!
//! Every entry point that uses a handle enters it ([`Guarded::enter`]: one atomic increment,
//! and a decrement when it returns), so that the destroy function knows how many calls are
//! inside. Destroy first marks the handle closing (later entries fail with a clear error),
//! then waits for the calls inside to leave, bounded: by the communicator's timeout, then, after
//! aborting the group (which makes them leave at once), by the timeout again. Only then is the
//! memory freed; a handle whose calls never leave is left allocated (a leak, reported as the
//! thread's last error and logged) rather than freed under them.
//!
//! A process-wide registry of live handles, consulted by create and destroy only (never by a
//! call's hot path), makes a second destroy of the same handle (two threads closing at once, or
//! one closing twice) a no-op that says so, instead of a double free.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::Failure;

/// Which kind of handle an address is registered as: destroying a live handle through the
/// destroy function of another kind is refused too.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Comm,
    Replicas,
    Work,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Comm => "tutti_comm",
            Kind::Replicas => "tutti_replicas",
            Kind::Work => "tutti_work",
        }
    }
}

/// Shards of the registry, by address, so that threads creating work handles at once rarely
/// meet on one lock.
const SHARDS: usize = 16;

static LIVE: [Mutex<BTreeMap<usize, Kind>>; SHARDS] =
    [const { Mutex::new(BTreeMap::new()) }; SHARDS];

fn shard(addr: usize) -> &'static Mutex<BTreeMap<usize, Kind>> {
    // Handles are boxes of at least 8-byte alignment: the low bits say nothing.
    &LIVE[(addr >> 4) % SHARDS]
}

fn register(addr: usize, kind: Kind) {
    shard(addr)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(addr, kind);
}

/// Remove `addr` from the registry if it is a live handle of `kind`; false otherwise (freed
/// already, being destroyed by another thread, never made, or of another kind).
fn unregister(addr: usize, kind: Kind) -> bool {
    let mut live = shard(addr).lock().unwrap_or_else(|e| e.into_inner());
    match live.get(&addr) {
        Some(k) if *k == kind => {
            live.remove(&addr);
            true
        }
        _ => false,
    }
}

/// The count of calls inside a handle, and its closing mark; embedded in each handle type.
pub(crate) struct Live {
    calls: AtomicUsize,
    closing: AtomicBool,
}

/// A C handle type: its object carries a [`Live`].
pub(crate) trait Handle: Sized {
    const KIND: Kind;
    fn live(&self) -> &Live;
}

/// A call inside a handle: the handle is not freed until it is dropped.
pub(crate) struct Entered<'a, H: Handle>(&'a H);

impl<H: Handle> Deref for Entered<'_, H> {
    type Target = H;
    fn deref(&self) -> &H {
        self.0
    }
}

impl<H: Handle> Drop for Entered<'_, H> {
    fn drop(&mut self) {
        self.0.live().calls.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Live {
    pub(crate) fn new() -> Live {
        Live {
            calls: AtomicUsize::new(0),
            closing: AtomicBool::new(false),
        }
    }

    /// Whether every call has left within `bound`.
    fn wait_out(&self, bound: Duration) -> bool {
        let deadline = Instant::now().checked_add(bound);
        let mut nap = Duration::from_micros(50);
        loop {
            if self.calls.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(5));
        }
    }
}

/// Box `h` for C and register the handle as live.
pub(crate) fn into_raw<H: Handle>(h: H) -> *mut H {
    let p = Box::into_raw(Box::new(h));
    register(p as usize, H::KIND);
    p
}

/// Enter the handle for one call; fails once its destroy has begun.
///
/// # Safety
///
/// `p` is NULL or a handle from [`into_raw`] whose memory is not freed yet.
pub(crate) unsafe fn enter<'a, H: Handle>(p: *const H) -> Result<Entered<'a, H>, Failure> {
    let name = H::KIND.name();
    // SAFETY: as the caller promises.
    let h =
        unsafe { p.as_ref() }.ok_or_else(|| Failure::invalid(format!("{} is NULL", &name[6..])))?;
    let live = h.live();
    // SeqCst on both sides: either this call sees `closing`, or destroy sees the call.
    live.calls.fetch_add(1, Ordering::SeqCst);
    if live.closing.load(Ordering::SeqCst) {
        live.calls.fetch_sub(1, Ordering::SeqCst);
        return Err(Failure::invalid(format!(
            "this {name} is being destroyed ({name}_destroy was called on another thread); no \
             call may use it from then on"
        )));
    }
    Ok(Entered(h))
}

/// Destroy a handle: refuse one that is not live (a second destroy), mark it closing, wait up
/// to `bound` for the calls inside; past it, `overdue` (which aborts the group, so that they
/// leave at once) and up to `bound` again; then `before_free` (waiting for its own work, say)
/// and free it.
///
/// # Safety
///
/// `p` is NULL or was returned by [`into_raw`] (live or destroyed: a handle no longer
/// registered is not touched).
pub(crate) unsafe fn destroy<H: Handle>(
    p: *mut H,
    bound: impl FnOnce(&H) -> Duration,
    overdue: impl FnOnce(&H, usize),
    before_free: impl FnOnce(&H),
) -> Result<(), Failure> {
    let name = H::KIND.name();
    if p.is_null() {
        return Ok(());
    }
    if !unregister(p as usize, H::KIND) {
        return Err(Failure::invalid(format!(
            "{p:?} is not a live {name}: it was destroyed already (or is being destroyed on \
             another thread), or never created; nothing was done"
        )));
    }
    // SAFETY: registered, so live; only this call unregistered it, so only this call frees.
    let h = unsafe { &*p };
    let live = h.live();
    live.closing.store(true, Ordering::SeqCst);
    let bound = bound(h);
    if !live.wait_out(bound) {
        overdue(h, live.calls.load(Ordering::SeqCst));
        if !live.wait_out(bound) {
            let n = live.calls.load(Ordering::SeqCst);
            return Err(Failure {
                code: crate::error::TuttiResult::TUTTI_ERROR_TIMEOUT,
                message: format!(
                    "{n} call(s) on other threads were still inside this {name} after its \
                     timeout and an abort; it is left allocated rather than freed under them"
                ),
            });
        }
    }
    before_free(h);
    // SAFETY: from Box::into_raw; no call is inside, and none can enter (`closing`) while the
    // memory lives; callers do not use the handle once destroy has returned.
    drop(unsafe { Box::from_raw(p) });
    Ok(())
}

/// Record a destroy's refusal as the thread's last error, and log it (destroy returns nothing).
pub(crate) fn report(function: &str, r: Result<(), Failure>) {
    match r {
        Ok(()) => crate::error::set_last_error(String::new()),
        Err(f) => {
            log::warn!("{function}: {}", f.message);
            crate::error::set_last_error(format!("{function}: {}", f.message));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    struct H(Live, u32);
    impl Handle for H {
        const KIND: Kind = Kind::Replicas;
        fn live(&self) -> &Live {
            &self.0
        }
    }
    struct W(Live);
    impl Handle for W {
        const KIND: Kind = Kind::Work;
        fn live(&self) -> &Live {
            &self.0
        }
    }

    #[test]
    fn a_second_destroy_is_refused_and_calls_inside_are_waited_for() {
        let p = into_raw(H(Live::new(), 7));
        // Another kind's destroy does not take it.
        let wrong = unsafe { destroy(p.cast::<W>(), |_| Duration::ZERO, |_, _| {}, |_| {}) };
        assert!(wrong.unwrap_err().message.contains("not a live tutti_work"));
        // A call inside holds destroy off until it leaves.
        let inside = unsafe { enter(p) }.unwrap();
        assert_eq!(inside.1, 7);
        let addr = p as usize;
        let left = Arc::new(AtomicBool::new(false));
        let l2 = left.clone();
        let t = std::thread::spawn(move || {
            let p = addr as *mut H;
            let r = unsafe { destroy(p, |_| Duration::from_secs(10), |_, _| {}, |_| {}) };
            assert!(l2.load(Ordering::SeqCst), "freed while a call was inside");
            r
        });
        std::thread::sleep(Duration::from_millis(50));
        // Closing: a new entry fails clearly.
        let e = unsafe { enter(p) }.err().unwrap();
        assert!(e.message.contains("being destroyed"), "{}", e.message);
        left.store(true, Ordering::SeqCst);
        drop(inside);
        t.join().unwrap().unwrap();
        let again = unsafe { destroy(p, |_| Duration::ZERO, |_, _| {}, |_| {}) };
        assert!(again.unwrap_err().message.contains("destroyed already"));
    }

    #[test]
    fn calls_that_do_not_leave_are_aborted_then_the_handle_is_kept() {
        let p = into_raw(H(Live::new(), 0));
        let inside = unsafe { enter(p) }.unwrap();
        let mut aborted = 0;
        let r = unsafe {
            destroy(
                p,
                |_| Duration::from_millis(20),
                |_, n| aborted = n,
                |_| panic!("freed with a call inside"),
            )
        };
        assert_eq!(aborted, 1);
        assert!(r.unwrap_err().message.contains("left allocated"));
        drop(inside);
        // Deliberately left allocated by destroy; reclaim it here.
        drop(unsafe { Box::from_raw(p) });
    }
}
