//! `tutti perf --device xla`: the collectives across XLA devices, measured and checked like the
//! CPU rows.
//!
//! All-reduce, broadcast, all-gather, reduce-scatter and all-to-all: each size uploads replica
//! r's test pattern to device r once, runs the collective once and counts the elements of
//! every device's result that differ from the reference, then times `iters` calls on the
//! device-resident buffers (a call: run the cached program on every device, wait for all of
//! them, release the results). Host copies are not in the timed loop, as in nccl-tests.
//!
//! The other collectives have no client-level program: they are timed as an XLA group's
//! communicators run them ([`staged`]), host copies included.

use std::marker::PhantomData;
use std::time::Duration;

use super::{
    fresh, measure, sizes, wrong_elements, Bench, Machine, Options, Placement, Row, RowOf, Shape,
};
use crate::dtype::Element;
use crate::error::{Collective, Error, Result};
use crate::xla::{Client, ClientOptions, OptionValue, Plugin, PluginKind, XlaBuffer};

/// The client perf measures with: the plugin of [`Client::discover`], with the options of
/// `TUTTI_PJRT_OPTIONS` and the perf timeout; for the CPU plugin `cpu_device_count` defaults
/// to the number of ranks.
fn client_for(ranks: usize, timeout: Duration) -> Result<Client> {
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
pub(super) fn run(
    opts: &Options,
    machine: &Machine,
    emit: &(dyn Fn(&Row) + Sync),
) -> Result<Vec<Row>> {
    if !on_buffers(opts.collective) {
        return staged(opts, emit);
    }
    if opts.placement != Placement::OutOfPlace {
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

/// Whether perf times `c` as the client's programs on device-resident buffers; the other
/// collectives run through an XLA group's communicators ([`staged`]).
fn on_buffers(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllReduce
            | Collective::Broadcast
            | Collective::AllGather
            | Collective::ReduceScatter
            | Collective::AllToAll
    )
}

/// The collectives that have no client-level program (reduce, gather, scatter, the `-v` forms,
/// send-recv) as an XLA group of `opts.ranks` devices runs them for its communicators: each
/// call's host buffers staged to the devices and back (send-recv between host buffers), timed
/// and checked as the CPU rows are. Rows say `xla-staged` (`xla-staged-ordered` for the
/// deterministic mode's reductions).
fn staged(opts: &Options, emit: &(dyn Fn(&Row) + Sync)) -> Result<Vec<Row>> {
    if opts.ranks == 0 {
        return Err(Error::config("perf needs at least one rank (-n)"));
    }
    let specs: Vec<String> = (0..opts.ranks).map(|r| format!("xla:{r}")).collect();
    let config = opts.config.clone().with_algorithm(opts.algorithm);
    let comms = crate::comm::device_group(&specs, &config)?;
    let algo = if opts.config.deterministic && super::reduces(opts.collective) {
        "xla-staged-ordered"
    } else {
        "xla-staged"
    };
    let named = |row: &Row| {
        emit(&Row {
            algo: algo.into(),
            ..row.clone()
        })
    };
    let mut rows = Vec::new();
    // Rank 0's rows; the first rank's error, if any.
    for (r, ranks) in crate::comm::run_group(&comms, |c| super::sweep(c, opts, &named))?
        .into_iter()
        .enumerate()
    {
        let ranks = ranks?;
        if r == 0 {
            rows = ranks;
        }
    }
    for row in &mut rows {
        row.algo = algo.into();
    }
    Ok(rows)
}

fn call(client: &Client, opts: &Options, inputs: &[&XlaBuffer]) -> Result<Vec<XlaBuffer>> {
    // The deterministic mode's programs: the inputs gathered, reduced in rank order.
    let ordered = opts.config.deterministic;
    match opts.collective {
        Collective::AllReduce if ordered => client.all_reduce_buffers_ordered(inputs, opts.op),
        Collective::ReduceScatter if ordered => {
            client.reduce_scatter_buffers_ordered(inputs, opts.op)
        }
        Collective::AllReduce => client.all_reduce_buffers(inputs, opts.op),
        Collective::Broadcast => client.broadcast_buffers(inputs, opts.root),
        Collective::AllGather => client.all_gather_buffers(inputs),
        Collective::AllToAll => client.all_to_all_buffers(inputs),
        _ => client.reduce_scatter_buffers(inputs, opts.op),
    }
}

/// One size on every XLA device: the inputs stay on the devices; each call's results are
/// checked (the first call) or released.
struct XlaBench<'a, T> {
    client: &'a Client,
    opts: &'a Options,
    inputs: Vec<&'a XlaBuffer>,
    /// The row's count (see [`wrong_elements`]).
    count: usize,
    /// The buffers are untyped device memory; the results are read back as `T`.
    dtype: PhantomData<T>,
}

impl<T: Element> Bench for XlaBench<'_, T> {
    fn check(&mut self) -> Result<u64> {
        let opts = self.opts;
        let outs = call(self.client, opts, &self.inputs)?;
        let p = outs.len();
        let mut errors = 0;
        for (r, o) in outs.iter().enumerate() {
            let got = o.to_vec::<T>()?;
            let c = opts.collective;
            errors += wrong_elements(c, opts.op, opts.root, p, r, self.count, &got) as u64;
        }
        Ok(errors)
    }
    fn call(&mut self) -> Result<()> {
        call(self.client, self.opts, &self.inputs).map(drop)
    }
}

fn one_size<T: Element>(
    client: &Client,
    opts: &Options,
    machine: &Machine,
    bytes: usize,
) -> Result<Option<Row>> {
    let p = opts.ranks;
    let Some(shape) = Shape::of(opts.collective, p, bytes, T::DTYPE) else {
        return Ok(None);
    };
    let inputs = (0..p)
        .map(|r| client.buffer_from_host(&fresh::<T>(opts, &shape, r).0, r))
        .collect::<Result<Vec<_>>>()?;
    let mut bench = XlaBench::<T> {
        client,
        opts,
        inputs: inputs.iter().collect(),
        count: shape.count,
        dtype: PhantomData,
    };
    let row = RowOf {
        opts,
        algo: if opts.config.deterministic && super::reduces(opts.collective) {
            "xla-ordered".into()
        } else {
            "xla".into()
        },
        ranks: p,
        dtype: T::DTYPE,
        count: shape.count,
        bandwidth: Some(machine.copy_gbps),
    };
    measure(&mut bench, row).map(Some)
}
