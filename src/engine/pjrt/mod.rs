//! PJRT programs on `xla:N` ranks: every rank's host buffer staged to its device, one program
//! over the group's devices, the results staged back (the client's host-staged path); or, for
//! the ranks' [`DeviceTensor`]s (all-reduce, broadcast, all-gather), one program over their buffers
//! where they lie, with no copy through host memory. Reduce and gather, which PJRT lacks, are
//! an all-reduce and an all-gather whose root keeps its result; scatter an all-to-all in which
//! the root's blocks alone are read back; the calls with a count per block their equal-block
//! programs over blocks padded to the longest.

mod collective;

use crate::device::pjrt::client::StepBuffers;
use crate::device::pjrt::program::{Combine, Kind, Step};
use crate::device::pjrt::{Client, XlaBuffer};
use crate::device::{DeviceTensor, Storage};
use crate::dtype::DType;
use crate::error::{Collective, Error, Result, Site};
use crate::transport::{CallBuffers, Held};

use super::{GroupCall, GroupEngine};

/// The PJRT engine of a group whose rank r is the client's device r (the client a view of the
/// plugin's, [`Client::subset`], where the ranks are some of its devices).
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

impl Pjrt {
    /// The calls with a count per block (all_gather_v, reduce_scatter_v, all_to_all_v) as
    /// their equal-block programs: every block padded with zeros to the longest, the program
    /// run, each rank's blocks cut back to their counts. The padding is never read back (a
    /// reduction's padded lanes are dropped).
    fn run_padded(&self, site: Site, c: &GroupCall, bufs: &[CallBuffers]) -> Result<()> {
        let (n, esize, d) = (bufs.len(), c.dtype.size(), c.dtype);
        // SAFETY: every rank is inside the call until rank 0 has run it.
        let offsets: Vec<&[usize]> = bufs.iter().map(|b| unsafe { b.offsets() }).collect();
        let want = if c.collective == Collective::AllToAllV {
            2 * (n + 1)
        } else {
            n + 1
        };
        if let Some(r) = offsets.iter().position(|o| o.len() != want) {
            return Err(Error::invalid(
                site,
                format!(
                    "{}: rank {r} published {} block offsets for {n} ranks",
                    c.collective,
                    offsets[r].len()
                ),
            ));
        }
        let len = |o: &[usize], k: usize| o[k + 1] - o[k];
        // (send offsets, receive offsets) of each rank, in elements.
        let lists: Vec<(&[usize], &[usize])> = offsets
            .iter()
            .map(|o| match c.collective {
                Collective::AllToAllV => (&o[..n + 1], &o[n + 1..]),
                _ => (&o[..], &o[..]),
            })
            .collect();
        if c.collective == Collective::AllToAllV {
            for (i, j) in (0..n).flat_map(|i| (0..n).map(move |j| (i, j))) {
                let (sent, expected) = (len(lists[i].0, j), len(lists[j].1, i));
                if sent != expected {
                    return Err(Error::invalid(
                        site,
                        format!(
                            "rank {i} sends {sent} elements to rank {j}, which expects \
                             {expected} from it (send_counts[{j}] of rank {i} against \
                             recv_counts[{i}] of rank {j})"
                        ),
                    ));
                }
            }
        }
        let m = (0..n)
            .flat_map(|r| (0..n).map(move |k| (r, k)))
            .map(|(r, k)| len(lists[r].0, k))
            .max()
            .unwrap_or(0);
        let (block, all) = (m * esize, m * esize * n);
        // Each rank's input blocks, padded: block k of rank r's padded input.
        let padded = |from: &[u8], o: &[usize]| {
            let mut p = Scratch::of(&vec![0u8; all]);
            for k in 0..n {
                let at = o[k] * esize..o[k + 1] * esize;
                p.bytes_mut()[k * block..k * block + at.len()].copy_from_slice(&from[at]);
            }
            p
        };
        // SAFETY (inputs and outputs below): the ranks published these buffers for this call.
        let ins: Vec<Scratch> = match c.collective {
            // Rank r's input is its block r alone.
            Collective::AllGatherV => (0..n)
                .map(|r| {
                    let mut p = Scratch::of(&vec![0u8; block]);
                    let x = unsafe { input(&bufs[r]) };
                    p.bytes_mut()[..x.len()].copy_from_slice(x);
                    p
                })
                .collect(),
            _ => (0..n)
                .map(|r| padded(unsafe { input(&bufs[r]) }, lists[r].0))
                .collect(),
        };
        let out_len = if c.collective == Collective::ReduceScatterV {
            block
        } else {
            all
        };
        let mut outs: Vec<Scratch> = (0..n).map(|_| Scratch::of(&vec![0u8; out_len])).collect();
        if m > 0 {
            let ins: Vec<&[u8]> = ins.iter().map(Scratch::bytes).collect();
            let mut views: Vec<&mut [u8]> = outs.iter_mut().map(Scratch::bytes_mut).collect();
            match c.collective {
                Collective::AllGatherV => self.client.all_gather_raw(d, &ins, &mut views)?,
                Collective::ReduceScatterV => {
                    self.client
                        .reduce_scatter_in(d, &ins, &mut views, c.op, c.deterministic)?
                }
                _ => self.client.all_to_all_raw(d, &ins, &mut views)?,
            }
        }
        for (r, (b, got)) in bufs.iter().zip(&outs).enumerate() {
            let out = unsafe { output(b) };
            let recv = lists[r].1;
            match c.collective {
                // Rank r's own block of the reduction, cut to its count.
                Collective::ReduceScatterV => {
                    out.copy_from_slice(&got.bytes()[..len(recv, r) * esize]);
                }
                // Block k of the result: rank k's (what rank k sent to this rank).
                _ => {
                    for k in 0..n {
                        let at = recv[k] * esize..recv[k + 1] * esize;
                        let l = at.len();
                        out[at].copy_from_slice(&got.bytes()[k * block..k * block + l]);
                    }
                }
            }
        }
        Ok(())
    }

