//! Direct algorithms: ranks read and reduce their peers' buffers in place, through
//! [`PeerMemory`] (threads of one process; shared memory between processes).
//!
//! all_reduce: the buffer is cut into P slices and each slice into chunks. Rank r reduces chunk c
//! of slice r from every rank's input into its own output (one pass: each input read once, the
//! result written once, `Mean`'s division fused), then writes the chunk, still in its cache, into
//! every peer's output. Each buffer is read once and written once (2·P·S bytes of traffic in all,
//! the memory-traffic limit), and no rank waits for another until the end, when every rank waits
//! until its peers are done with its buffers. (Pulling each finished chunk from its owner's
//! output instead reads it from another core's cache: as fast where the cores share their last
//! level cache, 0.78 of the limit where they do not, measured with two processes on two cores of
//! different core complexes.)
//!
//! all_to_all copies this rank's block of each peer's input into place; gather copies every
//! rank's input into the root's output and scatter this rank's block of the root's input;
//! all_gather copies each peer's input straight into place; reduce_scatter reduces slice r of
//! every input into rank r's output; reduce does the same into the root's output; broadcast copies
//! from the root's buffer. None stages anything.

use std::ops::Range;

use super::plan::List;
use super::{bytes, partition, Blocks, Ctx};
use crate::dtype::kernels::{self, Init};
use crate::error::Result;
use crate::transport::{CallBuffers, PeerMemory};

struct Call<'c> {
    pm: &'c dyn PeerMemory,
    bufs: List<'c, CallBuffers>,
    /// The progress value saying "done with every peer's buffers in this call": the call number
    /// plus one (progress only grows, call after call).
    done: u64,
}

impl<'c> Call<'c> {
    fn new(ctx: &'c Ctx<'_>) -> Result<Call<'c>> {
        let pm = ctx.peer_memory("direct")?;
        let mut bufs = ctx.plan.list::<CallBuffers>();
        bufs.extend((0..ctx.world()).map(|k| pm.buffers(k)));
        Ok(Call {
            pm,
            bufs,
            done: ctx.site.call + 1,
        })
    }

    /// `range` of rank `k`'s input.
    ///
    /// SAFETY (for callers): rank `k` keeps its input unchanged in `range` until this rank
    /// publishes that it is done with it (`finish`).
    unsafe fn input(&self, k: usize, range: Range<usize>) -> &[u8] {
        debug_assert!(range.end <= self.bufs[k].input_len);
        std::slice::from_raw_parts(self.bufs[k].input.add(range.start), range.len())
    }

    /// `range` of rank `k`'s output, mutable: only the rank that owns the range writes it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn output(&self, k: usize, range: Range<usize>) -> &mut [u8] {
        debug_assert!(range.end <= self.bufs[k].output_len);
        std::slice::from_raw_parts_mut(self.bufs[k].output.add(range.start), range.len())
    }

    /// Tell the peers this rank is done with their buffers and wait until they are done with ours.
    fn finish(&self, ctx: &Ctx<'_>) -> Result<()> {
        self.pm.set_progress(self.done);
        for k in (0..ctx.world()).filter(|&k| k != ctx.rank()) {
            self.pm
                .wait_progress(ctx.site, k, self.done, "finish reading this rank's buffers")?;
        }
        Ok(())
    }
}

pub(crate) fn all_reduce(ctx: &Ctx<'_>, in_place: bool, len: usize) -> Result<()> {
    let call = Call::new(ctx)?;
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    let slice = partition(len / esize, p, r);
    let ce = ctx.chunk_elems();
    let init = if in_place {
        Init::Accumulate
    } else {
        Init::Overwrite
    };
    // In rank order (deterministic), an in-place chunk is reduced from every input, its own
    // included, into scratch first: its own input must not be overwritten while it is read.
    let ordered = in_place && ctx.deterministic;
    let mut scratch = ctx
        .plan
        .scratch(if ordered { (ce * esize).min(len) } else { 0 });
    let mut srcs = ctx.plan.list::<&[u8]>();
    for lo in slice.clone().step_by(ce) {
        let range = bytes(lo..lo.saturating_add(ce).min(slice.end), esize);
        srcs.clear();
        for k in (0..p).filter(|&k| ordered || !(in_place && k == r)) {
            // SAFETY: only this rank touches slice r of any buffer during the call (in place,
            // each source chunk is read here before this rank writes it).
            srcs.push(unsafe { call.input(k, range.clone()) });
        }
        let dst = if ordered {
            let tmp = &mut scratch[..range.len()];
            let div = ctx.mean_divisor();
            kernels::reduce(ctx.dtype, ctx.op, tmp, &srcs, Init::Overwrite, div);
            // The chunk's sources (its own among them, in place) are read: drop them before
            // the chunk is written.
            srcs.clear();
            // SAFETY: as above; every rank's output outlives the call (`finish`).
            let dst = unsafe { call.output(r, range.clone()) };
            dst.copy_from_slice(tmp);
            dst
        } else {
            // SAFETY: as above; every rank's output outlives the call (`finish`).
            let dst = unsafe { call.output(r, range.clone()) };
            kernels::reduce(ctx.dtype, ctx.op, dst, &srcs, init, ctx.mean_divisor());
            dst
        };
        for j in (1..p).map(|d| (r + d) % p) {
            // SAFETY: slice r of rank j's output is this rank's alone to write.
            unsafe { call.output(j, range.clone()) }.copy_from_slice(dst);
        }
    }
    call.finish(ctx)
}

