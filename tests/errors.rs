//! Every bad argument gets its own error, on every rank, naming the rank and the collective; a
//! rank that never arrives gives `Timeout` naming it, within the bound; abort wakes a blocked call.

use std::time::{Duration, Instant};

use tutti::{local_group, run_local, Algorithm, Collective, Config, Error, ReduceOp, Replicas};

fn quick() -> Config {
    Config::default().with_timeout(Duration::from_secs(20))
}

#[test]
fn count_mismatch_names_both_ranks_and_leaves_the_group_usable() {
    let errs = run_local(3, &quick(), |comm| {
        let n = if comm.rank() == 2 { 5 } else { 4 };
        let mut buf = vec![1.0f32; n];
        let e = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        assert_eq!(buf, vec![1.0; n], "nothing may be written on a mismatch");
        // The same communicator still works.
        let mut ok = vec![1i32; 3];
        comm.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
        assert_eq!(ok, [3, 3, 3]);
        e
    })
    .unwrap();
    for (rank, e) in errs.iter().enumerate() {
        match e {
            Error::Mismatch {
                site, peer, field, ..
            } => {
                assert_eq!(site.rank, rank);
                assert_eq!(site.collective, Collective::AllReduce);
                assert_eq!(*field, "count");
                assert_eq!(*peer, if rank == 2 { 0 } else { 2 });
            }
            other => panic!("rank {rank}: expected Mismatch, got {other}"),
        }
        let m = e.to_string();
        assert!(
            m.contains("all_reduce") && m.contains(&format!("rank {rank}")),
            "{m}"
        );
    }
}

#[test]
fn dtype_op_collective_and_algorithm_mismatches() {
    let errs = run_local(2, &quick(), |comm| {
        let r = comm.rank();
        let mut out = Vec::new();
        // dtype
        out.push(if r == 0 {
            comm.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
        } else {
            comm.all_reduce(&mut [1.0f64; 4], ReduceOp::Sum)
        });
        // op
        let op = if r == 0 { ReduceOp::Sum } else { ReduceOp::Max };
        out.push(comm.all_reduce(&mut [1i32; 4], op));
        // collective
        out.push(if r == 0 {
            comm.all_reduce(&mut [1i32; 4], ReduceOp::Sum)
        } else {
            comm.broadcast(&mut [1i32; 4], 0)
        });
        // root
        out.push(comm.broadcast(&mut [1u8; 4], r));
        out
    })
    .unwrap();
    let fields: Vec<Vec<&str>> = errs
        .iter()
        .map(|v| {
            v.iter()
                .map(|e| match e {
                    Err(Error::Mismatch { field, .. }) => *field,
                    other => panic!("expected Mismatch, got {other:?}"),
                })
                .collect()
        })
        .collect();
    assert_eq!(fields[0], ["dtype", "op", "collective", "root"]);
    assert_eq!(fields[1], fields[0]);

    let mut comms = local_group(2, &quick()).unwrap();
    comms[1].set_algorithm(Algorithm::Ring).unwrap();
    let errs: Vec<Error> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| s.spawn(move || c.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum).unwrap_err()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        errs.iter().all(|e| matches!(
            e,
            Error::Mismatch {
                field: "algorithm",
                ..
            }
        )),
        "{errs:?}"
    );
}

