//! Transports: how the bytes of a collective move between ranks.
//!
//! A transport offers three things to the algorithms above it:
//!
//! 1. [`Transport::begin`]: every call starts with a small header (call number, collective, dtype,
//!    count, op, root, algorithm) that the ranks compare before any byte moves, so a mismatched call
//!    is an error naming both ranks, never a hang or a silently wrong sum;
//! 2. [`Transport::exchange`]: a batch of point-to-point sends and receives that run concurrently
//!    and all complete before it returns (a receive can reduce into its destination instead of
//!    copying);
//! 3. optionally [`PeerMemory`]: direct access to the peers' buffers of the current call, for the
//!    algorithms that read them in place.
//!
//! Algorithms are written once against this interface; [`local`] implements it for the threads of
//! one process.

pub mod local;
#[cfg(feature = "mpi")]
pub(crate) mod mpi;
pub mod net;
pub(crate) mod shared;
pub(crate) mod shm;
pub(crate) mod shrink;
pub(crate) mod sub;
pub(crate) mod wire;

/// Unlink the shared-memory segments (of shared buffers) and the sockets of link setups that
/// processes of this host left under /dev/shm when they died (those of live processes, and of
/// processes in other PID namespaces, are never touched); launchers call it after a job.
pub fn sweep_dead_segments() {
    shm::sweep_dead()
}

/// The names under /dev/shm of the shared-memory segments whose creating process is gone (in
/// this process's PID namespace): what [`sweep_dead_segments`] would unlink.
pub fn dead_segments() -> Vec<String> {
    shm::dead_segments()
}

pub use crate::call::CallHeader;
pub use net::{NetTransport, TransportKind};

use std::time::Duration;

use crate::dtype::kernels::{self, Init};
use crate::dtype::{Apply, DType, ReduceOp};
use crate::error::{Result, Site};

/// The buffers of one rank for the current call, published to peers by transports that expose
/// peer memory. `input` may equal `output` (in place).
#[derive(Copy, Clone, Debug)]
pub struct CallBuffers {
    /// Start of the input bytes.
    pub input: *const u8,
    /// Length of the input in bytes.
    pub input_len: usize,
    /// Start of the output bytes (may be null where this rank has no output, e.g. reduce off-root).
    pub output: *mut u8,
    /// Length of the output in bytes.
    pub output_len: usize,
    /// On a device whose engine orders work on streams (`cuda:N`): an event the call's device
    /// work waits for, marking the work the caller queued on its stream before issuing the
    /// call. 0: none.
    pub after: u64,
    /// With `after`: the event the call's device work records once queued, which the
    /// caller's stream then waits for. 0: none.
    pub end: u64,
    /// The call's block offsets (elements) where it has a count per block: P + 1 of them
    /// (all_gather_v, reduce_scatter_v), or all_to_all_v's send list then receive list. Null
    /// (and 0) for the other collectives. A group engine reads every rank's.
    pub offsets: *const usize,
    /// How many `offsets` there are.
    pub offsets_len: usize,
    /// What `input` and `output` are: bytes, or (on a rank of a group engine) the rank's
    /// tensors on its device.
    pub held: Held,
}

/// What a rank publishes for a call at [`CallBuffers::input`] and [`CallBuffers::output`].
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Held {
    /// Bytes.
    #[default]
    Bytes,
    /// The rank's [`crate::DeviceTensor`] at `output` (`input` is the same), which the group's
    /// engine runs the collective on where it lies and replaces with the result.
    Tensor,
    /// A variable's update: `input` is the rank's update tensor, `output` its copy of the
    /// variable; the engine combines the updates (the call's all-reduce or broadcast),
    /// applies the result to each copy as the [`Apply`] says and replaces the copies.
    Update(Apply),
    /// An optimizer's step fused with the gradients' sum (XLA devices): `output` is the rank's
    /// gradient, which the engine replaces with the sum, and `input` its
    /// `engine::pjrt::StepArgs`: the variable's copy, the learning rate and the rule's state,
    /// which the engine replaces with the stepped ones.
    #[cfg(feature = "xla")]
    Step,
}

