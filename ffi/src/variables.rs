//! `tutti_strategy_scope_begin`/`_end` and `tutti_variable_*`: TensorFlow's `strategy.scope()`
//! and `tf.Variable` for C trainers. A variable created inside a strategy's scope (on the thread
//! that began it) is that strategy's kind (a copy per replica, or one copy under
//! CentralStorageStrategy) with the chief's initial value; outside any scope, the default
//! strategy's plain variable of one copy.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::Arc;

use tutti::strategy::ps::Coordinator;
use tutti::strategy::{Aggregation, PerReplica, Variable};
use tutti::{DType, Element};

use crate::buffers::{self, byte_len, check};
use crate::error::{boundary, boundary_void, tutti_result, Failure};
use crate::ps::tutti_ps_coordinator;
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

    /// Its index among a parameter-server job's variables, where it lives on the ps tasks.
    fn ps_index(&self) -> Option<usize> {
        fn of<T: Element>(v: &tutti_variable) -> Option<usize> {
            let var = v.inner.downcast_ref::<Variable<T>>()?;
            var.as_sharded().map(|s| s.id().index())
        }
        let i;
        tutti::for_each_dtype!(self.dtype, T => { i = of::<T>(self) });
        i
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

/// Whose scope a C caller began: a strategy's or a parameter-server coordinator's.
#[derive(Clone)]
enum Owner {
    Strategy(Arc<tutti::strategy::Strategy>),
    Coordinator(Arc<Coordinator>),
}

impl Owner {
    fn exit(&self) -> tutti::Result<()> {
        match self {
            Owner::Strategy(s) => tutti::strategy::exit_scope(s),
            Owner::Coordinator(c) => tutti::strategy::exit_coordinator_scope(c),
        }
    }
}

thread_local! {
    /// The scopes this thread entered through the C ABI, innermost last: each handle's address
    /// and its owner, so that a scope is ended, and a destroyed handle's scopes dropped,
    /// without reading a handle that may be gone.
    static SCOPES: RefCell<Vec<(usize, Owner)>> = const { RefCell::new(Vec::new()) };
}

/// End every scope this thread entered on the strategy or coordinator at `addr` (its handle is
/// being destroyed): it is released with its handle, not kept alive by a scope.
pub(crate) fn end_scopes_of(addr: usize) {
    // `try_with`: at exit a thread's storage may be gone before a handle is destroyed (a C++
    // static, an atexit handler), its scopes with it.
    let ended: Vec<Owner> = SCOPES
        .try_with(|s| {
            let mut s = s.borrow_mut();
            let mut ended = Vec::new();
            while s.last().is_some_and(|(a, _)| *a == addr) {
                ended.extend(s.pop().map(|(_, o)| o));
            }
            ended
        })
        .unwrap_or_default();
    for o in &ended {
        let _ = o.exit();
    }
}

/// Record the scope just entered on the handle at `addr` (left again where this thread's
/// storage is gone, at its exit).
fn begun(addr: usize, owner: Owner) -> Result<(), Failure> {
    let recorded = SCOPES.try_with(|scopes| scopes.borrow_mut().push((addr, owner.clone())));
    if recorded.is_err() {
        let _ = owner.exit();
        return Err(Failure::invalid(
            "scope: this thread is exiting (its scopes are gone); begin a scope before",
        ));
    }
    Ok(())
}

/// Leave the innermost scope on this thread, where it was begun on the handle at `addr`.
fn end_scope(addr: usize, what: &str) -> Result<(), Failure> {
    let top = SCOPES
        .try_with(|s| {
            let mut s = s.borrow_mut();
            match s.last() {
                Some((a, _)) if *a == addr => s.pop().map(|(_, o)| o),
                _ => None,
            }
        })
        .ok()
        .flatten();
    let Some(owner) = top else {
        return Err(Failure::invalid(format!(
            "scope: this {what}'s scope is not the one this thread is in (each scope is left \
             on the thread that entered it, before its {what} is destroyed)"
        )));
    };
    owner.exit()?;
    Ok(())
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
        begun(strategy as usize, Owner::Strategy(s.clone()))
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
        end_scope(strategy as usize, "strategy")
    })
}

/// Enter the scope of the ParameterServerStrategy whose chief holds `coordinator`, on this
/// thread (TensorFlow's `with strategy.scope():` on the chief): until
/// `tutti_ps_coordinator_scope_end`, `tutti_variable_create` on this thread makes a variable
/// on the parameter servers (f32, f64, f16 or bf16), sharded by the strategy's partitioner and
/// stepped by `w -= gradient` (a step's gradient, `tutti_ps_step_push` with its own rule, or
/// `tutti_variable_update`). Its index among the job's variables, which a step reads with
/// `tutti_ps_step_variable`, is `tutti_variable_ps_index`'s. Inside another strategy's scope
/// it is `TUTTI_ERROR_INVALID_ARGUMENT`; scopes of one coordinator nest. The scope keeps the
/// coordinator's state alive until it ends.
///
/// Thread-safety: callable from any thread; the scope is that thread's.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_scope_begin(
    coordinator: *const tutti_ps_coordinator,
) -> tutti_result {
    boundary("tutti_ps_coordinator_scope_begin", || {
        // SAFETY: as the caller promises.
        let c = &unsafe { coordinator.as_ref() }
            .ok_or_else(|| Failure::invalid("coordinator is NULL"))?
            .inner;
        tutti::strategy::enter_coordinator_scope(c)?;
        begun(coordinator as usize, Owner::Coordinator(c.clone()))
    })
}

