//! Device memory: [`GpuBuffer`] (an owned, typed allocation on one logical GPU), its views
//! ([`GpuSlice`], [`GpuSliceMut`]), and [`DevicePtr`], the untyped form carriers such as the C ABI
//! use (a device address tagged with the logical GPU it belongs to).
//!
//! Host copies are queued on the logical GPU's stream and waited for with its timeout.

use std::marker::PhantomData;
use std::ops::Range;

use super::discovery::GpuDevice;
use super::driver;
use crate::dtype::Element;
use crate::error::{Error, Result};

/// A device address tagged with its logical GPU: the group's device index and the address.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(C)]
pub struct DevicePtr {
    /// The logical GPU (index among a group's devices) the memory belongs to.
    pub device: usize,
    /// The device address (`CUdeviceptr`).
    pub ptr: u64,
}

/// `len` elements of `T` on one logical GPU.
pub struct GpuBuffer<T: Element> {
    dev: GpuDevice,
    ptr: u64,
    len: usize,
    _t: PhantomData<T>,
}

// SAFETY: the buffer owns device memory; its address may be used from any thread.
unsafe impl<T: Element> Send for GpuBuffer<T> {}
// SAFETY: shared access only reads through the driver.
unsafe impl<T: Element> Sync for GpuBuffer<T> {}

impl<T: Element> std::fmt::Debug for GpuBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuBuffer<{}>[{}] on {} at {:#x}",
            T::DTYPE,
            self.len,
            self.dev.describe(),
            self.ptr
        )
    }
}

impl<T: Element> GpuBuffer<T> {
    /// `len` zeroed elements on `dev`, counted against its memory limit.
    pub fn zeros(dev: &GpuDevice, len: usize) -> Result<GpuBuffer<T>> {
        let bytes = len.checked_mul(T::DTYPE.size()).ok_or_else(|| {
            Error::config(format!(
                "GpuBuffer: {len} elements of {} overflow",
                T::DTYPE
            ))
        })?;
        let inner = &dev.inner;
        inner.reserve(bytes as u64)?;
        let ptr = match driver::alloc(&inner.ctx, bytes) {
            Ok(p) => p,
            Err(e) => {
                inner.release(bytes as u64);
                return Err(e);
            }
        };
        let buf = GpuBuffer {
            dev: dev.clone(),
            ptr,
            len,
            _t: PhantomData,
        };
        driver::memset_async(ptr, 0, bytes, &inner.stream)?;
        inner.sync(inner.timeout, "zero a new buffer")?;
        Ok(buf)
    }

    /// A copy of `data` on `dev`.
    pub fn from_host(dev: &GpuDevice, data: &[T]) -> Result<GpuBuffer<T>> {
        let mut b = GpuBuffer::zeros(dev, data.len())?;
        b.copy_from_host(data)?;
        Ok(b)
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The logical GPU it lives on.
    pub fn device(&self) -> &GpuDevice {
        &self.dev
    }

    /// The device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The tagged address, for a group whose device `index` this buffer's GPU is.
    pub fn tagged(&self, index: usize) -> DevicePtr {
        DevicePtr {
            device: index,
            ptr: self.ptr,
        }
    }

    /// Overwrite the buffer with `data` (the same length).
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<()> {
        self.view_mut().copy_from_host(data)
    }

    /// Copy the buffer into `out` (the same length).
    pub fn copy_to_host(&self, out: &mut [T]) -> Result<()> {
        self.view().copy_to_host(out)
    }

    /// The buffer's elements, copied to the host.
    pub fn to_host(&self) -> Result<Vec<T>> {
        let mut v = vec![T::from_f64(0.0); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// All of it, as a view.
    pub fn view(&self) -> GpuSlice<'_, T> {
        GpuSlice {
            buf: self,
            range: 0..self.len,
        }
    }

    /// All of it, as a mutable view.
    pub fn view_mut(&mut self) -> GpuSliceMut<'_, T> {
        let range = 0..self.len;
        GpuSliceMut { buf: self, range }
    }

    /// Elements `range`, as a view.
    pub fn slice(&self, range: Range<usize>) -> Result<GpuSlice<'_, T>> {
        check_range(&range, self.len)?;
        Ok(GpuSlice { buf: self, range })
    }

    /// Elements `range`, as a mutable view.
    pub fn slice_mut(&mut self, range: Range<usize>) -> Result<GpuSliceMut<'_, T>> {
        check_range(&range, self.len)?;
        Ok(GpuSliceMut { buf: self, range })
    }
}

impl<T: Element> Drop for GpuBuffer<T> {
    fn drop(&mut self) {
        let inner = &self.dev.inner;
        let bytes = (self.len * T::DTYPE.size()) as u64;
        if self.ptr == 0 {
            inner.release(bytes);
            return;
        }
        // Work queued on the buffer must finish before its memory goes back. After a timeout
        // on the device this does not wait again: memory a stuck stream may still use is
        // leaked (and stays counted against the device's limit) rather than freed under it.
        if inner.idle_before_free("freeing a GPU buffer") {
            driver::free(&inner.ctx, self.ptr);
            inner.release(bytes);
        } else {
            driver::log(&format!(
                "freeing a GPU buffer: {} is still busy after a timeout; its {bytes} bytes at \
                 {:#x} are left allocated",
                self.dev.describe(),
                self.ptr
            ));
        }
    }
}

