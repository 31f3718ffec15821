//! Ring algorithms.
//!
//! The buffer is cut into P slices (sizes differing by at most one element); slice k is cut into
//! pieces of at most `chunk_bytes`, and the ring runs once per round of pieces, so that one
//! step's working set stays in cache and, over a network, the next piece's send overlaps this
//! piece's reduction.
//!
//! * all_reduce: P-1 reduce-scatter steps (rank r sends piece r-s to r+1, receives piece r-s-1
//!   from r-1 and reduces it in) leave rank r owning piece r+1; P-1 all-gather steps pass the
//!   owned pieces round. Each rank sends and receives 2(P-1)/P·S bytes; the sum is rounded in
//!   the element type after every hop.
//! * all_gather: the all-gather half alone, (P-1)/P of the output sent per rank.
//! * reduce_scatter: partial sums travel the ring in two scratch slices; (P-1)/P·S per rank.
//! * reduce: reduce_scatter, then every rank sends its slice to the root.
//! * broadcast: a chain from the root, piece by piece (each piece forwarded while the next
//!   arrives); S per rank.

use std::ops::Range;

use super::{bytes, partition, split_pair, Blocks, Ctx};
use crate::error::Result;
use crate::transport::{RecvMode, RecvOp, SendOp};

/// Piece `g` of slice `k`, as a byte range of the whole buffer (empty when the slice is shorter).
pub(super) fn piece(ctx: &Ctx<'_>, blocks: Blocks<'_>, k: usize, g: usize) -> Range<usize> {
    let s = blocks.get(ctx.world(), k);
    let ce = ctx.chunk_elems();
    // Saturating: a chunk may be far larger than the buffer (one piece per slice).
    let lo = s.start.saturating_add(g.saturating_mul(ce)).min(s.end);
    let hi = lo.saturating_add(ce).min(s.end);
    bytes(lo..hi, ctx.dtype.size())
}

/// Rounds of pieces needed to cover the largest slice.
pub(super) fn rounds(ctx: &Ctx<'_>, blocks: Blocks<'_>) -> usize {
    blocks.largest(ctx.world()).div_ceil(ctx.chunk_elems())
}

/// One ring step: send `send` of `buf` to the right, receive into `recv` of `buf` from the left.
fn step(
    ctx: &Ctx<'_>,
    buf: &mut [u8],
    send: Range<usize>,
    recv: Range<usize>,
    mode: RecvMode<'_>,
) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    let (right, left) = ((r + 1) % p, (r + p - 1) % p);
    let (s, d) = split_pair(buf, send, recv);
    exchange_nonempty(ctx, right, s, left, d, mode)
}

/// All-reduce in `buf`. Out of place (`input` given), the reduce-scatter reads the input where
/// `buf` holds nothing yet: the first step sends the input's piece, and each piece that arrives
/// is combined with the input's into `buf`, so no byte of the input is copied into `buf` first.
pub(crate) fn all_reduce(ctx: &Ctx<'_>, input: Option<&[u8]>, buf: &mut [u8]) -> Result<()> {
    let p = ctx.world();
    let r = ctx.rank();
    let count = Blocks::Even(buf.len() / ctx.dtype.size());
    if p == 1 {
        if let Some(i) = input {
            buf.copy_from_slice(i);
        }
        ctx.finish_mean(buf);
        return Ok(());
    }
    if let Some(wire) = ctx.wire {
        return super::compressed::all_reduce(ctx, wire, input, buf);
    }
    let (dtype, op) = (ctx.dtype, ctx.op.combining());
    let (right, left) = ((r + 1) % p, (r + p - 1) % p);
    for g in 0..rounds(ctx, count) {
        // Step s receives slice r-s-1 (each slice but r once) and sends slice r-s: this rank's
        // own at the first step, then the one it received the step before.
        for s in 0..p - 1 {
            let send = piece(ctx, count, (r + p - s) % p, g);
            let recv = piece(ctx, count, (r + 2 * p - s - 1) % p, g);
            match input {
                Some(i) => {
                    let (sent, dst) = split_pair(buf, send.clone(), recv.clone());
                    let data = if s == 0 { &i[send] } else { sent };
                    let mode = RecvMode::ReduceWith(dtype, op, &i[recv]);
                    exchange_nonempty(ctx, right, data, left, dst, mode)?;
                }
                None => step(ctx, buf, send, recv, RecvMode::Reduce(dtype, op))?,
            }
        }
        ctx.finish_mean(&mut buf[piece(ctx, count, (r + 1) % p, g)]);
        for s in 0..p - 1 {
            let send = piece(ctx, count, (r + 1 + p - s) % p, g);
            let recv = piece(ctx, count, (r + p - s) % p, g);
            step(ctx, buf, send, recv, RecvMode::Copy)?;
        }
    }
    Ok(())
}

