//! The job's key: the secret every connection of a job proves in its handshake. One rule decides
//! it, for every way of joining (a communicator, a GPU group, the parameter-server strategy,
//! whether the spec came from the environment or was built by hand): [`ClusterSpec::job_key`].

use std::collections::HashMap;

use super::{auth, prefix, split_addr, ClusterSpec, MAX_WORLD_SIZE};
use crate::error::{Error, Result};

/// The fewest bytes a job token given by the user (`TUTTI_JOB_TOKEN`, or a spec's `token`) may
/// have: 16 bytes of random hex (`openssl rand -hex 8`) are 64 bits, the least an offline guess
/// against a recorded handshake should face. `tutti launch` and the per-user secret use 32.
pub const MIN_TOKEN_BYTES: usize = 16;

/// The variables the rule reads: the token, the opt-out, and where this user's secret lives.
const KEY_VARS: [&str; 4] = [
    "TUTTI_JOB_TOKEN",
    "TUTTI_INSECURE",
    "HOME",
    "XDG_RUNTIME_DIR",
];

/// What the rule decided.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Secret {
    /// The key every connection proves.
    Key(String),
    /// No secret: the job spans hosts and `TUTTI_INSECURE=1` opted out.
    Insecure,
}

impl ClusterSpec {
    /// The secret this job's connections prove, decided by the one rule that every way of
    /// joining applies before it makes or accepts a connection (`Communicator::from_cluster`,
    /// `Strategy::multi_worker_mirrored`, `ParameterServerStrategy::new`,
    /// `GpuGroup::from_cluster`, and everything built on them), so a spec built by hand, or by
    /// [`from_tf_config`](super::from_tf_config), gets what one from the environment gets:
    ///
    /// 1. the spec's `token`, else `TUTTI_JOB_TOKEN`, of at least [`MIN_TOKEN_BYTES`] bytes;
    /// 2. else, when every address in the spec is loopback (one host), this user's secret: a
    ///    random token in `$XDG_RUNTIME_DIR/tutti/secret` (else `~/.cache/tutti/secret`), mode
    ///    0600, which other users cannot read;
    /// 3. else (across hosts) an error saying how to set a token, unless `TUTTI_INSECURE=1`
    ///    opts out: then the key is empty and a warning says the job is open.
    ///
    /// It also refuses a spec whose world size or rank is out of range, before anything is
    /// allocated for it.
    pub fn job_key(&self) -> Result<String> {
        let vars: HashMap<String, String> = KEY_VARS
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
            .collect();
        match job_secret(self, &vars)? {
            Secret::Key(k) => Ok(k),
            Secret::Insecure => {
                log::warn!("{}", insecure_warning(self));
                Ok(String::new())
            }
        }
    }
}

/// The warning of a job that runs without a secret.
pub(crate) fn insecure_warning(spec: &ClusterSpec) -> String {
    format!(
        "{} {}: TUTTI_INSECURE=1: this job has no secret; any process that reaches its ports \
         (rendezvous at {}) can join it, read or set its store, or send it data",
        spec.task_type,
        spec.rank
            .map_or_else(|| spec.task_index.to_string(), |r| r.to_string()),
        spec.rendezvous
    )
}

/// Check a token the user gave: long enough to be a secret.
pub(crate) fn check_token(token: &str, what: &str) -> Result<()> {
    if token.len() < MIN_TOKEN_BYTES {
        return Err(Error::config(format!(
            "{what} is {} bytes; a job token needs at least {MIN_TOKEN_BYTES} (a random one: \
             TUTTI_JOB_TOKEN=$(openssl rand -hex 16), the same on every rank)",
            token.len()
        )));
    }
    Ok(())
}

