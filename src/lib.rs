//! # tutti
//!
//! An embeddable collective-communication runtime: all-reduce (direct, ring, hierarchical copy,
//! reduce-to-one), broadcast, all-gather, reduce and reduce-scatter across the replicas of
//! data-parallel training.
//!
//! Layers, bottom up: [`dtype`] (element types, reduce kernels), [`device`] (what replicas run
//! on), [`transport`] (how bytes move), [`algorithm`] (collectives written once against a
//! transport), [`comm`] (the communicator: one checked entry path, timeouts, abort).
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
pub mod cluster;
pub mod comm;
pub mod device;
pub mod dtype;
mod engine;
pub mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod perf;
pub mod reference;
pub mod strategy;
mod sync;
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
