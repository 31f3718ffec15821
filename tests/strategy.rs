//! Strategies: every one trains the example to the reference weights (synchronous strategies
//! within 1e-5, parameter servers, which are asynchronous, within 0.05 of the reference and with
//! a small loss); multi-worker and parameter-server jobs across processes; fusion; failures.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tutti::logical_cpus;
use tutti::strategy::{
    pack_plan, Aggregation, CrossDeviceOps, PerReplica, Strategy, StrategyKind, Tensor,
};
use tutti::{Error, ReduceOp};

mod common;

/// The example binary, freshly built.
fn train() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| common::example("train", &[])).clone()
}

fn last_json(out: &str) -> serde_json::Value {
    let line = out
        .lines()
        .rev()
        .find(|l| l.contains("\"strategy\""))
        .unwrap_or_else(|| panic!("no JSON line in {out}"));
    let json = &line[line.find('{').unwrap()..];
    serde_json::from_str(json).unwrap()
}

/// The JSON line worker `w` printed under `tutti launch --tag-output`.
fn worker_json(out: &str, w: usize) -> serde_json::Value {
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("[{w}] {{")))
        .unwrap_or_else(|| panic!("no JSON line from worker {w}: {out}"));
    last_json(line)
}

fn max_diff(j: &serde_json::Value) -> f64 {
    let w = j["weights"].as_array().unwrap();
    let r = j["reference_weights"].as_array().unwrap();
    assert_eq!(w.len(), r.len());
    w.iter()
        .zip(r)
        .map(|(a, b)| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs())
        .fold(0.0, f64::max)
}

fn bounded(cmd: &mut Command, limit: Duration) -> (bool, String, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    exit_within(
        &mut child,
        Instant::now(),
        limit,
        &format!("ran past {limit:?}"),
    );
    let o = child.wait_with_output().unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// How `child` exited, waiting at most `limit` (counted from `since`): past it the child is
/// killed and the test fails saying `what`.
fn exit_within(
    child: &mut std::process::Child,
    since: Instant,
    limit: Duration,
    what: &str,
) -> std::process::ExitStatus {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if since.elapsed() > limit {
            let _ = child.kill();
            panic!("{what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_local_strategy_trains_to_the_reference() {
    for strategy in ["default", "one-device", "mirrored", "central-storage"] {
        for replicas in [1, 2, 4] {
            let (ok, out, err) = bounded(
                Command::new(train()).args([
                    "--strategy",
                    strategy,
                    "--replicas",
                    &replicas.to_string(),
                    "--steps",
                    "60",
                    "--json",
                ]),
                Duration::from_secs(60),
            );
            assert!(ok, "{strategy} x{replicas}: {err}");
            let j = last_json(&out);
            let want = if matches!(strategy, "default" | "one-device") {
                1
            } else {
                replicas
            };
            assert_eq!(j["replicas"], want, "{strategy}");
            assert_eq!(j["steps"], 60);
            assert!(max_diff(&j) < 1e-5, "{strategy} x{replicas}: {j}");
        }
    }
    for ops in ["reduction-to-one", "hierarchical-copy", "ring"] {
        let (ok, out, err) = bounded(
            Command::new(train()).args([
                "--strategy",
                "mirrored",
                "--replicas",
                "4",
                "--cross-device-ops",
                ops,
                "--json",
            ]),
            Duration::from_secs(60),
        );
        assert!(ok, "{ops}: {err}");
        assert!(max_diff(&last_json(&out)) < 1e-5, "{ops}");
    }
}

#[test]
fn multi_worker_across_processes_trains_to_the_reference() {
    let t = train();
    let (ok, out, err) = bounded(
        Command::new(common::tutti_bin())
            .args(["launch", "--tag-output", "-n", "2", "--"])
            .arg(&t)
            .args([
                "--strategy",
                "multi-worker",
                "--replicas",
                "2",
                "--steps",
                "60",
                "--json",
            ]),
        Duration::from_secs(120),
    );
    assert!(ok, "{out}\n{err}");
    for w in 0..2 {
        let j = worker_json(&out, w);
        assert_eq!(j["replicas"], 4);
        assert!(max_diff(&j) < 1e-5, "worker {w}: {j}");
    }
}

#[test]
fn multi_worker_survivors_of_a_killed_worker_shrink_and_train_on() {
    // 4 workers; worker 2 kills itself (SIGKILL) before step 10; the other 3 shrink, take
    // the new chief's weights and step, and train the remaining 20 steps.
    let t = train();
    let (ok, out, err) = bounded(
        Command::new(common::tutti_bin())
            .args(["launch", "--elastic", "--tag-output", "-n", "4", "--"])
            .arg(&t)
            .args([
                "--strategy",
                "multi-worker",
                "--replicas",
                "1",
                "--steps",
                "30",
            ])
            .args([
                "--elastic",
                "--kill-worker",
                "2",
                "--kill-step",
                "10",
                "--json",
            ]),
        Duration::from_secs(120),
    );
    assert!(ok, "{out}\n{err}");
    assert!(err.contains("rank 2 was killed by signal 9"), "{err}");
    let survivors: Vec<serde_json::Value> =
        [0, 1, 3].iter().map(|&w| worker_json(&out, w)).collect();
    for j in &survivors {
        assert_eq!(j["replicas"], 3, "{j}");
        assert_eq!(j["resumed_at"], 10, "{j}");
        assert_eq!(
            j["weights"], survivors[0]["weights"],
            "the survivors differ"
        );
    }
    // The same 20 steps on 3 workers resumed from the state the survivors went on from.
    let resume: Vec<String> = survivors[0]["resumed_weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let (ok, out, err) = bounded(
        Command::new(common::tutti_bin())
            .args(["launch", "--tag-output", "-n", "3", "--"])
            .arg(&t)
            .args([
                "--strategy",
                "multi-worker",
                "--replicas",
                "1",
                "--steps",
                "20",
            ])
            .args(["--json", "--initial-weights", &resume.join(",")]),
        Duration::from_secs(120),
    );
    assert!(ok, "{out}\n{err}");
    let fresh = worker_json(&out, 0);
    let (a, b) = (
        survivors[0]["weights"].as_array().unwrap(),
        fresh["weights"].as_array().unwrap(),
    );
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x.as_f64().unwrap() - y.as_f64().unwrap()).abs() < 1e-6,
            "{a:?} vs {b:?}"
        );
    }
}

#[test]
fn only_a_multi_worker_strategy_shrinks() {
    let mut s = Strategy::mirrored(&logical_cpus(2).unwrap(), None).unwrap();
    match s.shrink() {
        Err(Error::Unavailable { why, .. }) => assert!(why.contains("MultiWorker"), "{why}"),
        r => panic!("{:?}", r.err()),
    }
}

#[test]
fn parameter_servers_converge_and_survive_a_lost_worker() {
    let t = train();
    let (ok, out, err) = bounded(
        Command::new(common::tutti_bin())
            .args([
                "launch",
                "--tag-output",
                "--workers",
                "2",
                "--ps",
                "2",
                "--",
            ])
            .arg(&t)
            .args(["--strategy", "parameter-server", "--steps", "100", "--json"]),
        Duration::from_secs(120),
    );
    assert!(ok, "{out}\n{err}");
    let j = last_json(
        out.lines()
            .find(|l| l.starts_with("[chief:0] {"))
            .unwrap_or_else(|| panic!("{out}")),
    );
    assert_eq!(j["replicas"], 2);
    assert!(j["loss"].as_f64().unwrap() < 1e-3, "{j}");
    assert!(max_diff(&j) < 0.05, "{j}");

    // Start the tasks by hand so one worker can be killed mid-training.
    let ports: Vec<u16> = (0..4)
        .map(|_| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        })
        .collect();
    let addr = |i: usize| format!("127.0.0.1:{}", ports[i]);
    let cluster =
        serde_json::json!({"chief": [addr(0)], "worker": [addr(1), addr(2)], "ps": [addr(3)]});
    let spawn = |ty: &str, i: usize| {
        let tf = serde_json::json!({"cluster": cluster, "task": {"type": ty, "index": i}});
        Command::new(&t)
            .args([
                "--strategy",
                "parameter-server",
                "--steps",
                "300",
                "--step-delay-ms",
                "10",
                "--json",
            ])
            .env("TF_CONFIG", tf.to_string())
            .env("TUTTI_JOB_TOKEN", "ps-test-job-token")
            .env_remove("TUTTI_RANK")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut ps = spawn("ps", 0);
    let mut w0 = spawn("worker", 0);
    let mut w1 = spawn("worker", 1);
    let mut chief = spawn("chief", 0);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        chief.try_wait().unwrap().is_none(),
        "training ended before the worker could be lost"
    );
    w1.kill().unwrap();
    let limit = Duration::from_secs(60);
    exit_within(
        &mut chief,
        Instant::now(),
        limit,
        "the chief did not finish",
    );
    let (mut out, mut err) = (String::new(), String::new());
    chief
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    chief
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(chief.wait().unwrap().success(), "{err}");
    assert!(
        err.contains("worker 1 lost during step") && err.contains("rescheduling"),
        "{err}"
    );
    let j = last_json(&out);
    assert_eq!(j["replicas"], 2);
    assert!(j["loss"].as_f64().unwrap() < 1e-3, "{j}");
    for c in [&mut ps, &mut w0, &mut w1] {
        let limit = Duration::from_secs(20);
        exit_within(
            c,
            Instant::now(),
            limit,
            "a task did not stop after shutdown",
        );
    }
}

#[test]
fn fusion_gives_the_same_values_as_one_all_reduce_per_tensor() {
    let devices = logical_cpus(4).unwrap();
    for ops in [
        None,
        Some(CrossDeviceOps::Ring),
        Some(CrossDeviceOps::HierarchicalCopyAllReduce {
            num_packs: 3,
            group_size: 2,
        }),
    ] {
        let mut s = Strategy::mirrored(&devices, ops.clone()).unwrap();
        let lens = [1usize, 7, 300, 2, 5000, 64, 3];
        let values: Vec<PerReplica<Vec<f32>>> = lens
            .iter()
            .enumerate()
            .map(|(t, &n)| {
                PerReplica(
                    (0..4)
                        .map(|r| {
                            (0..n)
                                .map(|i| ((i * 3 + r * 5 + t) % 11) as f32 - 5.0)
                                .collect()
                        })
                        .collect(),
                )
            })
            .collect();
        let one_by_one: Vec<Vec<f32>> = values
            .iter()
            .map(|v| {
                s.run(|ctx| {
                    let mut b = v.0[ctx.local_replica_id()].clone();
                    ctx.all_reduce(ReduceOp::Mean, &mut b)?;
                    Ok(b)
                })
                .unwrap()
                .0
                .remove(0)
            })
            .collect();
        s.set_bytes_per_pack(1024);
        assert!(
            pack_plan(&lens, 4, 1024).len() < lens.len(),
            "the test must fuse something"
        );
        let fused = s.batch_reduce(ReduceOp::Mean, &values).unwrap();
        assert_eq!(fused, one_by_one, "{ops:?}");
    }
}

#[test]
fn a_failing_replica_surfaces_its_error_and_the_strategy_stays_usable() {
    let s = Strategy::mirrored(&logical_cpus(4).unwrap(), None).unwrap();
    let t = Instant::now();
    let e = s
        .run(|ctx| {
            if ctx.replica_id_in_sync_group() == 2 {
                return Err(Error::config("replica 2 ran out of data"));
            }
            let mut b = vec![1.0f32; 16];
            ctx.all_reduce(ReduceOp::Sum, &mut b)?;
            Ok(b)
        })
        .unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the siblings waited for the timeout"
    );
    assert!(e.to_string().contains("replica 2 ran out of data"), "{e}");
    let ok = s
        .run(|ctx| {
            let mut b = vec![ctx.replica_id_in_sync_group() as f32; 4];
            ctx.all_reduce(ReduceOp::Sum, &mut b)?;
            Ok(b)
        })
        .unwrap();
    assert!(ok.local_results().iter().all(|b| b == &[6.0; 4]));
}

#[test]
fn a_nested_run_is_an_error_not_a_hang() {
    let s = Strategy::mirrored(&logical_cpus(2).unwrap(), None).unwrap();
    let t = Instant::now();
    let e = s.run(|_| s.run(|_| Ok(())).map(|_| ())).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(
        e.to_string()
            .contains("inside a replica function use the replica context"),
        "{e}"
    );
    assert!(
        s.run(|ctx| Ok(ctx.local_replica_id())).is_ok(),
        "still usable"
    );
}

