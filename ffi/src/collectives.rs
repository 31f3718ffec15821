//! The collectives of `tutti_comm`, blocking and (through `crate::work`) non-blocking: each
//! checks this rank's arguments in C terms, then hands the call by address to the
//! communicator, whatever the device its memory is on.

use std::ffi::c_void;

use tutti::{Collective, DType, DeviceKind, RawCall, ReduceOp};

use crate::buffers::{byte_len, check, counts_len, overlap, read_counts, slice_mut, AlignedCopy};
use crate::comm::{comm_ref, tutti_comm};
use crate::error::{boundary, tutti_result};
use crate::types::{self, tutti_dtype, tutti_op};
use crate::work::{InPlace, Mode};

/// All-reduce: every rank's `output` (`count` elements) becomes the element-wise `op` of every
/// rank's `input`. In place: pass the same pointer as `input` and `output`.
///
/// Every rank of the group must make the same call (same count, dtype, op) in the same order.
/// Errors: `TUTTI_ERROR_MISMATCH` when ranks disagree, `TUTTI_ERROR_PEER_REJECTED` when another
/// rank's arguments were wrong, `TUTTI_ERROR_TIMEOUT`, `TUTTI_ERROR_ABORTED`. Arguments this
/// rank rejects before taking part (NULL or misaligned buffers, unknown dtype or op, buffers
/// that overlap without being the same) fail with `TUTTI_ERROR_INVALID_ARGUMENT` and abort the
/// group so that its other ranks fail at once instead of waiting.
///
/// Thread-safety: calls on one communicator from several threads run one at a time in the
/// order they were issued (every rank must issue the same calls in the same order); the
/// communicators of a group are meant to be used from different threads at once. The
/// non-blocking form is `tutti_all_reduce_async`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `input` and `output` are NULL or point to `count` elements,
/// aligned to the element size, that nothing else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_reduce(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe {
        all_reduce(
            "tutti_all_reduce",
            comm,
            count,
            dtype,
            op,
            input,
            output,
            Mode::Blocking,
        )
    }
}

/// The body of `tutti_all_reduce` and `tutti_all_reduce_async`.
///
/// # Safety
///
/// As `tutti_all_reduce`; with `Mode::Async`, the buffers stay valid until the work completes.
#[allow(clippy::too_many_arguments)] // the C signature, plus the name and the mode
pub(crate) unsafe fn all_reduce(
    f: &'static str,
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    input: *const c_void,
    output: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            let op = types::op(op)?;
            let n = byte_len(count, 1, dtype)?;
            check(input, n, dtype, "input")?;
            check(output, n, dtype, "output")?;
            let in_place = std::ptr::eq(input, output);
            if !in_place && overlap(input, n, output, n) {
                return Err(
                    "input and output overlap without being the same buffer; pass the same \
                     pointer as both for an in-place all-reduce"
                        .to_string(),
                );
            }
            Ok((dtype, op, n, in_place))
        })();
        let (dtype, op, _, _) = checked.map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::AllReduce,
            dtype,
            count,
            op,
            root: 0,
            input: input.cast(),
            output: output.cast(),
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs.
        unsafe { mode.run(&c, call, None) }
    })
}

/// Broadcast: every rank's `buffer` (`count` elements) becomes the `root` rank's.
///
/// Every rank must make the same call; see `tutti_all_reduce` for the errors.
///
/// Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `buffer` is NULL or points to `count` elements, aligned to
/// the element size, that nothing else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_broadcast(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    buffer: *mut c_void,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe {
        broadcast(
            "tutti_broadcast",
            comm,
            count,
            dtype,
            root,
            buffer,
            Mode::Blocking,
        )
    }
}

