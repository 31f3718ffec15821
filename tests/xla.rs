//! XLA devices through a PJRT plugin (feature `xla`).
//!
//! The tests that need a real plugin use `TUTTI_PJRT_PLUGIN`, else the one discovery finds, with
//! 4 devices (`cpu_device_count=4` for the CPU plugin). Without a plugin they print why and
//! pass, unless `TUTTI_REQUIRE_XLA=1` (as `.ci/run` sets after fetching the CPU plugin), which
//! makes them fail instead. The error paths (no plugin, a library that is not a plugin, an
//! incompatible plugin, a plugin whose events never fire) use small C libraries built here
//! with `cc`. `TUTTI_TEST_LIBTPU=/path/to/libtpu.so` adds the libtpu check (see the README).
#![cfg(feature = "xla")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use tutti::xla::{self, Client, ClientOptions, OptionValue, PluginKind, XlaBuffer};
use tutti::{bf16, f16, reference, DType, Element, Error, ReduceOp};

/// The devices the tests use: 4 on the CPU plugin (which makes as many as it is asked for),
/// else every device of the plugin up to 4 (a GPU plugin has one per GPU).
fn n() -> usize {
    static DEVICES: OnceLock<usize> = OnceLock::new();
    *DEVICES.get_or_init(|| match plugin_path() {
        Some(p) if PluginKind::of(&p) != PluginKind::Cpu => {
            let plugin = xla::Plugin::load(&p).unwrap_or_else(|e| panic!("loading {p:?}: {e}"));
            let client = Client::new(plugin, &ClientOptions::default())
                .unwrap_or_else(|e| panic!("creating a client of {p:?}: {e}"));
            client.devices().len().clamp(1, 4)
        }
        _ => 4,
    })
}

/// The real plugin to test with, or why there is none.
fn plugin_path() -> Option<PathBuf> {
    static FOUND: OnceLock<Option<PathBuf>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let found = xla::plugin::candidates()
                .into_iter()
                .find(|c| xla::plugin::skip_reason(c).is_none())
                .map(|c| c.path);
            if found.is_none() && std::env::var("TUTTI_REQUIRE_XLA").as_deref() == Ok("1") {
                panic!("TUTTI_REQUIRE_XLA=1 but no PJRT plugin was found (set TUTTI_PJRT_PLUGIN)");
            }
            found
        })
        .clone()
}

fn options_for(path: &Path) -> ClientOptions {
    let o = ClientOptions::default().with_timeout(Duration::from_secs(120));
    if PluginKind::of(path) == PluginKind::Cpu {
        o.with("cpu_device_count", OptionValue::Int(n() as i64))
    } else {
        o
    }
}

/// A fresh client of the test plugin with 4 devices, or `None` (printed) without a plugin.
fn new_client(test: &str) -> Option<Client> {
    let Some(path) = plugin_path() else {
        eprintln!("{test}: skipped: no PJRT plugin found (set TUTTI_PJRT_PLUGIN=/path/plugin.so)");
        return None;
    };
    let plugin = xla::Plugin::load(&path).unwrap_or_else(|e| panic!("loading {path:?}: {e}"));
    let client = Client::new(plugin, &options_for(&path))
        .unwrap_or_else(|e| panic!("creating a client of {path:?}: {e}"));
    if client.devices().len() < n() {
        if std::env::var("TUTTI_REQUIRE_XLA").as_deref() == Ok("1") {
            panic!(
                "{test}: the plugin has {} devices, the tests need {}",
                client.devices().len(),
                n()
            );
        }
        eprintln!(
            "{test}: skipped: the plugin has {} devices, the tests need {}",
            client.devices().len(),
            n()
        );
        return None;
    }
    Some(client)
}

/// The client shared by the tests that do not change its settings.
fn shared() -> Option<&'static Client> {
    static C: OnceLock<Option<Client>> = OnceLock::new();
    C.get_or_init(|| new_client("shared client")).as_ref()
}

fn value<T: Element>(r: usize, i: usize) -> T {
    let v = ((i * 7 + r * 3 + 1) % 5) as f64;
    let signed = !matches!(T::DTYPE, DType::U8 | DType::U32 | DType::U64);
    T::from_f64(if signed { v - 2.0 } else { v })
}

fn data<T: Element>(r: usize, count: usize) -> Vec<T> {
    (0..count).map(|i| value::<T>(r, i)).collect()
}

