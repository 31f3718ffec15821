//! `tutti_strategy`: TensorFlow's `tf.distribute` strategies for C trainers.
//!
//! A strategy owns its replicas (threads of this process, one per local device); the trainer
//! writes one step as a `tutti_replica_fn` and `tutti_strategy_run` calls it once per local
//! replica, in parallel, each with a `tutti_replica_context` whose collectives span every
//! replica in sync.

use std::ffi::{c_char, c_void};

use tutti::logical_cpus;
use tutti::strategy::{
    CommunicationImplementation, CrossDeviceOps, PerReplica, ReplicaContext, Strategy, Tensor,
};
use tutti::{DType, Element, ReduceOp};

use crate::buffers::{self, byte_len, check};
use crate::error::{boundary, boundary_void, tutti_result, Failure, TuttiResult};
use crate::types::{self, tutti_dtype, tutti_op};

/// Strategy kinds.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiStrategyKind {
    /// The default strategy: one replica, the caller.
    TUTTI_STRATEGY_DEFAULT = 0,
    /// One replica on one device.
    TUTTI_STRATEGY_ONE_DEVICE = 1,
    /// A replica per local device, variables mirrored on each.
    TUTTI_STRATEGY_MIRRORED = 2,
    /// A replica per local device, variables kept once on the CPU.
    TUTTI_STRATEGY_CENTRAL_STORAGE = 3,
    /// Replicas on the local devices of every worker of the job in the environment.
    TUTTI_STRATEGY_MULTI_WORKER_MIRRORED = 4,
    /// TPUStrategy: a replica per device of this host's PJRT plugin (TPU cores through libtpu,
    /// else the plugin `TUTTI_PJRT_PLUGIN` names, with `TUTTI_PJRT_OPTIONS`); a build with the
    /// `xla` feature.
    TUTTI_STRATEGY_TPU = 5,
}

/// A `tutti_strategy_kind` as it crosses the C boundary: one of the `TUTTI_STRATEGY_*` values.
pub type tutti_strategy_kind = u32;

/// TensorFlow's cross-device ops.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiCrossDeviceOps {
    /// TensorFlow's choice: NcclAllReduce on GPUs with NCCL, else ReductionToOneDevice.
    TUTTI_CROSS_DEVICE_OPS_DEFAULT = 0,
    /// NCCL all-reduce (GPUs).
    TUTTI_CROSS_DEVICE_OPS_NCCL_ALL_REDUCE = 1,
    /// HierarchicalCopyAllReduce, one pack per batch.
    TUTTI_CROSS_DEVICE_OPS_HIERARCHICAL_COPY = 2,
    /// ReductionToOneDevice, onto the first device.
    TUTTI_CROSS_DEVICE_OPS_REDUCTION_TO_ONE_DEVICE = 3,
    /// The ring.
    TUTTI_CROSS_DEVICE_OPS_RING = 4,
    /// The trainer's own (`tutti_cross_device_ops_config`'s `all_reduce`).
    TUTTI_CROSS_DEVICE_OPS_CUSTOM = 5,
}

/// A `tutti_cross_device_ops` as it crosses the C boundary.
pub type tutti_cross_device_ops = u32;

/// A strategy (opaque). Created by `tutti_strategy_create`, released by
/// `tutti_strategy_destroy`.
pub struct tutti_strategy {
    /// Shared with the scopes entered on it (`tutti_strategy_scope_begin`).
    pub(crate) inner: std::sync::Arc<Strategy>,
}

/// What a replica function gets (opaque): valid only during that call, on that thread.
pub struct tutti_replica_context {
    ctx: *const c_void,
    /// The message `tutti_replica_set_error` left for the function's failure.
    error: parking_lot::Mutex<Option<String>>,
}

/// A step run once per local replica by `tutti_strategy_run`, on the replica's own thread, at
/// the same time as the other replicas' calls: it must be safe to call concurrently. Return
/// `TUTTI_SUCCESS`, or a failure code (the code of a failed tutti call made inside is a good
/// choice; `tutti_replica_set_error` says why): `tutti_strategy_run` then fails with the first
/// failing replica's error.
pub type tutti_replica_fn = Option<
    unsafe extern "C" fn(ctx: *const tutti_replica_context, user_data: *mut c_void) -> tutti_result,
>;

/// A trainer's cross-device op: leave `op` over every replica's value in every one of the
/// `num_values` buffers (`values[i]`: local replica `i`'s, `count` elements of `dtype`; a MEAN
/// included: the op divides). It gets SUM and MEAN of floating-point values; other ops and
/// integers run on tutti's algorithms. Called once per all-reduce, on one replica's thread,
/// while the others wait. Return `TUTTI_SUCCESS`, or a failure code (its `tutti_last_error`, if
/// it set one through a tutti call, goes with it).
pub type tutti_cross_device_op_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        op: tutti_op,
        dtype: tutti_dtype,
        count: usize,
        values: *const *mut c_void,
        num_values: usize,
    ) -> tutti_result,
>;

/// How a mirrored strategy's replicas combine their values: TensorFlow's cross-device ops and
/// their settings, or the trainer's own. Start from `TUTTI_CROSS_DEVICE_OPS_CONFIG_INIT`.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct tutti_cross_device_ops_config {
    /// `sizeof(tutti_cross_device_ops_config)` as the caller compiled it.
    pub struct_size: usize,
    /// Which: a `TUTTI_CROSS_DEVICE_OPS_*` value.
    pub kind: tutti_cross_device_ops,
    /// HIERARCHICAL_COPY: the packs a batch of values is fused into (0: the default fusion).
    pub num_packs: usize,
    /// HIERARCHICAL_COPY: replicas per group (0: 2).
    pub group_size: usize,
    /// REDUCTION_TO_ONE_DEVICE: the local replica whose device the values are reduced onto.
    pub reduce_to_device: usize,
    /// CUSTOM: a name for logs and errors (NULL: "custom"; copied).
    pub name: *const c_char,
    /// CUSTOM: the op; called while the strategy lives.
    pub all_reduce: tutti_cross_device_op_fn,
    /// CUSTOM: passed to `all_reduce`; it must stay valid while the strategy lives.
    pub user_data: *mut c_void,
}

/// A trainer's cross-device op, as the strategy calls it.
struct COps {
    name: String,
    f: unsafe extern "C" fn(
        *mut c_void,
        tutti_op,
        tutti_dtype,
        usize,
        *const *mut c_void,
        usize,
    ) -> tutti_result,
    user: *mut c_void,
}

