//! The simulated cluster (`scripts/sim_cluster.sh`): ranks in network namespaces as hosts,
//! joined through a bridge by links shaped with `tc tbf`. Two hosts of two ranks: every
//! collective is right, and `auto` runs the hierarchy across the hosts (the bytes on the links
//! show it). Needs root and iproute2; says so and passes where they are absent, unless
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

/// `scripts/sim_cluster.sh ARGS`, bounded to 5 minutes.
fn sim(args: &[&str]) -> Output {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/sim_cluster.sh");
    Command::new("timeout")
        .args(["-k", "10", "300", script])
        .args(args)
        .env("TUTTI_BIN", common::tutti_bin())
        .output()
        .unwrap()
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

/// Host 0's bytes sent on its link during a 16 MiB all-reduce sweep with algorithm `algo`.
fn bytes_sent(algo: &str) -> u64 {
    let o = sim(&[
        "--hosts",
        "2",
        "--ranks",
        "2",
        "--rate",
        "4gbit",
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
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{algo}: {out}");
    out.lines()
        .find_map(|l| l.strip_prefix("sim_cluster: host 0 sent "))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{algo}: no byte count for host 0: {out}"))
}

#[test]
fn auto_runs_the_hierarchy_across_simulated_hosts() {
    if !available() {
        return;
    }
    // Two hosts of two ranks: the flat ring crosses between hosts on two of its four links,
    // each carrying 2(P-1)/P = 1.5 buffers a call; the hierarchy runs the ring between the two
    // hosts' leaders only, 2(H-1)/H = 1 buffer a call: two thirds of the ring's bytes.
    let (auto, ring) = (bytes_sent("auto"), bytes_sent("ring"));
    let ratio = auto as f64 / ring as f64;
    assert!(
        (0.55..0.8).contains(&ratio),
        "auto sent {auto} bytes across hosts, the ring {ring}: {ratio:.2} of it, not the \
         hierarchy's two thirds"
    );
}
