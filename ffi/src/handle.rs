//! The lifetime of the handles C holds (`tutti_comm`, `tutti_replicas`, `tutti_work`).
//!
//! A process-wide registry of live handles, by address, is what decides whether a handle may be
//! used. Every entry point that uses a handle enters it ([`enter`]): under the read lock of the
//! address's shard of the registry, it checks that the address is a registered handle of the
//! right kind, not being destroyed, and increments the handle's count of calls inside; the
//! count is decremented when the call returns. An address that is not registered is refused
//! without its memory being read, so that a call racing a destroy never touches a freed handle.
//!
//! Destroy, under the shard's write lock, checks that the handle is registered and not closing
//! and marks it closing (later entries fail with a clear error; a second destroy is a no-op that
//! says so, instead of a double free). Since an entry increments the count under the read lock,
//! every call that entered before that is counted: destroy then waits for the calls inside to
//! leave, bounded: by the communicator's timeout, then, after aborting the group (which makes
//! them leave at once), by the timeout again. Only then is the handle removed from the registry
//! (under the write lock) and its memory freed; a handle whose calls never leave stays
//! registered as closing and allocated (a leak, reported as the thread's last error and logged)
//! rather than freed under them.
//!
//! As with `free()`, an address that the allocator hands to a new handle after a destroy has
//! returned cannot be told apart from the handle destroyed there: a call made with a destroyed
//! handle's address is refused only while that address is not reused by a live handle of the
//! same kind. The registry guards calls that race a destroy, not every use after it.
//!
//! The registry's shards are hash maps that keep their capacity when entries are removed: once
//! warmed up, registering a handle (every `tutti_*_async` registers a work handle) does not
//! allocate. A call's own cost is one uncontended read lock and the count's two atomics.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use crate::error::Failure;

/// Which kind of handle an address is registered as: using or destroying a live handle through
/// the functions of another kind is refused too.
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

/// A registered handle: its kind, and whether its destroy has begun.
#[derive(Copy, Clone, Debug)]
struct Entry {
    kind: Kind,
    closing: bool,
}

/// Hashes an address: a multiply that mixes every bit into the high ones, folded back into the
/// low ones (the map indexes its buckets by the low bits; the addresses of one shard share some).
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        let h = (self.0 ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

#[derive(Copy, Clone, Default)]
struct AddrState;

impl BuildHasher for AddrState {
    type Hasher = AddrHasher;
    fn build_hasher(&self) -> AddrHasher {
        AddrHasher(0)
    }
}

type Shard = RwLock<HashMap<usize, Entry, AddrState>>;

/// Shards of the registry, by address, so that threads creating work handles at once rarely
/// meet on one lock.
const SHARDS: usize = 16;

static LIVE: [Shard; SHARDS] = [const { RwLock::new(HashMap::with_hasher(AddrState)) }; SHARDS];

fn shard(addr: usize) -> &'static Shard {
    // Handles are boxes of at least 8-byte alignment: the low bits say nothing.
    &LIVE[(addr >> 4) % SHARDS]
}

fn register(addr: usize, kind: Kind) {
    // A live handle's address is not another live handle's: this replaces nothing.
    shard(addr).write().insert(
        addr,
        Entry {
            kind,
            closing: false,
        },
    );
}

/// Mark `addr` closing if it is a live handle of `kind` not closing yet; false otherwise (freed
/// already, being destroyed by another thread, never made, or of another kind).
fn close(addr: usize, kind: Kind) -> bool {
    match shard(addr).write().get_mut(&addr) {
        Some(e) if e.kind == kind && !e.closing => {
            e.closing = true;
            true
        }
        _ => false,
    }
}

/// Remove `addr`, closed by this thread, from the registry: from then on no call can enter it.
fn unregister(addr: usize) {
    shard(addr).write().remove(&addr);
}

/// The count of calls inside a handle; embedded in each handle type.
pub(crate) struct Live {
    calls: AtomicUsize,
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
        // Release: this call's uses of the handle happen before destroy's acquiring load that
        // sees the count at 0, and so before the free. The last touch of the handle.
        self.0.live().calls.fetch_sub(1, Ordering::Release);
    }
}

impl Live {
    pub(crate) fn new() -> Live {
        Live {
            calls: AtomicUsize::new(0),
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::Acquire)
    }

