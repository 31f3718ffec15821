//! The cost model's figures measured on a communicator's ranks (`tutti tune`,
//! `TUTTI_TUNING=measure`): see [`crate::tuning`].

use std::time::Instant;

use super::{Communicator, PeerOp};
use crate::algorithm::Algorithm;
use crate::dtype::kernels::{self, Init};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::tuning::{
    fit, terms, AllReduce, Link, Shape, Tuning, ALL_TO_ALL, FIT_ALL_TO_ALL_SENT, FIT_SIZES,
};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `comm`'s world as the cost model sees it.
fn shape(comm: &Communicator) -> Shape {
    let t = comm.transport();
    Shape {
        world: comm.world_size(),
        layout: super::work::layout(&**t),
        all_shm: t.all_shared_memory(),
    }
}

/// Whether a fit on `shape`'s world fits the network (else shared memory: every link is).
fn fits_network(shape: &Shape) -> bool {
    !(shape.layout.hosts == 1 && shape.all_shm)
}

/// Time `comm`'s all-reduces of every algorithm the model chooses among, at [`FIT_SIZES`],
/// and fit the figures of one carrier to what remains of them without `call_us` (a call that
/// moves nothing), the reduction (`g` µs per byte) and the other carrier's share at its
/// figures in `known`: (latency, per message, µs per byte). The carrier fitted is the
/// network, unless every link is shared memory. Collective over `comm`.
fn fit_carrier(comm: &Communicator, call_us: f64, g: f64, known: &Tuning) -> Result<[f64; 3]> {
    let p = comm.world_size();
    let shape = shape(comm);
    let fit_net = fits_network(&shape);
    let saved = comm.tuning();
    let mut rows = Vec::new();
    let mut buf = vec![0f32; (1 << 20) / 4];
    let algos = [
        (AllReduce::AllToAll, Algorithm::Auto),
        (AllReduce::Doubling, Algorithm::RecursiveDoubling),
        (AllReduce::Rabenseifner, Algorithm::Rabenseifner),
        (AllReduce::Ring, Algorithm::Ring),
    ];
    comm.set_tuning(ALL_TO_ALL);
    let timed = (|| -> Result<()> {
        for (which, algo) in algos {
            for (bytes, reps) in FIT_SIZES {
                if which == AllReduce::AllToAll
                    && (p - 1).saturating_mul(bytes) > FIT_ALL_TO_ALL_SENT
                {
                    continue; // P-1 copies of a large buffer per rank: time it smaller
                }
                if matches!(which, AllReduce::Ring | AllReduce::Rabenseifner) && bytes / 4 < p {
                    // Fewer elements than ranks: most of their steps carry nothing and cost
                    // nothing, where the model prices every step.
                    continue;
                }
                let b = &mut buf[..bytes / 4];
                comm.all_reduce_with(algo, b)?; // warm: scratch and slots
                let mut times = Vec::with_capacity(reps);
                for _ in 0..reps {
                    let t = Instant::now();
                    comm.all_reduce_with(algo, b)?;
                    times.push(t.elapsed().as_secs_f64() * 1e6);
                }
                // Rank 0's median for every rank: each fits the same rows.
                let mut m = [median(times)];
                comm.broadcast(&mut m, 0)?;
                // Less what every call costs and the reduction (measured on their own): the
                // carrier's figures are what remains.
                let Some(x) = terms(which, &shape, bytes) else {
                    continue;
                };
                let (mine, other, link) = if fit_net {
                    (x.net, x.shm, &known.shm)
                } else {
                    (x.shm, x.net, &known.net)
                };
                let t = m[0] - call_us - x.g * g - link.time(&other);
                rows.push(([0.0, mine[0], mine[1], mine[2], 0.0], t, m[0].max(0.01)));
            }
        }
        Ok(())
    })();
    comm.set_tuning(saved);
    timed?;
    let x = fit(&rows);
    Ok([x[1], x[2], x[3]])
}