/// The body of `tutti_broadcast` and `tutti_broadcast_async`.
///
/// # Safety
///
/// As `tutti_broadcast`; with `Mode::Async`, the buffers stay valid until the work completes.
pub(crate) unsafe fn broadcast(
    f: &'static str,
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    buffer: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            let n = byte_len(count, 1, dtype)?;
            check(buffer, n, dtype, "buffer")?;
            Ok((dtype, n))
        })();
        let (dtype, _) = checked.map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::Broadcast,
            dtype,
            count,
            op: ReduceOp::Sum,
            root,
            input: buffer.cast_const().cast(),
            output: buffer.cast(),
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs.
        unsafe { mode.run(&c, call, None) }
    })
}

/// All-gather: rank r's `input` (`count` elements) lands at element `r × count` of every rank's
/// `output` (`world_size × count` elements). In place: pass `output + rank × count` (in
/// elements) as `input`.
///
/// Every rank must make the same call; see `tutti_all_reduce` for the errors.
///
/// Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `input` is NULL or points to `count` elements and `output`
/// is NULL or points to `world_size × count` elements, aligned to the element size, that nothing
/// else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_gather(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe {
        all_gather(
            "tutti_all_gather",
            comm,
            count,
            dtype,
            input,
            output,
            Mode::Blocking,
        )
    }
}

/// The body of `tutti_all_gather` and `tutti_all_gather_async`.
///
/// # Safety
///
/// As `tutti_all_gather`; with `Mode::Async`, the buffers stay valid until the work completes.
pub(crate) unsafe fn all_gather(
    f: &'static str,
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let world = c.world;
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            let n = byte_len(count, 1, dtype)?;
            let total = byte_len(count, world, dtype)?;
            check(input, n, dtype, "input")?;
            check(output, total, dtype, "output")?;
            let own = (output as usize).wrapping_add(c.rank * n);
            let in_place = n == 0 || input as usize == own;
            if !in_place && overlap(input, n, output, total) {
                return Err(format!(
                    "input overlaps output without being this rank's slice of it; for an \
                     in-place all-gather pass output + rank × count (rank {}) as input",
                    c.rank
                ));
            }
            Ok((dtype, n, total, in_place))
        })();
        let (dtype, _, _, _) = checked.map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::AllGather,
            dtype,
            count,
            op: ReduceOp::Sum,
            root: 0,
            input: input.cast(),
            output: output.cast(),
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs.
        unsafe { mode.run(&c, call, None) }
    })
}

/// Reduce-scatter: rank r's `output` (`count` elements) becomes elements `r × count ..` of the
/// element-wise `op` of every rank's `input` (`world_size × count` elements). In place (output
/// inside input, e.g. `input + rank × count`) is allowed and costs one copy of the input.
///
/// Every rank must make the same call; see `tutti_all_reduce` for the errors.
///
/// Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `input` is NULL or points to `world_size × count` elements
/// and `output` is NULL or points to `count` elements, aligned to the element size, that nothing
/// else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_reduce_scatter(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe {
        reduce_scatter(
            "tutti_reduce_scatter",
            comm,
            count,
            dtype,
            op,
            input,
            output,
            Mode::Blocking,
        )
    }
}

/// The body of `tutti_reduce_scatter` and `tutti_reduce_scatter_async`.
///
/// # Safety
///
/// As `tutti_reduce_scatter`; with `Mode::Async`, the buffers stay valid until the work completes.
#[allow(clippy::too_many_arguments)] // the C signature, plus the name and the mode
pub(crate) unsafe fn reduce_scatter(
    f: &'static str,
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    input: *const c_void,
    output: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let world = c.world;
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            let op = types::op(op)?;
            let n = byte_len(count, 1, dtype)?;
            let total = byte_len(count, world, dtype)?;
            check(input, total, dtype, "input")?;
            check(output, n, dtype, "output")?;
            Ok((dtype, op, n, total))
        })();
        let (dtype, op, n, total) = checked.map_err(|m| c.reject(f, m))?;
        // Output inside the input: the call reads a copy of the input, taken when the call
        // starts (after every earlier call, which may still write the input, has completed)
        // and kept as long as the call runs. Host memory only.
        let copy = if overlap(input, total, output, n) {
            if c.device != DeviceKind::Cpu && c.device != DeviceKind::Xla {
                return Err(c.reject(
                    f,
                    "the output overlaps the input; on device memory pass separate buffers"
                        .to_string(),
                ));
            }
            Some(InPlace {
                from: input,
                copy: AlignedCopy::zeroed(total),
                scale: None,
            })
        } else {
            None
        };
        let call = RawCall {
            collective: Collective::ReduceScatter,
            dtype,
            count,
            op,
            root: 0,
            input: copy
                .as_ref()
                .map_or(input.cast(), |c| c.copy.bytes().as_ptr()),
            output: output.cast(),
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call
        // runs; the copy's heap bytes do not move when it moves into the call.
        unsafe { mode.run(&c, call, copy) }
    })
}

