//! Bitwise-deterministic mode (`Config::with_deterministic`, `TUTTI_DETERMINISTIC=1`): every
//! reducing collective gives, on every rank, the bits of the reduction of the inputs in rank
//! order, whatever the algorithm, chunk size, transport and world size; without the mode the
//! ring's bits differ. Over processes and two simulated hosts, tests/multiprocess.rs runs
//! `tutti check` in the mode, which checks the same on random floats.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::MemStore;
use tutti::kernels::{self, Init};
use tutti::{Algorithm, Communicator, Config, Error, ReduceOp, TransportKind};

const TOKEN: &str = "a-token-of-32-bytes-for-the-test";

/// Random floats whose sum's bits depend on the order of the additions: magnitudes from 2^-12
/// to 2^12, both signs.
fn random(r: usize, n: usize) -> Vec<f32> {
    let mut x = 0x2545_f491_4f6c_dd1d_u64 ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let unit = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            unit * 2f32.powi((x % 25) as i32 - 12)
        })
        .collect()
}

/// The reduction the mode promises: one kernel pass over rank 0's input, rank 1's, ...
fn in_rank_order(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<u32> {
    let mut out = vec![0f32; inputs[0].len()];
    let srcs: Vec<&[u8]> = inputs.iter().map(|v| bytemuck::cast_slice(v)).collect();
    let div = (op == ReduceOp::Mean).then_some(inputs.len());
    let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
    kernels::reduce(tutti::DType::F32, op, dst, &srcs, Init::Overwrite, div);
    out.iter().map(|x| x.to_bits()).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
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

/// Every rank's all-reduce (sum in place and mean out of place), reduce onto the last rank and
/// reduce-scatter, as bits, for every algorithm the world can run.
fn run_all(comms: Vec<Communicator>, n: usize) -> Vec<Vec<(String, Vec<u32>)>> {
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut comm| {
            std::thread::spawn(move || {
                let (p, r) = (comm.world_size(), comm.rank());
                let mut got = Vec::new();
                for algo in Algorithm::ALL_REDUCE {
                    if comm.set_algorithm(algo).is_err()
                        || (algo == Algorithm::Direct && !comm.has_peer_memory())
                    {
                        continue;
                    }
                    let mut buf = random(r, n);
                    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    got.push((format!("{algo} all_reduce sum"), bits(&buf)));
                    let mut out = vec![0f32; n];
                    comm.all_reduce_into(&random(r, n), &mut out, ReduceOp::Mean)
                        .unwrap();
                    got.push((format!("{algo} all_reduce mean"), bits(&out)));
                    let mut root = vec![0f32; n];
                    let recv = (r == p - 1).then_some(&mut root[..]);
                    comm.reduce(&random(r, n), recv, ReduceOp::Sum, p - 1)
                        .unwrap();
                    if r == p - 1 {
                        got.push((format!("{algo} reduce"), bits(&root)));
                    }
                    let mut slice = vec![0f32; n];
                    comm.reduce_scatter(&random(r + 100, n * p), &mut slice, ReduceOp::Sum)
                        .unwrap();
                    got.push((format!("{algo} reduce_scatter"), bits(&slice)));
                }
                got
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn every_algorithm_chunk_transport_and_world_gives_the_bits_in_rank_order() {
    let n = 1009;
    let transports = [None, Some(TransportKind::Tcp), Some(TransportKind::Auto)];
    for p in 2..=8 {
        let inputs: Vec<Vec<f32>> = (0..p).map(|r| random(r, n)).collect();
        let sum = in_rank_order(&inputs, ReduceOp::Sum);
        let mean = in_rank_order(&inputs, ReduceOp::Mean);
        let big: Vec<Vec<f32>> = (0..p).map(|r| random(r + 100, n * p)).collect();
        let scattered = in_rank_order(&big, ReduceOp::Sum);
        for kind in transports {
            // Worlds past 4 over sockets only at one chunk size: the machine has 2 cores.
            let chunks: &[usize] = if kind.is_some() && p > 4 {
                &[1 << 20]
            } else {
                &[12, 1000, 1 << 20]
            };
            for &chunk in chunks {
                let config = Config::default()
                    .with_timeout(Duration::from_secs(60))
                    .with_chunk_bytes(chunk)
                    .with_deterministic(true);
                let comms = group(p, kind, &config);
                for (r, got) in run_all(comms, n).into_iter().enumerate() {
                    assert!(got.len() >= 3 * 4, "{kind:?} p={p}: {}", got.len());
                    for (what, b) in got {
                        let want = if what.ends_with("mean") {
                            &mean[..]
                        } else if what.ends_with("reduce_scatter") {
                            &scattered[r * n..(r + 1) * n]
                        } else {
                            &sum[..]
                        };
                        assert!(
                            b == want,
                            "{what}, {kind:?}, chunk {chunk}, rank {r} of {p}: not the bits in rank order"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn without_the_mode_the_ring_sums_in_another_order() {
    let (p, n) = (4, 4099);
    let inputs: Vec<Vec<f32>> = (0..p).map(|r| random(r, n)).collect();
    let want = in_rank_order(&inputs, ReduceOp::Sum);
    let config = Config::default()
        .with_timeout(Duration::from_secs(60))
        .with_algorithm(Algorithm::Ring);
    let comms = group(p, Some(TransportKind::Tcp), &config);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            std::thread::spawn(move || {
                let mut buf = random(comm.rank(), 4099);
                comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                bits(&buf)
            })
        })
        .collect();
    let got: Vec<Vec<u32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // Each slice is summed starting from a different rank: the same sum, other bits.
    let differ = got[0].iter().zip(&want).filter(|(a, b)| a != b).count();
    assert!(
        differ > 0,
        "the ring happened to sum every element in rank order"
    );
}

#[test]
fn ranks_that_disagree_about_the_mode_get_a_mismatch() {
    let store = Arc::new(MemStore::default());
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                let config = Config::default()
                    .with_timeout(Duration::from_secs(20))
                    .with_deterministic(r == 1);
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
            Error::Mismatch { field, peer, .. } => {
                assert_eq!(field, "deterministic mode (TUTTI_DETERMINISTIC)");
                assert_eq!(peer, 1 - r);
            }
            other => panic!("rank {r}: expected a mismatch, got {other}"),
        }
    }
}

#[test]
fn perf_measures_the_mode() {
    let out = std::process::Command::new(common::tutti_bin())
        .args([
            "perf",
            "-n",
            "3",
            "-b",
            "1K",
            "-e",
            "64K",
            "--deterministic",
            "--json",
        ])
        .env_remove("TUTTI_DETERMINISTIC")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = text.lines().filter(|l| l.contains("\"errors\"")).collect();
    assert!(rows.len() >= 4, "{text}");
    assert!(rows.iter().all(|l| l.contains("\"errors\":0")), "{text}");
    assert!(
        rows.iter().all(|l| l.contains("\"deterministic\":true")),
        "{text}"
    );
}
