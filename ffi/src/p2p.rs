//! Point-to-point from C: `tutti_send`, `tutti_recv`, their `_async` forms, and groups of them
//! between `tutti_group_start` and `tutti_group_end`, as NCCL's `ncclGroupStart`/`ncclGroupEnd`.
//!
//! A group belongs to the calling thread: between the outermost start and its end, every
//! `tutti_send` and `tutti_recv` of the thread, on any communicator, is recorded (checked, not
//! run); the outermost end then issues each communicator's recorded operations as one
//! `send_recv` group (every communicator first, so that one thread may drive several ranks),
//! and waits for them all, or (`tutti_group_end_async`, one communicator's) returns a handle.
//! Communicators are recorded by address and serial number and looked up among the live handles
//! again at the end, so that one destroyed in between is an error naming it, never a use after
//! free.

use std::cell::RefCell;
use std::ffi::c_void;

use tutti::{PeerOp, RawPeerOp};

use crate::buffers::{byte_len, check, slice, slice_mut};
use crate::comm::{comm_ref, tutti_comm};
use crate::error::{boundary, tutti_result, Failure};
use crate::types::{self, tutti_dtype};
use crate::work::{tutti_work, Mode};

/// The operations one communicator recorded in the open group.
struct Recorded {
    /// The handle's address and serial number (an address reused by a new handle is told
    /// apart from the recorded one by the serial).
    comm: usize,
    serial: u64,
    rank: usize,
    world: usize,
    ops: Vec<RawPeerOp>,
}

/// The calling thread's group: how deep in `tutti_group_start` calls, and what was recorded.
struct Group {
    depth: usize,
    comms: Vec<Recorded>,
}

thread_local! {
    static GROUP: RefCell<Group> = const {
        RefCell::new(Group {
            depth: 0,
            comms: Vec::new(),
        })
    };
}

/// How many `tutti_group_start` calls of this thread are open (0 on a thread that is exiting).
fn depth() -> usize {
    GROUP
        .try_with(|g| g.try_borrow().map_or(0, |g| g.depth))
        .unwrap_or(0)
}

/// Refuse `what` (a collective, an `_async` point-to-point call) on `rank` while this thread
/// has a group open: a group records `tutti_send` and `tutti_recv` only.
pub(crate) fn refuse_in_group(rank: usize, what: &str) -> Result<(), Failure> {
    if depth() == 0 {
        return Ok(());
    }
    Err(Failure::invalid(format!(
        "rank {rank}: {what} was called between tutti_group_start and tutti_group_end; only \
         tutti_send and tutti_recv are grouped: make this call after tutti_group_end"
    )))
}

/// `op` of `comm`, appended to the open group.
fn record(comm: &tutti_comm, addr: usize, op: RawPeerOp) -> Result<(), Failure> {
    GROUP
        .try_with(|g| {
            let mut g = g.borrow_mut();
            let found = g
                .comms
                .iter_mut()
                .position(|r| r.comm == addr && r.serial == comm.serial);
            match found {
                Some(i) => g.comms[i].ops.push(op),
                None => g.comms.push(Recorded {
                    comm: addr,
                    serial: comm.serial,
                    rank: comm.rank,
                    world: comm.world,
                    ops: vec![op],
                }),
            }
        })
        .map_err(|_| Failure::invalid("the calling thread is exiting; its group is gone"))
}

/// The operations of a group in words, the first few of them: "send 4 f32 to rank 1, ...".
fn describe(ops: &[RawPeerOp]) -> String {
    const SHOWN: usize = 8;
    let mut words: Vec<String> = ops
        .iter()
        .take(SHOWN)
        .enumerate()
        .map(|(i, o)| {
            let n = o.len / o.dtype.size();
            if o.send {
                format!("{i}: send {n} {} to rank {}", o.dtype, o.peer)
            } else {
                format!("{i}: recv {n} {} from rank {}", o.dtype, o.peer)
            }
        })
        .collect();
    if ops.len() > SHOWN {
        words.push(format!("and {} more", ops.len() - SHOWN));
    }
    words.join(", ")
}

