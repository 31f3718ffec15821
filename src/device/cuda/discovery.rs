//! GPU discovery, visible devices, and opened (logical) GPUs.
//!
//! [`devices`] lists the GPUs the driver shows this process, with name, memory, compute
//! capability, multiprocessors, PCI bus id and UUID. Listing creates no CUDA context (a context
//! holds about half a GiB of the GPU's memory, and a GPU in `EXCLUSIVE_PROCESS` mode takes one
//! process only): free memory, which needs one, is read where this process has a context
//! already, and otherwise only for the GPUs a virtual-GPU plan splits. The driver applies
//! `CUDA_VISIBLE_DEVICES` itself; tutti reads the variable too ([`parse_cuda_visible_devices`])
//! to say which entry each GPU came from. An explicit list ([`select`], [`parse_device_list`])
//! narrows the GPUs further, like TensorFlow's `set_visible_devices`.
//!
//! [`GpuDevice::open`] opens one logical GPU of a plan (`logical.rs`): a whole physical GPU, or
//! one of several on it with its own stream and allocation budget.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use serde::Serialize;

use super::driver::{self, Context, Event, Stream};
use super::libs;
use super::logical::LogicalGpu;
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};

/// A physical GPU as the driver reports it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuInfo {
    /// The CUDA device ordinal in this process (after `CUDA_VISIBLE_DEVICES`): `gpu:N`.
    pub ordinal: usize,
    /// The device name (`NVIDIA H200`).
    pub name: String,
    /// Total device memory in bytes.
    pub total_memory: u64,
    /// Free device memory in bytes when it was read, else 0. Reading it needs a CUDA context
    /// on the GPU, so [`devices`] reads it only where this process has one already;
    /// [`GpuInfo::current_free_memory`] reads it, and virtual-GPU plans read it for the GPUs
    /// they split.
    pub free_memory: u64,
    /// Compute capability (major, minor), e.g. (9, 0).
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// PCI bus id (`0000:19:00.0`).
    pub pci_bus_id: String,
    /// The device UUID (`GPU-…`), as `CUDA_VISIBLE_DEVICES` and `nvidia-smi` name it.
    pub uuid: String,
    /// The `CUDA_VISIBLE_DEVICES` entry this GPU came from, when the variable is set.
    pub visible_as: Option<String>,
}

impl GpuInfo {
    /// The GPU's free memory now. This makes the GPU's primary context (kept for the life of
    /// the process) when nothing in the process uses the GPU yet: call it for GPUs this process
    /// uses.
    pub fn current_free_memory(&self) -> Result<u64> {
        libs::cuda()?;
        let ctx = driver::context(self.ordinal)?;
        Ok(driver::mem_info(&ctx)?.0)
    }

    /// `free_memory` when it was read, else read now ([`GpuInfo::current_free_memory`]).
    pub(super) fn known_free_memory(&self) -> Result<u64> {
        if self.free_memory > 0 {
            return Ok(self.free_memory);
        }
        self.current_free_memory().map_err(|e| match e {
            Error::Unavailable { .. } => e,
            e => Error::System {
                what: format!(
                    "reading the free memory of GPU {} ({})",
                    self.ordinal, self.name
                ),
                message: e.to_string(),
            },
        })
    }

    /// A copy with `free_memory` read, when it was not.
    pub fn with_free_memory(&self) -> Result<GpuInfo> {
        let mut g = self.clone();
        g.free_memory = self.known_free_memory()?;
        Ok(g)
    }

    /// The generic device record (`gpu:N`) for [`crate::device::discover`].
    pub fn to_device(&self) -> Device {
        Device {
            kind: DeviceKind::Gpu,
            index: self.ordinal,
            name: self.name.clone(),
            memory_bytes: Some(self.total_memory),
            physical_index: self.ordinal,
        }
    }
}

