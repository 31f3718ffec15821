//! Shared buffers: host memory allocated through a communicator, which every rank of a process
//! group on one host maps, so that collectives on it read and write peers' buffers in place.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use super::call::{Bytes, BytesMut};
use super::Communicator;
use crate::algorithm::Algorithm;
use crate::device::DeviceKind;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::transport::{shared::RECORD, Transport};

/// Host memory from [`Communicator::alloc_shared`]: zeroed, aligned to 64 bytes, mapped by every
/// rank of the communicator's processes on this host. A collective of 64 KiB or more per rank
/// whose buffers lie in shared buffers on every rank (the input in one allocation, the output
/// in one), with the algorithm `auto` or `direct`, runs `direct` between processes: each rank
/// reduces its slice from every peer's input and writes it into every peer's output, with no
/// copy through shared-memory slots. A reduce is the exception: its ranks off the root have no
/// output, so it runs on the slots.
///
/// Use it as a slice of any element type ([`SharedBuffer::as_mut_slice`], `AsMut<[T]>`), and
/// pass it by value to the non-blocking calls. Dropping it unmaps it on this rank only; calls on
/// the other ranks' buffers of the same allocation then go through the slots. Once a
/// communicator has allocated one, its calls of 64 KiB and more have a check round (about a
/// microsecond), freed or not.
pub struct SharedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

enum Backing {
    /// Threads of one process share memory already.
    Heap(Layout),
    /// A segment every rank of the host maps: the allocation's number.
    Mapped(Arc<dyn Transport>, u64),
}

// SAFETY: the buffer is plain memory owned by this value; the transport is Send + Sync.
unsafe impl Send for SharedBuffer {}
unsafe impl Sync for SharedBuffer {}

impl SharedBuffer {
    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The first byte, writable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The buffer as elements of `T` (a trailing partial element is left out).
    pub fn as_slice<T: Element>(&self) -> &[T] {
        // SAFETY: len bytes of initialized (zeroed) memory, 64-byte aligned, owned by self;
        // every bit pattern is a valid `T`.
        unsafe {
            std::slice::from_raw_parts(
                self.ptr.as_ptr() as *const T,
                self.len / std::mem::size_of::<T>(),
            )
        }
    }

    /// The buffer as mutable elements of `T` (a trailing partial element is left out).
    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, borrowed mutably.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr() as *mut T,
                self.len / std::mem::size_of::<T>(),
            )
        }
    }
}

impl<T: Element> AsRef<[T]> for SharedBuffer {
    fn as_ref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Element> AsMut<[T]> for SharedBuffer {
    fn as_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("len", &self.len)
            .field("mapped", &matches!(self.backing, Backing::Mapped(..)))
            .finish()
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        match &self.backing {
            // SAFETY: allocated in `alloc_shared` with this layout.
            Backing::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) },
            Backing::Mapped(t, id) => t.share_free(*id),
        }
    }
}

impl Communicator {
    /// An all-reduce with `auto`, whatever algorithm the user chose: for the bookkeeping of
    /// tutti's own (agreeing on a result, `tutti perf`'s counts and times), which must not
    /// depend on an algorithm that suits the user's buffers only.
    pub(crate) fn all_reduce_auto<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let call = self.all_reduce_call(
            T::DTYPE,
            None,
            BytesMut::of(bytemuck::cast_slice_mut(buf)),
            op,
        );
        self.blocking(call.with_algorithm(Algorithm::Auto))
    }

    /// A broadcast with `auto` (see [`Communicator::all_reduce_auto`]).
    pub(crate) fn broadcast_auto<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let call = self.broadcast_call(T::DTYPE, BytesMut::of(bytemuck::cast_slice_mut(buf)), root);
        self.blocking(call.with_algorithm(Algorithm::Auto))
    }

    /// The smallest call, in bytes per rank, that runs `direct` on shared buffers (0 where every
    /// call can: threads; `usize::MAX` before the first allocation between processes). Between
    /// processes 64 KiB, or 512 KiB where ranks outnumber the cores of the host.
    pub fn shared_min_bytes(&self) -> usize {
        self.transport().shared_min_bytes()
    }

    /// Whether [`Communicator::alloc_shared`] can map buffers between this communicator's
    /// ranks (threads of one process, or processes all on shared memory of one host).
    pub fn can_share_buffers(&self) -> bool {
        let t = self.transport();
        self.device.0 == DeviceKind::Cpu
            && self.progress.shared().engine.is_none()
            && (t.one_process() || t.all_shared_memory())
    }

    /// Allocate a [`SharedBuffer`] of `bytes` bytes, collectively: every rank calls it, in the
    /// same order as its other calls, with the same size, one allocation at a time. Between processes every peer must be
    /// on shared memory of this host (transport `shm`, or `auto` on one host); within one
    /// process the buffer is plain memory. Errors: `InvalidArgument` naming what is wrong (no
    /// shared memory with some peer, a rank that allocated another size, device ranks),
    /// `System` where a segment could not be created or mapped, or the error of the collectives
    /// that exchange the segments' names.
    pub fn alloc_shared(&self, bytes: usize) -> Result<SharedBuffer> {
        if self.device.0 != DeviceKind::Cpu || self.progress.shared().engine.is_some() {
            return Err(Error::config(format!(
                "rank {} is on {}: shared buffers are host memory of cpu ranks",
                self.rank(),
                self.device_spec()
            )));
        }
        let t = self.transport().clone();
        if t.one_process() {
            let layout = Layout::from_size_align(bytes.max(1), 64)
                .map_err(|e| Error::config(format!("shared buffer of {bytes} bytes: {e}")))?;
            // SAFETY: a non-zero size.
            let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
                .ok_or_else(|| Error::config(format!("out of memory for {bytes} bytes")))?;
            return Ok(SharedBuffer {
                ptr,
                len: bytes,
                backing: Backing::Heap(layout),
            });
        }
        if !t.all_shared_memory() {
            // The same on every rank: all fail here alike.
            return Err(Error::config(
                "shared buffers need every peer on shared memory of this host (transport shm, or auto on one host)",
            ));
        }
        let created = t.share_create(bytes);
        let record = created.as_ref().map_or([0; RECORD], |r| *r);
        let mut records = vec![0u8; RECORD * self.world_size()];
        // The communicator's own calls, whatever algorithm its user chose.
        let gather = self.all_gather_call(
            DType::U8,
            Some(Bytes::of(&record)),
            BytesMut::of(&mut records),
        );
        if let Err(e) = self.blocking(gather.with_algorithm(Algorithm::Auto)) {
            t.share_abandon();
            return Err(e);
        }
        // Called whether this rank's segment was created or not: from here on calls of this
        // communicator have the claim round, on every rank alike.
        let mapped = t.share_map(&records, bytes);
        let mapped = created.and(mapped);
        // Whether every rank mapped every segment; also, once it returns, no rank still needs
        // the names.
        let mut failed = [u8::from(mapped.is_err())];
        let agreed = self.all_reduce_auto(&mut failed, ReduceOp::Max);
        match (mapped, agreed) {
            (Ok((id, ptr)), Ok(())) if failed[0] == 0 => {
                t.share_mapped(id);
                Ok(SharedBuffer {
                    ptr: NonNull::new(ptr).expect("a mapping is not null"),
                    len: bytes,
                    backing: Backing::Mapped(t, id),
                })
            }
            (Ok((id, _)), agreed) => {
                t.share_free(id);
                agreed?;
                Err(Error::config(
                    "shared buffer: another rank could not map every segment (its own error says why)",
                ))
            }
            (Err(e), _) => {
                t.share_abandon();
                Err(e)
            }
        }
    }
}
