//! `tutti_tensor_*` and the replica context's collectives on tensors: values kept in a
//! replica's device memory (a PJRT buffer under TPUStrategy, host memory for CPU replicas),
//! reduced where they lie.

use std::ffi::c_void;

use tutti::DeviceTensor;

use crate::buffers::{self, byte_len, check};
use crate::comm::out_ptr;
use crate::error::{boundary, boundary_void, tutti_result, Failure};
use crate::strategy::{ctx_ref, tutti_replica_context, typed, typed_ref};
use crate::types::{self, tutti_device_kind, tutti_dtype, tutti_op};

/// A tensor in a replica's device memory (opaque). Created by `tutti_replica_place` or
/// `tutti_tensor_from_host`, released by `tutti_tensor_destroy`. A tensor belongs to one
/// replica: a call that finds it in use by another (the same handle passed to several
/// replicas' collectives) is an argument error, not a race.
pub struct tutti_tensor {
    inner: parking_lot::Mutex<DeviceTensor>,
}

/// The tensor, held for this call.
///
/// # Safety
///
/// `t` is NULL or a live handle.
pub(crate) unsafe fn tensor_lock<'a>(
    t: *const tutti_tensor,
) -> Result<parking_lot::MutexGuard<'a, DeviceTensor>, Failure> {
    // SAFETY: as the caller promises.
    let t = unsafe { t.as_ref() }.ok_or_else(|| Failure::invalid("tensor is NULL"))?;
    t.inner.try_lock().ok_or_else(|| {
        Failure::invalid(
            "the tensor is in use by another call (a tensor belongs to one replica: pass each \
             replica its own)",
        )
    })
}

/// `count` elements of `dtype` at `data` (the argument `name`), checked, as bytes.
///
/// # Safety
///
/// `data` is NULL or holds `count` elements of `dtype`.
pub(crate) unsafe fn input<'a>(
    count: usize,
    dtype: tutti_dtype,
    data: *const c_void,
    name: &str,
) -> Result<(tutti::DType, &'a [u8]), Failure> {
    let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
    let len = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
    check(data, len, dtype, name).map_err(Failure::invalid)?;
    // SAFETY: checked; the caller promises `count` elements.
    Ok((dtype, unsafe { buffers::slice(data, len) }))
}

fn hand_out(out: *mut *mut tutti_tensor, t: DeviceTensor) {
    let raw = Box::into_raw(Box::new(tutti_tensor {
        inner: parking_lot::Mutex::new(t),
    }));
    // SAFETY: `out` was checked non-NULL; the caller promises it is writable.
    unsafe { out.write(raw) };
}

/// Copy `count` elements of `dtype` from `data` to this replica's device and write the new
/// tensor to `*out` (a PJRT buffer under TPUStrategy, host memory for CPU replicas). The
/// `tutti_replica_*_tensor` collectives run on it where it lies; `tutti_tensor_read` copies it
/// back.
///
/// Thread-safety: only inside the replica function that was handed `ctx`.
///
/// # Safety
///
/// `ctx` is NULL or the running replica's context; `data` is NULL or holds `count` elements of
/// `dtype`; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_replica_place(
    ctx: *const tutti_replica_context,
    count: usize,
    dtype: tutti_dtype,
    data: *const c_void,
    out: *mut *mut tutti_tensor,
) -> tutti_result {
    boundary("tutti_replica_place", || {
        // SAFETY: as the caller promises.
        let c = unsafe { ctx_ref(ctx) }?;
        let out = out_ptr(out, "out")?;
        // SAFETY: as the caller promises.
        let (dtype, bytes) = unsafe { input(count, dtype, data, "data") }?;
        let t = tutti::for_each_dtype!(dtype, T => { c.place(typed_ref::<T>(bytes))? });
        hand_out(out, t);
        Ok(())
    })
}

/// Copy `count` elements of `dtype` from `data` to local replica `local_replica`'s device and
/// write the new tensor to `*out`, from outside `tutti_strategy_run` (as `tutti_replica_place`
/// places inside it): a PJRT buffer under TPUStrategy, host memory for CPU replicas. For an
/// input pipeline that places the next step's batches while a step runs.
///
/// Thread-safety: callable from any thread, during a run too.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; `data` is NULL or holds `count` elements of `dtype`;
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_place(
    strategy: *const crate::strategy::tutti_strategy,
    local_replica: usize,
    count: usize,
    dtype: tutti_dtype,
    data: *const c_void,
    out: *mut *mut tutti_tensor,
) -> tutti_result {
    boundary("tutti_strategy_place", || {
        // SAFETY: as the caller promises.
        let s = unsafe { crate::strategy::strategy_ref(strategy) }?;
        let out = out_ptr(out, "out")?;
        // SAFETY: as the caller promises.
        let (dtype, bytes) = unsafe { input(count, dtype, data, "data") }?;
        let t = tutti::for_each_dtype!(dtype, T => {
            s.place_on_replica(local_replica, typed_ref::<T>(bytes))?
        });
        hand_out(out, t);
        Ok(())
    })
}

/// A tensor in host memory holding `count` elements of `dtype` from `data`, written to `*out`
/// (for the default strategy and CPU replicas, whose tensors are host memory).
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `data` is NULL or holds `count` elements of `dtype`; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_tensor_from_host(
    count: usize,
    dtype: tutti_dtype,
    data: *const c_void,
    out: *mut *mut tutti_tensor,
) -> tutti_result {
    boundary("tutti_tensor_from_host", || {
        let out = out_ptr(out, "out")?;
        // SAFETY: as the caller promises.
        let (dtype, bytes) = unsafe { input(count, dtype, data, "data") }?;
        let t =
            tutti::for_each_dtype!(dtype, T => { DeviceTensor::from_host(typed_ref::<T>(bytes)) });
        hand_out(out, t);
        Ok(())
    })
}

