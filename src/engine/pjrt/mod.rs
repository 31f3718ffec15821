//! PJRT programs on `xla:N` ranks: every rank's host buffer staged to its device, one program
//! over the group's devices, the results staged back (the client's host-staged path). Reduce
//! and gather, which PJRT lacks, are an all-reduce and an all-gather whose root keeps its
//! result.

mod collective;

use crate::device::pjrt::Client;
use crate::error::{Collective, Error, Result, Site};
use crate::transport::CallBuffers;

use super::{GroupCall, GroupEngine};

/// The PJRT engine of a group whose rank r is the client's device r.
pub(crate) struct Pjrt {
    pub(crate) client: Client,
}

/// Bytes aligned for any element type, for staging copies.
struct Scratch(Vec<u128>, usize);

impl Scratch {
    fn of(bytes: &[u8]) -> Scratch {
        let mut v = vec![0u128; bytes.len().div_ceil(16)];
        bytemuck::cast_slice_mut::<u128, u8>(&mut v)[..bytes.len()].copy_from_slice(bytes);
        Scratch(v, bytes.len())
    }
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.0)[..self.1]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.0)[..self.1]
    }
}

/// # Safety
///
/// `b`'s input is valid for reading for `input_len` bytes during the call.
unsafe fn input<'a>(b: &CallBuffers) -> &'a [u8] {
    // SAFETY: as the caller promises; a published buffer is never null.
    unsafe { std::slice::from_raw_parts(b.input, b.input_len) }
}

/// # Safety
///
/// `b`'s output is valid for writing for `output_len` bytes, and nothing else touches it.
unsafe fn output<'a>(b: &CallBuffers) -> &'a mut [u8] {
    // SAFETY: as the caller promises.
    unsafe { std::slice::from_raw_parts_mut(b.output, b.output_len) }
}

impl GroupEngine for Pjrt {
    fn run(&self, _site: Site, c: &GroupCall, bufs: &[CallBuffers]) -> Result<()> {
        let d = c.dtype;
        // SAFETY (every input/output below): the ranks published these buffers for this call,
        // and wait until this rank has finished with them; each rank's are its own.
        match c.collective {
            Collective::AllReduce => {
                let mut outs: Vec<&mut [u8]> = bufs
                    .iter()
                    .map(|b| unsafe {
                        let o = output(b);
                        if !std::ptr::eq(b.input, b.output) {
                            o.copy_from_slice(input(b));
                        }
                        o
                    })
                    .collect();
                self.client.all_reduce_raw(d, &mut outs, c.op)
            }
            Collective::Broadcast => {
                let mut outs: Vec<&mut [u8]> = bufs.iter().map(|b| unsafe { output(b) }).collect();
                self.client.broadcast_raw(d, &mut outs, c.root)
            }
            Collective::AllGather => {
                // In place, a rank's input lies inside its output: stage the inputs first.
                let ins: Vec<Scratch> = bufs
                    .iter()
                    .map(|b| Scratch::of(unsafe { input(b) }))
                    .collect();
                let ins: Vec<&[u8]> = ins.iter().map(Scratch::bytes).collect();
                let mut outs: Vec<&mut [u8]> = bufs.iter().map(|b| unsafe { output(b) }).collect();
                self.client.all_gather_raw(d, &ins, &mut outs)
            }
            Collective::ReduceScatter => {
                let ins: Vec<&[u8]> = bufs.iter().map(|b| unsafe { input(b) }).collect();
                let mut outs: Vec<&mut [u8]> = bufs.iter().map(|b| unsafe { output(b) }).collect();
                self.client.reduce_scatter_raw(d, &ins, &mut outs, c.op)
            }
            Collective::Reduce => {
                // PJRT has no reduce: all-reduce copies of the inputs, keep the root's.
                let mut tmp: Vec<Scratch> = bufs
                    .iter()
                    .map(|b| Scratch::of(unsafe { input(b) }))
                    .collect();
                let mut views: Vec<&mut [u8]> = tmp.iter_mut().map(Scratch::bytes_mut).collect();
                self.client.all_reduce_raw(d, &mut views, c.op)?;
                let root = &bufs[c.root];
                if root.output.is_null() {
                    return Err(Error::config("reduce: the root published no output"));
                }
                unsafe { output(root) }.copy_from_slice(tmp[c.root].bytes());
                Ok(())
            }
            Collective::AllToAll => {
                let ins: Vec<&[u8]> = bufs.iter().map(|b| unsafe { input(b) }).collect();
                let mut outs: Vec<&mut [u8]> = bufs.iter().map(|b| unsafe { output(b) }).collect();
                self.client.all_to_all_raw(d, &ins, &mut outs)
            }
            Collective::Gather => {
                let ins: Vec<&[u8]> = bufs.iter().map(|b| unsafe { input(b) }).collect();
                let root = &bufs[c.root];
                if root.output.is_null() {
                    return Err(Error::config("gather: the root published no output"));
                }
                self.client
                    .gather_raw(d, &ins, c.root, unsafe { output(root) })
            }
            Collective::Barrier => Ok(()),
            // The communicator refuses these before the ranks meet (`GroupEngine::runs`).
            other => Err(crate::error::Error::Unavailable {
                what: format!("{other} on XLA devices"),
                why: format!("their engine runs {XLA_RUNS}"),
            }),
        }
    }

    fn runs(&self, c: Collective) -> bool {
        (c as usize) <= Collective::Barrier as usize
            || matches!(c, Collective::AllToAll | Collective::Gather)
    }

    fn runs_list(&self) -> &'static str {
        XLA_RUNS
    }
}

/// What the PJRT engine runs, as an error message lists it.
const XLA_RUNS: &str =
    "all_reduce, broadcast, all_gather, reduce, reduce_scatter, all_to_all, gather and barrier";
