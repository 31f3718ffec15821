//! Reductions in rank order, for the bitwise-deterministic mode (`Config::deterministic`)
//! where the ranks have no peer memory (with it, [`super::direct`] reduces every element from
//! every input in rank order already).
//!
//! * reduce_scatter: rank r owns block r. Piece by piece (`chunk_bytes`), every rank sends each
//!   peer its piece of that peer's block, all at once, and rank r reduces the P pieces of its
//!   own block in one kernel pass in rank order: the bits depend on the inputs alone, never on
//!   the chunk size, the transport or where the ranks are. Each rank sends (P-1)/P·S, as the
//!   ring's reduce-scatter does, in one step per piece instead of P-1.
//! * all_reduce: reduce_scatter, then the ring's all-gather of the blocks (copies).
//! * reduce: reduce_scatter, then every rank sends its block to the root.

use super::{bytes, partition, ring, Blocks, Ctx};
use crate::dtype::kernels::{self, Init};
use crate::error::Result;
use crate::transport::{RecvMode, RecvOp, SendOp};

/// `output` = block `rank` (as `blocks` cuts `input`) of the reduction in rank order of every
/// rank's `input`.
pub(crate) fn reduce_scatter(
    ctx: &Ctx<'_>,
    input: &[u8],
    output: &mut [u8],
    blocks: Blocks<'_>,
) -> Result<()> {
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    let ce = ctx.chunk_elems();
    let mine = blocks.get(p, r);
    let piece_bytes = (ce * esize).min(blocks.largest(p) * esize);
    // One piece from each peer (this rank's own is read from its input).
    let mut scratch = ctx.plan.scratch(piece_bytes * p.saturating_sub(1));
    let rounds = blocks.largest(p).div_ceil(ce);
    // Piece g of block k, as a byte range of the whole buffer.
    let piece = |k: usize, g: usize| {
        let b = blocks.get(p, k);
        let lo = b.start.saturating_add(g.saturating_mul(ce)).min(b.end);
        bytes(lo..lo.saturating_add(ce).min(b.end), esize)
    };
    for g in 0..rounds {
        let own = piece(r, g);
        let len = own.len();
        let mut sends = ctx.plan.list::<SendOp<'_>>();
        for k in (0..p).filter(|&k| k != r) {
            let data = &input[piece(k, g)];
            if !data.is_empty() {
                sends.push(SendOp { peer: k, data });
            }
        }
        let mut recvs = ctx.plan.list::<RecvOp<'_>>();
        if len > 0 {
            for (i, dst) in scratch.chunks_exact_mut(piece_bytes).enumerate() {
                let peer = if i < r { i } else { i + 1 };
                recvs.push(RecvOp {
                    peer,
                    dst: &mut dst[..len],
                    mode: RecvMode::Copy,
                });
            }
        }
        if !sends.is_empty() || !recvs.is_empty() {
            ctx.t.exchange(ctx.site, &sends, &mut recvs)?;
        }
        drop(recvs);
        drop(sends);
        if len == 0 {
            continue;
        }
        let mut srcs = ctx.plan.list::<&[u8]>();
        for k in 0..p {
            srcs.push(match k {
                k if k == r => &input[own.clone()],
                k => {
                    let i = if k < r { k } else { k - 1 };
                    &scratch[i * piece_bytes..i * piece_bytes + len]
                }
            });
        }
        let at = own.start - mine.start * esize;
        let dst = &mut output[at..at + len];
        kernels::reduce(
            ctx.dtype,
            ctx.op,
            dst,
            &srcs,
            Init::Overwrite,
            ctx.mean_divisor(),
        );
    }
    Ok(())
}

/// All-reduce in rank order: `output` = the reduction of every rank's input (`input = None`:
/// in place in `output`).
pub(crate) fn all_reduce(ctx: &Ctx<'_>, input: Option<&[u8]>, output: &mut [u8]) -> Result<()> {
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    let count = output.len() / esize;
    let blocks = Blocks::Even(count);
    let mine = bytes(blocks.get(p, r), esize);
    let mut block = ctx.plan.scratch(mine.len());
    match input {
        Some(i) => reduce_scatter(ctx, i, &mut block, blocks)?,
        None => reduce_scatter(ctx, output, &mut block, blocks)?,
    }
    // Every rank has sent what its peers need of its input: its own block may be written.
    output[mine].copy_from_slice(&block);
    drop(block);
    ring::all_gather(ctx, output, blocks)
}

/// Reduce in rank order onto `root`: `output` (root only) = the reduction of every rank's
/// input (`input = None` at the root: in place).
pub(crate) fn reduce(
    ctx: &Ctx<'_>,
    root: usize,
    input: Option<&[u8]>,
    output: Option<&mut [u8]>,
    len: usize,
) -> Result<()> {
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    let count = len / esize;
    let blocks = Blocks::Even(count);
    let mut block = ctx.plan.scratch(partition(count, p, r).len() * esize);
    match (input, &output) {
        (Some(i), _) => reduce_scatter(ctx, i, &mut block, blocks)?,
        (None, Some(o)) => reduce_scatter(ctx, o, &mut block, blocks)?,
        (None, None) => unreachable!("the communicator passes an input off the root"),
    }
    let Some(output) = output.filter(|_| r == root) else {
        if block.is_empty() {
            return Ok(());
        }
        let send = [SendOp {
            peer: root,
            data: &block,
        }];
        return ctx.t.exchange(ctx.site, &send, &mut []);
    };
    let mut recvs = ctx.plan.list::<RecvOp<'_>>();
    let mut rest: &mut [u8] = output;
    for k in 0..p {
        let (head, tail) =
            std::mem::take(&mut rest).split_at_mut(partition(count, p, k).len() * esize);
        rest = tail;
        if k == r {
            head.copy_from_slice(&block);
        } else if !head.is_empty() {
            recvs.push(RecvOp {
                peer: k,
                dst: head,
                mode: RecvMode::Copy,
            });
        }
    }
    if recvs.is_empty() {
        return Ok(());
    }
    ctx.t.exchange(ctx.site, &[], &mut recvs)
}
