//! Engines: what runs a call once the communicator has checked it and the ranks have met.
//!
//! - **Host**: the algorithms of [`crate::algorithm`] over the communicator's transport, run by
//!   every rank (threads, shared memory, TCP). That engine lives in `comm`, which hands the
//!   algorithm its context.
//! - **Group engines** ([`GroupEngine`]): several devices of one process are several ranks of
//!   one group (as `ncclCommInitAll`); a call runs once for the whole group, on rank 0's thread,
//!   over the buffers every rank published when it met the others:
//!   - [`pjrt`]: PJRT programs on `xla:N` ranks (compiled once per call shape, cached), over
//!     host memory staged to the devices, or over the ranks' [`DeviceTensor`]s where they lie;
//!   - [`cuda`] (feature `cuda`): NCCL or the CUDA copy algorithms on `cuda:N` ranks, over
//!     device memory.
//!
//! An engine never checks arguments, times calls or aborts on its own account: the
//! communicator did the checks, and its transport bounds every wait and carries aborts, so
//! every device gives the same errors for the same mistakes.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "xla")]
pub(crate) mod pjrt;

use crate::call::RawPeerOp;
use crate::device::DeviceTensor;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Collective, Result, Site};
use crate::transport::{CallBuffers, Held};

/// The collectives a CUDA group runs (feature `cuda`): every device library's, and the
/// personalized ones and those with a count per block (NCCL's grouped sends and receives;
/// copies between logical GPUs). Here, not in `cuda`, so that a build without CUDA says the
/// same (`tutti perf`).
pub(crate) fn cuda_runs(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllReduce
            | Collective::Broadcast
            | Collective::AllGather
            | Collective::Reduce
            | Collective::ReduceScatter
            | Collective::Barrier
            | Collective::AllToAll
            | Collective::Gather
            | Collective::Scatter
            | Collective::AllToAllV
            | Collective::AllGatherV
            | Collective::ReduceScatterV
    )
}

/// What [`cuda_runs`] takes, as an error message lists it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const CUDA_RUNS: &str =
    "all_reduce, broadcast, all_gather, reduce, reduce_scatter, all_to_all, all_to_all_v, \
     gather, scatter, all_gather_v, reduce_scatter_v and barrier";

/// What a CUDA rank of a job of one rank per process runs: [`CUDA_RUNS`] but all_to_all_v.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const CUDA_RUNS_PER_RANK: &str =
    "all_reduce, broadcast, all_gather, reduce, reduce_scatter, all_to_all, gather, scatter, \
     all_gather_v, reduce_scatter_v and barrier (all_to_all_v runs on a group of one \
     process's GPUs, or on host buffers)";

/// A checked call, as a group engine sees it. Counts as in [`crate::RawCall`].
#[derive(Copy, Clone, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct GroupCall {
    pub collective: Collective,
    pub dtype: DType,
    pub count: usize,
    pub op: ReduceOp,
    pub root: usize,
    /// The communicator's bitwise-deterministic mode: reduce in rank order
    /// ([`GroupEngine::orders`] says for which collectives the engine can; only XLA's reads
    /// it, the others refuse the mode before the call reaches them).
    #[cfg_attr(not(feature = "xla"), allow(dead_code))]
    pub deterministic: bool,
}

/// A call issued on a caller's device stream: the work queued there before the call (an event
/// recorded there), which the call's device work waits for; and the event the call's device
/// work records once queued, which the caller's stream then waits for (work queued there after
/// the call is ordered after it). The call's handle holds it until the call completes.
pub(crate) trait StreamMark: Send + Sync {
    /// The handle published with the call's buffers ([`CallBuffers::after`]).
    fn raw(&self) -> u64;
    /// The end event ([`CallBuffers::end`]).
    fn end(&self) -> u64;
    /// The caller's stream.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn stream(&self) -> u64;
}