/// What `CUDA_VISIBLE_DEVICES` makes visible, as CUDA reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VisibleDevices {
    /// `None`: the variable is unset and every GPU is visible; otherwise the entries CUDA
    /// uses, in order (indices of the physical GPUs or `GPU-`/`MIG-` UUIDs). Empty: none.
    pub entries: Option<Vec<String>>,
    /// The entries CUDA ignores: from the first invalid or repeated one to the end.
    pub ignored: Vec<String>,
}

/// Read a `CUDA_VISIBLE_DEVICES` value as CUDA does: comma-separated physical indices or UUIDs
/// (`GPU-…`, `MIG-…`, prefixes allowed); the list stops at the first entry that is neither, or
/// that repeats an earlier one (so `-1` or an empty value hides every GPU).
pub fn parse_cuda_visible_devices(value: Option<&str>) -> VisibleDevices {
    let Some(value) = value else {
        return VisibleDevices {
            entries: None,
            ignored: Vec::new(),
        };
    };
    let parts: Vec<String> = value
        .split(',')
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    let valid = |p: &str| {
        p.chars().all(|c| c.is_ascii_digit()) || p.starts_with("GPU-") || p.starts_with("MIG-")
    };
    let mut entries: Vec<String> = Vec::new();
    let mut stop = parts.len();
    for (i, p) in parts.iter().enumerate() {
        let canon = if p.chars().all(|c| c.is_ascii_digit()) {
            p.trim_start_matches('0')
                .parse::<u64>()
                .unwrap_or(0)
                .to_string()
        } else {
            p.clone()
        };
        if !valid(p) || entries.contains(&canon) {
            stop = i;
            break;
        }
        entries.push(canon);
    }
    VisibleDevices {
        entries: Some(entries),
        ignored: parts[stop..].to_vec(),
    }
}

/// Parse an explicit list of GPUs: `0,2`, `gpu:0,gpu:2` or `/device:GPU:1` specs.
pub fn parse_device_list(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            if let Ok(i) = p.parse::<usize>() {
                return Ok(i);
            }
            match crate::device::parse_spec(p)? {
                (DeviceKind::Gpu, i) => Ok(i),
                (k, _) => Err(Error::config(format!(
                    "GPU list '{s}': '{p}' is a {k} device, not a GPU"
                ))),
            }
        })
        .collect()
}

/// The GPUs of `list` (ordinals among `all`), in the list's order; an error names an ordinal out
/// of range or repeated.
pub fn select(all: &[GpuInfo], list: &[usize]) -> Result<Vec<GpuInfo>> {
    let mut out: Vec<GpuInfo> = Vec::with_capacity(list.len());
    for &i in list {
        let g = all.iter().find(|g| g.ordinal == i).ok_or_else(|| {
            Error::config(format!(
                "GPU {i} is not visible: this process sees {} GPU(s){}",
                all.len(),
                cvd_note()
            ))
        })?;
        if out.iter().any(|o| o.ordinal == i) {
            return Err(Error::config(format!("GPU {i} is listed twice")));
        }
        out.push(g.clone());
    }
    Ok(out)
}

pub(super) fn cvd_note() -> String {
    std::env::var("CUDA_VISIBLE_DEVICES")
        .map(|v| format!(" (CUDA_VISIBLE_DEVICES='{v}')"))
        .unwrap_or_default()
}

pub(super) fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Every GPU the driver shows this process, or `Unavailable` ("CUDA not available: ...") when
/// there is no driver or no GPU. Creates no CUDA context: `free_memory` is read only for GPUs
/// this process has a context on already (0 elsewhere).
pub fn devices() -> Result<Vec<GpuInfo>> {
    libs::cuda()?;
    let n = driver::device_count()?;
    if n == 0 {
        return Err(libs::unavailable(
            "CUDA",
            format!("the driver shows this process no GPU{}", cvd_note()),
        ));
    }
    let visible = parse_cuda_visible_devices(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref());
    (0..n)
        .map(|ordinal| {
            let mut info = info(ordinal, true)?;
            info.visible_as = visible
                .entries
                .as_ref()
                .and_then(|e| e.get(ordinal).cloned());
            Ok(info)
        })
        .collect()
}

