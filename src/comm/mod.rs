//! Communicators: one rank's handle on a group.
//!
//! Every collective goes through one checked path: local argument checks when it is issued
//! (building a `Call`), then, in issue order (see `work.rs`), the transport's `begin` (every rank
//! states the call's header: collective, dtype, count, op, root, algorithm; a rank that rejected
//! its arguments says so, and every peer fails the call at once), then the algorithm, then `end`.
//! An error found in `begin` is seen by every rank alike and leaves the communicator usable; any
//! later error (timeout, dead peer, abort) aborts it, and each later call fails at once with
//! `Aborted`. Between processes most calls carry their check with their data (see the network
//! transport), so a difference or a peer's rejection found there is such a later error: it names
//! the rank and the reason, and aborts.
//!
//! Every collective has a blocking form and a non-blocking one (`*_async`) that returns a
//! [`Work`]; a blocking call is the non-blocking call followed by its wait.

mod call;
mod group;
mod p2p;
mod premul;
mod replicas;
mod shared;
mod shrink;
mod split;
mod tensor;
mod tune;
mod work;

#[cfg(feature = "xla")]
pub(crate) use group::run_group;
pub use group::{device_group, local_group, run_local, MAX_LOCAL_RANKS};
pub(crate) use group::{engine_group, xla_engine};
pub use p2p::{PeerOp, RawPeerOp};
pub use replicas::Replicas;
pub use shared::SharedBuffer;
pub(crate) use tensor::Combined;
pub use work::Work;

pub use crate::config::{
    compression_from_env, deterministic_from_env, full_check_from_env, Compression, Config,
};
pub use crate::sync::{timeout_from_env, MAX_TIMEOUT};

use call::{Bytes, BytesMut, Call};
use work::{Owned, Prepared, Progress, Shared};

use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::{self, Algorithm};
use crate::cluster::ClusterSpec;
use crate::device::DeviceKind;
use crate::dtype::{DType, Element, ReduceOp};
use crate::engine::GroupEngine;
use crate::error::{Collective, Error, Result};
use crate::transport::{NetTransport, Transport, TransportKind};

/// Wakes a communicator's blocked calls from any thread; see [`Communicator::abort_handle`].
#[derive(Clone)]
pub struct AbortHandle(Arc<dyn Transport>, Option<Arc<dyn GroupEngine>>);

impl AbortHandle {
    /// Abort the communicator: every blocked and later call of every rank fails with `Aborted`.
    pub fn abort(&self, reason: &str) {
        self.0.abort(reason);
        if let Some(engine) = &self.1 {
            engine.abort(reason);
        }
    }
}

/// One rank's handle on a group of ranks. `Send + Sync`. Calls made from several threads run
/// one at a time in the order they were issued; every rank must issue the same calls in the same
/// order (a call that differs fails with `Mismatch` on every rank).
pub struct Communicator {
    progress: Progress,
    algorithm: Algorithm,
    /// The device this rank's buffers live on.
    device: (DeviceKind, usize),
    /// The CUDA stream whose earlier work this rank's calls wait for (`cuda:N` ranks).
    cuda_stream: Option<u64>,
    /// Splits made so far (the same number on every rank: a split is collective).
    splits: std::sync::atomic::AtomicU64,
}

/// A collective described by addresses, for memory that Rust cannot borrow: a device's
/// (`cuda:N` ranks), or a C caller's. Counts are per rank, as in the C API.
#[derive(Copy, Clone, Debug)]
pub struct RawCall<'a> {
    /// Which collective.
    pub collective: Collective,
    /// Element type.
    pub dtype: DType,
    /// Elements per rank: all-gather and gather of the input (the output holds world × count),
    /// reduce-scatter and scatter of the output (the input holds world × count), all-to-all of
    /// each block (each buffer holds world × count), the others of each buffer. Ignored by the
    /// collectives with a count per rank, which take `counts`.
    pub count: usize,
    /// The reduce op (reducing collectives; ignored by the others).
    pub op: ReduceOp,
    /// The root (broadcast, reduce, gather and scatter; ignored by the others).
    pub root: usize,
    /// The input. In place: equal to `output` (all-gather: `output` + rank × count elements);
    /// ignored by broadcast and barrier, and by scatter off the root.
    pub input: *const u8,
    /// The output (broadcast: the buffer; reduce and gather: used at the root only).
    pub output: *mut u8,
    /// A count per rank: all-gather-v's and reduce-scatter-v's, all-to-all-v's of the input
    /// (what goes to each rank). Empty for the others.
    pub counts: &'a [usize],
    /// All-to-all-v's count per rank of the output (what comes from each rank). Empty for the
    /// others.
    pub recv_counts: &'a [usize],
}

impl Communicator {
    pub(crate) fn new(transport: Arc<dyn Transport>, config: &Config) -> Communicator {
        let rank = transport.rank();
        Communicator::with_engine(transport, config, None, (DeviceKind::Cpu, rank))
    }