    /// `c` over the ranks' tensors ([`CallBuffers::held`]), where they lie: one program over
    /// their PJRT buffers, whose results the tensors hold afterwards (for an update, the
    /// variable's copies at `output`).
    fn run_held(&self, site: Site, c: &GroupCall, bufs: &[CallBuffers]) -> Result<()> {
        if c.deterministic && matches!(bufs[0].held, Held::Step | Held::Update(_)) {
            // Their programs fuse the sum with the step or update: not in rank order.
            return Err(Error::invalid(
                site,
                "deterministic mode (TUTTI_DETERMINISTIC): an update or optimizer step fused \
                 with its sum does not reduce in rank order on XLA devices; turn the mode off, \
                 or all-reduce the gradients first",
            ));
        }
        // SAFETY: each rank published its own tensors, which it holds (its output borrowed
        // mutably) until every rank has left the call; rank 0 runs the call for all of them.
        let mut outs: Vec<&mut DeviceTensor> = bufs
            .iter()
            .map(|b| unsafe { &mut *b.output.cast::<DeviceTensor>() })
            .collect();
        if bufs[0].held == Held::Step {
            // SAFETY: as above; a step's input is the rank's `StepArgs`, borrowed mutably by
            // the rank for the call.
            let args: Vec<&mut StepArgs<'_>> = bufs
                .iter()
                .map(|b| unsafe { &mut *b.input.cast_mut().cast::<StepArgs<'_>>() })
                .collect();
            return self.run_step(site, &mut outs, args);
        }
        fn on_device<'a>(site: Site, ts: &[&'a DeviceTensor]) -> Result<Vec<&'a XlaBuffer>> {
            ts.iter()
                .enumerate()
                .map(|(r, t)| buffer_of(site, r, t, "tensor"))
                .collect()
        }
        let results = {
            let copies: Vec<&DeviceTensor> = outs.iter().map(|t| &**t).collect();
            let copies = on_device(site, &copies)?;
            let combine = match c.collective {
                Collective::Broadcast => Combine::From(c.root),
                _ => Combine::Reduce(c.op),
            };
            match (bufs[0].held, c.collective) {
                (Held::Update(apply), _) => {
                    // SAFETY: as above; an update's input is the rank's update tensor, which
                    // it does not change during the call.
                    let ins: Vec<&DeviceTensor> = bufs
                        .iter()
                        .map(|b| unsafe { &*b.input.cast::<DeviceTensor>() })
                        .collect();
                    self.client.update_buffers(
                        Kind::Update { combine, apply },
                        &copies,
                        &on_device(site, &ins)?,
                    )?
                }
                (_, Collective::AllReduce) if c.deterministic => {
                    self.client.all_reduce_buffers_ordered(&copies, c.op)?
                }
                (_, Collective::AllReduce) => self.client.all_reduce_buffers(&copies, c.op)?,
                (_, Collective::Broadcast) => self.client.broadcast_buffers(&copies, c.root)?,
                (_, Collective::AllGather) => self.client.all_gather_buffers(&copies)?,
                (_, other) => {
                    return Err(Error::invalid(
                        site,
                        format!("{other} does not run on tensors on XLA devices"),
                    ))
                }
            }
        };
        for (t, out) in outs.iter_mut().zip(results) {
            t.replace(DeviceTensor::from(out));
        }
        Ok(())
    }
}

