//! Every algorithm against the naive reference: world sizes 1..8 × every dtype × every op ×
//! counts {0, 1, 7, 13, 1000, a prime above the chunk size}, in place and out of place.

mod common;

use common::data;
use tutti::reference::{count_errors, reduce as reference, tolerance};
use tutti::{run_local, Algorithm, Config, DType, Element, ReduceOp};

/// Small chunks so that the chunked paths have many pieces; 1031 is a prime above 1024 bytes
/// for every dtype.
const CHUNK: usize = 1024;
const COUNTS: [usize; 6] = [0, 1, 7, 13, 1000, 1031];

fn check_all_reduce<T: Element>(
    comm: &tutti::Communicator,
    world: usize,
    op: ReduceOp,
    count: usize,
    what: &str,
) {
    let inputs: Vec<Vec<T>> = (0..world).map(|r| data::<T>(r, count)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference(&refs, op);
    let tol = tolerance(T::DTYPE, op, world, 4.0);
    // In place.
    let mut buf = inputs[comm.rank()].clone();
    comm.all_reduce(&mut buf, op)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let bad = count_errors(&buf, &want, tol);
    assert_eq!(
        bad,
        0,
        "{what} in place: {bad} wrong of {count}: got {:?} want {:?}",
        &buf[..count.min(8)],
        &want[..count.min(8)]
    );
    // Out of place; the input must be left alone.
    let mut out = vec![T::from_f64(9.0); count];
    comm.all_reduce_into(&inputs[comm.rank()], &mut out, op)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(count_errors(&out, &want, tol), 0, "{what} out of place");
}

#[test]
fn all_reduce_matrix() {
    for algo in Algorithm::ALL_REDUCE {
        for world in 1..=8 {
            let config = Config::default()
                .with_algorithm(algo)
                .with_chunk_bytes(CHUNK);
            run_local(world, &config, |comm| {
                for dtype in DType::ALL {
                    for op in ReduceOp::ALL {
                        for count in COUNTS {
                            let what = format!("{algo} P={world} {dtype} {op} n={count} rank {}", comm.rank());
                            tutti::for_each_dtype!(dtype, T => { check_all_reduce::<T>(comm, world, op, count, &what) });
                        }
                    }
                }
            })
            .unwrap();
        }
    }
}

#[test]
fn all_reduce_default_chunk_and_hierarchical_groups() {
    // A prime above the default 256 KiB chunk (in f32 elements), and group sizes other than 2.
    for algo in [
        Algorithm::Auto,
        Algorithm::Ring,
        Algorithm::HierarchicalCopy { group_size: 3 },
        Algorithm::HierarchicalCopy { group_size: 1 },
        Algorithm::ReduceToOne { root: 2 },
    ] {
        for world in [3, 4, 7] {
            let config = Config::default().with_algorithm(algo);
            run_local(world, &config, |comm| {
                for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                    check_all_reduce::<f32>(
                        comm,
                        world,
                        op,
                        65_537,
                        &format!("{algo} P={world} {op}"),
                    );
                    check_all_reduce::<i32>(
                        comm,
                        world,
                        op,
                        65_537,
                        &format!("{algo} P={world} {op}"),
                    );
                }
            })
            .unwrap();
        }
    }
}

#[test]
fn float_values_that_round() {
    // Values that are not exact: results agree with the f64 reference within the stated tolerance.
    for algo in Algorithm::ALL_REDUCE {
        for world in [2, 5, 8] {
            let config = Config::default()
                .with_algorithm(algo)
                .with_chunk_bytes(CHUNK);
            run_local(world, &config, |comm| {
                let r = comm.rank();
                let mk = |r: usize| -> Vec<f64> {
                    (0..4099)
                        .map(|i| ((i * 31 + r * 17) as f64).sin() * 3.0)
                        .collect()
                };
                macro_rules! go {
                    ($t:ty) => {{
                        let inputs: Vec<Vec<$t>> = (0..world)
                            .map(|k| mk(k).into_iter().map(<$t>::from_f64).collect())
                            .collect();
                        let refs: Vec<&[$t]> = inputs.iter().map(|v| v.as_slice()).collect();
                        for op in ReduceOp::ALL {
                            let want = reference(&refs, op);
                            let mut buf = inputs[r].clone();
                            comm.all_reduce(&mut buf, op).unwrap();
                            let tol = tolerance(<$t as Element>::DTYPE, op, world, 3.0);
                            assert_eq!(
                                count_errors(&buf, &want, tol),
                                0,
                                "{algo} P={world} {op} {}",
                                stringify!($t)
                            );
                        }
                    }};
                }
                go!(f32);
                go!(f64);
                go!(tutti::f16);
                go!(tutti::bf16);
            })
            .unwrap();
        }
    }
}

