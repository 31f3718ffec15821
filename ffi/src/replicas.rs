//! `tutti_replicas`: the one-call form over per-replica buffers held by one caller.

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use tutti::{AbortHandle, Communicator, DType, Replicas};

use crate::buffers::{self, byte_len, check, overlap};
use crate::config::{self, tutti_config};
use crate::error::{boundary, boundary_void, panic_message, tutti_result, Failure, TuttiResult};
use crate::handle::{self, Entered, Handle, Kind, Live};
use crate::types::{self, tutti_dtype, tutti_op};

/// A group of replicas driven by one caller that holds every replica's buffer (opaque), as
/// TensorFlow's cross-device ops are: each call takes one buffer per replica and returns when
/// the collective is done on all of them. Replica 0 runs on the calling thread, the others on
/// threads the group owns. Created by `tutti_replicas_create`, released by
/// `tutti_replicas_destroy`.
pub struct tutti_replicas {
    /// One call at a time: a call holds it for its whole run.
    inner: Mutex<Replicas>,
    /// Aborts the group without waiting for the lock, from any thread.
    abort: AbortHandle,
    count: usize,
    /// The bound on every wait (the destroy's wait for calls inside too).
    timeout: std::time::Duration,
    /// The calls inside this handle, which `tutti_replicas_destroy` waits for.
    live: Live,
}

impl Handle for tutti_replicas {
    const KIND: Kind = Kind::Replicas;
    fn live(&self) -> &Live {
        &self.live
    }
}

/// A buffer address handed to the replica that uses it.
#[derive(Copy, Clone)]
struct Addr(usize, usize);

impl Addr {
    fn of(p: *const c_void, len: usize) -> Addr {
        Addr(p as usize, len)
    }
    /// SAFETY: the buffer passed `check`, and this replica alone writes it during the call.
    unsafe fn slice_mut<'a>(self) -> &'a mut [u8] {
        unsafe { buffers::slice_mut(self.0 as *mut c_void, self.1) }
    }
    /// SAFETY: the buffer passed `check`, and nothing writes it during the call.
    unsafe fn slice<'a>(self) -> &'a [u8] {
        unsafe { buffers::slice(self.0 as *const c_void, self.1) }
    }
}

type Task<'a> = dyn Fn(usize, &Communicator) -> tutti::Result<()> + Sync + 'a;

impl tutti_replicas {
    /// Run `task` on every replica, one call at a time, with a panic in any replica stopped
    /// there (it aborts the group and comes back as `TUTTI_ERROR_INTERNAL`).
    fn run(&self, task: &Task<'_>) -> Result<(), Failure> {
        let replicas = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                return Err(Failure::invalid(
                    "another call is running on these replicas; make one call at a time",
                ))
            }
        };
        let panicked = Mutex::new(None::<String>);
        let result = replicas.each(&|r, comm| {
            catch_unwind(AssertUnwindSafe(|| task(r, comm))).unwrap_or_else(|p| {
                let reason = format!("replica {r} panicked: {}", panic_message(&*p));
                comm.abort(&reason);
                if let Ok(mut m) = panicked.lock() {
                    m.get_or_insert(reason.clone());
                }
                Err(tutti::Error::Aborted { rank: r, reason })
            })
        });
        if let Some(message) = panicked.into_inner().ok().flatten() {
            return Err(Failure {
                code: TuttiResult::TUTTI_ERROR_INTERNAL,
                message: format!("internal error: {message}; please report this"),
            });
        }
        Ok(result?)
    }

    fn check_num(&self, name: &str, n: usize) -> Result<(), Failure> {
        if n != self.count {
            return Err(Failure::invalid(format!(
                "{name} is {n} but there are {} replicas; pass one buffer per replica",
                self.count
            )));
        }
        Ok(())
    }
}

/// The replicas behind a C handle, entered for one call (`tutti_replicas_destroy` waits until
/// it is dropped), or an error when it is NULL or being destroyed.
///
/// # Safety
///
/// `replicas` is NULL or a handle from `tutti_replicas_create` whose destroy has not returned
/// (one that is being destroyed, or was, is refused without being read).
unsafe fn replicas_ref<'a>(
    replicas: *const tutti_replicas,
) -> Result<Entered<'a, tutti_replicas>, Failure> {
    // SAFETY: as the caller promises.
    unsafe { handle::enter(replicas) }
}