#[test]
fn strategy_api() {
    let d = Strategy::default_strategy();
    assert_eq!(d.kind(), StrategyKind::Default);
    assert_eq!(d.num_replicas_in_sync(), 1);
    let r = d.cluster_resolver();
    assert_eq!(
        (r.task_type.as_str(), r.task_id, r.is_chief),
        ("worker", 0, true)
    );
    let v = PerReplica(vec![Tensor::vector(vec![3.0f32, 4.0])]);
    assert_eq!(
        d.reduce(ReduceOp::Mean, &v, None).unwrap().data,
        vec![3.0, 4.0],
        "reduce of one value returns it"
    );
    assert_eq!(
        d.run(|ctx| Ok(ctx.num_replicas_in_sync())).unwrap().0,
        vec![1]
    );

    // TensorFlow's fallback: no NCCL on CPUs, ReductionToOneDevice instead.
    let devices = logical_cpus(3).unwrap();
    let m = Strategy::mirrored(&devices, Some(CrossDeviceOps::NcclAllReduce)).unwrap();
    assert_eq!(m.cross_device_ops().unwrap().name(), "ReductionToOneDevice");
    assert_eq!(m.num_replicas_in_sync(), 3);
    let bad = CrossDeviceOps::ReductionToOneDevice {
        reduce_to_device: Some(logical_cpus(5).unwrap().remove(4)),
    };
    assert!(Strategy::mirrored(&devices, Some(bad))
        .err()
        .unwrap()
        .to_string()
        .contains("cpu:4 is not one of"));

    // reduce with and without an axis; gather along an axis.
    let per = PerReplica(
        (0..3)
            .map(|r| {
                Tensor::new((0..4).map(|i| (r * 10 + i) as f64).collect(), vec![2, 2]).unwrap()
            })
            .collect::<Vec<_>>(),
    );
    assert_eq!(
        m.reduce(ReduceOp::Sum, &per, None).unwrap().data,
        vec![30.0, 33.0, 36.0, 39.0]
    );
    let mean0 = m.reduce(ReduceOp::Mean, &per, Some(0)).unwrap();
    assert_eq!(mean0.shape, vec![2]);
    assert_eq!(
        mean0.data,
        vec![
            (0.0 + 2.0 + 10.0 + 12.0 + 20.0 + 22.0) / 6.0,
            (1.0 + 3.0 + 11.0 + 13.0 + 21.0 + 23.0) / 6.0
        ]
    );
    assert!(
        m.reduce(ReduceOp::Max, &per, None).is_err(),
        "TensorFlow's ReduceOp is SUM or MEAN"
    );
    let g = m.gather(&per, 0).unwrap();
    assert_eq!(g.shape, vec![6, 2]);
    assert_eq!(&g.data[4..6], &[10.0, 11.0]);

    // An uneven batch: the first replicas get one row more.
    let batch: Vec<f32> = (0..7 * 2).map(|x| x as f32).collect();
    let shards = m.distribute_batch(&batch, 2).unwrap();
    assert_eq!(
        shards.0.iter().map(|s| s.len() / 2).collect::<Vec<_>>(),
        vec![3, 2, 2]
    );
    assert_eq!(shards.0.concat(), batch);
    assert!(m.distribute_batch(&batch, 3).is_err());

    // Mirrored variables from outside run.
    let var = m.mirrored_variable(&[1.0f32, 1.0]).unwrap();
    var.assign_add(&m, &PerReplica(vec![vec![1.0, 2.0]; 3]), Aggregation::Sum)
        .unwrap();
    assert_eq!(var.value(), vec![4.0, 7.0]);
    var.assign_sub(
        &m,
        &PerReplica(vec![vec![1.0, 1.0], vec![2.0, 2.0], vec![3.0, 3.0]]),
        Aggregation::Mean,
    )
    .unwrap();
    assert_eq!(var.value(), vec![2.0, 5.0]);
    var.assign(
        &m,
        &PerReplica(vec![vec![9.0, 9.0], vec![0.0, 0.0], vec![0.0, 0.0]]),
        Aggregation::OnlyFirstReplica,
    )
    .unwrap();
    assert!(var.in_sync());
    assert_eq!(var.read(2), vec![9.0, 9.0]);

    // Central storage: one copy, updated once with the reduced update.
    let c = Strategy::central_storage(&devices).unwrap();
    let cv = c.central_variable(&[0i64, 0]).unwrap();
    cv.assign_add(&c, &PerReplica(vec![vec![1, 2]; 3]), Aggregation::Sum)
        .unwrap();
    assert_eq!(cv.value(), vec![3, 6]);

    // Inside run: replica context collectives.
    let out = m
        .run(|ctx| {
            let g = ctx.all_gather(&[ctx.replica_id_in_sync_group() as u32])?;
            let mut b = [ctx.replica_id_in_sync_group() as i32 * 7];
            ctx.broadcast(&mut b, 1)?;
            Ok((g, b[0]))
        })
        .unwrap();
    assert!(out
        .local_results()
        .iter()
        .all(|(g, b)| g == &[0, 1, 2] && *b == 7));
}

/// `n` addresses on loopback with ports free a moment ago.
fn free_addrs(n: usize) -> Vec<String> {
    let ls: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    ls.iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect()
}

/// The spec of task `ty`:`index` in `cluster`, with a token as a real job has.
fn spec_of(cluster: &serde_json::Value, ty: &str, index: usize) -> tutti::ClusterSpec {
    let tf = serde_json::json!({"cluster": cluster, "task": {"type": ty, "index": index}});
    let mut spec = tutti::from_tf_config(&tf.to_string()).unwrap();
    spec.token = Some("strategy-consistency-test-token".into());
    spec
}

/// `f(worker, strategy)` on each of two workers of a multi-worker strategy (the ring across
/// them, `local` logical CPU replicas each), in threads; their results in worker order.
fn on_two_workers<R: Send>(
    local: usize,
    f: impl Fn(usize, Strategy) -> tutti::Result<R> + Sync,
) -> Vec<R> {
    use tutti::strategy::CommunicationImplementation;
    let cluster = serde_json::json!({ "worker": free_addrs(2) });
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|w| {
                let spec = spec_of(&cluster, "worker", w);
                s.spawn(move || -> tutti::Result<R> {
                    let strategy = Strategy::multi_worker_mirrored(
                        CommunicationImplementation::Ring,
                        Some(spec),
                        &logical_cpus(local)?,
                    )?;
                    f(w, strategy)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    })
}

/// Two workers that each compute their own initial value (as workers seeded differently do)
/// start from the chief's, and stay identical; a worker whose variable differs in length from
/// the chief's gets an error naming both, and so does the chief.
#[test]
fn workers_start_from_the_chiefs_initial_value() {
    let out = on_two_workers(1, |w, strategy| {
        let mine = 10.0 * (w + 1) as f32; // 10 on worker 0, 20 on worker 1
        let v = strategy.mirrored_variable(&[mine])?;
        let before = v.value();
        v.assign_add(&strategy, &PerReplica(vec![vec![1.0]]), Aggregation::Mean)?;
        let c = strategy.central_variable(&[mine, mine])?;
        // A variable whose shape differs between the workers.
        let odd = strategy.mirrored_variable(&vec![0.0f32; 3 + w]);
        Ok((before, v.value(), c.value(), odd.err()))
    });
    for (w, (before, after, central, odd)) in out.into_iter().enumerate() {
        assert_eq!(
            before,
            vec![10.0],
            "worker {w} did not start from the chief's value"
        );
        assert_eq!(after, vec![11.0], "worker {w}");
        assert_eq!(central, vec![10.0, 10.0], "worker {w}");
        let e = odd.unwrap_or_else(|| panic!("worker {w} accepted a variable of another shape"));
        let msg = e.to_string();
        let (me, peer) = (w, 1 - w);
        assert!(
            msg.contains("mirrored_variable")
                && msg.contains(&format!("rank {me}"))
                && msg.contains(&format!("rank {peer}"))
                && msg.contains("element count"),
            "worker {w}: {msg}"
        );
    }
}

/// Tensors placed on CPU replicas (host memory) reduce, broadcast and gather across 2 workers
/// x 2 replicas as the replica context's slices do.
#[test]
fn tensors_on_cpu_replicas_reduce_across_workers() {
    let out = on_two_workers(2, |w, strategy| {
        let got = strategy.run(|ctx| {
            let id = ctx.replica_id_in_sync_group() as f64;
            let v = [id, 1.0, -id * 0.5];
            let mut t = ctx.place(&v)?;
            assert_eq!(t.kind(), tutti::DeviceKind::Cpu);
            ctx.all_reduce_tensor(ReduceOp::Mean, &mut t)?;
            let mut b = ctx.place(&[id * 10.0])?;
            ctx.broadcast_tensor(&mut b, 3)?;
            let mut g = ctx.place(&[id as i32, w as i32])?;
            ctx.all_gather_tensor(&mut g)?;
            let mut s = v.to_vec();
            ctx.all_reduce(ReduceOp::Mean, &mut s)?;
            Ok((
                t.to_vec::<f64>()?,
                s,
                b.to_vec::<f64>()?,
                g.to_vec::<i32>()?,
            ))
        })?;
        // A device variable starts from the chief's value; updates combine across workers.
        let var = strategy.device_variable(&[100.0 * (w + 1) as f32, 1.0])?;
        let start = var.value()?;
        strategy.run(|ctx| {
            let id = ctx.replica_id_in_sync_group() as f32;
            let u = ctx.place(&[id, 1.0])?;
            var.assign_add_in(ctx, &u, Aggregation::Mean)?;
            var.assign_sub_in(ctx, &u, Aggregation::Sum)?;
            var.assign_add_in(
                ctx,
                &ctx.place(&[id + 7.0, 0.0])?,
                Aggregation::OnlyFirstReplica,
            )
        })?;
        // The optimizers step device variables' copies (host memory here) as they step
        // mirrored variables', and save the same state.
        use tutti::strategy::{Checkpoint, Optimizer};
        let init = [1.0f32, -2.0, 0.5];
        let (dv, mv) = (
            strategy.device_variable(&init)?,
            strategy.mirrored_variable(&init)?,
        );
        let (od, om) = (Optimizer::adam(0.1)?, Optimizer::adam(0.1)?);
        for k in 0..3 {
            strategy.run(|ctx| {
                let id = ctx.replica_id_in_sync_group() as f32;
                let g = [id - 1.5, k as f32, 0.25 * id];
                od.apply_device_gradients(ctx, &mut [(&mut ctx.place(&g)?, &dv)])?;
                om.apply_gradients(ctx, &[(&g[..], &mv)])
            })?;
        }
        let (mut saved, mut want) = (Checkpoint::new(3), Checkpoint::new(3));
        od.save_device(&mut saved, "adam", &[("w", &dv)])?;
        om.save(&mut want, "adam", &[("w", &mv)])?;
        let stepped = dv.value()? == mv.value() && dv.value()? != init;
        let same_state = saved.to_bytes()? == want.to_bytes()?;
        Ok((
            got.0,
            start,
            var.value()?,
            var.in_sync()?,
            stepped && same_state,
        ))
    });
    for (per_worker, start, end, in_sync, optimized) in out {
        assert!(
            optimized,
            "the device variable stepped unlike the mirrored one"
        );
        for (t, s, b, g) in per_worker {
            assert_eq!(t, vec![1.5, 1.0, -0.75]);
            assert_eq!(t, s);
            assert_eq!(b, vec![30.0]);
            assert_eq!(g, vec![0, 0, 1, 0, 2, 1, 3, 1]);
        }
        assert_eq!(start, vec![100.0, 1.0]);
        // + mean (1.5, 1) - sum (6, 4) + replica 0's (7, 0).
        assert_eq!(end, vec![100.0 + 1.5 - 6.0 + 7.0, 1.0 + 1.0 - 4.0]);
        assert!(in_sync);
    }
}

/// A worker whose own part of a call across workers fails (its replicas' values disagree, an
/// update of the wrong length) still takes its place in the workers' collective, as a
/// rejection: the other worker's call fails at once naming it and the reason, instead of
/// waiting for it until the timeout.
#[test]
fn an_error_on_one_worker_before_a_collective_reaches_the_others_at_once() {
    let cases = [
        "reduce",
        "gather",
        "replica all_reduce",
        "device variable",
        "optimizer",
        "replica all_gather",
        "reduce, peer late",
    ];
    for case in cases {
        let start = Instant::now();
        let out = on_two_workers(2, |w, strategy| {
            let odd = w == 1;
            let got = match case {
                "reduce" | "reduce, peer late" => {
                    if case == "reduce, peer late" && !odd {
                        // Worker 1's error must not wait for this worker to come.
                        std::thread::sleep(Duration::from_millis(1500));
                    }
                    let asked = Instant::now();
                    // Worker 1's second replica holds a value of another shape.
                    let v = PerReplica(
                        (0..2)
                            .map(|r| {
                                Tensor::vector(vec![1.0f32; if odd && r == 1 { 3 } else { 2 }])
                            })
                            .collect(),
                    );
                    let got = strategy.reduce(ReduceOp::Sum, &v, None).map(drop);
                    if odd {
                        let took = asked.elapsed();
                        assert!(took < Duration::from_secs(1), "worker 1 waited {took:?}");
                    }
                    got
                }
                "replica all_gather" => strategy
                    .run(|ctx| {
                        let n = if odd && ctx.local_replica_id() == 1 {
                            3
                        } else {
                            2
                        };
                        ctx.all_gather(&vec![1.0f32; n]).map(drop)
                    })
                    .map(drop),
                "gather" => {
                    let v = PerReplica(
                        (0..2)
                            .map(|r| {
                                let cols = if odd && r == 1 { 3 } else { 2 };
                                Tensor::new(vec![0.0f32; 2 * cols], vec![2, cols]).unwrap()
                            })
                            .collect(),
                    );
                    strategy.gather(&v, 0).map(drop)
                }
                "replica all_reduce" => strategy
                    .run(|ctx| {
                        let n = if odd && ctx.local_replica_id() == 1 {
                            5
                        } else {
                            4
                        };
                        ctx.all_reduce(ReduceOp::Sum, &mut vec![1.0f32; n])
                    })
                    .map(drop),
                "optimizer" => {
                    let var = strategy.mirrored_variable(&[1.0f32, 2.0])?;
                    let opt = tutti::strategy::Optimizer::sgd(0.1)?;
                    let step = |s: &Strategy, n: usize| {
                        s.run(|ctx| {
                            let g = vec![1.0f32; n];
                            opt.apply_gradients(ctx, &[(&g[..], &var)])
                        })
                    };
                    let got = step(&strategy, if odd { 3 } else { 2 }).map(drop);
                    // Worker 1 shrinks as soon as its step returns, its rejection perhaps still
                    // on its queue: worker 0 must get the reason all the same (asserted below).
                    // No worker was lost: a shrink on both gives them a new communicator of
                    // both, and the strategy goes on from the variable as it was.
                    let mut strategy = strategy;
                    strategy.shrink()?;
                    assert_eq!(strategy.num_replicas_in_sync(), 4, "worker {w}");
                    assert_eq!(strategy.cluster_resolver().task_id, w);
                    assert_eq!(var.value(), vec![1.0, 2.0], "worker {w}, failed step");
                    step(&strategy, 2)?;
                    // The 4 replicas' gradients of 1, summed: 0.1 × 4 off each element.
                    assert_eq!(var.value(), vec![0.6, 1.6], "worker {w}, after the shrink");
                    return Ok((got.map_err(|e| e.to_string()), strategy));
                }
                _ => {
                    let var = strategy.device_variable(&[1.0f32, 2.0])?;
                    strategy
                        .run(|ctx| {
                            let u = ctx.place(&vec![1.0f32; if odd { 3 } else { 2 }])?;
                            var.assign_add_in(ctx, &u, Aggregation::Sum)
                        })
                        .map(drop)
                }
            };
            // Each worker keeps its strategy until both are done, as a worker that goes on
            // after an error would: the peer must not learn of it from a closed connection.
            Ok((got.map_err(|e| e.to_string()), strategy))
        });
        let out: Vec<_> = out.into_iter().map(|(got, _strategy)| got).collect();
        let took = start.elapsed();
        let why = match case {
            "reduce" | "reduce, peer late" => "replica values have different shapes",
            "replica all_gather" => "count is",
            "gather" => "concat",
            "replica all_reduce" => "count is",
            "optimizer" => "gradient 0 holds 3 elements, its variable 2",
            _ => "the update is",
        };
        let own = out[1].as_ref().expect_err(case);
        assert!(own.contains(why), "{case}, worker 1: {own}");
        let peer = out[0]
            .as_ref()
            .expect_err("worker 0's call must fail with worker 1's");
        assert!(
            peer.contains("rank 1") && peer.contains(why),
            "{case}, worker 0: {peer}"
        );
        assert!(
            took < Duration::from_secs(30),
            "{case}: took {took:?}, as if waiting for the timeout"
        );
    }
}

/// TensorFlow runs MultiWorkerMirroredStrategy without a cluster as one worker on the local
/// devices: a script written for a cluster runs unchanged on a laptop.
#[test]
fn multi_worker_without_a_cluster_runs_as_one_worker() {
    use tutti::strategy::CommunicationImplementation;
    assert!(
        !tutti::ClusterSpec::env_present(),
        "this test needs an environment without a cluster"
    );
    let cpus = logical_cpus(2).unwrap();
    let s =
        Strategy::multi_worker_mirrored(CommunicationImplementation::Auto, None, &cpus).unwrap();
    assert_eq!(s.kind(), StrategyKind::MultiWorkerMirrored);
    assert_eq!(s.num_replicas_in_sync(), 2);
    assert!(s.cluster_resolver().is_chief);
    assert_eq!(s.cluster_resolver().num_workers, 1);
    let v = s.mirrored_variable(&[1.0f32]).unwrap();
    let out = s
        .run(|ctx| {
            let mut g = [ctx.replica_id_in_sync_group() as f32 + 1.0];
            ctx.all_reduce(ReduceOp::Sum, &mut g)?;
            ctx.assign_add(&v, &g, Aggregation::Mean)?;
            Ok(g[0])
        })
        .unwrap();
    assert_eq!(out.local_results(), &[3.0, 3.0]);
    assert_eq!(v.value(), vec![4.0]);
    // TensorFlow's CommunicationOptions: the replicas' waits take its timeout (a replica that
    // stays away is given up on within it), and 0 is refused: tutti bounds every wait.
    use tutti::strategy::CommunicationOptions;
    let options = CommunicationOptions {
        bytes_per_pack: 4096,
        timeout: Some(Duration::from_millis(300)),
        ..CommunicationOptions::default()
    };
    let s = Strategy::multi_worker_mirrored_with(&options, None, &cpus).unwrap();
    let t = std::time::Instant::now();
    let e = s
        .run(|ctx| {
            let mut g = [1.0f32];
            if ctx.replica_id_in_sync_group() == 1 {
                return Ok(());
            }
            ctx.all_reduce(ReduceOp::Sum, &mut g)
        })
        .unwrap_err()
        .to_string();
    assert!(
        t.elapsed() < Duration::from_secs(10) && e.contains("timed out"),
        "{e}"
    );
    let zero = CommunicationOptions {
        timeout: Some(Duration::ZERO),
        ..CommunicationOptions::default()
    };
    let e = Strategy::multi_worker_mirrored_with(&zero, None, &cpus)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("tutti bounds every wait"), "{e}");
}

