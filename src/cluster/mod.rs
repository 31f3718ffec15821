//! Cluster configuration: who this process is in the job, and where to meet the others (the
//! sources it reads are listed on [`ClusterSpec`]).

pub(crate) mod auth;
mod key;
pub use key::MIN_TOKEN_BYTES;
use key::{is_loopback, job_secret, Secret};

/// The most ranks a job may have. Every rank keeps a connection to every other, so even this
/// many is more than one host's descriptors allow; larger sizes are mistakes (a unit in the
/// wrong place, an unset variable read as a huge number).
pub const MAX_WORLD_SIZE: usize = 1 << 16;
pub mod store;
pub use auth::random_token;

use std::collections::{BTreeMap, HashMap};

use crate::error::{Error, Result};

/// The task types TensorFlow knows.
pub const TASK_TYPES: [&str; 4] = ["chief", "worker", "ps", "evaluator"];

/// What this process is in the job.
///
/// [`ClusterSpec::from_env`] reads, in this order (the first present wins):
///
/// | source | variables |
/// |---|---|
/// | tutti | `TUTTI_RANK`, `TUTTI_WORLD_SIZE`, `TUTTI_LOCAL_RANK`, `TUTTI_MASTER_ADDR` (`host:port`) |
/// | TensorFlow | `TF_CONFIG` (`cluster` with `chief`/`worker`/`ps`/`evaluator` address lists, `task` with `type` and `index`) |
/// | torchrun | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` |
/// | Open MPI's mpirun | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK` |
/// | SLURM's srun | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` |
///
/// mpirun gives ranks but no meeting point: `MASTER_ADDR` and `MASTER_PORT` (or
/// `TUTTI_MASTER_ADDR`) name it. Under srun they may too; without them the ranks meet on the first
/// host of the step's node list. `TUTTI_TRANSPORT` (`auto`, `tcp`, `shm`) chooses the transport.
///
/// Every connection of a job proves its secret: `token`, else `TUTTI_JOB_TOKEN`, else this
/// user's own secret on one host; a job across hosts without one is refused unless
/// `TUTTI_INSECURE=1` (see [`ClusterSpec::job_key`], which every way of joining applies, to a
/// spec from the environment or one built by hand alike).
///
/// In a TF_CONFIG cluster the collective world is the chief and the workers, in that order (the
/// chief is rank 0; with no chief, worker 0 is the chief, as in TensorFlow). `ps` and `evaluator`
/// tasks are part of the cluster but not of the collective world. The chief's address is the
/// rendezvous; every task listens for its peers on its own listed host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterSpec {
    /// Where the values came from (`tutti`, `TF_CONFIG`, `torchrun`, `mpirun`, `srun`).
    pub source: &'static str,
    /// This process's rank in the collective world (`None` for `ps` and `evaluator` tasks).
    pub rank: Option<usize>,
    /// Ranks in the collective world.
    pub world_size: usize,
    /// Rank among the processes of this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// `host:port` of the rendezvous store (served by rank 0).
    pub rendezvous: String,
    /// The host this process listens on for its peers.
    pub listen_host: String,
    /// TensorFlow task type (`chief`, `worker`, `ps`, `evaluator`; `worker` elsewhere).
    pub task_type: String,
    /// TensorFlow task index.
    pub task_index: usize,
    /// True for the chief (rank 0).
    pub is_chief: bool,
    /// The full cluster by task type (TF_CONFIG), or `worker` → the rendezvous address.
    pub cluster: BTreeMap<String, Vec<String>>,
    /// The job token (at least [`MIN_TOKEN_BYTES`] bytes). `None` (or empty): the rule of
    /// [`ClusterSpec::job_key`] decides when the job connects (`TUTTI_JOB_TOKEN`, this user's
    /// secret on one host, or an error across hosts); never a job without a secret, unless
    /// `TUTTI_INSECURE=1`.
    pub token: Option<String>,
}

impl ClusterSpec {
    /// Resolve from this process's environment. `Ok(None)` when no launcher variables are set.
    pub fn from_env() -> Result<Option<ClusterSpec>> {
        let vars: HashMap<String, String> = std::env::vars().collect();
        ClusterSpec::from_vars(&vars)
    }

