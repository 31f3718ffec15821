//! MPI as a carrier (feature `mpi`): jobs started by `mpirun`, every collective checked against
//! the reference at 2, 3 and 4 ranks (`tutti check --transport mpi`), `tutti perf` over MPI with
//! no wrong element, mismatches named on both ranks, and splits, point-to-point, all-to-all,
//! a timeout and an abort inside one MPI job (this test binary, run under `mpirun` as the
//! ranks). Without `mpirun` on the PATH the tests say so and pass, unless `TUTTI_REQUIRE_MPI=1`.
#![cfg(feature = "mpi")]

mod common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tutti::{Communicator, Config, Error, PeerOp, ReduceOp};

/// Counts the allocations of each thread, for the test that a repeated call over MPI allocates
/// nothing (as `no_alloc.rs` counts them over the other carriers).
struct Counting;

thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn count() {
    // `try_with`: the allocator also runs while a thread's locals are torn down.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards every request to the system allocator unchanged.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        count();
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        count();
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        count();
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(std::cell::Cell::get)
}

/// `mpirun`, or `None` (after saying why) where this machine has none and none is required.
fn mpirun() -> Option<&'static str> {
    let found = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        return Some("mpirun");
    }
    assert!(
        std::env::var("TUTTI_REQUIRE_MPI").as_deref() != Ok("1"),
        "TUTTI_REQUIRE_MPI=1 but no mpirun on the PATH (Debian: apt-get install openmpi-bin)"
    );
    eprintln!("no mpirun on the PATH: MPI tests skipped");
    None
}

