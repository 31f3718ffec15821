//! The CUDA driver calls tutti makes, each checked: a failure becomes an [`Error::System`] naming
//! the call, the device and the driver's error name and text. Handles that own driver objects
//! (streams, events, allocations) release them in `Drop`, logging rather than panicking when the
//! driver refuses.
//!
//! Every function here assumes [`super::libs::cuda`] succeeded (the callers check it first).
//!
//! tutti never leaves a context of its own current on a caller's thread: where a call needs one,
//! [`Context::enter`] pushes it and its guard pops it again, so the caller's context (PyTorch's,
//! JAX's, CuPy's, or none) is current again afterwards; [`Preserve`] restores the caller's
//! context around calls into libraries that switch devices themselves (NCCL).

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUresult};

use crate::error::{Error, Result};

/// `CUDA_ERROR_NAME (text)` for a driver result.
pub(crate) fn describe(r: CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: valid out-pointers; the driver returns static strings or leaves them null.
    unsafe {
        let _ = sys::cuGetErrorName(r, &mut name);
        let _ = sys::cuGetErrorString(r, &mut text);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            None
        } else {
            // SAFETY: non-null, NUL-terminated static string from the driver.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    };
    match (s(name), s(text)) {
        (Some(n), Some(t)) => format!("{n} ({t})"),
        (Some(n), None) => n,
        _ => format!("{r:?}"),
    }
}

/// Turn a driver result into tutti's error, naming the call and what it was for.
pub(crate) fn check(r: CUresult, what: impl FnOnce() -> String) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::System {
            what: what(),
            message: describe(r),
        })
    }
}

/// Log a failure that cannot be returned (in `Drop`).
pub(crate) fn log(msg: &str) {
    log::warn!("{msg}");
}

/// The primary context of one physical GPU, retained for the life of the process (as the CUDA
/// runtime does), shared by every logical GPU on it.
pub(crate) struct Context {
    pub ordinal: usize,
    pub dev: sys::CUdevice,
    pub raw: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be made current and used from any thread.
unsafe impl Send for Context {}
// SAFETY: as above; the driver serializes what needs it.
unsafe impl Sync for Context {}

impl Context {
    /// Make this context current on the calling thread until the guard drops, when the
    /// thread's previous context is current again. Nothing is pushed when it is current
    /// already.
    pub fn enter(&self) -> Result<Current> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, || {
            format!("CUDA cuCtxGetCurrent (entering GPU {})", self.ordinal)
        })?;
        if cur == self.raw {
            return Ok(Current {
                pushed: None,
                _thread: PhantomData,
            });
        }
        // SAFETY: a retained primary context.
        check(unsafe { sys::cuCtxPushCurrent_v2(self.raw) }, || {
            format!("CUDA cuCtxPushCurrent for GPU {}", self.ordinal)
        })?;
        Ok(Current {
            pushed: Some(self.ordinal),
            _thread: PhantomData,
        })
    }
}

/// A context made current by [`Context::enter`]; dropping it makes the thread's previous
/// context current again. Bound to the thread that made it (not `Send`).
#[must_use = "the context is current only while the guard lives"]
pub(crate) struct Current {
    /// The GPU whose context was pushed, when one was.
    pushed: Option<usize>,
    _thread: PhantomData<*const ()>,
}

impl Drop for Current {
    fn drop(&mut self) {
        let Some(ordinal) = self.pushed else {
            return;
        };
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; pops the context `enter` pushed on this thread.
        let r = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        if r != CUresult::CUDA_SUCCESS {
            log(&format!(
                "cuCtxPopCurrent (leaving GPU {ordinal}) failed: {}",
                describe(r)
            ));
        }
    }
}

/// The calling thread's current context, made current again when the guard drops (whatever
/// the calls in between made current). For calls into libraries that switch devices
/// themselves.
#[must_use = "the context is restored when the guard drops"]
pub(crate) struct Preserve {
    saved: Option<sys::CUcontext>,
    _thread: PhantomData<*const ()>,
}

