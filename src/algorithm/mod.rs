//! Collective algorithms, written once against [`Transport`] and [`PeerMemory`].
//!
//! | algorithm | all_reduce steps | bytes sent per rank (S = buffer size, P = ranks) |
//! |---|---|---|
//! | `direct` | rank r reduces slice r of every input and writes it into every output, chunk by chunk | reads S, writes S (peer memory, nothing on a wire) |
//! | `ring` | P-1 reduce-scatter steps, P-1 all-gather steps around the ring | 2(P-1)S/P |
//! | `hierarchical-copy` | reduce onto group leaders, reduce across leaders, broadcast back | members S; leaders up to (G-1)S received + (P/G-1)S + G·S |
//! | `reduce-to-one` | every rank sends to the root, the root reduces and sends back | S (root: receives and sends (P-1)S) |
//!
//! `auto` picks `direct` where the transport exposes peer memory (threads of one process; a
//! call on shared buffers between processes). Elsewhere it all-reduces with what the cost
//! model of [`crate::tuning`] predicts fastest for the buffer's size, the ranks, the ranks per
//! host and the hosts: the one-step all-to-all, recursive doubling, Rabenseifner, the ring,
//! or, where the ranks span several hosts with more than one rank on some, a reduce within
//! each host, the ring among the hosts' leaders and a broadcast within each host; it
//! broadcasts down a binomial tree or around the ring by the same model. Each
//! module documents its steps; the README gives the full cost table.

mod compressed;
mod copies;
mod direct;
mod doubling;
mod flat;
mod hosts;
mod ordered;
mod personal;
mod plan;
mod ring;

pub(crate) use copies::CopyAlgorithm;
#[cfg(feature = "cuda")]
pub(crate) use copies::{Move, Ranks};
pub(crate) use plan::Plan;

pub use crate::call::Algorithm;

use std::ops::Range;

use crate::dtype::kernels;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Collective, Error, Result, Site};
use crate::transport::{PeerMemory, Transport};
use crate::tuning::{AllReduce, Layout, Shape, Tuning};

/// Everything an algorithm needs about the call.
pub(crate) struct Ctx<'a> {
    pub t: &'a dyn Transport,
    pub site: Site,
    pub dtype: DType,
    pub op: ReduceOp,
    /// Largest piece, in bytes, that one step of a chunked algorithm handles.
    pub chunk_bytes: usize,
    /// Reductions in rank order, whatever the algorithm (see `Config::deterministic`).
    pub deterministic: bool,
    /// The 16-bit float type an f32 reduction's ring carries on the wire (see
    /// `Config::compression`); `None`: the element type itself.
    pub wire: Option<DType>,
    /// The figures `auto` chooses by (see [`crate::tuning`]).
    pub tuning: Tuning,
    /// How the ranks lie on hosts, for the cost model.
    pub layout: Layout,
    /// Scratch and lists reused from the communicator's earlier calls.
    pub plan: &'a Plan,
}

impl Ctx<'_> {
    pub fn rank(&self) -> usize {
        self.t.rank()
    }
    pub fn world(&self) -> usize {
        self.t.world_size()
    }
    /// Elements per chunk (at least one).
    pub fn chunk_elems(&self) -> usize {
        (self.chunk_bytes / self.dtype.size()).max(1)
    }
    /// Record what this call runs as (see [`Plan::note`]); `ran` as tutti perf prints it.
    pub fn ran(&self, ran: &'static str) {
        self.plan.note(ran)
    }
    /// Peer memory, or an error naming the algorithm that needs it.
    pub fn peer_memory(&self, algo: &str) -> Result<&dyn PeerMemory> {
        self.t.peer_memory().ok_or_else(|| {
            Error::invalid(
                self.site,
                format!("algorithm {algo} needs peer memory, which this transport lacks"),
            )
        })
    }
    /// Divide `buf` by the world size when the op is `Mean`.
    pub fn finish_mean(&self, buf: &mut [u8]) {
        if self.op == ReduceOp::Mean && self.world() > 1 {
            kernels::divide(self.dtype, buf, self.world());
        }
    }
    /// `Some(world)` when the op is `Mean`: the divisor to fuse into a final reduction.
    pub fn mean_divisor(&self) -> Option<usize> {
        (self.op == ReduceOp::Mean).then_some(self.world())
    }
}

/// Range `i` of `count` elements cut into `parts` contiguous ranges whose sizes differ by at
/// most one (the first `count % parts` ranges are the longer ones).
pub fn partition(count: usize, parts: usize, i: usize) -> Range<usize> {
    let (base, rem) = (count / parts, count % parts);
    let start = i * base + i.min(rem);
    start..start + base + usize::from(i < rem)
}