/// The `num` pointers of a C array, or an error when the array is NULL.
///
/// # Safety
///
/// `array` is NULL or points to `num` pointers.
unsafe fn pointers<T>(
    array: *const *mut T,
    num: usize,
    name: &str,
) -> Result<Vec<*mut T>, Failure> {
    if array.is_null() {
        return Err(Failure::invalid(format!("{name} is NULL")));
    }
    // SAFETY: as the caller promises.
    Ok(unsafe { std::slice::from_raw_parts(array, num) }.to_vec())
}

/// Check every buffer of a list; the error names the one that is wrong.
fn check_all(ptrs: &[*mut c_void], len: usize, dtype: DType, name: &str) -> Result<(), Failure> {
    for (i, p) in ptrs.iter().enumerate() {
        check(*p, len, dtype, &format!("{name}[{i}]")).map_err(Failure::invalid)?;
    }
    Ok(())
}

/// Check that no two of the buffers the replicas write share memory.
fn check_disjoint(ptrs: &[*mut c_void], len: usize, name: &str) -> Result<(), Failure> {
    let regions: Vec<(*const c_void, usize)> = ptrs.iter().map(|p| (p.cast_const(), len)).collect();
    match buffers::any_overlap(&regions) {
        Some((a, b)) => Err(Failure::invalid(format!(
            "{name}[{a}] and {name}[{b}] overlap; each replica needs its own buffer"
        ))),
        None => Ok(()),
    }
}

/// Create `num_replicas` replicas (threads of this process) and write the handle to
/// `*replicas`. `config` may be NULL for every default.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `config` is NULL or points to a `tutti_config` of `config->struct_size` bytes; `replicas` is
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_replicas_create(
    num_replicas: usize,
    config: *const tutti_config,
    replicas: *mut *mut tutti_replicas,
) -> tutti_result {
    boundary("tutti_replicas_create", || {
        // SAFETY: as the caller promises.
        let settings = unsafe { config::read(config) }?;
        config::in_process(&settings)?;
        let config = settings.core;
        if replicas.is_null() {
            return Err(Failure::invalid("replicas is NULL"));
        }
        let inner = Replicas::new(num_replicas, &config)?;
        let handle = Mutex::new(None);
        inner.each(&|r, comm| {
            if r == 0 {
                *handle.lock().unwrap_or_else(|e| e.into_inner()) = Some(comm.abort_handle());
            }
            Ok(())
        })?;
        let abort = handle
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .ok_or_else(|| Failure::invalid("replica 0 did not start"))?;
        let r = handle::into_raw(tutti_replicas {
            inner: Mutex::new(inner),
            abort,
            count: num_replicas,
            timeout: config.timeout,
            live: Live::new(),
        });
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { replicas.write(r) };
        Ok(())
    })
}

/// Release replicas and stop their threads. NULL is accepted and ignored.
///
/// A call running on another thread is waited for, up to the replicas' timeout; past it they
/// are aborted, which ends it at once. Calls made from then on, until this returns, fail with
/// `TUTTI_ERROR_INVALID_ARGUMENT`. A second destroy of the same handle (or two threads
/// destroying it at once) does nothing but record, as the thread's last error, that it was not
/// a live handle; should a call never leave, the handle is left allocated and the last error
/// says so.
///
/// Thread-safety: callable from any thread, while another thread runs a call on `replicas` (a
/// watchdog's `tutti_replicas_abort` then `tutti_replicas_destroy`, say); no call may use
/// `replicas` after this has returned: a call that races the end of the destroy fails with
/// `TUTTI_ERROR_INVALID_ARGUMENT` (the handle is looked up among the live ones, never read once
/// destroyed), but as with `free()`, the address may be reused by a new handle, which such a call
/// would then use.
///
/// # Safety
///
/// `replicas` is NULL or a handle from `tutti_replicas_create` (destroyed already or not).
#[no_mangle]
pub unsafe extern "C" fn tutti_replicas_destroy(replicas: *mut tutti_replicas) {
    boundary_void("tutti_replicas_destroy", || {
        if replicas.is_null() {
            return; // a no-op that leaves the last error alone
        }
        // SAFETY: as the caller promises; a handle not registered as live is not touched.
        let r = unsafe {
            handle::destroy(
                replicas,
                |r| r.timeout,
                |r, n| {
                    r.abort.abort(&format!(
                        "tutti_replicas_destroy: {n} call(s) on other threads were still inside \
                         after the timeout ({:?})",
                        r.timeout
                    ))
                },
                |_| {},
            )
        };
        handle::report("tutti_replicas_destroy", r);
    })
}