/// Reduce onto `root`: the root's `output` (`count` elements) becomes the element-wise `op` of
/// every rank's `input`. Off the root `output` is not used and may be NULL. In place at the
/// root: pass the same pointer as `input` and `output`.
///
/// Every rank must make the same call; see `tutti_all_reduce` for the errors.
///
/// Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `input` and (at the root) `output` are NULL or point to
/// `count` elements, aligned to the element size, that nothing else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_reduce(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    root: usize,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe {
        reduce(
            "tutti_reduce",
            comm,
            count,
            dtype,
            op,
            root,
            input,
            output,
            Mode::Blocking,
        )
    }
}

/// The body of `tutti_reduce` and `tutti_reduce_async`.
///
/// # Safety
///
/// As `tutti_reduce`; with `Mode::Async`, the buffers stay valid until the work completes.
#[allow(clippy::too_many_arguments)] // the C signature, plus the name and the mode
pub(crate) unsafe fn reduce(
    f: &'static str,
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    root: usize,
    input: *const c_void,
    output: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let is_root = c.rank == root;
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            let op = types::op(op)?;
            let n = byte_len(count, 1, dtype)?;
            check(input, n, dtype, "input")?;
            let in_place = is_root && std::ptr::eq(input, output);
            if is_root {
                check(output, n, dtype, "output (at the root)")?;
                if !in_place && overlap(input, n, output, n) {
                    return Err(
                        "input and output overlap without being the same buffer; pass the \
                         same pointer as both for an in-place reduce"
                            .to_string(),
                    );
                }
            }
            Ok((dtype, op, n, in_place))
        })();
        let (dtype, op, _, _) = checked.map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::Reduce,
            dtype,
            count,
            op,
            root,
            input: input.cast(),
            output: output.cast(),
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs.
        unsafe { mode.run(&c, call, None) }
    })
}

/// All-to-all: block j of this rank's `input` goes to rank j, and block k of its `output`
/// comes from rank k. Both buffers hold `world_size × count` elements (`count` per block) and
/// must not overlap: the call cannot run in place.
///
/// Every rank must make the same call (same count, dtype); see `tutti_all_reduce` for the
/// errors.
///
/// Thread-safety: as `tutti_all_reduce`. The non-blocking form is `tutti_all_to_all_async`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `input` and `output` are NULL or point to
/// `world_size × count` elements, aligned to the element size, that nothing else touches
/// during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_to_all(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe {
        all_to_all(
            "tutti_all_to_all",
            comm,
            count,
            dtype,
            input,
            output,
            Mode::Blocking,
        )
    }
}

/// The body of `tutti_all_to_all` and `tutti_all_to_all_async`.
///
/// # Safety
///
/// As `tutti_all_to_all`; with `Mode::Async`, the buffers stay valid until the work completes.
pub(crate) unsafe fn all_to_all(
    f: &'static str,
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let world = c.world;
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            let total = byte_len(count, world, dtype)?;
            check(input, total, dtype, "input")?;
            check(output, total, dtype, "output")?;
            disjoint(input, total, output, total, "all-to-all")?;
            Ok(dtype)
        })();
        let dtype = checked.map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::AllToAll,
            dtype,
            count,
            op: ReduceOp::Sum,
            root: 0,
            input: input.cast(),
            output: output.cast(),
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs.
        unsafe { mode.run(&c, call, None) }
    })
}

