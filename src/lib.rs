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
//! [`dtype`] (element types, reduce kernels), [`device`] (what replicas run on), [`cluster`]
//! (cluster config, rendezvous store, the job secret), [`transport`] (how bytes move),
//! [`algorithm`] (collectives written once against a transport), group engines (PJRT programs,
//! NCCL and CUDA copies), [`comm`] (the communicator: one checked path, issue order, work
//! handles, timeouts, abort), [`strategy`].
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

pub mod algorithm;
mod call;
pub mod cluster;
pub mod comm;
mod config;
pub mod device;
pub mod dtype;
mod engine;
pub mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod perf;
pub mod reference;
mod reuse;
pub mod strategy;
mod sync;
mod trace;
pub mod transport;
#[cfg(feature = "xla")]
pub mod xla;

pub use algorithm::Algorithm;
pub use cluster::ClusterSpec;
pub use comm::{
    device_group, local_group, run_local, timeout_from_env, AbortHandle, Communicator, Config,
    RawCall, Replicas, Work, MAX_LOCAL_RANKS,
};
pub use device::{Device, DeviceKind};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{Collective, Error, Result, Site};
pub use half::{bf16, f16};
pub use transport::TransportKind;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
