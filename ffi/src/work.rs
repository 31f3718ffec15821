//! `tutti_work`: the handle of a non-blocking collective, and the `_async` form of every
//! collective (the blocking call's arguments, then `tutti_work **work`).

use std::ffi::c_void;
use std::time::Duration;

use tutti::{AbortHandle, Communicator, RawCall, Work};

use crate::buffers::AlignedCopy;
use crate::collectives as comm;
use crate::comm::tutti_comm;
use crate::error::{boundary, boundary_void, tutti_result, Failure, TuttiResult};
use crate::handle::{self, Handle, Kind, Live};
use crate::types::{tutti_dtype, tutti_op};

/// The handle of one non-blocking collective (opaque). Written by the `tutti_*_async`
/// functions; waited with `tutti_work_wait`, polled with `tutti_work_test`, released with
/// `tutti_work_destroy`.
pub struct tutti_work {
    work: Work,
    /// Aborts the communicator when a destroyed handle's call does not end in time.
    abort: AbortHandle,
    rank: usize,
    timeout: Duration,
    /// The calls inside this handle (waits, tests), which `tutti_work_destroy` waits for.
    live: Live,
}

impl Handle for tutti_work {
    const KIND: Kind = Kind::Work;
    fn live(&self) -> &Live {
        &self.live
    }
}

impl tutti_work {
    /// The handle of `work`, issued on `comm`.
    pub(crate) fn into_raw(comm: &Communicator, work: Work) -> *mut tutti_work {
        handle::into_raw(tutti_work {
            work,
            abort: comm.abort_handle(),
            rank: comm.rank(),
            timeout: comm.timeout(),
            live: Live::new(),
        })
    }
}

/// The input of an in-place reduce-scatter, or of a pre-multiplied sum: copied from `from` into
/// `copy` when the call starts, not when it is issued, so that an earlier call still writing it
/// is seen; then scaled, where `scale` gives the dtype and the factor.
pub(crate) struct InPlace {
    pub(crate) from: *const c_void,
    pub(crate) copy: AlignedCopy,
    pub(crate) scale: Option<(tutti::DType, f64)>,
}

impl InPlace {
    /// The step that takes the copy, and the storage the call reads (held until it completes).
    fn split(mut self) -> (Box<dyn FnOnce() + Send>, AlignedCopy) {
        let (from, to, len) = (
            self.from as usize,
            self.copy.as_mut_ptr() as usize,
            self.copy.len(),
        );
        let scale = self.scale;
        let before = Box::new(move || {
            if len > 0 {
                // SAFETY: `from` holds `len` readable bytes until the call completes (the
                // caller's promise), `to` is the copy's heap storage, which the call holds
                // and nothing else touches until the call reads it, after this step.
                let copy = unsafe {
                    std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, len);
                    std::slice::from_raw_parts_mut(to as *mut u8, len)
                };
                if let Some((dtype, factor)) = scale {
                    tutti::kernels::scale(dtype, copy, factor);
                }
            }
        });
        (before, self.copy)
    }
}

/// How a collective is made: waited for, or issued with its handle written to `*work`.
#[derive(Copy, Clone)]
pub(crate) enum Mode {
    Blocking,
    Async(*mut *mut tutti_work),
}

impl Mode {
    /// The handle's destination must exist before anything is issued.
    pub(crate) fn check(self) -> Result<(), String> {
        match self {
            Mode::Async(p) if p.is_null() => {
                Err("work is NULL; pass where to write the call's handle".into())
            }
            _ => Ok(()),
        }
    }

    /// Make the call: wait for it, or issue it and write its handle out; an in-place input
    /// is copied when the call starts.
    ///
    /// # Safety
    ///
    /// The memory `call` and `in_place` name is valid until the call completes.
    pub(crate) unsafe fn run(
        self,
        c: &tutti_comm,
        call: RawCall,
        in_place: Option<InPlace>,
    ) -> Result<(), Failure> {
        // The one place every collective (and barrier) of a `tutti_comm` passes, with its
        // arguments checked: a group records point-to-point calls only.
        crate::p2p::refuse_in_group(c.rank, "a collective")?;
        let comm = c.read();
        match self {
            Mode::Blocking => match in_place {
                // SAFETY: as the caller promises.
                None => Ok(unsafe { comm.run_raw(&call) }?),
                Some(p) => {
                    let (before, copy) = p.split();
                    // SAFETY: as the caller promises; `copy` outlives the call.
                    let r = unsafe { comm.run_raw_prepared(&call, before) };
                    drop(copy);
                    Ok(r?)
                }
            },
            Mode::Async(out) => {
                let work = match in_place {
                    // SAFETY: as the caller promises.
                    None => unsafe { comm.issue_raw(&call) },
                    Some(p) => {
                        let (before, copy) = p.split();
                        // SAFETY: as the caller promises; the call holds `copy` until it ends.
                        unsafe { comm.issue_raw_prepared(&call, before, Box::new(copy)) }
                    }
                };
                // SAFETY: checked non-NULL by `check`; the caller promises it is writable.
                unsafe { out.write(tutti_work::into_raw(&comm, work)) };
                Ok(())
            }
        }
    }
}