/// The rule of [`ClusterSpec::job_key`], over a set of variables (the environment, or a
/// test's). [`ClusterSpec::from_vars`] applies it too, to fail early and to carry the secret.
pub(crate) fn job_secret(spec: &ClusterSpec, vars: &HashMap<String, String>) -> Result<Secret> {
    let from = prefix(spec.source);
    if spec.world_size == 0 || spec.world_size > MAX_WORLD_SIZE {
        return Err(Error::config(format!(
            "{from}world size {} is out of range (1 to {MAX_WORLD_SIZE})",
            spec.world_size
        )));
    }
    if let Some(r) = spec.rank.filter(|&r| r >= spec.world_size) {
        return Err(Error::config(format!(
            "{from}rank {r} is out of range for world size {}",
            spec.world_size
        )));
    }
    if let Some(t) = spec.token.as_deref().filter(|t| !t.is_empty()) {
        check_token(t, &format!("{from}the cluster spec's token"))?;
        return Ok(Secret::Key(t.to_string()));
    }
    if let Some(t) = vars.get("TUTTI_JOB_TOKEN").filter(|t| !t.is_empty()) {
        check_token(t, "TUTTI_JOB_TOKEN")?;
        return Ok(Secret::Key(t.clone()));
    }
    let elsewhere = std::iter::once(&spec.rendezvous)
        .chain(spec.cluster.values().flatten())
        .find(|a| !split_addr(a, "address").is_ok_and(|(h, _)| is_loopback(&h)));
    let Some(elsewhere) = elsewhere else {
        return auth::user_secret(vars).map(Secret::Key);
    };
    if vars.get("TUTTI_INSECURE").is_some_and(|v| v == "1") {
        return Ok(Secret::Insecure);
    }
    Err(Error::config(format!(
        "{from}this job spans hosts (rendezvous at {}, {elsewhere} is not loopback) and has no \
         secret: set TUTTI_JOB_TOKEN to the same random string of at least {MIN_TOKEN_BYTES} \
         bytes on every rank (e.g. TUTTI_JOB_TOKEN=$(openssl rand -hex 16) in the job's \
         environment), or TUTTI_INSECURE=1 to run without one on a network you trust",
        spec.rendezvous
    )))
}

