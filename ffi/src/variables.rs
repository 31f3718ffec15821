//! `tutti_strategy_scope_begin`/`_end` and `tutti_variable_*`: TensorFlow's `strategy.scope()`
//! and `tf.Variable` for C trainers. A variable created inside a strategy's scope (on the thread
//! that began it) is that strategy's kind (a copy per replica, or one copy under
//! CentralStorageStrategy) with the chief's initial value; outside any scope, the default
//! strategy's plain variable of one copy.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::Arc;

use tutti::strategy::{Aggregation, PerReplica, Variable};
use tutti::{DType, Element};

use crate::buffers::{self, byte_len, check};
use crate::error::{boundary, boundary_void, tutti_result, Failure};
use crate::strategy::{
    ctx_ref, strategy_ref, tutti_replica_context, tutti_strategy, typed, typed_ref,
};
use crate::types::{self, tutti_dtype};

/// How the replicas' updates of a variable are combined (TensorFlow's `VariableAggregation`).
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiAggregation {
    /// The first replica's update (TensorFlow's NONE and ONLY_FIRST_REPLICA).
    TUTTI_AGGREGATION_ONLY_FIRST_REPLICA = 0,
    /// The sum of every replica's update.
    TUTTI_AGGREGATION_SUM = 1,
    /// The mean of every replica's update.
    TUTTI_AGGREGATION_MEAN = 2,
}

/// A `tutti_aggregation` as it crosses the C boundary: one of the `TUTTI_AGGREGATION_*` values.
pub type tutti_aggregation = u32;

/// A variable (opaque). Created by `tutti_variable_create`, released by
/// `tutti_variable_destroy`.
pub struct tutti_variable {
    dtype: DType,
    /// A `Variable<T>` of `dtype`'s `T`.
    inner: Box<dyn Any + Send + Sync>,
}

impl tutti_variable {
    fn get<T: Element>(&self) -> Result<&Variable<T>, Failure> {
        self.inner.downcast_ref().ok_or_else(|| {
            Failure::invalid(format!("the variable is {}, not {}", self.dtype, T::DTYPE))
        })
    }
}

/// # Safety
///
/// `v` is NULL or a live handle.
unsafe fn var_ref<'a>(v: *const tutti_variable) -> Result<&'a tutti_variable, Failure> {
    // SAFETY: as the caller promises.
    unsafe { v.as_ref() }.ok_or_else(|| Failure::invalid("variable is NULL"))
}

/// The strategy's shared handle.
///
/// # Safety
///
/// `strategy` is NULL or a live handle.
unsafe fn strategy_arc<'a>(
    strategy: *const tutti_strategy,
) -> Result<&'a std::sync::Arc<tutti::strategy::Strategy>, Failure> {
    // SAFETY: as the caller promises.
    unsafe { strategy.as_ref() }
        .map(|s| &s.inner)
        .ok_or_else(|| Failure::invalid("strategy is NULL"))
}

thread_local! {
    /// The scopes this thread entered through the C ABI, innermost last: each handle's address
    /// and its strategy, so that a scope is ended, and a destroyed strategy's scopes dropped,
    /// without reading a handle that may be gone.
    static SCOPES: RefCell<Vec<(usize, Arc<tutti::strategy::Strategy>)>> =
        const { RefCell::new(Vec::new()) };
}

/// End every scope this thread entered on the strategy at `addr` (its handle is being
/// destroyed): the strategy is released with its handle, not kept alive by a scope.
pub(crate) fn end_scopes_of(addr: usize) {
    let ended: Vec<Arc<tutti::strategy::Strategy>> = SCOPES.with(|s| {
        let mut s = s.borrow_mut();
        let mut ended = Vec::new();
        while s.last().is_some_and(|(a, _)| *a == addr) {
            ended.extend(s.pop().map(|(_, st)| st));
        }
        ended
    });
    for st in &ended {
        let _ = tutti::strategy::exit_scope(st);
    }
}

/// Enter `strategy`'s scope on this thread (TensorFlow's `with strategy.scope():`): until
/// `tutti_strategy_scope_end`, `tutti_variable_create` on this thread makes this strategy's
/// kind of variable. Scopes of one strategy nest; another strategy's scope inside it is
/// `TUTTI_ERROR_INVALID_ARGUMENT`. The scope keeps the strategy alive until it ends.
///
/// Thread-safety: callable from any thread; the scope is that thread's.
///
/// # Safety
///
/// `strategy` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_scope_begin(
    strategy: *const tutti_strategy,
) -> tutti_result {
    boundary("tutti_strategy_scope_begin", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy_arc(strategy) }?;
        tutti::strategy::enter_scope(s)?;
        SCOPES.with(|scopes| scopes.borrow_mut().push((strategy as usize, s.clone())));
        Ok(())
    })
}

