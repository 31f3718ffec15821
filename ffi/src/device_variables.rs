//! `tutti_strategy_device_variable` and `tutti_device_variable_*`: a mirrored variable whose
//! copies live in the replicas' device memory (PJRT buffers under TPUStrategy, host memory for
//! CPU replicas), updated from the replicas' tensors where they lie.

use std::any::Any;
use std::ffi::c_void;

use tutti::strategy::{Aggregation, DeviceVariable, PerReplica, ReplicaContext, Strategy};
use tutti::{DType, DeviceTensor, Element};

use crate::buffers::{self, byte_len, check};
use crate::comm::out_ptr;
use crate::error::{boundary, boundary_void, tutti_result, Failure};
use crate::strategy::{
    ctx_ref, strategy_ref, tutti_replica_context, tutti_strategy, typed, typed_ref,
};
use crate::tensor::{input, tensor_lock, tutti_tensor};
use crate::types::{self, tutti_dtype};
use crate::variables::{aggregation_of, tutti_aggregation, tutti_assign, TuttiAssign};

/// A variable whose copies live in the replicas' device memory (opaque). Created by
/// `tutti_strategy_device_variable`, released by `tutti_device_variable_destroy`.
pub struct tutti_device_variable {
    dtype: DType,
    /// A `DeviceVariable<T>` of `dtype`'s `T`.
    inner: Box<dyn Any + Send + Sync>,
}

impl tutti_device_variable {
    fn get<T: Element>(&self) -> Result<&DeviceVariable<T>, Failure> {
        self.inner.downcast_ref().ok_or_else(|| {
            Failure::invalid(format!(
                "the device variable is {}, not {}",
                self.dtype,
                T::DTYPE
            ))
        })
    }
}

/// # Safety
///
/// `v` is NULL or a live handle.
unsafe fn var_ref<'a>(
    v: *const tutti_device_variable,
) -> Result<&'a tutti_device_variable, Failure> {
    // SAFETY: as the caller promises.
    unsafe { v.as_ref() }.ok_or_else(|| Failure::invalid("variable is NULL"))
}

/// How a `tutti_assign` changes a device variable.
#[derive(Copy, Clone)]
enum How {
    Set,
    Add,
    Sub,
}

fn how_of(how: tutti_assign) -> Result<How, Failure> {
    Ok(match how {
        h if h == TuttiAssign::TUTTI_ASSIGN as u32 => How::Set,
        h if h == TuttiAssign::TUTTI_ASSIGN_ADD as u32 => How::Add,
        h if h == TuttiAssign::TUTTI_ASSIGN_SUB as u32 => How::Sub,
        other => {
            return Err(Failure::invalid(format!(
                "how {other} is not a tutti_assign (valid: 0..=2)"
            )))
        }
    })
}

fn update_in<T: Element>(
    var: &DeviceVariable<T>,
    ctx: &ReplicaContext<'_>,
    t: &DeviceTensor,
    agg: Aggregation,
    how: How,
) -> tutti::Result<()> {
    match how {
        How::Set => var.assign_in(ctx, t, agg),
        How::Add => var.assign_add_in(ctx, t, agg),
        How::Sub => var.assign_sub_in(ctx, t, agg),
    }
}

fn update_cross<T: Element>(
    var: &DeviceVariable<T>,
    s: &Strategy,
    updates: &PerReplica<Vec<T>>,
    agg: Aggregation,
    how: How,
) -> tutti::Result<()> {
    match how {
        How::Set => var.assign(s, updates, agg),
        How::Add => var.assign_add(s, updates, agg),
        How::Sub => var.assign_sub(s, updates, agg),
    }
}

/// Create a variable of `count` elements of `dtype` from `initial` whose copies live on the
/// strategy's replicas' devices (one PJRT buffer per replica under TPUStrategy, host memory for
/// CPU replicas), and write it to `*out`. Under a multi-worker strategy every worker creates
/// the same variables in the same order, and each starts from the chief's `initial` (a
/// length or dtype that differs between workers is an error naming both).
///
/// Thread-safety: not inside a replica function; one call at a time per strategy.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; `initial` is NULL or holds `count` elements of `dtype`;
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_device_variable(
    strategy: *const tutti_strategy,
    count: usize,
    dtype: tutti_dtype,
    initial: *const c_void,
    out: *mut *mut tutti_device_variable,
) -> tutti_result {
    boundary("tutti_strategy_device_variable", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy_ref(strategy) }?;
        let out = out_ptr(out, "out")?;
        // SAFETY: as the caller promises.
        let (d, bytes) = unsafe { input(count, dtype, initial, "initial") }?;
        let inner: Box<dyn Any + Send + Sync> = tutti::for_each_dtype!(d, T => {
            Box::new(s.device_variable(typed_ref::<T>(bytes))?)
        });
        let raw = Box::into_raw(Box::new(tutti_device_variable { dtype: d, inner }));
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(raw) };
        Ok(())
    })
}

/// Release a device variable (its copies' device memory too). NULL is accepted and ignored.
///
/// Thread-safety: no other call may be using `variable`, nor use it afterwards.
///
/// # Safety
///
/// `variable` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_device_variable_destroy(variable: *mut tutti_device_variable) {
    boundary_void("tutti_device_variable_destroy", || {
        if !variable.is_null() {
            // SAFETY: a live handle from Box::into_raw, released once.
            drop(unsafe { Box::from_raw(variable) });
        }
    })
}