    /// True when the environment names a cluster (any launcher's variables are set).
    pub fn env_present() -> bool {
        [
            "TUTTI_RANK",
            "TF_CONFIG",
            "RANK",
            "OMPI_COMM_WORLD_RANK",
            "SLURM_PROCID",
        ]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
    }

    /// Resolve from a set of variables (the environment, or a test's).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Option<ClusterSpec>> {
        // One of a pair without the other is a job set up by hand and half done: an error,
        // not a silent run alone.
        let spec = if vars.contains_key("TUTTI_RANK") || vars.contains_key("TUTTI_WORLD_SIZE") {
            Some(from_ranks(
                vars,
                "tutti",
                ["TUTTI_RANK", "TUTTI_WORLD_SIZE", "TUTTI_LOCAL_RANK"],
            )?)
        } else if let Some(tf) = vars.get("TF_CONFIG") {
            Some(from_tf_config(tf)?)
        } else if vars.contains_key("RANK") || vars.contains_key("WORLD_SIZE") {
            // One without the other is a job set up by hand and half done: an error, not a
            // silent run alone.
            Some(from_ranks(
                vars,
                "torchrun",
                ["RANK", "WORLD_SIZE", "LOCAL_RANK"],
            )?)
        } else if vars.contains_key("OMPI_COMM_WORLD_RANK") {
            let names = [
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ];
            Some(from_ranks(vars, "mpirun", names)?)
        } else if vars.contains_key("SLURM_PROCID") {
            Some(from_ranks(
                vars,
                "srun",
                ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"],
            )?)
        } else {
            None
        };
        let Some(spec) = spec else {
            return Ok(None);
        };
        // The rule every way of joining applies (ClusterSpec::job_key), applied here too: a job
        // across hosts without a token fails before it starts, and the spec carries the secret
        // it found (none when TUTTI_INSECURE=1 opted out: joining says so).
        let token = match job_secret(&spec, vars)? {
            Secret::Key(k) => Some(k),
            Secret::Insecure => None,
        };
        Ok(Some(ClusterSpec { token, ..spec }))
    }

    /// The rank, or an error for tasks outside the collective world.
    pub fn collective_rank(&self) -> Result<usize> {
        self.rank.ok_or_else(|| {
            Error::config(format!(
                "{}: task type '{}' takes no part in collectives (only chief and worker tasks do)",
                self.source, self.task_type
            ))
        })
    }
}

fn parse_num(vars: &HashMap<String, String>, name: &str, source: &str) -> Result<Option<usize>> {
    let from = prefix(source);
    match vars.get(name) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            Error::config(format!("{from}{name}='{v}' is not a non-negative integer"))
        }),
    }
}

/// Where the ranks of an `srun` step meet when no `MASTER_ADDR` is set: the first host of the
/// step's node list (`SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST` or `SLURM_NODELIST`), on
/// `MASTER_PORT` if given, else 15000 plus the last four digits of `SLURM_JOB_ID` (the port
/// PyTorch Lightning picks), so every rank of the step computes the same address.
fn slurm_rendezvous(vars: &HashMap<String, String>, port: Option<&String>) -> Result<String> {
    let list = [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ]
    .iter()
    .find_map(|v| vars.get(*v).map(|l| (*v, l)));
    let Some((var, list)) = list else {
        return Err(Error::config(
            "srun: no rendezvous address and no node list; set MASTER_ADDR and MASTER_PORT \
             (or TUTTI_MASTER_ADDR=host:port)",
        ));
    };
    let host = first_host(list).ok_or_else(|| {
        Error::config(format!(
            "srun: {var}='{list}' is not a Slurm host list; set MASTER_ADDR and MASTER_PORT"
        ))
    })?;
    let port: u16 = match port {
        Some(p) => p.trim().parse().ok().filter(|&p| p != 0).ok_or_else(|| {
            Error::config(format!("srun: MASTER_PORT='{p}' is not a port number"))
        })?,
        None => {
            let job = vars.get("SLURM_JOB_ID").ok_or_else(|| {
                Error::config("srun: neither MASTER_PORT nor SLURM_JOB_ID is set; set MASTER_PORT")
            })?;
            let id: u64 = job.trim().parse().map_err(|_| {
                Error::config(format!("srun: SLURM_JOB_ID='{job}' is not a number"))
            })?;
            15000 + (id % 10000) as u16
        }
    };
    Ok(format!("{host}:{port}"))
}