/// `mpirun -np N PROGRAM ARGS` (as root, oversubscribing the cores), killed past `limit`.
/// Each job's Open MPI session files go in a directory of its own: jobs started at once by
/// the tests running in parallel otherwise race to make the one under /tmp, and the loser
/// fails to start ("A call to mkdir was unable to create the desired directory").
fn run_mpi(np: usize, program: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    static JOBS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let limit = Duration::from_secs(240);
    let session = std::env::temp_dir().join(format!(
        "tutti-mpi-{}-{}",
        std::process::id(),
        JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&session).expect("a session directory for mpirun");
    let out = run_mpi_in(np, program, args, env, &session, limit);
    let _ = std::fs::remove_dir_all(&session);
    out
}

fn run_mpi_in(
    np: usize,
    program: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
    session: &std::path::Path,
    limit: Duration,
) -> Output {
    let mut child = Command::new(mpirun().expect("checked by the caller"))
        // Open MPI 4 (orte) and 5 (prte) name the setting differently.
        .env("OMPI_MCA_orte_tmpdir_base", session)
        .env("PRTE_MCA_prte_tmpdir_base", session)
        .args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(np.to_string())
        .arg(program)
        .args(args)
        .envs(env.iter().copied())
        .env_remove("TF_CONFIG")
        .env_remove("TUTTI_RANK")
        .env_remove("TUTTI_WORLD_SIZE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting mpirun");
    let t = Instant::now();
    while child.try_wait().expect("waiting for mpirun").is_none() {
        if t.elapsed() > limit {
            let _ = child.kill();
            panic!("mpirun -np {np} {} ran past {limit:?}", program.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("mpirun's output")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn every_collective_is_right_over_mpi_at_2_3_and_4_ranks() {
    if mpirun().is_none() {
        return;
    }
    let bin = common::tutti_bin();
    for np in [2, 3, 4] {
        // The default counts (up to 70001) at 2 ranks; the smaller ones at 3 and 4, where the
        // ranks outnumber the cores (messages of several MPI pieces: `an_mpi_job_...`).
        let counts = if np == 2 {
            "0,1,7,1000,70001"
        } else {
            "0,1,7,1000"
        };
        let o = run_mpi(
            np,
            &bin,
            &["check", "--transport", "mpi", "--counts", counts],
            &[],
        );
        let out = text(&o);
        assert!(o.status.success(), "np {np}:\n{out}");
        let ok = out
            .lines()
            .filter(|l| l.contains(&format!(" of {np}, hosts 1:")) && l.ends_with("all correct"))
            .count();
        assert_eq!(ok, np, "np {np}: every rank checks every call:\n{out}");
    }
}

#[test]
fn auto_under_mpirun_is_mpi_and_perf_has_no_errors() {
    if mpirun().is_none() {
        return;
    }
    let bin = common::tutti_bin();
    for c in [
        "all-reduce",
        "broadcast",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "send-recv",
    ] {
        let o = run_mpi(
            3,
            &bin,
            &[
                "perf", "-c", c, "-b", "8", "-e", "1M", "-f", "32", "--iters", "3", "--json",
            ],
            &[],
        );
        let out = text(&o);
        assert!(o.status.success(), "{c}:\n{out}");
        let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .filter(|v: &serde_json::Value| v.get("bytes").is_some())
            .collect();
        assert!(rows.len() >= 3, "{c}: rows of every size:\n{out}");
        for r in &rows {
            for key in ["errors", "errors_in_place"] {
                if let Some(e) = r.get(key) {
                    assert_eq!(e.as_u64(), Some(0), "{c}: {r}");
                }
            }
        }
    }
    let o = run_mpi(
        2,
        &bin,
        &["perf", "-b", "1K", "-e", "1K", "--iters", "3"],
        &[],
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("transport auto (mpi)"),
        "auto under mpirun is the MPI transport:\n{out}"
    );
}

#[test]
fn mpis_own_collectives_under_the_algorithm_mpi() {
    if mpirun().is_none() {
        return;
    }
    let bin = common::tutti_bin();
    let rows = |args: &[&str]| -> Vec<serde_json::Value> {
        let mut all = vec![
            "perf",
            "--transport",
            "mpi",
            "-a",
            "mpi",
            "--iters",
            "3",
            "--json",
        ];
        all.extend_from_slice(args);
        let o = run_mpi(3, &bin, &all, &[]);
        assert!(o.status.success(), "{args:?}:\n{}", text(&o));
        let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.get("bytes").is_some())
            .collect();
        assert!(!rows.is_empty(), "{args:?}:\n{}", text(&o));
        for r in &rows {
            assert_eq!(r["errors"].as_u64(), Some(0), "{args:?}: {r}");
        }
        rows
    };
    for c in [
        "all-reduce",
        "broadcast",
        "all-gather",
        "reduce",
        "reduce-scatter",
        "all-to-all",
        "gather",
        "scatter",
    ] {
        for r in rows(&["-c", c, "-b", "1K", "-e", "4M", "-f", "64"]) {
            assert_eq!(r["ran"], "mpi", "{c}: MPI's own collective ran: {r}");
        }
    }
    // MPI has no f16 and no mean: those run tutti's algorithms.
    for args in [["-d", "f16"], ["-o", "mean"]] {
        let mut a = vec!["-c", "all-reduce", "-b", "1K", "-e", "1K"];
        a.extend_from_slice(&args);
        for r in rows(&a) {
            assert_ne!(r["ran"], "mpi", "{args:?}: {r}");
        }
    }
}

#[test]
fn a_mismatch_over_mpi_is_named_on_both_ranks() {
    if mpirun().is_none() {
        return;
    }
    let bin = common::tutti_bin();
    for kind in ["dtype", "op", "order"] {
        let o = run_mpi(
            2,
            &bin,
            &["check", "--transport", "mpi", "--inject", kind],
            &[],
        );
        let out = text(&o);
        for (me, peer) in [(0, 1), (1, 0)] {
            assert!(
                out.lines()
                    .any(|l| l.starts_with("injected mismatch detected")
                        && l.contains(&format!("on rank {me}"))
                        && l.contains(&format!("rank {peer}"))),
                "{kind}: rank {me} names rank {peer}:\n{out}"
            );
        }
    }
}

#[test]
fn the_tutti_launcher_refuses_the_mpi_transport() {
    let o = Command::new(common::tutti_bin())
        .args(["launch", "-n", "2", "--transport", "mpi", "--", "true"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("MPI launcher"), "{}", text(&o));
}

/// A repeated call over MPI allocates nothing on the calling thread: every collective at
/// every count (rooted ones and count 0 with their check round), and a send and a receive, at
/// 2 and 3 ranks, after a first round that builds the plans.
#[test]
fn a_repeated_call_over_mpi_allocates_nothing() {
    if mpirun().is_none() {
        return;
    }
    let me = std::env::current_exe().unwrap();
    for np in [2, 3] {
        let o = run_mpi(
            np,
            &me,
            &[
                "--exact",
                "mpi_no_alloc_rank",
                "--nocapture",
                "--test-threads=1",
            ],
            &[("TUTTI_MPI_SCENARIO", "1")],
        );
        let out = text(&o);
        assert!(o.status.success(), "np {np}:\n{out}");
        assert_eq!(
            out.matches("allocations 0").count(),
            np,
            "np {np}: every rank allocates nothing:\n{out}"
        );
    }
}

/// Counts one rank's allocations for [`a_repeated_call_over_mpi_allocates_nothing`] (only
/// under that test's `mpirun`).
#[test]
fn mpi_no_alloc_rank() {
    if std::env::var("TUTTI_MPI_SCENARIO").is_err() {
        return;
    }
    let config = Config::default().with_timeout(Duration::from_secs(20));
    let c = Communicator::from_mpi(&config).expect("joining the MPI job");
    let (r, p) = (c.rank(), c.world_size());
    let counts = [0usize, 1, 7, 4099, 70_001];
    let max = 70_001;
    let (mut a, b, mut g) = (vec![1.0f32; max], vec![2.0f32; max], vec![0.0f32; max * p]);
    let (mut ring_in, ring_out) = (vec![0i32; 64], vec![r as i32; 64]);
    let round = |a: &mut [f32], g: &mut [f32], ring_in: &mut [i32]| {
        for &n in &counts {
            c.all_reduce(&mut a[..n], ReduceOp::Sum).unwrap();
            c.all_reduce_into(&b[..n], &mut a[..n], ReduceOp::Max)
                .unwrap();
            c.broadcast(&mut a[..n], p - 1).unwrap();
            c.all_gather(&b[..n], &mut g[..n * p]).unwrap();
            c.reduce_scatter(&g[..n * p], &mut a[..n], ReduceOp::Sum)
                .unwrap();
            c.reduce(&b[..n], (r == 0).then_some(&mut a[..n]), ReduceOp::Sum, 0)
                .unwrap();
        }
        c.barrier().unwrap();
        // A send and a receive each (a group of several builds its list of operations).
        match r {
            0 => {
                c.send(&ring_out, 1).unwrap();
                c.recv(ring_in, 1).unwrap();
            }
            1 => {
                c.recv(ring_in, 0).unwrap();
                c.send(&ring_out, 0).unwrap();
            }
            _ => {}
        }
    };
    round(&mut a, &mut g, &mut ring_in);
    let before = allocations();
    for _ in 0..3 {
        round(&mut a, &mut g, &mut ring_in);
    }
    println!("rank {r}: allocations {}", allocations() - before);
}

/// Runs the scenario of [`an_mpi_job_splits_sends_and_fails_cleanly`] as each rank of the job
/// (only under that test's `mpirun`).
#[test]
fn mpi_rank() {
    if std::env::var("TUTTI_MPI_SCENARIO").is_err() {
        return;
    }
    scenario();
}

#[test]
fn an_mpi_job_splits_sends_and_fails_cleanly() {
    if mpirun().is_none() {
        return;
    }
    let me = std::env::current_exe().unwrap();
    let o = run_mpi(
        4,
        &me,
        &["--exact", "mpi_rank", "--nocapture", "--test-threads=1"],
        &[("TUTTI_MPI_SCENARIO", "1")],
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert_eq!(
        out.matches("scenario done").count(),
        4,
        "every rank ran it to the end:\n{out}"
    );
}

fn scenario() {
    let config = Config::default().with_timeout(Duration::from_secs(20));
    let comm = Communicator::from_mpi(&config).expect("joining the MPI job");
    let (r, p) = (comm.rank(), comm.world_size());
    assert_eq!(p, 4);

    // Two groups by parity, ranked by descending rank, all-reducing at the same time.
    let half = comm
        .split(Some((r % 2) as u32), -(r as i64))
        .unwrap()
        .expect("a member");
    assert_eq!(half.world_size(), 2);
    assert_eq!(half.rank(), usize::from(r < 2));
    let mut v = [r as i64 + 1];
    half.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v[0], if r % 2 == 0 { 1 + 3 } else { 2 + 4 });

    // A split of a split, and a rank of no group.
    let one = half.split(Some(half.rank() as u32), 0).unwrap().unwrap();
    assert_eq!(one.world_size(), 1);
    let rest = comm.split((r != 0).then_some(7), 0).unwrap();
    assert_eq!(rest.is_none(), r == 0);
    if let Some(rest) = &rest {
        let mut g = vec![0u32; 3];
        rest.all_gather(&[r as u32], &mut g).unwrap();
        assert_eq!(g, [1, 2, 3]);
    }

    // A mismatch in one group (a checked round: the group stays usable), while the other
    // group runs undisturbed.
    let mut b = vec![0f32; if r == 1 { 3 } else { 4 }];
    let got = half.broadcast(&mut b, 0);
    if r % 2 == 1 {
        match got {
            Err(Error::Mismatch { peer, field, .. }) => {
                assert_eq!(peer, if r == 1 { 0 } else { 1 });
                assert_eq!(field, "count");
            }
            other => panic!("rank {r}: expected a count mismatch, got {other:?}"),
        }
    } else {
        got.unwrap();
    }
    let mut v = [1u64];
    half.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v[0], 2, "the group is usable after the mismatch");

    // Under MPI's own collectives a mismatch is found by the check round before MPI runs
    // anything: the communicator stays usable.
    let mut native = Communicator::from_mpi(&config).unwrap();
    native.set_algorithm(tutti::Algorithm::Mpi).unwrap();
    let mut w = vec![1f32; if r == 3 { 5 } else { 4 }];
    let e = native
        .all_reduce(&mut w, ReduceOp::Sum)
        .expect_err("rank 3's count differs");
    assert!(matches!(e, Error::Mismatch { .. }), "rank {r}: {e}");
    let mut w = vec![r as f64; 1 << 20];
    native.all_reduce(&mut w, ReduceOp::Max).unwrap();
    assert!(w.iter().all(|&x| x == 3.0));
    assert_eq!(
        native.last_algorithm(),
        Some((tutti::Collective::AllReduce, "mpi"))
    );
    // The calls with counts are tutti's, even where one rank moves nothing at all (its
    // lengths alone would not tell it so).
    let counts: Vec<usize> = (0..p)
        .map(|k| if r == 3 || k == 3 { 0 } else { 2 })
        .collect();
    let send = vec![r as u32; counts.iter().sum()];
    let mut recv = vec![0u32; counts.iter().sum()];
    native
        .all_to_all_v(&send, &counts, &mut recv, &counts)
        .unwrap();
    let want: Vec<u32> = (0..p).flat_map(|k| vec![k as u32; counts[k]]).collect();
    assert_eq!(recv, want);
    native.barrier().unwrap();

    // A group of a split shares its MPI communicator with the other groups: MPI's own
    // collectives would span them, so the group runs tutti's; a split into one group of
    // every rank hands them to MPI again.
    for (color, key, whole) in [
        ((r % 2) as u32, 0, false),
        (0, 0, true),
        (0, -(r as i64), false),
    ] {
        let mut g = comm.split(Some(color), key).unwrap().unwrap();
        g.set_algorithm(tutti::Algorithm::Mpi).unwrap();
        let mut v = vec![0u32; 3 * g.world_size()];
        g.all_gather(&[g.rank() as u32; 3], &mut v).unwrap();
        let want: Vec<u32> = (0..g.world_size() as u32).flat_map(|k| [k; 3]).collect();
        assert_eq!(v, want, "rank {r}: blocks in the group's rank order");
        let ran = g.last_algorithm().map(|(_, a)| a);
        assert_eq!(ran == Some("mpi"), whole, "rank {r}: {ran:?}");
    }

    // Point-to-point: a ring of grouped sends and receives, then every rank to every rank.
    let send = [r as i32; 5];
    let mut recv = [0i32; 5];
    comm.send_recv(&mut [
        PeerOp::send(&send, (r + 1) % p),
        PeerOp::recv(&mut recv, (r + p - 1) % p),
    ])
    .unwrap();
    assert_eq!(recv, [((r + p - 1) % p) as i32; 5]);
    let out: Vec<f64> = (0..p * 3).map(|i| (r * 100 + i) as f64).collect();
    let mut back = vec![0f64; p * 3];
    comm.all_to_all(&out, &mut back).unwrap();
    for (k, chunk) in back.chunks(3).enumerate() {
        let want: Vec<f64> = (0..3).map(|i| (k * 100 + r * 3 + i) as f64).collect();
        assert_eq!(chunk, &want[..]);
    }
    // A large all-reduce (several MPI messages per step) stays exact.
    let n = 3 << 20;
    let mut big: Vec<f32> = (0..n).map(|i| ((i % 97) + r) as f32).collect();
    comm.all_reduce(&mut big, ReduceOp::Sum).unwrap();
    assert!(big
        .iter()
        .enumerate()
        .all(|(i, &x)| x == (4 * (i % 97) + 6) as f32));

    // A rank that never comes: a timeout naming it on rank 0, within the timeout; the peers,
    // coming later, hear why rank 0 gave up.
    let short = Config::default().with_timeout(Duration::from_secs(2));
    let t = Communicator::from_mpi(&short).unwrap();
    if r == 0 {
        let start = Instant::now();
        let e = t
            .all_reduce(&mut [1.0f32; 16], ReduceOp::Sum)
            .expect_err("nobody else calls");
        assert!(start.elapsed() < Duration::from_secs(6), "{e}");
        match &e {
            // The ranks of the step it waited in (the algorithm's first partner at least).
            Error::Timeout { waiting_for, .. } => assert!(
                !waiting_for.is_empty() && waiting_for.iter().all(|w| (1..4).contains(w)),
                "{e}"
            ),
            other => panic!("expected a timeout, got {other}"),
        }
    }
    comm.barrier().unwrap();
    if r != 0 {
        let e = t
            .all_reduce(&mut [1.0f32; 16], ReduceOp::Sum)
            .expect_err("rank 0 gave up");
        assert!(
            matches!(&e, Error::Aborted { reason, .. } if reason.contains("rank 0")),
            "rank {r}: {e}"
        );
    }
    comm.barrier().unwrap();

    // The same with a large call, whose sends MPI holds until the peers take them: the late
    // peers, told why rank 0 gave up, take what it sent, so that its call returns (rather than
    // end the job) and every rank goes on.
    let t = Communicator::from_mpi(&short).unwrap();
    let mut big = vec![1.0f32; 8 << 20];
    if r == 0 {
        let start = Instant::now();
        let e = t
            .all_reduce(&mut big, ReduceOp::Sum)
            .expect_err("the others are late");
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    } else {
        std::thread::sleep(Duration::from_secs(3));
        let e = t
            .all_reduce(&mut big, ReduceOp::Sum)
            .expect_err("rank 0 gave up");
        assert!(matches!(&e, Error::Aborted { .. }), "rank {r}: {e}");
    }
    comm.barrier().unwrap();

    // Large mistakes, whose sends MPI holds until they are received: each is an error on the
    // ranks that see it, and every rank goes on (none is held past its clean-up, no MPI_Abort).
    let n = 4 << 20; // 16 MiB of 4-byte elements
    let fresh = || Communicator::from_mpi(&Config::default().with_timeout(Duration::from_secs(4)));
    // Two receives from one peer, the first of the wrong dtype.
    let t = fresh().unwrap();
    let start = Instant::now();
    if r == 0 {
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        let e = t
            .send_recv(&mut [PeerOp::recv(&mut a, 1), PeerOp::recv(&mut b, 1)])
            .expect_err("the dtypes differ");
        assert!(e.to_string().contains("rank 1"), "{e}");
    } else if r == 1 {
        let (a, b) = (vec![0i32; n], vec![0f32; n]);
        let _ = t.send_recv(&mut [PeerOp::send(&a, 0), PeerOp::send(&b, 0)]);
    }
    comm.barrier().unwrap();
    // An all-to-all whose blocks differ on one rank.
    let t = fresh().unwrap();
    let per = n + if r == 2 { 1 } else { 0 };
    let out = vec![1f32; per * p];
    let mut back = vec![0f32; per * p];
    let got = t.all_to_all(&out, &mut back);
    assert!(got.is_err(), "rank {r}: a mismatched all-to-all succeeded");
    comm.barrier().unwrap();
    // A rank that rejects its own arguments (a bitwise op on floats) while the others make a
    // sound call: every peer names it and its reason, at once.
    let t = fresh().unwrap();
    let asked = Instant::now();
    let op = if r == 2 {
        ReduceOp::BAnd
    } else {
        ReduceOp::Sum
    };
    let e = t
        .all_reduce(&mut [1.0f32; 64], op)
        .expect_err("rank 2 rejects");
    let why = "band is defined on integer types only, not f32";
    let text = e.to_string();
    assert!(text.contains(why), "rank {r}: {e}");
    assert!(
        r == 2 || text.contains("rank 2 rejected its arguments") || text.contains("rank 2 gave up"),
        "rank {r}: {e}"
    );
    assert!(asked.elapsed() < Duration::from_secs(3), "rank {r}: {e}");
    comm.barrier().unwrap();
    // A small mismatch from one peer while a large message from another is under way.
    let t = fresh().unwrap();
    if r == 0 {
        let (mut a, mut b) = (vec![0f32; 4], vec![0f32; n]);
        let e = t
            .send_recv(&mut [PeerOp::recv(&mut a, 1), PeerOp::recv(&mut b, 2)])
            .expect_err("rank 1 sends i32");
        assert!(e.to_string().contains("rank 1"), "{e}");
    } else if r == 1 {
        let _ = t.send_recv(&mut [PeerOp::send(&[0i32; 4], 0)]);
    } else if r == 2 {
        std::thread::sleep(Duration::from_millis(50));
        let _ = t.send_recv(&mut [PeerOp::send(&vec![0f32; n], 0)]);
    }
    comm.barrier().unwrap();
    // An abort from another thread in the middle of large all-reduces.
    let t = fresh().unwrap();
    if r == 0 {
        let h = t.abort_handle();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            h.abort("stopped by the test");
        });
    }
    let mut v = vec![1f32; 16 << 20];
    let stopped = (0..50).find_map(|_| t.all_reduce(&mut v, ReduceOp::Sum).err());
    assert!(stopped.is_some(), "rank {r}: the abort stopped nothing");
    comm.barrier().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(40),
        "rank {r}: the mistakes took {:?}",
        start.elapsed()
    );
    println!("rank {r}: scenario done");
}