/// `buf` holds P slices laid out as `count` says; this rank's slice is filled; fill the others.
pub(crate) fn all_gather(ctx: &Ctx<'_>, buf: &mut [u8], count: Blocks<'_>) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    for g in 0..rounds(ctx, count) {
        for s in 0..p - 1 {
            let send = piece(ctx, count, (r + p - s) % p, g);
            let recv = piece(ctx, count, (r + 2 * p - s - 1) % p, g);
            step(ctx, buf, send, recv, RecvMode::Copy)?;
        }
    }
    Ok(())
}

/// `output` = slice `rank` of the reduction of every rank's `input` (P slices laid out as
/// `count` says).
pub(crate) fn reduce_scatter(
    ctx: &Ctx<'_>,
    input: &[u8],
    output: &mut [u8],
    count: Blocks<'_>,
) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    if let Some(wire) = ctx.wire.filter(|_| p > 1) {
        return super::compressed::reduce_scatter(ctx, wire, input, output, count);
    }
    let esize = ctx.dtype.size();
    let slice_start = count.get(p, r).start * esize;
    // Slices may differ (reduce cuts uneven ones; reduce_scatter_v has a count per rank): size
    // for the largest piece.
    let scratch_len = (count.largest(p) * esize).min(ctx.chunk_elems() * esize);
    let mut scratch = [ctx.plan.scratch(scratch_len), ctx.plan.scratch(scratch_len)];
    for g in 0..rounds(ctx, count) {
        let own = piece(ctx, count, r, g);
        let out = own.start - slice_start..own.end - slice_start;
        if p == 1 {
            output[out.clone()].copy_from_slice(&input[own]);
        }
        // At step s this rank sends the partial of slice r-s-1 and receives that of r-s-2; the
        // partial it receives at step s is the one it sends at step s+1.
        for s in 0..p - 1 {
            let send_range = piece(ctx, count, (r + 2 * p - s - 1) % p, g);
            let recv_range = piece(ctx, count, (r + 2 * p - s - 2) % p, g);
            let [a, b] = &mut scratch;
            let (prev, cur): (&[u8], &mut [u8]) = if s % 2 == 0 { (a, b) } else { (b, a) };
            let send: &[u8] = if s == 0 {
                &input[send_range.clone()]
            } else {
                &prev[..send_range.len()]
            };
            let dst: &mut [u8] = if s == p - 2 {
                &mut output[out.clone()]
            } else {
                &mut cur[..recv_range.len()]
            };
            let mode = RecvMode::ReduceWith(ctx.dtype, ctx.op.combining(), &input[recv_range]);
            exchange_nonempty(ctx, (r + 1) % p, send, (r + p - 1) % p, dst, mode)?;
        }
        ctx.finish_mean(&mut output[out]);
    }
    Ok(())
}

