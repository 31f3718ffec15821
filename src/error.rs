//! The one error type of tutti.
//!
//! Every message names what failed: the collective, the rank that saw it, the peer involved and
//! the field that was wrong, and where it helps, what to do next.

use std::fmt;
use std::time::Duration;

/// The collectives, as named in errors, logs and `tutti perf`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Collective {
    /// Every rank ends with the reduction of every rank's buffer.
    AllReduce = 0,
    /// The root's buffer is copied to every rank.
    Broadcast = 1,
    /// Every rank ends with every rank's buffer, concatenated in rank order.
    AllGather = 2,
    /// The root ends with the reduction of every rank's buffer.
    Reduce = 3,
    /// Rank r ends with slice r of the reduction.
    ReduceScatter = 4,
    /// No rank leaves before every rank has arrived.
    Barrier = 5,
    /// Block j of rank i's input lands in block i of rank j's output (equal blocks).
    AllToAll = 6,
    /// All-to-all with a count per block: rank i sends `send_counts[j]` elements to rank j,
    /// which receives them as its `recv_counts[i]`.
    AllToAllV = 7,
    /// The root ends with every rank's buffer, concatenated in rank order.
    Gather = 8,
    /// Rank r ends with block r of the root's buffer.
    Scatter = 9,
    /// All-gather with a count per rank (the same counts on every rank).
    AllGatherV = 10,
    /// Reduce-scatter with a count per rank (the same counts on every rank).
    ReduceScatterV = 11,
    /// Point-to-point: this rank's buffer goes to one peer (matched with its `Recv`).
    Send = 12,
    /// Point-to-point: this rank's buffer is filled from one peer (matched with its `Send`).
    Recv = 13,
    /// Point-to-point: a group of sends and receives run together (`send_recv`, the C ABI's
    /// `tutti_group_start` / `tutti_group_end`).
    SendRecv = 14,
}

impl Collective {
    /// Every collective, in tag order.
    pub const ALL: [Collective; 15] = [
        Collective::AllReduce,
        Collective::Broadcast,
        Collective::AllGather,
        Collective::Reduce,
        Collective::ReduceScatter,
        Collective::Barrier,
        Collective::AllToAll,
        Collective::AllToAllV,
        Collective::Gather,
        Collective::Scatter,
        Collective::AllGatherV,
        Collective::ReduceScatterV,
        Collective::Send,
        Collective::Recv,
        Collective::SendRecv,
    ];

    /// The API name (`all_reduce`, `broadcast`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::Broadcast => "broadcast",
            Collective::AllGather => "all_gather",
            Collective::Reduce => "reduce",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::Barrier => "barrier",
            Collective::AllToAll => "all_to_all",
            Collective::AllToAllV => "all_to_all_v",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
            Collective::AllGatherV => "all_gather_v",
            Collective::ReduceScatterV => "reduce_scatter_v",
            Collective::Send => "send",
            Collective::Recv => "recv",
            Collective::SendRecv => "send_recv",
        }
    }

    /// The command-line name (`all-reduce`, `broadcast`, ...).
    pub const fn cli_name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::Broadcast => "broadcast",
            Collective::AllGather => "all-gather",
            Collective::Reduce => "reduce",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::Barrier => "barrier",
            Collective::AllToAll => "all-to-all",
            Collective::AllToAllV => "all-to-all-v",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
            Collective::AllGatherV => "all-gather-v",
            Collective::ReduceScatterV => "reduce-scatter-v",
            Collective::Send => "send",
            Collective::Recv => "recv",
            Collective::SendRecv => "send-recv",
        }
    }

    /// Whether every rank states a count per rank (the same on every rank), compared by a
    /// digest in the call's header.
    pub const fn has_counts(self) -> bool {
        matches!(self, Collective::AllGatherV | Collective::ReduceScatterV)
    }

    /// Whether this is a point-to-point call (between two ranks, not every rank).
    pub const fn is_point_to_point(self) -> bool {
        matches!(
            self,
            Collective::Send | Collective::Recv | Collective::SendRecv
        )
    }

    /// The collective with this numeric value (as used by the C ABI).
    pub fn from_u32(v: u32) -> Option<Collective> {
        Collective::ALL.get(v as usize).copied()
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Collective {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.to_ascii_lowercase().replace('_', "-");
        Collective::ALL
            .iter()
            .copied()
            .find(|c| c.cli_name() == s || c.cli_name().replace('-', "") == s)
            .ok_or_else(|| {
                format!(
                    "unknown collective '{s}' (expected all-reduce, broadcast, all-gather, reduce, reduce-scatter, barrier, all-to-all, all-to-all-v, gather, scatter, all-gather-v, reduce-scatter-v or send-recv)"
                )
            })
    }
}