/// Runs a call once for every rank of a group of this process's devices, or (`per_rank`) each
/// rank's own part of a call that spans processes (one NCCL rank per process).
pub(crate) trait GroupEngine: Send + Sync {
    /// True when every rank runs its own part of each call with its own buffers (the engine's
    /// group spans processes); false when rank 0 runs the whole call for every rank.
    fn per_rank(&self) -> bool {
        false
    }
    /// Run `call` over every rank's buffers (`bufs[r]` is rank r's, published when the ranks
    /// met: `input` equals `output` in place; `output` is null off the root of a reduce).
    fn run(&self, site: Site, call: &GroupCall, bufs: &[CallBuffers]) -> Result<()>;

    /// Whether this engine runs collective `c`. The group engines run the collectives every
    /// device library has (all-reduce, broadcast, all-gather, reduce, reduce-scatter, barrier);
    /// the communicator makes any other an argument error of the call, raised before the ranks
    /// meet, naming the device.
    fn runs(&self, c: Collective) -> bool {
        (c as usize) <= Collective::Barrier as usize
    }

    /// Whether this engine reduces `c` in rank order, with the bits of tutti's kernels, when a
    /// call is [`GroupCall::deterministic`]. The communicator refuses a reducing call of the
    /// deterministic mode on an engine that cannot, naming the device.
    fn orders(&self, c: Collective) -> bool {
        let _ = c;
        false
    }

