//! `tutti_ps_*`: TensorFlow's `ParameterServerStrategy` and `ClusterCoordinator` for C trainers
//! (and the Python package's). Every task of the job creates the strategy and calls
//! `tutti_ps_run_role` with the same step function: a `ps` task serves its variables' shards, a
//! `worker` runs the steps it is sent, each until the coordinator shuts the job down; the
//! `chief` gets a `tutti_ps_coordinator`, which creates the variables, schedules steps
//! (`tutti_ps_coordinator_schedule`, `_join`, `_fetch`) and reads the variables back.

use std::ffi::{c_char, c_void, CStr};
use std::time::Duration;

use tutti::strategy::ps::{
    Coordinator, ParameterServerStrategy, Partitioner, RemoteValue, Role, StepContext, Values,
    VariableId, MAX_STEP_BYTES,
};
use tutti::strategy::Rule;

use crate::error::{boundary, boundary_void, tutti_result, Failure, TuttiResult};
use crate::types::tutti_dtype;

/// How variables are cut into shards across the ps tasks (TensorFlow's partitioners).
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiPartitioner {
    /// At most `value` shards, and no more than there are ps tasks.
    TUTTI_PARTITIONER_MAX_SHARDS = 0,
    /// Exactly `value` shards (TensorFlow's `FixedShardsPartitioner`).
    TUTTI_PARTITIONER_FIXED_SHARDS = 1,
    /// Shards of at least `value` bytes, no more than there are ps tasks
    /// (`MinSizePartitioner`).
    TUTTI_PARTITIONER_MIN_SHARD_BYTES = 2,
    /// Shards of at most `value` bytes (`MaxSizePartitioner`).
    TUTTI_PARTITIONER_MAX_SHARD_BYTES = 3,
}

/// A `tutti_partitioner` as it crosses the C boundary: one of the `TUTTI_PARTITIONER_*` values.
pub type tutti_partitioner = u32;

/// How the ps tasks step a variable by a gradient (Keras's optimizers, applied where the
/// variable lives).
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiPsRule {
    /// `w -= lr * g`; with `momentum`, `v = momentum * v - lr * g; w += v` (`nesterov`:
    /// `w += momentum * v - lr * g`).
    TUTTI_PS_RULE_SGD = 0,
    /// Adam: `lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + epsilon)`, `t` the pushes the
    /// shard has taken with these slots.
    TUTTI_PS_RULE_ADAM = 1,
}

/// A `tutti_ps_rule` as it crosses the C boundary: one of the `TUTTI_PS_RULE_*` values.
pub type tutti_ps_rule = u32;

/// An update rule for parameter-server variables. Start from `TUTTI_PS_UPDATE_INIT` (plain SGD
/// at 0.01, Adam's hyper-parameters at Keras's defaults), then set `rule` and the fields it
/// uses. The rule's state (momentum, Adam's moments) lives beside each shard on its ps task,
/// under the key `slots`: one key per optimizer, so that two optimizers stepping one variable
/// keep apart. Hyper-parameters are float32 whatever the variable's dtype; f16 and bf16
/// variables are stepped in float32 arithmetic.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct tutti_ps_update {
    /// `sizeof(tutti_ps_update)` as the caller compiled it.
    pub struct_size: usize,
    /// A `TUTTI_PS_RULE_*` value.
    pub rule: tutti_ps_rule,
    /// The learning rate (finite, not negative).
    pub learning_rate: f32,
    /// SGD: momentum (0: none).
    pub momentum: f32,
    /// SGD: nonzero for Nesterov momentum.
    pub nesterov: u32,
    /// Adam: the first moment's decay.
    pub beta_1: f32,
    /// Adam: the second moment's decay.
    pub beta_2: f32,
    /// Adam: added to the root of the second moment.
    pub epsilon: f32,
    /// Zero.
    pub reserved: u32,
    /// The key of the rule's state on the ps tasks.
    pub slots: u64,
}

/// Read the caller's update rule (NULL: `w -= gradient`, SGD at learning rate 1).
///
/// # Safety
///
/// `u` is NULL or points to at least `u->struct_size` readable bytes.
pub(crate) unsafe fn read_update(
    u: *const tutti_ps_update,
    arg: &str,
) -> Result<(Rule, u64), Failure> {
    let Some(size) = (!u.is_null())
        // SAFETY: the first field is always there.
        .then(|| unsafe { std::ptr::addr_of!((*u).struct_size).read_unaligned() })
    else {
        return Ok((
            Rule::Sgd {
                learning_rate: 1.0,
                momentum: 0.0,
                nesterov: false,
            },
            0,
        ));
    };
    let known = std::mem::size_of::<tutti_ps_update>();
    // SAFETY: the caller promises `size` readable bytes.
    unsafe {
        crate::config::check_struct_size(
            u.cast(),
            size,
            known,
            known,
            arg,
            "tutti_ps_update",
            "initialize it with TUTTI_PS_UPDATE_INIT",
        )
    }?;
    // SAFETY: checked to hold a whole struct.
    let u = unsafe { u.read_unaligned() };
    if u.reserved != 0 {
        return Err(Failure::invalid(format!(
            "{arg}->reserved is {}; leave it 0 (TUTTI_PS_UPDATE_INIT does)",
            u.reserved
        )));
    }
    let rule = match u.rule {
        r if r == TuttiPsRule::TUTTI_PS_RULE_SGD as u32 => Rule::Sgd {
            learning_rate: u.learning_rate,
            momentum: u.momentum,
            nesterov: u.nesterov != 0,
        },
        r if r == TuttiPsRule::TUTTI_PS_RULE_ADAM as u32 => Rule::Adam {
            learning_rate: u.learning_rate,
            beta_1: u.beta_1,
            beta_2: u.beta_2,
            epsilon: u.epsilon,
        },
        other => {
            return Err(Failure::invalid(format!(
                "{arg}->rule {other} is not a tutti_ps_rule (valid: 0..=1)"
            )))
        }
    };
    Ok((rule, u.slots))
}

