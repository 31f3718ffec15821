//! What a communicator's calls keep from one call to the next, so that a repeated call allocates
//! nothing: scratch buffers, and the lists an algorithm builds per step (peers' buffers, the
//! sources of a reduction, sends and receives). The first call of a shape grows them; later
//! calls of that shape or smaller reuse them. A communicator runs one call at a time and hands
//! its plan to the running call, so nothing here is locked.

use std::cell::{Cell, RefCell};
use std::ops::{Deref, DerefMut};

use crate::reuse::recycle;
use crate::transport::{CallBuffers, RecvOp, SendOp};

/// Scratch buffers larger than this are freed when their call is done rather than kept: a
/// single huge call must not hold its memory for the communicator's life (calls that large spend
/// far longer moving bytes than allocating).
const KEEP_SCRATCH: usize = 4 << 20;

/// The reusable parts of a communicator's calls (see the module documentation), owned by the
/// running call.
#[derive(Default)]
pub(crate) struct Plan(RefCell<Parts>, Cell<Option<&'static str>>);

#[derive(Default)]
pub(crate) struct Parts {
    /// Scratch buffers, lent best fit first.
    bytes: Vec<Vec<u64>>,
    srcs: Vec<&'static [u8]>,
    sends: Vec<SendOp<'static>>,
    recvs: Vec<RecvOp<'static>>,
    bufs: Vec<CallBuffers>,
    ranks: Vec<usize>,
}

/// A list type that a plan keeps between calls.
pub(crate) trait Listed: Sized {
    /// The same type with its lifetimes `'static`, as the plan stores it (empty).
    type Stored;
    fn slot(plan: &mut Parts) -> &mut Vec<Self::Stored>;
}

impl Listed for &[u8] {
    type Stored = &'static [u8];
    fn slot(plan: &mut Parts) -> &mut Vec<&'static [u8]> {
        &mut plan.srcs
    }
}

impl Listed for SendOp<'_> {
    type Stored = SendOp<'static>;
    fn slot(plan: &mut Parts) -> &mut Vec<SendOp<'static>> {
        &mut plan.sends
    }
}

impl Listed for RecvOp<'_> {
    type Stored = RecvOp<'static>;
    fn slot(plan: &mut Parts) -> &mut Vec<RecvOp<'static>> {
        &mut plan.recvs
    }
}

impl Listed for CallBuffers {
    type Stored = CallBuffers;
    fn slot(plan: &mut Parts) -> &mut Vec<CallBuffers> {
        &mut plan.bufs
    }
}

impl Listed for usize {
    type Stored = usize;
    fn slot(plan: &mut Parts) -> &mut Vec<usize> {
        &mut plan.ranks
    }
}

impl Plan {
    /// Record what the running call runs as (the algorithm `auto` became, or the path a named
    /// algorithm takes), once: the first note of a call stands, so that the steps an algorithm
    /// runs through another (the ring among hosts' leaders) do not replace it.
    pub(crate) fn note(&self, ran: &'static str) {
        if self.1.get().is_none() {
            self.1.set(Some(ran));
        }
    }

    /// What the call noted, cleared for the next.
    pub(crate) fn take_ran(&self) -> Option<&'static str> {
        self.1.take()
    }

    /// An empty list of `T` with the capacity an earlier call left; handed back when dropped.
    pub(crate) fn list<T: Listed>(&self) -> List<'_, T> {
        let v = std::mem::take(T::slot(&mut self.0.borrow_mut()));
        List {
            plan: self,
            v: recycle(v),
        }
    }

    /// `len` bytes of scratch (contents unspecified), 8-byte aligned; handed back when dropped.
    pub(crate) fn scratch(&self, len: usize) -> Scratch<'_> {
        let words = len.div_ceil(8);
        // The smallest buffer that is large enough, else the largest (grown): calls of one
        // shape come to find the buffers they need.
        let mut v = {
            let bytes = &mut self.0.borrow_mut().bytes;
            let fit = (0..bytes.len())
                .filter(|&i| bytes[i].len() >= words)
                .min_by_key(|&i| bytes[i].len())
                .or_else(|| (0..bytes.len()).max_by_key(|&i| bytes[i].len()));
            fit.map(|i| bytes.swap_remove(i)).unwrap_or_default()
        };
        if v.len() < words {
            v.resize(words, 0);
        }
        Scratch { plan: self, v, len }
    }
}

/// A list lent by a [`Plan`].
pub(crate) struct List<'l, T: Listed> {
    plan: &'l Plan,
    v: Vec<T>,
}

impl<T: Listed> Deref for List<'_, T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.v
    }
}

impl<T: Listed> DerefMut for List<'_, T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.v
    }
}

impl<T: Listed> Drop for List<'_, T> {
    fn drop(&mut self) {
        let v = recycle(std::mem::take(&mut self.v));
        let mut plan = self.plan.0.borrow_mut();
        let slot = T::slot(&mut plan);
        // Two lists of one type lent at once: keep the larger allocation.
        if v.capacity() >= slot.capacity() {
            *slot = v;
        }
    }
}

/// Scratch bytes lent by a [`Plan`].
pub(crate) struct Scratch<'l> {
    plan: &'l Plan,
    v: Vec<u64>,
    len: usize,
}

impl Deref for Scratch<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.v)[..self.len]
    }
}

impl DerefMut for Scratch<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.v)[..self.len]
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.v);
        if v.capacity() > 0 && v.capacity() * 8 <= KEEP_SCRATCH {
            self.plan.0.borrow_mut().bytes.push(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_scratch_come_back_with_their_capacity() {
        let plan = Plan::default();
        {
            let lent = &plan;
            let data = [1u8, 2, 3];
            let mut l = lent.list::<&[u8]>();
            l.extend([&data[..], &data[1..]]);
            assert_eq!(l.len(), 2);
            let mut s = lent.scratch(13);
            s.fill(7);
            assert_eq!(s.len(), 13);
        }
        {
            let parts = plan.0.borrow();
            assert!(parts.srcs.is_empty() && parts.srcs.capacity() >= 2);
            assert_eq!(parts.bytes.len(), 1);
        }
        let lent = &plan;
        assert!(lent.list::<&[u8]>().capacity() >= 2);
        let (a, b) = (lent.scratch(16), lent.scratch(4));
        assert_eq!((a.len(), b.len()), (16, 4));
    }
}