/// All-reduce `tensor` in place across every replica in sync, where it lies (on XLA devices
/// one compiled program over the replicas' buffers, nothing copied through host memory).
/// `op` as `tutti_replica_all_reduce`. A tensor in host memory, or on another replica's device,
/// is an argument error on every replica.
///
/// Thread-safety: only inside the replica function that was handed `ctx`.
///
/// # Safety
///
/// `ctx` is NULL or the running replica's context; `tensor` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_replica_all_reduce_tensor(
    ctx: *const tutti_replica_context,
    op: tutti_op,
    tensor: *mut tutti_tensor,
) -> tutti_result {
    boundary("tutti_replica_all_reduce_tensor", || {
        // SAFETY: as the caller promises.
        let (c, mut t) = unsafe { (ctx_ref(ctx)?, tensor_lock(tensor)?) };
        let op = types::op(op).map_err(Failure::invalid)?;
        c.all_reduce_tensor(op, &mut t)?;
        Ok(())
    })
}

/// Broadcast `tensor` from the replica `root` (an index in sync) to every replica's, where
/// they lie.
///
/// Thread-safety: only inside the replica function that was handed `ctx`.
///
/// # Safety
///
/// As `tutti_replica_all_reduce_tensor`.
#[no_mangle]
pub unsafe extern "C" fn tutti_replica_broadcast_tensor(
    ctx: *const tutti_replica_context,
    root: usize,
    tensor: *mut tutti_tensor,
) -> tutti_result {
    boundary("tutti_replica_broadcast_tensor", || {
        // SAFETY: as the caller promises.
        let (c, mut t) = unsafe { (ctx_ref(ctx)?, tensor_lock(tensor)?) };
        c.broadcast_tensor(&mut t, root)?;
        Ok(())
    })
}

/// All-gather where the tensors lie: `tensor` becomes every replica's, concatenated in replica
/// order (as many times longer as there are replicas in sync).
///
/// Thread-safety: only inside the replica function that was handed `ctx`.
///
/// # Safety
///
/// As `tutti_replica_all_reduce_tensor`.
#[no_mangle]
pub unsafe extern "C" fn tutti_replica_all_gather_tensor(
    ctx: *const tutti_replica_context,
    tensor: *mut tutti_tensor,
) -> tutti_result {
    boundary("tutti_replica_all_gather_tensor", || {
        // SAFETY: as the caller promises.
        let (c, mut t) = unsafe { (ctx_ref(ctx)?, tensor_lock(tensor)?) };
        c.all_gather_tensor(&mut t)?;
        Ok(())
    })
}

/// Write the tensor's element type to `*dtype`, its number of elements to `*count` and the
/// kind of memory it is in to `*kind` (`TUTTI_DEVICE_CPU` for host memory, `TUTTI_DEVICE_XLA`).
/// Any output may be NULL.
///
/// Thread-safety: callable from any thread; while a collective runs on `tensor`, an error.
///
/// # Safety
///
/// `tensor` is NULL or a live handle; the outputs are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_tensor_info(
    tensor: *const tutti_tensor,
    dtype: *mut tutti_dtype,
    count: *mut usize,
    kind: *mut tutti_device_kind,
) -> tutti_result {
    boundary("tutti_tensor_info", || {
        // SAFETY: as the caller promises.
        let t = unsafe { tensor_lock(tensor) }?;
        // SAFETY: each is NULL or writable, as the caller promises.
        unsafe {
            if !dtype.is_null() {
                dtype.write(types::dtype_code(t.dtype()));
            }
            if !count.is_null() {
                count.write(t.len());
            }
            if !kind.is_null() {
                kind.write(types::device_kind_to_c(t.kind()));
            }
        }
        Ok(())
    })
}

/// Copy the tensor to `out`: `count` elements of `dtype`, its dtype and length.
///
/// Thread-safety: callable from any thread; while a collective runs on `tensor`, an error.
///
/// # Safety
///
/// `tensor` is NULL or a live handle; `out` is NULL or holds `count` writable elements of
/// `dtype`.
#[no_mangle]
pub unsafe extern "C" fn tutti_tensor_read(
    tensor: *const tutti_tensor,
    count: usize,
    dtype: tutti_dtype,
    out: *mut c_void,
) -> tutti_result {
    boundary("tutti_tensor_read", || {
        // SAFETY: as the caller promises.
        let t = unsafe { tensor_lock(tensor) }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        if (dtype, count) != (t.dtype(), t.len()) {
            return Err(Failure::invalid(format!(
                "reading {t:?} into {count} elements of {dtype}: they must be its dtype and length"
            )));
        }
        let len = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        check(out, len, dtype, "out").map_err(Failure::invalid)?;
        // SAFETY: checked; the caller promises `count` writable elements.
        let bytes = unsafe { buffers::slice_mut(out, len) };
        tutti::for_each_dtype!(dtype, T => {
            typed::<T>(bytes).copy_from_slice(&t.to_vec::<T>()?)
        });
        Ok(())
    })
}

/// Release a tensor (its device memory too). NULL is accepted and ignored.
///
/// Thread-safety: no other call may be using `tensor`, nor use it afterwards.
///
/// # Safety
///
/// `tensor` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_tensor_destroy(tensor: *mut tutti_tensor) {
    boundary_void("tutti_tensor_destroy", || {
        if !tensor.is_null() {
            // SAFETY: a live handle from Box::into_raw, released once.
            drop(unsafe { Box::from_raw(tensor) });
        }
    })
}