/// `count` elements of `dtype` at `ptr`, named `name`, copied: a float dtype, not NULL unless
/// `count` is 0, aligned.
///
/// # Safety
///
/// `ptr` is NULL or holds `count` readable elements of `dtype`.
unsafe fn values_at(
    dtype: tutti_dtype,
    ptr: *const c_void,
    count: usize,
    name: &str,
) -> Result<Values, Failure> {
    let d = crate::types::dtype(dtype).map_err(Failure::invalid)?;
    Values::zeros(d, 0)?;
    let len = crate::buffers::byte_len(count, 1, d).map_err(Failure::invalid)?;
    crate::buffers::check(ptr, len, d, name).map_err(Failure::invalid)?;
    // SAFETY: checked; the caller promises `count` readable elements.
    let b = unsafe { crate::buffers::slice(ptr, len) };
    Values::from_bytes(d, b).map_err(Failure::invalid)
}

/// A parameter-server strategy (opaque): this task's part of the job. Created by
/// `tutti_ps_strategy_create`, released by `tutti_ps_strategy_destroy`.
pub struct tutti_ps_strategy {
    inner: ParameterServerStrategy,
}

/// The chief's coordinator (opaque). Written by `tutti_ps_run_role` on the chief, released by
/// `tutti_ps_coordinator_shutdown` or `tutti_ps_coordinator_destroy`.
pub struct tutti_ps_coordinator {
    /// Shared with the scopes begun on it and the variables made in them.
    pub(crate) inner: std::sync::Arc<Coordinator>,
}

/// A scheduled step's result (opaque; TensorFlow's `RemoteValue`). Written by
/// `tutti_ps_coordinator_schedule`, read by `tutti_ps_coordinator_fetch`, released by
/// `tutti_ps_remote_value_destroy`.
pub struct tutti_ps_remote_value {
    inner: RemoteValue,
}

/// What a step function gets on a worker (opaque): valid only during that call. It reads the
/// variables and the step's payload and sets the gradients, the loss and what goes back.
pub struct tutti_ps_step {
    ctx: *const StepContext,
    gradients: Vec<Values>,
    loss: f32,
    error: Option<String>,
}

/// A worker's step. Return `TUTTI_SUCCESS`, or a failure code after
/// `tutti_ps_step_set_error` (the step then fails with that message, the worker stays in the
/// job, and the coordinator's `join` or `fetch` returns `TUTTI_ERROR_STEP_FAILED`). It runs on
/// a thread of tutti's, and may run on two threads at once after a worker rejoined.
pub type tutti_ps_step_fn =
    Option<unsafe extern "C" fn(step: *mut tutti_ps_step, user_data: *mut c_void) -> tutti_result>;

/// The step function and its data, as the worker's threads share them.
struct StepFn {
    f: unsafe extern "C" fn(*mut tutti_ps_step, *mut c_void) -> tutti_result,
    user: *mut c_void,
}

impl StepFn {
    /// # Safety
    ///
    /// As the trainer promised of the function (see `tutti_ps_run_role`).
    unsafe fn call(&self, st: &mut tutti_ps_step) -> tutti_result {
        // SAFETY: as the caller promises.
        unsafe { (self.f)(st, self.user) }
    }
}

// SAFETY: the trainer promises the function may be called from any thread with `user_data`
// (see `tutti_ps_run_role`).
unsafe impl Send for StepFn {}
// SAFETY: as above.
unsafe impl Sync for StepFn {}

/// `len` floats at `ptr`, named `name`: not NULL unless `len` is 0, aligned.
fn floats_ok(ptr: *const f32, len: usize, name: &str) -> Result<(), Failure> {
    len.checked_mul(4)
        .ok_or_else(|| Failure::invalid(format!("{name}: {len} elements is too many")))?;
    if len > 0 && ptr.is_null() {
        return Err(Failure::invalid(format!(
            "{name} is NULL but must hold {len} float32 elements"
        )));
    }
    if (ptr as usize) % 4 != 0 {
        return Err(Failure::invalid(format!(
            "{name} ({ptr:p}) is not aligned to 4 bytes, the size of a float32 element"
        )));
    }
    Ok(())
}

/// The `len` bytes at `ptr` (not NULL unless `len` is 0).
///
/// # Safety
///
/// `ptr` is NULL or holds `len` readable bytes.
unsafe fn bytes_at<'a>(ptr: *const c_void, len: usize, name: &str) -> Result<&'a [u8], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Failure::invalid(format!("{name} is NULL but len is {len}")));
    }
    // SAFETY: non-NULL; the caller promises `len` readable bytes.
    Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) })
}

fn partitioner(kind: tutti_partitioner, value: usize) -> Result<Partitioner, Failure> {
    use TuttiPartitioner as K;
    if value == 0 && kind <= K::TUTTI_PARTITIONER_MAX_SHARD_BYTES as u32 {
        return Err(Failure::invalid(
            "partitioner_value 0: a shard count or size is at least 1",
        ));
    }
    Ok(match kind {
        k if k == K::TUTTI_PARTITIONER_MAX_SHARDS as u32 => Partitioner::MaxShards(value),
        k if k == K::TUTTI_PARTITIONER_FIXED_SHARDS as u32 => Partitioner::FixedShards(value),
        k if k == K::TUTTI_PARTITIONER_MIN_SHARD_BYTES as u32 => Partitioner::MinShardBytes(value),
        k if k == K::TUTTI_PARTITIONER_MAX_SHARD_BYTES as u32 => Partitioner::MaxShardBytes(value),
        other => {
            return Err(Failure::invalid(format!(
                "partitioner {other} is not a tutti_partitioner (valid: 0..=3)"
            )))
        }
    })
}

