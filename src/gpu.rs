//! GPUs (cargo feature `cuda`): discovery, device buffers, NCCL, and TensorFlow's copy-based
//! all-reduce algorithms on GPUs.
//!
//! This module is the public face of two layers: CUDA devices (`device/cuda`: libraries,
//! discovery, buffers) and the CUDA engine (`engine/cuda`: [`GpuGroup`], NCCL calls, the copy
//! algorithms and their kernels).
//!
//! Nothing CUDA is linked: the driver (`libcuda.so.1`), NVRTC and NCCL (`libnccl.so.2`) are
//! loaded at run time, and a machine without them gets [`crate::Error::Unavailable`]
//! (`CUDA not available: libcuda.so.1 not found ...`), never a panic. See [`libs`] for where each
//! library is looked for (`TUTTI_NCCL_LIBRARY`, `TUTTI_NVRTC_LIBRARY`, pip packages, the CUDA
//! toolkit; NVRTC of CUDA 12 or 13).
//!
//! tutti saves the calling thread's current CUDA context and restores it after every call that
//! needs one of its own, so code that shares the process (PyTorch, JAX, CuPy) keeps its device.
//! Listing GPUs ([`devices`]) creates no context: only the GPUs a process opens
//! ([`GpuDevice::open`]) or splits into virtual GPUs get one.
//!
//! * [`devices`]: the GPUs the driver shows this process (name, total memory, compute
//!   capability, ...), after `CUDA_VISIBLE_DEVICES`; [`visible_devices`] with an explicit list;
//!   [`GpuInfo::current_free_memory`] for the GPUs this process uses.
//! * [`VirtualGpuConfig`]: physical GPUs split into logical GPUs with memory limits, as
//!   TensorFlow's logical device configuration; [`plan_replicas`] spreads N replicas.
//! * [`GpuDevice`]: an opened logical GPU (its own stream and allocation budget);
//!   [`GpuBuffer`]: typed device memory on one, with host copies and views.
//! * [`GpuGroup`]: all-reduce, broadcast, all-gather, reduce and reduce-scatter over one buffer
//!   per device, with [`GpuAlgorithm`] `nccl`, `hierarchical-copy[:G]`, `reduce-to-one[:ROOT]`
//!   or `auto` (NCCL when it can run, else reduce-to-one, as TensorFlow's MirroredStrategy);
//!   [`GpuGroup::from_cluster`]: one rank per process over NCCL, the NCCL id exchanged through
//!   tutti's rendezvous store; [`GpuGroup::collective_raw`]: device addresses tagged with their
//!   device, for the C ABI; [`GpuGroup::into_communicators`]: a communicator per device (the
//!   collectives and point-to-point, GPU to GPU).
//!
//! ```no_run
//! use tutti::gpu::{plan_replicas, devices, GpuAlgorithm, GpuBuffer, GpuDevice, GpuGroup};
//! use tutti::{Config, ReduceOp};
//!
//! // Four replicas: four GPUs, or four logical GPUs on the GPUs there are.
//! let plan = plan_replicas(4, &devices()?)?;
//! let gpus: Vec<GpuDevice> = plan.iter().map(GpuDevice::open).collect::<Result<_, _>>()?;
//! let group = GpuGroup::new(&gpus, GpuAlgorithm::Auto, &Config::default())?;
//! let mut grads: Vec<GpuBuffer<f32>> = gpus
//!     .iter()
//!     .enumerate()
//!     .map(|(r, d)| GpuBuffer::from_host(d, &vec![r as f32; 1 << 20]))
//!     .collect::<Result<_, _>>()?;
//! group.all_reduce(&mut grads, ReduceOp::Mean)?;
//! assert_eq!(grads[3].to_host()?[0], 1.5);
//! # Ok::<(), tutti::Error>(())
//! ```

pub use crate::device::cuda::libs;
pub use crate::device::cuda::{
    decode_version, device_copy_gbps, devices, discover_devices, driver_version,
    even_memory_limits, first_nvrtc_library, format_uuid, nccl_dtype, nccl_library, nccl_op,
    nvrtc_library, nvrtc_version, open_nccl_library, open_nvrtc_library,
    parse_cuda_visible_devices, parse_device_list, plan_replicas, replica_devices, select, status,
    visible_devices, DeviceMut, DevicePtr, DeviceRef, GpuBuffer, GpuDevice, GpuInfo, GpuSlice,
    GpuSliceMut, LogicalGpu, NcclLibrary, NvrtcLibrary, Status, VirtualGpuConfig, VisibleDevices,
    MIN_VERSION, NVRTC_MIN_VERSION, RESERVED_SHARE,
};
pub use crate::engine::cuda::kernels;
pub use crate::engine::cuda::{GpuAlgorithm, GpuGroup};