/// Write the number of replicas to `*num_replicas`.
///
/// Thread-safety: callable from any thread at any time.
///
/// # Safety
///
/// `replicas` is NULL or a live handle; `num_replicas` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_replicas_count(
    replicas: *const tutti_replicas,
    num_replicas: *mut usize,
) -> tutti_result {
    boundary("tutti_replicas_count", || {
        // SAFETY: as the caller promises.
        let r = unsafe { replicas_ref(replicas) }?;
        if num_replicas.is_null() {
            return Err(Failure::invalid("num_replicas is NULL"));
        }
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { num_replicas.write(r.count) };
        Ok(())
    })
}

/// Abort the replicas' group: a running call and every later one fail with
/// `TUTTI_ERROR_ABORTED`, carrying `reason` (NULL: a default reason). Destroy the replicas and
/// create new ones to go on.
///
/// Thread-safety: callable from any thread at any time, including while another thread is
/// inside a call on these replicas.
///
/// # Safety
///
/// `replicas` is NULL or a live handle; `reason` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tutti_replicas_abort(
    replicas: *const tutti_replicas,
    reason: *const c_char,
) -> tutti_result {
    boundary("tutti_replicas_abort", || {
        // SAFETY: as the caller promises.
        let r = unsafe { replicas_ref(replicas) }?;
        let reason = if reason.is_null() {
            "tutti_replicas_abort was called".to_string()
        } else {
            // SAFETY: the caller promises a NUL-terminated string.
            let s = unsafe { CStr::from_ptr(reason) }.to_string_lossy();
            format!("tutti_replicas_abort was called: {s}")
        };
        r.abort.abort(&reason);
        Ok(())
    })
}

/// All-reduce in place across the replicas: every `buffers[i]` (`count` elements) becomes the
/// element-wise `op` of all of them. `num_buffers` must equal the number of replicas.
///
/// Thread-safety: one call at a time per `tutti_replicas` (a concurrent one fails with
/// `TUTTI_ERROR_INVALID_ARGUMENT`); different replicas objects are independent.
///
/// # Safety
///
/// `replicas` is NULL or a live handle; `buffers` is NULL or points to `num_buffers` pointers,
/// each NULL or pointing to `count` elements aligned to the element size that nothing else
/// touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_replicas_all_reduce(
    replicas: *mut tutti_replicas,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    num_buffers: usize,
    buffers: *const *mut c_void,
) -> tutti_result {
    boundary("tutti_replicas_all_reduce", || {
        // SAFETY: as the caller promises.
        let r = unsafe { replicas_ref(replicas) }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let op = types::op(op).map_err(Failure::invalid)?;
        let n = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        r.check_num("num_buffers", num_buffers)?;
        // SAFETY: as the caller promises.
        let bufs = unsafe { pointers(buffers, num_buffers, "buffers") }?;
        check_all(&bufs, n, dtype, "buffers")?;
        check_disjoint(&bufs, n, "buffers")?;
        let addrs: Vec<Addr> = bufs.iter().map(|p| Addr::of(*p, n)).collect();
        r.run(&|i, comm| {
            // SAFETY: checked; replica i alone uses buffer i while the call runs.
            let b = unsafe { addrs[i].slice_mut() };
            comm.all_reduce_raw(dtype, None, b, op)
        })
    })
}

