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
    let at = bytes(blocks.get(ctx.world(), ctx.rank()), ctx.dtype.size()).start;
    // SAFETY: `input` is borrowed (unchanged) for the whole call.
    let input = unsafe { Pieces::of(input.as_ptr(), input.len()) };
    reduce_pieces(ctx, &input, blocks, |range, reduce| {
        reduce(&mut output[range.start - at..range.end - at])
    })
}

/// A rank's input by address, cut into short-lived slices: in place, this rank writes its own
/// block between the reads of its pieces.
struct Pieces {
    ptr: *const u8,
    len: usize,
}

impl Pieces {
    /// # Safety
    ///
    /// `ptr` is valid for `len` bytes for the life of the value, and nothing writes a range
    /// while a slice of it from [`Pieces::get`] is alive.
    unsafe fn of(ptr: *const u8, len: usize) -> Pieces {
        Pieces { ptr, len }
    }

    fn get(&self, r: std::ops::Range<usize>) -> &[u8] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "piece out of the buffer"
        );
        if r.is_empty() {
            return &[];
        }
        // SAFETY: in bounds (above); see `of`.
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
    }
}

/// All-reduce's first half in place: block `rank` of `buf` becomes the reduction in rank order
/// of every rank's block (each piece of this rank's own input is read before it is
/// overwritten, through a piece of scratch).
fn reduce_own_block(ctx: &Ctx<'_>, buf: &mut [u8], blocks: Blocks<'_>) -> Result<()> {
    let piece = (ctx.chunk_elems() * ctx.dtype.size()).min(buf.len());
    let mut tmp = ctx.plan.scratch(piece);
    let (at, len) = (buf.as_mut_ptr(), buf.len());
    // SAFETY: `buf` is this call's alone; its own block is written below only once the
    // piece's sources (every slice `reduce_pieces` made of it) are done with.
    let input = unsafe { Pieces::of(at, len) };
    reduce_pieces(ctx, &input, blocks, |range, reduce| {
        let tmp = &mut tmp[..range.len()];
        reduce(tmp);
        // SAFETY: `range` lies in `buf`; no slice of this range is read again (this piece's
        // sources were read into `tmp`, the round's sends are done, and peers never read this
        // rank's own block).
        unsafe { std::slice::from_raw_parts_mut(at.add(range.start), range.len()) }
            .copy_from_slice(tmp);
    })
}

/// Piece by piece of this rank's block of `input`: gather every rank's piece (this rank's own
/// read in place, the others' received into scratch), then hand `place` the piece's byte
/// range in `input` and the reduction to run into a destination of its choosing.
fn reduce_pieces(
    ctx: &Ctx<'_>,
    input: &Pieces,
    blocks: Blocks<'_>,
    mut place: impl FnMut(std::ops::Range<usize>, &mut dyn FnMut(&mut [u8])),
) -> Result<()> {
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    let ce = ctx.chunk_elems();
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
        {
            let mut sends = ctx.plan.list::<SendOp<'_>>();
            for k in (0..p).filter(|&k| k != r) {
                let data = input.get(piece(k, g));
                if !data.is_empty() {
                    sends.push(SendOp { peer: k, data });
                }
            }
            let mut recvs = ctx.plan.list::<RecvOp<'_>>();
            if len > 0 {
                for (i, dst) in scratch.chunks_exact_mut(piece_bytes).enumerate() {
                    recvs.push(RecvOp {
                        peer: if i < r { i } else { i + 1 },
                        dst: &mut dst[..len],
                        mode: RecvMode::Copy,
                    });
                }
            }
            if !sends.is_empty() || !recvs.is_empty() {
                ctx.t.exchange(ctx.site, &sends, &mut recvs)?;
            }
        }
        if len == 0 {
            continue;
        }
        let mut srcs = ctx.plan.list::<&[u8]>();
        for k in 0..p {
            srcs.push(match k.cmp(&r) {
                std::cmp::Ordering::Equal => input.get(own.clone()),
                std::cmp::Ordering::Less => &scratch[k * piece_bytes..k * piece_bytes + len],
                std::cmp::Ordering::Greater => {
                    &scratch[(k - 1) * piece_bytes..(k - 1) * piece_bytes + len]
                }
            });
        }
        let (dtype, op, div) = (ctx.dtype, ctx.op, ctx.mean_divisor());
        place(own, &mut |dst| {
            kernels::reduce(dtype, op, dst, &srcs, Init::Overwrite, div)
        });
    }
    Ok(())
}

/// All-reduce in rank order: `output` = the reduction of every rank's input (`input = None`:
/// in place in `output`).
pub(crate) fn all_reduce(ctx: &Ctx<'_>, input: Option<&[u8]>, output: &mut [u8]) -> Result<()> {
    let (p, r, esize) = (ctx.world(), ctx.rank(), ctx.dtype.size());
    let blocks = Blocks::Even(output.len() / esize);
    match input {
        Some(i) => {
            let mine = bytes(blocks.get(p, r), esize);
            reduce_scatter(ctx, i, &mut output[mine], blocks)?
        }
        None => reduce_own_block(ctx, output, blocks)?,
    }
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
    ring::slices_to_root(ctx, root, &block, output, count)
}
