//! Non-blocking calls: many in flight, waited in any order; a mismatch among them fails the
//! right handles; abort wakes every pending handle; a short wait times out and the call still
//! completes. (Across processes, `tutti check` issues every collective in flight: see
//! tests/multiprocess.rs.)

mod common;

use std::time::{Duration, Instant};

use common::data;
use tutti::reference::{count_errors, reduce as reference, tolerance};
use tutti::{run_local, Algorithm, Collective, Config, Error, ReduceOp, Work};

/// A small deterministic generator (the test must not depend on a crate for it).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as usize
    }
}

type Check = Box<dyn FnOnce() -> Result<(), String>>;

/// Issue one call of a mixed sequence (the same on every rank) and return its check.
fn issue(comm: &tutti::Communicator, i: usize) -> Check {
    let (p, r) = (comm.world_size(), comm.rank());
    let sizes = [0usize, 1, 13, 1000, 4099, 70_001];
    let count = sizes[i % sizes.len()];
    let inputs: Vec<Vec<f32>> = (0..p).map(|k| data::<f32>(k + i, count)).collect();
    let refs: Vec<&[f32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let what = format!("call {i} (n={count}) on rank {r}");
    match i % 5 {
        0 => {
            let ops = ReduceOp::ALL.map(|o| (!o.is_bitwise()).then_some(o));
            let ops: Vec<ReduceOp> = ops.into_iter().flatten().collect();
            let op = ops[i % ops.len()];
            let w = comm.all_reduce_async(inputs[r].clone(), op);
            let want = reference(&refs, op);
            let tol = tolerance(tutti::DType::F32, op, p, 4.0);
            Box::new(move || {
                let got = w.wait().map_err(|e| format!("{what}: {e}"))?;
                match count_errors(&got, &want, tol) {
                    0 => Ok(()),
                    bad => Err(format!("{what}: all_reduce {op}: {bad} wrong")),
                }
            })
        }
        1 => {
            let root = i % p;
            let buf = if r == root {
                inputs[root].clone()
            } else {
                vec![0.0; count]
            };
            let w = comm.broadcast_async(buf, root);
            let want = inputs[root].clone();
            Box::new(
                move || match w.wait().map_err(|e| format!("{what}: {e}"))? == want {
                    true => Ok(()),
                    false => Err(format!("{what}: broadcast wrong")),
                },
            )
        }
        2 => {
            let w = comm.all_gather_async(inputs[r].clone(), vec![0.0f32; count * p]);
            let want = inputs.concat();
            Box::new(
                move || match w.wait().map_err(|e| format!("{what}: {e}"))?.1 == want {
                    true => Ok(()),
                    false => Err(format!("{what}: all_gather wrong")),
                },
            )
        }
        3 => {
            let big: Vec<Vec<f32>> = (0..p).map(|k| data::<f32>(k + i, count * p)).collect();
            let big_refs: Vec<&[f32]> = big.iter().map(|v| v.as_slice()).collect();
            let want = reference(&big_refs, ReduceOp::Sum)[r * count..(r + 1) * count].to_vec();
            let tol = tolerance(tutti::DType::F32, ReduceOp::Sum, p, 4.0);
            let w = comm.reduce_scatter_async(big[r].clone(), vec![0.0f32; count], ReduceOp::Sum);
            Box::new(move || {
                let got = w.wait().map_err(|e| format!("{what}: {e}"))?.1;
                match count_errors(&got, &want, tol) {
                    0 => Ok(()),
                    bad => Err(format!("{what}: reduce_scatter: {bad} wrong")),
                }
            })
        }
        _ => {
            let root = (i / 5) % p;
            let w = comm.reduce_async(inputs[r].clone(), ReduceOp::Max, root);
            let want = reference(&refs, ReduceOp::Max);
            let mine = inputs[r].clone();
            Box::new(move || {
                let got = w.wait().map_err(|e| format!("{what}: {e}"))?;
                let ok = if r == root { got == want } else { got == mine };
                ok.then_some(())
                    .ok_or_else(|| format!("{what}: reduce onto {root} wrong"))
            })
        }
    }
}

#[test]
fn sixty_four_calls_in_flight_waited_in_random_order() {
    for algo in [Algorithm::Auto, Algorithm::Ring, Algorithm::Direct] {
        for world in [2, 3, 4] {
            let config = Config::default()
                .with_algorithm(algo)
                .with_chunk_bytes(4096)
                .with_timeout(Duration::from_secs(60));
            run_local(world, &config, |comm| {
                let mut checks: Vec<Option<Check>> =
                    (0..64).map(|i| Some(issue(comm, i))).collect();
                let mut rng = Lcg(comm.rank() as u64 * 7919 + world as u64);
                let mut left: Vec<usize> = (0..64).collect();
                while !left.is_empty() {
                    let k = left.swap_remove(rng.next() % left.len());
                    let check = checks[k].take().unwrap();
                    check().unwrap_or_else(|e| panic!("{algo} P={world}: {e}"));
                }
                // Blocking calls after the burst keep the order too.
                let mut x = vec![1.0f32; 5];
                comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x, vec![world as f32; 5]);
            })
            .unwrap();
        }
    }
}

