//! Strategies, after TensorFlow's `tf.distribute`: pick a strategy, write the step once, switch
//! hardware by switching the strategy.
//!
//! A [`Strategy`] owns the local replicas (one per local device, each a thread with its own rank
//! of an in-process group whose algorithm is the strategy's cross-device op) and, for
//! [`Strategy::multi_worker_mirrored`], a communicator across workers. Inside [`Strategy::run`]
//! each replica gets a [`ReplicaContext`] whose collectives span every replica in sync: local
//! reduce, cross-worker collective, local broadcast.
//!
//! | strategy | replicas | variables | gradient aggregation |
//! |---|---|---|---|
//! | [`Strategy::default_strategy`] | 1 (the caller) | one copy | none needed |
//! | [`Strategy::one_device`] | 1 on the device | one copy | none needed |
//! | [`Strategy::mirrored`] | one per local device | one per replica ([`MirroredVariable`]) | all-reduce with the cross-device op |
//! | [`Strategy::central_storage`] | one per local device | one copy on the CPU ([`CentralVariable`]) | reduce to the variable's device, apply once |
//! | [`Strategy::multi_worker_mirrored`] | local devices × workers | one per replica | local reduce, cross-worker all-reduce, local broadcast |
//! | [`ParameterServerStrategy`](ps::ParameterServerStrategy) | workers run scheduled steps | sharded on `ps` tasks | pushed to the ps asynchronously |
//!
//! Values may live on the replicas' devices: [`ReplicaContext::place`] makes a
//! [`DeviceTensor`] there, the `*_tensor` collectives of the replica
//! context run on it where it lies, and a [`DeviceVariable`] keeps its copies there, each
//! update combined and applied by the replicas' engine (one compiled program on XLA devices).
//! The strategy layer only hands tensors to the communicators; which memory they are in is
//! the device layer's business.
//!
//! (Why one long file: every strategy is the one `Strategy` type and its replica context;
//! variables, fusion, tensors and parameter servers have files of their own.)

pub mod checkpoint;
mod fusion;
mod input;
pub mod ps;
mod scope;
mod tensor;
#[cfg(feature = "xla")]
pub mod tpu;
mod training;
mod variables;

pub use checkpoint::{Checkpoint, CheckpointManager, SidecarEvaluator};
pub use fusion::pack_plan;
pub use input::{
    AutoShardPolicy, Batch, Dataset, DeviceBatch, DistributedDataset, FileDataset, InputContext,
    PlacedTensor, Prefetched, ValueContext,
};
pub use scope::{current_coordinator, current_strategy, enter_scope, exit_scope, Scope, Variable};
pub use scope::{enter_coordinator_scope, exit_coordinator_scope, ShardedVariable};
pub use tensor::Tensor;
pub use training::{compute_average_loss, Compute, Mean, Optimizer, Param, Rule, SlotState};
#[doc(hidden)]
pub use training::{AnySlots, Slots, Stretch};
pub use variables::{Aggregation, CentralVariable, DeviceVariable, MirroredVariable};

use std::sync::Arc;

use parking_lot::Mutex;

use crate::algorithm::Algorithm;
use crate::cluster::ClusterSpec;
use crate::comm::{Communicator, Config, Replicas};
use crate::device::{self, Device, DeviceKind, DeviceTensor};
use crate::dtype::{DType, Element, ReduceOp};
use crate::engine::GroupEngine;
use crate::error::{Collective, Error, Result};
use crate::transport::TransportKind;

/// A cross-device op of the caller's (TensorFlow's `CrossDeviceOps` subclasses): how a
/// worker's replicas combine their values, in the replica context's `all_reduce` (and what is
/// built on it: variables' aggregation, optimizers) and in `Strategy::reduce`. It takes
/// TensorFlow's ops, SUM and MEAN, of floating-point values; other ops and integer values run
/// on tutti's algorithms.
pub trait CrossDeviceOp: Send + Sync {
    /// A name for logs and errors.
    fn name(&self) -> &str;
    /// Leave `op` over every replica's value in every buffer: `values[i]` is local replica
    /// `i`'s, elements of `dtype` as their native bytes, all as long (`Mean` included: the op
    /// divides). Called once per all-reduce, on one replica's thread, while the others wait;
    /// it must not call the strategy's collectives (that is an error).
    fn all_reduce(&self, op: ReduceOp, dtype: crate::DType, values: &mut [&mut [u8]])
        -> Result<()>;
}

/// A user-defined cross-device op, as [`CrossDeviceOps::Custom`] holds it (equal when it is
/// the same object).
#[derive(Clone)]
pub struct CustomOps(pub Arc<dyn CrossDeviceOp>);

impl std::fmt::Debug for CustomOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CustomOps({})", self.0.name())
    }
}

impl PartialEq for CustomOps {
    fn eq(&self, other: &CustomOps) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for CustomOps {}

/// TensorFlow's cross-device ops: how the replicas of one worker combine their values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CrossDeviceOps {
    /// NCCL all-reduce across GPUs (TensorFlow's default when every device is a GPU and NCCL is
    /// present).
    NcclAllReduce,
    /// TensorFlow's HierarchicalCopyAllReduce; values are fused into `num_packs` packs.
    HierarchicalCopyAllReduce {
        /// Packs the values of a batch reduce are fused into (0: no fusion).
        num_packs: usize,
        /// Replicas per group: each group reduces onto its first, the firsts across groups,
        /// and back (0: 2).
        group_size: usize,
    },
    /// TensorFlow's ReductionToOneDevice: reduce onto one device, broadcast back.
    ReductionToOneDevice {
        /// The device to reduce to (default: the first device).
        reduce_to_device: Option<Device>,
    },
    /// The ring: reduce-scatter then all-gather.
    Ring,
    /// The caller's own ([`CrossDeviceOp`]): MirroredStrategy only.
    Custom(CustomOps),
}

impl CrossDeviceOps {
    /// A short name for logs and JSON.
    pub fn name(&self) -> &'static str {
        match self {
            CrossDeviceOps::NcclAllReduce => "NcclAllReduce",
            CrossDeviceOps::HierarchicalCopyAllReduce { .. } => "HierarchicalCopyAllReduce",
            CrossDeviceOps::ReductionToOneDevice { .. } => "ReductionToOneDevice",
            CrossDeviceOps::Ring => "Ring",
            CrossDeviceOps::Custom(_) => "Custom",
        }
    }
}

/// TensorFlow's `CommunicationImplementation` for multi-worker collectives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum CommunicationImplementation {
    /// tutti chooses (shared memory on one host, TCP across hosts).
    #[default]
    Auto,
    /// The ring over TCP.
    Ring,
    /// NCCL across GPUs.
    Nccl,
}

/// TensorFlow's `CommunicationOptions`: how a multi-worker strategy's collectives across workers
/// run.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct CommunicationOptions {
    /// Which implementation.
    pub implementation: CommunicationImplementation,
    /// Bytes of each pack a batch reduce fuses its tensors into (TensorFlow's
    /// `bytes_per_pack`); 0: tutti's default (32 MiB).
    pub bytes_per_pack: usize,
    /// The timeout of every wait of the strategy's collectives, across workers and among the
    /// local replicas (TensorFlow's `timeout_seconds`), and of the workers' joining; `None`: the
    /// configured one (`TUTTI_TIMEOUT`, else tutti's default). tutti bounds every wait: no value
    /// disables it.
    pub timeout: Option<std::time::Duration>,
}

impl std::str::FromStr for CommunicationImplementation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_uppercase().as_str() {
            "AUTO" => Ok(CommunicationImplementation::Auto),
            "RING" => Ok(CommunicationImplementation::Ring),
            "NCCL" => Ok(CommunicationImplementation::Nccl),
            _ => Err(format!(
                "unknown communication implementation '{s}' (expected RING, NCCL or AUTO)"
            )),
        }
    }
}

/// Which strategy.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StrategyKind {
    /// The default strategy: no distribution.
    Default,
    /// One device.
    OneDevice,
    /// Mirrored across local devices.
    Mirrored,
    /// Variables on the CPU, computation on local devices.
    CentralStorage,
    /// Mirrored across the devices of every worker.
    MultiWorkerMirrored,
    /// A replica per XLA device (TPU cores, or any PJRT plugin's devices); collectives run as
    /// compiled XLA programs.
    Tpu,
}

impl StrategyKind {
    /// TensorFlow's class name.
    pub fn name(self) -> &'static str {
        match self {
            StrategyKind::Default => "DefaultStrategy",
            StrategyKind::OneDevice => "OneDeviceStrategy",
            StrategyKind::Mirrored => "MirroredStrategy",
            StrategyKind::CentralStorage => "CentralStorageStrategy",
            StrategyKind::MultiWorkerMirrored => "MultiWorkerMirroredStrategy",
            StrategyKind::Tpu => "TPUStrategy",
        }
    }
}

/// TensorFlow's cluster resolver, as a strategy reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterResolver {
    /// `chief`, `worker`, `ps`, ...
    pub task_type: String,
    /// Index among the tasks of that type.
    pub task_id: usize,
    /// True on the chief.
    pub is_chief: bool,
    /// Workers in the collective world (1 without a cluster).
    pub num_workers: usize,
}

/// One value per local replica, in replica order.
#[derive(Clone, Debug, PartialEq)]
pub struct PerReplica<T>(pub Vec<T>);

impl<T> PerReplica<T> {
    /// The values of this worker's replicas (TensorFlow's `experimental_local_results`).
    pub fn local_results(&self) -> &[T] {
        &self.0
    }
}

/// What [`Strategy::run`] hands each replica function.
pub struct ReplicaContext<'a> {
    strategy: &'a Strategy,
    comm: &'a Communicator,
    local_id: usize,
    /// Per optimizer (by its id): the steps it had taken when this run's replicas first stepped
    /// with it, shared by the run's replicas.
    run_steps: &'a Mutex<std::collections::HashMap<u64, u64>>,
    /// Per optimizer: the steps this replica has taken with it in this run.
    taken: Mutex<std::collections::HashMap<u64, u64>>,
}