// SAFETY: the trainer promises the function may be called from the replicas' threads with
// `user_data` while the strategy lives (see `tutti_strategy_create_mirrored`).
unsafe impl Send for COps {}
// SAFETY: as above; it is called from one thread at a time.
unsafe impl Sync for COps {}

impl tutti::strategy::CrossDeviceOp for COps {
    fn name(&self) -> &str {
        &self.name
    }

    fn all_reduce(
        &self,
        op: ReduceOp,
        dtype: DType,
        values: &mut [&mut [u8]],
    ) -> tutti::Result<()> {
        let count = values.first().map_or(0, |v| v.len() / dtype.size());
        let ptrs: Vec<*mut c_void> = values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        crate::error::clear_last_error();
        // SAFETY: the trainer's function, called as it promised it can be, with buffers that
        // hold `count` elements each for the length of the call.
        let code = unsafe {
            (self.f)(
                self.user,
                types::op_code(op),
                types::dtype_code(dtype),
                count,
                ptrs.as_ptr(),
                ptrs.len(),
            )
        };
        if code == TuttiResult::TUTTI_SUCCESS as u32 {
            return Ok(());
        }
        Err(tutti::Error::System {
            what: format!("cross-device op {}", self.name),
            message: crate::error::callback_failure(code),
        })
    }
}

/// The cross-device ops `c` describes, on the local replicas `devices`.
///
/// # Safety
///
/// `c.name` is NULL or a NUL-terminated string.
unsafe fn ops_of(
    c: &tutti_cross_device_ops_config,
    devices: &[tutti::Device],
) -> Result<Option<CrossDeviceOps>, Failure> {
    use TuttiCrossDeviceOps as K;
    Ok(Some(match c.kind {
        k if k == K::TUTTI_CROSS_DEVICE_OPS_HIERARCHICAL_COPY as u32 => {
            CrossDeviceOps::HierarchicalCopyAllReduce {
                num_packs: c.num_packs,
                group_size: c.group_size,
            }
        }
        k if k == K::TUTTI_CROSS_DEVICE_OPS_REDUCTION_TO_ONE_DEVICE as u32 => {
            let d = devices.get(c.reduce_to_device).ok_or_else(|| {
                Failure::invalid(format!(
                    "reduce_to_device {}: the strategy has {} local replicas",
                    c.reduce_to_device,
                    devices.len()
                ))
            })?;
            CrossDeviceOps::ReductionToOneDevice {
                reduce_to_device: Some(d.clone()),
            }
        }
        k if k == K::TUTTI_CROSS_DEVICE_OPS_CUSTOM as u32 => {
            let f = c
                .all_reduce
                .ok_or_else(|| Failure::invalid("kind is CUSTOM but all_reduce is NULL"))?;
            let name = if c.name.is_null() {
                "custom".to_string()
            } else {
                // SAFETY: the caller promises a NUL-terminated string.
                unsafe { std::ffi::CStr::from_ptr(c.name) }
                    .to_string_lossy()
                    .into_owned()
            };
            CrossDeviceOps::Custom(tutti::strategy::CustomOps(std::sync::Arc::new(COps {
                name,
                f,
                user: c.user_data,
            })))
        }
        other => return cross_ops(other),
    }))
}

/// Create a MirroredStrategy of `num_local_replicas` replicas (logical CPU devices; 0: the
/// default devices) whose replicas combine their values as `ops` says (NULL: as TensorFlow
/// chooses), and write it to `*strategy`. A CUSTOM op's function and data must stay valid
/// until the strategy is destroyed.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `ops` is NULL or points to a `tutti_cross_device_ops_config` whose `struct_size` is set (its
/// `name` NULL or a NUL-terminated string; `all_reduce` safe to call from any thread with
/// `user_data` while the strategy lives); `strategy` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_create_mirrored(
    num_local_replicas: usize,
    ops: *const tutti_cross_device_ops_config,
    strategy: *mut *mut tutti_strategy,
) -> tutti_result {
    boundary("tutti_strategy_create_mirrored", || {
        if strategy.is_null() {
            return Err(Failure::invalid("strategy is NULL"));
        }
        let devices = if num_local_replicas == 0 {
            Vec::new()
        } else {
            logical_cpus(num_local_replicas)?
        };
        // SAFETY: NULL or a config as the caller promises.
        let chosen = unsafe { checked_ops(ops, &devices) }?;
        let inner = Strategy::mirrored(&devices, chosen)?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe {
            strategy.write(Box::into_raw(Box::new(tutti_strategy {
                inner: std::sync::Arc::new(inner),
            })))
        };
        Ok(())
    })
}

/// The cross-device ops `ops` describes (NULL: as TensorFlow chooses) on the local replicas
/// `devices` (empty: the default devices), its size checked.
///
/// # Safety
///
/// As [`tutti_strategy_create_mirrored`]'s `ops`.
unsafe fn checked_ops(
    ops: *const tutti_cross_device_ops_config,
    devices: &[tutti::Device],
) -> Result<Option<CrossDeviceOps>, Failure> {
    // SAFETY: NULL or readable, as the caller promises.
    let Some(c) = (unsafe { ops.as_ref() }) else {
        return Ok(None);
    };
    if c.struct_size < std::mem::size_of::<tutti_cross_device_ops_config>() {
        return Err(Failure::invalid(format!(
            "ops->struct_size is {}, not sizeof(tutti_cross_device_ops_config) ({}); start from \
             TUTTI_CROSS_DEVICE_OPS_CONFIG_INIT",
            c.struct_size,
            std::mem::size_of::<tutti_cross_device_ops_config>()
        )));
    }
    let default_devices;
    let on = if devices.is_empty() {
        default_devices = tutti::strategy::default_devices();
        &default_devices
    } else {
        devices
    };
    // SAFETY: as the caller promises of `name`.
    unsafe { ops_of(c, on) }
}

