//! TensorFlow's copy-based all-reduce algorithms, written once as schedules of whole-buffer
//! moves, and the host's way of running them.
//!
//! * `reduce-to-one[:ROOT]` (ReductionToOneDevice): ROOT reduces every rank's buffer in rank
//!   order, then every rank copies the result.
//! * `hierarchical-copy[:G]` (HierarchicalCopyAllReduce): groups of G consecutive ranks reduce
//!   onto their first rank (the leader), the leaders onto rank 0, rank 0 copies the result to the
//!   leaders and each leader to its members. With G = 1 or G ≥ P this is reduce-to-one onto 0.
//!
//! A schedule ([`CopyAlgorithm::moves`]) is the same list of [`Move`]s for every rank, in the
//! same order. Two engines run it:
//! * the host ([`all_reduce`]): every rank walks the list and plays its part in each move over
//!   the [`crate::transport::Transport`] (a reduction's sources send, its target receives and
//!   reduces in rank order; a copy's source sends to every target at once). Every rank sees the
//!   moves in one order, so the blocking exchanges cannot wait on each other in a cycle;
//! * the CUDA copy engine (`gpu::group`), which holds every device of the process and queues each
//!   move as peer copies and reduce kernels on the devices' streams (reading a peer GPU's memory
//!   where peer access allows, staging it otherwise).
//!
//! Costs (S = buffer size, P = ranks): reduce-to-one sends S per rank and (P-1)·S from the root,
//! which also receives (P-1)·S; hierarchical copy moves (G-1)·S into and out of each leader and
//! (P/G-1)·S into and out of rank 0.

use std::iter::StepBy;
use std::ops::Range;

use super::flat::{recv_copy, reduce_onto, scatter_copies};
use super::Ctx;
use crate::error::Result;

/// The ranks `start, start + step, …` below `end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ranks {
    start: usize,
    end: usize,
    step: usize,
}

impl Ranks {
    /// Every rank of `r`.
    pub(crate) fn range(r: Range<usize>) -> Ranks {
        Ranks {
            start: r.start,
            end: r.end,
            step: 1,
        }
    }

    pub(crate) fn iter(self) -> StepBy<Range<usize>> {
        (self.start..self.end).step_by(self.step)
    }

    pub(crate) fn contains(self, r: usize) -> bool {
        r >= self.start && r < self.end && (r - self.start) % self.step == 0
    }

    /// Whether some rank other than `r` is among these.
    pub(crate) fn any_but(self, r: usize) -> bool {
        self.iter().any(|k| k != r)
    }
}

/// One step of a schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Move {
    /// `at`'s buffer becomes the reduction, in rank order, of the buffers of `from` (`at` is
    /// among them). `inputs`: those buffers are still the ranks' inputs (no earlier move wrote
    /// them); otherwise they, `at`'s too, hold results of earlier moves. `last`: the schedule's
    /// final reduction, where `Mean` divides.
    Reduce {
        at: usize,
        from: Ranks,
        inputs: bool,
        last: bool,
    },
    /// Every rank of `to` but `from` receives a copy of `from`'s buffer (a result of an earlier
    /// move).
    Copy { from: usize, to: Ranks },
}

/// A copy-based all-reduce, as the host and the CUDA copy engine name it alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyAlgorithm {
    HierarchicalCopy { group_size: usize },
    ReduceToOne { root: usize },
}