/// Wait for the call of `work` and return its result: `TUTTI_OK`, or the call's error
/// (`TUTTI_ERROR_MISMATCH`, `TUTTI_ERROR_PEER_REJECTED`, `TUTTI_ERROR_TIMEOUT` naming the ranks
/// awaited — the group is then aborted —, `TUTTI_ERROR_ABORTED`, ...). `timeout_ms` bounds
/// this wait: when the call is still running after it, `TUTTI_ERROR_WAIT_TIMEOUT` is returned,
/// nothing has failed, the handle stays valid and the call goes on (a trainer that polls with a
/// bound tells "not yet" from "the group is gone" by the code alone); 0 waits until the call
/// completes (every call is bounded by the communicator's timeout once it starts). Waiting
/// again after completion returns the same result.
///
/// Thread-safety: callable from any thread; several threads may wait on one handle.
///
/// # Safety
///
/// `work` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_work_wait(work: *mut tutti_work, timeout_ms: u64) -> tutti_result {
    boundary("tutti_work_wait", || {
        // SAFETY: as the caller promises.
        let w = unsafe { handle::enter(work) }?;
        let bound = match timeout_ms {
            0 => Duration::MAX,
            ms => Duration::from_millis(ms),
        };
        match w.work.wait_timeout(bound) {
            // The wait's own bound, not the call's: the call goes on.
            Err(tutti::Error::Timeout {
                waiting_for, phase, ..
            }) if waiting_for.is_empty() && phase == "complete" && !w.work.is_completed() => {
                Err(Failure {
                    code: TuttiResult::TUTTI_ERROR_WAIT_TIMEOUT,
                    message: format!(
                        "rank {}: {} had not completed within this wait's bound ({timeout_ms} \
                         ms); it goes on: wait for it again or test it later",
                        w.rank,
                        w.work.site()
                    ),
                })
            }
            r => Ok(r?),
        }
    })
}

/// Write whether the call of `work` has completed (successfully or not) to `*done`, without
/// blocking; `tutti_work_wait` then returns its result at once.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `work` is NULL or a live handle; `done` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_work_test(work: *const tutti_work, done: *mut bool) -> tutti_result {
    boundary("tutti_work_test", || {
        // SAFETY: as the caller promises.
        let w = unsafe { handle::enter(work) }?;
        if done.is_null() {
            return Err(Failure::invalid("done is NULL"));
        }
        let d = w.work.is_completed();
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { done.write(d) };
        Ok(())
    })
}

