//! Issue order, the progress thread and work handles.
//!
//! Every collective is issued: it gets the communicator's next call number and joins a queue that
//! runs calls one at a time in that order, so calls complete in issue order on every rank. A
//! blocking call is an issued call followed by a wait; when nothing is queued or running it runs
//! at once on the caller's thread (the same order, without a thread switch). Non-blocking calls
//! run on a progress thread, started by the first one and kept for the communicator's life.
//!
//! A [`Work`] is the handle of one issued call: [`Work::wait`], [`Work::wait_timeout`],
//! [`Work::is_completed`]; the call's error is delivered there. Dropping a pending `Work` leaves
//! the call running: it still completes in order, and the buffers it owns are freed after it.

use std::any::Any;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::algorithm::Plan;
use crate::config::Compression;
use crate::engine::GroupEngine;
use crate::error::{Collective, Error, Result, Site};
use crate::transport::Transport;
use crate::tuning::{Layout, Tuning};

/// What a queued call owns until it completes (the buffers of a safe non-blocking call).
pub(crate) type Keep = Box<dyn Any + Send>;

/// A buffer that a safe non-blocking call owns, held by address: the call reads and writes it
/// through pointers taken from it, and moving a `Box` would assert a unique borrow over those
/// (the buffer may be stored inline, an array). Freed when dropped, or handed back by
/// [`Work::wait`].
pub(crate) struct Owned<B>(std::ptr::NonNull<B>);

// SAFETY: an `Owned<B>` is a `Box<B>` that never asserts uniqueness; it moves between threads
// as a `Box<B>` would.
unsafe impl<B: Send> Send for Owned<B> {}

impl<B> Owned<B> {
    pub(crate) fn new(b: B) -> Owned<B> {
        Owned(std::ptr::NonNull::from(Box::leak(Box::new(b))))
    }

    /// The buffer, for taking the call's pointers (valid until this is dropped or taken).
    pub(crate) fn get(&mut self) -> &mut B {
        // SAFETY: owned and live; the borrow ends before the call is issued, and the pointers
        // taken from it are derived from this address, which nothing retags.
        unsafe { self.0.as_mut() }
    }

    fn into_inner(self) -> B {
        let ptr = self.0.as_ptr();
        std::mem::forget(self);
        // SAFETY: made by `Box::leak` in `new`, and not freed (`self` was forgotten).
        *unsafe { Box::from_raw(ptr) }
    }
}

impl<B> Drop for Owned<B> {
    fn drop(&mut self) {
        // SAFETY: made by `Box::leak` in `new`; dropped once.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) })
    }
}

/// A call ready to run: everything it needs, its buffers as raw parts (see `Call`).
pub(crate) trait Runnable: Send {
    /// Run the call as call number `number`, with the communicator's plan (reused scratch).
    fn run(&self, shared: &Shared, number: u64, plan: &Plan) -> Result<()>;
    /// Where an error of this call is reported (collective and rank; the number is added).
    fn site(&self, number: u64) -> Site;
    /// Whether the call takes a call number of its own: every collective does, and every rank
    /// numbers its collectives alike; a point-to-point call involves two ranks only, so it
    /// runs under the number of the collective that comes next, which it does not use up.
    fn numbered(&self) -> bool {
        true
    }
}

struct Job {
    /// Its place in issue order, among every call of the communicator.
    seq: u64,
    number: u64,
    call: Box<dyn Runnable>,
    state: Arc<WorkState>,
    keep: Keep,
}

#[derive(Default)]
struct Queue {
    /// The next call number to hand out (collectives only: see [`Runnable::numbered`]).
    next_call: u64,
    /// The next place in issue order (every call).
    next_seq: u64,
    /// Issued calls not yet started, in issue order.
    jobs: VecDeque<Job>,
    /// A call is running (on the progress thread or inline on a caller's thread).
    running: bool,
    /// The communicator is being dropped: the progress thread drains the queue and stops.
    closed: bool,
    /// The progress thread has been started.
    thread: bool,
    /// What calls reuse from one to the next; the running call holds it (taken, not swapped
    /// for an empty one: making and dropping one per call is a cost a small call notices).
    plan: Option<Box<Plan>>,
    /// The place in issue order of the last call completed, plus one (calls complete in issue
    /// order).
    completed: u64,
    /// Values dropped once every call issued before them has completed (see
    /// [`Progress::drop_after_issued`]), each with the place in issue order it waits for.
    deferred: Vec<(u64, Keep)>,
}