/// All-to-all with a count per block: the first `send_counts[0]` elements of `input` go to
/// rank 0, the next `send_counts[1]` to rank 1, and so on; `output` receives
/// `recv_counts[k]` elements from each rank k, in rank order. `send_counts` and `recv_counts`
/// hold `world_size` entries each (read when the call is issued); `input` holds the sum of
/// `send_counts`, `output` the sum of `recv_counts`, and they must not overlap. Rank i's
/// `send_counts[j]` must equal rank j's `recv_counts[i]`: where they differ, the receiving
/// rank's call fails naming the sender and both byte counts, and the communicator is aborted
/// (the sender's call fails too between threads; between processes its next call does).
///
/// See `tutti_all_reduce` for the errors. Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `send_counts` and `recv_counts` are NULL or point to
/// `world_size` values; `input` and `output` are NULL or point to as many elements as their
/// counts sum to, aligned to the element size, that nothing else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_to_all_v(
    comm: *mut tutti_comm,
    send_counts: *const usize,
    recv_counts: *const usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    let f = "tutti_all_to_all_v";
    let mode = Mode::Blocking;
    // SAFETY: as the caller promises.
    unsafe {
        all_to_all_v(
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

/// The body of `tutti_all_to_all_v` and `tutti_all_to_all_v_async`.
///
/// # Safety
///
/// As `tutti_all_to_all_v`; with `Mode::Async`, the buffers stay valid until the work
/// completes (the counts are copied when the call is issued).
#[allow(clippy::too_many_arguments)] // the C signature, plus the name and the mode
pub(crate) unsafe fn all_to_all_v(
    f: &'static str,
    comm: *mut tutti_comm,
    send_counts: *const usize,
    recv_counts: *const usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let world = c.world;
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            // SAFETY: the caller promises `world_size` values behind each.
            let send = unsafe { read_counts(send_counts, world, "send_counts") }?;
            // SAFETY: as above.
            let recv = unsafe { read_counts(recv_counts, world, "recv_counts") }?;
            let n_in = counts_len(&send, dtype, "send_counts")?;
            let n_out = counts_len(&recv, dtype, "recv_counts")?;
            check(input, n_in, dtype, "input")?;
            check(output, n_out, dtype, "output")?;
            disjoint(input, n_in, output, n_out, "all-to-all-v")?;
            Ok((dtype, send, recv))
        })();
        let (dtype, send, recv) = checked.map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::AllToAllV,
            dtype,
            count: 0,
            op: ReduceOp::Sum,
            root: 0,
            input: input.cast(),
            output: output.cast(),
            counts: &send,
            recv_counts: &recv,
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs.
        unsafe { mode.run(&c, call, None) }
    })
}

/// Gather onto `root`: the root's `output` (`world_size × count` elements) becomes every
/// rank's `input` (`count` elements) in rank order. Off the root `output` is not used and may
/// be NULL. At the root `input` and `output` must not overlap: the call cannot run in place.
///
/// Every rank must make the same call (same count, dtype, root); see `tutti_all_reduce` for
/// the errors (a root out of range is this rank's argument error).
///
/// Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `input` is NULL or points to `count` elements and (at the
/// root) `output` is NULL or points to `world_size × count` elements, aligned to the element
/// size, that nothing else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_gather(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe {
        gather(
            "tutti_gather",
            comm,
            count,
            dtype,
            root,
            input,
            output,
            Mode::Blocking,
        )
    }
}