/// The devices `num_devices` names at `devices` name, one replica each: the names checked
/// (not NULL, known, none twice), at least one and at most a process's local replicas.
///
/// # Safety
///
/// `devices` is NULL or points to `num_devices` pointers, each NULL or a NUL-terminated string.
unsafe fn device_list(
    devices: *const *const c_char,
    num_devices: usize,
) -> Result<Vec<tutti::Device>, Failure> {
    if devices.is_null() || num_devices == 0 {
        return Err(Failure::invalid(
            "devices is NULL or num_devices is 0; tutti_strategy_create takes the default \
             devices",
        ));
    }
    if num_devices > tutti::MAX_LOCAL_RANKS {
        return Err(Failure::invalid(format!(
            "num_devices is {num_devices}; a process holds at most {} local replicas",
            tutti::MAX_LOCAL_RANKS
        )));
    }
    // SAFETY: `num_devices` pointers, as the caller promises.
    let names = unsafe { std::slice::from_raw_parts(devices, num_devices) };
    let devices = names
        .iter()
        .enumerate()
        .map(|(i, &name)| {
            if name.is_null() {
                return Err(Failure::invalid(format!("devices[{i}] is NULL")));
            }
            // SAFETY: a NUL-terminated string, as the caller promises.
            let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy();
            Ok(tutti::device_from_spec(&name)?)
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    if let Some((a, b)) = (0..devices.len())
        .flat_map(|b| (0..b).map(move |a| (a, b)))
        .find(|&(a, b)| devices[a] == devices[b])
    {
        return Err(Failure::invalid(format!(
            "devices[{a}] and devices[{b}] both name {}: a replica per device",
            devices[a].spec()
        )));
    }
    Ok(devices)
}

/// The implementation a `tutti_communication` names.
fn communication_of(c: tutti_communication) -> Result<CommunicationImplementation, Failure> {
    use TuttiCommunication as C;
    Ok(match c {
        c if c == C::TUTTI_COMMUNICATION_AUTO as u32 => CommunicationImplementation::Auto,
        c if c == C::TUTTI_COMMUNICATION_RING as u32 => CommunicationImplementation::Ring,
        c if c == C::TUTTI_COMMUNICATION_NCCL as u32 => CommunicationImplementation::Nccl,
        other => {
            return Err(Failure::invalid(format!(
                "communication {other} is not a tutti_communication (valid: 0..=2)"
            )))
        }
    })
}

/// The cluster `tf_config` (TF_CONFIG's JSON) describes; NULL: none (the environment's).
///
/// # Safety
///
/// `tf_config` is NULL or a NUL-terminated string.
unsafe fn tf_config_of(tf_config: *const c_char) -> Result<Option<tutti::ClusterSpec>, Failure> {
    if tf_config.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL; the caller promises a NUL-terminated string.
    let text = unsafe { std::ffi::CStr::from_ptr(tf_config) }
        .to_str()
        .map_err(|_| Failure::invalid("tf_config is not UTF-8"))?;
    Ok(Some(tutti::from_tf_config(text)?))
}

/// Create a strategy of `kind` whose local replicas are on `devices` (`num_devices` device
/// names: `"cpu:0"`, `"gpu:1"`, `"xla:0"`, or TensorFlow's `"/device:GPU:0"`,
/// `"/job:localhost/replica:0/task:0/device:CPU:0"`) and write it to `*strategy`: ONE_DEVICE
/// (one device), MIRRORED (combining as `ops` says; NULL: as TensorFlow chooses),
/// CENTRAL_STORAGE, and MULTI_WORKER_MIRRORED (the local devices of each worker of the job its
/// environment describes). On XLA devices (`xla:0` … `xla:N-1`, of the plugin
/// `TUTTI_PJRT_PLUGIN` names) the replicas reduce there; a GPU that is not there, or XLA in a
/// library built without it, is `TUTTI_ERROR_UNAVAILABLE` naming it. DEFAULT and TPU take no
/// devices (`tutti_strategy_create`); `ops` is for MIRRORED only.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `devices` points to `num_devices` NUL-terminated strings; `ops` as
/// `tutti_strategy_create_mirrored`'s; `strategy` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_create_on_devices(
    kind: tutti_strategy_kind,
    devices: *const *const c_char,
    num_devices: usize,
    ops: *const tutti_cross_device_ops_config,
    strategy: *mut *mut tutti_strategy,
) -> tutti_result {
    boundary("tutti_strategy_create_on_devices", || {
        use TuttiStrategyKind as K;
        if strategy.is_null() {
            return Err(Failure::invalid("strategy is NULL"));
        }
        // The kind and ops before the devices: a device not there is no excuse for them.
        match kind {
            k if k == K::TUTTI_STRATEGY_DEFAULT as u32 || k == K::TUTTI_STRATEGY_TPU as u32 => {
                return Err(Failure::invalid(
                    "DEFAULT and TPU strategies take no device list (TPU: every device of the \
                     plugin); create them with tutti_strategy_create",
                ))
            }
            k if k > K::TUTTI_STRATEGY_TPU as u32 => {
                return Err(Failure::invalid(format!(
                    "kind {k} is not a tutti_strategy_kind (valid: 0..=5)"
                )))
            }
            _ => {}
        }
        if !ops.is_null() && kind != K::TUTTI_STRATEGY_MIRRORED as u32 {
            return Err(Failure::invalid(
                "ops is for a MIRRORED strategy; pass NULL for this kind",
            ));
        }
        // SAFETY: as the caller promises.
        let devices = unsafe { device_list(devices, num_devices) }?;
        let inner = match kind {
            k if k == K::TUTTI_STRATEGY_ONE_DEVICE as u32 => match &devices[..] {
                [d] => Strategy::one_device(d.clone())?,
                _ => {
                    return Err(Failure::invalid(format!(
                        "ONE_DEVICE takes one device, not {}",
                        devices.len()
                    )))
                }
            },
            k if k == K::TUTTI_STRATEGY_MIRRORED as u32 => {
                // SAFETY: NULL or a config as the caller promises.
                let chosen = unsafe { checked_ops(ops, &devices) }?;
                Strategy::mirrored(&devices, chosen)?
            }
            k if k == K::TUTTI_STRATEGY_CENTRAL_STORAGE as u32 => {
                Strategy::central_storage(&devices)?
            }
            k if k == K::TUTTI_STRATEGY_MULTI_WORKER_MIRRORED as u32 => {
                Strategy::multi_worker_mirrored(CommunicationImplementation::Auto, None, &devices)?
            }
            // Refused above.
            other => {
                return Err(Failure::invalid(format!(
                    "kind {other} takes no device list"
                )))
            }
        };
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe {
            strategy.write(Box::into_raw(Box::new(tutti_strategy {
                inner: std::sync::Arc::new(inner),
            })))
        };
        Ok(())
    })
}

fn cross_ops(v: tutti_cross_device_ops) -> Result<Option<CrossDeviceOps>, Failure> {
    use TuttiCrossDeviceOps as K;
    Ok(Some(match v {
        x if x == K::TUTTI_CROSS_DEVICE_OPS_DEFAULT as u32 => return Ok(None),
        x if x == K::TUTTI_CROSS_DEVICE_OPS_NCCL_ALL_REDUCE as u32 => CrossDeviceOps::NcclAllReduce,
        x if x == K::TUTTI_CROSS_DEVICE_OPS_HIERARCHICAL_COPY as u32 => {
            CrossDeviceOps::HierarchicalCopyAllReduce {
                num_packs: 1,
                group_size: 2,
            }
        }
        x if x == K::TUTTI_CROSS_DEVICE_OPS_REDUCTION_TO_ONE_DEVICE as u32 => {
            CrossDeviceOps::ReductionToOneDevice {
                reduce_to_device: None,
            }
        }
        x if x == K::TUTTI_CROSS_DEVICE_OPS_RING as u32 => CrossDeviceOps::Ring,
        x if x == K::TUTTI_CROSS_DEVICE_OPS_CUSTOM as u32 => {
            return Err(Failure::invalid(
                "cross_device_ops CUSTOM takes its function from tutti_strategy_create_mirrored",
            ))
        }
        other => {
            return Err(Failure::invalid(format!(
                "cross_device_ops {other} is not a tutti_cross_device_ops (valid: 0..=5)"
            )))
        }
    }))
}

/// The collectives a multi-worker strategy runs across workers (TensorFlow's
/// `CommunicationImplementation`).
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiCommunication {
    /// tutti chooses (shared memory on one host, TCP across hosts).
    TUTTI_COMMUNICATION_AUTO = 0,
    /// The ring over TCP.
    TUTTI_COMMUNICATION_RING = 1,
    /// NCCL where every local device is a GPU and NCCL loads; elsewhere the ring, said once at
    /// warn level with the reason.
    TUTTI_COMMUNICATION_NCCL = 2,
}

/// A `tutti_communication` as it crosses the C boundary: one of the `TUTTI_COMMUNICATION_*`
/// values.
pub type tutti_communication = u32;

/// Create a MultiWorkerMirroredStrategy and write it to `*strategy`: `num_local_replicas`
/// replicas on this host (logical CPU devices; 0: every GPU, else the CPU) on every worker of
/// the cluster `tf_config` describes (a TF_CONFIG text; NULL: this process's environment, as
/// `tutti_strategy_create` reads it; no cluster at all runs one worker), its collectives across
/// workers as `communication` says. Every worker calls it (it joins the job).
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `tf_config` is NULL or a NUL-terminated string; `strategy` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_create_multi_worker(
    tf_config: *const c_char,
    communication: tutti_communication,
    num_local_replicas: usize,
    strategy: *mut *mut tutti_strategy,
) -> tutti_result {
    // SAFETY: as the caller promises; no pack size or timeout of its own.
    unsafe {
        tutti_strategy_create_multi_worker_with_options(
            tf_config,
            communication,
            0,
            0,
            num_local_replicas,
            strategy,
        )
    }
}

/// `tutti_strategy_create_multi_worker` with the rest of TensorFlow's `CommunicationOptions`:
/// `bytes_per_pack`, the bytes of each pack a batch reduce fuses its tensors into (0: tutti's
/// default, 32 MiB; the strategy's batch reduces and optimizers in Rust and Python: the C calls
/// reduce a tensor at a time), and `timeout_ms`, the timeout of every wait of the strategy's
/// collectives and of the workers' joining (0: the configured one, `TUTTI_TIMEOUT`; tutti
/// bounds every wait).
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `tf_config` is NULL or a NUL-terminated string; `strategy` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_create_multi_worker_with_options(
    tf_config: *const c_char,
    communication: tutti_communication,
    bytes_per_pack: usize,
    timeout_ms: u64,
    num_local_replicas: usize,
    strategy: *mut *mut tutti_strategy,
) -> tutti_result {
    boundary("tutti_strategy_create_multi_worker_with_options", || {
        // SAFETY: as the caller promises.
        unsafe {
            multi_worker_into(
                tf_config,
                communication,
                bytes_per_pack,
                timeout_ms,
                strategy,
                || {
                    Ok(if num_local_replicas == 0 {
                        Vec::new()
                    } else {
                        logical_cpus(num_local_replicas)?
                    })
                },
            )
        }
    })
}

/// `tutti_strategy_create_multi_worker_with_options` with its local replicas on `devices`
/// (`num_devices` names, as `tutti_strategy_create_on_devices` takes them: `"cpu:0"`,
/// `"gpu:1"`, `"xla:0"`, TensorFlow's `"/device:GPU:0"`): every worker of the cluster
/// `tf_config` describes (NULL: the environment's; none: this process alone, as TensorFlow
/// runs it) on its own devices, combined across workers as `communication` says, with
/// TensorFlow's `bytes_per_pack` and `timeout_ms` (0: the defaults). On XLA devices each
/// worker's replicas reduce there first. A device that is not there is
/// `TUTTI_ERROR_UNAVAILABLE` naming it.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `tf_config` is NULL or a NUL-terminated string; `devices` points to `num_devices`
/// NUL-terminated strings; `strategy` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_create_multi_worker_on_devices(
    tf_config: *const c_char,
    communication: tutti_communication,
    bytes_per_pack: usize,
    timeout_ms: u64,
    devices: *const *const c_char,
    num_devices: usize,
    strategy: *mut *mut tutti_strategy,
) -> tutti_result {
    boundary("tutti_strategy_create_multi_worker_on_devices", || {
        // SAFETY: as the caller promises.
        unsafe {
            multi_worker_into(
                tf_config,
                communication,
                bytes_per_pack,
                timeout_ms,
                strategy,
                || device_list(devices, num_devices),
            )
        }
    })
}