    /// Whether every call has left within `bound`.
    fn wait_out(&self, bound: Duration) -> bool {
        let deadline = Instant::now().checked_add(bound);
        let mut nap = Duration::from_micros(50);
        loop {
            if self.calls() == 0 {
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

/// Enter the handle for one call; fails, without reading its memory, when `p` is not a live
/// handle of this kind (destroyed already, or never made), and once its destroy has begun.
///
/// # Safety
///
/// `p` is NULL or any address: an address not registered as a live handle of this kind is not
/// read. (An address reused by a new handle after a destroy returned is that new handle.)
pub(crate) unsafe fn enter<'a, H: Handle>(p: *const H) -> Result<Entered<'a, H>, Failure> {
    let name = H::KIND.name();
    if p.is_null() {
        return Err(Failure::invalid(format!("{} is NULL", &name[6..])));
    }
    let addr = p as usize;
    let live = shard(addr).read();
    match live.get(&addr) {
        Some(e) if e.kind == H::KIND && !e.closing => {}
        Some(e) if e.kind == H::KIND => {
            return Err(Failure::invalid(format!(
                "this {name} is being destroyed ({name}_destroy was called on another thread); \
                 no call may use it from then on"
            )))
        }
        Some(e) => {
            return Err(Failure::invalid(format!(
                "{p:?} is a {}, not a {name}",
                e.kind.name()
            )))
        }
        None => {
            return Err(Failure::invalid(format!(
                "{p:?} is not a live {name} handle (destroyed already?)"
            )))
        }
    }
    // SAFETY: registered and not closing, under the shard's read lock: destroy cannot mark it
    // closing (a write lock) until this is released, and frees it only after this call, counted
    // below, has left.
    let h = unsafe { &*p };
    // Relaxed suffices: the increment happens before the read lock is released, and destroy
    // reads the count only after taking the write lock that marks the handle closing.
    h.live().calls.fetch_add(1, Ordering::Relaxed);
    drop(live);
    Ok(Entered(h))
}

/// Destroy a handle: refuse one that is not live (a second destroy), mark it closing, wait up
/// to `bound` for the calls inside; past it, `overdue` (which aborts the group, so that they
/// leave at once) and up to `bound` again; then `before_free` (waiting for its own work, say),
/// unregister and free it.
///
/// # Safety
///
/// `p` is NULL or any address: one not registered as a live handle of this kind is not
/// touched.
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
    if !close(p as usize, H::KIND) {
        return Err(Failure::invalid(format!(
            "{p:?} is not a live {name}: it was destroyed already (or is being destroyed on \
             another thread), or never created; nothing was done"
        )));
    }
    // SAFETY: registered, so live; only this call closed it, so only this call frees it.
    let h = unsafe { &*p };
    let live = h.live();
    let bound = bound(h);
    if !live.wait_out(bound) {
        overdue(h, live.calls());
        if !live.wait_out(bound) {
            let n = live.calls();
            // Left registered as closing: calls keep failing clearly, the address is not reused.
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
    // No call can enter once unregistered; none is inside (closing since, and the count at 0).
    unregister(p as usize);
    // SAFETY: from Box::into_raw; no call is inside and none can enter; callers do not use the
    // handle once destroy has returned.
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
    use std::sync::atomic::AtomicBool;
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
        // Freed: an entry is refused by the registry, without reading the memory.
        let e = unsafe { enter(p) }.err().unwrap();
        assert!(
            e.message.contains("not a live tutti_replicas"),
            "{}",
            e.message
        );
    }

    #[test]
    fn addresses_not_registered_or_of_another_kind_are_not_entered() {
        // Never allocated: reading it would fault.
        let bogus = 0x10usize as *const H;
        let e = unsafe { enter(bogus) }.err().unwrap();
        assert!(
            e.message.contains("not a live tutti_replicas"),
            "{}",
            e.message
        );
        let p = into_raw(H(Live::new(), 1));
        let e = unsafe { enter(p.cast::<W>()) }.err().unwrap();
        assert!(
            e.message.contains("is a tutti_replicas, not a tutti_work"),
            "{}",
            e.message
        );
        unsafe { destroy(p, |_| Duration::ZERO, |_, _| {}, |_| {}) }.unwrap();
    }

    /// Of a size no other test allocates, so that its freed address is not reused meanwhile.
    struct C(Live, [u64; 37]);
    impl Handle for C {
        const KIND: Kind = Kind::Comm;
        fn live(&self) -> &Live {
            &self.0
        }
    }

    #[test]
    fn calls_racing_a_destroy_fail_or_are_waited_for() {
        for _ in 0..50 {
            let p = into_raw(C(Live::new(), [3; 37]));
            let addr = p as usize;
            let callers: Vec<_> = (0..3)
                .map(|_| {
                    std::thread::spawn(move || loop {
                        match unsafe { enter(addr as *const C) } {
                            Ok(h) => assert_eq!(h.1[36], 3),
                            Err(e) => {
                                assert!(
                                    e.message.contains("being destroyed")
                                        || e.message.contains("not a live"),
                                    "{}",
                                    e.message
                                );
                                return;
                            }
                        }
                    })
                })
                .collect();
            std::thread::yield_now();
            unsafe { destroy(p, |_| Duration::from_secs(10), |_, _| {}, |_| {}) }.unwrap();
            for c in callers {
                c.join().unwrap();
            }
        }
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
        // Left registered as closing: entries still fail clearly.
        let e = unsafe { enter(p) }.err().unwrap();
        assert!(e.message.contains("being destroyed"), "{}", e.message);
        // Deliberately left allocated by destroy; reclaim it here.
        unregister(p as usize);
        drop(unsafe { Box::from_raw(p) });
    }
}