/// The body of `tutti_gather` and `tutti_gather_async`.
///
/// # Safety
///
/// As `tutti_gather`; with `Mode::Async`, the buffers stay valid until the work completes.
#[allow(clippy::too_many_arguments)] // the C signature, plus the name and the mode
pub(crate) unsafe fn gather(
    f: &'static str,
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    input: *const c_void,
    output: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let (world, is_root) = (c.world, c.rank == root);
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            let n = byte_len(count, 1, dtype)?;
            check(input, n, dtype, "input")?;
            if is_root {
                let total = byte_len(count, world, dtype)?;
                check(output, total, dtype, "output (at the root)")?;
                disjoint(input, n, output, total, "gather")?;
            }
            Ok(dtype)
        })();
        let dtype = checked.map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::Gather,
            dtype,
            count,
            op: ReduceOp::Sum,
            root,
            input: input.cast(),
            output: if is_root {
                output.cast()
            } else {
                std::ptr::null_mut()
            },
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs.
        unsafe { mode.run(&c, call, None) }
    })
}

/// Scatter from `root`: every rank's `output` (`count` elements) becomes block `rank` of the
/// root's `input` (`world_size × count` elements). Off the root `input` is not used and may be
/// NULL. At the root `input` and `output` must not overlap: the call cannot run in place.
///
/// Every rank must make the same call (same count, dtype, root); see `tutti_all_reduce` for
/// the errors (a root out of range is this rank's argument error).
///
/// Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; (at the root) `input` is NULL or points to
/// `world_size × count` elements and `output` is NULL or points to `count` elements, aligned to
/// the element size, that nothing else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_scatter(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe {
        scatter(
            "tutti_scatter",
            comm,
            count,
            dtype,
            root,
            input,
            output,
            Mode::Blocking,
        )
    }
}

/// The body of `tutti_scatter` and `tutti_scatter_async`.
///
/// # Safety
///
/// As `tutti_scatter`; with `Mode::Async`, the buffers stay valid until the work completes.
#[allow(clippy::too_many_arguments)] // the C signature, plus the name and the mode
pub(crate) unsafe fn scatter(
    f: &'static str,
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    input: *const c_void,
    output: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let (world, is_root) = (c.world, c.rank == root);
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            let n = byte_len(count, 1, dtype)?;
            check(output, n, dtype, "output")?;
            if is_root {
                let total = byte_len(count, world, dtype)?;
                check(input, total, dtype, "input (at the root)")?;
                disjoint(input, total, output, n, "scatter")?;
            }
            Ok(dtype)
        })();
        let dtype = checked.map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::Scatter,
            dtype,
            count,
            op: ReduceOp::Sum,
            root,
            input: if is_root {
                input.cast()
            } else {
                std::ptr::null()
            },
            output: output.cast(),
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs.
        unsafe { mode.run(&c, call, None) }
    })
}

/// All-gather with a count per rank: rank r's `input` (`counts[r]` elements) lands at element
/// `counts[0] + ... + counts[r-1]` of every rank's `output` (the sum of `counts`). `counts`
/// holds `world_size` entries (read when the call is issued), the same on every rank (else
/// `TUTTI_ERROR_MISMATCH`); zeros are allowed. `input` and `output` must not overlap: the call
/// cannot run in place.
///
/// See `tutti_all_reduce` for the errors. Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `counts` is NULL or points to `world_size` values; `input`
/// is NULL or points to `counts[rank]` elements and `output` is NULL or points to the sum of
/// `counts`, aligned to the element size, that nothing else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_gather_v(
    comm: *mut tutti_comm,
    counts: *const usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe {
        all_gather_v(
            "tutti_all_gather_v",
            comm,
            counts,
            dtype,
            input,
            output,
            Mode::Blocking,
        )
    }
}