/// Leave `strategy`'s innermost scope on this thread; `TUTTI_ERROR_INVALID_ARGUMENT` where this
/// thread is not in its scope. The handle is compared, not read: after
/// `tutti_strategy_destroy` (which ends its scopes on the calling thread) this is an error.
///
/// Thread-safety: on the thread that began the scope.
///
/// # Safety
///
/// None beyond the call's: `strategy` is only compared with the handles scopes began on.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_scope_end(strategy: *const tutti_strategy) -> tutti_result {
    boundary("tutti_strategy_scope_end", || {
        if strategy.is_null() {
            return Err(Failure::invalid("strategy is NULL"));
        }
        let top = SCOPES.with(|s| {
            let mut s = s.borrow_mut();
            match s.last() {
                Some((a, _)) if *a == strategy as usize => s.pop().map(|(_, st)| st),
                _ => None,
            }
        });
        let Some(st) = top else {
            return Err(Failure::invalid(
                "scope: this strategy's scope is not the one this thread is in (each scope is \
                 left on the thread that entered it, before its strategy is destroyed)",
            ));
        };
        tutti::strategy::exit_scope(&st)?;
        Ok(())
    })
}

pub(crate) fn aggregation_of(a: tutti_aggregation) -> Result<Aggregation, Failure> {
    use TuttiAggregation as A;
    Ok(match a {
        x if x == A::TUTTI_AGGREGATION_ONLY_FIRST_REPLICA as u32 => Aggregation::OnlyFirstReplica,
        x if x == A::TUTTI_AGGREGATION_SUM as u32 => Aggregation::Sum,
        x if x == A::TUTTI_AGGREGATION_MEAN as u32 => Aggregation::Mean,
        other => {
            return Err(Failure::invalid(format!(
                "aggregation {other} is not a tutti_aggregation (valid: 0..=2)"
            )))
        }
    })
}

/// Create a variable of `count` elements of `dtype` from `initial`, in the scope this thread
/// is in (see `tutti_strategy_scope_begin`; outside any, one plain copy), its cross-replica
/// updates combined by `aggregation`, and write it to `*variable`. Under a multi-worker strategy
/// every worker creates the same variables in the same order, and each starts from the chief's
/// `initial`.
///
/// Thread-safety: callable from any thread (the scope is the calling thread's).
///
/// # Safety
///
/// `initial` holds `count` readable elements of `dtype`; `variable` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_variable_create(
    dtype: tutti_dtype,
    count: usize,
    initial: *const c_void,
    aggregation: tutti_aggregation,
    variable: *mut *mut tutti_variable,
) -> tutti_result {
    boundary("tutti_variable_create", || {
        if variable.is_null() {
            return Err(Failure::invalid("variable is NULL"));
        }
        let d = types::dtype(dtype).map_err(Failure::invalid)?;
        let agg = aggregation_of(aggregation)?;
        let len = byte_len(count, 1, d).map_err(Failure::invalid)?;
        check(initial, len, d, "initial").map_err(Failure::invalid)?;
        // SAFETY: checked; the caller promises `count` readable elements.
        let bytes = unsafe { buffers::slice(initial, len) };
        let inner: Box<dyn Any + Send + Sync>;
        tutti::for_each_dtype!(d, T => {
            inner = Box::new(Variable::<T>::with_aggregation(typed_ref::<T>(bytes), agg)?)
        });
        let v = Box::new(tutti_variable { dtype: d, inner });
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { variable.write(Box::into_raw(v)) };
        Ok(())
    })
}

/// Release a variable. NULL is accepted and ignored.
///
/// Thread-safety: no other call may be using `variable`, nor use it afterwards.
///
/// # Safety
///
/// `variable` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_variable_destroy(variable: *mut tutti_variable) {
    boundary_void("tutti_variable_destroy", || {
        if !variable.is_null() {
            // SAFETY: a live handle from Box::into_raw, released once.
            drop(unsafe { Box::from_raw(variable) });
        }
    })
}