/// Create this task's parameter-server strategy and write it to `*strategy`. `tf_config` is a
/// TF_CONFIG text (`{"cluster": {"chief": [...], "worker": [...], "ps": [...]}, "task":
/// {...}}`), or NULL for this process's environment (TF_CONFIG, `tutti launch --workers N --ps
/// M`). The job's secret comes from the environment (`TUTTI_JOB_TOKEN`), as for every way of
/// joining. `partitioner` and `partitioner_value` (at least 1) shard the variables;
/// `timeout_ms` bounds every wait (0: the default, `TUTTI_TIMEOUT`).
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `tf_config` is NULL or a NUL-terminated string; `strategy` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_strategy_create(
    tf_config: *const c_char,
    partitioner_kind: tutti_partitioner,
    partitioner_value: usize,
    timeout_ms: u64,
    strategy: *mut *mut tutti_ps_strategy,
) -> tutti_result {
    boundary("tutti_ps_strategy_create", || {
        if strategy.is_null() {
            return Err(Failure::invalid("strategy is NULL"));
        }
        let p = partitioner(partitioner_kind, partitioner_value)?;
        let inner = if tf_config.is_null() {
            ParameterServerStrategy::from_env(p)?
        } else {
            // SAFETY: non-NULL; the caller promises a NUL-terminated string.
            let text = unsafe { CStr::from_ptr(tf_config) }
                .to_str()
                .map_err(|_| Failure::invalid("tf_config is not UTF-8"))?;
            ParameterServerStrategy::new(tutti::from_tf_config(text)?, p)?
        };
        let inner = match timeout_ms {
            0 => inner,
            ms => inner.with_timeout(Duration::from_millis(ms)),
        };
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { strategy.write(Box::into_raw(Box::new(tutti_ps_strategy { inner }))) };
        Ok(())
    })
}

/// Release a strategy. NULL is accepted and ignored.
///
/// Thread-safety: no other call may be using `strategy`, nor use it afterwards.
///
/// # Safety
///
/// `strategy` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_strategy_destroy(strategy: *mut tutti_ps_strategy) {
    boundary_void("tutti_ps_strategy_destroy", || {
        if !strategy.is_null() {
            // SAFETY: a live handle from Box::into_raw, released once.
            drop(unsafe { Box::from_raw(strategy) });
        }
    })
}

/// Take this task's role in the job. On the chief, connect to every task and write the
/// coordinator to `*coordinator`. On a ps task or a worker, serve (a worker runs `step` for
/// every step it is sent) until the coordinator shuts the job down, then write NULL to
/// `*coordinator`; a lost ps task ends the job with `TUTTI_ERROR_TASK_LOST` naming it.
///
/// Thread-safety: callable from any thread; `step` is called from tutti's threads.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; `step` is NULL or a function safe to call from any
/// thread, several at once, with `user_data` for as long as this call lasts; `coordinator` is
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_run_role(
    strategy: *const tutti_ps_strategy,
    step: tutti_ps_step_fn,
    user_data: *mut c_void,
    coordinator: *mut *mut tutti_ps_coordinator,
) -> tutti_result {
    boundary("tutti_ps_run_role", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy.as_ref() }.ok_or_else(|| Failure::invalid("strategy is NULL"))?;
        let f = step.ok_or_else(|| Failure::invalid("step is NULL"))?;
        if coordinator.is_null() {
            return Err(Failure::invalid("coordinator is NULL"));
        }
        let step = StepFn { f, user: user_data };
        let role = s.inner.run_role(move |ctx: &StepContext| {
            let mut st = tutti_ps_step {
                ctx,
                gradients: Vec::new(),
                loss: 0.0,
                error: None,
            };
            // A failure's message is the one this step function left, not an earlier one's.
            crate::error::clear_last_error();
            // SAFETY: the trainer's function, called as it promised it can be.
            let code = unsafe { step.call(&mut st) };
            if code == TuttiResult::TUTTI_SUCCESS as u32 {
                return Ok((st.gradients, st.loss));
            }
            let why = st
                .error
                .unwrap_or_else(|| crate::error::callback_failure(code));
            Err(tutti::Error::System {
                what: "the step function".into(),
                message: why,
            })
        })?;
        let out = match role {
            Role::Chief(inner) => Box::into_raw(Box::new(tutti_ps_coordinator {
                inner: std::sync::Arc::new(inner),
            })),
            Role::Done => std::ptr::null_mut(),
        };
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { coordinator.write(out) };
        Ok(())
    })
}

/// # Safety
///
/// `step` is NULL or the handle a step function was given, during that call.
unsafe fn step_mut<'a>(step: *mut tutti_ps_step) -> Result<&'a mut tutti_ps_step, Failure> {
    // SAFETY: as the caller promises.
    unsafe { step.as_mut() }.ok_or_else(|| Failure::invalid("step is NULL"))
}

/// # Safety
///
/// `st` is the handle of a running step function: its context is alive.
unsafe fn step_ctx(st: &tutti_ps_step) -> &StepContext {
    // SAFETY: the context outlives the step function's call, as the caller promises.
    unsafe { &*st.ctx }
}