/// The body of `tutti_all_gather_v` and `tutti_all_gather_v_async`.
///
/// # Safety
///
/// As `tutti_all_gather_v`; with `Mode::Async`, the buffers stay valid until the work
/// completes (the counts are copied when the call is issued).
pub(crate) unsafe fn all_gather_v(
    f: &'static str,
    comm: *mut tutti_comm,
    counts: *const usize,
    dtype: tutti_dtype,
    input: *const c_void,
    output: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let (world, rank) = (c.world, c.rank);
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            // SAFETY: the caller promises `world_size` values behind it.
            let counts = unsafe { read_counts(counts, world, "counts") }?;
            let total = counts_len(&counts, dtype, "counts")?;
            // Within the total, which did not overflow.
            let n = counts.get(rank).map_or(0, |&k| k * dtype.size());
            check(input, n, dtype, "input")?;
            check(output, total, dtype, "output")?;
            disjoint(input, n, output, total, "all-gather-v")?;
            Ok((dtype, counts))
        })();
        let (dtype, counts) = checked.map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::AllGatherV,
            dtype,
            count: 0,
            op: ReduceOp::Sum,
            root: 0,
            input: input.cast(),
            output: output.cast(),
            counts: &counts,
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs.
        unsafe { mode.run(&c, call, None) }
    })
}

/// Reduce-scatter with a count per rank: rank r's `output` (`counts[r]` elements) becomes
/// elements `counts[0] + ... + counts[r-1] ..` of the element-wise `op` of every rank's
/// `input` (the sum of `counts`). `counts` holds `world_size` entries (read when the call is
/// issued), the same on every rank (else `TUTTI_ERROR_MISMATCH`); zeros are allowed. `input`
/// and `output` must not overlap: the call cannot run in place.
///
/// See `tutti_all_reduce` for the errors. Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `counts` is NULL or points to `world_size` values; `input`
/// is NULL or points to the sum of `counts` elements and `output` is NULL or points to
/// `counts[rank]`, aligned to the element size, that nothing else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_reduce_scatter_v(
    comm: *mut tutti_comm,
    counts: *const usize,
    dtype: tutti_dtype,
    op: tutti_op,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe {
        reduce_scatter_v(
            "tutti_reduce_scatter_v",
            comm,
            counts,
            dtype,
            op,
            input,
            output,
            Mode::Blocking,
        )
    }
}

/// The body of `tutti_reduce_scatter_v` and `tutti_reduce_scatter_v_async`.
///
/// # Safety
///
/// As `tutti_reduce_scatter_v`; with `Mode::Async`, the buffers stay valid until the work
/// completes (the counts are copied when the call is issued).
#[allow(clippy::too_many_arguments)] // the C signature, plus the name and the mode
pub(crate) unsafe fn reduce_scatter_v(
    f: &'static str,
    comm: *mut tutti_comm,
    counts: *const usize,
    dtype: tutti_dtype,
    op: tutti_op,
    input: *const c_void,
    output: *mut c_void,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let (world, rank) = (c.world, c.rank);
        let checked = (|| {
            mode.check()?;
            let dtype = types::dtype(dtype)?;
            let op = types::op(op)?;
            // SAFETY: the caller promises `world_size` values behind it.
            let counts = unsafe { read_counts(counts, world, "counts") }?;
            let total = counts_len(&counts, dtype, "counts")?;
            // Within the total, which did not overflow.
            let n = counts.get(rank).map_or(0, |&k| k * dtype.size());
            check(input, total, dtype, "input")?;
            check(output, n, dtype, "output")?;
            disjoint(input, total, output, n, "reduce-scatter-v")?;
            Ok((dtype, op, counts))
        })();
        let (dtype, op, counts) = checked.map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::ReduceScatterV,
            dtype,
            count: 0,
            op,
            root: 0,
            input: input.cast(),
            output: output.cast(),
            counts: &counts,
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs.
        unsafe { mode.run(&c, call, None) }
    })
}

/// An error unless the `a_len` bytes at `input` and the `b_len` bytes at `output` are apart,
/// for a collective (`what`) that cannot run in place.
fn disjoint(
    input: *const c_void,
    a_len: usize,
    output: *mut c_void,
    b_len: usize,
    what: &str,
) -> Result<(), String> {
    if overlap(input, a_len, output.cast_const(), b_len) {
        return Err(format!(
            "input and output overlap; {what} cannot run in place: pass separate buffers"
        ));
    }
    Ok(())
}