/// A MultiWorkerMirroredStrategy with these options on the local devices `devices` gives
/// (none: the default ones), written to `*strategy`; the arguments checked in order (the
/// options before the devices: a device not there is no excuse for them).
///
/// # Safety
///
/// `tf_config` is NULL or a NUL-terminated string; `strategy` is NULL or writable.
unsafe fn multi_worker_into(
    tf_config: *const c_char,
    communication: tutti_communication,
    bytes_per_pack: usize,
    timeout_ms: u64,
    strategy: *mut *mut tutti_strategy,
    devices: impl FnOnce() -> Result<Vec<tutti::Device>, Failure>,
) -> Result<(), Failure> {
    if strategy.is_null() {
        return Err(Failure::invalid("strategy is NULL"));
    }
    let options = tutti::strategy::CommunicationOptions {
        implementation: communication_of(communication)?,
        bytes_per_pack,
        timeout: (timeout_ms > 0).then(|| std::time::Duration::from_millis(timeout_ms)),
    };
    // SAFETY: NULL or a NUL-terminated string, as the caller promises.
    let spec = unsafe { tf_config_of(tf_config) }?;
    let inner = Strategy::multi_worker_mirrored_with(&options, spec, &devices()?)?;
    // SAFETY: checked non-NULL; the caller promises it is writable.
    unsafe {
        strategy.write(Box::into_raw(Box::new(tutti_strategy {
            inner: std::sync::Arc::new(inner),
        })))
    };
    Ok(())
}

