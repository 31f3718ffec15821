//! Ranks that meet through a store the caller provides (`Communicator::from_store`): an
//! in-memory store shared by threads, as a framework's own store would be shared by processes.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::MemStore;

use tutti::{Communicator, Config, Error, ReduceOp, Store, TransportKind};

const TOKEN: &str = "a-token-of-32-bytes-for-the-test";

fn config(timeout: Duration) -> Config {
    Config {
        timeout,
        ..Config::default()
    }
}

/// Every rank of `world` made through `store` on its own thread, each given `token`.
fn ranks(
    store: &Arc<MemStore>,
    world: usize,
    token: &str,
    kind: TransportKind,
) -> Vec<tutti::Result<Communicator>> {
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let store = store.clone();
            let token = token.to_string();
            std::thread::spawn(move || {
                Communicator::from_store(
                    r,
                    world,
                    &*store,
                    &token,
                    "127.0.0.1",
                    kind,
                    &config(Duration::from_secs(20)),
                )
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// All-reduce on every communicator at once; each rank's result.
fn all_reduce(comms: Vec<Communicator>) -> Vec<Vec<f32>> {
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let r = c.rank() as f32;
                let mut v = vec![r + 1.0, 10.0 * r];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                v
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn three_ranks_meet_through_a_shared_store_and_all_reduce() {
    for kind in [TransportKind::Tcp, TransportKind::Auto] {
        let store = Arc::new(MemStore::default());
        let comms: Vec<Communicator> = ranks(&store, 3, TOKEN, kind)
            .into_iter()
            .map(|c| c.unwrap())
            .collect();
        for (r, c) in comms.iter().enumerate() {
            assert_eq!((c.rank(), c.world_size()), (r, 3));
        }
        for v in all_reduce(comms) {
            assert_eq!(v, vec![6.0, 30.0], "transport {kind}");
        }
        // A second communicator over the same store is numbered apart from the first.
        let again: Vec<Communicator> = ranks(&store, 3, TOKEN, kind)
            .into_iter()
            .map(|c| c.unwrap())
            .collect();
        for v in all_reduce(again) {
            assert_eq!(v, vec![6.0, 30.0]);
        }
        let map = store.map.lock().unwrap();
        assert!(map.contains_key("tutti/2/addr/0"), "{:?}", map.keys());
    }
}

#[test]
fn a_short_token_or_bad_rank_is_refused_before_the_store_is_touched() {
    let store = MemStore::default();
    let make = |rank, world, token: &str, host: &str| {
        Communicator::from_store(
            rank,
            world,
            &store,
            token,
            host,
            TransportKind::Auto,
            &Config::default(),
        )
        .map(|_| ())
        .unwrap_err()
    };
    let e = make(0, 2, "short", "127.0.0.1");
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("token is 5 bytes"), "{e}");
    assert!(e.to_string().contains("at least 16"), "{e}");
    let e = make(2, 2, TOKEN, "127.0.0.1");
    assert!(e.to_string().contains("rank 2 is out of range"), "{e}");
    let e = make(0, 0, TOKEN, "127.0.0.1");
    assert!(e.to_string().contains("world_size is 0"), "{e}");
    let e = make(0, 2, TOKEN, "");
    assert!(e.to_string().contains("listen_host"), "{e}");
    assert!(store.map.lock().unwrap().is_empty());
}

#[test]
fn a_wrong_token_does_not_join() {
    // Two ranks with different secrets: the connection does not prove the token, so neither
    // joins, and each says so within the timeout.
    let store = Arc::new(MemStore::default());
    let handles: Vec<_> = [TOKEN, "another-token-of-32-bytes-long!!"]
        .into_iter()
        .enumerate()
        .map(|(r, token)| {
            let store = store.clone();
            std::thread::spawn(move || {
                Communicator::from_store(
                    r,
                    2,
                    &*store,
                    token,
                    "127.0.0.1",
                    TransportKind::Tcp,
                    &config(Duration::from_secs(2)),
                )
                .map(|_| ())
            })
        })
        .collect();
    let t = Instant::now();
    let errors: Vec<String> = handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap_err().to_string())
        .collect();
    // Rank 1 is told its proof was refused; rank 0 that rank 1 never connected.
    assert!(errors[1].contains("job tokens differ"), "{}", errors[1]);
    assert!(
        errors[0].contains("ranks [1] did not connect"),
        "{}",
        errors[0]
    );
    assert!(t.elapsed() < Duration::from_secs(15));
}

#[test]
fn a_rank_that_never_comes_is_a_timeout_naming_it() {
    let store = Arc::new(MemStore::default());
    let t = Instant::now();
    // Ranks 0 and 2 of 3 come; rank 1 never does.
    let handles: Vec<_> = [0usize, 2]
        .into_iter()
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                Communicator::from_store(
                    r,
                    3,
                    &*store,
                    TOKEN,
                    "127.0.0.1",
                    TransportKind::Auto,
                    &config(Duration::from_millis(800)),
                )
                .map(|_| ())
            })
        })
        .collect();
    for h in handles {
        let e = h.join().unwrap().unwrap_err();
        assert!(matches!(e, Error::JoinTimeout { .. }), "{e}");
        assert!(e.to_string().contains("rank 1 did not publish"), "{e}");
    }
    assert!(t.elapsed() < Duration::from_secs(10));
}

/// A store whose every call fails, as a framework's store does when its server is gone.
struct Broken;

impl Store for Broken {
    fn set(&self, key: &str, _: &[u8]) -> tutti::Result<()> {
        Err(Error::System {
            what: format!("setting '{key}'"),
            message: "connection reset".into(),
        })
    }
    fn get(&self, key: &str, _: Duration) -> tutti::Result<Vec<u8>> {
        Err(Error::System {
            what: format!("getting '{key}'"),
            message: "connection reset".into(),
        })
    }
    fn add(&self, key: &str, _: i64) -> tutti::Result<i64> {
        Err(Error::System {
            what: format!("adding to '{key}'"),
            message: "connection reset".into(),
        })
    }
}

#[test]
fn a_failing_store_is_an_error_naming_the_key() {
    let e = Communicator::from_store(
        0,
        2,
        &Broken,
        TOKEN,
        "127.0.0.1",
        TransportKind::Auto,
        &Config::default(),
    )
    .map(|_| ())
    .unwrap_err();
    assert!(matches!(e, Error::System { .. }), "{e}");
    assert!(e.to_string().contains("'tutti/generation/0'"), "{e}");
}
