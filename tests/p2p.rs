//! Point-to-point: `send`, `recv` and `send_recv` groups on threads and between processes
//! (ranks meeting over TCP, and over shared memory): values, per-pair order, groups that
//! cannot deadlock, other ranks left alone, and every mistake an error naming both ranks.

use std::sync::Arc;
use std::time::Duration;

mod common;

use tutti::{run_local, Communicator, Config, Error, PeerOp, ReduceOp, TransportKind};

fn quick() -> Config {
    Config::default().with_timeout(Duration::from_secs(20))
}

#[derive(Copy, Clone, Debug)]
enum Kind {
    Threads,
    Tcp,
    Shm,
}

const KINDS: [Kind; 3] = [Kind::Threads, Kind::Tcp, Kind::Shm];

/// Run `f` on every rank of a world of `p` ranks of `kind`; the results in rank order.
fn world<R: Send + 'static>(
    kind: Kind,
    p: usize,
    config: Config,
    f: impl Fn(&Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let transport = match kind {
        Kind::Threads => return run_local(p, &config, |c| f(c)).unwrap(),
        Kind::Tcp => TransportKind::Tcp,
        Kind::Shm => TransportKind::Shm,
    };
    let store = Arc::new(common::MemStore::default());
    let f = Arc::new(f);
    let handles: Vec<_> = (0..p)
        .map(|r| {
            let (store, f, config) = (store.clone(), f.clone(), config.clone());
            std::thread::spawn(move || {
                let comm = Communicator::from_store(
                    r,
                    p,
                    &*store,
                    "a-token-of-32-bytes-for-the-test",
                    "127.0.0.1",
                    transport,
                    &config,
                )
                .unwrap();
                f(&comm)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_ring_of_sends_and_receives_in_a_group() {
    for kind in KINDS {
        for p in [1, 2, 3, 5] {
            // 3 MiB each way: more than a socket holds, so a group that ran its sends before
            // its receives would deadlock.
            let n = 3 << 18;
            let got = world(kind, p, quick(), move |c| {
                let (r, p) = (c.rank(), c.world_size());
                let send: Vec<f32> = (0..n).map(|i| (r * n + i) as f32).collect();
                let mut recv = vec![0.0f32; n];
                c.send_recv(&mut [
                    PeerOp::send(&send, (r + 1) % p),
                    PeerOp::recv(&mut recv, (r + p - 1) % p),
                ])
                .unwrap();
                recv
            });
            for (r, recv) in got.iter().enumerate() {
                let from = (r + p - 1) % p;
                assert!(
                    recv.iter()
                        .enumerate()
                        .all(|(i, &x)| x == (from * n + i) as f32),
                    "{kind:?} p={p}: rank {r} did not get rank {from}'s buffer"
                );
            }
        }
    }
}

/// The group without waiting: a ring of two messages each way per rank, an all-reduce issued
/// behind it, and the buffers handed back filled; a group with nothing in it completes.
#[test]
fn a_group_issued_without_waiting_hands_its_buffers_back() {
    for kind in KINDS {
        for p in [1, 2, 3] {
            let n = 3 << 16;
            let got = world(kind, p, quick(), move |c| {
                let (r, p) = (c.rank(), c.world_size());
                let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
                let mine = |k: usize| (0..n).map(|i| (r * n + i + k) as f64).collect::<Vec<_>>();
                let work = c.send_recv_async(
                    vec![(mine(0), next), (mine(1), next)],
                    vec![(vec![0.0f64; n], prev), (vec![0.0f64; n], prev)],
                );
                let mut one = [1u32];
                c.all_reduce(&mut one, ReduceOp::Sum).unwrap();
                assert_eq!(one[0] as usize, p);
                let (sent, received) = work.wait().unwrap();
                assert_eq!(sent[1], (mine(1), next), "the sends come back unchanged");
                let empty = c.send_recv_async::<f64, Vec<f64>, Vec<f64>>(vec![], vec![]);
                assert!(empty.wait().unwrap().0.is_empty());
                // This rank's own mistakes fail the Work, and the communicator goes on.
                let out = c.send_recv_async::<f64, _, Vec<f64>>(vec![(vec![1.0], p)], vec![]);
                let e = out.wait().unwrap_err().to_string();
                assert!(e.contains(&format!("peer {p}")), "{e}");
                let alone = c.send_recv_async::<f64, _, Vec<f64>>(vec![(vec![1.0], r)], vec![]);
                let e = alone.wait().unwrap_err().to_string();
                assert!(e.contains("to itself"), "{e}");
                c.barrier().unwrap();
                received
            });
            for (r, received) in got.iter().enumerate() {
                let from = (r + p - 1) % p;
                for (k, (buf, peer)) in received.iter().enumerate() {
                    assert_eq!(*peer, from);
                    assert!(
                        buf.iter()
                            .enumerate()
                            .all(|(i, &x)| x == (from * n + i + k) as f64),
                        "{kind:?} p={p}: rank {r}'s receive {k} is not rank {from}'s send {k}"
                    );
                }
            }
        }
    }
}

#[test]
fn sends_match_receives_in_order_and_other_ranks_are_left_alone() {
    for kind in KINDS {
        let got = world(kind, 4, quick(), |c| {
            let r = c.rank();
            let mut out = Vec::new();
            // Ranks 0 and 1 talk (several messages, one way and the other); 2 and 3 do not.
            if r == 0 {
                c.send(&[1u8, 2, 3], 1).unwrap();
                c.send::<u8>(&[], 1).unwrap();
                c.send(&[4.5f64; 1000], 1).unwrap();
                let mut back = [0i64; 2];
                c.recv(&mut back, 1).unwrap();
                out.push(back.iter().map(|&x| x as f64).collect::<Vec<_>>());
            } else if r == 1 {
                let mut a = [0u8; 3];
                let mut b: [u8; 0] = [];
                let mut d = vec![0.0f64; 1000];
                c.recv(&mut a, 0).unwrap();
                c.recv(&mut b, 0).unwrap();
                c.recv(&mut d, 0).unwrap();
                c.send(&[-7i64, 7], 0).unwrap();
                out.push(a.iter().map(|&x| x as f64).collect());
                out.push(vec![d.iter().sum::<f64>()]);
            }
            // Then a collective on every rank, then point-to-point again between 2 and 3.
            let mut v = [r as u32 + 1];
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            out.push(vec![v[0] as f64]);
            if r == 2 {
                let work = c.send_async(vec![9i32; 17], 3);
                assert_eq!(work.wait().unwrap(), vec![9; 17]);
            } else if r == 3 {
                let got = c.recv_async(vec![0i32; 17], 2).wait().unwrap();
                out.push(got.iter().map(|&x| x as f64).collect());
            }
            out
        });
        assert_eq!(got[0], [vec![-7.0, 7.0], vec![10.0]], "{kind:?}");
        assert_eq!(
            got[1],
            [vec![1.0, 2.0, 3.0], vec![4500.0], vec![10.0]],
            "{kind:?}"
        );
        assert_eq!(got[2], [vec![10.0]], "{kind:?}");
        assert_eq!(got[3], [vec![10.0], vec![9.0; 17]], "{kind:?}");
    }
}

#[test]
fn two_ranks_that_both_send_first_in_a_group_do_not_deadlock() {
    for kind in KINDS {
        let n = 1 << 20;
        let got = world(kind, 2, quick(), move |c| {
            let r = c.rank();
            let mine = vec![r as u32 + 1; n];
            let (mut a, mut b) = (vec![0u32; n], vec![0u32; 5]);
            // Two messages each way to the same peer: they keep their order.
            c.send_recv(&mut [
                PeerOp::send(&mine, 1 - r),
                PeerOp::send(&[r as u32; 5], 1 - r),
                PeerOp::recv(&mut a, 1 - r),
                PeerOp::recv(&mut b, 1 - r),
            ])
            .unwrap();
            (a[0], a[n - 1], b)
        });
        assert_eq!(got[0], (2, 2, vec![1; 5]), "{kind:?}");
        assert_eq!(got[1], (1, 1, vec![0; 5]), "{kind:?}");
    }
}

#[test]
fn a_group_may_send_to_its_own_rank() {
    let got = run_local(2, &quick(), |c| {
        let r = c.rank();
        let mut own = [0u32; 3];
        c.send_recv(&mut [PeerOp::send(&[r as u32; 3], r), PeerOp::recv(&mut own, r)])
            .unwrap();
        // Unmatched: refused before anything moves, and the communicator goes on.
        let e = c.send(&[1u32], r).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().contains("sends to itself"), "{e}");
        let mut v = [1u32];
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        (own, v[0])
    })
    .unwrap();
    assert_eq!(got, [([0; 3], 2), ([1; 3], 2)]);
}

#[test]
fn argument_errors_name_what_was_wrong() {
    let errs = run_local(2, &quick(), |c| {
        let mut out = Vec::new();
        out.push(c.send(&[1.0f32], 2).unwrap_err());
        // A receive that overlaps a send of the same group.
        let mut whole = [0u8; 8];
        let ptr = whole.as_mut_ptr();
        // SAFETY: a deliberately overlapping pair, refused before either is touched.
        let (x, y) = unsafe {
            (
                std::slice::from_raw_parts(ptr, 8),
                std::slice::from_raw_parts_mut(ptr.add(4), 4),
            )
        };
        out.push(
            c.send_recv(&mut [PeerOp::send(x, 1), PeerOp::recv(y, 1)])
                .unwrap_err(),
        );
        out
    })
    .unwrap();
    for errs in errs {
        assert!(
            errs[0].to_string().contains("peer 2 is out of range"),
            "{}",
            errs[0]
        );
        assert!(
            errs[1]
                .to_string()
                .contains("overlaps the buffer of send 0"),
            "{}",
            errs[1]
        );
        assert!(errs[0].to_string().contains("send"), "{}", errs[0]);
        assert!(errs[1].to_string().contains("send_recv"), "{}", errs[1]);
    }
}

#[test]
fn a_send_and_receive_that_disagree_name_both_ranks() {
    for kind in KINDS {
        // Count, then dtype.
        for dtype_differs in [false, true] {
            let got = world(kind, 2, quick(), move |c| {
                if c.rank() == 0 {
                    let first = if dtype_differs {
                        c.send(&[1i32; 4], 1)
                    } else {
                        c.send(&[1.0f32; 5], 1)
                    };
                    // The receiver aborted the communicator: this rank's next call says so
                    // (between threads a send is already delivered and the abort is seen on
                    // the next call; between processes too).
                    let mut v = [1.0f32];
                    let next = c.recv(&mut v, 1);
                    (first.err(), next.err())
                } else {
                    let mut got = [0.0f32; 4];
                    (c.recv(&mut got, 0).err(), None)
                }
            });
            let recv_err = got[1].0.as_ref().expect("the receive fails").to_string();
            let want = if dtype_differs {
                "rank 0 sent 4 i32 where rank 1 receives 4 f32"
            } else {
                "rank 0 sent 5 f32 where rank 1 receives 4 f32"
            };
            assert!(recv_err.contains(want), "{kind:?}: {recv_err}");
            let sender = got[0].0.as_ref().or(got[0].1.as_ref());
            let sender = sender.expect("the sender learns of it").to_string();
            assert!(
                sender.contains("abort") || sender.contains("gave up"),
                "{kind:?}: {sender}"
            );
        }
    }
}

#[test]
fn a_receive_with_no_send_times_out_naming_the_peer() {
    for kind in KINDS {
        let config = Config::default().with_timeout(Duration::from_millis(1500));
        let got = world(kind, 3, config, |c| {
            if c.rank() == 2 {
                let mut x = [0u8; 4];
                Some(c.recv(&mut x, 1).unwrap_err())
            } else {
                // Rank 1 never sends; it waits out the timeout so that its connections stay.
                std::thread::sleep(Duration::from_millis(2500));
                None
            }
        });
        let e = got[2].as_ref().unwrap();
        match e {
            Error::Timeout { waiting_for, .. } => {
                assert_eq!(waiting_for, &[1], "{kind:?}: {e}")
            }
            other => panic!("{kind:?}: expected a timeout, got {other}"),
        }
    }
}

#[test]
fn a_collective_where_a_send_is_due_is_a_mismatch_between_processes() {
    let got = world(Kind::Tcp, 2, quick(), |c| {
        let mut v = [1.0f32; 4];
        if c.rank() == 0 {
            let _ = c.send(&[1.0f32; 4], 1);
            c.all_reduce(&mut v, ReduceOp::Sum).err()
        } else {
            let e = c.all_reduce(&mut v, ReduceOp::Sum).err();
            let _ = c.recv(&mut v, 0);
            e
        }
    });
    let e = got[1].as_ref().expect("rank 1's all_reduce fails");
    match e {
        Error::Mismatch {
            peer, field, mine, ..
        } => {
            assert_eq!(
                (*peer, *field, mine.as_str()),
                (0, "collective", "all_reduce")
            );
        }
        other => panic!("expected a mismatch, got {other}"),
    }
}

#[test]
fn cpu_device_ranks_take_point_to_point() {
    let comms = tutti::device_group(&["cpu:0", "cpu:1"], &quick()).unwrap();
    // cpu:N ranks run the host algorithms, so they take point-to-point calls.
    std::thread::scope(|s| {
        s.spawn(|| comms[0].send(&[3u8], 1).unwrap());
        let mut x = [0u8];
        comms[1].recv(&mut x, 0).unwrap();
        assert_eq!(x, [3]);
    });
}

#[test]
fn peers_that_group_differently_still_match_in_order() {
    for kind in KINDS {
        let got = world(kind, 2, quick(), |c| {
            if c.rank() == 0 {
                // One group: two sends, then a receive that the peer sends only after both.
                let mut back = [0u64; 2];
                c.send_recv(&mut [
                    PeerOp::send(&[1u64; 3], 1),
                    PeerOp::send(&[2u64; 5], 1),
                    PeerOp::recv(&mut back, 1),
                ])
                .unwrap();
                back.to_vec()
            } else {
                let (mut a, mut b) = ([0u64; 3], [0u64; 5]);
                c.recv(&mut a, 0).unwrap();
                c.recv(&mut b, 0).unwrap();
                c.send(&[a[0] + b[0]; 2], 0).unwrap();
                vec![a[0], b[0]]
            }
        });
        assert_eq!(got, [vec![3, 3], vec![1, 2]], "{kind:?}");
    }
}

#[test]
fn an_abort_during_a_receive_reaches_the_peer_at_once() {
    for kind in KINDS {
        let config = Config::default().with_timeout(Duration::from_secs(30));
        let got = world(kind, 2, config, |c| {
            let mut x = [0u8; 4];
            if c.rank() == 0 {
                let handle = c.abort_handle();
                let t = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(300));
                    handle.abort("the user stopped it");
                });
                let e = c.recv(&mut x, 1).unwrap_err();
                t.join().unwrap();
                (e, Duration::ZERO)
            } else {
                let start = std::time::Instant::now();
                let e = c.recv(&mut x, 0).unwrap_err();
                (e, start.elapsed())
            }
        });
        let (e, took) = &got[1];
        assert!(
            e.to_string().contains("the user stopped it"),
            "{kind:?}: {e}"
        );
        assert!(*took < Duration::from_secs(10), "{kind:?}: {took:?}");
    }
}

#[test]
fn a_receive_that_meets_a_collective_names_it() {
    for kind in [Kind::Tcp, Kind::Shm] {
        let got = world(kind, 2, quick(), |c| {
            if c.rank() == 0 {
                let mut v = [3i32; 64];
                c.all_reduce(&mut v, ReduceOp::Sum).err()
            } else {
                let mut x = [0i32; 64];
                c.recv(&mut x, 0).err()
            }
        });
        let e = got[1].as_ref().expect("the receive fails");
        match e {
            Error::Mismatch { peer, field, .. } => {
                assert_eq!((*peer, *field), (0, "collective"), "{kind:?}: {e}")
            }
            other => panic!("{kind:?}: expected a mismatch, got {other}"),
        }
        assert!(got[0].is_some(), "{kind:?}: the all_reduce must fail too");
    }
}

#[test]
fn a_raw_call_naming_point_to_point_is_refused_on_its_rank_alone() {
    let got = run_local(2, &quick(), |c| {
        let mut buf = [0u8; 4];
        let refused = if c.rank() == 0 {
            let call = tutti::RawCall {
                collective: tutti::Collective::Send,
                dtype: tutti::DType::U8,
                count: 4,
                op: tutti::ReduceOp::Sum,
                root: 1,
                input: buf.as_ptr(),
                output: buf.as_mut_ptr(),
                counts: &[],
                recv_counts: &[],
            };
            // SAFETY: the buffer outlives the call.
            Some(unsafe { c.run_raw(&call) }.unwrap_err())
        } else {
            None
        };
        // The collectives' numbers are unchanged on both ranks.
        let mut v = [1u32];
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        (refused, v[0])
    })
    .unwrap();
    let e = got[0].0.as_ref().unwrap();
    assert!(e.to_string().contains("point-to-point"), "{e}");
    assert_eq!((got[0].1, got[1].1), (2, 2));
}

/// A process killed outright while its partner sends to it and waits for its answer: the
/// survivor's call fails with `PeerLost` naming the killed rank, within the timeout, over TCP
/// and over shared memory.
#[test]
fn a_killed_peer_process_is_named_by_the_rank_waiting_on_it() {
    use std::io::Read;
    use std::process::{Command, Stdio};
    use std::time::Instant;
    let ping_pong = common::example("ping_pong", &[]);
    for transport in ["tcp", "shm"] {
        let master = format!("127.0.0.1:{}", common::free_port());
        let mut ranks: Vec<_> = (0..2)
            .map(|r| {
                Command::new(&ping_pong)
                    // 8 bytes, rounds enough to outlast the test.
                    .args(["8", "1000000000"])
                    .env_remove("TF_CONFIG")
                    .env("TUTTI_RANK", r.to_string())
                    .env("TUTTI_WORLD_SIZE", "2")
                    .env("TUTTI_MASTER_ADDR", &master)
                    .env("TUTTI_JOB_TOKEN", "p2p-kill-test-job-token")
                    .env("TUTTI_TRANSPORT", transport)
                    .env("TUTTI_TIMEOUT", "20")
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        // Into the timed rounds: rank 0 says so on stderr (read on; the rest is its error).
        let mut err0 = std::io::BufReader::new(ranks[0].stderr.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut err0, &mut line).unwrap();
        assert!(line.contains("warmed up"), "{transport}: rank 0: {line}");
        std::thread::sleep(Duration::from_millis(100));
        ranks[1].kill().unwrap();
        ranks[1].wait().unwrap();
        let t = Instant::now();
        let status = loop {
            if let Some(s) = ranks[0].try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > Duration::from_secs(25) {
                let _ = ranks[0].kill();
                panic!("{transport}: rank 0 still waits after its peer was killed");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        err0.read_to_string(&mut err).unwrap();
        assert!(!status.success(), "{transport}: rank 0 succeeded");
        assert!(err.contains("lost rank 1"), "{transport}: {err}");
        // A broken connection is seen at once, not at the timeout.
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{transport}: {:?}",
            t.elapsed()
        );
    }
}