// SAFETY: the pointers are only dereferenced by peers while the owning rank is inside the call
// that published them; the call does not return before every peer is done with them.
unsafe impl Send for CallBuffers {}
unsafe impl Sync for CallBuffers {}

impl CallBuffers {
    /// No buffers (barrier).
    pub const NONE: CallBuffers = CallBuffers {
        input: std::ptr::null(),
        input_len: 0,
        output: std::ptr::null_mut(),
        output_len: 0,
        after: 0,
        end: 0,
        offsets: std::ptr::null(),
        offsets_len: 0,
        held: Held::Bytes,
    };

    /// The call's block offsets (see [`CallBuffers::offsets`]).
    ///
    /// # Safety
    ///
    /// The rank that published them is still inside the call (its offsets live in it).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) unsafe fn offsets<'a>(&self) -> &'a [usize] {
        if self.offsets.is_null() || self.offsets_len == 0 {
            &[]
        } else {
            // SAFETY: as the caller promises.
            unsafe { std::slice::from_raw_parts(self.offsets, self.offsets_len) }
        }
    }
}

/// A whole collective as a carrier's own implementation takes it ([`Transport::native`]):
/// this rank's buffers of a checked call (in place, the input lies in the output: this
/// rank's choice alone, not checked across ranks).
#[derive(Copy, Clone, Debug)]
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) struct NativeCall {
    pub collective: crate::error::Collective,
    pub dtype: DType,
    pub op: Option<ReduceOp>,
    pub root: usize,
    pub buffers: CallBuffers,
}

/// A send in an [`Transport::exchange`].
pub struct SendOp<'a> {
    /// Destination rank.
    pub peer: usize,
    /// The bytes, which must stay unchanged until the exchange returns.
    pub data: &'a [u8],
}

/// What a receive does with the bytes that arrive.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RecvMode<'a> {
    /// Copy them into the destination.
    Copy,
    /// Combine them into the destination with a reduce op: `dst = dst ⊕ incoming`.
    Reduce(DType, ReduceOp),
    /// Combine them with `base` (as long as the destination) into the destination:
    /// `dst = base ⊕ incoming`, never reading what the destination held. An out-of-place
    /// reduction receives this way, sparing a copy of its input into the output first.
    ReduceWith(DType, ReduceOp, &'a [u8]),
}

impl RecvMode<'_> {
    /// Deliver `incoming`, the bytes that arrived for `dst`, which starts `off` bytes into the
    /// receive's destination. Every transport delivers through here.
    #[inline]
    pub(crate) fn deliver(&self, dst: &mut [u8], off: usize, incoming: &[u8]) {
        match *self {
            RecvMode::Copy => dst.copy_from_slice(incoming),
            RecvMode::Reduce(dtype, op) => {
                kernels::reduce(dtype, op, dst, &[incoming], Init::Accumulate, None)
            }
            RecvMode::ReduceWith(dtype, op, base) => kernels::reduce(
                dtype,
                op,
                dst,
                &[&base[off..off + dst.len()], incoming],
                Init::Overwrite,
                None,
            ),
        }
    }

    /// The element type a reducing receive combines (it needs whole elements); `None` for a
    /// copy.
    pub(crate) fn combined(&self) -> Option<DType> {
        match *self {
            RecvMode::Copy => None,
            RecvMode::Reduce(dtype, _) | RecvMode::ReduceWith(dtype, ..) => Some(dtype),
        }
    }
}

/// A receive in an [`Transport::exchange`].
pub struct RecvOp<'a> {
    /// Source rank.
    pub peer: usize,
    /// Where the bytes go; its length must equal the sender's.
    pub dst: &'a mut [u8],
    /// Copy or reduce.
    pub mode: RecvMode<'a>,
}