/// Captures the library's log records (this test binary's only logger).
struct Captured;
/// Each record's level, message and the thread that logged it (tests run side by side).
#[allow(clippy::type_complexity)]
static RECORDS: std::sync::Mutex<Vec<(log::Level, String, std::thread::ThreadId)>> =
    std::sync::Mutex::new(Vec::new());
impl log::Log for Captured {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        RECORDS.lock().unwrap().push((
            r.level(),
            r.args().to_string(),
            std::thread::current().id(),
        ));
    }
    fn flush(&self) {}
}

/// NCCL asked for where it cannot run (across workers whose devices are not all GPUs, or
/// NcclAllReduce for a MirroredStrategy on CPUs): the fallback runs, and the user is told why
/// at `warn`, once (not at `info`, where nobody looks).
#[test]
fn nccl_asked_for_where_it_cannot_run_is_a_warning_once() {
    use tutti::strategy::CommunicationImplementation;
    static LOGGER: Captured = Captured;
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Trace);
    let cpus = logical_cpus(1).unwrap();
    for _ in 0..2 {
        let cluster = serde_json::json!({ "worker": free_addrs(2) });
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|w| {
                    let (spec, cpus) = (spec_of(&cluster, "worker", w), cpus.clone());
                    s.spawn(move || {
                        let st = Strategy::multi_worker_mirrored(
                            CommunicationImplementation::Nccl,
                            Some(spec),
                            &cpus,
                        )?;
                        st.run(|ctx| {
                            let mut x = [1.0f32];
                            ctx.all_reduce(ReduceOp::Sum, &mut x)?;
                            Ok(x[0])
                        })
                    })
                })
                .collect();
            for h in hs {
                assert_eq!(h.join().unwrap().unwrap().local_results(), &[2.0]);
            }
        });
    }
    let warned: Vec<_> = RECORDS
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, m, _)| m.contains("NCCL cannot run here"))
        .map(|(l, m, _)| (*l, m.clone()))
        .collect();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(warned[0].0, log::Level::Warn);
    assert!(
        warned[0].1.contains("cpu:0") && warned[0].1.contains("using RING"),
        "{}",
        warned[0].1
    );
    // MirroredStrategy told NcclAllReduce by name, on CPUs: ReductionToOneDevice runs, at any
    // number of devices, and the user is warned once per strategy; left to choose, it falls
    // back quietly (at info), as TensorFlow does.
    // This thread's records only: other tests make mirrored strategies meanwhile.
    let me = std::thread::current().id();
    let fallbacks = |level: log::Level| {
        RECORDS
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, m, t)| {
                *l == level && *t == me && m.contains("NcclAllReduce is not usable")
            })
            .count()
    };
    for n in [1, 2] {
        let before = fallbacks(log::Level::Warn);
        let s = Strategy::mirrored(
            &logical_cpus(n).unwrap(),
            Some(CrossDeviceOps::NcclAllReduce),
        )
        .unwrap();
        let out = s.run(|ctx| {
            let mut x = [1.0f32];
            ctx.all_reduce(ReduceOp::Sum, &mut x)?;
            Ok(x[0])
        });
        assert_eq!(out.unwrap().local_results(), &vec![n as f32; n][..]);
        let warned = fallbacks(log::Level::Warn) - before;
        assert_eq!(warned, usize::from(n > 1), "{n} devices");
    }
    let before = fallbacks(log::Level::Info);
    Strategy::mirrored(&logical_cpus(2).unwrap(), None).unwrap();
    assert_eq!(fallbacks(log::Level::Info) - before, 1);
}

/// Parameter-server variables of every float dtype, stepped on the ps tasks by their own rule
/// or by the one a step pushes with, whose slots (momentum, moments) the ps tasks keep per key
/// and keep through an assign.
#[test]
fn ps_variables_of_every_float_dtype_step_by_rules_the_ps_tasks_keep() {
    use half::{bf16, f16};
    use tutti::strategy::ps::{ParameterServerStrategy, Partitioner, Role, StepContext, Values};
    use tutti::strategy::Rule;
    use tutti::DType;
    let addrs = free_addrs(4);
    let cluster = serde_json::json!({
        "chief": [addrs[0]], "worker": [addrs[1]], "ps": [addrs[2], addrs[3]]
    });
    let task = |ty: &str, i: usize| {
        ParameterServerStrategy::new(spec_of(&cluster, ty, i), Partitioner::FixedShards(2))
            .unwrap()
            .with_timeout(Duration::from_secs(20))
    };
    let momentum = Rule::Sgd {
        learning_rate: 0.1,
        momentum: 0.9,
        nesterov: false,
    };
    let step_fn = move |ctx: &StepContext| {
        let v = ctx.variables();
        if ctx.payload() == b"wrong dtype" {
            let none = || Values::F32(Vec::new());
            return Ok((vec![vec![1.0f32; 5].into(), none(), none(), none()], 0.0));
        }
        // Two optimizers step variable 2: each with its own momentum.
        for key in [7, 8] {
            ctx.push(2, vec![1.0f32; 4].into(), momentum, key);
        }
        Ok((
            vec![
                vec![0.5f64; 5].into(),
                vec![f16::from_f32(1.0); 3].into(),
                Values::F32(Vec::new()),
                vec![bf16::from_f32(0.25); 2].into(),
            ],
            v[1].get::<f16>().unwrap()[0].to_f32(),
        ))
    };
    std::thread::scope(|s| {
        let servers: Vec<_> = [("ps", 0), ("ps", 1), ("worker", 0)]
            .into_iter()
            .map(|(ty, i)| {
                let t = task(ty, i);
                s.spawn(move || t.run_role(step_fn).map(|r| matches!(r, Role::Done)))
            })
            .collect();
        let Role::Chief(coord) = task("chief", 0).run_role(step_fn).unwrap() else {
            panic!("the chief got no coordinator")
        };
        let adam = Rule::Adam {
            learning_rate: 0.1,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-7,
        };
        let sgd = |lr| Rule::Sgd {
            learning_rate: lr,
            momentum: 0.0,
            nesterov: false,
        };
        let ids = [
            coord.create_variable_with("a", vec![1.0f64; 5].into(), adam, None),
            coord.create_variable_with("b", vec![f16::from_f32(2.0); 3].into(), sgd(0.5), None),
            coord.create_variable_with("c", vec![0.0f32; 4].into(), sgd(1.0), Some(1)),
            coord.create_variable_with("d", vec![bf16::from_f32(1.0); 2].into(), sgd(1.0), None),
        ]
        .map(Result::unwrap);
        assert_eq!(coord.shards(), [2, 2, 1, 2]);
        let losses = coord.run_steps(3).unwrap();
        // The loss each step read: variable b as pulled.
        assert_eq!(losses, [2.0, 1.5, 1.0]);
        // Adam's step on a constant gradient is the learning rate (but for epsilon).
        let a = coord.read_values(ids[0]).unwrap();
        assert_eq!(a.dtype(), DType::F64);
        for w in a.get::<f64>().unwrap() {
            assert!((w - 0.7).abs() < 1e-5, "{a:?}");
        }
        // Adam's state, its two shards' joined: 3 steps of the gradient 0.5, in f64.
        let st = coord.read_slots(ids[0], None).unwrap();
        assert_eq!(st.steps, 3);
        let m = 0.5 * (1.0 - 0.9f64.powi(3));
        for x in st.first.as_ref().unwrap().get::<f64>().unwrap() {
            assert!((x - m).abs() < 1e-6, "{st:?}");
        }
        assert_eq!(st.second.as_ref().unwrap().len(), 5);
        let e = coord.read_variable(ids[0]).unwrap_err().to_string();
        assert!(e.contains("is f64") && e.contains("read_values"), "{e}");
        assert_eq!(
            coord.read_values(ids[1]).unwrap(),
            vec![f16::from_f32(0.5); 3].into()
        );
        assert_eq!(
            coord.read_values(ids[3]).unwrap(),
            vec![bf16::from_f32(0.25); 2].into()
        );
        // Momentum by key: v = -0.1, -0.19, -0.271; w = -0.1, -0.29, -0.561 for each.
        for w in coord.read_variable(ids[2]).unwrap() {
            assert!((w + 2.0 * 0.561).abs() < 1e-5, "{w}");
        }
        // A pushed rule's slots by its key: momentum 7's v, and none yet for key 9.
        let v7 = coord.read_slots(ids[2], Some((momentum, 7))).unwrap();
        for v in v7.first.as_ref().unwrap().as_f32().unwrap() {
            assert!((v + 0.271).abs() < 1e-6, "{v7:?}");
        }
        let v9 = coord.read_slots(ids[2], Some((momentum, 9))).unwrap();
        assert_eq!(v9.first, Some(vec![0.0f32; 4].into()));
        // An assign keeps the slots: the next step goes on from v = -0.271.
        coord.assign_variable(ids[2], &[0.0; 4]).unwrap();
        coord.run_steps(1).unwrap();
        for w in coord.read_variable(ids[2]).unwrap() {
            assert!((w + 2.0 * 0.3439).abs() < 1e-5, "{w}");
        }
        // From the coordinator: the variable's own rule (SGD at 0.5; b is 0 after 4 steps)...
        coord
            .push_values(ids[1], vec![f16::from_f32(1.0); 3].into(), None)
            .unwrap();
        assert_eq!(
            coord.read_values(ids[1]).unwrap(),
            vec![f16::from_f32(-0.5); 3].into()
        );
        // ... and a step's rule and key, with the step's slots: momentum 7 goes on from -0.3439.
        coord
            .push_values(ids[2], vec![0.0f32; 4].into(), Some((momentum, 7)))
            .unwrap();
        for w in coord.read_variable(ids[2]).unwrap() {
            let v = 0.9 * -0.3439;
            assert!((w - (-2.0 * 0.3439 + v)).abs() < 1e-5, "{w}");
        }
        let e = coord
            .push_values(
                ids[2],
                vec![0.0f32; 4].into(),
                Some((
                    Rule::Sgd {
                        learning_rate: 0.1,
                        momentum: 1.5,
                        nesterov: false,
                    },
                    7,
                )),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("momentum 1.5 must be in [0, 1]"), "{e}");
        // A shard keeps the slots of a bounded number of optimizers.
        let e = (0..100)
            .find_map(|key| {
                coord
                    .push_values(ids[2], vec![0.0f32; 4].into(), Some((momentum, 1000 + key)))
                    .err()
            })
            .unwrap()
            .to_string();
        assert!(
            e.contains("more than 64 optimizers' slots on one shard"),
            "{e}"
        );
        // A gradient of another dtype fails its step, naming both; the job goes on.
        coord.schedule(b"wrong dtype".to_vec()).unwrap();
        let e = coord.join().unwrap_err().to_string();
        assert!(e.contains("5 f32 elements for variable 0 of 5 f64"), "{e}");
        let e = coord
            .assign_values(ids[1], vec![1.0f32; 3].into())
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 f32 values for variable 1 of 3 f16"), "{e}");
        let e = coord
            .create_variable_with("e", vec![1.0f32].into(), sgd(-1.0), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("learning rate -1 must be finite and not negative"),
            "{e}"
        );
        assert!(Values::zeros(DType::I32, 3)
            .unwrap_err()
            .to_string()
            .contains("not i32"));
        let st = coord.read_slots(ids[0], None).unwrap();
        assert_eq!(st.steps, 4);
        // Set onto a variable of one shard (a checkpoint restored onto fewer ps tasks), both
        // then step alike.
        let a1 = coord
            .create_variable_with("a1", coord.read_values(ids[0]).unwrap(), adam, Some(1))
            .unwrap();
        coord.assign_slots(a1, None, &st).unwrap();
        assert_eq!(coord.read_slots(a1, None).unwrap(), st);
        for id in [ids[0], a1] {
            coord
                .push_values(id, vec![0.25f64; 5].into(), None)
                .unwrap();
        }
        assert_eq!(
            coord.read_values(a1).unwrap(),
            coord.read_values(ids[0]).unwrap()
        );
        assert_eq!(coord.read_slots(a1, None).unwrap().steps, 5);
        // A state the rule could not have kept is refused, naming why.
        let mut short = st.clone();
        short.second = None;
        let e = coord
            .assign_slots(a1, None, &short)
            .unwrap_err()
            .to_string();
        assert!(e.contains("keeps a second slot; none given"), "{e}");
        let e = coord
            .assign_slots(ids[1], None, &st)
            .unwrap_err()
            .to_string();
        assert!(e.contains("keeps no first slot"), "{e}");
        coord.shutdown().unwrap();
        for h in servers {
            assert!(h.join().unwrap().unwrap());
        }
    });
}