/// The replicas of a strategy on this worker, rebuilt after a failed `run`.
struct Local {
    replicas: Option<Replicas>,
    comm: Option<Communicator>,
}

/// A distribution strategy. See the module docs.
pub struct Strategy {
    kind: StrategyKind,
    devices: Vec<Device>,
    cross_device_ops: Option<CrossDeviceOps>,
    config: Config,
    local: Mutex<Local>,
    /// Across workers (multi-worker only): used by local replica 0 alone.
    workers: Option<Arc<Communicator>>,
    resolver: ClusterResolver,
    /// Fusion threshold of batch reduces (TensorFlow's `bytes_per_pack`; 0: no fusion).
    bytes_per_pack: usize,
    /// What runs the replicas' collectives when it is not the host algorithms: PJRT programs
    /// (TPUStrategy), NCCL over staged copies (MirroredStrategy with NcclAllReduce). The
    /// replicas' communicators carry it; nothing else here knows the device.
    engine: Option<(DeviceKind, Arc<dyn GroupEngine>)>,
    /// Where the replicas meet for a custom cross-device op.
    meet: Meet,
    /// This worker's last rejection (see [`Strategy::in_place_of`]), which a shrink lets reach
    /// the other workers before it aborts their communicator.
    rejection: Mutex<Option<crate::comm::Work<()>>>,
}

/// Places values on a strategy's local replicas' devices, as their communicators do
/// ([`Communicator::place`]), without the strategy: an input pipeline's thread holds one.
pub(crate) struct Placer {
    /// The replicas' group engine, where it keeps tensors on the devices.
    engine: Option<Arc<dyn GroupEngine>>,
    local: usize,
}

impl Placer {
    /// Local replicas.
    pub(crate) fn local(&self) -> usize {
        self.local
    }

    /// `bytes` (whole elements of `dtype`) on local replica `replica`'s device.
    pub(crate) fn place(&self, replica: usize, dtype: DType, bytes: &[u8]) -> Result<DeviceTensor> {
        if replica >= self.local {
            return Err(Error::config(format!(
                "no local replica {replica}: the strategy has {}",
                self.local
            )));
        }
        if bytes.len() % dtype.size() != 0 {
            return Err(Error::config(format!(
                "{} bytes are not whole {dtype} elements",
                bytes.len()
            )));
        }
        match &self.engine {
            Some(engine) => engine.place(replica, dtype, bytes),
            None => Ok(DeviceTensor::from_bytes(dtype, bytes)),
        }
    }
}

/// Where a worker's replicas meet for a custom cross-device op: each leaves its buffer, the
/// last to come runs the op over them all, and each leaves once it has run. A replica that
/// waits past the timeout (or finds its group aborted) withdraws before the op starts.
#[derive(Default)]
struct Meet {
    state: Mutex<MeetState>,
    ended: parking_lot::Condvar,
}

#[derive(Default)]
struct MeetState {
    round: u64,
    /// Each replica's buffer (address, bytes) and call (op, dtype) while it waits in this
    /// round.
    slots: Vec<Option<(usize, usize, ReduceOp, crate::DType)>>,
    arrived: usize,
    running: bool,
    /// How the last round ended.
    outcome: Option<Result<()>>,
}

impl Meet {
    /// Run `ops` over the `n` local replicas' `buf`s, as replica `local`.
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        local: usize,
        n: usize,
        ops: &dyn CrossDeviceOp,
        op: ReduceOp,
        dtype: crate::DType,
        buf: &mut [u8],
        timeout: std::time::Duration,
        comm: &Communicator,
    ) -> Result<()> {
        use std::time::{Duration, Instant};
        thread_local! {
            static IN_OP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        }
        if IN_OP.with(|f| f.get()) {
            return Err(Error::config(format!(
                "cross-device op {}: it called an all-reduce of the strategy; an op combines the \
                 buffers it is given, without tutti's collectives",
                ops.name()
            )));
        }
        let mut st = self.state.lock();
        if st.slots.len() != n {
            st.slots = vec![None; n];
        }
        let round = st.round;
        st.slots[local] = Some((buf.as_mut_ptr() as usize, buf.len(), op, dtype));
        st.arrived += 1;
        if st.arrived == n {
            st.running = true;
            let slots: Vec<(usize, usize, ReduceOp, crate::DType)> =
                st.slots.iter_mut().filter_map(|s| s.take()).collect();
            let outcome = parking_lot::MutexGuard::unlocked(&mut st, || {
                let first = slots[0];
                if let Some((i, &(_, len, o, d))) = slots
                    .iter()
                    .enumerate()
                    .find(|(_, s)| (s.1, s.2, s.3) != (first.1, first.2, first.3))
                {
                    return Err(Error::config(format!(
                        "cross-device op {}: the replicas' calls differ: replica 0 all-reduces \
                         {} of {} bytes of {}, replica {i} {o} of {len} bytes of {d}",
                        ops.name(),
                        first.2,
                        first.1,
                        first.3
                    )));
                }
                let mut views: Vec<&mut [u8]> = slots
                    .iter()
                    // SAFETY: each buffer is its replica's `&mut [u8]`, borrowed by that
                    // replica's call, which does not return before this round has ended (it
                    // may withdraw only while no op runs); the replicas' buffers are distinct.
                    .map(|&(p, l, _, _)| unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l) })
                    .collect();
                IN_OP.with(|f| f.set(true));
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    ops.all_reduce(op, dtype, &mut views)
                }));
                IN_OP.with(|f| f.set(false));
                run.unwrap_or_else(|p| {
                    Err(Error::System {
                        what: format!("cross-device op {}", ops.name()),
                        message: format!(
                            "panicked: {}",
                            p.downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_default()
                        ),
                    })
                })
            });
            st.outcome = Some(outcome.clone());
            st.arrived = 0;
            st.running = false;
            st.round += 1;
            self.ended.notify_all();
            return outcome;
        }
        let deadline = Instant::now() + timeout;
        loop {
            if st.round != round {
                return st.outcome.clone().unwrap_or(Ok(()));
            }
            let until = (Instant::now() + Duration::from_millis(20)).min(deadline);
            self.ended.wait_until(&mut st, until);
            if st.round != round || st.running {
                // Ended, or the op runs on this buffer: wait for it whatever the clock says.
                continue;
            }
            let aborted = comm.aborted();
            if aborted.is_some() || Instant::now() >= deadline {
                // No op has started: nothing holds this buffer; leave the round, and the group
                // with it (a later call must not meet its siblings' calls of this round).
                st.slots[local] = None;
                st.arrived -= 1;
                if aborted.is_none() {
                    comm.abort(&format!(
                        "replica {local} timed out waiting for its siblings in cross-device op {}",
                        ops.name()
                    ));
                }
                let missing: Vec<usize> = (0..n)
                    .filter(|&i| st.slots[i].is_none() && i != local)
                    .collect();
                return Err(match aborted {
                    Some(reason) => Error::Aborted {
                        rank: local,
                        reason,
                    },
                    None => Error::Timeout {
                        site: crate::error::Site {
                            collective: crate::error::Collective::AllReduce,
                            rank: local,
                            call: round,
                        },
                        waiting_for: missing,
                        phase: "arrive",
                        timeout,
                        stalled_on: Vec::new(),
                    },
                });
            }
        }
    }
}

fn log(msg: &str) {
    log::info!("{msg}");
}

fn local_resolver() -> ClusterResolver {
    ClusterResolver {
        task_type: "worker".into(),
        task_id: 0,
        is_chief: true,
        num_workers: 1,
    }
}

/// The algorithm that carries a cross-device op over an in-process group of these devices.
fn algorithm_for(ops: &CrossDeviceOps, devices: &[Device]) -> Result<Algorithm> {
    Ok(match ops {
        // A custom op's strategy runs its other collectives (broadcast) on the ring.
        CrossDeviceOps::Ring | CrossDeviceOps::Custom(_) => Algorithm::Ring,
        CrossDeviceOps::HierarchicalCopyAllReduce { group_size, .. } => {
            Algorithm::HierarchicalCopy {
                group_size: match group_size {
                    0 => 2,
                    g => *g,
                },
            }
        }
        CrossDeviceOps::ReductionToOneDevice { reduce_to_device } => {
            let root = match reduce_to_device {
                None => 0,
                Some(d) => devices
                    .iter()
                    .position(|x| x == d || x.spec() == d.spec())
                    .ok_or_else(|| {
                        Error::config(format!(
                            "ReductionToOneDevice: {} is not one of the strategy's devices",
                            d.spec()
                        ))
                    })?,
            };
            Algorithm::ReduceToOne { root }
        }
        CrossDeviceOps::NcclAllReduce => {
            return Err(Error::Unavailable {
                what: "NCCL".into(),
                why: format!("NcclAllReduce cannot run here: {}", no_nccl()),
            })
        }
    })
}

