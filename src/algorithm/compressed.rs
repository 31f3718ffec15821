//! The ring of an f32 reduction over a compressed wire ([`crate::Compression`]): the same steps
//! as [`super::ring`], with every piece narrowed to a 16-bit float type as it leaves a rank and
//! widened as it arrives, and every combination done in f32.
//!
//! * all_reduce: at each reduce-scatter step a rank narrows the partial it sends (its own input
//!   at the first step, then the partial it has just combined), and combines the piece that
//!   arrives into its f32 buffer. The rank that finishes a piece narrows it once and keeps the
//!   widened result, the very bits the all-gather steps carry to every other rank (they relay
//!   the 16-bit bytes as they arrive, without narrowing again): every rank ends with the same
//!   result, rounded to the wire type once more than the f32 sum.
//! * reduce_scatter: the partials travel narrowed; each rank's slice is the f32 combination of
//!   its own input with the last partial that arrives.
//!
//! Each rank sends half the ring's bytes; narrowing and widening cost a pass over each piece,
//! in cache (pieces are at most `chunk_bytes`).

use super::ring::{exchange_nonempty, piece, rounds};
use super::{Blocks, Ctx};
use crate::dtype::{kernels, DType};
use crate::error::Result;
use crate::transport::RecvMode;

/// All-reduce of the f32 elements in `buf` (`input` given: out of place), carried as `wire`.
pub(super) fn all_reduce(
    ctx: &Ctx<'_>,
    wire: DType,
    input: Option<&[u8]>,
    buf: &mut [u8],
) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    let count = Blocks::Even(buf.len() / ctx.dtype.size());
    let op = ctx.op.combining();
    let (right, left) = ((r + 1) % p, (r + p - 1) % p);
    // The wire bytes of the largest piece: one buffer for what leaves, one for what arrives;
    // in the all-gather they swap at each step (what arrived is what leaves next).
    let half = |range: &std::ops::Range<usize>| range.len() / 2;
    let wire_len = piece(ctx, count, 0, 0).len() / 2;
    let mut bufs = [ctx.plan.scratch(wire_len), ctx.plan.scratch(wire_len)];
    for g in 0..rounds(ctx, count) {
        let [out, inc] = &mut bufs;
        for s in 0..p - 1 {
            let send = piece(ctx, count, (r + p - s) % p, g);
            let recv = piece(ctx, count, (r + 2 * p - s - 1) % p, g);
            if s == 0 {
                let own = input.unwrap_or(buf);
                kernels::narrow_f32(wire, &own[send.clone()], &mut out[..half(&send)]);
            }
            let arrived = &mut inc[..half(&recv)];
            exchange_nonempty(
                ctx,
                right,
                &out[..half(&send)],
                left,
                arrived,
                RecvMode::Copy,
            )?;
            let base = input.map(|i| &i[recv.clone()]);
            kernels::widen_f32(wire, Some(op), &mut buf[recv.clone()], base, arrived);
            // The piece just combined is the one this rank sends next (or, after the last
            // step, the one it owns).
            if s < p - 2 {
                kernels::narrow_f32(wire, &buf[recv.clone()], &mut out[..half(&recv)]);
            }
        }
        // Own the piece: finish the mean, round it as the other ranks will receive it.
        let own = piece(ctx, count, (r + 1) % p, g);
        ctx.finish_mean(&mut buf[own.clone()]);
        kernels::narrow_f32(wire, &buf[own.clone()], &mut out[..half(&own)]);
        kernels::widen_f32(wire, None, &mut buf[own.clone()], None, &out[..half(&own)]);
        let (mut out, mut inc) = (&mut **out, &mut **inc);
        for s in 0..p - 1 {
            let send = piece(ctx, count, (r + 1 + p - s) % p, g);
            let recv = piece(ctx, count, (r + p - s) % p, g);
            let arrived = &mut inc[..half(&recv)];
            exchange_nonempty(
                ctx,
                right,
                &out[..half(&send)],
                left,
                arrived,
                RecvMode::Copy,
            )?;
            kernels::widen_f32(wire, None, &mut buf[recv], None, arrived);
            std::mem::swap(&mut out, &mut inc);
        }
    }
    Ok(())
}

/// `output` = slice `rank` of the f32 reduction of every rank's `input` (P slices laid out as
/// `count` says), the partials carried as `wire`. More than one rank.
pub(super) fn reduce_scatter(
    ctx: &Ctx<'_>,
    wire: DType,
    input: &[u8],
    output: &mut [u8],
    count: Blocks<'_>,
) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    let esize = ctx.dtype.size();
    let op = ctx.op.combining();
    let slice_start = count.get(p, r).start * esize;
    let piece_len = (count.largest(p) * esize).min(ctx.chunk_elems() * esize);
    let mut partial = ctx.plan.scratch(piece_len);
    let [mut out, mut inc] = [
        ctx.plan.scratch(piece_len / 2),
        ctx.plan.scratch(piece_len / 2),
    ];
    for g in 0..rounds(ctx, count) {
        let own = piece(ctx, count, r, g);
        let mine = own.start - slice_start..own.end - slice_start;
        // At step s this rank sends the partial of slice r-s-1 and receives that of r-s-2; the
        // partial it receives at step s is the one it sends at step s+1.
        for s in 0..p - 1 {
            let send = piece(ctx, count, (r + 2 * p - s - 1) % p, g);
            let recv = piece(ctx, count, (r + 2 * p - s - 2) % p, g);
            if s == 0 {
                kernels::narrow_f32(wire, &input[send.clone()], &mut out[..send.len() / 2]);
            }
            let arrived = &mut inc[..recv.len() / 2];
            exchange_nonempty(
                ctx,
                (r + 1) % p,
                &out[..send.len() / 2],
                (r + p - 1) % p,
                arrived,
                RecvMode::Copy,
            )?;
            let base = Some(&input[recv.clone()]);
            if s == p - 2 {
                kernels::widen_f32(wire, Some(op), &mut output[mine.clone()], base, arrived);
            } else {
                let dst = &mut partial[..recv.len()];
                kernels::widen_f32(wire, Some(op), dst, base, arrived);
                kernels::narrow_f32(wire, dst, &mut out[..recv.len() / 2]);
            }
        }
        ctx.finish_mean(&mut output[mine]);
    }
    Ok(())
}
