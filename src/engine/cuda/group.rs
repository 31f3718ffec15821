//! [`GpuGroup`]: the collectives over buffers on several GPUs (or logical GPUs) of this process,
//! or over one rank per process with NCCL, with one of three algorithms.
//!
//! | algorithm | all-reduce | the other collectives |
//! |---|---|---|
//! | `nccl` | `ncclAllReduce` on every device in one NCCL group | NCCL's broadcast, all-gather, reduce, reduce-scatter |
//! | `hierarchical-copy[:G]` | TensorFlow's HierarchicalCopyAllReduce: groups of G consecutive devices (default 2) reduce onto their first device, the leaders onto device 0, and the result is copied back the same way | flat, as `reduce-to-one` |
//! | `reduce-to-one[:ROOT]` | TensorFlow's ReductionToOneDevice: ROOT (default 0) reduces every buffer in device order, then every device copies the result | broadcast: every device copies the root's buffer; reduce: the root reduces every input; all-gather: every device copies every input; reduce-scatter: device r reduces slice r of every input |
//! | `auto` | `nccl` when NCCL is present and every device is a whole GPU of its own; otherwise `reduce-to-one`, as TensorFlow's MirroredStrategy falls back (the reason goes to stderr) | |
//!
//! All-to-all, gather, scatter and the calls with a count per block ([`Blocks`]) run as NCCL's
//! grouped sends and receives (reduce-scatter-v: one `ncclReduce` per block), or between logical
//! GPUs as one copy or reduction per block. Point-to-point between the GPUs of one process meets
//! in the engine (`super::pairs`) and moves with [`GpuGroup::pair_copy`].
//!
//! The copy-based all-reduces are not written here: they are the host's schedules of moves
//! (`algorithm::CopyAlgorithm`), which a [`GpuGroup`] queues move by move as copies and
//! reductions over every device of the group. They read a peer GPU's memory directly where
//! `cuDeviceCanAccessPeer` allows (peer access is enabled when the group is built) and logical
//! GPUs of one physical GPU always can; other sources are first copied to a scratch buffer on
//! the reducing GPU (`cuMemcpyPeerAsync`, which the driver stages through the host). Reductions
//! run the kernels of [`super::kernels`]. Every device works on its own stream; events order the
//! steps between streams, and a call returns once every stream is idle (or fails at the timeout).
//!
//! A call is synchronous: the buffers must not be in use by other work when it starts, and they
//! hold the result when it returns. Each group runs one call at a time.
//!
//! (Why one long file: the group's three algorithms share its devices, streams, events, scratch
//! buffers and the one checked call path; split, their invariants would span files.)

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::kernels::{self, Kernels};
use super::moves::{self, DeviceOp};
use crate::algorithm::{CopyAlgorithm, Move, Ranks};
use crate::cluster::store::Store;
use crate::cluster::ClusterSpec;
use crate::config::Config;
use crate::device::cuda::buffer::{DeviceMut, DevicePtr, DeviceRef, Region};
use crate::device::cuda::discovery::{DeviceInner, GpuDevice};
use crate::device::cuda::driver;
use crate::device::cuda::nccl::{self, Call, Comms};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Collective, Error, Result, Site};

/// A call issued on a caller's CUDA stream: the work queued there before the call (an event
/// recorded there), which the call's device work waits for; the caller's stream; and the event
/// the call records after its device work, which that stream then waits for. Dropping it is
/// safe once no call uses its events (see [`GpuGroup::retire`]): the driver frees an event
/// that something still waits on once it completes.
pub(crate) struct StreamMark {
    event: driver::Event,
    end: driver::Event,
    stream: u64,
}

impl StreamMark {
    /// The event before the call, for [`GpuGroup::execute`].
    pub(crate) fn raw(&self) -> u64 {
        self.event.raw()
    }

    /// The event after the call's device work, for [`GpuGroup::execute`] and
    /// [`GpuGroup::stream_done`].
    pub(crate) fn end(&self) -> u64 {
        self.end.raw()
    }

    /// The caller's stream.
    pub(crate) fn stream(&self) -> u64 {
        self.stream
    }
}

/// How a [`GpuGroup`] runs its collectives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum GpuAlgorithm {
    /// NCCL when it can run (NCCL present, every device a whole GPU), else `ReductionToOneDevice`.
    #[default]
    Auto,
    /// NCCL (TensorFlow's NcclAllReduce).
    Nccl,
    /// TensorFlow's HierarchicalCopyAllReduce over groups of `group_size` devices.
    HierarchicalCopy {
        /// Devices per group (default 2).
        group_size: usize,
    },
    /// TensorFlow's ReductionToOneDevice onto device `root`.
    ReductionToOneDevice {
        /// The device that reduces (default 0).
        root: usize,
    },
}

impl GpuAlgorithm {
    /// The algorithms `tutti perf --device gpu` and the tests sweep.
    pub const ALL: [GpuAlgorithm; 3] = [
        GpuAlgorithm::Nccl,
        GpuAlgorithm::HierarchicalCopy { group_size: 2 },
        GpuAlgorithm::ReductionToOneDevice { root: 0 },
    ];

    /// The GPU form of a core algorithm: `auto`, `hierarchical-copy[:G]` and `reduce-to-one[:R]`
    /// carry over; `direct` and `ring` are CPU algorithms (on GPUs NCCL runs its own rings).
    pub fn from_core(a: crate::Algorithm) -> Result<GpuAlgorithm> {
        match a {
            crate::Algorithm::Auto => Ok(GpuAlgorithm::Auto),
            crate::Algorithm::HierarchicalCopy { group_size } => {
                Ok(GpuAlgorithm::HierarchicalCopy { group_size })
            }
            crate::Algorithm::ReduceToOne { root } => Ok(GpuAlgorithm::ReductionToOneDevice { root }),
            a => Err(Error::config(format!(
                "algorithm {a} runs on CPUs; on GPUs use nccl, hierarchical-copy[:G], reduce-to-one[:ROOT] or auto"
            ))),
        }
    }
}

impl fmt::Display for GpuAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuAlgorithm::Auto => f.write_str("auto"),
            GpuAlgorithm::Nccl => f.write_str("nccl"),
            GpuAlgorithm::HierarchicalCopy { group_size: 2 } => f.write_str("hierarchical-copy"),
            GpuAlgorithm::HierarchicalCopy { group_size } => {
                write!(f, "hierarchical-copy:{group_size}")
            }
            GpuAlgorithm::ReductionToOneDevice { root: 0 } => f.write_str("reduce-to-one"),
            GpuAlgorithm::ReductionToOneDevice { root } => write!(f, "reduce-to-one:{root}"),
        }
    }
}

impl FromStr for GpuAlgorithm {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<GpuAlgorithm, String> {
        let l = s.to_ascii_lowercase().replace('_', "-");
        match l.as_str() {
            "nccl" | "nccl-all-reduce" | "ncclallreduce" => Ok(GpuAlgorithm::Nccl),
            _ => match l.parse::<crate::Algorithm>() {
                Ok(a) => GpuAlgorithm::from_core(a).map_err(|e| e.to_string()),
                Err(_) => Err(format!(
                    "unknown GPU algorithm '{s}' (expected auto, nccl, hierarchical-copy[:GROUP] or reduce-to-one[:ROOT])"
                )),
            },
        }
    }
}

/// A group of GPUs (or logical GPUs) running collectives together: one per replica.
pub struct GpuGroup {
    // Fields drop in order: the NCCL communicators before the devices' streams and contexts.
    nccl: Option<Comms>,
    devices: Vec<GpuDevice>,
    algorithm: GpuAlgorithm,
    fallback: Option<String>,
    timeout: Duration,
    first_rank: usize,
    world: usize,
    /// `readable[a][b]`: device a's kernels may read device b's memory.
    readable: Vec<Vec<bool>>,
    scratch: Vec<Mutex<Scratch>>,
    calls: AtomicU64,
    aborted: Mutex<Option<String>>,
    busy: Mutex<()>,
    /// Stream marks of calls that failed on their own rank while the group's call may still
    /// use their events (rank 0 runs an in-process group's call for every rank): freed once
    /// no call runs (the next call, or the group's drop).
    retired: Mutex<Vec<Box<dyn crate::engine::StreamMark>>>,
}

impl fmt::Debug for GpuGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuGroup")
            .field("devices", &self.devices)
            .field("algorithm", &self.algorithm)
            .field(
                "ranks",
                &(self.first_rank..self.first_rank + self.devices.len()),
            )
            .field("world", &self.world)
            .finish()
    }
}

/// The blocks of a call with a count per block, for each of this process's devices: P + 1
/// offsets (elements, P the world's ranks) into its input (`send`) and into its output
/// (`recv`). all_gather_v and reduce_scatter_v give the call's one list in both (rank r's block
/// is r of both); all_to_all_v each device's own (block j: what goes to, or comes from, rank j).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Blocks {
    pub(crate) send: Vec<Vec<usize>>,
    pub(crate) recv: Vec<Vec<usize>>,
}

