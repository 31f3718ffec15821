//! `tutti perf --device gpu`: the collectives over `-n` GPUs (or, when the machine has fewer,
//! `-n` logical GPUs split evenly over them), measured and checked like the CPU rows.
//!
//! For each size every device's buffers are filled with the test pattern, the collective runs
//! once and every device's result is compared with the reference, then the timed calls run on
//! the device-resident buffers (host copies are not in the timed loop, as in nccl-tests). A call
//! returns when every device is done, so the wall-clock time per call is the collective's.
//!
//! `mem_ratio` on GPUs is the least memory traffic of the collective per second over the
//! device-to-device copy bandwidth measured in the same run ([`crate::gpu::device_copy_gbps`]) times the
//! number of physical GPUs in use: 1.0 means the collective moves its bytes as fast as a plain
//! copy would.

use super::{
    device_measures, fresh, measure, offsets, sizes, wrong_elements, Bench, Options, Row, RowOf,
    Shape,
};
use crate::device::DeviceKind;
use crate::dtype::Element;
use crate::engine::cuda::Blocks;
use crate::error::{Collective, Error, Result};
use crate::gpu::{replica_devices, GpuAlgorithm, GpuBuffer, GpuGroup};

/// Run the sweep of `opts` (`opts.ranks` GPUs or logical GPUs) with `algorithm`, calling
/// `emit` with each row; `copy_gbps` is [`crate::gpu::device_copy_gbps`] of this run.
pub fn run(
    opts: &Options,
    algorithm: GpuAlgorithm,
    copy_gbps: f64,
    emit: &(dyn Fn(&Row) + Sync),
) -> Result<Vec<Row>> {
    if opts.collective == Collective::Barrier {
        return Err(Error::config(
            "perf measures data collectives; barrier moves no bytes",
        ));
    }
    // Before any device is touched: what GPU ranks do not run.
    device_measures(DeviceKind::Gpu, opts.collective)?;
    if opts.ranks == 0 {
        return Err(Error::config("perf needs at least one GPU (-n)"));
    }
    let devices = replica_devices(opts.ranks)?;
    let group = GpuGroup::new(&devices, algorithm, &opts.config)?;
    let mut physical: Vec<usize> = devices.iter().map(|d| d.physical()).collect();
    physical.sort_unstable();
    physical.dedup();
    let bandwidth = copy_gbps * physical.len() as f64;
    opts.check_root(opts.ranks)?;
    let mut rows = Vec::new();
    for bytes in sizes(opts.min_bytes, opts.max_bytes, opts.factor) {
        for &in_place in opts.placement.runs() {
            let opts = opts.run_of(in_place);
            let row = crate::for_each_dtype!(opts.dtype, T => {
                one_size::<T>(&group, &opts, bandwidth, bytes)?
            });
            if let Some(row) = row {
                emit(&row);
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

/// One size on every device of the group, driven from this thread. The call's addresses are
/// worked out once, not in the timed loop.
struct GpuBench<'a, T: Element> {
    group: &'a GpuGroup,
    opts: &'a Options,
    /// Owns the input buffers that `send` points into.
    _input: Vec<GpuBuffer<T>>,
    output: Vec<GpuBuffer<T>>,
    send: Vec<u64>,
    recv: Vec<u64>,
    /// Elements per rank, as `GpuGroup::execute` counts them.
    n: usize,
    /// The blocks of the `-v` forms.
    blocks: Option<Blocks>,
    /// The row's count (see [`wrong_elements`]).
    count: usize,
}

impl<'a, T: Element> GpuBench<'a, T> {
    /// In place the call uses the output buffers only (all-gather: its own slice as input);
    /// off the root a reduce receives nothing.
    fn new(
        group: &'a GpuGroup,
        opts: &'a Options,
        shape: &Shape,
        input: Vec<GpuBuffer<T>>,
        output: Vec<GpuBuffer<T>>,
    ) -> GpuBench<'a, T> {
        let c = opts.collective;
        let p = output.len();
        let es = T::DTYPE.size();
        let ptrs = |v: &[GpuBuffer<T>]| -> Vec<u64> { v.iter().map(|x| x.device_ptr()).collect() };
        let out = ptrs(&output);
        let send = match c {
            _ if !(opts.in_place() || c == Collective::Broadcast) => ptrs(&input),
            Collective::AllGather => out
                .iter()
                .enumerate()
                .map(|(r, &o)| o + (r * shape.in_len(r) * es) as u64)
                .collect(),
            Collective::ReduceScatter => ptrs(&input),
            _ => out.clone(),
        };
        let recv = out
            .into_iter()
            .enumerate()
            .map(|(r, o)| {
                if matches!(c, Collective::Reduce | Collective::Gather) && r != opts.root {
                    0
                } else {
                    o
                }
            })
            .collect();
        let n = match c {
            Collective::AllGather => shape.in_len(0),
            Collective::ReduceScatter
            | Collective::AllToAll
            | Collective::Gather
            | Collective::Scatter => shape.count / p,
            _ => shape.count,
        };
        // The `-v` forms' counts as the group takes them: all-to-all-v's rows are what each
        // rank sends (device k receives column k).
        let blocks = match c {
            Collective::AllGatherV | Collective::ReduceScatterV => {
                let o = offsets(&shape.counts[0]);
                Some(Blocks {
                    send: vec![o.clone(); p],
                    recv: vec![o; p],
                })
            }
            Collective::AllToAllV => Some(Blocks {
                send: shape.counts.iter().map(|row| offsets(row)).collect(),
                recv: (0..p)
                    .map(|k| offsets(&shape.counts.iter().map(|row| row[k]).collect::<Vec<_>>()))
                    .collect(),
            }),
            _ => None,
        };
        GpuBench {
            group,
            opts,
            _input: input,
            output,
            send,
            recv,
            n,
            blocks,
            count: shape.count,
        }
    }
}

impl<T: Element> Bench for GpuBench<'_, T> {
    fn check(&mut self) -> Result<u64> {
        self.call()?;
        let (p, opts) = (self.output.len(), self.opts);
        let mut errors = 0;
        for (r, o) in self.output.iter().enumerate() {
            let got = o.to_host()?;
            let c = opts.collective;
            errors += wrong_elements(c, opts.op, opts.root, p, r, self.count, &got) as u64;
        }
        Ok(errors)
    }

    fn call(&mut self) -> Result<()> {
        let o = self.opts;
        let (send, recv) = (&self.send, &self.recv);
        self.group.execute(
            o.collective,
            T::DTYPE,
            o.op,
            o.root,
            self.n,
            self.blocks.as_ref(),
            send,
            recv,
            &[],
            &[],
        )
    }
}

fn one_size<T: Element>(
    group: &GpuGroup,
    opts: &Options,
    bandwidth: f64,
    bytes: usize,
) -> Result<Option<Row>> {
    let p = group.devices().len();
    let Some(shape) = Shape::of(opts.collective, p, bytes, T::DTYPE) else {
        return Ok(None);
    };
    let (mut input, mut output) = (Vec::with_capacity(p), Vec::with_capacity(p));
    for (r, d) in group.devices().iter().enumerate() {
        let (i, o) = fresh::<T>(opts, &shape, r);
        input.push(GpuBuffer::from_host(d, &i)?);
        output.push(GpuBuffer::from_host(d, &o)?);
    }
    let mut bench = GpuBench::new(group, opts, &shape, input, output);
    let row = RowOf {
        opts,
        algo: group.algorithm().to_string(),
        ranks: p,
        dtype: T::DTYPE,
        count: shape.count,
        bandwidth: Some(bandwidth),
    };
    measure(&mut bench, row).map(Some)
}