/// Save the calling thread's current context until the guard drops (nothing to save without
/// a driver).
pub(crate) fn preserve_current() -> Preserve {
    if super::libs::cuda().is_err() {
        return Preserve {
            saved: None,
            _thread: PhantomData,
        };
    }
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let r = unsafe { sys::cuCtxGetCurrent(&mut cur) };
    if r != CUresult::CUDA_SUCCESS {
        log(&format!(
            "cuCtxGetCurrent failed ({}); the current CUDA context will not be restored",
            describe(r)
        ));
    }
    Preserve {
        saved: (r == CUresult::CUDA_SUCCESS).then_some(cur),
        _thread: PhantomData,
    }
}

impl Drop for Preserve {
    fn drop(&mut self) {
        let Some(saved) = self.saved else {
            return;
        };
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let r = unsafe { sys::cuCtxGetCurrent(&mut cur) };
        if r == CUresult::CUDA_SUCCESS && cur == saved {
            return;
        }
        // SAFETY: the context that was current on this thread before (or null).
        let r = unsafe { sys::cuCtxSetCurrent(saved) };
        if r != CUresult::CUDA_SUCCESS {
            log(&format!(
                "cuCtxSetCurrent (restoring the caller's CUDA context) failed: {}",
                describe(r)
            ));
        }
    }
}

/// The number of GPUs the driver shows this process (after `CUDA_VISIBLE_DEVICES`).
pub(crate) fn device_count() -> Result<usize> {
    let mut n: c_int = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, || {
        "CUDA cuDeviceGetCount".into()
    })?;
    Ok(n.max(0) as usize)
}

/// The driver's handle of GPU `ordinal`.
pub(crate) fn device(ordinal: usize) -> Result<sys::CUdevice> {
    let mut d: sys::CUdevice = 0;
    // SAFETY: valid out-pointer.
    check(
        unsafe { sys::cuDeviceGet(&mut d, ordinal as c_int) },
        || format!("CUDA cuDeviceGet for GPU {ordinal}"),
    )?;
    Ok(d)
}

/// One integer attribute of a device.
pub(crate) fn attribute(
    dev: sys::CUdevice,
    attr: sys::CUdevice_attribute,
    ordinal: usize,
) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: valid out-pointer and device.
    check(
        unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) },
        || format!("CUDA cuDeviceGetAttribute({attr:?}) for GPU {ordinal}"),
    )?;
    Ok(v)
}

/// Total memory of a device in bytes (no context needed).
pub(crate) fn total_memory(dev: sys::CUdevice, ordinal: usize) -> Result<u64> {
    let mut bytes: usize = 0;
    // SAFETY: valid out-pointer and device.
    check(unsafe { sys::cuDeviceTotalMem_v2(&mut bytes, dev) }, || {
        format!("CUDA cuDeviceTotalMem for GPU {ordinal}")
    })?;
    Ok(bytes as u64)
}

/// The primary contexts tutti retained, by ordinal.
static CONTEXTS: Mutex<Vec<Option<Arc<Context>>>> = Mutex::new(Vec::new());

/// The primary context of GPU `ordinal`, retained once per process. This creates the context
/// when nothing in the process uses the GPU yet: only for GPUs a process opens.
pub(crate) fn context(ordinal: usize) -> Result<Arc<Context>> {
    let mut all = CONTEXTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(Some(c)) = all.get(ordinal) {
        return Ok(c.clone());
    }
    let dev = device(ordinal)?;
    let mut raw: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer and device.
    check(
        unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, dev) },
        || format!("CUDA cuDevicePrimaryCtxRetain for GPU {ordinal}"),
    )?;
    let c = Arc::new(Context { ordinal, dev, raw });
    if all.len() <= ordinal {
        all.resize(ordinal + 1, None);
    }
    all[ordinal] = Some(c.clone());
    Ok(c)
}

/// A non-blocking stream on one context.
pub(crate) struct Stream {
    pub ctx: Arc<Context>,
    pub raw: sys::CUstream,
}

