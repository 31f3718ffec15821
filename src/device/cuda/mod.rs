//! CUDA devices (cargo feature `cuda`): the driver, NVRTC and NCCL libraries loaded at run
//! time, GPU discovery and virtual GPUs, and device buffers. What runs collectives on them
//! (NCCL calls, the copy algorithms, reduction kernels) is the CUDA engine,
//! `crate::engine::cuda`; users see both through [`crate::gpu`].
//!
//! Nothing CUDA is linked: a machine without the driver gets [`Error::Unavailable`], never a
//! panic. [`libs`] says where each library is looked for.

pub(crate) mod buffer;
pub(crate) mod discovery;
pub(crate) mod driver;
pub mod libs;
pub(crate) mod logical;
pub(crate) mod nccl;
pub(crate) mod nvrtc;

pub use buffer::{DeviceMut, DevicePtr, DeviceRef, GpuBuffer, GpuSlice, GpuSliceMut};
pub use discovery::{
    devices, discover_devices, format_uuid, parse_cuda_visible_devices, parse_device_list, select,
    visible_devices, GpuDevice, GpuInfo, VisibleDevices,
};
pub use logical::{
    even_memory_limits, plan_replicas, LogicalGpu, VirtualGpuConfig, RESERVED_SHARE,
};
pub use nccl::{
    decode_version, nccl_dtype, nccl_library, nccl_op, open_nccl_library, NcclLibrary, MIN_VERSION,
};
pub use nvrtc::{
    first_nvrtc_library, nvrtc_library, open_nvrtc_library, NvrtcLibrary,
    MIN_VERSION as NVRTC_MIN_VERSION,
};

use std::time::Instant;

use crate::error::{Error, Result};

/// The CUDA driver's version (major, minor), e.g. (12, 4): the newest CUDA it runs.
pub fn driver_version() -> Result<(u32, u32)> {
    libs::cuda()?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: valid out-pointer; the driver is present.
    driver::check(
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) },
        || "CUDA cuDriverGetVersion".into(),
    )?;
    Ok(((v / 1000) as u32, ((v % 1000) / 10) as u32))
}

/// The devices `-n ranks` means: that many GPUs, or logical GPUs spread over the GPUs there
/// are.
pub fn replica_devices(ranks: usize) -> Result<Vec<GpuDevice>> {
    let gpus = devices()?;
    plan_replicas(ranks, &gpus)?
        .iter()
        .map(GpuDevice::open)
        .collect()
}

/// Device-to-device copy bandwidth of physical GPU `ordinal`: bytes read plus written per
/// second by 256 MiB copies within its memory (GB/s, the best of three rounds of ten).
pub fn device_copy_gbps(ordinal: usize) -> Result<f64> {
    let dev = GpuDevice::open(&LogicalGpu {
        index: 0,
        physical: ordinal,
        memory_limit: None,
        is_virtual: false,
    })?;
    let n = (256usize << 20) / 4;
    let src = GpuBuffer::<u32>::zeros(&dev, n)?;
    let dst = GpuBuffer::<u32>::zeros(&dev, n)?;
    let inner = &dev.inner;
    let bytes = n * 4;
    let mut best = f64::MAX;
    for round in 0..4 {
        let reps = if round == 0 { 2 } else { 10 };
        let t = Instant::now();
        for _ in 0..reps {
            driver::copy_async(
                dst.device_ptr(),
                &inner.ctx,
                src.device_ptr(),
                &inner.ctx,
                bytes,
                &inner.stream,
            )?;
        }
        inner.sync(inner.timeout, "finish the copy-bandwidth test")?;
        if round > 0 {
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
    }
    Ok(2.0 * bytes as f64 / best / 1e9)
}

/// NVRTC's version, when it is there (the copy-based algorithms need it).
pub fn nvrtc_version() -> Result<(u32, u32)> {
    nvrtc_library().map(|l| l.version)
}

/// What this build and machine offer for GPUs: every part, or why it is missing.
#[derive(Clone, Debug)]
pub struct Status {
    /// The driver version, or why CUDA is not available.
    pub driver: Result<(u32, u32)>,
    /// The GPUs, or why there are none.
    pub gpus: Result<Vec<GpuInfo>>,
    /// The NCCL library, or why it is not available.
    pub nccl: Result<NcclLibrary>,
    /// The NVRTC library, or why it is not available.
    pub nvrtc: Result<NvrtcLibrary>,
}

/// Probe the driver, the GPUs, NCCL and NVRTC (for `tutti devices`).
pub fn status() -> Status {
    Status {
        driver: driver_version(),
        gpus: devices(),
        nccl: nccl_library(),
        nvrtc: nvrtc_library(),
    }
}

impl Status {
    /// One line per part: `CUDA driver 12.4`, `NCCL 2.21.5 (libnccl.so.2)`,
    /// `NVRTC 13.0 (libnvrtc.so.13)`, or why not.
    pub fn lines(&self) -> Vec<String> {
        let why = |e: &Error| e.to_string();
        vec![
            match &self.driver {
                Ok((a, b)) => format!("CUDA driver {a}.{b}"),
                Err(e) => why(e),
            },
            match &self.nccl {
                Ok(l) => format!(
                    "NCCL {}.{}.{} ({})",
                    l.version.0, l.version.1, l.version.2, l.path
                ),
                Err(e) => why(e),
            },
            match &self.nvrtc {
                Ok(l) => format!("NVRTC {}.{} ({})", l.version.0, l.version.1, l.path),
                Err(e) => why(e),
            },
        ]
    }

    /// The same as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        let err = |e: &Error| serde_json::json!({ "error": e.to_string() });
        serde_json::json!({
            "driver": self.driver.as_ref().map_or_else(err, |(a, b)| serde_json::json!(format!("{a}.{b}"))),
            "gpus": self.gpus.as_ref().map_or_else(err, |g| serde_json::json!(g)),
            "nccl": self.nccl.as_ref().map_or_else(err, |l| serde_json::json!({
                "path": l.path,
                "version": format!("{}.{}.{}", l.version.0, l.version.1, l.version.2),
            })),
            "nvrtc": self.nvrtc.as_ref().map_or_else(err, |l| serde_json::json!({
                "path": l.path,
                "version": format!("{}.{}", l.version.0, l.version.1),
            })),
        })
    }
}
