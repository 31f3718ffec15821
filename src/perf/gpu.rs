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

use super::{fresh, measure, sizes, wrong_elements, Bench, Options, Row, RowOf, Shape};
use crate::dtype::Element;
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

/// One size on every device of the group, driven from this thread.
struct GpuBench<'a, T: Element> {
    group: &'a GpuGroup,
    opts: &'a Options,
    shape: Shape,
    input: Vec<GpuBuffer<T>>,
    output: Vec<GpuBuffer<T>>,
}

impl<T: Element> Bench for GpuBench<'_, T> {
    fn check(&mut self) -> Result<u64> {
        self.call()?;
        let (p, opts) = (self.output.len(), self.opts);
        let mut errors = 0;
        for (r, o) in self.output.iter().enumerate() {
            let got = o.to_host()?;
            errors += wrong_elements(opts.collective, opts.op, opts.root, p, r, &got) as u64;
        }
        Ok(errors)
    }

    /// One call: in place uses the output buffers only (all-gather: the own slice as input).
    fn call(&mut self) -> Result<()> {
        let (c, opts) = (self.opts.collective, self.opts);
        let p = self.output.len();
        let es = T::DTYPE.size();
        let in_len = self.shape.in_len;
        let out: Vec<u64> = self.output.iter().map(|x| x.device_ptr()).collect();
        let inp: Vec<u64> = if opts.in_place() || c == Collective::Broadcast {
            match c {
                Collective::AllGather => out
                    .iter()
                    .enumerate()
                    .map(|(r, &o)| o + (r * in_len * es) as u64)
                    .collect(),
                Collective::ReduceScatter => self.input.iter().map(|x| x.device_ptr()).collect(),
                _ => out.clone(),
            }
        } else {
            self.input.iter().map(|x| x.device_ptr()).collect()
        };
        let n = match c {
            Collective::AllGather => in_len,
            Collective::ReduceScatter => self.shape.count / p,
            _ => self.shape.count,
        };
        let mut recv = out;
        if c == Collective::Reduce {
            // Only the root receives.
            for (r, x) in recv.iter_mut().enumerate() {
                if r != opts.root {
                    *x = 0;
                }
            }
        }
        self.group
            .execute(c, T::DTYPE, opts.op, opts.root, n, &inp, &recv, &[])
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
    let mut bench = GpuBench {
        group,
        opts,
        input: Vec::with_capacity(p),
        output: Vec::with_capacity(p),
        shape,
    };
    for (r, d) in group.devices().iter().enumerate() {
        let (input, output) = fresh::<T>(opts, &bench.shape, r);
        bench.input.push(GpuBuffer::from_host(d, &input)?);
        bench.output.push(GpuBuffer::from_host(d, &output)?);
    }
    let row = RowOf {
        opts,
        algo: group.algorithm().to_string(),
        ranks: p,
        dtype: T::DTYPE,
        count: bench.shape.count,
        bandwidth,
    };
    measure(&mut bench, row).map(Some)
}