/// Broadcast across the replicas: every `buffers[i]` (`count` elements) becomes
/// `buffers[root]`.
///
/// Thread-safety: as `tutti_replicas_all_reduce`.
///
/// # Safety
///
/// As `tutti_replicas_all_reduce`.
#[no_mangle]
pub unsafe extern "C" fn tutti_replicas_broadcast(
    replicas: *mut tutti_replicas,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    num_buffers: usize,
    buffers: *const *mut c_void,
) -> tutti_result {
    boundary("tutti_replicas_broadcast", || {
        // SAFETY: as the caller promises.
        let r = unsafe { replicas_ref(replicas) }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let n = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        r.check_num("num_buffers", num_buffers)?;
        if root >= r.count {
            return Err(Failure::invalid(format!(
                "root {root} is out of range for {} replicas",
                r.count
            )));
        }
        // SAFETY: as the caller promises.
        let bufs = unsafe { pointers(buffers, num_buffers, "buffers") }?;
        check_all(&bufs, n, dtype, "buffers")?;
        check_disjoint(&bufs, n, "buffers")?;
        let addrs: Vec<Addr> = bufs.iter().map(|p| Addr::of(*p, n)).collect();
        r.run(&|i, comm| {
            // SAFETY: checked; replica i alone uses buffer i while the call runs.
            let b = unsafe { addrs[i].slice_mut() };
            comm.broadcast_raw(dtype, b, root)
        })
    })
}

/// Check the inputs and outputs of a replicas call in which replica i reads `inputs[i]`
/// (`in_len` bytes) and writes `outputs[i]` (`out_len` bytes): every output its own memory, and
/// no input inside any output except, where `own` says so, replica i's input at byte `own(i)` of
/// its own output (the in-place form). Returns which replicas run in place.
fn check_in_out(
    inputs: &[*mut c_void],
    in_len: usize,
    outputs: &[*mut c_void],
    out_len: usize,
    own: Option<&dyn Fn(usize) -> usize>,
) -> Result<Vec<bool>, Failure> {
    check_disjoint(outputs, out_len, "outputs")?;
    let mut in_place = vec![false; inputs.len()];
    for (i, &input) in inputs.iter().enumerate() {
        if let Some(own) = own {
            if in_len == 0 || input as usize == (outputs[i] as usize).wrapping_add(own(i)) {
                in_place[i] = true;
                continue;
            }
        }
        if let Some(j) = (0..outputs.len()).find(|&j| overlap(input, in_len, outputs[j], out_len)) {
            return Err(Failure::invalid(format!(
                "inputs[{i}] overlaps outputs[{j}]{}",
                if own.is_some() && i == j {
                    " without being that replica's slice of it (the in-place form)"
                } else {
                    ""
                }
            )));
        }
    }
    Ok(in_place)
}

/// All-gather across the replicas: every `outputs[i]` (`num_buffers × count` elements) becomes
/// the concatenation of every `inputs[j]` (`count` elements) in replica order. In place: pass
/// `outputs[i] + i × count` (in elements) as `inputs[i]`.
///
/// Thread-safety: as `tutti_replicas_all_reduce`.
///
/// # Safety
///
/// `replicas` is NULL or a live handle; `inputs` and `outputs` are NULL or point to
/// `num_buffers` pointers, each NULL or pointing to memory of the size above, aligned to the
/// element size, that nothing else touches during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_replicas_all_gather(
    replicas: *mut tutti_replicas,
    count: usize,
    dtype: tutti_dtype,
    num_buffers: usize,
    inputs: *const *const c_void,
    outputs: *const *mut c_void,
) -> tutti_result {
    boundary("tutti_replicas_all_gather", || {
        // SAFETY: as the caller promises.
        let r = unsafe { replicas_ref(replicas) }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let n = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        let total = byte_len(count, r.count, dtype).map_err(Failure::invalid)?;
        r.check_num("num_buffers", num_buffers)?;
        // SAFETY: as the caller promises.
        let ins = unsafe { pointers(inputs.cast::<*mut c_void>(), num_buffers, "inputs") }?;
        // SAFETY: as the caller promises.
        let outs = unsafe { pointers(outputs, num_buffers, "outputs") }?;
        check_all(&ins, n, dtype, "inputs")?;
        check_all(&outs, total, dtype, "outputs")?;
        let in_place = check_in_out(&ins, n, &outs, total, Some(&|i| i * n))?;
        let ins: Vec<Addr> = ins.iter().map(|p| Addr::of(*p, n)).collect();
        let outs: Vec<Addr> = outs.iter().map(|p| Addr::of(*p, total)).collect();
        r.run(&|i, comm| {
            // SAFETY: checked; replica i alone writes output i, and no input is written.
            let o = unsafe { outs[i].slice_mut() };
            let input = (!in_place[i]).then(|| unsafe { ins[i].slice() });
            comm.all_gather_raw(dtype, input, o)
        })
    })
}

