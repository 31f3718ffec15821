//! Groups of devices of this process through the one communicator (`device_group`): every
//! collective, in place and out of place, blocking and in flight, checked against the
//! reference (`perf::check`) on `cpu:N` ranks and, with the `xla` feature and a PJRT plugin
//! (`TUTTI_PJRT_PLUGIN`), on 4 XLA devices; the errors every device shares; specs that are
//! wrong.

use std::time::Duration;

use tutti::{device_group, Collective, Config, DeviceKind, Error, RawCall, ReduceOp};

fn check_group(specs: &[&str], counts: &[usize]) -> usize {
    check_group_with(specs, counts, Config::default())
}

fn check_group_with(specs: &[&str], counts: &[usize], config: Config) -> usize {
    let config = config.with_timeout(Duration::from_secs(120));
    let comms = device_group(specs, &config).unwrap_or_else(|e| panic!("{specs:?}: {e}"));
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| s.spawn(move || tutti::perf::check(&mut c, counts)))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{specs:?}: {e}"))
            })
            .max()
            .unwrap()
    })
}

#[test]
fn cpu_devices_every_collective() {
    let calls = check_group(&["cpu:0", "cpu:1", "cpu:2"], &[0, 1, 7, 1000]);
    assert!(calls > 1000, "{calls}");
}

#[test]
fn device_specs_that_are_wrong_say_which() {
    let c = Config::default();
    let msg = |r: Result<Vec<tutti::Communicator>, Error>| r.err().unwrap().to_string();
    let m = msg(device_group(&["cpu:0", "cpu:0"], &c));
    assert!(m.contains("listed twice") && m.contains("device 1"), "{m}");
    let m = msg(device_group(&["cpu:0", "npu:1"], &c));
    assert!(m.contains("npu"), "{m}");
    let m = msg(device_group::<&str>(&[], &c));
    assert!(m.contains("at least one rank"), "{m}");
    if !cfg!(feature = "xla") {
        let m = msg(device_group(&["xla:0"], &c));
        assert!(m.starts_with("XLA not available"), "{m}");
    } else {
        // Refused before any client starts (the CPU plugin would make that many devices).
        let m = msg(device_group(&["xla:0", "xla:5000"], &c));
        assert!(m.contains("rank 1 is on xla:5000"), "{m}");
    }
    if !cfg!(feature = "cuda") {
        let m = msg(device_group(&["cuda:0", "cuda:1"], &c));
        assert!(m.starts_with("CUDA not available"), "{m}");
    }
    let m = msg(device_group(&["cpu:0", "xla:1"], &c));
    assert!(m.contains("one kind of device"), "{m}");
    let comms = device_group(&["cpu:3", "cpu:5"], &c).unwrap();
    assert_eq!(comms[0].device_kind(), DeviceKind::Cpu);
    assert_eq!(comms[1].device_spec(), "cpu:5");
}

/// By address, with NULL for empty buffers: the same results and the same errors.
#[test]
fn calls_by_address_on_a_device_group() {
    let comms = device_group(&["cpu:0", "cpu:1"], &Config::default()).unwrap();
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let r = c.rank();
                let mut x = vec![r as f32 + 1.0; 5];
                let call = RawCall {
                    collective: Collective::AllReduce,
                    dtype: tutti::DType::F32,
                    count: 5,
                    op: ReduceOp::Sum,
                    root: 0,
                    input: x.as_ptr().cast(),
                    output: x.as_mut_ptr().cast(),
                    counts: &[],
                    recv_counts: &[],
                };
                // SAFETY: x holds 5 f32 and lives through the call.
                unsafe { c.run_raw(&call) }.unwrap();
                assert_eq!(x, vec![3.0; 5]);
                let empty = RawCall {
                    count: 0,
                    input: std::ptr::null(),
                    output: std::ptr::null_mut(),
                    ..call
                };
                // SAFETY: no bytes.
                unsafe { c.run_raw(&empty) }.unwrap();
                let mut g = vec![0i64; 4];
                let own = [r as i64 * 10, r as i64 * 10 + 1];
                let gather = RawCall {
                    collective: Collective::AllGather,
                    dtype: tutti::DType::I64,
                    count: 2,
                    input: own.as_ptr().cast(),
                    output: g.as_mut_ptr().cast(),
                    ..call
                };
                // SAFETY: own holds 2 and g 4 i64, both live through the call.
                unsafe { c.issue_raw(&gather) }.wait().unwrap();
                assert_eq!(g, vec![0, 1, 10, 11]);
                let wrong = RawCall {
                    count: 5 + r,
                    ..call
                };
                // SAFETY: x holds 5 f32; rank 1 claims 6 and is caught before any byte moves.
                match unsafe { c.run_raw(&wrong) } {
                    Err(Error::Mismatch { field, .. }) => assert_eq!(field, "count"),
                    other => panic!("want a count mismatch, got {other:?}"),
                }
            });
        }
    });
}

