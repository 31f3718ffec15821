//! A view of some ranks of a transport as a transport of their own, so that an algorithm can
//! run among them unchanged (the ring among the leaders of each host, say).

use std::time::Duration;

use super::{CallBuffers, CallHeader, RecvOp, SendOp, Transport};
use crate::error::{Error, Result, Site};

/// `members` (global ranks, this rank among them) of `inner`, renumbered 0..members.len().
pub(crate) struct SubTransport<'a> {
    inner: &'a dyn Transport,
    members: &'a [usize],
    rank: usize,
}

/// Sends of one exchange renumbered on the stack up to this many (a ring step sends one).
const INLINE_SENDS: usize = 4;

impl<'a> SubTransport<'a> {
    /// The view, or `None` when this rank is not among `members`.
    pub(crate) fn new(inner: &'a dyn Transport, members: &'a [usize]) -> Option<SubTransport<'a>> {
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

    /// The sends are renumbered into a small array and the receives in place (and back), so a
    /// step of a repeated call allocates nothing.
    fn exchange(&self, site: Site, sends: &[SendOp<'_>], recvs: &mut [RecvOp<'_>]) -> Result<()> {
        for peer in sends
            .iter()
            .map(|s| s.peer)
            .chain(recvs.iter().map(|r| r.peer))
        {
            self.global(site, peer)?;
        }
        let global = |peer: usize| self.members[peer];
        for r in recvs.iter_mut() {
            r.peer = global(r.peer);
        }
        let result = if sends.len() <= INLINE_SENDS {
            let mut inline: [SendOp<'_>; INLINE_SENDS] =
                std::array::from_fn(|_| SendOp { peer: 0, data: &[] });
            for (to, s) in inline.iter_mut().zip(sends) {
                *to = SendOp {
                    peer: global(s.peer),
                    data: s.data,
                };
            }
            self.inner.exchange(site, &inline[..sends.len()], recvs)
        } else {
            let mapped: Vec<SendOp<'_>> = sends
                .iter()
                .map(|s| SendOp {
                    peer: global(s.peer),
                    data: s.data,
                })
                .collect();
            self.inner.exchange(site, &mapped, recvs)
        };
        for r in recvs.iter_mut() {
            r.peer = self
                .members
                .iter()
                .position(|&m| m == r.peer)
                .unwrap_or(r.peer);
        }
        result
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
