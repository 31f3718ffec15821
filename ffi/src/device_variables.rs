//! `tutti_strategy_device_variable` and `tutti_device_variable_*`: a mirrored variable whose
//! copies live in the replicas' device memory (PJRT buffers under TPUStrategy, host memory for
//! CPU replicas), updated from the replicas' tensors where they lie; and `tutti_optimizer_*`,
//! which steps them there.

use std::any::Any;
use std::ffi::{c_char, c_void};

use tutti::strategy::{
    Aggregation, DeviceVariable, Optimizer, PerReplica, ReplicaContext, Strategy,
};
use tutti::{DType, DeviceTensor, Element};

use crate::checkpoint::{text, tutti_checkpoint};
use crate::ps::{read_update, tutti_ps_update};

use crate::buffers::{self, byte_len, check};
use crate::comm::out_ptr;
use crate::error::{boundary, boundary_void, tutti_result, Failure};
use crate::strategy::{
    ctx_ref, strategy_ref, tutti_replica_context, tutti_strategy, typed, typed_ref,
};
use crate::tensor::{input, tensor_lock, tutti_tensor};
use crate::types::{self, tutti_dtype};
use crate::variables::{
    aggregation_of, per_replica_parts, tutti_aggregation, tutti_assign, TuttiAssign,
};

/// A variable whose copies live in the replicas' device memory (opaque). Created by
/// `tutti_strategy_device_variable`, released by `tutti_device_variable_destroy`.
pub struct tutti_device_variable {
    dtype: DType,
    /// Elements in each copy.
    len: usize,
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
        let raw = Box::into_raw(Box::new(tutti_device_variable {
            dtype: d,
            len: count,
            inner,
        }));
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
        if let Ok(d) = types::dtype(dtype) {
            if count != v.len || d != v.dtype {
                return Err(Failure::invalid(format!(
                    "count {count} of {d}, but the device variable holds {} elements of {}",
                    v.len, v.dtype
                )));
            }
        }
        // SAFETY: as the caller promises.
        let (d, parts) = unsafe { per_replica_parts(s, dtype, count, per_replica) }?;
        tutti::for_each_dtype!(d, T => {
            let updates = PerReplica(parts.iter().map(|b| typed_ref::<T>(b).to_vec()).collect());
            update_cross(v.get::<T>()?, s, &updates, agg, how)?;
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

/// An optimizer (opaque): Keras's SGD, momentum, Nesterov or Adam, for device variables.
/// Created by `tutti_optimizer_create`, released by `tutti_optimizer_destroy`.
pub struct tutti_optimizer {
    inner: Optimizer,
}

/// # Safety
///
/// `o` is NULL or a live handle.
unsafe fn optimizer_ref<'a>(o: *const tutti_optimizer) -> Result<&'a Optimizer, Failure> {
    // SAFETY: as the caller promises.
    unsafe { o.as_ref() }
        .map(|o| &o.inner)
        .ok_or_else(|| Failure::invalid("optimizer is NULL"))
}

/// `count` handles at `ptrs` (the argument `name`), each checked non-NULL.
///
/// # Safety
///
/// `ptrs` is NULL or holds `count` pointers.
unsafe fn handles<'a, T>(
    ptrs: *const *const T,
    count: usize,
    name: &str,
) -> Result<Vec<&'a T>, Failure> {
    if count == 0 {
        return Ok(Vec::new());
    }
    if ptrs.is_null() {
        return Err(Failure::invalid(format!("{name} is NULL")));
    }
    // SAFETY: the caller promises `count` pointers.
    let ptrs = unsafe { std::slice::from_raw_parts(ptrs, count) };
    ptrs.iter()
        .enumerate()
        // SAFETY: each NULL or live, as the caller promises.
        .map(|(i, p)| {
            unsafe { p.as_ref() }.ok_or_else(|| Failure::invalid(format!("{name}[{i}] is NULL")))
        })
        .collect()
}

/// The dtype every one of `vars` holds; variables of several dtypes are an argument error.
fn one_dtype(vars: &[&tutti_device_variable]) -> Result<Option<DType>, Failure> {
    let Some(first) = vars.first() else {
        return Ok(None);
    };
    if let Some((i, v)) = vars
        .iter()
        .enumerate()
        .find(|(_, v)| v.dtype != first.dtype)
    {
        return Err(Failure::invalid(format!(
            "variables[0] is {} but variables[{i}] {}: one call steps variables of one dtype",
            first.dtype, v.dtype
        )));
    }
    Ok(Some(first.dtype))
}

/// `f::<T>()` for a float dtype; another is an argument error.
macro_rules! for_each_param {
    ($d:expr, $t:ident => $body:block) => {
        match $d {
            DType::F32 => { type $t = f32; $body }
            DType::F64 => { type $t = f64; $body }
            DType::F16 => { type $t = tutti::f16; $body }
            DType::BF16 => { type $t = tutti::bf16; $body }
            other => {
                return Err(Failure::invalid(format!(
                    "the variables are {other}; optimizers step float variables (f32, f64, f16, bf16)"
                )))
            }
        }
    };
}

/// Create an optimizer stepping by `rule` (a `tutti_ps_update` from `TUTTI_PS_UPDATE_INIT`;
/// its `slots` key is not used) and write it to `*out`. A learning rate that is negative
/// or not finite, or a hyper-parameter out of range, is an argument error naming it.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `rule` is NULL or points to `rule->struct_size` readable bytes; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_optimizer_create(
    rule: *const tutti_ps_update,
    out: *mut *mut tutti_optimizer,
) -> tutti_result {
    boundary("tutti_optimizer_create", || {
        let out = out_ptr(out, "out")?;
        if rule.is_null() {
            return Err(Failure::invalid("rule is NULL"));
        }
        // SAFETY: as the caller promises.
        let (rule, _) = unsafe { read_update(rule, "rule") }?;
        let inner = Optimizer::new(rule)?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(Box::into_raw(Box::new(tutti_optimizer { inner }))) };
        Ok(())
    })
}

