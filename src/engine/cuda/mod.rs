//! NCCL or the CUDA copy algorithms on `cuda:N` ranks: one [`GpuGroup`] call over every rank's
//! device memory (the group's algorithm: NCCL, hierarchical copy or reduction to one device).

mod group;
pub mod kernels;
mod moves;
mod pairs;

pub(crate) use group::Blocks;
pub use group::{GpuAlgorithm, GpuGroup};

use std::time::Instant;

use crate::call::RawPeerOp;
use crate::device::cuda::{DevicePtr, GpuBuffer};
use crate::error::{Collective, Result, Site};
use crate::transport::CallBuffers;

use super::{GroupCall, GroupEngine, StreamMark};

impl StreamMark for group::StreamMark {
    fn raw(&self) -> u64 {
        group::StreamMark::raw(self)
    }
    fn end(&self) -> u64 {
        group::StreamMark::end(self)
    }
    fn stream(&self) -> u64 {
        group::StreamMark::stream(self)
    }
}

/// The CUDA engine of a group whose rank r is the group's device r, or (`per_rank`) of one
/// process's GPU in a job of one NCCL rank per process.
pub(crate) struct Cuda {
    group: GpuGroup,
    per_rank: bool,
    /// Where an in-process group's point-to-point calls meet.
    post: pairs::Post,
}

impl Cuda {
    pub(crate) fn new(group: GpuGroup, per_rank: bool) -> Cuda {
        Cuda {
            group,
            per_rank,
            post: pairs::Post::default(),
        }
    }
}

impl GroupEngine for Cuda {
    fn per_rank(&self) -> bool {
        self.per_rank
    }

    fn splits(&self) -> std::result::Result<(), String> {
        // Groups sharing a device would queue their NCCL kernels on its one stream in orders
        // that may differ between devices, and wait on each other.
        Err(
            "a group of GPUs runs every call over one set of NCCL communicators and device \
             streams, which cannot be split yet; split a communicator of host ranks, or make a \
             group of the devices wanted"
                .into(),
        )
    }

    fn run(&self, _site: Site, c: &GroupCall, bufs: &[CallBuffers]) -> Result<()> {
        if c.collective == Collective::Barrier {
            // The ranks met before the call; there is nothing to move.
            return Ok(());
        }
        // An empty buffer is address 0 to the group (the communicator gives empty buffers a
        // placeholder address that is no device memory).
        let ptr = |device: usize, p: *const u8, len: usize| DevicePtr {
            device,
            ptr: if len == 0 { 0 } else { p as u64 },
        };
        let send: Vec<DevicePtr> = bufs
            .iter()
            .enumerate()
            .map(|(r, b)| match c.collective {
                Collective::Broadcast => ptr(r, b.output, b.output_len),
                _ => ptr(r, b.input, b.input_len),
            })
            .collect();
        let recv: Vec<DevicePtr> = bufs
            .iter()
            .enumerate()
            .map(|(r, b)| ptr(r, b.output, b.output_len))
            .collect();
        let after: Vec<u64> = bufs.iter().map(|b| b.after).collect();
        let ends: Vec<u64> = bufs.iter().map(|b| b.end).collect();
        if let Some(blocks) = blocks_of(c.collective, bufs) {
            return self.group.collective_v_after(
                c.collective,
                c.dtype,
                c.op,
                &blocks,
                &send,
                &recv,
                &after,
                &ends,
            );
        }
        self.group.collective_raw_after(
            c.collective,
            c.dtype,
            c.count,
            c.op,
            c.root,
            &send,
            &recv,
            &after,
            &ends,
        )
    }

    fn runs(&self, c: Collective) -> bool {
        // Across processes each rank knows its own all_to_all_v counts only: nothing could
        // check a pair's before NCCL moved them.
        match c {
            Collective::Send | Collective::Recv | Collective::SendRecv => self.runs_pairs(),
            _ => super::cuda_runs(c) && !(self.per_rank && c == Collective::AllToAllV),
        }
    }

