//! `tutti check`: every collective with every algorithm on one communicator, blocking and in
//! flight, against the reference.

use super::pattern;
use crate::algorithm::Algorithm;
use crate::comm::Communicator;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::reference;

/// Check every collective with every algorithm on this communicator against the reference:
/// all-reduce (every op, in place and out of place, f32 bf16 i32 u8 f64), broadcast and reduce
/// from every root, all-gather, reduce-scatter, barrier. Every rank calls it; returns the number
/// of calls checked, or an error naming the algorithm, collective, dtype and count that failed.
pub fn check(comm: &mut Communicator, counts: &[usize]) -> Result<usize> {
    let mut calls = 0;
    for algo in Algorithm::ALL_REDUCE {
        if algo == Algorithm::Direct && !comm.has_peer_memory() {
            continue;
        }
        comm.set_algorithm(algo)?;
        for &count in counts {
            for dtype in [DType::F32, DType::BF16, DType::I32, DType::U8, DType::F64] {
                calls += crate::for_each_dtype!(dtype, T => { check_one::<T>(comm, algo, count)? });
                calls += crate::for_each_dtype!(dtype, T => { check_in_flight::<T>(comm, algo, count)? });
            }
        }
    }
    comm.barrier()?;
    Ok(calls + 1)
}

fn check_one<T: Element>(comm: &Communicator, algo: Algorithm, count: usize) -> Result<usize> {
    let (p, r) = (comm.world_size(), comm.rank());
    let fail = |what: String| Error::System {
        what: format!("check {algo} {} n={count}", T::DTYPE),
        message: what,
    };
    let data = |k: usize, n: usize| -> Vec<T> { (0..n).map(|i| pattern(k, i)).collect() };
    let inputs: Vec<Vec<T>> = (0..p).map(|k| data(k, count)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let mut calls = 0;
    for op in ReduceOp::ALL {
        let want = reference::reduce(&refs, op);
        let tol = reference::tolerance(T::DTYPE, op, p, 2.0);
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
    let data = |k: usize, n: usize| -> Vec<T> { (0..n).map(|i| pattern(k, i)).collect() };
    let inputs: Vec<Vec<T>> = (0..p).map(|k| data(k, count)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let big: Vec<Vec<T>> = (0..p).map(|k| data(k + 1, count * p)).collect();
    let big_refs: Vec<&[T]> = big.iter().map(|v| v.as_slice()).collect();
    type Check = Box<dyn FnOnce() -> std::result::Result<(), String>>;
    let mut pending: Vec<Check> = Vec::new();
    for op in ReduceOp::ALL {
        let work = comm.all_reduce_async(inputs[r].clone(), op);
        let want = reference::reduce(&refs, op);
        let tol = reference::tolerance(T::DTYPE, op, p, 2.0);
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