fn check_range(r: &Range<usize>, len: usize) -> Result<()> {
    if r.start > r.end || r.end > len {
        return Err(Error::config(format!(
            "GPU buffer view {}..{} is out of range for a buffer of {len} elements",
            r.start, r.end
        )));
    }
    Ok(())
}

/// A view of elements of a [`GpuBuffer`].
#[derive(Clone)]
pub struct GpuSlice<'a, T: Element> {
    buf: &'a GpuBuffer<T>,
    range: Range<usize>,
}

/// A mutable view of elements of a [`GpuBuffer`].
pub struct GpuSliceMut<'a, T: Element> {
    buf: &'a mut GpuBuffer<T>,
    range: Range<usize>,
}

/// Where a run of device elements lives, without its type: what the collectives work on. Named
/// by the sealed buffer trait only, so no user can build one.
#[doc(hidden)]
#[allow(unnameable_types)]
#[derive(Clone, Debug)]
pub struct Region {
    pub(crate) dev: GpuDevice,
    pub(crate) ptr: u64,
    pub(crate) len: usize,
}

fn region<T: Element>(buf: &GpuBuffer<T>, range: &Range<usize>) -> Region {
    Region {
        dev: buf.dev.clone(),
        ptr: buf.ptr + (range.start * T::DTYPE.size()) as u64,
        len: range.len(),
    }
}

fn upload<T: Element>(r: &Region, data: &[T]) -> Result<()> {
    if data.len() != r.len {
        return Err(Error::config(format!(
            "copy to {}: {} host elements for {} device elements",
            r.dev.describe(),
            data.len(),
            r.len
        )));
    }
    let inner = &r.dev.inner;
    // SAFETY: the region lies in a live allocation; `data` outlives the wait below.
    let queued = unsafe { driver::upload_async(r.ptr, bytemuck::cast_slice(data), &inner.stream) };
    // Wait even when queueing failed part-way, so `data` is not read after we return.
    let waited = inner.sync(inner.timeout, "copy from the host");
    queued.and(waited)
}

fn download<T: Element>(r: &Region, out: &mut [T]) -> Result<()> {
    if out.len() != r.len {
        return Err(Error::config(format!(
            "copy from {}: {} host elements for {} device elements",
            r.dev.describe(),
            out.len(),
            r.len
        )));
    }
    let inner = &r.dev.inner;
    // SAFETY: the region lies in a live allocation; `out` outlives the wait below.
    let queued =
        unsafe { driver::download_async(bytemuck::cast_slice_mut(out), r.ptr, &inner.stream) };
    let waited = inner.sync(inner.timeout, "copy to the host");
    queued.and(waited)
}

impl<T: Element> GpuSlice<'_, T> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.range.len()
    }
    /// True when the view is empty.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
    /// The device address of the view's first element.
    pub fn device_ptr(&self) -> u64 {
        region(self.buf, &self.range).ptr
    }
    /// Copy the view into `out` (the same length).
    pub fn copy_to_host(&self, out: &mut [T]) -> Result<()> {
        download(&region(self.buf, &self.range), out)
    }
}

impl<T: Element> GpuSliceMut<'_, T> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.range.len()
    }
    /// True when the view is empty.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
    /// The device address of the view's first element.
    pub fn device_ptr(&self) -> u64 {
        region(self.buf, &self.range).ptr
    }
    /// Overwrite the view with `data` (the same length).
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<()> {
        upload(&region(self.buf, &self.range), data)
    }
    /// Copy the view into `out` (the same length).
    pub fn copy_to_host(&self, out: &mut [T]) -> Result<()> {
        download(&region(self.buf, &self.range), out)
    }
}

/// Device elements a collective reads: a [`GpuBuffer`] or a view of one (or a reference to
/// either).
pub trait DeviceRef<T: Element> {
    /// Where the elements are.
    #[doc(hidden)]
    fn region(&self) -> Region;
}

/// Device elements a collective writes: a mutably borrowed [`GpuBuffer`] or [`GpuSliceMut`].
pub trait DeviceMut<T: Element>: DeviceRef<T> {}

impl<T: Element> DeviceRef<T> for GpuBuffer<T> {
    fn region(&self) -> Region {
        region(self, &(0..self.len))
    }
}
impl<T: Element> DeviceRef<T> for &GpuBuffer<T> {
    fn region(&self) -> Region {
        region(self, &(0..self.len))
    }
}
impl<T: Element> DeviceRef<T> for &mut GpuBuffer<T> {
    fn region(&self) -> Region {
        region(self, &(0..self.len))
    }
}
impl<T: Element> DeviceRef<T> for GpuSlice<'_, T> {
    fn region(&self) -> Region {
        region(self.buf, &self.range)
    }
}
impl<T: Element> DeviceRef<T> for GpuSliceMut<'_, T> {
    fn region(&self) -> Region {
        region(self.buf, &self.range)
    }
}
impl<T: Element> DeviceMut<T> for GpuBuffer<T> {}
impl<T: Element> DeviceMut<T> for &mut GpuBuffer<T> {}
impl<T: Element> DeviceMut<T> for GpuSliceMut<'_, T> {}
