//! `cargo bench`: all-reduce per algorithm at 2 and 4 ranks, 4 KiB..64 MiB, plus broadcast and
//! all-gather. Throughput is the buffer size in bytes (algbw); the ranks are threads, timed from
//! inside the group so that no thread start is counted.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tutti::{run_local, Algorithm, Collective, Config, ReduceOp};

const SIZES: [usize; 5] = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];

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
        comm.barrier().unwrap();
        let t = Instant::now();
        for _ in 0..iters {
            match c {
                Collective::AllReduce => comm.all_reduce_into(&input, &mut output, ReduceOp::Sum),
                Collective::Broadcast => comm.broadcast(&mut output, 0),
                Collective::AllGather => comm.all_gather(&input, &mut output),
                _ => unreachable!(),
            }
            .unwrap();
        }
        t.elapsed()
    })
    .unwrap();
    times.into_iter().max().unwrap()
}

fn bench(cr: &mut Criterion) {
    let mut cases: Vec<(Collective, Algorithm)> = Algorithm::ALL_REDUCE
        .iter()
        .map(|&a| (Collective::AllReduce, a))
        .collect();
    cases.push((Collective::Broadcast, Algorithm::Auto));
    cases.push((Collective::AllGather, Algorithm::Auto));
    for (c, algo) in cases {
        for world in [2, 4] {
            let mut g = cr.benchmark_group(format!("{}/{algo}/{world}ranks", c.cli_name()));
            g.sample_size(10)
                .warm_up_time(Duration::from_millis(300))
                .measurement_time(Duration::from_secs(2));
            for bytes in SIZES {
                g.throughput(Throughput::Bytes(bytes as u64));
                g.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |b, &bytes| {
                    b.iter_custom(|iters| timed(world, algo, c, bytes, iters))
                });
            }
            g.finish();
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