/// Release an optimizer (its slots on the devices too). NULL is accepted and ignored.
///
/// Thread-safety: no other call may be using `optimizer`, nor use it afterwards.
///
/// # Safety
///
/// `optimizer` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_optimizer_destroy(optimizer: *mut tutti_optimizer) {
    boundary_void("tutti_optimizer_destroy", || {
        if !optimizer.is_null() {
            // SAFETY: a live handle from Box::into_raw, released once.
            drop(unsafe { Box::from_raw(optimizer) });
        }
    })
}

/// Write the steps the optimizer has taken (one per `tutti_optimizer_apply_device_gradients`
/// call of the replicas in sync) to `*iterations`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `optimizer` is NULL or a live handle; `iterations` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_optimizer_iterations(
    optimizer: *const tutti_optimizer,
    iterations: *mut u64,
) -> tutti_result {
    boundary("tutti_optimizer_iterations", || {
        // SAFETY: as the caller promises.
        let o = unsafe { optimizer_ref(optimizer) }?;
        let out = out_ptr(iterations, "iterations")?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(o.iterations()) };
        Ok(())
    })
}

/// From the next step on, step at `learning_rate` (as setting Keras's `optimizer.learning_rate`
/// does; a schedule is this call before each step with the schedule's rate). Negative or not
/// finite: an argument error naming it, and the rate stays as it was. Set it alike on every
/// worker, between steps.
///
/// Thread-safety: callable from any thread. A step reads the rate as it begins on each replica:
/// set it before any replica begins the step, or from every replica of the step with one value
/// before it calls `tutti_optimizer_apply_device_gradients`.
///
/// # Safety
///
/// `optimizer` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_optimizer_set_learning_rate(
    optimizer: *const tutti_optimizer,
    learning_rate: f32,
) -> tutti_result {
    boundary("tutti_optimizer_set_learning_rate", || {
        // SAFETY: as the caller promises.
        let o = unsafe { optimizer_ref(optimizer) }?;
        o.set_learning_rate(learning_rate)?;
        Ok(())
    })
}

