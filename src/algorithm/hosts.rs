//! All-reduce across hosts: a reduce-scatter within each host, a ring among the hosts for each
//! slice, and an all-gather within each host. (TensorFlow's HierarchicalCopyAllReduce within
//! one group of devices is a copy schedule: see [`super::copies`].)

use std::ops::Range;

use super::{bytes, partition, ring, Blocks, Ctx};
use crate::error::{Error, Result};
use crate::transport::sub::SubTransport;
use crate::transport::{RecvMode, RecvOp, SendOp};
use crate::tuning::{HostsForm, Layout};

/// All-reduce across hosts with several leaders a host, one for each slice (as NCCL's and
/// oneCCL's hierarchical paths share the network among a host's ranks). With M the fewest ranks
/// on one host, the buffer is cut into M slices and the i-th rank of each host (in rank order)
/// leads slice i:
///
/// 1. within each host, a ring reduce-scatter (through shared memory where the transport has
///    it) leaves each leader its slice summed over the host's ranks (a host's ranks past the
///    M-th lead none: they send their part and receive nothing);
/// 2. the leaders of slice i, one on each host, run the ring on it among themselves (over the
///    network), all M rings at once;
/// 3. within each host, a ring all-gather hands every leader's slice to the host's ranks.
///
/// Each host's link carries its M leaders' rings, 2(H-1)/H·S/M each for H hosts: 2(H-1)/H·S in
/// all, as one leader would send, instead of the flat ring's 2(P-1)/P·S on each rank that
/// crosses; and each leader reduces and sends only its slice, so a host's ranks share the work.
///
/// Where every host has as many ranks (as the launchers place them) and f32 is not narrowed on
/// the network, [`pipelined`] runs the three phases overlapped, piece by piece; else they run
/// one after the other, as above. For small buffers, where the cost model predicts it faster,
/// [`one_step_within`] runs instead, on as many slices as the model chose. On one host, the
/// ring within it.
pub(crate) fn all_reduce(
    ctx: &Ctx<'_>,
    hosts: Option<&[usize]>,
    input: Option<&[u8]>,
    buf: &mut [u8],
) -> Result<()> {
    let (r, world, esize) = (ctx.rank(), ctx.world(), ctx.dtype.size());
    let count = buf.len() / esize;
    // Without hosts (threads of one process, or a transport that does not know them), one.
    let host_of = |k: usize| hosts.map_or(0, |h| h[k]);
    let host_count = (0..world).map(host_of).max().map_or(0, |h| h + 1);
    // One list, in sections: each rank's place on its host, the ranks on each host, this
    // host's ranks, this slice's ring, the slices' offsets within the buffer.
    let mut v = ctx.plan.list::<usize>();
    v.resize(world + host_count, 0);
    for k in 0..world {
        v[k] = v[world + host_of(k)];
        v[world + host_of(k)] += 1;
    }
    let (place, on_host) = v.split_at(world);
    let fewest = on_host
        .iter()
        .copied()
        .filter(|&n| n > 0)
        .min()
        .unwrap_or(1);
    // Every rank decides alike (from the same hosts and figures) whether every host has as
    // many ranks, the form, and how many slices.
    let even = on_host.iter().all(|&n| n == 0 || n == fewest);
    let form = if host_count > 1 {
        ctx.tuning
            .hosts_form(&super::shape(ctx), buf.len(), ctx.wire.is_some())
            .0
    } else {
        HostsForm::Rings // one host: its ring
    };
    let slices = form.slices(fewest);
    // Before any step runs through another algorithm (whose note would not stand).
    ctx.ran(form.name(fewest));
    let me = place[r];
    let members_at = v.len();
    v.extend((0..world).filter(|&k| host_of(k) == host_of(r)));
    let ring_at = v.len();
    if me < slices {
        for k in 0..world {
            if v[k] == me {
                v.push(k);
            }
        }
    }
    let offsets_at = v.len();
    let here = ring_at - members_at;
    v.extend((0..=here).map(|i| partition(count, slices, i.min(slices)).start));
    let members = &v[members_at..ring_at];
    let ring_ranks = &v[ring_at..offsets_at];
    let offsets = &v[offsets_at..];
    let blocks = Blocks::At(offsets);
    if form != HostsForm::Rings {
        return one_step_within(ctx, members, ring_ranks, blocks, input, buf);
    }
    if even && ctx.wire.is_none() {
        // Every host has as many ranks (the launchers' placement): the phases pipelined.
        return pipelined(ctx, members, ring_ranks, input, buf);
    }

    let host = SubTransport::new(ctx.t, members).ok_or_else(|| {
        Error::invalid(ctx.site, format!("rank {r} is not among its host's ranks"))
    })?;
    // Within a host: shared memory carries the element type itself; the sums are the ring's,
    // divided once at the end for a mean.
    let within = part_of(ctx, &host, members.len(), 1, None);
    let own = bytes(blocks.get(here, me), esize);
    let mut slice = ctx.plan.scratch(own.len());
    ring::reduce_scatter(&within, input.unwrap_or(&*buf), &mut slice, blocks)?;
    if me < slices {
        let sub = SubTransport::new(ctx.t, ring_ranks).ok_or_else(|| {
            Error::invalid(
                ctx.site,
                format!("rank {r} leads a slice but is not in its ring"),
            )
        })?;
        // One leader of this slice on each host; the ring runs as named, without the model.
        let across = part_of(ctx, &sub, 1, ring_ranks.len(), ctx.wire);
        ring::all_reduce(&across, None, &mut slice)?;
        ctx.finish_mean(&mut slice);
    }
    buf[own].copy_from_slice(&slice);
    ring::all_gather(&within, buf, blocks)
}