/// Write the step's number to `*step_number`, this worker's index to `*worker`, the workers in
/// the job to `*num_workers` and the variables to `*num_variables`. Any output may be NULL.
///
/// Thread-safety: only inside the step function that was given `step`.
///
/// # Safety
///
/// `step` is NULL or the handle of the running step function; outputs NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_step_info(
    step: *mut tutti_ps_step,
    step_number: *mut u64,
    worker: *mut usize,
    num_workers: *mut usize,
    num_variables: *mut usize,
) -> tutti_result {
    boundary("tutti_ps_step_info", || {
        // SAFETY: as the caller promises.
        let st = unsafe { step_mut(step) }?;
        // SAFETY: the step function is running.
        let c = unsafe { step_ctx(st) };
        // SAFETY: NULL-checked; the caller promises they are writable.
        unsafe {
            if !step_number.is_null() {
                step_number.write(c.step());
            }
            if !worker.is_null() {
                worker.write(c.worker());
            }
            if !num_workers.is_null() {
                num_workers.write(c.num_workers());
            }
            if !num_variables.is_null() {
                num_variables.write(c.variables().len());
            }
        }
        Ok(())
    })
}

/// Point `*data` at variable `index`'s value as pulled for this step (valid until the step
/// function returns), and write its dtype to `*dtype` (NULL: not wanted) and its elements to
/// `*count`.
///
/// Thread-safety: only inside the step function that was given `step`.
///
/// # Safety
///
/// `step` is NULL or the handle of the running step function; `dtype` NULL or writable;
/// `data` and `count` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_step_variable(
    step: *mut tutti_ps_step,
    index: usize,
    dtype: *mut tutti_dtype,
    data: *mut *const c_void,
    count: *mut usize,
) -> tutti_result {
    boundary("tutti_ps_step_variable", || {
        // SAFETY: as the caller promises.
        let st = unsafe { step_mut(step) }?;
        if data.is_null() || count.is_null() {
            return Err(Failure::invalid("data or count is NULL"));
        }
        // SAFETY: the step function is running.
        let v = step_variable(unsafe { step_ctx(st) }, index)?;
        // SAFETY: checked non-NULL (dtype: NULL-checked); the caller promises they are writable.
        unsafe {
            if !dtype.is_null() {
                dtype.write(crate::types::dtype_code(v.dtype()));
            }
            data.write(v.as_bytes().as_ptr().cast());
            count.write(v.len());
        }
        Ok(())
    })
}

/// Variable `index` of a step, or an error naming it.
fn step_variable(c: &StepContext, index: usize) -> Result<&Values, Failure> {
    let vars = c.variables();
    vars.get(index)
        .ok_or_else(|| Failure::invalid(format!("variable {index}: the job has {}", vars.len())))
}

/// A step's gradient for variable `index`: `count` elements of `dtype` at `gradient`, which
/// must be the variable's dtype and length.
///
/// # Safety
///
/// `gradient` is NULL or holds `count` readable elements of `dtype`.
unsafe fn gradient_for(
    c: &StepContext,
    index: usize,
    dtype: tutti_dtype,
    gradient: *const c_void,
    count: usize,
) -> Result<Values, Failure> {
    let v = step_variable(c, index)?;
    // SAFETY: as the caller promises.
    let g = unsafe { values_at(dtype, gradient, count, "gradient") }?;
    if g.len() != v.len() || g.dtype() != v.dtype() {
        return Err(Failure::invalid(format!(
            "a gradient of {count} {} elements for variable {index}, of {} {}",
            g.dtype(),
            v.len(),
            v.dtype()
        )));
    }
    Ok(g)
}

/// Point `*data` at what the coordinator scheduled this step with (valid until the step
/// function returns; empty for `tutti_ps_coordinator_run_steps`) and write its length to
/// `*len`.
///
/// Thread-safety: only inside the step function that was given `step`.
///
/// # Safety
///
/// `step` is NULL or the handle of the running step function; `data` and `len` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_step_payload(
    step: *mut tutti_ps_step,
    data: *mut *const c_void,
    len: *mut usize,
) -> tutti_result {
    boundary("tutti_ps_step_payload", || {
        // SAFETY: as the caller promises.
        let st = unsafe { step_mut(step) }?;
        if data.is_null() || len.is_null() {
            return Err(Failure::invalid("data or len is NULL"));
        }
        // SAFETY: the step function is running.
        let p = unsafe { step_ctx(st) }.payload();
        // SAFETY: checked non-NULL; the caller promises they are writable.
        unsafe {
            data.write(p.as_ptr().cast());
            len.write(p.len());
        }
        Ok(())
    })
}

/// Set variable `index`'s gradient for this step: `count` elements of `dtype` (the
/// variable's dtype and length), copied. The ps tasks step the variable by it with the rule it
/// was created with when the step function returns. A variable given no gradient is left
/// alone.
///
/// Thread-safety: only inside the step function that was given `step`.
///
/// # Safety
///
/// `step` is NULL or the handle of the running step function; `gradient` holds `count`
/// elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_step_set_gradient(
    step: *mut tutti_ps_step,
    index: usize,
    dtype: tutti_dtype,
    gradient: *const c_void,
    count: usize,
) -> tutti_result {
    boundary("tutti_ps_step_set_gradient", || {
        // SAFETY: as the caller promises.
        let st = unsafe { step_mut(step) }?;
        // SAFETY: the step function is running.
        let c = unsafe { step_ctx(st) };
        // SAFETY: as the caller promises.
        let g = unsafe { gradient_for(c, index, dtype, gradient, count) }?;
        let n = c.variables().len();
        st.gradients.resize(n, Values::F32(Vec::new()));
        st.gradients[index] = g;
        Ok(())
    })
}