// SAFETY: stream handles may be used from any thread with their context current.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        let _cur = ctx.enter()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        check(
            unsafe {
                sys::cuStreamCreate(
                    &mut raw,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
                )
            },
            || format!("CUDA cuStreamCreate on GPU {}", ctx.ordinal),
        )?;
        Ok(Stream {
            ctx: ctx.clone(),
            raw,
        })
    }

    /// True once every operation queued on the stream has finished.
    pub fn done(&self) -> Result<bool> {
        let _cur = self.ctx.enter()?;
        // SAFETY: a live stream.
        match unsafe { sys::cuStreamQuery(self.raw) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(r, || format!("CUDA work on GPU {}", self.ctx.ordinal)).map(|_| true),
        }
    }

    /// Make this stream wait for everything queued so far on `other`, through `event`
    /// (recorded on `other`).
    pub fn wait_for(&self, other: &Stream, event: &Event) -> Result<()> {
        if std::ptr::eq(self, other) {
            return Ok(());
        }
        event.record(other)?;
        let _cur = self.ctx.enter()?;
        // SAFETY: live stream and event.
        check(
            unsafe { sys::cuStreamWaitEvent(self.raw, event.raw, 0) },
            || {
                format!(
                    "CUDA cuStreamWaitEvent (GPU {} waiting for GPU {})",
                    self.ctx.ordinal, other.ctx.ordinal
                )
            },
        )
    }

    /// Make this stream wait for `event` (a raw `CUevent` of this stream's context, from
    /// [`Event::raw`]), without blocking the host.
    pub fn wait_event(&self, event: u64) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: a live stream; the event is live while the call that waits on it runs (its
        // owner holds it until the call completes).
        check(
            unsafe { sys::cuStreamWaitEvent(self.raw, event as sys::CUevent, 0) },
            || {
                format!(
                    "CUDA cuStreamWaitEvent (GPU {} waiting for the caller's stream)",
                    self.ctx.ordinal
                )
            },
        )
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let Ok(_cur) = self.ctx.enter() else {
            return log(&format!(
                "could not make GPU {}'s context current to destroy a CUDA stream",
                self.ctx.ordinal
            ));
        };
        // SAFETY: the stream is ours and no longer used.
        let r = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        if r != CUresult::CUDA_SUCCESS {
            log(&format!(
                "cuStreamDestroy on GPU {} failed: {}",
                self.ctx.ordinal,
                describe(r)
            ));
        }
    }
}

/// An event without timing, used to order streams.
pub(crate) struct Event {
    ctx: Arc<Context>,
    raw: sys::CUevent,
}

// SAFETY: event handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(ctx: &Arc<Context>) -> Result<Event> {
        let _cur = ctx.enter()?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        check(
            unsafe {
                sys::cuEventCreate(
                    &mut raw,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint,
                )
            },
            || format!("CUDA cuEventCreate on GPU {}", ctx.ordinal),
        )?;
        Ok(Event {
            ctx: ctx.clone(),
            raw,
        })
    }

    pub fn record(&self, stream: &Stream) -> Result<()> {
        let _cur = stream.ctx.enter()?;
        // SAFETY: live event and stream.
        check(unsafe { sys::cuEventRecord(self.raw, stream.raw) }, || {
            format!("CUDA cuEventRecord on GPU {}", stream.ctx.ordinal)
        })
    }

    /// Record the event on a caller's stream (a `CUstream`, or a `cudaStream_t`: the same
    /// handle) of this event's context: it completes once the work queued there so far has.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream handle, or 0 (the legacy default stream).
    pub unsafe fn record_raw(&self, stream: u64) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: a live event; the stream as the caller promises. A stream of another
        // context is refused by the driver (CUDA_ERROR_INVALID_HANDLE), not undefined.
        check(
            unsafe { sys::cuEventRecord(self.raw, stream as sys::CUstream) },
            || {
                format!(
                    "CUDA cuEventRecord on the stream given for GPU {} (it must belong to the \
                     GPU's primary context, as the CUDA runtime's streams do)",
                    self.ctx.ordinal
                )
            },
        )
    }

    /// The raw handle, for [`Stream::wait_event`].
    pub fn raw(&self) -> u64 {
        self.raw as u64
    }
}