/// A step function that fails is the user's error: `run_steps` returns it with its message and
/// the worker that raised it, and the workers stay in the job (the next `run_steps` uses them).
#[test]
fn a_failing_step_is_returned_and_the_workers_stay() {
    use tutti::strategy::ps::{ParameterServerStrategy, Partitioner, Role};
    let addrs = free_addrs(4);
    let cluster = serde_json::json!({
        "chief": [addrs[0]], "worker": [addrs[1], addrs[2]], "ps": [addrs[3]]
    });
    let task = |ty: &str, i: usize| {
        ParameterServerStrategy::new(spec_of(&cluster, ty, i), Partitioner::MaxShards(1))
            .unwrap()
            .with_timeout(Duration::from_secs(20))
    };
    let step_fn = |ctx: &tutti::strategy::ps::StepContext| {
        if ctx.step() == 3 {
            return Err(Error::config("the loss is NaN at step 3"));
        }
        Ok((vec![vec![1.0f32; 4].into()], ctx.step() as f32))
    };
    std::thread::scope(|s| {
        let servers: Vec<_> = [("ps", 0), ("worker", 0), ("worker", 1)]
            .into_iter()
            .map(|(ty, i)| {
                let t = task(ty, i);
                s.spawn(move || t.run_role(step_fn).map(|r| matches!(r, Role::Done)))
            })
            .collect();
        let Role::Chief(coord) = task("chief", 0).run_role(step_fn).unwrap() else {
            panic!("the chief got no coordinator")
        };
        coord.create_variable("w", &[0.0; 4], 0.5).unwrap();
        let e = coord.run_steps(6).unwrap_err();
        match &e {
            Error::StepFailed { step, message, .. } => {
                assert_eq!(*step, 3, "{e}");
                assert!(message.contains("the loss is NaN at step 3"), "{e}");
            }
            other => panic!("not the step's error: {other}"),
        }
        let shown = e.to_string();
        assert!(shown.contains("step 3 failed on worker "), "{shown}");
        assert_eq!(
            coord.num_workers(),
            2,
            "a worker was dropped for the step's error"
        );
        // The job goes on with both workers (steps 0..2 run again: none of them fails).
        let losses = coord.run_steps(3).unwrap();
        assert_eq!(losses, vec![0.0, 1.0, 2.0]);
        assert_eq!(coord.num_workers(), 2);
        coord.shutdown().unwrap();
        for h in servers {
            assert!(
                h.join().unwrap().unwrap(),
                "a task did not end with the job"
            );
        }
    });
}

/// A cross-device op of the caller's: the replica context's all-reduce (SUM, MEAN of floats)
/// and `strategy.reduce` run through it, other ops and integers do not, its error is the
/// step's, and values of different lengths are an error naming it.
#[test]
fn a_user_defined_cross_device_op_combines_the_replicas() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tutti::strategy::{CrossDeviceOp, CustomOps};
    struct Elementwise {
        calls: AtomicUsize,
    }
    impl CrossDeviceOp for Elementwise {
        fn name(&self) -> &str {
            "elementwise"
        }
        fn all_reduce(
            &self,
            op: ReduceOp,
            dtype: tutti::DType,
            values: &mut [&mut [u8]],
        ) -> tutti::Result<()> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if dtype != tutti::DType::F32 {
                return Err(Error::config(format!("elementwise: f32 only, not {dtype}")));
            }
            let read = |b: &[u8]| -> Vec<f32> {
                b.chunks_exact(4)
                    .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
                    .collect()
            };
            let mut acc = read(values[0]);
            for v in values[1..].iter() {
                for (a, x) in acc.iter_mut().zip(read(v)) {
                    *a = match op {
                        ReduceOp::Sum | ReduceOp::Mean => *a + x,
                        ReduceOp::Max => a.max(x),
                        other => return Err(Error::config(format!("elementwise: no {other}"))),
                    };
                }
            }
            if op == ReduceOp::Mean {
                acc.iter_mut().for_each(|a| *a /= values.len() as f32);
            }
            for v in values.iter_mut() {
                for (c, a) in v.chunks_exact_mut(4).zip(&acc) {
                    c.copy_from_slice(&a.to_ne_bytes());
                }
            }
            Ok(())
        }
    }
    let op = std::sync::Arc::new(Elementwise {
        calls: AtomicUsize::new(0),
    });
    let s = Strategy::mirrored(
        &logical_cpus(3).unwrap(),
        Some(CrossDeviceOps::Custom(CustomOps(op.clone()))),
    )
    .unwrap();
    let out = s
        .run(|ctx| {
            let id = ctx.replica_id_in_sync_group() as f32;
            let (mut sum, mut mean, mut max) = ([id + 1.0, 10.0], [id], [id * 2.0]);
            ctx.all_reduce(ReduceOp::Sum, &mut sum)?;
            ctx.all_reduce(ReduceOp::Mean, &mut mean)?;
            // Not the op's: MAX, and integers (tutti's own algorithms).
            ctx.all_reduce(ReduceOp::Max, &mut max)?;
            let mut count = [1i32];
            ctx.all_reduce(ReduceOp::Sum, &mut count)?;
            Ok((sum, mean[0], max[0], count[0]))
        })
        .unwrap();
    for r in out.local_results() {
        assert_eq!(*r, ([6.0, 30.0], 1.0, 4.0, 3));
    }
    assert_eq!(op.calls.load(Ordering::SeqCst), 2);
    let per = PerReplica((0..3).map(|i| Tensor::vector(vec![i as f32; 2])).collect());
    assert_eq!(
        s.reduce(ReduceOp::Sum, &per, None).unwrap().data,
        vec![3.0, 3.0]
    );
    let mean = s.reduce(ReduceOp::Mean, &per, None).unwrap();
    assert_eq!(mean.data, vec![1.0, 1.0]);
    assert_eq!(op.calls.load(Ordering::SeqCst), 4);
    // The op's own error, on every replica; then the strategy goes on.
    let e = s
        .run(|ctx| ctx.all_reduce(ReduceOp::Sum, &mut [1.0f64]))
        .unwrap_err();
    assert!(e.to_string().contains("elementwise: f32 only"), "{e}");
    let e = s
        .run(|ctx| {
            let mut v = vec![1.0f32; 1 + ctx.local_replica_id()];
            ctx.all_reduce(ReduceOp::Sum, &mut v)
        })
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("elementwise: the replicas' calls differ")
            && e.to_string().contains("replica 1 sum of 8 bytes of f32"),
        "{e}"
    );
    // A SUM meeting a MEAN of as many bytes is no less an error.
    let e = s
        .run(|ctx| {
            let op = [ReduceOp::Sum, ReduceOp::Mean][ctx.local_replica_id() % 2];
            ctx.all_reduce(op, &mut [1.0f32])
        })
        .unwrap_err();
    assert!(e.to_string().contains("the replicas' calls differ"), "{e}");
    let ok = s.run(|ctx| {
        let mut v = [1.0f32];
        ctx.all_reduce(ReduceOp::Sum, &mut v)?;
        Ok(v[0])
    });
    assert_eq!(ok.unwrap().local_results(), &[3.0; 3]);
}

/// `ClusterCoordinator.schedule` and `join`: scheduled steps carry their arguments and send a
/// value back; a step that raises fails `join` with its error, and its value and the values it
/// cancelled say so; a worker lost to the timeout is replaced, then rejoins at the next run;
/// the three partitioner kinds shard as TensorFlow's do.
#[test]
fn scheduled_steps_return_values_and_a_lost_worker_rejoins() {
    use tutti::strategy::ps::{ParameterServerStrategy, Partitioner, Role, StepContext};
    let addrs = free_addrs(5);
    let cluster = serde_json::json!({
        "chief": [addrs[0]], "worker": [addrs[1], addrs[2]], "ps": [addrs[3], addrs[4]]
    });
    let task = |ty: &str, i: usize, secs: u64| {
        ParameterServerStrategy::new(spec_of(&cluster, ty, i), Partitioner::FixedShards(3))
            .unwrap()
            .with_timeout(Duration::from_secs(secs))
    };
    // The payload is a command; the output: the worker, then the variable's first element.
    let step_fn = |ctx: &StepContext| {
        let w = ctx.worker() as u8;
        match ctx.payload() {
            b"raise" => return Err(Error::config("raised by the step function")),
            // Worker 0 outlives the coordinator's 2 s timeout; worker 1 is slow enough that
            // worker 0 surely takes one of the six (worker 1 alone would need 1.8 s).
            b"slow" => std::thread::sleep(Duration::from_millis(if w == 0 { 3500 } else { 300 })),
            b"read" => {
                ctx.set_output(vec![w, ctx.variables()[0].as_f32().unwrap()[0] as u8]);
                return Ok((vec![], 0.0));
            }
            _ => {}
        }
        ctx.set_output(vec![w]);
        Ok((vec![vec![1.0f32; 6].into()], ctx.step() as f32))
    };
    std::thread::scope(|s| {
        let servers: Vec<_> = [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
            .into_iter()
            .map(|(ty, i)| {
                let t = task(ty, i, 30);
                s.spawn(move || t.run_role(step_fn).map(|r| matches!(r, Role::Done)))
            })
            .collect();
        let Role::Chief(coord) = task("chief", 0, 2).run_role(step_fn).unwrap() else {
            panic!("the chief got no coordinator")
        };
        let w = coord.create_variable("w", &[100.0; 6], 1.0).unwrap();
        // Three fixed shards over two ps tasks.
        assert_eq!(coord.shards(), vec![3]);

        let ok: Vec<_> = (0..4).map(|_| coord.schedule(vec![]).unwrap()).collect();
        assert!(!ok[0].is_ready(), "scheduled steps ran before join");
        coord.join().unwrap();
        for (i, v) in ok.iter().enumerate() {
            let out = coord.fetch(v).unwrap();
            assert_eq!(out.loss, i as f32);
            assert!(out.output[0] < 2, "{out:?}");
        }
        assert_eq!(coord.read_variable(w).unwrap(), vec![96.0; 6]);
        // Set from the coordinator (a restored checkpoint), across the three shards.
        let set = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        coord.assign_variable(w, &set).unwrap();
        assert_eq!(coord.read_variable(w).unwrap(), set);
        assert!(coord.assign_variable(w, &set[..5]).is_err());
        coord.assign_variable(w, &[96.0; 6]).unwrap();
        // A read-only step pushes nothing; fetch runs what is scheduled.
        let read = coord.schedule(b"read".to_vec()).unwrap();
        assert_eq!(coord.fetch(&read).unwrap().output[1], 96);

        // One step raises: join returns its error, the workers stay.
        let mut vals = vec![coord.schedule(b"raise".to_vec()).unwrap()];
        vals.extend((0..40).map(|_| coord.schedule(vec![]).unwrap()));
        let e = coord.join().unwrap_err();
        assert!(
            matches!(&e, Error::StepFailed { message, .. } if message.contains("raised by the step function")),
            "{e}"
        );
        let raised = coord.fetch(&vals[0]).unwrap_err();
        assert_eq!(raised, e);
        let cancelled = vals[1..].iter().filter_map(|v| coord.fetch(v).err());
        for c in cancelled {
            assert!(c.to_string().contains("cancelled, not run: step"), "{c}");
        }
        assert_eq!(coord.num_workers(), 2);

        // Worker 0 outlives the timeout: dropped, its step run by worker 1.
        let slow: Vec<_> = (0..6)
            .map(|_| coord.schedule(b"slow".to_vec()).unwrap())
            .collect();
        coord.join().unwrap();
        assert_eq!(coord.num_workers(), 1);
        for v in &slow {
            assert_eq!(coord.fetch(v).unwrap().output, vec![1]);
        }
        // Once it is free again, it rejoins at the next run and takes steps.
        std::thread::sleep(Duration::from_millis(2000));
        // Read steps are short: one worker may drain a whole batch while the other's thread
        // waits for a core, so batches go on until both have taken one (at most 10).
        let mut by: Vec<u8> = Vec::new();
        for _ in 0..10 {
            let vals: Vec<_> = (0..30)
                .map(|_| coord.schedule(b"read".to_vec()).unwrap())
                .collect();
            coord.join().unwrap();
            assert_eq!(coord.num_workers(), 2, "worker 0 did not rejoin");
            by.extend(vals.iter().map(|v| coord.fetch(v).unwrap().output[0]));
            if by.contains(&0) && by.contains(&1) {
                break;
            }
        }
        assert!(by.contains(&0) && by.contains(&1), "{by:?}");
        coord.shutdown().unwrap();
        for h in servers {
            assert!(
                h.join().unwrap().unwrap(),
                "a task did not end with the job"
            );
        }
    });
}

/// A parameter server that dies is named by the coordinator and by every worker, each within
/// the timeout, instead of the workers being dropped one by one.
#[test]
fn a_lost_parameter_server_is_named_by_every_task() {
    let t = train();
    let addrs = free_addrs(4);
    let cluster =
        serde_json::json!({"chief": [addrs[0]], "worker": [addrs[1], addrs[2]], "ps": [addrs[3]]});
    let spawn = |ty: &str, i: usize| {
        let tf = serde_json::json!({"cluster": cluster, "task": {"type": ty, "index": i}});
        Command::new(&t)
            .args([
                "--strategy",
                "parameter-server",
                "--steps",
                "1000",
                "--step-delay-ms",
                "10",
                "--json",
            ])
            .env("TF_CONFIG", tf.to_string())
            .env("TUTTI_JOB_TOKEN", "ps-lost-test-token")
            .env("TUTTI_TIMEOUT", "20")
            .env_remove("TUTTI_RANK")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut ps = spawn("ps", 0);
    let tasks = vec![
        ("worker 0", spawn("worker", 0)),
        ("worker 1", spawn("worker", 1)),
        ("chief", spawn("chief", 0)),
    ];
    std::thread::sleep(Duration::from_millis(2000));
    ps.kill().unwrap();
    let _ = ps.wait();
    let start = Instant::now();
    for (name, mut c) in tasks {
        let why = format!("{name} did not end after the ps task was lost");
        exit_within(&mut c, start, Duration::from_secs(60), &why);
        let mut err = String::new();
        c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        assert!(!c.wait().unwrap().success(), "{name} succeeded: {err}");
        assert!(err.contains("lost ps task 0"), "{name}: {err}");
    }
}

/// `cmd`, which must succeed within two minutes; its output.
fn run_ok(cmd: &mut Command) -> String {
    let (ok, out, err) = bounded(cmd, Duration::from_secs(120));
    assert!(ok, "{out}\n{err}");
    out
}

fn checkpoint_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tutti-ckpt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The steps of the checkpoints in `dir`, in order.
fn saved_steps(dir: &std::path::Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_prefix("ckpt-")?
                .strip_suffix(".tutti")?
                .parse()
                .ok()
        })
        .collect();
    steps.sort();
    steps
}

