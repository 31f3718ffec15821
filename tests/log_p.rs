//! The all-reduce algorithms whose steps grow like log2 P, forced by name
//! (`recursive-doubling`, `rabenseifner`), and the hierarchy across hosts (`hosts`, here on one
//! host; tests/multiprocess.rs places ranks on several): world sizes 1 to 9 (powers of two and the folds
//! between), every op on f32, integers and 16-bit floats, counts 0, 1, 2, primes, in place and
//! out of place, over threads, shared memory and TCP: the reference's values, the same bits on
//! every rank; and the other collectives of a communicator set to one run as `auto` does.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::MemStore;
use tutti::{bf16, Algorithm, Communicator, Config, Element, ReduceOp, TransportKind};

const TOKEN: &str = "a-token-of-32-bytes-for-the-test";

fn group(world: usize, kind: Option<TransportKind>, config: &Config) -> Vec<Communicator> {
    let Some(kind) = kind else {
        return tutti::local_group(world, config).unwrap();
    };
    let store = Arc::new(MemStore::default());
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let (store, config) = (store.clone(), config.clone());
            std::thread::spawn(move || {
                Communicator::from_store(r, world, &*store, TOKEN, "127.0.0.1", kind, &config)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect()
}

fn input<T: Element>(r: usize, n: usize) -> Vec<T> {
    (0..n)
        .map(|i| T::from_f64(((i * 7 + r * 3) % 11) as f64 - 5.0))
        .collect()
}

/// Every count and op of `T` on every rank, in place and out of place: the reference, and rank
/// 0's bits on every rank.
fn check<T: Element>(comms: &[Communicator], what: &str) {
    let p = comms.len();
    for n in [0, 1, 2, 7, 101, 1000] {
        for op in [
            ReduceOp::Sum,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Mean,
            ReduceOp::Prod,
        ] {
            if op.check(T::DTYPE).is_err() || (op == ReduceOp::Prod && p > 5) {
                continue;
            }
            let ins: Vec<Vec<T>> = (0..p).map(|r| input(r, n)).collect();
            let refs: Vec<&[T]> = ins.iter().map(|v| v.as_slice()).collect();
            let want = tutti::reference::reduce(&refs, op);
            let tol = tutti::reference::tolerance(T::DTYPE, op, p, 5.0);
            let outs: Vec<(Vec<T>, Vec<T>)> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .iter()
                    .map(|c| {
                        let mine = &ins[c.rank()];
                        s.spawn(move || {
                            let mut a = mine.clone();
                            c.all_reduce(&mut a, op).unwrap();
                            let mut b = vec![T::from_f64(0.0); n];
                            c.all_reduce_into(mine, &mut b, op).unwrap();
                            (a, b)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let bits = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
            for (r, (a, b)) in outs.iter().enumerate() {
                let at = format!("{what}, {} {op} n={n}, rank {r}", T::DTYPE);
                assert_eq!(
                    tutti::reference::count_errors(a, &want, tol),
                    0,
                    "{at} in place: {a:?}"
                );
                assert_eq!(
                    tutti::reference::count_errors(b, &want, tol),
                    0,
                    "{at} out of place"
                );
                assert_eq!(bits(a), bits(&outs[0].0), "{at}: not rank 0's bits");
                assert_eq!(bits(b), bits(&outs[0].1), "{at}: not rank 0's bits");
            }
        }
    }
}

#[test]
fn forced_log_p_algorithms_give_the_reference_everywhere() {
    for algo in [
        Algorithm::RecursiveDoubling,
        Algorithm::Rabenseifner,
        Algorithm::Hosts,
    ] {
        assert_eq!(algo.to_string().parse::<Algorithm>().unwrap(), algo);
        for (kind, worlds) in [
            (None, 1..=9),
            (Some(TransportKind::Tcp), 1..=6),
            (Some(TransportKind::Shm), 2..=5),
        ] {
            for p in worlds {
                let config = Config::default()
                    .with_timeout(Duration::from_secs(60))
                    .with_algorithm(algo);
                let comms = group(p, kind, &config);
                let what = format!("{algo} over {kind:?}, {p} ranks");
                check::<f32>(&comms, &what);
                check::<i32>(&comms, &what);
                check::<bf16>(&comms, &what);
                check::<f64>(&comms, &what);
            }
        }
    }
}

/// A communicator set to an all-reduce-only algorithm runs its other collectives as `auto`.
#[test]
fn the_other_collectives_run_as_auto() {
    let config = Config::default()
        .with_timeout(Duration::from_secs(60))
        .with_algorithm(Algorithm::Rabenseifner);
    let comms = group(3, Some(TransportKind::Tcp), &config);
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let r = c.rank() as f32;
                let mut b = [r; 5];
                c.broadcast(&mut b, 2).unwrap();
                assert_eq!(b, [2.0; 5]);
                let mut g = [0f32; 6];
                c.all_gather(&[r, r], &mut g).unwrap();
                assert_eq!(g, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
                let mut part = [0f32; 2];
                c.reduce_scatter(&[1.0; 6], &mut part, ReduceOp::Sum)
                    .unwrap();
                assert_eq!(part, [3.0; 2]);
            });
        }
    });
}
