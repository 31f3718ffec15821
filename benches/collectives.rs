//! `cargo bench`: all-reduce per algorithm at 2 and 4 ranks, 4 KiB..64 MiB, plus broadcast and
//! all-gather. Throughput is the buffer size in bytes (algbw); the ranks are threads, timed from
//! inside the group so that no thread start is counted.
//!
//! Names read as a user types them: `all_reduce/ring/2/1MiB` (collective, algorithm, ranks,
//! size), so `cargo bench -- all_reduce/ring/2` or `cargo bench -- 1MiB` finds them. Criterion's
//! flags (`--warm-up-time`, `--measurement-time`, `--sample-size`, `--save-baseline`...) override
//! the defaults below; its HTML report with plots is in `target/criterion/report/index.html`. A
//! filter that matches no benchmark is an error that lists the names, not a silent success.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use tutti::{run_local, Algorithm, Collective, Config, ReduceOp};

const SIZES: [usize; 5] = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];
const WORLDS: [usize; 2] = [2, 4];

/// A benchmark ran (its filter matched).
static RAN: AtomicBool = AtomicBool::new(false);

/// `4KiB`, `1MiB`: sizes as people write them.
fn size_name(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}KiB", b >> 10),
        b => format!("{b}B"),
    }
}

/// Run `iters` collectives on every rank; the slowest rank's time.
fn timed(world: usize, algo: Algorithm, c: Collective, bytes: usize, iters: u64) -> Duration {
    let config = Config::default().with_algorithm(algo);
    let n = bytes / 4;
    let times = run_local(world, &config, |comm| {
        let input = vec![1.0f32; n];
        let mut output = vec![
            0f32;
            if c == Collective::AllGather {
                n * world
            } else {
                n
            }
        ];
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            match c {
                Collective::AllReduce => comm.all_reduce_into(&input, &mut output, ReduceOp::Sum),
                Collective::Broadcast => comm.broadcast(&mut output, 0),
                Collective::AllGather => comm.all_gather(&input, &mut output),
                _ => unreachable!("only the collectives listed in cases()"),
            }?;
        }
        Ok(t.elapsed())
    })
    .and_then(|ranks| ranks.into_iter().collect::<tutti::Result<Vec<_>>>())
    .unwrap_or_else(|e| panic!("{} {algo} on {world} ranks: {e}", c.cli_name()));
    times.into_iter().max().unwrap_or_default()
}

fn cases() -> Vec<(Collective, Algorithm)> {
    let mut cases: Vec<(Collective, Algorithm)> = Algorithm::ALL_REDUCE
        .iter()
        .map(|&a| (Collective::AllReduce, a))
        .collect();
    cases.push((Collective::Broadcast, Algorithm::Auto));
    cases.push((Collective::AllGather, Algorithm::Auto));
    cases
}

/// `all_reduce/ring/2`: a group's name.
fn group_name(c: Collective, algo: Algorithm, world: usize) -> String {
    format!("{}/{algo}/{world}", c.cli_name().replace('-', "_"))
}

fn bench(cr: &mut Criterion) {
    for (c, algo) in cases() {
        for world in WORLDS {
            let mut g = cr.benchmark_group(group_name(c, algo, world));
            for bytes in SIZES {
                g.throughput(Throughput::Bytes(bytes as u64));
                g.bench_with_input(
                    BenchmarkId::from_parameter(size_name(bytes)),
                    &bytes,
                    |b, &bytes| {
                        RAN.store(true, Ordering::Relaxed);
                        b.iter_custom(|iters| timed(world, algo, c, bytes, iters))
                    },
                );
            }
            g.finish();
        }
    }
}

fn main() {
    // Defaults that fit these benchmarks (each iteration is a whole collective on every rank);
    // flags given on the command line override them.
    let mut cr = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    bench(&mut cr);
    cr.final_summary();
    let args: Vec<String> = std::env::args().collect();
    let listing = args
        .iter()
        .any(|a| a == "--list" || a == "--help" || a == "-h");
    // `cargo bench` passes --bench; `cargo test --all-targets FILTER` runs this binary too, where
    // a filter meant for tests matches no benchmark and that is fine.
    let benching = args.iter().any(|a| a == "--bench");
    if benching && !listing && !RAN.load(Ordering::Relaxed) {
        eprintln!(
            "no benchmark matches the filter given ({:?}); the benchmarks are:",
            &args[1..]
        );
        for (c, algo) in cases() {
            for world in WORLDS {
                let sizes: Vec<String> = SIZES.iter().map(|&b| size_name(b)).collect();
                eprintln!("  {}/{{{}}}", group_name(c, algo, world), sizes.join(","));
            }
        }
        std::process::exit(1);
    }
}
