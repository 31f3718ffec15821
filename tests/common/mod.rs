//! Shared helpers of the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use tutti::{DType, Element};

/// Small integral values (exact in every type, even f16 products of 8 of them): rank r,
/// element i.
pub fn value<T: Element>(r: usize, i: usize) -> T {
    let v = ((i * 7 + r * 3 + 1) % 5) as f64;
    let signed = !matches!(T::DTYPE, DType::U8 | DType::U32 | DType::U64);
    T::from_f64(if signed { v - 2.0 } else { v })
}

/// Rank r's buffer of `count` elements.
pub fn data<T: Element>(r: usize, count: usize) -> Vec<T> {
    (0..count).map(|i| value::<T>(r, i)).collect()
}

/// Build an example of this package with the test's profile, target directory and `features`,
/// and return its path (`cargo test --test X` alone builds no examples, and a stale one would
/// test old code).
pub fn example(name: &str, features: &[&str]) -> std::path::PathBuf {
    let features: Vec<String> = features.iter().map(|f| format!("tutti/{f}")).collect();
    build(&["--example", name], &features, &format!("examples/{name}"))
}

/// The `tutti` command (the `tutti-cli` package), built once per test process with this
/// test's profile, target directory and the library features the test was built with; or,
/// where `TUTTI_TEST_BIN` names one, that prebuilt command (for test binaries carried to a
/// machine without cargo, such as a GPU machine).
pub fn tutti_bin() -> std::path::PathBuf {
    static BIN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("TUTTI_TEST_BIN") {
            let bin = std::path::PathBuf::from(bin);
            assert!(
                bin.exists(),
                "TUTTI_TEST_BIN={} does not exist",
                bin.display()
            );
            return bin;
        }
        let mut features = Vec::new();
        if cfg!(feature = "xla") {
            features.push("tutti-cli/xla".to_string());
        }
        if cfg!(feature = "cuda") {
            features.push("tutti-cli/cuda".to_string());
        }
        if cfg!(feature = "mpi") {
            features.push("tutti-cli/mpi".to_string());
        }
        build(&["--bin", "tutti", "--test", "layers"], &features, "tutti")
    })
    .clone()
}

/// `cargo build` of `what` into this test's target directory and profile; the path of
/// `target/<profile>/<output>`. `what` selects targets of the whole workspace, with at least
/// one that has the dev-dependencies (an example or a test): cargo then resolves the
/// dependencies' features as `cargo test` of the workspace does, and reuses the library it
/// built for the tests, where `-p tutti-cli` alone would build tutti and its derives again
/// with other features. `features` are `package/feature`.
fn build(what: &[&str], features: &[String], output: &str) -> std::path::PathBuf {
    use std::path::Path;
    let exe = std::env::current_exe().expect("the test's own path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("tests run from target/<profile>/deps");
    let profile = profile_dir
        .file_name()
        .and_then(|p| p.to_str())
        .unwrap_or("debug")
        .to_string();
    let target_dir = profile_dir.parent().expect("target/<profile> has a parent");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(&cargo);
    cmd.arg("build")
        .arg("--quiet")
        .arg("--workspace")
        .args(what)
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    match profile.as_str() {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cargo}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p = profile_dir.join(output);
    assert!(p.exists(), "{} was not built", p.display());
    p
}

/// A port on loopback that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Rank `rank` of a `world`-rank job meeting at `master`, as `TUTTI_*` variables describe it
/// (for communicators made on threads of the test).
pub fn spec(rank: usize, world: usize, master: &str) -> tutti::ClusterSpec {
    let vars = [
        ("TUTTI_RANK".to_string(), rank.to_string()),
        ("TUTTI_WORLD_SIZE".to_string(), world.to_string()),
        ("TUTTI_MASTER_ADDR".to_string(), master.to_string()),
        (
            "TUTTI_JOB_TOKEN".to_string(),
            "in-process-job-token".to_string(),
        ),
    ];
    tutti::ClusterSpec::from_vars(&vars.into_iter().collect())
        .unwrap()
        .unwrap()
}

/// A store in memory: what torch's `HashStore` is, for threads of one process.
#[derive(Default)]
pub struct MemStore {
    pub map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl tutti::Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> tutti::Result<()> {
        self.map.lock().unwrap().insert(key.into(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> tutti::Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut map = self.map.lock().unwrap();
        loop {
            if let Some(v) = map.get(key) {
                return Ok(v.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(tutti::Error::JoinTimeout {
                    message: format!("key '{key}' was not set within {timeout:?}"),
                    timeout,
                });
            }
            map = self.changed.wait_timeout(map, left).unwrap().0;
        }
    }

    fn add(&self, key: &str, delta: i64) -> tutti::Result<i64> {
        let mut map = self.map.lock().unwrap();
        let v = map
            .get(key)
            .map(|v| String::from_utf8_lossy(v).parse::<i64>().unwrap())
            .unwrap_or(0)
            + delta;
        map.insert(key.into(), v.to_string().into_bytes());
        self.changed.notify_all();
        Ok(v)
    }
}