/// The call as a part of the world runs it: on `t` (the ranks of one host, or one rank of each
/// host), summing (a mean divides once, over the world, at the end), `wire` on the network, a
/// layout of `hosts` hosts of `per_host` ranks (the parts run as named, without the model).
fn part_of<'c>(
    ctx: &'c Ctx<'_>,
    t: &'c dyn crate::transport::Transport,
    per_host: usize,
    hosts: usize,
    wire: Option<crate::dtype::DType>,
) -> Ctx<'c> {
    Ctx {
        t,
        site: ctx.site,
        dtype: ctx.dtype,
        op: ctx.op.combining(),
        chunk_bytes: ctx.chunk_bytes,
        deterministic: ctx.deterministic,
        wire,
        tuning: ctx.tuning,
        layout: Layout {
            hosts,
            most: per_host,
            fewest: per_host,
            ..Default::default()
        },
        plan: ctx.plan,
    }
}

/// Where a step's bytes come from or go to.
#[derive(Copy, Clone)]
enum Src {
    /// `buf`.
    Buf,
    /// The caller's input (out of place): its first send of a piece.
    Input,
}

/// One rank's side of one step of a ring: a send to `to` and a receive from `from` (each left
/// out when its range is empty: a piece is empty on both ends of a link or on neither).
#[derive(Clone)]
struct Step {
    to: usize,
    send: Range<usize>,
    src: Src,
    from: usize,
    recv: Range<usize>,
    /// Reduce into `buf` (with the input's piece as the base, out of place, when `with_input`);
    /// else copy.
    reduce: bool,
    with_input: bool,
}

