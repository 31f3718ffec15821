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
                    // Every op defined on the dtype (bitwise ones on the integer types).
                    for op in ReduceOp::ALL.into_iter().filter(|o| o.check(dtype).is_ok()) {
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
                        for op in ReduceOp::ALL.into_iter().filter(|o| !o.is_bitwise()) {
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

/// Rank r's `count` elements of `T` with every bit of the type in play (the small values of
/// `data` leave the high bits of the wide types alone).
fn bits<T: Element>(r: usize, count: usize) -> Vec<T> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (r as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mut v = vec![T::from_f64(0.0); count];
    for b in bytemuck::cast_slice_mut::<T, u8>(&mut v) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 29) as u8;
    }
    v
}

const BITWISE: [ReduceOp; 3] = [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor];
/// The integer types: those the bitwise ops are defined on.
fn integers() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|d| !d.is_float())
}

/// All-reduce (in place, out of place, in flight), reduce at every root and reduce-scatter of
/// the bitwise ops on one integer type, exactly equal to the reference.
fn check_bitwise<T: Element>(
    comm: &tutti::Communicator,
    world: usize,
    op: ReduceOp,
    count: usize,
    what: &str,
) {
    let r = comm.rank();
    let inputs: Vec<Vec<T>> = (0..world).map(|k| bits::<T>(k, count)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference(&refs, op);
    let mut buf = inputs[r].clone();
    comm.all_reduce(&mut buf, op)
        .unwrap_or_else(|e| panic!("all_reduce {what}: {e}"));
    assert_eq!(buf, want, "all_reduce in place {what}");
    let mut out = vec![T::from_f64(0.0); count];
    comm.all_reduce_into(&inputs[r], &mut out, op)
        .unwrap_or_else(|e| panic!("all_reduce_into {what}: {e}"));
    assert_eq!(out, want, "all_reduce_into {what}");
    let got = comm
        .all_reduce_async(inputs[r].clone(), op)
        .wait()
        .unwrap_or_else(|e| panic!("all_reduce_async {what}: {e}"));
    assert_eq!(got, want, "all_reduce_async {what}");
    for root in 0..world {
        let mut out = vec![T::from_f64(0.0); count];
        let recv = (r == root).then_some(&mut out[..]);
        comm.reduce(&inputs[r], recv, op, root)
            .unwrap_or_else(|e| panic!("reduce root {root} {what}: {e}"));
        if r == root {
            assert_eq!(out, want, "reduce root {root} {what}");
        }
    }
    let big: Vec<Vec<T>> = (0..world)
        .map(|k| bits::<T>(k + 7, count * world))
        .collect();
    let big_refs: Vec<&[T]> = big.iter().map(|v| v.as_slice()).collect();
    let full = reference(&big_refs, op);
    let mut out = vec![T::from_f64(0.0); count];
    comm.reduce_scatter(&big[r], &mut out, op)
        .unwrap_or_else(|e| panic!("reduce_scatter {what}: {e}"));
    assert_eq!(
        out,
        full[r * count..(r + 1) * count],
        "reduce_scatter {what}"
    );
}

/// The bitwise ops × every integer type × world 1..4 × every algorithm, against the reference.
#[test]
fn bitwise_ops_on_every_integer_type() {
    // The reference itself, on values whose answer is known.
    assert_eq!(
        reference(&[&[0b1100u8][..], &[0b1010u8][..]], ReduceOp::BXor),
        [0b0110]
    );
    assert_eq!(
        reference(&[&[-1i64, 6][..], &[i64::MIN, 3][..]], ReduceOp::BAnd),
        [i64::MIN, 2]
    );
    assert_eq!(
        reference(&[&[1u32 << 31][..], &[1][..], &[4][..]], ReduceOp::BOr),
        [(1u32 << 31) | 5]
    );
    for algo in Algorithm::ALL_REDUCE {
        for world in 1..=4 {
            let config = Config::default()
                .with_algorithm(algo)
                .with_chunk_bytes(CHUNK);
            run_local(world, &config, |comm| {
                for dtype in integers() {
                    for op in BITWISE {
                        for count in [0, 1, 13, 1031] {
                            let what = format!("{algo} P={world} {dtype} {op} n={count} rank {}", comm.rank());
                            tutti::for_each_dtype!(dtype, T => { check_bitwise::<T>(comm, world, op, count, &what) });
                        }
                    }
                }
            })
            .unwrap();
        }
    }
}

/// A bitwise op on a float type is an argument error naming the op and the type, on the rank
/// that made it, before anything is sent: the others get an error naming that rank, nobody
/// waits for the timeout, and the communicator goes on working.
#[test]
fn bitwise_ops_on_floats_are_refused_on_every_rank() {
    let world = 3;
    let config = Config::default().with_timeout(std::time::Duration::from_secs(60));
    let t = std::time::Instant::now();
    run_local(world, &config, |comm| {
        let r = comm.rank();
        let own = |e: &tutti::Error, want: &str| {
            assert!(
                matches!(e, tutti::Error::InvalidArgument { site: Some(s), .. } if s.rank == r),
                "rank {r}: {e:?}"
            );
            assert!(e.to_string().contains(want), "rank {r}: {e}");
        };
        // Every rank makes the mistake.
        let e = comm
            .all_reduce(&mut [1.5f32; 4], ReduceOp::BAnd)
            .unwrap_err();
        own(&e, "band is defined on integer types only, not f32");
        let e = comm
            .reduce_scatter(
                &[tutti::bf16::ONE; 6],
                &mut [tutti::bf16::ZERO; 2],
                ReduceOp::BOr,
            )
            .unwrap_err();
        own(&e, "bor is defined on integer types only, not bf16");
        let e = comm
            .reduce(
                &[1.0f64; 2],
                Some(&mut [0.0f64; 2][..]).filter(|_| r == 1),
                ReduceOp::BXor,
                1,
            )
            .unwrap_err();
        own(&e, "bxor is defined on integer types only, not f64");
        let e = comm
            .all_reduce_async(vec![tutti::f16::ONE; 5], ReduceOp::BXor)
            .wait()
            .unwrap_err();
        own(&e, "bxor is defined on integer types only, not f16");
        // One rank makes it: it is told why, the others which rank refused.
        let op = if r == 1 {
            ReduceOp::BAnd
        } else {
            ReduceOp::Sum
        };
        let e = comm.all_reduce(&mut [1.0f32; 4], op).unwrap_err();
        if r == 1 {
            own(&e, "band is defined on integer types only, not f32");
        } else {
            assert!(
                matches!(e, tutti::Error::PeerRejected { peer: 1, .. }),
                "rank {r}: {e:?}"
            );
            assert!(
                e.to_string()
                    .contains("band is defined on integer types only, not f32"),
                "rank {r}: {e}"
            );
        }
        // Still usable, with the same op on an integer type.
        let mut ok = [0b0110u32 << r];
        comm.all_reduce(&mut ok, ReduceOp::BOr).unwrap();
        assert_eq!(ok, [0b0110 | 0b1100 | 0b11000]);
    })
    .unwrap();
    assert!(
        t.elapsed() < std::time::Duration::from_secs(20),
        "refused calls must not wait for the timeout"
    );
}