#[test]
fn every_strategy_resumes_from_its_checkpoint_as_if_never_stopped() {
    let t = train();
    for (strategy, replicas) in [
        ("default", 1),
        ("one-device", 1),
        ("mirrored", 3),
        ("central-storage", 2),
    ] {
        let dir = checkpoint_dir(strategy);
        let base = |steps: &str| {
            let mut c = Command::new(&t);
            c.args(["--strategy", strategy, "--replicas", &replicas.to_string()])
                .args(["--steps", steps, "--json"]);
            c
        };
        let whole = last_json(&run_ok(&mut base("60")));
        let first = last_json(&run_ok(
            base("30")
                .arg("--checkpoint-dir")
                .arg(&dir)
                .args(["--checkpoint-every", "10"]),
        ));
        assert_eq!(first["restored_step"], serde_json::Value::Null);
        assert_eq!(saved_steps(&dir), [10, 20, 30], "{strategy}");
        let resumed = last_json(&run_ok(
            base("30").arg("--checkpoint-dir").arg(&dir).args([
                "--checkpoint-every",
                "10",
                "--resume",
            ]),
        ));
        // Restored at 30, trained to 60: the same bits as 60 steps in one run; the last 3 kept.
        assert_eq!(resumed["restored_step"], 30, "{strategy}: {resumed}");
        assert_eq!(resumed["weights"], whole["weights"], "{strategy}");
        assert_eq!(resumed["reference_weights"], whole["reference_weights"]);
        assert_eq!(saved_steps(&dir), [40, 50, 60], "{strategy}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // Nothing to resume from, and a damaged checkpoint: errors naming the directory or file.
    let dir = checkpoint_dir("none");
    let (ok, _, err) = bounded(
        Command::new(&t)
            .arg("--checkpoint-dir")
            .arg(&dir)
            .arg("--resume"),
        Duration::from_secs(60),
    );
    assert!(!ok && err.contains("no checkpoint in"), "{err}");
    assert!(
        !dir.exists(),
        "a run that found nothing to resume made the directory"
    );
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("ckpt-7.tutti"),
        [&b"TUTTICKP"[..], &1u32.to_le_bytes(), &[0; 88]].concat(),
    )
    .unwrap();
    let (ok, _, err) = bounded(
        Command::new(&t)
            .arg("--checkpoint-dir")
            .arg(&dir)
            .arg("--resume"),
        Duration::from_secs(60),
    );
    assert!(
        !ok && err.contains("ckpt-7.tutti") && err.contains("checksum"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `evaluator` task of TF_CONFIG: a side-car that evaluates each checkpoint the chief saves
/// as it appears, in step order, up to the training's last, whose weights are the trainer's.
#[test]
fn the_evaluator_task_follows_the_chiefs_checkpoints() {
    let t = train();
    let dir = checkpoint_dir("evaluator");
    let tf = serde_json::json!({
        "cluster": {"chief": ["127.0.0.1:1"], "evaluator": ["127.0.0.1:2"]},
        "task": {"type": "evaluator", "index": 0}
    });
    let mut evaluator = Command::new(&t);
    evaluator
        .arg("--checkpoint-dir")
        .arg(&dir)
        .args(["--steps", "40", "--json"])
        .env("TF_CONFIG", tf.to_string())
        .env("TUTTI_TIMEOUT", "60")
        .env_remove("TUTTI_RANK");
    let side = std::thread::spawn(move || bounded(&mut evaluator, Duration::from_secs(120)));
    let trained = last_json(&run_ok(
        Command::new(&t)
            .args([
                "--strategy",
                "default",
                "--steps",
                "40",
                "--step-delay-ms",
                "40",
            ])
            .args(["--checkpoint-every", "5", "--json", "--checkpoint-dir"])
            .arg(&dir)
            .env_remove("TF_CONFIG"),
    ));
    let (ok, out, err) = side.join().unwrap();
    assert!(ok, "{out}\n{err}");
    let evaluated: Vec<serde_json::Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let steps: Vec<u64> = evaluated[..evaluated.len() - 1]
        .iter()
        .map(|e| e["evaluated_step"].as_u64().unwrap())
        .collect();
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "{steps:?}");
    assert!(steps.len() >= 2, "the evaluator saw only {steps:?}");
    let last = evaluated.last().unwrap();
    assert_eq!(last["evaluated_step"], 40);
    assert_eq!(last["evaluations"], steps.len());
    assert_eq!(last["weights"], trained["weights"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn workers_restore_the_chiefs_checkpoint_and_train_on() {
    let t = train();
    let dir = checkpoint_dir("multi-worker");
    let job = |n: &str, steps: &str, extra: &[&str]| {
        let mut c = Command::new(common::tutti_bin());
        c.args(["launch", "--tag-output", "-n", n, "--"])
            .arg(&t)
            .args([
                "--strategy",
                "multi-worker",
                "--replicas",
                "2",
                "--steps",
                steps,
            ])
            .arg("--checkpoint-dir")
            .arg(&dir)
            .args(["--json"])
            .args(extra);
        run_ok(&mut c)
    };
    let whole = worker_json(&job("2", "40", &[]), 0);
    std::fs::remove_dir_all(&dir).unwrap();
    job("2", "20", &[]);
    // The chief alone wrote.
    assert_eq!(saved_steps(&dir), [20]);
    let out = job("2", "20", &["--resume"]);
    for w in 0..2 {
        let j = worker_json(&out, w);
        assert_eq!(j["restored_step"], 20, "{j}");
        assert_eq!(j["weights"], whole["weights"], "worker {w}");
    }
    // Three workers go on from the two's checkpoint: the weights are the model's, whoever
    // trained them (the data split three ways sums to the same gradient, to rounding).
    let out = job("3", "20", &["--resume"]);
    for w in 0..3 {
        let j = worker_json(&out, w);
        assert_eq!(j["restored_step"], 40, "{j}");
        assert_eq!(j["replicas"], 6);
        assert!(max_diff(&j) < 1e-5, "worker {w}: {j}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn parameter_servers_restore_onto_a_different_number_of_them() {
    let t = train();
    let dir = checkpoint_dir("ps");
    let job = |ps: &str, extra: &[&str]| {
        let mut c = Command::new(common::tutti_bin());
        c.args(["launch", "--tag-output", "--workers", "2", "--ps", ps, "--"])
            .arg(&t)
            .args(["--strategy", "parameter-server", "--steps", "50", "--json"])
            .arg("--checkpoint-dir")
            .arg(&dir)
            .args(extra);
        let out = run_ok(&mut c);
        last_json(
            out.lines()
                .find(|l| l.starts_with("[chief:0] {"))
                .unwrap_or_else(|| panic!("{out}")),
        )
    };
    let first = job("2", &["--checkpoint-every", "10"]);
    assert_eq!(saved_steps(&dir), [30, 40, 50], "{first}");
    // Saved from two parameter servers' shards, restored onto one: 50 more steps land where
    // 100 do (asynchronous steps: within the tolerance of the uninterrupted run's test).
    let j = job("1", &["--resume"]);
    assert_eq!(j["restored_step"], 50, "{j}");
    assert!(j["loss"].as_f64().unwrap() < 1e-3, "{j}");
    assert!(max_diff(&j) < 0.05, "{j}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Start `cmd`, a `tutti launch` job saving checkpoints into `dir`, and kill the launcher
/// outright (SIGKILL; every task dies with it) once a checkpoint of step `at_least` or later is
/// there: the last step saved, which must be short of the job's end.
fn kill_once_saved(cmd: &mut Command, dir: &std::path::Path, at_least: u64, end: u64) -> u64 {
    let mut job = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let saved = || {
        if dir.exists() {
            saved_steps(dir)
        } else {
            vec![]
        }
    };
    while saved().last().is_none_or(|&s| s < at_least) {
        if let Some(status) = job.try_wait().unwrap() {
            panic!("the job ended ({status}) before step {at_least} was saved");
        }
        if t.elapsed() > Duration::from_secs(90) {
            let _ = job.kill();
            panic!("no checkpoint of step {at_least} within 90 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    job.kill().unwrap();
    job.wait().unwrap();
    // The tasks die with the launcher (their parent-death signal), a moment after it: a
    // checkpoint being renamed into place then lands before the last one is read.
    std::thread::sleep(Duration::from_millis(500));
    let last = *saved().last().unwrap();
    assert!(
        last < end,
        "the job saved its last step ({last}) before it was killed"
    );
    last
}

/// Every task killed outright mid-training, after a checkpoint: restarted with `--resume`,
/// the job ends where an uninterrupted one does. Workers: the same bits; parameter servers
/// (asynchronous steps), restored onto a different number of them: the reference weights.
#[test]
fn a_job_killed_outright_resumes_from_its_last_checkpoint() {
    let t = train();
    let dir = checkpoint_dir("killed");
    let workers = |steps: u64, extra: &[&str]| {
        let mut c = Command::new(common::tutti_bin());
        c.args(["launch", "--tag-output", "-n", "2", "--"])
            .arg(&t)
            .args(["--strategy", "multi-worker", "--replicas", "2", "--json"])
            .args(["--steps", &steps.to_string(), "--checkpoint-every", "10"])
            .arg("--checkpoint-dir")
            .arg(&dir)
            .args(extra);
        c
    };
    let whole = worker_json(&run_ok(&mut workers(200, &[])), 0);
    std::fs::remove_dir_all(&dir).unwrap();
    let last = kill_once_saved(&mut workers(200, &["--step-delay-ms", "30"]), &dir, 50, 200);
    let out = run_ok(&mut workers(200 - last, &["--resume"]));
    for w in 0..2 {
        let j = worker_json(&out, w);
        assert_eq!(j["restored_step"], last, "{j}");
        assert_eq!(
            j["weights"], whole["weights"],
            "worker {w} (killed after step {last})"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();

    let ps = |ps: &str, steps: u64, extra: &[&str]| {
        let mut c = Command::new(common::tutti_bin());
        c.args(["launch", "--tag-output", "--workers", "2", "--ps", ps, "--"])
            .arg(&t)
            .args(["--strategy", "parameter-server", "--json"])
            .args(["--steps", &steps.to_string(), "--checkpoint-every", "10"])
            .arg("--checkpoint-dir")
            .arg(&dir)
            .args(extra);
        c
    };
    let last = kill_once_saved(&mut ps("2", 300, &["--step-delay-ms", "20"]), &dir, 50, 300);
    let out = run_ok(&mut ps("1", 300 - last, &["--resume"]));
    let j = last_json(
        out.lines()
            .find(|l| l.starts_with("[chief:0] {"))
            .unwrap_or_else(|| panic!("{out}")),
    );
    assert_eq!(j["restored_step"], last, "{j}");
    assert!(j["loss"].as_f64().unwrap() < 1e-3, "{j}");
    assert!(max_diff(&j) < 0.05, "{j}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A parameter-server worker killed outright and started again on its address rejoins the
/// job: the chief's next run of steps takes it back, and it ends with the job.
#[test]
fn a_killed_worker_started_again_rejoins_the_parameter_server_job() {
    use std::io::BufRead;
    let t = train();
    let dir = checkpoint_dir("rejoin");
    let addrs = free_addrs(4);
    let cluster =
        serde_json::json!({"chief": [addrs[0]], "worker": [addrs[1], addrs[2]], "ps": [addrs[3]]});
    let spawn = |ty: &str, i: usize| {
        let tf = serde_json::json!({"cluster": cluster, "task": {"type": ty, "index": i}});
        Command::new(&t)
            .args(["--strategy", "parameter-server", "--json"])
            .args(["--steps", "1200", "--step-delay-ms", "10"])
            // The chief runs the steps up to each checkpoint in one call: a lost worker
            // rejoins at the next.
            .args(["--checkpoint-every", "20"])
            .arg("--checkpoint-dir")
            .arg(&dir)
            .env("TF_CONFIG", tf.to_string())
            .env("TUTTI_JOB_TOKEN", "ps-rejoin-test-token")
            .env("TUTTI_TIMEOUT", "20")
            // The chief's rejoin is logged at info (the others' stderr is read at their end).
            .env("TUTTI_LOG", if ty == "chief" { "info" } else { "warn" })
            .env_remove("TUTTI_RANK")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Killed when the test ends, should it fail first.
    let mut job = Reaped(vec![
        spawn("ps", 0),
        spawn("worker", 0),
        spawn("worker", 1),
        spawn("chief", 0),
    ]);
    const CHIEF: usize = 3;
    // The chief's log, line by line, as it comes.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let log = std::io::BufReader::new(job.0[CHIEF].stderr.take().unwrap());
    let reader = std::thread::spawn(move || {
        for line in log.lines().map_while(std::result::Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut err = String::new();
    let wait_for = |what: &str, err: &mut String| {
        let t = Instant::now();
        while !err.contains(what) {
            match rx.recv_timeout(Duration::from_secs(60).saturating_sub(t.elapsed())) {
                Ok(line) => {
                    err.push_str(&line);
                    err.push('\n');
                }
                Err(e) => panic!("the chief did not log '{what}' ({e}): {err}"),
            }
        }
    };
    // Into training (a first checkpoint saved), then worker 1 is killed; once the chief has
    // dropped it, it starts again.
    let t0 = Instant::now();
    while !dir.exists() || saved_steps(&dir).is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no checkpoint within 60 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    job.0[2].kill().unwrap();
    job.0[2].wait().unwrap();
    wait_for("worker 1 lost", &mut err);
    job.0[2] = spawn("worker", 1);
    wait_for("worker 1 is back and rejoins", &mut err);
    let limit = Duration::from_secs(60);
    let done = exit_within(
        &mut job.0[CHIEF],
        Instant::now(),
        limit,
        "the chief did not finish",
    );
    reader.join().unwrap();
    err.extend(rx.try_iter().map(|l| l + "\n"));
    assert!(done.success(), "{err}");
    let mut out = String::new();
    job.0[CHIEF]
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let j = last_json(&out);
    assert!(j["loss"].as_f64().unwrap() < 1e-3, "{j}");
    assert!(max_diff(&j) < 0.05, "{j}");
    // Every task, the one started again too, ends with the job.
    for (name, c) in ["ps 0", "worker 0", "worker 1 (started again)"]
        .iter()
        .zip(&mut job.0[..CHIEF])
    {
        let why = format!("{name} did not stop after the job ended");
        let status = exit_within(c, Instant::now(), Duration::from_secs(20), &why);
        let mut e = String::new();
        c.stderr.take().unwrap().read_to_string(&mut e).unwrap();
        assert!(status.success(), "{name}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Child processes killed (and reaped) when this goes: a test that fails midway leaves none
/// running.
struct Reaped(Vec<std::process::Child>);

impl Drop for Reaped {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// TensorFlow's checkpoint_interval across workers: every worker calls
/// `save_checkpoint_if_due` every step; the chief writes every 3rd step, the last 2 kept, and
/// every worker agrees which steps were saved (a disagreement would hang the workers' call).
#[test]
fn workers_save_a_checkpoint_once_every_interval() {
    use tutti::strategy::{Checkpoint, CheckpointManager};
    let dir = checkpoint_dir("interval");
    let out = on_two_workers(1, |w, strategy| {
        // Only the chief's directory is written; the worker's manager counts the chief's saves.
        let m = CheckpointManager::new(
            if w == 0 {
                dir.clone()
            } else {
                dir.join("unused")
            },
            2,
        )?
        .with_checkpoint_interval(3)?;
        assert_eq!(m.checkpoint_interval(), Some(3));
        let mut saved = vec![];
        for step in 1..=11u64 {
            let mut c = Checkpoint::new(step);
            c.insert("w", &Tensor::vector(vec![step as f32]))?;
            let due = m.due(step);
            let written = strategy.save_checkpoint_if_due(&m, &c)?;
            assert_eq!(written.is_some(), due && w == 0, "worker {w}, step {step}");
            if due {
                saved.push(step);
            }
        }
        Ok(saved)
    });
    assert_eq!(out[0], [1, 4, 7, 10]);
    assert_eq!(out[1], out[0]);
    let m = CheckpointManager::new(&dir, 2).unwrap();
    let kept: Vec<u64> = m.checkpoints().unwrap().iter().map(|c| c.0).collect();
    assert_eq!(kept, [7, 10]);
    assert!(CheckpointManager::new(&dir, 2)
        .unwrap()
        .with_checkpoint_interval(0)
        .is_err());
    std::fs::remove_dir_all(&dir).ok();
}

/// The chief reads the checkpoint and every worker receives it: a worker whose directory is
/// empty (no shared file system) restores the chief's. A chief that cannot write makes the
/// save fail on every worker, naming the chief.
#[test]
fn workers_need_no_shared_file_system_for_checkpoints() {
    use tutti::strategy::{Checkpoint, CheckpointManager};
    let dirs = [checkpoint_dir("chief"), checkpoint_dir("worker")];
    let mut saved = Checkpoint::new(12);
    saved
        .insert(
            "w",
            &Tensor::new(vec![1.0f32, 2.0, 3.0, 4.0], vec![2, 2]).unwrap(),
        )
        .unwrap();
    CheckpointManager::new(&dirs[0], 2)
        .unwrap()
        .save(&saved)
        .unwrap();
    let out = on_two_workers(1, |w, strategy| {
        let dir = &dirs[w];
        let m = CheckpointManager::new(dir, 2)?;
        let c = strategy
            .restore_checkpoint(&m)?
            .expect("the chief's checkpoint");
        let w_saved = c.get::<f32>("w")?;
        if w == 0 {
            // The chief's directory becomes a file: it cannot write there.
            std::fs::remove_dir_all(dir).unwrap();
            std::fs::write(dir, b"").unwrap();
        }
        let failed = strategy.save_checkpoint(&m, &Checkpoint::new(13)).err();
        Ok((c.step(), w_saved, failed))
    });
    for (w, (step, t, failed)) in out.into_iter().enumerate() {
        assert_eq!(
            (step, t.data, t.shape),
            (12, vec![1.0, 2.0, 3.0, 4.0], vec![2, 2])
        );
        let e = failed.unwrap_or_else(|| panic!("worker {w}: the chief could not write"));
        assert!(e.to_string().contains("checkpoint"), "worker {w}: {e}");
        if w == 1 {
            assert!(e.to_string().contains("on the chief (worker 0)"), "{e}");
        }
    }
    assert!(
        !dirs[1].exists(),
        "the worker, which never writes, made its directory"
    );
    std::fs::remove_file(&dirs[0]).ok();
}

/// Examples 0..n as (features, label) batches: each row's first feature is its id.
fn examples(ids: std::ops::Range<usize>) -> (Tensor<f32>, Tensor<i64>) {
    let n = ids.len();
    let x = ids
        .clone()
        .flat_map(|i| [i as f32, i as f32 * 0.5])
        .collect();
    let y = ids.map(|i| (i % 3) as i64).collect();
    (
        Tensor::new(x, vec![n, 2]).unwrap(),
        Tensor::new(y, vec![n]).unwrap(),
    )
}

/// The ids each local replica got, step by step.
fn ids_of(
    ds: impl Iterator<Item = tutti::Result<PerReplica<(Tensor<f32>, Tensor<i64>)>>>,
) -> Vec<Vec<Vec<usize>>> {
    ds.map(|step| {
        step.unwrap()
            .0
            .iter()
            .map(|(x, y)| {
                assert_eq!(x.shape[0], y.shape[0]);
                x.data.chunks(2).map(|r| r[0] as usize).collect()
            })
            .collect()
    })
    .collect()
}

/// Global batches of 8 over 25 examples, and the same examples in 5 files of 5.
fn global_batches() -> tutti::strategy::Dataset<(Tensor<f32>, Tensor<i64>)> {
    tutti::strategy::Dataset::from_batches((0..25).step_by(8).map(|i| examples(i..(i + 8).min(25))))
}

fn five_files() -> tutti::strategy::Dataset<(Tensor<f32>, Tensor<i64>)> {
    let files = (0..5).map(|k| PathBuf::from(format!("part-{k}"))).collect();
    tutti::strategy::Dataset::Files(
        tutti::strategy::FileDataset::new(files, 8, |p| {
            let k: usize = p.to_str().unwrap()[5..].parse().unwrap();
            Ok(examples(5 * k..5 * k + 5))
        })
        .unwrap(),
    )
}

#[test]
fn datasets_split_across_the_replicas_by_every_policy() {
    use tutti::strategy::AutoShardPolicy as P;
    let s = Strategy::mirrored(&logical_cpus(2).unwrap(), None).unwrap();
    for policy in [P::Auto, P::Data, P::Off] {
        let seen = ids_of(
            s.experimental_distribute_dataset(global_batches(), policy)
                .unwrap(),
        );
        let sizes: Vec<Vec<usize>> = seen
            .iter()
            .map(|s| s.iter().map(Vec::len).collect())
            .collect();
        assert_eq!(sizes, [[4, 4], [4, 4], [4, 4], [1, 0]], "{policy:?}");
        let mut all: Vec<usize> = seen.into_iter().flatten().flatten().collect();
        all.sort();
        assert_eq!(all, (0..25).collect::<Vec<_>>(), "{policy:?}");
    }
    let seen = ids_of(
        s.experimental_distribute_dataset(five_files(), P::File)
            .unwrap(),
    );
    assert_eq!(seen.concat().concat(), (0..25).collect::<Vec<_>>());
    let e = s
        .experimental_distribute_dataset(global_batches(), P::File)
        .err()
        .unwrap();
    assert!(e.to_string().contains("FILE sharding needs"), "{e}");
    let seen = ids_of(s.distribute_datasets_from_function(|ctx| {
        assert_eq!(
            (
                ctx.num_input_pipelines,
                ctx.input_pipeline_id,
                ctx.num_replicas_in_sync
            ),
            (1, 0, 2)
        );
        let k = ctx.get_per_replica_batch_size(8).unwrap();
        (0..25)
            .step_by(k)
            .map(move |i| examples(i..(i + k).min(25)))
    }));
    let sizes: Vec<Vec<usize>> = seen
        .iter()
        .map(|s| s.iter().map(Vec::len).collect())
        .collect();
    assert_eq!(sizes, [[4, 4], [4, 4], [4, 4], [1, 0]]);
    let v = s.experimental_distribute_values_from_function(|c| {
        (c.replica_id_in_sync_group, c.num_replicas_in_sync)
    });
    assert_eq!(v.0, [(0, 2), (1, 2)]);
}

/// Prefetched, a dataset's steps are the same, made by a thread at most the buffer ahead; on
/// the replicas' devices (host memory for CPU replicas) each batch keeps its shape; an error
/// and a panic of the dataset reach the caller in their place.
#[test]
fn prefetched_datasets_run_their_buffer_ahead_and_place_on_the_replicas() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tutti::strategy::{AutoShardPolicy as P, Dataset};
    let s = Strategy::mirrored(&logical_cpus(2).unwrap(), None).unwrap();
    let plain = ids_of(
        s.experimental_distribute_dataset(global_batches(), P::Data)
            .unwrap(),
    );
    let ahead = s
        .experimental_distribute_dataset(global_batches(), P::Data)
        .unwrap()
        .prefetch(2)
        .unwrap();
    assert_eq!(ids_of(ahead), plain);
    // At most the buffer ahead: 2 global batches read before any step is taken, then one
    // more for each step taken.
    let pulled = Arc::new(AtomicUsize::new(0));
    let counted = {
        let pulled = pulled.clone();
        (0..25).step_by(8).map(move |i| {
            pulled.fetch_add(1, Ordering::SeqCst);
            examples(i..(i + 8).min(25))
        })
    };
    let settle = |want: usize| {
        let t = Instant::now();
        while pulled.load(Ordering::SeqCst) < want && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(pulled.load(Ordering::SeqCst), want, "batches read ahead");
    };
    let mut ds = s
        .experimental_distribute_dataset(Dataset::from_batches(counted), P::Data)
        .unwrap()
        .prefetch(2)
        .unwrap();
    settle(2);
    ds.next().unwrap().unwrap();
    settle(3);
    assert_eq!(ds.count(), 3);
    // On the devices: each replica's rows, as tensors of the same shapes.
    let placed: Vec<_> = s
        .experimental_distribute_dataset(global_batches(), P::Data)
        .unwrap()
        .to_devices(&s, 1)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(placed.len(), plain.len());
    for (step, ids) in placed.iter().zip(&plain) {
        for ((x, y), ids) in step.0.iter().zip(ids) {
            assert_eq!(
                (x.shape.clone(), y.shape.clone()),
                (vec![ids.len(), 2], vec![ids.len()])
            );
            assert_eq!(x.tensor.kind(), tutti::DeviceKind::Cpu);
            let firsts: Vec<usize> = x
                .tensor
                .to_vec::<f32>()
                .unwrap()
                .chunks(2)
                .map(|r| r[0] as usize)
                .collect();
            assert_eq!(&firsts, ids);
        }
    }
    assert_eq!(
        s.place_on_replica(1, &[1.5f32])
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        [1.5]
    );
    let e = s.place_on_replica(2, &[1.5f32]).unwrap_err().to_string();
    assert!(e.contains("no local replica 2: the strategy has 2"), "{e}");
    let one = Strategy::default_strategy();
    let e = s
        .experimental_distribute_dataset(global_batches(), P::Data)
        .unwrap()
        .to_devices(&one, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("cut for 2 local replicas, the strategy has 1"),
        "{e}"
    );
    let e = s
        .experimental_distribute_dataset(global_batches(), P::Data)
        .unwrap()
        .prefetch(0)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("at least 1"), "{e}");
    // A file that fails to read: the batches before it, its error, then nothing.
    let files = (0..5).map(|k| PathBuf::from(format!("part-{k}"))).collect();
    let failing = tutti::strategy::FileDataset::new(files, 5, |p| {
        let k: usize = p.to_str().unwrap()[5..].parse().unwrap();
        if k == 2 {
            return Err(Error::config("disk on fire"));
        }
        Ok(examples(5 * k..5 * k + 5))
    })
    .unwrap();
    let got: Vec<_> = s
        .experimental_distribute_dataset(Dataset::Files(failing), P::Data)
        .unwrap()
        .prefetch(3)
        .unwrap()
        .collect();
    assert_eq!(got.len(), 3);
    assert!(got[..2].iter().all(Result::is_ok));
    let e = got[2].as_ref().unwrap_err().to_string();
    assert!(e.contains("reading part-2: disk on fire"), "{e}");
    // A panic of the dataset's iterator is the caller's, at its place.
    let panicking = (0..3).map(|i| {
        assert!(i < 1, "batch {i} cannot be made");
        examples(0..4)
    });
    let mut ds = s
        .experimental_distribute_dataset(Dataset::from_batches(panicking), P::Data)
        .unwrap()
        .prefetch(2)
        .unwrap();
    assert!(ds.next().unwrap().is_ok());
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ds.next())).unwrap_err();
    let text = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(text.contains("batch 1 cannot be made"), "{text}");
}

/// Two workers of two replicas each: under DATA, FILE, AUTO and from a function the job sees
/// each example once per epoch; under OFF each worker sees every one.
#[test]
fn every_auto_shard_policy_sees_each_example_once_across_workers() {
    use tutti::strategy::AutoShardPolicy as P;
    let per_worker = on_two_workers(2, |_, strategy| {
        let flat = |d: Vec<Vec<Vec<usize>>>| -> Vec<usize> {
            let mut v: Vec<usize> = d.into_iter().flatten().flatten().collect();
            v.sort();
            v
        };
        let mut out = Vec::new();
        for policy in [P::Auto, P::Data, P::Off] {
            let ds = strategy.experimental_distribute_dataset(global_batches(), policy)?;
            out.push(flat(ids_of(ds)));
        }
        for policy in [P::File, P::Auto] {
            let ds = strategy.experimental_distribute_dataset(five_files(), policy)?;
            out.push(flat(ids_of(ds)));
        }
        out.push(flat(ids_of(strategy.distribute_datasets_from_function(
            |ctx| {
                let k = ctx.get_per_replica_batch_size(8).unwrap();
                let mine: Vec<usize> = (0..25)
                    .filter(|i| i % ctx.num_input_pipelines == ctx.input_pipeline_id)
                    .collect();
                // Each of this pipeline's examples (every other one), k a batch.
                mine.chunks(k)
                    .map(|c| {
                        let x = c.iter().flat_map(|&i| [i as f32, 0.0]).collect();
                        let y = c.iter().map(|&i| i as i64).collect();
                        (
                            Tensor::new(x, vec![c.len(), 2]).unwrap(),
                            Tensor::new(y, vec![c.len()]).unwrap(),
                        )
                    })
                    .collect::<Vec<_>>()
            },
        ))));
        let ids =
            strategy.experimental_distribute_values_from_function(|c| c.replica_id_in_sync_group);
        out.push(ids.0);
        Ok(out)
    });
    let everything: Vec<usize> = (0..25).collect();
    for (k, name) in ["AUTO", "DATA", "OFF", "FILE", "AUTO (files)", "function"]
        .iter()
        .enumerate()
    {
        let (a, b) = (&per_worker[0][k], &per_worker[1][k]);
        if *name == "OFF" {
            assert_eq!((a, b), (&everything, &everything), "{name}");
            continue;
        }
        assert!(!a.is_empty() && !b.is_empty(), "{name}: {a:?} {b:?}");
        let mut both = [a.clone(), b.clone()].concat();
        both.sort();
        assert_eq!(both, everything, "{name}: {a:?} {b:?}");
    }
    assert_eq!(per_worker[0][6], [0, 1]);
    assert_eq!(per_worker[1][6], [2, 3]);
}

/// Linear regression with `optimizer` on `strategy`: each replica's gradient of its shard,
/// scaled by the global batch, summed by `apply_gradients`; the weights and the metric's mean
/// squared error over every step.
fn fit(strategy: &Strategy, rule: tutti::strategy::Rule, steps: usize) -> (Vec<f32>, u64, f64) {
    use tutti::strategy::{compute_average_loss, Mean, Optimizer};
    let n = 24;
    let rows: Vec<f32> = (0..n)
        .flat_map(|i| {
            let (a, b) = ((i as f32 * 0.37).sin(), (i as f32 * 0.73).cos());
            [a, b, 0.5 * a - b + 0.25]
        })
        .collect();
    let shards = strategy.distribute_batch(&rows, 3).unwrap();
    let w = strategy.mirrored_variable(&[0f32; 3]).unwrap();
    let opt = Optimizer::new(rule).unwrap();
    let mse = Mean::new(strategy);
    for _ in 0..steps {
        strategy
            .run(|ctx| {
                let wv = w.read_in(ctx);
                let mut g = [0f32; 3];
                let mut errs = Vec::new();
                for r in shards.0[ctx.local_replica_id()].chunks(3) {
                    let e = wv[0] * r[0] + wv[1] * r[1] + wv[2] - r[2];
                    g[0] += 2.0 * e * r[0] / n as f32;
                    g[1] += 2.0 * e * r[1] / n as f32;
                    g[2] += 2.0 * e / n as f32;
                    errs.push(e * e);
                }
                mse.update_state(ctx, &errs);
                compute_average_loss(&errs, n)?;
                opt.apply_gradients(ctx, &[(&g, &w)])
            })
            .unwrap();
    }
    assert!(w.in_sync());
    (w.value(), opt.iterations(), mse.result(strategy).unwrap())
}

#[test]
fn optimizers_train_every_copy_to_the_one_replica_weights() {
    use tutti::strategy::Rule;
    let rules = [
        Rule::Sgd {
            learning_rate: 0.1,
            momentum: 0.0,
            nesterov: false,
        },
        Rule::Sgd {
            learning_rate: 0.05,
            momentum: 0.9,
            nesterov: true,
        },
        Rule::Adam {
            learning_rate: 0.05,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-7,
        },
    ];
    let one = Strategy::default_strategy();
    let three = Strategy::mirrored(&logical_cpus(3).unwrap(), None).unwrap();
    for rule in rules {
        let (reference, _, ref_mse) = fit(&one, rule, 30);
        let (w, iterations, mse) = fit(&three, rule, 30);
        assert_eq!(iterations, 30, "{rule:?}");
        for (a, b) in w.iter().zip(&reference) {
            assert!((a - b).abs() < 1e-5, "{rule:?}: {w:?} vs {reference:?}");
        }
        assert!(
            (mse - ref_mse).abs() < 1e-5 * ref_mse.max(1.0),
            "{mse} vs {ref_mse}"
        );
    }
    // The model is learnt: Adam's weights near (0.5, -1, 0.25) after enough steps.
    let (w, _, _) = fit(&three, rules[2], 400);
    assert!(
        (w[0] - 0.5).abs() < 0.05 && (w[1] + 1.0).abs() < 0.05,
        "{w:?}"
    );
    assert!(tutti::strategy::Optimizer::sgd(-0.5).is_err());
    assert!(tutti::strategy::Optimizer::sgd(f32::INFINITY).is_err());
    assert!(tutti::strategy::compute_average_loss(&[1.0], 0).is_err());
}

/// A learning rate set between steps, or a schedule of the step count, steps every kind of
/// variable at the step's rate, every copy alike, however far apart the replicas run (a replica
/// begins its next step before replica 0 has counted the last); a rate of 0 steps nothing; a
/// rate that is negative or not finite is an error of its step that leaves the variables as
/// they were.
#[test]
fn a_learning_rate_set_between_steps_or_scheduled_steps_every_kind_of_variable() {
    use tutti::strategy::Optimizer;
    let s = Strategy::mirrored(&logical_cpus(3).unwrap(), None).unwrap();
    let h = s.mirrored_variable(&[1.0f32; 2]).unwrap();
    let d = s.device_variable(&[1.0f32; 2]).unwrap();
    let opt = Optimizer::sgd(0.1).unwrap();
    // Each replica's gradient is 1: the sum, 3. Two steps a run, and replica 2 slower.
    let step = || {
        s.run(|ctx| {
            if ctx.local_replica_id() == 2 {
                std::thread::sleep(Duration::from_millis(2));
            }
            opt.apply_gradients(ctx, &[(&[1.0f32; 2], &h)])?;
            opt.apply_device_gradients(ctx, &mut [(&mut ctx.place(&[1.0f32; 2])?, &d)])
        })
    };
    // The rate halves at every step.
    opt.set_schedule(|t| 0.1 * 0.5f32.powi(t as i32));
    assert_eq!(opt.learning_rate(), 0.1);
    for _ in 0..2 {
        step().unwrap();
    }
    assert_eq!(opt.iterations(), 4);
    assert_eq!(opt.learning_rate(), 0.1 * 0.5f32.powi(4));
    // The mirrored variable took steps 0 and 2, the device variable 1 and 3.
    let (want_h, want_d) = (1.0 - 3.0 * (0.1 + 0.025), 1.0 - 3.0 * (0.05 + 0.0125));
    let close = |want_h: f32, want_d: f32, what: &str| {
        assert!(
            h.in_sync() && d.in_sync().unwrap(),
            "{what}: the copies differ"
        );
        for (w, want) in h.value().into_iter().zip([want_h; 2]) {
            assert!((w - want).abs() < 1e-6, "{what}: {w}, not {want}");
        }
        for (w, want) in d.value().unwrap().into_iter().zip([want_d; 2]) {
            assert!((w - want).abs() < 1e-6, "{what}: {w}, not {want}");
        }
    };
    close(want_h, want_d, "2 runs of a schedule");
    opt.set_learning_rate(0.2).unwrap();
    step().unwrap();
    let (want_h, want_d) = (want_h - 0.6, want_d - 0.6);
    close(want_h, want_d, "a step at 0.2");
    // 0 (a warm-up's first rate) steps nothing.
    opt.set_schedule(|t| if t == 6 { 0.0 } else { 0.1 });
    step().unwrap();
    close(want_h, want_d - 0.3, "steps at 0 and 0.1");
    let want_d = want_d - 0.3;
    let e = opt.set_learning_rate(-1.0).unwrap_err().to_string();
    assert!(
        e.contains("learning rate -1 must be finite and not negative"),
        "{e}"
    );
    // A schedule's rate that is not finite fails its step, naming it, on every replica.
    opt.set_schedule(|t| if t == 8 { f32::NAN } else { 0.1 });
    let e = step().unwrap_err().to_string();
    assert!(
        e.contains("apply_gradients: step 8 of the optimizer: learning rate NaN must be finite"),
        "{e}"
    );
    assert_eq!(opt.iterations(), 8);
    close(want_h, want_d, "a failed step");
}

/// The optimizer steps f64 and bf16 variables too (bf16 in f32 arithmetic), every copy alike.
#[test]
fn optimizers_step_f64_and_bf16_variables() {
    use half::bf16;
    use tutti::strategy::{Optimizer, Rule};
    let three = Strategy::mirrored(&logical_cpus(3).unwrap(), None).unwrap();
    let w = three.mirrored_variable(&[0f64; 2]).unwrap();
    let h = three.mirrored_variable(&[bf16::ZERO; 2]).unwrap();
    let opt = Optimizer::new(Rule::Sgd {
        learning_rate: 0.1,
        momentum: 0.9,
        nesterov: false,
    })
    .unwrap();
    for _ in 0..4 {
        three
            .run(|ctx| {
                // Summed over the three replicas: 1.5 for each.
                opt.apply_gradients(ctx, &[(&[0.5f64; 2], &w)])?;
                opt.apply_gradients(ctx, &[(&[bf16::from_f32(0.5); 2], &h)])
            })
            .unwrap();
    }
    assert!(w.in_sync() && h.in_sync());
    // v = -0.15, -0.285, -0.4065, -0.51585: their sum (the hyper-parameters are f32s).
    for x in w.value() {
        assert!((x + 1.35735).abs() < 1e-7, "{x}");
    }
    for x in h.value() {
        assert!((x.to_f32() + 1.35735).abs() < 0.02, "{x}");
    }
}

/// An optimizer's state goes into a checkpoint beside the variables: 20 steps, save, a new
/// variable and optimizer restored from it, 20 more land where 40 uninterrupted steps do, bit
/// for bit; restoring the variables alone does not (Adam starts its moments and step count
/// afresh).
#[test]
fn optimizer_state_is_saved_and_restored_with_the_variables() {
    use tutti::strategy::{Checkpoint, MirroredVariable, Optimizer, Rule};
    let three = Strategy::mirrored(&logical_cpus(3).unwrap(), None).unwrap();
    let adam = Rule::Adam {
        learning_rate: 0.05,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-7,
    };
    let steps = |w: &MirroredVariable<f64>, opt: &Optimizer, n: usize| {
        for _ in 0..n {
            three
                .run(|ctx| {
                    let v = w.read_in(ctx);
                    let g = [v[0] - 1.0, 2.0 * v[1] + 0.5];
                    opt.apply_gradients(ctx, &[(&g, w)])
                })
                .unwrap();
        }
    };
    let w = three.mirrored_variable(&[0f64; 2]).unwrap();
    let opt = Optimizer::new(adam).unwrap();
    steps(&w, &opt, 40);
    let reference = w.value();

    let w = three.mirrored_variable(&[0f64; 2]).unwrap();
    let opt = Optimizer::new(adam).unwrap();
    steps(&w, &opt, 20);
    let mut ckpt = Checkpoint::new(20);
    ckpt.insert("w", &tutti::strategy::Tensor::vector(w.value()))
        .unwrap();
    opt.save(&mut ckpt, "optimizer", &[("w", &w)]).unwrap();
    let names: Vec<&str> = ckpt.names().collect();
    assert_eq!(
        names,
        [
            "w",
            "optimizer/iterations",
            "optimizer/w/m",
            "optimizer/w/v",
            "optimizer/w/t"
        ]
    );
    // Through the file format.
    let ckpt = Checkpoint::from_bytes(&ckpt.to_bytes().unwrap(), "test").unwrap();

    let resume = |with_optimizer: bool| {
        let w = three
            .mirrored_variable(&ckpt.get::<f64>("w").unwrap().data)
            .unwrap();
        let opt = Optimizer::new(adam).unwrap();
        if with_optimizer {
            opt.restore(&ckpt, "optimizer", &[("w", &w)]).unwrap();
            assert_eq!(opt.iterations(), 20);
        }
        steps(&w, &opt, 20);
        assert!(w.in_sync());
        w.value()
    };
    assert_eq!(resume(true), reference);
    assert_ne!(resume(false), reference);

    // A state another rule saved, or another variable's length, is refused, naming it.
    let sgd = Optimizer::new(Rule::Sgd {
        learning_rate: 0.1,
        momentum: 0.9,
        nesterov: false,
    })
    .unwrap();
    let e = sgd
        .restore(&ckpt, "optimizer", &[("w", &w)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("optimizer/w/momentum"), "{e}");
    let long = three.mirrored_variable(&[0f64; 3]).unwrap();
    let e = opt
        .restore(&ckpt, "optimizer", &[("w", &long)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("optimizer/w/m: 2 elements, for a variable of 3"),
        "{e}"
    );
    let f32w = three.mirrored_variable(&[0f32; 2]).unwrap();
    let e = opt
        .restore(&ckpt, "optimizer", &[("w", &f32w)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("saved as f64, read as f32"), "{e}");
    // A checkpoint with no state of the optimizer at all: it starts afresh (a warning), as
    // Python's Checkpoint and TensorFlow's restore do.
    let bare = Checkpoint::new(ckpt.step());
    sgd.restore(&bare, "optimizer", &[("w", &w)]).unwrap();
    assert_eq!(sgd.iterations(), 0);
}

/// `--device gpu` trains on the GPUs where tutti sees them, and where it does not says so.
#[test]
fn the_example_puts_its_replicas_on_the_device_asked_for() {
    let t = train();
    let (ok, out, err) = bounded(
        Command::new(&t).args([
            "--device",
            "gpu",
            "--replicas",
            "1",
            "--steps",
            "20",
            "--json",
        ]),
        Duration::from_secs(120),
    );
    if ok {
        let j = last_json(&out);
        assert_eq!(j["device"], "gpu");
        assert!(max_diff(&j) < 1e-5, "{j}");
    } else {
        assert!(err.contains("--device gpu not available"), "{err}");
    }
    // Built without the xla feature: XLA devices are not available, saying why; the
    // strategies whose variables live in host memory have no XLA form in any build.
    let (ok, _, err) = bounded(
        Command::new(&t).args(["--device", "xla", "--strategy", "central-storage"]),
        Duration::from_secs(60),
    );
    assert!(
        !ok && err.contains("--device xla not available") && err.contains("--features xla"),
        "{err}"
    );
    let (ok, _, err) = bounded(
        Command::new(&t).args(["--device", "xla", "--strategy", "parameter-server"]),
        Duration::from_secs(60),
    );
    assert!(
        !ok && err.contains("keeps its variables in host memory"),
        "{err}"
    );
    let j = last_json(&run_ok(Command::new(&t).args(["--steps", "5", "--json"])));
    assert_eq!(j["device"], "cpu");
}

/// `strategy.scope()`: code that makes variables without knowing the strategy (a model's
/// constructor) makes the scope's kind; outside any scope, the default strategy's; a second
/// strategy's scope cannot be entered inside a first's; a scope is its thread's.
#[test]
fn a_scope_makes_its_strategys_variables() {
    use std::sync::Arc;
    use tutti::strategy::{current_strategy, Aggregation, PerReplica, Variable};
    fn model() -> tutti::Result<Variable<f32>> {
        Variable::with_aggregation(&[0.0; 2], Aggregation::Mean)
    }
    let plain = Variable::new(&[1.0f32, 2.0]).unwrap();
    assert!(current_strategy().is_none());
    assert_eq!(plain.as_mirrored().unwrap().value(), [1.0, 2.0]);
    let mirrored = Arc::new(Strategy::mirrored(&logical_cpus(3).unwrap(), None).unwrap());
    let central = Arc::new(Strategy::central_storage(&logical_cpus(2).unwrap()).unwrap());
    {
        let _scope = mirrored.scope().unwrap();
        assert!(Arc::ptr_eq(&current_strategy().unwrap(), &mirrored));
        let w = model().unwrap();
        assert_eq!(w.as_mirrored().unwrap().read(2), [0.0, 0.0]);
        // The mean of the replicas' updates, on every copy.
        let updates = PerReplica(vec![vec![1.0; 2], vec![2.0; 2], vec![3.0; 2]]);
        w.assign_add(&mirrored, &updates).unwrap();
        assert_eq!(w.value().unwrap(), [2.0, 2.0]);
        assert!(w.as_mirrored().unwrap().in_sync());
        {
            let _again = mirrored.scope().unwrap();
        }
        let e = central.scope().err().unwrap().to_string();
        assert!(
            e.contains("inside a MirroredStrategy's scope")
                && e.contains("a CentralStorageStrategy's cannot"),
            "{e}"
        );
        assert!(Arc::ptr_eq(&current_strategy().unwrap(), &mirrored));
    }
    assert!(current_strategy().is_none());
    {
        let _scope = central.scope().unwrap();
        let w = model().unwrap();
        assert!(w.as_central().is_some() && w.as_mirrored().is_none());
        w.assign_add(&central, &PerReplica(vec![vec![1.0; 2], vec![3.0; 2]]))
            .unwrap();
        assert_eq!(w.value().unwrap(), [2.0, 2.0]);
    }
    // A variable of one copy updated through three replicas: an error, not a panic.
    let e = plain
        .assign_add(&mirrored, &PerReplica(vec![vec![1.0; 2]]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("1 copies, updated through a strategy of 3"),
        "{e}"
    );
    let _scope = mirrored.scope().unwrap();
    // Variables are made outside run.
    let e = mirrored
        .run(|_| Variable::new(&[0.0f32]).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside run"), "{e}");
    std::thread::spawn(|| assert!(current_strategy().is_none()))
        .join()
        .unwrap();
}

/// A ParameterServerStrategy's scope on the chief: a model's variables, made by code that does
/// not know the strategy, live on the ps tasks, sharded by the partitioner; a scheduled step
/// reads them by their index and its gradient steps them; the chief reads, sets and steps them
/// through the variable; a second strategy's scope cannot be entered inside it.
#[test]
fn a_coordinators_scope_makes_variables_on_the_parameter_servers() {
    use std::sync::Arc;
    use tutti::strategy::ps::{ParameterServerStrategy, Partitioner, Role, StepContext, Values};
    use tutti::strategy::{current_coordinator, current_strategy, Aggregation, Variable};
    fn model() -> tutti::Result<(Variable<f32>, Variable<f64>)> {
        Ok((
            Variable::with_aggregation(&[1.0, 2.0, 3.0, 4.0], Aggregation::Sum)?,
            Variable::new(&[0.5])?,
        ))
    }
    let addrs = free_addrs(4);
    let cluster = serde_json::json!({
        "chief": [addrs[0]], "worker": [addrs[1]], "ps": [addrs[2], addrs[3]]
    });
    let task = |ty: &str, i: usize| {
        ParameterServerStrategy::new(spec_of(&cluster, ty, i), Partitioner::FixedShards(2))
            .unwrap()
            .with_timeout(Duration::from_secs(20))
    };
    // Each step: w's gradient is 1 everywhere, b's is half of b; the loss is w[3] as pulled.
    let step_fn = |ctx: &StepContext| {
        let v = ctx.variables();
        let w = v[0].get::<f32>().unwrap();
        let b = v[1].get::<f64>().unwrap();
        let half: Vec<f64> = b.iter().map(|x| x / 2.0).collect();
        Ok((vec![vec![1.0f32; w.len()].into(), half.into()], w[3]))
    };
    std::thread::scope(|s| {
        let servers: Vec<_> = [("ps", 0), ("ps", 1), ("worker", 0)]
            .into_iter()
            .map(|(ty, i)| {
                let t = task(ty, i);
                s.spawn(move || t.run_role(step_fn).map(|r| matches!(r, Role::Done)))
            })
            .collect();
        let Role::Chief(coord) = task("chief", 0).run_role(step_fn).unwrap() else {
            panic!("the chief got no coordinator")
        };
        let coord = Arc::new(coord);
        let (w, b) = {
            let scope = coord.scope().unwrap();
            assert!(Arc::ptr_eq(scope.coordinator().unwrap(), &coord));
            assert!(scope.strategy().is_none() && current_strategy().is_none());
            assert!(Arc::ptr_eq(&current_coordinator().unwrap(), &coord));
            {
                let _again = coord.scope().unwrap();
            }
            let mirrored = Arc::new(Strategy::mirrored(&logical_cpus(2).unwrap(), None).unwrap());
            let e = mirrored.scope().err().unwrap().to_string();
            assert!(
                e.contains("inside a ParameterServerStrategy's scope")
                    && e.contains("a MirroredStrategy's cannot"),
                "{e}"
            );
            let e = Variable::new(&[1i32]).err().unwrap().to_string();
            assert!(e.contains("floats (f32, f64, f16, bf16), not i32"), "{e}");
            model().unwrap()
        };
        assert!(current_coordinator().is_none());
        let (ws, bs) = (w.as_sharded().unwrap(), b.as_sharded().unwrap());
        assert!(w.as_mirrored().is_none() && w.as_central().is_none());
        assert_eq!(w.aggregation(), Aggregation::Sum);
        // The i32 variable was refused before it was made: w and b are the job's first two.
        assert_eq!((ws.id().index(), bs.id().index()), (0, 1));
        assert_eq!(coord.shards(), [2, 1]);
        assert_eq!((ws.shards(), w.len()), (2, 4));
        assert_eq!(w.value().unwrap(), [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(coord.read_values(bs.id()).unwrap(), Values::F64(vec![0.5]));
        // Three steps: w -= 1 each, b halves each.
        assert_eq!(coord.run_steps(3).unwrap(), [4.0, 3.0, 2.0]);
        assert_eq!(w.value().unwrap(), [-2.0, -1.0, 0.0, 1.0]);
        assert_eq!(b.value().unwrap(), [0.0625]);
        // From the chief: set, then step it as the workers' steps do.
        ws.assign(&[10.0, 20.0, 30.0, 40.0]).unwrap();
        ws.assign_add(&[1.0, -1.0, 0.5, 0.0]).unwrap();
        ws.assign_sub(&[1.0, 1.0, 1.0, 1.0]).unwrap();
        assert_eq!(w.value().unwrap(), [10.0, 18.0, 29.5, 39.0]);
        let e = ws.assign(&[1.0]).unwrap_err().to_string();
        assert!(e.contains("1 elements for variable 0 of 4"), "{e}");
        let mirrored = Strategy::mirrored(&logical_cpus(2).unwrap(), None).unwrap();
        let e = w
            .assign_add(
                &mirrored,
                &tutti::strategy::PerReplica(vec![vec![0.0; 4]; 2]),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("lives on the parameter servers"), "{e}");
        coord.shutdown().unwrap();
        for h in servers {
            assert!(h.join().unwrap().unwrap());
        }
        // The job is over: reading fails, naming the ps task, and does not hang.
        let e = w.value().unwrap_err().to_string();
        assert!(e.contains("ps task"), "{e}");
    });
}

/// Keras's optimizers step CentralStorageStrategy's one copy: the replicas' gradients summed
/// onto it and one step taken, as a mirrored variable's copies step; the slots save and
/// restore in the same names, and a run from the restored state goes on identically.
#[test]
fn optimizers_step_central_variables_as_mirrored_ones() {
    use tutti::strategy::{Checkpoint, Optimizer};
    let devices = logical_cpus(3).unwrap();
    let central = Strategy::central_storage(&devices).unwrap();
    let mirrored = Strategy::mirrored(&devices, None).unwrap();
    let init = [1.0f32, -2.0, 0.5];
    let (cv, mv) = (
        central.central_variable(&init).unwrap(),
        mirrored.mirrored_variable(&init).unwrap(),
    );
    let grad = |id: usize, k: usize| [id as f32 - 1.5, k as f32, 0.25 * id as f32];
    let (oc, om) = (Optimizer::adam(0.1).unwrap(), Optimizer::adam(0.1).unwrap());
    let step_central = |o: &Optimizer, k: usize| {
        let g = PerReplica((0..3).map(|id| grad(id, k).to_vec()).collect());
        o.apply_central_gradients(&central, &[(&g, &cv)])
    };
    for k in 0..3 {
        step_central(&oc, k).unwrap();
        mirrored
            .run(|ctx| {
                om.apply_gradients(ctx, &[(&grad(ctx.replica_id_in_sync_group(), k)[..], &mv)])
            })
            .unwrap();
    }
    assert_eq!(cv.value(), mv.value());
    assert_ne!(cv.value(), init);
    assert_eq!(oc.iterations(), 3);
    let (mut saved, mut want) = (Checkpoint::new(3), Checkpoint::new(3));
    oc.save_central(&mut saved, "adam", &[("w", &cv)]).unwrap();
    om.save(&mut want, "adam", &[("w", &mv)]).unwrap();
    assert_eq!(saved.to_bytes().unwrap(), want.to_bytes().unwrap());

    // A fresh optimizer restored from the checkpoint takes the next step as the first would.
    let restored = Optimizer::adam(0.1).unwrap();
    restored
        .restore_central(&saved, "adam", &[("w", &cv)])
        .unwrap();
    assert_eq!(restored.iterations(), 3);
    let before = cv.value();
    step_central(&restored, 3).unwrap();
    let after_restored = cv.value();
    cv_set(&central, &cv, &before);
    step_central(&oc, 3).unwrap();
    assert_eq!(cv.value(), after_restored);

    // Wrong shapes: errors naming them, the variable untouched.
    let before = cv.value();
    let two = PerReplica(vec![vec![1.0f32; 3]; 2]);
    let e = oc
        .apply_central_gradients(&central, &[(&two, &cv)])
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("2 per-replica values, the strategy 3"),
        "{e}"
    );
    let short = PerReplica(vec![vec![1.0f32; 3], vec![1.0; 2], vec![1.0; 3]]);
    let e = oc
        .apply_central_gradients(&central, &[(&short, &cv)])
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("gradient 0 of replica 1 holds 2 elements"),
        "{e}"
    );
    assert_eq!(cv.value(), before);
}

/// Set a central variable to `value` (through its public updates).
fn cv_set(s: &Strategy, v: &tutti::strategy::CentralVariable<f32>, value: &[f32]) {
    let per = PerReplica(vec![value.to_vec(); s.num_local_replicas()]);
    v.assign(s, &per, Aggregation::OnlyFirstReplica).unwrap();
}