fn check_all_reduce<T: Element>(client: &Client, count: usize, op: ReduceOp) {
    let inputs: Vec<Vec<T>> = (0..n()).map(|r| data(r, count)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference::reduce(&refs, op);
    let tol = reference::tolerance(T::DTYPE, op, n(), 2.0);
    let mut bufs = inputs.clone();
    let mut views: Vec<&mut [T]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    client
        .all_reduce(&mut views, op)
        .unwrap_or_else(|e| panic!("all_reduce {} {op} x{count}: {e}", T::DTYPE));
    for (r, b) in bufs.iter().enumerate() {
        let bad = reference::count_errors(b, &want, tol);
        assert_eq!(
            bad,
            0,
            "all_reduce {} {op} x{count}: {bad} wrong elements on replica {r}: {:?} vs {:?}",
            T::DTYPE,
            &b[..b.len().min(8)],
            &want[..want.len().min(8)]
        );
    }
}

fn every_dtype(f: &mut dyn FnMut(DType)) {
    for d in DType::ALL {
        f(d)
    }
}

/// The issue's matrix, on compiled programs only (a program the plugin refuses fails here):
/// all-reduce for every op on f32, bf16 and i32.
#[test]
fn all_reduce_programs_every_op_f32_bf16_i32() {
    let Some(client) = new_client("all_reduce_programs") else {
        return;
    };
    client.set_route(xla::Route::Program);
    for count in [1, 7, 1000] {
        for op in ReduceOp::ALL {
            if op.is_bitwise() {
                bitwise_program::<i32>(&client, count, op);
                continue;
            }
            check_all_reduce::<f32>(&client, count, op);
            check_all_reduce::<bf16>(&client, count, op);
            check_all_reduce::<i32>(&client, count, op);
        }
    }
    let s = client.cache_stats();
    assert_eq!(s.staged_calls, 0, "{s:?}");
    // 3 counts × (5 ops × 3 dtypes + 3 bitwise ops × i32), compiled or refused.
    assert_eq!(s.compiled + s.refused, 3 * (5 * 3 + 3), "{s:?}");
    assert!(s.compiled >= 3 * 5 * 3, "{s:?}");
}

/// A bitwise all-reduce forced onto a program: right, or, where the plugin refuses `and`, `or`,
/// `xor` as an all-reduce's reduction (the CPU plugin does: "Unsupported reduction
/// computation"), an error saying that compiling it failed, naming the op.
fn bitwise_program<T: Element>(client: &Client, count: usize, op: ReduceOp) {
    let inputs: Vec<Vec<T>> = (0..n()).map(|r| data(r, count)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference::reduce(&refs, op);
    let mut bufs = inputs.clone();
    let mut views: Vec<&mut [T]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    match client.all_reduce(&mut views, op) {
        Ok(()) => assert!(bufs.iter().all(|b| *b == want), "{op} x{count}"),
        Err(e) => assert!(
            e.to_string()
                .contains(&format!("compiling the all_reduce {op} program")),
            "{e}"
        ),
    }
}

/// Every element type and op through the default path (a program, or host-staged where the
/// plugin refuses the program), checked against the reference.
#[test]
fn all_reduce_every_dtype_and_op() {
    let Some(client) = new_client("all_reduce_every_dtype_and_op") else {
        return;
    };
    every_dtype(&mut |d| {
        for op in ReduceOp::ALL.into_iter().filter(|o| o.check(d).is_ok()) {
            tutti::for_each_dtype!(d, T => { check_all_reduce::<T>(&client, 100, op) });
        }
    });
    let s = client.cache_stats();
    eprintln!("all_reduce_every_dtype_and_op: {s:?}");
    if client.plugin().kind() == PluginKind::Cpu {
        // The CPU plugin compiles the 50 programs of 10 dtypes × 5 ops, and refuses the 18 of
        // 6 integer dtypes × 3 bitwise ops ("Unsupported reduction computation": its
        // all-reduce has add, multiply, minimum, maximum), which then run host-staged.
        assert_eq!(
            (s.compiled, s.refused, s.staged_calls),
            (50, 18, 18),
            "{s:?}"
        );
    }
}

/// The bits of tutti's kernels' one pass over `inputs` in replica order: what the ordered
/// programs promise.
fn in_rank_order<T: Element>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); inputs[0].len()];
    let srcs: Vec<&[u8]> = inputs.iter().map(|v| bytemuck::cast_slice(v)).collect();
    tutti::kernels::reduce(
        T::DTYPE,
        op,
        bytemuck::cast_slice_mut(&mut out),
        &srcs,
        tutti::kernels::Init::Overwrite,
        (op == ReduceOp::Mean).then_some(inputs.len()),
    );
    out
}

/// Values whose sums depend on the order they are added in.
fn spread<T: Element>(r: usize, i: usize) -> T {
    let x = ((r * 7919 + i * 104_729) % 2003) as f64 / 2003.0 - 0.5;
    T::from_f64(x * 10f64.powi(((r + i) % 7) as i32 - 3))
}

/// The ordered all-reduce of `count` elements per replica against the rank-order reference,
/// bit for bit.
fn check_ordered_all_reduce<T: Element>(client: &Client, count: usize, op: ReduceOp) {
    let inputs: Vec<Vec<T>> = (0..n())
        .map(|r| (0..count).map(|i| spread(r, i)).collect())
        .collect();
    let want = in_rank_order(&inputs, op);
    let mut bufs = inputs.clone();
    let mut views: Vec<&mut [u8]> = bufs
        .iter_mut()
        .map(|b| bytemuck::cast_slice_mut(b))
        .collect();
    client
        .all_reduce_in(T::DTYPE, &mut views, op, true)
        .unwrap_or_else(|e| panic!("ordered all_reduce {} {op} x{count}: {e}", T::DTYPE));
    for (r, b) in bufs.iter().enumerate() {
        let same = bytemuck::cast_slice::<T, u8>(b) == bytemuck::cast_slice::<T, u8>(&want);
        assert!(same, "all_reduce {} {op} x{count} on {r}", T::DTYPE);
    }
}

fn check_ordered<T: Element>(client: &Client, count: usize, op: ReduceOp) {
    let n = n();
    let inputs: Vec<Vec<T>> = (0..n)
        .map(|r| (0..count * n).map(|i| spread(r, i)).collect())
        .collect();
    let bits = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
    let want = in_rank_order(&inputs, op);
    let mut bufs = inputs.clone();
    let mut views: Vec<&mut [u8]> = bufs
        .iter_mut()
        .map(|b| bytemuck::cast_slice_mut(b))
        .collect();
    client
        .all_reduce_in(T::DTYPE, &mut views, op, true)
        .unwrap_or_else(|e| panic!("ordered all_reduce {} {op}: {e}", T::DTYPE));
    for (r, b) in bufs.iter().enumerate() {
        assert_eq!(bits(b), bits(&want), "all_reduce {} {op} on {r}", T::DTYPE);
    }
    let ins: Vec<&[u8]> = inputs.iter().map(|v| bytemuck::cast_slice(v)).collect();
    let mut outs: Vec<Vec<T>> = vec![vec![T::from_f64(0.0); count]; n];
    let mut views: Vec<&mut [u8]> = outs
        .iter_mut()
        .map(|b| bytemuck::cast_slice_mut(b))
        .collect();
    client
        .reduce_scatter_in(T::DTYPE, &ins, &mut views, op, true)
        .unwrap_or_else(|e| panic!("ordered reduce_scatter {} {op}: {e}", T::DTYPE));
    for (r, o) in outs.iter().enumerate() {
        let mine = &want[r * count..(r + 1) * count];
        assert_eq!(
            bits(o),
            bits(mine),
            "reduce_scatter {} {op} on {r}",
            T::DTYPE
        );
    }
}