    fn with_engine(
        transport: Arc<dyn Transport>,
        config: &Config,
        engine: Option<Arc<dyn GroupEngine>>,
        device: (DeviceKind, usize),
    ) -> Communicator {
        // Engines move data outside the transport: their calls are always checked first.
        let full_check = config.full_check || engine.is_some();
        let shared = Arc::new(Shared::new(
            transport,
            config.chunk_bytes,
            full_check,
            config.deterministic,
            config.compression,
            config.cost_model.figures(),
            engine,
        ));
        Communicator {
            progress: Progress::new(shared),
            algorithm: config.algorithm,
            device,
            cuda_stream: None,
            splits: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// With `TUTTI_TUNING=measure` ([`CostModel::Measure`](crate::tuning::CostModel)), this
    /// new communicator with the cost model's figures measured on its ranks (collective, before
    /// any call of the caller's); else as it is.
    fn tuned(self, config: &Config) -> Result<Communicator> {
        if config.cost_model == crate::tuning::CostModel::Measure
            && self.world_size() > 1
            && !config.deterministic
            && self.progress.shared().engine.is_none()
        {
            let figures = self.measure_tuning()?;
            self.set_tuning(figures);
        }
        Ok(self)
    }

    /// The figures `auto` chooses by between processes (see [`crate::tuning`]).
    pub fn tuning(&self) -> crate::tuning::Tuning {
        self.progress.shared().tuning.lock().0
    }

    /// Measure the cost model's figures on this communicator's ranks (collective: every rank
    /// calls it, as `tutti tune` does and a communicator made with `TUTTI_TUNING=measure`
    /// does): all-reduces of each algorithm the model chooses among (the one-step all-to-all,
    /// recursive doubling, Rabenseifner, the ring) are timed at 8 B to 1 MiB, all ranks at
    /// once, and the carrier's latency, per-message cost and bandwidth fitted to them by least
    /// squares, less what a call that moves nothing costs and the reduction (timed on its own).
    /// On several hosts shared memory's figures come first, from each host's ranks (a split per
    /// host, every host at once, their figures averaged; not where the links within a host are
    /// TCP), then the network's from the whole world, less what its steps within hosts cost at
    /// shared memory's figures (see [`crate::tuning`]).
    /// A carrier the world does not use keeps this communicator's figures. Every rank returns
    /// the same figures (fitted from rank 0's times). The communicator's own figures are not
    /// changed; pass the result to `TUTTI_TUNING` through a file (`tutti tune -o`).
    pub fn measure_tuning(&self) -> Result<crate::tuning::Tuning> {
        tune::measure(self, &self.tuning())
    }

    /// What `auto` runs for an all-reduce of `bytes` on this communicator's ranks with
    /// `figures`, and the time the model predicts for it in µs (`None` where the ranks read
    /// each other's memory: `direct`, with no choice to make).
    pub fn predict_all_reduce(
        &self,
        figures: &crate::tuning::Tuning,
        bytes: usize,
    ) -> (&'static str, Option<f64>) {
        tune::predict_all_reduce(self, figures, bytes)
    }

    /// Replace the figures, between calls. Every rank must hold the same: a call made while
    /// ranks hold different figures fails with a `Mismatch` naming the cost model.
    pub(crate) fn set_tuning(&self, figures: crate::tuning::Tuning) {
        *self.progress.shared().tuning.lock() = (figures, figures.digest());
    }

    /// The kind of device this rank's buffers live on: `cpu` for host groups (threads,
    /// processes), `xla` and `gpu` for groups made by [`device_group`].
    pub fn device_kind(&self) -> DeviceKind {
        self.device.0
    }

    /// This rank's device's index among the process's devices of its kind (the `N` of
    /// `cuda:N`).
    pub fn device_index(&self) -> usize {
        self.device.1
    }

    /// This rank's device, as a spec (`cpu:1`, `xla:2`, `gpu:0`).
    pub fn device_spec(&self) -> String {
        format!("{}:{}", self.device.0, self.device.1)
    }

    pub(crate) fn transport(&self) -> &Arc<dyn Transport> {
        &self.progress.shared().transport
    }

    /// Join the job that this process's environment describes (`TUTTI_*`, `TF_CONFIG`, torchrun,
    /// mpirun or srun variables; see [`ClusterSpec`](crate::ClusterSpec)), over the transport
    /// `TUTTI_TRANSPORT` names (`auto` by default: shared memory for peers on this host, TCP for
    /// the others).
    ///
    /// ```no_run
    /// // Under `tutti launch -n 2 -- ./trainer`, torchrun, mpirun or a TF_CONFIG job:
    /// let comm = tutti::Communicator::from_env(&tutti::Config::default()).unwrap();
    /// let mut grad = vec![1.0f32; 1024];
    /// comm.all_reduce(&mut grad, tutti::ReduceOp::Mean).unwrap();
    /// ```
    pub fn from_env(config: &Config) -> Result<Communicator> {
        let kind = match std::env::var("TUTTI_TRANSPORT") {
            Ok(v) => v
                .parse::<TransportKind>()
                .map_err(|e| Error::config(format!("TUTTI_TRANSPORT: {e}")))?,
            Err(_) => TransportKind::Auto,
        };
        Communicator::from_env_over(kind, config)
    }

    /// [`Communicator::from_env`] over the transport `kind` (rather than `TUTTI_TRANSPORT`'s).
    /// Under an MPI launcher (`mpirun`, `srun`), a build with the `mpi` feature takes `auto`
    /// for `mpi`: the ranks come from the MPI job and the bytes travel on MPI.
    pub fn from_env_over(kind: TransportKind, config: &Config) -> Result<Communicator> {
        if kind.is_mpi_here() {
            // A job another launcher started (`tutti launch`, torchrun, TF_CONFIG) is not an
            // MPI job: each of its processes would be an MPI world of one.
            if let Ok(Some(spec)) = ClusterSpec::from_env() {
                if !matches!(spec.source, "mpirun" | "srun") {
                    return Err(Error::config(format!(
                        "the MPI transport needs a job started by an MPI launcher (mpirun, \
                         srun), and this process was started by {} (choose TUTTI_TRANSPORT=auto, \
                         tcp or shm, or launch with mpirun)",
                        spec.source
                    )));
                }
            }
            if let Ok(device) = std::env::var("TUTTI_DEVICE") {
                if !device.eq_ignore_ascii_case("cpu") && device != "cpu:0" {
                    return Err(Error::config(format!(
                        "TUTTI_DEVICE={device}: the MPI transport carries host memory only; \
                         leave TUTTI_DEVICE unset or cpu, or choose TUTTI_TRANSPORT=auto"
                    )));
                }
            }
            return Communicator::from_mpi(config);
        }
        let spec = ClusterSpec::from_env()?.ok_or_else(|| {
            Error::config(
                "no cluster in the environment: run under tutti launch, torchrun, mpirun or srun, or set TF_CONFIG or TUTTI_RANK, TUTTI_WORLD_SIZE and TUTTI_MASTER_ADDR",
            )
        })?;
        Communicator::from_cluster_on_env_device(&spec, kind, config)
    }

    /// Join the MPI job this process belongs to (launched by `mpirun`, `srun` or any MPI
    /// launcher) as its rank in `MPI_COMM_WORLD`, every byte carried by MPI's point-to-point
    /// calls (feature `mpi`): each tutti algorithm runs over it, with tutti's checks, timeouts
    /// and errors. MPI is initialized with `MPI_THREAD_MULTIPLE` if the program has not done so
    /// (and finalized at exit); a program that initialized it must have asked for that level.
    /// Collective over the MPI job; bounded by `config.timeout`. Without the feature, or with
    /// an MPI library that lacks `MPI_THREAD_MULTIPLE`, an `Unavailable` error says so.
    ///
    /// ```no_run
    /// // mpirun -np 4 ./trainer
    /// let comm = tutti::Communicator::from_mpi(&tutti::Config::default()).unwrap();
    /// let mut grad = vec![1.0f32; 1024];
    /// comm.all_reduce(&mut grad, tutti::ReduceOp::Sum).unwrap();
    /// ```
    pub fn from_mpi(config: &Config) -> Result<Communicator> {
        #[cfg(feature = "mpi")]
        {
            let t = crate::transport::mpi::MpiTransport::world(config.timeout)?;
            config.check(t.world_size())?;
            Communicator::with_engine(Arc::new(t), config, None, (DeviceKind::Cpu, 0)).tuned(config)
        }
        #[cfg(not(feature = "mpi"))]
        {
            let _ = config;
            Err(Error::Unavailable {
                what: "the MPI transport".into(),
                why: "this build of tutti has no MPI: build it with `--features mpi` (needs an \
                      MPI library with its headers, such as Debian's libopenmpi-dev, and \
                      libclang-dev)"
                    .into(),
            })
        }
    }

    /// Join the job `spec` describes on the device `TUTTI_DEVICE` names
    /// ([`Communicator::from_cluster_on`]; host memory when it is unset).
    pub fn from_cluster_on_env_device(
        spec: &ClusterSpec,
        kind: TransportKind,
        config: &Config,
    ) -> Result<Communicator> {
        let Ok(device) = std::env::var("TUTTI_DEVICE") else {
            return Communicator::from_cluster(spec, kind, config);
        };
        let known = match device.split_once(':') {
            None => device.parse::<DeviceKind>().map(|_| ()),
            Some(_) => crate::device::parse_spec(&device).map(|_| ()),
        };
        known.map_err(|e| Error::config(format!("TUTTI_DEVICE={device}: {e}")))?;
        Communicator::from_cluster_on(spec, kind, &device, config)
    }

    /// Join the job `spec` describes over `kind` of transport: rendezvous through the store that
    /// rank 0 serves, then a connection to every peer, each proving the job token.
    pub fn from_cluster(
        spec: &ClusterSpec,
        kind: TransportKind,
        config: &Config,
    ) -> Result<Communicator> {
        if kind == TransportKind::Mpi {
            let c = Communicator::from_mpi(config)?;
            if c.world_size() != spec.world_size {
                return Err(Error::config(format!(
                    "the MPI job has {} ranks where the cluster spec ({}) has {}",
                    c.world_size(),
                    spec.source,
                    spec.world_size
                )));
            }
            return Ok(c);
        }
        config.check(spec.world_size)?;
        let t = NetTransport::connect(spec, kind, config.timeout, config.chunk_bytes)?;
        Communicator::with_engine(Arc::new(t), config, None, (DeviceKind::Cpu, 0)).tuned(config)
    }

    /// Join a job whose ranks meet through `store`, a key-value store the caller provides (a
    /// framework's own, such as the store torch.distributed hands a backend), as rank `rank` of
    /// `world_size`: no rendezvous port of tutti's to configure. Each rank listens on
    /// `listen_host` (a port chosen by the OS; `0.0.0.0` publishes this host's name), publishes
    /// its address under `tutti/…` keys of `store`, then connects to every peer as
    /// [`Communicator::from_cluster`] does: every connection proves `token`, the job's secret
    /// (at least [`MIN_TOKEN_BYTES`](crate::MIN_TOKEN_BYTES) bytes, the same on every rank), and
    /// peers on this host use shared memory under [`TransportKind::Auto`].
    ///
    /// Several communicators may meet through one store: each `from_store` adds one to a
    /// counter in it, which numbers them (every rank must create them in the same order).
    /// Setup waits at most `config.timeout` in all; a rank that does not come is a
    /// [`Error::JoinTimeout`] naming it. `store` is called only from this thread and only until
    /// this returns; its `set` and `add` must bound their own waits.
    ///
    /// ```no_run
    /// # fn demo(store: &dyn tutti::Store) -> tutti::Result<()> {
    /// let token = std::env::var("MY_JOB_TOKEN").unwrap();
    /// let comm = tutti::Communicator::from_store(0, 2, store, &token, "127.0.0.1",
    ///     tutti::TransportKind::Auto, &tutti::Config::default())?;
    /// # Ok(()) }
    /// ```
    pub fn from_store(
        rank: usize,
        world_size: usize,
        store: &dyn crate::cluster::store::Store,
        token: &str,
        listen_host: &str,
        kind: TransportKind,
        config: &Config,
    ) -> Result<Communicator> {
        // Named as the arguments they are, before anything is sized by them.
        if world_size == 0 {
            return Err(Error::config(
                "world_size is 0: a job has at least one rank",
            ));
        }
        if world_size > crate::cluster::MAX_WORLD_SIZE {
            return Err(Error::config(format!(
                "world_size {world_size} is more ranks than tutti supports ({})",
                crate::cluster::MAX_WORLD_SIZE
            )));
        }
        if rank >= world_size {
            return Err(Error::config(format!(
                "rank {rank} is out of range for world_size {world_size}"
            )));
        }
        if listen_host.is_empty() {
            return Err(Error::config(
                "listen_host is empty (use 127.0.0.1 for one host, 0.0.0.0 for several)",
            ));
        }
        // The one rule of every way of joining: the job's secret, or a refusal (before the
        // store is touched or any connection made).
        crate::cluster::check_token(token, "token")?;
        config.check(world_size)?;
        let meet = crate::transport::net::Meeting {
            rank,
            world: world_size,
            token,
            listen_host,
            deadline: std::time::Instant::now() + config.timeout,
            served_by: "the server of the store the caller provided",
        };
        let t = NetTransport::meet(store, &meet, kind, config.timeout, config.chunk_bytes)?;
        Communicator::with_engine(Arc::new(t), config, None, (DeviceKind::Cpu, 0)).tuned(config)
    }

    /// Join the job `spec` describes as this process's rank on `device` (`from_env` reads it
    /// from `TUTTI_DEVICE`): `cpu` (host memory, as [`Communicator::from_cluster`]), or
    /// `cuda:N` / `cuda` (this process's GPU N, or its local rank's GPU; feature `cuda`): one
    /// NCCL rank per process, its buffers device memory passed by address
    /// ([`Communicator::run_raw`]). Calls are checked across ranks over the job's transport
    /// before NCCL runs them, so a mismatched call is an error naming both ranks, not a hang.
    /// XLA devices form in-process groups only ([`device_group`]).
    pub fn from_cluster_on(
        spec: &ClusterSpec,
        kind: TransportKind,
        device: &str,
        config: &Config,
    ) -> Result<Communicator> {
        let (dkind, index) = match device.split_once(':') {
            None => (device.parse::<DeviceKind>()?, spec.local_rank.unwrap_or(0)),
            Some(_) => crate::device::parse_spec(device)?,
        };
        match dkind {
            DeviceKind::Cpu => Communicator::from_cluster(spec, kind, config),
            DeviceKind::Xla => Err(Error::config(format!(
                "device '{device}': XLA devices form groups within one process (device_group, \
                 tutti_comm_create_devices), not one rank per process"
            ))),
            DeviceKind::Gpu => Communicator::gpu_rank(spec, kind, index, config, false),
        }
    }

    /// Join the job `spec` describes as one NCCL rank per process on this process's GPU
    /// `index`, with buffers in host memory: each call copies this rank's input to the GPU,
    /// runs NCCL there and copies the output back (MultiWorkerMirroredStrategy's NCCL across
    /// workers, whose replicas' values live in host memory).
    pub(crate) fn from_cluster_staged_on_gpu(
        spec: &ClusterSpec,
        kind: TransportKind,
        index: usize,
        config: &Config,
    ) -> Result<Communicator> {
        Communicator::gpu_rank(spec, kind, index, config, true)
    }

    fn gpu_rank(
        spec: &ClusterSpec,
        kind: TransportKind,
        index: usize,
        config: &Config,
        staged: bool,
    ) -> Result<Communicator> {
        config.check(spec.world_size)?;
        let engine = group::cuda_rank_engine(index, spec, config, staged)?;
        let t = NetTransport::connect(spec, kind, config.timeout, config.chunk_bytes)?;
        Ok(Communicator::with_engine(
            Arc::new(t),
            config,
            Some(engine),
            (DeviceKind::Gpu, index),
        ))
    }

    /// This rank, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.transport().rank()
    }

    /// Whether this communicator's ranks run `collective`: host ranks run every one; device
    /// groups (CUDA, XLA) the collectives every device library has, and refuse the others
    /// before the ranks meet.
    pub fn runs(&self, collective: Collective) -> bool {
        self.progress
            .shared()
            .engine
            .as_ref()
            .is_none_or(|e| e.runs(collective))
    }

    /// The wire this communicator's f32 all-reduce and reduce-scatter travel on (see
    /// [`Compression`]): the configured compression where some peer is reached over TCP and
    /// the host algorithms run, else [`Compression::None`].
    pub fn compression(&self) -> Compression {
        let shared = self.progress.shared();
        if shared.engine.is_none() && shared.transport.over_network() {
            shared.compression
        } else {
            Compression::None
        }
    }

    /// Whether this communicator's reductions are bitwise-deterministic (see
    /// [`Config::deterministic`]).
    pub fn deterministic(&self) -> bool {
        self.progress.shared().deterministic
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.transport().world_size()
    }

    /// The bound on every wait.
    pub fn timeout(&self) -> Duration {
        self.transport().timeout()
    }

    /// How many hosts the ranks are on (1 for threads of one process).
    pub fn num_hosts(&self) -> usize {
        self.transport().hosts().map_or(1, |h| {
            h.iter().collect::<std::collections::BTreeSet<_>>().len()
        })
    }

    /// True when the transport lets ranks read each other's buffers (the `direct` algorithm).
    pub fn has_peer_memory(&self) -> bool {
        self.transport().peer_memory().is_some()
    }

    /// What the last call on this rank that ran an algorithm (a barrier runs none) ran as, and
    /// which collective it was, once it succeeded: the
    /// algorithm `auto` became (`direct`, `ring`, `all-to-all` (one step), `recursive-doubling`,
    /// `binomial-tree`, `hosts/rings` or `hosts/one-step-N` (within each host, then among them:
    /// the hierarchy's rings, or its one-step form with N leaders a host), ...) or the path a named
    /// algorithm took (`ordered` where reductions are deterministic). `tutti perf` prints it for
    /// each size. `None` before any call, and for the calls that device engines run.
    pub fn last_algorithm(&self) -> Option<(Collective, &'static str)> {
        *self.progress.shared().ran.lock()
    }

    /// Whether the carrier has collectives of its own (MPI's, under the algorithm `mpi`).
    pub(crate) fn has_native(&self) -> bool {
        self.transport().has_native()
    }

    /// The algorithm used by the collectives.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Choose the algorithm for later calls. Every rank must make the same choice: a call whose
    /// algorithm differs between ranks fails with `Mismatch`.
    pub fn set_algorithm(&mut self, algorithm: Algorithm) -> Result<()> {
        algorithm::check(algorithm, self.world_size()).map_err(Error::config)?;
        self.algorithm = algorithm;
        Ok(())
    }

    /// Order this rank's later calls on a CUDA stream (`cuda:N` ranks; `None`: no stream, the
    /// default), as NCCL does. A call issued while a stream is set waits, on the GPU and not on
    /// the host, for the work queued on the stream before it was issued; the work queued on the
    /// stream after it waits for the call's GPU work. The call meets its peers when it is
    /// issued (each rank of an in-process group issues from its own thread) and returns once
    /// its GPU work is queued; its [`Work`] completes when that work is done (a blocking call
    /// returns then). The stream belongs to the GPU's primary context, as the CUDA runtime's
    /// streams do (PyTorch's, CuPy's); `Some(0)` is the legacy default stream. Point-to-point
    /// calls between GPUs of one process wait for the stream's earlier work too, but complete
    /// on the host: wait for a non-blocking one's handle before queuing work that reads what
    /// it received. Errors: `InvalidArgument` on a rank whose device is not a CUDA GPU.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this rank's GPU until it is replaced or the communicator is
    /// dropped.
    pub unsafe fn set_cuda_stream(&mut self, stream: Option<u64>) -> Result<()> {
        if stream.is_some() && self.device.0 != DeviceKind::Gpu {
            return Err(Error::config(format!(
                "rank {} is on {}: only cuda:N ranks take a CUDA stream",
                self.rank(),
                self.device_spec()
            )));
        }
        self.cuda_stream = stream;
        Ok(())
    }

    /// The CUDA stream set by [`Communicator::set_cuda_stream`].
    pub fn cuda_stream(&self) -> Option<u64> {
        self.cuda_stream
    }

    /// A device call issued while a stream is set waits for the stream's work so far; failing
    /// to mark it is this rank's argument error, which every rank sees before anything moves.
    fn on_stream(&self, mut call: Call) -> Call {
        let (Some(stream), Some(engine)) = (self.cuda_stream, &self.progress.shared().engine)
        else {
            return call;
        };
        if call.check.is_ok() {
            // SAFETY: `set_cuda_stream`'s caller promised the stream lives while it is set.
            match unsafe { engine.mark_stream(self.rank(), stream) } {
                Ok(mark) => call.wait_for(mark),
                Err(e) => call.check = Err(format!("the CUDA stream it was given: {e}")),
            }
        }
        call
    }

    /// Abort the group: blocked and later calls on every rank fail with `Aborted` (and a
    /// GPU group's NCCL communicators are aborted, which ends their kernels).
    pub fn abort(&self, reason: &str) {
        self.abort_handle().abort(reason)
    }

    /// The abort reason, once the group is aborted.
    pub fn aborted(&self) -> Option<String> {
        self.transport().aborted()
    }

    /// A handle that aborts this communicator from any thread, e.g. to wake a blocked call.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle(
            self.transport().clone(),
            self.progress.shared().engine.clone(),
        )
    }

    // ----- byte-level API (the C ABI and other carriers build on it) -----

    /// Issue `call` and wait for it.
    fn blocking(&self, call: Call) -> Result<()> {
        self.progress.run_blocking(&self.host_memory(call))
    }

    /// Issue `call` without waiting; `keep` is held until the call completes.
    fn issue<B: Send + 'static>(&self, call: Call, keep: Owned<B>) -> Work<B> {
        self.progress
            .issue(Box::new(self.host_memory(call)), Box::new(keep))
    }

    /// A call over Rust slices (host memory): on a rank whose buffers are device memory it is
    /// this rank's argument error, seen by every rank before anything moves.
    fn host_memory(&self, call: Call) -> Call {
        let mut call = self.engine_runs(call);
        if self.device.0 == DeviceKind::Gpu && call.check.is_ok() && call.count > 0 {
            call.check = Err(format!(
                "rank {} is on {}, whose buffers are device memory: pass them by address \
                 (Communicator::run_raw / issue_raw, or the C API)",
                self.rank(),
                self.device_spec()
            ));
        }
        call
    }

    /// All-reduce of raw bytes holding `dtype` elements: `output = ⊕ over ranks of input`, or in
    /// place in `output` when `input` is `None`.
    pub fn all_reduce_raw(
        &self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
        op: ReduceOp,
    ) -> Result<()> {
        self.blocking(self.all_reduce_call(dtype, input.map(Bytes::of), BytesMut::of(output), op))
    }

    /// An f32 sum in place with `algorithm` rather than this communicator's (the cost model's
    /// measurements: every rank calls it alike).
    pub(crate) fn all_reduce_with(&self, algorithm: Algorithm, buf: &mut [f32]) -> Result<()> {
        let call = self.all_reduce_call(
            DType::F32,
            None,
            BytesMut::of(bytemuck::cast_slice_mut(buf)),
            ReduceOp::Sum,
        );
        self.blocking(call.with_algorithm(algorithm))
    }

    /// Broadcast raw bytes from `root` into every rank's `buf`.
    pub fn broadcast_raw(&self, dtype: DType, buf: &mut [u8], root: usize) -> Result<()> {
        self.blocking(self.broadcast_call(dtype, BytesMut::of(buf), root))
    }

    /// All-gather of raw bytes: rank r's `input` lands in slice r of every rank's `output`
    /// (`world_size` times as long). `input = None`: in place, slice `rank` of `output` is the input.
    pub fn all_gather_raw(
        &self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
    ) -> Result<()> {
        self.blocking(self.all_gather_call(dtype, input.map(Bytes::of), BytesMut::of(output)))
    }

    /// Reduce-scatter of raw bytes: `output` (one slice) = slice `rank` of the reduction of every
    /// rank's `input` (`world_size` slices).
    pub fn reduce_scatter_raw(
        &self,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
        op: ReduceOp,
    ) -> Result<()> {
        self.blocking(self.reduce_scatter_call(dtype, Bytes::of(input), BytesMut::of(output), op))
    }

    /// Reduce of raw bytes onto `root`. Off the root `output` is ignored and may be `None`; at the
    /// root it is required, and `input = None` means in place in `output`.
    pub fn reduce_raw(
        &self,
        dtype: DType,
        input: Option<&[u8]>,
        output: Option<&mut [u8]>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.blocking(self.reduce_call(
            dtype,
            input.map(Bytes::of),
            output.map(BytesMut::of),
            op,
            root,
        ))
    }

    /// All-to-all of raw bytes holding `dtype` elements: block j of `input` goes to rank j and
    /// block k of `output` comes from rank k (`world_size` equal blocks each).
    pub fn all_to_all_raw(&self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.blocking(self.all_to_all_call(dtype, Bytes::of(input), BytesMut::of(output)))
    }

    /// All-to-all of raw bytes with a count of elements per block (see
    /// [`Communicator::all_to_all_v`]).
    pub fn all_to_all_v_raw(
        &self,
        dtype: DType,
        input: &[u8],
        send_counts: &[usize],
        output: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.blocking(self.all_to_all_v_call(
            dtype,
            Bytes::of(input),
            send_counts,
            BytesMut::of(output),
            recv_counts,
        ))
    }

    /// Gather of raw bytes onto `root` (see [`Communicator::gather`]).
    pub fn gather_raw(
        &self,
        dtype: DType,
        input: &[u8],
        output: Option<&mut [u8]>,
        root: usize,
    ) -> Result<()> {
        self.blocking(self.gather_call(dtype, Bytes::of(input), output.map(BytesMut::of), root))
    }

    /// Scatter of raw bytes from `root` (see [`Communicator::scatter`]).
    pub fn scatter_raw(
        &self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
        root: usize,
    ) -> Result<()> {
        self.blocking(self.scatter_call(dtype, input.map(Bytes::of), BytesMut::of(output), root))
    }

    /// All-gather of raw bytes with a count of elements per rank (see
    /// [`Communicator::all_gather_v`]).
    pub fn all_gather_v_raw(
        &self,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
    ) -> Result<()> {
        self.blocking(self.all_gather_v_call(dtype, Bytes::of(input), BytesMut::of(output), counts))
    }

    /// Reduce-scatter of raw bytes with a count of elements per rank (see
    /// [`Communicator::reduce_scatter_v`]).
    pub fn reduce_scatter_v_raw(
        &self,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.blocking(self.reduce_scatter_v_call(
            dtype,
            Bytes::of(input),
            BytesMut::of(output),
            counts,
            op,
        ))
    }

    // ----- non-blocking byte-level API (the C ABI builds on it) -----

    /// [`Communicator::all_reduce_raw`] without waiting: the call is issued and runs in issue
    /// order on the communicator's progress thread; its result comes from the [`Work`].
    ///
    /// # Safety
    ///
    /// The memory of `input` and `output` must stay valid, and nothing else may read `output`
    /// or write either, until the call has completed (`Work::wait` returned, or
    /// `Work::is_completed` said so), even if the `Work` is dropped first.
    pub unsafe fn all_reduce_raw_async(
        &self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
        op: ReduceOp,
    ) -> Work {
        self.issue(
            self.all_reduce_call(dtype, input.map(Bytes::of), BytesMut::of(output), op),
            Owned::new(()),
        )
    }

    /// [`Communicator::broadcast_raw`] without waiting.
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_reduce_raw_async`], for `buf`.
    pub unsafe fn broadcast_raw_async(&self, dtype: DType, buf: &mut [u8], root: usize) -> Work {
        self.issue(
            self.broadcast_call(dtype, BytesMut::of(buf), root),
            Owned::new(()),
        )
    }

    /// [`Communicator::all_gather_raw`] without waiting.
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_reduce_raw_async`].
    pub unsafe fn all_gather_raw_async(
        &self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
    ) -> Work {
        self.issue(
            self.all_gather_call(dtype, input.map(Bytes::of), BytesMut::of(output)),
            Owned::new(()),
        )
    }

    /// [`Communicator::reduce_scatter_raw`] without waiting.
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_reduce_raw_async`].
    pub unsafe fn reduce_scatter_raw_async(
        &self,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
        op: ReduceOp,
    ) -> Work {
        self.issue(
            self.reduce_scatter_call(dtype, Bytes::of(input), BytesMut::of(output), op),
            Owned::new(()),
        )
    }

    /// [`Communicator::reduce_raw`] without waiting.
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_reduce_raw_async`].
    pub unsafe fn reduce_raw_async(
        &self,
        dtype: DType,
        input: Option<&[u8]>,
        output: Option<&mut [u8]>,
        op: ReduceOp,
        root: usize,
    ) -> Work {
        self.issue(
            self.reduce_call(
                dtype,
                input.map(Bytes::of),
                output.map(BytesMut::of),
                op,
                root,
            ),
            Owned::new(()),
        )
    }

    // ----- by address: memory Rust cannot borrow (devices, C callers) -----

    /// Run the collective `c` describes by address and wait for it: the same checks, errors and
    /// order as the slice forms. The memory is the rank's device's: host memory on `cpu:N` and
    /// `xla:N` ranks, device memory (a `CUdeviceptr`) on `cuda:N` ranks.
    ///
    /// # Safety
    ///
    /// The addresses hold the bytes `c` describes on this rank's device, and nothing else
    /// touches them during the call.
    pub unsafe fn run_raw(&self, c: &RawCall<'_>) -> Result<()> {
        if c.collective.is_point_to_point() {
            return self
                .progress
                .run_blocking(&*self.raw_point_to_point(c.collective));
        }
        let call = self.on_stream(self.raw_call(c));
        if call.on_stream() {
            return self.run_on_stream(call).wait();
        }
        self.progress.run_blocking(&call)
    }

    /// Issue the collective `c` describes by address without waiting.
    ///
    /// # Safety
    ///
    /// As [`Communicator::run_raw`], until the call has completed (even if the `Work` is
    /// dropped first).
    pub unsafe fn issue_raw(&self, c: &RawCall<'_>) -> Work {
        if c.collective.is_point_to_point() {
            let refused = self.raw_point_to_point(c.collective);
            return self.progress.issue(refused, Box::new(Owned::new(())));
        }
        let call = self.on_stream(self.raw_call(c));
        if call.on_stream() {
            return self.run_on_stream(call);
        }
        self.progress
            .issue(Box::new(call), Box::new(Owned::new(())))
    }

    /// [`Communicator::run_raw`] with a step `before` that runs when the call starts, after
    /// every call issued before it has completed: e.g. copying an input that an earlier
    /// non-blocking call writes (an in-place reduce-scatter of the C API reads such a copy).
    /// On a caller's CUDA stream (device memory) `before` runs when the call is issued.
    ///
    /// # Safety
    ///
    /// As [`Communicator::run_raw`]; what `before` touches is valid when it runs.
    pub unsafe fn run_raw_prepared(
        &self,
        c: &RawCall<'_>,
        before: Box<dyn FnOnce() + Send>,
    ) -> Result<()> {
        if c.collective.is_point_to_point() {
            return self
                .progress
                .run_blocking(&*self.raw_point_to_point(c.collective));
        }
        let call = self.on_stream(self.raw_call(c));
        if call.on_stream() {
            before();
            return self.run_on_stream(call).wait();
        }
        let call = Prepared {
            call,
            before: parking_lot::Mutex::new(Some(before)),
            _keep: parking_lot::Mutex::new(None),
        };
        self.progress.run_blocking(&call)
    }

    /// [`Communicator::issue_raw`] with a step `before` that runs when the call starts (see
    /// [`Communicator::run_raw_prepared`]); `keep` is held until the call has completed (even
    /// if the `Work` is dropped first).
    ///
    /// # Safety
    ///
    /// As [`Communicator::issue_raw`]; what `before` touches is valid when it runs.
    pub unsafe fn issue_raw_prepared(
        &self,
        c: &RawCall<'_>,
        before: Box<dyn FnOnce() + Send>,
        keep: Box<dyn std::any::Any + Send>,
    ) -> Work {
        if c.collective.is_point_to_point() {
            let refused = self.raw_point_to_point(c.collective);
            return self.progress.issue(refused, Box::new(Owned::new(keep)));
        }
        let call = self.on_stream(self.raw_call(c));
        if call.on_stream() {
            before();
            let work = self.run_on_stream(call);
            self.drop_after_issued(keep);
            return work;
        }
        let call = Prepared {
            call,
            before: parking_lot::Mutex::new(Some(before)),
            _keep: parking_lot::Mutex::new(Some(keep)),
        };
        self.progress
            .issue(Box::new(call), Box::new(Owned::new(())))
    }

    /// Hold `value` until every call issued on this communicator before now has completed,
    /// then drop it (at once when none is queued or running). For memory that calls issued by
    /// address may still read or write: the C API's `tutti_mem_free` hands a [`SharedBuffer`]
    /// here, so that a queued call never writes through an unmapped or reused page.
    pub fn drop_after_issued<T: Send + 'static>(&self, value: T) {
        self.progress.drop_after_issued(Box::new(value))
    }

    /// Run a call issued on a caller's stream at once (the ranks meet now, in issue order) up
    /// to queueing its device work, which the caller's stream then waits for; its handle waits
    /// for that work on the host.
    fn run_on_stream(&self, mut call: Call) -> Work {
        let (site, result) = self.progress.run_numbered(&call);
        let started = std::time::Instant::now();
        let shared = self.progress.shared();
        let (Some(mark), Some(engine)) = (call.take_mark(), &shared.engine) else {
            return Work::ran(site, result, None, started);
        };
        if result.is_err() {
            // Another rank may still be running the call with this mark's events.
            engine.retire(mark);
            return Work::ran(site, result, None, started);
        }
        // SAFETY: `set_cuda_stream`'s caller promised the stream lives while it is set.
        let ordered = unsafe { engine.order_stream(self.rank(), &*mark) };
        let device = call::OnStream {
            engine: engine.clone(),
            transport: shared.transport.clone(),
            mark,
            site,
            deadline: started + shared.transport.timeout(),
        };
        match ordered {
            Ok(()) => Work::ran(site, Ok(()), Some(Box::new(device)), started),
            Err(e) => {
                // The caller's stream is not ordered after the call: its error comes once the
                // call's device work is done, so that nothing reuses the buffers under it.
                let _ = work::DeviceWork::wait(&device, None);
                Work::ran(site, Err(e), None, started)
            }
        }
    }

    // ----- typed API -----

    /// All-reduce in place: every rank's `buf` becomes the element-wise `op` over all ranks.
    ///
    /// Errors: `Mismatch` when ranks disagree on dtype, count, op or algorithm; `Timeout` naming
    /// the ranks that never arrived; `Aborted`.
    ///
    /// ```
    /// use tutti::{run_local, Config, ReduceOp};
    /// let sums = run_local(4, &Config::default(), |comm| {
    ///     let mut grad = vec![comm.rank() as f32; 3];
    ///     comm.all_reduce(&mut grad, ReduceOp::Sum).unwrap();
    ///     grad
    /// })
    /// .unwrap();
    /// assert!(sums.iter().all(|g| g == &[6.0, 6.0, 6.0]));
    /// ```
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_raw(T::DTYPE, None, bytemuck::cast_slice_mut(buf), op)
    }

    /// All-reduce out of place: `recv` becomes the element-wise `op` of every rank's `send`.
    /// `recv` must be as long as `send`.
    pub fn all_reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.all_reduce_raw(
            T::DTYPE,
            Some(bytemuck::cast_slice(send)),
            bytemuck::cast_slice_mut(recv),
            op,
        )
    }

    /// Broadcast: every rank's `buf` becomes the root's.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_raw(T::DTYPE, bytemuck::cast_slice_mut(buf), root)
    }

    /// All-gather: `recv` (world size × `send.len()`) becomes every rank's `send`, in rank order.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_gather_raw(
            T::DTYPE,
            Some(bytemuck::cast_slice(send)),
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// All-gather in place: slice `rank` of `buf` is this rank's input; the other slices are filled.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.all_gather_raw(T::DTYPE, None, bytemuck::cast_slice_mut(buf))
    }

    /// Reduce-scatter: `recv` becomes slice `rank` of the element-wise `op` over every rank's
    /// `send` (world size × `recv.len()` elements).
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_raw(
            T::DTYPE,
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            op,
        )
    }

    /// Reduce onto `root`: the root's `recv` becomes the element-wise `op` of every rank's `send`.
    /// Other ranks pass `None` (a `Some` is ignored).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: Option<&mut [T]>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let recv = recv.map(|r| bytemuck::cast_slice_mut::<T, u8>(r));
        self.reduce_raw(T::DTYPE, Some(bytemuck::cast_slice(send)), recv, op, root)
    }

    /// Reduce in place onto `root`: the root's `buf` becomes the reduction; other ranks' `buf`
    /// is their input and is left unchanged.
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        if self.rank() == root {
            self.reduce_raw(T::DTYPE, None, Some(bytes), op, root)
        } else {
            self.reduce_raw(T::DTYPE, Some(bytes), None, op, root)
        }
    }

    /// Barrier: returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.blocking(self.barrier_call())
    }

    /// Take this rank's place in the next call, a `collective` its peers make, as a rejection
    /// with `why`: they fail it at once with [`Error::PeerRejected`] naming this rank and
    /// `why` (or, a peer that waits on another rank, with the abort that carries them),
    /// rather than wait for this rank until the timeout. For a layer above that found an error
    /// in its own part before the call (a strategy whose local replicas failed), which returns
    /// that error to its caller at once: the call is issued, not waited for (its own error is
    /// the handle's), and this rank's later calls queue behind it as every call does.
    pub(crate) fn reject(&self, collective: Collective, why: &str) -> Work<()> {
        self.issue(self.rejected_call(collective, why), Owned::new(()))
    }

    /// All-to-all: block j of `send` goes to rank j, and block k of `recv` comes from rank k
    /// (both cut into `world_size` equal blocks; `send` and `recv` equally long).
    ///
    /// ```
    /// use tutti::{run_local, Config};
    /// let out = run_local(2, &Config::default(), |comm| {
    ///     let r = comm.rank() as i32;
    ///     let mut recv = [0; 2];
    ///     comm.all_to_all(&[10 * r, 10 * r + 1], &mut recv).unwrap();
    ///     recv
    /// })
    /// .unwrap();
    /// assert_eq!(out, [[0, 10], [1, 11]]);
    /// ```
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_to_all_raw(
            T::DTYPE,
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// All-to-all with a count per block: the first `send_counts[0]` elements of `send` go to
    /// rank 0, the next `send_counts[1]` to rank 1, and so on; `recv` holds `recv_counts[k]`
    /// elements from each rank k, in rank order. Rank i's `send_counts[j]` must equal rank j's
    /// `recv_counts[i]`: where they differ, the receiving rank's call fails naming the sender
    /// and both byte counts, and the communicator is aborted (between threads the sender's
    /// call fails too; between processes the sender's next call does).
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.all_to_all_v_raw(
            T::DTYPE,
            bytemuck::cast_slice(send),
            send_counts,
            bytemuck::cast_slice_mut(recv),
            recv_counts,
        )
    }

    /// Gather onto `root`: the root's `recv` (world size × `send.len()`) becomes every rank's
    /// `send`, in rank order. Other ranks pass `None` (a `Some` is ignored).
    pub fn gather<T: Element>(
        &self,
        send: &[T],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        let recv = recv.map(|r| bytemuck::cast_slice_mut::<T, u8>(r));
        self.gather_raw(T::DTYPE, bytemuck::cast_slice(send), recv, root)
    }

    /// Scatter from `root`: every rank's `recv` becomes block `rank` of the root's `send`
    /// (world size × `recv.len()`). Other ranks pass `None` (a `Some` is ignored).
    pub fn scatter<T: Element>(
        &self,
        send: Option<&[T]>,
        recv: &mut [T],
        root: usize,
    ) -> Result<()> {
        let send = send.map(|s| bytemuck::cast_slice::<T, u8>(s));
        self.scatter_raw(T::DTYPE, send, bytemuck::cast_slice_mut(recv), root)
    }

    /// All-gather with a count per rank: `recv` (the sum of `counts`) becomes every rank's
    /// `send` in rank order, rank r's `counts[r]` elements long. Every rank passes the same
    /// `counts` (else an error naming both ranks).
    ///
    /// ```
    /// use tutti::{run_local, Config};
    /// let out = run_local(2, &Config::default(), |comm| {
    ///     let send = vec![comm.rank() as u8; 1 + comm.rank()];
    ///     let mut recv = [0u8; 3];
    ///     comm.all_gather_v(&send, &mut recv, &[1, 2]).unwrap();
    ///     recv
    /// })
    /// .unwrap();
    /// assert_eq!(out, [[0, 1, 1], [0, 1, 1]]);
    /// ```
    pub fn all_gather_v<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        self.all_gather_v_raw(
            T::DTYPE,
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            counts,
        )
    }

    /// Reduce-scatter with a count per rank: `recv` (`counts[rank]` elements) becomes this
    /// rank's block of the element-wise `op` over every rank's `send` (the sum of `counts`).
    /// Every rank passes the same `counts`.
    pub fn reduce_scatter_v<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_v_raw(
            T::DTYPE,
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            counts,
            op,
        )
    }

    // ----- non-blocking typed API: each call owns its buffers until it completes -----

    /// [`Communicator::all_reduce`] without waiting: the call owns `buf` (a `Vec<T>`, a boxed
    /// slice, an array...) and [`Work::wait`] hands it back reduced. Calls complete in the
    /// order they were issued; many may be in flight.
    ///
    /// ```
    /// use tutti::{run_local, Config, ReduceOp};
    /// let out = run_local(2, &Config::default(), |comm| {
    ///     let a = comm.all_reduce_async(vec![1.0f32; 8], ReduceOp::Sum);
    ///     let b = comm.all_reduce_async([comm.rank() as i32; 3], ReduceOp::Max);
    ///     (a.wait().unwrap(), b.wait().unwrap())
    /// })
    /// .unwrap();
    /// assert_eq!(out[0], (vec![2.0; 8], [1; 3]));
    /// ```
    pub fn all_reduce_async<T, B>(&self, buf: B, op: ReduceOp) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        let mut buf = Owned::new(buf);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf.get().as_mut());
        let call = self.all_reduce_call(T::DTYPE, None, BytesMut::of(bytes), op);
        self.issue(call, buf)
    }

    /// [`Communicator::broadcast`] without waiting; [`Work::wait`] hands `buf` back.
    pub fn broadcast_async<T, B>(&self, buf: B, root: usize) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        let mut buf = Owned::new(buf);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf.get().as_mut());
        let call = self.broadcast_call(T::DTYPE, BytesMut::of(bytes), root);
        self.issue(call, buf)
    }

    /// [`Communicator::all_gather`] without waiting; [`Work::wait`] hands back `(send, recv)`.
    pub fn all_gather_async<T, S, R>(&self, send: S, recv: R) -> Work<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        let mut bufs = Owned::new((send, recv));
        let (send, recv) = bufs.get();
        let call = self.all_gather_call(
            T::DTYPE,
            Some(Bytes::of(bytemuck::cast_slice(send.as_ref()))),
            BytesMut::of(bytemuck::cast_slice_mut(recv.as_mut())),
        );
        self.issue(call, bufs)
    }

    /// [`Communicator::reduce_scatter`] without waiting; [`Work::wait`] hands back
    /// `(send, recv)`.
    pub fn reduce_scatter_async<T, S, R>(&self, send: S, recv: R, op: ReduceOp) -> Work<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        let mut bufs = Owned::new((send, recv));
        let (send, recv) = bufs.get();
        let call = self.reduce_scatter_call(
            T::DTYPE,
            Bytes::of(bytemuck::cast_slice(send.as_ref())),
            BytesMut::of(bytemuck::cast_slice_mut(recv.as_mut())),
            op,
        );
        self.issue(call, bufs)
    }

    /// [`Communicator::reduce_in_place`] without waiting: the root's `buf` comes back holding
    /// the reduction, the others' unchanged.
    pub fn reduce_async<T, B>(&self, buf: B, op: ReduceOp, root: usize) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        let mut buf = Owned::new(buf);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf.get().as_mut());
        let call = if self.rank() == root {
            self.reduce_call(T::DTYPE, None, Some(BytesMut::of(bytes)), op, root)
        } else {
            self.reduce_call(T::DTYPE, Some(Bytes::of(bytes)), None, op, root)
        };
        self.issue(call, buf)
    }

    /// [`Communicator::all_to_all`] without waiting; [`Work::wait`] hands back `(send, recv)`.
    pub fn all_to_all_async<T, S, R>(&self, send: S, recv: R) -> Work<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        let mut bufs = Owned::new((send, recv));
        let (send, recv) = bufs.get();
        let call = self.all_to_all_call(
            T::DTYPE,
            Bytes::of(bytemuck::cast_slice(send.as_ref())),
            BytesMut::of(bytemuck::cast_slice_mut(recv.as_mut())),
        );
        self.issue(call, bufs)
    }

    /// [`Communicator::all_to_all_v`] without waiting (the counts are read when it is
    /// issued); [`Work::wait`] hands back `(send, recv)`.
    pub fn all_to_all_v_async<T, S, R>(
        &self,
        send: S,
        send_counts: &[usize],
        recv: R,
        recv_counts: &[usize],
    ) -> Work<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        let mut bufs = Owned::new((send, recv));
        let (send, recv) = bufs.get();
        let call = self.all_to_all_v_call(
            T::DTYPE,
            Bytes::of(bytemuck::cast_slice(send.as_ref())),
            send_counts,
            BytesMut::of(bytemuck::cast_slice_mut(recv.as_mut())),
            recv_counts,
        );
        self.issue(call, bufs)
    }

    /// [`Communicator::gather`] without waiting; [`Work::wait`] hands back `(send, recv)`.
    pub fn gather_async<T, S, R>(
        &self,
        send: S,
        recv: Option<R>,
        root: usize,
    ) -> Work<(S, Option<R>)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        let mut bufs = Owned::new((send, recv));
        let (send, recv) = bufs.get();
        let call = self.gather_call(
            T::DTYPE,
            Bytes::of(bytemuck::cast_slice(send.as_ref())),
            recv.as_mut()
                .map(|r| BytesMut::of(bytemuck::cast_slice_mut(r.as_mut()))),
            root,
        );
        self.issue(call, bufs)
    }

    /// [`Communicator::scatter`] without waiting; [`Work::wait`] hands back `(send, recv)`.
    pub fn scatter_async<T, S, R>(
        &self,
        send: Option<S>,
        recv: R,
        root: usize,
    ) -> Work<(Option<S>, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        let mut bufs = Owned::new((send, recv));
        let (send, recv) = bufs.get();
        let call = self.scatter_call(
            T::DTYPE,
            send.as_ref()
                .map(|s| Bytes::of(bytemuck::cast_slice(s.as_ref()))),
            BytesMut::of(bytemuck::cast_slice_mut(recv.as_mut())),
            root,
        );
        self.issue(call, bufs)
    }

    /// [`Communicator::all_gather_v`] without waiting (the counts are read when it is
    /// issued); [`Work::wait`] hands back `(send, recv)`.
    pub fn all_gather_v_async<T, S, R>(&self, send: S, recv: R, counts: &[usize]) -> Work<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        let mut bufs = Owned::new((send, recv));
        let (send, recv) = bufs.get();
        let call = self.all_gather_v_call(
            T::DTYPE,
            Bytes::of(bytemuck::cast_slice(send.as_ref())),
            BytesMut::of(bytemuck::cast_slice_mut(recv.as_mut())),
            counts,
        );
        self.issue(call, bufs)
    }

    /// [`Communicator::reduce_scatter_v`] without waiting (the counts are read when it is
    /// issued); [`Work::wait`] hands back `(send, recv)`.
    pub fn reduce_scatter_v_async<T, S, R>(
        &self,
        send: S,
        recv: R,
        counts: &[usize],
        op: ReduceOp,
    ) -> Work<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        let mut bufs = Owned::new((send, recv));
        let (send, recv) = bufs.get();
        let call = self.reduce_scatter_v_call(
            T::DTYPE,
            Bytes::of(bytemuck::cast_slice(send.as_ref())),
            BytesMut::of(bytemuck::cast_slice_mut(recv.as_mut())),
            counts,
            op,
        );
        self.issue(call, bufs)
    }

    /// [`Communicator::barrier`] without waiting.
    pub fn barrier_async(&self) -> Work {
        self.issue(self.barrier_call(), Owned::new(()))
    }
}