/// Create a strategy of `kind` with `num_local_replicas` replicas on this host (logical CPU
/// devices; 0 means the default devices: every GPU, else the CPU) and write it to `*strategy`.
/// `cross_device_ops` applies to MIRRORED; `TUTTI_CROSS_DEVICE_OPS_DEFAULT` chooses as
/// TensorFlow does (and says on stderr why NCCL is not used where it is not).
/// MULTI_WORKER_MIRRORED joins the job its environment describes (TF_CONFIG, tutti launch...).
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `strategy` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_create(
    kind: tutti_strategy_kind,
    num_local_replicas: usize,
    cross_device_ops: tutti_cross_device_ops,
    strategy: *mut *mut tutti_strategy,
) -> tutti_result {
    boundary("tutti_strategy_create", || {
        use TuttiStrategyKind as K;
        if strategy.is_null() {
            return Err(Failure::invalid("strategy is NULL"));
        }
        let ops = cross_ops(cross_device_ops)?;
        let devices = if num_local_replicas == 0 {
            Vec::new()
        } else {
            logical_cpus(num_local_replicas)?
        };
        let inner = match kind {
            k if k == K::TUTTI_STRATEGY_DEFAULT as u32 => Strategy::default_strategy(),
            k if k == K::TUTTI_STRATEGY_ONE_DEVICE as u32 => {
                Strategy::one_device(logical_cpus(1)?.remove(0))?
            }
            k if k == K::TUTTI_STRATEGY_MIRRORED as u32 => Strategy::mirrored(&devices, ops)?,
            k if k == K::TUTTI_STRATEGY_CENTRAL_STORAGE as u32 => {
                Strategy::central_storage(&devices)?
            }
            k if k == K::TUTTI_STRATEGY_MULTI_WORKER_MIRRORED as u32 => {
                Strategy::multi_worker_mirrored(CommunicationImplementation::Auto, None, &devices)?
            }
            k if k == K::TUTTI_STRATEGY_TPU as u32 => tpu_strategy(num_local_replicas)?,
            other => {
                return Err(Failure::invalid(format!(
                    "kind {other} is not a tutti_strategy_kind (valid: 0..=5)"
                )))
            }
        };
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe {
            strategy.write(Box::into_raw(Box::new(tutti_strategy {
                inner: std::sync::Arc::new(inner),
            })))
        };
        Ok(())
    })
}

/// TPUStrategy over this host's PJRT devices (every one: `num_local_replicas` must be 0 or
/// their number).
#[cfg(feature = "xla")]
fn tpu_strategy(num_local_replicas: usize) -> Result<Strategy, Failure> {
    // The system may have been initialized already (tutti_tpu_initialize): this opens the
    // devices without initializing it again.
    let client = tutti::xla::Client::from_env()?;
    let topology = tutti::strategy::tpu::topology(&client);
    if num_local_replicas != 0 && num_local_replicas != topology.num_cores {
        return Err(Failure::invalid(format!(
            "num_local_replicas {num_local_replicas}: TPUStrategy runs a replica on each of the \
             {} devices (pass 0)",
            topology.num_cores
        )));
    }
    Ok(Strategy::tpu(client)?)
}

#[cfg(not(feature = "xla"))]
fn tpu_strategy(_num_local_replicas: usize) -> Result<Strategy, Failure> {
    Err(tutti::Error::Unavailable {
        what: "TPUStrategy".into(),
        why: crate::xla::NO_XLA.into(),
    }
    .into())
}

/// The topology of this host's TPU (TensorFlow's `initialize_tpu_system`): open its devices
/// through the PJRT plugin (TPU cores through libtpu, else the plugin `TUTTI_PJRT_PLUGIN`
/// names, with `TUTTI_PJRT_OPTIONS`) and write the cores to `*num_cores`, the tasks (hosts) to
/// `*num_tasks` and the cores per task to `*num_cores_per_task` (any may be NULL). A second
/// call warns that initializing again loses what the devices hold. UNAVAILABLE without a
/// plugin, or in a build without the `xla` feature.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// The outputs are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_tpu_initialize(
    num_cores: *mut usize,
    num_tasks: *mut usize,
    num_cores_per_task: *mut usize,
) -> tutti_result {
    boundary("tutti_tpu_initialize", || {
        #[cfg(feature = "xla")]
        {
            let (_, t) = tutti::strategy::tpu::initialize_tpu_system(
                &tutti::strategy::tpu::TpuClusterResolver::new("")?,
            )?;
            // SAFETY: NULL-checked; the caller promises they are writable.
            unsafe {
                for (p, v) in [
                    (num_cores, t.num_cores),
                    (num_tasks, t.num_tasks),
                    (num_cores_per_task, t.num_cores_per_task),
                ] {
                    if !p.is_null() {
                        p.write(v);
                    }
                }
            }
            Ok(())
        }
        #[cfg(not(feature = "xla"))]
        {
            let _ = (num_cores, num_tasks, num_cores_per_task);
            Err(tutti::Error::Unavailable {
                what: "TPU".into(),
                why: crate::xla::NO_XLA.into(),
            }
            .into())
        }
    })
}

/// Release a strategy and stop its replicas (once no scope on another thread holds it). Its
/// scopes on the calling thread end. NULL is accepted and ignored.
///
/// Thread-safety: no other call may be using `strategy`, on any thread, nor use it afterwards.
///
/// # Safety
///
/// `strategy` is NULL or a live handle from `tutti_strategy_create`, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_destroy(strategy: *mut tutti_strategy) {
    boundary_void("tutti_strategy_destroy", || {
        if !strategy.is_null() {
            // Its scopes on this thread end with it (a scope on another thread keeps the
            // strategy until that scope ends).
            crate::variables::end_scopes_of(strategy as usize);
            // SAFETY: a live handle from Box::into_raw, released once.
            drop(unsafe { Box::from_raw(strategy) });
        }
    })
}

/// # Safety
///
/// `strategy` is NULL or a live handle.
pub(crate) unsafe fn strategy_ref<'a>(
    strategy: *const tutti_strategy,
) -> Result<&'a Strategy, Failure> {
    // SAFETY: as the caller promises.
    unsafe { strategy.as_ref() }
        .map(|s| &*s.inner)
        .ok_or_else(|| Failure::invalid("strategy is NULL"))
}