    /// The collectives [`GroupEngine::runs`] takes, as an error message lists them.
    fn runs_list(&self) -> &'static str {
        "all_reduce, broadcast, all_gather, reduce, reduce_scatter and barrier"
    }

    /// Why this engine cannot run the reduce op `op` (on a type it is defined on), if it
    /// cannot: NCCL has no bitwise ops. The communicator makes it an argument error of the
    /// call, raised before the ranks meet, like its own checks.
    fn op_unavailable(&self, op: ReduceOp) -> Option<String> {
        let _ = op;
        None
    }

    /// The PJRT client whose devices this engine's ranks are on, for an XLA group.
    #[cfg(feature = "xla")]
    fn xla_client(&self) -> Option<crate::device::pjrt::Client> {
        None
    }

    /// Mark the work queued so far on `stream`, a stream of rank `rank`'s device, for a call
    /// being issued to wait for. Engines whose devices have no streams refuse.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of that device (for CUDA, 0 is the legacy default stream).
    unsafe fn mark_stream(&self, rank: usize, stream: u64) -> Result<Box<dyn StreamMark>> {
        let _ = stream;
        Err(crate::error::Error::config(format!(
            "rank {rank}'s group orders no work on device streams (its buffers are host \
             memory): only cuda:N ranks with device buffers take a CUDA stream"
        )))
    }

    /// Make the caller's stream of `mark` (rank `rank`'s) wait for the device work of the call
    /// that just ran with it (its end event). Called on the thread that issued the call.
    ///
    /// # Safety
    ///
    /// The mark's stream is still live (as promised to `mark_stream`).
    unsafe fn order_stream(&self, rank: usize, mark: &dyn StreamMark) -> Result<()> {
        let _ = (rank, mark);
        Ok(())
    }

    /// Take the mark of a call that failed on its own rank: freed once no call of the engine
    /// runs (another rank may still be running the call with it).
    fn retire(&self, mark: Box<dyn StreamMark>) {
        drop(mark)
    }

    /// Whether this engine runs point-to-point calls ([`GroupEngine::pair_exchange`]): an
    /// in-process group of CUDA devices. The communicator refuses them on the others, naming
    /// the device, before anything moves.
    fn runs_pairs(&self) -> bool {
        false
    }

    /// Whether this engine's ranks make their point-to-point calls over the group's transport,
    /// as host ranks do: their buffers are host memory (XLA's, staged to the devices by each
    /// collective), so a pair's bytes move between host buffers and no device is involved.
    fn pairs_on_host(&self) -> bool {
        false
    }

    /// Why rank `rank` cannot use `op`'s buffer in a point-to-point call, if it cannot (not
    /// memory of its device, too short, misaligned): the call's argument error.
    fn check_pair(&self, rank: usize, op: &RawPeerOp) -> std::result::Result<(), String> {
        let _ = (rank, op);
        Ok(())
    }

    /// Run rank `rank`'s point-to-point operations `ops` (checked), each matched with its
    /// peer's in issue order, as [`crate::Communicator::send_recv`] describes; `mark`: the
    /// caller's stream's work before the call, which the data waits for; `aborted`: the
    /// communicator's abort (its reason), which ends every wait.
    fn pair_exchange(
        &self,
        site: Site,
        rank: usize,
        ops: &[RawPeerOp],
        mark: Option<&dyn StreamMark>,
        aborted: &dyn Fn() -> Option<String>,
    ) -> Result<()> {
        let _ = (rank, ops, mark, aborted);
        Err(crate::error::Error::invalid(
            site,
            "point-to-point calls are not available on this device engine",
        ))
    }

    /// A tensor holding `bytes` (whole elements of `dtype`) in rank `rank`'s device memory,
    /// where the engine's collectives on tensors ([`CallBuffers::held`]) take it: a PJRT
    /// buffer on device `rank`. Engines that reduce host memory keep it there.
    fn place(&self, rank: usize, dtype: DType, bytes: &[u8]) -> Result<DeviceTensor> {
        let _ = rank;
        Ok(DeviceTensor::from_bytes(dtype, bytes))
    }

    /// Why rank `rank` cannot pass `t` to a collective on tensors, if it cannot: a tensor on
    /// another device or client, or in host memory where the engine's tensors are on the
    /// devices. The communicator makes it the call's argument error before the ranks meet.
    fn check_tensor(&self, rank: usize, t: &DeviceTensor) -> std::result::Result<(), String> {
        let _ = (rank, t);
        Ok(())
    }

    /// Whether this engine runs collective `c` on tensors it placed ([`GroupEngine::place`]),
    /// where they lie, as `held` says (the tensor in place, or a variable's update). The
    /// communicator refuses the others.
    fn runs_held(&self, c: Collective, held: Held) -> bool {
        let _ = (c, held);
        false
    }

    /// Whether [`GroupEngine::subgroup`] makes groups (XLA's does; GPU groups cannot be split),
    /// or why not: the communicator then refuses a split before the ranks meet.
    fn splits(&self) -> std::result::Result<(), String> {
        Err("this group's engine cannot run a group of some of its ranks".into())
    }

    /// The engine of a group of some of this one's ranks (a split of an in-process group): its
    /// rank i is this engine's rank `ranks[i]`, on the same device, and its calls run apart
    /// from this engine's and any other group's. Engines that cannot make one say why
    /// (`Unavailable`).
    fn subgroup(&self, ranks: &[usize]) -> Result<std::sync::Arc<dyn GroupEngine>> {
        let _ = ranks;
        Err(crate::error::Error::Unavailable {
            what: "split".into(),
            why: self.splits().err().unwrap_or_default(),
        })
    }

    /// Abort the engine's own work (NCCL's communicators), with the communicator.
    fn abort(&self, reason: &str) {
        let _ = reason;
    }

    /// Wait on the host for the device work of a call that ran with rank `rank`'s stream mark
    /// `mark` (its end event): `Ok(true)` once done, `Ok(false)` once `until` passed first.
    /// Past `deadline` (the call's) the error is `Timeout` and the engine is aborted.
    fn stream_done(
        &self,
        site: Site,
        rank: usize,
        mark: &dyn StreamMark,
        until: std::time::Instant,
        deadline: std::time::Instant,
    ) -> Result<bool> {
        let _ = (site, rank, mark, until, deadline);
        Ok(true)
    }
}
