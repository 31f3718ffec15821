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
    let w = j["weights"].as_array().unwrap();
    let r = j["reference_weights"].as_array().unwrap();
    for (a, b) in w.iter().zip(r) {
        assert!(
            (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4,
            "{j}"
        );
    }

    // MirroredStrategy on the XLA devices, 20 steps, a checkpoint, 20 more: the 40 steps'
    // weights.
    let dir = std::env::temp_dir().join(format!("tutti-xla-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_s = dir.to_str().unwrap();
    let twenty = ["--strategy", "mirrored", "--device", "xla", "--steps", "20"];
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
