//! `tutti perf --device gpu`: the collectives over `-n` GPUs (or, when the machine has fewer,
//! `-n` logical GPUs split evenly over them), measured and checked like the CPU rows.
//!
//! For each size every device's buffers are filled with the test pattern, the collective runs
//! once and every device's result is compared with the reference, then the timed calls run on
//! the device-resident buffers (host copies are not in the timed loop, as in nccl-tests). A call
//! returns when every device is done, so the wall-clock time per call is the collective's.
//!
//! `mem_ratio` on GPUs is the least memory traffic of the collective per second over the
//! device-to-device copy bandwidth measured in the same run ([`device_copy_gbps`]) times the
//! number of physical GPUs in use: 1.0 means the collective moves its bytes as fast as a plain
//! copy would.

use std::time::{Duration, Instant};

use super::discovery::{self, GpuDevice, LogicalGpu};
use super::driver;
use super::group::{GpuAlgorithm, GpuGroup};
use super::GpuBuffer;
use crate::dtype::Element;
use crate::error::{Collective, Error, Result};
use crate::perf::{bus_factor, min_traffic, pattern, sizes, Options, Row};

/// The devices `-n ranks` means: that many GPUs, or logical GPUs spread over the GPUs there
/// are.
pub fn replica_devices(ranks: usize) -> Result<Vec<GpuDevice>> {
    let gpus = discovery::devices()?;
    discovery::plan_replicas(ranks, &gpus)?
        .iter()
        .map(GpuDevice::open)
        .collect()
}

/// Device-to-device copy bandwidth of physical GPU `ordinal`: bytes read plus written per
/// second by 256 MiB copies within its memory (GB/s, the best of three rounds of ten).
pub fn device_copy_gbps(ordinal: usize) -> Result<f64> {
    let dev = GpuDevice::open(&LogicalGpu {
        index: 0,
        physical: ordinal,
        memory_limit: None,
        is_virtual: false,
    })?;
    let n = (256usize << 20) / 4;
    let src = GpuBuffer::<u32>::zeros(&dev, n)?;
    let dst = GpuBuffer::<u32>::zeros(&dev, n)?;
    let inner = &dev.inner;
    let bytes = n * 4;
    let mut best = f64::MAX;
    for round in 0..4 {
        let reps = if round == 0 { 2 } else { 10 };
        let t = Instant::now();
        for _ in 0..reps {
            driver::copy_async(
                dst.device_ptr(),
                &inner.ctx,
                src.device_ptr(),
                &inner.ctx,
                bytes,
                &inner.stream,
            )?;
        }
        inner.sync(inner.timeout, "finish the copy-bandwidth test")?;
        if round > 0 {
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
    }
    Ok(2.0 * bytes as f64 / best / 1e9)
}

/// Run the sweep of `opts` (`opts.ranks` GPUs or logical GPUs) with `algorithm`, calling
/// `emit` with each row; `copy_gbps` is [`device_copy_gbps`] of this run.
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

struct Bufs<T: Element> {
    input: Vec<GpuBuffer<T>>,
    output: Vec<GpuBuffer<T>>,
}

fn one_size<T: Element>(
    group: &GpuGroup,
    opts: &Options,
    bandwidth: f64,
    bytes: usize,
) -> Result<Option<Row>> {
    let p = group.devices().len();
    let c = opts.collective;
    let es = T::DTYPE.size();
    let mut count = bytes / es;
    if matches!(c, Collective::AllGather | Collective::ReduceScatter) {
        count -= count % p;
    }
    if count == 0 {
        return Ok(None);
    }
    let (in_len, out_len) = match c {
        Collective::AllGather => (count / p, count),
        Collective::ReduceScatter => (count, count / p),
        _ => (count, count),
    };
    let data = |r: usize, n: usize| -> Vec<T> { (0..n).map(|i| pattern(r, i)).collect() };
    let mut b = Bufs {
        input: Vec::with_capacity(p),
        output: Vec::with_capacity(p),
    };
    for (r, d) in group.devices().iter().enumerate() {
        b.input.push(GpuBuffer::from_host(d, &data(r, in_len))?);
        let out = if opts.in_place() || (c == Collective::Broadcast && r == opts.root) {
            let mut v = data(r, out_len);
            if opts.in_place() && c == Collective::AllGather {
                v = vec![T::from_f64(0.0); out_len];
                v[r * in_len..(r + 1) * in_len].copy_from_slice(&data(r, in_len));
            }
            v
        } else {
            vec![T::from_f64(0.0); out_len]
        };
        b.output.push(GpuBuffer::from_host(d, &out)?);
    }
    run_once(group, opts, &b, count, in_len)?;
    let errors = count_errors(group, opts, &b)?;
    let t = Instant::now();
    run_once(group, opts, &b, count, in_len)?;
    let iters = opts.iters.unwrap_or_else(|| {
        let per = t.elapsed().max(Duration::from_nanos(200));
        (0.25 / per.as_secs_f64()).clamp(3.0, 2000.0) as usize
    });
    let t = Instant::now();
    for _ in 0..iters {
        run_once(group, opts, &b, count, in_len)?;
    }
    let time = t.elapsed().as_secs_f64() / iters as f64;
    let algbw = (count * es) as f64 / time / 1e9;
    Ok(Some(Row {
        collective: c.cli_name().into(),
        algo: group.algorithm().to_string(),
        ranks: p,
        dtype: T::DTYPE.name().into(),
        op: if matches!(c, Collective::Broadcast | Collective::AllGather) {
            "none".into()
        } else {
            opts.op.name().into()
        },
        root: opts.rooted(),
        in_place: opts.in_place(),
        bytes: count * es,
        count,
        time_us: time * 1e6,
        algbw_gbps: algbw,
        busbw_gbps: algbw * bus_factor(c, p),
        mem_ratio: min_traffic(c, p, count * es) / time / 1e9 / bandwidth,
        errors: errors as u64,
    }))
}

/// One call: in place uses the output buffers only (all-gather: the own slice as input).
fn run_once<T: Element>(
    group: &GpuGroup,
    opts: &Options,
    b: &Bufs<T>,
    count: usize,
    in_len: usize,
) -> Result<()> {
    let c = opts.collective;
    let es = T::DTYPE.size();
    let out: Vec<u64> = b.output.iter().map(|x| x.device_ptr()).collect();
    let inp: Vec<u64> = if opts.in_place() || c == Collective::Broadcast {
        match c {
            Collective::AllGather => out
                .iter()
                .enumerate()
                .map(|(r, &o)| o + (r * in_len * es) as u64)
                .collect(),
            Collective::ReduceScatter => b.input.iter().map(|x| x.device_ptr()).collect(),
            _ => out.clone(),
        }
    } else {
        b.input.iter().map(|x| x.device_ptr()).collect()
    };
    let n = match c {
        Collective::AllGather => in_len,
        Collective::ReduceScatter => count / group.devices().len(),
        _ => count,
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
    group.execute(c, T::DTYPE, opts.op, opts.root, n, &inp, &recv, &[])
}

/// Wrong elements over every device after one call on fresh data.
fn count_errors<T: Element>(group: &GpuGroup, opts: &Options, b: &Bufs<T>) -> Result<usize> {
    let p = group.devices().len();
    let mut errors = 0;
    for (r, o) in b.output.iter().enumerate() {
        errors +=
            crate::perf::wrong_elements(opts.collective, opts.op, opts.root, p, r, &o.to_host()?);
    }
    Ok(errors)
}