impl Queue {
    /// The call number and place in issue order of a call issued now.
    fn take_numbers(&mut self, call: &(dyn Runnable + '_)) -> (u64, u64) {
        let number = self.next_call;
        if call.numbered() {
            self.next_call += 1;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        (number, seq)
    }

    /// The call at `seq` in issue order has completed: the deferred values it held back, to
    /// drop outside the lock.
    fn completed(&mut self, seq: u64) -> Vec<Keep> {
        self.completed = self.completed.max(seq + 1);
        if self.deferred.is_empty() {
            return Vec::new();
        }
        let done = self.completed;
        let (ready, waiting) = std::mem::take(&mut self.deferred)
            .into_iter()
            .partition(|(mark, _)| *mark <= done);
        self.deferred = waiting;
        ready.into_iter().map(|(_, k)| k).collect()
    }
}

/// Drop deferred values, each caught: their `Drop` may unmap memory or take locks, and a panic
/// in one must not end the progress thread or a caller's call.
fn release(values: Vec<Keep>) {
    for v in values {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(v)));
    }
}

/// The state a communicator shares with its progress thread.
pub(crate) struct Shared {
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) chunk_bytes: usize,
    /// Every call is checked in a round of its own (see `Config::full_check`).
    pub(crate) full_check: bool,
    /// Reductions are bitwise-deterministic (see `Config::deterministic`).
    pub(crate) deterministic: bool,
    /// How f32 travels between hosts in reductions (see `Config::compression`).
    pub(crate) compression: Compression,
    /// The figures `auto` chooses by between processes (see [`crate::tuning`]), and their
    /// digest; replaced between calls, where they are measured when the communicator is made.
    pub(crate) tuning: Mutex<(Tuning, u16)>,
    /// How the ranks lie on hosts, for the cost model (computed once).
    pub(crate) layout: Layout,
    /// Runs calls for a group of this process's devices; `None`: the host algorithms.
    pub(crate) engine: Option<Arc<dyn GroupEngine>>,
    /// What the last host call that succeeded ran as (see `Communicator::last_algorithm`).
    pub(crate) ran: Mutex<Option<(Collective, &'static str)>>,
    queue: Mutex<Queue>,
    /// Rung when a job is queued, a call ends or the communicator closes.
    cv: Condvar,
}

/// How a transport's ranks lie on hosts, for the cost model.
pub(super) fn layout(t: &dyn Transport) -> Layout {
    Layout {
        shm_within: t.shm_within_hosts(),
        ..Layout::of(t.world_size(), t.hosts())
    }
}

impl Shared {
    pub(crate) fn new(
        transport: Arc<dyn Transport>,
        chunk_bytes: usize,
        full_check: bool,
        deterministic: bool,
        compression: Compression,
        tuning: Tuning,
        engine: Option<Arc<dyn GroupEngine>>,
    ) -> Shared {
        let layout = layout(&*transport);
        Shared {
            transport,
            chunk_bytes,
            full_check,
            deterministic,
            compression,
            tuning: Mutex::new((tuning, tuning.digest())),
            layout,
            engine,
            ran: Mutex::new(None),
            queue: Mutex::new(Queue::default()),
            cv: Condvar::new(),
        }
    }
}

/// Clears `running` when an inline call (at `.2` in issue order) ends, a panic included, hands
/// the plan back and the queue on.
struct Inline<'a>(&'a Shared, Option<Box<Plan>>, u64);

impl Drop for Inline<'_> {
    fn drop(&mut self) {
        let mut q = self.0.queue.lock();
        q.running = false;
        q.plan = self.1.take();
        let ready = q.completed(self.2);
        if !q.jobs.is_empty() {
            self.0.cv.notify_all();
        }
        drop(q);
        if !ready.is_empty() {
            release(ready);
        }
    }
}

