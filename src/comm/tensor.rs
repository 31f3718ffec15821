//! Collectives on tensors in the ranks' device memory ([`DeviceTensor`]).

use super::Communicator;
use crate::device::DeviceTensor;
use crate::dtype::{Apply, DType, Element, ReduceOp};
use crate::error::{Collective, Result};

impl Communicator {
    /// A tensor holding `data` in this rank's device memory: a PJRT buffer on an `xla:N` rank
    /// of a device group, host memory elsewhere. The collectives on tensors
    /// ([`Communicator::all_reduce_tensor`], [`Communicator::broadcast_tensor`]) run on it
    /// where it lies.
    pub fn place<T: Element>(&self, data: &[T]) -> Result<DeviceTensor> {
        self.place_bytes(T::DTYPE, bytemuck::cast_slice(data))
    }

    /// [`Communicator::place`] of `bytes`, whole elements of `dtype`.
    pub(crate) fn place_bytes(&self, dtype: DType, bytes: &[u8]) -> Result<DeviceTensor> {
        match &self.progress.shared().engine {
            Some(engine) if !engine.per_rank() => engine.place(self.rank(), dtype, bytes),
            _ => Ok(DeviceTensor::from_bytes(dtype, bytes)),
        }
    }

    /// All-reduce `t` in place, where it lies: on XLA devices one compiled program over every
    /// rank's device buffer, with no copy through host memory (every rank of the group passes
    /// a tensor on its device); in host memory the communicator's own algorithms. The checks,
    /// timeout and errors are those of [`Communicator::all_reduce`].
    pub fn all_reduce_tensor(&self, t: &mut DeviceTensor, op: ReduceOp) -> Result<()> {
        let dtype = t.dtype();
        if let Some(bytes) = t.host_bytes_mut() {
            return self.all_reduce_raw(dtype, None, bytes, op);
        }
        self.blocking(self.tensor_call(Collective::AllReduce, t, None, op, 0))
    }

    /// All-gather where the tensors lie: every rank's `t` becomes every rank's tensor
    /// concatenated in rank order (world size times as long), as
    /// [`Communicator::all_reduce_tensor`] runs.
    pub fn all_gather_tensor(&self, t: &mut DeviceTensor) -> Result<()> {
        let dtype = t.dtype();
        let gathered = t.len().saturating_mul(self.world_size());
        if gathered
            .checked_mul(dtype.size())
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(crate::Error::config(format!(
                "all_gather of {t:?} over {} ranks: more bytes than a buffer can hold",
                self.world_size()
            )));
        }
        if let Some(bytes) = t.host_bytes_mut() {
            let mut out = DeviceTensor::zeroed(dtype, gathered);
            let output = out.host_bytes_mut().unwrap_or_default();
            self.all_gather_raw(dtype, Some(bytes), output)?;
            *t = out;
            return Ok(());
        }
        self.blocking(self.tensor_call(Collective::AllGather, t, None, ReduceOp::Sum, 0))
    }

    /// Broadcast rank `root`'s `t` into every rank's, where they lie (as
    /// [`Communicator::all_reduce_tensor`]).
    pub fn broadcast_tensor(&self, t: &mut DeviceTensor, root: usize) -> Result<()> {
        let dtype = t.dtype();
        if let Some(bytes) = t.host_bytes_mut() {
            return self.broadcast_raw(dtype, bytes, root);
        }
        self.blocking(self.tensor_call(Collective::Broadcast, t, None, ReduceOp::Sum, root))
    }

    /// A variable's update on this rank's copy `copy`: every rank's `update` combined as
    /// `combine` says, then applied to the copy as `apply` says. On XLA devices one compiled
    /// program does both where the tensors lie; in host memory the update is combined in a
    /// copy, then applied.
    pub(crate) fn update_tensor(
        &self,
        copy: &mut DeviceTensor,
        update: &DeviceTensor,
        combine: Combined,
        apply: Apply,
    ) -> Result<()> {
        let (collective, op, root) = match combine {
            Combined::Reduce(op) => (Collective::AllReduce, op, 0),
            Combined::From(root) => (Collective::Broadcast, ReduceOp::Sum, root),
        };
        if copy.host_bytes_mut().is_none() {
            let call = self.tensor_call(collective, copy, Some((update, apply)), op, root);
            return self.blocking(call);
        }
        let dtype = copy.dtype();
        let mut u = update.to_host()?;
        let bytes = u.host_bytes_mut().unwrap_or_default();
        match combine {
            Combined::Reduce(op) => self.all_reduce_raw(dtype, None, bytes, op)?,
            Combined::From(root) => self.broadcast_raw(dtype, bytes, root)?,
        }
        if (u.dtype(), u.len()) != (dtype, copy.len()) {
            return Err(crate::Error::config(format!(
                "the update {u:?} does not match the variable's copy {copy:?}; they must have one \
                 dtype and length"
            )));
        }
        let var = copy.host_bytes_mut().unwrap_or_default();
        crate::dtype::kernels::apply_update(dtype, var, u.host_bytes(), apply);
        Ok(())
    }
}

/// How [`Communicator::update_tensor`] combines the ranks' updates.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Combined {
    /// An all-reduce with this op.
    Reduce(ReduceOp),
    /// Rank `root`'s update, broadcast.
    From(usize),
}
