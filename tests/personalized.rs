//! The calls where every rank sends each peer its own block (all-to-all, gather, scatter) and
//! the collectives with a count per rank: their mistakes are errors naming both ranks, on every
//! rank, before a byte is written where the ranks can tell; the values themselves are checked by
//! `tutti check` (every algorithm, dtype and transport; tests/multiprocess.rs runs it over
//! processes) and by the unit test below on threads.

use std::time::Duration;

mod common;

use tutti::{run_local, Collective, Config, Error, RawCall, ReduceOp};

fn quick() -> Config {
    Config::default().with_timeout(Duration::from_secs(20))
}

#[test]
fn every_new_call_is_right_on_threads_for_every_world_size() {
    for p in 1..=8 {
        let counts: Vec<Vec<usize>> = run_local(p, &quick(), |comm| {
            let (p, r) = (comm.world_size(), comm.rank());
            // all_to_all: block k of the output is block r of rank k's input.
            let send: Vec<u32> = (0..3 * p).map(|i| (100 * r + i) as u32).collect();
            let mut recv = vec![0u32; 3 * p];
            comm.all_to_all(&send, &mut recv).unwrap();
            let want: Vec<u32> = (0..p)
                .flat_map(|k| (0..3).map(move |i| (100 * k + 3 * r + i) as u32))
                .collect();
            assert_eq!(recv, want, "all_to_all on rank {r} of {p}");
            // all_to_all_v: rank i sends (i + j) % 3 elements to rank j.
            let c = |i: usize, j: usize| (i + j) % 3;
            let sc: Vec<usize> = (0..p).map(|j| c(r, j)).collect();
            let rc: Vec<usize> = (0..p).map(|k| c(k, r)).collect();
            let send: Vec<f64> = (0..sc.iter().sum())
                .map(|i| (r * 1000 + i) as f64)
                .collect();
            let mut recv = vec![0.0; rc.iter().sum()];
            comm.all_to_all_v(&send, &sc, &mut recv, &rc).unwrap();
            let want: Vec<f64> = (0..p)
                .flat_map(|k| {
                    let from: usize = (0..r).map(|j| c(k, j)).sum();
                    (from..from + c(k, r)).map(move |i| (k * 1000 + i) as f64)
                })
                .collect();
            assert_eq!(recv, want, "all_to_all_v on rank {r} of {p}");
            // gather and scatter from every root.
            for root in 0..p {
                let mut all = vec![0i64; 2 * p];
                let mine = [r as i64, -(r as i64)];
                comm.gather(&mine, (r == root).then_some(&mut all[..]), root)
                    .unwrap();
                if r == root {
                    let want: Vec<i64> = (0..p as i64).flat_map(|k| [k, -k]).collect();
                    assert_eq!(all, want, "gather onto {root} of {p}");
                }
                let whole: Vec<u8> = (0..2 * p as u8).map(|i| i + root as u8).collect();
                let mut part = [0u8; 2];
                comm.scatter((r == root).then_some(&whole[..]), &mut part, root)
                    .unwrap();
                assert_eq!(
                    part[..],
                    whole[2 * r..2 * r + 2],
                    "scatter from {root} of {p}"
                );
            }
            // all_gather_v and reduce_scatter_v: counts r % 3 (zeros among them).
            let counts: Vec<usize> = (0..p).map(|k| k % 3).collect();
            let total: usize = counts.iter().sum();
            let mut all = vec![0i32; total];
            comm.all_gather_v(&vec![r as i32; counts[r]], &mut all, &counts)
                .unwrap();
            let want: Vec<i32> = (0..p).flat_map(|k| vec![k as i32; counts[k]]).collect();
            assert_eq!(all, want, "all_gather_v on rank {r} of {p}");
            let send: Vec<i32> = (0..total as i32).map(|i| i + r as i32).collect();
            let mut mine = vec![0i32; counts[r]];
            comm.reduce_scatter_v(&send, &mut mine, &counts, ReduceOp::Sum)
                .unwrap();
            let at: usize = counts[..r].iter().sum();
            let sum_r: i32 = (0..p as i32).sum();
            let want: Vec<i32> = (at..at + counts[r])
                .map(|i| p as i32 * i as i32 + sum_r)
                .collect();
            assert_eq!(mine, want, "reduce_scatter_v on rank {r} of {p}");
            counts
        })
        .unwrap();
        assert_eq!(counts.len(), p);
    }
}