/// The first host of a Slurm host list: `node[07-10,12],gpu1` gives `node07`, `a[1,3]-ib` gives
/// `a1-ib`. None for a list that is empty or unbalanced.
fn first_host(list: &str) -> Option<String> {
    // The first entry: up to the first comma outside brackets.
    let mut depth = 0i32;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    let entry = list[..end].trim();
    let host = match entry.split_once('[') {
        None => entry.to_string(),
        Some((prefix, rest)) => {
            let (ranges, suffix) = rest.split_once(']')?;
            let first = ranges.split([',', '-']).next()?.trim();
            if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            format!("{prefix}{first}{suffix}")
        }
    };
    (!host.is_empty() && !host.contains(['[', ']', ' '])).then_some(host)
}

/// Split `host:port` (IPv6 in brackets), checking the port.
pub fn split_addr(addr: &str, what: &str) -> Result<(String, u16)> {
    let bad = || Error::config(format!("{what}: '{addr}' is not host:port"));
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    if port == 0 {
        return Err(Error::config(format!(
            "{what}: '{addr}' has port 0; peers need a fixed port to meet at"
        )));
    }
    Ok((host.to_string(), port))
}

/// How a message about a source's variables starts: the launcher that set them
/// (`torchrun: RANK is set but ...`); tutti's own (`TUTTI_RANK ...`) need no name, and the
/// `tutti` command and the C ABI put their own name first.
fn prefix(source: &str) -> String {
    if source == "tutti" {
        String::new()
    } else {
        format!("{source}: ")
    }
}

fn from_ranks(
    vars: &HashMap<String, String>,
    source: &'static str,
    names: [&str; 3],
) -> Result<ClusterSpec> {
    let from = prefix(source);
    let [rank_v, size_v, local_v] = names;
    let rank = parse_num(vars, rank_v, source)?
        .ok_or_else(|| Error::config(format!("{from}{size_v} is set but {rank_v} is not")))?;
    let world_size = parse_num(vars, size_v, source)?
        .ok_or_else(|| Error::config(format!("{from}{rank_v} is set but {size_v} is not")))?;
    if world_size == 0 {
        return Err(Error::config(format!("{from}{size_v} must be at least 1")));
    }
    if world_size > MAX_WORLD_SIZE {
        return Err(Error::config(format!(
            "{from}{size_v}={world_size} is more ranks than tutti supports \
             ({MAX_WORLD_SIZE}); every rank keeps a connection to every other"
        )));
    }
    if rank >= world_size {
        return Err(Error::config(format!(
            "{from}{rank_v}={rank} is out of range for {size_v}={world_size}"
        )));
    }
    let local_rank = parse_num(vars, local_v, source)?;
    let rendezvous = if let Some(a) = vars.get("TUTTI_MASTER_ADDR") {
        split_addr(a, "TUTTI_MASTER_ADDR")?;
        a.clone()
    } else {
        match (vars.get("MASTER_ADDR"), vars.get("MASTER_PORT")) {
            (Some(h), Some(p)) => {
                let port: u16 = p.trim().parse().ok().filter(|&p| p != 0).ok_or_else(|| {
                    Error::config(format!("{from}MASTER_PORT='{p}' is not a port number"))
                })?;
                format!("{h}:{port}")
            }
            (Some(_), None) => return Err(Error::config(format!("{from}MASTER_ADDR is set but MASTER_PORT is not"))),
            (None, port) if source == "srun" => slurm_rendezvous(vars, port)?,
            _ => {
                return Err(Error::config(format!(
                    "{from}no rendezvous address; set TUTTI_MASTER_ADDR=host:port, or MASTER_ADDR and MASTER_PORT"
                )))
            }
        }
    };
    let (master_host, _) = split_addr(&rendezvous, "rendezvous address")?;
    let listen_host = vars.get("TUTTI_LISTEN_HOST").cloned().unwrap_or_else(|| {
        if is_loopback(&master_host) {
            master_host.clone()
        } else {
            "0.0.0.0".to_string()
        }
    });
    Ok(ClusterSpec {
        source,
        rank: Some(rank),
        world_size,
        local_rank,
        rendezvous: rendezvous.clone(),
        listen_host,
        task_type: if rank == 0 { "chief" } else { "worker" }.into(),
        task_index: rank,
        is_chief: rank == 0,
        cluster: BTreeMap::from([("worker".to_string(), vec![rendezvous])]),
        token: None,
    })
}

