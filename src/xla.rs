//! XLA devices through a PJRT plugin (cargo feature `xla`): TPUs through libtpu, and any other
//! plugin that exports `GetPjrtApi` (the CPU plugin `xla-cpu-pjrt`, the CUDA plugins
//! `jax-cuda12-pjrt` / `jax-cuda13-pjrt`).
//!
//! This module is the public face of two layers: XLA devices (`device/pjrt`: the plugin, the
//! client, buffers, programs) and the PJRT engine (`engine/pjrt`: the collectives across a
//! client's devices).
//!
//! tutti loads the plugin at run time (nothing of XLA is linked in) through its own bindings to
//! the PJRT C API ([`ffi`]): the plugin's API version is checked (same major version as the
//! header tutti mirrors, a minor version at least [`ffi::MIN_MINOR`]) and an incompatible plugin
//! is refused with an error saying which versions meet.
//!
//! * Plugins: `TUTTI_PJRT_PLUGIN=/path/plugin.so`, else discovery ([`plugin::candidates`]):
//!   libtpu's usual places, then plugins installed in Python site-packages.
//! * Clients: [`Client::from_env`] (options from `TUTTI_PJRT_OPTIONS=key=value,...`, e.g.
//!   `cpu_device_count=4` for the CPU plugin) or [`Client::new`] with [`ClientOptions`].
//! * Devices: [`Client::devices`]; host ↔ device copies for every element type
//!   ([`Client::buffer_from_host`], [`XlaBuffer::to_vec`]).
//! * Collectives across the devices, compiled as XLA programs (see [`program`]) and cached per
//!   (collective, dtype, count, op or root, replicas): [`Client::all_reduce`] (every op),
//!   [`Client::broadcast`], [`Client::all_gather`], [`Client::reduce_scatter`] on host buffers,
//!   one per replica, and the `*_buffers` forms on device buffers. A program the plugin refuses
//!   runs host-staged instead (copied to the host, reduced with tutti's kernels, copied back);
//!   [`Client::set_route`] forces either path.
//!
//! Every wait on the devices is bounded by the client's timeout (`TUTTI_TIMEOUT`, default
//! 300 s): tutti registers a callback on each PJRT event and waits on a channel with a deadline.
//! Host-to-device copies take the data during the call (`kImmutableOnlyDuringCall`); device-to-
//! host copies land in memory tutti owns, so that after a timeout nothing the plugin may still
//! write belongs to the caller. A client whose wait timed out refuses further work.
//!
//! ```no_run
//! use tutti::xla::Client;
//! use tutti::ReduceOp;
//!
//! // TUTTI_PJRT_PLUGIN=.../xla_cpu_pjrt.so TUTTI_PJRT_OPTIONS=cpu_device_count=4
//! let client = Client::from_env()?;
//! let mut grads: Vec<Vec<f32>> = (0..4).map(|r| vec![r as f32; 1024]).collect();
//! let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
//! client.all_reduce(&mut views, ReduceOp::Mean)?;
//! assert!(grads.iter().all(|g| g[0] == 1.5));
//! # Ok::<(), tutti::Error>(())
//! ```

pub use crate::device::pjrt::{client, ffi, plugin, program};
pub use crate::device::pjrt::{
    discover_devices, discovery, CacheStats, Candidate, Client, ClientOptions, Discovery,
    OptionValue, Plugin, PluginKind, Route, XlaBuffer, XlaDevice, OPTIONS_ENV, PLUGIN_ENV,
};