impl Blocks {
    /// The one list of offsets `o` of an all_gather_v or reduce_scatter_v on `n` devices.
    fn shared(o: Vec<usize>, n: usize) -> Blocks {
        Blocks {
            send: vec![o.clone(); n],
            recv: vec![o; n],
        }
    }

    /// Elements of block `k` of the offsets `o`.
    fn len(o: &[usize], k: usize) -> usize {
        o[k + 1] - o[k]
    }
}

/// The counts of a list of offsets.
fn counts_of(o: &[usize]) -> Vec<usize> {
    o.windows(2).map(|w| w[1] - w[0]).collect()
}

/// A scratch allocation on one device, grown on demand, for sources it cannot read directly.
struct Scratch {
    ptr: u64,
    bytes: usize,
}

/// Why NCCL cannot run on these devices, if it cannot.
fn nccl_refusal(devices: &[GpuDevice]) -> Option<String> {
    for (i, a) in devices.iter().enumerate() {
        if let Some(b) = devices[..i].iter().find(|b| b.physical() == a.physical()) {
            return Some(format!(
                "NCCL refuses two ranks on one physical GPU: {} and {} are both on GPU {} (virtual GPUs need hierarchical-copy or reduce-to-one)",
                b.describe(),
                a.describe(),
                a.physical()
            ));
        }
    }
    None
}

/// `Auto`'s NCCL communicators: what `start` makes, or why they did not start (a sandbox
/// without the network NCCL needs, say), logged; `Auto` then falls back to
/// ReductionToOneDevice.
fn start_or_fall_back<C>(start: impl FnOnce() -> Result<C>) -> std::result::Result<C, String> {
    start().map_err(|e| {
        let why = format!("NCCL's communicators did not start: {e}");
        driver::log(&format!(
            "GPU group: NcclAllReduce is not usable ({why}); using ReductionToOneDevice"
        ));
        why
    })
}

fn check_devices(devices: &[GpuDevice]) -> Result<()> {
    if devices.is_empty() {
        return Err(Error::config("a GPU group needs at least one device"));
    }
    for (i, a) in devices.iter().enumerate() {
        if devices[..i].iter().any(|b| b.same(a)) {
            return Err(Error::config(format!(
                "{} is given twice; a GPU group needs a distinct device per replica",
                a.describe()
            )));
        }
    }
    Ok(())
}

impl GpuGroup {
    /// A group over `devices` (one replica each) in this process, running `algorithm`, with
    /// `config`'s timeout on every wait. `Nccl` on logical GPUs that share a physical GPU is an
    /// error saying why; `Auto` then falls back to `ReductionToOneDevice`, as it does when NCCL
    /// does not load or its communicators do not start (the reason is logged and kept:
    /// [`GpuGroup::fallback_reason`]). A pair of GPUs whose peer access the driver refuses has
    /// its copies staged through the host (logged).
    pub fn new(
        devices: &[GpuDevice],
        algorithm: GpuAlgorithm,
        config: &Config,
    ) -> Result<GpuGroup> {
        check_devices(devices)?;
        let n = devices.len();
        let auto = algorithm == GpuAlgorithm::Auto;
        let (mut algorithm, mut fallback) = match algorithm {
            GpuAlgorithm::Auto => match nccl_refusal(devices)
                .map_or_else(|| nccl::api().map(|_| ()).map_err(|e| e.to_string()), Err)
            {
                Ok(()) => (GpuAlgorithm::Nccl, None),
                Err(why) => {
                    driver::log(&format!(
                        "GPU group: NcclAllReduce is not usable ({why}); using ReductionToOneDevice"
                    ));
                    (GpuAlgorithm::ReductionToOneDevice { root: 0 }, Some(why))
                }
            },
            GpuAlgorithm::Nccl => {
                if let Some(why) = nccl_refusal(devices) {
                    return Err(Error::config(why));
                }
                nccl::api()?;
                (GpuAlgorithm::Nccl, None)
            }
            GpuAlgorithm::HierarchicalCopy { group_size: 0 } => {
                return Err(Error::config(
                    "hierarchical-copy: the group size must be at least 1",
                ))
            }
            GpuAlgorithm::ReductionToOneDevice { root } if root >= n => {
                return Err(Error::config(format!(
                    "reduce-to-one: root {root} is out of range for a group of {n} devices"
                )))
            }
            a => (a, None),
        };
        let nccl = if algorithm == GpuAlgorithm::Nccl {
            let start = || -> Result<Comms> {
                let id = nccl::unique_id()?;
                let inner: Vec<&DeviceInner> = devices.iter().map(|d| &*d.inner).collect();
                Comms::init(&inner, &id, 0, n, config.timeout)
            };
            if auto {
                match start_or_fall_back(start) {
                    Ok(comms) => Some(comms),
                    Err(why) => {
                        algorithm = GpuAlgorithm::ReductionToOneDevice { root: 0 };
                        fallback = Some(why);
                        None
                    }
                }
            } else {
                Some(start()?)
            }
        } else {
            None
        };
        let mut readable = vec![vec![true; n]; n];
        if nccl.is_none() {
            for a in 0..n {
                for b in 0..n {
                    let (x, y) = (&devices[a].inner.ctx, &devices[b].inner.ctx);
                    if x.ordinal != y.ordinal {
                        readable[a][b] = match driver::enable_peer_access(x, y) {
                            Ok(on) => on,
                            Err(why) => {
                                driver::log(&format!(
                                    "GPU group: {} reads {}'s memory through host-staged copies: \
                                     peer access failed ({why})",
                                    devices[a].describe(),
                                    devices[b].describe()
                                ));
                                false
                            }
                        };
                    }
                }
            }
        }
        Ok(GpuGroup {
            devices: devices.to_vec(),
            algorithm,
            fallback,
            timeout: config.timeout,
            first_rank: 0,
            world: n,
            nccl,
            readable,
            scratch: (0..n)
                .map(|_| Mutex::new(Scratch { ptr: 0, bytes: 0 }))
                .collect(),
            calls: AtomicU64::new(0),
            aborted: Mutex::new(None),
            busy: Mutex::new(()),
            retired: Mutex::new(Vec::new()),
        })
    }

    /// This process's part of a group of processes (NCCL, one rank per device): `rank` of
    /// `world` processes, meeting through `store`. Each process gives its own devices (any
    /// number, each a whole GPU); the NCCL ranks follow the process ranks, then each process's
    /// device order. Rank 0 makes NCCL's unique id and publishes it in the store; every wait
    /// is bounded by `config`'s timeout (give processes that start late enough time).
    pub fn from_store(
        store: &dyn Store,
        rank: usize,
        world: usize,
        devices: &[GpuDevice],
        config: &Config,
    ) -> Result<GpuGroup> {
        GpuGroup::join(store, rank, world, devices, config, config.timeout)
    }