/// Release a work handle; NULL is accepted and ignored. A call still running is waited for
/// first, up to the communicator's timeout; if it has not completed by then, the communicator
/// is aborted (every rank's calls fail with `TUTTI_ERROR_ABORTED`) and the call ends at once,
/// so that the buffers are never touched after this returns. Waits and tests on other threads
/// that are inside the handle are waited for too (they return once the call has completed);
/// calls on it from then on fail with `TUTTI_ERROR_INVALID_ARGUMENT`. A second destroy of the
/// same handle does nothing but record, as the thread's last error, that it was not live.
///
/// Thread-safety: callable from any thread, while other threads wait on `work`; no call may use
/// `work` after this has returned: a call that races the end of the destroy fails with
/// `TUTTI_ERROR_INVALID_ARGUMENT` (the handle is looked up among the live ones, never read once
/// destroyed), but as with `free()`, the address may be reused by a new handle, which such a call
/// would then use.
///
/// # Safety
///
/// `work` is NULL or a handle from a `tutti_*_async` call (destroyed already or not).
#[no_mangle]
pub unsafe extern "C" fn tutti_work_destroy(work: *mut tutti_work) {
    boundary_void("tutti_work_destroy", || {
        if work.is_null() {
            return; // a no-op that leaves the last error alone
        }
        // The call itself first, as below; then the waiters, which leave once it completed.
        let finish = |w: &tutti_work| {
            // Calls queued before this one are each bounded; this one gets the timeout from
            // when it starts, and is ended by an abort past that, so its buffers are free on
            // return.
            while !w.work.is_completed() {
                if w.work.started().is_some_and(|t| t.elapsed() > w.timeout) {
                    w.abort.abort(&format!(
                        "tutti_work_destroy on rank {}: {} had not completed within the timeout \
                         ({:?})",
                        w.rank,
                        w.work.site(),
                        w.timeout
                    ));
                    let _ = w.work.wait_timeout(Duration::MAX);
                    break;
                }
                let _ = w.work.wait_timeout(Duration::from_millis(50));
            }
        };
        // SAFETY: as the caller promises; a handle not registered as live is not touched.
        let r = unsafe {
            handle::destroy(
                work,
                |w| {
                    // Waiters without a bound leave when the call completes: finish it first.
                    finish(w);
                    w.timeout
                },
                |w, n| {
                    w.abort.abort(&format!(
                        "tutti_work_destroy on rank {}: {n} wait(s) on other threads had not \
                         returned",
                        w.rank
                    ))
                },
                |_| {},
            )
        };
        handle::report("tutti_work_destroy", r);
    })
}

/// All-reduce without waiting: `tutti_all_reduce`'s arguments, then where to write the handle.
/// The buffers must stay valid and untouched until the call completes (`tutti_work_wait`
/// returned, or `tutti_work_test` said done). Calls complete in the order they were issued on
/// every rank; many may be in flight. Errors of the call come from `tutti_work_wait`; this
/// returns an error (and writes no handle) only for arguments this rank rejects, which abort
/// the group as in `tutti_all_reduce`.
///
/// # Safety
///
/// As `tutti_all_reduce`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_reduce_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_all_reduce_async";
    // SAFETY: as the caller promises.
    unsafe { comm::all_reduce(f, comm, count, dtype, op, input, output, Mode::Async(work)) }
}

/// Broadcast without waiting; see `tutti_broadcast` and `tutti_all_reduce_async`.
///
/// # Safety
///
/// As `tutti_broadcast`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_broadcast_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    buffer: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_broadcast_async";
    // SAFETY: as the caller promises.
    unsafe { comm::broadcast(f, comm, count, dtype, root, buffer, Mode::Async(work)) }
}

/// All-gather without waiting; see `tutti_all_gather` and `tutti_all_reduce_async`.
///
/// # Safety
///
/// As `tutti_all_gather`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_gather_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_all_gather_async";
    // SAFETY: as the caller promises.
    unsafe { comm::all_gather(f, comm, count, dtype, input, output, Mode::Async(work)) }
}

/// Reduce-scatter without waiting; see `tutti_reduce_scatter` and `tutti_all_reduce_async`.
///
/// # Safety
///
/// As `tutti_reduce_scatter`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_reduce_scatter_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_reduce_scatter_async";
    let mode = Mode::Async(work);
    // SAFETY: as the caller promises.
    unsafe { comm::reduce_scatter(f, comm, count, dtype, op, input, output, mode) }
}

/// Pre-multiplied sum without waiting; see `tutti_all_reduce_premul_sum` and
/// `tutti_all_reduce_async`. The input is read (and scaled into a copy the call holds) when the
/// call starts, after every call issued before it has completed.
///
/// # Safety
///
/// As `tutti_all_reduce_premul_sum`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_reduce_premul_sum_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    factor: f64,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_all_reduce_premul_sum_async";
    let call = (
        tutti::Collective::AllReduce,
        count,
        dtype,
        factor,
        input,
        output,
    );
    // SAFETY: as the caller promises.
    unsafe { comm::premul_sum(f, comm, call, Mode::Async(work)) }
}