/// Reduce-scatter across the replicas: `outputs[i]` (`count` elements) becomes elements
/// `i × count ..` of the element-wise `op` of every `inputs[j]` (`num_buffers × count`
/// elements).
///
/// Thread-safety: as `tutti_replicas_all_reduce`.
///
/// # Safety
///
/// As `tutti_replicas_all_gather`, with the sizes above.
#[no_mangle]
pub unsafe extern "C" fn tutti_replicas_reduce_scatter(
    replicas: *mut tutti_replicas,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    num_buffers: usize,
    inputs: *const *const c_void,
    outputs: *const *mut c_void,
) -> tutti_result {
    boundary("tutti_replicas_reduce_scatter", || {
        // SAFETY: as the caller promises.
        let r = unsafe { replicas_ref(replicas) }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let op = types::op(op).map_err(Failure::invalid)?;
        let n = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        let total = byte_len(count, r.count, dtype).map_err(Failure::invalid)?;
        r.check_num("num_buffers", num_buffers)?;
        // SAFETY: as the caller promises.
        let ins = unsafe { pointers(inputs.cast::<*mut c_void>(), num_buffers, "inputs") }?;
        // SAFETY: as the caller promises.
        let outs = unsafe { pointers(outputs, num_buffers, "outputs") }?;
        check_all(&ins, total, dtype, "inputs")?;
        check_all(&outs, n, dtype, "outputs")?;
        check_in_out(&ins, total, &outs, n, None)?;
        let ins: Vec<Addr> = ins.iter().map(|p| Addr::of(*p, total)).collect();
        let outs: Vec<Addr> = outs.iter().map(|p| Addr::of(*p, n)).collect();
        r.run(&|i, comm| {
            // SAFETY: checked; replica i alone writes output i, and no input is written.
            let (input, output) = unsafe { (ins[i].slice(), outs[i].slice_mut()) };
            comm.reduce_scatter_raw(dtype, input, output, op)
        })
    })
}

/// Reduce across the replicas into one destination: `output` (`count` elements) becomes the
/// element-wise `op` of every `inputs[i]` (`count` elements). `output` may be `inputs[0]`
/// (reduced in place there) or memory of its own; any other overlap is an error.
///
/// Thread-safety: as `tutti_replicas_all_reduce`.
///
/// # Safety
///
/// `replicas` is NULL or a live handle; `inputs` is NULL or points to `num_inputs` pointers,
/// each NULL or pointing to `count` elements; `output` is NULL or points to `count` elements;
/// all aligned to the element size, and nothing else touches them during the call.
#[no_mangle]
pub unsafe extern "C" fn tutti_replicas_reduce(
    replicas: *mut tutti_replicas,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    num_inputs: usize,
    inputs: *const *const c_void,
    output: *mut c_void,
) -> tutti_result {
    boundary("tutti_replicas_reduce", || {
        // SAFETY: as the caller promises.
        let r = unsafe { replicas_ref(replicas) }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let op = types::op(op).map_err(Failure::invalid)?;
        let n = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        r.check_num("num_inputs", num_inputs)?;
        // SAFETY: as the caller promises.
        let ins = unsafe { pointers(inputs.cast::<*mut c_void>(), num_inputs, "inputs") }?;
        check_all(&ins, n, dtype, "inputs")?;
        check(output, n, dtype, "output").map_err(Failure::invalid)?;
        let in_place = std::ptr::eq(ins[0], output);
        let first_other = ins
            .iter()
            .enumerate()
            .skip(usize::from(in_place))
            .find(|(_, p)| overlap(**p, n, output, n));
        if let Some((i, _)) = first_other {
            return Err(Failure::invalid(format!(
                "inputs[{i}] overlaps output; the output may be inputs[0] (in place) or memory of its own"
            )));
        }
        let ins: Vec<Addr> = ins.iter().map(|p| Addr::of(*p, n)).collect();
        let out = Addr::of(output, n);
        r.run(&|i, comm| {
            if i == 0 {
                // SAFETY: checked; replica 0 alone writes the output.
                let o = unsafe { out.slice_mut() };
                let input = (!in_place).then(|| unsafe { ins[0].slice() });
                comm.reduce_raw(dtype, input, Some(o), op, 0)
            } else {
                // SAFETY: checked; no input is written.
                comm.reduce_raw(dtype, Some(unsafe { ins[i].slice() }), None, op, 0)
            }
        })
    })
}