#[test]
fn counts_that_differ_between_ranks_are_a_mismatch_naming_both() {
    let errs = run_local(3, &quick(), |comm| {
        let r = comm.rank();
        let counts = if r == 1 { [1, 2, 2] } else { [2, 1, 2] };
        let mut out = vec![0f32; 5];
        let send = vec![1.0f32; counts[r]];
        let e = comm.all_gather_v(&send, &mut out, &counts).unwrap_err();
        assert_eq!(out, vec![0.0; 5], "nothing may be written on a mismatch");
        // The group still works.
        let mut ok = vec![0u8; 3];
        comm.all_gather_v(&[r as u8], &mut ok, &[1, 1, 1]).unwrap();
        assert_eq!(ok, [0, 1, 2]);
        e
    })
    .unwrap();
    for (rank, e) in errs.iter().enumerate() {
        match e {
            Error::Mismatch {
                site, peer, field, ..
            } => {
                assert_eq!(site.collective, Collective::AllGatherV);
                assert_eq!(site.rank, rank);
                assert_eq!(*field, "counts (digest)");
                assert_eq!(*peer, if rank == 1 { 0 } else { 1 }, "rank {rank}: {e}");
            }
            other => panic!("rank {rank}: expected Mismatch, got {other}"),
        }
    }
}

#[test]
fn all_to_all_v_pairs_that_disagree_are_named_by_both_ranks() {
    let errs = run_local(2, &quick(), |comm| {
        let r = comm.rank();
        // Rank 0 sends 3 elements to rank 1, which expects 2.
        let (sc, rc) = if r == 0 {
            ([1, 3], [1, 1])
        } else {
            ([1, 1], [2, 1])
        };
        let send = vec![7u32; sc.iter().sum()];
        let mut recv = vec![0u32; rc.iter().sum()];
        comm.all_to_all_v(&send, &sc, &mut recv, &rc).unwrap_err()
    })
    .unwrap();
    let m1 = errs[1].to_string();
    assert!(
        m1.contains("all_to_all_v")
            && m1.contains("rank 1")
            && m1.contains("rank 0 sent 12 bytes where 8 were expected"),
        "{m1}"
    );
    let m0 = errs[0].to_string();
    assert!(
        m0.contains("all_to_all_v") && m0.contains("rank 0") && m0.contains("rank 1"),
        "{m0}"
    );
}

#[test]
fn bad_arguments_fail_every_rank_at_once() {
    // (what rank 1 does wrong, what its error says)
    type Wrong = fn(&tutti::Communicator) -> tutti::Result<()>;
    let cases: [(Wrong, &str); 7] = [
        (
            |c| c.all_gather_v(&[1u8], &mut [0u8; 2], &[1, 1, 1]),
            "counts has 3 entries for a world of 2 ranks",
        ),
        (
            |c| c.reduce_scatter_v(&[1u8; 3], &mut [0u8; 2], &[1, 1], ReduceOp::Sum),
            "the input holds 3 elements but counts says 2",
        ),
        (
            |c| c.all_to_all(&[1u8; 3], &mut [0u8; 3]),
            "not a whole number of blocks for 2 ranks",
        ),
        (
            |c| c.all_to_all_v(&[1u8; 2], &[1, 1], &mut [0u8; 3], &[1, 2]),
            "send_counts[1] = 1 but recv_counts[1] = 2",
        ),
        (
            |c| c.gather(&[1u8; 2], None, 1),
            "the root needs an output buffer",
        ),
        (
            |c| c.scatter::<u8>(None, &mut [0u8; 2], 1),
            "the root needs an input buffer",
        ),
        (
            |c| c.scatter(Some(&[1u8; 2]), &mut [0u8; 2], 5),
            "root 5 is out of range for a world of 2 ranks",
        ),
    ];
    for (i, (wrong, says)) in cases.into_iter().enumerate() {
        let errs = run_local(2, &quick(), move |comm| {
            if comm.rank() == 1 {
                return wrong(comm).unwrap_err();
            }
            // Rank 0 makes the right call of the same collective (1 element per rank).
            match i {
                0 => comm.all_gather_v(&[1u8], &mut [0u8; 2], &[1, 1]),
                1 => comm.reduce_scatter_v(&[1u8; 2], &mut [0u8; 1], &[1, 1], ReduceOp::Sum),
                2 => comm.all_to_all(&[1u8; 2], &mut [0u8; 2]),
                3 => comm.all_to_all_v(&[1u8; 2], &[1, 1], &mut [0u8; 2], &[1, 1]),
                4 => comm.gather(&[1u8; 2], None, 1),
                5 => comm.scatter::<u8>(None, &mut [0u8; 2], 1),
                _ => comm.scatter::<u8>(None, &mut [0u8; 2], 1),
            }
            .unwrap_err()
        })
        .unwrap();
        let m = errs[1].to_string();
        assert!(m.contains(says) && m.contains("rank 1"), "case {i}: {m}");
        let m = errs[0].to_string();
        assert!(
            m.contains("rank 1") && (m.contains("rejected its arguments") || m.contains(says)),
            "case {i}, rank 0: {m}"
        );
    }
}