/// Whether a PJRT plugin is set for the XLA tests (`TUTTI_PJRT_PLUGIN`); without one, `test`
/// is skipped (printed), unless `TUTTI_REQUIRE_XLA=1`.
#[cfg(feature = "xla")]
fn xla_plugin(test: &str) -> bool {
    if std::env::var_os("TUTTI_PJRT_PLUGIN").is_some() {
        return true;
    }
    assert!(
        std::env::var("TUTTI_REQUIRE_XLA").as_deref() != Ok("1"),
        "TUTTI_REQUIRE_XLA=1 but TUTTI_PJRT_PLUGIN is not set"
    );
    eprintln!("{test}: skipped: set TUTTI_PJRT_PLUGIN");
    false
}

#[cfg(feature = "xla")]
#[test]
fn xla_devices_every_collective() {
    if !xla_plugin("xla_devices_every_collective") {
        return;
    }
    let calls = check_group(&["xla:0", "xla:1", "xla:2", "xla:3"], &[0, 1, 7, 1000]);
    assert!(calls > 1000, "{calls}");
    // Any of the client's devices, in any order: rank r runs on the device it names.
    let calls = check_group(&["xla:3", "xla:1"], &[0, 1, 7]);
    assert!(calls > 10, "{calls}");
}

/// all_to_all_v on XLA devices whose ranks disagree on a pair's count: every rank's call fails
/// before anything moves, naming both ranks and both counts; the group is aborted.
#[cfg(feature = "xla")]
#[test]
fn xla_all_to_all_v_counts_that_disagree_name_both_ranks() {
    if !xla_plugin("xla_all_to_all_v_counts_that_disagree_name_both_ranks") {
        return;
    }
    let config = Config::default().with_timeout(Duration::from_secs(60));
    let comms = device_group(&["xla:0", "xla:1"], &config).unwrap();
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    // Rank 0 sends 2 elements to rank 1, which expects 3 from it.
                    let (send, recv) = if r == 0 {
                        ([1, 2], [1, 1])
                    } else {
                        ([1, 1], [3, 1])
                    };
                    let input = vec![1.0f32; send.iter().sum()];
                    let mut output = vec![0.0f32; recv.iter().sum()];
                    c.all_to_all_v(&input, &send, &mut output, &recv)
                        .unwrap_err()
                        .to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errors {
        assert!(
            e.contains("rank 0 sends 2 elements to rank 1, which expects 3"),
            "{e}"
        );
    }
}