/// What a call that moves nothing costs (a send to this rank itself), in µs, and how long
/// reducing a byte takes (f32 sums of 4 MiB, out of cache, every rank at once), in µs; rank
/// 0's figures for every rank.
fn call_and_reduce(comm: &Communicator) -> Result<(f64, f64)> {
    let r = comm.rank();
    let (out, mut inp) = ([0u8; 8], [0u8; 8]);
    let mut times = Vec::with_capacity(60);
    for _ in 0..60 {
        let t = Instant::now();
        comm.send_recv(&mut [PeerOp::send(&out[..], r), PeerOp::recv(&mut inp[..], r)])?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let call_us = median(times);
    comm.barrier()?;
    let bytes = 4 << 20;
    let mut acc = vec![0u8; bytes];
    let src = vec![1u8; bytes];
    let mut times = Vec::with_capacity(12);
    for _ in 0..12 {
        let t = Instant::now();
        kernels::reduce(
            DType::F32,
            ReduceOp::Sum,
            &mut acc,
            &[&src],
            Init::Accumulate,
            None,
        );
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut m = [call_us, median(times) / bytes as f64];
    comm.broadcast(&mut m, 0)?;
    Ok((m[0], m[1]))
}

/// [`Communicator::measure_tuning`], from the figures `start`.
pub(crate) fn measure(comm: &Communicator, start: &Tuning) -> Result<Tuning> {
    if comm.deterministic() {
        return Err(Error::config(
            "deterministic mode (TUTTI_DETERMINISTIC) reduces in rank order whatever the \
             algorithm, so the cost model has nothing to choose and nothing to measure: \
             measure without it",
        ));
    }
    // Every call of the measurement carries figures of its own, so that a rank that is not
    // measuring (TUTTI_TUNING differs) fails its call naming the cost model rather than
    // pairing its calls with these.
    let saved = comm.tuning();
    comm.set_tuning(ALL_TO_ALL);
    let measured = measure_figures(comm, start);
    comm.set_tuning(saved);
    measured
}

fn measure_figures(comm: &Communicator, start: &Tuning) -> Result<Tuning> {
    let world = shape(comm);
    let layout = world.layout;
    let (mut shm, mut net) = (start.shm, start.net);
    let as_link = |f: [f64; 3]| Link {
        latency_us: f[0].clamp(0.01, 1e6),
        per_message_us: f[1].clamp(0.0, 1e6),
        gbytes_per_s: (1e-3 / f[2].max(1e-7)).clamp(1e-6, 1e4),
    };
    let (call_us, g) = call_and_reduce(comm)?;
    if layout.hosts > 1 && layout.most > 1 && layout.shm_within {
        // Shared memory first: each host's ranks on their own, every host at once (as the
        // hierarchy runs them); the hosts' figures averaged (over the hosts with more than
        // one rank).
        let host = comm.transport().hosts().map_or(0, |h| h[comm.rank()]);
        let group = comm.split(Some(host as u32), comm.rank() as i64)?;
        let mut sums = [0f64; 4];
        if let Some(group) = group.filter(|g| g.world_size() > 1) {
            let f = fit_carrier(&group, call_us, g, start)?;
            if group.rank() == 0 {
                sums = [f[0], f[1], f[2], 1.0];
            }
        }
        comm.all_reduce(&mut sums, ReduceOp::Sum)?;
        comm.broadcast(&mut sums, 0)?;
        if sums[3] > 0.0 {
            shm = as_link([sums[0] / sums[3], sums[1] / sums[3], sums[2] / sums[3]]);
        }
    }
    if world.world > 1 {
        // Then the whole world: its steps within hosts cost what shared memory was just
        // measured at, and the rest is the network's.
        let known = Tuning { shm, ..*start };
        let f = fit_carrier(comm, call_us, g, &known)?;
        if !fits_network(&world) {
            shm = as_link(f);
        } else {
            net = as_link(f);
        }
    }
    let mut cores = [crate::sync::cores() as f64];
    comm.all_reduce(&mut cores, ReduceOp::Max)?;
    let t = Tuning {
        tutti_tuning: Tuning::VERSION,
        shm,
        net,
        reduce_gbytes_per_s: (1e-3 / g.max(1e-7)).clamp(1e-6, 1e4),
        ranks_per_host: layout.most,
        cores: cores[0] as usize,
    };
    t.check().map_err(|e| {
        Error::config(format!(
            "the cost model's figures measured are out of range: {e}"
        ))
    })?;
    Ok(t)
}

/// [`Communicator::predict_all_reduce`].
pub(crate) fn predict_all_reduce(
    comm: &Communicator,
    figures: &Tuning,
    bytes: usize,
) -> (&'static str, Option<f64>) {
    let t = comm.transport();
    if t.peer_memory().is_some() || comm.world_size() < 2 {
        return ("direct", None);
    }
    let shape = shape(comm);
    let compressed = comm.compression() != crate::config::Compression::None;
    let pick = figures.all_reduce(&shape, bytes, compressed);
    if pick == crate::tuning::AllReduce::Hosts {
        let (form, time) = figures.hosts_form(&shape, bytes, compressed);
        return (form.name(shape.layout.fewest), Some(time));
    }
    let time = figures
        .all_reduce_times(&shape, bytes, compressed)
        .into_iter()
        .find(|(a, _)| *a == pick)
        .map(|(_, t)| t);
    (pick.name(), time)
}
