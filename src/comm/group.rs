//! Groups of ranks that are threads of one process.

use std::sync::Arc;

use super::{Communicator, Config};
use crate::error::{Error, Result};
use crate::transport::local::LocalTransport;

/// The communicators of a new in-process group of `world` ranks, one per thread that will use
/// it (rank r is element r).
pub fn local_group(world: usize, config: &Config) -> Result<Vec<Communicator>> {
    config.check(world)?;
    Ok(LocalTransport::group(world, config.timeout)
        .into_iter()
        .map(|t| Communicator::new(Arc::new(t), config))
        .collect())
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// Run `f` on `world` threads, each with its rank's communicator, and return their results in
/// rank order. A rank that panics aborts the group (its peers' calls fail at once instead of
/// waiting for the timeout) and the panic is returned as an error naming the rank.
pub fn run_local<R, F>(world: usize, config: &Config, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(&Communicator) -> R + Sync,
{
    let comms = local_group(world, config)?;
    let results: Vec<std::thread::Result<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("tutti-rank-{}", comm.rank()))
                    .spawn_scoped(s, move || {
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
                        if let Err(p) = &r {
                            comm.abort(&format!(
                                "rank {} panicked: {}",
                                comm.rank(),
                                panic_message(&**p)
                            ));
                        }
                        r
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(Err))
            .collect()
    });
    let mut out = Vec::with_capacity(world);
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => out.push(v),
            Err(p) => {
                return Err(Error::Aborted {
                    rank,
                    reason: format!("rank {rank} panicked: {}", panic_message(&*p)),
                })
            }
        }
    }
    Ok(out)
}