/// What one operation of a point-to-point group moves.
pub enum PairData<'a> {
    /// These bytes go to the peer.
    Send(&'a [u8]),
    /// The peer's bytes land here; the length must equal the sender's.
    Recv(&'a mut [u8]),
}

/// One operation of a point-to-point group ([`Transport::pair_exchange`]).
pub struct PairOp<'a> {
    /// The other rank.
    pub peer: usize,
    /// The element type both sides must state alike.
    pub dtype: DType,
    /// The bytes.
    pub data: PairData<'a>,
}

impl PairOp<'_> {
    /// Whether this operation sends.
    pub fn is_send(&self) -> bool {
        matches!(self.data, PairData::Send(_))
    }
}

/// Moves the bytes of collectives between the ranks of one communicator.
pub trait Transport: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The bound on every wait.
    fn timeout(&self) -> Duration;

    /// Publish this rank's header (and buffers, where peer memory is offered), wait for every
    /// peer's, and check that they agree. Errors: `Mismatch` naming the first peer and field that
    /// differ, `PeerRejected` when a peer refused its arguments, `Timeout` naming the ranks that
    /// never arrived, `Aborted`.
    fn begin(&self, site: Site, header: &CallHeader, buffers: CallBuffers) -> Result<()>;

    /// Run `sends` and `recvs` concurrently; return when all have completed. A send completes when
    /// its data may be changed again; receives from the same peer match that peer's sends to this
    /// rank in order, and receives that reduce into overlapping destinations run in list order.
    fn exchange(&self, site: Site, sends: &[SendOp<'_>], recvs: &mut [RecvOp<'_>]) -> Result<()>;

    /// Point-to-point, outside any collective call (no `begin` or `end`, no other rank
    /// involved): run this rank's sends and receives of one group, each matched with its peer's
    /// operations in the other direction in per-pair issue order, whatever the grouping on
    /// either side. A receive whose sender states another length or dtype fails naming both;
    /// the caller aborts the communicator on any error (the peers may be mid-message). No op
    /// names this rank itself.
    fn pair_exchange(&self, site: Site, ops: &mut [PairOp<'_>]) -> Result<()> {
        let _ = ops;
        Err(crate::error::Error::Unavailable {
            what: format!("{} on this transport", site.collective),
            why: "it moves the bytes of collectives only".into(),
        })
    }

    /// Run a whole collective (begun, checked) with the carrier's own implementation: MPI's
    /// collectives under the algorithm `mpi`. `None` where the carrier has none for this call
    /// (its collective, element type, op, or in place), which the algorithms then run; every
    /// rank decides alike from the checked call.
    fn native(&self, site: Site, call: &NativeCall) -> Option<Result<()>> {
        let _ = (site, call);
        None
    }

    /// Whether [`Transport::native`] runs any call (the MPI transport).
    fn has_native(&self) -> bool {
        false
    }

    /// Leave the current call. `failed` is the call's error, if any: an error found by every
    /// rank alike in `begin` leaves the communicator usable; any other aborts it, and the
    /// transport waits (bounded) until no peer still touches this rank's buffers.
    fn end(&self, failed: Option<&crate::error::Error>);

    /// Direct access to peers' buffers, when the transport has it.
    fn peer_memory(&self) -> Option<&dyn PeerMemory> {
        None
    }

    /// Every peer is reached through shared memory (the same for every rank of a world).
    fn all_shared_memory(&self) -> bool {
        false
    }

    /// Some peer is reached over a network link (TCP), where a compressed wire pays
    /// (`Config::compression`). The same on every rank of a world: links are TCP for every
    /// pair, or for the pairs on different hosts, and a world on several hosts gives every
    /// rank such a peer.
    fn over_network(&self) -> bool {
        false
    }

    /// The links between ranks of one host are shared memory (the same on every rank: it
    /// follows from the transport's kind), as the cost model prices a step between them. By
    /// default, where every link is.
    fn shm_within_hosts(&self) -> bool {
        self.all_shared_memory()
    }

    /// The host of every rank (equal numbers: the same host), when ranks can be on several;
    /// hosts are numbered from 0 in the order of their first rank.
    fn hosts(&self) -> Option<&[usize]> {
        None
    }

    /// The ranks are threads of one process (their memory is shared already).
    fn one_process(&self) -> bool {
        false
    }

    /// Shared buffers ([`shared`]), step 1 of a collective allocation: this rank's record for
    /// the all-gather. Transports without them (the in-process one needs none) refuse.
    fn share_create(&self, len: usize) -> Result<[u8; shared::RECORD]> {
        let _ = len;
        Err(crate::error::Error::config(
            "shared buffers are not available on this transport",
        ))
    }

    /// Step 2, on every rank whose all-gather of the records succeeded (step 1 failed or not):
    /// map the peers' segments from every rank's record; (allocation number, this rank's
    /// buffer).
    fn share_map(&self, records: &[u8], len: usize) -> Result<(u64, *mut u8)> {
        let _ = (records, len);
        Err(crate::error::Error::config(
            "shared buffers are not available on this transport",
        ))
    }

    /// Step 3, once every rank has mapped allocation `id`.
    fn share_mapped(&self, id: u64) {
        let _ = id;
    }

    /// Give up the segment of step 1 (an allocation that failed before step 2).
    fn share_abandon(&self) {}

    /// The smallest call, in bytes per rank, that runs on shared buffers where every rank's
    /// buffers are in them (`usize::MAX`: none does; 0 where every call has peer memory).
    fn shared_min_bytes(&self) -> usize {
        if self.one_process() {
            0
        } else {
            usize::MAX
        }
    }

    /// Give up allocation `id` on this rank.
    fn share_free(&self, id: u64) {
        let _ = id;
    }

    /// The transport of the survivors after ranks were lost (`Communicator::shrink`), agreed
    /// by `deadline`; `None` where this transport cannot shrink.
    fn shrink(
        &self,
        deadline: std::time::Instant,
    ) -> Option<Result<std::sync::Arc<dyn Transport>>> {
        let _ = deadline;
        None
    }

    /// How a split of this transport's communicator finds its members again
    /// (`Communicator::split`); `None` where it cannot.
    fn regroup(&self) -> Option<Regroup> {
        None
    }

    /// Fail every current and later call of every rank at once with `Aborted` carrying `reason`.
    fn abort(&self, reason: &str);

    /// The abort reason, once aborted.
    fn aborted(&self) -> Option<String>;
}