/// Parse and check a TF_CONFIG value.
pub fn from_tf_config(text: &str) -> Result<ClusterSpec> {
    let err = |m: String| Error::config(format!("TF_CONFIG: {m}"));
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| err(format!("not valid JSON ({e})")))?;
    let cluster_v = v
        .get("cluster")
        .ok_or_else(|| err("missing field 'cluster'".into()))?;
    let cluster_o = cluster_v
        .as_object()
        .ok_or_else(|| err("'cluster' must be an object of address lists".into()))?;
    let mut cluster = BTreeMap::new();
    let mut seen: HashMap<String, String> = HashMap::new();
    for (ty, list) in cluster_o {
        if !TASK_TYPES.contains(&ty.as_str()) {
            return Err(err(format!(
                "cluster.{ty}: unknown task type (expected chief, worker, ps or evaluator)"
            )));
        }
        let list = list
            .as_array()
            .ok_or_else(|| err(format!("cluster.{ty} must be a list of \"host:port\"")))?;
        let mut addrs = Vec::new();
        for (i, a) in list.iter().enumerate() {
            let field = format!("cluster.{ty}[{i}]");
            let a = a
                .as_str()
                .ok_or_else(|| err(format!("{field} must be a \"host:port\" string")))?;
            split_addr(a, &format!("TF_CONFIG: {field}"))?;
            if let Some(prev) = seen.insert(a.to_string(), field.clone()) {
                return Err(err(format!(
                    "address {a} appears twice ({prev} and {field})"
                )));
            }
            addrs.push(a.to_string());
        }
        cluster.insert(ty.clone(), addrs);
    }
    let chiefs = cluster.get("chief").map_or(0, |c| c.len());
    if chiefs > 1 {
        return Err(err(format!(
            "cluster.chief lists {chiefs} addresses; there is at most one chief"
        )));
    }
    let task = v
        .get("task")
        .ok_or_else(|| err("missing field 'task'".into()))?;
    let task_type = task
        .get("type")
        .and_then(|t| t.as_str())
        .ok_or_else(|| err("task.type is missing or not a string".into()))?
        .to_string();
    let task_index = match task.get("index") {
        None => 0,
        Some(i) => i
            .as_u64()
            .ok_or_else(|| err("task.index must be a non-negative integer".into()))?
            as usize,
    };
    let tasks = cluster
        .get(&task_type)
        .ok_or_else(|| err(format!("task.type '{task_type}' has no list in 'cluster'")))?;
    if task_index >= tasks.len() {
        return Err(err(format!(
            "task.index {task_index} is out of range for the {} '{task_type}' task(s)",
            tasks.len()
        )));
    }
    // The collective world: the chief, then the workers.
    let world: Vec<(&str, usize, &String)> = ["chief", "worker"]
        .iter()
        .flat_map(|ty| {
            cluster
                .get(*ty)
                .into_iter()
                .flatten()
                .enumerate()
                .map(move |(i, a)| (*ty, i, a))
        })
        .collect();
    if world.is_empty() {
        return Err(err("the cluster has no chief and no worker".into()));
    }
    let rank = world
        .iter()
        .position(|(ty, i, _)| *ty == task_type && *i == task_index);
    let own_addr = &tasks[task_index];
    Ok(ClusterSpec {
        source: "TF_CONFIG",
        rank,
        world_size: world.len(),
        local_rank: None,
        rendezvous: world[0].2.clone(),
        listen_host: split_addr(own_addr, "TF_CONFIG")?.0,
        is_chief: rank == Some(0),
        task_type,
        task_index,
        cluster,
        token: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn tf_config_valid() {
        let tf = r#"{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"], "ps": ["h3:2222"]},
                     "task": {"type": "worker", "index": 1}}"#;
        let s = from_tf_config(tf).unwrap();
        assert_eq!((s.rank, s.world_size, s.is_chief), (Some(2), 3, false));
        assert_eq!(s.rendezvous, "h0:2222");
        assert_eq!(s.listen_host, "h2");
        let ps = from_tf_config(&tf.replace(
            r#""type": "worker", "index": 1"#,
            r#""type": "ps", "index": 0"#,
        ))
        .unwrap();
        assert_eq!(ps.rank, None);
        assert!(ps
            .collective_rank()
            .unwrap_err()
            .to_string()
            .contains("'ps' takes no part"));
        // No chief: worker 0 is the chief.
        let s = from_tf_config(
            r#"{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}}"#,
        )
        .unwrap();
        assert!(s.is_chief);
        assert_eq!(s.rendezvous, "a:1");
    }

    #[test]
    fn tf_config_invalid_names_the_field() {
        let cases = [
            ("{not json", "not valid JSON"),
            (r#"{"task": {"type": "worker"}}"#, "missing field 'cluster'"),
            (
                r#"{"cluster": {"worker": ["a:1"]}}"#,
                "missing field 'task'",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}"#,
                "task.index 3 is out of range",
            ),
            (
                r#"{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}"#,
                "address a:1 appears twice (cluster.worker[0] and cluster.worker[1])",
            ),
            (
                r#"{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}"#,
                "cluster.worker[0]: 'a' is not host:port",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}"#,
                "task.type 'chief' has no list",
            ),
            (
                r#"{"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief"}}"#,
                "at most one chief",
            ),
            (
                r#"{"cluster": {"boss": ["a:1"]}, "task": {"type": "boss"}}"#,
                "cluster.boss: unknown task type",
            ),
            (
                r#"{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps"}}"#,
                "no chief and no worker",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}"#,
                "task.index must be",
            ),
        ];
        for (text, want) in cases {
            let e = from_tf_config(text).unwrap_err().to_string();
            assert!(
                e.contains(want) && e.starts_with("TF_CONFIG: "),
                "{text}: {e}"
            );
        }
    }

    #[test]
    fn launcher_environments() {
        let s = ClusterSpec::from_vars(&vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (s.source, s.rank, s.world_size, s.local_rank),
            ("torchrun", Some(1), 4, Some(1))
        );
        assert_eq!(s.rendezvous, "127.0.0.1:29500");
        assert_eq!(s.listen_host, "127.0.0.1");
        let s = ClusterSpec::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("TUTTI_MASTER_ADDR", "10.0.0.1:5000"),
            ("TUTTI_JOB_TOKEN", "s3cret-s3cret-s3cret"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((s.source, s.rank, s.is_chief), ("mpirun", Some(0), true));
        assert_eq!(s.token.as_deref(), Some("s3cret-s3cret-s3cret"));
        assert_eq!(s.listen_host, "0.0.0.0");
        let s = ClusterSpec::from_vars(&vars(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "7000"),
            ("TUTTI_JOB_TOKEN", "s3cret-s3cret-s3cret"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((s.source, s.rank, s.local_rank), ("srun", Some(3), Some(1)));
        // Slurm sets no MASTER_ADDR: the step's first node, on a port from the job id.
        let s = ClusterSpec::from_vars(&vars(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODELIST", "gpu[007-008,012],login1"),
            ("SLURM_JOB_ID", "4242137"),
            ("TUTTI_JOB_TOKEN", "s3cret-s3cret-s3cret"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(s.rendezvous, "gpu007:17137");
        let e = ClusterSpec::from_vars(&vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_NODELIST", "n[1-"),
            ("MASTER_PORT", "7000"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("SLURM_JOB_NODELIST"), "{e}");
        // tutti's own variables win over the others.
        let s = ClusterSpec::from_vars(&vars(&[
            ("TUTTI_RANK", "0"),
            ("TUTTI_WORLD_SIZE", "1"),
            ("TUTTI_MASTER_ADDR", "127.0.0.1:1"),
            ("RANK", "5"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(s.source, "tutti");
        assert_eq!(ClusterSpec::from_vars(&vars(&[])).unwrap(), None);
    }

    /// Nobody joins a job without its secret (issue 12, item 1): a one-host job that set none
    /// gets this user's private secret; a job across hosts refuses to start without one, unless
    /// the user opts out.
    #[test]
    fn jobs_without_a_token_get_a_secret_or_refuse() {
        use std::os::unix::fs::PermissionsExt;
        let home = std::env::temp_dir().join(format!("tutti-secret-test-{}", std::process::id()));
        std::fs::create_dir_all(&home).unwrap();
        let h = home.to_str().unwrap();
        let torchrun = |addr: &str, extra: &[(&str, &str)]| {
            let mut v = vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", addr),
                ("MASTER_PORT", "29500"),
                ("HOME", h),
            ];
            v.extend_from_slice(extra);
            ClusterSpec::from_vars(&vars(&v))
        };
        let a = torchrun("127.0.0.1", &[]).unwrap().unwrap();
        let b = torchrun("localhost", &[]).unwrap().unwrap();
        let secret = a.token.clone().unwrap();
        assert!(secret.len() >= 32, "{secret}");
        assert_eq!(b.token, a.token, "the user's processes share the secret");
        let file = home.join(".cache/tutti/secret");
        assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), secret);
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "other users must not read it");
        // A secret file others can read is refused, not used.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = torchrun("127.0.0.1", &[]).unwrap_err().to_string();
        assert!(e.contains("not private"), "{e}");
        // Across hosts: an error that says how to set one, unless TUTTI_INSECURE=1.
        let e = torchrun("10.0.0.7", &[]).unwrap_err().to_string();
        assert!(
            e.contains("TUTTI_JOB_TOKEN") && e.contains("TUTTI_INSECURE=1"),
            "{e}"
        );
        let s = torchrun("10.0.0.7", &[("TUTTI_INSECURE", "1")])
            .unwrap()
            .unwrap();
        assert_eq!(s.token, None);
        let s = torchrun("10.0.0.7", &[("TUTTI_JOB_TOKEN", "given-given-given")])
            .unwrap()
            .unwrap();
        assert_eq!(s.token.as_deref(), Some("given-given-given"));
        std::fs::remove_dir_all(&home).unwrap();
    }

    /// Ranks of one process joining at once race to create the secret: every one gets it.
    #[test]
    fn threads_racing_for_a_fresh_secret_share_it() {
        let home = std::env::temp_dir().join(format!("tutti-secret-race-{}", std::process::id()));
        std::fs::create_dir_all(&home).unwrap();
        let v = vars(&[("HOME", home.to_str().unwrap())]);
        let got: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| s.spawn(|| auth::user_secret(&v).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|t| t == &got[0]), "{got:?}");
        std::fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn launcher_environments_invalid() {
        let cases: [(&[(&str, &str)], &str); 10] = [
            (
                &[
                    ("RANK", "4"),
                    ("WORLD_SIZE", "4"),
                    ("MASTER_ADDR", "a"),
                    ("MASTER_PORT", "1"),
                ],
                "RANK=4 is out of range for WORLD_SIZE=4",
            ),
            (
                &[("RANK", "x"), ("WORLD_SIZE", "4")],
                "RANK='x' is not a non-negative integer",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "a"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT='99999' is not a port",
            ),
            (
                &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")],
                "mpirun: no rendezvous address",
            ),
            (
                &[("SLURM_PROCID", "0")],
                "SLURM_PROCID is set but SLURM_NTASKS is not",
            ),
            (
                &[("RANK", "0")],
                "torchrun: RANK is set but WORLD_SIZE is not",
            ),
            (
                &[("WORLD_SIZE", "2")],
                "torchrun: WORLD_SIZE is set but RANK is not",
            ),
            (
                &[("TUTTI_RANK", "0"), ("TUTTI_WORLD_SIZE", "0")],
                "TUTTI_WORLD_SIZE must be at least 1",
            ),
            (
                &[("TUTTI_WORLD_SIZE", "2")],
                "TUTTI_WORLD_SIZE is set but TUTTI_RANK is not",
            ),
            (
                &[
                    ("TUTTI_RANK", "0"),
                    ("TUTTI_WORLD_SIZE", "2"),
                    ("TUTTI_MASTER_ADDR", "127.0.0.1:0"),
                ],
                "has port 0",
            ),
        ];
        for (v, want) in cases {
            let e = ClusterSpec::from_vars(&vars(v)).unwrap_err().to_string();
            assert!(e.contains(want), "{v:?}: {e}");
            // tutti's own variables need no source name (the caller names itself).
            assert!(!e.starts_with("tutti:"), "{v:?}: {e}");
        }
    }

    #[test]
    fn the_first_host_of_a_slurm_host_list() {
        for (list, first) in [
            ("n0", Some("n0")),
            ("node[07-10,12],gpu1", Some("node07")),
            ("a[1,3]-ib", Some("a1-ib")),
            ("x1,y[2-3]", Some("x1")),
            ("", None),
            ("n[", None),
            ("n[a-b]", None),
        ] {
            assert_eq!(first_host(list).as_deref(), first, "{list}");
        }
    }
}
