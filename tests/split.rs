//! `Communicator::split`: groups by color ordered by key, then rank; no communicator for `None`;
//! groups of threads and of processes (ranks meeting over TCP or shared memory); splits of
//! splits; two groups running at once; an error in one group leaving the other, and the
//! parent, working.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::MemStore;
use tutti::{run_local, Communicator, Config, Error, ReduceOp, TransportKind};

const TOKEN: &str = "a-token-of-32-bytes-for-the-test";

fn quick() -> Config {
    Config::default().with_timeout(Duration::from_secs(30))
}

/// What every rank sees of a split by `rank % 2` ordered by descending rank, then of a split of
/// that by `new rank < 1`, with an all-reduce of the parent ranks in each.
fn split_twice(comm: &Communicator) -> (usize, usize, i64, usize, usize, i64) {
    let r = comm.rank();
    let half = comm
        .split(Some((r % 2) as u32), -(r as i64))
        .unwrap()
        .expect("every rank has a color");
    let mut sum = [r as i64];
    half.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
    let quarter = half
        .split(Some(u32::from(half.rank() < 1)), 0)
        .unwrap()
        .expect("every rank has a color");
    let mut q = [r as i64];
    quarter.all_reduce(&mut q, ReduceOp::Sum).unwrap();
    (
        half.rank(),
        half.world_size(),
        sum[0],
        quarter.rank(),
        quarter.world_size(),
        q[0],
    )
}

fn expect_split_twice(got: &[(usize, usize, i64, usize, usize, i64)]) {
    // 5 ranks: evens {0, 2, 4} ranked 4, 2, 0; odds {1, 3} ranked 3, 1.
    let want = [
        (2, 3, 6, 1, 2, 2),
        (1, 2, 4, 0, 1, 1),
        (1, 3, 6, 0, 2, 2),
        (0, 2, 4, 0, 1, 3),
        (0, 3, 6, 0, 1, 4),
    ];
    assert_eq!(got, want);
}

#[test]
fn threads_split_by_color_and_key_and_split_again() {
    let got = run_local(5, &quick(), split_twice).unwrap();
    expect_split_twice(&got);
}

/// Ranks of `world` meeting through a store on threads of this process, as processes would.
fn ranks(world: usize, kind: TransportKind) -> Vec<Communicator> {
    let store = Arc::new(MemStore::default());
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                Communicator::from_store(r, world, &*store, TOKEN, "127.0.0.1", kind, &quick())
                    .unwrap()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn on_every_rank<T: Send + 'static>(
    comms: Vec<Communicator>,
    f: impl Fn(&Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(&c))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn processes_split_over_tcp_and_shared_memory() {
    for kind in [TransportKind::Tcp, TransportKind::Auto] {
        let got = on_every_rank(ranks(5, kind), split_twice);
        expect_split_twice(&got);
    }
}

#[test]
fn no_color_gets_no_communicator_and_the_parent_goes_on() {
    for kind in [None, Some(TransportKind::Tcp)] {
        let comms = match kind {
            None => tutti::local_group(3, &quick()).unwrap(),
            Some(k) => ranks(3, k),
        };
        let got = on_every_rank(comms, |comm| {
            let r = comm.rank();
            let sub = comm.split((r != 1).then_some(7), 0).unwrap();
            let size = sub.as_ref().map(|s| s.world_size());
            if let Some(s) = &sub {
                let mut v = [1u32];
                s.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert_eq!(v, [2]);
            }
            let mut v = [1u32];
            comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            (size, v[0])
        });
        assert_eq!(got, [(Some(2), 3), (None, 3), (Some(2), 3)], "{kind:?}");
    }
}

#[test]
fn an_error_in_one_group_leaves_the_other_and_the_parent_working() {
    for kind in [None, Some(TransportKind::Tcp)] {
        let comms = match kind {
            None => tutti::local_group(4, &quick()).unwrap(),
            Some(k) => ranks(4, k),
        };
        let got = on_every_rank(comms, |comm| {
            let r = comm.rank();
            let group = comm.split(Some((r / 2) as u32), 0).unwrap().unwrap();
            // Group 0 disagrees about a count; group 1 runs many calls at the same time.
            let mut outcomes = Vec::new();
            if r / 2 == 0 {
                let n = if r == 0 { 3 } else { 4 };
                let e = group.all_reduce(&mut vec![1.0f32; n], ReduceOp::Sum);
                outcomes.push(matches!(e, Err(Error::Mismatch { .. })));
            } else {
                for i in 0..50 {
                    let mut v = [i as f64; 16];
                    group.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                    outcomes.push(v == [2.0 * i as f64; 16]);
                }
            }
            let mut v = [r as i32];
            comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            outcomes.push(v == [6]);
            outcomes.iter().all(|&ok| ok)
        });
        assert!(got.iter().all(|&ok| ok), "{kind:?}: {got:?}");
    }
}

#[test]
fn a_split_is_checked_like_any_call() {
    let errs = run_local(2, &quick(), |comm| {
        if comm.rank() == 0 {
            comm.split(Some(0), 0).map(|_| ()).unwrap_err()
        } else {
            comm.all_reduce(&mut [0i64; 2], ReduceOp::Sum).unwrap_err()
        }
    })
    .unwrap();
    for e in errs {
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    }
}