    fn join(
        store: &dyn Store,
        rank: usize,
        world: usize,
        devices: &[GpuDevice],
        config: &Config,
        setup: Duration,
    ) -> Result<GpuGroup> {
        check_devices(devices)?;
        if rank >= world {
            return Err(Error::config(format!(
                "rank {rank} is out of range for a world of {world}"
            )));
        }
        if let Some(why) = nccl_refusal(devices) {
            return Err(Error::config(why));
        }
        nccl::api()?;
        let generation = store.add(&format!("tutti/gpu/generation/{rank}"), 1)?;
        let key = |what: &str| format!("tutti/gpu/{generation}/{what}");
        store.set(
            &key(&format!("devices/{rank}")),
            devices.len().to_string().as_bytes(),
        )?;
        let deadline = Instant::now() + setup;
        let mut counts = Vec::with_capacity(world);
        for r in 0..world {
            let v = store.get(
                &key(&format!("devices/{r}")),
                deadline.saturating_duration_since(Instant::now()),
            )?;
            let n: usize = std::str::from_utf8(&v)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| {
                    Error::config(format!(
                        "rendezvous: rank {r} published a malformed device count"
                    ))
                })?;
            counts.push(n);
        }
        let first_rank: usize = counts[..rank].iter().sum();
        let total: usize = counts.iter().sum();
        let id: [u8; 128] = if rank == 0 {
            let id = nccl::unique_id()?;
            store.set(&key("nccl-id"), &id)?;
            id
        } else {
            let v = store.get(
                &key("nccl-id"),
                deadline.saturating_duration_since(Instant::now()),
            )?;
            v.as_slice().try_into().map_err(|_| {
                Error::config(format!(
                    "rendezvous: the NCCL id from rank 0 has {} bytes, not 128",
                    v.len()
                ))
            })?
        };
        let inner: Vec<&DeviceInner> = devices.iter().map(|d| &*d.inner).collect();
        let comms = Comms::init(&inner, &id, first_rank, total, setup)?;
        let n = devices.len();
        Ok(GpuGroup {
            devices: devices.to_vec(),
            algorithm: GpuAlgorithm::Nccl,
            fallback: None,
            timeout: config.timeout,
            first_rank,
            world: total,
            nccl: Some(comms),
            readable: vec![vec![true; n]; n],
            scratch: (0..n)
                .map(|_| Mutex::new(Scratch { ptr: 0, bytes: 0 }))
                .collect(),
            calls: AtomicU64::new(0),
            aborted: Mutex::new(None),
            busy: Mutex::new(()),
            retired: Mutex::new(Vec::new()),
        })
    }

    /// This process's part of the job `spec` describes (see [`ClusterSpec`]), over NCCL: the
    /// NCCL id travels through the job's rendezvous store (served by rank 0). `devices` `None`
    /// means one GPU per process: GPU `local_rank % GPUs` (or `rank % GPUs`).
    pub fn from_cluster(
        spec: &ClusterSpec,
        devices: Option<&[GpuDevice]>,
        config: &Config,
    ) -> Result<GpuGroup> {
        let rank = spec.collective_rank()?;
        // The one rule of every way of joining: the job's secret, or a refusal (before a
        // device is opened or any connection is made or accepted).
        let token = spec.job_key()?;
        let owned;
        let devices = match devices {
            Some(d) => d,
            None => {
                let gpus = crate::device::cuda::discovery::devices()?;
                let pick = spec.local_rank.unwrap_or(rank) % gpus.len();
                let plan =
                    crate::device::cuda::VirtualGpuConfig::new().plan(&gpus[pick..pick + 1])?;
                owned = vec![GpuDevice::open(&plan[0])?];
                &owned[..]
            }
        };
        // Processes may start at different times: joining waits for them as long as the
        // configured timeout, and no longer (a short timeout asked for is honoured here too).
        let setup = config.timeout;
        let store = crate::cluster::store::store_for(spec, rank, &token, setup)?;
        GpuGroup::join(&store, rank, spec.world_size, devices, config, setup)
    }

    /// The group of the job this process's environment describes (`tutti launch`, torchrun,
    /// mpirun, srun, `TF_CONFIG`), one GPU per process.
    pub fn from_env(config: &Config) -> Result<GpuGroup> {
        let spec = ClusterSpec::from_env()?.ok_or_else(|| {
            Error::config("GpuGroup::from_env: no cluster in the environment (run under tutti launch, torchrun, mpirun or srun, or set TF_CONFIG)")
        })?;
        GpuGroup::from_cluster(&spec, None, config)
    }

    /// This process's devices, in rank order.
    pub fn devices(&self) -> &[GpuDevice] {
        &self.devices
    }

    /// The algorithm the group runs (`auto` resolved).
    pub fn algorithm(&self) -> GpuAlgorithm {
        self.algorithm
    }

    /// Why `auto` did not choose NCCL, when it did not.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Ranks in the whole group (every process's devices).
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The rank of this process's first device.
    pub fn first_rank(&self) -> usize {
        self.first_rank
    }

    /// The bound on every wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Mark the work queued so far on a caller's CUDA stream (a `CUstream` or `cudaStream_t` of
    /// device `index`'s GPU, in its primary context; 0: the legacy default stream), for a call
    /// to wait for ([`GpuGroup::execute`]).
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of that GPU, or 0.
    pub(crate) unsafe fn mark_stream(&self, index: usize, stream: u64) -> Result<StreamMark> {
        let d = self.devices.get(index).ok_or_else(|| {
            Error::config(format!(
                "device {index} is not in this GPU group of {}",
                self.devices.len()
            ))
        })?;
        let event = driver::Event::new(&d.inner.ctx)?;
        let end = driver::Event::new(&d.inner.ctx)?;
        // SAFETY: as the caller promises.
        unsafe { event.record_raw(stream)? };
        Ok(StreamMark { event, end, stream })
    }

    /// Make the caller's `stream` wait for the end event `end` of a call that ran on device
    /// `index` (recorded by [`GpuGroup::execute`] before the call returned on any rank). On the
    /// thread that issued the call: a per-thread default stream handle means that thread's.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of that device's GPU (or 0), as given to `mark_stream`.
    pub(crate) unsafe fn order_caller(&self, index: usize, stream: u64, end: u64) -> Result<()> {
        let d = self.device_at(index)?;
        // SAFETY: as the caller promises; the end event is the call's own, of this context.
        unsafe { driver::stream_wait_raw(&d.inner.ctx, stream, end) }
    }

    /// Keep the mark of a call that failed on its own rank until no call of this group runs:
    /// in an in-process group, rank 0 may still be queueing that call with the mark's events.
    pub(crate) fn retire(&self, mark: Box<dyn crate::engine::StreamMark>) {
        self.retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(mark);
    }

    fn device_at(&self, index: usize) -> Result<&GpuDevice> {
        self.devices.get(index).ok_or_else(|| {
            Error::config(format!(
                "device {index} is not in this GPU group of {}",
                self.devices.len()
            ))
        })
    }

    /// Wait for the device work of a call that ran on a caller's stream on device `index` (its
    /// `end` event, see [`GpuGroup::execute`]): `Ok(true)` once done, `Ok(false)` once `until`
    /// passed first. Past `deadline` (the call's), the device is marked failed, the group
    /// aborted and the error is `Timeout`. NCCL's asynchronous errors are watched meanwhile.
    pub(crate) fn stream_done(
        &self,
        site: Site,
        index: usize,
        end: u64,
        until: Instant,
        deadline: Instant,
    ) -> Result<bool> {
        let d = self.device_at(index)?;
        let stop = until.min(deadline);
        let what = format!("NCCL {site}");
        let start = Instant::now();
        loop {
            if driver::event_done(&d.inner.ctx, end)? {
                return Ok(true);
            }
            if let Some(comms) = &self.nccl {
                // Only for its errors: a communicator busy with a later call is no sign of
                // this one.
                comms.in_progress(&what)?;
            }
            let now = Instant::now();
            if now >= stop {
                break;
            }
            driver::pause(now - start);
        }
        if stop < deadline {
            return Ok(false);
        }
        d.inner.mark_failed();
        let e = Error::Timeout {
            site,
            waiting_for: vec![self.first_rank + index],
            phase: "finish its work on the GPU (queued before the caller's stream's next work)",
            timeout: self.timeout,
            stalled_on: Vec::new(),
        };
        self.abort(&format!("an earlier call failed: {e}"));
        Err(e)
    }

    /// Abort the group: NCCL communicators are aborted, and this and later calls fail.
    pub fn abort(&self, reason: &str) {
        let mut a = self.aborted.lock().unwrap_or_else(|p| p.into_inner());
        if a.is_none() {
            *a = Some(reason.to_string());
        }
        drop(a);
        if let Some(c) = &self.nccl {
            c.abort();
        }
    }

    /// The abort reason, once aborted.
    pub fn aborted(&self) -> Option<String> {
        self.aborted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    // ----- the typed collectives -----

    /// In place: every buffer becomes the element-wise `op` over every rank's buffer.
    pub fn all_reduce<T: Element, B: DeviceMut<T>>(
        &self,
        bufs: &mut [B],
        op: ReduceOp,
    ) -> Result<()> {
        let regions = self.regions(Collective::AllReduce, bufs.iter().map(|b| b.region()))?;
        let count = self.same_len(Collective::AllReduce, &regions, "buffer")?;
        let ptrs: Vec<u64> = regions.iter().map(|r| r.ptr).collect();
        self.execute(
            Collective::AllReduce,
            T::DTYPE,
            op,
            0,
            count,
            None,
            &ptrs,
            &ptrs,
            &[],
            &[],
        )
    }

    /// `recv[i]` = the element-wise `op` over every rank's `send`.
    pub fn all_reduce_into<T: Element, S: DeviceRef<T>, D: DeviceMut<T>>(
        &self,
        send: &[S],
        recv: &mut [D],
        op: ReduceOp,
    ) -> Result<()> {
        let c = Collective::AllReduce;
        let s = self.regions(c, send.iter().map(|b| b.region()))?;
        let r = self.regions(c, recv.iter().map(|b| b.region()))?;
        let count = self.same_len(c, &s, "send buffer")?;
        self.expect_len(c, &r, count, "receive buffer")?;
        self.no_partial_overlap(c, &s, &r, T::DTYPE.size())?;
        self.execute(
            c,
            T::DTYPE,
            op,
            0,
            count,
            None,
            &ptrs(&s),
            &ptrs(&r),
            &[],
            &[],
        )
    }

    /// In place: every buffer becomes rank `root`'s.
    pub fn broadcast<T: Element, B: DeviceMut<T>>(
        &self,
        bufs: &mut [B],
        root: usize,
    ) -> Result<()> {
        let c = Collective::Broadcast;
        let regions = self.regions(c, bufs.iter().map(|b| b.region()))?;
        let count = self.same_len(c, &regions, "buffer")?;
        let p = ptrs(&regions);
        self.execute(
            c,
            T::DTYPE,
            ReduceOp::Sum,
            root,
            count,
            None,
            &p,
            &p,
            &[],
            &[],
        )
    }

    /// `recv[i]` = every rank's `send`, in rank order (`recv` holds world × `send`).
    pub fn all_gather<T: Element, S: DeviceRef<T>, D: DeviceMut<T>>(
        &self,
        send: &[S],
        recv: &mut [D],
    ) -> Result<()> {
        let c = Collective::AllGather;
        let s = self.regions(c, send.iter().map(|b| b.region()))?;
        let r = self.regions(c, recv.iter().map(|b| b.region()))?;
        let count = self.same_len(c, &s, "send buffer")?;
        self.expect_len(c, &r, count * self.world, "receive buffer")?;
        for (i, (a, b)) in s.iter().zip(&r).enumerate() {
            let own = b.ptr + ((self.first_rank + i) * count * T::DTYPE.size()) as u64;
            if a.ptr != own && overlaps(a, b, T::DTYPE.size()) {
                return Err(self.invalid(c, format!(
                    "device {i}: the send buffer overlaps the receive buffer but is not its slice for rank {} (the in-place form)",
                    self.first_rank + i
                )));
            }
        }
        self.execute(
            c,
            T::DTYPE,
            ReduceOp::Sum,
            0,
            count,
            None,
            &ptrs(&s),
            &ptrs(&r),
            &[],
            &[],
        )
    }

    /// The root receives the element-wise `op` over every rank's `send` in `recv` (which this
    /// process gives exactly when it holds rank `root`; it must be on that rank's device).
    pub fn reduce<T: Element, S: DeviceRef<T>, D: DeviceMut<T>>(
        &self,
        send: &[S],
        recv: Option<&mut D>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let c = Collective::Reduce;
        let s = self.regions(c, send.iter().map(|b| b.region()))?;
        let count = self.same_len(c, &s, "send buffer")?;
        let local_root = root
            .checked_sub(self.first_rank)
            .filter(|&i| i < self.devices.len());
        let mut r = vec![0u64; self.devices.len()];
        match (local_root, recv) {
            (Some(i), Some(d)) => {
                let reg = d.region();
                if !reg.dev.same(&self.devices[i]) {
                    return Err(self.invalid(
                        c,
                        format!(
                            "the receive buffer is on {}, but rank {root} is {}",
                            reg.dev.describe(),
                            self.devices[i].describe()
                        ),
                    ));
                }
                if reg.len != count {
                    return Err(self.invalid(
                        c,
                        format!(
                            "the receive buffer has {} elements, the send buffers {count}",
                            reg.len
                        ),
                    ));
                }
                self.no_partial_overlap(
                    c,
                    &s[i..i + 1],
                    std::slice::from_ref(&reg),
                    T::DTYPE.size(),
                )?;
                r[i] = reg.ptr;
            }
            (Some(_), None) => {
                return Err(self.invalid(
                    c,
                    format!("rank {root} (the root) is this process's: give a receive buffer"),
                ))
            }
            (None, Some(_)) if root < self.world => {
                return Err(self.invalid(
                    c,
                    format!("rank {root} (the root) is another process's: give no receive buffer"),
                ))
            }
            _ => {}
        }
        self.execute(c, T::DTYPE, op, root, count, None, &ptrs(&s), &r, &[], &[])
    }

    /// `recv[i]` = slice `rank` of the element-wise `op` over every rank's `send` (`send`
    /// holds world × `recv`).
    pub fn reduce_scatter<T: Element, S: DeviceRef<T>, D: DeviceMut<T>>(
        &self,
        send: &[S],
        recv: &mut [D],
        op: ReduceOp,
    ) -> Result<()> {
        let c = Collective::ReduceScatter;
        let s = self.regions(c, send.iter().map(|b| b.region()))?;
        let r = self.regions(c, recv.iter().map(|b| b.region()))?;
        let count = self.same_len(c, &r, "receive buffer")?;
        self.expect_len(c, &s, count * self.world, "send buffer")?;
        for (i, (a, b)) in s.iter().zip(&r).enumerate() {
            if overlaps(a, b, T::DTYPE.size()) {
                return Err(self.invalid(
                    c,
                    format!("device {i}: the send and receive buffers overlap"),
                ));
            }
        }
        self.execute(
            c,
            T::DTYPE,
            op,
            0,
            count,
            None,
            &ptrs(&s),
            &ptrs(&r),
            &[],
            &[],
        )
    }

    /// Any collective over device addresses, for carriers such as the C ABI. `send[i]` and
    /// `recv[i]` belong to this process's device `i` (their `device` field must say so) and
    /// must lie in device memory of its physical GPU, in allocations big enough for the call:
    /// `count` elements per rank (all-gather: `send` count, `recv` world × count;
    /// reduce-scatter: `send` world × count, `recv` count; broadcast: `send` read on the root
    /// only; reduce: `recv` used on the root only, may be 0 elsewhere). Equal `send` and `recv`
    /// run in place.
    #[allow(clippy::too_many_arguments)]
    pub fn collective_raw(
        &self,
        collective: Collective,
        dtype: DType,
        count: usize,
        op: ReduceOp,
        root: usize,
        send: &[DevicePtr],
        recv: &[DevicePtr],
    ) -> Result<()> {
        self.collective_raw_after(collective, dtype, count, op, root, send, recv, &[], &[])
    }

    /// [`GpuGroup::collective_raw`], with device i's work first waiting for the event
    /// `after[i]`, and recording `ends[i]` once queued ([`GpuGroup::execute`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn collective_raw_after(
        &self,
        collective: Collective,
        dtype: DType,
        count: usize,
        op: ReduceOp,
        root: usize,
        send: &[DevicePtr],
        recv: &[DevicePtr],
        after: &[u64],
        ends: &[u64],
    ) -> Result<()> {
        let c = collective;
        if c == Collective::Barrier {
            return Err(self.invalid(
                c,
                "a GPU group has no barrier; use a collective of zero elements".to_string(),
            ));
        }
        let es = dtype.size();
        // The caller's count: world × count elements, and their bytes, must not wrap.
        let whole = count
            .checked_mul(self.world)
            .filter(|n| n.checked_mul(es).is_some_and(|b| b <= isize::MAX as usize))
            .ok_or_else(|| {
                self.invalid(
                    c,
                    format!(
                        "{} × count {count} of {dtype} is more bytes than a buffer can hold",
                        self.world
                    ),
                )
            })?;
        let (send_len, recv_len) = match c {
            Collective::AllGather | Collective::Gather => (count, whole),
            Collective::ReduceScatter | Collective::Scatter => (whole, count),
            Collective::AllToAll => (whole, whole),
            _ => (count, count),
        };
        // Off the root a broadcast and a scatter send nothing, a reduce and a gather receive
        // nothing: those addresses may be null.
        let s = self.addresses(
            c,
            es,
            "send",
            send,
            |_| send_len,
            matches!(c, Collective::Broadcast | Collective::Scatter),
        )?;
        let r = self.addresses(
            c,
            es,
            "receive",
            recv,
            |_| recv_len,
            matches!(c, Collective::Reduce | Collective::Gather),
        )?;
        if let Some(i) = root.checked_sub(self.first_rank) {
            let null = match c {
                Collective::Reduce | Collective::Gather => r.get(i) == Some(&0),
                Collective::Scatter => s.get(i) == Some(&0),
                _ => false,
            };
            if null && count > 0 {
                let which = if c == Collective::Scatter {
                    "send"
                } else {
                    "receive"
                };
                return Err(self.invalid(
                    c,
                    format!("device {i} holds the root (rank {root}): its {which} address is null"),
                ));
            }
        }
        self.execute(c, dtype, op, root, count, None, &s, &r, after, ends)
    }

    /// all_gather_v over the group: device i's `send` holds `counts[r]` elements, r its rank;
    /// every `recv` holds the sum of the counts, rank j's block at `counts[0] + … +
    /// counts[j-1]`. Addresses as for [`GpuGroup::collective_raw`]; `send` and `recv` are
    /// disjoint.
    pub fn all_gather_v_raw(
        &self,
        dtype: DType,
        counts: &[usize],
        send: &[DevicePtr],
        recv: &[DevicePtr],
    ) -> Result<()> {
        let c = Collective::AllGatherV;
        let o = self.offsets_of(c, dtype, "counts", counts)?;
        let blocks = Blocks::shared(o, self.devices.len());
        self.collective_v_after(c, dtype, ReduceOp::Sum, &blocks, send, recv, &[], &[])
    }

    /// reduce_scatter_v over the group: every `send` holds the sum of the counts; device i's
    /// `recv` (`counts[r]` elements, r its rank) ends with block r of their reduction by `op`.
    pub fn reduce_scatter_v_raw(
        &self,
        dtype: DType,
        op: ReduceOp,
        counts: &[usize],
        send: &[DevicePtr],
        recv: &[DevicePtr],
    ) -> Result<()> {
        let c = Collective::ReduceScatterV;
        let o = self.offsets_of(c, dtype, "counts", counts)?;
        let blocks = Blocks::shared(o, self.devices.len());
        self.collective_v_after(c, dtype, op, &blocks, send, recv, &[], &[])
    }

    /// all_to_all_v over the group: device i (rank i) sends `send_counts[i][j]` elements of
    /// its `send` (blocks in rank order) to rank j, which receives them as its
    /// `recv_counts[j][i]`; each pair's counts must agree. A group whose ranks span
    /// processes refuses it (the other processes' counts are not at hand to check).
    pub fn all_to_all_v_raw(
        &self,
        dtype: DType,
        send: &[DevicePtr],
        send_counts: &[&[usize]],
        recv: &[DevicePtr],
        recv_counts: &[&[usize]],
    ) -> Result<()> {
        let c = Collective::AllToAllV;
        let lists = |name: &str, v: &[&[usize]]| -> Result<Vec<Vec<usize>>> {
            if v.len() != self.devices.len() {
                return Err(self.invalid(
                    c,
                    format!(
                        "{} lists of {name} for a group of {} devices in this process",
                        v.len(),
                        self.devices.len()
                    ),
                ));
            }
            v.iter()
                .enumerate()
                .map(|(i, l)| self.offsets_of(c, dtype, &format!("{name}[{i}]"), l))
                .collect()
        };
        let blocks = Blocks {
            send: lists("send_counts", send_counts)?,
            recv: lists("recv_counts", recv_counts)?,
        };
        self.collective_v_after(c, dtype, ReduceOp::Sum, &blocks, send, recv, &[], &[])
    }

    /// P + 1 offsets (elements) from a count per rank of the group's world.
    fn offsets_of(
        &self,
        c: Collective,
        dtype: DType,
        name: &str,
        counts: &[usize],
    ) -> Result<Vec<usize>> {
        if counts.len() != self.world {
            return Err(self.invalid(
                c,
                format!(
                    "{name} has {} entries for a world of {} ranks; it needs one per rank",
                    counts.len(),
                    self.world
                ),
            ));
        }
        let mut o = Vec::with_capacity(counts.len() + 1);
        o.push(0usize);
        let mut at = 0usize;
        for (k, &n) in counts.iter().enumerate() {
            at = at
                .checked_add(n)
                .filter(|a| a.checked_mul(dtype.size()).is_some_and(|b| b <= isize::MAX as usize))
                .ok_or_else(|| {
                    self.invalid(
                        c,
                        format!("{name} up to rank {k} sum to more {dtype} elements than a buffer can hold"),
                    )
                })?;
            o.push(at);
        }
        Ok(o)
    }

    /// A call with a count per block ([`Blocks`]: the communicator's offsets, or the raw
    /// forms' counts), device i's work ordered as in [`GpuGroup::execute`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn collective_v_after(
        &self,
        c: Collective,
        dtype: DType,
        op: ReduceOp,
        blocks: &Blocks,
        send: &[DevicePtr],
        recv: &[DevicePtr],
        after: &[u64],
        ends: &[u64],
    ) -> Result<()> {
        let (n, p) = (self.devices.len(), self.world);
        if !matches!(
            c,
            Collective::AllGatherV | Collective::ReduceScatterV | Collective::AllToAllV
        ) {
            return Err(self.invalid(c, format!("{c} has no count per block")));
        }
        if blocks.send.len() != n || blocks.recv.len() != n {
            return Err(self.invalid(
                c,
                format!(
                    "{} send and {} receive block lists for a group of {n} devices",
                    blocks.send.len(),
                    blocks.recv.len()
                ),
            ));
        }
        let rank = |i: usize| self.first_rank + i;
        let lists = (blocks.send.iter().map(|o| ("send", o)))
            .enumerate()
            .chain(blocks.recv.iter().map(|o| ("receive", o)).enumerate());
        for (i, (what, o)) in lists {
            if o.len() != p + 1 || o[0] != 0 || o.windows(2).any(|w| w[0] > w[1]) {
                return Err(self.invalid(
                    c,
                    format!(
                        "rank {}'s {what} blocks are not {} increasing offsets from 0 (one \
                         count per rank of {p}): {} offsets",
                        rank(i),
                        p + 1,
                        o.len()
                    ),
                ));
            }
        }
        let len = Blocks::len;
        if c == Collective::AllToAllV {
            if n != p {
                return Err(Error::Unavailable {
                    what: format!("{c} on a GPU group spanning processes"),
                    why: "each pair's counts are checked before anything moves, and the other \
                          processes' counts are not at hand here; run all_to_all_v on host \
                          buffers, or on a group of this process's GPUs"
                        .into(),
                });
            }
            for (i, j) in (0..n).flat_map(|i| (0..n).map(move |j| (i, j))) {
                let (sent, expected) = (len(&blocks.send[i], j), len(&blocks.recv[j], i));
                if sent != expected {
                    return Err(self.invalid(
                        c,
                        format!(
                            "rank {} sends {sent} elements to rank {}, which expects {expected} \
                             from it (send_counts[{j}] of rank {} against recv_counts[{i}] of \
                             rank {})",
                            rank(i),
                            rank(j),
                            rank(i),
                            rank(j)
                        ),
                    ));
                }
            }
        } else if let Some(i) = (1..n).find(|&i| blocks.send[i] != blocks.send[0]) {
            return Err(self.invalid(
                c,
                format!(
                    "rank {} has counts {:?} but rank {} has {:?}; every rank gives the same",
                    rank(i),
                    counts_of(&blocks.send[i]),
                    rank(0),
                    counts_of(&blocks.send[0])
                ),
            ));
        }
        let total = |o: &[usize]| o[p];
        let (send_len, recv_len): (Vec<usize>, Vec<usize>) = (0..n)
            .map(|i| match c {
                Collective::AllGatherV => (len(&blocks.send[i], rank(i)), total(&blocks.recv[i])),
                Collective::ReduceScatterV => {
                    (total(&blocks.send[i]), len(&blocks.recv[i], rank(i)))
                }
                _ => (total(&blocks.send[i]), total(&blocks.recv[i])),
            })
            .unzip();
        let es = dtype.size();
        let s = self.addresses(c, es, "send", send, |i| send_len[i], false)?;
        let r = self.addresses(c, es, "receive", recv, |i| recv_len[i], false)?;
        for i in 0..n {
            let (a0, a1) = (s[i], s[i] + (send_len[i] * es) as u64);
            let (b0, b1) = (r[i], r[i] + (recv_len[i] * es) as u64);
            if a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1 {
                return Err(self.invalid(
                    c,
                    format!(
                        "device {i}: the send and receive buffers overlap; {c} has no in-place \
                         form"
                    ),
                ));
            }
        }
        self.execute(c, dtype, op, 0, 0, Some(blocks), &s, &r, after, ends)
    }

    // ----- argument checks -----

    /// The addresses of `ptrs` (one per device, in device order, `len(i)` elements of `es`
    /// bytes on device i), each checked to lie in its device's memory; 0 where the buffer is
    /// empty or (`optional`) not given.
    fn addresses(
        &self,
        c: Collective,
        es: usize,
        what: &str,
        ptrs: &[DevicePtr],
        len: impl Fn(usize) -> usize,
        optional: bool,
    ) -> Result<Vec<u64>> {
        if ptrs.len() != self.devices.len() {
            return Err(self.invalid(
                c,
                format!(
                    "{} {what} addresses for {} devices",
                    ptrs.len(),
                    self.devices.len()
                ),
            ));
        }
        ptrs.iter()
            .enumerate()
            .map(|(i, p)| {
                if p.device != i {
                    return Err(self.invalid(
                        c,
                        format!(
                            "{what} address {i} is tagged with device {} (addresses go in device \
                             order)",
                            p.device
                        ),
                    ));
                }
                let len = len(i);
                if p.ptr == 0 && (optional || len == 0) {
                    return Ok(0);
                }
                self.address(i, what, p.ptr, len * es, es)
                    .map_err(|m| self.invalid(c, m))
            })
            .collect()
    }

    /// `ptr` checked to hold `bytes` bytes of device `i`'s memory, aligned to `align`.
    pub(crate) fn address(
        &self,
        i: usize,
        what: &str,
        ptr: u64,
        bytes: usize,
        align: usize,
    ) -> std::result::Result<u64, String> {
        if ptr % align as u64 != 0 {
            return Err(format!(
                "{what} address {ptr:#x} on device {i} is not aligned to {align} bytes"
            ));
        }
        let d = self
            .devices
            .get(i)
            .ok_or_else(|| format!("device {i} is not in this GPU group"))?;
        let not_device =
            |e: Error| format!("{what} address {ptr:#x} on device {i} is not device memory: {e}");
        let ordinal = driver::pointer_ordinal(&d.inner.ctx, ptr).map_err(not_device)?;
        if ordinal != d.physical() {
            return Err(format!(
                "{what} address {ptr:#x} is memory of GPU {ordinal}, but device {i} is {}",
                d.describe()
            ));
        }
        let (base, size) = driver::address_range(&d.inner.ctx, ptr).map_err(not_device)?;
        let end = ptr.checked_add(bytes as u64);
        if end.is_none_or(|end| end > base + size as u64) {
            return Err(format!(
                "{what} address {ptr:#x} on device {i}: {bytes} bytes do not fit in its \
                 allocation ({size} bytes from {base:#x})"
            ));
        }
        Ok(ptr)
    }

    /// Point-to-point in an in-process group: copy `bytes` from device `from`'s `src` into
    /// device `to`'s `dst` on `to`'s stream, once the events `after` (0: none) have fired, and
    /// wait for the copy until `deadline`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pair_copy(
        &self,
        site: Site,
        to: usize,
        dst: u64,
        from: usize,
        src: u64,
        bytes: usize,
        after: &[u64],
        deadline: Instant,
    ) -> Result<()> {
        if let Some(reason) = self.aborted() {
            return Err(Error::Aborted {
                rank: self.first_rank + to,
                reason,
            });
        }
        let d = &self.device_at(to)?.inner;
        self.device_at(from)?;
        for &event in after.iter().filter(|&&e| e != 0) {
            d.stream.wait_event(event)?;
        }
        if bytes > 0 {
            self.copy(to, dst, from, src, bytes, false)?;
        }
        match driver::wait_all(&[&d.stream], deadline)? {
            Ok(()) => Ok(()),
            Err(_) => {
                d.mark_failed();
                let e = Error::Timeout {
                    site,
                    waiting_for: vec![self.first_rank + to],
                    phase: "finish copying a received message on the GPU",
                    timeout: self.timeout,
                    stalled_on: Vec::new(),
                };
                self.abort(&format!("an earlier call failed: {e}"));
                Err(e)
            }
        }
    }

    /// Why this group cannot run the reduce op `op`, if it cannot: NCCL has no bitwise ops
    /// (`ncclRedOp_t` is sum, prod, min, max, avg), and a group on NCCL has no other path.
    pub(crate) fn op_unavailable(&self, op: ReduceOp) -> Option<String> {
        (self.nccl.is_some() && op.is_bitwise()).then(|| {
            format!(
                "NCCL has no bitwise reduce ops, so {op} is not available on NCCL; on GPUs of one \
                 process use the hierarchical-copy or reduce-to-one algorithm (tutti's own \
                 kernels), or reduce host buffers"
            )
        })
    }

    fn site(&self, c: Collective) -> Site {
        Site {
            collective: c,
            rank: self.first_rank,
            call: self.calls.load(Ordering::Relaxed),
        }
    }

    fn invalid(&self, c: Collective, message: String) -> Error {
        Error::invalid(self.site(c), message)
    }

    fn regions(&self, c: Collective, it: impl Iterator<Item = Region>) -> Result<Vec<Region>> {
        let v: Vec<Region> = it.collect();
        if v.len() != self.devices.len() {
            return Err(self.invalid(
                c,
                format!(
                    "{} buffers for a group of {} devices in this process",
                    v.len(),
                    self.devices.len()
                ),
            ));
        }
        for (i, (r, d)) in v.iter().zip(&self.devices).enumerate() {
            if !r.dev.same(d) {
                return Err(self.invalid(
                    c,
                    format!(
                        "buffer {i} is on {}, but the group's device {i} is {}",
                        r.dev.describe(),
                        d.describe()
                    ),
                ));
            }
        }
        Ok(v)
    }

    fn same_len(&self, c: Collective, v: &[Region], what: &str) -> Result<usize> {
        let n = v[0].len;
        if let Some((i, r)) = v.iter().enumerate().find(|(_, r)| r.len != n) {
            return Err(self.invalid(
                c,
                format!("{what} {i} has {} elements but {what} 0 has {n}", r.len),
            ));
        }
        Ok(n)
    }

    fn expect_len(&self, c: Collective, v: &[Region], n: usize, what: &str) -> Result<()> {
        if let Some((i, r)) = v.iter().enumerate().find(|(_, r)| r.len != n) {
            return Err(self.invalid(
                c,
                format!("{what} {i} has {} elements; it needs {n}", r.len),
            ));
        }
        Ok(())
    }

    /// Inputs and outputs on one device are the same (in place) or disjoint.
    fn no_partial_overlap(
        &self,
        c: Collective,
        a: &[Region],
        b: &[Region],
        es: usize,
    ) -> Result<()> {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            if x.ptr != y.ptr && overlaps(x, y, es) {
                return Err(self.invalid(c, format!(
                    "device {i}: the send and receive buffers overlap without being the same buffer (the in-place form)"
                )));
            }
        }
        Ok(())
    }

    // ----- running a call -----

    /// Run a collective over addresses already checked (see [`GpuGroup::collective_raw`]).
    /// Device i's work first waits (on the GPU) for the event `after[i]` (a [`StreamMark`]'s;
    /// 0 or missing: none): the work a caller queued on its stream before issuing the call.
    ///
    /// With an end event for every device (`ends[i]`, a [`StreamMark::end`]), the call returns
    /// once its work is queued and the events recorded after it: each caller's stream then
    /// waits for its event ([`GpuGroup::order_caller`]), and [`GpuGroup::stream_done`] waits
    /// for it on the host. Otherwise it returns once the work is done.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn execute(
        &self,
        c: Collective,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        count: usize,
        blocks: Option<&Blocks>,
        send: &[u64],
        recv: &[u64],
        after: &[u64],
        ends: &[u64],
    ) -> Result<()> {
        if let Some(reason) = self.aborted() {
            return Err(Error::Aborted {
                rank: self.first_rank,
                reason,
            });
        }
        let Ok(_busy) = self.busy.try_lock() else {
            return Err(self.invalid(
                c,
                "another call is running on this GPU group; a group runs one call at a time".into(),
            ));
        };
        if matches!(
            c,
            Collective::Broadcast | Collective::Reduce | Collective::Gather | Collective::Scatter
        ) && root >= self.world
        {
            return Err(self.invalid(
                c,
                format!(
                    "root {root} is out of range for a group of {} ranks",
                    self.world
                ),
            ));
        }
        if matches!(
            c,
            Collective::AllReduce
                | Collective::Reduce
                | Collective::ReduceScatter
                | Collective::ReduceScatterV
        ) {
            op.check(dtype).map_err(|m| self.invalid(c, m))?;
            if let Some(why) = self.op_unavailable(op) {
                return Err(Error::Unavailable {
                    what: format!("{op} on NCCL"),
                    why,
                });
            }
        }
        self.retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        let site = self.site(c);
        self.calls.fetch_add(1, Ordering::Relaxed);
        // Every device waits for every caller's earlier work: a copy queued on one device
        // reads another's input (an event may be waited for from any device).
        for d in &self.devices {
            for &event in after.iter().filter(|&&e| e != 0) {
                d.inner.stream.wait_event(event)?;
            }
        }
        let deadline = Instant::now() + self.timeout;
        let queued = match &self.nccl {
            Some(comms) => self.queue_nccl(comms, site, dtype, op, root, count, blocks, send, recv),
            None => match blocks {
                Some(b) => self.queue_copies_v(site, dtype, op, b, send, recv),
                None => self.queue_copies(site, dtype, op, count, root, send, recv),
            },
        };
        let streamed = ends.len() == self.devices.len() && ends.iter().all(|&e| e != 0);
        let r = match (&self.nccl, queued) {
            // NCCL refused the call: nothing waits for its kernels but an abort (below).
            (Some(_), Err(e)) => Err(e),
            (_, queued) => {
                let ended = queued.and_then(|()| self.record_ends(site, ends, deadline));
                if streamed && ended.is_ok() {
                    Ok(())
                } else {
                    // Wait for what was queued even when queueing failed part-way, so that no
                    // device still works on the buffers when the call returns.
                    let waited = match &self.nccl {
                        Some(comms) => self.wait_nccl(comms, site, deadline),
                        None => self.finish(site, deadline),
                    };
                    ended.and(waited)
                }
            }
        };
        if let Err(e) = &r {
            // A timeout, or NCCL failing, leaves the devices in an unknown state.
            let fatal = matches!(e, Error::Timeout { .. })
                || (self.nccl.is_some() && matches!(e, Error::System { .. }));
            if fatal {
                self.abort(&format!("an earlier call failed: {e}"));
            }
        }
        r
    }

    /// Record each device's end event (`ends[i]`, 0: none) once the call's work is queued:
    /// after every device's work of the call (a copy on one device reads another's buffers),
    /// so that the caller's stream, which waits for it, is ordered after the whole call.
    fn record_ends(&self, site: Site, ends: &[u64], deadline: Instant) -> Result<()> {
        if ends.iter().all(|&e| e == 0) {
            return Ok(());
        }
        if let Some(comms) = &self.nccl {
            // Non-blocking communicators may still be queueing the call when ncclGroupEnd
            // returns (ncclInProgress): its kernels are on the streams once none is.
            let what = format!("NCCL {site}");
            if let Err(ranks) = comms.wait_for(|_| Ok(true), deadline, &what)? {
                comms.abort();
                return Err(Error::Timeout {
                    site,
                    waiting_for: ranks,
                    phase: "queue the NCCL call (the NCCL communicators were aborted)",
                    timeout: self.timeout,
                    stalled_on: Vec::new(),
                });
            }
        }
        for (i, &end) in ends.iter().enumerate() {
            if end == 0 {
                continue;
            }
            for k in 0..self.devices.len() {
                self.order(i, k)?;
            }
            driver::record_on(end, &self.devices[i].inner.stream)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn queue_nccl(
        &self,
        comms: &Comms,
        site: Site,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        count: usize,
        blocks: Option<&Blocks>,
        send: &[u64],
        recv: &[u64],
    ) -> Result<()> {
        let call = match site.collective {
            Collective::AllReduce => Call::AllReduce { op },
            Collective::Broadcast => Call::Broadcast { root },
            Collective::Reduce => Call::Reduce { op, root },
            Collective::AllGather => Call::AllGather,
            Collective::ReduceScatter => Call::ReduceScatter { op },
            Collective::AllToAll => Call::AllToAll,
            Collective::Gather => Call::Gather { root },
            Collective::Scatter => Call::Scatter { root },
            Collective::AllGatherV => Call::AllGatherV,
            Collective::ReduceScatterV => Call::ReduceScatterV { op },
            Collective::AllToAllV => Call::AllToAllV,
            Collective::Barrier => {
                return Err(self.invalid(site.collective, "a GPU group has no barrier".into()))
            }
            // The communicator refuses these before the ranks meet (`GroupEngine::runs`).
            c => return Err(not_run(c)),
        };
        if count == 0 && blocks.is_none() {
            return Ok(());
        }
        // NCCL's broadcast reads `send` on the root only; elsewhere pass the receive buffer.
        let send: Vec<u64> = if site.collective == Collective::Broadcast {
            send.iter()
                .zip(recv)
                .map(|(&s, &r)| if s == 0 { r } else { s })
                .collect()
        } else {
            send.to_vec()
        };
        let inner: Vec<&DeviceInner> = self.devices.iter().map(|d| &*d.inner).collect();
        comms.enqueue(
            &call,
            dtype,
            count,
            blocks.map(|b| (&b.send[..], &b.recv[..])),
            &send,
            recv,
            &inner,
            &format!("NCCL {site}"),
        )
    }

    /// Wait for the NCCL work queued on the devices' streams, up to the deadline.
    fn wait_nccl(&self, comms: &Comms, site: Site, deadline: Instant) -> Result<()> {
        let inner: Vec<&DeviceInner> = self.devices.iter().map(|d| &*d.inner).collect();
        match comms.wait(&inner, deadline, &format!("NCCL {site}"))? {
            Ok(()) => Ok(()),
            Err(ranks) => {
                for r in &ranks {
                    if let Some(d) = r
                        .checked_sub(self.first_rank)
                        .and_then(|i| self.devices.get(i))
                    {
                        d.inner.mark_failed();
                    }
                }
                Err(Error::Timeout {
                    site,
                    waiting_for: ranks,
                    phase: "finish the NCCL call (the NCCL communicators were aborted)",
                    timeout: self.timeout,
                    stalled_on: Vec::new(),
                })
            }
        }
    }

    /// Device `a`'s stream waits for everything queued so far on device `b`'s.
    fn order(&self, a: usize, b: usize) -> Result<()> {
        if a == b {
            return Ok(());
        }
        let (x, y) = (&self.devices[a].inner, &self.devices[b].inner);
        x.stream.wait_for(&y.stream, &y.event)
    }

    /// Queue on device `to`'s stream a copy of `bytes` from device `from`'s `src` to `dst`.
    /// `produced`: the source was written earlier in this call, so the copy waits for the work
    /// queued on `from` so far. (Inputs need no wait: a call starts with every stream idle,
    /// or, on callers' streams, after every device waited for every caller's earlier work,
    /// the previous calls' included; not waiting lets the devices' copies run side by side.)
    fn copy(
        &self,
        to: usize,
        dst: u64,
        from: usize,
        src: u64,
        bytes: usize,
        produced: bool,
    ) -> Result<()> {
        if produced {
            self.order(to, from)?;
        }
        let (d, s) = (&self.devices[to].inner, &self.devices[from].inner);
        driver::copy_async(dst, &d.ctx, src, &s.ctx, bytes, &d.stream)
    }

    /// Queue on device `at`: `dst = (accumulate ? dst : first) ⊕ …` over `srcs` = (device,
    /// address) in order, staging sources `at` cannot read into its scratch buffer first.
    /// `produced` as for [`GpuGroup::copy`].
    #[allow(clippy::too_many_arguments)]
    fn reduce_at(
        &self,
        k: &Kernels,
        at: usize,
        dtype: DType,
        op: ReduceOp,
        dst: u64,
        srcs: &[(usize, u64)],
        count: usize,
        accumulate: bool,
        divisor: Option<usize>,
        produced: bool,
    ) -> Result<()> {
        let bytes = count * dtype.size();
        let staged = srcs.iter().filter(|(d, _)| !self.readable[at][*d]).count();
        let scratch = if staged > 0 {
            self.scratch(at, staged * bytes)?
        } else {
            0
        };
        let mut addrs = Vec::with_capacity(srcs.len());
        let mut slot = 0u64;
        for &(d, a) in srcs {
            if self.readable[at][d] {
                if produced {
                    self.order(at, d)?;
                }
                addrs.push(a);
            } else {
                let s = scratch + slot * bytes as u64;
                slot += 1;
                self.copy(at, s, d, a, bytes, produced)?;
                addrs.push(s);
            }
        }
        let dev = &self.devices[at].inner;
        k.reduce(dev, dtype, op, dst, &addrs, count, accumulate, divisor)
    }

    /// Device `at`'s scratch buffer, at least `bytes` long.
    fn scratch(&self, at: usize, bytes: usize) -> Result<u64> {
        let mut s = self.scratch[at].lock().unwrap_or_else(|p| p.into_inner());
        if s.bytes >= bytes {
            return Ok(s.ptr);
        }
        let dev = &self.devices[at].inner;
        if s.ptr != 0 {
            // Work queued earlier in this call may still read the old buffer.
            dev.sync(self.timeout, "finish before its scratch buffer grows")?;
            driver::free(&dev.ctx, s.ptr);
            dev.release(s.bytes as u64);
            *s = Scratch { ptr: 0, bytes: 0 };
        }
        dev.reserve(bytes as u64)?;
        match driver::alloc(&dev.ctx, bytes) {
            Ok(p) => {
                *s = Scratch { ptr: p, bytes };
                Ok(p)
            }
            Err(e) => {
                dev.release(bytes as u64);
                Err(e)
            }
        }
    }

    fn kernels(&self, at: usize) -> Result<std::sync::Arc<Kernels>> {
        kernels::kernels_for(&self.devices[at].inner)
    }

    /// Wait for every device's stream until the deadline (bounded by
    /// [`crate::device::cuda::discovery::FAILED_DEVICE_WAIT`] when a device timed out before); the devices
    /// still busy then are marked failed.
    fn finish(&self, site: Site, deadline: Instant) -> Result<()> {
        let streams: Vec<&driver::Stream> = self.devices.iter().map(|d| &d.inner.stream).collect();
        let deadline = if self.devices.iter().any(|d| d.inner.has_failed()) {
            deadline.min(Instant::now() + crate::device::cuda::discovery::FAILED_DEVICE_WAIT)
        } else {
            deadline
        };
        match driver::wait_all(&streams, deadline)? {
            Ok(()) => {
                for d in &self.devices {
                    d.inner.mark_idle();
                }
                Ok(())
            }
            Err(pending) => {
                for &i in &pending {
                    self.devices[i].inner.mark_failed();
                }
                Err(Error::Timeout {
                    site,
                    waiting_for: pending.into_iter().map(|i| self.first_rank + i).collect(),
                    phase: "finish its copies and reductions on the GPU",
                    timeout: self.timeout,
                    stalled_on: Vec::new(),
                })
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn queue_copies(
        &self,
        site: Site,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        root: usize,
        send: &[u64],
        recv: &[u64],
    ) -> Result<()> {
        let p = self.devices.len();
        let es = dtype.size();
        let bytes = count * es;
        if count == 0 {
            return Ok(());
        }
        let mean = (op == ReduceOp::Mean && p > 1).then_some(p);
        {
            match site.collective {
                Collective::AllReduce => {
                    let algo = match self.algorithm {
                        GpuAlgorithm::HierarchicalCopy { group_size } => {
                            CopyAlgorithm::HierarchicalCopy { group_size }
                        }
                        GpuAlgorithm::ReductionToOneDevice { root } => {
                            CopyAlgorithm::ReduceToOne { root }
                        }
                        a => {
                            return Err(Error::System {
                                what: format!("GPU group {site}"),
                                message: format!("algorithm {a} reached the copy path"),
                            })
                        }
                    };
                    algo.moves(p, |m| {
                        self.queue_move(m, dtype, op, count, send, recv, mean)
                    })
                }
                Collective::Broadcast => {
                    let src = if send[root] != 0 {
                        send[root]
                    } else {
                        recv[root]
                    };
                    for (k, &r) in recv.iter().enumerate() {
                        if (k, r) != (root, src) {
                            self.copy(k, r, root, src, bytes, false)?;
                        }
                    }
                    Ok(())
                }
                Collective::Reduce => self.queue_move(
                    Move::Reduce {
                        at: root,
                        from: Ranks::range(0..p),
                        inputs: true,
                        last: true,
                    },
                    dtype,
                    op,
                    count,
                    send,
                    recv,
                    mean,
                ),
                Collective::AllGather => {
                    for (k, &r) in recv.iter().enumerate() {
                        for (j, &s) in send.iter().enumerate() {
                            let d = r + (j * bytes) as u64;
                            if (k, d) != (j, s) {
                                self.copy(k, d, j, s, bytes, false)?;
                            }
                        }
                    }
                    Ok(())
                }
                Collective::ReduceScatter => {
                    for (k, &r) in recv.iter().enumerate() {
                        let kern = self.kernels(k)?;
                        let off = (k * bytes) as u64;
                        let srcs: Vec<(usize, u64)> = send
                            .iter()
                            .enumerate()
                            .map(|(j, &s)| (j, s + off))
                            .collect();
                        self.reduce_at(&kern, k, dtype, op, r, &srcs, count, false, mean, false)?;
                    }
                    Ok(())
                }
                // Personalized moves: one copy per block, each on its destination's stream.
                Collective::AllToAll => {
                    for (k, &r) in recv.iter().enumerate() {
                        for (j, &s) in send.iter().enumerate() {
                            let (d, s) = (r + (j * bytes) as u64, s + (k * bytes) as u64);
                            self.copy(k, d, j, s, bytes, false)?;
                        }
                    }
                    Ok(())
                }
                Collective::Gather => {
                    for (j, &s) in send.iter().enumerate() {
                        self.copy(root, recv[root] + (j * bytes) as u64, j, s, bytes, false)?;
                    }
                    Ok(())
                }
                Collective::Scatter => {
                    for (k, &r) in recv.iter().enumerate() {
                        self.copy(k, r, root, send[root] + (k * bytes) as u64, bytes, false)?;
                    }
                    Ok(())
                }
                Collective::Barrier => Ok(()),
                c => Err(not_run(c)),
            }
        }
    }

    /// The calls with a count per block ([`Blocks`]) as copies and reductions, each on its
    /// destination's stream. A group of copies is one process's: local index is rank.
    fn queue_copies_v(
        &self,
        site: Site,
        dtype: DType,
        op: ReduceOp,
        b: &Blocks,
        send: &[u64],
        recv: &[u64],
    ) -> Result<()> {
        let p = self.devices.len();
        if self.first_rank != 0 || self.world != p {
            // Copies run within one process, where device index is rank.
            return Err(not_run(site.collective));
        }
        let es = dtype.size();
        let at = |base: u64, o: &[usize], k: usize| base + (o[k] * es) as u64;
        let len = Blocks::len;
        match site.collective {
            // Rank j's input into block j of every output.
            Collective::AllGatherV => {
                for (k, &r) in recv.iter().enumerate() {
                    for (j, &s) in send.iter().enumerate() {
                        let n = len(&b.send[j], j);
                        if n > 0 {
                            self.copy(k, at(r, &b.recv[k], j), j, s, n * es, false)?;
                        }
                    }
                }
                Ok(())
            }
            // Block k of every input reduced into rank k's output.
            Collective::ReduceScatterV => {
                let mean = (op == ReduceOp::Mean && p > 1).then_some(p);
                for (k, &r) in recv.iter().enumerate() {
                    let n = len(&b.recv[k], k);
                    if n == 0 {
                        continue;
                    }
                    let kern = self.kernels(k)?;
                    let srcs: Vec<(usize, u64)> = send
                        .iter()
                        .enumerate()
                        .map(|(j, &s)| (j, at(s, &b.send[j], k)))
                        .collect();
                    self.reduce_at(&kern, k, dtype, op, r, &srcs, n, false, mean, false)?;
                }
                Ok(())
            }
            // Rank j's block k into rank k's block j.
            Collective::AllToAllV => {
                for (k, &r) in recv.iter().enumerate() {
                    for (j, &s) in send.iter().enumerate() {
                        let n = len(&b.send[j], k);
                        if n > 0 {
                            let (d, s) = (at(r, &b.recv[k], j), at(s, &b.send[j], k));
                            self.copy(k, d, j, s, n * es, false)?;
                        }
                    }
                }
                Ok(())
            }
            c => Err(not_run(c)),
        }
    }

    /// Queue one move of a copy schedule (see `algorithm::CopyAlgorithm`) as device work
    /// ([`moves::lower`]).
    #[allow(clippy::too_many_arguments)]
    fn queue_move(
        &self,
        m: Move,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        send: &[u64],
        recv: &[u64],
        mean: Option<usize>,
    ) -> Result<()> {
        let bytes = count * dtype.size();
        moves::lower(m, send, recv, mean, |work| match work {
            DeviceOp::Copy {
                to,
                dst,
                from,
                src,
                produced,
            } => self.copy(to, dst, from, src, bytes, produced),
            DeviceOp::Reduce {
                at,
                dst,
                srcs,
                accumulate,
                divisor,
                produced,
            } => {
                let k = self.kernels(at)?;
                self.reduce_at(
                    &k, at, dtype, op, dst, &srcs, count, accumulate, divisor, produced,
                )
            }
        })
    }
}

impl Drop for GpuGroup {
    fn drop(&mut self) {
        for (i, s) in self.scratch.iter().enumerate() {
            let s = s.lock().unwrap_or_else(|p| p.into_inner());
            if s.ptr != 0 {
                let dev = &self.devices[i].inner;
                // As for buffers: no second wait after a timeout, and a busy stream's scratch
                // memory is left allocated rather than freed under it.
                if dev.idle_before_free("dropping a GPU group") {
                    driver::free(&dev.ctx, s.ptr);
                    dev.release(s.bytes as u64);
                } else {
                    driver::log(&format!(
                        "dropping a GPU group: {} is still busy after a timeout; its scratch \
                         buffer ({} bytes) is left allocated",
                        self.devices[i].describe(),
                        s.bytes
                    ));
                }
            }
        }
    }
}

fn ptrs(v: &[Region]) -> Vec<u64> {
    v.iter().map(|r| r.ptr).collect()
}

/// Byte ranges of two regions of the same element type (lengths in elements).
fn overlaps(a: &Region, b: &Region, es: usize) -> bool {
    let (a0, a1) = (a.ptr, a.ptr + (a.len * es) as u64);
    let (b0, b1) = (b.ptr, b.ptr + (b.len * es) as u64);
    a.len > 0 && b.len > 0 && a0 < b1 && b0 < a1
}

/// A collective this engine does not run (the communicator refuses it before the ranks meet).
fn not_run(c: Collective) -> Error {
    Error::Unavailable {
        what: format!("{c} on a CUDA device group"),
        why: format!("its engine runs {}", crate::engine::CUDA_RUNS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithm_names_round_trip() {
        for a in GpuAlgorithm::ALL.into_iter().chain([GpuAlgorithm::Auto]) {
            assert_eq!(a.to_string().parse::<GpuAlgorithm>().unwrap(), a);
        }
        assert_eq!("NCCL".parse::<GpuAlgorithm>().unwrap(), GpuAlgorithm::Nccl);
        assert_eq!(
            "hierarchical-copy:4".parse::<GpuAlgorithm>().unwrap(),
            GpuAlgorithm::HierarchicalCopy { group_size: 4 }
        );
        assert_eq!(
            "reduce-to-one:1".parse::<GpuAlgorithm>().unwrap(),
            GpuAlgorithm::ReductionToOneDevice { root: 1 }
        );
        assert!("ring".parse::<GpuAlgorithm>().unwrap_err().contains("CPUs"));
        assert!("tree".parse::<GpuAlgorithm>().unwrap_err().contains("tree"));
    }

    #[test]
    fn auto_falls_back_when_the_communicators_do_not_start() {
        let why = start_or_fall_back(|| -> Result<()> {
            Err(Error::System {
                what: "NCCL ncclCommInitRankConfig (rank 0 of 2, gpu:0 on GPU 0)".into(),
                message: "ncclSystemError: System call (e.g. socket, malloc) or external library \
                          call failed or device error"
                    .into(),
            })
        })
        .unwrap_err();
        assert!(
            why.starts_with("NCCL's communicators did not start: "),
            "{why}"
        );
        assert!(why.contains("ncclCommInitRankConfig") && why.contains("ncclSystemError"));
        assert_eq!(start_or_fall_back(|| Ok(7)), Ok(7));
    }

    #[test]
    fn only_success_or_already_enabled_means_peer_access() {
        use cudarc::driver::sys::CUresult as R;
        assert!(driver::peer_access_enabled(R::CUDA_SUCCESS));
        assert!(driver::peer_access_enabled(
            R::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        ));
        for r in [
            R::CUDA_ERROR_TOO_MANY_PEERS,
            R::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
            R::CUDA_ERROR_INVALID_DEVICE,
            R::CUDA_ERROR_INVALID_CONTEXT,
        ] {
            assert!(!driver::peer_access_enabled(r), "{r:?}");
        }
    }
}