    fn runs_list(&self) -> &'static str {
        if self.per_rank {
            super::CUDA_RUNS_PER_RANK
        } else {
            super::CUDA_RUNS
        }
    }

    fn op_unavailable(&self, op: crate::ReduceOp) -> Option<String> {
        self.group.op_unavailable(op)
    }

    unsafe fn mark_stream(&self, rank: usize, stream: u64) -> Result<Box<dyn StreamMark>> {
        // SAFETY: as the caller promises.
        let mark = unsafe { self.group.mark_stream(self.index(rank), stream)? };
        Ok(Box::new(mark))
    }

    unsafe fn order_stream(&self, rank: usize, mark: &dyn StreamMark) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe {
            self.group
                .order_caller(self.index(rank), mark.stream(), mark.end())
        }
    }

    fn retire(&self, mark: Box<dyn StreamMark>) {
        self.group.retire(mark)
    }

    fn runs_pairs(&self) -> bool {
        // Across processes the pairs would meet in NCCL (ncclSend/ncclRecv), which is not
        // wired here.
        !self.per_rank
    }

    fn check_pair(&self, rank: usize, op: &RawPeerOp) -> std::result::Result<(), String> {
        if op.len == 0 {
            return Ok(());
        }
        let what = if op.send { "send" } else { "receive" };
        self.group
            .address(rank, what, op.ptr as u64, op.len, op.dtype.size())
            .map(drop)
    }

    fn pair_exchange(
        &self,
        site: Site,
        rank: usize,
        ops: &[RawPeerOp],
        mark: Option<&dyn StreamMark>,
        communicator_aborted: &dyn Fn() -> Option<String>,
    ) -> Result<()> {
        let deadline = Instant::now() + self.group.timeout();
        let timeout = self.group.timeout();
        let aborted = || self.group.aborted().or_else(communicator_aborted);
        let after = mark.map_or(0, |m| m.raw());
        // Every send first, so that grouped sends and receives in a ring cannot wait on
        // each other.
        let sent: Vec<(u64, usize)> = ops
            .iter()
            .filter(|o| o.send)
            .map(|o| {
                let id = self
                    .post
                    .put(o.peer, rank, o.dtype, o.ptr as u64, o.len, after);
                (id, o.peer)
            })
            .collect();
        let mut received = Ok(());
        for o in ops.iter().filter(|o| !o.send) {
            let (letter, taken) = match self
                .post
                .take(site, rank, o.peer, deadline, timeout, &aborted)
            {
                Ok(t) => t,
                Err(e) => {
                    received = Err(e);
                    break;
                }
            };
            let r = if (letter.dtype, letter.bytes) != (o.dtype, o.len) {
                Err(crate::transport::pair_mismatch(
                    site,
                    o.peer,
                    (letter.dtype, letter.bytes),
                    (o.dtype, o.len),
                ))
            } else {
                self.group.pair_copy(
                    site,
                    rank,
                    o.ptr as u64,
                    letter.from,
                    letter.ptr,
                    o.len,
                    &[letter.after, after],
                    deadline,
                )
            };
            taken.settle(r.as_ref().map(drop).map_err(|e| e.to_string()));
            if let Err(e) = r {
                received = Err(e);
                break;
            }
        }
        let sent = self.post.wait_sent(
            site,
            rank,
            &sent,
            received.is_err(),
            deadline,
            timeout,
            &aborted,
        );
        received.and(sent)
    }

    fn abort(&self, reason: &str) {
        self.group.abort(reason);
        self.post.ring();
    }

    fn stream_done(
        &self,
        site: Site,
        rank: usize,
        mark: &dyn StreamMark,
        until: Instant,
        deadline: Instant,
    ) -> Result<bool> {
        self.group
            .stream_done(site, self.index(rank), mark.end(), until, deadline)
    }
}

/// The blocks of a call with a count per block, from the offsets each rank published with its
/// buffers (the communicator's, checked: P + 1 of them, all_to_all_v's send then receive
/// lists); `None` for the other collectives.
fn blocks_of(c: Collective, bufs: &[CallBuffers]) -> Option<Blocks> {
    if !matches!(
        c,
        Collective::AllGatherV | Collective::ReduceScatterV | Collective::AllToAllV
    ) {
        return None;
    }
    let (mut send, mut recv) = (
        Vec::with_capacity(bufs.len()),
        Vec::with_capacity(bufs.len()),
    );
    for b in bufs {
        // SAFETY: each rank's offsets live in its call, which it does not leave before rank 0
        // (which runs the group's call) is done with them: a rank that stops waiting (a
        // timeout, an abort) ends its call by waiting for every rank to leave it
        // (`LocalTransport::end`), so its `Call` outlives rank 0's use.
        let o = unsafe { b.offsets() };
        let (s, r) = if c == Collective::AllToAllV {
            o.split_at(o.len() / 2)
        } else {
            (o, o)
        };
        send.push(s.to_vec());
        recv.push(r.to_vec());
    }
    Some(Blocks { send, recv })
}

impl Cuda {
    /// The group's device of rank `rank` (a group spanning processes holds this process's
    /// device only).
    fn index(&self, rank: usize) -> usize {
        if self.per_rank {
            0
        } else {
            rank
        }
    }
}

/// The CUDA engine of a group whose buffers are host memory (a strategy's replica values): each
/// call copies every rank's input to its GPU, runs the group's call there, and copies the
/// outputs back.
pub(crate) struct Staged {
    pub(crate) group: GpuGroup,
    /// As [`Cuda::per_rank`]: the group holds this process's GPU alone, in a job of one rank
    /// per process, and each rank stages its own buffers.
    pub(crate) per_rank: bool,
}

impl GroupEngine for Staged {
    fn per_rank(&self) -> bool {
        self.per_rank
    }

    fn run(&self, _site: Site, c: &GroupCall, bufs: &[CallBuffers]) -> Result<()> {
        if c.collective == Collective::Barrier {
            return Ok(());
        }
        let devices = self.group.devices();
        let mut staged_in = Vec::with_capacity(bufs.len());
        let mut staged_out = Vec::with_capacity(bufs.len());
        for (b, dev) in bufs.iter().zip(devices) {
            // SAFETY: the ranks published these host buffers for this call and wait until
            // rank 0 has finished with them.
            let input = unsafe { std::slice::from_raw_parts(b.input, b.input_len) };
            staged_in.push(GpuBuffer::<u8>::from_host(dev, input)?);
            staged_out.push(if b.output.is_null() {
                None
            } else {
                Some(GpuBuffer::<u8>::zeros(dev, b.output_len)?)
            });
        }
        let ptr = |device: usize, b: Option<&GpuBuffer<u8>>| DevicePtr {
            device,
            ptr: b.map_or(0, |b| b.device_ptr()),
        };
        let send: Vec<DevicePtr> = (staged_in.iter().enumerate())
            .map(|(r, b)| ptr(r, Some(b)))
            .collect();
        let recv: Vec<DevicePtr> = (staged_out.iter().enumerate())
            .map(|(r, b)| ptr(r, b.as_ref()))
            .collect();
        self.group
            .collective_raw(c.collective, c.dtype, c.count, c.op, c.root, &send, &recv)?;
        for (b, out) in bufs.iter().zip(&staged_out) {
            if let Some(out) = out {
                // SAFETY: as above; this rank's output, written by nobody else meanwhile.
                let host = unsafe { std::slice::from_raw_parts_mut(b.output, b.output_len) };
                out.copy_to_host(host)?;
            }
        }
        Ok(())
    }
}