#[test]
fn bad_arguments_fail_every_rank_at_once() {
    let t = Instant::now();
    let errs = run_local(3, &quick(), |comm| {
        let r = comm.rank();
        let mut v = Vec::new();
        // Root out of range on every rank.
        v.push(comm.broadcast(&mut [0u32; 4], 7).unwrap_err());
        // Out-of-place buffers of different lengths on rank 1 only.
        let n = if r == 1 { 3 } else { 4 };
        v.push(
            comm.all_reduce_into(&[1i64; 4], &mut vec![0i64; n], ReduceOp::Sum)
                .unwrap_err(),
        );
        // all_gather output too small on rank 0 only.
        let n = if r == 0 { 5 } else { 6 };
        v.push(comm.all_gather(&[1u8; 2], &mut vec![0u8; n]).unwrap_err());
        // reduce_scatter input of the wrong size on rank 2 only.
        let n = if r == 2 { 7 } else { 6 };
        v.push(
            comm.reduce_scatter(&vec![1i32; n], &mut [0i32; 2], ReduceOp::Sum)
                .unwrap_err(),
        );
        // The root of a reduce without an output.
        v.push(comm.reduce(&[1i32; 2], None, ReduceOp::Sum, 0).unwrap_err());
        // Raw bytes that are not whole elements.
        v.push(
            comm.all_reduce_raw(tutti::DType::F32, None, &mut [0u8; 6], ReduceOp::Sum)
                .unwrap_err(),
        );
        // Still usable afterwards.
        let mut ok = [1u8; 2];
        comm.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
        assert_eq!(ok, [3, 3]);
        v
    })
    .unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "bad arguments must not wait for the timeout"
    );
    let culprit = [None, Some(1), Some(0), Some(2), Some(0), None];
    for (rank, errs) in errs.iter().enumerate() {
        for (i, e) in errs.iter().enumerate() {
            let m = e.to_string();
            match (culprit[i], e) {
                (None, Error::InvalidArgument { site: Some(s), .. }) => assert_eq!(s.rank, rank),
                (Some(c), Error::InvalidArgument { site: Some(s), .. }) if c == rank => {
                    assert_eq!(s.rank, rank)
                }
                (Some(c), Error::PeerRejected { peer, .. }) if c != rank => assert_eq!(*peer, c),
                _ => panic!("case {i} rank {rank}: unexpected {e:?}"),
            }
            assert!(m.contains(&format!("rank {rank}")), "{m}");
        }
    }
    let m = errs[0][0].to_string();
    assert!(
        m.contains("root 7 is out of range for a world of 3 ranks") && m.contains("broadcast"),
        "{m}"
    );
    assert!(
        errs[0][2]
            .to_string()
            .contains("all_gather needs world size × input = 3 × 2 = 6"),
        "{}",
        errs[0][2]
    );
    assert!(
        errs[1][2]
            .to_string()
            .contains("rank 0 rejected its arguments"),
        "{}",
        errs[1][2]
    );
    assert!(
        errs[0][4]
            .to_string()
            .contains("the root needs an output buffer"),
        "{}",
        errs[0][4]
    );
    assert!(
        errs[0][5]
            .to_string()
            .contains("not a whole number of f32 elements"),
        "{}",
        errs[0][5]
    );
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_it() {
    let config = Config::default().with_timeout(Duration::from_millis(300));
    let comms = local_group(4, &config).unwrap();
    let t = Instant::now();
    let errs: Vec<Error> = std::thread::scope(|s| {
        // Rank 3 never calls.
        let hs: Vec<_> = comms[..3]
            .iter()
            .map(|c| s.spawn(move || c.all_reduce(&mut [1.0f32; 16], ReduceOp::Sum).unwrap_err()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let took = t.elapsed();
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let mut saw_timeout = false;
    for e in &errs {
        let m = e.to_string();
        assert!(m.contains("rank 3"), "every rank's error names rank 3: {m}");
        if let Error::Timeout {
            waiting_for, site, ..
        } = e
        {
            assert_eq!(waiting_for, &[3]);
            assert_eq!(site.collective, Collective::AllReduce);
            saw_timeout = true;
        }
    }
    assert!(saw_timeout, "{errs:?}");
    // The group is aborted: later calls fail at once, rank 3's too.
    let t = Instant::now();
    assert!(matches!(comms[3].barrier(), Err(Error::Aborted { .. })));
    assert!(matches!(comms[0].barrier(), Err(Error::Aborted { .. })));
    assert!(t.elapsed() < Duration::from_millis(200));
}

#[test]
fn abort_from_another_thread_wakes_a_blocked_call() {
    let comms = local_group(2, &quick()).unwrap();
    let handle = comms[0].abort_handle();
    let t = Instant::now();
    let e = std::thread::scope(|s| {
        let h = s.spawn(|| comms[0].all_reduce(&mut [0u64; 8], ReduceOp::Sum));
        std::thread::sleep(Duration::from_millis(50));
        handle.abort("stopping the job");
        h.join().unwrap().unwrap_err()
    });
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(&e, Error::Aborted { reason, .. } if reason == "stopping the job"),
        "{e}"
    );
}

#[test]
fn a_panicking_rank_fails_its_peers_fast() {
    let t = Instant::now();
    let r = run_local(3, &quick(), |comm| {
        if comm.rank() == 1 {
            panic!("out of memory in the model");
        }
        comm.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
    });
    assert!(t.elapsed() < Duration::from_secs(10));
    let e = r.unwrap_err().to_string();
    assert!(
        e.contains("rank 1 panicked: out of memory in the model"),
        "{e}"
    );
}

#[test]
fn config_and_replica_arguments() {
    assert!(local_group(0, &Config::default()).is_err());
    let e = local_group(
        2,
        &Config::default().with_algorithm(Algorithm::ReduceToOne { root: 5 }),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("root 5 is out of range"), "{e}");
    assert!(local_group(2, &Config::default().with_chunk_bytes(0)).is_err());
    let reps = Replicas::new(3, &quick()).unwrap();
    let mut a = [1.0f32; 4];
    let mut b = [1.0f32; 4];
    let e = reps
        .all_reduce(&mut [&mut a[..], &mut b[..]], ReduceOp::Sum)
        .unwrap_err();
    assert!(
        e.to_string().contains("2 buffers given for 3 replicas"),
        "{e}"
    );
}

#[test]
fn misaligned_raw_buffers_are_an_error_not_a_panic() {
    let errs = run_local(2, &quick(), |comm| {
        let mut backing = vec![0u64; 5];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut backing);
        // 16 bytes starting one byte in: four f32 slots, none aligned.
        let e = comm
            .all_reduce_raw(tutti::DType::F32, None, &mut bytes[1..17], ReduceOp::Sum)
            .unwrap_err();
        // Still usable.
        let mut ok = [1.0f32; 2];
        comm.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
        e
    })
    .unwrap();
    for (rank, e) in errs.iter().enumerate() {
        match e {
            Error::InvalidArgument {
                site: Some(s),
                message,
            } => {
                assert_eq!(s.rank, rank);
                assert!(
                    message.contains("not aligned to 4 bytes for f32"),
                    "{message}"
                );
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }
}

#[test]
fn replicas_survive_concurrent_callers_and_a_panicking_first_replica() {
    let reps = Replicas::new(3, &quick()).unwrap();
    std::thread::scope(|s| {
        for t in 0..4 {
            let reps = &reps;
            s.spawn(move || {
                for round in 0..50 {
                    let v = (t * 100 + round) as i64;
                    let mut bufs = [[v; 4], [v; 4], [v; 4]];
                    let mut views: Vec<&mut [i64]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                    reps.all_reduce(&mut views, ReduceOp::Sum).unwrap();
                    assert!(
                        bufs.iter().all(|b| b == &[3 * v; 4]),
                        "thread {t} round {round}"
                    );
                }
            });
        }
    });
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = reps.each(&|r, comm| {
            if r == 0 {
                panic!("replica 0 blew up");
            }
            comm.all_reduce(&mut [1u8; 4], ReduceOp::Sum)
        });
    }));
    assert!(caught.is_err(), "the panic is passed on to the caller");
    assert!(
        reps.aborted().is_some(),
        "the group is aborted so the other replicas were released"
    );
}

/// World sizes past what tutti supports are errors that say so, never an allocation that
/// aborts the process or a capacity-overflow panic (issue 12, item 2).
#[test]
fn huge_world_sizes_are_errors() {
    let m = tutti::local_group(30_000, &quick())
        .err()
        .unwrap()
        .to_string();
    assert!(m.contains("30000 ranks in one process"), "{m}");
    for world in ["1000000000", "18446744073709551615"] {
        let vars = [
            ("RANK".to_string(), "0".to_string()),
            ("WORLD_SIZE".to_string(), world.to_string()),
            ("MASTER_ADDR".to_string(), "127.0.0.1".to_string()),
            ("MASTER_PORT".to_string(), "29500".to_string()),
        ];
        let m = tutti::ClusterSpec::from_vars(&vars.into_iter().collect())
            .err()
            .unwrap()
            .to_string();
        assert!(
            m.contains(&format!("WORLD_SIZE={world}")) && m.contains("more ranks"),
            "{m}"
        );
    }
}

/// A chunk size past the bound is refused when the group is made, naming the field and the
/// bound, whatever the algorithm (issue 29, item 5: `usize::MAX` with `direct` skipped slices
/// and with `ring` panicked).
#[test]
fn oversized_chunk_bytes_is_refused_naming_the_field_and_the_bound() {
    for algo in [Algorithm::Direct, Algorithm::Ring, Algorithm::Auto] {
        for chunk in [usize::MAX, usize::MAX / 2 + 1, (1 << 30) + 1] {
            let config = quick().with_algorithm(algo).with_chunk_bytes(chunk);
            let e = local_group(2, &config)
                .err()
                .unwrap_or_else(|| panic!("{algo}: chunk_bytes {chunk} was accepted"));
            assert!(
                matches!(e, Error::InvalidArgument { site: None, .. }),
                "{e:?}"
            );
            let m = e.to_string();
            assert!(
                m.contains(&format!("chunk_bytes {chunk}")) && m.contains("1073741824"),
                "{m}"
            );
        }
    }
}

/// At the bound, with buffers far smaller than one chunk, `direct` and `ring` give every
/// collective's right answer (no range wraps).
#[test]
fn the_largest_chunk_gives_the_right_results() {
    for algo in [Algorithm::Direct, Algorithm::Ring] {
        let config = quick()
            .with_algorithm(algo)
            .with_chunk_bytes(Config::MAX_CHUNK_BYTES);
        run_local(2, &config, |comm| {
            let r = comm.rank() as u8;
            let input: Vec<u8> = (0..100u8).map(|i| i % 7 + r).collect();
            let sum: Vec<u8> = (0..100u8).map(|i| 2 * (i % 7) + 1).collect();
            let mut v = input.clone();
            comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v, sum, "{algo}: in-place all_reduce on rank {r}");
            let mut out = vec![0u8; 100];
            comm.all_reduce_into(&input, &mut out, ReduceOp::Sum)
                .unwrap();
            assert_eq!(out, sum, "{algo}: all_reduce_into on rank {r}");
            let mut b = input.clone();
            comm.broadcast(&mut b, 1).unwrap();
            assert_eq!(
                b,
                (0..100u8).map(|i| i % 7 + 1).collect::<Vec<_>>(),
                "{algo}"
            );
            let mut g = vec![0u8; 200];
            comm.all_gather(&input, &mut g).unwrap();
            let want: Vec<u8> = (0..2u8)
                .flat_map(|k| (0..100u8).map(move |i| i % 7 + k))
                .collect();
            assert_eq!(g, want, "{algo}: all_gather on rank {r}");
            let mut s = vec![0u8; 100];
            comm.reduce_scatter(&g, &mut s, ReduceOp::Sum).unwrap();
            // Both ranks gathered the same 200 elements: slice r of the sum is twice slice r.
            let off = 100 * comm.rank();
            let want: Vec<u8> = (0..100).map(|i| 2 * want[off + i]).collect();
            assert_eq!(s, want, "{algo}: reduce_scatter on rank {r}");
            let mut root = vec![0u8; 100];
            let recv = (comm.rank() == 0).then_some(&mut root[..]);
            comm.reduce(&input, recv, ReduceOp::Sum, 0).unwrap();
            if comm.rank() == 0 {
                assert_eq!(root, sum, "{algo}: reduce at the root");
            }
        })
        .unwrap();
    }
}