/// The strategy behind `strategy`, or `None` for NULL.
///
/// # Safety
///
/// `strategy` is NULL or a live handle.
pub(crate) unsafe fn strategy_opt<'a>(strategy: *const tutti_strategy) -> Option<&'a Strategy> {
    // SAFETY: as the caller promises.
    unsafe { strategy.as_ref() }.map(|s| &*s.inner)
}

/// Write the number of replicas in sync across the job to `*num_replicas` (TensorFlow's
/// `num_replicas_in_sync`), and the number on this process to `*num_local_replicas`.
/// Either output may be NULL.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; the outputs are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_num_replicas(
    strategy: *const tutti_strategy,
    num_replicas: *mut usize,
    num_local_replicas: *mut usize,
) -> tutti_result {
    boundary("tutti_strategy_num_replicas", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy_ref(strategy) }?;
        // SAFETY: NULL-checked; the caller promises they are writable.
        unsafe {
            if !num_replicas.is_null() {
                num_replicas.write(s.num_replicas_in_sync());
            }
            if !num_local_replicas.is_null() {
                num_local_replicas.write(s.num_local_replicas());
            }
        }
        Ok(())
    })
}

/// Which rows of a global batch of `rows` rows each of this process's replicas takes: replica
/// `i` (local) takes rows `starts[i]` to `starts[i + 1]` (contiguous, the first `rows %
/// replicas in sync` replicas of the whole job one row more; a replica may get none). `starts`
/// holds `num_local_replicas + 1` values.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; `starts` is NULL or holds `num_local_replicas + 1`
/// writable values.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_batch_rows(
    strategy: *const tutti_strategy,
    rows: usize,
    starts: *mut usize,
    num_starts: usize,
) -> tutti_result {
    boundary("tutti_strategy_batch_rows", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy_ref(strategy) }?;
        let ranges = s.batch_rows(rows);
        if num_starts != ranges.len() + 1 {
            return Err(Failure::invalid(format!(
                "num_starts is {num_starts}; this process has {} replicas, so {} starts",
                ranges.len(),
                ranges.len() + 1
            )));
        }
        if starts.is_null() || (starts as usize) % std::mem::align_of::<usize>() != 0 {
            return Err(Failure::invalid("starts is NULL or not aligned for size_t"));
        }
        let mut out: Vec<usize> = ranges.iter().map(|r| r.start).collect();
        out.push(ranges.last().map_or(0, |r| r.end));
        // SAFETY: non-NULL, aligned; the caller promises `num_starts` writable values.
        unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), starts, out.len()) };
        Ok(())
    })
}

/// This process's place in the job (TensorFlow's `strategy.cluster_resolver`): its task type
/// (`worker`, `chief`, ...) written NUL-terminated into `task_type` (cut to fit
/// `task_type_len` bytes; NULL with 0 to skip it), its index among the workers to
/// `*task_id`, the number of workers to `*num_workers`, and whether it is the chief to
/// `*is_chief`. A strategy of one process's replicas is one worker, the chief. Any output may
/// be NULL.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; `task_type` is NULL or holds `task_type_len` writable
/// bytes; the other outputs are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_cluster(
    strategy: *const tutti_strategy,
    task_type: *mut c_char,
    task_type_len: usize,
    task_id: *mut usize,
    num_workers: *mut usize,
    is_chief: *mut bool,
) -> tutti_result {
    boundary("tutti_strategy_cluster", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy_ref(strategy) }?;
        let r = s.cluster_resolver();
        if task_type.is_null() && task_type_len > 0 {
            return Err(Failure::invalid(format!(
                "task_type is NULL but task_type_len is {task_type_len}"
            )));
        }
        // SAFETY: NULL-checked; the caller promises they are writable (task_type: its length).
        unsafe {
            if task_type_len > 0 {
                let n = crate::error::floor_char_boundary(&r.task_type, task_type_len - 1);
                std::ptr::copy_nonoverlapping(r.task_type.as_ptr(), task_type.cast::<u8>(), n);
                task_type.add(n).write(0);
            }
            if !task_id.is_null() {
                task_id.write(r.task_id);
            }
            if !num_workers.is_null() {
                num_workers.write(r.num_workers);
            }
            if !is_chief.is_null() {
                is_chief.write(r.is_chief);
            }
        }
        Ok(())
    })
}

/// The replica function and its data, shared by the replica threads.
struct Step {
    f: unsafe extern "C" fn(*const tutti_replica_context, *mut c_void) -> tutti_result,
    user: *mut c_void,
}

// SAFETY: the trainer promises (see `tutti_replica_fn`) that the function may run on several
// threads at once with this data.
unsafe impl Sync for Step {}

/// Call `step(ctx, user_data)` once per local replica, in parallel, and return when every call
/// has returned. A replica whose call fails makes this fail with its code and message (its
/// siblings' collectives are woken rather than left to time out); the strategy stays usable.
/// Across workers, where a replica's own part of a collective failed before the call across
/// workers, this worker takes its place there as a rejection: the other workers' call fails at
/// once naming it, which ends the workers' communicator under the default check, and
/// `tutti_strategy_shrink` on every worker then goes on.
///
/// Thread-safety: one `tutti_strategy_run` at a time per strategy.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; `step` is NULL or a function safe to call on several
/// threads at once with `user_data`.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_run(
    strategy: *mut tutti_strategy,
    step: tutti_replica_fn,
    user_data: *mut c_void,
) -> tutti_result {
    boundary("tutti_strategy_run", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy_ref(strategy) }?;
        let f = step.ok_or_else(|| Failure::invalid("step is NULL"))?;
        let step = Step { f, user: user_data };
        let step = &step;
        s.run(|ctx: &ReplicaContext<'_>| {
            let c = tutti_replica_context {
                ctx: (ctx as *const ReplicaContext<'_>).cast(),
                error: Default::default(),
            };
            // A failure's message is the one this call left, not an earlier one's.
            crate::error::clear_last_error();
            // SAFETY: the trainer's function, called as it promised it can be.
            let code = unsafe { (step.f)(&c, step.user) };
            if code == TuttiResult::TUTTI_SUCCESS as u32 {
                return Ok(());
            }
            let why = c
                .error
                .lock()
                .take()
                .unwrap_or_else(|| crate::error::callback_failure(code));
            Err(tutti::Error::System {
                what: format!("the step of replica {}", ctx.replica_id_in_sync_group()),
                message: why,
            })
        })?;
        Ok(())
    })
}