/// The body of `tutti_send`, `tutti_recv` and their `_async` forms.
///
/// # Safety
///
/// As `tutti_send` (`send`) or `tutti_recv`; with `Mode::Async` or inside a group, the buffer
/// stays valid until the call completes.
#[allow(clippy::too_many_arguments)] // the C signature, plus the name, direction and mode
unsafe fn peer_call(
    f: &'static str,
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    buf: *mut c_void,
    peer: usize,
    send: bool,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        if let Mode::Async(_) = mode {
            refuse_in_group(c.rank, f)?;
        }
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            let n = byte_len(count, 1, dtype)?;
            check(buf, n, dtype, "buf")?;
            if peer >= c.world {
                return Err(format!(
                    "peer {peer} is out of range (world size {})",
                    c.world
                ));
            }
            Ok((dtype, n))
        })();
        // This rank's own mistake, found before anything was issued: the communicator stays
        // usable (no other rank is waiting for a call that was never made).
        let (dtype, n) = checked.map_err(|m| Failure::invalid(format!("rank {}: {m}", c.rank)))?;
        let op = RawPeerOp {
            send,
            peer,
            dtype,
            ptr: buf.cast(),
            len: n,
        };
        if depth() > 0 {
            return record(&c, comm as usize, op);
        }
        let core = c.read();
        match mode {
            Mode::Blocking => {
                // SAFETY: checked above; the caller promises `n` bytes (writable for a
                // receive) that nothing else touches during the call.
                let op = unsafe {
                    if send {
                        PeerOp::send_raw(dtype, slice(buf, n), peer)
                    } else {
                        PeerOp::recv_raw(dtype, slice_mut(buf, n), peer)
                    }
                };
                Ok(core.send_recv(&mut [op])?)
            }
            Mode::Async(out) => {
                // SAFETY: checked above; the caller promises the buffer until the call
                // completes.
                let work = unsafe { core.send_recv_raw_async(&[op]) };
                // SAFETY: checked non-NULL by `mode.check`; the caller promises it is writable.
                unsafe { out.write(tutti_work::into_raw(&core, work)) };
                Ok(())
            }
        }
    })
}

/// Send `count` elements of `dtype` at `buf` to rank `peer` of the communicator, which receives
/// them with `tutti_recv` (or `tutti_recv_async`, or in a group). Only the two ranks take part.
/// A rank's sends to a peer match that peer's receives from it in issue order; both state the
/// same count and dtype, or the receive fails with `TUTTI_ERROR_INVALID_ARGUMENT` naming both
/// ranks ("rank 0 sent 5 f32 where rank 1 receives 4 f32") and the communicator is aborted (the
/// sender's next call fails with `TUTTI_ERROR_ABORTED`). Returns once the bytes are handed over
/// (between threads: copied; between processes: written to the connection, which may wait for
/// the receiver), bounded by the communicator's timeout. Point-to-point calls keep their order
/// with the collectives of the communicator. A send to this rank itself needs its receive in
/// the same group.
///
/// Between `tutti_group_start` and `tutti_group_end` the send is recorded, not run: this
/// returns `TUTTI_SUCCESS` at once and `buf` must stay valid and unchanged until
/// `tutti_group_end` returns (after `tutti_group_end_async`, until its handle completes).
///
/// Errors of this rank's arguments (NULL `buf` with `count` > 0, a misaligned `buf`, an unknown
/// dtype, a byte size that overflows, `peer` out of range) are `TUTTI_ERROR_INVALID_ARGUMENT`
/// and leave the communicator usable. On a communicator of an in-process group of GPUs `buf` is
/// a `CUdeviceptr` of the rank's GPU, moved GPU to GPU; on XLA devices it is host memory, as
/// in their collectives; a GPU rank of a job of one GPU per process refuses point-to-point
/// calls (`TUTTI_ERROR_INVALID_ARGUMENT`).
///
/// Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `buf` is NULL or points to `count` elements, aligned to the
/// element size, that nothing writes during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_send(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    buf: *const c_void,
    peer: usize,
) -> tutti_result {
    let (f, b) = ("tutti_send", buf.cast_mut());
    // SAFETY: as the caller promises; a send only reads `buf`.
    unsafe { peer_call(f, comm, count, dtype, b, peer, true, Mode::Blocking) }
}

/// Receive rank `peer`'s next send to this rank (`count` elements of `dtype`) into `buf`; see
/// `tutti_send` for the matching, the errors and the groups (inside one, `buf` must stay valid
/// and untouched until `tutti_group_end` returns, or the handle of `tutti_group_end_async`
/// completes, which is when it holds the data).
///
/// Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `buf` is NULL or points to `count` writable elements,
/// aligned to the element size, that nothing else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_recv(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    buf: *mut c_void,
    peer: usize,
) -> tutti_result {
    let f = "tutti_recv";
    // SAFETY: as the caller promises.
    unsafe { peer_call(f, comm, count, dtype, buf, peer, false, Mode::Blocking) }
}