#[test]
fn broadcast_all_gather_reduce_scatter_reduce_exact() {
    let algos = [
        Algorithm::Auto,
        Algorithm::Direct,
        Algorithm::Ring,
        Algorithm::ReduceToOne { root: 0 },
    ];
    for algo in algos {
        for world in 1..=8 {
            let config = Config::default()
                .with_algorithm(algo)
                .with_chunk_bytes(CHUNK);
            run_local(world, &config, |comm| {
                let r = comm.rank();
                for count in COUNTS {
                    let what = format!("{algo} P={world} n={count} rank {r}");
                    // Broadcast: every root, its values exactly.
                    for root in 0..world {
                        let mut buf = if r == root {
                            data::<i32>(root, count)
                        } else {
                            vec![-99; count]
                        };
                        comm.broadcast(&mut buf, root)
                            .unwrap_or_else(|e| panic!("broadcast {what}: {e}"));
                        assert_eq!(
                            buf,
                            data::<i32>(root, count),
                            "broadcast root {root} {what}"
                        );
                    }
                    // Reduce at every root, exactly; other ranks' inputs untouched.
                    for root in 0..world {
                        let input = data::<i64>(r, count);
                        let inputs: Vec<Vec<i64>> = (0..world).map(|k| data(k, count)).collect();
                        let refs: Vec<&[i64]> = inputs.iter().map(|v| v.as_slice()).collect();
                        let want = reference(&refs, ReduceOp::Sum);
                        let mut out = vec![7i64; count];
                        let recv = (r == root).then_some(&mut out[..]);
                        comm.reduce(&input, recv, ReduceOp::Sum, root)
                            .unwrap_or_else(|e| panic!("reduce {what}: {e}"));
                        if r == root {
                            assert_eq!(out, want, "reduce root {root} {what}");
                        }
                        let mut buf = input.clone();
                        comm.reduce_in_place(&mut buf, ReduceOp::Sum, root).unwrap();
                        assert_eq!(
                            buf,
                            if r == root { want } else { input },
                            "reduce in place root {root} {what}"
                        );
                    }
                    if matches!(algo, Algorithm::ReduceToOne { .. }) {
                        continue;
                    }
                    // All-gather: rank order, exactly; in place too.
                    let mut out = vec![0u8; count * world];
                    comm.all_gather(&data::<u8>(r, count), &mut out)
                        .unwrap_or_else(|e| panic!("all_gather {what}: {e}"));
                    let want: Vec<u8> = (0..world).flat_map(|k| data::<u8>(k, count)).collect();
                    assert_eq!(out, want, "all_gather {what}");
                    let mut buf = vec![0u8; count * world];
                    buf[r * count..(r + 1) * count].copy_from_slice(&data::<u8>(r, count));
                    comm.all_gather_in_place(&mut buf).unwrap();
                    assert_eq!(buf, want, "all_gather in place {what}");
                    // Reduce-scatter: slice r of the reduction, exactly.
                    for op in ReduceOp::ALL {
                        let inputs: Vec<Vec<i32>> =
                            (0..world).map(|k| data(k, count * world)).collect();
                        let refs: Vec<&[i32]> = inputs.iter().map(|v| v.as_slice()).collect();
                        let full = reference(&refs, op);
                        let mut out = vec![0i32; count];
                        comm.reduce_scatter(&inputs[r], &mut out, op)
                            .unwrap_or_else(|e| panic!("reduce_scatter {what}: {e}"));
                        assert_eq!(
                            out,
                            full[r * count..(r + 1) * count],
                            "reduce_scatter {op} {what}"
                        );
                    }
                }
            })
            .unwrap();
        }
    }
}
