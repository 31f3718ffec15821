//! `Communicator::shrink`: ranks meeting over TCP and shared memory (on threads of this process,
//! as processes would) go on without a rank whose communicator is gone; a rank that is alive
//! but silent is left out (survivors coming at different times too), a rank too late for the
//! others fails rather than go on alone, and a failed shrink can be retried; groups that cannot
//! shrink say so. Killed processes: tests/multiprocess.rs.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::MemStore;
use tutti::{run_local, Communicator, Config, Error, ReduceOp, TransportKind};

const TOKEN: &str = "a-token-of-32-bytes-for-the-test";

/// Ranks of `world` meeting through a store on threads of this process, as processes would.
fn ranks(world: usize, kind: TransportKind, timeout: Duration) -> Vec<Communicator> {
    let store = Arc::new(MemStore::default());
    let config = Config::default().with_timeout(timeout);
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let (store, config) = (store.clone(), config.clone());
            std::thread::spawn(move || {
                Communicator::from_store(r, world, &*store, TOKEN, "127.0.0.1", kind, &config)
                    .unwrap()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Shrink every communicator of `comms` at once, each on its own thread.
fn shrink_all(comms: Vec<Communicator>) -> Vec<(Communicator, tutti::Result<Communicator>)> {
    shrink_staggered(comms, Duration::ZERO)
}

/// Shrink every communicator of `comms`, each on its own thread, the `i`th `i × stagger`
/// after the first.
fn shrink_staggered(
    comms: Vec<Communicator>,
    stagger: Duration,
) -> Vec<(Communicator, tutti::Result<Communicator>)> {
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            std::thread::spawn(move || {
                std::thread::sleep(stagger * i as u32);
                let s = c.shrink();
                (c, s)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Every rank's sum of `value(rank)` over the communicators, with an all-gather of the ranks.
fn sums(comms: Vec<Communicator>, value: fn(usize) -> f64) -> Vec<(f64, Vec<u64>)> {
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let mut v = vec![value(c.rank()); 1001];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert!(v.iter().all(|&x| x == v[0]));
                let mut ranks = vec![0u64; c.world_size()];
                c.all_gather(&[c.rank() as u64], &mut ranks).unwrap();
                (v[0], ranks)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn survivors_go_on_renumbered_over_tcp_and_shared_memory() {
    for kind in [TransportKind::Tcp, TransportKind::Auto] {
        let mut comms = ranks(5, kind, Duration::from_secs(20));
        // Ranks 1 and 3 are gone: their ports close with them.
        drop(comms.remove(3));
        drop(comms.remove(1));
        let t = Instant::now();
        let shrunk = shrink_all(comms);
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        let mut survivors = Vec::new();
        for (i, (parent, s)) in shrunk.into_iter().enumerate() {
            let s = s.unwrap_or_else(|e| panic!("{kind}: rank {}: {e}", parent.rank()));
            assert_eq!((s.rank(), s.world_size()), (i, 3), "{kind}");
            // The parent is done: its calls fail saying why.
            let e = parent.barrier().unwrap_err();
            assert!(e.to_string().contains("shrinks this communicator"), "{e}");
            survivors.push(s);
        }
        // Parent ranks 0, 2, 4 are ranks 0, 1, 2.
        for (sum, ranks) in sums(survivors, |r| (r + 1) as f64) {
            assert_eq!(sum, 6.0);
            assert_eq!(ranks, [0, 1, 2]);
        }
    }
}

#[test]
fn a_shrink_without_a_loss_keeps_every_rank_and_shrinks_again() {
    let comms = ranks(3, TransportKind::Tcp, Duration::from_secs(20));
    let once: Vec<Communicator> = shrink_all(comms)
        .into_iter()
        .map(|(_, s)| s.unwrap())
        .collect();
    assert!(once.iter().all(|c| c.world_size() == 3));
    // A shrink of a shrink, after losing rank 0 of the first.
    let mut once = once;
    drop(once.remove(0));
    let twice: Vec<Communicator> = shrink_all(once)
        .into_iter()
        .map(|(_, s)| s.unwrap())
        .collect();
    assert_eq!(
        twice.iter().map(|c| c.world_size()).collect::<Vec<_>>(),
        [2, 2]
    );
    for (sum, ranks) in sums(twice, |r| (10 * r + 1) as f64) {
        assert_eq!(sum, 12.0);
        assert_eq!(ranks, [0, 1]);
    }
}

#[test]
fn a_silent_rank_is_left_out_and_its_late_shrink_fails() {
    let timeout = Duration::from_secs(2);
    let mut comms = ranks(3, TransportKind::Tcp, timeout);
    // Rank 2 runs but does not shrink in time.
    let late = comms.pop().unwrap();
    let t = Instant::now();
    let shrunk = shrink_all(comms);
    let waited = t.elapsed();
    assert!(waited >= timeout - Duration::from_millis(100), "{waited:?}");
    assert!(waited < timeout * 4, "{waited:?}");
    let survivors: Vec<Communicator> = shrunk.into_iter().map(|(_, s)| s.unwrap()).collect();
    assert!(survivors.iter().all(|c| c.world_size() == 2));
    // Too late: the others went on; it must not go on alone.
    let Err(e) = late.shrink() else {
        panic!("the late rank went on alone")
    };
    let msg = e.to_string();
    assert!(
        msg.contains("ranks 0, 1 running but silent") && msg.contains("shrank already"),
        "{msg}"
    );
    for (sum, _) in sums(survivors, |r| (r + 1) as f64) {
        assert_eq!(sum, 3.0);
    }
}

#[test]
fn two_ranks_with_one_silent_cannot_tell_who_is_late_and_both_retry() {
    let mut comms = ranks(2, TransportKind::Tcp, Duration::from_millis(1500));
    let silent = comms.pop().unwrap();
    let first = comms.pop().unwrap();
    let Err(e) = first.shrink() else {
        panic!("one of two went on alone")
    };
    assert!(e.to_string().contains("rank 1 running but silent"), "{e}");
    // Both shrink again: the retry finds both.
    let shrunk = shrink_all(vec![first, silent]);
    let survivors: Vec<Communicator> = shrunk.into_iter().map(|(_, s)| s.unwrap()).collect();
    for (sum, ranks) in sums(survivors, |r| (r + 1) as f64) {
        assert_eq!(sum, 3.0);
        assert_eq!(ranks, [0, 1]);
    }
}

#[test]
fn survivors_coming_at_different_times_leave_a_silent_rank_out_over_shared_memory() {
    // The last survivor comes most of a timeout after the first, and the probing of all of
    // them runs to its deadline (rank 3 is silent): the agreement and the new shared-memory
    // links still have their time.
    let timeout = Duration::from_secs(2);
    let mut comms = ranks(4, TransportKind::Auto, timeout);
    let _silent = comms.pop().unwrap();
    let survivors: Vec<Communicator> = shrink_staggered(comms, Duration::from_millis(600))
        .into_iter()
        .map(|(_, s)| s.unwrap())
        .collect();
    assert!(survivors.iter().all(|c| c.world_size() == 3));
    for (sum, ranks) in sums(survivors, |r| (r + 1) as f64) {
        assert_eq!(sum, 6.0);
        assert_eq!(ranks, [0, 1, 2]);
    }
}

#[test]
fn groups_that_cannot_shrink_say_so() {
    let errs = run_local(2, &Config::default(), |c| c.shrink().err()).unwrap();
    for e in errs {
        match e {
            Some(Error::Unavailable { what, why }) => {
                assert!(what.contains("shrink"), "{what}");
                assert!(why.contains("group of threads"), "{why}");
            }
            e => panic!("{e:?}"),
        }
    }
}
