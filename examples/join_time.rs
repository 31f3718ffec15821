//! How long a job's processes take to meet: each rank times `Communicator::from_env` (the
//! rendezvous, a connection to every peer, shared memory with those on its host) and the
//! barrier after it; rank 0 prints the slowest rank's times as one JSON line.
//!
//! ```sh
//! cargo build --release --example join_time
//! tutti launch -n 64 -- target/release/examples/join_time
//! ```
use std::time::Instant;

use tutti::{Communicator, Config, ReduceOp};

fn main() -> tutti::Result<()> {
    let start = Instant::now();
    let comm = Communicator::from_env(&Config::default())?;
    let joined = start.elapsed().as_secs_f64();
    comm.barrier()?;
    let ready = start.elapsed().as_secs_f64();
    let mut slowest = [joined, ready];
    comm.all_reduce(&mut slowest, ReduceOp::Max)?;
    if comm.rank() == 0 {
        println!(
            "{{\"ranks\": {}, \"join_s\": {:.3}, \"first_barrier_s\": {:.3}}}",
            comm.world_size(),
            slowest[0],
            slowest[1]
        );
    }
    Ok(())
}
