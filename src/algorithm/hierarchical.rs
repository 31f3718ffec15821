//! TensorFlow's HierarchicalCopyAllReduce.
//!
//! Ranks form groups of G consecutive ranks (default 2); the first of each group is its leader.
//! 1. Members send to their leader, which reduces them in (each member sends S).
//! 2. Leaders send to leader 0, which reduces them in (and divides, for `Mean`).
//! 3. Leader 0 sends the result to every other leader.
//! 4. Each leader sends it to its members.
//!
//! A leader receives (G-1)·S and sends (G-1)·S within its group; leader 0 also receives and sends
//! (P/G - 1)·S across leaders. With G = 1 this is reduce-to-one onto rank 0; with G = P, too.

use super::flat::{recv_copy, reduce_onto, scatter_copies};
use super::{ring, Ctx};
use crate::error::Result;
use crate::transport::sub::SubTransport;

pub(crate) fn all_reduce(ctx: &Ctx<'_>, group_size: usize, buf: &mut [u8]) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    if buf.is_empty() || p == 1 {
        ctx.finish_mean(buf);
        return Ok(());
    }
    let g = group_size.clamp(1, p);
    let leader = r - r % g;
    let members = leader..(leader + g).min(p);
    let leaders = (0..p).step_by(g);

    reduce_onto(ctx, leader, members.clone(), buf)?;
    if r == leader {
        reduce_onto(ctx, 0, leaders.clone(), buf)?;
        if r == 0 {
            ctx.finish_mean(buf);
            scatter_copies(ctx, 0, leaders, buf)?;
        } else {
            recv_copy(ctx, 0, buf)?;
        }
        scatter_copies(ctx, leader, members, buf)
    } else {
        recv_copy(ctx, leader, buf)
    }
}

/// All-reduce across hosts: each host's ranks reduce onto the host's first rank (through shared
/// memory where the transport has it), those leaders run the ring among themselves (over the
/// network), and each leader sends the result back to its host's ranks. Only the leaders' ring
/// crosses hosts: 2(H-1)/H·S per leader for H hosts, instead of 2(P-1)/P·S for every rank.
pub(crate) fn all_reduce_hosts(
    ctx: &Ctx<'_>,
    hosts: &[usize],
    input: Option<&[u8]>,
    buf: &mut [u8],
) -> Result<()> {
    if let Some(i) = input {
        buf.copy_from_slice(i);
    }
    let r = ctx.rank();
    let members: Vec<usize> = (0..ctx.world()).filter(|&k| hosts[k] == hosts[r]).collect();
    let leader = members[0];
    let leaders: Vec<usize> = (0..ctx.world())
        .filter(|&k| hosts[..k].iter().all(|&h| h != hosts[k]))
        .collect();
    reduce_onto(ctx, leader, members.iter().copied(), buf)?;
    if r == leader {
        let sub = SubTransport::new(ctx.t, leaders).expect("a leader is among the leaders");
        // The ring sums; the mean divides by every rank, not by the leaders.
        let across = Ctx {
            t: &sub,
            site: ctx.site,
            dtype: ctx.dtype,
            op: ctx.op.combining(),
            chunk_bytes: ctx.chunk_bytes,
            plan: ctx.plan,
        };
        ring::all_reduce(&across, None, buf)?;
        ctx.finish_mean(buf);
        scatter_copies(ctx, leader, members.into_iter(), buf)
    } else {
        recv_copy(ctx, leader, buf)
    }
}