/// Send `send` to `to` and receive into `dst` from `from`, leaving out an empty side (a piece is
/// empty on both ends of a link or on neither).
pub(super) fn exchange_nonempty(
    ctx: &Ctx<'_>,
    to: usize,
    send: &[u8],
    from: usize,
    dst: &mut [u8],
    mode: RecvMode<'_>,
) -> Result<()> {
    let sends = [SendOp {
        peer: to,
        data: send,
    }];
    let sends = if send.is_empty() {
        &sends[..0]
    } else {
        &sends[..]
    };
    let nonempty = !dst.is_empty();
    let mut recvs = [RecvOp {
        peer: from,
        dst,
        mode,
    }];
    let recvs = if nonempty {
        &mut recvs[..]
    } else {
        &mut recvs[..0]
    };
    if sends.is_empty() && recvs.is_empty() {
        return Ok(());
    }
    ctx.t.exchange(ctx.site, sends, recvs)
}

/// Reduce onto `root`: reduce-scatter, then every rank sends its slice to the root.
pub(crate) fn reduce(
    ctx: &Ctx<'_>,
    root: usize,
    input: Option<&[u8]>,
    output: Option<&mut [u8]>,
    len: usize,
) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    let esize = ctx.dtype.size();
    let count = len / esize;
    let mut slice = ctx.plan.scratch(partition(count, p, r).len() * esize);
    let blocks = Blocks::Even(count);
    match (input, &output) {
        (Some(i), _) => reduce_scatter(ctx, i, &mut slice, blocks)?,
        (None, Some(o)) => reduce_scatter(ctx, o, &mut slice, blocks)?,
        (None, None) => unreachable!("the communicator passes an input off the root"),
    }
    slices_to_root(ctx, root, &slice, output, count)
}

/// Every rank's `slice` of `count` elements (cut as [`partition`] cuts them) into the root's
/// `output`, in rank order (`output` is `None` off the root).
pub(super) fn slices_to_root(
    ctx: &Ctx<'_>,
    root: usize,
    slice: &[u8],
    output: Option<&mut [u8]>,
    count: usize,
) -> Result<()> {
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    let Some(output) = output.filter(|_| r == root) else {
        return exchange_nonempty(ctx, root, slice, root, &mut [], RecvMode::Copy);
    };
    let mut recvs = ctx.plan.list::<RecvOp<'_>>();
    let mut rest: &mut [u8] = output;
    for k in 0..p {
        let (head, tail) =
            std::mem::take(&mut rest).split_at_mut(partition(count, p, k).len() * esize);
        rest = tail;
        if k == r {
            head.copy_from_slice(slice);
        } else if !head.is_empty() {
            recvs.push(RecvOp {
                peer: k,
                dst: head,
                mode: RecvMode::Copy,
            });
        }
    }
    ctx.t.exchange(ctx.site, &[], &mut recvs)
}

/// Broadcast along the chain root, root+1, ..., piece by piece.
pub(crate) fn broadcast(ctx: &Ctx<'_>, root: usize, buf: &mut [u8]) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    if p == 1 {
        return Ok(());
    }
    let pos = (r + p - root) % p;
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    let chunk = ctx.chunk_elems() * ctx.dtype.size();
    let len = buf.len();
    let n = len.div_ceil(chunk);
    // g < n, so g·chunk < len; (g+1)·chunk may pass usize::MAX when one chunk is most of it.
    let range = |g: usize| g * chunk..(g + 1).saturating_mul(chunk).min(len);
    if pos == 0 {
        for g in 0..n {
            ctx.t.exchange(
                ctx.site,
                &[SendOp {
                    peer: next,
                    data: &buf[range(g)],
                }],
                &mut [],
            )?;
        }
        return Ok(());
    }
    let has_next = pos + 1 < p;
    for g in 0..=n {
        // Forward piece g-1 while piece g arrives.
        let send = if g > 0 && has_next {
            range(g - 1)
        } else {
            0..0
        };
        let recv = if g < n { range(g) } else { 0..0 };
        let (s, d) = split_pair(buf, send, recv);
        exchange_nonempty(ctx, next, s, prev, d, RecvMode::Copy)?;
    }
    Ok(())
}