/// The engine that reduces the local replicas on `devices` in their own memory, where host
/// groups would not: XLA devices' (those of the plugin's client the strategy names). CPU and
/// GPU replicas keep their values in host memory, reduced by the host algorithms (NCCL's path
/// is chosen by the caller). XLA devices beside others are an error: no one group holds both.
fn device_engine(
    kind: StrategyKind,
    devices: &[Device],
    config: &Config,
) -> Result<Option<(DeviceKind, Arc<dyn GroupEngine>)>> {
    let xla = devices.iter().filter(|d| d.kind == DeviceKind::Xla).count();
    if xla == 0 {
        return Ok(None);
    }
    if xla < devices.len() {
        return Err(Error::config(format!(
            "{}: devices {} mix XLA devices with others; a worker's replicas are all on XLA \
             devices or none are",
            kind.name(),
            devices
                .iter()
                .map(|d| d.spec())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let indices: Vec<usize> = devices.iter().map(|d| d.index).collect();
    let specs = || {
        devices
            .iter()
            .map(|d| d.spec())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let engine = crate::comm::xla_engine(&indices, config).map_err(|e| match e {
        Error::InvalidArgument { message, .. } => {
            Error::config(format!("{}: {message}", kind.name()))
        }
        Error::Unavailable { what, why } => Error::Unavailable {
            what: format!("{what} for {}'s devices {}", kind.name(), specs()),
            why,
        },
        e => e,
    })?;
    Ok(Some((DeviceKind::Xla, engine)))
}

/// The GPU (its index among the visible GPUs) through which NCCL can carry the cross-worker
/// collectives of replicas on `devices`, or why it cannot.
fn nccl_across_workers(devices: &[Device]) -> std::result::Result<usize, String> {
    if let Some(d) = devices.iter().find(|d| d.kind != DeviceKind::Gpu) {
        return Err(format!(
            "NCCL reduces GPU buffers and not every local device is a GPU ({} is not)",
            d.spec()
        ));
    }
    #[cfg(feature = "cuda")]
    return match (crate::gpu::nccl_library(), devices.first()) {
        (Err(e), _) => Err(e.to_string()),
        (Ok(_), None) => Err("there are no local devices".into()),
        (Ok(_), Some(d)) => Ok(d.physical_index),
    };
    #[cfg(not(feature = "cuda"))]
    Err("this build has no CUDA support, so no NCCL".into())
}

/// Why the strategies cannot run NcclAllReduce in this build.
fn no_nccl() -> String {
    #[cfg(feature = "cuda")]
    return match crate::gpu::nccl_library() {
        Err(e) => e.to_string(),
        Ok(_) => "the strategies keep replica values in host memory and NCCL reduces device \
                  buffers (tutti::gpu::GpuGroup runs NCCL on GPU buffers)"
            .into(),
    };
    #[cfg(not(feature = "cuda"))]
    "this build has no CUDA support, so no NCCL".into()
}

impl Strategy {
    /// A strategy whose local replicas reduce where their devices are: on XLA devices through
    /// the plugin's compiled collectives (as [`Strategy::tpu`]), elsewhere in host memory.
    fn build(
        kind: StrategyKind,
        devices: Vec<Device>,
        cross_device_ops: Option<CrossDeviceOps>,
        config: Config,
        workers: Option<Arc<Communicator>>,
        resolver: ClusterResolver,
    ) -> Result<Strategy> {
        let engine = device_engine(kind, &devices, &config)?;
        Strategy::build_on(
            kind,
            devices,
            cross_device_ops,
            config,
            workers,
            resolver,
            engine,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build_on(
        kind: StrategyKind,
        devices: Vec<Device>,
        cross_device_ops: Option<CrossDeviceOps>,
        config: Config,
        workers: Option<Arc<Communicator>>,
        resolver: ClusterResolver,
        engine: Option<(DeviceKind, Arc<dyn GroupEngine>)>,
    ) -> Result<Strategy> {
        if devices.is_empty() {
            return Err(Error::config(format!("{}: no devices", kind.name())));
        }
        let bytes_per_pack = 32 << 20;
        let s = Strategy {
            kind,
            devices,
            cross_device_ops,
            config,
            local: Mutex::new(Local {
                replicas: None,
                comm: None,
            }),
            workers,
            resolver,
            bytes_per_pack,
            engine,
            meet: Meet::default(),
            rejection: Mutex::new(None),
        };
        s.rebuild()?;
        Ok(s)
    }

    fn rebuild(&self) -> Result<()> {
        let mut local = self.local.lock();
        let n = self.devices.len();
        let mut comms = match &self.engine {
            None => crate::comm::local_group(n, &self.config)?,
            Some((kind, engine)) => {
                let specs: Vec<(DeviceKind, usize)> =
                    self.devices.iter().map(|d| (*kind, d.index)).collect();
                crate::comm::engine_group(&specs, &self.config, Some(engine.clone()))
            }
        };
        *local = if n == 1 {
            Local {
                replicas: None,
                comm: comms.pop(),
            }
        } else {
            Local {
                replicas: Some(Replicas::from_group(comms, &self.config)?),
                comm: None,
            }
        };
        Ok(())
    }

    /// TensorFlow's default strategy: one replica, the caller; collectives are identities.
    pub fn default_strategy() -> Strategy {
        let cpu = device::discover().remove(0);
        Strategy::build(
            StrategyKind::Default,
            vec![cpu],
            None,
            Config::default(),
            None,
            local_resolver(),
        )
        .expect("a one-replica strategy on the CPU always builds")
    }

    /// One replica on `device`.
    pub fn one_device(device: Device) -> Result<Strategy> {
        Strategy::build(
            StrategyKind::OneDevice,
            vec![device],
            None,
            Config::default(),
            None,
            local_resolver(),
        )
    }

    /// A replica per device of this process. `devices` empty means every GPU, else the CPU.
    /// `cross_device_ops` `None` chooses as TensorFlow does: NcclAllReduce when every device is
    /// a GPU and NCCL is present, else ReductionToOneDevice (logged). On XLA devices the
    /// replicas reduce there, with XLA's own collectives, as under TPUStrategy (so too
    /// the other strategies of local devices).
    pub fn mirrored(
        devices: &[Device],
        cross_device_ops: Option<CrossDeviceOps>,
    ) -> Result<Strategy> {
        let devices = if devices.is_empty() {
            default_devices()
        } else {
            devices.to_vec()
        };
        let ops = choose_cross_device_ops(&devices, cross_device_ops);
        #[cfg(feature = "cuda")]
        if ops == CrossDeviceOps::NcclAllReduce {
            return Strategy::mirrored_nccl(devices);
        }
        let config = Config::default().with_algorithm(algorithm_for(&ops, &devices)?);
        Strategy::build(
            StrategyKind::Mirrored,
            devices,
            Some(ops),
            config,
            None,
            local_resolver(),
        )
    }

    /// MirroredStrategy with NcclAllReduce across whole GPUs.
    #[cfg(feature = "cuda")]
    fn mirrored_nccl(devices: Vec<Device>) -> Result<Strategy> {
        let gpus = devices
            .iter()
            .map(|d| {
                let logical = crate::gpu::LogicalGpu {
                    index: d.index,
                    physical: d.physical_index,
                    memory_limit: None,
                    is_virtual: false,
                };
                crate::gpu::GpuDevice::open(&logical)
            })
            .collect::<Result<Vec<_>>>()?;
        let config = Config::default();
        let group = crate::gpu::GpuGroup::new(&gpus, crate::gpu::GpuAlgorithm::Nccl, &config)?;
        // The replicas' values live in host memory: the engine stages them to the GPUs.
        let engine: Arc<dyn GroupEngine> = Arc::new(crate::engine::cuda::Staged {
            group,
            per_rank: false,
        });
        Strategy::build_on(
            StrategyKind::Mirrored,
            devices,
            Some(CrossDeviceOps::NcclAllReduce),
            config,
            None,
            local_resolver(),
            Some((DeviceKind::Gpu, engine)),
        )
    }

    /// Variables kept once, in host memory (TensorFlow puts them on the GPU when there is
    /// exactly one; tutti's [`CentralVariable`] stays on the host whatever the devices);
    /// computation replicated on `devices`; updates aggregated onto the variable before they
    /// are applied.
    pub fn central_storage(devices: &[Device]) -> Result<Strategy> {
        let devices = if devices.is_empty() {
            default_devices()
        } else {
            devices.to_vec()
        };
        let ops = CrossDeviceOps::ReductionToOneDevice {
            reduce_to_device: None,
        };
        let config = Config::default().with_algorithm(algorithm_for(&ops, &devices)?);
        Strategy::build(
            StrategyKind::CentralStorage,
            devices,
            Some(ops),
            config,
            None,
            local_resolver(),
        )
    }

    /// Replicas on every local device of every worker of the cluster `resolver` describes
    /// (default: this process's environment, see [`ClusterSpec`]); `communication` picks the
    /// cross-worker transport.
    ///
    /// Without a cluster (no `resolver`, no TF_CONFIG, no launcher) it runs, as TensorFlow
    /// does, as a single worker on the local devices (logged at `info`), so a script written
    /// for a cluster runs unchanged on one machine.
    ///
    /// `Nccl` runs the cross-worker collectives with NCCL (one rank per worker, on local
    /// replica 0's GPU, the values staged through it) where every local device is a GPU and
    /// NCCL loads; elsewhere it runs the ring over TCP and says why once, at `warn`.
    pub fn multi_worker_mirrored(
        communication: CommunicationImplementation,
        resolver: Option<ClusterSpec>,
        local_devices: &[Device],
    ) -> Result<Strategy> {
        let options = CommunicationOptions {
            implementation: communication,
            ..CommunicationOptions::default()
        };
        Strategy::multi_worker_mirrored_with(&options, resolver, local_devices)
    }

    /// [`Strategy::multi_worker_mirrored`] with TensorFlow's `CommunicationOptions`: the
    /// implementation, the bytes per pack of batch reduces and the collectives' timeout. A zero
    /// timeout is an error (tutti bounds every wait).
    pub fn multi_worker_mirrored_with(
        options: &CommunicationOptions,
        resolver: Option<ClusterSpec>,
        local_devices: &[Device],
    ) -> Result<Strategy> {
        let mut s = Strategy::multi_worker_mirrored_built(options, resolver, local_devices)?;
        if options.bytes_per_pack > 0 {
            s.set_bytes_per_pack(options.bytes_per_pack);
        }
        Ok(s)
    }

    fn multi_worker_mirrored_built(
        options: &CommunicationOptions,
        resolver: Option<ClusterSpec>,
        local_devices: &[Device],
    ) -> Result<Strategy> {
        let communication = options.implementation;
        let config =
            match options.timeout {
                Some(t) if t.is_zero() => return Err(Error::config(
                    "CommunicationOptions: a timeout of 0; tutti bounds every wait (None takes \
                     the configured one, TUTTI_TIMEOUT)",
                )),
                Some(t) => Config::default().with_timeout(t),
                None => Config::default(),
            };
        let devices = if local_devices.is_empty() {
            default_devices()
        } else {
            local_devices.to_vec()
        };
        // Before joining: a worker whose devices cannot be opened must not leave the others
        // waiting for it in their first collective.
        let engine = device_engine(StrategyKind::MultiWorkerMirrored, &devices, &config)?;
        let spec = match resolver {
            Some(s) => Some(s),
            None => ClusterSpec::from_env()?,
        };
        let nccl = match communication {
            CommunicationImplementation::Nccl => match nccl_across_workers(&devices) {
                Ok(gpu) => Some(gpu),
                Err(why) => {
                    static WARNED: std::sync::Once = std::sync::Once::new();
                    WARNED.call_once(|| {
                        log::warn!(
                            "MultiWorkerMirroredStrategy: CommunicationImplementation NCCL cannot \
                             run here ({why}); using RING"
                        )
                    });
                    None
                }
            },
            _ => None,
        };
        let Some(spec) = spec else {
            log(&format!(
                "MultiWorkerMirroredStrategy: no cluster (no TF_CONFIG, no launcher's \
                 variables): running as a single worker on the local devices ({})",
                devices
                    .iter()
                    .map(|d| d.spec())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            let ops = CrossDeviceOps::Ring;
            let local = config.with_algorithm(algorithm_for(&ops, &devices)?);
            return Strategy::build_on(
                StrategyKind::MultiWorkerMirrored,
                devices,
                Some(ops),
                local,
                None,
                local_resolver(),
                engine,
            );
        };
        let kind = match communication {
            CommunicationImplementation::Auto => TransportKind::Auto,
            CommunicationImplementation::Ring | CommunicationImplementation::Nccl => {
                TransportKind::Tcp
            }
        };
        let workers = match nccl {
            Some(gpu) => {
                Communicator::from_cluster_staged_on_gpu(&spec, TransportKind::Auto, gpu, &config)?
            }
            None => Communicator::from_cluster(&spec, kind, &config)?,
        };
        // Every worker must run the same number of replicas.
        let mut n = [devices.len() as u64];
        workers.all_reduce(&mut n, ReduceOp::Max)?;
        if n[0] != devices.len() as u64 {
            return Err(Error::config(format!(
                "MultiWorkerMirroredStrategy: this worker has {} local devices but another has {}; every worker needs the same number",
                devices.len(),
                n[0]
            )));
        }
        let resolver = ClusterResolver {
            task_type: spec.task_type.clone(),
            task_id: spec.task_index,
            is_chief: spec.is_chief,
            num_workers: spec.world_size,
        };
        let ops = CrossDeviceOps::Ring;
        let local = config.with_algorithm(algorithm_for(&ops, &devices)?);
        Strategy::build_on(
            StrategyKind::MultiWorkerMirrored,
            devices,
            Some(ops),
            local,
            Some(Arc::new(workers)),
            resolver,
            engine,
        )
    }

    /// TensorFlow's TPUStrategy: a replica per device of `client` (TPU cores through libtpu, or
    /// any PJRT plugin's devices); the replica context's collectives run as compiled XLA
    /// programs on every device at once.
    #[cfg(feature = "xla")]
    pub fn tpu(client: crate::xla::Client) -> Result<Strategy> {
        let devices: Vec<Device> = client
            .devices()
            .iter()
            .map(|d| Device {
                kind: DeviceKind::Xla,
                index: d.index,
                name: d.kind.clone(),
                memory_bytes: d.memory_bytes,
                physical_index: d.index,
            })
            .collect();
        if devices.is_empty() {
            return Err(Error::Unavailable {
                what: "XLA".into(),
                why: "the PJRT client has no addressable devices".into(),
            });
        }
        let engine: Arc<dyn GroupEngine> = Arc::new(crate::engine::pjrt::Pjrt { client });
        Strategy::build_on(
            StrategyKind::Tpu,
            devices,
            None,
            Config::default(),
            None,
            local_resolver(),
            Some((DeviceKind::Xla, engine)),
        )
    }

    /// The PJRT client whose devices the local replicas are on (TPUStrategy's, or the one a
    /// strategy of XLA devices opened): to run one's own XLA programs on the replicas' buffers,
    /// or read its `cache_stats`. `None` off XLA devices.
    #[cfg(feature = "xla")]
    pub fn xla_client(&self) -> Option<crate::xla::Client> {
        self.engine.as_ref().and_then(|(_, e)| e.xla_client())
    }

    /// Which strategy this is.
    pub fn kind(&self) -> StrategyKind {
        self.kind
    }

    /// The local devices, one per local replica.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The cross-device ops in use, if the strategy has several local replicas to combine.
    pub fn cross_device_ops(&self) -> Option<&CrossDeviceOps> {
        self.cross_device_ops.as_ref()
    }

    /// Replicas on this worker.
    pub fn num_local_replicas(&self) -> usize {
        self.devices.len()
    }

    /// A tensor holding `data` on local replica `local_replica`'s device, from outside
    /// [`Strategy::run`] (as [`ReplicaContext::place`] places it inside): a PJRT buffer under
    /// [`Strategy::tpu`], host memory for CPU replicas. Callable from any thread, during a
    /// run too (an input pipeline placing the next step's batches).
    pub fn place_on_replica<T: Element>(
        &self,
        local_replica: usize,
        data: &[T],
    ) -> Result<DeviceTensor> {
        self.placer()
            .place(local_replica, T::DTYPE, bytemuck::cast_slice(data))
    }

    /// What places values on the local replicas' devices, apart from the strategy.
    pub(crate) fn placer(&self) -> Placer {
        Placer {
            engine: self
                .engine
                .as_ref()
                .map(|(_, e)| e.clone())
                .filter(|e| !e.per_rank()),
            local: self.num_local_replicas(),
        }
    }

    /// Replicas in sync across the whole job.
    pub fn num_replicas_in_sync(&self) -> usize {
        self.devices.len() * self.resolver.num_workers
    }

    /// This worker's index in the collective world.
    fn worker_index(&self) -> usize {
        self.workers.as_ref().map_or(0, |w| w.rank())
    }

    /// The cluster as this strategy sees it.
    pub fn cluster_resolver(&self) -> &ClusterResolver {
        &self.resolver
    }

    /// Multi-worker: go on with the workers still alive after one was lost (a `run`, `reduce`
    /// or variable update failed with [`Error::PeerLost`], or with [`Error::Aborted`] or
    /// [`Error::Timeout`] because of it), without restarting; with none lost, go on after a
    /// worker's rejection aborted the workers' communicator (see [`Strategy::run`]), with the
    /// same workers and the variables as they were. Every surviving worker calls it:
    /// the communicator across workers shrinks to the survivors ([`Communicator::shrink`]),
    /// they are renumbered in their old order (the lowest is the chief), and
    /// [`Strategy::num_replicas_in_sync`] and [`Strategy::cluster_resolver`] follow (its
    /// `task_id` becomes the worker's new index, `is_chief` true on the new chief, whatever
    /// its task type). Split the data again for the new number of replicas
    /// ([`Strategy::distribute_batch`]).
    ///
    /// The state to restore, from the new chief, before the next step: every variable
    /// (`mirrored_variable(&v.value())` makes one from the chief's value), the optimizer's
    /// state and the step counter ([`Strategy::broadcast_from_chief`]). The step that failed
    /// is then repeated: it may have completed on some survivors and not on others, so
    /// their variables may differ by it until the chief's are broadcast.
    ///
    /// Other strategies: [`Error::Unavailable`] (their replicas live and fail in one process);
    /// so does a multi-worker strategy whose workers run NCCL (`CommunicationImplementation::Nccl`
    /// on GPUs).
    pub fn shrink(&mut self) -> Result<()> {
        let Some(workers) = &self.workers else {
            return Err(Error::Unavailable {
                what: format!("shrink of {}", self.kind.name()),
                why: "only MultiWorkerMirroredStrategy across processes has workers to lose".into(),
            });
        };
        // A rejection still on this worker's queue goes out first: the shrink's abort would
        // otherwise take its place, and the other workers would not learn why the call failed.
        // It is bounded by the timeout, as every call is; its own error is the rejection's.
        if let Some(sent) = self.rejection.get_mut().take() {
            let _ = sent.wait_timeout(workers.timeout());
        }
        let survivors = workers.shrink()?;
        self.resolver.task_id = survivors.rank();
        self.resolver.is_chief = survivors.rank() == 0;
        self.resolver.num_workers = survivors.world_size();
        self.workers = Some(Arc::new(survivors));
        Ok(())
    }

    /// `value` as the chief (worker 0) holds it, on every worker of a multi-worker strategy
    /// (a broadcast; this worker's own value elsewhere): the step, an optimizer's state, what
    /// the workers must agree on. Collective across workers: every worker calls it, with the
    /// same length and element type (else an error naming both workers).
    pub fn broadcast_from_chief<T: Element>(&self, value: &[T]) -> Result<Vec<T>> {
        self.chiefs_value(value, "broadcast_from_chief")
    }

    /// Save `ckpt` with `manager` on the chief (worker 0; this worker elsewhere), as
    /// TensorFlow's multi-worker guides have the chief write. Collective across workers: every
    /// worker calls it, and every worker returns the chief's error where the chief could not
    /// write. The path written on the chief, `None` on the other workers.
    pub fn save_checkpoint(
        &self,
        manager: &CheckpointManager,
        ckpt: &Checkpoint,
    ) -> Result<Option<std::path::PathBuf>> {
        let mut path = None;
        self.chiefs_outcome("save_checkpoint", || {
            path = Some(manager.save(ckpt)?);
            Ok(Some(Vec::new()))
        })?;
        // Every worker's manager counts the chief's save, so that their intervals agree.
        manager.saved(ckpt.step());
        Ok(path)
    }

    /// [`Strategy::save_checkpoint`] where `manager`'s checkpoint interval says a checkpoint of
    /// `ckpt.step` is due ([`CheckpointManager::due`]), on every worker alike (each worker's
    /// manager counts the chief's successful saves, through this or `save_checkpoint`); `None`
    /// where it is not due, and on the workers that do not write. Call it every step, on every
    /// worker.
    pub fn save_checkpoint_if_due(
        &self,
        manager: &CheckpointManager,
        ckpt: &Checkpoint,
    ) -> Result<Option<std::path::PathBuf>> {
        if !manager.due(ckpt.step()) {
            return Ok(None);
        }
        self.save_checkpoint(manager, ckpt)
    }

    /// The latest checkpoint in the chief's `manager` directory, read by the chief (worker 0;
    /// this worker elsewhere) and received by every worker, so the workers need no shared file
    /// system; `None` where there is none. Collective across workers; an unreadable or damaged
    /// checkpoint is an error on every worker naming the chief's file.
    pub fn restore_checkpoint(&self, manager: &CheckpointManager) -> Result<Option<Checkpoint>> {
        // The payload: the file's name (its length first, 8 bytes little-endian), its bytes.
        let payload = self.chiefs_outcome("restore_checkpoint", || {
            let Some(path) = manager.latest()? else {
                return Ok(None);
            };
            let name = path.display().to_string();
            let bytes = std::fs::read(&path)
                .map_err(|e| Error::io(format!("reading checkpoint {name}"), e))?;
            let mut out = Vec::with_capacity(8 + name.len() + bytes.len());
            out.extend_from_slice(&(name.len() as u64).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&bytes);
            Ok(Some(out))
        })?;
        let Some(payload) = payload else {
            return Ok(None);
        };
        let (len, rest) = payload.split_at(8.min(payload.len()));
        let len = len
            .try_into()
            .map(u64::from_le_bytes)
            .ok()
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| l <= rest.len())
            .ok_or_else(|| Error::config("restore_checkpoint: the chief's reply is cut short"))?;
        let (name, bytes) = rest.split_at(len);
        Checkpoint::from_bytes(bytes, &String::from_utf8_lossy(name)).map(Some)
    }

    /// What `chief` gives on the chief (worker 0), received by every worker of a multi-worker
    /// strategy: bytes, none, or the chief's error (on every worker: a system error stays one,
    /// named as the chief's). Elsewhere `chief` runs here.
    fn chiefs_outcome(
        &self,
        what: &str,
        chief: impl FnOnce() -> Result<Option<Vec<u8>>>,
    ) -> Result<Option<Vec<u8>>> {
        let Some(w) = &self.workers else {
            return chief();
        };
        const BYTES: u64 = 0;
        const NONE: u64 = 1;
        const FAILED: u64 = 2;
        const FAILED_SYSTEM: u64 = 3;
        let mine = (w.rank() == 0).then(chief);
        let (code, mut payload) = match &mine {
            Some(Ok(Some(b))) => (BYTES, b.clone()),
            Some(Ok(None)) => (NONE, Vec::new()),
            Some(Err(e @ Error::System { .. })) => (FAILED_SYSTEM, e.to_string().into_bytes()),
            Some(Err(e)) => (FAILED, e.to_string().into_bytes()),
            None => (BYTES, Vec::new()),
        };
        let mut head = [code, payload.len() as u64];
        w.broadcast(&mut head, 0)?;
        if w.rank() != 0 {
            // The chief holds these bytes in memory of the same width as this worker's.
            let len = usize::try_from(head[1]).map_err(|_| {
                Error::config(format!(
                    "{what}: the chief's {} bytes do not fit here",
                    head[1]
                ))
            })?;
            payload = vec![0u8; len];
        }
        w.broadcast(&mut payload, 0)?;
        let theirs = || String::from_utf8_lossy(&payload).into_owned();
        match (head[0], mine) {
            (_, Some(Err(e))) => Err(e),
            (FAILED_SYSTEM, _) => Err(Error::System {
                what: format!("{what} on the chief (worker 0)"),
                message: theirs(),
            }),
            (FAILED, _) => Err(Error::config(format!(
                "{what}: failed on the chief (worker 0): {}",
                theirs()
            ))),
            (NONE, _) => Ok(None),
            _ => Ok(Some(payload)),
        }
    }

    /// Set the fusion threshold of batch reduces (TensorFlow's `bytes_per_pack`, Horovod's
    /// fusion threshold): small tensors are packed into buffers of about this size. 0 disables
    /// fusion.
    pub fn set_bytes_per_pack(&mut self, bytes: usize) {
        self.bytes_per_pack = bytes;
    }

    /// Call `f` once per local replica, in parallel, each with its [`ReplicaContext`]. A replica
    /// whose `f` fails makes `run` return that error (its siblings' collectives are woken, not
    /// left waiting); the strategy stays usable on one worker. Across workers, where local
    /// replica 0 fails before a call across workers (its local step of a collective failed),
    /// the other workers' call fails at once naming this worker (see `before_workers`); between
    /// processes that aborts the workers' communicator under the default check, as a
    /// rejection does there: [`Strategy::shrink`] on every worker then gives the same workers
    /// a new one, and the strategy goes on. An `f` that fails with no such call left is not
    /// announced.
    pub fn run<R: Send>(
        &self,
        f: impl Fn(&ReplicaContext<'_>) -> Result<R> + Sync,
    ) -> Result<PerReplica<R>> {
        let n = self.devices.len();
        let slots: Vec<Mutex<Option<R>>> = (0..n).map(|_| Mutex::new(None)).collect();
        let result = {
            // A run inside a replica function would wait for itself: refuse it.
            let local = self.local.try_lock().ok_or_else(|| {
                Error::config(
                    "strategy.run (or batch_reduce, or a variable's cross-replica update) called while a run is going on: inside a replica function use the replica context",
                )
            })?;
            let run_steps = Mutex::new(std::collections::HashMap::new());
            let task = |local_id: usize, comm: &Communicator| -> Result<()> {
                let ctx = ReplicaContext {
                    strategy: self,
                    comm,
                    local_id,
                    run_steps: &run_steps,
                    taken: Mutex::new(std::collections::HashMap::new()),
                };
                match f(&ctx) {
                    Ok(v) => {
                        *slots[local_id].lock() = Some(v);
                        Ok(())
                    }
                    Err(e) => {
                        // Wake the siblings that wait for this replica in a collective.
                        comm.abort(&format!(
                            "replica {} failed: {e}",
                            ctx.replica_id_in_sync_group()
                        ));
                        Err(e)
                    }
                }
            };
            match (&local.replicas, &local.comm) {
                (Some(reps), _) => reps.each(&task),
                (None, Some(comm)) => task(0, comm),
                (None, None) => unreachable!("built in rebuild"),
            }
        };
        if let Err(e) = result {
            self.rebuild()?;
            return Err(e);
        }
        Ok(PerReplica(
            slots
                .into_iter()
                .map(|s| s.into_inner().expect("every replica succeeded"))
                .collect(),
        ))
    }

    /// Reduce a per-replica value across every replica in sync (TensorFlow's `strategy.reduce`):
    /// `axis` `None` reduces element-wise across replicas; `Some(a)` also reduces along axis `a`
    /// of each value (a `Mean` then divides by the total length along `a`). Every worker gets the
    /// result.
    pub fn reduce<T: Element>(
        &self,
        op: ReduceOp,
        value: &PerReplica<Tensor<T>>,
        axis: Option<usize>,
    ) -> Result<Tensor<T>> {
        // This worker's part first: where it fails, the other workers hear why in the
        // all-reduce they make next.
        let (mut out, shape, mut along) =
            match self.before_workers(Collective::AllReduce, self.reduce_here(op, value, axis))? {
                Reduced::Done(t) => return Ok(t),
                Reduced::Local { sum, shape, along } => (sum, shape, along),
            };
        if let Some(w) = &self.workers {
            if axis.is_some() {
                let mut total = [along as u64];
                w.all_reduce(&mut total, ReduceOp::Sum)?;
                along = total[0] as usize;
            }
            w.all_reduce(&mut out, ReduceOp::Sum)?;
        }
        if op == ReduceOp::Mean {
            let n = if axis.is_some() {
                along
            } else {
                self.num_replicas_in_sync()
            };
            crate::dtype::kernels::divide(T::DTYPE, bytemuck::cast_slice_mut(&mut out), n.max(1));
        }
        Ok(Tensor { data: out, shape })
    }

    /// [`Strategy::reduce`]'s part on this worker's replicas, before any call across workers.
    fn reduce_here<T: Element>(
        &self,
        op: ReduceOp,
        value: &PerReplica<Tensor<T>>,
        axis: Option<usize>,
    ) -> Result<Reduced<T>> {
        check_sum_or_mean(op, "reduce")?;
        let mut along = 1usize;
        let parts: Vec<Tensor<T>> = match axis {
            None => value.0.clone(),
            Some(a) => {
                along = value.0.iter().map(|t| *t.shape.get(a).unwrap_or(&0)).sum();
                value
                    .0
                    .iter()
                    .map(|t| t.reduce_axis(a, ReduceOp::Sum))
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let shape = parts.first().map(|t| t.shape.clone()).unwrap_or_default();
        if let Some(t) = parts.iter().find(|t| t.shape != shape) {
            return Err(Error::config(format!(
                "reduce: replica values have different shapes ({:?} and {:?})",
                shape, t.shape
            )));
        }
        let inputs: Vec<&[T]> = parts.iter().map(|t| t.data.as_slice()).collect();
        let mut sum = vec![T::from_f64(0.0); shape.iter().product()];
        if let (Some(c), None, None) = (self.custom_ops(op, T::DTYPE), &self.workers, axis) {
            // Not inside a run (where the op may be running), and one reduce at a time.
            let _outside_run = self.outside_run()?;
            // The caller's op takes the op itself (it divides a MEAN).
            custom_reduce(c, op, &inputs, &mut sum)?;
            return Ok(Reduced::Done(Tensor { data: sum, shape }));
        }
        self.local_reduce(&inputs, &mut sum)?;
        Ok(Reduced::Local { sum, shape, along })
    }

    /// `local`, this worker's own part of a cross-replica call before a `collective` across
    /// workers that every worker makes next: where it failed, this worker takes its place in
    /// that collective as a rejection, so that the other workers fail it at once naming this
    /// worker and why, rather than wait for this one until the timeout. Not while a run goes
    /// on (a cross-replica call from inside a replica function, its own error): there the
    /// workers' calls are local replica 0's ([`ReplicaContext::before_workers`]).
    fn before_workers<R>(&self, collective: Collective, local: Result<R>) -> Result<R> {
        if self.local.is_locked() {
            return local;
        }
        self.in_place_of(collective, local)
    }

    /// `local`, or where it failed, this worker's place in the workers' next `collective` taken
    /// as a rejection with its error.
    fn in_place_of<R>(&self, collective: Collective, local: Result<R>) -> Result<R> {
        if let (Err(e), Some(w)) = (&local, &self.workers) {
            *self.rejection.lock() = Some(w.reject(collective, &e.to_string()));
        }
        local
    }

    /// Sum the local replicas' values into `out`.
    fn local_reduce<T: Element>(&self, inputs: &[&[T]], out: &mut [T]) -> Result<()> {
        let local = self.outside_run()?;
        if let Some(c) = self.custom_ops(ReduceOp::Sum, T::DTYPE) {
            return custom_reduce(c, ReduceOp::Sum, inputs, out);
        }
        match &local.replicas {
            Some(reps) => reps.reduce(inputs, out, ReduceOp::Sum),
            None => {
                out.copy_from_slice(inputs[0]);
                Ok(())
            }
        }
    }

    /// The replicas, for a cross-replica call: an error inside a run (or while one goes on).
    fn outside_run(&self) -> Result<parking_lot::MutexGuard<'_, Local>> {
        self.local.try_lock().ok_or_else(|| {
            Error::config(
                "strategy.reduce called inside run: use the replica context's all_reduce there",
            )
        })
    }

    /// Concatenate the replicas' values along `axis`, in replica order across the whole job
    /// (TensorFlow's `strategy.gather`). The values may differ in length along `axis` only.
    pub fn gather<T: Element>(
        &self,
        value: &PerReplica<Tensor<T>>,
        axis: usize,
    ) -> Result<Tensor<T>> {
        let local = self.before_workers(Collective::AllGather, Tensor::concat(&value.0, axis))?;
        let Some(w) = &self.workers else {
            return Ok(local);
        };
        // Workers' parts may differ in length along the axis: share the lengths, then gather
        // each worker's part at its own length.
        let p = w.world_size();
        let mut lens = vec![0u64; p];
        w.all_gather(&[local.data.len() as u64], &mut lens)?;
        let counts = lens
            .iter()
            .map(|&l| usize::try_from(l).ok())
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| {
                Error::config("gather: a worker's part is longer than this host can hold")
            })?;
        let total = counts
            .iter()
            .try_fold(0usize, |a, &c| a.checked_add(c))
            .ok_or_else(|| {
                Error::config("gather: the workers' parts sum past what a buffer holds")
            })?;
        let mut all = vec![T::from_f64(0.0); total];
        w.all_gather_v(&local.data, &mut all, &counts)?;
        let inner: usize = local
            .shape
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != axis)
            .map(|(_, d)| *d)
            .product();
        let mut parts = Vec::with_capacity(p);
        let mut rest = &all[..];
        for len in counts {
            let (data, tail) = rest.split_at(len);
            rest = tail;
            let mut shape = local.shape.clone();
            shape[axis] = len.checked_div(inner).unwrap_or(0);
            parts.push(Tensor {
                data: data.to_vec(),
                shape,
            });
        }
        Tensor::concat(&parts, axis)
    }

    /// Which rows of a global batch of `rows` rows each of this worker's replicas takes, as
    /// [`Strategy::distribute_batch`] splits it: contiguous, the first `rows % replicas`
    /// replicas in sync one row more.
    pub fn batch_rows(&self, rows: usize) -> Vec<std::ops::Range<usize>> {
        let n = self.num_replicas_in_sync();
        let first = self.worker_index() * self.devices.len();
        (first..first + self.devices.len())
            .map(|g| crate::algorithm::partition(rows, n, g))
            .collect()
    }

    /// Split a global batch of `rows` rows (each `row_len` elements) across every replica in
    /// sync and return this worker's replicas' shards. Shards are contiguous; when the rows do not
    /// divide evenly, the first `rows % replicas` replicas get one row more (a replica may get
    /// none). Gradients should then be summed and divided by the global batch size.
    pub fn distribute_batch<T: Element>(
        &self,
        batch: &[T],
        row_len: usize,
    ) -> Result<PerReplica<Vec<T>>> {
        if row_len == 0 || batch.len() % row_len != 0 {
            return Err(Error::config(format!(
                "distribute_batch: {} elements are not whole rows of {row_len}",
                batch.len()
            )));
        }
        Ok(PerReplica(
            self.batch_rows(batch.len() / row_len)
                .into_iter()
                .map(|r| batch[r.start * row_len..r.end * row_len].to_vec())
                .collect(),
        ))
    }

    /// Create a variable mirrored on every replica, initialised to the chief's `initial` (as
    /// TensorFlow, Horovod's `broadcast_variables` and DDP do): on a multi-worker strategy the
    /// chief's value is broadcast to every worker, so workers that computed different initial
    /// values (another seed) still start identical. Every worker creates the same variables in
    /// the same order; one whose `initial` differs in length or element type from the chief's
    /// gets an error naming both workers (so does the chief).
    pub fn mirrored_variable<T: Element>(&self, initial: &[T]) -> Result<MirroredVariable<T>> {
        let value = self.chiefs_value(initial, "mirrored_variable")?;
        Ok(MirroredVariable::new(&value, self.devices.len()))
    }

    /// Create a mirrored variable whose copies live on the replicas' devices
    /// ([`DeviceVariable`]), initialised to the chief's `initial` as
    /// [`Strategy::mirrored_variable`] is: each copy placed on its replica's device once.
    pub fn device_variable<T: Element>(&self, initial: &[T]) -> Result<DeviceVariable<T>> {
        let value = self.chiefs_value(initial, "device_variable")?;
        let copies = self.run(|ctx| ctx.place(&value))?;
        Ok(DeviceVariable::new(copies.0, self.config.timeout))
    }

    /// Create a variable stored once (CentralStorageStrategy's way), initialised to the chief's
    /// `initial` as [`Strategy::mirrored_variable`] is.
    pub fn central_variable<T: Element>(&self, initial: &[T]) -> Result<CentralVariable<T>> {
        let value = self.chiefs_value(initial, "central_variable")?;
        Ok(CentralVariable::new(&value))
    }

    /// `initial` as the chief holds it: broadcast from the chief (worker 0) to every worker
    /// of a multi-worker strategy; this worker's own value elsewhere. The broadcast is checked
    /// across workers, so a length or element type that differs is an error naming both.
    fn chiefs_value<T: Element>(&self, initial: &[T], what: &str) -> Result<Vec<T>> {
        let mut value = initial.to_vec();
        let Some(w) = &self.workers else {
            return Ok(value);
        };
        w.broadcast(&mut value, 0).map_err(|e| match e {
            Error::Mismatch {
                peer,
                field,
                mine,
                theirs,
                ..
            } => {
                let field = match field {
                    "count" => "element count",
                    "dtype" => "element type",
                    f => f,
                };
                Error::config(format!(
                    "{what}: the initial value's {field} is {mine} on this worker (rank {}) \
                     but {theirs} on rank {peer}; every worker creates the same variables, in \
                     the same order, with the same shape and element type (the chief's value, \
                     rank 0's, is broadcast to the others)",
                    w.rank()
                ))
            }
            e => e,
        })?;
        Ok(value)
    }

    /// Reduce each of `values` (per-replica tensors) across every replica, packing small ones
    /// into buffers of `bytes_per_pack` so that fewer, larger collectives run.
    pub fn batch_reduce<T: Element>(
        &self,
        op: ReduceOp,
        values: &[PerReplica<Vec<T>>],
    ) -> Result<Vec<Vec<T>>> {
        let n = self.devices.len();
        let checked = check_sum_or_mean(op, "batch_reduce").and_then(|()| {
            match values.iter().find(|v| v.0.len() != n) {
                Some(v) => Err(Error::config(format!(
                    "batch_reduce: a value has {} replicas' parts, not {n}",
                    v.0.len()
                ))),
                None => Ok(()),
            }
        });
        if values.is_empty() {
            // No call across workers follows.
            checked?;
        } else {
            self.before_workers(Collective::AllReduce, checked)?;
        }
        let out = self.run(|ctx| {
            let mut mine: Vec<Vec<T>> = values.iter().map(|v| v.0[ctx.local_id].clone()).collect();
            let mut views: Vec<&mut [T]> = mine.iter_mut().map(|v| v.as_mut_slice()).collect();
            ctx.all_reduce_batch(op, &mut views)?;
            Ok(mine)
        })?;
        Ok(out.0.into_iter().next().unwrap_or_default())
    }

    /// The caller's cross-device op, where it combines `op` of `dtype` values: TensorFlow's
    /// ops (SUM, MEAN) of floating-point values across several local replicas. Other ops and
    /// integers (tutti's own bookkeeping: lengths, agreement, bit-exact gathers) run on the
    /// strategy's algorithms.
    fn custom_ops(&self, op: ReduceOp, dtype: crate::DType) -> Option<&CustomOps> {
        match &self.cross_device_ops {
            Some(CrossDeviceOps::Custom(c))
                if self.devices.len() > 1
                    && matches!(op, ReduceOp::Sum | ReduceOp::Mean)
                    && dtype.is_float() =>
            {
                Some(c)
            }
            _ => None,
        }
    }

    /// The fusion threshold for a batch of `total` bytes: HierarchicalCopyAllReduce's
    /// `num_packs` splits the batch into that many packs, else `bytes_per_pack`.
    fn pack_bytes(&self, total: usize) -> usize {
        match &self.cross_device_ops {
            Some(CrossDeviceOps::HierarchicalCopyAllReduce { num_packs, .. }) if *num_packs > 0 => {
                total.div_ceil(*num_packs).max(1)
            }
            _ => self.bytes_per_pack,
        }
    }
}

/// [`Strategy::reduce`] on this worker: the whole result (the caller's op, on one worker), or
/// the local replicas' sum, its shape, and the length along the reduced axis, for the workers.
enum Reduced<T> {
    Done(Tensor<T>),
    Local {
        sum: Vec<T>,
        shape: Vec<usize>,
        along: usize,
    },
}

/// `op` over `inputs` (one per local replica) into `out`, through the caller's cross-device op.
fn custom_reduce<T: Element>(
    c: &CustomOps,
    op: ReduceOp,
    inputs: &[&[T]],
    out: &mut [T],
) -> Result<()> {
    // Copies as the elements (aligned as they are), seen as bytes.
    let mut values: Vec<Vec<T>> = inputs.iter().map(|v| v.to_vec()).collect();
    let mut views: Vec<&mut [u8]> = values
        .iter_mut()
        .map(|v| bytemuck::cast_slice_mut::<T, u8>(v))
        .collect();
    c.0.all_reduce(op, T::DTYPE, &mut views)?;
    out.copy_from_slice(&values[0]);
    Ok(())
}

fn check_sum_or_mean(op: ReduceOp, what: &str) -> Result<()> {
    if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
        return Err(Error::config(format!(
            "{what}: TensorFlow's ReduceOp is SUM or MEAN, not {op}"
        )));
    }
    Ok(())
}

/// The devices a strategy given none runs on: every GPU, else the CPU.
pub fn default_devices() -> Vec<Device> {
    let all = device::discover();
    let gpus: Vec<Device> = all
        .iter()
        .filter(|d| d.kind == DeviceKind::Gpu)
        .cloned()
        .collect();
    if gpus.is_empty() {
        all.into_iter()
            .filter(|d| d.kind == DeviceKind::Cpu)
            .take(1)
            .collect()
    } else {
        gpus
    }
}

/// TensorFlow's choice of cross-device ops, with its fallbacks logged.
fn choose_cross_device_ops(devices: &[Device], asked: Option<CrossDeviceOps>) -> CrossDeviceOps {
    let all_gpu = devices.iter().all(|d| d.kind == DeviceKind::Gpu);
    let virtual_gpus = devices.iter().filter(|d| d.kind == DeviceKind::Gpu).count()
        > devices
            .iter()
            .filter(|d| d.kind == DeviceKind::Gpu)
            .map(|d| d.physical_index)
            .collect::<std::collections::BTreeSet<_>>()
            .len();
    let fallback = CrossDeviceOps::ReductionToOneDevice {
        reduce_to_device: None,
    };
    match asked {
        // One replica: nothing crosses devices, whatever carries it.
        Some(CrossDeviceOps::NcclAllReduce) | None if devices.len() <= 1 => fallback,
        // XLA devices reduce with XLA's own collectives, whatever the op.
        None if devices.iter().all(|d| d.kind == DeviceKind::Xla) => fallback,
        // A named algorithm cannot change how XLA's programs reduce: said, not silently
        // dropped (a caller's `Custom` op is not this arm's: it runs, on host memory).
        Some(ops)
            if devices.len() > 1
                && devices.iter().all(|d| d.kind == DeviceKind::Xla)
                && !matches!(ops, CrossDeviceOps::Custom(_)) =>
        {
            log::warn!(
                "MirroredStrategy: {} does not apply on XLA devices, whose replicas reduce \
                 with XLA's own collectives (compiled programs where the values lie); its \
                 algorithm is not used (HierarchicalCopyAllReduce's num_packs still packs a \
                 batch)",
                ops.name()
            );
            if ops == CrossDeviceOps::NcclAllReduce {
                fallback
            } else {
                ops
            }
        }
        Some(CrossDeviceOps::NcclAllReduce) | None => {
            #[cfg(feature = "cuda")]
            if all_gpu && !virtual_gpus && crate::gpu::nccl_library().is_ok() {
                return CrossDeviceOps::NcclAllReduce;
            }
            let why = if !all_gpu {
                "not every device is a GPU".to_string()
            } else if virtual_gpus {
                "NCCL refuses virtual GPUs".to_string()
            } else {
                no_nccl()
            };
            let msg = format!(
                "MirroredStrategy: NcclAllReduce is not usable ({why}); using ReductionToOneDevice"
            );
            // TensorFlow's own choice falls back quietly; one the user named is a warning.
            if asked.is_some() {
                log::warn!("{msg}");
            } else {
                log(&msg);
            }
            fallback
        }
        Some(ops) => ops,
    }
}

impl ReplicaContext<'_> {
    /// This replica's index among every replica in sync (TensorFlow's
    /// `replica_id_in_sync_group`).
    pub fn replica_id_in_sync_group(&self) -> usize {
        self.strategy.worker_index() * self.strategy.devices.len() + self.local_id
    }

    /// This replica's index on this worker.
    pub fn local_replica_id(&self) -> usize {
        self.local_id
    }

    /// Replicas in sync across the job.
    pub fn num_replicas_in_sync(&self) -> usize {
        self.strategy.num_replicas_in_sync()
    }

    /// The device this replica runs on.
    pub fn device(&self) -> &Device {
        &self.strategy.devices[self.local_id]
    }

    /// The strategy.
    pub fn strategy(&self) -> &Strategy {
        self.strategy
    }

    /// The number of the step this replica takes next with the optimizer `optimizer` (its id),
    /// which had taken `iterations` steps before this call: the steps it had taken when this
    /// run's replicas first stepped with it, plus those this replica has taken with it since.
    /// The same on every replica of a step however far apart they run (a replica may begin its
    /// next step before replica 0 has counted the last), counted as taken.
    pub(crate) fn step_number(&self, optimizer: u64, iterations: u64) -> u64 {
        // Every replica calls this before the step's collective, so the first of them sees the
        // count before any replica of the run has added to it.
        let base = *self.run_steps.lock().entry(optimizer).or_insert(iterations);
        let mut taken = self.taken.lock();
        let k = taken.entry(optimizer).or_insert(0);
        *k += 1;
        base + *k - 1
    }

    /// `local`, this replica's part before a `collective` across workers (see
    /// [`Strategy::before_workers`]): local replica 0 makes the workers' calls, so it alone
    /// takes this worker's place there as a rejection where its part failed (a sibling's
    /// failure reaches it through the local collective it then waits in).
    pub(crate) fn before_workers<R>(&self, collective: Collective, local: Result<R>) -> Result<R> {
        if self.local_id == 0 {
            self.strategy.in_place_of(collective, local)
        } else {
            local
        }
    }

    /// All-reduce across every replica in sync: local reduce, cross-worker all-reduce (from local
    /// replica 0), local broadcast. `Mean` divides by the number of replicas in sync.
    pub fn all_reduce<T: Element>(&self, op: ReduceOp, buf: &mut [T]) -> Result<()> {
        self.all_reduce_bytes(op, T::DTYPE, bytemuck::cast_slice_mut(buf))
    }

    fn all_reduce_bytes(&self, op: ReduceOp, dtype: DType, buf: &mut [u8]) -> Result<()> {
        let custom = self.strategy.custom_ops(op, dtype);
        let Some(workers) = &self.strategy.workers else {
            return match custom {
                Some(c) => self.custom_all_reduce(c, op, dtype, buf),
                None => self.comm.all_reduce_raw(dtype, None, buf, op),
            };
        };
        let combine = op.combining();
        let local = match custom {
            Some(c) => self.custom_all_reduce(c, combine, dtype, buf),
            None => self.comm.all_reduce_raw(dtype, None, buf, combine),
        };
        if self.local_id == 0 {
            self.before_workers(Collective::AllReduce, local)?;
            workers.all_reduce_raw(dtype, None, buf, combine)?;
        } else {
            local?;
        }
        self.comm.broadcast_raw(dtype, buf, 0)?;
        if op == ReduceOp::Mean {
            crate::dtype::kernels::divide(dtype, buf, self.num_replicas_in_sync());
        }
        Ok(())
    }

    /// The local replicas' all-reduce through the caller's cross-device op.
    fn custom_all_reduce(
        &self,
        c: &CustomOps,
        op: ReduceOp,
        dtype: DType,
        buf: &mut [u8],
    ) -> Result<()> {
        self.strategy.meet.all_reduce(
            self.local_id,
            self.strategy.devices.len(),
            &*c.0,
            op,
            dtype,
            buf,
            self.strategy.config.timeout,
            self.comm,
        )
    }

    /// A tensor holding `data` on this replica's device, as TensorFlow places a replica's
    /// values: a PJRT buffer under `Strategy::tpu`, host memory for CPU replicas. The
    /// replica context's collectives on tensors run on it where it lies.
    pub fn place<T: Element>(&self, data: &[T]) -> Result<DeviceTensor> {
        self.comm.place(data)
    }

    /// [`ReplicaContext::all_reduce`] of a tensor on this replica's device, in place, where it
    /// lies: on XLA devices one compiled program over the replicas' device buffers, with no
    /// copy through host memory. Across workers, local replica 0 alone takes the local result
    /// to the host for the workers' all-reduce and back; a caller's own cross-device op
    /// ([`CrossDeviceOps::Custom`]) reduces host memory, so each replica's value goes there
    /// and back.
    pub fn all_reduce_tensor(&self, op: ReduceOp, t: &mut DeviceTensor) -> Result<()> {
        let dtype = t.dtype();
        let custom = self.strategy.custom_ops(op, dtype);
        let workers = self.strategy.workers.as_ref();
        if custom.is_none() && workers.is_none() {
            return self.comm.all_reduce_tensor(t, op);
        }
        if let Some(bytes) = t.host_bytes_mut() {
            return self.all_reduce_bytes(op, dtype, bytes);
        }
        let combine = if workers.is_some() {
            op.combining()
        } else {
            op
        };
        let local = match custom {
            Some(c) => t.to_host().and_then(|mut host| {
                let bytes = host.host_bytes_mut().expect("a tensor in host memory");
                self.custom_all_reduce(c, combine, dtype, bytes)?;
                *t = self.comm.place_bytes(dtype, bytes)?;
                Ok(())
            }),
            None => self.comm.all_reduce_tensor(t, combine),
        };
        let Some(workers) = workers else {
            return local;
        };
        if self.local_id == 0 {
            let local = local.and_then(|()| t.to_host());
            let mut host = self.before_workers(Collective::AllReduce, local)?;
            let bytes = host.host_bytes_mut().expect("a tensor in host memory");
            workers.all_reduce_raw(dtype, None, bytes, combine)?;
            if op == ReduceOp::Mean {
                crate::dtype::kernels::divide(dtype, bytes, self.num_replicas_in_sync());
            }
            *t = self.comm.place_bytes(dtype, bytes)?;
        } else {
            local?;
        }
        self.comm.broadcast_tensor(t, 0)
    }

    /// The worker and local replica of the replica `root` (an index in sync), or an error
    /// where there is none.
    fn root_of(&self, root: usize) -> Result<(usize, usize)> {
        let n = self.strategy.num_replicas_in_sync();
        if root >= n {
            return Err(Error::config(format!(
                "broadcast: root replica {root} is out of range for {n} replicas"
            )));
        }
        let local_n = self.strategy.devices.len();
        Ok((root / local_n, root % local_n))
    }

    /// [`ReplicaContext::broadcast`] of a tensor on this replica's device, where it lies
    /// (across workers, through local replica 0's host memory).
    pub fn broadcast_tensor(&self, t: &mut DeviceTensor, root: usize) -> Result<()> {
        let local = self.root_of(root).and_then(|(root_worker, root_local)| {
            self.comm.broadcast_tensor(t, root_local)?;
            Ok(root_worker)
        });
        let Some(w) = &self.strategy.workers else {
            return local.map(drop);
        };
        if self.local_id == 0 {
            let dtype = t.dtype();
            let local = local.and_then(|root| Ok((root, t.to_host()?)));
            let (root_worker, mut host) = self.before_workers(Collective::Broadcast, local)?;
            let bytes = host.host_bytes_mut().expect("a tensor in host memory");
            w.broadcast_raw(dtype, bytes, root_worker)?;
            *t = self.comm.place_bytes(dtype, bytes)?;
        } else {
            local?;
        }
        self.comm.broadcast_tensor(t, 0)
    }

    /// All-reduce many tensors at once, packed into buffers of the strategy's `bytes_per_pack`.
    /// The values are the same as one all-reduce per tensor.
    pub fn all_reduce_batch<T: Element>(&self, op: ReduceOp, bufs: &mut [&mut [T]]) -> Result<()> {
        let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let per_pack = self
            .strategy
            .pack_bytes(lens.iter().sum::<usize>() * T::DTYPE.size());
        for pack in pack_plan(&lens, T::DTYPE.size(), per_pack) {
            if let [i] = pack[..] {
                self.all_reduce(op, bufs[i])?;
                continue;
            }
            let mut packed: Vec<T> = pack.iter().flat_map(|&i| bufs[i].iter().copied()).collect();
            self.all_reduce(op, &mut packed)?;
            let mut at = 0;
            for &i in &pack {
                bufs[i].copy_from_slice(&packed[at..at + lens[i]]);
                at += lens[i];
            }
        }
        Ok(())
    }

    /// Broadcast `buf` from the replica `root` (an index in sync) to every replica.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let local = self.root_of(root).and_then(|(root_worker, root_local)| {
            self.comm.broadcast(buf, root_local)?;
            Ok(root_worker)
        });
        let Some(w) = &self.strategy.workers else {
            return local.map(drop);
        };
        if self.local_id == 0 {
            let root_worker = self.before_workers(Collective::Broadcast, local)?;
            w.broadcast(buf, root_worker)?;
        } else {
            local?;
        }
        self.comm.broadcast(buf, 0)
    }

    /// Every replica's `input` (all the same length), concatenated in replica order.
    pub fn all_gather<T: Element>(&self, input: &[T]) -> Result<Vec<T>> {
        let local_n = self.strategy.devices.len();
        let mut local = vec![T::from_f64(0.0); input.len() * local_n];
        let gathered = self.comm.all_gather(input, &mut local);
        let Some(w) = &self.strategy.workers else {
            return gathered.map(|()| local);
        };
        let mut all = vec![T::from_f64(0.0); local.len() * w.world_size()];
        if self.local_id == 0 {
            self.before_workers(Collective::AllGather, gathered)?;
            w.all_gather(&local, &mut all)?;
        } else {
            gathered?;
        }
        self.comm.broadcast(&mut all, 0)?;
        Ok(all)
    }

    /// [`ReplicaContext::all_gather`] of a tensor on this replica's device, where it lies: `t`
    /// becomes every replica's, concatenated in replica order (across workers, through local
    /// replica 0's host memory).
    pub fn all_gather_tensor(&self, t: &mut DeviceTensor) -> Result<()> {
        let gathered = self.comm.all_gather_tensor(t);
        let Some(w) = &self.strategy.workers else {
            return gathered;
        };
        let dtype = t.dtype();
        let local = gathered.and_then(|()| {
            t.len()
                .checked_mul(w.world_size())
                .filter(|n| {
                    n.checked_mul(dtype.size())
                        .is_some_and(|b| b <= isize::MAX as usize)
                })
                .ok_or_else(|| {
                    Error::config(format!(
                        "all_gather of {t:?} over {} workers: more bytes than a buffer can hold",
                        w.world_size()
                    ))
                })
        });
        let all = if self.local_id == 0 {
            let local = local.and_then(|len| Ok((len, t.to_host()?)));
            let (len, mut host) = self.before_workers(Collective::AllGather, local)?;
            let mut all = DeviceTensor::zeroed(dtype, len);
            let local = host.host_bytes_mut().expect("a tensor in host memory");
            let out = all.host_bytes_mut().expect("a tensor in host memory");
            w.all_gather_raw(dtype, Some(local), out)?;
            all
        } else {
            // The other local replicas upload a tensor of the gathered length, which receives
            // replica 0's.
            DeviceTensor::zeroed(dtype, local?)
        };
        *t = self.comm.place_bytes(dtype, all.host_bytes())?;
        self.comm.broadcast_tensor(t, 0)
    }

    /// `var.assign_add(update)` after the updates of every replica were aggregated.
    pub fn assign_add<T: Element>(
        &self,
        var: &MirroredVariable<T>,
        update: &[T],
        agg: Aggregation,
    ) -> Result<()> {
        var.update_in_replica(self, update, agg, variables::Update::Add)
    }

    /// `var.assign_sub(update)` after aggregation.
    pub fn assign_sub<T: Element>(
        &self,
        var: &MirroredVariable<T>,
        update: &[T],
        agg: Aggregation,
    ) -> Result<()> {
        var.update_in_replica(self, update, agg, variables::Update::Sub)
    }

    /// `var.assign(value)` after aggregation.
    pub fn assign<T: Element>(
        &self,
        var: &MirroredVariable<T>,
        value: &[T],
        agg: Aggregation,
    ) -> Result<()> {
        var.update_in_replica(self, value, agg, variables::Update::Set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::local::LocalTransport;

    /// Workers whose parts differ in length along the axis gather every part at its own
    /// length, in worker order (one all_gather_v, no padding).
    #[test]
    fn gather_across_workers_keeps_each_part_its_length() {
        let config = Config::default().with_timeout(std::time::Duration::from_secs(20));
        let comms: Vec<Communicator> = LocalTransport::group(3, config.timeout)
            .into_iter()
            .map(|t| Communicator::new(Arc::new(t), &config))
            .collect();
        let got: Vec<Tensor<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(w, comm)| {
                    let config = config.clone();
                    s.spawn(move || {
                        let resolver = ClusterResolver {
                            task_type: "worker".into(),
                            task_id: w,
                            is_chief: w == 0,
                            num_workers: 3,
                        };
                        let devices = crate::device::logical_cpus(1).unwrap();
                        let s = Strategy::build(
                            StrategyKind::MultiWorkerMirrored,
                            devices,
                            None,
                            config,
                            Some(Arc::new(comm)),
                            resolver,
                        )
                        .unwrap();
                        // Worker w holds w rows of 2 (worker 0 none).
                        let rows: Vec<f32> = (0..2 * w).map(|i| (10 * w + i) as f32).collect();
                        let t = Tensor::new(rows, vec![w, 2]).unwrap();
                        s.gather(&PerReplica(vec![t]), 0).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for g in got {
            assert_eq!(g.shape, vec![3, 2]);
            assert_eq!(g.data, vec![10.0, 11.0, 20.0, 21.0, 22.0, 23.0]);
        }
    }
}
