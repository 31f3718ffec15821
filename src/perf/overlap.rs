//! How much of an all-reduce hides behind computation: a non-blocking all-reduce issued, then
//! computation on the caller's thread, then the wait; against the two run one after the other.
//!
//! `ratio = time(issue + compute + wait) / (time(compute) + time(all-reduce))`: 1.0 is no
//! overlap, 0.5 a perfect one where both take equally long. Every rank computes the same amount,
//! calibrated to take about as long as the all-reduce alone; each time is the slowest rank's.

use std::hint::black_box;
use std::time::Instant;

use serde::Serialize;

use crate::comm::Communicator;
use crate::dtype::ReduceOp;
use crate::error::Result;

/// One size's overlap figures (times in microseconds per iteration, slowest rank).
#[derive(Clone, Debug, Serialize)]
pub struct OverlapRow {
    /// Bytes of the all-reduce (f32 sum).
    pub bytes: usize,
    /// The blocking all-reduce alone.
    pub all_reduce_us: f64,
    /// The computation alone.
    pub compute_us: f64,
    /// Non-blocking all-reduce, computation meanwhile, then the wait.
    pub overlapped_us: f64,
    /// `overlapped / (compute + all_reduce)`; lower is better, 1.0 is no overlap.
    pub ratio: f64,
}

/// Compute-bound work on a cache-resident array: `units` passes of a multiply-add.
fn compute(units: usize, scratch: &mut [f32]) -> f32 {
    for _ in 0..units {
        for x in scratch.iter_mut() {
            *x = black_box(*x * 0.999_9 + 0.000_1);
        }
    }
    scratch[0]
}

/// The slowest rank's value of `secs`, in microseconds.
fn slowest(comm: &Communicator, secs: f64) -> Result<f64> {
    let mut v = [secs * 1e6];
    comm.all_reduce(&mut v, ReduceOp::Max)?;
    Ok(v[0])
}

/// Measure one size over `iters` iterations; every rank calls it.
pub fn overlap_one(comm: &Communicator, bytes: usize, iters: usize) -> Result<OverlapRow> {
    let iters = iters.max(1);
    let mut buf = vec![0.0f32; bytes / 4];
    let mut scratch = vec![1.0f32; 1024];
    comm.all_reduce(&mut buf, ReduceOp::Sum)?;

    comm.barrier()?;
    let t = Instant::now();
    for _ in 0..iters {
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    }
    let all_reduce_us = slowest(comm, t.elapsed().as_secs_f64() / iters as f64)?;

    // Calibrate: units of computation that take about as long as the all-reduce (rank 0's
    // measure, so that every rank computes the same amount).
    let t = Instant::now();
    let mut probe = 0;
    while t.elapsed().as_secs_f64() < 0.02 {
        compute(16, &mut scratch);
        probe += 16;
    }
    let unit_us = t.elapsed().as_secs_f64() * 1e6 / probe as f64;
    let mut units = [((all_reduce_us / unit_us).ceil()).max(1.0)];
    comm.broadcast(&mut units, 0)?;
    let units = units[0] as usize;

    comm.barrier()?;
    let t = Instant::now();
    for _ in 0..iters {
        compute(units, &mut scratch);
    }
    let compute_us = slowest(comm, t.elapsed().as_secs_f64() / iters as f64)?;

    comm.barrier()?;
    let t = Instant::now();
    for _ in 0..iters {
        let work = comm.all_reduce_async(std::mem::take(&mut buf), ReduceOp::Sum);
        compute(units, &mut scratch);
        buf = work.wait()?;
    }
    let overlapped_us = slowest(comm, t.elapsed().as_secs_f64() / iters as f64)?;
    black_box(&scratch);
    Ok(OverlapRow {
        bytes,
        all_reduce_us,
        compute_us,
        overlapped_us,
        ratio: overlapped_us / (compute_us + all_reduce_us),
    })
}
