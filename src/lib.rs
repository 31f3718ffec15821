//! # tutti
//!
//! An embeddable collective-communication runtime: all-reduce (direct, ring, hierarchical copy,
//! reduce-to-one), broadcast, all-gather, reduce and reduce-scatter across the replicas of
//! data-parallel training, on CPUs, GPUs and XLA devices, blocking or not.
//!
//! ## Getting a communicator
//!
//! A [`Communicator`] is one rank's handle on a group; every collective goes through it, checked
//! the same way whatever the device.
//!
//! | ranks are | get them with |
//! |---|---|
//! | threads of this process | [`local_group`], or [`run_local`] to run a closure per rank |
//! | devices of this process (`cpu:N`, `xla:N`, `cuda:N`) | [`device_group`] |
//! | processes, on one host or many | [`Communicator::from_env`] under `tutti launch`, torchrun, mpirun, srun or `TF_CONFIG`; [`Communicator::from_cluster`] with a [`ClusterSpec`] |
//! | one GPU per process | [`Communicator::from_cluster_on`], or `TUTTI_DEVICE=cuda` with `from_env` |
//!
//! Every collective has a blocking form and a non-blocking one returning a [`Work`]
//! (`all_reduce_async`, ...). [`Replicas`] is the one-call form over every replica's buffer;
//! [`strategy`] has tf.distribute's strategies on top.
//!
//! ## Features
//!
//! - `xla`: XLA devices through a PJRT plugin loaded at run time (module `xla`).
//! - `cuda`: CUDA GPUs, NCCL and the copy algorithms, every library loaded at run time
//!   (module `gpu`). Without a GPU or its libraries, calls fail with [`Error::Unavailable`].
//!
//! ## Layers, bottom up
//!
//! Element types and reduce kernels ([`kernels`]), devices (what replicas run on), the cluster
//! (configuration, rendezvous [`Store`], the job secret), transports (how bytes move), the
//! algorithms (collectives written once against a transport), the group engines (PJRT
//! programs, NCCL and CUDA copies), the communicator (one checked path, issue order, work
//! handles, timeouts, abort), and the [`strategy`] objects on top. The layers are modules of
//! the crate, private: everything a user names is re-exported here, at the top.
//!
//! ```
//! use tutti::{run_local, Config, ReduceOp};
//!
//! // Four ranks, each a thread of this process.
//! let results = run_local(4, &Config::default(), |comm| {
//!     let mut grad = vec![comm.rank() as f32 + 1.0; 1024];
//!     comm.all_reduce(&mut grad, ReduceOp::Mean).unwrap();
//!     grad[0]
//! })
//! .unwrap();
//! assert_eq!(results, vec![2.5; 4]);
//! ```
#![warn(missing_docs)]
#![warn(unnameable_types)]

mod algorithm;
mod call;
mod cluster;
mod comm;
mod config;
mod device;
mod dtype;
mod engine;
mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod perf;
pub mod reference;
mod reuse;
pub mod strategy;
mod sync;
mod trace;
mod transport;
pub mod tuning;
#[cfg(feature = "xla")]
pub mod xla;

// The public API is flat: every item a user names is re-exported here, whatever layer it lives
// in, so the layers can move without moving a user's paths. `strategy`, `perf`, `reference`,
// `kernels`, `gpu` and `xla` are the namespaces of their areas.
pub use algorithm::{partition, Algorithm};
pub use cluster::store::{FileStore, Store, TcpStore, TcpStoreServer};
pub use cluster::{
    from_tf_config, random_token, split_addr, ClusterSpec, MAX_WORLD_SIZE, MIN_TOKEN_BYTES,
    TASK_TYPES,
};
pub use comm::{
    compression_from_env, deterministic_from_env, device_group, full_check_from_env, local_group,
    run_local, timeout_from_env, AbortHandle, Communicator, Compression, Config, PeerOp, RawCall,
    RawPeerOp, Replicas, SharedBuffer, Work, MAX_LOCAL_RANKS, MAX_TIMEOUT,
};
pub use device::{
    device_from_spec, discover as discover_devices, host as host_info, logical_cpus,
    parse_spec as parse_device, Device, DeviceKind, DeviceTensor, HostInfo,
};
pub use dtype::{kernels, Apply, DType, Element, ReduceOp};
pub use error::{Collective, Error, Result, Site};
pub use half::{bf16, f16};
pub use trace::flush as flush_trace;
pub use transport::{dead_segments, sweep_dead_segments, TransportKind};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
