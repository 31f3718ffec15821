//! Variables under a strategy.
//!
//! [`MirroredVariable`]: one copy per local replica, kept identical by applying the same
//! aggregated update to every copy; [`DeviceVariable`]: the same, with the copies in the
//! replicas' device memory. [`CentralVariable`]: one copy (CentralStorageStrategy), to
//! which the reduced update is applied once.

use parking_lot::RwLock;

use super::{PerReplica, ReplicaContext, Strategy};
use crate::comm::Combined;
use crate::device::DeviceTensor;
use crate::dtype::kernels;
use crate::dtype::{Apply, Element, ReduceOp};
use crate::error::{Collective, Error, Result};

/// How the replicas' updates of a variable are combined (TensorFlow's `VariableAggregation`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Aggregation {
    /// Sum of every replica's update.
    Sum,
    /// Mean of every replica's update.
    Mean,
    /// The first replica's update (the others' are ignored).
    OnlyFirstReplica,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Update {
    Add,
    Sub,
    Set,
}

impl Update {
    /// The update as the kernels and the engines apply it.
    fn apply(self) -> Apply {
        match self {
            Update::Add => Apply::Add,
            Update::Sub => Apply::Subtract,
            Update::Set => Apply::Assign,
        }
    }
}

fn apply<T: Element>(v: &mut [T], u: &[T], how: Update) -> Result<()> {
    if v.len() != u.len() {
        return Err(Error::config(format!(
            "variable update: the update holds {} elements, the variable {}",
            u.len(),
            v.len()
        )));
    }
    kernels::apply_update(
        T::DTYPE,
        bytemuck::cast_slice_mut(v),
        bytemuck::cast_slice(u),
        how.apply(),
    );
    Ok(())
}

/// A new variable's id, for state kept beside it (an optimizer's slots).
fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A variable with one copy per local replica, kept identical.
pub struct MirroredVariable<T> {
    values: Vec<RwLock<Vec<T>>>,
    /// Which variable this is, for state kept beside it (an optimizer's slots).
    id: u64,
}

