//! The algorithms whose steps grow like log2 P, for small buffers between processes: a binomial
//! tree broadcast ([`broadcast`]), and the recursive doubling all-reduce: log2 P steps, in each of
//! which a rank exchanges its whole buffer with one partner (rank ^ 1, ^ 2, ^ 4, ...) and
//! reduces, so a rank sends log2 P messages where the one-step all-to-all sends P - 1.
//!
//! A world that is not a power of two folds first (MPICH's way): of the first 2·rem ranks (rem =
//! P minus the largest power of two below it), each even rank hands its buffer to the odd rank
//! after it and sits the doubling out, and gets the result back at the end.
//!
//! Each pair reduces the lower rank's value first, the partner's second, on both sides, so that
//! every rank ends with the same bits whatever the op (`min`/`max` of signed zeros and NaN
//! payloads included); `Mean` divides once, at the end, on every rank alike.

use super::{flat, ring, Ctx};
use crate::dtype::kernels::{self, Init};
use crate::dtype::ReduceOp;
use crate::error::Result;
use crate::transport::{RecvMode, RecvOp, SendOp};

/// All-reduce in place in `buf`.
pub(crate) fn all_reduce(ctx: &Ctx<'_>, buf: &mut [u8]) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    if buf.is_empty() || p == 1 {
        return Ok(());
    }
    let pof2 = 1usize << (usize::BITS - 1 - p.leading_zeros());
    let rem = p - pof2;
    let op = ctx.op.combining();
    let mut theirs = ctx.plan.scratch(buf.len());
    let theirs = &mut theirs[..buf.len()];
    // The rank's place among the pof2 ranks that double, if it has one.
    let place = if r < 2 * rem {
        if r % 2 == 0 {
            flat::send(ctx, r + 1, buf)?;
            None
        } else {
            flat::recv_copy(ctx, r - 1, theirs)?;
            combine(ctx, op, buf, theirs, true);
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
    if let Some(v) = place {
        let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
        let mut mask = 1;
        while mask < pof2 {
            let peer = real(v ^ mask);
            ctx.t.exchange(
                ctx.site,
                &[SendOp { peer, data: &*buf }],
                &mut [RecvOp {
                    peer,
                    dst: &mut *theirs,
                    mode: RecvMode::Copy,
                }],
            )?;
            combine(ctx, op, buf, theirs, peer < r);
            mask <<= 1;
        }
    }
    if r < 2 * rem {
        if r % 2 == 1 {
            flat::send(ctx, r - 1, buf)?;
        } else {
            flat::recv_copy(ctx, r + 1, buf)?;
        }
    }
    ctx.finish_mean(buf);
    Ok(())
}

/// Rabenseifner's all-reduce in place in `buf`: a reduce-scatter by recursive halving (log2 P
/// steps; at each, a rank sends the half of its current segment that its partner keeps and
/// reduces the partner's copy of the half it keeps into its own), then an all-gather by
/// recursive doubling (the same steps backwards, copying). Each rank sends 2(P-1)/P of the
/// buffer, as the ring does, in 2·log2 P steps instead of the ring's 2(P-1): the mid-size
/// algorithm between doubling's whole-buffer steps and the ring's pipeline. Worlds that are not
/// a power of two fold first, as [`all_reduce`] does. Each element is reduced along one path
/// and then copied, so every rank ends with the same bits.
pub(crate) fn rabenseifner(ctx: &Ctx<'_>, buf: &mut [u8]) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    let esize = ctx.dtype.size();
    let count = buf.len() / esize;
    if count == 0 || p == 1 {
        return Ok(());
    }
    let pof2 = 1usize << (usize::BITS - 1 - p.leading_zeros());
    let rem = p - pof2;
    let op = ctx.op.combining();
    let place = if r < 2 * rem {
        if r % 2 == 0 {
            flat::send(ctx, r + 1, buf)?;
            None
        } else {
            let mut theirs = ctx.plan.scratch(buf.len());
            let theirs = &mut theirs[..buf.len()];
            flat::recv_copy(ctx, r - 1, theirs)?;
            combine(ctx, op, buf, theirs, true);
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
    if let Some(v) = place {
        let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
        // The segment (in elements) this rank keeps after each halving step, outermost first.
        let steps = pof2.trailing_zeros() as usize;
        let mut kept = ctx.plan.list::<usize>();
        let (mut lo, mut hi) = (0, count);
        let mut mask = pof2 >> 1;
        while mask > 0 {
            let peer = real(v ^ mask);
            let mid = lo + (hi - lo) / 2;
            let (keep, give) = if v & mask == 0 {
                (lo..mid, mid..hi)
            } else {
                (mid..hi, lo..mid)
            };
            let (send, dst) = super::split_pair(
                buf,
                super::bytes(give, esize),
                super::bytes(keep.clone(), esize),
            );
            // A half empty here is empty at the partner too: it skips the matching side.
            ring::exchange_nonempty(ctx, peer, send, peer, dst, RecvMode::Reduce(ctx.dtype, op))?;
            kept.extend([lo, hi]);
            (lo, hi) = (keep.start, keep.end);
            mask >>= 1;
        }
        debug_assert_eq!(kept.len(), 2 * steps);
        // Backwards: the partner of each step sends the half this rank gave away, reduced.
        let mut mask = 1;
        for k in (0..steps).rev() {
            let peer = real(v ^ mask);
            let (plo, phi) = (kept[2 * k], kept[2 * k + 1]);
            let mid = plo + (phi - plo) / 2;
            let theirs = if v & mask == 0 { mid..phi } else { plo..mid };
            let (send, dst) = super::split_pair(
                buf,
                super::bytes(lo..hi, esize),
                super::bytes(theirs, esize),
            );
            ring::exchange_nonempty(ctx, peer, send, peer, dst, RecvMode::Copy)?;
            (lo, hi) = (plo, phi);
            mask <<= 1;
        }
    }
    if r < 2 * rem {
        if r % 2 == 1 {
            flat::send(ctx, r - 1, buf)?;
        } else {
            flat::recv_copy(ctx, r + 1, buf)?;
        }
    }
    ctx.finish_mean(buf);
    Ok(())
}

/// Binomial-tree broadcast from `root`: in round k (k = 0, 1, ...) every rank that has the
/// buffer sends it to the rank 2^k places after it (counted from the root), so the buffer
/// reaches every rank in ceil(log2 P) rounds where the ring takes P - 1 hops.
pub(crate) fn broadcast(ctx: &Ctx<'_>, root: usize, buf: &mut [u8]) -> Result<()> {
    let (p, r) = (ctx.world(), ctx.rank());
    if buf.is_empty() || p == 1 {
        return Ok(());
    }
    let v = (r + p - root) % p;
    let real = |v: usize| (v + root) % p;
    let mut mask = 1;
    while mask < p {
        if v < mask {
            if v + mask < p {
                flat::send(ctx, real(v + mask), buf)?;
            }
        } else if v < 2 * mask {
            flat::recv_copy(ctx, real(v - mask), buf)?;
        }
        mask <<= 1;
    }
    Ok(())
}

/// `buf` = the lower rank's value ⊕ the higher's, where `theirs` (the partner's) is the lower
/// when `theirs_lower`.
fn combine(ctx: &Ctx<'_>, op: ReduceOp, buf: &mut [u8], theirs: &mut [u8], theirs_lower: bool) {
    if theirs_lower {
        kernels::reduce(ctx.dtype, op, theirs, &[&*buf], Init::Accumulate, None);
        buf.copy_from_slice(theirs);
    } else {
        kernels::reduce(ctx.dtype, op, buf, &[&*theirs], Init::Accumulate, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Plan;
    use crate::dtype::DType;
    use crate::error::{Collective, Site};
    use crate::transport::local::LocalTransport;

    /// Every world size up to 9 and every root: every rank ends with the root's bytes.
    #[test]
    fn broadcast_reaches_every_rank_from_every_root() {
        for p in 1..=9 {
            for root in 0..p {
                let transports = LocalTransport::group(p, std::time::Duration::from_secs(20));
                let outs: Vec<Vec<u8>> = std::thread::scope(|s| {
                    let hs: Vec<_> = transports
                        .iter()
                        .enumerate()
                        .map(|(r, t)| {
                            s.spawn(move || {
                                let plan = Plan::default();
                                let ctx = Ctx {
                                    t,
                                    site: Site {
                                        collective: Collective::Broadcast,
                                        rank: r,
                                        call: 0,
                                    },
                                    dtype: DType::U8,
                                    op: ReduceOp::Sum,
                                    chunk_bytes: 1 << 20,
                                    deterministic: false,
                                    wire: None,
                                    tuning: crate::tuning::Tuning::BUILT_IN,
                                    layout: crate::tuning::Layout::default(),
                                    plan: &plan,
                                };
                                let mut buf = vec![r as u8; 13];
                                broadcast(&ctx, root, &mut buf).unwrap();
                                buf
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (r, o) in outs.iter().enumerate() {
                    assert_eq!(o, &vec![root as u8; 13], "p={p} root={root}: rank {r}");
                }
            }
        }
    }

    /// Every world size up to 9 (powers of two and the folds between), every op: the
    /// reference's values, and the same bits on every rank.
    #[test]
    fn every_world_size_and_op_gives_the_reference_on_every_rank() {
        for p in 1..=9 {
            for op in [
                ReduceOp::Sum,
                ReduceOp::Prod,
                ReduceOp::Min,
                ReduceOp::Max,
                ReduceOp::Mean,
            ] {
                let transports = LocalTransport::group(p, std::time::Duration::from_secs(20));
                let n = 37;
                let input = |r: usize| -> Vec<f32> {
                    (0..n)
                        .map(|i| ((i * 7 + r * 3) % 11) as f32 * 0.3 - 1.1)
                        .collect()
                };
                let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
                    let hs: Vec<_> = transports
                        .iter()
                        .enumerate()
                        .map(|(r, t)| {
                            s.spawn(move || {
                                let plan = Plan::default();
                                let ctx = Ctx {
                                    t,
                                    site: Site {
                                        collective: Collective::AllReduce,
                                        rank: r,
                                        call: 0,
                                    },
                                    dtype: DType::F32,
                                    op,
                                    chunk_bytes: 1 << 20,
                                    deterministic: false,
                                    wire: None,
                                    tuning: crate::tuning::Tuning::BUILT_IN,
                                    layout: crate::tuning::Layout::default(),
                                    plan: &plan,
                                };
                                let mut buf = input(r);
                                all_reduce(&ctx, bytemuck::cast_slice_mut(&mut buf)).unwrap();
                                buf
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).collect()
                });
                let ins: Vec<Vec<f32>> = (0..p).map(input).collect();
                let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
                let want = crate::reference::reduce(&refs, op);
                let tol = crate::reference::tolerance(DType::F32, op, p, 2.0);
                assert_eq!(
                    crate::reference::count_errors(&outs[0], &want, tol),
                    0,
                    "p={p} {op}"
                );
                for (r, o) in outs.iter().enumerate() {
                    let same = o
                        .iter()
                        .zip(&outs[0])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "p={p} {op}: rank {r} differs from rank 0");
                }
            }
        }
    }
}