/// The bitwise-deterministic programs: all-reduce and reduce-scatter in replica order give the
/// bits of tutti's kernels for the float types (f16 and bf16 in f32, rounded once), every
/// combining op, compiled (never staged through the host), and on device buffers too.
#[test]
fn ordered_programs_give_the_bits_of_the_reduction_in_rank_order() {
    let Some(client) = new_client("ordered_programs") else {
        return;
    };
    client.set_route(xla::Route::Program);
    for count in [1, 5, 300] {
        for op in [
            ReduceOp::Sum,
            ReduceOp::Mean,
            ReduceOp::Prod,
            ReduceOp::Min,
            ReduceOp::Max,
        ] {
            check_ordered::<f32>(&client, count, op);
            check_ordered::<f64>(&client, count, op);
            check_ordered::<f16>(&client, count, op);
            check_ordered::<bf16>(&client, count, op);
            check_ordered::<i32>(&client, count, op);
        }
    }
    // Inputs large enough that the all-reduce exchanges blocks first, then gathers them: the
    // bytes the one gather would move beyond that pass, (n-1)(n-2)/n of the input, twice the
    // 4 MiB where the program switches (padded to n equal blocks where the count does not
    // split).
    let p = n();
    if p > 2 {
        let over = |size: usize| {
            let count = (8 << 20) * p / ((p - 1) * (p - 2)) / size;
            count + usize::from(count % p == 0)
        };
        check_ordered::<f32>(&client, over(4) / p + 1, ReduceOp::Sum);
        check_ordered_all_reduce::<f32>(&client, over(4), ReduceOp::Sum);
        check_ordered_all_reduce::<f64>(&client, over(8), ReduceOp::Mean);
        check_ordered_all_reduce::<bf16>(&client, over(2), ReduceOp::Sum);
    }
    let s = client.cache_stats();
    assert_eq!((s.staged_calls, s.refused), (0, 0), "{s:?}");
    // On device buffers: the same bits, left on the devices.
    let inputs: Vec<Vec<f32>> = (0..n())
        .map(|r| (0..64).map(|i| spread(r, i)).collect())
        .collect();
    let dev: Vec<XlaBuffer> = inputs
        .iter()
        .enumerate()
        .map(|(r, v)| client.buffer_from_host(v, r).unwrap())
        .collect();
    let refs: Vec<&XlaBuffer> = dev.iter().collect();
    let want = in_rank_order(&inputs, ReduceOp::Sum);
    for out in client
        .all_reduce_buffers_ordered(&refs, ReduceOp::Sum)
        .unwrap()
    {
        assert_eq!(out.to_vec::<f32>().unwrap(), want);
    }
}

#[test]
fn second_call_hits_the_program_cache() {
    let Some(client) = new_client("program_cache") else {
        return;
    };
    client.set_route(xla::Route::Program);
    check_all_reduce::<f32>(&client, 64, ReduceOp::Sum);
    let first = client.cache_stats();
    assert_eq!((first.compiled, first.hits), (1, 0), "{first:?}");
    check_all_reduce::<f32>(&client, 64, ReduceOp::Sum);
    let second = client.cache_stats();
    assert_eq!((second.compiled, second.hits), (1, 1), "{second:?}");
    // Another shape, op or dtype is another program.
    check_all_reduce::<f32>(&client, 65, ReduceOp::Sum);
    check_all_reduce::<f32>(&client, 64, ReduceOp::Max);
    check_all_reduce::<i32>(&client, 64, ReduceOp::Sum);
    assert_eq!(client.cache_stats().compiled, 4);
}

/// A view of some of a client's devices (`Client::subset`): its devices are those asked for,
/// in that order, named as the client names them; its programs are compiled for them alone
/// and run beside the client's; buffers placed through it are on its devices; devices listed
/// twice or missing are refused, naming them.
#[test]
fn a_subset_of_the_devices_runs_programs_of_its_own() {
    let Some(client) = new_client("subset") else {
        return;
    };
    client.set_route(xla::Route::Program);
    let view = client.subset(&[3, 1]).unwrap();
    let ids: Vec<i64> = view.devices().iter().map(|d| d.id).collect();
    let want_ids = [client.devices()[3].id, client.devices()[1].id];
    assert_eq!(ids, want_ids);
    assert_eq!(view.devices()[0].index, 3);
    std::thread::scope(|s| {
        s.spawn(|| check_all_reduce::<f32>(&client, 33, ReduceOp::Sum));
        let mut a = vec![1.0f32, 2.0];
        let mut b = vec![10.0f32, 20.0];
        view.all_reduce(&mut [&mut a[..], &mut b[..]], ReduceOp::Sum)
            .unwrap();
        assert_eq!((a, b), (vec![11.0, 22.0], vec![11.0, 22.0]));
    });
    assert_eq!(view.cache_stats().compiled, 1);
    let buf = view.buffer_from_host(&[5i32, 6], 0).unwrap();
    assert_eq!(format!("{buf:?}"), "XlaBuffer(i32 x 2 on xla:3)");
    assert_eq!(buf.to_vec::<i32>().unwrap(), [5, 6]);
    // A view of a view, outliving both.
    let inner = view.subset(&[1]).unwrap();
    drop((client, view));
    assert_eq!(inner.devices()[0].index, 1);
    let mut one = vec![7u8];
    inner
        .all_reduce(&mut [&mut one[..]], ReduceOp::Max)
        .unwrap();
    assert_eq!(one, [7]);
    let m = inner.subset(&[0, 0]).unwrap_err().to_string();
    assert!(m.contains("device 0 is listed twice"), "{m}");
    let m = inner.subset(&[1]).unwrap_err().to_string();
    assert!(m.contains("device 1") && m.contains("has 1 device"), "{m}");
}

#[test]
fn broadcast_from_every_root_is_bit_exact() {
    let Some(client) = shared() else { return };
    let devices = n();
    for n in [devices, 3, 1].into_iter().filter(|&k| k <= devices) {
        for root in 0..n {
            let mut bufs: Vec<Vec<f32>> = (0..n).map(|r| vec![r as f32 * 10.0; 33]).collect();
            // Values an addition with zero would change: -0.0 and a NaN payload.
            bufs[root][0] = -0.0;
            bufs[root][1] = f32::from_bits(0x7fc0_1234);
            let want = bufs[root].clone();
            let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            client.broadcast(&mut views, root).unwrap();
            for (r, b) in bufs.iter().enumerate() {
                let same = b.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "broadcast n={n} root={root}: replica {r} got {:?}",
                    &b[..4]
                );
            }
        }
    }
    every_dtype(&mut |d| {
        tutti::for_each_dtype!(d, T => {
            let mut bufs: Vec<Vec<T>> = (0..n()).map(|r| data(r, 50)).collect();
            let root = n() - 1;
            let want = bufs[root].clone();
            let mut views: Vec<&mut [T]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            client.broadcast(&mut views, root).unwrap();
            assert!(bufs.iter().all(|b| *b == want), "broadcast {d}");
        })
    });
}