/// Pre-multiplied reduce-scatter without waiting; see `tutti_reduce_scatter_premul_sum` and
/// `tutti_all_reduce_premul_sum_async`.
///
/// # Safety
///
/// As `tutti_reduce_scatter_premul_sum`, for as long as the call runs; `work` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_reduce_scatter_premul_sum_async(
    comm: *mut tutti_comm,
    recv_count: usize,
    dtype: tutti_dtype,
    factor: f64,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_reduce_scatter_premul_sum_async";
    let call = (
        tutti::Collective::ReduceScatter,
        recv_count,
        dtype,
        factor,
        input,
        output,
    );
    // SAFETY: as the caller promises.
    unsafe { comm::premul_sum(f, comm, call, Mode::Async(work)) }
}

/// Reduce without waiting; see `tutti_reduce` and `tutti_all_reduce_async`.
///
/// # Safety
///
/// As `tutti_reduce`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tutti_reduce_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    root: usize,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_reduce_async";
    let mode = Mode::Async(work);
    // SAFETY: as the caller promises.
    unsafe { comm::reduce(f, comm, count, dtype, op, root, input, output, mode) }
}

/// All-to-all without waiting; see `tutti_all_to_all` and `tutti_all_reduce_async`.
///
/// # Safety
///
/// As `tutti_all_to_all`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_to_all_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_all_to_all_async";
    // SAFETY: as the caller promises.
    unsafe { comm::all_to_all(f, comm, count, dtype, input, output, Mode::Async(work)) }
}

/// All-to-all with a count per block without waiting; see `tutti_all_to_all_v` and
/// `tutti_all_reduce_async`. The counts are read before this returns; the buffers must stay
/// valid until the call completes.
///
/// # Safety
///
/// As `tutti_all_to_all_v`, for as long as the call runs (the counts only during this call);
/// `work` is NULL or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tutti_all_to_all_v_async(
    comm: *mut tutti_comm,
    send_counts: *const usize,
    recv_counts: *const usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_all_to_all_v_async";
    let mode = Mode::Async(work);
    // SAFETY: as the caller promises.
    unsafe {
        comm::all_to_all_v(
            f,
            comm,
            send_counts,
            recv_counts,
            dtype,
            input,
            output,
            mode,
        )
    }
}

/// Gather without waiting; see `tutti_gather` and `tutti_all_reduce_async`.
///
/// # Safety
///
/// As `tutti_gather`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tutti_gather_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_gather_async";
    let mode = Mode::Async(work);
    // SAFETY: as the caller promises.
    unsafe { comm::gather(f, comm, count, dtype, root, input, output, mode) }
}

/// Scatter without waiting; see `tutti_scatter` and `tutti_all_reduce_async`.
///
/// # Safety
///
/// As `tutti_scatter`, for as long as the call runs; `work` is NULL or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tutti_scatter_async(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_scatter_async";
    let mode = Mode::Async(work);
    // SAFETY: as the caller promises.
    unsafe { comm::scatter(f, comm, count, dtype, root, input, output, mode) }
}

/// All-gather with a count per rank without waiting; see `tutti_all_gather_v` and
/// `tutti_all_reduce_async`. The counts are read before this returns.
///
/// # Safety
///
/// As `tutti_all_gather_v`, for as long as the call runs (the counts only during this call);
/// `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_gather_v_async(
    comm: *mut tutti_comm,
    counts: *const usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_all_gather_v_async";
    // SAFETY: as the caller promises.
    unsafe { comm::all_gather_v(f, comm, counts, dtype, input, output, Mode::Async(work)) }
}

/// Reduce-scatter with a count per rank without waiting; see `tutti_reduce_scatter_v` and
/// `tutti_all_reduce_async`. The counts are read before this returns.
///
/// # Safety
///
/// As `tutti_reduce_scatter_v`, for as long as the call runs (the counts only during this
/// call); `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_reduce_scatter_v_async(
    comm: *mut tutti_comm,
    counts: *const usize,
    dtype: tutti_dtype,
    op: tutti_op,
    input: *const c_void,
    output: *mut c_void,
    work: *mut *mut tutti_work,
) -> tutti_result {
    let f = "tutti_reduce_scatter_v_async";
    let mode = Mode::Async(work);
    // SAFETY: as the caller promises.
    unsafe { comm::reduce_scatter_v(f, comm, counts, dtype, op, input, output, mode) }
}

/// Barrier without waiting: the handle completes once every rank has called it.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `work` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_barrier_async(
    comm: *mut tutti_comm,
    work: *mut *mut tutti_work,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe { comm::barrier("tutti_barrier_async", comm, Mode::Async(work)) }
}