/// Send without waiting: `tutti_send`'s arguments, then where to write the handle, which
/// completes once the bytes are handed over (`tutti_work_wait` returns the send's error, if
/// any). `buf` must stay valid and unchanged until then. Refused inside a group
/// (`TUTTI_ERROR_INVALID_ARGUMENT`): there, `tutti_send` itself is deferred.
///
/// # Safety
///
/// As `tutti_send`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_send_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    buf: *const c_void,
    peer: usize,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let (f, b, mode) = ("tutti_send_async", buf.cast_mut(), Mode::Async(work));
    // SAFETY: as the caller promises; a send only reads `buf`.
    unsafe { peer_call(f, comm, count, dtype, b, peer, true, mode) }
}

/// Receive without waiting: `tutti_recv`'s arguments, then where to write the handle, which
/// completes once `buf` holds the data. `buf` must stay valid and untouched until then.
/// Refused inside a group (`TUTTI_ERROR_INVALID_ARGUMENT`).
///
/// # Safety
///
/// As `tutti_recv`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_recv_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    buf: *mut c_void,
    peer: usize,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let (f, mode) = ("tutti_recv_async", Mode::Async(work));
    // SAFETY: as the caller promises.
    unsafe { peer_call(f, comm, count, dtype, buf, peer, false, mode) }
}

/// Open a group on the calling thread, as NCCL's `ncclGroupStart`: until the matching
/// `tutti_group_end`, `tutti_send` and `tutti_recv` on any communicator are recorded, not run
/// (they return at once; their buffers must stay valid until `tutti_group_end` returns, or
/// until the handle of `tutti_group_end_async` completes).
/// Groups nest: only the outermost `tutti_group_end` runs what was recorded. Inside a group,
/// collectives, `tutti_barrier` and the `_async` point-to-point calls are refused with
/// `TUTTI_ERROR_INVALID_ARGUMENT`.
///
/// Thread-safety: the group is the calling thread's; other threads are not affected.
#[no_mangle]
pub extern "C" fn tutti_group_start() -> tutti_result {
    boundary("tutti_group_start", || {
        GROUP
            .try_with(|g| g.borrow_mut().depth += 1)
            .map_err(|_| Failure::invalid("the calling thread is exiting"))
    })
}

/// Close the calling thread's innermost group (see `tutti_group_start`). The outermost end runs
/// each communicator's recorded sends and receives as one group: every operation under way at
/// once, so a ring (each rank sends to the next and receives from the previous) or two ranks
/// that both send first cannot deadlock; each peer's operations in one direction keep their
/// order. Every communicator's group is issued before any is waited for, so one thread may
/// drive several ranks of an in-process group. Returns once all have completed: the first error
/// (`tutti_last_error` names the communicator, its rank and its recorded operations, then the
/// error), after every group has ended. A communicator destroyed after its operations were
/// recorded is `TUTTI_ERROR_INVALID_ARGUMENT` naming it (the others still run). Without an open
/// group: `TUTTI_ERROR_INVALID_ARGUMENT`.
///
/// Thread-safety: closes the calling thread's group only.
#[no_mangle]
pub extern "C" fn tutti_group_end() -> tutti_result {
    boundary("tutti_group_end", || {
        let recorded = with_open_group(|g| {
            g.depth -= 1;
            Ok(if g.depth == 0 {
                std::mem::take(&mut g.comms)
            } else {
                Vec::new()
            })
        })?;
        run_group(&recorded)
    })
}

/// `f` over this thread's open group; without one (or on a thread that is exiting), an error
/// saying so, and `f` is not called.
fn with_open_group<T>(f: impl FnOnce(&mut Group) -> Result<T, Failure>) -> Result<T, Failure> {
    GROUP
        .try_with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return Err(Failure::invalid(
                    "no group is open on this thread: call tutti_group_start first",
                ));
            }
            f(&mut g)
        })
        .map_err(|_| Failure::invalid("the calling thread is exiting"))?
}