#[test]
fn all_gather_and_reduce_scatter() {
    let Some(client) = shared() else { return };
    every_dtype(&mut |d| {
        tutti::for_each_dtype!(d, T => {
            for count in [1, 5, 256] {
                let inputs: Vec<Vec<T>> = (0..n()).map(|r| data(r, count)).collect();
                let ins: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
                let mut outs: Vec<Vec<T>> = vec![vec![T::from_f64(0.0); count * n()]; n()];
                let mut views: Vec<&mut [T]> = outs.iter_mut().map(|b| b.as_mut_slice()).collect();
                client.all_gather(&ins, &mut views).unwrap();
                let want = inputs.concat();
                assert!(outs.iter().all(|o| *o == want), "all_gather {d} x{count}");

                let big: Vec<Vec<T>> = (0..n()).map(|r| data(r + 1, count * n())).collect();
                let bigs: Vec<&[T]> = big.iter().map(|v| v.as_slice()).collect();
                for op in ReduceOp::ALL.into_iter().filter(|o| o.check(d).is_ok()) {
                    let want = reference::reduce(&bigs, op);
                    let tol = reference::tolerance(d, op, n(), 2.0);
                    let mut outs: Vec<Vec<T>> = vec![vec![T::from_f64(0.0); count]; n()];
                    let mut views: Vec<&mut [T]> =
                        outs.iter_mut().map(|b| b.as_mut_slice()).collect();
                    client.reduce_scatter(&bigs, &mut views, op).unwrap();
                    for (r, o) in outs.iter().enumerate() {
                        let bad = reference::count_errors(o, &want[r * count..(r + 1) * count], tol);
                        assert_eq!(bad, 0, "reduce_scatter {d} {op} x{count}: replica {r}");
                    }
                }
            }
        })
    });
}

/// All-to-all of every dtype on a compiled `stablehlo.all_to_all` (host-staged where the plugin
/// refuses the type), forced host-staged, and of device buffers: block j of replica i's input
/// is block i of replica j's output.
#[test]
fn all_to_all_programs_and_staged() {
    let Some(client) = new_client("all_to_all") else {
        return;
    };
    let p = n();
    for route in [xla::Route::Auto, xla::Route::HostStaged] {
        client.set_route(route);
        every_dtype(&mut |d| {
            tutti::for_each_dtype!(d, T => {
                for block in [1, 5, 256] {
                    let inputs: Vec<Vec<T>> =
                        (0..p).map(|r| (0..block * p).map(|i| T::from_f64(((r * 31 + i) % 97) as f64)).collect()).collect();
                    let ins: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
                    let mut outs: Vec<Vec<T>> = vec![vec![T::from_f64(0.0); block * p]; p];
                    let mut views: Vec<&mut [T]> =
                        outs.iter_mut().map(|b| b.as_mut_slice()).collect();
                    client
                        .all_to_all(&ins, &mut views)
                        .unwrap_or_else(|e| panic!("all_to_all {d} x{block} ({route:?}): {e}"));
                    for (j, o) in outs.iter().enumerate() {
                        let want: Vec<T> = (0..p)
                            .flat_map(|i| inputs[i][j * block..(j + 1) * block].to_vec())
                            .collect();
                        assert!(*o == want, "all_to_all {d} x{block} ({route:?}): replica {j}");
                    }
                }
            })
        });
    }
    let s = client.cache_stats();
    // Every dtype × 3 sizes compiled, or refused where the plugin lacks the type (then staged).
    let calls = DType::ALL.len() as u64 * 3;
    assert_eq!(s.compiled + s.refused, calls, "{s:?}");
    assert!(s.compiled >= 3 * 3, "{s:?}");
    assert_eq!(s.staged_calls, s.refused + calls, "{s:?}");
    // Device buffers, on the program.
    client.set_route(xla::Route::Program);
    let bufs: Vec<xla::XlaBuffer> = (0..p)
        .map(|r| {
            let v: Vec<f32> = (0..2 * p).map(|i| (r * 100 + i) as f32).collect();
            client.buffer_from_host(&v, r).unwrap()
        })
        .collect();
    let refs: Vec<&xla::XlaBuffer> = bufs.iter().collect();
    let outs = client.all_to_all_buffers(&refs).unwrap();
    for (j, o) in outs.iter().enumerate() {
        let want: Vec<f32> = (0..p)
            .flat_map(|i| [(i * 100 + 2 * j) as f32, (i * 100 + 2 * j + 1) as f32])
            .collect();
        assert_eq!(
            o.to_vec::<f32>().unwrap(),
            want,
            "device all_to_all, replica {j}"
        );
    }
    // A count that does not split into one block per replica names the collective.
    if p > 1 {
        let odd = vec![0f32; p + 1];
        let ins: Vec<&[f32]> = (0..p).map(|_| odd.as_slice()).collect();
        let mut outs = vec![vec![0f32; p + 1]; p];
        let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let e = client.all_to_all(&ins, &mut views).unwrap_err().to_string();
        assert!(
            e.contains("all_to_all") && e.contains("equal slices"),
            "{e}"
        );
    }
}

#[test]
fn host_device_round_trip_every_dtype() {
    let Some(client) = shared() else { return };
    every_dtype(&mut |d| {
        tutti::for_each_dtype!(d, T => {
            for dev in 0..n() {
                let v: Vec<T> = (0..77).map(|i| T::from_f64((i % 13) as f64)).collect();
                let b = client.buffer_from_host(&v, dev).unwrap();
                assert_eq!((b.device(), b.dtype(), b.len()), (dev, d, 77));
                assert_eq!(b.to_vec::<T>().unwrap(), v, "{d} on device {dev}");
                let mut back = vec![T::from_f64(0.0); 77];
                b.copy_to_host(&mut back).unwrap();
                assert_eq!(back, v);
            }
        })
    });
    let b = client.buffer_from_host(&[1.0f32; 4], 0).unwrap();
    let e = b.to_vec::<i32>().unwrap_err();
    assert!(e.to_string().contains("i32"), "{e}");
    let e = client.buffer_from_host(&[1.0f32], 99).unwrap_err();
    assert!(e.to_string().contains("device 99"), "{e}");
}

fn device_inputs<T: Element>(client: &Client, count: usize) -> (Vec<Vec<T>>, Vec<XlaBuffer>) {
    let host: Vec<Vec<T>> = (0..n()).map(|r| data(r, count)).collect();
    let dev = host
        .iter()
        .enumerate()
        .map(|(r, v)| client.buffer_from_host(v, r).unwrap())
        .collect();
    (host, dev)
}

