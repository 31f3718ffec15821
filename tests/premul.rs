//! The pre-multiplied sum: each rank's input scaled by its own factor, then summed, for every
//! element type, in place and out of place, all-reduce and reduce-scatter; a factor an integer
//! type cannot hold is an argument error every rank sees, with the buffers left as they were.

use std::time::Duration;

use tutti::{run_local, Config, DType, Element, Error};

fn quick() -> Config {
    Config::default().with_timeout(Duration::from_secs(20))
}

/// Rank r's factor: r + 1 (a whole number: exact in every type).
fn factor(r: usize) -> f64 {
    (r + 1) as f64
}

fn check<T: Element>(p: usize) {
    let n = 7 * p;
    let got = run_local(p, &quick(), move |c| {
        let r = c.rank();
        let input: Vec<T> = (0..n).map(|i| T::from_f64(((i + r) % 4) as f64)).collect();
        let mut in_place = input.clone();
        c.all_reduce_premul_sum(&mut in_place, factor(r)).unwrap();
        let mut out = vec![T::from_f64(0.0); n];
        c.all_reduce_premul_sum_raw(
            T::DTYPE,
            Some(bytemuck::cast_slice(&input)),
            bytemuck::cast_slice_mut(&mut out),
            factor(r),
        )
        .unwrap();
        let mut part = vec![T::from_f64(0.0); n / p];
        c.reduce_scatter_premul_sum(&input, &mut part, factor(r))
            .unwrap();
        // Non-blocking, both in flight, waited in reverse order.
        let sum = c.all_reduce_premul_sum_async(input.clone(), factor(r));
        let slice = c.reduce_scatter_premul_sum_async(
            input.clone(),
            vec![T::from_f64(0.0); n / p],
            factor(r),
        );
        let (_, part_async) = slice.wait().unwrap();
        let sum = sum.wait().unwrap();
        assert_eq!(
            part_async,
            part,
            "{} rank {r}: async reduce_scatter",
            T::DTYPE
        );
        assert_eq!(sum, in_place, "{} rank {r}: async all_reduce", T::DTYPE);
        (in_place, out, part)
    })
    .unwrap();
    let want: Vec<f64> = (0..n)
        .map(|i| (0..p).map(|r| factor(r) * ((i + r) % 4) as f64).sum())
        .collect();
    for (r, (in_place, out, part)) in got.iter().enumerate() {
        let f = |v: &[T]| v.iter().map(|x| x.to_f64()).collect::<Vec<_>>();
        assert_eq!(f(in_place), want, "{} in place, rank {r} of {p}", T::DTYPE);
        assert_eq!(f(out), want, "{} out of place, rank {r} of {p}", T::DTYPE);
        let slice = &want[r * (n / p)..(r + 1) * (n / p)];
        assert_eq!(
            f(part),
            slice,
            "{} reduce_scatter, rank {r} of {p}",
            T::DTYPE
        );
    }
}

#[test]
fn every_dtype_sums_each_ranks_scaled_input() {
    for p in 1..=4 {
        check::<f32>(p);
        check::<f64>(p);
        check::<tutti::f16>(p);
        check::<tutti::bf16>(p);
        check::<i8>(p);
        check::<u8>(p);
        check::<i32>(p);
        check::<u32>(p);
        check::<i64>(p);
        check::<u64>(p);
    }
}

#[test]
fn fractional_factors_scale_floats_as_the_type_multiplies() {
    let got = run_local(3, &quick(), |c| {
        let mut g = vec![3.0f32, -1.5, 1e-3];
        c.all_reduce_premul_sum(&mut g, 1.0 / 3.0).unwrap();
        g
    })
    .unwrap();
    let third = 1.0f32 / 3.0;
    let want: Vec<f32> = [3.0f32, -1.5, 1e-3]
        .iter()
        .map(|&x| (x * third) + (x * third) + (x * third))
        .collect();
    for g in got {
        assert_eq!(g, want);
    }
}

#[test]
fn a_factor_an_integer_type_cannot_hold_is_refused_on_every_rank() {
    let got = run_local(2, &quick(), |c| {
        let mut v = vec![5i32; 4];
        // Rank 1 passes a fraction; rank 0 a good factor.
        let f = if c.rank() == 1 { 0.5 } else { 2.0 };
        let e = c.all_reduce_premul_sum(&mut v, f).unwrap_err();
        let mut u = vec![1u8; 2];
        let e2 = c.all_reduce_premul_sum(&mut u, 300.0).unwrap_err();
        let e3 = c.all_reduce_premul_sum_async(vec![1u8; 2], -1.0).wait();
        assert!(
            e3.as_ref().is_err_and(|e| e.to_string().contains("-1")),
            "{e3:?}"
        );
        // Still usable, and nothing was scaled.
        let mut w = vec![1i32];
        c.all_reduce_premul_sum(&mut w, 3.0).unwrap();
        (e, e2, v, w)
    })
    .unwrap();
    match &got[1].0 {
        Error::InvalidArgument { .. } => {
            let m = got[1].0.to_string();
            assert!(m.contains("0.5 is not a whole number i32 holds"), "{m}");
        }
        other => panic!("expected rank 1's argument error, got {other}"),
    }
    assert!(
        matches!(got[0].0, Error::PeerRejected { peer: 1, .. }),
        "{}",
        got[0].0
    );
    for (r, (_, e2, v, w)) in got.iter().enumerate() {
        assert!(e2.to_string().contains("300"), "rank {r}: {e2}");
        assert_eq!(v, &vec![5; 4], "rank {r}'s buffer was touched");
        assert_eq!(w, &vec![6], "rank {r}");
    }
    let _ = DType::I32;
}

#[test]
fn deterministic_mode_sums_the_scaled_inputs_in_rank_order() {
    let config = quick().with_deterministic(true);
    let got = run_local(4, &config, |c| {
        let r = c.rank();
        let mut v: Vec<f32> = (0..1000)
            .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.37)
            .collect();
        let scaled: Vec<f32> = v.iter().map(|x| x * (r as f32 + 0.25)).collect();
        c.all_reduce_premul_sum(&mut v, r as f64 + 0.25).unwrap();
        (v, scaled)
    })
    .unwrap();
    let want: Vec<f32> = (0..1000)
        .map(|i| {
            let mut acc = got[0].1[i];
            for (_, s) in &got[1..] {
                acc += s[i];
            }
            acc
        })
        .collect();
    for (v, _) in &got {
        assert!(v.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
