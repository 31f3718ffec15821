//! Personalized exchanges, where every rank sends each peer its own block: all-to-all, gather
//! and scatter, each one [`crate::transport::Transport::exchange`] with every peer at once.
//!
//! * all_to_all: rank r sends block j of its input to rank j and receives block k of its output
//!   from rank k; (P-1)/P of the input leaves each rank. Equal blocks that are all empty move
//!   nothing; with a count per block every pair exchanges, an empty block too, so that counts
//!   that disagree between a sender and its receiver are an error at the receiver naming the
//!   sender.
//! * gather: every rank sends its input to the root; (P-1)·S arrive at the root.
//! * scatter: the root sends block k of its input to rank k; (P-1)·S leave the root.
//!
//! With peer memory ([`super::direct`]) each rank instead copies its blocks straight out of its
//! peers' buffers.

use super::{bytes, Blocks, Ctx};
use crate::error::Result;
use crate::transport::{RecvMode, RecvOp, SendOp};

/// All-to-all: block j of `input` (as `send` cuts it) to rank j; block k of `output` (as `recv`
/// cuts it) from rank k.
pub(crate) fn all_to_all(
    ctx: &Ctx<'_>,
    input: &[u8],
    send: Blocks<'_>,
    output: &mut [u8],
    recv: Blocks<'_>,
) -> Result<()> {
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    let every_pair = matches!(send, Blocks::At(_));
    let mut sends = ctx.plan.list::<SendOp<'_>>();
    let mut recvs = ctx.plan.list::<RecvOp<'_>>();
    let mut rest: &mut [u8] = output;
    let mut at = 0;
    for k in 0..p {
        let block = bytes(recv.get(p, k), esize);
        // The blocks tile the output in order: split each off the front.
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(block.start - at);
        let (dst, tail) = tail.split_at_mut(block.len());
        rest = tail;
        at = block.end;
        let out = bytes(send.get(p, k), esize);
        if k == r {
            dst.copy_from_slice(&input[out]);
            continue;
        }
        if every_pair || !out.is_empty() {
            sends.push(SendOp {
                peer: k,
                data: &input[out],
            });
        }
        if every_pair || !dst.is_empty() {
            recvs.push(RecvOp {
                peer: k,
                dst,
                mode: RecvMode::Copy,
            });
        }
    }
    if sends.is_empty() && recvs.is_empty() {
        return Ok(());
    }
    ctx.t.exchange(ctx.site, &sends, &mut recvs)
}

/// Gather onto `root`: its `output` holds every rank's `input` in rank order.
pub(crate) fn gather(
    ctx: &Ctx<'_>,
    root: usize,
    input: &[u8],
    output: Option<&mut [u8]>,
) -> Result<()> {
    let (p, r, len) = (ctx.world(), ctx.rank(), input.len());
    let Some(output) = output.filter(|_| r == root) else {
        if len == 0 {
            return Ok(());
        }
        let send = [SendOp {
            peer: root,
            data: input,
        }];
        return ctx.t.exchange(ctx.site, &send, &mut []);
    };
    if len == 0 || p == 1 {
        output.copy_from_slice(input);
        return Ok(());
    }
    let mut recvs = ctx.plan.list::<RecvOp<'_>>();
    for (k, dst) in output.chunks_exact_mut(len).enumerate() {
        if k == r {
            dst.copy_from_slice(input);
        } else {
            recvs.push(RecvOp {
                peer: k,
                dst,
                mode: RecvMode::Copy,
            });
        }
    }
    ctx.t.exchange(ctx.site, &[], &mut recvs)
}

/// Scatter from `root`: every rank's `output` is block `rank` of the root's `input`.
pub(crate) fn scatter(
    ctx: &Ctx<'_>,
    root: usize,
    input: Option<&[u8]>,
    output: &mut [u8],
) -> Result<()> {
    let (p, r, len) = (ctx.world(), ctx.rank(), output.len());
    let Some(input) = input.filter(|_| r == root) else {
        if len == 0 {
            return Ok(());
        }
        let mut recv = [RecvOp {
            peer: root,
            dst: output,
            mode: RecvMode::Copy,
        }];
        return ctx.t.exchange(ctx.site, &[], &mut recv);
    };
    if len == 0 || p == 1 {
        output.copy_from_slice(input);
        return Ok(());
    }
    let mut sends = ctx.plan.list::<SendOp<'_>>();
    for (k, data) in input.chunks_exact(len).enumerate() {
        if k == r {
            output.copy_from_slice(data);
        } else {
            sends.push(SendOp { peer: k, data });
        }
    }
    ctx.t.exchange(ctx.site, &sends, &mut [])
}
