//! `Communicator::shrink`: the survivors of a lost rank go on, without restarting (NCCL's
//! `ncclCommShrink`, ULFM's `MPIX_Comm_shrink`). The survivors find each other and agree on who
//! they are over connections of their own (see `transport::shrink`).

use std::time::Instant;

use super::Communicator;
use crate::device::DeviceKind;
use crate::error::{Error, Result};
use crate::transport::Regroup;

impl Communicator {
    /// A new communicator of the ranks of this one that are still alive, renumbered in this
    /// one's rank order (the lowest survivor is rank 0), with this one's settings: how the
    /// survivors go on after a call failed with [`Error::PeerLost`] (or [`Error::Aborted`],
    /// [`Error::Timeout`] naming a lost rank) without restarting their processes.
    ///
    /// Every surviving rank calls it. It first aborts this communicator (whose calls then fail
    /// on every rank that still runs one, so that every survivor learns to shrink), then the
    /// survivors find each other and agree on who they are within the timeout: each reaches
    /// every other on the port it listened on when it joined, and a rank counts as alive when
    /// it answers by the deadline. A rank that is alive but does not call `shrink` within the
    /// timeout is left out (its own late shrink fails). The survivors must all have made the
    /// same set of ranks, else each fails with an error naming two views; calling `shrink`
    /// again then retries.
    ///
    /// With no rank lost it re-forms the group: after a rank's rejection of its own arguments or
    /// a mismatch found in the data aborted this communicator (between processes under the
    /// default check), every rank calls it and gets a communicator of all of them, in the same
    /// rank order.
    ///
    /// What the lost rank held is gone: the survivors restore the state of the training from
    /// one of them (broadcast the weights, the optimizer's state and the step from the new
    /// rank 0) and repeat the step that failed, since it may have completed on some survivors
    /// and not on others.
    ///
    /// A rank not known to be gone (its port did not refuse) that does not answer within the
    /// timeout is silent (stuck, or out of reach); the survivors must outnumber the silent
    /// ranks, else the shrink fails: two halves cut apart never both go on. With silent ranks
    /// a shrink takes the timeout, then at most as long again to agree and connect; a survivor
    /// that stops answering during the agreement is given up after two timeouts.
    ///
    /// Processes over tcp and shared memory (host buffers). A group of threads, a device group
    /// or GPU ranks, and the MPI transport (which would need ULFM) give
    /// [`Error::Unavailable`]. One thread of a rank shrinks at a time.
    pub fn shrink(&self) -> Result<Communicator> {
        let shared = self.progress.shared();
        let unavailable = |why: &str| Error::Unavailable {
            what: format!("shrink of {} ranks", self.device_spec()),
            why: why.into(),
        };
        if shared.engine.is_some() {
            return Err(unavailable(
                "a communicator whose calls run on a device engine (GPU ranks, NCCL, XLA \
                 devices) cannot shrink yet: a device group's ranks live and fail in one \
                 process, and a GPU rank's engine would need its NCCL communicator shrunk too",
            ));
        }
        match shared.transport.regroup() {
            Some(Regroup::Threads(_)) => {
                return Err(unavailable(
                    "a group of threads lives and fails in one process: make a new group",
                ))
            }
            #[cfg(feature = "mpi")]
            Some(Regroup::Mpi(_)) => {
                return Err(unavailable(
                    "shrinking an MPI communicator needs ULFM (MPIX_Comm_shrink), which tutti's \
                     MPI transport does not use; run the job over tcp or shm to shrink it",
                ))
            }
            _ => {}
        }
        let deadline = Instant::now() + self.timeout();
        if self.aborted().is_none() {
            self.abort(&format!(
                "rank {} shrinks this communicator: its survivors go on in a new one",
                self.rank()
            ));
        }
        let transport = match shared.transport.shrink(deadline) {
            Some(t) => t?,
            None => return Err(unavailable("this transport cannot shrink")),
        };
        let config = self.settings();
        let c = Communicator::with_engine(transport, &config, None, (DeviceKind::Cpu, 0));
        log::info!(
            "shrink: rank {} of {} is rank {} of {}",
            self.rank(),
            self.world_size(),
            c.rank(),
            c.world_size()
        );
        Ok(c)
    }
}