/// The progress thread of a communicator, joined when the communicator is dropped.
pub(crate) struct Progress {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Progress {
    pub(crate) fn new(shared: Arc<Shared>) -> Progress {
        Progress {
            shared,
            thread: Mutex::new(None),
        }
    }

    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// Run `call` now when nothing is queued or running, else queue it and wait for it.
    pub(crate) fn run_blocking(&self, call: &(dyn Runnable + Sync + '_)) -> Result<()> {
        self.run_numbered(call).1
    }

    /// [`Progress::run_blocking`], also saying where the call ran (its number).
    pub(crate) fn run_numbered(&self, call: &(dyn Runnable + Sync + '_)) -> (Site, Result<()>) {
        let mut q = self.shared.queue.lock();
        if q.jobs.is_empty() && !q.running {
            let (number, seq) = q.take_numbers(call);
            q.running = true;
            let mut inline = Inline(&self.shared, q.plan.take(), seq);
            drop(q);
            let plan = inline.1.get_or_insert_with(Box::default);
            return (call.site(number), call.run(&self.shared, number, plan));
        }
        drop(q);
        // SAFETY: the call's borrows outlive this function, and it waits until the call has
        // completed (a wait without a deadline returns only then).
        let call: Box<dyn Runnable + '_> = Box::new(Borrowed(call));
        let call: Box<dyn Runnable> = unsafe { std::mem::transmute(call) };
        let work: Work<()> = self.issue(call, Box::new(Owned::new(())));
        (work.site(), work.wait().map(drop))
    }

    /// Hold `value` until every call issued before now has completed, then drop it (at once
    /// when none is queued or running): for memory that calls issued by address may still
    /// use, such as a shared buffer its owner frees while a non-blocking call on it is queued.
    pub(crate) fn drop_after_issued(&self, value: Keep) {
        let mut q = self.shared.queue.lock();
        if q.completed >= q.next_seq {
            drop(q);
            release(vec![value]);
            return;
        }
        let mark = q.next_seq;
        q.deferred.push((mark, value));
    }

    /// Queue `call` and return its handle; `keep` is held until the call completes.
    pub(crate) fn issue<B: Send + 'static>(&self, call: Box<dyn Runnable>, keep: Keep) -> Work<B> {
        let mut q = self.shared.queue.lock();
        if !q.thread {
            let shared = self.shared.clone();
            let name = format!("tutti-progress-{}", self.shared.transport.rank());
            match std::thread::Builder::new()
                .name(name)
                .spawn(move || progress(shared))
            {
                Ok(h) => {
                    q.thread = true;
                    *self.thread.lock() = Some(h);
                }
                Err(e) => {
                    // The call's number is used up and the peers are told: they would wait for
                    // this call, and this rank's next call would carry their call's number.
                    let (number, _) = q.take_numbers(&*call);
                    let site = call.site(number);
                    drop(q);
                    drop(call);
                    let error = Error::io("starting the communicator's progress thread", e);
                    self.shared
                        .transport
                        .abort(&format!("rank {}: {error}", site.rank));
                    let state = Arc::new(WorkState::new(site));
                    state.complete(Err(error), Some(keep));
                    return Work::from_state(state);
                }
            }
        }
        let (number, seq) = q.take_numbers(&*call);
        let state = Arc::new(WorkState::new(call.site(number)));
        q.jobs.push_back(Job {
            seq,
            number,
            call,
            state: state.clone(),
            keep,
        });
        self.shared.cv.notify_all();
        Work::from_state(state)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.shared.queue.lock().closed = true;
        self.shared.cv.notify_all();
        // The thread drains the queue (every call is bounded by the timeout) and stops. A panic
        // on it was already caught per call; a join error is nothing to report from a drop.
        if let Some(h) = self.thread.get_mut().take() {
            // Dropped on the progress thread itself (the last communicator handle was in a
            // buffer a call kept): it stops by itself once the queue is drained.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// A call with a step that runs when the call starts, in issue order (every earlier call of
/// the communicator has completed by then), and a value it holds until it is dropped.
pub(crate) struct Prepared<R> {
    pub(crate) call: R,
    pub(crate) before: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    pub(crate) _keep: Mutex<Option<Keep>>,
}

impl<R: Runnable> Runnable for Prepared<R> {
    fn run(&self, shared: &Shared, number: u64, plan: &Plan) -> Result<()> {
        if let Some(before) = self.before.lock().take() {
            before();
        }
        self.call.run(shared, number, plan)
    }
    fn site(&self, number: u64) -> Site {
        self.call.site(number)
    }
    fn numbered(&self) -> bool {
        self.call.numbered()
    }
}

/// A borrowed call, boxed for the queue by a caller that waits for it.
struct Borrowed<'a>(&'a (dyn Runnable + Sync + 'a));

impl Runnable for Borrowed<'_> {
    fn run(&self, shared: &Shared, number: u64, plan: &Plan) -> Result<()> {
        self.0.run(shared, number, plan)
    }
    fn site(&self, number: u64) -> Site {
        self.0.site(number)
    }
    fn numbered(&self) -> bool {
        self.0.numbered()
    }
}

fn progress(shared: Arc<Shared>) {
    let mut q = shared.queue.lock();
    loop {
        if !q.running {
            if let Some(job) = q.jobs.pop_front() {
                q.running = true;
                let plan = q.plan.take().unwrap_or_default();
                drop(q);
                let Job {
                    seq,
                    number,
                    call,
                    state,
                    keep,
                } = job;
                state.start();
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    call.run(&shared, number, &plan)
                }))
                .unwrap_or_else(|_| {
                    Err(Error::Aborted {
                        rank: shared.transport.rank(),
                        reason: format!("a panic inside {}", call.site(number)),
                    })
                });
                drop(call);
                state.complete(result, Some(keep));
                // The last reference may hold the caller's buffer (a dropped `Work`): drop it
                // here, outside the queue's lock (its Drop may use this communicator) and
                // caught (a panic in it must not end this thread).
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(state)));
                q = shared.queue.lock();
                q.running = false;
                q.plan = Some(plan);
                let ready = q.completed(seq);
                shared.cv.notify_all();
                if !ready.is_empty() {
                    drop(q);
                    release(ready);
                    q = shared.queue.lock();
                }
                continue;
            }
            if q.closed {
                return;
            }
        }
        shared.cv.wait(&mut q);
    }
}