/// Read the variable's value into `out`: `count` elements of `dtype`, its dtype and length.
/// Inside a replica function, pass its `ctx` to read that replica's copy; NULL reads the
/// value outside `tutti_strategy_run` (every copy holds it).
///
/// Thread-safety: callable from any thread; with `ctx`, only inside the replica function that
/// was handed it.
///
/// # Safety
///
/// `variable` is NULL or a live handle; `ctx` is NULL or a live replica context; `out` holds
/// `count` writable elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn tutti_variable_read(
    variable: *const tutti_variable,
    ctx: *const tutti_replica_context,
    dtype: tutti_dtype,
    count: usize,
    out: *mut c_void,
) -> tutti_result {
    boundary("tutti_variable_read", || {
        // SAFETY: as the caller promises.
        let v = unsafe { var_ref(variable) }?;
        let d = types::dtype(dtype).map_err(Failure::invalid)?;
        let len = byte_len(count, 1, d).map_err(Failure::invalid)?;
        check(out, len, d, "out").map_err(Failure::invalid)?;
        let ctx = if ctx.is_null() {
            None
        } else {
            // SAFETY: as the caller promises.
            Some(unsafe { ctx_ref(ctx) }?)
        };
        tutti::for_each_dtype!(d, T => {
            let var = v.get::<T>()?;
            let value = match ctx {
                Some(c) => var.read_in(c),
                None => var.value(),
            };
            if value.len() != count {
                return Err(Failure::invalid(format!(
                    "count {count}, but the variable holds {} elements",
                    value.len()
                )));
            }
            // SAFETY: checked above; the caller promises `count` writable elements.
            typed::<T>(unsafe { buffers::slice_mut(out, len) }).copy_from_slice(&value);
        });
        Ok(())
    })
}

/// The dtype and the bytes of each local replica's `count` elements of `dtype` at
/// `per_replica` (one pointer per local replica of `s`), each pointer checked.
///
/// # Safety
///
/// `per_replica` is NULL or holds one pointer per local replica, each to `count` readable
/// elements of `dtype`.
pub(crate) unsafe fn per_replica_parts<'a>(
    s: &tutti::strategy::Strategy,
    dtype: tutti_dtype,
    count: usize,
    per_replica: *const *const c_void,
) -> Result<(DType, Vec<&'a [u8]>), Failure> {
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
    // SAFETY: checked; the caller promises the lengths.
    Ok((
        d,
        ptrs.iter()
            .map(|p| unsafe { buffers::slice(*p, len) })
            .collect(),
    ))
}

/// How `tutti_variable_update` changes the variable.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiAssign {
    /// `assign`: set it to the combined value.
    TUTTI_ASSIGN = 0,
    /// `assign_add`: add the combined update.
    TUTTI_ASSIGN_ADD = 1,
    /// `assign_sub`: subtract the combined update.
    TUTTI_ASSIGN_SUB = 2,
}

/// A `tutti_assign` as it crosses the C boundary: one of the `TUTTI_ASSIGN*` values.
pub type tutti_assign = u32;

/// From outside `tutti_strategy_run`: combine the local replicas' updates (`per_replica[i]`:
/// `count` elements of `dtype` from local replica `i`, across every replica in sync) by the
/// variable's aggregation, and `assign`, `assign_add` or `assign_sub` the result (TensorFlow's
/// cross-replica `variable.assign*`). Every copy changes alike.
///
/// Thread-safety: not inside a replica function; one call at a time per strategy.
///
/// # Safety
///
/// `strategy` and `variable` are NULL or live handles; `per_replica` is NULL or holds one
/// pointer per local replica, each to `count` readable elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn tutti_variable_update(
    strategy: *const tutti_strategy,
    variable: *const tutti_variable,
    how: tutti_assign,
    dtype: tutti_dtype,
    count: usize,
    per_replica: *const *const c_void,
) -> tutti_result {
    boundary("tutti_variable_update", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy_ref(strategy) }?;
        // SAFETY: as the caller promises.
        let v = unsafe { var_ref(variable) }?;
        // SAFETY: as the caller promises.
        let (d, parts) = unsafe { per_replica_parts(s, dtype, count, per_replica) }?;
        tutti::for_each_dtype!(d, T => {
            let var = v.get::<T>()?;
            let updates = PerReplica(parts.iter().map(|b| typed_ref::<T>(b).to_vec()).collect());
            match how {
                h if h == TuttiAssign::TUTTI_ASSIGN as u32 => var.assign(s, &updates)?,
                h if h == TuttiAssign::TUTTI_ASSIGN_ADD as u32 => var.assign_add(s, &updates)?,
                h if h == TuttiAssign::TUTTI_ASSIGN_SUB as u32 => var.assign_sub(s, &updates)?,
                other => {
                    return Err(Failure::invalid(format!(
                        "how {other} is not a tutti_assign (valid: 0..=2)"
                    )))
                }
            }
        });
        Ok(())
    })
}