/// True for a name of this host's loopback interface: `localhost`, 127.0.0.0/8, `::1` (and
/// IPv4-mapped 127.x).
pub(crate) fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") || host.eq_ignore_ascii_case("localhost.") {
        return true;
    }
    match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(a)) => a.is_loopback(),
        Ok(std::net::IpAddr::V6(a)) => {
            a.is_loopback() || a.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::from_tf_config;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn temp_home(what: &str) -> std::path::PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("tutti-key-{what}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A spec as a program builds one by hand from a TF_CONFIG it holds (no token).
    fn tf(cluster: serde_json::Value, ty: &str, index: usize) -> ClusterSpec {
        let text = serde_json::json!({"cluster": cluster, "task": {"type": ty, "index": index}});
        let s = from_tf_config(&text.to_string()).unwrap();
        assert_eq!(s.token, None);
        s
    }

    fn free_addr() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("127.0.0.1:{}", l.local_addr().unwrap().port())
    }

    /// The rule on specs built by hand: the same outcomes `from_vars` gives.
    #[test]
    fn the_rule_on_a_spec_built_by_hand() {
        let home = temp_home("rule");
        let h = home.to_str().unwrap();
        let one = tf(
            serde_json::json!({"chief": ["127.0.0.1:1"], "worker": ["localhost:2", "[::1]:3"]}),
            "worker",
            0,
        );
        // One host: this user's secret, the one in the file.
        let Secret::Key(k) = job_secret(&one, &vars(&[("HOME", h)])).unwrap() else {
            panic!("no key")
        };
        let file = home.join(".cache/tutti/secret");
        assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), k);
        assert!(k.len() >= 32);
        // Across hosts: refused, saying how to set a token (and how long).
        let two = tf(
            serde_json::json!({"chief": ["10.0.0.1:1"], "worker": ["10.0.0.2:1"]}),
            "chief",
            0,
        );
        let e = job_secret(&two, &vars(&[("HOME", h)]))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("TF_CONFIG: ")
                && e.contains("TUTTI_JOB_TOKEN")
                && e.contains("TUTTI_INSECURE=1")
                && e.contains("at least 16"),
            "{e}"
        );
        // One address elsewhere is enough to span hosts.
        let mixed = tf(
            serde_json::json!({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "evaluator": ["gpu7:1"]}),
            "chief",
            0,
        );
        let e = job_secret(&mixed, &vars(&[("HOME", h)])).unwrap_err();
        assert!(e.to_string().contains("gpu7:1 is not loopback"), "{e}");
        // The opt-out, and the warning it gives.
        assert_eq!(
            job_secret(&two, &vars(&[("TUTTI_INSECURE", "1")])).unwrap(),
            Secret::Insecure
        );
        assert!(job_secret(&two, &vars(&[("TUTTI_INSECURE", "yes")])).is_err());
        let w = insecure_warning(&two);
        assert!(
            w.contains("chief 0: TUTTI_INSECURE=1") && w.contains("10.0.0.1:1"),
            "{w}"
        );
        // A token: the spec's first, else the environment's; either checked for length.
        let given = "0123456789abcdef";
        let from_env = job_secret(&two, &vars(&[("TUTTI_JOB_TOKEN", given)])).unwrap();
        assert_eq!(from_env, Secret::Key(given.into()));
        let with = ClusterSpec {
            token: Some("fedcba9876543210".into()),
            ..two.clone()
        };
        let s = job_secret(&with, &vars(&[("TUTTI_JOB_TOKEN", given)])).unwrap();
        assert_eq!(s, Secret::Key("fedcba9876543210".into()));
        let e = job_secret(&two, &vars(&[("TUTTI_JOB_TOKEN", "short")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("TUTTI_JOB_TOKEN is 5 bytes; a job token needs at least 16"),
            "{e}"
        );
        let short = ClusterSpec {
            token: Some("short".into()),
            ..one.clone()
        };
        let e = job_secret(&short, &vars(&[("HOME", h)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("the cluster spec's token is 5 bytes"), "{e}");
        // An empty token is no token: the rule decides.
        let empty = ClusterSpec {
            token: Some(String::new()),
            ..two.clone()
        };
        assert!(job_secret(&empty, &vars(&[])).is_err());
        // A world size or rank out of range is refused before anything is sized by it.
        let huge = ClusterSpec {
            world_size: 1 << 60,
            ..one.clone()
        };
        let e = job_secret(&huge, &vars(&[])).unwrap_err().to_string();
        assert!(
            e.contains("world size 1152921504606846976 is out of range"),
            "{e}"
        );
        let far = ClusterSpec {
            rank: Some(9),
            ..one.clone()
        };
        let e = job_secret(&far, &vars(&[])).unwrap_err().to_string();
        assert!(e.contains("rank 9 is out of range"), "{e}");
        std::fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn loopback_names() {
        for h in [
            "localhost",
            "LOCALHOST",
            "127.0.0.1",
            "127.9.8.7",
            "::1",
            "[::1]",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_loopback(h), "{h}");
        }
        for h in [
            "0.0.0.0",
            "10.0.0.1",
            "::",
            "gpu1",
            "127.0.0.1.example.com",
            "localhostx",
            "",
        ] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    /// Set in the child processes of the tests below: they join jobs, and the rule reads this
    /// process's environment, which the parent sets (a home of its own, no token).
    const CHILD: &str = "TUTTI_KEY_TEST_CHILD";

    struct StderrLog;
    impl log::Log for StderrLog {
        fn enabled(&self, _: &log::Metadata) -> bool {
            true
        }
        fn log(&self, r: &log::Record) {
            eprintln!("[{}] {}", r.level(), r.args());
        }
        fn flush(&self) {}
    }
    static LOG: StderrLog = StderrLog;

    /// Run the test `name` again in a child process with a fresh `HOME`, no token, and `env`;
    /// its exit status and output. In the child, `true` (and warnings go to stderr).
    fn in_child(name: &str, env: &[(&str, &str)]) -> Option<(bool, String)> {
        if std::env::var_os(CHILD).is_some() {
            let _ = log::set_logger(&LOG);
            log::set_max_level(log::LevelFilter::Warn);
            return None;
        }
        let home = temp_home("child");
        let mut c = Command::new(std::env::current_exe().unwrap())
            .args([
                &format!("cluster::key::tests::{name}"),
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .env("HOME", &home)
            .env_remove("XDG_RUNTIME_DIR")
            .env_remove("TUTTI_JOB_TOKEN")
            .env_remove("TUTTI_INSECURE")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while c.try_wait().unwrap().is_none() {
            if t.elapsed() > Duration::from_secs(120) {
                let _ = c.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = c.wait_with_output().unwrap();
        let _ = std::fs::remove_dir_all(&home);
        let out = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        Some((o.status.success(), out))
    }

    /// Wait until something listens at `addr`.
    fn until_listening(addr: &str, alive: impl Fn() -> bool) {
        let t = Instant::now();
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(alive(), "the server stopped before it listened at {addr}");
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "nothing listens at {addr}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A stranger that knows the address but not the secret: it answers the challenge with the
    /// empty key, as a job without a secret would accept.
    fn stranger(addr: &str, purpose: auth::Purpose) -> Result<()> {
        let mut s = std::net::TcpStream::connect(addr).map_err(|e| Error::io("connecting", e))?;
        auth::handshake_client(&mut s, "", purpose, 1, Duration::from_secs(5))
    }

    /// Communicators (and so `multi_worker_mirrored`, built on them) from a spec built by hand
    /// without a token: on one host they share this user's secret, and a stranger with the
    /// empty key is refused by the store.
    #[test]
    fn communicators_from_a_hand_built_spec_refuse_strangers() {
        let Some((ok, out)) =
            in_child("communicators_from_a_hand_built_spec_refuse_strangers", &[])
        else {
            let (chief, worker) = (free_addr(), free_addr());
            let cluster = serde_json::json!({"chief": [chief], "worker": [worker]});
            let (s0, s1) = (tf(cluster.clone(), "chief", 0), tf(cluster, "worker", 0));
            let config = crate::Config::default().with_timeout(Duration::from_secs(30));
            std::thread::scope(|sc| {
                let r0 = sc.spawn(|| {
                    crate::Communicator::from_cluster(&s0, crate::TransportKind::Tcp, &config)
                });
                until_listening(&chief, || !r0.is_finished());
                let e = stranger(&chief, auth::Purpose::Store);
                assert!(
                    e.is_err(),
                    "a stranger with the empty key reached the store"
                );
                let c1 = crate::Communicator::from_cluster(&s1, crate::TransportKind::Tcp, &config)
                    .unwrap();
                let c0 = r0.join().unwrap().unwrap();
                let h = sc.spawn(move || {
                    let mut x = [1u32; 3];
                    c0.all_reduce(&mut x, crate::ReduceOp::Sum).unwrap();
                    x
                });
                let mut y = [2u32; 3];
                c1.all_reduce(&mut y, crate::ReduceOp::Sum).unwrap();
                assert_eq!((h.join().unwrap(), y), ([3; 3], [3; 3]));
            });
            let home = std::env::var("HOME").unwrap();
            assert!(std::path::Path::new(&home)
                .join(".cache/tutti/secret")
                .exists());
            println!("joined");
            return;
        };
        assert!(ok && out.contains("joined"), "{out}");
    }

    /// Across hosts a spec without a token is refused before anything connects (the error
    /// says how to set one); `TUTTI_INSECURE=1` runs it, with a warning.
    #[test]
    fn communicators_across_hosts_need_a_token_or_the_opt_out() {
        let Some((ok, out)) = in_child(
            "communicators_across_hosts_need_a_token_or_the_opt_out",
            &[],
        ) else {
            // Both ranks on loopback, but the spec names another host (an evaluator): by the
            // rule, the job spans hosts.
            let (chief, worker) = (free_addr(), free_addr());
            let cluster = serde_json::json!({"chief": [chief], "worker": [worker], "evaluator": ["10.255.0.1:2222"]});
            let (s0, s1) = (tf(cluster.clone(), "chief", 0), tf(cluster, "worker", 0));
            let config = crate::Config::default().with_timeout(Duration::from_secs(20));
            let join = || {
                std::thread::scope(|sc| {
                    let r0 = sc.spawn(|| {
                        crate::Communicator::from_cluster(&s0, crate::TransportKind::Tcp, &config)
                    });
                    let r1 =
                        crate::Communicator::from_cluster(&s1, crate::TransportKind::Tcp, &config);
                    (r0.join().unwrap().map(|_| ()), r1.map(|_| ()))
                })
            };
            if std::env::var("TUTTI_INSECURE").is_ok() {
                let (a, b) = join();
                a.unwrap();
                b.unwrap();
                println!("joined without a secret");
            } else {
                let t = Instant::now();
                let (a, b) = join();
                for e in [a.unwrap_err(), b.unwrap_err()] {
                    let e = e.to_string();
                    assert!(
                        e.contains("spans hosts") && e.contains("TUTTI_JOB_TOKEN"),
                        "{e}"
                    );
                }
                assert!(
                    t.elapsed() < Duration::from_secs(15),
                    "refused only after a wait (the timeout is 20 s)"
                );
                // And so is the strategy built on them.
                let e = crate::strategy::Strategy::multi_worker_mirrored(
                    crate::strategy::CommunicationImplementation::Ring,
                    Some(s0.clone()),
                    &[],
                )
                .err()
                .unwrap()
                .to_string();
                assert!(e.contains("spans hosts"), "{e}");
                println!("refused");
            }
            return;
        };
        assert!(ok && out.contains("refused"), "{out}");
        let (ok, out) = in_child(
            "communicators_across_hosts_need_a_token_or_the_opt_out",
            &[("TUTTI_INSECURE", "1")],
        )
        .unwrap();
        assert!(ok && out.contains("joined without a secret"), "{out}");
        assert!(
            out.matches("TUTTI_INSECURE=1: this job has no secret")
                .count()
                >= 2,
            "every rank says it runs without a secret: {out}"
        );
    }

    /// The parameter-server strategy from a spec built by hand: across hosts refused without a
    /// token; on one host its tasks share this user's secret and refuse a stranger with the
    /// empty key; with `TUTTI_INSECURE=1` across hosts it runs, with a warning.
    #[test]
    fn parameter_servers_from_a_hand_built_spec() {
        use crate::strategy::ps::{ParameterServerStrategy, Partitioner, Role};
        let Some((ok, out)) = in_child("parameter_servers_from_a_hand_built_spec", &[]) else {
            let p = Partitioner::MaxShards(1);
            let far = tf(
                serde_json::json!({"chief": ["10.0.0.1:1"], "worker": ["10.0.0.2:1"], "ps": ["10.0.0.3:1"]}),
                "worker",
                0,
            );
            let insecure = std::env::var("TUTTI_INSECURE").is_ok();
            let e = ParameterServerStrategy::new(far, p).err();
            if insecure {
                assert!(e.is_none(), "{e:?}");
            } else {
                let e = e.unwrap().to_string();
                assert!(
                    e.contains("spans hosts") && e.contains("TUTTI_JOB_TOKEN"),
                    "{e}"
                );
            }
            let (chief, worker, ps) = (free_addr(), free_addr(), free_addr());
            let mut cluster = serde_json::json!({"chief": [chief], "worker": [worker], "ps": [ps]});
            if insecure {
                cluster["evaluator"] = serde_json::json!(["10.255.0.1:2222"]);
            }
            let strategy = |ty: &str| {
                ParameterServerStrategy::new(tf(cluster.clone(), ty, 0), p)
                    .unwrap()
                    .with_timeout(Duration::from_secs(20))
            };
            let step = |_: &crate::strategy::ps::StepContext| -> crate::strategy::ps::StepResult {
                Ok((Vec::new(), 0.0))
            };
            std::thread::scope(|sc| {
                let (sw, sp) = (strategy("worker"), strategy("ps"));
                let w = sc.spawn(move || sw.run_role(step).map(|r| matches!(r, Role::Done)));
                let s = sc.spawn(move || sp.run_role(step).map(|r| matches!(r, Role::Done)));
                until_listening(&ps, || !s.is_finished());
                until_listening(&worker, || !w.is_finished());
                let e = stranger(&ps, auth::Purpose::Data);
                assert_eq!(e.is_err(), !insecure, "the empty key at a ps task: {e:?}");
                let e = stranger(&worker, auth::Purpose::Data);
                assert_eq!(e.is_err(), !insecure, "the empty key at a worker: {e:?}");
                let Role::Chief(c) = strategy("chief").run_role(step).unwrap() else {
                    panic!("the chief got no coordinator")
                };
                let v = c.create_variable("v", &[1.0, 2.0], 0.1).unwrap();
                assert_eq!(c.read_variable(v).unwrap(), [1.0, 2.0]);
                c.shutdown().unwrap();
                assert!(w.join().unwrap().unwrap() && s.join().unwrap().unwrap());
            });
            println!("served");
            return;
        };
        assert!(ok && out.contains("served"), "{out}");
        let (ok, out) = in_child(
            "parameter_servers_from_a_hand_built_spec",
            &[("TUTTI_INSECURE", "1")],
        )
        .unwrap();
        assert!(ok && out.contains("served"), "{out}");
        assert!(
            out.contains("TUTTI_INSECURE=1: this job has no secret"),
            "{out}"
        );
    }

    /// The GPU group's path applies the rule before it looks for a device (so this runs
    /// without a GPU): across hosts without a token, the token error; with the opt-out, a
    /// warning and then whatever the devices say.
    #[cfg(feature = "cuda")]
    #[test]
    fn gpu_groups_apply_the_rule_before_any_device() {
        let Some((ok, out)) = in_child("gpu_groups_apply_the_rule_before_any_device", &[]) else {
            let far = tf(
                serde_json::json!({"chief": ["127.0.0.1:1"], "worker": ["10.0.0.2:1"]}),
                "worker",
                0,
            );
            let config = crate::Config::default().with_timeout(Duration::from_secs(2));
            let e = crate::gpu::GpuGroup::from_cluster(&far, None, &config)
                .err()
                .unwrap()
                .to_string();
            if std::env::var("TUTTI_INSECURE").is_ok() {
                assert!(!e.contains("TUTTI_JOB_TOKEN"), "{e}");
            } else {
                assert!(
                    e.contains("spans hosts") && e.contains("TUTTI_JOB_TOKEN"),
                    "{e}"
                );
            }
            println!("checked: {e}");
            return;
        };
        assert!(ok && out.contains("checked"), "{out}");
        let (ok, out) = in_child(
            "gpu_groups_apply_the_rule_before_any_device",
            &[("TUTTI_INSECURE", "1")],
        )
        .unwrap();
        assert!(
            ok && out.contains("TUTTI_INSECURE=1: this job has no secret"),
            "{out}"
        );
    }
}
