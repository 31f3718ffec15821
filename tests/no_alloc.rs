//! A repeated call allocates nothing: its plan (scratch, peer tables, poll sets) is built by
//! the first call of its shape and reused. Counted with a global allocator that counts the
//! allocations of the calling thread only.
//!
//! The ranks are threads of this test, each with its own communicator (in-process, or a network
//! communicator over TCP or shared memory: the same code path as separate processes), except
//! across hosts: there the ranks are processes (this test binary again) whose host ids differ.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, spec};

use tutti::{local_group, Algorithm, Communicator, Config, ReduceOp, TransportKind};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: the allocator also runs while a thread's locals are torn down.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards every request to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// Communicators of `world` ranks over `kind` (`None`: in-process), configured by `config`.
fn group(world: usize, kind: Option<TransportKind>, config: &Config) -> Vec<Communicator> {
    let config = config.clone().with_timeout(Duration::from_secs(20));
    let Some(kind) = kind else {
        return local_group(world, &config).unwrap();
    };
    let master = format!("127.0.0.1:{}", free_port());
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (m, c) = (&master, &config);
                s.spawn(move || Communicator::from_cluster(&spec(r, world, m), kind, c).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every collective of `count` f32 elements, as a trainer repeats them.
fn every_collective(c: &Communicator, count: usize, bufs: &mut Buffers) {
    let world = c.world_size();
    c.all_reduce(&mut bufs.a[..count], ReduceOp::Sum).unwrap();
    c.all_reduce_into(&bufs.b[..count], &mut bufs.a[..count], ReduceOp::Max)
        .unwrap();
    c.broadcast(&mut bufs.a[..count], world - 1).unwrap();
    c.all_gather(&bufs.b[..count], &mut bufs.g[..count * world])
        .unwrap();
    c.reduce_scatter(
        &bufs.g[..count * world],
        &mut bufs.a[..count],
        ReduceOp::Sum,
    )
    .unwrap();
    let root = c.rank() == 0;
    c.reduce(
        &bufs.b[..count],
        root.then_some(&mut bufs.a[..count]),
        ReduceOp::Sum,
        0,
    )
    .unwrap();
    c.barrier().unwrap();
}

struct Buffers {
    a: Vec<f32>,
    b: Vec<f32>,
    g: Vec<f32>,
}

/// The allocations of each rank's thread over `rounds` repeats of every collective at every
/// count, after a first round that builds the plans.
fn repeated(comms: &[Communicator], counts: &[usize], rounds: usize) -> Vec<u64> {
    let max = counts.iter().copied().max().unwrap_or(0);
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let world = c.world_size();
                    // A thread's first sleep lets parking_lot allocate its thread data (and grow
                    // its table): sleep once before counting, whether or not a call will.
                    let lock = parking_lot::Mutex::new(());
                    parking_lot::Condvar::new()
                        .wait_for(&mut lock.lock(), Duration::from_micros(1));
                    let mut bufs = Buffers {
                        a: vec![1.0; max],
                        b: vec![2.0; max],
                        g: vec![0.0; max * world],
                    };
                    for &n in counts {
                        every_collective(c, n, &mut bufs);
                    }
                    let before = allocations();
                    for _ in 0..rounds {
                        for &n in counts {
                            every_collective(c, n, &mut bufs);
                        }
                    }
                    allocations() - before
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// 1 element, small (one-step) sizes and sizes that take the chunked ring.
const COUNTS: [usize; 5] = [1, 2, 256, 4099, 300_000];

fn check(kind: Option<TransportKind>, algorithm: Algorithm, world: usize) {
    let comms = group(
        world,
        kind,
        &Config::default()
            .with_algorithm(algorithm)
            .with_chunk_bytes(64 << 10),
    );
    let counts = repeated(&comms, &COUNTS, 3);
    assert!(
        counts.iter().all(|&n| n == 0),
        "{kind:?} {algorithm}, {world} ranks: repeated calls allocated {counts:?} times (per rank)"
    );
}

#[test]
fn repeated_calls_allocate_nothing_in_process() {
    for algo in [
        Algorithm::Auto,
        Algorithm::Ring,
        Algorithm::Direct,
        Algorithm::HierarchicalCopy { group_size: 2 },
        Algorithm::ReduceToOne { root: 1 },
        Algorithm::Hosts,
    ] {
        check(None, algo, 2);
        check(None, algo, 4);
    }
}

#[test]
fn repeated_calls_allocate_nothing_over_tcp() {
    for algo in [
        Algorithm::Auto,
        Algorithm::Ring,
        Algorithm::HierarchicalCopy { group_size: 2 },
        Algorithm::ReduceToOne { root: 1 },
        Algorithm::Hosts,
    ] {
        check(Some(TransportKind::Tcp), algo, 2);
        check(Some(TransportKind::Tcp), algo, 3);
        check(Some(TransportKind::Tcp), algo, 4);
    }
}

#[test]
fn repeated_calls_allocate_nothing_over_shared_memory() {
    for algo in [
        Algorithm::Auto,
        Algorithm::Ring,
        Algorithm::HierarchicalCopy { group_size: 2 },
        Algorithm::ReduceToOne { root: 1 },
        Algorithm::Hosts,
    ] {
        check(Some(TransportKind::Shm), algo, 2);
        check(Some(TransportKind::Shm), algo, 3);
        check(Some(TransportKind::Shm), algo, 4);
    }
}

/// Set in the child processes of [`repeated_calls_allocate_nothing_across_hosts`]: the rank, the
/// world size and where the ranks meet.
const CHILD: &str = "TUTTI_NOALLOC_CHILD";

#[test]
fn repeated_calls_allocate_nothing_across_hosts() {
    // Two "hosts" of two ranks each (TUTTI_HOST_ID is per process, so the ranks are processes):
    // auto's large all-reduce runs the hierarchy (a reduce-scatter within each host, a ring
    // among the hosts for each slice, an all-gather within each host, pipelined in the same
    // exchanges), and that path too reuses its plan and the transport's scratch.
    const WORLD: usize = 4;
    if let Ok(child) = std::env::var(CHILD) {
        let mut parts = child.split(' ');
        let (Some(rank), Some(master)) = (parts.next(), parts.next()) else {
            panic!("{CHILD}={child}: expected 'RANK MASTER'");
        };
        let config = Config::default()
            .with_timeout(Duration::from_secs(30))
            .with_chunk_bytes(64 << 10);
        let c = Communicator::from_cluster(
            &spec(rank.parse().unwrap(), WORLD, master),
            TransportKind::Auto,
            &config,
        )
        .unwrap();
        let n = repeated(std::slice::from_ref(&c), &COUNTS, 3)[0];
        println!("allocations: {n}");
        return;
    }
    let master = format!("127.0.0.1:{}", free_port());
    let children: Vec<Child> = (0..WORLD)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "repeated_calls_allocate_nothing_across_hosts",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD, format!("{r} {master}"))
                .env("TUTTI_HOST_ID", if r < 2 { "host-a" } else { "host-b" })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let started = Instant::now();
    for (r, mut c) in children.into_iter().enumerate() {
        while c.try_wait().unwrap().is_none() {
            if started.elapsed() > Duration::from_secs(120) {
                let _ = c.kill();
                panic!("rank {r} ran past 120 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = c.wait_with_output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "rank {r}:\n{out}\n{err}");
        assert!(
            out.contains("allocations: 0"),
            "rank {r}: repeated calls across hosts allocated:\n{out}"
        );
    }
}