/// Rank `r`'s tensor `t` (its `what`) as the PJRT buffer it is on rank r's device; in host
/// memory, the call's error saying so.
fn buffer_of<'t>(site: Site, r: usize, t: &'t DeviceTensor, what: &str) -> Result<&'t XlaBuffer> {
    match t.storage() {
        Storage::Xla(b) => Ok(b),
        Storage::Host(_) => Err(Error::invalid(
            site,
            format!("rank {r}'s {what} is in host memory, not on its XLA device"),
        )),
    }
}

/// A rank's part of an optimizer step fused with its gradients' sum ([`Held::Step`]): its
/// gradient is the call's tensor; these are the rest.
pub(crate) struct StepArgs<'a> {
    /// The rule, as the program steps by it (every rank's the same).
    pub(crate) step: Step,
    /// The rank's copy of the variable, replaced by the stepped one.
    pub(crate) copy: &'a mut DeviceTensor,
    /// The learning rate, on the rank's device.
    pub(crate) lr: &'a XlaBuffer,
    /// The rule's state on the rank's device (slots, then Adam's powers), replaced by the
    /// state after the step.
    pub(crate) state: &'a mut Vec<DeviceTensor>,
    /// Adam's steps taken by `state`, counted with it (by rank 0, which runs the step for
    /// every rank, even one that stopped waiting for it).
    pub(crate) steps: &'a mut u32,
}