impl<T: Element> MirroredVariable<T> {
    pub(crate) fn new(initial: &[T], replicas: usize) -> MirroredVariable<T> {
        MirroredVariable {
            values: (0..replicas)
                .map(|_| RwLock::new(initial.to_vec()))
                .collect(),
            id: next_id(),
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Its copies (one per local replica).
    pub(crate) fn copies(&self) -> usize {
        self.values.len()
    }

    /// Change local replica `replica`'s copy in place.
    pub(crate) fn update_copy<R>(&self, replica: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
        f(&mut self.values[replica].write())
    }

    /// Elements in each copy.
    pub fn len(&self) -> usize {
        self.values[0].read().len()
    }

    /// True for a variable of no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The copy of local replica `replica`.
    pub fn read(&self, replica: usize) -> Vec<T> {
        self.values[replica].read().clone()
    }

    /// The variable's value (every copy holds it).
    pub fn value(&self) -> Vec<T> {
        self.read(0)
    }

    /// The copy of the replica running `ctx` (a variable of one copy, made outside any scope,
    /// reads the same on every replica).
    pub fn read_in(&self, ctx: &ReplicaContext<'_>) -> Vec<T> {
        self.read(ctx.local_replica_id().min(self.values.len() - 1))
    }

    /// The copy the replica running `ctx` updates: an error for a variable made for another
    /// number of replicas (under another strategy).
    pub(crate) fn copy_in(&self, ctx: &ReplicaContext<'_>) -> Result<usize> {
        let (me, n) = (ctx.local_replica_id(), ctx.strategy().num_local_replicas());
        if self.values.len() != n {
            return Err(Error::config(format!(
                "a variable of {} copies updated in a run of {n} local replicas (made under \
                 another strategy's scope, or outside any?)",
                self.values.len()
            )));
        }
        Ok(me)
    }

    /// True when every copy is identical.
    pub fn in_sync(&self) -> bool {
        let first = self.values[0].read();
        self.values.iter().all(|v| *v.read() == *first)
    }

    pub(crate) fn update_in_replica(
        &self,
        ctx: &ReplicaContext<'_>,
        update: &[T],
        agg: Aggregation,
        how: Update,
    ) -> Result<()> {
        let mut u = update.to_vec();
        match agg {
            Aggregation::Sum => ctx.all_reduce(ReduceOp::Sum, &mut u)?,
            Aggregation::Mean => ctx.all_reduce(ReduceOp::Mean, &mut u)?,
            Aggregation::OnlyFirstReplica => ctx.broadcast(&mut u, 0)?,
        }
        apply(&mut self.values[self.copy_in(ctx)?].write(), &u, how)
    }

    /// From outside `run`: aggregate `updates` (one per local replica) and add the result to
    /// every copy.
    pub fn assign_add(
        &self,
        strategy: &Strategy,
        updates: &PerReplica<Vec<T>>,
        agg: Aggregation,
    ) -> Result<()> {
        self.cross_replica(strategy, updates, agg, Update::Add)
    }

    /// From outside `run`: aggregate and subtract.
    pub fn assign_sub(
        &self,
        strategy: &Strategy,
        updates: &PerReplica<Vec<T>>,
        agg: Aggregation,
    ) -> Result<()> {
        self.cross_replica(strategy, updates, agg, Update::Sub)
    }

    /// From outside `run`: aggregate and assign.
    pub fn assign(
        &self,
        strategy: &Strategy,
        values: &PerReplica<Vec<T>>,
        agg: Aggregation,
    ) -> Result<()> {
        self.cross_replica(strategy, values, agg, Update::Set)
    }

    fn cross_replica(
        &self,
        strategy: &Strategy,
        updates: &PerReplica<Vec<T>>,
        agg: Aggregation,
        how: Update,
    ) -> Result<()> {
        if updates.0.len() != self.values.len() {
            return Err(Error::config(format!(
                "mirrored variable: {} updates for {} replicas",
                updates.0.len(),
                self.values.len()
            )));
        }
        if strategy.num_local_replicas() != self.values.len() {
            return Err(Error::config(format!(
                "mirrored variable: {} copies, updated through a strategy of {} local replicas \
                 (made under another strategy's scope, or outside any?)",
                self.values.len(),
                strategy.num_local_replicas()
            )));
        }
        strategy
            .run(|ctx| self.update_in_replica(ctx, &updates.0[ctx.local_replica_id()], agg, how))?;
        Ok(())
    }
}

/// A variable stored once (on the CPU) under CentralStorageStrategy: replicas read it, their
/// updates are reduced onto it and applied once.
pub struct CentralVariable<T> {
    value: RwLock<Vec<T>>,
    /// Which variable this is, for state kept beside it (an optimizer's slots).
    id: u64,
}

impl<T: Element> CentralVariable<T> {
    pub(crate) fn new(initial: &[T]) -> CentralVariable<T> {
        CentralVariable {
            value: RwLock::new(initial.to_vec()),
            id: next_id(),
        }
    }

    /// The value.
    pub fn value(&self) -> Vec<T> {
        self.value.read().clone()
    }

    /// Elements in the variable.
    pub fn len(&self) -> usize {
        self.value.read().len()
    }

    /// True for a variable of no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Change the one copy with `f`.
    pub(crate) fn update_with<R>(&self, f: impl FnOnce(&mut [T]) -> R) -> R {
        f(&mut self.value.write())
    }

    fn update(
        &self,
        strategy: &Strategy,
        updates: &PerReplica<Vec<T>>,
        agg: Aggregation,
        how: Update,
    ) -> Result<()> {
        let u = match agg {
            Aggregation::OnlyFirstReplica => updates.0.first().cloned().unwrap_or_default(),
            Aggregation::Sum | Aggregation::Mean => {
                let op = if agg == Aggregation::Sum {
                    ReduceOp::Sum
                } else {
                    ReduceOp::Mean
                };
                let shape = vec![updates.0.first().map_or(0, |u| u.len())];
                let per = PerReplica(
                    updates
                        .0
                        .iter()
                        .map(|u| super::Tensor {
                            data: u.clone(),
                            shape: shape.clone(),
                        })
                        .collect(),
                );
                strategy.reduce(op, &per, None)?.data
            }
        };
        apply(&mut self.value.write(), &u, how)
    }

    /// Reduce the replicas' `updates` onto the variable and add the result, once.
    pub fn assign_add(
        &self,
        strategy: &Strategy,
        updates: &PerReplica<Vec<T>>,
        agg: Aggregation,
    ) -> Result<()> {
        self.update(strategy, updates, agg, Update::Add)
    }

    /// Reduce and subtract, once.
    pub fn assign_sub(
        &self,
        strategy: &Strategy,
        updates: &PerReplica<Vec<T>>,
        agg: Aggregation,
    ) -> Result<()> {
        self.update(strategy, updates, agg, Update::Sub)
    }

    /// Reduce and assign, once.
    pub fn assign(
        &self,
        strategy: &Strategy,
        values: &PerReplica<Vec<T>>,
        agg: Aggregation,
    ) -> Result<()> {
        self.update(strategy, values, agg, Update::Set)
    }
}

/// A mirrored variable whose copies live in the replicas' device memory: PJRT buffers under
/// `Strategy::tpu` (feature `xla`), host memory for CPU replicas. Made by [`Strategy::device_variable`].
///
/// An update in the replica context ([`DeviceVariable::assign_add_in`] and its kin) takes
/// each replica's update as a tensor on its device ([`ReplicaContext::place`], or the caller's
/// own program's output) and, on XLA devices, combines the updates across the replicas and
/// applies the result to every copy in one compiled program, with no copy through host
/// memory. Reading a copy ([`DeviceVariable::read`]) is the one copy to the host. Across
/// workers, the updates are first combined as [`ReplicaContext::all_reduce_tensor`] does
/// (through local replica 0's host memory).
pub struct DeviceVariable<T> {
    copies: Vec<parking_lot::Mutex<DeviceTensor>>,
    len: usize,
    /// Which variable this is, for state kept beside it (an optimizer's slots).
    id: u64,
    /// How long a copy in use elsewhere is waited for (the strategy's timeout).
    timeout: std::time::Duration,
    _element: std::marker::PhantomData<T>,
}

impl<T: Element> DeviceVariable<T> {
    pub(crate) fn new(
        copies: Vec<DeviceTensor>,
        timeout: std::time::Duration,
    ) -> DeviceVariable<T> {
        DeviceVariable {
            len: copies.first().map_or(0, DeviceTensor::len),
            copies: copies.into_iter().map(parking_lot::Mutex::new).collect(),
            id: next_id(),
            timeout,
            _element: std::marker::PhantomData,
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Its copies (one per local replica).
    pub(crate) fn copies(&self) -> usize {
        self.copies.len()
    }

    /// Local replica `replica`'s copy, waited for at most the strategy's timeout (a
    /// [`DeviceVariable::with_copy`] whose function reads or updates the variable would wait
    /// for itself).
    pub(crate) fn copy(&self, replica: usize) -> Result<parking_lot::MutexGuard<'_, DeviceTensor>> {
        let Some(copy) = self.copies.get(replica) else {
            return Err(Error::config(format!(
                "device variable: no replica {replica} (it has {} copies)",
                self.copies.len()
            )));
        };
        copy.try_lock_for(self.timeout).ok_or_else(|| {
            Error::config(format!(
                "device variable: replica {replica}'s copy stayed in use for {:?} (read or \
                 updated inside with_copy's function, which holds it?)",
                self.timeout
            ))
        })
    }

    /// Elements in each copy.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a variable of no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The copy of local replica `replica`, copied to the host.
    pub fn read(&self, replica: usize) -> Result<Vec<T>> {
        self.copy(replica)?.to_vec()
    }

    /// The variable's value (every copy holds it), copied to the host.
    pub fn value(&self) -> Result<Vec<T>> {
        self.read(0)
    }

    /// True when every copy holds the same elements (each copied to the host to compare).
    pub fn in_sync(&self) -> Result<bool> {
        let first = self.read(0)?;
        for r in 1..self.copies.len() {
            if self.read(r)? != first {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// `f` of the copy of the replica running `ctx`, where it lies (for the caller's own
    /// programs: `DeviceTensor::as_xla` is its PJRT buffer). The copy is held while `f` runs:
    /// `f` must not read or update the variable (that is an error after the timeout).
    pub fn with_copy<R>(
        &self,
        ctx: &ReplicaContext<'_>,
        f: impl FnOnce(&DeviceTensor) -> R,
    ) -> Result<R> {
        let me = self.copy_in(ctx)?;
        Ok(f(&*self.copy(me)?))
    }

    /// The local replica running `ctx`, whose copy it updates; an error for a run of another
    /// strategy's replicas.
    pub(crate) fn copy_in(&self, ctx: &ReplicaContext<'_>) -> Result<usize> {
        let (me, n) = (ctx.local_replica_id(), ctx.strategy().num_local_replicas());
        if self.copies.len() != n {
            return Err(Error::config(format!(
                "a device variable of {} copies updated in a run of {n} local replicas (made \
                 under another strategy)",
                self.copies.len()
            )));
        }
        Ok(me)
    }

    /// In the replica context: every replica's `update` (a tensor on its device) aggregated
    /// as `agg` says, then added to every copy.
    pub fn assign_add_in(
        &self,
        ctx: &ReplicaContext<'_>,
        update: &DeviceTensor,
        agg: Aggregation,
    ) -> Result<()> {
        self.update_in(ctx, update, agg, Update::Add)
    }

    /// As [`DeviceVariable::assign_add_in`], subtracting.
    pub fn assign_sub_in(
        &self,
        ctx: &ReplicaContext<'_>,
        update: &DeviceTensor,
        agg: Aggregation,
    ) -> Result<()> {
        self.update_in(ctx, update, agg, Update::Sub)
    }

    /// In the replica context: every replica's `value` aggregated as `agg` says becomes every
    /// copy.
    pub fn assign_in(
        &self,
        ctx: &ReplicaContext<'_>,
        value: &DeviceTensor,
        agg: Aggregation,
    ) -> Result<()> {
        self.update_in(ctx, value, agg, Update::Set)
    }

    fn update_in(
        &self,
        ctx: &ReplicaContext<'_>,
        update: &DeviceTensor,
        agg: Aggregation,
        how: Update,
    ) -> Result<()> {
        let local = self.copy_in(ctx).and_then(|me| {
            if (update.dtype(), update.len()) != (T::DTYPE, self.len) {
                return Err(Error::config(format!(
                    "device variable of {} x {}: the update is {update:?}",
                    T::DTYPE,
                    self.len
                )));
            }
            self.copy(me)
        });
        let apply = how.apply();
        let custom = match agg {
            Aggregation::Sum => ctx.strategy().custom_ops(ReduceOp::Sum, T::DTYPE),
            Aggregation::Mean => ctx.strategy().custom_ops(ReduceOp::Mean, T::DTYPE),
            Aggregation::OnlyFirstReplica => None,
        };
        if ctx.strategy().workers.is_some() || custom.is_some() {
            // The aggregate across workers, or through the caller's cross-device op (host
            // memory), first, in a tensor of its own: each replica's update goes to the host
            // and back. Every local replica then holds the aggregate; local replica 0's applies.
            let local = local.and_then(|copy| {
                let u = ctx
                    .comm
                    .place_bytes(T::DTYPE, update.to_host()?.host_bytes())?;
                Ok((copy, u))
            });
            let collective = match agg {
                Aggregation::OnlyFirstReplica => Collective::Broadcast,
                _ => Collective::AllReduce,
            };
            let (mut copy, mut u) = ctx.before_workers(collective, local)?;
            match agg {
                Aggregation::Sum => ctx.all_reduce_tensor(ReduceOp::Sum, &mut u)?,
                Aggregation::Mean => ctx.all_reduce_tensor(ReduceOp::Mean, &mut u)?,
                Aggregation::OnlyFirstReplica => ctx.broadcast_tensor(&mut u, 0)?,
            }
            return ctx
                .comm
                .update_tensor(&mut copy, &u, Combined::From(0), apply);
        }
        let mut copy = local?;
        let combine = match agg {
            Aggregation::Sum => Combined::Reduce(ReduceOp::Sum),
            Aggregation::Mean => Combined::Reduce(ReduceOp::Mean),
            Aggregation::OnlyFirstReplica => Combined::From(0),
        };
        ctx.comm.update_tensor(&mut copy, update, combine, apply)
    }

    /// From outside `run`: the replicas' `updates` (host values, each placed on its replica's
    /// device) aggregated and added to every copy.
    pub fn assign_add(
        &self,
        strategy: &Strategy,
        updates: &PerReplica<Vec<T>>,
        agg: Aggregation,
    ) -> Result<()> {
        self.cross_replica(strategy, updates, agg, Update::Add)
    }

    /// From outside `run`: aggregate and subtract.
    pub fn assign_sub(
        &self,
        strategy: &Strategy,
        updates: &PerReplica<Vec<T>>,
        agg: Aggregation,
    ) -> Result<()> {
        self.cross_replica(strategy, updates, agg, Update::Sub)
    }

    /// From outside `run`: aggregate and assign.
    pub fn assign(
        &self,
        strategy: &Strategy,
        values: &PerReplica<Vec<T>>,
        agg: Aggregation,
    ) -> Result<()> {
        self.cross_replica(strategy, values, agg, Update::Set)
    }

    fn cross_replica(
        &self,
        strategy: &Strategy,
        updates: &PerReplica<Vec<T>>,
        agg: Aggregation,
        how: Update,
    ) -> Result<()> {
        let n = strategy.num_local_replicas();
        if updates.0.len() != n || self.copies.len() != n {
            return Err(Error::config(format!(
                "device variable of {} copies: {} updates through a strategy of {n} local \
                 replicas; they must be equal",
                self.copies.len(),
                updates.0.len()
            )));
        }
        strategy.run(|ctx| {
            let u = ctx.place(&updates.0[ctx.local_replica_id()])?;
            self.update_in(ctx, &u, agg, how)
        })?;
        Ok(())
    }
}