/// The bitwise-deterministic mode on XLA devices: every reducing collective (all-reduce,
/// reduce, reduce-scatter; f32, bf16, f64; sum and mean) gives the bits of tutti's kernels'
/// reduction in rank order (`perf::check` compares them), in host memory and on tensors on the
/// devices.
#[cfg(feature = "xla")]
#[test]
fn xla_devices_reduce_in_rank_order_in_deterministic_mode() {
    if !xla_plugin("xla_devices_reduce_in_rank_order_in_deterministic_mode") {
        return;
    }
    let specs = ["xla:0", "xla:1", "xla:2", "xla:3"];
    let config = Config::default().with_deterministic(true);
    let calls = check_group_with(&specs, &[1, 7, 1000], config.clone());
    assert!(calls > 100, "{calls}");
    // Sums whose bits depend on the order: ((1e8 + 1) - 1e8) + 0.5 is 0.5 in f32, where
    // (1e8 - 1e8) + (1 + 0.5) would be 1.5; in host memory and on the devices.
    let comms = device_group(&specs, &config.with_timeout(Duration::from_secs(60))).unwrap();
    let inputs: Vec<Vec<f32>> = vec![vec![1e8; 5], vec![1.0; 5], vec![-1e8; 5], vec![0.5; 5]];
    let want = vec![0.5f32; 5];
    let got: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&inputs)
            .map(|(c, x)| {
                s.spawn(move || {
                    let mut host = x.clone();
                    c.all_reduce(&mut host, ReduceOp::Sum).unwrap();
                    let mut t = c.place(x).unwrap();
                    c.all_reduce_tensor(&mut t, ReduceOp::Sum).unwrap();
                    (host, t.to_vec().unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (host, dev) in &got {
        assert_eq!(host, &want);
        assert_eq!(dev, &want);
    }
}

/// A group of XLA devices splits as threads do (by color, then key; a split of a split; a rank
/// of no color), each group running its calls on its members' devices while the other group
/// and the parent run theirs; a group's mistake fails that group alone; tensors placed by a
/// group's communicator are reduced where they lie, and the parent's tensors are refused there.
#[cfg(feature = "xla")]
#[test]
fn xla_device_groups_split_and_split_again() {
    if !xla_plugin("xla_device_groups_split_and_split_again") {
        return;
    }
    let config = Config::default().with_timeout(Duration::from_secs(60));
    let specs = ["xla:0", "xla:1", "xla:2", "xla:3", "xla:4"];
    let comms = device_group(&specs, &config).unwrap();
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || {
                    let r = comm.rank();
                    // Evens {0, 2, 4} ranked 4, 2, 0; odds {1, 3} ranked 3, 1.
                    let half = comm
                        .split(Some((r % 2) as u32), -(r as i64))
                        .unwrap()
                        .unwrap();
                    assert_eq!(half.device_spec(), comm.device_spec());
                    let mut order = vec![0i64; half.world_size()];
                    half.all_gather(&[r as i64], &mut order).unwrap();
                    // The odds disagree about a count; the evens run calls meanwhile.
                    let mut ok = true;
                    if r % 2 == 1 {
                        let n = if r == 1 { 3 } else { 4 };
                        let e = half.all_reduce(&mut vec![1.0f32; n], ReduceOp::Sum);
                        ok &= matches!(e, Err(Error::Mismatch { .. }));
                    } else {
                        for i in 0..20 {
                            let mut v = [i as f32 + r as f32; 9];
                            half.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                            ok &= v == [3.0 * i as f32 + 6.0; 9];
                        }
                        // A split of a split, and a rank of no color: {4, 2} and nothing for 0.
                        let quarter = half.split((half.rank() < 2).then_some(1), 0).unwrap();
                        if let Some(q) = &quarter {
                            let mut t = q.place(&[r as f64, 1.0]).unwrap();
                            q.all_reduce_tensor(&mut t, ReduceOp::Sum).unwrap();
                            ok &= t.to_vec::<f64>().unwrap() == [6.0, 2.0];
                            let mut theirs = half.place(&[1.0f64]).unwrap();
                            let e = q.all_reduce_tensor(&mut theirs, ReduceOp::Sum).unwrap_err();
                            ok &= e.to_string().contains("another XLA client");
                        }
                        ok &= quarter.is_some() == (r != 0);
                    }
                    let mut v = [r as i32];
                    comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                    ok &= v == [10];
                    (order, ok)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let orders: Vec<&Vec<i64>> = got.iter().map(|g| &g.0).collect();
    let (evens, odds) = (vec![4, 2, 0], vec![3, 1]);
    assert_eq!(orders, [&evens, &odds, &evens, &odds, &evens]);
    assert!(got.iter().all(|g| g.1), "{got:?}");
}

/// Point-to-point on XLA ranks, whose buffers are host memory: a ring of grouped sends and
/// receives, pairs between collectives keeping their order, and a count that differs between
/// a send and its receive named on both ranks.
#[cfg(feature = "xla")]
#[test]
fn xla_ranks_send_and_receive() {
    if !xla_plugin("xla_ranks_send_and_receive") {
        return;
    }
    let config = Config::default().with_timeout(Duration::from_secs(60));
    let comms = device_group(&["xla:0", "xla:1", "xla:2"], &config).unwrap();
    let got: Vec<(Vec<f32>, f32, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let (r, p) = (c.rank(), c.world_size());
                    let send = vec![r as f32 + 0.5; 7];
                    let mut recv = vec![0.0f32; 7];
                    c.send_recv(&mut [
                        tutti::PeerOp::send(&send, (r + 1) % p),
                        tutti::PeerOp::recv(&mut recv, (r + p - 1) % p),
                    ])
                    .unwrap();
                    let mut sum = [1.0f32];
                    c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
                    let e = match r {
                        // The send is delivered; the receive fails and aborts the group.
                        0 => c
                            .send(&[1u32; 4], 2)
                            .map_or_else(|e| e.to_string(), |()| String::new()),
                        2 => c.recv(&mut [0u32; 5], 0).unwrap_err().to_string(),
                        _ => String::new(),
                    };
                    (recv, sum[0], e)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (recv, sum, _)) in got.iter().enumerate() {
        assert_eq!(recv, &vec![((r + 2) % 3) as f32 + 0.5; 7]);
        assert_eq!(*sum, 3.0);
    }
    let e = &got[2].2;
    assert!(
        e.contains("rank 0 sent 4 u32 where rank 2 receives 5 u32"),
        "{e}"
    );
}

/// One rank per process on a device (`TUTTI_DEVICE`): what cannot be is said before any
/// connection is made; `cpu` joins as before.
#[test]
fn a_process_rank_on_a_device() {
    use tutti::ClusterSpec;
    use tutti::{Communicator, TransportKind};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let vars = [
        ("TUTTI_RANK".to_string(), "0".to_string()),
        ("TUTTI_WORLD_SIZE".to_string(), "1".to_string()),
        ("TUTTI_MASTER_ADDR".to_string(), format!("127.0.0.1:{port}")),
        (
            "TUTTI_JOB_TOKEN".to_string(),
            "devices-test-job-token".to_string(),
        ),
    ];
    let spec = ClusterSpec::from_vars(&vars.into_iter().collect())
        .unwrap()
        .unwrap();
    let config = Config::default().with_timeout(Duration::from_secs(20));
    let on = |device: &str| {
        Communicator::from_cluster_on(&spec, TransportKind::Tcp, device, &config)
            .err()
            .map(|e| e.to_string())
    };
    let m = on("xla:0").unwrap();
    assert!(m.contains("within one process"), "{m}");
    let m = on("npu:0").unwrap();
    assert!(m.contains("npu"), "{m}");
    if !cfg!(feature = "cuda") {
        let m = on("cuda").unwrap();
        assert!(m.starts_with("CUDA not available"), "{m}");
    }
    let comm = Communicator::from_cluster_on(&spec, TransportKind::Tcp, "cpu", &config).unwrap();
    assert_eq!(comm.device_spec(), "cpu:0");
    let mut x = [2.0f64; 3];
    comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x, [2.0; 3]);
}

#[test]
fn only_cuda_ranks_take_a_cuda_stream() {
    let mut comms = device_group(&["cpu:0", "cpu:1"], &Config::default()).unwrap();
    // SAFETY: the call refuses before the stream is ever used.
    let e = unsafe { comms[1].set_cuda_stream(Some(0)) }.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let m = e.to_string();
    assert!(
        m.contains("rank 1 is on cpu:1") && m.contains("CUDA stream"),
        "{m}"
    );
    assert_eq!(comms[1].cuda_stream(), None);
    // No stream is always fine, and the group still works.
    // SAFETY: no stream.
    unsafe { comms[1].set_cuda_stream(None) }.unwrap();
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let mut v = [1.0f32; 3];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert_eq!(v, [2.0; 3]);
            });
        }
    });
}