fn check_device_collectives(client: &Client) {
    let (host, dev) = device_inputs::<f32>(client, 120);
    let refs: Vec<&XlaBuffer> = dev.iter().collect();
    let hrefs: Vec<&[f32]> = host.iter().map(|v| v.as_slice()).collect();
    let want = reference::reduce(&hrefs, ReduceOp::Mean);
    let outs = client.all_reduce_buffers(&refs, ReduceOp::Mean).unwrap();
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.device(), r);
        let got = o.to_vec::<f32>().unwrap();
        assert_eq!(reference::count_errors(&got, &want, 1e-6), 0, "replica {r}");
    }
    // Results feed the next collective without leaving the devices.
    let orefs: Vec<&XlaBuffer> = outs.iter().collect();
    let again = client.all_reduce_buffers(&orefs, ReduceOp::Sum).unwrap();
    let last = n() - 1;
    let got = again[last].to_vec::<f32>().unwrap();
    assert!(got
        .iter()
        .zip(&want)
        .all(|(g, w)| (g - n() as f32 * w).abs() < 1e-5));
    // The inputs are untouched.
    assert_eq!(dev[last].to_vec::<f32>().unwrap(), host[last]);
    let b = client.broadcast_buffers(&refs, last).unwrap();
    assert!(b.iter().all(|x| x.to_vec::<f32>().unwrap() == host[last]));
    let g = client.all_gather_buffers(&refs).unwrap();
    assert!(g
        .iter()
        .all(|x| x.to_vec::<f32>().unwrap() == host.concat()));
    let s = client.reduce_scatter_buffers(&refs, ReduceOp::Max).unwrap();
    let want = reference::reduce(&hrefs, ReduceOp::Max);
    let per = 120 / n();
    for (r, x) in s.iter().enumerate() {
        assert_eq!(x.to_vec::<f32>().unwrap(), want[r * per..(r + 1) * per]);
    }
}

#[test]
fn device_buffer_collectives() {
    let Some(client) = shared() else { return };
    check_device_collectives(client);
}

/// A bitwise op on a float type is refused before anything runs, naming the op and the dtype;
/// the client goes on working.
#[test]
fn bitwise_ops_on_floats_are_refused() {
    let Some(client) = shared() else {
        return;
    };
    let mut bufs = vec![vec![1.0f32; 4]; n()];
    let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let e = client.all_reduce(&mut views, ReduceOp::BXor).unwrap_err();
    assert!(
        e.to_string()
            .contains("bxor is defined on integer types only, not f32"),
        "{e}"
    );
    let ins: Vec<Vec<bf16>> = vec![vec![bf16::from_f64(1.0); 2 * n()]; n()];
    let ins: Vec<&[bf16]> = ins.iter().map(|v| v.as_slice()).collect();
    let mut outs = vec![vec![bf16::from_f64(0.0); 2]; n()];
    let mut views: Vec<&mut [bf16]> = outs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let e = client
        .reduce_scatter(&ins, &mut views, ReduceOp::BAnd)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("band is defined on integer types only, not bf16"),
        "{e}"
    );
    check_all_reduce::<u64>(client, 5, ReduceOp::BOr);
}

/// The host-staged path, forced: the same results, no program compiled.
#[test]
fn host_staged_path() {
    let Some(client) = new_client("host_staged_path") else {
        return;
    };
    client.set_route(xla::Route::HostStaged);
    for op in ReduceOp::ALL {
        if !op.is_bitwise() {
            check_all_reduce::<f32>(&client, 300, op);
            check_all_reduce::<bf16>(&client, 300, op);
            check_all_reduce::<f16>(&client, 300, op);
        }
        check_all_reduce::<i32>(&client, 300, op);
        check_all_reduce::<u8>(&client, 300, op);
    }
    check_device_collectives(&client);
    let s = client.cache_stats();
    assert_eq!(s.compiled, 0, "{s:?}");
    // 5 ops × 5 dtypes, 3 bitwise ops × 2 integer dtypes, 5 device collectives.
    assert_eq!(s.staged_calls, 25 + 6 + 5, "{s:?}");
    if n() < 4 {
        eprintln!("host_staged_path: the bf16 rounding part needs 4 devices");
        return;
    }
    // Host-staged bf16 rounds once, like tutti's kernels: the mean of 1, 2, 2, 2 bf16 is
    // exactly 1.75.
    let mut bufs: Vec<Vec<bf16>> = [1.0, 2.0, 2.0, 2.0]
        .iter()
        .map(|&v| vec![bf16::from_f64(v); 3])
        .collect();
    let mut views: Vec<&mut [bf16]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    client.all_reduce(&mut views, ReduceOp::Mean).unwrap();
    assert_eq!(bufs[2][1].to_f64(), 1.75);
}

#[test]
fn argument_errors_name_the_replica() {
    let Some(client) = shared() else { return };
    if n() < 2 {
        eprintln!("argument_errors_name_the_replica: skipped: needs 2 devices, the plugin has 1");
        return;
    }
    let mut a = [1.0f32; 8];
    let mut b = [1.0f32; 9];
    let e = client
        .all_reduce(&mut [&mut a[..], &mut b[..]], ReduceOp::Sum)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("replica 1 has 9 elements"), "{e}");
    let mut many: Vec<Vec<f32>> = vec![vec![0.0; 4]; n() + 1];
    let mut views: Vec<&mut [f32]> = many.iter_mut().map(|b| b.as_mut_slice()).collect();
    let e = client.all_reduce(&mut views, ReduceOp::Sum).unwrap_err();
    assert!(
        e.to_string().contains(&format!("{} buffers", n() + 1)),
        "{e}"
    );
    let e = client
        .all_reduce::<f32>(&mut [], ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("got none"), "{e}");
    let mut c = [1.0f32; 8];
    let e = client
        .broadcast(&mut [&mut a[..], &mut c[..]], 2)
        .unwrap_err();
    assert!(e.to_string().contains("root 2 is out of range"), "{e}");
    let ins = [&a[..7], &c[..7]];
    let mut o1 = [0.0f32; 3];
    let mut o2 = [0.0f32; 3];
    let e = client
        .reduce_scatter(&ins, &mut [&mut o1[..], &mut o2[..]], ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("does not split into 2"), "{e}");
    let ins = [&a[..], &c[..]];
    let mut o2 = [0.0f32; 15];
    let mut o1 = [0.0f32; 16];
    let e = client
        .all_gather(&ins, &mut [&mut o1[..], &mut o2[..]])
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("output of replica 1 has 15 elements; it must have 16"),
        "{e}"
    );
    // Device buffers in the wrong places.
    let x = client.buffer_from_host(&[1.0f32; 4], 1).unwrap();
    let y = client.buffer_from_host(&[1.0f32; 4], 0).unwrap();
    let e = client
        .all_reduce_buffers(&[&x, &y], ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("replica 0 is on device 1"), "{e}");
    let z = client.buffer_from_host(&[1i32; 4], 1).unwrap();
    let e = client
        .all_reduce_buffers(&[&y, &z], ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("holds i32"), "{e}");
    // The client is still usable.
    check_all_reduce::<f32>(client, 10, ReduceOp::Sum);
}