/// Leave `coordinator`'s innermost scope on this thread; `TUTTI_ERROR_INVALID_ARGUMENT` where
/// this thread is not in its scope (after `tutti_ps_coordinator_shutdown` or `_destroy`, which
/// end its scopes on the calling thread, too).
///
/// Thread-safety: on the thread that began the scope.
///
/// # Safety
///
/// None beyond the call's: `coordinator` is only compared with the handles scopes began on.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_scope_end(
    coordinator: *const tutti_ps_coordinator,
) -> tutti_result {
    boundary("tutti_ps_coordinator_scope_end", || {
        if coordinator.is_null() {
            return Err(Failure::invalid("coordinator is NULL"));
        }
        end_scope(coordinator as usize, "coordinator")
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
/// value outside `tutti_strategy_run` (every copy holds it), or, for a variable made in a
/// parameter-server coordinator's scope, its value on the ps tasks now.
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
            if var.len() != count {
                return Err(Failure::invalid(format!(
                    "count {count}, but the variable holds {} elements",
                    var.len()
                )));
            }
            let value = match ctx {
                Some(c) => var.read_in(c)?,
                None => var.value()?,
            };
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
/// A variable made in a parameter-server coordinator's scope is updated on the chief with
/// `strategy` NULL and one value, `per_replica[0]`: `TUTTI_ASSIGN` sets it on the ps tasks
/// (steps running meanwhile may push onto the old value or the new), `TUTTI_ASSIGN_ADD` and
/// `TUTTI_ASSIGN_SUB` step it there as the workers' steps do, losing none of theirs.
///
/// Thread-safety: not inside a replica function; one call at a time per strategy (a
/// parameter-server variable: from any thread).
///
/// # Safety
///
/// `strategy` and `variable` are NULL or live handles; `per_replica` is NULL or holds one
/// pointer per local replica (one for a parameter-server variable), each to `count` readable
/// elements of `dtype`.
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
        let v = unsafe { var_ref(variable) }?;
        if how > TuttiAssign::TUTTI_ASSIGN_SUB as u32 {
            return Err(Failure::invalid(format!(
                "how {how} is not a tutti_assign (valid: 0..=2)"
            )));
        }
        if v.ps_index().is_some() {
            if !strategy.is_null() {
                return Err(Failure::invalid(
                    "the variable lives on the parameter servers: update it with strategy NULL \
                     and one value",
                ));
            }
            // SAFETY: the caller promises one pointer to `count` readable elements.
            let (d, value) = unsafe { one_value(dtype, count, per_replica) }?;
            tutti::for_each_dtype!(d, T => {
                let var = v.get::<T>()?.as_sharded().ok_or_else(|| Failure::invalid("not sharded"))?;
                let x = typed_ref::<T>(value);
                match how {
                    h if h == TuttiAssign::TUTTI_ASSIGN as u32 => var.assign(x)?,
                    h if h == TuttiAssign::TUTTI_ASSIGN_ADD as u32 => var.assign_add(x)?,
                    _ => var.assign_sub(x)?,
                }
            });
            return Ok(());
        }
        // SAFETY: as the caller promises.
        let s = unsafe { strategy_ref(strategy) }?;
        // SAFETY: as the caller promises.
        let (d, parts) = unsafe { per_replica_parts(s, dtype, count, per_replica) }?;
        tutti::for_each_dtype!(d, T => {
            let var = v.get::<T>()?;
            let updates = PerReplica(parts.iter().map(|b| typed_ref::<T>(b).to_vec()).collect());
            match how {
                h if h == TuttiAssign::TUTTI_ASSIGN as u32 => var.assign(s, &updates)?,
                h if h == TuttiAssign::TUTTI_ASSIGN_ADD as u32 => var.assign_add(s, &updates)?,
                _ => var.assign_sub(s, &updates)?,
            }
        });
        Ok(())
    })
}

/// The dtype and the bytes of the one value at `per_replica[0]`: `count` elements of `dtype`.
///
/// # Safety
///
/// `per_replica` is NULL or holds one pointer to `count` readable elements of `dtype`.
unsafe fn one_value<'a>(
    dtype: tutti_dtype,
    count: usize,
    per_replica: *const *const c_void,
) -> Result<(DType, &'a [u8]), Failure> {
    let d = types::dtype(dtype).map_err(Failure::invalid)?;
    let len = byte_len(count, 1, d).map_err(Failure::invalid)?;
    if per_replica.is_null() {
        return Err(Failure::invalid("per_replica is NULL"));
    }
    // SAFETY: non-NULL; the caller promises one pointer.
    let p = unsafe { *per_replica };
    check(p, len, d, "per_replica[0]").map_err(Failure::invalid)?;
    // SAFETY: checked; the caller promises the length.
    Ok((d, unsafe { buffers::slice(p, len) }))
}

/// Write the index among the parameter-server job's variables of `variable`, made in a
/// coordinator's scope (`tutti_ps_coordinator_scope_begin`), to `*index`: what a step reads it
/// by (`tutti_ps_step_variable`) and the coordinator's calls take. Another kind of variable is
/// `TUTTI_ERROR_INVALID_ARGUMENT`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `variable` is NULL or a live handle; `index` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_variable_ps_index(
    variable: *const tutti_variable,
    index: *mut usize,
) -> tutti_result {
    boundary("tutti_variable_ps_index", || {
        // SAFETY: as the caller promises.
        let v = unsafe { var_ref(variable) }?;
        if index.is_null() {
            return Err(Failure::invalid("index is NULL"));
        }
        let i = v.ps_index().ok_or_else(|| {
            Failure::invalid(
                "the variable was not made in a parameter-server coordinator's scope \
                 (tutti_ps_coordinator_scope_begin)",
            )
        })?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { index.write(i) };
        Ok(())
    })
}
