//! The default call check between processes, which travels with each call's data: every field
//! of a mismatched call is caught with both ranks named, over TCP and shared memory; matched
//! calls of every size still agree; a peer that disappears mid-call is named.
//!
//! The ranks are threads of this test, each with its own network communicator (the same code
//! path as separate processes).

mod common;

use std::time::Duration;

use common::{free_port, spec};

use tutti::{Algorithm, Communicator, Config, Error, ReduceOp, TransportKind};

/// `world` communicators over `kind`, rank r configured by `config(r)`.
fn group(
    world: usize,
    kind: TransportKind,
    config: impl Fn(usize) -> Config + Sync,
) -> Vec<Communicator> {
    let master = format!("127.0.0.1:{}", free_port());
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (m, config) = (&master, &config);
                s.spawn(move || {
                    let c = config(r).with_timeout(Duration::from_secs(20));
                    Communicator::from_cluster(&spec(r, world, m), kind, &c).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Run `call` on every rank at once; the results in rank order.
fn on_all<T: Send>(comms: &[Communicator], call: impl Fn(&Communicator) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| call(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank 1 makes a call that differs from rank 0's in `field`; each rank's error must name the
/// field and the other rank (as its own `Mismatch`, or in the reason of the peer that found it
/// first).
fn mismatch(field: &str, kind: TransportKind) {
    let configs = |r: usize| match field {
        "algorithm" => Config::default().with_algorithm(if r == 1 {
            Algorithm::ReduceToOne { root: 0 }
        } else {
            Algorithm::Ring
        }),
        "call check (TUTTI_CHECK)" => Config::default().with_full_check(r == 1),
        _ => Config::default().with_full_check(false),
    };
    let comms = group(2, kind, configs);
    let errs = on_all(&comms, |c| {
        let odd = c.rank() == 1;
        match field {
            "count" => c.all_reduce(&mut vec![1.0f32; if odd { 5 } else { 4 }], ReduceOp::Sum),
            "dtype" if odd => c.all_reduce(&mut [1.0f64; 4], ReduceOp::Sum),
            "dtype" => c.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum),
            "op" => c.all_reduce(
                &mut [1.0f32; 4],
                if odd { ReduceOp::Max } else { ReduceOp::Sum },
            ),
            "collective" if odd => c.all_gather(&[1.0f32; 4], &mut [0.0f32; 8]),
            "collective" | "algorithm" | "call check (TUTTI_CHECK)" => {
                c.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
            }
            "root" => c.broadcast(&mut [1.0f32; 4], if odd { 1 } else { 0 }),
            _ => unreachable!("{field}"),
        }
        .unwrap_err()
    });
    for (r, e) in errs.iter().enumerate() {
        let text = e.to_string();
        let named = match e {
            Error::Mismatch { peer, field: f, .. } => *peer == 1 - r && *f == field,
            Error::Aborted { reason, .. } => reason.contains(field),
            _ => false,
        };
        assert!(
            named && text.contains("rank 0") && text.contains("rank 1"),
            "{kind} {field}, rank {r}: {e}"
        );
    }
}

/// The fields a test call can make differ between two ranks.
const FIELDS: [&str; 7] = [
    "count",
    "dtype",
    "op",
    "collective",
    "root",
    "algorithm",
    "call check (TUTTI_CHECK)",
];

#[test]
fn every_field_of_a_mismatched_call_is_named_over_tcp() {
    for field in FIELDS {
        mismatch(field, TransportKind::Tcp);
    }
}

#[test]
fn every_field_of_a_mismatched_call_is_named_over_shm() {
    for field in FIELDS {
        mismatch(field, TransportKind::Shm);
    }
}

/// Many small calls of changing sizes, then large ones, agree with the sums computed here, on
/// world sizes 2 to 4 (oversubscribed above 2 on a 2-core machine: waits must sleep).
#[test]
fn repeated_calls_of_every_size_agree() {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        for world in 2..=4 {
            let comms = group(world, kind, |_| Config::default());
            let ok = on_all(&comms, |c| {
                let r = c.rank();
                for (i, n) in [0usize, 1, 2, 7, 256, 4099, 70_001, 1 << 20]
                    .iter()
                    .cycle()
                    .take(40)
                    .enumerate()
                {
                    let mut v: Vec<f64> = (0..*n).map(|k| (k + r + i) as f64).collect();
                    c.all_reduce(&mut v, ReduceOp::Sum)?;
                    let want = |k: usize| (0..world).map(|q| (k + q + i) as f64).sum::<f64>();
                    if let Some(k) = (0..*n).find(|&k| v[k] != want(k)) {
                        panic!("{kind} world {world} call {i} n {n}: [{k}] = {}", v[k]);
                    }
                    let mut g = vec![0u32; n * world];
                    c.all_gather(&vec![r as u32; *n], &mut g)?;
                    assert!(g
                        .chunks(n.max(&1).to_owned())
                        .enumerate()
                        .all(|(q, ch)| *n == 0 || ch.iter().all(|&x| x == q as u32)));
                }
                c.barrier()
            });
            assert!(ok.iter().all(|r| r.is_ok()), "{kind} world {world}: {ok:?}");
        }
    }
}

/// A rank that stops taking part mid-call (its communicator dropped while peers wait on the
/// fast path) is named by the survivor, within the timeout.
#[test]
fn a_peer_that_leaves_mid_call_is_named() {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let mut comms = group(2, kind, |_| Config::default());
        let gone = comms.pop().unwrap();
        let t = std::time::Instant::now();
        let e = std::thread::scope(|s| {
            let h = s.spawn(|| comms[0].all_reduce(&mut [1.0f32; 64], ReduceOp::Sum));
            std::thread::sleep(Duration::from_millis(200));
            drop(gone);
            h.join().unwrap().unwrap_err()
        });
        assert!(t.elapsed() < Duration::from_secs(10), "{kind}: {e}");
        assert!(
            matches!(&e, Error::PeerLost { peer: 1, .. })
                || matches!(&e, Error::Aborted { reason, .. } if reason.contains("rank 1")),
            "{kind}: {e}"
        );
    }
}

/// One rank of three rejects its own arguments (a bitwise op on floats; an all-gather output of
/// the wrong length) while the others make a sound call: it gets its own `InvalidArgument`, and
/// every other rank an error naming it and its reason (its rejection, or the abort it sent),
/// at once, whatever its call's fields say.
/// Under the default check the call's data carries the check, so the call aborts the
/// communicator (as a mismatch found in the data does), and a shrink on every rank gives the
/// same ranks a new one; under `TUTTI_CHECK=full` every rank meets first and the communicator
/// goes on.
#[test]
fn a_rank_that_rejects_its_arguments_is_named_on_every_peer() {
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        for full in [false, true] {
            let comms = group(3, kind, |_| Config::default().with_full_check(full));
            for case in ["op", "length"] {
                let t = std::time::Instant::now();
                let errs = on_all(&comms, |c| {
                    let odd = c.rank() == 1;
                    match case {
                        "op" => c.all_reduce(
                            &mut [1.0f32; 4],
                            if odd { ReduceOp::BAnd } else { ReduceOp::Sum },
                        ),
                        _ => c.all_gather(&[1.0f32; 4], &mut vec![0.0; if odd { 8 } else { 12 }]),
                    }
                    .unwrap_err()
                });
                let why = match case {
                    "op" => "band is defined on integer types only, not f32",
                    _ => "all_gather needs world size × input = 3 × 4 = 12",
                };
                for (r, e) in errs.iter().enumerate() {
                    let text = e.to_string();
                    if r == 1 {
                        assert!(
                            matches!(e, Error::InvalidArgument { .. }) && text.contains(why),
                            "{kind} full={full} {case}, rank 1: {e}"
                        );
                    } else {
                        assert!(
                            (text.contains("rank 1 rejected its arguments")
                                || text.contains("rank 1 gave up: "))
                                && text.contains(why),
                            "{kind} full={full} {case}, rank {r}: {e}"
                        );
                    }
                }
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "{kind} full={full} {case}: a rejection must not wait for the timeout"
                );
                let after = on_all(&comms, |c| {
                    let mut v = [1u32 << c.rank()];
                    c.all_reduce(&mut v, ReduceOp::Sum).map(|()| v[0])
                });
                if full {
                    for got in after {
                        assert_eq!(got.unwrap(), 7, "{kind} {case}: usable after a rejection");
                    }
                    continue;
                }
                for (r, got) in after.iter().enumerate() {
                    assert!(
                        matches!(got, Err(Error::Aborted { .. })),
                        "{kind} {case}, rank {r}: {got:?}"
                    );
                }
                // Nobody was lost: a shrink on every rank gives the same ranks a communicator
                // that works, without restarting.
                let again = on_all(&comms, |c| {
                    let c = c.shrink()?;
                    let mut v = [1u32 << c.rank()];
                    c.all_reduce(&mut v, ReduceOp::Sum)
                        .map(|()| (c.rank(), c.world_size(), v[0]))
                });
                for (r, got) in again.into_iter().enumerate() {
                    assert_eq!(got.unwrap(), (r, 3, 7), "{kind} {case}: shrunk, rank {r}");
                }
                break;
            }
        }
    }
}
