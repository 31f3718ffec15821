//! `tutti check`: every collective with every algorithm on one communicator, blocking and in
//! flight, against the reference.

use super::pattern;
use crate::algorithm::Algorithm;
use crate::comm::Communicator;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::reference;

/// Check every collective with every algorithm on this communicator against the reference:
/// all-reduce (every op, in place and out of place), broadcast and reduce from every root,
/// all-gather, reduce-scatter, barrier, all-to-all, gather and scatter from every root, and the
/// collectives with a count per rank on uneven counts; every dtype with `auto`, and with each
/// forced algorithm u8, bf16, i32, f32 and f64 (an algorithm tells dtypes apart only by their
/// element size and kernels, and those cover every size and kind). On a deterministic
/// communicator, also that every reduction of random floats has the bits of the reduction in
/// rank order, on every rank. Every rank calls it; returns the number
/// of calls checked, or an error naming the algorithm, collective, dtype and count that failed.
pub fn check(comm: &mut Communicator, counts: &[usize]) -> Result<usize> {
    let mut calls = 0;
    // MPI's own collectives too, where the carrier is MPI; the hierarchy across hosts, on CPU
    // ranks (whatever the hosts: one, or several of equal or unequal sizes).
    let native = comm.has_native().then_some(Algorithm::Mpi);
    let hosts = (comm.device_kind() == crate::DeviceKind::Cpu).then_some(Algorithm::Hosts);
    for algo in Algorithm::ALL_REDUCE.into_iter().chain(native).chain(hosts) {
        if algo == Algorithm::Direct && !comm.has_peer_memory() {
            continue;
        }
        comm.set_algorithm(algo)?;
        for &count in counts {
            let dtypes: &[DType] = match algo {
                Algorithm::Auto => &DType::ALL,
                _ => &[DType::F32, DType::BF16, DType::I32, DType::U8, DType::F64],
            };
            for &dtype in dtypes {
                calls += crate::for_each_dtype!(dtype, T => { check_one::<T>(comm, algo, count)? });
                calls += crate::for_each_dtype!(dtype, T => { check_in_flight::<T>(comm, algo, count)? });
                // Device groups (CUDA, XLA) run those of them their engine has.
                calls +=
                    crate::for_each_dtype!(dtype, T => { check_personal::<T>(comm, algo, count)? });
            }
        }
    }
    if comm.deterministic() {
        for algo in Algorithm::ALL_REDUCE {
            if algo == Algorithm::Direct && !comm.has_peer_memory() {
                continue;
            }
            comm.set_algorithm(algo)?;
            for &count in counts {
                calls += check_deterministic::<f32>(comm, algo, count)?;
                calls += check_deterministic::<half::bf16>(comm, algo, count)?;
                calls += check_deterministic::<f64>(comm, algo, count)?;
            }
        }
        comm.set_algorithm(Algorithm::Auto)?;
    }
    if comm.compression() != crate::Compression::None {
        calls += check_compression(comm, counts)?;
    }
    if comm.can_share_buffers() {
        for &count in counts {
            calls += check_shared::<f32>(comm, count)?;
            calls += check_shared::<half::bf16>(comm, count)?;
        }
        // And the smallest call that runs through shared buffers (larger where ranks share
        // cores), whatever counts were asked for.
        let min = comm.shared_min_bytes();
        if min > 0 && min <= 16 << 20 {
            calls += check_shared::<f32>(comm, min / 4 + 1)?;
        }
        comm.set_algorithm(Algorithm::Auto)?;
    }
    comm.barrier()?;
    Ok(calls + 1)
}