impl Pjrt {
    /// Every rank's step fused with the gradients' sum, in one program over their buffers
    /// ([`Client::run_group_step`]); each rank's gradient becomes the sum, its copy and state
    /// the stepped ones.
    fn run_step(
        &self,
        site: Site,
        grads: &mut [&mut DeviceTensor],
        mut args: Vec<&mut StepArgs<'_>>,
    ) -> Result<()> {
        let step = args[0].step;
        if let Some(r) = args.iter().position(|a| a.step != step) {
            return Err(Error::invalid(
                site,
                format!(
                    "rank 0 steps by {step:?} but rank {r} by {:?}; every rank of an XLA group \
                     steps by one rule",
                    args[r].step
                ),
            ));
        }
        let mut steps = Vec::with_capacity(args.len());
        for (r, (a, g)) in args.iter().zip(grads.iter()).enumerate() {
            let mut state = Vec::with_capacity(a.state.len());
            for t in a.state.iter() {
                state.push(buffer_of(site, r, t, "optimizer state")?);
            }
            steps.push(StepBuffers {
                w: buffer_of(site, r, a.copy, "copy of the variable")?,
                g: buffer_of(site, r, g, "gradient")?,
                lr: a.lr,
                state,
            });
        }
        let Some(results) = self.client.run_group_step(step, &steps)? else {
            // The replicas chose this form from the route as it was: set it between steps.
            return Err(Error::invalid(
                site,
                "the XLA client's route was set to host-staged while the replicas stepped \
                 (set it between steps)",
            ));
        };
        drop(steps);
        for ((g, a), res) in grads.iter_mut().zip(args.iter_mut()).zip(results) {
            g.replace(DeviceTensor::from(res.g));
            a.copy.replace(DeviceTensor::from(res.w));
            *a.state = res.state.into_iter().map(DeviceTensor::from).collect();
            if step.powers() {
                *a.steps = a.steps.saturating_add(1);
            }
        }
        Ok(())
    }
}

impl GroupEngine for Pjrt {
    fn splits(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    fn subgroup(&self, ranks: &[usize]) -> Result<std::sync::Arc<dyn GroupEngine>> {
        Ok(std::sync::Arc::new(Pjrt {
            client: self.client.subset(ranks)?,
        }))
    }

    fn xla_client(&self) -> Option<Client> {
        Some(self.client.clone())
    }

    fn run(&self, site: Site, c: &GroupCall, bufs: &[CallBuffers]) -> Result<()> {
        // Every rank passes a tensor, or every rank host memory: never a mix, which would read
        // one as the other.
        let held = bufs.first().map_or(Held::Bytes, |b| b.held);
        if let Some(r) = bufs.iter().position(|b| b.held != held) {
            let what = |h: Held| match h {
                Held::Bytes => "host memory",
                Held::Tensor => "a tensor on its device",
                Held::Update(_) => "an update of a variable",
                Held::Step => "an optimizer step",
            };
            return Err(Error::invalid(
                site,
                format!(
                    "rank 0 passes {} but rank {r} passes {}; every rank of an XLA group passes \
                     the same kind",
                    what(held),
                    what(bufs[r].held)
                ),
            ));
        }
        if held != Held::Bytes {
            return self.run_held(site, c, bufs);
        }
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
                self.client
                    .all_reduce_in(d, &mut outs, c.op, c.deterministic)
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
                self.client
                    .reduce_scatter_in(d, &ins, &mut outs, c.op, c.deterministic)
            }
            Collective::Reduce => {
                // PJRT has no reduce: all-reduce copies of the inputs, keep the root's.
                let mut tmp: Vec<Scratch> = bufs
                    .iter()
                    .map(|b| Scratch::of(unsafe { input(b) }))
                    .collect();
                let mut views: Vec<&mut [u8]> = tmp.iter_mut().map(Scratch::bytes_mut).collect();
                self.client
                    .all_reduce_in(d, &mut views, c.op, c.deterministic)?;
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
            Collective::Scatter => {
                // An all-to-all in which only the root's blocks are real: rank r's block from
                // the root is block r of the root's input.
                let n = bufs.len();
                let root = &bufs[c.root];
                let block = bufs.iter().map(|b| b.output_len).max().unwrap_or(0);
                if root.input_len != block * n || bufs.iter().any(|b| b.output_len != block) {
                    return Err(Error::invalid(
                        site,
                        format!(
                            "scatter: the root's {} bytes are not {n} blocks of every rank's \
                             output ({block} bytes)",
                            root.input_len
                        ),
                    ));
                }
                let zeros = Scratch::of(&vec![0u8; block * n]);
                let ins: Vec<&[u8]> = (0..n)
                    .map(|r| {
                        if r == c.root {
                            unsafe { input(&bufs[r]) }
                        } else {
                            zeros.bytes()
                        }
                    })
                    .collect();
                let mut tmp: Vec<Scratch> =
                    (0..n).map(|_| Scratch::of(&vec![0u8; block * n])).collect();
                let mut views: Vec<&mut [u8]> = tmp.iter_mut().map(Scratch::bytes_mut).collect();
                if block > 0 {
                    self.client.all_to_all_raw(d, &ins, &mut views)?;
                }
                for (b, t) in bufs.iter().zip(&tmp) {
                    unsafe { output(b) }
                        .copy_from_slice(&t.bytes()[c.root * block..(c.root + 1) * block]);
                }
                Ok(())
            }
            Collective::AllGatherV | Collective::ReduceScatterV | Collective::AllToAllV => {
                self.run_padded(site, c, bufs)
            }
            Collective::Barrier => Ok(()),
            // The communicator refuses these before the ranks meet (`GroupEngine::runs`).
            other => Err(crate::error::Error::Unavailable {
                what: format!("{other} on XLA devices"),
                why: format!("their engine runs {XLA_RUNS}"),
            }),
        }
    }