/// The device work a call queued on a caller's stream when it ran (see
/// `Communicator::set_cuda_stream`), which its handle waits for on the host.
pub(crate) trait DeviceWork: Send + Sync {
    /// Wait until the work is done (`Ok(true)`) or `until` passes (`Ok(false)`; `None`: until
    /// the call's own deadline); past that deadline, its error (`Timeout`).
    fn wait(&self, until: Option<Instant>) -> Result<bool>;
}

/// The shared state of one issued call.
pub(crate) struct WorkState {
    site: Site,
    done: Mutex<Option<(Result<()>, Option<Keep>)>>,
    cv: Condvar,
    /// When the call started running (it waits in the queue before).
    started: Mutex<Option<Instant>>,
    /// The device work of a call that ran on a caller's stream, and its result once known.
    device: Option<(Box<dyn DeviceWork>, DeviceResult)>,
}

/// The result of a call's device work, once known.
type DeviceResult = Mutex<Option<Result<()>>>;

impl WorkState {
    fn new(site: Site) -> WorkState {
        WorkState {
            site,
            done: Mutex::new(None),
            cv: Condvar::new(),
            started: Mutex::new(None),
            device: None,
        }
    }

    /// Wait for the device work, if any, until `until` (`None`: the call's own deadline).
    /// `Ok(true)` once done (or there is none), `Ok(false)` once `until` passed first.
    fn device_wait(&self, until: Option<Instant>) -> Result<bool> {
        let Some((work, result)) = &self.device else {
            return Ok(true);
        };
        if let Some(r) = &*result.lock() {
            return r.clone().map(|()| true);
        }
        // Several threads may wait at once; each asks the device, the first answer is kept.
        let r = match work.wait(until) {
            Ok(false) => return Ok(false),
            Ok(true) => Ok(()),
            Err(e) => Err(e),
        };
        result.lock().get_or_insert(r).clone().map(|()| true)
    }