/// Where each rank's block lies in a buffer of P blocks, in elements.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Blocks<'a> {
    /// `count` elements cut evenly ([`partition`]).
    Even(usize),
    /// Block k is `offsets[k]..offsets[k + 1]` (a count per rank, summed: P + 1 offsets).
    At(&'a [usize]),
}

impl Blocks<'_> {
    /// Block `k` of `parts`.
    pub(crate) fn get(&self, parts: usize, k: usize) -> Range<usize> {
        match *self {
            Blocks::Even(count) => partition(count, parts, k),
            Blocks::At(offsets) => offsets[k]..offsets[k + 1],
        }
    }

    /// The length of the largest block.
    pub(crate) fn largest(&self, parts: usize) -> usize {
        match *self {
            Blocks::Even(count) => partition(count, parts, 0).len(),
            Blocks::At(offsets) => offsets.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0),
        }
    }
}

/// Scale an element range to bytes.
pub(crate) fn bytes(r: Range<usize>, esize: usize) -> Range<usize> {
    r.start * esize..r.end * esize
}

/// Borrow `a` shared and `b` mutably from one buffer; the ranges must not overlap.
pub(crate) fn split_pair(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    assert!(
        a.end <= b.start || b.end <= a.start,
        "split_pair: ranges overlap"
    );
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// The algorithm that `auto` becomes on this transport.
fn resolve(ctx: &Ctx<'_>, algo: Algorithm) -> Algorithm {
    // `mpi` reaches the algorithms only where MPI's own collective does not apply: `auto`.
    let algo = match algo {
        Algorithm::Mpi => Algorithm::Auto,
        a => a,
    };
    match algo {
        Algorithm::Auto if ctx.t.peer_memory().is_some() => Algorithm::Direct,
        Algorithm::Auto => Algorithm::Ring,
        // One rank has no peers whose memory to read: every algorithm is the ring's copy.
        Algorithm::Direct if ctx.world() == 1 && ctx.t.peer_memory().is_none() => Algorithm::Ring,
        a => a,
    }
}

/// The algorithm for a collective other than all-reduce. `hierarchical-copy`,
/// `recursive-doubling` and `rabenseifner` are all-reduce algorithms: a communicator configured
/// with one runs its other collectives with `auto`;
/// `reduce-to-one` runs broadcast and reduce flat (root to all, all to root) and the rest with
/// `auto`.
fn resolve_other(ctx: &Ctx<'_>, algo: Algorithm, collective: Collective) -> Algorithm {
    match (algo, collective) {
        (Algorithm::ReduceToOne { .. }, Collective::Broadcast | Collective::Reduce) => algo,
        (
            Algorithm::HierarchicalCopy { .. }
            | Algorithm::ReduceToOne { .. }
            | Algorithm::RecursiveDoubling
            | Algorithm::Rabenseifner
            | Algorithm::Hosts,
            _,
        ) => resolve(ctx, Algorithm::Auto),
        _ => resolve(ctx, algo),
    }
}

/// Check an algorithm's parameters against the world.
pub(crate) fn check(algo: Algorithm, world: usize) -> Result<(), String> {
    match algo {
        Algorithm::ReduceToOne { root } if root >= world => Err(format!(
            "reduce-to-one root {root} is out of range for a world of {world} ranks"
        )),
        // Groups as large as the world (or the default, 2) make sense; larger is a mistake.
        Algorithm::HierarchicalCopy { group_size } if group_size > world.max(2) => Err(format!(
            "hierarchical-copy group size {group_size} is larger than the world of {world} ranks"
        )),
        _ => Ok(()),
    }
}

/// The world as the cost model sees it (the same on every rank).
fn shape(ctx: &Ctx<'_>) -> Shape {
    Shape {
        world: ctx.world(),
        layout: ctx.layout,
        all_shm: ctx.t.all_shared_memory(),
    }
}

/// All-reduce: `output = ⊕ over ranks of input` (`input = None`: in place in `output`).
pub(crate) fn all_reduce(
    ctx: &Ctx<'_>,
    algo: Algorithm,
    input: Option<&[u8]>,
    output: &mut [u8],
) -> Result<()> {
    if ctx.deterministic {
        // Rank order whatever the algorithm: direct reduces in it; without peer memory, the
        // ordered reduce-scatter and an all-gather.
        return match ctx.t.peer_memory() {
            Some(_) => {
                ctx.ran("direct");
                direct::all_reduce(ctx, input.is_none(), output.len())
            }
            None => {
                ctx.ran("ordered");
                ordered::all_reduce(ctx, input, output)
            }
        };
    }
    let auto = algo == Algorithm::Auto;
    let algo = resolve(ctx, algo);
    if algo == Algorithm::Direct {
        ctx.ran("direct");
        return direct::all_reduce(ctx, input.is_none(), output.len());
    }
    // Between processes `auto` runs what the cost model predicts fastest; every rank decides
    // alike (the same figures, checked in every call's identity, and the same world).
    let pick = if auto {
        ctx.tuning
            .all_reduce(&shape(ctx), output.len(), ctx.wire.is_some())
    } else {
        match algo {
            Algorithm::Ring => AllReduce::Ring,
            Algorithm::RecursiveDoubling => AllReduce::Doubling,
            Algorithm::Rabenseifner => AllReduce::Rabenseifner,
            Algorithm::Hosts => AllReduce::Hosts,
            _ => AllReduce::Ring, // the copy schedules below
        }
    };
    match (algo, pick) {
        (Algorithm::Ring | Algorithm::Hosts, AllReduce::Hosts) => {
            // Noted there, with the form it runs in.
            return hosts::all_reduce(ctx, ctx.t.hosts(), input, output);
        }
        (Algorithm::Ring, AllReduce::Ring) => {
            ctx.ran("ring");
            return ring::all_reduce(ctx, input, output);
        }
        _ => {}
    }
    if let Some(i) = input {
        output.copy_from_slice(i);
    }
    // Noted before it runs: an algorithm may run steps through another.
    match algo {
        Algorithm::Ring | Algorithm::RecursiveDoubling | Algorithm::Rabenseifner => {
            ctx.ran(pick.name());
            match pick {
                AllReduce::AllToAll => flat::all_to_all_reduce(ctx, output),
                AllReduce::Doubling => doubling::all_reduce(ctx, output),
                _ => doubling::rabenseifner(ctx, output),
            }
        }
        Algorithm::HierarchicalCopy { group_size } => {
            ctx.ran("hierarchical-copy");
            copies::all_reduce(ctx, CopyAlgorithm::HierarchicalCopy { group_size }, output)
        }
        Algorithm::ReduceToOne { root } => {
            ctx.ran("reduce-to-one");
            copies::all_reduce(ctx, CopyAlgorithm::ReduceToOne { root }, output)
        }
        Algorithm::Auto | Algorithm::Direct | Algorithm::Mpi | Algorithm::Hosts => {
            unreachable!("resolved above")
        }
    }
}

/// Broadcast `buf` from `root` to every rank.
pub(crate) fn broadcast(ctx: &Ctx<'_>, algo: Algorithm, root: usize, buf: &mut [u8]) -> Result<()> {
    match resolve_other(ctx, algo, Collective::Broadcast) {
        Algorithm::Direct => {
            ctx.ran("direct");
            direct::broadcast(ctx, root, buf)
        }
        Algorithm::Ring
            if algo == Algorithm::Auto
                && ctx
                    .tuning
                    .tree_broadcast(&shape(ctx), buf.len(), ctx.chunk_bytes) =>
        {
            ctx.ran("binomial-tree");
            doubling::broadcast(ctx, root, buf)
        }
        Algorithm::Ring => {
            ctx.ran("ring");
            ring::broadcast(ctx, root, buf)
        }
        _ => {
            ctx.ran("flat");
            flat::broadcast(ctx, root, buf)
        }
    }
}

/// All-gather: block r of `output` (laid out as `blocks` says) = rank r's input (`input =
/// None`: in place, own block already there).
pub(crate) fn all_gather(
    ctx: &Ctx<'_>,
    algo: Algorithm,
    input: Option<&[u8]>,
    output: &mut [u8],
    blocks: Blocks<'_>,
) -> Result<()> {
    if resolve_other(ctx, algo, Collective::AllGather) == Algorithm::Direct {
        ctx.ran("direct");
        return direct::all_gather(ctx, input.is_none(), output, blocks);
    }
    if let Some(i) = input {
        output[bytes(blocks.get(ctx.world(), ctx.rank()), ctx.dtype.size())].copy_from_slice(i);
    }
    ctx.ran("ring");
    ring::all_gather(ctx, output, blocks)
}

/// Reduce-scatter: `output` = block `rank` of the reduction of every rank's `input` (laid out
/// as `blocks` says).
pub(crate) fn reduce_scatter(
    ctx: &Ctx<'_>,
    algo: Algorithm,
    input: &[u8],
    output: &mut [u8],
    blocks: Blocks<'_>,
) -> Result<()> {
    if ctx.deterministic {
        // direct reduces every input in rank order into the (separate) output already.
        return match ctx.t.peer_memory() {
            Some(_) => {
                ctx.ran("direct");
                direct::reduce_scatter(ctx, output, blocks)
            }
            None => {
                ctx.ran("ordered");
                ordered::reduce_scatter(ctx, input, output, blocks)
            }
        };
    }
    match resolve_other(ctx, algo, Collective::ReduceScatter) {
        Algorithm::Direct => {
            ctx.ran("direct");
            direct::reduce_scatter(ctx, output, blocks)
        }
        _ => {
            ctx.ran("ring");
            ring::reduce_scatter(ctx, input, output, blocks)
        }
    }
}

/// All-to-all: block j of `input` (laid out as `send` says) goes to rank j, and block k of
/// `output` (as `recv` says) comes from rank k.
pub(crate) fn all_to_all(
    ctx: &Ctx<'_>,
    algo: Algorithm,
    input: &[u8],
    send: Blocks<'_>,
    output: &mut [u8],
    recv: Blocks<'_>,
) -> Result<()> {
    match (resolve_other(ctx, algo, Collective::AllToAll), send) {
        // A peer's block for this rank is where this rank can compute it only when every
        // rank cuts its input alike.
        (Algorithm::Direct, Blocks::Even(_)) => {
            ctx.ran("direct");
            direct::all_to_all(ctx, output, send)
        }
        _ => {
            ctx.ran("flat");
            personal::all_to_all(ctx, input, send, output, recv)
        }
    }
}

/// Gather onto `root`: block k of the root's `output` (`world` × the input) = rank k's input.
pub(crate) fn gather(
    ctx: &Ctx<'_>,
    algo: Algorithm,
    root: usize,
    input: &[u8],
    output: Option<&mut [u8]>,
) -> Result<()> {
    match resolve_other(ctx, algo, Collective::Gather) {
        Algorithm::Direct => {
            ctx.ran("direct");
            direct::gather(ctx, root, input.len(), output)
        }
        _ => {
            ctx.ran("flat");
            personal::gather(ctx, root, input, output)
        }
    }
}

/// Scatter from `root`: every rank's `output` = block `rank` of the root's `input` (`world` ×
/// the output; `None` off the root).
pub(crate) fn scatter(
    ctx: &Ctx<'_>,
    algo: Algorithm,
    root: usize,
    input: Option<&[u8]>,
    output: &mut [u8],
) -> Result<()> {
    match resolve_other(ctx, algo, Collective::Scatter) {
        Algorithm::Direct => {
            ctx.ran("direct");
            direct::scatter(ctx, root, output)
        }
        _ => {
            ctx.ran("flat");
            personal::scatter(ctx, root, input, output)
        }
    }
}

/// Reduce onto `root`: `output` (root only) = reduction of every rank's input (`input = None` at
/// the root: in place).
pub(crate) fn reduce(
    ctx: &Ctx<'_>,
    algo: Algorithm,
    root: usize,
    input: Option<&[u8]>,
    output: Option<&mut [u8]>,
    len: usize,
) -> Result<()> {
    if ctx.deterministic {
        return match ctx.t.peer_memory() {
            Some(_) => {
                ctx.ran("direct");
                direct::reduce(ctx, root, len)
            }
            None => {
                ctx.ran("ordered");
                ordered::reduce(ctx, root, input, output, len)
            }
        };
    }
    match resolve_other(ctx, algo, Collective::Reduce) {
        Algorithm::Direct => {
            ctx.ran("direct");
            direct::reduce(ctx, root, len)
        }
        Algorithm::Ring => {
            ctx.ran("ring");
            ring::reduce(ctx, root, input, output, len)
        }
        _ => {
            ctx.ran("flat");
            flat::reduce(ctx, root, input, output)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_covers_everything_evenly() {
        for count in [0, 1, 7, 8, 1000, 1009] {
            for parts in 1..=8 {
                let mut next = 0;
                for i in 0..parts {
                    let r = partition(count, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == count / parts || r.len() == count / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, count);
            }
        }
    }

    #[test]
    fn algorithm_names_round_trip() {
        for a in Algorithm::ALL_REDUCE {
            assert_eq!(a.to_string().parse::<Algorithm>().unwrap(), a);
        }
        assert_eq!(
            "hierarchical-copy:4".parse::<Algorithm>().unwrap(),
            Algorithm::HierarchicalCopy { group_size: 4 }
        );
        assert_eq!(
            "reduce-to-one:3".parse::<Algorithm>().unwrap(),
            Algorithm::ReduceToOne { root: 3 }
        );
        assert!("ring:2".parse::<Algorithm>().is_err());
        assert!("hierarchical-copy:0".parse::<Algorithm>().is_err());
        let huge = "hierarchical-copy:4294967295".parse::<Algorithm>().unwrap();
        assert!(check(huge, 2)
            .unwrap_err()
            .contains("group size 4294967295"));
        assert!(check(Algorithm::HierarchicalCopy { group_size: 4 }, 4).is_ok());
        assert!(check(Algorithm::HierarchicalCopy { group_size: 2 }, 1).is_ok());
        assert!("tree".parse::<Algorithm>().unwrap_err().contains("tree"));
    }

    /// Chunks far larger than any buffer, past the bound [`crate::Config::check`] puts on them
    /// (a communicator made without that check), still give every collective's right answer
    /// with `direct` and `ring`: no piece's range wraps (issue 29, item 5).
    #[test]
    fn any_chunk_size_gives_the_right_results() {
        use crate::comm::Communicator;
        use crate::transport::local::LocalTransport;
        use std::sync::Arc;
        let big = [usize::MAX, usize::MAX / 2 + 1, isize::MAX as usize + 1];
        for (algo, chunk) in [Algorithm::Direct, Algorithm::Ring]
            .into_iter()
            .flat_map(|a| big.map(|c| (a, c)))
        {
            let config = crate::Config::default()
                .with_timeout(std::time::Duration::from_secs(20))
                .with_algorithm(algo)
                .with_chunk_bytes(chunk);
            let comms: Vec<Communicator> = LocalTransport::group(3, config.timeout)
                .into_iter()
                .map(|t| Communicator::new(Arc::new(t), &config))
                .collect();
            std::thread::scope(|s| {
                for comm in &comms {
                    s.spawn(move || {
                        let r = comm.rank() as u8;
                        let what = format!("{algo} with chunk_bytes {chunk}, rank {r}");
                        let input: Vec<u8> = (0..101u8).map(|i| i % 7 + r).collect();
                        let sum: Vec<u8> = (0..101u8).map(|i| 3 * (i % 7) + 3).collect();
                        let mut v = input.clone();
                        comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                        assert_eq!(v, sum, "in-place all_reduce, {what}");
                        let mut out = vec![0u8; 101];
                        comm.all_reduce_into(&input, &mut out, ReduceOp::Sum)
                            .unwrap();
                        assert_eq!(out, sum, "all_reduce_into, {what}");
                        let f: Vec<f32> = (0..37).map(|i| (i + comm.rank()) as f32).collect();
                        let mut fs = f.clone();
                        comm.all_reduce(&mut fs, ReduceOp::Sum).unwrap();
                        let want: Vec<f32> = (0..37).map(|i| (3 * i + 3) as f32).collect();
                        assert_eq!(fs, want, "f32 all_reduce, {what}");
                        let mut b = input.clone();
                        comm.broadcast(&mut b, 1).unwrap();
                        assert!(
                            b.iter().enumerate().all(|(i, &x)| x == i as u8 % 7 + 1),
                            "{what}"
                        );
                        let mut g = vec![0u8; 303];
                        comm.all_gather(&input, &mut g).unwrap();
                        let all: Vec<u8> = (0..3u8)
                            .flat_map(|k| (0..101u8).map(move |i| i % 7 + k))
                            .collect();
                        assert_eq!(g, all, "all_gather, {what}");
                        let mut part = vec![0u8; 101];
                        comm.reduce_scatter(&g, &mut part, ReduceOp::Sum).unwrap();
                        let off = 101 * comm.rank();
                        let want: Vec<u8> = (0..101)
                            .map(|i| all[off + i] + all[off + i] + all[off + i])
                            .collect();
                        assert_eq!(part, want, "reduce_scatter, {what}");
                        let mut root = vec![0u8; 101];
                        let recv = (comm.rank() == 2).then_some(&mut root[..]);
                        comm.reduce(&input, recv, ReduceOp::Sum, 2).unwrap();
                        if comm.rank() == 2 {
                            assert_eq!(root, sum, "reduce, {what}");
                        }
                    });
                }
            });
        }
    }

    #[test]
    fn split_pair_either_order() {
        let mut v: Vec<u8> = (0..10).collect();
        let (a, b) = split_pair(&mut v, 6..8, 1..3);
        assert_eq!(a, &[6, 7]);
        b[0] = 99;
        let (a, b) = split_pair(&mut v, 0..2, 5..10);
        assert_eq!(a, &[0, 99]);
        assert_eq!(b.len(), 5);
    }
}
