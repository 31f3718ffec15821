//! Waiting without spinning forever: a doorbell per rank.
//!
//! A rank that waits for a peer first spins briefly (only when the ranks have a core each), then
//! sleeps on its own [`Bell`] until a peer rings it or the deadline passes. A peer rings the bell
//! of every rank that might wait on what it just did. Ringing costs one fence and one load while
//! nobody sleeps.

use std::sync::atomic::{fence, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// The longest timeout a communicator accepts: 30 days (deadlines are computed as now +
/// timeout, and a wait that long means something else is wrong).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(30 * 24 * 3600);

/// `TUTTI_TIMEOUT` in seconds (a positive number, at most 30 days), `None` when unset, or an
/// error that says what is wrong with its value.
pub fn timeout_from_env() -> Result<Option<Duration>> {
    let Ok(v) = std::env::var("TUTTI_TIMEOUT") else {
        return Ok(None);
    };
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .filter(|d| !d.is_zero() && *d <= MAX_TIMEOUT)
        .map(Some)
        .ok_or_else(|| {
            Error::config(format!(
                "TUTTI_TIMEOUT='{v}' is not a timeout: give a positive number of seconds \
                 (e.g. 30 or 0.5), at most 30 days"
            ))
        })
}

/// The bound on every wait unless a config says otherwise: `TUTTI_TIMEOUT` when it is valid
/// (an invalid one is reported by every communicator built with it), else 300 s.
pub fn default_timeout() -> Duration {
    timeout_from_env()
        .ok()
        .flatten()
        .unwrap_or(Duration::from_secs(300))
}

/// Cores this process may run on (read once).
pub(crate) fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// How long a waiter whose ranks share cores yields the core before it sleeps.
pub(crate) const YIELD_FOR: Duration = Duration::from_micros(50);

/// How long a waiter may spin before it sleeps.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Spin(pub(crate) Duration);

impl Spin {
    /// Spin up to 50 µs when every rank has a core of its own, not at all when they share cores
    /// (a spinning rank would then steal the time of the rank it waits for; it yields instead).
    pub(crate) fn for_world(ranks: usize) -> Spin {
        if ranks <= cores() {
            Spin(Duration::from_micros(50))
        } else {
            Spin(Duration::ZERO)
        }
    }
}

/// A doorbell: sleep until rung or until a deadline.
#[derive(Default)]
pub(crate) struct Bell {
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Bell {
    /// Wake whoever sleeps on this bell. Call after publishing what they wait for.
    #[inline]
    pub(crate) fn ring(&self) {
        // Pairs with the fence in `wait`: either the sleeper sees our store, or we see it sleeping.
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock();
            self.cv.notify_all();
        }
    }

    /// Wait until `ready()` is true (returns true) or `deadline` passes (returns `ready()`).
    pub(crate) fn wait(
        &self,
        deadline: Instant,
        spin: Spin,
        mut ready: impl FnMut() -> bool,
    ) -> bool {
        if ready() {
            return true;
        }
        if !spin.0.is_zero() {
            let until = Instant::now() + spin.0;
            loop {
                for _ in 0..64 {
                    std::hint::spin_loop();
                    if ready() {
                        return true;
                    }
                }
                if Instant::now() >= until {
                    break;
                }
            }
        } else {
            // Ranks share cores: give the core away for a while before sleeping. The ranks this
            // one waits for run at once, and a step that ends within the while costs no sleep
            // and wake-up (tens of microseconds each here).
            let until = Instant::now() + YIELD_FOR;
            while Instant::now() < until {
                std::thread::yield_now();
                if ready() {
                    return true;
                }
            }
        }
        loop {
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            let mut g = self.lock.lock();
            let ok = ready();
            let timed_out = !ok && self.cv.wait_until(&mut g, deadline).timed_out();
            drop(g);
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            if ok {
                return true;
            }
            if timed_out {
                return ready();
            }
            if ready() {
                return true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn wakes_on_ring_and_times_out_without() {
        let bell = Arc::new(Bell::default());
        let flag = Arc::new(AtomicBool::new(false));
        let t = {
            let (bell, flag) = (bell.clone(), flag.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                flag.store(true, Ordering::SeqCst);
                bell.ring();
            })
        };
        let start = Instant::now();
        let ok = bell.wait(
            start + Duration::from_secs(10),
            Spin(Duration::ZERO),
            || flag.load(Ordering::SeqCst),
        );
        assert!(ok);
        assert!(start.elapsed() < Duration::from_secs(5));
        t.join().unwrap();
        let start = Instant::now();
        assert!(!bell.wait(
            start + Duration::from_millis(30),
            Spin(Duration::ZERO),
            || false
        ));
        assert!(start.elapsed() >= Duration::from_millis(30));
    }
}