/// Barrier: returns once every rank of the group has called it.
///
/// Thread-safety: as `tutti_all_reduce`.
///
/// # Safety
///
/// `comm` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_barrier(comm: *mut tutti_comm) -> tutti_result {
    // SAFETY: as the caller promises.
    unsafe { barrier("tutti_barrier", comm, Mode::Blocking) }
}

/// The body of `tutti_barrier` and `tutti_barrier_async`.
///
/// # Safety
///
/// As `tutti_barrier`; with `Mode::Async`, the buffers stay valid until the work completes.
pub(crate) unsafe fn barrier(f: &'static str, comm: *mut tutti_comm, mode: Mode) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        mode.check().map_err(|m| c.reject(f, m))?;
        let call = RawCall {
            collective: Collective::Barrier,
            dtype: DType::U8,
            count: 0,
            op: ReduceOp::Sum,
            root: 0,
            input: std::ptr::null(),
            output: std::ptr::null_mut(),
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: no memory.
        unsafe { mode.run(&c, call, None) }?;
        Ok(())
    })
}

/// Pre-multiplied sum (NCCL's `ncclRedOpCreatePreMulSum`): every rank's `output` (`count`
/// elements) becomes the sum over ranks of that rank's `input` multiplied by its own `factor`.
/// The factor becomes the element type first (for integer dtypes it must be a whole number the
/// type holds; otherwise every rank gets an error naming the factor), each element is
/// multiplied as the type multiplies (f16 and bf16 in float, rounded once; integers wrap), then
/// summed as `TUTTI_OP_SUM` sums. In place: pass the same pointer as `input` and `output`; the
/// scaled copy is made when the call starts (after the calls issued before it, which may still
/// write `input`) and before the ranks meet, so a failed call leaves `input` as it was.
/// Host memory only (ranks on a GPU: `TUTTI_ERROR_INVALID_ARGUMENT`). Errors as
/// `tutti_all_reduce`'s; `tutti_all_reduce_premul_sum_async` does not wait (a factor it
/// refuses is this rank's argument error there, which aborts the group as every argument error
/// of an `_async` call does).
///
/// # Safety
///
/// As `tutti_all_reduce`.
#[no_mangle]
pub unsafe extern "C" fn tutti_all_reduce_premul_sum(
    comm: *mut tutti_comm,
    count: usize,
    dtype: tutti_dtype,
    factor: f64,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    let f = "tutti_all_reduce_premul_sum";
    let call = (Collective::AllReduce, count, dtype, factor, input, output);
    // SAFETY: as the caller promises.
    unsafe { premul_sum(f, comm, call, Mode::Blocking) }
}

/// Pre-multiplied reduce-scatter: `output` (`recv_count` elements) becomes this rank's block
/// of the sum over ranks of each rank's `input` (world size × `recv_count` elements) scaled by
/// its own `factor`; see `tutti_all_reduce_premul_sum`. Not in place.
///
/// # Safety
///
/// As `tutti_reduce_scatter`.
#[no_mangle]
pub unsafe extern "C" fn tutti_reduce_scatter_premul_sum(
    comm: *mut tutti_comm,
    recv_count: usize,
    dtype: tutti_dtype,
    factor: f64,
    input: *const c_void,
    output: *mut c_void,
) -> tutti_result {
    let f = "tutti_reduce_scatter_premul_sum";
    let call = (
        Collective::ReduceScatter,
        recv_count,
        dtype,
        factor,
        input,
        output,
    );
    // SAFETY: as the caller promises.
    unsafe { premul_sum(f, comm, call, Mode::Blocking) }
}

