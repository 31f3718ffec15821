//! All-reduce across hosts: reduce within each host, the ring among the hosts' leaders, and a
//! broadcast within each host. (TensorFlow's HierarchicalCopyAllReduce within one group of
//! devices is a copy schedule: see [`super::copies`].)

use super::flat::{recv_copy, reduce_onto, scatter_copies};
use super::ring;
use super::Ctx;
use crate::error::{Error, Result};
use crate::transport::sub::SubTransport;

/// All-reduce across hosts: each host's ranks reduce onto the host's first rank (through shared
/// memory where the transport has it), those leaders run the ring among themselves (over the
/// network), and each leader sends the result back to its host's ranks. Only the leaders' ring
/// crosses hosts: 2(H-1)/H·S per leader for H hosts, instead of 2(P-1)/P·S for every rank.
pub(crate) fn all_reduce(
    ctx: &Ctx<'_>,
    hosts: &[usize],
    input: Option<&[u8]>,
    buf: &mut [u8],
) -> Result<()> {
    if let Some(i) = input {
        buf.copy_from_slice(i);
    }
    let r = ctx.rank();
    let world = ctx.world();
    let members = move || (0..world).filter(move |&k| hosts[k] == hosts[r]);
    let leader = members().next().unwrap_or(r); // r is among its host's ranks
    reduce_onto(ctx, leader, members(), buf)?;
    if r != leader {
        return recv_copy(ctx, leader, buf);
    }
    let mut leaders = ctx.plan.list::<usize>();
    leaders.extend((0..world).filter(|&k| hosts[..k].iter().all(|&h| h != hosts[k])));
    let sub = SubTransport::new(ctx.t, &leaders).ok_or_else(|| {
        Error::invalid(
            ctx.site,
            format!("rank {r} leads its host but is not a leader"),
        )
    })?;
    // The ring sums; the mean divides by every rank, not by the leaders.
    let across = Ctx {
        t: &sub,
        site: ctx.site,
        dtype: ctx.dtype,
        op: ctx.op.combining(),
        chunk_bytes: ctx.chunk_bytes,
        deterministic: ctx.deterministic,
        wire: ctx.wire,
        tuning: ctx.tuning,
        // One leader a host; the leaders' ring runs as named, without the model.
        layout: crate::tuning::Layout {
            hosts: leaders.len(),
            most: 1,
            ..Default::default()
        },
        plan: ctx.plan,
    };
    ring::all_reduce(&across, None, buf)?;
    ctx.finish_mean(buf);
    scatter_copies(ctx, leader, members(), buf)
}