/// Record the event `event` (a raw `CUevent` of `stream`'s context, from [`Event::raw`]) on
/// `stream`: it completes once the work queued there so far has.
pub(crate) fn record_on(event: u64, stream: &Stream) -> Result<()> {
    let _cur = stream.ctx.enter()?;
    // SAFETY: a live stream; the event is live while the call that records it runs (its owner
    // holds it until the call completes).
    check(
        unsafe { sys::cuEventRecord(event as sys::CUevent, stream.raw) },
        || format!("CUDA cuEventRecord on GPU {}", stream.ctx.ordinal),
    )
}

/// Make a caller's stream (a `CUstream` or `cudaStream_t` of `ctx`; 0: the legacy default
/// stream) wait, on the GPU, for the event `event` (a raw `CUevent` of `ctx`).
///
/// # Safety
///
/// `stream` is a live stream of `ctx`, or 0; `event` is a live event of `ctx`.
pub(crate) unsafe fn stream_wait_raw(ctx: &Context, stream: u64, event: u64) -> Result<()> {
    let _cur = ctx.enter()?;
    // SAFETY: as the caller promises.
    check(
        unsafe { sys::cuStreamWaitEvent(stream as sys::CUstream, event as sys::CUevent, 0) },
        || {
            format!(
                "CUDA cuStreamWaitEvent (the stream given for GPU {} waiting for a call)",
                ctx.ordinal
            )
        },
    )
}

/// True once the work before the last record of `event` (a raw `CUevent` of `ctx`) is done,
/// or the event was never recorded.
pub(crate) fn event_done(ctx: &Context, event: u64) -> Result<bool> {
    let _cur = ctx.enter()?;
    // SAFETY: a live event, as its owner holds it while asking.
    match unsafe { sys::cuEventQuery(event as sys::CUevent) } {
        CUresult::CUDA_SUCCESS => Ok(true),
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => check(r, || format!("CUDA work on GPU {}", ctx.ordinal)).map(|_| true),
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let Ok(_cur) = self.ctx.enter() else {
            return log(&format!(
                "could not make GPU {}'s context current to destroy a CUDA event",
                self.ctx.ordinal
            ));
        };
        // SAFETY: the event is ours and no longer used.
        let r = unsafe { sys::cuEventDestroy_v2(self.raw) };
        if r != CUresult::CUDA_SUCCESS {
            log(&format!(
                "cuEventDestroy on GPU {} failed: {}",
                self.ctx.ordinal,
                describe(r)
            ));
        }
    }
}

/// Wait until every stream is idle, or the deadline passes: then `Err(indices of the streams
/// still busy)`. A driver error on any stream is returned as it is.
pub(crate) fn wait_all(
    streams: &[&Stream],
    deadline: Instant,
) -> Result<std::result::Result<(), Vec<usize>>> {
    let mut pending: Vec<usize> = (0..streams.len()).collect();
    let start = Instant::now();
    loop {
        let mut still = Vec::with_capacity(pending.len());
        for &i in &pending {
            if !streams[i].done()? {
                still.push(i);
            }
        }
        if still.is_empty() {
            return Ok(Ok(()));
        }
        pending = still;
        let now = Instant::now();
        if now >= deadline {
            return Ok(Err(pending));
        }
        pause(now - start);
    }
}

