//! A compressed wire (`Config::with_compression`, `TUTTI_COMPRESSION=bf16|f16`): f32
//! all-reduce and reduce-scatter over TCP carry 16-bit floats, reduce in f32, stay within the
//! rounding bound of the f32 sum, and leave every rank with the same bits; over shared memory
//! and threads, and for other dtypes, nothing changes; ranks that disagree get a mismatch.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::MemStore;
use tutti::{
    bf16, f16, Algorithm, Communicator, Compression, Config, Error, ReduceOp, TransportKind,
};

const TOKEN: &str = "a-token-of-32-bytes-for-the-test";

/// Random floats in [-1, 1), a different stream per rank.
fn random(r: usize, n: usize) -> Vec<f32> {
    let mut x = 0x2545_f491_4f6c_dd1d_u64 ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `world` ranks on threads: sharing memory (`None`), or meeting through a store and
/// connected by `kind` as processes would be.
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

/// What one rank ends with: the all-reduce sum (in place), the mean (out of place), its
/// reduce-scatter slice and its reduce-scatter-v slice (rank r gets n + 3r elements).
struct Results {
    sum: Vec<f32>,
    mean: Vec<f32>,
    scattered: Vec<f32>,
    scattered_v: Vec<f32>,
}

fn v_counts(p: usize, n: usize) -> Vec<usize> {
    (0..p).map(|k| n + 3 * k).collect()
}

fn run(comms: Vec<Communicator>, n: usize) -> Vec<Results> {
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            std::thread::spawn(move || {
                let (p, r) = (comm.world_size(), comm.rank());
                let mut sum = random(r, n);
                comm.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
                let mut mean = vec![0f32; n];
                comm.all_reduce_into(&random(r, n), &mut mean, ReduceOp::Mean)
                    .unwrap();
                let mut scattered = vec![0f32; n];
                comm.reduce_scatter(&random(r + 100, n * p), &mut scattered, ReduceOp::Sum)
                    .unwrap();
                let counts = v_counts(p, n);
                let total: usize = counts.iter().sum();
                let mut scattered_v = vec![0f32; counts[r]];
                comm.reduce_scatter_v(
                    &random(r + 200, total),
                    &mut scattered_v,
                    &counts,
                    ReduceOp::Sum,
                )
                .unwrap();
                Results {
                    sum,
                    mean,
                    scattered,
                    scattered_v,
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The exact sum over ranks of `seed + r`'s inputs, and the sum of their magnitudes.
fn exact(p: usize, seed: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let inputs: Vec<Vec<f32>> = (0..p).map(|r| random(seed + r, n)).collect();
    let sum = (0..n)
        .map(|i| inputs.iter().map(|v| v[i] as f64).sum())
        .collect();
    let abs = (0..n)
        .map(|i| inputs.iter().map(|v| (v[i] as f64).abs()).sum())
        .collect();
    (sum, abs)
}

/// The largest error of `got` against `want`, relative to the magnitudes summed.
fn worst(got: &[f32], want: &[f64], abs: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .zip(abs)
        .map(|((g, w), a)| (*g as f64 - w).abs() / a.max(1e-30))
        .fold(0.0, f64::max)
}

/// Whether `x` is a value of the wire type (it came off the wire, or was rounded like it).
fn on_the_wire(c: Compression, x: f32) -> bool {
    match c {
        Compression::Bf16 => bf16::from_f32(x).to_f32() == x,
        Compression::F16 => f16::from_f32(x).to_f32() == x,
        Compression::None => true,
    }
}

#[test]
fn f32_reductions_over_tcp_travel_narrowed_and_agree_on_every_rank() {
    let n = 3001;
    for compression in [Compression::Bf16, Compression::F16] {
        // Unit roundoff of the wire type: each partial sum is rounded once per hop.
        let u = match compression {
            Compression::Bf16 => 2f64.powi(-8),
            _ => 2f64.powi(-11),
        };
        for p in 2..=5 {
            let (sum, abs) = exact(p, 0, n);
            let (scattered, scattered_abs) = exact(p, 100, n * p);
            let total: usize = v_counts(p, n).iter().sum();
            let (scattered_v, scattered_v_abs) = exact(p, 200, total);
            // Several pieces per slice, and one piece per slice.
            let chunks: &[usize] = if p > 3 { &[1 << 20] } else { &[100, 1 << 20] };
            for &chunk in chunks {
                for algo in [Algorithm::Ring, Algorithm::Auto] {
                    let at = format!("{compression}, {algo}, chunk {chunk}, {p} ranks");
                    let config = Config::default()
                        .with_timeout(Duration::from_secs(60))
                        .with_chunk_bytes(chunk)
                        .with_algorithm(algo)
                        .with_compression(compression);
                    let got = run(group(p, Some(TransportKind::Tcp), &config), n);
                    let bound = u * (p as f64 + 1.0);
                    for (r, g) in got.iter().enumerate() {
                        assert!(
                            g.sum
                                .iter()
                                .map(|x| x.to_bits())
                                .eq(got[0].sum.iter().map(|x| x.to_bits())),
                            "{at}: rank {r}'s sum differs from rank 0's"
                        );
                        assert!(
                            g.mean
                                .iter()
                                .map(|x| x.to_bits())
                                .eq(got[0].mean.iter().map(|x| x.to_bits())),
                            "{at}: rank {r}'s mean differs from rank 0's"
                        );
                        if algo == Algorithm::Ring {
                            assert!(
                                g.sum.iter().all(|&x| on_the_wire(compression, x)),
                                "{at}: rank {r}'s sum has values the wire cannot carry"
                            );
                        }
                        let e = worst(&g.sum, &sum, &abs);
                        assert!(
                            e <= bound,
                            "{at}: rank {r}'s sum is off by {e:e} (bound {bound:e})"
                        );
                        let mean: Vec<f64> = sum.iter().map(|s| s / p as f64).collect();
                        let mean_abs: Vec<f64> = abs.iter().map(|s| s / p as f64).collect();
                        let e = worst(&g.mean, &mean, &mean_abs);
                        assert!(e <= bound, "{at}: rank {r}'s mean is off by {e:e}");
                        let e = worst(
                            &g.scattered,
                            &scattered[r * n..(r + 1) * n],
                            &scattered_abs[r * n..(r + 1) * n],
                        );
                        assert!(
                            e <= bound,
                            "{at}: rank {r}'s reduce_scatter is off by {e:e}"
                        );
                        let off: usize = v_counts(p, n)[..r].iter().sum();
                        let want = off..off + g.scattered_v.len();
                        let e = worst(
                            &g.scattered_v,
                            &scattered_v[want.clone()],
                            &scattered_v_abs[want],
                        );
                        assert!(
                            e <= bound,
                            "{at}: rank {r}'s reduce_scatter_v is off by {e:e}"
                        );
                    }
                    // The ring narrows: its sum is not the f32 sum's bits.
                    if algo == Algorithm::Ring {
                        let f32_sum = f32_ring_sum(p, n);
                        assert_ne!(got[0].sum, f32_sum, "{at}: the sum has the f32 ring's bits");
                    }
                }
            }
        }
    }
}

/// The uncompressed ring's sum over TCP.
fn f32_ring_sum(p: usize, n: usize) -> Vec<f32> {
    let config = Config::default()
        .with_timeout(Duration::from_secs(60))
        .with_algorithm(Algorithm::Ring);
    run(group(p, Some(TransportKind::Tcp), &config), n)
        .swap_remove(0)
        .sum
}

/// Over shared memory and between threads, f32 travels as f32: the bits of the uncompressed
/// run. Over TCP, f64 and bf16 are never converted.
#[test]
fn memory_links_and_other_dtypes_are_not_compressed() {
    let (p, n) = (3, 2048);
    let plain = Config::default()
        .with_timeout(Duration::from_secs(60))
        .with_algorithm(Algorithm::Ring);
    let narrowed = plain.clone().with_compression(Compression::Bf16);
    for kind in [None, Some(TransportKind::Shm)] {
        let a = run(group(p, kind, &plain), n);
        let b = run(group(p, kind, &narrowed), n);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.sum, y.sum, "{kind:?}");
            assert_eq!(x.scattered, y.scattered, "{kind:?}");
        }
    }
    let sums = |config: &Config| -> Vec<(Vec<f64>, Vec<bf16>)> {
        let comms = group(p, Some(TransportKind::Tcp), config);
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                std::thread::spawn(move || {
                    let r = comm.rank();
                    let mut d: Vec<f64> = random(r, n).iter().map(|&x| x as f64 / 3.0).collect();
                    comm.all_reduce(&mut d, ReduceOp::Sum).unwrap();
                    let mut h: Vec<bf16> =
                        random(r, n).iter().map(|&x| bf16::from_f32(x)).collect();
                    comm.all_reduce(&mut h, ReduceOp::Sum).unwrap();
                    (d, h)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    };
    assert_eq!(sums(&plain), sums(&narrowed));
}

#[test]
fn ranks_that_disagree_about_the_wire_get_a_mismatch() {
    let store = Arc::new(MemStore::default());
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                let wire = if r == 1 {
                    Compression::F16
                } else {
                    Compression::Bf16
                };
                let config = Config::default()
                    .with_timeout(Duration::from_secs(20))
                    .with_compression(wire);
                let comm = Communicator::from_store(
                    r,
                    2,
                    &*store,
                    TOKEN,
                    "127.0.0.1",
                    TransportKind::Tcp,
                    &config,
                )
                .unwrap();
                comm.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum)
                    .unwrap_err()
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        match h.join().unwrap() {
            Error::Mismatch {
                field,
                peer,
                mine,
                theirs,
                ..
            } => {
                assert_eq!(field, "wire compression (TUTTI_COMPRESSION)");
                assert_eq!(peer, 1 - r);
                assert_eq!(
                    (mine.as_str(), theirs.as_str()),
                    if r == 0 {
                        ("bf16", "f16")
                    } else {
                        ("f16", "bf16")
                    }
                );
            }
            other => panic!("rank {r}: expected a mismatch, got {other}"),
        }
    }
}

#[test]
fn compression_names_parse_and_exclude_deterministic_mode() {
    assert_eq!("bf16".parse::<Compression>().unwrap(), Compression::Bf16);
    assert_eq!("F16".parse::<Compression>().unwrap(), Compression::F16);
    assert_eq!("none".parse::<Compression>().unwrap(), Compression::None);
    let e = "int8".parse::<Compression>().unwrap_err();
    assert!(e.contains("int8") && e.contains("bf16"), "{e}");
    let config = Config::default()
        .with_deterministic(true)
        .with_compression(Compression::Bf16);
    let e = tutti::local_group(2, &config)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("compression bf16") && e.contains("deterministic"),
        "{e}"
    );
}