#[test]
fn raw_calls_whose_input_overlaps_the_output_are_refused() {
    let errs = run_local(2, &quick(), |comm| {
        let mut buf = vec![0u32; 4];
        let p = buf.as_mut_ptr().cast::<u8>();
        let call = RawCall {
            collective: Collective::AllToAll,
            dtype: tutti::DType::U32,
            count: 2,
            op: ReduceOp::Sum,
            root: 0,
            input: p,
            output: p,
            counts: &[],
            recv_counts: &[],
        };
        // SAFETY: buf holds the 4 elements the call names, and lives through it.
        unsafe { comm.run_raw(&call) }.unwrap_err()
    })
    .unwrap();
    for e in errs {
        assert!(e.to_string().contains("overlap"), "{e}");
    }
}

#[test]
fn raw_counts_that_overflow_are_errors_not_huge_buffers() {
    let errs = run_local(2, &quick(), |comm| {
        let counts = [usize::MAX / 2, usize::MAX / 2];
        let mut out = [0u8; 4];
        let call = RawCall {
            collective: Collective::AllGatherV,
            dtype: tutti::DType::F32,
            count: 0,
            op: ReduceOp::Sum,
            root: 0,
            input: out.as_ptr(),
            output: out.as_mut_ptr(),
            counts: &counts,
            recv_counts: &[],
        };
        // SAFETY: refused before any byte is touched.
        unsafe { comm.run_raw(&call) }.unwrap_err()
    })
    .unwrap();
    for e in errs {
        assert!(
            e.to_string()
                .contains("more f32 elements than a buffer can hold"),
            "{e}"
        );
    }
}

/// Between processes too (ranks meeting over TCP): ranks that disagree about a gather's or
/// scatter's root, or about counts whose data would still match in length, get a `Mismatch`
/// before any byte moves, not a hang or a wrong result.
#[test]
fn between_processes_roots_and_counts_that_differ_are_a_mismatch() {
    use std::sync::Arc;
    use tutti::{Communicator, TransportKind};
    let store = Arc::new(common::MemStore::default());
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                let comm = Communicator::from_store(
                    r,
                    2,
                    &*store,
                    "a-token-of-32-bytes-for-the-test",
                    "127.0.0.1",
                    TransportKind::Tcp,
                    &quick(),
                )
                .unwrap();
                let mut fields = Vec::new();
                let mut all = [0u32; 4];
                let e = comm.gather(&[1u32, 2], Some(&mut all[..]), r).unwrap_err();
                fields.push(e);
                let mut part = [0u32; 2];
                let e = comm
                    .scatter(Some(&[1u32; 4][..]), &mut part, r)
                    .unwrap_err();
                fields.push(e);
                let counts = if r == 0 { [5, 0] } else { [0, 5] };
                let mut out = [0u32; 5];
                let e = comm.all_gather_v(&vec![1u32; counts[r]], &mut out, &counts);
                fields.push(e.unwrap_err());
                // The communicator is still usable.
                let mut v = [1u32];
                comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert_eq!(v, [2]);
                fields
            })
        })
        .collect();
    for h in handles {
        let errs = h.join().unwrap();
        let fields: Vec<&str> = errs
            .iter()
            .map(|e| match e {
                Error::Mismatch { field, .. } => *field,
                other => panic!("expected a mismatch, got {other}"),
            })
            .collect();
        assert_eq!(fields, ["root", "root", "counts (digest)"]);
    }
}