#[test]
fn zero_length_calls() {
    let Some(client) = shared() else { return };
    let mut bufs: Vec<Vec<f32>> = vec![Vec::new(); n()];
    let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    client.all_reduce(&mut views, ReduceOp::Sum).unwrap();
    client.broadcast(&mut views, n() - 1).unwrap();
    let ins: Vec<&[f32]> = vec![&[]; n()];
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); n()];
    let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|b| b.as_mut_slice()).collect();
    client.all_gather(&ins, &mut views).unwrap();
    client
        .reduce_scatter(&ins, &mut views, ReduceOp::Sum)
        .unwrap();
    let dev: Vec<XlaBuffer> = (0..n())
        .map(|r| client.buffer_from_host::<f32>(&[], r).unwrap())
        .collect();
    let refs: Vec<&XlaBuffer> = dev.iter().collect();
    let out = client.all_reduce_buffers(&refs, ReduceOp::Sum).unwrap();
    assert!(out
        .iter()
        .all(|b| b.is_empty() && b.to_vec::<f32>().unwrap().is_empty()));
    assert_eq!(client.all_gather_buffers(&refs).unwrap()[n() - 1].len(), 0);
}

#[test]
fn handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Client>();
    send_sync::<XlaBuffer>();
    send_sync::<xla::Plugin>();
}

#[test]
fn options_parse() {
    let o = ClientOptions::parse("cpu_device_count=4, flag=true,frac=0.5,name=abc").unwrap();
    assert_eq!(o.get("cpu_device_count"), Some(&OptionValue::Int(4)));
    assert_eq!(o.get("flag"), Some(&OptionValue::Bool(true)));
    assert_eq!(o.get("frac"), Some(&OptionValue::Float(0.5)));
    assert_eq!(o.get("name"), Some(&OptionValue::Str("abc".into())));
    let e = ClientOptions::parse("cpu_device_count").unwrap_err();
    assert!(e.to_string().contains("not key=value"), "{e}");
    assert_eq!(ClientOptions::parse("").unwrap().options, vec![]);
}

// ------------------------------ the command ---------------------------------

fn tutti() -> Command {
    let mut c = Command::new(common::tutti_bin());
    c.env_remove("TUTTI_PJRT_OPTIONS");
    c
}

#[test]
fn perf_device_xla_rows_are_correct() {
    let Some(path) = plugin_path() else {
        eprintln!("perf_device_xla: skipped: no PJRT plugin found");
        return;
    };
    for c in [
        "all-reduce",
        "broadcast",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
    ] {
        let out = tutti()
            .env("TUTTI_PJRT_PLUGIN", &path)
            .args(["perf", "--device", "xla", "-n", &n().to_string(), "-c", c])
            .args([
                "-b", "1K", "-e", "256K", "-f", "16", "--iters", "2", "--json",
            ])
            .args(["-d", "bf16", "-o", "max"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "perf -c {c}: {stdout}\n{stderr}");
        let rows: Vec<serde_json::Value> = stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.get("errors").is_some())
            .collect();
        assert_eq!(rows.len(), 3, "perf -c {c}: {stdout}");
        for r in &rows {
            assert_eq!(r["errors"], 0, "{r}");
            assert_eq!(r["ranks"], n(), "{r}");
            assert_eq!(r["collective"], c, "{r}");
        }
    }
    // The collectives without a client-level program, as an XLA group's communicators run
    // them on host buffers.
    for c in [
        "reduce",
        "gather",
        "scatter",
        "all-gather-v",
        "reduce-scatter-v",
        "all-to-all-v",
        "send-recv",
    ] {
        let out = tutti()
            .env("TUTTI_PJRT_PLUGIN", &path)
            .args(["perf", "--device", "xla", "-n", &n().to_string(), "-c", c])
            .args(["-b", "1K", "-e", "64K", "-f", "8", "--iters", "2", "--json"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "perf -c {c}: {stdout}\n{stderr}");
        let rows: Vec<serde_json::Value> = stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.get("errors").is_some())
            .collect();
        assert_eq!(rows.len(), 3, "perf -c {c}: {stdout}");
        for r in &rows {
            assert_eq!(r["errors"], 0, "{r}");
            assert_eq!(r["collective"], c, "{r}");
            assert_eq!(r["algo"], "xla-staged", "{r}");
        }
    }
}