#[test]
fn a_mismatch_in_flight_fails_only_its_handles_naming_rank_and_field() {
    let config = Config::default().with_timeout(Duration::from_secs(30));
    let out = run_local(2, &config, |comm| {
        let r = comm.rank();
        let works: Vec<Work<Vec<f32>>> = (0..8)
            .map(|i| {
                // Call 5 differs in count on rank 1.
                let n = if i == 5 && r == 1 { 11 } else { 10 };
                comm.all_reduce_async(vec![1.0f32; n], ReduceOp::Sum)
            })
            .collect();
        works.into_iter().map(|w| w.wait()).collect::<Vec<_>>()
    })
    .unwrap();
    for (rank, results) in out.iter().enumerate() {
        for (i, res) in results.iter().enumerate() {
            if i == 5 {
                match res {
                    Err(Error::Mismatch {
                        site, peer, field, ..
                    }) => {
                        assert_eq!(field, &"count");
                        assert_eq!(*peer, 1 - rank);
                        assert_eq!(site.call, 5);
                        assert_eq!(site.collective, Collective::AllReduce);
                    }
                    other => panic!("rank {rank} call 5: want a count mismatch, got {other:?}"),
                }
            } else {
                assert_eq!(
                    res.as_ref().unwrap(),
                    &vec![2.0f32; 10],
                    "rank {rank} call {i}"
                );
            }
        }
    }
}

#[test]
fn abort_from_another_thread_wakes_every_pending_handle() {
    let config = Config::default().with_timeout(Duration::from_secs(60));
    let comms = tutti::local_group(2, &config).unwrap();
    // Rank 1 never calls: rank 0's calls wait until the abort.
    let works: Vec<Work<Vec<f32>>> = (0..8)
        .map(|_| comms[0].all_reduce_async(vec![1.0f32; 1000], ReduceOp::Sum))
        .collect();
    let abort = comms[0].abort_handle();
    let t = Instant::now();
    let aborter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        abort.abort("the trainer gave up");
    });
    for (i, w) in works.into_iter().enumerate() {
        match w.wait() {
            Err(Error::Aborted { reason, .. }) => {
                assert!(reason.contains("the trainer gave up"), "call {i}: {reason}")
            }
            other => panic!("call {i}: want Aborted, got {other:?}"),
        }
    }
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "the handles woke only after {:?}",
        t.elapsed()
    );
    aborter.join().unwrap();
    // Later calls fail at once too.
    assert!(matches!(
        comms[0]
            .all_reduce_async(vec![1.0f32; 4], ReduceOp::Sum)
            .wait(),
        Err(Error::Aborted { .. })
    ));
}

#[test]
fn a_short_wait_times_out_and_the_call_completes_later() {
    let config = Config::default().with_timeout(Duration::from_secs(30));
    let comms = tutti::local_group(2, &config).unwrap();
    let work = comms[0].all_reduce_async(vec![1.0f32, 2.0], ReduceOp::Sum);
    match work.wait_timeout(Duration::from_millis(50)) {
        Err(Error::Timeout {
            site,
            waiting_for,
            phase,
            ..
        }) => {
            assert!(waiting_for.is_empty());
            assert_eq!(phase, "complete");
            assert_eq!((site.rank, site.call), (0, 0));
            let msg = Error::Timeout {
                site,
                waiting_for,
                phase,
                timeout: Duration::from_millis(50),
                stalled_on: Vec::new(),
            }
            .to_string();
            assert!(msg.contains("wait for it again"), "{msg}");
        }
        other => panic!("want a Timeout of the wait, got {other:?}"),
    }
    assert!(!work.is_completed());
    // The peer arrives late; the call completes and the handle delivers it.
    let mut peer = vec![10.0f32, 20.0];
    comms[1].all_reduce(&mut peer, ReduceOp::Sum).unwrap();
    assert_eq!(work.wait_timeout(Duration::from_secs(10)), Ok(()));
    assert!(work.is_completed());
    assert_eq!(work.wait().unwrap(), vec![11.0, 22.0]);
    assert_eq!(peer, vec![11.0, 22.0]);
}

#[test]
fn blocking_calls_from_two_threads_are_ordered_not_rejected() {
    let config = Config::default().with_timeout(Duration::from_secs(30));
    let out = run_local(2, &config, |comm| {
        // Two threads per rank issue blocking barriers and all-reduces of equal shape: whatever
        // order they are issued in, each completes, and every sum is right.
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        (0..20)
                            .map(|_| {
                                let mut x = [1u64; 3];
                                comm.all_reduce(&mut x, ReduceOp::Sum).map(|_| x)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    })
    .unwrap();
    for results in out {
        for r in results {
            assert_eq!(r.unwrap(), [2u64; 3]);
        }
    }
}

#[test]
fn dropping_a_communicator_with_calls_in_flight_completes_them() {
    let config = Config::default().with_timeout(Duration::from_secs(30));
    let comms = tutti::local_group(2, &config).unwrap();
    let mut works = Vec::new();
    for c in &comms {
        works.push(c.all_reduce_async(vec![c.rank() as i64 + 1; 100], ReduceOp::Sum));
        works.push(c.all_reduce_async(vec![2i64; 100], ReduceOp::Prod));
    }
    drop(comms);
    let got: Vec<Vec<i64>> = works.into_iter().map(|w| w.wait().unwrap()).collect();
    assert_eq!(got[0], vec![3; 100]);
    assert_eq!(got[1], vec![4; 100]);
    assert_eq!(got[2], vec![3; 100]);
    assert_eq!(got[3], vec![4; 100]);
}