    fn start(&self) {
        *self.started.lock() = Some(Instant::now());
    }

    fn complete(&self, result: Result<()>, keep: Option<Keep>) {
        *self.done.lock() = Some((result, keep));
        self.cv.notify_all();
    }
}

/// The handle of a non-blocking collective: wait for it, test it, and get its result (and the
/// buffer it owned, for the safe typed calls) from it.
///
/// Calls complete in the order they were issued on their communicator. Errors of the call
/// (`Mismatch`, `PeerRejected`, `Timeout`, `Aborted`, `PeerLost`, an `InvalidArgument` of this
/// rank's own) are delivered by [`Work::wait`] and [`Work::wait_timeout`]. Dropping a pending
/// handle does not cancel the call; abort the communicator for that.
///
/// ```
/// use tutti::{run_local, Config, ReduceOp};
/// let sums = run_local(2, &Config::default(), |comm| {
///     let work = comm.all_reduce_async(vec![comm.rank() as f32 + 1.0; 4], ReduceOp::Sum);
///     // ... compute something else meanwhile ...
///     work.wait().unwrap()
/// })
/// .unwrap();
/// assert_eq!(sums, vec![vec![3.0; 4], vec![3.0; 4]]);
/// ```
#[must_use = "a collective's error is only seen by waiting for it"]
pub struct Work<B = ()> {
    state: Arc<WorkState>,
    _buffer: PhantomData<fn() -> B>,
}

impl<B> std::fmt::Debug for Work<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("site", &self.state.site)
            .field("completed", &self.state.done.lock().is_some())
            .finish()
    }
}

