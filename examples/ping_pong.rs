//! Point-to-point latency: rank 0 sends `BYTES` (default 8) to rank 1, which sends them back,
//! `ITERS` times (default 10000, after 1000 warm-up rounds); rank 0 prints half the median round
//! trip in microseconds as one JSON line. Two ranks of a job (`tutti launch -n 2 --`,
//! torchrun, mpirun, ...); `TUTTI_TRANSPORT=tcp|shm` picks the transport.
//!
//! ```sh
//! cargo build --release --example ping_pong
//! TUTTI_TRANSPORT=shm tutti launch -n 2 -- target/release/examples/ping_pong [BYTES [ITERS]]
//! ```
use std::time::Instant;

use tutti::{Communicator, Config, Error};

fn arg(i: usize, default: usize) -> tutti::Result<usize> {
    match std::env::args().nth(i) {
        None => Ok(default),
        Some(a) => a
            .parse()
            .map_err(|e| Error::config(format!("argument {i} ('{a}'): {e}"))),
    }
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ping_pong: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> tutti::Result<()> {
    let (bytes, iters) = (arg(1, 8)?, arg(2, 10_000)?.max(1));
    let comm = Communicator::from_env(&Config::default())?;
    if comm.world_size() != 2 {
        return Err(Error::config("ping_pong runs on 2 ranks"));
    }
    let r = comm.rank();
    let mut buf = vec![0u8; bytes];
    let mut round = || -> tutti::Result<()> {
        if r == 0 {
            comm.send(&buf, 1)?;
            comm.recv(&mut buf, 1)
        } else {
            comm.recv(&mut buf, 0)?;
            comm.send(&buf, 0)
        }
    };
    for _ in 0..1000 {
        round()?;
    }
    // On stderr, apart from the result: the timed rounds begin (fault drills wait for it).
    eprintln!("ping_pong: rank {r} warmed up; timing {iters} rounds");
    let mut times = Vec::with_capacity(iters.min(1 << 20));
    for _ in 0..iters {
        let t = Instant::now();
        round()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    if r == 0 {
        let transport = std::env::var("TUTTI_TRANSPORT").unwrap_or_else(|_| "auto".into());
        println!(
            "{{\"bytes\": {bytes}, \"transport\": \"{transport}\", \"half_round_trip_us\": {:.2}}}",
            times[times.len() / 2] * 1e6 / 2.0
        );
    }
    Ok(())
}