/// Back off while polling: spin for the first 50 µs, then yield, then sleep up to 200 µs.
pub(crate) fn pause(waited: Duration) {
    if waited < Duration::from_micros(50) {
        std::hint::spin_loop();
    } else if waited < Duration::from_millis(2) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Allocate `bytes` of device memory on `ctx` (0 bytes: the null pointer).
pub(crate) fn alloc(ctx: &Context, bytes: usize) -> Result<sys::CUdeviceptr> {
    if bytes == 0 {
        return Ok(0);
    }
    let _cur = ctx.enter()?;
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointer; the context is current.
    check(unsafe { sys::cuMemAlloc_v2(&mut p, bytes) }, || {
        format!("CUDA cuMemAlloc of {bytes} bytes on GPU {}", ctx.ordinal)
    })?;
    Ok(p)
}

/// Free device memory from [`alloc`], logging a failure.
pub(crate) fn free(ctx: &Context, p: sys::CUdeviceptr) {
    if p == 0 {
        return;
    }
    let Ok(_cur) = ctx.enter() else {
        return log(&format!(
            "could not make GPU {}'s context current to free device memory; the allocation at \
             {p:#x} is left allocated",
            ctx.ordinal
        ));
    };
    // SAFETY: `p` came from cuMemAlloc on this context and is freed once.
    let r = unsafe { sys::cuMemFree_v2(p) };
    if r != CUresult::CUDA_SUCCESS {
        log(&format!(
            "cuMemFree on GPU {} failed: {}",
            ctx.ordinal,
            describe(r)
        ));
    }
}

/// Queue a copy of `bytes` from `src` (on `src_ctx`) to `dst` (on `dst_ctx`) on `stream`: a
/// device-to-device copy within one GPU, a peer copy between GPUs (direct over NVLink or PCIe
/// where peer access is enabled, staged by the driver otherwise).
pub(crate) fn copy_async(
    dst: sys::CUdeviceptr,
    dst_ctx: &Context,
    src: sys::CUdeviceptr,
    src_ctx: &Context,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    if bytes == 0 || dst == src {
        return Ok(());
    }
    let _cur = stream.ctx.enter()?;
    let r = if dst_ctx.ordinal == src_ctx.ordinal {
        // SAFETY: both ranges lie in live allocations of this context (checked by callers).
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.raw) }
    } else {
        // SAFETY: as above, on their own contexts.
        unsafe { sys::cuMemcpyPeerAsync(dst, dst_ctx.raw, src, src_ctx.raw, bytes, stream.raw) }
    };
    check(r, || {
        format!(
            "CUDA copy of {bytes} bytes from GPU {} to GPU {}",
            src_ctx.ordinal, dst_ctx.ordinal
        )
    })
}

/// Queue a host-to-device copy.
///
/// # Safety
/// `dst` must hold `src.len()` bytes, and `src` must stay alive and unchanged until the stream
/// has finished the copy.
pub(crate) unsafe fn upload_async(
    dst: sys::CUdeviceptr,
    src: &[u8],
    stream: &Stream,
) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    let _cur = stream.ctx.enter()?;
    check(
        sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, src.len(), stream.raw),
        || {
            format!(
                "CUDA copy of {} bytes to GPU {}",
                src.len(),
                stream.ctx.ordinal
            )
        },
    )
}

/// Queue a device-to-host copy.
///
/// # Safety
/// `src` must hold `dst.len()` bytes, and `dst` must stay alive and untouched until the stream
/// has finished the copy.
pub(crate) unsafe fn download_async(
    dst: &mut [u8],
    src: sys::CUdeviceptr,
    stream: &Stream,
) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    let _cur = stream.ctx.enter()?;
    check(
        sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len(), stream.raw),
        || {
            format!(
                "CUDA copy of {} bytes from GPU {}",
                dst.len(),
                stream.ctx.ordinal
            )
        },
    )
}

/// Queue a fill of `bytes` bytes at `dst` with `value`.
pub(crate) fn memset_async(
    dst: sys::CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let _cur = stream.ctx.enter()?;
    // SAFETY: the range lies in a live allocation of the stream's context (checked by callers).
    check(
        unsafe { sys::cuMemsetD8Async(dst, value, bytes, stream.raw) },
        || format!("CUDA memset of {bytes} bytes on GPU {}", stream.ctx.ordinal),
    )
}