/// How the ranks of a split meet (see [`Transport::regroup`]).
pub(crate) enum Regroup {
    /// Threads of one process: the identity of their group in this process.
    Threads(usize),
    /// Processes: new connections, proving the job's token, listening on the host the
    /// parent's ranks listen on, over the same kind of transport.
    Network {
        /// The job's secret.
        token: String,
        /// Where this rank listens.
        listen_host: String,
        /// TCP, shared memory or either.
        kind: TransportKind,
    },
    /// MPI: `MPI_Comm_split` of the parent's MPI communicator.
    #[cfg(feature = "mpi")]
    Mpi(mpi::Parent),
}

/// The error of a point-to-point receive whose sender stated another dtype or length: it
/// names both ranks and both sides' element counts.
pub(crate) fn pair_mismatch(
    site: Site,
    peer: usize,
    sent: (DType, usize),
    receive: (DType, usize),
) -> crate::error::Error {
    let elements = |(d, bytes): (DType, usize)| format!("{} {d}", bytes / d.size().max(1));
    crate::error::Error::invalid(
        site,
        format!(
            "rank {peer} sent {} where rank {} receives {} (a send and its receive must \
             state the same count and dtype)",
            elements(sent),
            site.rank,
            elements(receive)
        ),
    )
}

/// Check the peers of an exchange: each a peer of this rank, and at most one send and one
/// receive per peer (a peer's messages match in order, one exchange at a time).
pub(crate) fn check_peers(
    site: Site,
    rank: usize,
    world: usize,
    sends: &[SendOp<'_>],
    recvs: &[RecvOp<'_>],
) -> Result<()> {
    check_list(site, rank, world, sends.iter().map(|x| x.peer), "sends to")?;
    for r in recvs {
        if let RecvMode::ReduceWith(_, _, base) = r.mode {
            if base.len() != r.dst.len() {
                return Err(crate::error::Error::invalid(
                    site,
                    format!(
                        "receive from rank {}: {} bytes to combine with a {}-byte destination",
                        r.peer,
                        base.len(),
                        r.dst.len()
                    ),
                ));
            }
        }
    }
    check_list(
        site,
        rank,
        world,
        recvs.iter().map(|x| x.peer),
        "receives from",
    )
}

/// Every peer in range and not this rank, and none twice, without a table per exchange:
/// algorithms list peers in increasing order, which proves them distinct in one pass; any other
/// order is compared pair by pair.
fn check_list(
    site: Site,
    rank: usize,
    world: usize,
    peers: impl Iterator<Item = usize> + Clone,
    what: &str,
) -> Result<()> {
    let mut increasing = true;
    let mut last = None;
    for p in peers.clone() {
        if p >= world || p == rank {
            return Err(crate::error::Error::invalid(
                site,
                format!("exchange with rank {p}: not a peer"),
            ));
        }
        increasing &= last.is_none_or(|l| l < p);
        last = Some(p);
    }
    if increasing {
        return Ok(());
    }
    for (i, p) in peers.clone().enumerate() {
        if peers.clone().take(i).any(|q| q == p) {
            return Err(crate::error::Error::invalid(
                site,
                format!("exchange: two {what} rank {p} in one step"),
            ));
        }
    }
    Ok(())
}

/// Direct reads and writes of peers' buffers during a call (threads of one process; shared memory).
pub trait PeerMemory {
    /// The buffers `peer` published in its current [`Transport::begin`].
    fn buffers(&self, peer: usize) -> CallBuffers;
    /// Publish this rank's progress counter (monotonic over the communicator's life).
    fn set_progress(&self, value: u64);
    /// Wait until `peer`'s progress counter reaches `value`; `phase` names what is awaited in a
    /// `Timeout` error.
    fn wait_progress(&self, site: Site, peer: usize, value: u64, phase: &'static str)
        -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Collective;

    fn check(sends: &[usize], recvs: &[usize]) -> std::result::Result<(), String> {
        let site = Site {
            collective: Collective::AllReduce,
            rank: 1,
            call: 0,
        };
        let data = [0u8; 1];
        let mut dst = [[0u8; 1]; 8];
        let sends: Vec<SendOp<'_>> = sends
            .iter()
            .map(|&peer| SendOp { peer, data: &data })
            .collect();
        let recvs: Vec<RecvOp<'_>> = recvs
            .iter()
            .zip(dst.iter_mut())
            .map(|(&peer, d)| RecvOp {
                peer,
                dst: d,
                mode: RecvMode::Copy,
            })
            .collect();
        check_peers(site, 1, 4, &sends, &recvs).map_err(|e| e.to_string())
    }

    #[test]
    fn exchange_peers_are_checked_in_any_order() {
        assert!(check(&[0, 2, 3], &[0, 2, 3]).is_ok());
        assert!(check(&[3, 0, 2], &[2, 0]).is_ok());
        assert!(check(&[4], &[]).unwrap_err().contains("rank 4: not a peer"));
        assert!(check(&[], &[1]).unwrap_err().contains("rank 1: not a peer"));
        assert!(check(&[3, 0, 3], &[])
            .unwrap_err()
            .contains("two sends to rank 3"));
        assert!(check(&[0], &[2, 2])
            .unwrap_err()
            .contains("two receives from rank 2"));
    }
}