/// A pre-multiplied sum's arguments: the collective (all-reduce or reduce-scatter), the count
/// (the output's elements), the dtype, the factor, the input and the output.
pub(crate) type PremulCall = (
    Collective,
    usize,
    tutti_dtype,
    f64,
    *const c_void,
    *mut c_void,
);

/// The body of the pre-multiplied sums, blocking and not. The call sums a copy of the input
/// scaled by the factor, taken when the call starts (after every earlier call, which may still
/// write the input, has completed) and held as long as the call runs.
///
/// # Safety
///
/// As `tutti_all_reduce_premul_sum`; with `Mode::Async`, the buffers stay valid until the work
/// completes.
pub(crate) unsafe fn premul_sum(
    f: &'static str,
    comm: *mut tutti_comm,
    (collective, count, dtype, factor, input, output): PremulCall,
    mode: Mode,
) -> tutti_result {
    boundary(f, || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let world = c.read().world_size();
        let scatter = collective == Collective::ReduceScatter;
        let checked = (|| {
            mode.check()?;
            host_ranks_only(c.device)?;
            let dtype = types::dtype(dtype)?;
            let n_in = byte_len(count, if scatter { world } else { 1 }, dtype)?;
            let n_out = byte_len(count, 1, dtype)?;
            check(input, n_in, dtype, "input")?;
            check(output, n_out, dtype, "output")?;
            if scatter && overlap(input, n_in, output, n_out) {
                return Err("input and output overlap; reduce-scatter is not in place".to_string());
            }
            if !scatter && !std::ptr::eq(input, output) && overlap(input, n_in, output, n_out) {
                return Err(
                    "input and output overlap without being the same buffer; pass the same \
                     pointer as both for an in-place all-reduce"
                        .to_string(),
                );
            }
            if let (Mode::Async(_), Err(e)) = (mode, tutti::kernels::check_scale(dtype, factor)) {
                return Err(format!("premul_sum: {e}"));
            }
            Ok((dtype, n_in, n_out))
        })();
        let (dtype, n_in, n_out) = checked.map_err(|m| c.reject(f, m))?;
        if tutti::kernels::check_scale(dtype, factor).is_err() {
            // Blocking: the factor's error goes into the call, where the ranks meet, as the
            // Rust call's does: this rank's call fails with it and the others' name this rank,
            // and this rank alone does not abort the group. The call moves nothing, so it runs
            // over buffers of its own: the caller's may still be written by an earlier call.
            crate::p2p::refuse_in_group(c.rank, f)?;
            let comm = c.read();
            let (input, mut output) = (AlignedCopy::zeroed(n_in), AlignedCopy::zeroed(n_out));
            // SAFETY: the copy's own storage, `n_out` bytes.
            let out = unsafe { slice_mut(output.as_mut_ptr().cast(), n_out) };
            let result = if scatter {
                comm.reduce_scatter_premul_sum_raw(dtype, input.bytes(), out, factor)
            } else {
                comm.all_reduce_premul_sum_raw(dtype, None, out, factor)
            };
            return Ok(result?);
        }
        let scaled = InPlace {
            from: input,
            copy: AlignedCopy::zeroed(n_in),
            scale: Some((dtype, factor)),
        };
        let call = RawCall {
            collective,
            dtype,
            count,
            op: ReduceOp::Sum,
            root: 0,
            input: scaled.copy.bytes().as_ptr(),
            output: output.cast(),
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: checked above; the caller promises the memory, for as long as the call runs;
        // the call reads the copy, which it holds.
        unsafe { mode.run(&c, call, Some(scaled)) }
    })
}

/// The pre-multiplied sums scale host memory: GPU ranks, whose buffers are device memory,
/// refuse them (XLA ranks take host memory).
fn host_ranks_only(device: DeviceKind) -> Result<(), String> {
    if device == DeviceKind::Cpu || device == DeviceKind::Xla {
        Ok(())
    } else {
        Err(format!(
            "the pre-multiplied sums take host memory; this rank is on a {device} device"
        ))
    }
}