/// MultiWorkerMirroredStrategy: go on with the workers still alive after one was lost (a run,
/// reduce or variable update failed with `TUTTI_ERROR_PEER_LOST`, or aborted because of it),
/// without restarting; with none lost, go on with the same workers after a worker's rejection
/// or a mismatch aborted the workers' communicator (see `tutti_strategy_run`). Every surviving
/// worker calls it. The workers are renumbered in their old order (the lowest is the chief),
/// and `tutti_strategy_num_replicas` and `tutti_strategy_cluster` follow. Then take the
/// variables, the optimizer's state and the step from the new chief before the next step (the
/// failed step may have completed on some workers and not others), and split the data again
/// for the new number of replicas.
///
/// Other strategies, and workers that run NCCL: `TUTTI_ERROR_UNAVAILABLE`.
///
/// Thread-safety: no other call on this strategy at the same time (`tutti_strategy_place` from
/// an input thread included), and no scope open on it (`tutti_strategy_scope_begin`; an error
/// otherwise).
///
/// # Safety
///
/// `strategy` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_shrink(strategy: *mut tutti_strategy) -> tutti_result {
    boundary("tutti_strategy_shrink", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy.as_mut() }.ok_or_else(|| Failure::invalid("strategy is NULL"))?;
        let inner = std::sync::Arc::get_mut(&mut s.inner).ok_or_else(|| {
            tutti::Error::config(
                "tutti_strategy_shrink: a scope is open on this strategy \
                 (tutti_strategy_scope_begin): end it first",
            )
        })?;
        inner.shrink()?;
        Ok(())
    })
}

/// Set the message the replica function's failure carries when it returns a failure code: the
/// error of `tutti_strategy_run` (and, across workers, what the other workers hear) then says
/// this rather than the code alone.
///
/// Thread-safety: only inside the replica function that was handed `ctx`.
///
/// # Safety
///
/// `ctx` is NULL or the context of the running replica function; `message` is NULL or a
/// NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tutti_replica_set_error(
    ctx: *const tutti_replica_context,
    message: *const c_char,
) -> tutti_result {
    boundary("tutti_replica_set_error", || {
        // SAFETY: as the caller promises.
        let c = unsafe { ctx.as_ref() }.ok_or_else(|| Failure::invalid("ctx is NULL"))?;
        if message.is_null() {
            return Err(Failure::invalid("message is NULL"));
        }
        // SAFETY: non-NULL; the caller promises a NUL-terminated string.
        let m = unsafe { std::ffi::CStr::from_ptr(message) }.to_string_lossy();
        *c.error.lock() = Some(m.into_owned());
        Ok(())
    })
}

