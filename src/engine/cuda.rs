//! NCCL or the CUDA copy algorithms on `cuda:N` ranks: one [`GpuGroup`] call over every rank's
//! device memory (the group's algorithm: NCCL, hierarchical copy or reduction to one device).

use crate::error::{Collective, Result, Site};
use crate::gpu::{DevicePtr, GpuGroup};
use crate::transport::CallBuffers;

use super::{GroupCall, GroupEngine};

/// The CUDA engine of a group whose rank r is the group's device r.
pub(crate) struct Cuda {
    pub(crate) group: GpuGroup,
}

impl GroupEngine for Cuda {
    fn run(&self, _site: Site, c: &GroupCall, bufs: &[CallBuffers]) -> Result<()> {
        if c.collective == Collective::Barrier {
            // The ranks met before the call; there is nothing to move.
            return Ok(());
        }
        let ptr = |device: usize, p: *const u8| DevicePtr {
            device,
            ptr: p as u64,
        };
        let send: Vec<DevicePtr> = bufs
            .iter()
            .enumerate()
            .map(|(r, b)| match c.collective {
                Collective::Broadcast => ptr(r, b.output),
                _ => ptr(r, b.input),
            })
            .collect();
        let recv: Vec<DevicePtr> = bufs
            .iter()
            .enumerate()
            .map(|(r, b)| ptr(r, b.output))
            .collect();
        self.group
            .collective_raw(c.collective, c.dtype, c.count, c.op, c.root, &send, &recv)
    }
}