/// The GPUs of an explicit list (every visible GPU when `None`).
pub fn visible_devices(list: Option<&[usize]>) -> Result<Vec<GpuInfo>> {
    let all = devices()?;
    match list {
        None => Ok(all),
        Some(l) => select(&all, l),
    }
}

/// What the driver says of GPU `ordinal`, without making a context; `read_free`: read the free
/// memory when the process has a context on the GPU already.
fn info(ordinal: usize, read_free: bool) -> Result<GpuInfo> {
    use sys::CUdevice_attribute as A;
    let dev = driver::device(ordinal)?;
    let mut name = [0 as std::ffi::c_char; 256];
    // SAFETY: a buffer of the stated length.
    driver::check(
        unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev) },
        || format!("CUDA cuDeviceGetName for GPU {ordinal}"),
    )?;
    // SAFETY: the driver NUL-terminates within the buffer.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut bus = [0 as std::ffi::c_char; 64];
    // SAFETY: a buffer of the stated length.
    driver::check(
        unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev) },
        || format!("CUDA cuDeviceGetPCIBusId for GPU {ordinal}"),
    )?;
    // SAFETY: as above.
    let pci_bus_id = unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: valid out-pointer.
    driver::check(unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) }, || {
        format!("CUDA cuDeviceGetUuid for GPU {ordinal}")
    })?;
    let total = driver::total_memory(dev, ordinal)?;
    let free = if read_free {
        driver::free_memory_if_active(dev, ordinal).unwrap_or(0)
    } else {
        0
    };
    Ok(GpuInfo {
        ordinal,
        name,
        total_memory: total,
        free_memory: free,
        compute_capability: (
            driver::attribute(
                dev,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                ordinal,
            )? as u32,
            driver::attribute(
                dev,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                ordinal,
            )? as u32,
        ),
        multiprocessors: driver::attribute(
            dev,
            A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            ordinal,
        )? as u32,
        pci_bus_id,
        uuid: format_uuid(&uuid.bytes.map(|b| b as u8)),
        visible_as: None,
    })
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi prints it.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let h: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// The physical GPUs as generic devices (`gpu:0`, `gpu:1`, ...), or none when CUDA is not
/// available.
pub fn discover_devices() -> Vec<Device> {
    devices()
        .map(|v| v.iter().map(GpuInfo::to_device).collect())
        .unwrap_or_default()
}

/// An opened logical GPU: its physical GPU's context, its own stream, and its allocation
/// budget. Cloning shares it.
#[derive(Clone)]
pub struct GpuDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    pub logical: LogicalGpu,
    pub name: String,
    pub compute_capability: (u32, u32),
    pub multiprocessors: u32,
    pub total_memory: u64,
    pub used: AtomicU64,
    pub ctx: Arc<Context>,
    pub stream: Stream,
    pub event: Event,
    pub timeout: Duration,
    /// Set when a wait on the stream timed out, cleared when the stream is found idle: later
    /// waits are bounded by [`FAILED_DEVICE_WAIT`], and drops do not wait at all.
    pub failed: AtomicBool,
}

/// The longest a wait on a device whose stream timed out before may take: the device is stuck
/// or far behind, and waiting the whole timeout again (for every buffer dropped after a
/// timeout, say) would only stall the caller.
pub(crate) const FAILED_DEVICE_WAIT: Duration = Duration::from_secs(1);

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.describe())
    }
}

impl GpuDevice {
    /// Open a logical GPU of a plan ([`super::VirtualGpuConfig::plan`], [`super::plan_replicas`]).
    pub fn open(logical: &LogicalGpu) -> Result<GpuDevice> {
        libs::cuda()?;
        let ctx = driver::context(logical.physical)?;
        let info = info(logical.physical, false)?;
        let stream = Stream::new(&ctx)?;
        let event = Event::new(&ctx)?;
        Ok(GpuDevice {
            inner: Arc::new(DeviceInner {
                logical: logical.clone(),
                name: info.name,
                compute_capability: info.compute_capability,
                multiprocessors: info.multiprocessors,
                total_memory: info.total_memory,
                used: AtomicU64::new(0),
                ctx,
                stream,
                event,
                timeout: crate::sync::default_timeout(),
                failed: AtomicBool::new(false),
            }),
        })
    }

