//! Collectives on tensors in the ranks' device memory ([`DeviceTensor`]).

use super::{Bytes, BytesMut, Call, Communicator};
use crate::device::DeviceTensor;
use crate::dtype::{Apply, DType, Element, ReduceOp};
use crate::error::{Collective, Result};
#[cfg(feature = "xla")]
use crate::transport::Held;

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

    /// Why this rank cannot run a collective on `tensors` where they lie, if it cannot (a
    /// tensor on another device or client, or in host memory on a rank whose tensors are on
    /// its device): the call's argument error, which every rank sees before anything moves.
    fn tensor_refused(&self, tensors: &[&DeviceTensor]) -> Option<String> {
        let shared = self.progress.shared();
        let engine = shared.engine.as_ref().filter(|e| !e.per_rank())?;
        tensors
            .iter()
            .find_map(|t| engine.check_tensor(self.rank(), t).err())
    }

    /// `call`, made this rank's argument error where `refused` says why.
    fn refused(mut call: Call, refused: Option<String>) -> Call {
        if let (Ok(()), Some(why)) = (&call.check, refused) {
            call.check = Err(why);
        }
        call
    }

    /// All-reduce `t` in place, where it lies: on XLA devices one compiled program over every
    /// rank's device buffer, with no copy through host memory (every rank of the group passes
    /// a tensor on its device, made by [`Communicator::place`]); in host memory the
    /// communicator's own algorithms. The checks, timeout and errors are those of
    /// [`Communicator::all_reduce`].
    pub fn all_reduce_tensor(&self, t: &mut DeviceTensor, op: ReduceOp) -> Result<()> {
        let dtype = t.dtype();
        let refused = self.tensor_refused(&[t]);
        let call = match t.host_bytes_mut() {
            Some(bytes) => self.all_reduce_call(dtype, None, BytesMut::of(bytes), op),
            None => self.tensor_call(Collective::AllReduce, t, None, op, 0),
        };
        self.blocking(Self::refused(call, refused))
    }

    /// All-gather where the tensors lie: every rank's `t` becomes every rank's tensor
    /// concatenated in rank order (world size times as long), as
    /// [`Communicator::all_reduce_tensor`] runs.
    pub fn all_gather_tensor(&self, t: &mut DeviceTensor) -> Result<()> {
        let dtype = t.dtype();
        let refused = self.tensor_refused(&[t]);
        let Some(bytes) = t.host_bytes_mut() else {
            let call = self.tensor_call(Collective::AllGather, t, None, ReduceOp::Sum, 0);
            return self.blocking(Self::refused(call, refused));
        };
        // A tensor in memory times the world: the output's length fits unless the world is
        // absurd, which the call's own check then names.
        let gathered = (bytes.len() / dtype.size()).saturating_mul(self.world_size());
        let fits = gathered
            .checked_mul(dtype.size())
            .is_some_and(|b| b <= isize::MAX as usize);
        let mut out = DeviceTensor::zeroed(dtype, if fits { gathered } else { 0 });
        let output = out.host_bytes_mut().unwrap_or_default();
        let call = self.all_gather_call(dtype, Some(Bytes::of(bytes)), BytesMut::of(output));
        self.blocking(Self::refused(call, refused))?;
        *t = out;
        Ok(())
    }

    /// Broadcast rank `root`'s `t` into every rank's, where they lie (as
    /// [`Communicator::all_reduce_tensor`]).
    pub fn broadcast_tensor(&self, t: &mut DeviceTensor, root: usize) -> Result<()> {
        let dtype = t.dtype();
        let refused = self.tensor_refused(&[t]);
        let call = match t.host_bytes_mut() {
            Some(bytes) => self.broadcast_call(dtype, BytesMut::of(bytes), root),
            None => self.tensor_call(Collective::Broadcast, t, None, ReduceOp::Sum, root),
        };
        self.blocking(Self::refused(call, refused))
    }

    /// An optimizer's step of this rank's copy (in `args`) fused with the gradients' sum, on
    /// XLA devices: every rank's `grad` summed, in place, and each rank's copy and the rule's
    /// state stepped by the sum, in one program over every rank's device (see
    /// `engine::pjrt::StepArgs`). The checks, timeout and errors are those of
    /// [`Communicator::all_reduce_tensor`].
    #[cfg(feature = "xla")]
    pub(crate) fn step_tensor(
        &self,
        grad: &mut DeviceTensor,
        args: &mut crate::engine::pjrt::StepArgs<'_>,
    ) -> Result<()> {
        let refused = self.tensor_refused(&[grad, &*args.copy]);
        let call = self.tensor_call(Collective::AllReduce, grad, None, ReduceOp::Sum, 0);
        let runs = self
            .progress
            .shared()
            .engine
            .as_ref()
            .is_some_and(|e| !e.per_rank() && e.runs_held(Collective::AllReduce, Held::Step));
        let refused = refused.or_else(|| {
            (!runs).then(|| {
                format!(
                    "rank {} is on {}, which does not fuse an optimizer's step with the \
                     gradients' sum",
                    self.rank(),
                    self.device_spec()
                )
            })
        });
        let args = (args as *mut crate::engine::pjrt::StepArgs<'_>).cast::<u8>();
        self.blocking(Self::refused(
            call.holding(args.cast_const(), Held::Step),
            refused,
        ))
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
        let refused = self.tensor_refused(&[copy, update]);
        if copy.host_bytes_mut().is_none() {
            let call = self.tensor_call(collective, copy, Some((update, apply)), op, root);
            return self.blocking(Self::refused(call, refused));
        }
        let dtype = copy.dtype();
        let mismatch = (update.dtype(), update.len()) != (dtype, copy.len());
        let refused = refused.or_else(|| {
            mismatch.then(|| {
                format!(
                    "the update {update:?} does not match the variable's copy {copy:?}; they \
                     must have one dtype and length"
                )
            })
        });
        let mut u = update.to_host()?;
        let bytes = u.host_bytes_mut().unwrap_or_default();
        let call = match combine {
            Combined::Reduce(op) => self.all_reduce_call(dtype, None, BytesMut::of(bytes), op),
            Combined::From(root) => self.broadcast_call(dtype, BytesMut::of(bytes), root),
        };
        self.blocking(Self::refused(call, refused))?;
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
