//! TPUStrategy on XLA devices: with the CPU PJRT plugin and 4 devices (set TUTTI_PJRT_PLUGIN;
//! `.ci/run` does), the training example reaches the reference weights, and the replica
//! context's collectives run as compiled programs. Skips, saying why, without a plugin, unless
//! TUTTI_REQUIRE_XLA=1.
#![cfg(feature = "xla")]

mod common;

use std::process::Command;

use tutti::strategy::{Strategy, StrategyKind};
use tutti::xla::{Client, ClientOptions};
use tutti::ReduceOp;

fn client() -> Option<Client> {
    let opts = ClientOptions::parse("cpu_device_count=4").unwrap();
    match Client::discover(&opts) {
        Ok(c) => Some(c),
        Err(e) if std::env::var("TUTTI_REQUIRE_XLA").as_deref() == Ok("1") => {
            panic!("no XLA plugin: {e}")
        }
        Err(e) => {
            println!("SKIPPED: no XLA plugin ({e})");
            None
        }
    }
}

#[test]
fn tpu_strategy_collectives_and_training() {
    let Some(c) = client() else { return };
    let n = c.devices().len();
    let before = c.cache_stats();
    let s = Strategy::tpu(c.clone()).unwrap();
    assert_eq!(s.kind(), StrategyKind::Tpu);
    assert_eq!(s.num_replicas_in_sync(), n);
    for round in 0..3 {
        let out = s
            .run(|ctx| {
                let id = ctx.replica_id_in_sync_group() as f32;
                let mut v = vec![id, 1.0, id * id + round as f32];
                ctx.all_reduce(ReduceOp::Sum, &mut v)?;
                let mut b = [id * 3.0];
                ctx.broadcast(&mut b, n - 1)?;
                Ok((v, b[0]))
            })
            .unwrap();
        let ids: f32 = (0..n).map(|i| i as f32).sum();
        let sq: f32 = (0..n).map(|i| (i * i) as f32).sum::<f32>() + (round * n) as f32;
        for (v, b) in out.local_results() {
            assert_eq!(v, &vec![ids, n as f32, sq]);
            assert_eq!(*b, (n - 1) as f32 * 3.0);
        }
    }
    let after = c.cache_stats();
    assert!(
        after.compiled + after.hits > before.compiled + before.hits
            && after.staged_calls == before.staged_calls,
        "the collectives compiled XLA programs: {after:?}"
    );

    // The training example on TPUStrategy lands on the reference weights.
    let train = common::example("train", &["xla"]);
    let run = |args: &[&str]| -> serde_json::Value {
        let out = Command::new(&train)
            .args(args)
            .arg("--json")
            .env("TUTTI_PJRT_OPTIONS", "cpu_device_count=4")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    let j = run(&["--strategy", "tpu", "--steps", "40"]);
    assert_eq!(j["replicas"], 4);
    assert_eq!(j["device"], "xla");
    // The weights live on the devices and every collective runs there.
    assert_eq!(j["xla_host_calls"], 0, "{j}");
    let w = j["weights"].as_array().unwrap();
    let r = j["reference_weights"].as_array().unwrap();
    for (a, b) in w.iter().zip(r) {
        assert!(
            (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4,
            "{j}"
        );
    }

    // Every other strategy of local devices on the 4 XLA devices lands there too; all but
    // CentralStorageStrategy (its variable in host memory) keep every collective on them.
    for strategy in ["mirrored", "one-device", "central-storage", "multi-worker"] {
        let k = run(&[
            "--strategy",
            strategy,
            "--device",
            "xla",
            "--replicas",
            "4",
            "--steps",
            "40",
        ]);
        assert_eq!(k["replicas"], if strategy == "one-device" { 1 } else { 4 });
        let host_calls = k["xla_host_calls"].as_u64().unwrap();
        assert_eq!(host_calls == 0, strategy != "central-storage", "{k}");
        for (a, b) in k["weights"].as_array().unwrap().iter().zip(r) {
            assert!(
                (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4,
                "{k}"
            );
        }
    }

    // MultiWorkerMirroredStrategy across two processes, each on two of its own XLA devices
    // (`tutti launch`): 4 replicas in sync, both workers at the reference weights, alike.
    let mut job = Command::new(common::tutti_bin())
        .args(["launch", "-n", "2", "--"])
        .arg(&train)
        .args(["--strategy", "multi-worker", "--device", "xla"])
        .args(["--replicas", "2", "--steps", "40", "--json"])
        .env("TUTTI_PJRT_OPTIONS", "cpu_device_count=4")
        .env("TUTTI_TIMEOUT", "60")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    while job.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = job.kill();
            panic!("two multi-worker processes on XLA devices did not end within 300 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let out = job.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let workers: Vec<serde_json::Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(workers.len(), 2, "{stdout}");
    for k in &workers {
        assert_eq!(
            (k["replicas"].as_u64(), k["device"].as_str()),
            (Some(4), Some("xla")),
            "{k}"
        );
        assert_eq!(
            k["weights"], workers[0]["weights"],
            "the workers differ: {stdout}"
        );
        for (a, b) in k["weights"].as_array().unwrap().iter().zip(r) {
            assert!(
                (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4,
                "{k}"
            );
        }
    }

    // MirroredStrategy on the XLA devices, 20 steps, a checkpoint, 20 more: the 40 steps'
    // weights.
    let dir = std::env::temp_dir().join(format!("tutti-xla-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_s = dir.to_str().unwrap();
    let twenty = [
        "--strategy",
        "mirrored",
        "--device",
        "xla",
        "--replicas",
        "4",
        "--steps",
        "20",
    ];
    run(&[&twenty[..], &["--checkpoint-dir", dir_s]].concat());
    let resumed = run(&[&twenty[..], &["--checkpoint-dir", dir_s, "--resume"]].concat());
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        (
            resumed["device"].as_str(),
            resumed["restored_step"].as_u64()
        ),
        (Some("xla"), Some(20))
    );
    assert_eq!(resumed["reference_weights"], j["reference_weights"]);
    assert_eq!(resumed["xla_host_calls"], 0, "{resumed}");
    for (a, b) in resumed["weights"].as_array().unwrap().iter().zip(w) {
        assert!(
            (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-6,
            "{resumed} vs {j}"
        );
    }
}

/// TPU setup as the guides write it: a resolver of this host's TPU (a remote one refused, saying
/// why), `initialize_tpu_system` reporting the topology, then TPUStrategy over its devices.
#[test]
fn tpu_setup_resolves_initializes_and_reports_the_topology() {
    use tutti::strategy::tpu::{initialize_tpu_system_with, TpuClusterResolver};
    let e = TpuClusterResolver::new("grpc://10.1.2.3:8470").unwrap_err();
    assert!(
        e.to_string()
            .contains("TPU 'grpc://10.1.2.3:8470' not available")
            && e.to_string().contains("run on the TPU VM"),
        "{e}"
    );
    let resolver = TpuClusterResolver::new("").unwrap();
    assert_eq!(resolver.master(), "local");
    if client().is_none() {
        return;
    }
    let opts = ClientOptions::parse("cpu_device_count=4").unwrap();
    let (c, topology) = initialize_tpu_system_with(&resolver, &opts).unwrap();
    assert_eq!(
        (
            topology.num_cores,
            topology.num_tasks,
            topology.num_cores_per_task
        ),
        (4, 1, 4),
        "{topology:?}"
    );
    assert_eq!(topology.platform, c.platform_name());
    let s = Strategy::tpu(c).unwrap();
    assert_eq!(s.num_replicas_in_sync(), topology.num_cores);
    // Again: a warning that it loses what the devices hold, and a working client.
    let (_, again) = initialize_tpu_system_with(&resolver, &opts).unwrap();
    assert_eq!(again, topology);
}

/// Replica values placed on their XLA devices reduce there: the collectives on tensors copy
/// nothing between host and devices (a collective on host values copies every replica's value
/// both ways), and give what the host values give.
#[test]
fn tensors_on_xla_devices_reduce_without_a_host_round_trip() {
    let Some(c) = client() else { return };
    let n = c.devices().len();
    let s = Strategy::tpu(c.clone()).unwrap();
    let len = 1000;
    let value = |id: usize, i: usize| (id * 7 + i % 13) as f32 * 0.25;

    // Place every replica's value on its device (n uploads), then reduce and broadcast there.
    let placed = s
        .run(|ctx| {
            let id = ctx.replica_id_in_sync_group();
            let v: Vec<f32> = (0..len).map(|i| value(id, i)).collect();
            ctx.place(&v)
        })
        .unwrap();
    let mut placed = placed.0;
    let before = c.cache_stats();
    let slots: Vec<std::sync::Mutex<Option<tutti::DeviceTensor>>> = placed
        .drain(..)
        .map(|t| std::sync::Mutex::new(Some(t)))
        .collect();
    let gathered = s
        .run(|ctx| {
            let mut t = slots[ctx.local_replica_id()]
                .lock()
                .unwrap()
                .take()
                .unwrap();
            assert_eq!(t.kind(), tutti::DeviceKind::Xla);
            ctx.all_reduce_tensor(ReduceOp::Sum, &mut t)?;
            ctx.all_reduce_tensor(ReduceOp::Mean, &mut t)?;
            ctx.broadcast_tensor(&mut t, n - 1)?;
            let mut g = ctx.place(&[ctx.replica_id_in_sync_group() as u8; 3])?;
            ctx.all_gather_tensor(&mut g)?;
            *slots[ctx.local_replica_id()].lock().unwrap() = Some(t);
            Ok(g)
        })
        .unwrap();
    let after = c.cache_stats();
    // n uploads: the small tensors the all-gather starts from.
    assert_eq!(
        (after.uploads, after.downloads, after.staged_calls),
        (
            before.uploads + n as u64,
            before.downloads,
            before.staged_calls
        ),
        "the collectives on tensors copied through host memory: {before:?} -> {after:?}"
    );
    assert!(after.compiled + after.hits >= before.compiled + before.hits + 4);
    let want: Vec<u8> = (0..n as u8).flat_map(|r| [r; 3]).collect();
    for g in gathered.local_results() {
        assert_eq!(g.len(), 3 * n);
        assert_eq!(g.as_xla().map(|b| b.len()), Some(3 * n));
    }
    for g in gathered.0 {
        let b = g.into_xla().unwrap();
        assert_eq!(b.to_vec::<u8>().unwrap(), want);
    }

    // The same reductions on host values: the same numbers, with copies both ways.
    let host = s
        .run(|ctx| {
            let id = ctx.replica_id_in_sync_group();
            let mut v: Vec<f32> = (0..len).map(|i| value(id, i)).collect();
            ctx.all_reduce(ReduceOp::Sum, &mut v)?;
            ctx.all_reduce(ReduceOp::Mean, &mut v)?;
            ctx.broadcast(&mut v, n - 1)?;
            Ok(v)
        })
        .unwrap();
    let staged = c.cache_stats();
    assert!(
        staged.uploads >= after.uploads + 3 * n as u64
            && staged.downloads >= after.downloads + 3 * n as u64,
        "host values are copied to the devices and back: {after:?} -> {staged:?}"
    );
    for (slot, h) in slots.iter().zip(host.local_results()) {
        let t = slot.lock().unwrap().take().unwrap();
        assert_eq!(&t.to_vec::<f32>().unwrap(), h);
    }
    let want: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|id| value(id, i)).sum::<f32>())
        .collect();
    assert_eq!(host.local_results()[0], want);

    // A replica whose value is in host memory while the others' are on their devices is an
    // argument error on every replica, before anything moves, not a misread buffer.
    let err = s
        .run(|ctx| {
            let id = ctx.replica_id_in_sync_group();
            let mut t = if id == 1 {
                tutti::DeviceTensor::from_host(&[1.0f32, 2.0])
            } else {
                ctx.place(&[1.0f32, 2.0])?
            };
            ctx.all_reduce_tensor(ReduceOp::Sum, &mut t)
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank 1 is on xla:1") && err.contains("in host memory"),
        "{err}"
    );
    // A tensor on another replica's device, or one a CPU strategy is given: errors that say so.
    let err = s
        .run(|ctx| {
            let id = ctx.replica_id_in_sync_group();
            let mut t = tutti::DeviceTensor::from(c.buffer_from_host(&[1.0f32], (id + 1) % n)?);
            ctx.all_reduce_tensor(ReduceOp::Sum, &mut t)
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("is not on rank 0's device xla:0"), "{err}");
    let cpus = Strategy::mirrored(&tutti::logical_cpus(2).unwrap(), None).unwrap();
    let err = cpus
        .run(|ctx| {
            let mut t = tutti::DeviceTensor::from(c.buffer_from_host(&[1.0f32], 0)?);
            ctx.all_reduce_tensor(ReduceOp::Sum, &mut t)
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cpu:") && err.contains("Communicator::place"),
        "{err}"
    );
    // The strategy goes on.
    let ok = s
        .run(|ctx| {
            let mut t = ctx.place(&[2i32, 3])?;
            ctx.all_reduce_tensor(ReduceOp::Max, &mut t)?;
            t.to_vec::<i32>()
        })
        .unwrap();
    assert!(ok.local_results().iter().all(|v| v == &[2, 3]));
}

/// A variable whose copies live on the XLA devices: each update in the replica context combines
/// the replicas' update tensors and applies the result to every copy in one program, with no
/// copy through host memory; the values are those of a host variable updated alike.
#[test]
fn device_variables_update_on_their_devices() {
    use tutti::strategy::Aggregation;
    let Some(c) = client() else { return };
    let n = c.devices().len();
    let s = Strategy::tpu(c.clone()).unwrap();
    let len = 257;
    let init: Vec<f32> = (0..len).map(|i| i as f32 * 0.5).collect();
    let grad = |id: usize, i: usize| ((id + 1) * (i % 5 + 1)) as f32 * 0.125;
    let v = s.device_variable(&init).unwrap();
    let h = s.mirrored_variable(&init).unwrap();
    assert_eq!(v.len(), len);
    let steps = [
        (Aggregation::Mean, 0),
        (Aggregation::Sum, 1),
        (Aggregation::OnlyFirstReplica, 0),
        (Aggregation::Mean, 2),
    ];
    // Each replica's update placed on its device once.
    let updates = s
        .run(|ctx| {
            let id = ctx.replica_id_in_sync_group();
            ctx.place(&(0..len).map(|i| grad(id, i)).collect::<Vec<f32>>())
        })
        .unwrap();
    let updates: Vec<tutti::DeviceTensor> = updates.0;
    let before = c.cache_stats();
    s.run(|ctx| {
        let u = &updates[ctx.local_replica_id()];
        for &(agg, how) in &steps {
            match how {
                0 => v.assign_add_in(ctx, u, agg)?,
                1 => v.assign_sub_in(ctx, u, agg)?,
                _ => v.assign_in(ctx, u, agg)?,
            }
        }
        for &(agg, how) in &steps[..3] {
            match how {
                0 => v.assign_add_in(ctx, u, agg)?,
                _ => v.assign_sub_in(ctx, u, agg)?,
            }
        }
        Ok(())
    })
    .unwrap();
    let after = c.cache_stats();
    assert_eq!(
        (after.uploads, after.downloads, after.staged_calls),
        (before.uploads, before.downloads, before.staged_calls),
        "the updates copied through host memory: {before:?} -> {after:?}"
    );
    // The same updates on a host variable.
    s.run(|ctx| {
        let id = ctx.replica_id_in_sync_group();
        let u: Vec<f32> = (0..len).map(|i| grad(id, i)).collect();
        for &(agg, how) in steps.iter().chain(&steps[..3]) {
            match how {
                0 => ctx.assign_add(&h, &u, agg)?,
                1 => ctx.assign_sub(&h, &u, agg)?,
                _ => ctx.assign(&h, &u, agg)?,
            }
        }
        Ok(())
    })
    .unwrap();
    assert!(v.in_sync().unwrap());
    let got = v.value().unwrap();
    let want = h.value();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "element {i}: {a} vs {b}"
        );
    }
    // By hand: after the assign (the mean of the updates), +mean -sum +first.
    let mean = |i: usize| (0..n).map(|id| grad(id, i)).sum::<f32>() / n as f32;
    let sum = |i: usize| (0..n).map(|id| grad(id, i)).sum::<f32>();
    assert!((got[3] - (mean(3) + mean(3) - sum(3) + grad(0, 3))).abs() < 1e-5);

    // From outside `run`: host updates placed once per replica.
    let ups = tutti::strategy::PerReplica((0..n).map(|r| vec![r as f32; len]).collect());
    v.assign(&s, &ups, Aggregation::Sum).unwrap();
    let total = (0..n).sum::<usize>() as f32;
    assert_eq!(v.read(n - 1).unwrap(), vec![total; len]);
    // An update of another length is an error, and the variable is unchanged.
    let err = s
        .run(|ctx| {
            let u = ctx.place(&[1.0f32; 3])?;
            v.assign_add_in(ctx, &u, Aggregation::Sum)
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("the update is"), "{err}");
    assert_eq!(v.value().unwrap(), vec![total; len]);

    // Where a plugin refuses the program, the update runs host-staged, to the same values.
    c.set_route(tutti::xla::Route::HostStaged);
    let staged = c.cache_stats().staged_calls;
    s.run(|ctx| {
        let u = ctx.place(&vec![ctx.replica_id_in_sync_group() as f32; len])?;
        v.assign_sub_in(ctx, &u, Aggregation::Sum)?;
        v.assign_add_in(ctx, &u, Aggregation::OnlyFirstReplica)
    })
    .unwrap();
    assert_eq!(c.cache_stats().staged_calls, staged + 2);
    assert_eq!(v.value().unwrap(), vec![0.0; len]);
    assert!(v.in_sync().unwrap());
}

/// The optimizers step a device variable's copies on their devices, their slots beside them,
/// to the values the host optimizer gives a mirrored variable; their state saves and restores
/// in the host optimizer's names, and a host-staged client steps to the same values.
#[test]
fn optimizers_step_device_variables_on_their_devices() {
    use tutti::strategy::{Checkpoint, Optimizer, Param, Rule};
    let Some(c) = client() else { return };
    let s = Strategy::tpu(c.clone()).unwrap();
    let n = c.devices().len();
    let rules = [
        Rule::Sgd {
            learning_rate: 0.1,
            momentum: 0.0,
            nesterov: false,
        },
        Rule::Sgd {
            learning_rate: 0.05,
            momentum: 0.9,
            nesterov: false,
        },
        Rule::Sgd {
            learning_rate: 0.05,
            momentum: 0.8,
            nesterov: true,
        },
        Rule::Adam {
            learning_rate: 0.01,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-7,
        },
    ];
    fn check<T: Param + Into<f64>>(s: &Strategy, c: &Client, rule: Rule, n: usize, tolerance: f64) {
        let len = 131;
        let init: Vec<T> = (0..len)
            .map(|i| T::from_f64(i as f64 * 0.25 - 8.0))
            .collect();
        let grad = |step: usize, id: usize, i: usize| {
            T::from_f64(((i * 7 + step * 3 + id) % 11) as f64 * 0.125 - 0.5)
        };
        let v = s.device_variable(&init).unwrap();
        let h = s.mirrored_variable(&init).unwrap();
        let (od, oh) = (Optimizer::new(rule).unwrap(), Optimizer::new(rule).unwrap());
        let step = |k: usize, v: &tutti::strategy::DeviceVariable<T>, od: &Optimizer| {
            s.run(|ctx| {
                let id = ctx.replica_id_in_sync_group();
                let g: Vec<T> = (0..len).map(|i| grad(k, id, i)).collect();
                od.apply_device_gradients(ctx, &mut [(&mut ctx.place(&g)?, v)])
            })
            .unwrap();
        };
        let host_step = |k: usize| {
            s.run(|ctx| {
                let id = ctx.replica_id_in_sync_group();
                let g: Vec<T> = (0..len).map(|i| grad(k, id, i)).collect();
                oh.apply_gradients(ctx, &[(&g, &h)])
            })
            .unwrap();
        };
        let close = |v: &tutti::strategy::DeviceVariable<T>, what: &str| {
            assert!(v.in_sync().unwrap(), "{what}: the copies diverged");
            for (i, (a, b)) in v.value().unwrap().iter().zip(h.value()).enumerate() {
                let (a, b): (f64, f64) = ((*a).into(), b.into());
                assert!(
                    (a - b).abs() <= tolerance * b.abs().max(1.0),
                    "{rule:?} {}: {what}: element {i}: {a} on the devices, {b} on the host",
                    T::DTYPE
                );
            }
        };
        step(0, &v, &od);
        host_step(0);
        // After the first step (which made the slots there), nothing but the gradients goes
        // between host and devices.
        let before = c.cache_stats();
        for k in 1..4 {
            step(k, &v, &od);
        }
        let after = c.cache_stats();
        for k in 1..4 {
            host_step(k);
        }
        assert_eq!(
            (
                after.uploads - before.uploads,
                after.downloads,
                after.staged_calls
            ),
            (3 * n as u64, before.downloads, before.staged_calls),
            "{rule:?}: the steps went through host memory: {before:?} -> {after:?}"
        );
        close(&v, "4 steps");
        assert_eq!(od.iterations(), 4);
        // Saved in the host optimizer's names: each restores the other's.
        let (mut dev_ckpt, mut host_ckpt) = (Checkpoint::new(4), Checkpoint::new(4));
        od.save_device(&mut dev_ckpt, "opt", &[("w", &v)]).unwrap();
        oh.save(&mut host_ckpt, "opt", &[("w", &h)]).unwrap();
        assert_eq!(
            dev_ckpt.names().collect::<Vec<_>>(),
            host_ckpt.names().collect::<Vec<_>>()
        );
        // The slots read back from the devices are the host optimizer's; the counts exact.
        for name in dev_ckpt.names() {
            if name.ends_with("/t") || name.ends_with("/iterations") {
                assert_eq!(
                    dev_ckpt.get::<i64>(name).unwrap().data,
                    host_ckpt.get::<i64>(name).unwrap().data,
                    "{name}"
                );
                continue;
            }
            let (a, b) = if T::DTYPE == tutti::DType::F64 {
                (
                    dev_ckpt.get::<f64>(name).unwrap().data,
                    host_ckpt.get::<f64>(name).unwrap().data,
                )
            } else {
                let f = |c: &Checkpoint| -> Vec<f64> {
                    c.get::<f32>(name)
                        .unwrap()
                        .data
                        .into_iter()
                        .map(f64::from)
                        .collect()
                };
                (f(&dev_ckpt), f(&host_ckpt))
            };
            assert!(a.iter().any(|x| *x != 0.0), "{rule:?}: {name} is all zeros");
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(
                    (x - y).abs() <= tolerance * y.abs().max(1e-3),
                    "{rule:?} {}: {name}[{i}]: {x} from the devices, {y} on the host",
                    T::DTYPE
                );
            }
        }
        let resumed = Optimizer::new(rule).unwrap();
        let v2 = s.device_variable(&v.value().unwrap()).unwrap();
        resumed
            .restore_device(&host_ckpt, "opt", &[("w", &v2)])
            .unwrap();
        assert_eq!(resumed.iterations(), 4);
        for k in 4..6 {
            step(k, &v2, &resumed);
            host_step(k);
        }
        close(&v2, "restored, 2 more steps");
        // Host-staged: the same rule, through host memory.
        c.set_route(tutti::xla::Route::HostStaged);
        let staged = c.cache_stats().staged_calls;
        step(6, &v2, &resumed);
        // Each replica's step, and the gradients' all-reduce.
        assert_eq!(c.cache_stats().staged_calls, staged + n as u64 + 1);
        host_step(6);
        c.set_route(tutti::xla::Route::Auto);
        close(&v2, "a host-staged step");
        // A learning rate that changes at every step (a schedule) runs the same program, the
        // rate uploaded beside the gradient.
        let lr0 = rule.learning_rate();
        for o in [&resumed, &oh] {
            o.set_schedule(move |t| lr0 / (1 + t) as f32);
        }
        let before = c.cache_stats();
        for k in 7..9 {
            step(k, &v2, &resumed);
        }
        let after = c.cache_stats();
        for k in 7..9 {
            host_step(k);
        }
        assert_eq!(
            (
                after.compiled - before.compiled,
                after.uploads - before.uploads,
                after.staged_calls
            ),
            (0, 2 * 2 * n as u64, before.staged_calls),
            "{rule:?}: a schedule's steps: {before:?} -> {after:?}"
        );
        assert_eq!(resumed.learning_rate(), lr0 / 10.0);
        close(&v2, "on a schedule");
    }
    for rule in rules {
        check::<f32>(&s, &c, rule, n, 1e-5);
    }
    check::<f64>(&s, &c, rules[3], n, 1e-12);
    check::<half::bf16>(&s, &c, rules[1], n, 1e-2);
    // A gradient in host memory, or of another length, is an error naming it.
    let v = s.device_variable(&[1.0f32; 4]).unwrap();
    let opt = Optimizer::sgd(0.1).unwrap();
    let err = s
        .run(|ctx| opt.apply_device_gradients(ctx, &mut [(&mut ctx.place(&[1.0f32; 3])?, &v)]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("gradient 0 is"), "{err}");
    let err = s
        .run(|ctx| {
            let mut g = tutti::DeviceTensor::from_host(&[1.0f32; 4]);
            opt.apply_device_gradients(ctx, &mut [(&mut g, &v)])
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("in host memory"), "{err}");
    assert_eq!(v.value().unwrap(), vec![1.0; 4]);
}

/// A dataset's batches placed on the replicas' devices ahead of the steps: each replica's rows
/// in a buffer on its own device, which the replica context's collectives take where it lies.
#[test]
fn datasets_prefetch_to_the_replicas_devices() {
    use tutti::strategy::{AutoShardPolicy, Dataset, Tensor};
    let Some(c) = client() else { return };
    let n = c.devices().len();
    let s = Strategy::tpu(c.clone()).unwrap();
    // 3 global batches of 2 rows a replica, 3 columns: row k holds k, k, k.
    let batches = (0..3).map(move |b| {
        let rows = 2 * n;
        let data = (0..rows * 3).map(|i| (b * rows + i / 3) as f32).collect();
        Tensor::new(data, vec![rows, 3]).unwrap()
    });
    let ds = s
        .experimental_distribute_dataset(Dataset::from_batches(batches), AutoShardPolicy::Data)
        .unwrap()
        .to_devices(&s, 2)
        .unwrap();
    let staged = c.cache_stats().staged_calls;
    for (b, step) in ds.enumerate() {
        let slots: Vec<std::sync::Mutex<Option<tutti::strategy::PlacedTensor>>> = step
            .unwrap()
            .0
            .into_iter()
            .map(|t| std::sync::Mutex::new(Some(t)))
            .collect();
        let sums = s
            .run(|ctx| {
                let me = ctx.local_replica_id();
                let mut t = slots[me].lock().unwrap().take().unwrap();
                assert_eq!(t.shape, [2, 3]);
                let on = t.tensor.as_xla().map(|x| x.device());
                assert_eq!(on, Some(me), "replica {me}'s batch is on {:?}", t.tensor);
                ctx.all_reduce_tensor(ReduceOp::Sum, &mut t.tensor)?;
                t.tensor.to_vec::<f32>()
            })
            .unwrap();
        // Each column sums the rows of every replica: rows b*2n .. b*2n+2n, their pairs summed.
        let rows: Vec<f32> = (0..2 * n).map(|k| (b * 2 * n + k) as f32).collect();
        let want: Vec<f32> = (0..2)
            .flat_map(|r| {
                let s: f32 = (0..n).map(|i| rows[2 * i + r]).sum();
                [s; 3]
            })
            .collect();
        for got in sums.local_results() {
            assert_eq!(got, &want, "step {b}");
        }
    }
    assert_eq!(
        c.cache_stats().staged_calls,
        staged,
        "the batches went through host memory"
    );
}

/// Replicas that pass a tensor on one side and host memory on the other to the same
/// collective: an error naming both, never one read as the other.
#[test]
fn a_tensor_against_host_memory_in_one_collective_is_an_error() {
    let Some(c) = client() else { return };
    let s = Strategy::tpu(c.clone()).unwrap();
    let e = s
        .run(|ctx| {
            if ctx.local_replica_id() == 1 {
                let mut v = vec![1.0f32; 8];
                ctx.all_reduce(ReduceOp::Sum, &mut v)?;
                return Ok(v);
            }
            let mut t = ctx.place(&[1.0f32; 8])?;
            ctx.all_reduce_tensor(ReduceOp::Sum, &mut t)?;
            t.to_vec::<f32>()
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 1") && e.contains("host memory"), "{e}");
    // The strategy goes on.
    let ok = s
        .run(|ctx| {
            let mut t = ctx.place(&[1.0f32; 8])?;
            ctx.all_reduce_tensor(ReduceOp::Sum, &mut t)?;
            t.to_vec::<f32>()
        })
        .unwrap();
    assert_eq!(ok.local_results()[0], vec![c.devices().len() as f32; 8]);
}

/// On one worker's XLA devices an optimizer's step of each variable is one program with its
/// gradients' sum (one launch, not a sum and a step per device), to the host optimizer's values;
/// host-staged, the sum and the steps run apart, to the same values.
#[test]
fn optimizer_steps_fuse_with_the_gradients_sum() {
    use tutti::strategy::{Optimizer, Rule};
    let Some(c) = client() else { return };
    let s = Strategy::tpu(c.clone()).unwrap();
    let rule = Rule::Adam {
        learning_rate: 0.01,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-7,
    };
    let (a0, b0) = (vec![0.5f32; 131], vec![-1.0f32; 7]);
    let (da, db) = (
        s.device_variable(&a0).unwrap(),
        s.device_variable(&b0).unwrap(),
    );
    let (ha, hb) = (
        s.mirrored_variable(&a0).unwrap(),
        s.mirrored_variable(&b0).unwrap(),
    );
    let (od, oh) = (Optimizer::new(rule).unwrap(), Optimizer::new(rule).unwrap());
    oh.set_schedule(|t| 0.01 / (1 + t) as f32);
    od.set_schedule(|t| 0.01 / (1 + t) as f32);
    let grad = |k: usize, id: usize, n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i + 3 * k + id) % 5) as f32 - 2.0)
            .collect()
    };
    let step = |k: usize| {
        s.run(|ctx| {
            let id = ctx.replica_id_in_sync_group();
            let (mut ga, mut gb) = (ctx.place(&grad(k, id, 131))?, ctx.place(&grad(k, id, 7))?);
            od.apply_device_gradients(ctx, &mut [(&mut ga, &da), (&mut gb, &db)])?;
            // Each gradient holds the sum afterwards.
            ga.to_vec::<f32>()
        })
        .unwrap()
    };
    let host_step = |k: usize| {
        s.run(|ctx| {
            let id = ctx.replica_id_in_sync_group();
            let (ga, gb) = (grad(k, id, 131), grad(k, id, 7));
            oh.apply_gradients(ctx, &[(&ga[..], &ha), (&gb[..], &hb)])
        })
        .unwrap();
    };
    let n = c.devices().len();
    let close = |what: &str| {
        for (d, h) in [(&da, &ha), (&db, &hb)] {
            assert!(d.in_sync().unwrap(), "{what}: the copies differ");
            for (x, y) in d.value().unwrap().iter().zip(h.value()) {
                assert!(
                    (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                    "{what}: {x} against {y}"
                );
            }
        }
    };
    step(0);
    host_step(0);
    for k in 1..4 {
        let before = c.cache_stats();
        let sums = step(k);
        let after = c.cache_stats();
        // 2 variables: a launch each, where the sum and the steps apart take 1 + n; the
        // gradients and the learning rate (2 each a replica) uploaded, nothing else.
        assert_eq!(
            (
                after.launches - before.launches,
                after.uploads - before.uploads,
                after.staged_calls - before.staged_calls
            ),
            (2, 4 * n as u64, 0),
            "step {k}: {before:?} -> {after:?}"
        );
        let want: Vec<f32> = (0..131)
            .map(|i| (0..n).map(|id| grad(k, id, 131)[i]).sum())
            .collect();
        for got in sums.local_results() {
            assert_eq!(got, &want, "the gradient's sum");
        }
        host_step(k);
    }
    close("fused steps");
    // Host-staged: the sum and the steps apart, through host memory, to the same values.
    c.set_route(tutti::xla::Route::HostStaged);
    step(4);
    host_step(4);
    c.set_route(tutti::xla::Route::Auto);
    close("host-staged steps");
    assert_eq!(od.iterations(), 5);
    // One replica's gradient in host memory: its argument error, heard by every replica before
    // anything moved; the variables as they were, and the strategy goes on.
    let kept = (da.value().unwrap(), db.value().unwrap());
    let e = s
        .run(|ctx| {
            let id = ctx.replica_id_in_sync_group();
            let mut ga = match id {
                1 => tutti::DeviceTensor::from_host(&grad(5, id, 131)),
                _ => ctx.place(&grad(5, id, 131))?,
            };
            let mut gb = ctx.place(&grad(5, id, 7))?;
            od.apply_device_gradients(ctx, &mut [(&mut ga, &da), (&mut gb, &db)])
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("in host memory"), "{e}");
    assert_eq!((da.value().unwrap(), db.value().unwrap()), kept);
    assert_eq!(od.iterations(), 5);
    step(5);
    host_step(5);
    close("a step after a refused one");
    // A variable given twice steps twice (the sum and the steps apart), as on the host.
    s.run(|ctx| {
        let id = ctx.replica_id_in_sync_group();
        let (mut g1, mut g2) = (ctx.place(&grad(6, id, 7))?, ctx.place(&grad(7, id, 7))?);
        od.apply_device_gradients(ctx, &mut [(&mut g1, &db), (&mut g2, &db)])
    })
    .unwrap();
    s.run(|ctx| {
        let id = ctx.replica_id_in_sync_group();
        let (g1, g2) = (grad(6, id, 7), grad(7, id, 7));
        oh.apply_gradients(ctx, &[(&g1[..], &hb), (&g2[..], &hb)])
    })
    .unwrap();
    close("a variable given twice");
}

/// MirroredStrategy, CentralStorageStrategy, OneDeviceStrategy and a single worker's
/// MultiWorkerMirroredStrategy on XLA devices reduce there, as TPUStrategy does: a tensor's
/// collectives compile programs over the device buffers and none is copied through host
/// memory; a host value's collectives are right too. XLA devices beside others are refused.
#[test]
fn every_strategy_on_xla_devices_reduces_on_them() {
    use tutti::strategy::CommunicationImplementation;
    use tutti::{Device, DeviceKind};
    let Some(c) = client() else { return };
    let xla: Vec<Device> = (0..c.devices().len())
        .map(|i| tutti::device_from_spec(&format!("xla:{i}")).unwrap())
        .collect();
    drop(c);
    let n = xla.len();
    let strategies = [
        Strategy::mirrored(&xla, None).unwrap(),
        Strategy::central_storage(&xla).unwrap(),
        Strategy::multi_worker_mirrored(CommunicationImplementation::Auto, None, &xla).unwrap(),
        Strategy::one_device(xla[0].clone()).unwrap(),
    ];
    for s in &strategies {
        let replicas = s.num_replicas_in_sync();
        assert_eq!(
            replicas,
            if s.kind() == StrategyKind::OneDevice {
                1
            } else {
                n
            }
        );
        let kind = s.kind();
        let placed = s
            .run(|ctx| {
                let id = ctx.replica_id_in_sync_group() as f32;
                ctx.place(&[id, 1.0, 2.0 * id])
            })
            .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        let slots: Vec<std::sync::Mutex<Option<tutti::DeviceTensor>>> = placed
            .0
            .into_iter()
            .map(|t| std::sync::Mutex::new(Some(t)))
            .collect();
        let client = {
            let t = slots[0].lock().unwrap();
            let t = t.as_ref().unwrap();
            assert_eq!(t.kind(), DeviceKind::Xla, "{kind:?}");
            t.as_xla().unwrap().client()
        };
        let before = client.cache_stats();
        let reduced = s
            .run(|ctx| {
                let mut t = slots[ctx.local_replica_id()]
                    .lock()
                    .unwrap()
                    .take()
                    .unwrap();
                ctx.all_reduce_tensor(ReduceOp::Sum, &mut t)?;
                Ok(t)
            })
            .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        let after = client.cache_stats();
        assert_eq!(
            (after.staged_calls, after.uploads, after.downloads),
            (before.staged_calls, before.uploads, before.downloads),
            "{kind:?}: the tensors' all-reduce went through host memory"
        );
        assert!(
            after.compiled + after.hits > before.compiled + before.hits,
            "{kind:?}"
        );
        let ids: f32 = (0..replicas).map(|i| i as f32).sum();
        for t in reduced.local_results() {
            assert_eq!(
                t.to_vec::<f32>().unwrap(),
                [ids, replicas as f32, 2.0 * ids],
                "{kind:?}"
            );
        }
        let host = s
            .run(|ctx| {
                let mut v = [ctx.replica_id_in_sync_group() as f32 + 1.0];
                ctx.all_reduce(ReduceOp::Sum, &mut v)?;
                Ok(v[0])
            })
            .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        for v in host.local_results() {
            assert_eq!(*v, ids + replicas as f32, "{kind:?}");
        }
    }
    let cpu = tutti::logical_cpus(1).unwrap().remove(0);
    let Err(e) = Strategy::mirrored(&[cpu, xla[0].clone()], None) else {
        panic!("a strategy over a CPU and an XLA device")
    };
    assert!(e.to_string().contains("mix XLA devices with others"), "{e}");
    // A cross-device op named for XLA devices cannot change their programs: the strategy
    // reduces as before, and says at `warn` that the op is not used.
    static LOGGER: Captured = Captured;
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Warn);
    let named = tutti::strategy::CrossDeviceOps::HierarchicalCopyAllReduce {
        num_packs: 1,
        group_size: 2,
    };
    let s = Strategy::mirrored(&xla, Some(named)).unwrap();
    let sums = s
        .run(|ctx| {
            let mut v = [1.0f32];
            ctx.all_reduce(ReduceOp::Sum, &mut v)?;
            Ok(v[0])
        })
        .unwrap();
    assert!(sums.local_results().iter().all(|&v| v == n as f32));
    let warned = WARNINGS.lock().unwrap().clone();
    assert!(
        warned
            .iter()
            .any(|m| m.contains("HierarchicalCopyAllReduce does not apply on XLA")),
        "{warned:?}"
    );
}

/// Captures the library's warnings (this test binary's only logger).
struct Captured;
static WARNINGS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
impl log::Log for Captured {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record<'_>) {
        if r.level() <= log::Level::Warn {
            WARNINGS.lock().unwrap().push(r.args().to_string());
        }
    }
    fn flush(&self) {}
}