/// Write the learning rate the optimizer's next step takes to `*learning_rate`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `optimizer` is NULL or a live handle; `learning_rate` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_optimizer_learning_rate(
    optimizer: *const tutti_optimizer,
    learning_rate: *mut f32,
) -> tutti_result {
    boundary("tutti_optimizer_learning_rate", || {
        // SAFETY: as the caller promises.
        let o = unsafe { optimizer_ref(optimizer) }?;
        let out = out_ptr(learning_rate, "learning_rate")?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(o.learning_rate()) };
        Ok(())
    })
}

/// Inside a replica function: each of the `count` gradients (`gradients[i]`, a tensor on this
/// replica's device of `variables[i]`'s dtype and length) summed in place across every replica
/// in sync, where it lies, then this replica's copy of `variables[i]` stepped by the sum on
/// its device, the rule's slots beside it (on an XLA device one compiled program per
/// variable). Collective: every replica calls it with the same variables in the same order;
/// the variables are of one float dtype (variables of several dtypes take a call each, and each
/// call counts in `tutti_optimizer_iterations`).
///
/// Thread-safety: only inside the replica function that was handed `ctx`.
///
/// # Safety
///
/// `ctx` is NULL or the running replica's context; `optimizer` is NULL or a live handle;
/// `gradients` and `variables` are NULL or hold `count` pointers, each NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_optimizer_apply_device_gradients(
    ctx: *const tutti_replica_context,
    optimizer: *const tutti_optimizer,
    count: usize,
    gradients: *const *mut tutti_tensor,
    variables: *const *const tutti_device_variable,
) -> tutti_result {
    boundary("tutti_optimizer_apply_device_gradients", || {
        // SAFETY: as the caller promises.
        let (c, o) = unsafe { (ctx_ref(ctx)?, optimizer_ref(optimizer)?) };
        // SAFETY: as the caller promises.
        let grads =
            unsafe { handles(gradients.cast::<*const tutti_tensor>(), count, "gradients") }?;
        // SAFETY: as the caller promises.
        let vars = unsafe { handles(variables, count, "variables") }?;
        let Some(d) = one_dtype(&vars)? else {
            // No variables: a step all the same, counted, as in Rust.
            o.apply_device_gradients::<f32>(c, &mut [])?;
            return Ok(());
        };
        let mut held = Vec::with_capacity(count);
        for g in &grads {
            // SAFETY: a live handle, as the caller promises.
            held.push(unsafe { tensor_lock(*g) }?);
        }
        for_each_param!(d, T => {
            let typed: Vec<&DeviceVariable<T>> =
                vars.iter().map(|v| v.get::<T>()).collect::<Result<_, _>>()?;
            let mut pairs: Vec<(&mut DeviceTensor, &DeviceVariable<T>)> =
                held.iter_mut().map(|g| &mut **g).zip(typed).collect();
            o.apply_device_gradients(c, &mut pairs)?;
        });
        Ok(())
    })
}

/// The `count` names at `names` and variables at `variables`.
///
/// # Safety
///
/// As the callers': each array NULL or `count` pointers, each NULL or live.
unsafe fn named<'a>(
    count: usize,
    names: *const *const c_char,
    variables: *const *const tutti_device_variable,
) -> Result<(Vec<&'a str>, Vec<&'a tutti_device_variable>), Failure> {
    // SAFETY: as the caller promises.
    let vars = unsafe { handles(variables, count, "variables") }?;
    if count > 0 && names.is_null() {
        return Err(Failure::invalid("names is NULL"));
    }
    let mut ns = Vec::with_capacity(count);
    for i in 0..count {
        // SAFETY: `count` pointers, as the caller promises; each NULL or a C string.
        ns.push(unsafe { text(*names.add(i), &format!("names[{i}]")) }?);
    }
    Ok((ns, vars))
}