pub(crate) fn all_gather(
    ctx: &Ctx<'_>,
    in_place: bool,
    output: &mut [u8],
    blocks: Blocks<'_>,
) -> Result<()> {
    let call = Call::new(ctx)?;
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    for k in (0..p).filter(|&k| k != r || !in_place) {
        let at = bytes(blocks.get(p, k), esize);
        // SAFETY: inputs are not written during an all_gather (in place, rank k's input is its
        // own slice k, which only rank k writes, and it does not).
        let input = unsafe { call.input(k, 0..at.len()) };
        output[at].copy_from_slice(input);
    }
    call.finish(ctx)
}

pub(crate) fn reduce_scatter(ctx: &Ctx<'_>, output: &mut [u8], blocks: Blocks<'_>) -> Result<()> {
    let call = Call::new(ctx)?;
    let range = bytes(blocks.get(ctx.world(), ctx.rank()), ctx.dtype.size());
    // SAFETY: inputs are not written during a reduce_scatter.
    let mut srcs = ctx.plan.list::<&[u8]>();
    srcs.extend((0..ctx.world()).map(|k| unsafe { call.input(k, range.clone()) }));
    kernels::reduce(
        ctx.dtype,
        ctx.op,
        output,
        &srcs,
        Init::Overwrite,
        ctx.mean_divisor(),
    );
    call.finish(ctx)
}

pub(crate) fn reduce(ctx: &Ctx<'_>, root: usize, len: usize) -> Result<()> {
    let call = Call::new(ctx)?;
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    let range = bytes(partition(len / esize, p, r), esize);
    let root_in_place = std::ptr::eq(call.bufs[root].input, call.bufs[root].output);
    // In rank order (deterministic), the root's own input is a source like the others: an
    // in-place slice is reduced into scratch first.
    let ordered = root_in_place && ctx.deterministic;
    if !range.is_empty() {
        let mut srcs = ctx.plan.list::<&[u8]>();
        srcs.extend(
            (0..p)
                .filter(|&k| ordered || !(root_in_place && k == root))
                // SAFETY: inputs are not written during a reduce, except the root's in place,
                // whose slice r only this rank touches.
                .map(|k| unsafe { call.input(k, range.clone()) }),
        );
        let init = if root_in_place && !ordered {
            Init::Accumulate
        } else {
            Init::Overwrite
        };
        if ordered {
            let mut tmp = ctx.plan.scratch(range.len());
            kernels::reduce(ctx.dtype, ctx.op, &mut tmp, &srcs, init, ctx.mean_divisor());
            // The sources (the root's own input among them) are read: drop them before the
            // slice is written.
            srcs.clear();
            // SAFETY: slice r of the root's output is written by this rank alone.
            unsafe { call.output(root, range) }.copy_from_slice(&tmp);
        } else {
            // SAFETY: slice r of the root's output is written by this rank alone.
            let dst = unsafe { call.output(root, range) };
            kernels::reduce(ctx.dtype, ctx.op, dst, &srcs, init, ctx.mean_divisor());
        }
    }
    call.finish(ctx)
}

pub(crate) fn broadcast(ctx: &Ctx<'_>, root: usize, buf: &mut [u8]) -> Result<()> {
    let call = Call::new(ctx)?;
    if ctx.rank() != root {
        // SAFETY: the root's buffer is not written during a broadcast.
        buf.copy_from_slice(unsafe { call.input(root, 0..buf.len()) });
    }
    call.finish(ctx)
}

/// All-to-all of equal blocks: block k of `output` = block `rank` of rank k's input.
pub(crate) fn all_to_all(ctx: &Ctx<'_>, output: &mut [u8], blocks: Blocks<'_>) -> Result<()> {
    let call = Call::new(ctx)?;
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    let mine = bytes(blocks.get(p, r), esize);
    for k in (0..p).map(|d| (r + d) % p) {
        // SAFETY: inputs are not written during an all_to_all, and no input overlaps an
        // output (the communicator checked).
        let input = unsafe { call.input(k, mine.clone()) };
        output[bytes(blocks.get(p, k), esize)].copy_from_slice(input);
    }
    call.finish(ctx)
}

/// Gather onto `root`: the root copies every rank's `len` input bytes into its `output`.
pub(crate) fn gather(
    ctx: &Ctx<'_>,
    root: usize,
    len: usize,
    output: Option<&mut [u8]>,
) -> Result<()> {
    let call = Call::new(ctx)?;
    if let Some(output) = output.filter(|_| ctx.rank() == root) {
        for (k, block) in output.chunks_exact_mut(len.max(1)).enumerate() {
            // SAFETY: inputs are not written during a gather.
            block.copy_from_slice(unsafe { call.input(k, 0..len) });
        }
    }
    call.finish(ctx)
}

/// Scatter from `root`: this rank copies its block of the root's input into `output`.
pub(crate) fn scatter(ctx: &Ctx<'_>, root: usize, output: &mut [u8]) -> Result<()> {
    let call = Call::new(ctx)?;
    let len = output.len();
    let at = ctx.rank() * len;
    // SAFETY: the root's input is not written during a scatter.
    output.copy_from_slice(unsafe { call.input(root, at..at + len) });
    call.finish(ctx)
}