impl<B: Send + 'static> Work<B> {
    fn from_state(state: Arc<WorkState>) -> Work<B> {
        Work {
            state,
            _buffer: PhantomData,
        }
    }

    /// The handle of a call that already ran (issued on a caller's stream: its device work
    /// is queued, `device` waits for it). Started at `started`.
    pub(crate) fn ran(
        site: Site,
        result: Result<()>,
        device: Option<Box<dyn DeviceWork>>,
        started: Instant,
    ) -> Work<B> {
        let mut state = WorkState::new(site);
        state.device = device.map(|d| (d, Mutex::new(None)));
        *state.started.get_mut() = Some(started);
        *state.done.get_mut() = Some((result, None));
        Work::from_state(Arc::new(state))
    }

    /// The call: its collective, this rank and its call number.
    pub fn site(&self) -> Site {
        self.state.site
    }

    /// When the call started running, if it has (calls wait in issue order before they run).
    pub fn started(&self) -> Option<Instant> {
        *self.state.started.lock()
    }

    /// True once the call has completed, successfully or not (never blocks).
    pub fn is_completed(&self) -> bool {
        match &*self.state.done.lock() {
            None => return false,
            Some((Err(_), _)) => return true,
            Some((Ok(()), _)) => {}
        }
        !matches!(self.state.device_wait(Some(Instant::now())), Ok(false))
    }

    /// Wait up to `timeout` for the call. `Ok` once it completed successfully; the call's
    /// error once it failed; `Timeout` (waiting for no rank, phase `complete`) when it is still
    /// running: the handle stays valid, and the call goes on and completes or fails later.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now().checked_add(timeout);
        let mut done = self.state.done.lock();
        while done.is_none() {
            match deadline {
                Some(d) => {
                    if self.state.cv.wait_until(&mut done, d).timed_out() && done.is_none() {
                        return Err(Error::Timeout {
                            site: self.state.site,
                            waiting_for: Vec::new(),
                            phase: "complete",
                            timeout,
                            stalled_on: Vec::new(),
                        });
                    }
                }
                None => self.state.cv.wait(&mut done),
            }
        }
        done.as_ref().map_or(Ok(()), |(r, _)| r.clone())?;
        drop(done);
        match self.state.device_wait(deadline)? {
            true => Ok(()),
            false => Err(Error::Timeout {
                site: self.state.site,
                waiting_for: Vec::new(),
                phase: "complete",
                timeout,
                stalled_on: Vec::new(),
            }),
        }
    }

    /// Wait until the call completes and return its result: the buffer the call owned (for
    /// the safe typed calls), or its error. Every call is bounded by the communicator's timeout
    /// once it starts, so this returns once the calls issued before it have.
    pub fn wait(self) -> Result<B> {
        let mut done = self.state.done.lock();
        while done.is_none() {
            self.state.cv.wait(&mut done);
        }
        let (result, keep) = done.take().expect("checked above");
        drop(done);
        result?;
        self.state.device_wait(None)?;
        let keep: Keep = keep.unwrap_or_else(|| Box::new(Owned::new(())));
        match keep.downcast::<Owned<B>>() {
            Ok(b) => Ok(b.into_inner()),
            // A handle's type is fixed when it is issued; this is unreachable by construction.
            Err(_) => Err(Error::System {
                what: format!("{}", self.state.site),
                message: "the work handle's buffer has another type".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Collective;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Device work that is done once `done` is set, or fails with `Timeout` at its deadline.
    struct Flag {
        done: Arc<AtomicBool>,
        deadline: Instant,
    }

    impl DeviceWork for Flag {
        fn wait(&self, until: Option<Instant>) -> Result<bool> {
            loop {
                if self.done.load(Ordering::Acquire) {
                    return Ok(true);
                }
                let now = Instant::now();
                if now >= self.deadline {
                    return Err(Error::Timeout {
                        site: SITE,
                        waiting_for: vec![0],
                        phase: "finish its work on the device",
                        timeout: Duration::ZERO,
                        stalled_on: Vec::new(),
                    });
                }
                if until.is_some_and(|u| now >= u) {
                    return Ok(false);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    const SITE: Site = Site {
        collective: Collective::AllReduce,
        rank: 0,
        call: 7,
    };

    /// A call that ran at issue is complete only once its device work is: a bounded wait
    /// times out before, `is_completed` says no, and both see it once the work is done.
    #[test]
    fn a_call_that_ran_completes_with_its_device_work() {
        let done = Arc::new(AtomicBool::new(false));
        let device = Flag {
            done: done.clone(),
            deadline: Instant::now() + Duration::from_secs(60),
        };
        let work: Work<()> = Work::ran(SITE, Ok(()), Some(Box::new(device)), Instant::now());
        assert!(!work.is_completed());
        let e = work.wait_timeout(Duration::from_millis(20)).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Timeout {
                    phase: "complete",
                    ..
                }
            ),
            "{e}"
        );
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            done.store(true, Ordering::Release);
        });
        work.wait_timeout(Duration::MAX).unwrap();
        assert!(work.is_completed());
        work.wait().unwrap();
        setter.join().unwrap();
    }

    /// Device work past the call's deadline fails the handle with its error, every time asked.
    #[test]
    fn device_work_past_its_deadline_is_the_calls_error() {
        let device = Flag {
            done: Arc::new(AtomicBool::new(false)),
            deadline: Instant::now() + Duration::from_millis(20),
        };
        let work: Work<()> = Work::ran(SITE, Ok(()), Some(Box::new(device)), Instant::now());
        for _ in 0..2 {
            let e = work.wait_timeout(Duration::MAX).unwrap_err();
            assert!(
                matches!(&e, Error::Timeout { waiting_for, .. } if waiting_for == &[0]),
                "{e}"
            );
        }
        assert!(work.is_completed());
        assert!(work.wait().is_err());
    }

    /// A call whose own run failed never asks its device work.
    #[test]
    fn a_failed_call_does_not_wait_for_device_work() {
        let device = Flag {
            done: Arc::new(AtomicBool::new(false)),
            deadline: Instant::now() + Duration::from_secs(60),
        };
        let failed = Error::Aborted {
            rank: 1,
            reason: "peer gone".into(),
        };
        let work: Work<()> = Work::ran(SITE, Err(failed), Some(Box::new(device)), Instant::now());
        assert!(work.is_completed());
        let e = work.wait().unwrap_err();
        assert!(matches!(e, Error::Aborted { rank: 1, .. }), "{e}");
    }
}
