//! A value in one device's memory, which collectives reduce where it lies.

use super::DeviceKind;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// A 1-D tensor in one device's memory: host memory for a `cpu:N` rank, a PJRT buffer for an
/// `xla:N` rank (cargo feature `xla`).
///
/// A communicator makes one on its rank's device ([`crate::Communicator::place`]) and runs
/// collectives on it where it lies ([`crate::Communicator::all_reduce_tensor`],
/// [`crate::Communicator::broadcast_tensor`]): on XLA devices the collective is a compiled
/// program over the device buffers, with no copy through host memory, and the tensor holds
/// the program's result afterwards. Reading it back ([`DeviceTensor::to_vec`]) is the one copy
/// to the host.
pub struct DeviceTensor {
    storage: Storage,
    dtype: DType,
    len: usize,
}

/// Where a [`DeviceTensor`]'s elements are.
pub(crate) enum Storage {
    /// Host memory, aligned for every element type.
    Host(Vec<u128>),
    /// A PJRT buffer.
    #[cfg(feature = "xla")]
    Xla(super::pjrt::XlaBuffer),
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.storage {
            Storage::Host(_) => {
                write!(f, "DeviceTensor({} x {} on the host)", self.dtype, self.len)
            }
            #[cfg(feature = "xla")]
            Storage::Xla(b) => write!(
                f,
                "DeviceTensor({} x {} on {})",
                self.dtype,
                self.len,
                b.device_name()
            ),
        }
    }
}

impl DeviceTensor {
    /// A tensor in host memory holding `data`.
    pub fn from_host<T: Element>(data: &[T]) -> DeviceTensor {
        DeviceTensor::from_bytes(T::DTYPE, bytemuck::cast_slice(data))
    }

    /// A tensor in host memory holding `bytes`, whole elements of `dtype`.
    pub(crate) fn from_bytes(dtype: DType, bytes: &[u8]) -> DeviceTensor {
        let mut words = vec![0u128; bytes.len().div_ceil(16)];
        bytemuck::cast_slice_mut::<u128, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        DeviceTensor {
            storage: Storage::Host(words),
            dtype,
            len: bytes.len() / dtype.size(),
        }
    }

    /// `len` zeros of `dtype` in host memory.
    pub(crate) fn zeroed(dtype: DType, len: usize) -> DeviceTensor {
        DeviceTensor {
            storage: Storage::Host(vec![0u128; (len * dtype.size()).div_ceil(16)]),
            dtype,
            len,
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The kind of memory it is in: [`DeviceKind::Cpu`] for host memory.
    pub fn kind(&self) -> DeviceKind {
        match &self.storage {
            Storage::Host(_) => DeviceKind::Cpu,
            #[cfg(feature = "xla")]
            Storage::Xla(_) => DeviceKind::Xla,
        }
    }

    /// The elements, copied to the host; `T` must be its element type.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::config(format!(
                "reading {self:?} as {} elements",
                T::DTYPE
            )));
        }
        match &self.storage {
            Storage::Host(_) => {
                let mut v = vec![T::from_f64(0.0); self.len];
                bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(self.host_bytes());
                Ok(v)
            }
            #[cfg(feature = "xla")]
            Storage::Xla(b) => b.to_vec(),
        }
    }

    /// A copy of it in host memory.
    pub(crate) fn to_host(&self) -> Result<DeviceTensor> {
        match &self.storage {
            Storage::Host(_) => Ok(DeviceTensor::from_bytes(self.dtype, self.host_bytes())),
            #[cfg(feature = "xla")]
            Storage::Xla(b) => {
                let n = self.len * self.dtype.size();
                let mut words = vec![0u128; n.div_ceil(16)];
                b.copy_bytes_to_host(&mut bytemuck::cast_slice_mut::<u128, u8>(&mut words)[..n])?;
                Ok(DeviceTensor {
                    storage: Storage::Host(words),
                    dtype: self.dtype,
                    len: self.len,
                })
            }
        }
    }

    /// The PJRT buffer holding it, if it is on an XLA device.
    #[cfg(feature = "xla")]
    pub fn as_xla(&self) -> Option<&super::pjrt::XlaBuffer> {
        match &self.storage {
            Storage::Xla(b) => Some(b),
            Storage::Host(_) => None,
        }
    }

    /// The PJRT buffer holding it, taken out, if it is on an XLA device (for the caller's own
    /// programs); else the tensor back.
    #[cfg(feature = "xla")]
    pub fn into_xla(self) -> std::result::Result<super::pjrt::XlaBuffer, DeviceTensor> {
        match self.storage {
            Storage::Xla(b) => Ok(b),
            storage => Err(DeviceTensor { storage, ..self }),
        }
    }

    /// Its bytes, for a tensor in host memory (empty otherwise).
    pub(crate) fn host_bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Host(w) => &bytemuck::cast_slice(w)[..self.len * self.dtype.size()],
            #[cfg(feature = "xla")]
            Storage::Xla(_) => &[],
        }
    }

    /// Its bytes, for a tensor in host memory.
    pub(crate) fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        let n = self.len * self.dtype.size();
        match &mut self.storage {
            Storage::Host(w) => Some(&mut bytemuck::cast_slice_mut(w)[..n]),
            #[cfg(feature = "xla")]
            Storage::Xla(_) => None,
        }
    }

    /// Where its elements are.
    #[cfg_attr(not(feature = "xla"), allow(dead_code))]
    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Hold `other`'s elements from now on (a collective's result), dropping its own.
    #[cfg_attr(not(feature = "xla"), allow(dead_code))]
    pub(crate) fn replace(&mut self, other: DeviceTensor) {
        *self = other;
    }
}

#[cfg(feature = "xla")]
impl From<super::pjrt::XlaBuffer> for DeviceTensor {
    /// A tensor storage in `buffer` (on its device).
    fn from(buffer: super::pjrt::XlaBuffer) -> DeviceTensor {
        DeviceTensor {
            dtype: buffer.dtype(),
            len: buffer.len(),
            storage: Storage::Xla(buffer),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_tensors_read_back_what_they_hold() {
        let t = DeviceTensor::from_host(&[1.5f32, -2.0, 3.25]);
        assert_eq!(t.len(), 3);
        assert_eq!(t.dtype(), DType::F32);
        assert_eq!(t.kind(), DeviceKind::Cpu);
        assert_eq!(t.to_vec::<f32>().unwrap(), [1.5, -2.0, 3.25]);
        let e = t.to_vec::<f64>().unwrap_err().to_string();
        assert!(e.contains("as f64"), "{e}");
        let empty = DeviceTensor::from_host::<u8>(&[]);
        assert!(empty.is_empty());
        assert_eq!(empty.to_vec::<u8>().unwrap(), Vec::<u8>::new());
    }
}