    /// Index among the logical GPUs it was planned with.
    pub fn index(&self) -> usize {
        self.inner.logical.index
    }

    /// The physical GPU's ordinal.
    pub fn physical(&self) -> usize {
        self.inner.logical.physical
    }

    /// True when its physical GPU carries other logical GPUs too.
    pub fn is_virtual(&self) -> bool {
        self.inner.logical.is_virtual
    }

    /// The physical GPU's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Compute capability of the physical GPU.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.inner.compute_capability
    }

    /// Bytes this logical GPU may allocate, when limited.
    pub fn memory_limit(&self) -> Option<u64> {
        self.inner.logical.memory_limit
    }

    /// Bytes its live buffers hold.
    pub fn memory_used(&self) -> u64 {
        self.inner.used.load(Ordering::Relaxed)
    }

    /// `gpu:3 (virtual, on GPU 0)`, or `gpu:1` for a whole GPU.
    pub fn describe(&self) -> String {
        let l = &self.inner.logical;
        if l.is_virtual {
            format!("gpu:{} (virtual, on GPU {})", l.index, l.physical)
        } else {
            format!("gpu:{} (GPU {})", l.index, l.physical)
        }
    }

    /// The generic device record of this logical GPU.
    pub fn to_device(&self) -> Device {
        Device {
            kind: DeviceKind::Gpu,
            index: self.index(),
            name: self.inner.name.clone(),
            memory_bytes: Some(self.memory_limit().unwrap_or(self.inner.total_memory)),
            physical_index: self.physical(),
        }
    }

    /// True when both handles are the same logical GPU.
    pub fn same(&self, other: &GpuDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Wait for the work queued on this logical GPU's stream, up to its timeout
    /// (`TUTTI_TIMEOUT`, default 300 s).
    pub fn synchronize(&self) -> Result<()> {
        self.inner.sync(self.inner.timeout, "finish its work")
    }
}