/// Push a gradient to variable `index` with a rule of its own, `update` (NULL: `w -=
/// gradient`), not the variable's: `count` elements of `dtype` (the variable's dtype and
/// length), copied, pushed when the step function returns (after the gradients set with
/// `tutti_ps_step_set_gradient`). A step may push to one variable several times.
///
/// Thread-safety: only inside the step function that was given `step`.
///
/// # Safety
///
/// `step` is NULL or the handle of the running step function; `gradient` holds `count`
/// elements of `dtype`; `update` is NULL or points to `update->struct_size` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_step_push(
    step: *mut tutti_ps_step,
    index: usize,
    dtype: tutti_dtype,
    gradient: *const c_void,
    count: usize,
    update: *const tutti_ps_update,
) -> tutti_result {
    boundary("tutti_ps_step_push", || {
        // SAFETY: as the caller promises.
        let st = unsafe { step_mut(step) }?;
        // SAFETY: as the caller promises.
        let (rule, slots) = unsafe { read_update(update, "update") }?;
        rule.check()
            .map_err(|why| Failure::invalid(format!("update: {why}")))?;
        // SAFETY: the step function is running.
        let c = unsafe { step_ctx(st) };
        // SAFETY: as the caller promises.
        let g = unsafe { gradient_for(c, index, dtype, gradient, count) }?;
        c.push(index, g, rule, slots);
        Ok(())
    })
}

/// Set the step's loss (what `tutti_ps_coordinator_run_steps` and `_fetch` return).
///
/// Thread-safety: only inside the step function that was given `step`.
///
/// # Safety
///
/// `step` is NULL or the handle of the running step function.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_step_set_loss(
    step: *mut tutti_ps_step,
    loss: f32,
) -> tutti_result {
    boundary("tutti_ps_step_set_loss", || {
        // SAFETY: as the caller promises.
        unsafe { step_mut(step) }?.loss = loss;
        Ok(())
    })
}

/// Send `len` bytes at `data` (copied; at most 256 MiB) back to the coordinator with the
/// step: `tutti_ps_coordinator_fetch` returns them.
///
/// Thread-safety: only inside the step function that was given `step`.
///
/// # Safety
///
/// `step` is NULL or the handle of the running step function; `data` holds `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_step_set_output(
    step: *mut tutti_ps_step,
    data: *const c_void,
    len: usize,
) -> tutti_result {
    boundary("tutti_ps_step_set_output", || {
        // SAFETY: as the caller promises.
        let st = unsafe { step_mut(step) }?;
        if len > MAX_STEP_BYTES {
            return Err(Failure::invalid(format!(
                "an output of {len} bytes, more than the {MAX_STEP_BYTES} a step may send back"
            )));
        }
        // SAFETY: the caller promises `len` readable bytes.
        let b = unsafe { bytes_at(data, len, "data") }?;
        // SAFETY: the step function is running.
        unsafe { step_ctx(st) }.set_output(b.to_vec());
        Ok(())
    })
}

/// Set the message the step fails with when the step function returns a failure code (the
/// coordinator's `tutti_last_error` shows it, with the worker and the step).
///
/// Thread-safety: only inside the step function that was given `step`.
///
/// # Safety
///
/// `step` is NULL or the handle of the running step function; `message` is NULL or a
/// NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_step_set_error(
    step: *mut tutti_ps_step,
    message: *const c_char,
) -> tutti_result {
    boundary("tutti_ps_step_set_error", || {
        // SAFETY: as the caller promises.
        let st = unsafe { step_mut(step) }?;
        if message.is_null() {
            return Err(Failure::invalid("message is NULL"));
        }
        // SAFETY: non-NULL; the caller promises a NUL-terminated string.
        let m = unsafe { CStr::from_ptr(message) }.to_string_lossy();
        st.error = Some(m.into_owned());
        Ok(())
    })
}

/// # Safety
///
/// `c` is NULL or a live handle.
unsafe fn coord<'a>(c: *const tutti_ps_coordinator) -> Result<&'a Coordinator, Failure> {
    // SAFETY: as the caller promises.
    unsafe { c.as_ref() }
        .map(|c| &*c.inner)
        .ok_or_else(|| Failure::invalid("coordinator is NULL"))
}

/// Variable `index` of the coordinator's, or an error saying how many it created.
fn known_variable(c: &Coordinator, index: usize) -> Result<VariableId, Failure> {
    let known = c.shards().len();
    if index >= known {
        return Err(Failure::invalid(format!(
            "variable {index}: the coordinator created {known}"
        )));
    }
    Ok(VariableId::from_index(index))
}

/// Write the workers still in the job to `*num_workers`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle; `num_workers` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_num_workers(
    coordinator: *const tutti_ps_coordinator,
    num_workers: *mut usize,
) -> tutti_result {
    boundary("tutti_ps_coordinator_num_workers", || {
        // SAFETY: as the caller promises.
        let c = unsafe { coord(coordinator) }?;
        if num_workers.is_null() {
            return Err(Failure::invalid("num_workers is NULL"));
        }
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { num_workers.write(c.num_workers()) };
        Ok(())
    })
}