/// Issue every communicator's recorded operations, then wait for them all; the first error.
fn run_group(recorded: &[Recorded]) -> Result<(), Failure> {
    let mut first: Option<Failure> = None;
    let mut note = |f: Failure| {
        first.get_or_insert(f);
    };
    let mut issued = Vec::with_capacity(recorded.len());
    for r in recorded {
        match live(r, "tutti_group_end") {
            Err(e) => note(e),
            Ok(c) => {
                // SAFETY: checked when recorded; the caller keeps the buffers valid until
                // tutti_group_end returns, and this waits for the call before returning.
                let work = unsafe { c.read().send_recv_raw_async(&r.ops) };
                issued.push((c, r, work));
            }
        }
    }
    for (c, r, work) in issued {
        if let Err(e) = work.wait() {
            let f = Failure::from(e);
            note(Failure {
                code: f.code,
                message: format!("{}: {}", name(r), f.message),
            });
        }
        drop(c);
    }
    first.map_or(Ok(()), Err)
}

/// A recorded communicator in words, with its operations.
fn name(r: &Recorded) -> String {
    format!(
        "communicator {:#x} (rank {} of {}), recorded {}",
        r.comm,
        r.rank,
        r.world,
        describe(&r.ops)
    )
}

/// The live handle `r` was recorded on, or an error naming it (destroyed before `end`, the
/// function ending the group, so that nothing of it ran).
fn live<'a>(r: &Recorded, end: &str) -> Result<crate::handle::Entered<'a, tutti_comm>, Failure> {
    // SAFETY: an address that is not a live handle is refused without being read.
    let entered = unsafe { comm_ref(r.comm as *const tutti_comm) }.and_then(|c| {
        if c.serial == r.serial {
            Ok(c)
        } else {
            Err(Failure::invalid(format!(
                "{:#x} is not a live tutti_comm handle (destroyed already?)",
                r.comm
            )))
        }
    });
    entered.map_err(|e| {
        Failure::invalid(format!(
            "{}: destroyed before {end}, nothing of it ran: {}",
            name(r),
            e.message
        ))
    })
}

/// Close the calling thread's innermost group without waiting, and write a handle to `*work`
/// that completes when every recorded operation has (`tutti_work_wait`, `tutti_work_test`,
/// `tutti_work_destroy`, as for the `_async` calls): the outermost end issues the recorded
/// sends and receives as one group, as `tutti_group_end` does, and returns at once. Their
/// buffers must stay valid and untouched until the handle completes. `*work` is NULL when
/// nothing was issued: an inner group (the outermost end runs what it recorded), or a group
/// that recorded nothing.
///
/// An asynchronous end issues one communicator's operations. A group that recorded operations
/// on several, or on a communicator destroyed since, is refused (`TUTTI_ERROR_INVALID_ARGUMENT`
/// naming them, `*work` NULL) and stays open, its operations recorded: `tutti_group_end` then
/// runs them (or names the destroyed communicator). Without an open group, or with `work`
/// NULL: `TUTTI_ERROR_INVALID_ARGUMENT`.
///
/// Thread-safety: closes the calling thread's group only; the handle may be waited for from
/// any thread.
///
/// # Safety
///
/// `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_group_end_async(work: *mut *mut tutti_work) -> tutti_result {
    boundary("tutti_group_end_async", || {
        if work.is_null() {
            return Err(Failure::invalid(
                "work is NULL; pass where to write the group's handle",
            ));
        }
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { work.write(std::ptr::null_mut()) };
        // Every error leaves the group open: its operations stay recorded, and
        // tutti_group_end runs them (or names what stops them).
        let issuing = with_open_group(|g| {
            if g.depth == 1 && g.comms.len() > 1 {
                let names: Vec<String> = g.comms.iter().map(name).collect();
                return Err(Failure::invalid(format!(
                    "the group recorded operations on {} communicators ({}); an \
                         asynchronous end issues one communicator's: call tutti_group_end, \
                         which runs them all (the group is still open)",
                    g.comms.len(),
                    names.join("; ")
                )));
            }
            let c = match g.comms.first() {
                Some(r) if g.depth == 1 => Some(live(r, "tutti_group_end_async").map_err(|e| {
                    Failure::invalid(format!("{} (the group is still open)", e.message))
                })?),
                _ => None,
            };
            g.depth -= 1;
            Ok(c.zip(if g.depth == 0 { g.comms.pop() } else { None }))
        })?;
        let Some((c, r)) = issuing else {
            return Ok(());
        };
        let comm = c.read();
        // SAFETY: checked when recorded; the caller keeps the buffers valid and untouched
        // until the handle completes.
        let issued = unsafe { comm.send_recv_raw_async(&r.ops) };
        // SAFETY: as above.
        unsafe { work.write(tutti_work::into_raw(&comm, issued)) };
        Ok(())
    })
}