#[test]
fn devices_lists_pjrt_devices() {
    let Some(path) = plugin_path() else {
        eprintln!("devices_lists_pjrt_devices: skipped: no PJRT plugin found");
        return;
    };
    let mut cmd = tutti();
    cmd.env("TUTTI_PJRT_PLUGIN", &path);
    if PluginKind::of(&path) == PluginKind::Cpu {
        cmd.env("TUTTI_PJRT_OPTIONS", "cpu_device_count=3");
    }
    let out = cmd.args(["devices", "--json"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let xla_devs = v["xla"]["devices"].as_array().expect("an xla section");
    if PluginKind::of(&path) == PluginKind::Cpu {
        assert_eq!(xla_devs.len(), 3, "{v}");
        assert_eq!(xla_devs[2]["id"], 2, "{v}");
        assert_eq!(xla_devs[2]["process_index"], 0, "{v}");
        assert_eq!(xla_devs[2]["kind"], "cpu", "{v}");
        let all = v["devices"].as_array().unwrap();
        assert!(
            all.iter().any(|d| d["kind"] == "xla" && d["index"] == 2),
            "{v}"
        );
    }
    let out = tutti()
        .env("TUTTI_PJRT_PLUGIN", &path)
        .arg("devices")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("xla:0"), "{text}");
}

#[test]
fn bogus_plugin_path_is_a_clean_error() {
    let out = tutti()
        .env("TUTTI_PJRT_PLUGIN", "/nonexistent/tutti-test/plugin.so")
        .args(["perf", "--device", "xla", "-n", "2", "-e", "1K"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("XLA not available")
            && stderr.contains("/nonexistent/tutti-test/plugin.so: no such file"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let e = xla::Plugin::load("/nonexistent/tutti-test/plugin.so").unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    // tutti devices still lists the CPU, and says why there are no XLA devices.
    let out = tutti()
        .env("TUTTI_PJRT_PLUGIN", "/nonexistent/tutti-test/plugin.so")
        .arg("devices")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("cpu:0"), "{text}");
    assert!(text.contains("no such file"), "{text}");
}

#[test]
fn no_plugin_found_says_how_to_set_one() {
    // An empty environment: no TUTTI_PJRT_PLUGIN, no site-packages, no python3 on PATH.
    let out = Command::new(common::tutti_bin())
        .env_clear()
        .env("PATH", "/nonexistent")
        .env("HOME", "/nonexistent")
        .args(["perf", "--device", "xla", "-n", "2", "-e", "1K"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("/usr/") || stderr.contains("/opt/") {
        // A plugin installed system-wide was found and tried: nothing to check here.
        return;
    }
    assert!(!out.status.success());
    assert!(
        stderr.contains("no PJRT plugin found (set TUTTI_PJRT_PLUGIN="),
        "{stderr}"
    );
}

// ----------------------- plugins that are not (quite) PJRT ------------------------

/// Build `src` as a shared library in a temp folder; `None` (printed) without a C compiler.
fn build_so(name: &str, src: &str, flags: &[&str]) -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("tutti-xla-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let c = dir.join(format!("{name}.c"));
    let so = dir.join(format!("{name}.so"));
    std::fs::write(&c, src).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1"])
        .args(flags)
        .arg("-o")
        .arg(&so)
        .arg(&c)
        .output()
    {
        Ok(o) if o.status.success() => Some(so),
        Ok(o) => panic!(
            "{cc} failed on {c:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            if std::env::var("TUTTI_REQUIRE_XLA").as_deref() == Ok("1") {
                panic!("no C compiler ({cc}: {e})");
            }
            eprintln!("{name}: skipped: no C compiler ({cc}: {e})");
            None
        }
    }
}

#[test]
fn library_without_get_pjrt_api_is_refused() {
    let Some(so) = build_so(
        "not_a_plugin",
        "int tutti_test_nothing(void) { return 1; }\n",
        &[],
    ) else {
        return;
    };
    let e = xla::Plugin::load(&so).unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    assert!(e.to_string().contains("exports no GetPjrtApi"), "{e}");
    let garbage = so.with_file_name("garbage.so");
    std::fs::write(&garbage, b"not an ELF file").unwrap();
    let e = xla::Plugin::load(&garbage).unwrap_err();
    assert!(e.to_string().contains("could not be loaded"), "{e}");
}

/// A table that claims another API version, or is too short.
fn versioned_plugin(major: i32, minor: i32, size: usize) -> String {
    format!(
        r#"#include <stddef.h>
struct version {{ size_t struct_size; void *ext; int major; int minor; }};
struct api {{ size_t struct_size; void *ext; struct version v; void *fns[200]; }};
static struct api table = {{ {size}, 0, {{ sizeof(struct version), 0, {major}, {minor} }}, {{0}} }};
const struct api *GetPjrtApi(void) {{ return &table; }}
"#
    )
}

#[test]
fn incompatible_plugins_are_refused() {
    let cases = [
        (
            "major1",
            versioned_plugin(1, 0, 2000),
            "implements PJRT C API 1.0",
        ),
        (
            "minor_old",
            versioned_plugin(0, 10, 2000),
            "implements PJRT C API 0.10",
        ),
        (
            "short_table",
            versioned_plugin(0, 81, 200),
            "its API table is 200 bytes",
        ),
    ];
    for (name, src, want) in cases {
        let Some(so) = build_so(name, &src, &[]) else {
            return;
        };
        let e = xla::Plugin::load(&so).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Error::Unavailable { .. }), "{m}");
        assert!(
            m.contains("incompatible") && m.contains(want),
            "{name}: {m}"
        );
        assert!(m.contains("0.81"), "{name}: {m}");
    }
}

/// A small fake plugin: two devices whose buffers live in host memory, a compiler that
/// compiles nothing, and (built with `-DSTUCK`) device-to-host copies that never finish.
const FAKE_PLUGIN: &str = r#"
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef struct { size_t struct_size; void *ext; } H;
struct version { size_t struct_size; void *ext; int major; int minor; };
typedef void *(*fn)(void *);
struct api { size_t struct_size; void *ext; struct version v; fn f[120]; };
struct err { int code; char msg[64]; };
struct buf { size_t n; unsigned char data[]; };
typedef void (*on_ready_cb)(void *err, void *arg);
static int dummy_client, dummy_event;
static int devs[2], descs[2];
static struct err *new_err(int code, const char *m) {
  struct err *e = malloc(sizeof *e); e->code = code; strncpy(e->msg, m, sizeof e->msg - 1); e->msg[63] = 0; return e;
}
static void *error_destroy(void *a) { struct { H h; struct err *e; } *x = a; free(x->e); return 0; }
static void *error_message(void *a) { struct { H h; struct err *e; const char *m; size_t n; } *x = a; x->m = x->e->msg; x->n = strlen(x->e->msg); return 0; }
static void *error_code(void *a) { struct { H h; struct err *e; int code; } *x = a; x->code = x->e->code; return 0; }
static void *ok(void *a) { return 0; }
static void *on_ready(void *a) {
  struct { H h; void *ev; on_ready_cb cb; void *arg; } *x = a;
#ifndef STUCK
  x->cb(0, x->arg);
#endif
  return 0;
}
static void *client_create(void *a) { struct { H h; void *o; size_t n; void *g, *ga, *p, *pa, *client; } *x = a; x->client = &dummy_client; return 0; }
static void *platform_name(void *a) { struct { H h; void *c; const char *s; size_t n; } *x = a; x->s = "fake"; x->n = 4; return 0; }
static void *devices(void *a) { static void *list[2] = { &devs[0], &devs[1] }; struct { H h; void *c; void **d; size_t n; } *x = a; x->d = list; x->n = 2; return 0; }
static void *get_description(void *a) { struct { H h; int *d; void *desc; } *x = a; x->desc = &descs[x->d - devs]; return 0; }
static void *description_id(void *a) { struct { H h; int *desc; int id; } *x = a; x->id = (int)(x->desc - descs) + 10; return 0; }
static void *compile(void *a) { return new_err(12, "the fake plugin compiles nothing"); }
static size_t esize(int t) { switch (t) { case 2: case 6: return 1; case 10: case 13: return 2; case 5: case 9: case 12: return 8; default: return 4; } }
static void *from_host(void *a) {
  struct { H h; void *c; const void *data; int t; const int64_t *dims; size_t nd; const int64_t *bs; size_t nbs; int sem; void *dev, *mem, *layout, *done; struct buf *buffer; } *x = a;
  size_t n = (size_t)x->dims[0] * esize(x->t);
  struct buf *b = malloc(sizeof *b + n); b->n = n; memcpy(b->data, x->data, n);
  x->done = 0; x->buffer = b; return 0;
}
static void *buffer_destroy(void *a) { struct { H h; struct buf *b; } *x = a; free(x->b); return 0; }
static void *to_host(void *a) {
  struct { H h; struct buf *src; void *layout, *dst; size_t n; void *event; } *x = a;
  if (x->n < x->src->n) return new_err(3, "destination too small");
#ifndef STUCK
  memcpy(x->dst, x->src->data, x->src->n);
#endif
  x->event = &dummy_event; return 0;
}
static struct api table;
const struct api *GetPjrtApi(void) {
  table.struct_size = sizeof table; table.v.struct_size = sizeof table.v;
  table.v.major = 0; table.v.minor = 81;
  table.f[0] = error_destroy; table.f[1] = error_message; table.f[2] = error_code;
  table.f[5] = ok;               /* Event_Destroy */
  table.f[9] = on_ready;         /* Event_OnReady */
  table.f[10] = client_create; table.f[11] = ok; table.f[12] = platform_name;
  table.f[16] = devices;         /* Client_AddressableDevices */
  table.f[20] = compile;         /* Client_Compile */
  table.f[22] = from_host;       /* Client_BufferFromHostBuffer */
  table.f[23] = description_id;  /* DeviceDescription_Id */
  table.f[29] = get_description; /* Device_GetDescription */
  table.f[58] = buffer_destroy;  /* Buffer_Destroy */
  table.f[70] = to_host;         /* Buffer_ToHostBuffer */
  return &table;
}
"#;

#[test]
fn a_refused_program_runs_host_staged() {
    let Some(so) = build_so("fake_plugin", FAKE_PLUGIN, &[]) else {
        return;
    };
    let client = Client::new(xla::Plugin::load(&so).unwrap(), &ClientOptions::default()).unwrap();
    assert_eq!(client.platform_name(), "fake");
    assert_eq!(client.devices()[1].id, 11);
    let a = client.buffer_from_host(&[1i64, -2, 3], 0).unwrap();
    let b = client.buffer_from_host(&[10i64, 20, -30], 1).unwrap();
    for round in 1..=2 {
        let out = client.all_reduce_buffers(&[&a, &b], ReduceOp::Sum).unwrap();
        assert_eq!(out[0].to_vec::<i64>().unwrap(), [11, 18, -27]);
        assert_eq!(out[1].device(), 1);
        assert_eq!(out[1].to_vec::<i64>().unwrap(), [11, 18, -27]);
        let s = client.cache_stats();
        // Refused once, remembered: the second call does not try to compile again.
        assert_eq!(
            (s.compiled, s.refused, s.staged_calls),
            (0, 1, round),
            "{s:?}"
        );
    }
    let g = client.all_gather_buffers(&[&a, &b]).unwrap();
    assert_eq!(g[1].to_vec::<i64>().unwrap(), [1, -2, 3, 10, 20, -30]);
    client.set_route(xla::Route::Program);
    let e = client
        .all_reduce_buffers(&[&a, &b], ReduceOp::Max)
        .unwrap_err();
    assert!(
        e.to_string().contains("the fake plugin compiles nothing"),
        "{e}"
    );
    assert!(e.to_string().contains("UNIMPLEMENTED"), "{e}");
}

#[test]
fn a_wait_that_never_ends_times_out() {
    let Some(so) = build_so("stuck_plugin", FAKE_PLUGIN, &["-DSTUCK"]) else {
        return;
    };
    let plugin = xla::Plugin::load(&so).unwrap();
    let client = Client::new(
        plugin,
        &ClientOptions::default().with_timeout(Duration::from_millis(300)),
    )
    .unwrap();
    assert_eq!(client.devices().len(), 2);
    let b = client.buffer_from_host(&[1.0f32; 16], 1).unwrap();
    let t = std::time::Instant::now();
    let e = b.to_vec::<f32>().unwrap_err();
    assert!(t.elapsed() >= Duration::from_millis(300) && t.elapsed() < Duration::from_secs(10));
    let m = e.to_string();
    assert!(
        m.contains("timed out after 300ms waiting for XLA device(s) 1"),
        "{m}"
    );
    let e = client.buffer_from_host(&[1.0f32; 16], 0).unwrap_err();
    assert!(e.to_string().contains("unusable"), "{e}");
    // A dead group is Aborted on every device kind.
    assert!(matches!(e, tutti::Error::Aborted { .. }), "{e:?}");
}

/// libtpu, when `TUTTI_TEST_LIBTPU` names it: it loads, and on a machine without TPUs the
/// client fails with a clean "no TPU" error (`TPU_SKIP_MDS_QUERY=1` keeps it from waiting
/// minutes for a cloud metadata server).
#[test]
fn libtpu_loads_and_reports_no_tpu() {
    let Some(path) = std::env::var_os("TUTTI_TEST_LIBTPU") else {
        eprintln!("libtpu: skipped: set TUTTI_TEST_LIBTPU=/path/to/libtpu.so to run it");
        return;
    };
    let out = tutti()
        .env("TUTTI_PJRT_PLUGIN", &path)
        .env("TPU_SKIP_MDS_QUERY", "1")
        .args(["devices", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    if xla::plugin::tpu_device_files() {
        assert!(
            v["xla"]["devices"]
                .as_array()
                .is_some_and(|d| !d.is_empty()),
            "{v}"
        );
    } else {
        let err = v["xla"]["error"].as_str().unwrap_or_default();
        // Loaded, version accepted, initialized: only the client found no TPU.
        assert!(err.contains("no TPU"), "{v}");
        assert!(err.contains("could not start a client"), "{v}");
        assert!(v["xla"]["api_version"].is_null(), "{v}");
    }
}
