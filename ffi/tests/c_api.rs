//! The C and C++ programs of the C API, compiled with every warning an error against
//! `libtutti.a` and run: collectives (every algorithm, several dtypes, checked values), every
//! error path, the replicas form, ranks in separate processes, the example trainer, the
//! README's C example and the C++ wrapper. `TUTTI_CFLAGS` adds compiler flags (the
//! AddressSanitizer pass of `.ci/run`).

mod common;

use std::time::Duration;

use common::{compile, run, Lang};

const LIMIT: Duration = Duration::from_secs(300);

#[test]
fn c_collectives_every_algorithm_and_dtype() {
    let exe = compile(
        Lang::C,
        "collectives",
        &["ffi/tests/c/collectives.c"],
        &["ffi/tests/c"],
    );
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("collectives:") && out.contains("ok"), "{out}");
}

#[test]
fn c_error_paths() {
    let exe = compile(
        Lang::C,
        "errors",
        &["ffi/tests/c/errors.c"],
        &["ffi/tests/c"],
    );
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("every error path: ok"), "{out}");
}

#[test]
fn c_non_blocking_calls() {
    let exe = compile(Lang::C, "async", &["ffi/tests/c/async.c"], &["ffi/tests/c"]);
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("async: ok"), "{out}");
}

/// all_to_all(_v), gather, scatter, all_gather_v and reduce_scatter_v, blocking and `_async`,
/// on 1 to 4 ranks with uneven counts and every root, and their argument errors.
#[test]
fn c_block_collectives() {
    let exe = compile(
        Lang::C,
        "blocks",
        &["ffi/tests/c/blocks.c"],
        &["ffi/tests/c"],
    );
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("blocks:") && out.contains("ok"), "{out}");
}

/// tutti_send, tutti_recv, their `_async` forms and groups (tutti_group_start/end) on 1 to 4
/// ranks on threads and 3 processes: a 1 MiB ring in a group (ended waiting, and with
/// tutti_group_end_async), one thread driving every rank,
/// blocking pairs, a count mismatch naming both ranks, argument errors and group misuse.
#[test]
fn c_point_to_point() {
    let exe = compile(Lang::C, "p2p", &["ffi/tests/c/p2p.c"], &["ffi/tests/c"]);
    let out = run(&exe, &[], LIMIT);
    assert!(
        out.contains("group misuse: ok") && out.contains("3 processes over TCP: ok"),
        "{out}"
    );
    assert!(out.contains("p2p: ok"), "{out}");
}

/// `tutti_comm_create_devices` over CPU devices, and over 4 XLA devices of the CPU plugin in a
/// build with `xla` and `TUTTI_PJRT_PLUGIN` set (else the clean "unavailable" path).
#[test]
fn c_device_groups() {
    let exe = compile(
        Lang::C,
        "devices",
        &["ffi/tests/c/devices.c"],
        &["ffi/tests/c"],
    );
    let out = run(
        &exe,
        &[("DEVICE_KIND", "cpu"), ("DEVICE_COUNT", "3")],
        LIMIT,
    );
    assert!(out.contains("devices cpu x3: ok"), "{out}");
    let out = run(
        &exe,
        &[("DEVICE_KIND", "xla"), ("DEVICE_COUNT", "4")],
        LIMIT,
    );
    if cfg!(feature = "xla") && std::env::var_os("TUTTI_PJRT_PLUGIN").is_some() {
        assert!(out.contains("devices xla x4: ok"), "{out}");
    } else {
        assert!(
            out.contains("devices xla x4: ok") || out.contains("devices: unavailable"),
            "{out}"
        );
    }
}

#[test]
fn c_replicas() {
    let exe = compile(
        Lang::C,
        "replicas",
        &["ffi/tests/c/replicas.c"],
        &["ffi/tests/c"],
    );
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("replicas:") && out.contains("ok"), "{out}");
}

#[test]
fn c_multiprocess() {
    let exe = compile(
        Lang::C,
        "multiprocess",
        &["ffi/tests/c/multiprocess.c"],
        &["ffi/tests/c"],
    );
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("multiprocess: ok"), "{out}");
}