/// Every collective on buffers from [`Communicator::alloc_shared`], with `auto` and, where the
/// call is large enough to run through shared buffers (or the ranks are threads), `direct`
/// forced: an error rather than a silent fallback if the mappings are not used (except reduce,
/// whose ranks off the root have no output, so between processes it runs on the slots).
fn check_shared<T: Element>(comm: &mut Communicator, count: usize) -> Result<usize> {
    let (p, r) = (comm.world_size(), comm.rank());
    let bytes = count * p * std::mem::size_of::<T>();
    // A call in flight across an allocation: whether it has a claim round (no, the first time
    // round; yes, later) is the same on every rank, and so is every later call's.
    comm.set_algorithm(Algorithm::Auto)?;
    let before = comm.all_reduce_async(vec![T::from_f64(1.0); 1 << 16], ReduceOp::Sum);
    let mut inb = comm.alloc_shared(bytes)?;
    let mut outb = comm.alloc_shared(bytes)?;
    if before.wait()?.iter().any(|&x| x != T::from_f64(p as f64)) {
        return Err(Error::System {
            what: format!("check shared buffers {} n={count}", T::DTYPE),
            message: format!("an all_reduce in flight across the allocation: wrong on rank {r}"),
        });
    }
    let inputs: Vec<Vec<T>> = (0..p).map(|k| data(k, count)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let big: Vec<Vec<T>> = (0..p).map(|k| data(k + 1, count * p)).collect();
    let big_refs: Vec<&[T]> = big.iter().map(|v| v.as_slice()).collect();
    let direct = count * std::mem::size_of::<T>() >= comm.shared_min_bytes();
    let mut algos = vec![Algorithm::Auto];
    if direct {
        algos.push(Algorithm::Direct);
    }
    let mut calls = 0;
    for algo in algos {
        comm.set_algorithm(algo)?;
        let fail = |what: String| Error::System {
            what: format!("check shared buffers {algo} {} n={count}", T::DTYPE),
            message: what,
        };
        let (sum, tol) = (
            reference::reduce(&refs, ReduceOp::Sum),
            reference::tolerance(super::rounded_in(comm, T::DTYPE), ReduceOp::Sum, p, 2.0),
        );
        inb.as_mut_slice::<T>()[..count].copy_from_slice(&inputs[r]);
        comm.all_reduce_into(
            &inb.as_slice::<T>()[..count],
            &mut outb.as_mut_slice::<T>()[..count],
            ReduceOp::Sum,
        )?;
        if reference::count_errors(&outb.as_slice::<T>()[..count], &sum, tol) > 0 {
            return Err(fail(format!("all_reduce out of place: wrong on rank {r}")));
        }
        let in_place = &mut outb.as_mut_slice::<T>()[..count];
        in_place.copy_from_slice(&inputs[r]);
        comm.all_reduce(in_place, ReduceOp::Sum)?;
        if reference::count_errors(in_place, &sum, tol) > 0 {
            return Err(fail(format!("all_reduce in place: wrong on rank {r}")));
        }
        comm.all_gather(
            &inb.as_slice::<T>()[..count],
            &mut outb.as_mut_slice::<T>()[..count * p],
        )?;
        if outb.as_slice::<T>()[..count * p] != inputs.concat()[..] {
            return Err(fail(format!("all_gather: wrong values on rank {r}")));
        }
        inb.as_mut_slice::<T>()[..count * p].copy_from_slice(&big[r]);
        comm.reduce_scatter(
            &inb.as_slice::<T>()[..count * p],
            &mut outb.as_mut_slice::<T>()[..count],
            ReduceOp::Min,
        )?;
        let want = reference::reduce(&big_refs, ReduceOp::Min);
        if outb.as_slice::<T>()[..count] != want[r * count..(r + 1) * count] {
            return Err(fail(format!("reduce_scatter min: wrong slice on rank {r}")));
        }
        for (root, want) in inputs.iter().enumerate() {
            let buf = &mut outb.as_mut_slice::<T>()[..count];
            match r == root {
                true => buf.copy_from_slice(want),
                false => buf.fill(T::from_f64(0.0)),
            }
            comm.broadcast(buf, root)?;
            if buf != &want[..] {
                return Err(fail(format!(
                    "broadcast from root {root}: wrong values on rank {r}"
                )));
            }
        }
        calls += 4 + p;
        // The buffer travels into a non-blocking call and back.
        outb.as_mut_slice::<T>()[..count].copy_from_slice(&inputs[r]);
        outb = comm.all_reduce_async::<T, _>(outb, ReduceOp::Sum).wait()?;
        if reference::count_errors(&outb.as_slice::<T>()[..count], &sum, tol) > 0 {
            return Err(fail(format!("all_reduce in flight: wrong on rank {r}")));
        }
        calls += 1;
        if algo == Algorithm::Direct && !comm.has_peer_memory() {
            // A reduce's ranks off the root have no output: between processes it runs on the
            // slots, which `direct` does not.
            continue;
        }
        inb.as_mut_slice::<T>()[..count].copy_from_slice(&inputs[r]);
        comm.reduce(
            &inb.as_slice::<T>()[..count],
            (r == 0).then(|| &mut outb.as_mut_slice::<T>()[..count]),
            ReduceOp::Max,
            0,
        )?;
        if r == 0 && outb.as_slice::<T>()[..count] != reference::reduce(&refs, ReduceOp::Max)[..] {
            return Err(fail("reduce max onto root 0: wrong values".into()));
        }
        calls += 1;
    }
    Ok(calls)
}

fn check_one<T: Element>(comm: &Communicator, algo: Algorithm, count: usize) -> Result<usize> {
    let (p, r) = (comm.world_size(), comm.rank());
    let fail = |what: String| Error::System {
        what: format!("check {algo} {} n={count}", T::DTYPE),
        message: what,
    };
    let inputs: Vec<Vec<T>> = (0..p).map(|k| data(k, count)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let mut calls = 0;
    for op in ReduceOp::ALL
        .into_iter()
        .filter(|o| o.check(T::DTYPE).is_ok())
    {
        let want = reference::reduce(&refs, op);
        let tol = reference::tolerance(super::rounded_in(comm, T::DTYPE), op, p, 2.0);
        let mut buf = inputs[r].clone();
        comm.all_reduce(&mut buf, op)?;
        let mut out = vec![T::from_f64(0.0); count];
        comm.all_reduce_into(&inputs[r], &mut out, op)?;
        for (got, how) in [(&buf, "in place"), (&out, "out of place")] {
            let bad = reference::count_errors(got, &want, tol);
            if bad > 0 {
                return Err(fail(format!(
                    "all_reduce {op} {how}: {bad} of {count} elements wrong on rank {r}"
                )));
            }
        }
        calls += 2;
    }
    for root in 0..p {
        let mut buf = if r == root {
            inputs[root].clone()
        } else {
            vec![T::from_f64(0.0); count]
        };
        comm.broadcast(&mut buf, root)?;
        if buf != inputs[root] {
            return Err(fail(format!(
                "broadcast from root {root}: wrong values on rank {r}"
            )));
        }
        let mut out = vec![T::from_f64(0.0); count];
        comm.reduce(
            &inputs[r],
            (r == root).then_some(&mut out[..]),
            ReduceOp::Max,
            root,
        )?;
        if r == root && out != reference::reduce(&refs, ReduceOp::Max) {
            return Err(fail(format!("reduce max onto root {root}: wrong values")));
        }
        calls += 2;
    }
    let mut gathered = vec![T::from_f64(0.0); count * p];
    comm.all_gather(&inputs[r], &mut gathered)?;
    if gathered != inputs.concat() {
        return Err(fail(format!("all_gather: wrong values on rank {r}")));
    }
    let big: Vec<Vec<T>> = (0..p).map(|k| data(k + 1, count * p)).collect();
    let big_refs: Vec<&[T]> = big.iter().map(|v| v.as_slice()).collect();
    let want = reference::reduce(&big_refs, ReduceOp::Min);
    let mut slice = vec![T::from_f64(0.0); count];
    comm.reduce_scatter(&big[r], &mut slice, ReduceOp::Min)?;
    if slice[..] != want[r * count..(r + 1) * count] {
        return Err(fail(format!("reduce_scatter min: wrong slice on rank {r}")));
    }
    Ok(calls + 2)
}

/// Every collective of `check_one` issued non-blocking before any is waited for, then waited
/// in reverse issue order: the calls complete in issue order all the same, each correct.
fn check_in_flight<T: Element>(
    comm: &Communicator,
    algo: Algorithm,
    count: usize,
) -> Result<usize> {
    let (p, r) = (comm.world_size(), comm.rank());
    let fail = |what: String| Error::System {
        what: format!("check in flight {algo} {} n={count}", T::DTYPE),
        message: what,
    };
    let inputs: Vec<Vec<T>> = (0..p).map(|k| data(k, count)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let big: Vec<Vec<T>> = (0..p).map(|k| data(k + 1, count * p)).collect();
    let big_refs: Vec<&[T]> = big.iter().map(|v| v.as_slice()).collect();
    type Check = Box<dyn FnOnce() -> std::result::Result<(), String>>;
    let mut pending: Vec<Check> = Vec::new();
    for op in ReduceOp::ALL
        .into_iter()
        .filter(|o| o.check(T::DTYPE).is_ok())
    {
        let work = comm.all_reduce_async(inputs[r].clone(), op);
        let want = reference::reduce(&refs, op);
        let tol = reference::tolerance(super::rounded_in(comm, T::DTYPE), op, p, 2.0);
        pending.push(Box::new(move || {
            let got = work.wait().map_err(|e| e.to_string())?;
            match reference::count_errors(&got, &want, tol) {
                0 => Ok(()),
                bad => Err(format!(
                    "all_reduce {op}: {bad} of {count} elements wrong on rank {r}"
                )),
            }
        }));
    }
    for root in 0..p {
        let buf = if r == root {
            inputs[root].clone()
        } else {
            vec![T::from_f64(0.0); count]
        };
        let work = comm.broadcast_async(buf, root);
        let want = inputs[root].clone();
        pending.push(Box::new(move || {
            match work.wait().map_err(|e| e.to_string())? == want {
                true => Ok(()),
                false => Err(format!(
                    "broadcast from root {root}: wrong values on rank {r}"
                )),
            }
        }));
        let work = comm.reduce_async(inputs[r].clone(), ReduceOp::Max, root);
        let want = reference::reduce(&refs, ReduceOp::Max);
        pending.push(Box::new(move || {
            let got = work.wait().map_err(|e| e.to_string())?;
            match r != root || got == want {
                true => Ok(()),
                false => Err(format!("reduce max onto root {root}: wrong values")),
            }
        }));
    }
    let work = comm.all_gather_async(inputs[r].clone(), vec![T::from_f64(0.0); count * p]);
    let want = inputs.concat();
    pending.push(Box::new(move || {
        match work.wait().map_err(|e| e.to_string())?.1 == want {
            true => Ok(()),
            false => Err(format!("all_gather: wrong values on rank {r}")),
        }
    }));
    let work =
        comm.reduce_scatter_async(big[r].clone(), vec![T::from_f64(0.0); count], ReduceOp::Min);
    let want = reference::reduce(&big_refs, ReduceOp::Min)[r * count..(r + 1) * count].to_vec();
    pending.push(Box::new(move || {
        match work.wait().map_err(|e| e.to_string())?.1 == want {
            true => Ok(()),
            false => Err(format!("reduce_scatter min: wrong slice on rank {r}")),
        }
    }));
    let calls = pending.len();
    // Wait newest first; the first failure (in issue order) is the one reported.
    let results: Vec<_> = pending.into_iter().rev().map(|check| check()).collect();
    match results.into_iter().rev().find_map(|r| r.err()) {
        Some(e) => Err(fail(e)),
        None => Ok(calls),
    }
}

/// A count per rank (or per pair) that differs from rank to rank, zero for some, derived from
/// the check's `count` alike on every rank.
fn uneven(count: usize, k: usize) -> usize {
    count / 2 + (k * 7919 + count) % (count + 2)
}

/// Rank `k`'s pattern: `n` elements.
fn data<T: Element>(k: usize, n: usize) -> Vec<T> {
    (0..n).map(|i| pattern(k, i)).collect()
}

fn zeros<T: Element>(n: usize) -> Vec<T> {
    vec![T::from_f64(0.0); n]
}

/// All-to-all, gather and scatter from every root, and the collectives with a count per rank,
/// blocking and non-blocking, against the reference: those `comm` runs
/// ([`Communicator::runs`]).
fn check_personal<T: Element>(comm: &Communicator, algo: Algorithm, count: usize) -> Result<usize> {
    use crate::error::Collective;
    let fail = |what: String| Error::System {
        what: format!("check {algo} {} n={count}", T::DTYPE),
        message: what,
    };
    let mut calls = 0;
    if comm.runs(Collective::AllToAll) {
        calls += check_all_to_all::<T>(comm, count, &fail)?;
    }
    if comm.runs(Collective::AllToAllV) {
        calls += check_all_to_all_v::<T>(comm, count, &fail)?;
    }
    if comm.runs(Collective::Gather) || comm.runs(Collective::Scatter) {
        calls += check_rooted::<T>(comm, count, &fail)?;
    }
    if comm.runs(Collective::AllGatherV) {
        calls += check_all_gather_v::<T>(comm, count, &fail)?;
    }
    if comm.runs(Collective::ReduceScatterV) {
        calls += check_reduce_scatter_v::<T>(comm, count, &fail)?;
    }
    Ok(calls)
}

fn check_all_to_all<T: Element>(
    comm: &Communicator,
    count: usize,
    fail: &dyn Fn(String) -> Error,
) -> Result<usize> {
    let (p, r) = (comm.world_size(), comm.rank());
    // Block k of the output is block r of rank k's input.
    let inputs: Vec<Vec<T>> = (0..p).map(|k| data(k + 2, count * p)).collect();
    let want: Vec<T> = (0..p)
        .flat_map(|k| inputs[k][r * count..(r + 1) * count].to_vec())
        .collect();
    let mut out = zeros(count * p);
    comm.all_to_all(&inputs[r], &mut out)?;
    if out != want {
        return Err(fail(format!("all_to_all: wrong values on rank {r}")));
    }
    let (_, out) = comm
        .all_to_all_async(inputs[r].clone(), zeros(count * p))
        .wait()?;
    if out != want {
        return Err(fail(format!(
            "all_to_all (non-blocking): wrong values on rank {r}"
        )));
    }
    Ok(2)
}

fn check_all_to_all_v<T: Element>(
    comm: &Communicator,
    count: usize,
    fail: &dyn Fn(String) -> Error,
) -> Result<usize> {
    let (p, r) = (comm.world_size(), comm.rank());
    // Rank i sends c(i, j) elements to rank j.
    let c = |i: usize, j: usize| uneven(count, i * p + j);
    let send_counts: Vec<usize> = (0..p).map(|j| c(r, j)).collect();
    let recv_counts: Vec<usize> = (0..p).map(|k| c(k, r)).collect();
    let input = data::<T>(r + 3, send_counts.iter().sum());
    let mut want = Vec::new();
    for k in 0..p {
        let from: usize = (0..r).map(|j| c(k, j)).sum();
        want.extend(data::<T>(k + 3, from + c(k, r)).split_off(from));
    }
    let mut out = zeros(want.len());
    comm.all_to_all_v(&input, &send_counts, &mut out, &recv_counts)?;
    if out != want {
        return Err(fail(format!("all_to_all_v: wrong values on rank {r}")));
    }
    let work = comm.all_to_all_v_async(input, &send_counts, zeros(want.len()), &recv_counts);
    if work.wait()?.1 != want {
        return Err(fail(format!(
            "all_to_all_v (non-blocking): wrong values on rank {r}"
        )));
    }
    Ok(2)
}

/// Gather and scatter from every root (each where `comm` runs it).
fn check_rooted<T: Element>(
    comm: &Communicator,
    count: usize,
    fail: &dyn Fn(String) -> Error,
) -> Result<usize> {
    use crate::error::Collective;
    let (p, r) = (comm.world_size(), comm.rank());
    let mut calls = 0;
    for root in 0..p {
        if comm.runs(Collective::Gather) {
            let mut out = zeros::<T>(count * p);
            comm.gather(&data(r, count), (r == root).then_some(&mut out[..]), root)?;
            let want: Vec<T> = (0..p).flat_map(|k| data(k, count)).collect();
            if r == root && out != want {
                return Err(fail(format!("gather onto root {root}: wrong values")));
            }
            let recv = (r == root).then(|| zeros::<T>(count * p));
            let (_, got) = comm.gather_async(data(r, count), recv, root).wait()?;
            if got.is_some_and(|g| g != want) {
                return Err(fail(format!(
                    "gather onto root {root} (non-blocking): wrong values"
                )));
            }
            calls += 2;
        }
        if comm.runs(Collective::Scatter) {
            let whole = data::<T>(root + 5, count * p);
            let mut mine = zeros(count);
            comm.scatter((r == root).then_some(&whole[..]), &mut mine, root)?;
            if mine[..] != whole[r * count..(r + 1) * count] {
                return Err(fail(format!(
                    "scatter from root {root}: wrong values on rank {r}"
                )));
            }
            let send = (r == root).then(|| whole.clone());
            let (_, got) = comm.scatter_async(send, zeros(count), root).wait()?;
            if got != mine {
                return Err(fail(format!(
                    "scatter from root {root} (non-blocking): wrong values on rank {r}"
                )));
            }
            calls += 2;
        }
    }
    Ok(calls)
}

fn check_all_gather_v<T: Element>(
    comm: &Communicator,
    count: usize,
    fail: &dyn Fn(String) -> Error,
) -> Result<usize> {
    let (p, r) = (comm.world_size(), comm.rank());
    // Uneven counts.
    let counts: Vec<usize> = (0..p).map(|k| uneven(count, k)).collect();
    let total: usize = counts.iter().sum();
    let want: Vec<T> = (0..p).flat_map(|k| data(k, counts[k])).collect();
    let mut out = zeros::<T>(total);
    comm.all_gather_v(&data(r, counts[r]), &mut out, &counts)?;
    if out != want {
        return Err(fail(format!("all_gather_v: wrong values on rank {r}")));
    }
    let (_, out) = comm
        .all_gather_v_async(data::<T>(r, counts[r]), zeros::<T>(total), &counts)
        .wait()?;
    if out != want {
        return Err(fail(format!(
            "all_gather_v (non-blocking): wrong values on rank {r}"
        )));
    }
    Ok(2)
}

fn check_reduce_scatter_v<T: Element>(
    comm: &Communicator,
    count: usize,
    fail: &dyn Fn(String) -> Error,
) -> Result<usize> {
    let (p, r) = (comm.world_size(), comm.rank());
    // Uneven counts.
    let counts: Vec<usize> = (0..p).map(|k| uneven(count, k)).collect();
    let total: usize = counts.iter().sum();
    let at: usize = counts[..r].iter().sum();
    let big: Vec<Vec<T>> = (0..p).map(|k| data(k + 1, total)).collect();
    let refs: Vec<&[T]> = big.iter().map(|v| v.as_slice()).collect();
    let want = reference::reduce(&refs, ReduceOp::Min)[at..at + counts[r]].to_vec();
    let mut out = zeros(counts[r]);
    comm.reduce_scatter_v(&big[r], &mut out, &counts, ReduceOp::Min)?;
    if out != want {
        return Err(fail(format!(
            "reduce_scatter_v min: wrong slice on rank {r}"
        )));
    }
    let work =
        comm.reduce_scatter_v_async(big[r].clone(), zeros(counts[r]), &counts, ReduceOp::Min);
    if work.wait()?.1 != want {
        return Err(fail(format!(
            "reduce_scatter_v min (non-blocking): wrong slice on rank {r}"
        )));
    }
    Ok(2)
}

/// Element i of rank r's random input: magnitudes from 2^-10 to 2^10 and both signs, so that
/// the order of a float sum shows in its bits.
fn random<T: Element>(r: usize, i: usize) -> T {
    let h = hash(r, i);
    let unit = (h >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
    T::from_f64(unit * f64::powi(2.0, (h % 21) as i32 - 10))
}

/// 64 random bits for element `i` of rank `r`.
fn hash(r: usize, i: usize) -> u64 {
    let mut h = (r as u64) << 32 ^ i as u64;
    h = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^= h >> 29;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^ h >> 32
}

/// What a compressed wire ([`crate::Compression`]) did to one f32 all-reduce of random values
/// in [-1, 1): errors against the exact sum, relative to the sum of the magnitudes.
#[derive(Copy, Clone, Debug)]
pub struct CompressionError {
    /// Values reduced per rank.
    pub count: usize,
    /// The largest error of any element.
    pub max: f64,
    /// The root mean square of the errors.
    pub rms: f64,
    /// Every rank ended with the same bits.
    pub agree: bool,
}

/// All-reduce `count` random f32 in [-1, 1) per rank (sum, in place) and measure the error
/// against the exact sum (every rank computes every rank's input) and whether the ranks agree.
/// Every rank calls it.
pub fn compression_error(comm: &Communicator, count: usize) -> Result<CompressionError> {
    let (p, r) = (comm.world_size(), comm.rank());
    let input = |k: usize| -> Vec<f32> {
        (0..count)
            .map(|i| (hash(k + 3, i) >> 40) as f32 / (1u32 << 23) as f32 - 1.0)
            .collect()
    };
    let inputs: Vec<Vec<f32>> = (0..p).map(input).collect();
    let mut buf = inputs[r].clone();
    comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    let (mut max, mut squares) = (0f64, 0f64);
    for (i, got) in buf.iter().enumerate() {
        let exact: f64 = inputs.iter().map(|v| f64::from(v[i])).sum();
        let magnitude: f64 = inputs.iter().map(|v| f64::from(v[i]).abs()).sum();
        let e = (f64::from(*got) - exact).abs() / magnitude.max(f64::MIN_POSITIVE);
        max = max.max(e);
        squares += e * e;
    }
    // FNV-1a of the result's bits, gathered: equal on every rank when the ranks agree.
    let digest = buf.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let mut all = vec![0u64; p];
    comm.all_gather(&[digest], &mut all)?;
    Ok(CompressionError {
        count,
        max,
        rms: (squares / count.max(1) as f64).sqrt(),
        agree: all.iter().all(|&d| d == all[0]),
    })
}

/// On a compressed wire: every f32 all-reduce (the ring and `auto`) lands within the bound of
/// one rounding to the wire type per hop, plus the final one, and every rank has the same bits.
fn check_compression(comm: &mut Communicator, counts: &[usize]) -> Result<usize> {
    let unit = match comm.compression() {
        crate::Compression::F16 => 2f64.powi(-11),
        _ => 2f64.powi(-8),
    };
    let bound = unit * (comm.world_size() as f64 + 1.0);
    let mut calls = 0;
    for algo in [Algorithm::Ring, Algorithm::Auto] {
        comm.set_algorithm(algo)?;
        for &count in counts {
            let e = compression_error(comm, count)?;
            if !(e.agree && e.max <= bound) {
                return Err(Error::System {
                    what: format!("check compression {} {algo} n={count}", comm.compression()),
                    message: format!(
                        "largest relative error {:.3e} (bound {bound:.3e}); ranks agree: {}",
                        e.max, e.agree
                    ),
                });
            }
            calls += 2;
        }
    }
    comm.set_algorithm(Algorithm::Auto)?;
    Ok(calls)
}

/// The reduction in rank order that deterministic mode promises: one kernel pass over every
/// rank's input, rank 0's first.
fn in_rank_order<T: Element>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); inputs.first().map_or(0, Vec::len)];
    let srcs: Vec<&[u8]> = inputs.iter().map(|v| bytemuck::cast_slice(v)).collect();
    let div = (op == ReduceOp::Mean).then_some(inputs.len());
    let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
    crate::dtype::kernels::reduce(
        T::DTYPE,
        op,
        dst,
        &srcs,
        crate::dtype::kernels::Init::Overwrite,
        div,
    );
    out
}

/// Every reducing collective on random floats gives the bits of the reduction in rank order.
fn check_deterministic<T: Element>(
    comm: &Communicator,
    algo: Algorithm,
    count: usize,
) -> Result<usize> {
    let (p, r) = (comm.world_size(), comm.rank());
    let fail = |what: String| Error::System {
        what: format!("check deterministic {algo} {} n={count}", T::DTYPE),
        message: what,
    };
    let bits = |v: &[T]| -> Vec<u8> { bytemuck::cast_slice(v).to_vec() };
    let inputs: Vec<Vec<T>> = (0..p)
        .map(|k| (0..count).map(|i| random(k, i)).collect())
        .collect();
    let mut calls = 0;
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let want = bits(&in_rank_order(&inputs, op));
        let mut buf = inputs[r].clone();
        comm.all_reduce(&mut buf, op)?;
        let mut out = vec![T::from_f64(0.0); count];
        comm.all_reduce_into(&inputs[r], &mut out, op)?;
        for (got, how) in [(&buf, "in place"), (&out, "out of place")] {
            if bits(got) != want {
                return Err(fail(format!(
                    "all_reduce {op} {how}: not the bits of the reduction in rank order on rank {r}"
                )));
            }
        }
        for root in 0..p {
            let mut out = vec![T::from_f64(0.0); count];
            comm.reduce(&inputs[r], (r == root).then_some(&mut out[..]), op, root)?;
            let mut buf = inputs[r].clone();
            comm.reduce_in_place(&mut buf, op, root)?;
            if r == root && (bits(&out) != want || bits(&buf) != want) {
                return Err(fail(format!(
                    "reduce {op} onto root {root}: not the bits of the reduction in rank order"
                )));
            }
        }
        calls += 2 + 2 * p;
    }
    // reduce_scatter and reduce_scatter_v: each rank's block of the same reduction.
    let big: Vec<Vec<T>> = (0..p)
        .map(|k| (0..count * p).map(|i| random(k + 7, i)).collect())
        .collect();
    let want = in_rank_order(&big, ReduceOp::Sum);
    let mut slice = vec![T::from_f64(0.0); count];
    comm.reduce_scatter(&big[r], &mut slice, ReduceOp::Sum)?;
    if bits(&slice) != bits(&want[r * count..(r + 1) * count]) {
        return Err(fail(format!(
            "reduce_scatter: not the bits in rank order on rank {r}"
        )));
    }
    if !comm.runs(crate::error::Collective::ReduceScatterV) {
        // A device group whose engine has no reduce_scatter_v (XLA's).
        return Ok(calls + 1);
    }
    let counts: Vec<usize> = (0..p).map(|k| uneven(count, k)).collect();
    let total: usize = counts.iter().sum();
    let v: Vec<Vec<T>> = (0..p)
        .map(|k| (0..total).map(|i| random(k + 11, i)).collect())
        .collect();
    let want = in_rank_order(&v, ReduceOp::Sum);
    let at: usize = counts[..r].iter().sum();
    let mut mine = vec![T::from_f64(0.0); counts[r]];
    comm.reduce_scatter_v(&v[r], &mut mine, &counts, ReduceOp::Sum)?;
    if bits(&mine) != bits(&want[at..at + counts[r]]) {
        return Err(fail(format!(
            "reduce_scatter_v: not the bits in rank order on rank {r}"
        )));
    }
    Ok(calls + 2)
}
