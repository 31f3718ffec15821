//! A view of some ranks of a transport as a transport of their own, so that an algorithm can
//! run among them unchanged (the ring among the leaders of each host, say).

use std::time::Duration;

use super::{CallBuffers, CallHeader, RecvOp, SendOp, Transport};
use crate::error::{Error, Result, Site};

/// `members` (global ranks, this rank among them) of `inner`, renumbered 0..members.len().
pub(crate) struct SubTransport<'a> {
    inner: &'a dyn Transport,
    members: Vec<usize>,
    rank: usize,
}

impl<'a> SubTransport<'a> {
    /// The view, or `None` when this rank is not among `members`.
    pub(crate) fn new(inner: &'a dyn Transport, members: Vec<usize>) -> Option<SubTransport<'a>> {
        let rank = members.iter().position(|&m| m == inner.rank())?;
        Some(SubTransport {
            inner,
            members,
            rank,
        })
    }

    fn global(&self, site: Site, peer: usize) -> Result<usize> {
        self.members
            .get(peer)
            .copied()
            .ok_or_else(|| Error::invalid(site, format!("sub-group rank {peer} out of range")))
    }
}

impl Transport for SubTransport<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    /// The whole group's `begin` already checked the call.
    fn begin(&self, _site: Site, _header: &CallHeader, _buffers: CallBuffers) -> Result<()> {
        Ok(())
    }

    fn exchange(&self, site: Site, sends: &[SendOp<'_>], recvs: &mut [RecvOp<'_>]) -> Result<()> {
        let sends = sends
            .iter()
            .map(|s| {
                Ok(SendOp {
                    peer: self.global(site, s.peer)?,
                    data: s.data,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut mapped = Vec::with_capacity(recvs.len());
        for r in recvs.iter_mut() {
            let peer = self.global(site, r.peer)?;
            mapped.push(RecvOp {
                peer,
                dst: &mut *r.dst,
                mode: r.mode,
            });
        }
        self.inner.exchange(site, &sends, &mut mapped)
    }

    fn end(&self, failed: Option<&Error>) {
        self.inner.end(failed)
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }

    fn aborted(&self) -> Option<String> {
        self.inner.aborted()
    }
}