/// `tutti_comm_create_store`: three ranks on threads meet through an in-memory store and
/// all-reduce; the errors of the arguments and of the store's callbacks name what failed.
#[test]
fn c_store_rendezvous() {
    let exe = compile(Lang::C, "store", &["ffi/tests/c/store.c"], &["ffi/tests/c"]);
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("store: ok"), "{out}");
}

#[test]
fn c_example_trainer() {
    let exe = compile(Lang::C, "train_step", &["examples/c/train_step.c"], &[]);
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("replicas agree"), "{out}");
}

/// XLA devices from C: run for real with a plugin (TUTTI_PJRT_PLUGIN) in a build with the
/// `xla` feature; otherwise the clean "not available" path.
#[test]
fn c_xla() {
    let exe = compile(Lang::C, "xla", &["ffi/tests/c/xla.c"], &["ffi/tests/c"]);
    let out = run(&exe, &[], LIMIT);
    if cfg!(feature = "xla") && std::env::var_os("TUTTI_PJRT_PLUGIN").is_some() {
        assert!(out.contains("xla: ok"), "{out}");
    } else {
        assert!(
            out.contains("xla: ok") || out.contains("xla: unavailable"),
            "{out}"
        );
    }
}

#[test]
fn c_strategies() {
    let exe = compile(
        Lang::C,
        "strategy",
        &["ffi/tests/c/strategy.c"],
        &["ffi/tests/c"],
    );
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("strategy: ok"), "{out}");
}

#[test]
fn c_checkpoints() {
    let exe = compile(
        Lang::C,
        "checkpoint",
        &["ffi/tests/c/checkpoint.c"],
        &["ffi/tests/c"],
    );
    let dir = std::env::temp_dir().join(format!("tutti-c-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = run(&exe, &[("CHECKPOINT_DIR", dir.to_str().unwrap())], LIMIT);
    assert!(out.contains("checkpoint: ok"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Parameter servers: a ps task, two workers and the chief on threads; scheduled steps with
/// payloads and outputs, a failing step, run_steps, and the argument errors.
#[test]
fn c_parameter_servers() {
    let exe = compile(Lang::C, "ps", &["ffi/tests/c/ps.c"], &["ffi/tests/c"]);
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("ps: ok"), "{out}");
}

#[test]
fn c_trainer_with_mirrored_strategy() {
    let exe = compile(
        Lang::C,
        "train_mirrored",
        &["examples/c/train_mirrored.c"],
        &[],
    );
    let out = run(&exe, &[], LIMIT);
    assert!(
        out.contains("mirrored replicas agree and converged"),
        "{out}"
    );
}

/// The README's C example (the first ```c block of its "C API" section) compiles and runs.
#[test]
fn readme_c_example() {
    let readme = std::fs::read_to_string(common::repo().join("README.md")).expect("README.md");
    let section = readme
        .split("\n## C API")
        .nth(1)
        .expect("the README has a \"## C API\" section");
    let code = section
        .split("```c\n")
        .nth(1)
        .and_then(|s| s.split("\n```").next())
        .expect("the C API section has a ```c block");
    let dir = common::profile_dir().join("c-api-tests");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("readme_example.c");
    std::fs::write(&src, code).unwrap();
    let rel = src.to_str().unwrap().to_string();
    let exe = compile(Lang::C, "readme_example", &[&rel], &[]);
    run(&exe, &[], LIMIT);
}

#[test]
fn cpp_wrapper() {
    let exe = compile(
        Lang::Cxx,
        "cpp_wrapper",
        &["bindings/cpp/tests/wrapper_test.cpp"],
        &["bindings/cpp"],
    );
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("tutti.hpp: ok"), "{out}");
}

/// Handles destroyed while other threads are inside calls on them, destroyed twice, work
/// handles destroyed while waited on, shared memory freed while a call on it is queued, and an
/// in-place reduce-scatter behind a call that writes its input: under AddressSanitizer in
/// `.ci/run`, any use after free or double free fails it.
#[test]
fn c_lifetimes_across_threads() {
    let exe = compile(
        Lang::C,
        "lifetime",
        &["ffi/tests/c/lifetime.c"],
        &["ffi/tests/c"],
    );
    let out = run(&exe, &[], LIMIT);
    assert!(out.contains("lifetime: ok"), "{out}");
}