impl DeviceInner {
    /// Count `bytes` against the memory limit, or fail naming the limit and the use.
    pub fn reserve(&self, bytes: u64) -> Result<()> {
        let limit = self.logical.memory_limit.unwrap_or(u64::MAX);
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let new = cur.saturating_add(bytes);
            if new > limit {
                return Err(Error::InvalidArgument {
                    site: None,
                    message: format!(
                        "gpu:{} (on GPU {}): allocating {bytes} bytes would pass its memory limit of {limit} bytes ({cur} in use)",
                        self.logical.index, self.logical.physical
                    ),
                });
            }
            match self
                .used
                .compare_exchange(cur, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    pub fn release(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// True when a wait on this device timed out and its stream was not idle since.
    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Record that a wait on this device timed out.
    pub fn mark_failed(&self) {
        self.failed.store(true, Ordering::Release);
    }

    /// Record that the stream was found idle.
    pub fn mark_idle(&self) {
        self.failed.store(false, Ordering::Release);
    }

    /// How long a wait of `timeout` may take on this device: all of it, or at most
    /// [`FAILED_DEVICE_WAIT`] once a wait on it timed out.
    pub fn wait_bound(&self, timeout: Duration) -> Duration {
        if self.has_failed() {
            timeout.min(FAILED_DEVICE_WAIT)
        } else {
            timeout
        }
    }

    /// Wait for this stream, up to `timeout` ([`DeviceInner::wait_bound`]); a timeout names
    /// the device and `phase`, and marks the device failed.
    pub fn sync(&self, timeout: Duration, phase: &str) -> Result<()> {
        let failed = self.has_failed();
        let bound = self.wait_bound(timeout);
        match driver::wait_all(&[&self.stream], Instant::now() + bound)? {
            Ok(()) => {
                self.mark_idle();
                Ok(())
            }
            Err(_) => {
                self.mark_failed();
                let message = if failed {
                    format!(
                        "the device is still busy {bound:?} after an earlier wait on it timed \
                         out, waiting for it to {phase}; it is stuck or slow (raise the timeout \
                         with TUTTI_TIMEOUT)"
                    )
                } else {
                    format!(
                        "timed out after {timeout:?} waiting for the device to {phase}; it is \
                         stuck or slow (raise the timeout with TUTTI_TIMEOUT)"
                    )
                };
                Err(Error::System {
                    what: format!("gpu:{} (GPU {})", self.logical.index, self.logical.physical),
                    message,
                })
            }
        }
    }

    /// Whether memory the stream may still use can go back to the driver: the stream is idle.
    /// Waits up to the device's timeout, but on a device that timed out before only looks
    /// once, so that what is dropped after a timeout does not wait again. `false` (the
    /// caller leaks the memory rather than free it under a running kernel) when the stream is
    /// still busy; a driver error is logged and counts as idle (the stream runs nothing more).
    pub fn idle_before_free(&self, phase: &str) -> bool {
        if self.has_failed() {
            return match self.stream.done() {
                Ok(true) => {
                    self.mark_idle();
                    true
                }
                Ok(false) => false,
                Err(e) => {
                    driver::log(&format!("{phase}: {e}"));
                    true
                }
            };
        }
        match self.sync(self.timeout, phase) {
            Ok(()) => true,
            Err(e) => {
                driver::log(&format!("{phase}: {e}"));
                !self.has_failed()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::device::cuda::logical::test_gpu as gpu;

    #[test]
    fn cuda_visible_devices_as_cuda_reads_it() {
        let p = |s: &str| parse_cuda_visible_devices(Some(s));
        assert_eq!(parse_cuda_visible_devices(None).entries, None);
        assert_eq!(p("2,0").entries, Some(vec!["2".into(), "0".into()]));
        assert_eq!(p(" 1 , 3 ").entries, Some(vec!["1".into(), "3".into()]));
        // An invalid entry hides it and everything after it.
        let v = p("0,x,1");
        assert_eq!(v.entries, Some(vec!["0".into()]));
        assert_eq!(v.ignored, vec!["x".to_string(), "1".to_string()]);
        assert_eq!(p("-1").entries, Some(vec![]));
        assert_eq!(p("").entries, Some(vec![]));
        // A repeated entry stops the list too.
        assert_eq!(p("1,01,2").entries, Some(vec!["1".into()]));
        assert_eq!(
            p("GPU-8932f937,MIG-1").entries,
            Some(vec!["GPU-8932f937".into(), "MIG-1".into()])
        );
    }

    #[test]
    fn explicit_lists_parse_and_select() {
        assert_eq!(parse_device_list("0, 2").unwrap(), vec![0, 2]);
        assert_eq!(
            parse_device_list("gpu:1,/device:GPU:3").unwrap(),
            vec![1, 3]
        );
        assert!(parse_device_list("cpu:0")
            .unwrap_err()
            .to_string()
            .contains("not a GPU"));
        let all = vec![gpu(0, 10), gpu(1, 10)];
        let s = select(&all, &[1, 0]).unwrap();
        assert_eq!(s.iter().map(|g| g.ordinal).collect::<Vec<_>>(), vec![1, 0]);
        assert!(select(&all, &[2])
            .unwrap_err()
            .to_string()
            .contains("GPU 2 is not visible"));
        assert!(select(&all, &[1, 1])
            .unwrap_err()
            .to_string()
            .contains("twice"));
    }

    #[test]
    fn uuid_format() {
        let b: [u8; 16] = core::array::from_fn(|i| i as u8);
        assert_eq!(format_uuid(&b), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f");
    }
}
