//! `tutti perf --device xla`: the collectives across XLA devices, measured and checked like the
//! CPU rows.
//!
//! Each size uploads replica r's test pattern to device r once, runs the collective once and
//! counts the elements of every device's result that differ from the reference, then times
//! `iters` calls on the device-resident buffers (a call: run the cached program on every
//! device, wait for all of them, release the results). Host copies are not in the timed loop,
//! as in nccl-tests.

use std::time::{Duration, Instant};

use super::client::{Client, ClientOptions, OptionValue, XlaBuffer};
use super::plugin::{Plugin, PluginKind};
use crate::dtype::Element;
use crate::error::{Collective, Error, Result};
use crate::perf::{bus_factor, min_traffic, pattern, sizes, Machine, Options, Row};

/// The client perf measures with: the plugin of [`Client::discover`], with the options of
/// `TUTTI_PJRT_OPTIONS` and the perf timeout; for the CPU plugin `cpu_device_count` defaults
/// to the number of ranks.
pub fn client_for(ranks: usize, timeout: Duration) -> Result<Client> {
    let base = ClientOptions::from_env()?.with_timeout(timeout);
    Client::discover_with(&|p: &Plugin| {
        if p.kind() == PluginKind::Cpu && base.get("cpu_device_count").is_none() {
            base.clone()
                .with("cpu_device_count", OptionValue::Int(ranks as i64))
        } else {
            base.clone()
        }
    })
}

/// Run the sweep of `opts` on the first `opts.ranks` XLA devices, calling `emit` per row.
pub fn run(opts: &Options, machine: &Machine, emit: &(dyn Fn(&Row) + Sync)) -> Result<Vec<Row>> {
    match opts.collective {
        Collective::AllReduce
        | Collective::Broadcast
        | Collective::AllGather
        | Collective::ReduceScatter => {}
        c => {
            return Err(Error::config(format!(
            "--device xla measures all-reduce, broadcast, all-gather and reduce-scatter, not {}",
            c.cli_name()
        )))
        }
    }
    if opts.placement != crate::perf::Placement::OutOfPlace {
        return Err(Error::config(
            "--device xla: XLA collectives write new device buffers; drop --in-place",
        ));
    }
    if opts.ranks == 0 {
        return Err(Error::config("perf needs at least one rank (-n)"));
    }
    opts.check_root(opts.ranks)?;
    let client = client_for(opts.ranks, opts.config.timeout)?;
    let have = client.devices().len();
    if opts.ranks > have {
        return Err(Error::config(format!(
            "-n {}: the PJRT plugin {} ({}) has {have} device(s)",
            opts.ranks,
            client.plugin().path().display(),
            client.platform_name()
        )));
    }
    let mut rows = Vec::new();
    for bytes in sizes(opts.min_bytes, opts.max_bytes, opts.factor) {
        let row = crate::for_each_dtype!(opts.dtype, T => {
            one_size::<T>(&client, opts, machine, bytes)?
        });
        if let Some(row) = row {
            emit(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

fn call(client: &Client, opts: &Options, inputs: &[&XlaBuffer]) -> Result<Vec<XlaBuffer>> {
    match opts.collective {
        Collective::AllReduce => client.all_reduce_buffers(inputs, opts.op),
        Collective::Broadcast => client.broadcast_buffers(inputs, opts.root),
        Collective::AllGather => client.all_gather_buffers(inputs),
        _ => client.reduce_scatter_buffers(inputs, opts.op),
    }
}

fn one_size<T: Element>(
    client: &Client,
    opts: &Options,
    machine: &Machine,
    bytes: usize,
) -> Result<Option<Row>> {
    let p = opts.ranks;
    let c = opts.collective;
    let esize = T::DTYPE.size();
    let mut count = bytes / esize;
    if matches!(c, Collective::AllGather | Collective::ReduceScatter) {
        count -= count % p;
    }
    if count == 0 {
        return Ok(None);
    }
    let in_len = if c == Collective::AllGather {
        count / p
    } else {
        count
    };
    let inputs = (0..p)
        .map(|r| {
            let data: Vec<T> = (0..in_len).map(|i| pattern(r, i)).collect();
            client.buffer_from_host(&data, r)
        })
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&XlaBuffer> = inputs.iter().collect();
    let outs = call(client, opts, &refs)?;
    let mut errors = 0u64;
    for (r, o) in outs.iter().enumerate() {
        errors += count_errors::<T>(opts, r, p, &o.to_vec::<T>()?) as u64;
    }
    drop(outs);

    // Warm up, then choose the iteration count (about 0.25 s per size).
    let t = Instant::now();
    drop(call(client, opts, &refs)?);
    let iters = opts.iters.unwrap_or_else(|| {
        let per = t.elapsed().max(Duration::from_nanos(200));
        (0.25 / per.as_secs_f64()).clamp(3.0, 2000.0) as usize
    });
    let t = Instant::now();
    for _ in 0..iters {
        drop(call(client, opts, &refs)?);
    }
    let time = t.elapsed().as_secs_f64() / iters as f64;
    let algbw = (count * esize) as f64 / time / 1e9;
    Ok(Some(Row {
        collective: c.cli_name().into(),
        algo: "xla".into(),
        ranks: p,
        dtype: T::DTYPE.name().into(),
        op: if matches!(c, Collective::Broadcast | Collective::AllGather) {
            "none".into()
        } else {
            opts.op.name().into()
        },
        root: opts.rooted(),
        in_place: false,
        bytes: count * esize,
        count,
        time_us: time * 1e6,
        algbw_gbps: algbw,
        busbw_gbps: algbw * bus_factor(c, p),
        mem_ratio: min_traffic(c, p, count * esize) / time / 1e9 / machine.copy_gbps,
        errors,
    }))
}

/// Wrong elements in replica r's result (see `tutti::perf` for the pattern).
fn count_errors<T: Element>(opts: &Options, r: usize, p: usize, got: &[T]) -> usize {
    crate::perf::wrong_elements(opts.collective, opts.op, opts.root, p, r, got)
}
