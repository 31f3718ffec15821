//! Long runs on one communicator, and the one-call per-replica form.

mod common;

use common::data;
use tutti::reference::reduce as reference;
use tutti::{run_local, Algorithm, Config, ReduceOp, Replicas};

#[test]
fn thousand_mixed_collectives_back_to_back() {
    for (world, algo) in [
        (4, Algorithm::Auto),
        (3, Algorithm::Ring),
        (5, Algorithm::HierarchicalCopy { group_size: 2 }),
    ] {
        let config = Config::default()
            .with_algorithm(algo)
            .with_chunk_bytes(4096);
        run_local(world, &config, |comm| {
            let r = comm.rank();
            for i in 0..1000usize {
                let count = (i * 7919) % 3001;
                match i % 5 {
                    0 | 1 => {
                        let inputs: Vec<Vec<f64>> =
                            (0..world).map(|k| data(k + i, count)).collect();
                        let refs: Vec<&[f64]> = inputs.iter().map(|v| v.as_slice()).collect();
                        let op = ReduceOp::ALL[i % 5 + (i / 5) % 3];
                        let mut buf = inputs[r].clone();
                        comm.all_reduce(&mut buf, op).unwrap();
                        assert_eq!(buf, reference(&refs, op), "call {i}");
                    }
                    2 => {
                        let root = i % world;
                        let mut buf = if r == root {
                            data::<i32>(i, count)
                        } else {
                            vec![0; count]
                        };
                        comm.broadcast(&mut buf, root).unwrap();
                        assert_eq!(buf, data::<i32>(i, count), "call {i}");
                    }
                    3 => {
                        let mut out = vec![0u8; count * world];
                        comm.all_gather(&data::<u8>(r + i, count), &mut out)
                            .unwrap();
                        let want: Vec<u8> =
                            (0..world).flat_map(|k| data::<u8>(k + i, count)).collect();
                        assert_eq!(out, want, "call {i}");
                    }
                    _ => {
                        let inputs: Vec<Vec<i64>> =
                            (0..world).map(|k| data(k, count * world)).collect();
                        let refs: Vec<&[i64]> = inputs.iter().map(|v| v.as_slice()).collect();
                        let mut out = vec![0i64; count];
                        comm.reduce_scatter(&inputs[r], &mut out, ReduceOp::Sum)
                            .unwrap();
                        assert_eq!(
                            out,
                            reference(&refs, ReduceOp::Sum)[r * count..(r + 1) * count],
                            "call {i}"
                        );
                    }
                }
            }
        })
        .unwrap();
    }
}

#[test]
fn replicas_one_call_form() {
    for algo in Algorithm::ALL_REDUCE {
        let reps = Replicas::new(4, &Config::default().with_algorithm(algo)).unwrap();
        for round in 0..50 {
            let count = 1 + round * 37;
            let inputs: Vec<Vec<f32>> = (0..4).map(|k| data(k + round, count)).collect();
            let refs: Vec<&[f32]> = inputs.iter().map(|v| v.as_slice()).collect();
            let want = reference(&refs, ReduceOp::Mean);
            let mut bufs = inputs.clone();
            let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            reps.all_reduce(&mut views, ReduceOp::Mean).unwrap();
            for b in &bufs {
                assert_eq!(b, &want, "{algo} round {round}");
            }
            let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            views[2].copy_from_slice(&inputs[2]);
            reps.broadcast(&mut views, 2).unwrap();
            assert!(bufs.iter().all(|b| b == &inputs[2]));
            let mut out = vec![0f32; count];
            reps.reduce(&refs, &mut out, ReduceOp::Sum).unwrap();
            assert_eq!(out, reference(&refs, ReduceOp::Sum));
            let mut outs = vec![vec![0f32; 4 * count]; 4];
            let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|b| b.as_mut_slice()).collect();
            reps.all_gather(&refs, &mut views).unwrap();
            assert!(outs.iter().all(|o| o == &inputs.concat()));
        }
    }
}