/// Where an error happened: which collective, on which rank, at which call of the communicator.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Site {
    /// The collective being run.
    pub collective: Collective,
    /// The rank that reports the error.
    pub rank: usize,
    /// The communicator's call number (0 for the first collective). A point-to-point call runs
    /// under the number of the collective that comes after it, which it does not use up: its
    /// `call` is how many collectives came before it.
    pub call: u64,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.collective {
            // Only two ranks take part in each: they are not numbered among the collectives.
            c if c.is_point_to_point() => write!(
                f,
                "{} (point-to-point, after {} collective call{}) on rank {}",
                self.collective,
                self.call,
                if self.call == 1 { "" } else { "s" },
                self.rank
            ),
            _ => write!(
                f,
                "{} (call #{}) on rank {}",
                self.collective, self.call, self.rank
            ),
        }
    }
}

pub(crate) fn list(ranks: &[usize]) -> String {
    let v: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    match v.len() {
        1 => format!("rank {}", v[0]),
        _ => format!("ranks {}", v.join(", ")),
    }
}

fn awaited(ranks: &[usize], phase: &str, stalled_on: &[(usize, usize)]) -> String {
    if ranks.is_empty() {
        return format!(
            "the call to {phase}; it goes on: wait for it again, or abort the communicator to end it"
        );
    }
    if stalled_on.is_empty() {
        return format!(
            "{} to {phase}; that rank is stuck, dead or making a different call (raise the \
             timeout if it is only slow)",
            list(ranks)
        );
    }
    // Ranks answered that they were waiting too: the stuck rank is one they wait for that did
    // not answer (or, if every one answered, any of those waited for).
    let chain: Vec<String> = stalled_on
        .iter()
        .map(|(r, w)| format!("rank {r} answered that it was itself waiting for rank {w}"))
        .collect();
    let named = |silent_only: bool| {
        let mut v: Vec<usize> = stalled_on
            .iter()
            .map(|&(_, w)| w)
            .filter(|w| !silent_only || !stalled_on.iter().any(|&(r, _)| r == *w))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let last = match named(true) {
        silent if silent.is_empty() => named(false),
        silent => silent,
    };
    format!(
        "{} to {phase}; {}: {} likely stuck, dead or making a different call, or waiting in \
         turn for a rank that is (raise the timeout if it is only slow)",
        list(ranks),
        chain.join(", "),
        match last.len() {
            1 => format!("rank {} is", last[0]),
            _ => format!("{} are", list(&last)),
        }
    )
}

/// What went wrong. Marked non-exhaustive: new carriers add variants.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument was wrong on this rank alone (root out of range, buffer too small, unknown name).
    #[error("{}{message}", site.map(|s| format!("{s}: ")).unwrap_or_default())]
    InvalidArgument {
        /// The call, when the error came from one.
        site: Option<Site>,
        /// What was wrong.
        message: String,
    },
    /// The ranks called the same collective step with different arguments.
    #[error(
        "{site}: {field} is {mine} here but {theirs} on rank {peer}; every rank must make the same \
         collective calls in the same order with the same {field}"
    )]
    Mismatch {
        /// The call that disagreed, as seen by the reporting rank.
        site: Site,
        /// The rank whose call differs.
        peer: usize,
        /// The field that differs (`collective`, `dtype`, `count`, `op`, `root`, `algorithm`).
        field: &'static str,
        /// This rank's value.
        mine: String,
        /// The peer's value.
        theirs: String,
    },
    /// A peer refused its own arguments for this call, so the call fails on every rank.
    #[error("{site}: rank {peer} rejected its arguments for this call: {message}")]
    PeerRejected {
        /// The call, as seen by the reporting rank.
        site: Site,
        /// The rank that rejected its arguments.
        peer: usize,
        /// That rank's error.
        message: String,
    },
    /// The connection to a peer broke during a call: the peer exited, crashed or was killed.
    #[error("{site}: lost rank {peer} ({detail}); that rank exited, crashed or was killed")]
    PeerLost {
        /// The call, as seen by the reporting rank.
        site: Site,
        /// The rank that was lost.
        peer: usize,
        /// What the connection reported.
        detail: String,
    },
    /// A blocking wait ran past the communicator's timeout.
    /// With no ranks in `waiting_for`, a wait on a [`crate::Work`] ran past its own bound while
    /// the call goes on.
    #[error(
        "{site}: timed out after {timeout:?} waiting for {}",
        awaited(waiting_for, phase, stalled_on)
    )]
    Timeout {
        /// The call that timed out.
        site: Site,
        /// The ranks that never did what was awaited.
        waiting_for: Vec<usize>,
        /// What was awaited (`arrive`, `send data`, `finish reading`...).
        phase: &'static str,
        /// The bound that was exceeded.
        timeout: Duration,
        /// What the other ranks answered when this rank gave up: (rank, the rank it was itself
        /// waiting for), as far as this rank could learn within a tenth of the timeout. Empty
        /// when none answered. A rank that stopped is one waited for that did not answer.
        stalled_on: Vec<(usize, usize)>,
    },
    /// Creating a communicator ran past its bound: a rank did not join, or the rendezvous
    /// store was out of reach. Nothing was created. (A call's wait past the timeout is
    /// [`Error::Timeout`].)
    #[error("{message}")]
    JoinTimeout {
        /// What was not done in time, and the likely causes.
        message: String,
        /// The bound that was exceeded.
        timeout: Duration,
    },
    /// The communicator was aborted (by `abort()`, or after an earlier failure); build a new one.
    #[error("communicator aborted on rank {rank}: {reason}")]
    Aborted {
        /// The rank that reports it.
        rank: usize,
        /// Why it was aborted.
        reason: String,
    },
    /// A device, library or feature is not available on this machine or build.
    #[error("{what} not available: {why}")]
    Unavailable {
        /// What was asked for (`CUDA`, `NCCL`, `XLA`, ...).
        what: String,
        /// Why it is not there and what would make it so.
        why: String,
    },
    /// A task of a parameter-server job (a `ps` task, a worker, the coordinator) is gone: its
    /// connection broke or it did not answer within the timeout.
    #[error("lost {task} ({detail}); that task exited, crashed or was killed")]
    TaskLost {
        /// The task, as TF_CONFIG names it (`ps task 0`, `worker 1`).
        task: String,
        /// What the connection reported.
        detail: String,
    },
    /// The user's step function failed on a worker of a parameter-server job: its own error,
    /// with the worker that raised it. The worker stays in the job.
    #[error("step {step} failed on worker {worker}: {message}")]
    StepFailed {
        /// The worker's index among the `worker` tasks.
        worker: usize,
        /// The step the coordinator scheduled.
        step: u64,
        /// The step function's error.
        message: String,
    },
    /// An operating-system call failed.
    #[error("{what}: {message}")]
    System {
        /// What tutti was doing.
        what: String,
        /// The system's message.
        message: String,
    },
}