/// The hierarchy where every host has L ranks, pipelined: the buffer is cut into L slices and
/// each slice into pieces of the chunk size, and round g handles piece g of every slice, as the
/// ring does. Round g is a ring reduce-scatter within the host (L-1 steps: this rank then holds
/// piece g of slice i+1 summed over its host, i its place on the host), the ring among the
/// hosts on that piece (2(H-1) steps, with the i-th rank of every other host), and a ring
/// all-gather within the host (L-1 steps). The rounds overlap: while the ranks' steps across
/// hosts carry round g over the network, their steps within the host reduce round g+1 and
/// gather round g-1, in the same exchanges (disjoint peers: within the host and on other
/// hosts). The network never waits for the host's memory work and the cores reduce while the
/// links carry, where phase after phase each would wait for the other.
fn pipelined(
    ctx: &Ctx<'_>,
    members: &[usize],
    ring_ranks: &[usize],
    input: Option<&[u8]>,
    buf: &mut [u8],
) -> Result<()> {
    let r = ctx.rank();
    let (l, h) = (members.len(), ring_ranks.len());
    let (Some(me), Some(at)) = (
        members.iter().position(|&k| k == r),
        ring_ranks.iter().position(|&k| k == r),
    ) else {
        return Err(Error::invalid(
            ctx.site,
            format!("rank {r} is not among its host's ranks or its slice's ring"),
        ));
    };
    let esize = ctx.dtype.size();
    let count = Blocks::Even(buf.len() / esize);
    // The host's ranks cut the buffer as the ring among them would: L slices, pieces of the
    // chunk size.
    let host = SubTransport::new(ctx.t, members).ok_or_else(|| {
        Error::invalid(ctx.site, format!("rank {r} is not among its host's ranks"))
    })?;
    let within = part_of(ctx, &host, l, 1, None);
    let piece = |k: usize, g: usize| ring::piece(&within, count, k, g);
    let rounds = ring::rounds(&within, count);
    let (right, left) = (members[(me + 1) % l], members[(me + l - 1) % l]);
    let (next, prev) = (ring_ranks[(at + 1) % h], ring_ranks[(at + h - 1) % h]);
    // Step `i` within the host in tick `t`: the reduce-scatter of round t, then the all-gather
    // of round t-2.
    let within_step = |t: usize, i: usize| -> Option<Step> {
        let rs = if t < rounds { l - 1 } else { 0 };
        if i < rs {
            let send = piece((me + l - i) % l, t);
            let recv = piece((me + 2 * l - i - 1) % l, t);
            return Some(Step {
                to: right,
                send,
                src: if i == 0 && input.is_some() {
                    Src::Input
                } else {
                    Src::Buf
                },
                from: left,
                recv,
                reduce: true,
                with_input: input.is_some(),
            });
        }
        let g = t.checked_sub(2).filter(|&g| g < rounds)?;
        let i = i - rs;
        (i < l - 1).then(|| Step {
            to: right,
            send: piece((me + 1 + l - i) % l, g),
            src: Src::Buf,
            from: left,
            recv: piece((me + l - i) % l, g),
            reduce: false,
            with_input: false,
        })
    };
    // Step `i` across hosts in tick `t`: the ring among the hosts on this rank's piece of
    // round t-1, cut into H parts.
    let part = |g: usize, k: usize| -> Range<usize> {
        let p = piece((me + 1) % l, g);
        let e = bytes(partition(p.len() / esize, h, k), esize);
        p.start + e.start..p.start + e.end
    };
    let across_step = |t: usize, i: usize| -> Option<Step> {
        let g = t.checked_sub(1).filter(|&g| g < rounds)?;
        if i < h - 1 {
            return Some(Step {
                to: next,
                send: part(g, (at + h - i) % h),
                src: Src::Buf,
                from: prev,
                recv: part(g, (at + 2 * h - i - 1) % h),
                reduce: true,
                with_input: false,
            });
        }
        let i = i - (h - 1);
        (i < h - 1).then(|| Step {
            to: next,
            send: part(g, (at + 1 + h - i) % h),
            src: Src::Buf,
            from: prev,
            recv: part(g, (at + h - i) % h),
            reduce: false,
            with_input: false,
        })
    };
    let op = ctx.op.combining();
    let steps = (2 * (l - 1)).max(2 * (h - 1));
    for t in 0..rounds + 2 {
        if l == 1 && t < rounds {
            // No reduce-scatter: the piece this rank carries across is its own.
            if let Some(i) = input {
                let p = piece(0, t);
                buf[p.clone()].copy_from_slice(&i[p]);
            }
        }
        for i in 0..steps {
            let w = within_step(t, i);
            let x = across_step(t, i);
            if i == h - 1 {
                // The ring across hosts has summed this rank's part (on one host: the whole
                // piece, at once): divide it once, for a mean, before it goes round.
                if let Some(g) = t.checked_sub(1).filter(|&g| g < rounds) {
                    ctx.finish_mean(&mut buf[part(g, (at + 1) % h)]);
                }
            }
            if w.is_none() && x.is_none() {
                continue;
            }
            run_steps(ctx, op, input, buf, [w, x])?;
        }
    }
    Ok(())
}