/// Create a variable named `name` from `count` elements of `dtype` at `initial` (a float
/// dtype: f32, f64, f16, bf16), in `num_shards` shards across the ps tasks (0: as the
/// strategy's partitioner says), stepped by `update` (NULL: `w -= gradient`) as gradients
/// arrive. Write its index (its place in the step's variables) to `*index` and its shard count
/// to `*shards` (either may be NULL).
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle; `name` a NUL-terminated string; `initial` holds
/// `count` elements of `dtype`; `update` is NULL or points to `update->struct_size` readable
/// bytes; `index` and `shards` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_create_variable(
    coordinator: *const tutti_ps_coordinator,
    name: *const c_char,
    dtype: tutti_dtype,
    initial: *const c_void,
    count: usize,
    num_shards: usize,
    update: *const tutti_ps_update,
    index: *mut usize,
    shards: *mut usize,
) -> tutti_result {
    boundary("tutti_ps_coordinator_create_variable", || {
        // SAFETY: as the caller promises.
        let c = unsafe { coord(coordinator) }?;
        if name.is_null() {
            return Err(Failure::invalid("name is NULL"));
        }
        // SAFETY: non-NULL; the caller promises a NUL-terminated string.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        // SAFETY: the caller promises `count` readable elements.
        let v = unsafe { values_at(dtype, initial, count, "initial") }?;
        // SAFETY: as the caller promises.
        let (rule, _) = unsafe { read_update(update, "update") }?;
        let shards_wanted = (num_shards > 0).then_some(num_shards);
        let id = c.create_variable_with(&name, v, rule, shards_wanted)?;
        let n = c.shards()[id.index()];
        // SAFETY: NULL-checked; the caller promises they are writable.
        unsafe {
            if !index.is_null() {
                index.write(id.index());
            }
            if !shards.is_null() {
                shards.write(n);
            }
        }
        Ok(())
    })
}

/// Read variable `index`'s current value from its ps tasks into `out`: `count` elements of
/// `dtype` (its dtype and length exactly).
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle; `out` holds `count` writable elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_read_variable(
    coordinator: *const tutti_ps_coordinator,
    index: usize,
    dtype: tutti_dtype,
    out: *mut c_void,
    count: usize,
) -> tutti_result {
    boundary("tutti_ps_coordinator_read_variable", || {
        // SAFETY: as the caller promises.
        let c = unsafe { coord(coordinator) }?;
        let id = known_variable(c, index)?;
        let d = crate::types::dtype(dtype).map_err(Failure::invalid)?;
        let len = crate::buffers::byte_len(count, 1, d).map_err(Failure::invalid)?;
        crate::buffers::check(out, len, d, "out").map_err(Failure::invalid)?;
        let v = c.read_values(id)?;
        if v.len() != count || v.dtype() != d {
            return Err(Failure::invalid(format!(
                "{count} {d} elements, but variable {index} has {} {}",
                v.len(),
                v.dtype()
            )));
        }
        // SAFETY: checked above; the caller promises `count` writable elements.
        unsafe { crate::buffers::slice_mut(out, len) }.copy_from_slice(v.as_bytes());
        Ok(())
    })
}

/// Set variable `index` to the `count` elements of `dtype` at `values` (its dtype and length
/// exactly) on its ps tasks: a restored checkpoint, or a value of the trainer's. The state of
/// its update rules (momentum, moments) stays.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle; `values` holds `count` readable elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_assign_variable(
    coordinator: *const tutti_ps_coordinator,
    index: usize,
    dtype: tutti_dtype,
    values: *const c_void,
    count: usize,
) -> tutti_result {
    boundary("tutti_ps_coordinator_assign_variable", || {
        // SAFETY: as the caller promises.
        let c = unsafe { coord(coordinator) }?;
        let id = known_variable(c, index)?;
        // SAFETY: the caller promises `count` readable elements.
        let v = unsafe { values_at(dtype, values, count, "values") }?;
        c.assign_values(id, v)?;
        Ok(())
    })
}

/// Step variable `index` on its ps tasks by the `count` elements of `dtype` at `gradient` (its
/// dtype and length exactly) with `update` (NULL: `w -= gradient`), from the coordinator, as a
/// step's `tutti_ps_step_push` does: an optimizer applied on the chief, or an `assign_sub` that
/// loses none of the steps pushed meanwhile.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle; `gradient` holds `count` readable elements of
/// `dtype`; `update` is NULL or points to `update->struct_size` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_push(
    coordinator: *const tutti_ps_coordinator,
    index: usize,
    dtype: tutti_dtype,
    gradient: *const c_void,
    count: usize,
    update: *const tutti_ps_update,
) -> tutti_result {
    boundary("tutti_ps_coordinator_push", || {
        // SAFETY: as the caller promises.
        let c = unsafe { coord(coordinator) }?;
        let id = known_variable(c, index)?;
        // SAFETY: as the caller promises.
        let rule = unsafe { read_update(update, "update") }?;
        // SAFETY: the caller promises `count` readable elements.
        let g = unsafe { values_at(dtype, gradient, count, "gradient") }?;
        c.push_values(id, g, Some(rule))?;
        Ok(())
    })
}

/// Which rule's slots a slots call names: the variable's own (`update` NULL), or a pushed
/// rule's with its key.
///
/// # Safety
///
/// `update` is NULL or points to `update->struct_size` readable bytes.
unsafe fn slots_rule(update: *const tutti_ps_update) -> Result<Option<(Rule, u64)>, Failure> {
    if update.is_null() {
        return Ok(None);
    }
    // SAFETY: as the caller promises.
    unsafe { read_update(update, "update") }.map(Some)
}

/// The elements of each slot of a variable of `count` elements, and their dtype: checked
/// against what the caller says its buffers hold.
fn slot_dtype(dtype: tutti_dtype, count: usize) -> Result<(tutti::DType, usize), Failure> {
    let d = crate::types::dtype(dtype).map_err(Failure::invalid)?;
    if !matches!(d, tutti::DType::F32 | tutti::DType::F64) {
        return Err(Failure::invalid(format!(
            "slots are float32 (float64 for a float64 variable), not {d}"
        )));
    }
    let len = crate::buffers::byte_len(count, 1, d).map_err(Failure::invalid)?;
    Ok((d, len))
}