/// What `cuCtxEnablePeerAccess` returned means for a pair of GPUs: peer access is on after
/// success or when it was on already; any other result leaves the pair without it.
pub(crate) fn peer_access_enabled(r: CUresult) -> bool {
    matches!(
        r,
        CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    )
}

/// Whether GPU `a` can read GPU `b`'s memory directly, and if so, enable it (once per pair of
/// contexts; already enabled counts as success). `Err(why)` when the driver refuses either
/// step: the pair then has no peer access, and its copies are staged through the host.
pub(crate) fn enable_peer_access(a: &Context, b: &Context) -> std::result::Result<bool, String> {
    let mut can: c_int = 0;
    // SAFETY: valid out-pointer and devices.
    let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.dev, b.dev) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(format!(
            "cuDeviceCanAccessPeer(GPU {}, GPU {}) failed: {}",
            a.ordinal,
            b.ordinal,
            describe(r)
        ));
    }
    if can == 0 {
        return Ok(false);
    }
    let _cur = a.enter().map_err(|e| e.to_string())?;
    // SAFETY: a current context and a live peer context.
    let r = unsafe { sys::cuCtxEnablePeerAccess(b.raw, 0) };
    if peer_access_enabled(r) {
        Ok(true)
    } else {
        Err(format!(
            "cuCtxEnablePeerAccess(GPU {} reading GPU {}) failed: {}",
            a.ordinal,
            b.ordinal,
            describe(r)
        ))
    }
}

/// The physical GPU that holds device address `p` (asked with `ctx` current: the driver's
/// pointer queries need a context).
pub(crate) fn pointer_ordinal(ctx: &Context, p: sys::CUdeviceptr) -> Result<usize> {
    let _cur = ctx.enter()?;
    let mut ordinal: c_int = -1;
    // SAFETY: valid out-pointer of the attribute's type (int).
    check(
        unsafe {
            sys::cuPointerGetAttribute(
                &mut ordinal as *mut c_int as *mut c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                p,
            )
        },
        || format!("CUDA cuPointerGetAttribute(DEVICE_ORDINAL) of address {p:#x}"),
    )?;
    Ok(ordinal.max(0) as usize)
}

/// The base and size of the allocation that holds device address `p`, on `ctx`'s GPU.
pub(crate) fn address_range(
    ctx: &Context,
    p: sys::CUdeviceptr,
) -> Result<(sys::CUdeviceptr, usize)> {
    let _cur = ctx.enter()?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers.
    check(
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, p) },
        || format!("CUDA cuMemGetAddressRange of address {p:#x}"),
    )?;
    Ok((base, size))
}

/// Free and total memory of the GPU whose context is `ctx`.
pub(crate) fn mem_info(ctx: &Context) -> Result<(u64, u64)> {
    let _cur = ctx.enter()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers; the context is current.
    check(
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        || format!("CUDA cuMemGetInfo on GPU {}", ctx.ordinal),
    )?;
    Ok((free as u64, total as u64))
}

/// Free memory of GPU `ordinal` when this process has a context on it already (tutti's, or
/// another library's primary context): reading it then creates nothing. `None` otherwise.
pub(crate) fn free_memory_if_active(dev: sys::CUdevice, ordinal: usize) -> Option<u64> {
    let ours = CONTEXTS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(ordinal)
        .cloned()
        .flatten();
    if let Some(c) = ours {
        return mem_info(&c).ok().map(|(free, _)| free);
    }
    let (mut flags, mut active): (c_uint, c_int) = (0, 0);
    // SAFETY: valid out-pointers and device.
    let r = unsafe { sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) };
    if r != CUresult::CUDA_SUCCESS || active == 0 {
        return None;
    }
    let mut raw: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer and device; the primary context is active, so retaining it
    // creates nothing (the retain is released below).
    if unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, dev) } != CUresult::CUDA_SUCCESS {
        return None;
    }
    let borrowed = Context { ordinal, dev, raw };
    let free = mem_info(&borrowed).ok().map(|(free, _)| free);
    // SAFETY: releases the retain above.
    let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) };
    free
}