/// # Safety
///
/// `ctx` is NULL or the context a replica function was handed, during that call.
pub(crate) unsafe fn ctx_ref<'a>(
    ctx: *const tutti_replica_context,
) -> Result<&'a ReplicaContext<'a>, Failure> {
    // SAFETY: as the caller promises: it points at a live ReplicaContext.
    let c = unsafe { ctx.as_ref() }.ok_or_else(|| Failure::invalid("ctx is NULL"))?;
    Ok(unsafe { &*(c.ctx as *const ReplicaContext<'a>) })
}

/// Write this replica's index among every replica in sync to `*replica_id` (TensorFlow's
/// `replica_id_in_sync_group`) and its index on this process to `*local_replica_id`. Either
/// output may be NULL.
///
/// Thread-safety: only inside the replica function that was handed `ctx`.
///
/// # Safety
///
/// `ctx` is NULL or the context of the running replica function; outputs NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_replica_id(
    ctx: *const tutti_replica_context,
    replica_id: *mut usize,
    local_replica_id: *mut usize,
) -> tutti_result {
    boundary("tutti_replica_id", || {
        // SAFETY: as the caller promises.
        let c = unsafe { ctx_ref(ctx) }?;
        // SAFETY: NULL-checked; the caller promises they are writable.
        unsafe {
            if !replica_id.is_null() {
                replica_id.write(c.replica_id_in_sync_group());
            }
            if !local_replica_id.is_null() {
                local_replica_id.write(c.local_replica_id());
            }
        }
        Ok(())
    })
}

/// `b` as elements. An empty slice's dangling address need not be aligned for `T`: it is
/// none of `T`'s to cast.
pub(crate) fn typed<T: Element>(b: &mut [u8]) -> &mut [T] {
    if b.is_empty() {
        return &mut [];
    }
    bytemuck::cast_slice_mut(b)
}

/// As [`typed`], read only.
pub(crate) fn typed_ref<T: Element>(b: &[u8]) -> &[T] {
    if b.is_empty() {
        return &[];
    }
    bytemuck::cast_slice(b)
}

/// All-reduce `count` elements of `buf` in place across every replica in sync. `op` may be any
/// `tutti_op`; MEAN divides by the number of replicas in sync.
///
/// Thread-safety: only inside the replica function that was handed `ctx`.
///
/// # Safety
///
/// `ctx` is NULL or the running replica's context; `buf` is NULL or holds `count` elements of
/// `dtype`, readable and writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_replica_all_reduce(
    ctx: *const tutti_replica_context,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    buf: *mut c_void,
) -> tutti_result {
    boundary("tutti_replica_all_reduce", || {
        // SAFETY: as the caller promises.
        let c = unsafe { ctx_ref(ctx) }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let op = types::op(op).map_err(Failure::invalid)?;
        let len = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        check(buf, len, dtype, "buf").map_err(Failure::invalid)?;
        // SAFETY: checked; the caller promises `count` elements.
        let bytes = unsafe { buffers::slice_mut(buf, len) };
        tutti::for_each_dtype!(dtype, T => { c.all_reduce(op, typed::<T>(bytes))? });
        Ok(())
    })
}

/// Broadcast `count` elements of `buf` from the replica `root` (an index in sync) to every
/// replica.
///
/// Thread-safety: only inside the replica function that was handed `ctx`.
///
/// # Safety
///
/// As `tutti_replica_all_reduce`.
#[no_mangle]
pub unsafe extern "C" fn tutti_replica_broadcast(
    ctx: *const tutti_replica_context,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    buf: *mut c_void,
) -> tutti_result {
    boundary("tutti_replica_broadcast", || {
        // SAFETY: as the caller promises.
        let c = unsafe { ctx_ref(ctx) }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let len = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        check(buf, len, dtype, "buf").map_err(Failure::invalid)?;
        // SAFETY: checked; the caller promises `count` elements.
        let bytes = unsafe { buffers::slice_mut(buf, len) };
        tutti::for_each_dtype!(dtype, T => { c.broadcast(typed::<T>(bytes), root)? });
        Ok(())
    })
}

/// Concatenate the rows of every replica in sync, in replica order across the whole job
/// (TensorFlow's `strategy.gather` along axis 0): local replica `i` gives `rows[i]` rows of
/// `row_len` elements of `dtype` at `per_replica[i]` (the replicas may differ in rows, not in
/// `row_len`). The rows gathered go to `output`, which holds `capacity_rows` rows, and their
/// number to `*total_rows` (NULL: not wanted). Every worker calls it (a collective); one whose
/// `output` is too small gets `TUTTI_ERROR_INVALID_ARGUMENT` with `*total_rows` set and nothing
/// written, once the rows have been gathered (the others are not held up).
///
/// Thread-safety: not inside a replica function; one call at a time per strategy.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; `per_replica` and `rows` are NULL or hold one entry
/// per local replica, `per_replica[i]` pointing to `rows[i] * row_len` readable elements;
/// `output` is NULL or holds `capacity_rows * row_len` writable ones; `total_rows` is NULL or
/// writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tutti_strategy_gather(
    strategy: *mut tutti_strategy,
    dtype: tutti_dtype,
    row_len: usize,
    per_replica: *const *const c_void,
    rows: *const usize,
    output: *mut c_void,
    capacity_rows: usize,
    total_rows: *mut usize,
) -> tutti_result {
    boundary("tutti_strategy_gather", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy_ref(strategy) }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        if row_len == 0 {
            return Err(Failure::invalid(
                "row_len is 0: a row holds one element at least",
            ));
        }
        if per_replica.is_null() {
            return Err(Failure::invalid("per_replica is NULL"));
        }
        let local = s.num_local_replicas();
        // SAFETY: the caller promises one count per local replica.
        let rows =
            unsafe { buffers::read_counts(rows, local, "rows") }.map_err(Failure::invalid)?;
        // SAFETY: the caller promises one pointer per local replica.
        let ptrs = unsafe { std::slice::from_raw_parts(per_replica, local) };
        let mut lens = Vec::with_capacity(local);
        for (i, (p, r)) in ptrs.iter().zip(&rows).enumerate() {
            let len = byte_len(*r, row_len, dtype).map_err(Failure::invalid)?;
            check(*p, len, dtype, &format!("per_replica[{i}]")).map_err(Failure::invalid)?;
            lens.push(len);
        }
        let out_len = byte_len(capacity_rows, row_len, dtype).map_err(Failure::invalid)?;
        check(output, out_len, dtype, "output").map_err(Failure::invalid)?;
        /// Gather, then write the rows to `output` if they fit.
        #[allow(clippy::too_many_arguments)]
        fn run<T: Element>(
            s: &Strategy,
            row_len: usize,
            ptrs: &[*const c_void],
            lens: &[usize],
            rows: &[usize],
            output: *mut c_void,
            capacity_rows: usize,
            total_rows: *mut usize,
        ) -> Result<(), Failure> {
            let parts = ptrs
                .iter()
                .zip(lens)
                .zip(rows)
                .map(|((p, &len), &r)| {
                    // SAFETY: checked by the caller; the trainer promises the lengths.
                    let data = typed_ref::<T>(unsafe { buffers::slice(*p, len) }).to_vec();
                    Tensor::new(data, vec![r, row_len])
                })
                .collect::<tutti::Result<Vec<_>>>()?;
            let all = s.gather(&PerReplica(parts), 0)?.data;
            let total = all.len() / row_len;
            if !total_rows.is_null() {
                // SAFETY: NULL-checked; the trainer promises it is writable.
                unsafe { total_rows.write(total) };
            }
            if total > capacity_rows {
                return Err(Failure::invalid(format!(
                    "output holds {capacity_rows} rows, but the replicas gathered {total}"
                )));
            }
            let bytes: &[u8] = bytemuck::cast_slice(&all);
            // SAFETY: checked by the caller for `capacity_rows` rows; `total` fit.
            unsafe { buffers::slice_mut(output, bytes.len()) }.copy_from_slice(bytes);
            Ok(())
        }
        tutti::for_each_dtype!(dtype, T => {
            run::<T>(s, row_len, ptrs, &lens, &rows, output, capacity_rows, total_rows)?
        });
        Ok(())
    })
}

/// Reduce one value per local replica (`per_replica[i]`: `count` elements of `dtype`) across
/// every replica in sync into `output` (TensorFlow's `strategy.reduce` with no axis). `op` is
/// SUM or MEAN.
///
/// Thread-safety: not inside a replica function; one call at a time per strategy.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; `per_replica` is NULL or holds one pointer per local
/// replica, each to `count` readable elements; `output` is NULL or holds `count` writable ones.
#[no_mangle]
pub unsafe extern "C" fn tutti_strategy_reduce(
    strategy: *mut tutti_strategy,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    per_replica: *const *const c_void,
    output: *mut c_void,
) -> tutti_result {
    boundary("tutti_strategy_reduce", || {
        // SAFETY: as the caller promises.
        let s = unsafe { strategy_ref(strategy) }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let op = types::op(op).map_err(Failure::invalid)?;
        let len = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        if per_replica.is_null() {
            return Err(Failure::invalid("per_replica is NULL"));
        }
        // SAFETY: the caller promises one pointer per local replica.
        let ptrs = unsafe { std::slice::from_raw_parts(per_replica, s.num_local_replicas()) };
        for (i, p) in ptrs.iter().enumerate() {
            check(*p, len, dtype, &format!("per_replica[{i}]")).map_err(Failure::invalid)?;
        }
        check(output, len, dtype, "output").map_err(Failure::invalid)?;
        fn run<T: Element>(
            s: &Strategy,
            op: ReduceOp,
            ptrs: &[*const c_void],
            len: usize,
            out: *mut c_void,
        ) -> tutti::Result<()> {
            // SAFETY: checked above; the caller promises the lengths.
            let parts: Vec<Tensor<T>> = ptrs
                .iter()
                .map(|p| {
                    Tensor::vector(typed_ref::<T>(unsafe { buffers::slice(*p, len) }).to_vec())
                })
                .collect();
            let r = s.reduce(op, &PerReplica(parts), None)?;
            let out: &mut [T] = typed(unsafe { buffers::slice_mut(out, len) });
            out.copy_from_slice(&r.data);
            Ok(())
        }
        let _: DType = dtype;
        tutti::for_each_dtype!(dtype, T => { run::<T>(s, op, ptrs, len, output)? });
        Ok(())
    })
}