/// Add the optimizer's state to `checkpoint` under `name`: `{name}/iterations` and each
/// variable's slots under `{name}/{names[i]}/` (`momentum`; Adam's `m`, `v` and `t`), copied
/// from the first copy's device; the names and format of tutti's optimizers everywhere (Rust's
/// `Optimizer::save`, Python's `Checkpoint`). Outside `tutti_strategy_run`; the variables are
/// of one float dtype.
///
/// Thread-safety: not inside a replica function.
///
/// # Safety
///
/// `optimizer` and `checkpoint` are NULL or live handles; `name` is NULL or a NUL-terminated
/// string; `names` and `variables` are NULL or hold `count` pointers (C strings, live handles).
#[no_mangle]
pub unsafe extern "C" fn tutti_optimizer_save(
    optimizer: *const tutti_optimizer,
    checkpoint: *mut tutti_checkpoint,
    name: *const c_char,
    count: usize,
    names: *const *const c_char,
    variables: *const *const tutti_device_variable,
) -> tutti_result {
    boundary("tutti_optimizer_save", || {
        // SAFETY: as the caller promises.
        let o = unsafe { optimizer_ref(optimizer) }?;
        // SAFETY: as the caller promises.
        let ckpt = unsafe { checkpoint.as_mut() }
            .map(|c| &mut c.inner)
            .ok_or_else(|| Failure::invalid("checkpoint is NULL"))?;
        // SAFETY: as the caller promises.
        let (name, (names, vars)) =
            unsafe { (text(name, "name")?, named(count, names, variables)?) };
        let d = one_dtype(&vars)?.unwrap_or(DType::F32);
        for_each_param!(d, T => {
            let typed = names
                .iter()
                .zip(&vars)
                .map(|(n, v)| Ok((*n, v.get::<T>()?)))
                .collect::<Result<Vec<_>, Failure>>()?;
            o.save_device(ckpt, name, &typed)?;
        });
        Ok(())
    })
}

/// Take back the state `tutti_optimizer_save` (or any tutti optimizer) added to `checkpoint`
/// under `name` for these variables: everything checked before anything is set (a slot
/// missing, or of another length or type, is an error naming it); a checkpoint with none of
/// this optimizer's state leaves it as it is, with a warning. Each copy's slots go to its
/// device at its next step. A call takes all of its variables' state or none; variables of
/// several dtypes take a call each. Outside `tutti_strategy_run`, on every worker.
///
/// Thread-safety: not inside a replica function.
///
/// # Safety
///
/// As `tutti_optimizer_save`.
#[no_mangle]
pub unsafe extern "C" fn tutti_optimizer_restore(
    optimizer: *const tutti_optimizer,
    checkpoint: *const tutti_checkpoint,
    name: *const c_char,
    count: usize,
    names: *const *const c_char,
    variables: *const *const tutti_device_variable,
) -> tutti_result {
    boundary("tutti_optimizer_restore", || {
        // SAFETY: as the caller promises.
        let o = unsafe { optimizer_ref(optimizer) }?;
        // SAFETY: as the caller promises.
        let ckpt = unsafe { checkpoint.as_ref() }
            .map(|c| &c.inner)
            .ok_or_else(|| Failure::invalid("checkpoint is NULL"))?;
        // SAFETY: as the caller promises.
        let (name, (names, vars)) =
            unsafe { (text(name, "name")?, named(count, names, variables)?) };
        let d = one_dtype(&vars)?.unwrap_or(DType::F32);
        for_each_param!(d, T => {
            let typed = names
                .iter()
                .zip(&vars)
                .map(|(n, v)| Ok((*n, v.get::<T>()?)))
                .collect::<Result<Vec<_>, Failure>>()?;
            o.restore_device(ckpt, name, &typed)?;
        });
        Ok(())
    })
}