impl Error {
    /// An invalid-argument error tied to a call.
    pub fn invalid(site: Site, message: impl Into<String>) -> Error {
        Error::InvalidArgument {
            site: Some(site),
            message: message.into(),
        }
    }

    /// An invalid-argument error not tied to a call (configuration, names).
    pub fn config(message: impl Into<String>) -> Error {
        Error::InvalidArgument {
            site: None,
            message: message.into(),
        }
    }

    /// A system error from an `io::Error`.
    pub fn io(what: impl Into<String>, e: std::io::Error) -> Error {
        Error::System {
            what: what.into(),
            message: e.to_string(),
        }
    }
}

/// `Result` with tutti's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_point_to_point_site_counts_the_collectives_before_it() {
        let at = |collective, call| {
            Site {
                collective,
                rank: 2,
                call,
            }
            .to_string()
        };
        assert_eq!(
            at(Collective::AllReduce, 3),
            "all_reduce (call #3) on rank 2"
        );
        assert_eq!(
            at(Collective::Recv, 0),
            "recv (point-to-point, after 0 collective calls) on rank 2"
        );
        assert_eq!(
            at(Collective::Send, 1),
            "send (point-to-point, after 1 collective call) on rank 2"
        );
        assert!(at(Collective::SendRecv, 5).starts_with("send_recv (point-to-point, after 5 "));
    }

    #[test]
    fn messages_name_rank_collective_and_field() {
        let site = Site {
            collective: Collective::AllReduce,
            rank: 2,
            call: 7,
        };
        let e = Error::Mismatch {
            site,
            peer: 0,
            field: "count",
            mine: "100".into(),
            theirs: "200".into(),
        };
        let m = e.to_string();
        assert!(
            m.contains("all_reduce") && m.contains("rank 2") && m.contains("rank 0"),
            "{m}"
        );
        assert!(m.contains("count is 100 here but 200"), "{m}");
        let e = Error::Timeout {
            site,
            waiting_for: vec![1, 3],
            phase: "arrive",
            timeout: Duration::from_millis(50),
            stalled_on: Vec::new(),
        };
        assert!(e.to_string().contains("ranks 1, 3 to arrive"), "{e}");
        let e = Error::Timeout {
            site,
            waiting_for: vec![1, 3],
            phase: "arrive",
            timeout: Duration::from_millis(50),
            stalled_on: vec![(1, 0), (3, 2)],
        };
        let m = e.to_string();
        assert!(
            m.contains("rank 1 answered that it was itself waiting for rank 0")
                && m.contains("ranks 0, 2 are likely stuck"),
            "{m}"
        );
        // A rank that answered is not the stuck one: rank 2 was waiting for rank 0.
        let e = Error::Timeout {
            site,
            waiting_for: vec![1],
            phase: "arrive",
            timeout: Duration::from_millis(50),
            stalled_on: vec![(1, 2), (2, 0)],
        };
        assert!(e.to_string().contains(": rank 0 is likely stuck"), "{e}");
        assert_eq!(
            "all_gather".parse::<Collective>().unwrap(),
            Collective::AllGather
        );
        assert_eq!(
            "reduce-scatter".parse::<Collective>().unwrap(),
            Collective::ReduceScatter
        );
    }
}