/// Run up to two steps (on disjoint peers and disjoint ranges of `buf`) in one exchange.
fn run_steps(
    ctx: &Ctx<'_>,
    op: crate::dtype::ReduceOp,
    input: Option<&[u8]>,
    buf: &mut [u8],
    steps: [Option<Step>; 2],
) -> Result<()> {
    // The ranges of `buf` the steps send from and receive into, carved apart in order.
    let mut wanted: [(Range<usize>, usize); 4] = Default::default();
    let mut n = 0;
    for (j, s) in steps.iter().enumerate() {
        if let Some(s) = s {
            if matches!(s.src, Src::Buf) && !s.send.is_empty() {
                wanted[n] = (s.send.clone(), 2 * j);
                n += 1;
            }
            if !s.recv.is_empty() {
                wanted[n] = (s.recv.clone(), 2 * j + 1);
                n += 1;
            }
        }
    }
    wanted[..n].sort_by_key(|w| w.0.start);
    let mut parts: [Option<&mut [u8]>; 4] = Default::default();
    let mut rest: &mut [u8] = buf;
    let mut at = 0;
    for (range, slot) in &wanted[..n] {
        if range.start < at {
            return Err(Error::invalid(
                ctx.site,
                "hosts: two ranges of one step overlap (a bug in tutti's schedule)",
            ));
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(range.start - at);
        let (part, tail) = tail.split_at_mut(range.len());
        parts[*slot] = Some(part);
        rest = tail;
        at = range.end;
    }
    let mut sends = ctx.plan.list::<SendOp<'_>>();
    let mut recvs = ctx.plan.list::<RecvOp<'_>>();
    let [s0, r0, s1, r1] = parts;
    for (s, (sent, dst)) in steps.iter().zip([(s0, r0), (s1, r1)]) {
        let Some(s) = s else { continue };
        if !s.send.is_empty() {
            let data: &[u8] = match (s.src, sent) {
                (Src::Input, _) => {
                    &input.expect("a send from the input out of place")[s.send.clone()]
                }
                (Src::Buf, Some(d)) => d,
                (Src::Buf, None) => unreachable!("carved above"),
            };
            sends.push(SendOp { peer: s.to, data });
        }
        if let Some(dst) = dst {
            let mode = match (s.reduce, s.with_input, input) {
                (true, true, Some(i)) => RecvMode::ReduceWith(ctx.dtype, op, &i[s.recv.clone()]),
                (true, _, _) => RecvMode::Reduce(ctx.dtype, op),
                (false, _, _) => RecvMode::Copy,
            };
            recvs.push(RecvOp {
                peer: s.from,
                dst,
                mode,
            });
        }
    }
    ctx.t.exchange(ctx.site, &sends, &mut recvs)
}

/// The hierarchy for latency: one step within each host each way and recursive doubling among
/// the hosts, where the rings' 2(L-1) + 2(H-1) steps cost more than their bytes save. The
/// buffer is cut into as many slices as the model chose (from 1 to the fewest ranks on a host:
/// `blocks`), led by the first ranks of each host. Each rank sends slice i of its buffer to the
/// host's i-th rank and the leaders reduce what arrives (in the host's rank order); the leaders
/// of each slice run recursive doubling on it among the hosts (log2 H steps); each leader sends
/// its slice to the host's ranks.
fn one_step_within(
    ctx: &Ctx<'_>,
    members: &[usize],
    ring_ranks: &[usize],
    blocks: Blocks<'_>,
    input: Option<&[u8]>,
    buf: &mut [u8],
) -> Result<()> {
    let (r, esize, here) = (ctx.rank(), ctx.dtype.size(), members.len());
    let Some(me) = members.iter().position(|&k| k == r) else {
        return Err(Error::invalid(
            ctx.site,
            format!("rank {r} is not among its host's ranks"),
        ));
    };
    let slice = |k: usize| bytes(blocks.get(here, k), esize);
    let own = slice(me);
    let mut mine = ctx.plan.scratch(own.len());
    {
        // 1. Each slice to its leader; this rank's (if it leads one) from every other rank.
        let src: &[u8] = input.unwrap_or(&*buf);
        let mut theirs = ctx.plan.scratch(own.len() * (here - 1));
        let mut sends = ctx.plan.list::<SendOp<'_>>();
        sends.extend(
            (0..here)
                .filter(|&k| k != me && !slice(k).is_empty())
                .map(|k| SendOp {
                    peer: members[k],
                    data: &src[slice(k)],
                }),
        );
        let mut recvs = ctx.plan.list::<RecvOp<'_>>();
        if !own.is_empty() {
            let others = (0..here).filter(|&k| k != me);
            recvs.extend(
                theirs
                    .chunks_mut(own.len())
                    .zip(others)
                    .map(|(dst, k)| RecvOp {
                        peer: members[k],
                        dst,
                        mode: RecvMode::Copy,
                    }),
            );
        }
        if !(sends.is_empty() && recvs.is_empty()) {
            ctx.t.exchange(ctx.site, &sends, &mut recvs)?;
        }
        drop(recvs);
        if !own.is_empty() {
            // In the host's rank order: every rank of a host reduces alike.
            let mut srcs = ctx.plan.list::<&[u8]>();
            let mut rest = theirs.chunks(own.len());
            for k in 0..here {
                srcs.push(if k == me {
                    &src[own.clone()]
                } else {
                    rest.next().unwrap_or(&[])
                });
            }
            crate::dtype::kernels::reduce(
                ctx.dtype,
                ctx.op.combining(),
                &mut mine,
                &srcs,
                crate::dtype::kernels::Init::Overwrite,
                None,
            );
        }
    }
    // 2. Recursive doubling among the hosts on this rank's slice, if it leads one.
    if ring_ranks.len() > 1 && !own.is_empty() {
        let sub = SubTransport::new(ctx.t, ring_ranks).ok_or_else(|| {
            Error::invalid(
                ctx.site,
                format!("rank {r} leads a slice but is not in its group"),
            )
        })?;
        let across = part_of(ctx, &sub, 1, ring_ranks.len(), None);
        super::doubling::all_reduce(&across, &mut mine)?;
    }
    ctx.finish_mean(&mut mine);
    // 3. Each leader's slice to the host's ranks.
    let mut sends = ctx.plan.list::<SendOp<'_>>();
    let mut recvs = ctx.plan.list::<RecvOp<'_>>();
    let mut rest: &mut [u8] = buf;
    for k in 0..here {
        let (part, tail) = std::mem::take(&mut rest).split_at_mut(slice(k).len());
        rest = tail;
        if k == me {
            part.copy_from_slice(&mine);
            if !part.is_empty() {
                let part: &[u8] = part;
                sends.extend((0..here).filter(|&j| j != me).map(|j| SendOp {
                    peer: members[j],
                    data: part,
                }));
            }
        } else if !part.is_empty() {
            recvs.push(RecvOp {
                peer: members[k],
                dst: part,
                mode: RecvMode::Copy,
            });
        }
    }
    if sends.is_empty() && recvs.is_empty() {
        return Ok(());
    }
    ctx.t.exchange(ctx.site, &sends, &mut recvs)
}