impl CopyAlgorithm {
    /// Call `f` with each move of the all-reduce over `world` ranks, in order; stop at the first
    /// error. The parameters must have passed [`super::check`] (a root below `world`).
    pub(crate) fn moves(self, world: usize, mut f: impl FnMut(Move) -> Result<()>) -> Result<()> {
        match self {
            CopyAlgorithm::ReduceToOne { root } => {
                let all = Ranks::range(0..world);
                f(Move::Reduce {
                    at: root,
                    from: all,
                    inputs: true,
                    last: true,
                })?;
                f(Move::Copy {
                    from: root,
                    to: all,
                })
            }
            CopyAlgorithm::HierarchicalCopy { group_size } => {
                let g = group_size.clamp(1, world.max(1));
                let group = |l: usize| Ranks::range(l..(l + g).min(world));
                let leaders = Ranks {
                    start: 0,
                    end: world,
                    step: g,
                };
                let one_group = g >= world;
                // 1. Each group onto its leader.
                for l in leaders.iter() {
                    f(Move::Reduce {
                        at: l,
                        from: group(l),
                        inputs: true,
                        last: one_group,
                    })?;
                }
                if !one_group {
                    // 2. The leaders onto rank 0, 3. rank 0 back to the leaders.
                    f(Move::Reduce {
                        at: 0,
                        from: leaders,
                        inputs: false,
                        last: true,
                    })?;
                    f(Move::Copy {
                        from: 0,
                        to: leaders,
                    })?;
                }
                // 4. Each leader to its members.
                for l in leaders.iter() {
                    f(Move::Copy {
                        from: l,
                        to: group(l),
                    })?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
impl CopyAlgorithm {
    /// Every root and every group size (one past the world too) for `world` ranks.
    pub(crate) fn every(world: usize) -> impl Iterator<Item = CopyAlgorithm> {
        let roots = (0..world).map(|root| CopyAlgorithm::ReduceToOne { root });
        roots
            .chain((1..=world + 1).map(|group_size| CopyAlgorithm::HierarchicalCopy { group_size }))
    }
}

/// Run `algo`'s all-reduce in place in `buf` (which holds this rank's input) over the transport.
pub(crate) fn all_reduce(ctx: &Ctx<'_>, algo: CopyAlgorithm, buf: &mut [u8]) -> Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let r = ctx.rank();
    algo.moves(ctx.world(), |m| match m {
        Move::Reduce { at, from, last, .. } => {
            if from.any_but(at) && from.contains(r) {
                reduce_onto(ctx, at, from.iter(), buf)?;
            }
            if last && r == at {
                ctx.finish_mean(buf);
            }
            Ok(())
        }
        Move::Copy { from, to } => {
            if r == from {
                if to.any_but(from) {
                    scatter_copies(ctx, from, to.iter(), buf)?;
                }
                Ok(())
            } else if to.contains(r) {
                recv_copy(ctx, from, buf)
            } else {
                Ok(())
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a rank's buffer holds in a model run: how many times each rank's input was summed
    /// in, and how many times the mean divided it.
    #[derive(Clone, Debug, PartialEq)]
    struct Held {
        terms: Vec<usize>,
        divided: usize,
    }

    /// Run a schedule on a model of P buffers, checking each move's promises on the way.
    fn model(algo: CopyAlgorithm, p: usize) -> Vec<Held> {
        let input = |r: usize| Held {
            terms: (0..p).map(|k| usize::from(k == r)).collect(),
            divided: 0,
        };
        let mut bufs: Vec<Held> = (0..p).map(input).collect();
        let mut written = vec![false; p];
        algo.moves(p, |m| {
            match m {
                Move::Reduce {
                    at,
                    from,
                    inputs,
                    last,
                } => {
                    assert!(
                        from.contains(at),
                        "{algo:?} P={p}: {m:?} leaves out its target"
                    );
                    for k in from.iter() {
                        assert!(k < p, "{algo:?} P={p}: {m:?} names rank {k}");
                        assert_eq!(written[k], !inputs, "{algo:?} P={p}: {m:?} on rank {k}");
                    }
                    let mut sum = Held {
                        terms: vec![0; p],
                        divided: 0,
                    };
                    for k in from.iter() {
                        for (s, t) in sum.terms.iter_mut().zip(&bufs[k].terms) {
                            *s += t;
                        }
                        sum.divided += bufs[k].divided;
                    }
                    sum.divided += usize::from(last);
                    bufs[at] = sum;
                    written[at] = true;
                }
                Move::Copy { from, to } => {
                    assert!(written[from], "{algo:?} P={p}: {m:?} copies an input");
                    for k in to.iter().filter(|&k| k != from) {
                        assert!(k < p);
                        bufs[k] = bufs[from].clone();
                        written[k] = true;
                    }
                }
            }
            Ok(())
        })
        .unwrap();
        bufs
    }

    #[test]
    fn every_schedule_leaves_every_input_once_on_every_rank() {
        for p in 1..=9 {
            for algo in CopyAlgorithm::every(p) {
                let want = Held {
                    terms: vec![1; p],
                    divided: 1,
                };
                for (r, held) in model(algo, p).into_iter().enumerate() {
                    assert_eq!(held, want, "{algo:?} P={p}, rank {r}");
                }
            }
        }
    }

    #[test]
    fn hierarchical_copy_follows_tensorflow() {
        let mut moves = Vec::new();
        CopyAlgorithm::HierarchicalCopy { group_size: 2 }
            .moves(5, |m| {
                moves.push(m);
                Ok(())
            })
            .unwrap();
        let reduce = |at, from: Ranks, inputs, last| Move::Reduce {
            at,
            from,
            inputs,
            last,
        };
        let leaders = Ranks {
            start: 0,
            end: 5,
            step: 2,
        };
        assert_eq!(
            moves,
            vec![
                reduce(0, Ranks::range(0..2), true, false),
                reduce(2, Ranks::range(2..4), true, false),
                reduce(4, Ranks::range(4..5), true, false),
                reduce(0, leaders, false, true),
                Move::Copy {
                    from: 0,
                    to: leaders
                },
                Move::Copy {
                    from: 0,
                    to: Ranks::range(0..2)
                },
                Move::Copy {
                    from: 2,
                    to: Ranks::range(2..4)
                },
                Move::Copy {
                    from: 4,
                    to: Ranks::range(4..5)
                },
            ]
        );
    }

    #[test]
    fn rank_sets_step() {
        let leaders = Ranks {
            start: 0,
            end: 7,
            step: 3,
        };
        assert_eq!(leaders.iter().collect::<Vec<_>>(), vec![0, 3, 6]);
        assert!(leaders.contains(6) && !leaders.contains(7) && !leaders.contains(4));
        assert!(!Ranks::range(4..5).any_but(4) && Ranks::range(4..6).any_but(4));
    }
}