/// Inside a replica function: every replica's `tensor` (its update, on its device: from
/// `tutti_replica_place` or a program of the caller's) combined by `aggregation`, then
/// `assign`ed, added or subtracted (`how`) to every copy. On XLA devices the replicas' updates
/// are combined and applied in one compiled program, nothing copied through host memory.
/// Collective: every replica calls it, with a tensor of the variable's dtype and length.
///
/// Thread-safety: only inside the replica function that was handed `ctx`.
///
/// # Safety
///
/// `ctx` is NULL or the running replica's context; `variable` and `tensor` are NULL or live
/// handles.
#[no_mangle]
pub unsafe extern "C" fn tutti_device_variable_update_in(
    ctx: *const tutti_replica_context,
    variable: *const tutti_device_variable,
    how: tutti_assign,
    aggregation: tutti_aggregation,
    tensor: *const tutti_tensor,
) -> tutti_result {
    boundary("tutti_device_variable_update_in", || {
        // SAFETY: as the caller promises.
        let (c, v, t) = unsafe { (ctx_ref(ctx)?, var_ref(variable)?, tensor_lock(tensor)?) };
        let how = how_of(how)?;
        let agg = aggregation_of(aggregation)?;
        tutti::for_each_dtype!(v.dtype, T => { update_in(v.get::<T>()?, c, &t, agg, how)? });
        Ok(())
    })
}

/// From outside `tutti_strategy_run`: each local replica's update (`per_replica[i]`: `count`
/// elements of `dtype`, placed on local replica `i`'s device) combined across every replica in
/// sync by `aggregation`, then `assign`ed, added or subtracted (`how`) to every copy. A
/// collective: under a multi-worker strategy every worker calls it. `count` and `dtype` come in
/// the order of the `tutti_tensor` calls (`tutti_variable_update` takes `dtype` first).
///
/// Thread-safety: not inside a replica function; one call at a time per strategy.
///
/// # Safety
///
/// `strategy` and `variable` are NULL or live handles; `per_replica` is NULL or holds one
/// pointer per local replica, each to `count` readable elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn tutti_device_variable_update(
    strategy: *const tutti_strategy,
    variable: *const tutti_device_variable,
    how: tutti_assign,
    aggregation: tutti_aggregation,
    count: usize,
    dtype: tutti_dtype,
    per_replica: *const *const c_void,
) -> tutti_result {
    boundary("tutti_device_variable_update", || {
        // SAFETY: as the caller promises.
        let (s, v) = unsafe { (strategy_ref(strategy)?, var_ref(variable)?) };
        let how = how_of(how)?;
        let agg = aggregation_of(aggregation)?;
        let d = types::dtype(dtype).map_err(Failure::invalid)?;
        let len = byte_len(count, 1, d).map_err(Failure::invalid)?;
        if per_replica.is_null() {
            return Err(Failure::invalid("per_replica is NULL"));
        }
        // SAFETY: the caller promises one pointer per local replica.
        let ptrs = unsafe { std::slice::from_raw_parts(per_replica, s.num_local_replicas()) };
        for (i, p) in ptrs.iter().enumerate() {
            check(*p, len, d, &format!("per_replica[{i}]")).map_err(Failure::invalid)?;
        }
        tutti::for_each_dtype!(d, T => {
            let var = v.get::<T>()?;
            if count != var.len() {
                return Err(Failure::invalid(format!(
                    "count {count}, but the device variable holds {} elements",
                    var.len()
                )));
            }
            // SAFETY: checked above; the caller promises the lengths.
            let updates = PerReplica(
                ptrs.iter()
                    .map(|p| typed_ref::<T>(unsafe { buffers::slice(*p, len) }).to_vec())
                    .collect(),
            );
            update_cross(var, s, &updates, agg, how)?;
        });
        Ok(())
    })
}

/// Copy local replica `replica`'s copy of the variable to `out`: `count` elements of `dtype`,
/// the variable's dtype and length (in the order of `tutti_tensor_read`). Outside
/// `tutti_strategy_run` every copy holds the value.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `variable` is NULL or a live handle; `out` is NULL or holds `count` writable elements of
/// `dtype`.
#[no_mangle]
pub unsafe extern "C" fn tutti_device_variable_read(
    variable: *const tutti_device_variable,
    replica: usize,
    count: usize,
    dtype: tutti_dtype,
    out: *mut c_void,
) -> tutti_result {
    boundary("tutti_device_variable_read", || {
        // SAFETY: as the caller promises.
        let v = unsafe { var_ref(variable) }?;
        let d = types::dtype(dtype).map_err(Failure::invalid)?;
        let len = byte_len(count, 1, d).map_err(Failure::invalid)?;
        check(out, len, d, "out").map_err(Failure::invalid)?;
        tutti::for_each_dtype!(d, T => {
            let var = v.get::<T>()?;
            if count != var.len() {
                return Err(Failure::invalid(format!(
                    "count {count}, but the device variable holds {} elements",
                    var.len()
                )));
            }
            let value = var.read(replica)?;
            // SAFETY: checked above; the caller promises `count` writable elements.
            typed::<T>(unsafe { buffers::slice_mut(out, len) }).copy_from_slice(&value);
        });
        Ok(())
    })
}
