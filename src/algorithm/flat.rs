//! One-to-all and all-to-one: flat broadcast and reduce, the one-step all-to-all all-reduce, and
//! the moves that the copy schedules of [`super::copies`] are made of.
//!
//! * broadcast: the root sends to every rank at once; (P-1)·S leave the root.
//! * reduce: every rank sends to the root, which reduces in rank order.

use super::Ctx;
use crate::error::Result;
use crate::transport::{RecvMode, RecvOp, SendOp};

/// Reduce onto `root` in place in the root's `buf`; other ranks send `buf`.
fn gather_reduce(
    ctx: &Ctx<'_>,
    root: usize,
    ranks: impl Iterator<Item = usize>,
    buf: &mut [u8],
) -> Result<()> {
    let mode = RecvMode::Reduce(ctx.dtype, ctx.op.combining());
    for peer in ranks.filter(|&k| k != root) {
        ctx.t.exchange(
            ctx.site,
            &[],
            &mut [RecvOp {
                peer,
                dst: &mut *buf,
                mode,
            }],
        )?;
    }
    Ok(())
}

/// Send `buf` from `root` to each of `ranks` at once.
pub(super) fn scatter_copies(
    ctx: &Ctx<'_>,
    root: usize,
    ranks: impl Iterator<Item = usize>,
    buf: &[u8],
) -> Result<()> {
    let mut sends = ctx.plan.list::<SendOp<'_>>();
    sends.extend(
        ranks
            .filter(|&k| k != root)
            .map(|peer| SendOp { peer, data: buf }),
    );
    ctx.t.exchange(ctx.site, &sends, &mut [])
}

/// Receive `buf` from `from`.
pub(super) fn recv_copy(ctx: &Ctx<'_>, from: usize, buf: &mut [u8]) -> Result<()> {
    ctx.t.exchange(
        ctx.site,
        &[],
        &mut [RecvOp {
            peer: from,
            dst: buf,
            mode: RecvMode::Copy,
        }],
    )
}

/// Send `buf` to `to`.
pub(super) fn send(ctx: &Ctx<'_>, to: usize, buf: &[u8]) -> Result<()> {
    ctx.t.exchange(
        ctx.site,
        &[SendOp {
            peer: to,
            data: buf,
        }],
        &mut [],
    )
}

/// Reduce `members` (the root among them) onto `root`, in place in each rank's `buf`.
pub(super) fn reduce_onto(
    ctx: &Ctx<'_>,
    root: usize,
    members: impl Iterator<Item = usize>,
    buf: &mut [u8],
) -> Result<()> {
    if ctx.rank() == root {
        gather_reduce(ctx, root, members, buf)
    } else {
        send(ctx, root, buf)
    }
}

pub(crate) fn broadcast(ctx: &Ctx<'_>, root: usize, buf: &mut [u8]) -> Result<()> {
    if ctx.world() == 1 || buf.is_empty() {
        return Ok(());
    }
    if ctx.rank() == root {
        scatter_copies(ctx, root, 0..ctx.world(), buf)
    } else {
        recv_copy(ctx, root, buf)
    }
}

pub(crate) fn reduce(
    ctx: &Ctx<'_>,
    root: usize,
    input: Option<&[u8]>,
    output: Option<&mut [u8]>,
) -> Result<()> {
    match output.filter(|_| ctx.rank() == root) {
        Some(out) => {
            if let Some(i) = input {
                out.copy_from_slice(i);
            }
            if !out.is_empty() {
                gather_reduce(ctx, root, 0..ctx.world(), out)?;
            }
            ctx.finish_mean(out);
            Ok(())
        }
        None => {
            let input = input.expect("the communicator passes an input off the root");
            if input.is_empty() {
                return Ok(());
            }
            send(ctx, root, input)
        }
    }
}

/// All-reduce in one step, for small buffers on transports without peer memory: every rank sends
/// its buffer to every peer, then reduces all P buffers in rank order, so every rank computes
/// the same bits. Each rank sends and receives (P-1)·S: one latency instead of 2(P-1).
pub(crate) fn all_to_all_reduce(ctx: &Ctx<'_>, buf: &mut [u8]) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    if buf.is_empty() {
        return Ok(());
    }
    let mut theirs = ctx.plan.scratch(buf.len() * p);
    {
        let mut sends = ctx.plan.list::<SendOp<'_>>();
        sends.extend(
            (0..p)
                .filter(|&k| k != r)
                .map(|peer| SendOp { peer, data: &*buf }),
        );
        let mut recvs = ctx.plan.list::<RecvOp<'_>>();
        recvs.extend(
            theirs
                .chunks_mut(buf.len())
                .enumerate()
                .filter(|(k, _)| *k != r)
                .map(|(peer, dst)| RecvOp {
                    peer,
                    dst,
                    mode: RecvMode::Copy,
                }),
        );
        ctx.t.exchange(ctx.site, &sends, &mut recvs)?;
    }
    theirs[r * buf.len()..(r + 1) * buf.len()].copy_from_slice(buf);
    let mut srcs = ctx.plan.list::<&[u8]>();
    srcs.extend(theirs.chunks(buf.len()));
    crate::dtype::kernels::reduce(
        ctx.dtype,
        ctx.op,
        buf,
        &srcs,
        crate::dtype::kernels::Init::Overwrite,
        ctx.mean_divisor(),
    );
    Ok(())
}