/// Counts whose byte size overflows, on the raw forms, are this rank's argument error (and the
/// communicator stays usable), never a wrapped length.
#[test]
fn raw_counts_whose_bytes_overflow_are_errors() {
    let collectives = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::Broadcast,
        Collective::Reduce,
    ];
    let errs = run_local(2, &quick(), |comm| {
        let mut buf = [0u32; 4];
        let mut msgs = Vec::new();
        for collective in collectives {
            for count in [
                usize::MAX,
                usize::MAX / 4 + 1,
                usize::MAX / 8 + 1,
                isize::MAX as usize / 4 + 1,
            ] {
                let call = tutti::RawCall {
                    collective,
                    dtype: tutti::DType::F32,
                    count,
                    op: ReduceOp::Sum,
                    root: 0,
                    input: buf.as_ptr().cast(),
                    output: buf.as_mut_ptr().cast(),
                    counts: &[],
                    recv_counts: &[],
                };
                // SAFETY: the call is refused before any byte is touched.
                let e = unsafe { comm.run_raw(&call) }.unwrap_err();
                assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
                msgs.push(e.to_string());
            }
        }
        let mut ok = [1u32; 4];
        comm.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
        assert_eq!(ok, [2; 4]);
        msgs
    })
    .unwrap();
    for m in errs.into_iter().flatten() {
        assert!(m.contains("more bytes than a buffer can hold"), "{m}");
    }
}
