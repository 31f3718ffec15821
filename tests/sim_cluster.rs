//! The simulated cluster (`scripts/sim_cluster.sh`): ranks in network namespaces as hosts,
//! joined through a bridge by links shaped with `tc tbf`. Two hosts of two ranks: every
//! collective is right, `tutti tune` measures the links' bandwidth, and with its figures
//! `auto` runs the hierarchy across the hosts (the bytes on the links show it). Needs root and iproute2; says so and passes where they are absent, unless
//! `TUTTI_REQUIRE_NAMESPACES` is set (CI as root).

mod common;

use std::process::{Command, Output};

/// Whether the harness can run here.
fn available() -> bool {
    // SAFETY: plain syscall.
    let root = unsafe { libc::geteuid() } == 0;
    let tools = ["ip", "tc"].iter().all(|t| {
        Command::new("sh")
            .args(["-c", &format!("command -v {t}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if root && tools {
        return true;
    }
    assert!(
        std::env::var("TUTTI_REQUIRE_NAMESPACES").is_err(),
        "TUTTI_REQUIRE_NAMESPACES is set but the simulated cluster needs root and iproute2 \
         (root: {root}, ip and tc: {tools})"
    );
    eprintln!("skipped: the simulated cluster needs root and iproute2");
    false
}

/// One simulated cluster at a time: two at once share the 2 cores, and what `tutti tune`
/// measures is then the other cluster's load.
fn one_cluster_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// `scripts/sim_cluster.sh ARGS`, bounded to 5 minutes.
fn sim(args: &[&str]) -> Output {
    sim_tuned(args, None)
}

/// `scripts/sim_cluster.sh ARGS` with `TUTTI_TUNING=tuning` for every rank.
fn sim_tuned(args: &[&str], tuning: Option<&str>) -> Output {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/sim_cluster.sh");
    let mut c = Command::new("timeout");
    c.args(["-k", "10", "300", script])
        .args(args)
        .env("TUTTI_BIN", common::tutti_bin())
        .env_remove("TUTTI_TUNING");
    if let Some(t) = tuning {
        c.env("TUTTI_TUNING", t);
    }
    c.output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn every_collective_is_right_on_two_simulated_hosts() {
    if !available() {
        return;
    }
    let _one = one_cluster_at_a_time();
    let o = sim(&[
        "--hosts",
        "2",
        "--ranks",
        "2",
        "--",
        "tutti",
        "check",
        "--counts",
        "1,7,1000,70001",
        "--timeout",
        "60",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for (host, rank) in [(0, 0), (0, 1), (1, 2), (1, 3)] {
        assert!(
            out.lines().any(
                |l| l.starts_with(&format!("[h{host}] rank {rank} of 4, hosts 2:"))
                    && l.contains("all correct")
            ),
            "rank {rank} on host {host}: {out}"
        );
    }
}

/// Host 0's bytes sent on its link during a 16 MiB all-reduce sweep with algorithm `algo`
/// (and the cost model's figures from `tuning`, a file).
fn bytes_sent(algo: &str, tuning: Option<&str>) -> u64 {
    let o = sim_tuned(
        &[
            "--hosts",
            "2",
            "--ranks",
            "2",
            "--rate",
            "2gbit",
            "--stats",
            "--",
            "tutti",
            "perf",
            "-a",
            algo,
            "-b",
            "16M",
            "-e",
            "16M",
            "--iters",
            "4",
            "--out-of-place",
        ],
        tuning,
    );
    let out = text(&o);
    assert!(o.status.success(), "{algo}: {out}");
    out.lines()
        .find_map(|l| l.strip_prefix("sim_cluster: host 0 sent "))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{algo}: no byte count for host 0: {out}"))
}

#[test]
fn tune_measures_the_links_and_auto_runs_the_hierarchy_across_simulated_hosts() {
    if !available() {
        return;
    }
    let _one = one_cluster_at_a_time();
    // `tutti tune` on two hosts of two ranks joined by 2 Gbit/s links (0.25 GB/s): the
    // network's bandwidth it fits is that of the links (within a factor of two), not of
    // loopback, nor of the bursts a shaper's bucket lets through at memory speed.
    let dir = std::env::temp_dir().join(format!("tutti-sim-tune-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tuning.json");
    let file_s = file.to_str().unwrap();
    // At 16 MiB the hierarchy's prediction is below the ring's by the time its one buffer
    // fewer takes on the link, less its two copies within each host; a fit of shared memory
    // low enough on this loaded 2-core machine to tip it the other way is measured once more.
    let mut tries = Vec::new();
    let out = loop {
        let o = sim(&[
            "--hosts", "2", "--ranks", "2", "--rate", "2gbit", "--", "tutti", "tune", "-o", file_s,
        ]);
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        let hierarchy = out
            .lines()
            .any(|l| l.contains("16777216") && l.contains("hosts"));
        tries.push(out);
        if hierarchy || tries.len() == 2 {
            break tries.join("\n");
        }
    };
    let figures: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let net = figures["net"]["gbytes_per_s"].as_f64().unwrap();
    assert!(
        (0.125..0.5).contains(&net),
        "tutti tune fitted the 2 Gbit/s links at {net} GB/s: {out}"
    );
    assert_eq!(figures["ranks_per_host"], 2, "{figures}");
    assert!(
        tries
            .last()
            .unwrap()
            .lines()
            .any(|l| l.contains("16777216") && l.contains("hosts")),
        "with links this slow the model should run the hierarchy for 16 MiB: {out}"
    );
    // Two hosts of two ranks: the flat ring crosses between hosts on two of its four links,
    // each carrying 2(P-1)/P = 1.5 buffers a call; the hierarchy runs the ring between the two
    // hosts' leaders only, 2(H-1)/H = 1 buffer a call: two thirds of the ring's bytes. With
    // the figures measured, `auto` runs the hierarchy.
    let (auto, ring) = (bytes_sent("auto", Some(file_s)), bytes_sent("ring", None));
    std::fs::remove_dir_all(&dir).ok();
    let ratio = auto as f64 / ring as f64;
    assert!(
        (0.55..0.8).contains(&ratio),
        "auto sent {auto} bytes across hosts, the ring {ring}: {ratio:.2} of it, not the \
         hierarchy's two thirds"
    );
}