/// Read the state of an update rule for variable `index` (its shards' joined): the variable's
/// own rule's (`update` NULL), or that of the pushes naming `update` and its `slots` key. The
/// first slot (SGD's momentum, Adam's `m`) goes to `first`, the second (Adam's `v`) to
/// `second`, each `count` elements of `dtype` (the variable's length; `TUTTI_FLOAT32`, or
/// `TUTTI_FLOAT64` for a float64 variable), the steps taken (Adam's `t`) to `*steps`. Pass NULL
/// for what you do not want; a buffer for a slot the rule does not keep is an error. Zeros where
/// the rule has not stepped the variable yet. `*kept` (NULL: not wanted) says which slots the
/// rule keeps: 1 for the first, 2 for the second, both or neither (a call with both buffers
/// NULL asks just that). A checkpoint keeps them beside the variable.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle; `update` NULL or `update->struct_size` readable
/// bytes; `first` and `second` NULL or `count` writable elements of `dtype`; `steps` and `kept`
/// NULL or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tutti_ps_coordinator_read_slots(
    coordinator: *const tutti_ps_coordinator,
    index: usize,
    update: *const tutti_ps_update,
    dtype: tutti_dtype,
    first: *mut c_void,
    second: *mut c_void,
    count: usize,
    steps: *mut u32,
    kept: *mut u32,
) -> tutti_result {
    boundary("tutti_ps_coordinator_read_slots", || {
        // SAFETY: as the caller promises.
        let c = unsafe { coord(coordinator) }?;
        let id = known_variable(c, index)?;
        // SAFETY: as the caller promises.
        let rule = unsafe { slots_rule(update) }?;
        let (d, len) = slot_dtype(dtype, count)?;
        for (p, name) in [(first, "first"), (second, "second")] {
            if !p.is_null() {
                crate::buffers::check(p, len, d, name).map_err(Failure::invalid)?;
            }
        }
        let state = c.read_slots(id, rule)?;
        if let Some(v) = state.first.as_ref().or(state.second.as_ref()) {
            if v.len() != count {
                return Err(Failure::invalid(format!(
                    "count is {count}, but the slots of variable {index} hold {}",
                    v.len()
                )));
            }
        }
        let outs = [
            (first, &state.first, "first"),
            (second, &state.second, "second"),
        ];
        // Every buffer is checked before any is written.
        for (_, v, name) in outs.iter().filter(|(p, ..)| !p.is_null()) {
            let Some(v) = v else {
                return Err(Failure::invalid(format!(
                    "{name}: the rule keeps no {name} slot for variable {index}; pass NULL"
                )));
            };
            if v.len() != count || v.dtype() != d {
                return Err(Failure::invalid(format!(
                    "{name}: {count} {d} elements, but the slot of variable {index} has {} {}",
                    v.len(),
                    v.dtype()
                )));
            }
        }
        for (p, v, _) in outs {
            if let (false, Some(v)) = (p.is_null(), v) {
                // SAFETY: checked above; the caller promises `count` writable elements.
                unsafe { crate::buffers::slice_mut(p, len) }.copy_from_slice(v.as_bytes());
            }
        }
        // SAFETY (both): NULL-checked; the caller promises they are writable.
        if !steps.is_null() {
            unsafe { steps.write(state.steps) };
        }
        if !kept.is_null() {
            let k = u32::from(state.first.is_some()) | u32::from(state.second.is_some()) << 1;
            unsafe { kept.write(k) };
        }
        Ok(())
    })
}

/// Set the state of an update rule for variable `index` (as `tutti_ps_coordinator_read_slots`
/// names and lays it out: NULL for a slot the rule does not keep): a restored checkpoint's,
/// onto however many ps tasks hold the variable now. A slot missing, or given where the rule
/// keeps none, is an error before any shard is set.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle; `update` NULL or `update->struct_size` readable
/// bytes; `first` and `second` NULL or `count` readable elements of `dtype`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tutti_ps_coordinator_assign_slots(
    coordinator: *const tutti_ps_coordinator,
    index: usize,
    update: *const tutti_ps_update,
    dtype: tutti_dtype,
    first: *const c_void,
    second: *const c_void,
    count: usize,
    steps: u32,
) -> tutti_result {
    boundary("tutti_ps_coordinator_assign_slots", || {
        // SAFETY: as the caller promises.
        let c = unsafe { coord(coordinator) }?;
        let id = known_variable(c, index)?;
        // SAFETY: as the caller promises.
        let rule = unsafe { slots_rule(update) }?;
        slot_dtype(dtype, count)?;
        let slot = |p: *const c_void, name: &str| -> Result<Option<Values>, Failure> {
            if p.is_null() {
                return Ok(None);
            }
            // SAFETY: the caller promises `count` readable elements.
            unsafe { values_at(dtype, p, count, name) }.map(Some)
        };
        let state = tutti::strategy::SlotState {
            first: slot(first, "first")?,
            second: slot(second, "second")?,
            steps,
        };
        c.assign_slots(id, rule, &state)?;
        Ok(())
    })
}

/// Run steps `0..n` on the workers (each step on whichever worker is free) and write their
/// losses to `losses` (`n` floats; NULL to drop them). A failing step function returns
/// `TUTTI_ERROR_STEP_FAILED` (the workers stay); a lost ps task `TUTTI_ERROR_TASK_LOST`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle; `losses` NULL or `n` writable floats.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_run_steps(
    coordinator: *const tutti_ps_coordinator,
    n: usize,
    losses: *mut f32,
) -> tutti_result {
    boundary("tutti_ps_coordinator_run_steps", || {
        // SAFETY: as the caller promises.
        let c = unsafe { coord(coordinator) }?;
        if !losses.is_null() {
            floats_ok(losses, n, "losses")?;
        }
        let l = c.run_steps(n)?;
        if !losses.is_null() {
            // SAFETY: checked above; the caller promises `n` writable floats.
            unsafe { std::ptr::copy_nonoverlapping(l.as_ptr(), losses, n) };
        }
        Ok(())
    })
}