    fn pairs_on_host(&self) -> bool {
        // The ranks' buffers are host memory: a pair's bytes need no program.
        true
    }

    fn runs(&self, c: Collective) -> bool {
        (c as usize) <= Collective::Barrier as usize
            || matches!(
                c,
                Collective::Send
                    | Collective::Recv
                    | Collective::SendRecv
                    | Collective::AllToAll
                    | Collective::Gather
                    | Collective::Scatter
                    | Collective::AllGatherV
                    | Collective::ReduceScatterV
                    | Collective::AllToAllV
            )
    }

    fn runs_list(&self) -> &'static str {
        XLA_RUNS
    }

    fn orders(&self, c: Collective) -> bool {
        // All-reduce gathers and reduce-scatter exchanges every input, then one chain of the
        // op runs over them in rank order (see the program module); reduce is an all-reduce.
        matches!(
            c,
            Collective::AllReduce
                | Collective::ReduceScatter
                | Collective::ReduceScatterV
                | Collective::Reduce
        )
    }

    fn place(&self, rank: usize, dtype: DType, bytes: &[u8]) -> Result<DeviceTensor> {
        self.client
            .upload_bytes(bytes, dtype, rank)
            .map(DeviceTensor::from)
    }

    fn check_tensor(&self, rank: usize, t: &DeviceTensor) -> std::result::Result<(), String> {
        let device = self
            .client
            .devices()
            .get(rank)
            .map_or(usize::MAX, |d| d.index);
        match t.storage() {
            Storage::Host(_) => Err(format!(
                "rank {rank} is on xla:{device}, whose tensors are on the device, but {t:?} is \
                 in host memory; make tensors with the rank's communicator (Communicator::place, \
                 ReplicaContext::place)"
            )),
            Storage::Xla(b) if !b.same_client(&self.client) => Err(format!(
                "{t:?} belongs to another XLA client than rank {rank}'s group (a tensor placed \
                 by one group's communicator serves that group's calls only)"
            )),
            Storage::Xla(b) if b.device() != rank => {
                Err(format!("{t:?} is not on rank {rank}'s device xla:{device}"))
            }
            Storage::Xla(_) => Ok(()),
        }
    }

    fn runs_held(&self, c: Collective, held: Held) -> bool {
        match held {
            Held::Bytes => false,
            Held::Tensor => matches!(
                c,
                Collective::AllReduce | Collective::Broadcast | Collective::AllGather
            ),
            Held::Update(_) => matches!(c, Collective::AllReduce | Collective::Broadcast),
            Held::Step => c == Collective::AllReduce,
        }
    }
}

/// What the PJRT engine runs, as an error message lists it.
const XLA_RUNS: &str = "all_reduce, broadcast, all_gather, reduce, reduce_scatter, all_to_all, \
                        gather, scatter, all_gather_v, reduce_scatter_v, all_to_all_v, barrier \
                        and point-to-point (send, recv, send_recv)";