/// Schedule a step carrying `len` bytes at `payload` (copied; at most 256 MiB; the step
/// function reads them with `tutti_ps_step_payload`) and write its result's handle to
/// `*value`. Returns at once: scheduled steps run at the next `tutti_ps_coordinator_join` or
/// `_fetch`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle; `payload` holds `len` bytes (NULL if 0); `value`
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_schedule(
    coordinator: *const tutti_ps_coordinator,
    payload: *const c_void,
    len: usize,
    value: *mut *mut tutti_ps_remote_value,
) -> tutti_result {
    boundary("tutti_ps_coordinator_schedule", || {
        // SAFETY: as the caller promises.
        let c = unsafe { coord(coordinator) }?;
        if value.is_null() {
            return Err(Failure::invalid("value is NULL"));
        }
        // SAFETY: the caller promises `len` readable bytes.
        let p = unsafe { bytes_at(payload, len, "payload") }?.to_vec();
        let inner = c.schedule(p)?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { value.write(Box::into_raw(Box::new(tutti_ps_remote_value { inner }))) };
        Ok(())
    })
}

/// Run every step scheduled so far and wait for them. The first failing step function's error
/// (`TUTTI_ERROR_STEP_FAILED`) or lost ps task stops the run; the steps it stopped are not run,
/// and fetching them says so.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_join(
    coordinator: *const tutti_ps_coordinator,
) -> tutti_result {
    boundary("tutti_ps_coordinator_join", || {
        // SAFETY: as the caller promises.
        unsafe { coord(coordinator) }?.join()?;
        Ok(())
    })
}

/// The result of a scheduled step, running what is scheduled first if it has not run: write
/// its loss to `*loss` (may be NULL), copy up to `capacity` bytes of what it sent back to
/// `output` (NULL if `capacity` is 0) and write their full length to `*output_len` (may be
/// NULL): call again with a larger buffer when it did not fit. A step that failed returns its
/// error (`TUTTI_ERROR_STEP_FAILED`, or why it was not run).
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `coordinator` and `value` are NULL or live handles; `loss` and `output_len` NULL or
/// writable; `output` holds `capacity` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_fetch(
    coordinator: *const tutti_ps_coordinator,
    value: *const tutti_ps_remote_value,
    loss: *mut f32,
    output: *mut c_void,
    capacity: usize,
    output_len: *mut usize,
) -> tutti_result {
    boundary("tutti_ps_coordinator_fetch", || {
        // SAFETY: as the caller promises.
        let c = unsafe { coord(coordinator) }?;
        // SAFETY: as the caller promises.
        let v = unsafe { value.as_ref() }.ok_or_else(|| Failure::invalid("value is NULL"))?;
        if capacity > 0 && output.is_null() {
            return Err(Failure::invalid(format!(
                "output is NULL but capacity is {capacity}"
            )));
        }
        let out = c.fetch(&v.inner)?;
        // SAFETY: NULL-checked or checked above; the caller promises they are writable.
        unsafe {
            if !loss.is_null() {
                loss.write(out.loss);
            }
            if capacity > 0 {
                let n = capacity.min(out.output.len());
                std::ptr::copy_nonoverlapping(out.output.as_ptr(), output.cast::<u8>(), n);
            }
            if !output_len.is_null() {
                output_len.write(out.output.len());
            }
        }
        Ok(())
    })
}

/// Release a scheduled step's handle (the step still runs). NULL is accepted and ignored.
///
/// Thread-safety: no other call may be using `value`, nor use it afterwards.
///
/// # Safety
///
/// `value` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_remote_value_destroy(value: *mut tutti_ps_remote_value) {
    boundary_void("tutti_ps_remote_value_destroy", || {
        if !value.is_null() {
            // SAFETY: a live handle from Box::into_raw, released once.
            drop(unsafe { Box::from_raw(value) });
        }
    })
}

/// Tell every task the job is over (their `tutti_ps_run_role` returns) and release the
/// coordinator, whatever the outcome. Its scopes on the calling thread end; variables made in
/// its scopes stay valid handles, but reading or updating them fails from then on.
///
/// Thread-safety: no other call may be using `coordinator`, nor use it afterwards.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_shutdown(
    coordinator: *mut tutti_ps_coordinator,
) -> tutti_result {
    boundary("tutti_ps_coordinator_shutdown", || {
        if coordinator.is_null() {
            return Err(Failure::invalid("coordinator is NULL"));
        }
        crate::variables::end_scopes_of(coordinator as usize);
        // SAFETY: a live handle from Box::into_raw, released once.
        let c = unsafe { Box::from_raw(coordinator) };
        c.inner.shutdown()?;
        Ok(())
    })
}

/// `tutti_ps_coordinator_shutdown` without its result (a failure is logged). NULL is accepted
/// and ignored.
///
/// Thread-safety: no other call may be using `coordinator`, nor use it afterwards.
///
/// # Safety
///
/// `coordinator` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_ps_coordinator_destroy(coordinator: *mut tutti_ps_coordinator) {
    boundary_void("tutti_ps_coordinator_destroy", || {
        if !coordinator.is_null() {
            crate::variables::end_scopes_of(coordinator as usize);
            // SAFETY: a live handle from Box::into_raw, released once.
            let c = unsafe { Box::from_raw(coordinator) };
            if let Err(e) = c.inner.shutdown() {
                log::warn!("tutti_ps_coordinator_destroy: shutting the job down: {e}");
            }
        }
    })
}
